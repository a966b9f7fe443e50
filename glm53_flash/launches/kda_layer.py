"""The persistent kernel shared by the `embed`, `dense` and `kda` launches: one layer = a KDA mixer
and an FFN, each inside its mHC, in one launch. The host side (graph, scratch, arguments, run) is
launches/layer_host.py; the per-kind classes are thin (embed.py, dense.py, kda.py).

Stages (each task family is a branch of the one kernel; every hand-off is plain rows + a box, or
tagged pairs across TP ranks; every wait is a named site `<kind>.<region>`):
  0 hc_pre    column tiles of the 4 streams -> hc_pre partial slots (24 GEMV sums + Gram matrix);
              embed: the task first gathers its columns of the embedding rows into 4 streams (x0).
  1 gate_in   [waits hp1] column tiles of the attention gate row a_in (bf16): each task joins the
              slots and runs the Sinkhorn itself; tile 0 also stores the coefficients (coef1).
  2 inproj    [waits a_in] GEMV tiles of the fused q|k|v|b|f_a|g_a rows -> yin (fp32); the first
              weight chunk of a tile is loaded before the wait.
  3 kda       [waits yin] (row, head, value block) tasks: conv + gate + delta rule into the SECOND
              state / window buffers; f and the output gate formed in-task from f_a / g_a. One block
              per head (BV = DV): the gated norm too -> o (bf16). Otherwise raw blocks -> oraw.
  3b kda_norm [waits oraw] (BV < DV) joins the blocks' sums of squares, gated norm -> o.
  4 o_proj    [waits o] GEMV tiles over this rank's heads. TP 1: the tile's owner runs hc_post on its
              columns (X -> xmid) fused with the FFN hc_pre partials of the same columns (hp2).
              TP > 1: the partial tile goes to every rank's exchange slot (tagged pairs, xo) and
  4b o_sum    [waits xo] the tile's owner sums the ranks' partials in rank order, then as above.
  5 gate_ffn  [waits hp2] FFN gate row a (bf16) and coef2, as gate_in.
  6 gate_up   [waits a] gate|up tile pairs, clamped SwiGLU -> h (bf16) (kernels/mlp.py).
  7 down      [waits h] GEMV tiles; TP 1: hc_post of the tile's columns -> X_out. TP > 1: xd, and
  7b down_sum [waits xd] rank-order sum, hc_post -> X_out.
Data read after a wait but written earlier than the region waited on (coef1 / coef2, x0, xmid) is
ordered by the chain of release/acquire hand-offs in between (happens-before is transitive).
Pad rows (rows <= r < width) compute nothing and write nothing, but their tasks still signal.
A fault anywhere on one rank reaches every rank: the last exchange (xd) follows every local site, so a
rank that stops early starves the others' down_sum and every rank raises (none commits its state).

Registers (sm_90, Triton 3.6's bundled ptxas, offline: tests/test_launch_kda.py test_sm90_compile_*; real
shapes, BLOCK_N 64, 3 stages; every build 255): spilled at 4 / 8 warps, bf16 and FP8, TP1 and TP8:
dense 0-108 / 68 B, embed 56-100 / 60-68 B, kda (MoE) 180-444 / 192-316 B. No one family sets it:
alone they take 48-167 (o_proj + fused hc_post the most), and dropping any one family from the dense
kernel still leaves 251-255, so ptxas fills what a 4-warp CTA may use (2 CTAs/SM still fit).
"""
import triton
import triton.language as tl

from sync.device import launch_begin, launch_end, signal_box, wait_box

from ..kernels.gemv import gemv_finish, gemv_prefetch, gemv_store
from ..kernels.mhc import hc_partial_finish, hc_partial_prefetch, hc_post_partial
from ..kernels.moe import moe_down_finish, moe_down_prefetch, router_finish, router_prefetch, router_store_partial
from ..kernels.mlp import gateup_finish, gateup_prefetch
from .ffn import expert_slot, post_cols
from .mixer_kda import (SLOT_W, embed_gather, gate_rows, kda_block, kda_norm_task, kda_prefetch, peer_publish,
                        xchg_publish, xchg_sum)

FAMILIES = {"part": 0, "gate1": 1, "inproj": 2, "kda": 3, "kda_norm": 4, "oproj": 5, "post1": 6, "gate2": 7,
            "gu": 8, "down": 9, "post2": 10, "peer_o": 11, "peer_d": 12, "router": 13, "expert": 14,
            "moe_down": 15}
