"""The `tail` launch: mean of the 4 mHC streams, RMSNorm, lm_head over this rank's vocabulary shard,
logits out, and the greedy token (argmax across CTAs, then across TP ranks), in one persistent kernel.

Stages (schedule.py places them; sync/ hands off between them):
  0 norm     "box" mode: one task per row (up to the built width) writes the normed row xn (fp32) and
             signals box `xn` to every CTA (plain rows + release drain). "local" mode: every CTA
             normalises all rows into its own slot instead (no hand-off, redundant reads of X).
  1 lm_head  contiguous ranges of BLOCK_N-row tiles, balanced by weight bytes. A task issues its first
             weight chunk before it waits on `xn` (kernels/gemv.py prefetch/finish), stores logits and
             publishes its range's per-row candidate (value, index) as tagged pairs (mailbox `cand`).
  2 reduce   CTA 0 awaits every candidate slot and reduces them in slot order (ties -> lower index).
             TP 1: writes the tokens. TP > 1: publishes the rank's candidate to every rank's `xchg`
             slot; in loopback mode (one GPU) peer tasks publish the other ranks' candidates locally.
  3 final    (TP > 1) CTA 0 awaits the `xchg` slots of all ranks and reduces them in rank order.
Norm mode (measured on the H200, kernel time per launch in a CUDA graph): "box" beat "local" in every
case: TP1 bf16 517.6 vs 530.4 us at 1 row and 517.9 vs 547.4 us at 8 rows; TP8 154.2 vs 157.7 / 151.6
vs 167.3 us. Local mode reads X (rows x 64 KB, twice) in every CTA before its first GEMV; box mode
runs the norm in `width` CTAs and its one hop (~1 us) is hidden behind the first weight chunk each
CTA issues before the wait. So "box" is the default.
xn travels as fp32 (the GEMV multiplies it as bf16 hi + lo): the tail decides the token, so its
input keeps ~16 mantissa bits instead of bf16's 8 (relative logit error ~1e-5 vs the fp32 reference).
Registers: the GEMV family dominates (kernels/gemv.py: 200-255 registers on its own). 8 warps with
BLOCK_K=128 give 255 registers and <= 48 B of stack; 4 warps with BLOCK_K=256 made ptxas (12.8) fall
back to 32 registers and a 3.6 KB stack. Speed (H200, first run): 2.45 TB/s (55% of the HBM floor)
at TP1 bf16, 31% for FP8, 23% at TP8: streaming, not hand-offs, limits it (one 255-register CTA per
SM keeps too few bytes in flight); `tests/test_gpu_engine.py::test_gpu_tail_sweep` measures the knobs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from layout import Planner
from sync.device import launch_begin, launch_end, signal_box, wait_box

from ..config import GlmConfig
from ..fp8 import scale_grid
from ..kernels.gemv import gemv_finish, gemv_prefetch, gemv_store
from ..kernels.sample import (ROWS_PAD, SLOT_WORDS, argmax_merge, empty_candidate, publish_candidate,
                              reduce_candidates, tile_argmax)
from ..schedule import TaskGraph
from .base import Launch

FAMILIES = {"norm": 0, "norm_local": 1, "gemv": 2, "reduce": 3, "peer": 4, "final": 5}
NORM_MODES = ("box", "local")
DEFAULT_NORM_MODE = "box"
WIDTHS = (1, 2, 4, 8)
F32_NEG_INF_BITS = -8388608          # 0xFF800000
INT32_MAX = 2147483647
ROWS = 8                             # widest build = rows of a candidate slot = GEMV ROWS_PAD
SLOT = 2 * ROWS                      # int64 pairs per candidate slot (kernels/sample.py)


@triton.jit
def _norm_row(X, norm_w, out, r, eps, H: tl.constexpr, CH: tl.constexpr):
    """out[k] = rms_norm(mean_m X[r, m, :])[k] * w[k] (fp32), in CH-wide chunks (two passes over L2)."""
    base = X + r * 4 * H
    ss = tl.zeros([CH], tl.float32)
    for c in tl.static_range(0, H, CH):
        k = c + tl.arange(0, CH)
        m = k < H
        xm = (tl.load(base + k, mask=m, other=0.0) + tl.load(base + H + k, mask=m, other=0.0)
              + tl.load(base + 2 * H + k, mask=m, other=0.0) + tl.load(base + 3 * H + k, mask=m, other=0.0)) * 0.25
        ss += xm * xm
    inv = tl.rsqrt(tl.sum(ss, axis=0) / H + eps)
    for c in tl.static_range(0, H, CH):
        k = c + tl.arange(0, CH)
        m = k < H
        xm = (tl.load(base + k, mask=m, other=0.0) + tl.load(base + H + k, mask=m, other=0.0)
              + tl.load(base + 2 * H + k, mask=m, other=0.0) + tl.load(base + 3 * H + k, mask=m, other=0.0)) * 0.25
        w = tl.load(norm_w + k, mask=m, other=0.0).to(tl.float32)
        tl.store(out + k, xm * inv * w, mask=m)


@triton.jit(do_not_specialize=["rows", "vocab_off", "tp_rank", "tp_size", "stage_lo", "stage_hi", "bump",
                               "tag_stride", "tag_offset", "fault_site", "timeout_ns", "site_xn", "site_cand",
                               "site_xchg", "n_slots", "n_norm"])
def tail_kernel(table, starts, X, norm_w, W, S, logits, tokens, best, scratch, xchg, peer_src,
                o_hdr, o_xn, o_box, o_cand, xn_cta_stride, box_words,
                rows, V_rank, vocab_off, tp_rank, tp_size, n_norm, n_slots, eps,
                stage_lo, stage_hi, bump, tag_stride, tag_offset, fault_site, timeout_ns,
                site_xn, site_cand, site_xchg,
                H: tl.constexpr, CH: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, LOCAL_NORM: tl.constexpr, SLOTS: tl.constexpr):
    pid = tl.program_id(0)
    hdr = scratch + o_hdr
    s64 = scratch.to(tl.pointer_type(tl.int64), bitcast=True)
    cand = s64 + o_cand                                              # [n_slots, SLOT_WORDS] pairs
    xn = scratch.to(tl.pointer_type(tl.float32), bitcast=True) + o_xn  # [width, H] fp32 (local: per CTA)
    if LOCAL_NORM:
        xn += pid * xn_cta_stride
    box = scratch + o_box
    rr = tl.arange(0, ROWS_PAD)
    tag, ok = launch_begin(hdr, tag_stride, tag_offset)
    xn_ready = 0                                                     # this CTA already passed site xn
    i = tl.load(starts + pid)
    end = tl.load(starts + pid + 1)
    while (i < end) & (ok != 0):
        fam = tl.load(table + i * 8)
        st = tl.load(table + i * 8 + 1)
        a0 = tl.load(table + i * 8 + 2)
        a1 = tl.load(table + i * 8 + 3)
        a2 = tl.load(table + i * 8 + 4)
        if (st >= stage_lo) & (st < stage_hi):
            if fam == 0:                                             # norm (box mode): row a0
                if a0 < rows:
                    _norm_row(X, norm_w, xn + a0 * H, a0, eps, H, CH)
                signal_box(box, tl.num_programs(0), box_words, a0, tag, site_xn, fault_site, 128)
            elif fam == 1:                                           # norm_local: every row, own slot
                r = 0
                while r < rows:
                    _norm_row(X, norm_w, xn + r * H, r, eps, H, CH)
                    r += 1
                tl.debug_barrier()                                   # own warps' stores before the GEMVs
            elif fam == 2:                                           # gemv: tiles a0..a0+a1-1, slot a2
                bv, bi = empty_candidate()
                j = 0
                while (j < a1) & (ok != 0):
                    n0 = (a0 + j) * BLOCK_N
                    w0 = gemv_prefetch(W, n0, 0, H, V_rank, H, BLOCK_N, PF_K)   # weights before the wait
                    if not LOCAL_NORM:
                        if xn_ready == 0:
                            ok = wait_box(box, pid, box_words, n_norm, tag, hdr, site_xn, pid, timeout_ns)
                            xn_ready = ok
                    if ok != 0:
                        acc = gemv_finish(w0, W, S, xn, H, rows, n0, 0, H, V_rank, H, ROWS_PAD, BLOCK_N, BLOCK_K,
                                          PF_K, NUM_STAGES)
                        gemv_store(logits, V_rank, acc, rows, n0, V_rank, ROWS_PAD, BLOCK_N)
                        v, ix = tile_argmax(acc, n0, V_rank, vocab_off, BLOCK_N)
                        bv, bi = argmax_merge(bv, bi, v, ix)
                    j += 1
                if ok != 0:
                    publish_candidate(cand + a2 * SLOT_WORDS, bv, bi, rows, tag, site_cand, fault_site)
            elif fam == 3:                                           # reduce: all slots, in slot order
                bv, bi, ok = reduce_candidates(cand, n_slots, rows, tag, hdr, site_cand, pid, timeout_ns, SLOTS)
                if ok != 0:
                    tl.store(best + rr, bv.to(tl.int32, bitcast=True), mask=rr < rows)
                    tl.store(best + ROWS_PAD + rr, bi, mask=rr < rows)
                    if tp_size == 1:
                        tl.store(tokens + rr, bi, mask=rr < rows)
                    else:
                        d = 0
                        while d < tp_size:                           # this rank's slot of every rank
                            publish_candidate(xchg + (d * tp_size + tp_rank) * SLOT_WORDS, bv, bi, rows, tag,
                                              site_xchg, fault_site)
                            d += 1
            elif fam == 4:                                           # peer (loopback): rank a0's candidate
                pv = tl.load(peer_src + a0 * 2 * ROWS_PAD + rr).to(tl.float32, bitcast=True)
                pi = tl.load(peer_src + a0 * 2 * ROWS_PAD + ROWS_PAD + rr)
                publish_candidate(xchg + (tp_rank * tp_size + a0) * SLOT_WORDS, pv, pi, rows, tag, site_xchg,
                                  fault_site)
            elif fam == 5:                                           # final: ranks in rank order
                bv, bi, ok = reduce_candidates(xchg + tp_rank * tp_size * SLOT_WORDS, tp_size, rows, tag, hdr,
                                               site_xchg, pid, timeout_ns, 8)
                if ok != 0:
                    tl.store(tokens + rr, bi, mask=rr < rows)
        i += 1
    launch_end(hdr, bump)


def _pick_block_n(v_rank: int, grid: int) -> int:
    """Largest tile (64, 32, 16 rows) whose tiles spread over the grid at >= 90% balance."""
    best, best_eff = 16, 0.0
    for bn in (64, 32, 16):
        tiles = -(-v_rank // bn)
        eff = tiles / (grid * -(-tiles // grid)) if tiles >= grid else tiles / grid
        if eff >= 0.9:
            return bn
        if eff > best_eff:
            best, best_eff = bn, eff
    return best


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
                 block_n: int | None = None, block_k: int = 128, num_stages: int = 3, num_warps: int = 8, **tag_kw):
        super().__init__(grid=grid, device=device, timeout_s=timeout_s, **tag_kw)
        cfg.check_tp(tp_size)
        if not (isinstance(tp_rank, int) and 0 <= tp_rank < tp_size):
            raise ValueError(f"tail: tp_rank={tp_rank!r} must be in [0, tp_size={tp_size})")
        if width not in WIDTHS:
            raise ValueError(f"tail: width={width!r} must be one of {WIDTHS}")
        if norm_mode not in NORM_MODES:
            raise ValueError(f"tail: norm_mode={norm_mode!r} must be one of {NORM_MODES}")
        H, V = cfg.hidden_size, cfg.vocab_size
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
        self.block_n = block_n or _pick_block_n(self.V_rank, self.grid)
        self.block_k, self.num_stages = block_k, num_stages
        self.loopback = tp_size > 1 and xchg is None
        self.xchg = xchg
        if tp_size > 1 and xchg is None:
            self.xchg = new_xchg(tp_size, self.device)
        if tp_size > 1 and (self.xchg.dtype != torch.int64 or self.xchg.numel() < tp_size * tp_size * SLOT):
            raise ValueError(f"tail: xchg must be int64 with >= {tp_size * tp_size * SLOT} words (see new_xchg)")
        self.peer_src = torch.zeros(max(tp_size, 1), 2, ROWS, dtype=torch.int32, device=self.device)
        self.set_peers(None)
        self.logits = torch.empty(width, self.V_rank, dtype=torch.float32, device=self.device)
        self.tokens = torch.empty(width, dtype=torch.int32, device=self.device)
        self.best = torch.empty(2, ROWS, dtype=torch.int32, device=self.device)
        self.X = None
        self.rows = 0
        self._setup()

    # ------------------------------------------------------------------ plan
    @staticmethod
    def site_names(tp_size: int = 1, norm_mode: str = DEFAULT_NORM_MODE) -> list[str]:
        return (["tail.xn"] if norm_mode == "box" else []) + ["tail.cand"] + (["tail.xchg"] if tp_size > 1 else [])

    def build_graph(self) -> TaskGraph:
        g, H, G = TaskGraph("tail", FAMILIES), self.H, self.grid
        wbytes = 1 if self.fp8 else 2
        g.stage("norm")
        if self.norm_mode == "box":
            for r in range(self.width):
                g.add("norm", (r,), writes=("xn",), nbytes=2 * 4 * H * 4 + 2 * H)
        else:
            for c in range(G):
                g.add("norm_local", (), nbytes=self.width * 2 * 4 * H * 4, cta=c)
        g.stage("lm_head")
        tiles = -(-self.V_rank // self.block_n)
        n_tasks = min(G, tiles)
        reads = ("xn",) if self.norm_mode == "box" else ()
        for s in range(n_tasks):
            t0, t1 = s * tiles // n_tasks, (s + 1) * tiles // n_tasks
            nrows = min(t1 * self.block_n, self.V_rank) - t0 * self.block_n
            g.add("gemv", (t0, t1 - t0, s), reads=reads, writes=("cand",), nbytes=nrows * H * wbytes)
        self.n_slots = n_tasks
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
            pl.rows("xn", (self.width, H), "float32")
            pl.box("box", self.grid, self.width)
        else:
            pl.rows("xn", (self.grid, self.width, H), "float32")
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
                self.scratch, xchg, self.peer_src,
                L["hdr"].elem_offset(), L["xn"].elem_offset(), box_off, L["cand"].elem_offset(),
                self.width * self.H, box_words,
                self.rows, self.V_rank, self.vocab_off, self.tp_rank, self.tp_size, self.width, self.n_slots,
                float(self.cfg.rms_norm_eps), stage_lo, stage_hi, bump, self.tag_stride, self.tag_offset,
                fault_site, self._timeout_ns,
                sched.site_id("xn"), sched.site_id("cand"), sched.site_id("xchg"))
        const = dict(H=self.H, CH=min(1024, triton.next_power_of_2(self.H)), BLOCK_N=self.block_n,
                     BLOCK_K=self.block_k, PF_K=128, NUM_STAGES=self.num_stages, LOCAL_NORM=self.norm_mode == "local", SLOTS=16)
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
