"""The `tail` launch: mean of the 4 mHC streams, RMSNorm, lm_head over this rank's vocabulary shard,
logits out, and the greedy token (argmax across CTAs, then across TP ranks), in one persistent kernel.

Stages (schedule.py places them; sync/ hands off between them):
  0 norm     "box" mode: one task per (row, column chunk of NORM_SPLIT) writes its chunk of u = mean(X) * w
             into xn and the chunk's sum of squares into ssq, and signals box `xn` to every CTA (plain rows
             + release drain); the row's 1 / RMS is a scalar the GEMV applies to the row's logits (the
             partials joined in chunk order), so no chunk waits for another. "local" mode: every CTA runs
             every chunk of every row into its own slots instead (no hand-off, redundant reads of X).
  1 lm_head  one contiguous vocab row range per CTA, equal bytes (bf16: 16-row aligned; FP8: whole
             BLOCK_N tiles, see build_graph). A task moves its first tile's first lines to L2
             (prefetch.global.L2) before it waits on `xn`, then streams its tiles (kernels/gemv.py),
             stores logits and publishes its per-row candidate (value, index) as tagged pairs (`cand`).
  2 reduce   CTA 0 awaits every candidate slot and reduces them in slot order (ties -> lower index),
             reduce_slots(width) slots (values and indices together) per L2 round trip: 1024 at 1 row.
             TP 1: writes the tokens. TP > 1: publishes the rank's candidate to every rank's `xchg`
             slot; in loopback mode (one GPU) peer tasks publish the other ranks' candidates locally.
  3 final    (TP > 1) CTA 0 awaits the `xchg` slots of all ranks and reduces them in rank order.
Norm mode: "box" beat "local" on the H200 in every case measured (box runs the norm in 8 x width tasks
and hides its hop behind the L2 prefetch), so "box" is the default.
xn precision: the norm writes u ~= hi + lo as two bf16 rows (~16 mantissa bits; relative logit error
~5e-6 vs the fp32 reference on the H200); logits = (W @ u) / RMS. hi rows 0..XR-1 and lo rows XR..2XR-1
are the x rows of ONE MMA of 2*XR columns; logits of row r = column r + column XR + r. XR = 4 for widths
<= 4 (n8 mma.sync), 8 for width 8 (n16: wgmma at 4 warps, 102 KB shared memory, 2 CTAs/SM; FP8 bits of
width 8 differ from the narrower builds'). An fp32 xn split inside the MMA loop cost ~75 registers (gemv.py _dot_x).
Registers (scripts/regs_offline.py, sm_90, 4 warps): the old kernel was 255 because (a) fp32 xn
(standalone GEMV 62 -> 138), (b) the families were inlined into one while loop, whose loop-invariant
index tensors (norm chunks, reduce offsets) the compiler hoisted to the loop top, live across the GEMV,
(c) the register prefetch (32 registers) held across the wait, (d) masks against runtime bounds of
unknown alignment. Now: cold families are noinline calls, the wait happens once before the tile loop
(after an L2 prefetch), bounds carry 16-row alignment, and maxnreg=120 (no spills; 112 before the RMS
scale moved after the GEMV): 120 registers, 55 KB shared (bf16, 4 stages) -> 4 CTAs/SM; grid=None picks
the resident maximum (<= 4/SM).
H200, 1 row, CUDA graph: TP1 bf16 307.8 us (92% of the 283 us floor; torch ops 321-323 us), FP8 ~185
us (77%; measured with a scale bug since fixed), TP8 bf16 67-69 us (52%; torch 71 us).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from layout import Planner
from sync.asm import in_interpreter
from sync.device import launch_begin, launch_end, signal_box, trace_clock, trace_cycles, trace_store, wait_box

from ..config import GlmConfig
from ..fp8 import scale_grid
from ..kernels.gemv import gemv_finish, gemv_prefetch, gemv_store
from ..kernels.sample import (ROWS_PAD, SLOT_WORDS, argmax_merge, empty_candidate, publish_candidate,
                              reduce_candidates, tile_argmax)
from ..schedule import TaskGraph
from .base import Launch, check_rank_width, interpreting, launch_options

FAMILIES = {"norm": 0, "norm_local": 1, "gemv": 2, "reduce": 3, "peer": 4, "final": 5}
NORM_MODES = ("box", "local")
DEFAULT_NORM_MODE = "box"
F32_NEG_INF_BITS = -8388608          # 0xFF800000
INT32_MAX = 2147483647
ROWS_H = 8                           # widest build = rows of a candidate slot (host int)
ROWS: tl.constexpr = tl.constexpr(ROWS_H)
SLOT = 2 * ROWS_H                     # int64 pairs per candidate slot (kernels/sample.py)
NORM_SPLIT = 8                       # column chunks of the norm: tasks per row (box mode). Fixed, not per width
NORM_SPLIT_C: tl.constexpr = tl.constexpr(NORM_SPLIT)   # or grid: a row's 8 partial sums join in one order
DEFAULT_CTAS_PER_SM = 4              # grid=None cap on the GPU (see _fit_grid)
DEFAULT_MAXNREG = 120                # ptxas cap, widths <= 4 (-1 = this default; None = ptxas's choice): 4 CTAs
                                     # per SM up to 128 (65536 / (4 CTAs x 4 warps x 32)); 112 spilled 40 B once
                                     # the GEMV held the rows' RMS partials


@triton.jit
def _norm_part(X, norm_w, xn, ssq, r, c, H: tl.constexpr, XR: tl.constexpr):
    """Column chunk c (of NORM_SPLIT) of row r: u = mean_m X[r, m, :] * w (fp32) as bf16 hi = xn[r] and lo =
    xn[XR + r] (u ~= hi + lo, ~16 mantissa bits), and the chunk's sum of squares of the mean -> ssq[r, c]. The
    row's RMS scale is a scalar, applied to its logits after the GEMV (_row_scale), so a chunk needs nothing
    from the others: one round trip of loads. (The row in one task, scaled before the GEMV, took two passes
    of 8 dependent chunk loads: 8.6 us, traced on the H200, on the launch's critical path.)"""
    CW: tl.constexpr = H // NORM_SPLIT_C
    k = c * CW + tl.arange(0, CW)
    base = X + r * 4 * H
    xm = (tl.load(base + k) + tl.load(base + H + k) + tl.load(base + 2 * H + k) + tl.load(base + 3 * H + k)) * 0.25
    u = xm * tl.load(norm_w + k).to(tl.float32)
    hi = u.to(tl.bfloat16)
    tl.store(xn + r * H + k, hi)
    tl.store(xn + (XR + r) * H + k, (u - hi.to(tl.float32)).to(tl.bfloat16))
    tl.store(ssq + r * NORM_SPLIT_C + c, tl.sum(xm * xm, axis=0))


@triton.jit
def _row_ss(ssq, rows):
    """The rows' NORM_SPLIT partial sums of squares [ROWS, NORM_SPLIT] (pad rows 0), loaded right after the xn
    wait and used only after the first tile's MMAs (_row_scale), so the load's round trip hides behind it."""
    r = tl.arange(0, ROWS)
    c = tl.arange(0, NORM_SPLIT_C)
    return tl.load(ssq + r[:, None] * NORM_SPLIT_C + c[None, :], mask=(r < rows)[:, None], other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _row_scale(ss, eps, H: tl.constexpr):
    """[ROWS] 1 / RMS of each row's stream mean: its partials summed in chunk order (one shape, one order, at
    every width and grid), as rms_norm's rsqrt(mean + eps)."""
    return tl.rsqrt(tl.sum(ss, axis=1) / H + eps)


@triton.jit
def _l2_prefetch(W, n0, n1, H: tl.constexpr, BLOCK_N: tl.constexpr, LINES: tl.constexpr, EPL: tl.constexpr):
    """prefetch.global.L2 of the first LINES 128-byte lines (EPL elements each) of rows n0..n0+BLOCK_N-1
    (< n1): bytes start moving while nothing is held in registers (a register prefetch held 32 registers
    per thread across the wait and the loops)."""
    if not in_interpreter():
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_l = tl.arange(0, LINES) * EPL
        ptrs = W + offs_n[:, None].to(tl.int64) * H + offs_l[None, :]
        prefetch_l2(ptrs, (offs_n[:, None] < n1) & (offs_l[None, :] < H))


@triton.jit
def prefetch_l2(ptrs, m):
    """prefetch.global.L2 [ptrs] where m (GPU only: the interpreter has no asm)."""
    tl.inline_asm_elementwise("{\n.reg .pred %pm;\nsetp.ne.b32 %pm, $2, 0;\n@%pm prefetch.global.L2 [$1];\n"
                              "mov.u32 $0, 0;\n}", "=r,l,r", [ptrs, m.to(tl.int32)], dtype=tl.int32,
                              is_pure=False, pack=1)


# The families run in one while loop; inlined, the compiler hoists each family's loop-invariant index
# tensors to the loop's top, where they stay live through the GEMV (the kernel reached 255 registers).
# As calls (noinline) the cold families keep their registers to themselves.
@triton.jit(noinline=True)
def _norm_task(X, norm_w, xn, ssq, a0, a1, rows, box, box_words, tag, site_xn, fault_site, H: tl.constexpr,
               XR: tl.constexpr):
    """norm (box mode): row a0's column chunk a1, producer a0 * NORM_SPLIT + a1 of xn."""
    if a0 < rows:
        _norm_part(X, norm_w, xn, ssq, a0, a1, H, XR)
    signal_box(box, tl.num_programs(0), box_words, a0 * NORM_SPLIT_C + a1, tag, site_xn, fault_site, 128)


@triton.jit(noinline=True)
def _norm_local_task(X, norm_w, xn, ssq, rows, H: tl.constexpr, XR: tl.constexpr):
    """norm_local: every chunk of every row into this CTA's own xn / ssq slots (the same code and order as
    the box mode's tasks, so the same bits)."""
    r = 0
    while r < rows:
        c = 0
        while c < NORM_SPLIT_C:
            _norm_part(X, norm_w, xn, ssq, r, c, H, XR)
            c += 1
        r += 1
    tl.debug_barrier()                                               # own warps' stores before the GEMVs


@triton.jit(noinline=True)
def _wait_xn(box, pid, box_words, n_norm, tag, hdr, site_xn, timeout_ns):
    # line polls (POLLS 2): under the tail's 120-register cap the chunked spin spilled 60 B (tests/test_tail.py
    # test_sm90_registers_offline), and the xn box is one wait per CTA, not called from a register-heavy site
    return wait_box(box, pid, box_words, n_norm, tag, hdr, site_xn, pid, timeout_ns, 2)


@triton.jit(noinline=True)
def _reduce_task(cand, n_slots, rows, tag, hdr, site_cand, site_xchg, fault_site, pid, timeout_ns, best, tokens,
                 xchg, tp_rank, tp_size, SLOTS: tl.constexpr, RP: tl.constexpr):
    rr = tl.arange(0, ROWS_PAD)
    bv, bi, ok = reduce_candidates(cand, n_slots, rows, tag, hdr, site_cand, pid, timeout_ns, SLOTS, RP)
    if ok != 0:
        tl.store(best + rr, bv.to(tl.int32, bitcast=True), mask=rr < rows)
        tl.store(best + ROWS_PAD + rr, bi, mask=rr < rows)
        if tp_size == 1:
            tl.store(tokens + rr, bi, mask=rr < rows)
        else:
            d = 0
            while d < tp_size:                                       # this rank's slot of every rank
                publish_candidate(xchg + (d * tp_size + tp_rank) * SLOT_WORDS, bv, bi, rows, tag, site_xchg,
                                  fault_site)
                d += 1
    return ok


@triton.jit(noinline=True)
def _peer_task(peer_src, xchg, a0, rows, tag, tp_rank, tp_size, site_xchg, fault_site):
    rr = tl.arange(0, ROWS_PAD)
    pv = tl.load(peer_src + a0 * 2 * ROWS_PAD + rr).to(tl.float32, bitcast=True)
    pi = tl.load(peer_src + a0 * 2 * ROWS_PAD + ROWS_PAD + rr)
    publish_candidate(xchg + (tp_rank * tp_size + a0) * SLOT_WORDS, pv, pi, rows, tag, site_xchg, fault_site)


@triton.jit(noinline=True)
def _final_task(xchg, tokens, rows, tag, hdr, tp_rank, tp_size, site_xchg, pid, timeout_ns):
    rr = tl.arange(0, ROWS_PAD)
    bv, bi, ok = reduce_candidates(xchg + tp_rank * tp_size * SLOT_WORDS, tp_size, rows, tag, hdr, site_xchg, pid,
                                   timeout_ns, 8)
    if ok != 0:
        tl.store(tokens + rr, bi, mask=rr < rows)
    return ok


@triton.jit(do_not_specialize=["rows", "vocab_off", "tp_rank", "tp_size", "stage_lo", "stage_hi", "bump",
                               "tag_stride", "tag_offset", "fault_site", "timeout_ns", "site_xn", "site_cand",
                               "site_xchg", "n_slots", "n_norm"])
def tail_kernel(table, starts, X, norm_w, W, S, logits, tokens, best, scratch, xchg, peer_src, trace,
                o_hdr, o_xn, o_box, o_cand, o_ssq, xn_cta_stride, box_words,
                rows, V_rank, vocab_off, tp_rank, tp_size, n_norm, n_slots, eps,
                stage_lo, stage_hi, bump, tag_stride, tag_offset, fault_site, timeout_ns,
                site_xn, site_cand, site_xchg,
                H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, LOCAL_NORM: tl.constexpr, SLOTS: tl.constexpr,
                L2_LINES: tl.constexpr, EPL: tl.constexpr, XPF: tl.constexpr, ROW16: tl.constexpr,
                XR: tl.constexpr, RP: tl.constexpr, TRACE: tl.constexpr):
    pid = tl.program_id(0)
    hdr = scratch + o_hdr
    if TRACE:                                                        # launches/trace.py (Launch.enable_trace)
        t_cta = trace_clock(pid)
        c_cta = trace_cycles(pid)
    s64 = scratch.to(tl.pointer_type(tl.int64), bitcast=True)
    cand = s64 + o_cand                                              # [n_slots, SLOT_WORDS] pairs
    xn = scratch.to(tl.pointer_type(tl.bfloat16), bitcast=True) + o_xn  # [2, ROWS, H] bf16 (local: per CTA)
    ssq = scratch.to(tl.pointer_type(tl.float32), bitcast=True) + o_ssq  # [ROWS, NORM_SPLIT] (local: per CTA)
    if LOCAL_NORM:
        xn += pid * xn_cta_stride
        ssq += pid * (ROWS * NORM_SPLIT_C)
    box = scratch + o_box
    # the task range before launch_begin: constant, and not ordered after its acquire (PDL: before the
    # previous kernel is done)
    i = tl.load(starts + pid)
    end = tl.load(starts + pid + 1)
    tag, ok = launch_begin(hdr, tag_stride, tag_offset, False)   # its register cap: see launch_begin
    xn_ready = 0                                                     # this CTA already passed site xn
    while (i < end) & (ok != 0):
        fam = tl.load(table + i * 8)
        st = tl.load(table + i * 8 + 1)
        a0 = tl.load(table + i * 8 + 2)
        a1 = tl.load(table + i * 8 + 3)
        a2 = tl.load(table + i * 8 + 4)
        if (st >= stage_lo) & (st < stage_hi):
            if TRACE:
                t_task = trace_clock(i)
                c_task = trace_cycles(i)
            if fam == 0:                                             # norm (box mode): row a0, chunk a1
                _norm_task(X, norm_w, xn, ssq, a0, a1, rows, box, box_words, tag, site_xn, fault_site, H, XR)
            elif fam == 1:                                           # norm_local: every row, own slot
                _norm_local_task(X, norm_w, xn, ssq, rows, H, XR)
            elif fam == 2:                                           # gemv: vocab rows a0..a1-1, slot a2
                if not LOCAL_NORM:
                    if xn_ready == 0:
                        # the first tile's first lines move to L2 while the norm finishes (hides the hop)
                        _l2_prefetch(W, a0, a1, H, BLOCK_N, L2_LINES, EPL)
                        ok = _wait_xn(box, pid, box_words, n_norm, tag, hdr, site_xn, timeout_ns)
                        xn_ready = ok
                ss = _row_ss(ssq, rows)                              # the rows' RMS partials (after the wait)
                if ROW16:
                    a1 = (a1 >> 4) << 4                              # tells the masks: 16-row granules
                a0 = (a0 >> 4) << 4
                bv, bi = empty_candidate()
                n0 = a0
                while (n0 < a1) & (ok != 0):
                    if XPF:                                          # next tile's first lines, to L2
                        _l2_prefetch(W, n0 + BLOCK_N, a1, H, BLOCK_N, L2_LINES, EPL)
                    # rows >= a1 (the task's end) are masked: a task is any 16-row aligned range
                    n0 = (n0 >> 4) << 4                              # (alignment lost on the loop variable)
                    w0 = gemv_prefetch(W, n0, 0, H, a1, H, BLOCK_N, PF_K)
                    # xn rows 0..XR-1 = hi, XR..2XR-1 = lo: one 2XR-column MMA, then column r + column XR + r
                    acc2 = gemv_finish(w0, W, S, xn, H, 2 * XR, n0, 0, H, a1, H, 2 * XR, BLOCK_N, BLOCK_K,
                                       PF_K, NUM_STAGES)
                    acc = tl.sum(tl.reshape(acc2, (BLOCK_N, 2, XR)), axis=1)
                    if XR < ROWS:                                    # back to ROWS columns (copies, masked)
                        acc = tl.reshape(tl.broadcast_to(acc[:, None, :], (BLOCK_N, ROWS // XR, XR)),
                                         (BLOCK_N, ROWS))
                    acc = acc * _row_scale(ss, eps, H)[None, :]       # the norm's 1 / RMS, per row
                    gemv_store(logits, V_rank, acc, rows, n0, a1, ROWS_PAD, BLOCK_N)
                    v, ix = tile_argmax(acc, n0, a1, vocab_off, BLOCK_N)
                    bv, bi = argmax_merge(bv, bi, v, ix)
                    n0 += BLOCK_N
                if ok != 0:
                    publish_candidate(cand + a2 * SLOT_WORDS, bv, bi, rows, tag, site_cand, fault_site)
            elif fam == 3:                                           # reduce: all slots, in slot order
                ok = _reduce_task(cand, n_slots, rows, tag, hdr, site_cand, site_xchg, fault_site, pid, timeout_ns,
                                  best, tokens, xchg, tp_rank, tp_size, SLOTS, RP)
            elif fam == 4:                                           # peer (loopback): rank a0's candidate
                _peer_task(peer_src, xchg, a0, rows, tag, tp_rank, tp_size, site_xchg, fault_site)
            elif fam == 5:                                           # final: ranks in rank order
                ok = _final_task(xchg, tokens, rows, tag, hdr, tp_rank, tp_size, site_xchg, pid, timeout_ns)
            if TRACE:
                trace_store(trace, i, t_task, c_task, hdr, pid, i)
        i += 1
    if TRACE:                                                        # this CTA's whole run: row n_tasks + pid
        trace_store(trace, tl.load(starts + tl.num_programs(0)) + pid, t_cta, c_cta, hdr, pid, pid)
    launch_end(hdr, bump)


def reduce_rows(width: int) -> int:
    """Rows the candidate reduce reads per slot: the power of two >= width (kernels/sample.py reduce_candidates)."""
    return 1 << (max(1, width) - 1).bit_length()


def reduce_slots(width: int) -> int:
    """Candidate slots the reduce awaits per step (one L2 round trip each): 512 slot rows (1024 at 1 row) a step,
    what the 120-register build holds without spilling (scripts/regs_offline.py: 1024 at 2 or 4 rows spills
    64-88 B). At TP8's 528 CTAs: 1 step at 1 row, 3 at 2, 5 at 4, 9 at 8 (was 9 at every width)."""
    rp = reduce_rows(width)
    return (1024 if rp == 1 else 512) // rp


def _task_rows(v_rank: int, n_tasks: int, gran: int = 16) -> list[tuple[int, int]]:
    """n_tasks contiguous vocab row ranges of about equal bytes (boundaries on multiples of gran rows)."""
    b = [min(v_rank, ((s * v_rank // n_tasks) + gran // 2) // gran * gran) for s in range(n_tasks)] + [v_rank]
    return [(b[s], b[s + 1]) for s in range(n_tasks) if b[s + 1] > b[s]]


class TailLaunch(Launch):
    """Host side of the tail launch for one TP rank.

    lm_head: this rank's vocabulary shard [V/tp, H], bf16, or FP8 e4m3 with `scales` = its own
    weight_scale_inv grid [ceil(V/tp / 128), H/128] (as fp8.quantize_fp8 of the shard gives).
    norm_w: [H] (final norm). X passed to run(): fp32 [rows, 4, H], rows <= width.
    run() returns (logits fp32 [rows, V/tp] of this rank, tokens int32 [rows] global vocab ids).
    TP > 1 needs `xchg` (shared by the ranks: simulated TP on the CPU, see run_tp) or runs in
    loopback mode: the peers' candidates come from `peer` (default: none, so the rank's own wins).
    """

    kind = "tail"

    def __init__(self, cfg: GlmConfig, lm_head: torch.Tensor, norm_w: torch.Tensor, scales: torch.Tensor | None = None,
                 *, tp_rank: int = 0, tp_size: int = 1, width: int = 1, device=None, grid: int | None = None,
                 norm_mode: str = DEFAULT_NORM_MODE, timeout_s: float = 1.0, xchg: torch.Tensor | None = None,
                 block_n: int = 64, block_k: int = 128, num_stages: int = 4, num_warps: int = 4,
                 ctas_per_sm: int = DEFAULT_CTAS_PER_SM, l2_prefetch_k: int = 256, xpf: bool = False,
                 maxnreg: int | None = -1, **tag_kw):
        self._auto_grid = grid is None and not interpreting()
        super().__init__(grid=grid, device=device, timeout_s=timeout_s, **tag_kw)
        check_rank_width("tail", cfg, tp_rank, tp_size, width)
        if norm_mode not in NORM_MODES:
            raise ValueError(f"tail: norm_mode={norm_mode!r} must be one of {NORM_MODES}")
        H, V = cfg.hidden_size, cfg.vocab_size
        cw = H // NORM_SPLIT
        if H % NORM_SPLIT or cw & (cw - 1):
            raise ValueError(f"tail: hidden_size {H} must be {NORM_SPLIT} x a power of two (the norm's column chunks)")
        self.cfg, self.H, self.V_rank = cfg, H, V // tp_size
        self.tp_rank, self.tp_size, self.width, self.norm_mode = tp_rank, tp_size, width, norm_mode
        self.vocab_off = tp_rank * self.V_rank
        self.num_warps = num_warps
        if tuple(lm_head.shape) != (self.V_rank, H):
            raise ValueError(f"tail: lm_head shard has shape {tuple(lm_head.shape)}, expected "
                             f"[{self.V_rank}, {H}] (vocab {V} / tp {tp_size})")
        self.fp8 = lm_head.dtype == torch.float8_e4m3fn
        if not self.fp8 and lm_head.dtype != torch.bfloat16:
            raise ValueError(f"tail: lm_head dtype {lm_head.dtype}: expected bfloat16 or float8_e4m3fn")
        if self.fp8:
            want = scale_grid(self.V_rank, H)
            if scales is None or tuple(scales.shape) != want or scales.dtype != torch.float32:
                raise ValueError(f"tail: FP8 lm_head needs fp32 scales of shape {want}, got "
                                 f"{None if scales is None else (tuple(scales.shape), scales.dtype)}")
        elif scales is not None:
            raise ValueError("tail: scales given for a bf16 lm_head")
        if tuple(norm_w.shape) != (H,):
            raise ValueError(f"tail: norm_w has shape {tuple(norm_w.shape)}, expected [{H}]")
        self.W = lm_head.to(self.device).contiguous()
        self.S = scales.to(self.device).contiguous() if self.fp8 else self.W
        self.norm_w = norm_w.to(self.device).contiguous()
        self.block_n, self.block_k, self.num_stages = block_n, block_k, num_stages
        self.ctas_per_sm, self.l2_prefetch_k, self.xpf = ctas_per_sm, l2_prefetch_k, bool(xpf)
        self.maxnreg = (DEFAULT_MAXNREG if width <= 4 else None) if maxnreg == -1 else maxnreg
        # xn hi/lo halves of XR rows each feed one MMA of 2 XR columns: n8 (mma.sync) up to 4 rows;
        # width 8 needs n16, which Triton lowers to wgmma at 4 warps (more shared memory, other FP8 bits)
        self.xr = 4 if width <= 4 else 8
        self.loopback = tp_size > 1 and xchg is None
        self.xchg = xchg
        if tp_size > 1 and xchg is None:
            self.xchg = new_xchg(tp_size, self.device)
        if tp_size > 1 and (self.xchg.dtype != torch.int64 or self.xchg.numel() < tp_size * tp_size * SLOT):
            raise ValueError(f"tail: xchg must be int64 with >= {tp_size * tp_size * SLOT} words (see new_xchg)")
        self.peer_src = torch.zeros(max(tp_size, 1), 2, ROWS_H, dtype=torch.int32, device=self.device)
        self.set_peers(None)
        self.logits = torch.empty(width, self.V_rank, dtype=torch.float32, device=self.device)
        self.tokens = torch.empty(width, dtype=torch.int32, device=self.device)
        self.best = torch.empty(2, ROWS_H, dtype=torch.int32, device=self.device)
        self.X = None
        self.rows = 0
        self._setup()
        if self._auto_grid:
            self._fit_grid()

    def _fit_grid(self) -> None:
        """grid=None on the GPU: as many CTAs as can be resident (from the compiled kernel's registers and
        shared memory), at most ctas_per_sm per SM and one per 16 vocab rows; rebuilds the schedule."""
        from ..schedule import kernel_resources, max_resident_ctas, device_sm_count
        self.X = torch.zeros(1, self.cfg.hc_mult, self.H, dtype=torch.float32, device=self.device)
        self.rows = 1
        args, const = self.kernel_args(0, self.n_stages, 1, -1)
        ck = self.kernel().warmup(*args, grid=(self.grid,), **const, num_warps=self.num_warps,
                                  **launch_options())   # the options enqueue compiles with
        res = kernel_resources(ck)
        n_sm = device_sm_count(self.device)
        cap = max_resident_ctas(res["n_regs"], res["num_warps"], res["shared"], n_sm)
        grid = max(1, min(cap, self.ctas_per_sm * n_sm, -(-self.V_rank // 16)))
        self.X, self.rows = None, 0
        if grid != self.grid:
            self.grid = grid
            self._setup()

    # ------------------------------------------------------------------ plan
    @property
    def n_norm(self) -> int:
        """Producers of box xn: the norm tasks, NORM_SPLIT column chunks of every built row."""
        return self.width * NORM_SPLIT

    @staticmethod
    def site_names(tp_size: int = 1, norm_mode: str = DEFAULT_NORM_MODE) -> list[str]:
        return (["tail.xn"] if norm_mode == "box" else []) + ["tail.cand"] + (["tail.xchg"] if tp_size > 1 else [])

    def build_graph(self) -> TaskGraph:
        g, H, G = TaskGraph("tail", FAMILIES), self.H, self.grid
        wbytes = 1 if self.fp8 else 2
        g.stage("norm")
        if self.norm_mode == "box":
            for r in range(self.width):
                for c in range(NORM_SPLIT):
                    g.add("norm", (r, c), writes=("xn",), nbytes=(4 * H * 4 + 2 * H) // NORM_SPLIT)
        else:
            for c in range(G):
                g.add("norm_local", (), nbytes=self.width * 4 * H * 4, cta=c)
        g.stage("lm_head")
        # bf16: equal 16-row aligned ranges, not whole tiles (2420 64-row tiles over 528 CTAs would leave
        # the longest task 9% above the mean); a range's last tile is masked at the range's end.
        # FP8: whole tiles, since kernels/gemv.py reads one scale per tile (n0 % BLOCK_N == 0, so a tile
        # never straddles a 128-row scale block); a 16-row aligned start gave 16% logit error on the H200
        reads = ("xn",) if self.norm_mode == "box" else ()
        gran = self.block_n if self.fp8 else 16
        ranges = _task_rows(self.V_rank, min(G, -(-self.V_rank // gran)), gran)
        for s, (r0, r1) in enumerate(ranges):
            g.add("gemv", (r0, r1, s), reads=reads, writes=("cand",), nbytes=(r1 - r0) * H * wbytes)
        self.n_slots = len(ranges)
        g.stage("reduce")
        g.add("reduce", (), reads=("cand",), writes=("xchg",) if self.tp_size > 1 else (), cta=0)
        if self.loopback:
            others = [p for p in range(self.tp_size) if p != self.tp_rank]
            for k, p in enumerate(others):
                g.add("peer", (p,), writes=("xchg",), cta=(1 + k) % G)
        if self.tp_size > 1:
            g.stage("final")
            g.add("final", (), reads=("xchg",), cta=0)
        return g

    def plan_scratch(self, pl: Planner) -> None:
        H = self.H
        if self.norm_mode == "box":
            pl.rows("xn", (2, self.xr, H), "bfloat16")
            pl.rows("ssq", (ROWS_H, NORM_SPLIT), "float32")
            pl.box("box", self.grid, self.n_norm)
        else:
            pl.rows("xn", (self.grid, 2, self.xr, H), "bfloat16")
            pl.rows("ssq", (self.grid, ROWS_H, NORM_SPLIT), "float32")
        pl.pairs("cand", (self.n_slots, SLOT))

    def kernel(self):
        return tail_kernel

    def kernel_args(self, stage_lo, stage_hi, bump, fault_site):
        if self.X is None:
            raise RuntimeError("tail: no input; call run(X) or set_input(X) first")
        L = self.layout
        box_off = L["box"].elem_offset() if "box" in L else 0
        box_words = L["box"].shape[1] if "box" in L else 32
        xchg = self.xchg if self.xchg is not None else self.scratch
        sched = self.schedule
        args = (self.table, self.starts, self.X, self.norm_w, self.W, self.S, self.logits, self.tokens, self.best,
                self.scratch, xchg, self.peer_src, self.trace_args()[0],
                L["hdr"].elem_offset(), L["xn"].elem_offset(), box_off, L["cand"].elem_offset(), L["ssq"].elem_offset(),
                2 * self.xr * self.H, box_words,
                self.rows, self.V_rank, self.vocab_off, self.tp_rank, self.tp_size, self.n_norm, self.n_slots,
                float(self.cfg.rms_norm_eps), stage_lo, stage_hi, bump, self.tag_stride, self.tag_offset,
                fault_site, self._timeout_ns,
                sched.site_id("xn"), sched.site_id("cand"), sched.site_id("xchg"))
        esize = 1 if self.fp8 else 2
        const = dict(H=self.H, BLOCK_N=self.block_n, BLOCK_K=self.block_k, PF_K=128,
                     NUM_STAGES=self.num_stages, LOCAL_NORM=self.norm_mode == "local",
                     SLOTS=reduce_slots(self.width), RP=reduce_rows(self.width),
                     TRACE=self.trace_args()[1],
                     L2_LINES=max(1, self.l2_prefetch_k * esize // 128), EPL=128 // esize, XPF=self.xpf,
                     ROW16=self.V_rank % 16 == 0, XR=self.xr)
        if self.maxnreg:
            const["maxnreg"] = self.maxnreg       # a compile option (ptxas), not a kernel argument
        return args, const

    # ------------------------------------------------------------------ run
    def set_input(self, X: torch.Tensor) -> None:
        H, m = self.H, self.cfg.hc_mult
        if X.dim() != 3 or X.shape[1:] != (m, H) or X.dtype != torch.float32:
            raise ValueError(f"tail: X must be fp32 [rows, {m}, {H}], got {tuple(X.shape)} {X.dtype}")
        if not 1 <= X.shape[0] <= self.width:
            raise ValueError(f"tail: X has {X.shape[0]} rows; this launch is built for 1..{self.width}")
        if X.device != self.device and not (X.device.type == self.device.type == "cuda"):
            raise ValueError(f"tail: X is on {X.device}, the launch on {self.device}")
        self.X = X.contiguous()
        self.rows = X.shape[0]

    def set_peers(self, peer: dict | None) -> None:
        """Loopback: peer rank -> (values [rows] fp32, global indices [rows]); absent ranks never win."""
        self.peer_src[:, 0].fill_(F32_NEG_INF_BITS)
        self.peer_src[:, 1].fill_(INT32_MAX)
        for p, (v, ix) in (peer or {}).items():
            n = v.numel()
            self.peer_src[p, 0, :n] = v.to(self.device, torch.float32).view(torch.int32)
            self.peer_src[p, 1, :n] = ix.to(self.device, torch.int32)

    def run(self, X: torch.Tensor, *, inject_fault: str | None = None, peer: dict | None = None):
        """One checked launch -> (logits [rows, V/tp] fp32, tokens [rows] int32), fresh tensors.
        Raises HandoffTimeout (naming the wait site) if a hand-off timed out."""
        fault = self.fault_id(inject_fault)
        self.set_input(X)
        if self.loopback:
            self.set_peers(peer)
        self.enqueue(fault)
        self.check()
        return self.logits[: self.rows].clone(), self.tokens[: self.rows].clone()

    def candidate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (values fp32, global indices int64) of the latest launch, rows of X."""
        return (self.best[0, : self.rows].view(torch.float32).clone(), self.best[1, : self.rows].long())


def new_xchg(tp_size: int, device) -> torch.Tensor:
    """The cross-rank candidate mailbox [tp (reader), tp (writer), SLOT pairs], shared by simulated ranks."""
    return torch.zeros(tp_size * tp_size * SLOT, dtype=torch.int64, device=device)


def run_tp(launches: list[TailLaunch], X: torch.Tensor, inject_fault: str | None = None, fault_rank: int = 0):
    """Simulated TP (CPU): every rank's stage s, then stage s + 1. -> [(logits, tokens)] per rank."""
    from .base import run_interleaved

    faults = []
    for r, L in enumerate(launches):
        L.set_input(X)
        faults.append(L.fault_id(inject_fault) if r == fault_rank else -1)
    run_interleaved(launches, faults)
    return [(L.logits[: L.rows].clone(), L.tokens[: L.rows].clone()) for L in launches]