BOXES = ("hp1", "a_in", "yin", "oraw", "o", "hp2", "a", "h", "rl", "xe")   # box b: meta words 4b..4b+3 =
                                                                             # offset, words, producers, site
ROWS_REGIONS = ("part1", "part2", "coef1", "coef2", "x0", "a_in_rows", "a_rows", "yin_rows", "oraw_rows", "ssq",
                "o_rows", "y1", "xmid", "h_rows", "y2", "part_r", "ids_rec", "rw_rec", "act_e")
META_NAMES = ROWS_REGIONS + ("hdr", "site_xo", "site_xd", "npart1", "npart2", "nrpart")
META_BASE = 4 * len(BOXES)
META = {n: META_BASE + i for i, n in enumerate(META_NAMES)}
META_WORDS = META_BASE + len(META_NAMES)

_B = {n: tl.constexpr(i) for i, n in enumerate(BOXES)}
B_HP1, B_AIN, B_YIN, B_ORAW, B_O, B_HP2, B_A, B_H, B_RL, B_XE = (_B[n] for n in BOXES)
_M = {n: tl.constexpr(v) for n, v in META.items()}
(M_PART1, M_PART2, M_COEF1, M_COEF2, M_X0, M_AIN, M_A, M_YIN, M_ORAW, M_SSQ, M_ON, M_Y1, M_XMID, M_H, M_Y2, M_PART_R,
 M_IDS, M_RW, M_ACTE) = (_M[n] for n in ROWS_REGIONS)
M_HDR, M_SITE_XO, M_SITE_XD, M_NPART1, M_NPART2, M_NRPART = (_M[n] for n in ("hdr", "site_xo", "site_xd", "npart1",
                                                                             "npart2", "nrpart"))


@triton.jit
def _box(scratch, meta, b):
    m = meta + 4 * b
    return scratch + tl.load(m), tl.load(m + 1), tl.load(m + 2), tl.load(m + 3)


@triton.jit
def _wait(scratch, meta, b, ready, pid, tag, hdr, timeout_ns):
    """Wait once per CTA for every producer of box b (ready: this CTA already passed it) -> ok."""
    if ready == 0:
        box, words, nprod, site = _box(scratch, meta, b)
        ready = wait_box(box, pid, words, nprod, tag, hdr, site, pid, timeout_ns)
    return ready


@triton.jit
def _signal(scratch, meta, b, producer, tag, fault_site):
    box, words, nprod, site = _box(scratch, meta, b)
    signal_box(box, tl.num_programs(0), words, producer, tag, site, fault_site, 128)


@triton.jit
def _f32(scratch, meta, m):
    return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + tl.load(meta + m)


@triton.jit
def _act(scratch, meta, m, ACT_F32: tl.constexpr):
    """A hand-off row region in the activation dtype (bf16; fp32 for diagnostics)."""
    if ACT_F32:
        return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + tl.load(meta + m)
    else:
        return scratch.to(tl.pointer_type(tl.bfloat16), bitcast=True) + tl.load(meta + m)


@triton.jit
def _streams(X, scratch, meta, EMBED: tl.constexpr):
    """The layer's input streams [width, 4, H] fp32: X, or the gathered x0 of the embed launch."""
    if EMBED:
        return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + tl.load(meta + M_X0)
    else:
        return X


@triton.jit
def _post_partials(fn2, X, scratch, meta, rows, t0, nt, H: tl.constexpr, ROWS_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """hc_post of the mixer on column tiles t0 .. t0 + nt - 1 (X -> xmid) fused with the FFN hc_pre
    partials, one slot per BLOCK_N tile: the join order (tile order) does not depend on the grid."""
    y1 = _f32(scratch, meta, M_Y1)
    coef1 = _f32(scratch, meta, M_COEF1)
    xmid = _f32(scratch, meta, M_XMID)
    part2 = _f32(scratch, meta, M_PART2)
    j = 0
    while j < nt:
        c0 = (t0 + j) * BLOCK_N
        wf = hc_partial_prefetch(fn2, c0, c0 + BLOCK_N, H, BLOCK_C)
        hc_post_partial(wf, fn2, X, y1, H, coef1, 24, xmid, 4 * H, part2 + (t0 + j) * ROWS_PAD * SLOT_W, SLOT_W, rows,
                        c0, c0 + BLOCK_N, H, ROWS_PAD, BLOCK_C)
        j += 1


@triton.jit
def _post_final(scratch, meta, X_out, rows, t0, nt, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """hc_post of the FFN on column tiles t0 .. t0 + nt - 1: xmid, y2 -> X_out."""
    post_cols(_f32(scratch, meta, M_XMID), _f32(scratch, meta, M_Y2), _f32(scratch, meta, M_COEF2), X_out, rows,
              t0 * BLOCK_N, tl.minimum((t0 + nt) * BLOCK_N, H), H, BLOCK_N)


@triton.jit(do_not_specialize=["rows", "width", "tp_rank", "tp_size", "stage_lo", "stage_hi", "bump", "tag_stride",
                               "tag_offset", "fault_site", "timeout_ns"])
def kda_layer_kernel(table, starts, meta, scratch, xo, xd, peer_o, peer_d, X, X_out, tokens, embed_w,
                     fn1, base1, scale1, ln1, fn2, base2, scale2, ln2,
                     W_in, S_in, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, W_o,
                     W_g, S_g, W_u, S_u, W_d, S_d, W_r, bias_r, w_gu, s_gu, w_de, s_de,
                     rows, width, tp_rank, tp_size, eps, hc_eps, lower_bound, swiglu_limit, scaling,
                     stage_lo, stage_hi, bump, tag_stride, tag_offset, fault_site, timeout_ns,
                     H: tl.constexpr, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr, N_IN: tl.constexpr,
                     I: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                     CK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, BLOCK_C: tl.constexpr, GATE_BH: tl.constexpr, ITERS: tl.constexpr,
                     ROWS_PAD: tl.constexpr, EMBED: tl.constexpr, ACT_F32: tl.constexpr, MOE: tl.constexpr,
                     E: tl.constexpr, KE: tl.constexpr, I_E: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                     RENORM: tl.constexpr, BLOCK_E: tl.constexpr, RCK: tl.constexpr):
    pid = tl.program_id(0)
    NB: tl.constexpr = DV // BV
    # Region pointers are formed inside each branch from the meta words (cheap cached loads), never
    # hoisted here: ~25 pointers live across the task loop cost ~50 registers in every family.
    hdr = scratch + tl.load(meta + M_HDR)
    tag, ok = launch_begin(hdr, tag_stride, tag_offset)
    r_hp1 = 0          # this CTA already passed the wait on box ...
    r_ain = 0
    r_yin = 0
    r_oraw = 0
    r_o = 0
    r_hp2 = 0
    r_a = 0
    r_h = 0
    r_rl = 0
    r_xe = 0
    i = tl.load(starts + pid)
    end = tl.load(starts + pid + 1)
    while (i < end) & (ok != 0):
        fam = tl.load(table + i * 8)
        st = tl.load(table + i * 8 + 1)
        a0 = tl.load(table + i * 8 + 2)
        a1 = tl.load(table + i * 8 + 3)
        a2 = tl.load(table + i * 8 + 4)
        a3 = tl.load(table + i * 8 + 5)
        a4 = tl.load(table + i * 8 + 6)
        if (st >= stage_lo) & (st < stage_hi):
            if fam == 0:                                   # part: column tiles a0 .. a0 + a1 - 1, producer a2
                xs = _streams(X, scratch, meta, EMBED)
                part1 = _f32(scratch, meta, M_PART1)
                j = 0
                while j < a1:
                    c0 = (a0 + j) * BLOCK_N
                    w0 = hc_partial_prefetch(fn1, c0, c0 + BLOCK_N, H, BLOCK_C)
                    if EMBED:
                        embed_gather(tokens, embed_w, xs, rows, c0, c0 + BLOCK_N, H, BLOCK_C)
                        tl.debug_barrier()                 # own warps' x0 stores before the partial reads
                    hc_partial_finish(w0, fn1, xs, 4 * H, part1 + (a0 + j) * ROWS_PAD * SLOT_W, SLOT_W, rows, c0,
                                      c0 + BLOCK_N, H, ROWS_PAD, BLOCK_C)
                    j += 1
                _signal(scratch, meta, B_HP1, a2, tag, fault_site)
            elif fam == 1:                                 # gate1: columns [a0, a0 + GATE_BH), producer a1
                r_hp1 = _wait(scratch, meta, B_HP1, r_hp1, pid, tag, hdr, timeout_ns)
                ok = r_hp1
                if ok != 0:
                    gate_rows(_streams(X, scratch, meta, EMBED), _f32(scratch, meta, M_PART1),
                              tl.load(meta + M_NPART1), base1, scale1, ln1, _f32(scratch, meta, M_COEF1),
                              _act(scratch, meta, M_AIN, ACT_F32), rows, a0, a1 == 0, eps, hc_eps, H, ROWS_PAD,
                              ITERS, GATE_BH)
                    _signal(scratch, meta, B_AIN, a1, tag, fault_site)
            elif fam == 2:                                 # inproj: tiles a0 .. a0 + a1 - 1, producer a2
                j = 0
                while (j < a1) & (ok != 0):
                    n0 = (a0 + j) * BLOCK_N
                    w0 = gemv_prefetch(W_in, n0, 0, H, N_IN, H, BLOCK_N, PF_K)     # weights before the wait
                    r_ain = _wait(scratch, meta, B_AIN, r_ain, pid, tag, hdr, timeout_ns)
                    ok = r_ain
                    if ok != 0:
                        acc = gemv_finish(w0, W_in, W_in, _act(scratch, meta, M_AIN, ACT_F32), H, rows, n0, 0, H,
                                          N_IN, H, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        gemv_store(_f32(scratch, meta, M_YIN), N_IN, acc, rows, n0, N_IN, ROWS_PAD, BLOCK_N)
                    j += 1
                if ok != 0:
                    _signal(scratch, meta, B_YIN, a2, tag, fault_site)
            elif fam == 3:                                 # kda: row a0, head a1, block a2, producer a3
                if a0 < rows:
                    S_blk = kda_prefetch(S_in, a0, a1, a2 * BV, NH, DK, DV, BV)    # state before the wait
                    r_yin = _wait(scratch, meta, B_YIN, r_yin, pid, tag, hdr, timeout_ns)
                    ok = r_yin
                    if ok != 0:
                        kda_block(S_blk, a0, a1, a2 * BV, _f32(scratch, meta, M_YIN), S_out, win_in, win_out, conv_w,
                                  A_log, dt_bias, f_b, g_b, onorm_w, _act(scratch, meta, M_ON, ACT_F32),
                                  _f32(scratch, meta, M_ORAW), _f32(scratch, meta, M_SSQ), eps, lower_bound, D, NH, R,
                                  N_IN, DK, DV, BV, KC, CK)
                if ok != 0:
                    if NB == 1:
                        _signal(scratch, meta, B_O, a3, tag, fault_site)
                    else:
                        _signal(scratch, meta, B_ORAW, a3, tag, fault_site)
            elif fam == 4:                                 # kda_norm: row a0, head a1, block a2, producer a3
                r_oraw = _wait(scratch, meta, B_ORAW, r_oraw, pid, tag, hdr, timeout_ns)
                ok = r_oraw
                if ok != 0:
                    if a0 < rows:
                        kda_norm_task(a0, a1, a2 * BV, _f32(scratch, meta, M_YIN), g_b, onorm_w,
                                      _act(scratch, meta, M_ON, ACT_F32), _f32(scratch, meta, M_ORAW),
                                      _f32(scratch, meta, M_SSQ), eps, D, NH, R, N_IN, DV, BV, CK)
                    _signal(scratch, meta, B_O, a3, tag, fault_site)
            elif fam == 5:                                 # oproj: tiles a0 .. a0 + a1 - 1, producer a2
                j = 0
                while (j < a1) & (ok != 0):
                    n0 = (a0 + j) * BLOCK_N
                    w0 = gemv_prefetch(W_o, n0, 0, D, H, D, BLOCK_N, PF_K)
                    r_o = _wait(scratch, meta, B_O, r_o, pid, tag, hdr, timeout_ns)
                    ok = r_o
                    if ok != 0:
                        acc = gemv_finish(w0, W_o, W_o, _act(scratch, meta, M_ON, ACT_F32), D, rows, n0, 0, D, H, D,
                                          ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        if tp_size == 1:
                            gemv_store(_f32(scratch, meta, M_Y1), H, acc, rows, n0, H, ROWS_PAD, BLOCK_N)
                        else:
                            xchg_publish(xo, acc, n0, rows, width, tp_rank, tp_size, tag, tl.load(meta + M_SITE_XO),
                                         fault_site, H, ROWS_PAD, BLOCK_N)
                    j += 1
                if (ok != 0) & (tp_size == 1):
                    tl.debug_barrier()                     # own warps' y1 stores before hc_post reads them
                    _post_partials(fn2, _streams(X, scratch, meta, EMBED), scratch, meta, rows, a0, a1, H, ROWS_PAD,
                                   BLOCK_N, BLOCK_C)
                    _signal(scratch, meta, B_HP2, a2, tag, fault_site)
            elif fam == 6:                                 # post1: rank sum of tiles a0 .., producer a2
                j = 0
                while (j < a1) & (ok != 0):
                    ok = xchg_sum(xo, _f32(scratch, meta, M_Y1), (a0 + j) * BLOCK_N, rows, width, tp_rank, tp_size,
                                  tag, hdr, tl.load(meta + M_SITE_XO), pid, timeout_ns, H, ROWS_PAD, BLOCK_N)
                    j += 1
                if ok != 0:
                    tl.debug_barrier()
                    _post_partials(fn2, _streams(X, scratch, meta, EMBED), scratch, meta, rows, a0, a1, H, ROWS_PAD,
                                   BLOCK_N, BLOCK_C)
                    _signal(scratch, meta, B_HP2, a2, tag, fault_site)
            elif fam == 7:                                 # gate2: columns [a0, a0 + GATE_BH), producer a1
                r_hp2 = _wait(scratch, meta, B_HP2, r_hp2, pid, tag, hdr, timeout_ns)
                ok = r_hp2
                if ok != 0:
                    gate_rows(_f32(scratch, meta, M_XMID), _f32(scratch, meta, M_PART2), tl.load(meta + M_NPART2),
                              base2, scale2, ln2, _f32(scratch, meta, M_COEF2), _act(scratch, meta, M_A, ACT_F32),
                              rows, a0, a1 == 0, eps, hc_eps, H, ROWS_PAD, ITERS, GATE_BH)
                    _signal(scratch, meta, B_A, a1, tag, fault_site)
            elif fam == 8:                                 # gu: gate|up tiles a0 .., producer a2
                j = 0
                while (j < a1) & (ok != 0):
                    n0 = (a0 + j) * BLOCK_N
                    wg, wu = gateup_prefetch(W_g, W_u, n0, I, H, BLOCK_N, PF_K)
                    r_a = _wait(scratch, meta, B_A, r_a, pid, tag, hdr, timeout_ns)
                    ok = r_a
                    if ok != 0:
                        act = gateup_finish(wg, wu, W_g, W_u, S_g, S_u, _act(scratch, meta, M_A, ACT_F32), H, rows,
                                            n0, I, H, swiglu_limit, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        gemv_store(_act(scratch, meta, M_H, ACT_F32), I, act, rows, n0, I, ROWS_PAD, BLOCK_N)
                    j += 1
                if ok != 0:
                    _signal(scratch, meta, B_H, a2, tag, fault_site)
            elif fam == 9:                                 # down: tiles a0 .. a0 + a1 - 1
                j = 0
                while (j < a1) & (ok != 0):
                    n0 = (a0 + j) * BLOCK_N
                    w0 = gemv_prefetch(W_d, n0, 0, I, H, I, BLOCK_N, PF_K)
                    r_h = _wait(scratch, meta, B_H, r_h, pid, tag, hdr, timeout_ns)
                    ok = r_h
                    if ok != 0:
                        acc = gemv_finish(w0, W_d, S_d, _act(scratch, meta, M_H, ACT_F32), I, rows, n0, 0, I, H, I,
                                          ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        if tp_size == 1:
                            gemv_store(_f32(scratch, meta, M_Y2), H, acc, rows, n0, H, ROWS_PAD, BLOCK_N)
                        else:
                            xchg_publish(xd, acc, n0, rows, width, tp_rank, tp_size, tag, tl.load(meta + M_SITE_XD),
                                         fault_site, H, ROWS_PAD, BLOCK_N)
                    j += 1
                if (ok != 0) & (tp_size == 1):
                    tl.debug_barrier()
                    _post_final(scratch, meta, X_out, rows, a0, a1, H, BLOCK_N)
            elif fam == 10:                                # post2: rank sum of tiles a0 .., hc_post
                j = 0
                while (j < a1) & (ok != 0):
                    ok = xchg_sum(xd, _f32(scratch, meta, M_Y2), (a0 + j) * BLOCK_N, rows, width, tp_rank, tp_size,
                                  tag, hdr, tl.load(meta + M_SITE_XD), pid, timeout_ns, H, ROWS_PAD, BLOCK_N)
                    j += 1
                if ok != 0:
                    tl.debug_barrier()
                    _post_final(scratch, meta, X_out, rows, a0, a1, H, BLOCK_N)
            elif fam == 11:                                # peer_o (loopback): rank a0's tiles a1 .. a1 + a2 - 1
                j = 0
                while j < a2:
                    peer_publish(xo, peer_o, a0, (a1 + j) * BLOCK_N, rows, width, tp_rank, tp_size, tag,
                                 tl.load(meta + M_SITE_XO), fault_site, H, ROWS_PAD, BLOCK_N)
                    j += 1
            elif fam == 12:                                # peer_d (loopback)
                j = 0
                while j < a2:
                    peer_publish(xd, peer_d, a0, (a1 + j) * BLOCK_N, rows, width, tp_rank, tp_size, tag,
                                 tl.load(meta + M_SITE_XD), fault_site, H, ROWS_PAD, BLOCK_N)
                    j += 1
            elif fam == 13:                                # router: experts [a0, +BLOCK_E), k in [a1, a2),
                if MOE:                                    # producer a3, K part a4
                    w0 = router_prefetch(W_r, a0, a1, a2, E, H, BLOCK_E, RCK)
                    r_a = _wait(scratch, meta, B_A, r_a, pid, tag, hdr, timeout_ns)
                    ok = r_a
                    if ok != 0:
                        lg = router_finish(w0, W_r, _act(scratch, meta, M_A, ACT_F32), H, rows, a0, a1, a2, E, H,
                                           ROWS_PAD, BLOCK_E, RCK, NUM_STAGES)
                        router_store_partial(_f32(scratch, meta, M_PART_R) + a4 * width * E, lg, rows, a0, E, ROWS_PAD,
                                             BLOCK_E)
                        _signal(scratch, meta, B_RL, a3, tag, fault_site)
            elif fam == 14:                                # expert slot: row a0, rank a1, tile a2, producer a3
                if MOE:
                    r_rl = _wait(scratch, meta, B_RL, r_rl, pid, tag, hdr, timeout_ns)
                    ok = r_rl
                    if ok != 0:
                        if a0 < rows:
                            expert_slot(_f32(scratch, meta, M_PART_R), tl.load(meta + M_NRPART), width, bias_r, w_gu,
                                        s_gu, _act(scratch, meta, M_A, ACT_F32), _act(scratch, meta, M_ACTE, ACT_F32),
                                        scratch + tl.load(meta + M_IDS), _f32(scratch, meta, M_RW), a0, a1,
                                        a2 * BLOCK_N, swiglu_limit, scaling, E, KE, I_E, H, E_PAD, K_PAD, RENORM,
                                        ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        _signal(scratch, meta, B_XE, a3, tag, fault_site)
            elif fam == 15:                                # moe_down: tiles a0 .. a0 + a1 - 1, row by row
                if MOE:
                    j = 0
                    while (j < a1) & (ok != 0):
                        n0 = (a0 + j) * BLOCK_N
                        d0 = moe_down_prefetch(W_d, n0, H, I, BLOCK_N, PF_K)           # shared expert's weights
                        r_h = _wait(scratch, meta, B_H, r_h, pid, tag, hdr, timeout_ns)
                        ok = r_h
                        if ok != 0:
                            r_xe = _wait(scratch, meta, B_XE, r_xe, pid, tag, hdr, timeout_ns)
                            ok = r_xe
                        rr = 0
                        while (rr < rows) & (ok != 0):
                            if rr > 0:
                                d0 = moe_down_prefetch(W_d, n0, H, I, BLOCK_N, PF_K)
                            acc = moe_down_finish(d0, W_d, S_d, _act(scratch, meta, M_H, ACT_F32) + rr * I,
                                                  scratch + tl.load(meta + M_IDS) + rr * KE,
                                                  _f32(scratch, meta, M_RW) + rr * KE,
                                                  _act(scratch, meta, M_ACTE, ACT_F32) + rr * KE * I_E, w_de, s_de,
                                                  n0, E, H, I_E, I, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, KE)
                            if tp_size == 1:
                                gemv_store(_f32(scratch, meta, M_Y2) + rr * H, 0, acc, 1, n0, H, ROWS_PAD, BLOCK_N)
                            else:
                                xchg_publish(xd + rr * H, acc, n0, 1, width, tp_rank, tp_size, tag,
                                             tl.load(meta + M_SITE_XD), fault_site, H, ROWS_PAD, BLOCK_N)
                            rr += 1
                        j += 1
                    if (ok != 0) & (tp_size == 1):
                        tl.debug_barrier()
                        _post_final(scratch, meta, X_out, rows, a0, a1, H, BLOCK_N)
        i += 1
    launch_end(hdr, bump)
