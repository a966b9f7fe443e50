"""Task families and hand-off helpers shared by the layer kernels (launches/kda_layer.py for the
embed / dense / kda kinds, launches/sparse_layer.py for sparse / nextn): the mHC pre / gate / post
glue, o_proj with its cross-rank sum, the dense and shared-expert gate|up, the MoE (router partials,
expert slots, down + hc_post, cross-rank down sum) and the loopback peer tasks. Both kernels call
these functions; they differ only in their mixer families.

Meta words (one int32 vector per launch, host side: layer_host.py `KdaLayerLaunch._meta`): region
offsets and scalars at words 0 .. BOX_BASE - 1, the COMMON_* names first (so a shared family finds
them at the same word in both kernels), box b's (offset, words, producers, site) at BOX_BASE + 4b,
COMMON_BOXES first.

Registers: each family is a `noinline` function (its own PTX .func). Inlined into the persistent
kernel's one while loop, the families' loop-invariant index tensors and pointers were hoisted to the
loop top and stayed live through every GEMV, and every build reached 255 registers with spills
(launches/tail.py found the same). The waits are noinline too (spin loops with inline asm).

Dense MLP (kernels/mlp.py): a gate|up task owns the same BLOCK_N intermediate rows of both
projections, so the clamped SwiGLU needs no hop (both weight chunks prefetched before the wait); the
down tiles follow. The MoE's shared expert is the same gate|up task over its own weights.

MoE (kernels/moe.py): router partial tasks (expert tile x K range) -> expert slots (row, rank, tile),
each selecting redundantly from the joined partials (`expert_slot`) -> down tiles per row
(kernels/moe.py moe_down_finish: the k routed experts in rank order, then the shared expert).
"""
import triton
import triton.language as tl

from sync.device import signal_box, wait_box

from ..kernels.gemv import gemv_finish, gemv_prefetch, gemv_store
from ..kernels.mhc import hc_partial_finish, hc_partial_prefetch, hc_post_partial, hc_post_tile
from ..kernels.mlp import swiglu_clamped
from ..kernels.moe import (moe_down_finish, moe_down_prefetch, router_finish, router_prefetch, router_select,
                           router_store_partial, router_store_record)
from .tail import _l2_prefetch
from .mixer_kda import SLOT_W, embed_gather, gate_rows, peer_publish, xchg_publish, xchg_sum

# ---------------------------------------------------------------------------- meta layout
BOX_BASE_H = 64
BOX_BASE: tl.constexpr = tl.constexpr(BOX_BASE_H)
COMMON_BOXES = ("hp1", "a_in", "o", "hp2", "a", "h", "rl", "xe")
COMMON_ROWS = ("part1", "part2", "coef1", "coef2", "a_in_rows", "a_rows", "o_rows", "y1", "xmid", "h_rows", "y2",
               "part_r", "ids_rec", "rw_rec", "act_e")
COMMON_SCALARS = ("hdr", "site_xo", "site_xd", "npart1", "npart2", "nrpart")


def meta_layout(boxes: tuple, rows_regions: tuple):
    """-> (META name -> word, META_WORDS) for a kernel whose boxes / row regions start with COMMON_*."""
    assert boxes[:len(COMMON_BOXES)] == COMMON_BOXES and rows_regions[:len(COMMON_ROWS)] == COMMON_ROWS
    names = COMMON_ROWS + COMMON_SCALARS + rows_regions[len(COMMON_ROWS):]
    assert len(names) <= BOX_BASE_H
    return {n: i for i, n in enumerate(names)}, BOX_BASE_H + 4 * len(boxes)


_META, _ = meta_layout(COMMON_BOXES, COMMON_ROWS)
(M_PART1, M_PART2, M_COEF1, M_COEF2, M_AIN, M_A, M_ON, M_Y1, M_XMID, M_H, M_Y2, M_PART_R, M_IDS, M_RW, M_ACTE, M_HDR,
 M_SITE_XO, M_SITE_XD, M_NPART1, M_NPART2, M_NRPART) = (tl.constexpr(_META[n]) for n in COMMON_ROWS + COMMON_SCALARS)
B_HP1, B_AIN, B_O, B_HP2, B_A, B_H, B_RL, B_XE = (tl.constexpr(i) for i in range(len(COMMON_BOXES)))


# ---------------------------------------------------------------------------- hand-off helpers
@triton.jit
def box_at(scratch, meta, b):
    m = meta + BOX_BASE + 4 * b
    return scratch + tl.load(m), tl.load(m + 1), tl.load(m + 2), tl.load(m + 3)


@triton.jit(noinline=True)
def _wait_box(scratch, meta, b, pid, tag, hdr, timeout_ns):
    box, words, nprod, site = box_at(scratch, meta, b)
    return wait_box(box, pid, words, nprod, tag, hdr, site, pid, timeout_ns)


@triton.jit
def waitb(scratch, meta, b, ready, pid, tag, hdr, timeout_ns):
    """Wait once per CTA for every producer of box b; ready: bit b set = this CTA already passed it.
    -> (ok, ready | ok << b)."""
    ok = (ready >> b) & 1
    if ok == 0:
        ok = _wait_box(scratch, meta, b, pid, tag, hdr, timeout_ns)
    return ok, ready | (ok << b)


@triton.jit
def task_entry(table, i):
    """Task i of the table (8 int32 words: family, stage, a0 .. a4, pad)."""
    t = table + i * 8
    return (tl.load(t), tl.load(t + 1), tl.load(t + 2), tl.load(t + 3), tl.load(t + 4), tl.load(t + 5),
            tl.load(t + 6))


@triton.jit
def signal(scratch, meta, b, producer, tag, fault_site):
    box, words, nprod, site = box_at(scratch, meta, b)
    signal_box(box, tl.num_programs(0), words, producer, tag, site, fault_site, 128)


@triton.jit
def f32_at(scratch, meta, m):
    return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + tl.load(meta + m)


@triton.jit
def i32_at(scratch, meta, m):
    return scratch + tl.load(meta + m)


@triton.jit
def act_at(scratch, meta, m, ACT_F32: tl.constexpr):
    """A hand-off row region in the activation dtype (bf16; fp32 for diagnostics)."""
    if ACT_F32:
        return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + tl.load(meta + m)
    else:
        return scratch.to(tl.pointer_type(tl.bfloat16), bitcast=True) + tl.load(meta + m)


# ---------------------------------------------------------------------------- compute pieces
@triton.jit
def l2_prefetch_rows(W, n0, N, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """prefetch.global.L2 of the first 512 bytes of rows n0 .. n0 + BLOCK_N - 1 (< N) of W [N, K]: a task
    moves its first tile toward L2 before it waits, holding no registers across the wait (a register
    prefetch held 32-64 registers per thread across the wait and the loops; launches/tail.py)."""
    EPL: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth      # elements per 128-byte line
    _l2_prefetch(W, n0, N, K, BLOCK_N, 4, EPL)


@triton.jit(noinline=True)
def gateup_tile(wg, wu, sg, su, x, stride_x, out, stride_o, rows, i0, I: tl.constexpr, H: tl.constexpr, limit,
                ROWS_PAD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                NUM_STAGES: tl.constexpr):
    """out[r, i0 + j] = swiglu(x[r] . wg[i0 + j], x[r] . wu[i0 + j]): kernels/mlp.py gateup_prefetch +
    gateup_finish (the same loads, sums and bits) with the up tile's first chunk loaded after the gate
    GEMV instead of held in registers through it. A call: the tile loop around it keeps no hoisted
    index tensors of the two K loops live."""
    g = gemv_finish(gemv_prefetch(wg, i0, 0, H, I, H, BLOCK_I, PF_K), wg, sg, x, stride_x, rows, i0, 0, H, I, H,
                    ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)
    u = gemv_finish(gemv_prefetch(wu, i0, 0, H, I, H, BLOCK_I, PF_K), wu, su, x, stride_x, rows, i0, 0, H, I, H,
                    ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)
    gemv_store(out, stride_o, swiglu_clamped(g, u, limit), rows, i0, I, ROWS_PAD, BLOCK_I)


@triton.jit(noinline=True)
def gemv_tile(W, S, x, stride_x, n0, rows, width, tp_rank, tp_size, y, stride_y, xchg, tag, site, fault_site,
              N: tl.constexpr, K: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, XCHG: tl.constexpr):
    """One GEMV tile y[r, n0:n0 + BLOCK_N] = W[n0:] @ x[r] (x rows of stride_x, y fp32 rows of stride_y);
    XCHG and tp_size > 1: published to every rank's exchange slot instead (xchg_publish). A call, for
    the same reason as gateup_tile."""
    acc = gemv_finish(gemv_prefetch(W, n0, 0, K, N, K, BLOCK_N, PF_K), W, S, x, stride_x, rows, n0, 0, K, N, K,
                      ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
    if XCHG:
        if tp_size == 1:
            gemv_store(y, stride_y, acc, rows, n0, N, ROWS_PAD, BLOCK_N)
        else:
            xchg_publish(xchg, acc, n0, rows, width, tp_rank, tp_size, tag, site, fault_site, N, ROWS_PAD, BLOCK_N)
    else:
        gemv_store(y, stride_y, acc, rows, n0, N, ROWS_PAD, BLOCK_N)


@triton.jit
def post_cols(X, y, coef, X_out, rows, c0, c1, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """X_out[r, i, c] = post[i] y[r, c] + sum_j comb[j, i] X[r, j, c] for columns [c0, c1), rows < rows;
    post / comb from the coefficient rows coef [rows, 24] (hc_store_coef's layout)."""
    i4 = tl.arange(0, 4)
    r = 0
    while r < rows:
        post = tl.load(coef + r * 24 + 4 + i4, cache_modifier=".cg")
        comb = tl.load(coef + r * 24 + 8 + i4[:, None] * 4 + i4[None, :], cache_modifier=".cg")
        c = c0
        while c < c1:
            hc_post_tile(X + r * 4 * H, y + r * H, X_out + r * 4 * H, c, H, post, comb, BLOCK_N)
            c += BLOCK_N
        r += 1


@triton.jit
def add_cols(a, b, out, rows, c0, c1, H: tl.constexpr, BLOCK: tl.constexpr):
    """out[r, c] = a[r, c] + b[r, c] for columns [c0, c1), rows < rows (fp32 [rows, H]; b from other
    warps of this CTA or other CTAs: .cg). The NextN block's residual adds (no mHC there)."""
    r = 0
    while r < rows:
        c = c0
        while c < c1:
            offs = c + tl.arange(0, BLOCK)
            m = offs < c1
            v = tl.load(a + r * H + offs, mask=m, other=0.0, cache_modifier=".cg") + \
                tl.load(b + r * H + offs, mask=m, other=0.0, cache_modifier=".cg")
            tl.store(out + r * H + offs, v, mask=m)
            c += BLOCK
        r += 1


@triton.jit
def post_partials(fn2, X, y1, coef1, xmid, part2, rows, t0, nt, H: tl.constexpr, ROWS_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """hc_post of the mixer on column tiles t0 .. t0 + nt - 1 (X -> xmid) fused with the FFN hc_pre
    partials, one slot per BLOCK_N tile: the join order (tile order) does not depend on the grid."""
    j = 0
    while j < nt:
        c0 = (t0 + j) * BLOCK_N
        wf = hc_partial_prefetch(fn2, c0, c0 + BLOCK_N, H, BLOCK_C)
        hc_post_partial(wf, fn2, X, y1, H, coef1, 24, xmid, 4 * H, part2 + (t0 + j) * ROWS_PAD * SLOT_W, SLOT_W, rows,
                        c0, c0 + BLOCK_N, H, ROWS_PAD, BLOCK_C)
        j += 1


@triton.jit(noinline=True)
def _expert_pick(part_r, n_parts, width, bias, ids_rec, rw_rec, r, j, i0, scaling, E: tl.constexpr, K: tl.constexpr,
                 E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr):
    """The row's selection (router_select over the joined partials) -> expert id of rank j (int64); slot
    (r, 0, 0) also stores the record. A call: the [E_PAD] selection tensors stay out of the GEMVs."""
    ids, w = router_select(part_r + r * E, width * E, n_parts, bias, E, scaling, K, E_PAD, K_PAD, RENORM)
    kk = tl.arange(0, K_PAD)
    if (j == 0) & (i0 == 0):
        router_store_record(ids_rec + r * K, rw_rec + r * K, ids, w, K, K_PAD)
    e = tl.sum(tl.where(kk == j, ids, 0), axis=0)
    return tl.minimum(tl.maximum(e, 0), E - 1).to(tl.int64)


@triton.jit
def expert_slot(part_r, n_parts, width, bias, w_gu, s_gu, x, act_e, ids_rec, rw_rec, r, j, i0, limit, scaling,
                E: tl.constexpr, K: tl.constexpr, I: tl.constexpr, H: tl.constexpr, E_PAD: tl.constexpr,
                K_PAD: tl.constexpr, RENORM: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_I: tl.constexpr,
                BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Expert slot (row r, rank j, intermediate tile i0) after the router-partial wait: the slot joins
    the row's logit partials and selects itself (kernels/moe.py router_select: the same code and
    inputs in every slot, so every slot of the row gets the same bits), then streams the chosen
    expert's gate|up tile and stores the activation act_e[r, j, i0:]. Slot (r, 0, 0) also writes the
    row's record (ids, weights) that the down tasks read: no separate select stage, no extra hop."""
    e = _expert_pick(part_r, n_parts, width, bias, ids_rec, rw_rec, r, j, i0, scaling, E, K, E_PAD, K_PAD, RENORM)
    wg = w_gu + e * 2 * I * H
    wu = wg + I * H
    if w_gu.dtype.element_ty == tl.float8e4nv:
        nkb: tl.constexpr = (H + 127) // 128
        sg = s_gu + e * (2 * (I // 128) * nkb)
        su = sg + (I // 128) * nkb
    else:
        sg = wg
        su = wu
    gateup_tile(wg, wu, sg, su, x + r * H, 0, act_e + (r * K + j) * I, 0, 1, i0, I, H, limit, ROWS_PAD, BLOCK_I,
                BLOCK_K, PF_K, NUM_STAGES)


# ---------------------------------------------------------------------------- task families
@triton.jit(noinline=True)
def hc_pre_task(xs, fn1, tokens, embed_w, scratch, meta, rows, a0, a1, a2, tag, fault_site, H: tl.constexpr,
                ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, EMBED: tl.constexpr):
    """part: hc_pre partial slots of column tiles a0 .. a0 + a1 - 1 of the streams xs, producer a2 of
    hp1. EMBED: the task first gathers its columns of the embedding rows into xs (x0)."""
    part1 = f32_at(scratch, meta, M_PART1)
    j = 0
    while j < a1:
        c0 = (a0 + j) * BLOCK_N
        w0 = hc_partial_prefetch(fn1, c0, c0 + BLOCK_N, H, BLOCK_C)
        if EMBED:
            embed_gather(tokens, embed_w, xs, rows, c0, c0 + BLOCK_N, H, BLOCK_C)
            tl.debug_barrier()                 # own warps' x0 stores before the partial reads
        hc_partial_finish(w0, fn1, xs, 4 * H, part1 + (a0 + j) * ROWS_PAD * SLOT_W, SLOT_W, rows, c0, c0 + BLOCK_N,
                          H, ROWS_PAD, BLOCK_C)
        j += 1
    signal(scratch, meta, B_HP1, a2, tag, fault_site)


@triton.jit(noinline=True)
def gate_task(xs, base, scale, ln, scratch, meta, rows, a0, a1, rdy, pid, tag, hdr, timeout_ns, fault_site, eps,
              hc_eps, SECOND: tl.constexpr, H: tl.constexpr, ROWS_PAD: tl.constexpr, ITERS: tl.constexpr,
              GATE_BH: tl.constexpr, ACT_F32: tl.constexpr):
    """gate1 (SECOND False: waits hp1, writes coef1 / a_in) or gate2 (waits hp2, coef2 / a): columns
    [a0, a0 + GATE_BH) of every row's gate row from the streams xs, producer a1. -> (ok, rdy)."""
    if SECOND:
        ok, rdy = waitb(scratch, meta, B_HP2, rdy, pid, tag, hdr, timeout_ns)
        if ok != 0:
            gate_rows(xs, f32_at(scratch, meta, M_PART2), tl.load(meta + M_NPART2), base, scale, ln,
                      f32_at(scratch, meta, M_COEF2), act_at(scratch, meta, M_A, ACT_F32), rows, a0, a1 == 0, eps,
                      hc_eps, H, ROWS_PAD, ITERS, GATE_BH)
            signal(scratch, meta, B_A, a1, tag, fault_site)
    else:
        ok, rdy = waitb(scratch, meta, B_HP1, rdy, pid, tag, hdr, timeout_ns)
        if ok != 0:
            gate_rows(xs, f32_at(scratch, meta, M_PART1), tl.load(meta + M_NPART1), base, scale, ln,
                      f32_at(scratch, meta, M_COEF1), act_at(scratch, meta, M_AIN, ACT_F32), rows, a0, a1 == 0, eps,
                      hc_eps, H, ROWS_PAD, ITERS, GATE_BH)
            signal(scratch, meta, B_AIN, a1, tag, fault_site)
    return ok, rdy


@triton.jit
def _post_mixer(xs, fn2, scratch, meta, rows, a0, a1, a2, tag, fault_site, H: tl.constexpr, ROWS_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NEXTN: tl.constexpr):
    """After the mixer's output tiles a0 .. a0 + a1 - 1 (y1) are complete: hc_post (xs -> xmid) fused with
    the FFN hc_pre partials; NEXTN: xmid = x0 + y1 (xs is x0). Signals hp2 (producer a2)."""
    tl.debug_barrier()                         # own warps' y1 stores before hc_post reads them
    if NEXTN:
        add_cols(xs, f32_at(scratch, meta, M_Y1), f32_at(scratch, meta, M_XMID), rows, a0 * BLOCK_N,
                 tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
    else:
        post_partials(fn2, xs, f32_at(scratch, meta, M_Y1), f32_at(scratch, meta, M_COEF1),
                      f32_at(scratch, meta, M_XMID), f32_at(scratch, meta, M_PART2), rows, a0, a1, H, ROWS_PAD,
                      BLOCK_N, BLOCK_C)
    signal(scratch, meta, B_HP2, a2, tag, fault_site)


@triton.jit(noinline=True)
def oproj_task(W_o, S_o, xs, fn2, xo, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, rdy, pid, tag, hdr,
               timeout_ns, fault_site, H: tl.constexpr, D: tl.constexpr, ROWS_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
               BLOCK_C: tl.constexpr, ACT_F32: tl.constexpr, NEXTN: tl.constexpr):
    """o_proj tiles a0 .. a0 + a1 - 1 (K = D) after the o wait, producer a2. TP 1: y1, then the tile
    range's hc_post (_post_mixer). TP > 1: the partial tiles go to every rank's xo slot. -> (ok, rdy)."""
    l2_prefetch_rows(W_o, a0 * BLOCK_N, H, D, BLOCK_N)                  # weights before the wait
    ok, rdy = waitb(scratch, meta, B_O, rdy, pid, tag, hdr, timeout_ns)
    j = 0
    while (j < a1) & (ok != 0):
        gemv_tile(W_o, S_o, act_at(scratch, meta, M_ON, ACT_F32), D, (a0 + j) * BLOCK_N, rows, width, tp_rank,
                  tp_size, f32_at(scratch, meta, M_Y1), H, xo, tag, tl.load(meta + M_SITE_XO), fault_site, H, D,
                  ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, True)
        j += 1
    if (ok != 0) & (tp_size == 1):
        _post_mixer(xs, fn2, scratch, meta, rows, a0, a1, a2, tag, fault_site, H, ROWS_PAD, BLOCK_N, BLOCK_C, NEXTN)
    return ok, rdy


@triton.jit
def _rank_sum_tiles(xchg, y, a0, a1, rows, width, tp_rank, tp_size, tag, hdr, site, pid, timeout_ns,
                    H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tiles a0 .. a0 + a1 - 1 of y [rows, H] = every rank's partial from mailbox xchg, added in rank
    order (mixer_kda.xchg_sum), stopping at the first stalled tile. -> ok."""
    ok = 1
    j = 0
    while (j < a1) & (ok != 0):
        ok = xchg_sum(xchg, y, (a0 + j) * BLOCK_N, rows, width, tp_rank, tp_size, tag, hdr, site, pid, timeout_ns, H,
                      ROWS_PAD, BLOCK_N)
        j += 1
    return ok


@triton.jit(noinline=True)
def post1_task(xs, fn2, xo, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, pid, tag, hdr, timeout_ns,
               fault_site, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
               NEXTN: tl.constexpr):
    """o_sum (TP > 1): rank-order sum of the xo tiles a0 .. a0 + a1 - 1 -> y1, then as oproj_task. -> ok."""
    ok = _rank_sum_tiles(xo, f32_at(scratch, meta, M_Y1), a0, a1, rows, width, tp_rank, tp_size, tag, hdr,
                         tl.load(meta + M_SITE_XO), pid, timeout_ns, H, ROWS_PAD, BLOCK_N)
    if ok != 0:
        _post_mixer(xs, fn2, scratch, meta, rows, a0, a1, a2, tag, fault_site, H, ROWS_PAD, BLOCK_N, BLOCK_C, NEXTN)
    return ok


@triton.jit(noinline=True)
def gu_task(W_g, S_g, W_u, S_u, scratch, meta, rows, a0, a1, a2, rdy, pid, tag, hdr, timeout_ns, fault_site,
            swiglu_limit, H: tl.constexpr, I: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr):
    """gate|up tiles a0 .. a0 + a1 - 1 (dense MLP or shared expert) after the a wait -> h, producer a2.
    -> (ok, rdy)."""
    l2_prefetch_rows(W_g, a0 * BLOCK_N, I, H, BLOCK_N)                  # weights before the wait
    l2_prefetch_rows(W_u, a0 * BLOCK_N, I, H, BLOCK_N)
    ok, rdy = waitb(scratch, meta, B_A, rdy, pid, tag, hdr, timeout_ns)
    j = 0
    while (j < a1) & (ok != 0):
        gateup_tile(W_g, W_u, S_g, S_u, act_at(scratch, meta, M_A, ACT_F32), H, act_at(scratch, meta, M_H, ACT_F32), I,
                    rows, (a0 + j) * BLOCK_N, I, H, swiglu_limit, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
        j += 1
    if ok != 0:
        signal(scratch, meta, B_H, a2, tag, fault_site)
    return ok, rdy


@triton.jit
def _post_ffn(X_out, scratch, meta, rows, a0, a1, a2, tag, fault_site, H: tl.constexpr, BLOCK_N: tl.constexpr,
              NEXTN: tl.constexpr, B_Z: tl.constexpr):
    """After the FFN's output tiles a0 .. a0 + a1 - 1 (y2) are complete: hc_post of the FFN (xmid, y2 ->
    X_out); NEXTN: X_out [width, H] = xmid + y2 and signal box B_Z (producer a2)."""
    tl.debug_barrier()
    if NEXTN:
        add_cols(f32_at(scratch, meta, M_XMID), f32_at(scratch, meta, M_Y2), X_out, rows, a0 * BLOCK_N,
                 tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
        signal(scratch, meta, B_Z, a2, tag, fault_site)
    else:
        post_cols(f32_at(scratch, meta, M_XMID), f32_at(scratch, meta, M_Y2), f32_at(scratch, meta, M_COEF2), X_out,
                  rows, a0 * BLOCK_N, tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)


@triton.jit(noinline=True)
def down_task(W_d, S_d, X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, rdy, pid, tag, hdr,
              timeout_ns, fault_site, H: tl.constexpr, I: tl.constexpr, ROWS_PAD: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
              ACT_F32: tl.constexpr):
    """Dense down tiles a0 .. a0 + a1 - 1 after the h wait. TP 1: y2, then hc_post -> X_out. TP > 1: xd.
    -> (ok, rdy)."""
    l2_prefetch_rows(W_d, a0 * BLOCK_N, H, I, BLOCK_N)                  # weights before the wait
    ok, rdy = waitb(scratch, meta, B_H, rdy, pid, tag, hdr, timeout_ns)
    j = 0
    while (j < a1) & (ok != 0):
        gemv_tile(W_d, S_d, act_at(scratch, meta, M_H, ACT_F32), I, (a0 + j) * BLOCK_N, rows, width, tp_rank,
                  tp_size, f32_at(scratch, meta, M_Y2), H, xd, tag, tl.load(meta + M_SITE_XD), fault_site, H, I,
                  ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, True)
        j += 1
    if (ok != 0) & (tp_size == 1):
        _post_ffn(X_out, scratch, meta, rows, a0, a1, 0, tag, fault_site, H, BLOCK_N, False, 0)
    return ok, rdy


@triton.jit(noinline=True)
def post2_task(X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, pid, tag, hdr, timeout_ns,
               fault_site, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NEXTN: tl.constexpr,
               B_Z: tl.constexpr):
    """down_sum (TP > 1): rank-order sum of the xd tiles a0 .. a0 + a1 - 1 -> y2, then _post_ffn. -> ok."""
    ok = _rank_sum_tiles(xd, f32_at(scratch, meta, M_Y2), a0, a1, rows, width, tp_rank, tp_size, tag, hdr,
                         tl.load(meta + M_SITE_XD), pid, timeout_ns, H, ROWS_PAD, BLOCK_N)
    if ok != 0:
        _post_ffn(X_out, scratch, meta, rows, a0, a1, a2, tag, fault_site, H, BLOCK_N, NEXTN, B_Z)
    return ok


@triton.jit(noinline=True)
def peer_task(xchg, peer, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, tag, fault_site,
              SITE: tl.constexpr, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Loopback (one GPU, TP > 1): rank a0's partial tiles a1 .. a1 + a2 - 1 from peer into xchg."""
    j = 0
    while j < a2:
        peer_publish(xchg, peer, a0, (a1 + j) * BLOCK_N, rows, width, tp_rank, tp_size, tag, tl.load(meta + SITE),
                     fault_site, H, ROWS_PAD, BLOCK_N)
        j += 1


@triton.jit(noinline=True)
def router_task(W_r, scratch, meta, rows, width, a0, a1, a2, a3, a4, rdy, pid, tag, hdr, timeout_ns, fault_site,
                E: tl.constexpr, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RCK: tl.constexpr,
                NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr):
    """Router logit partial: experts [a0, a0 + BLOCK_E), K range [a1, a2), K part a4, producer a3 of rl.
    -> (ok, rdy)."""
    w0 = router_prefetch(W_r, a0, a1, a2, E, H, BLOCK_E, RCK)
    ok, rdy = waitb(scratch, meta, B_A, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        lg = router_finish(w0, W_r, act_at(scratch, meta, M_A, ACT_F32), H, rows, a0, a1, a2, E, H, ROWS_PAD,
                           BLOCK_E, RCK, NUM_STAGES)
        router_store_partial(f32_at(scratch, meta, M_PART_R) + a4 * width * E, lg, rows, a0, E, ROWS_PAD, BLOCK_E)
        signal(scratch, meta, B_RL, a3, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def expert_task(bias_r, w_gu, s_gu, scratch, meta, rows, width, a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns,
                fault_site, swiglu_limit, scaling, E: tl.constexpr, KE: tl.constexpr, I_E: tl.constexpr,
                H: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
                ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr):
    """Expert slot (row a0, rank a1, tile a2) after the rl wait, producer a3 of xe. -> (ok, rdy)."""
    ok, rdy = waitb(scratch, meta, B_RL, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        if a0 < rows:
            expert_slot(f32_at(scratch, meta, M_PART_R), tl.load(meta + M_NRPART), width, bias_r, w_gu, s_gu,
                        act_at(scratch, meta, M_A, ACT_F32), act_at(scratch, meta, M_ACTE, ACT_F32),
                        i32_at(scratch, meta, M_IDS), f32_at(scratch, meta, M_RW), a0, a1, a2 * BLOCK_N, swiglu_limit,
                        scaling, E, KE, I_E, H, E_PAD, K_PAD, RENORM, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
        signal(scratch, meta, B_XE, a3, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _moe_down_row(W_d, S_d, w_de, s_de, xd, scratch, meta, rr, n0, width, tp_rank, tp_size, tag, fault_site,
                  E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, I_E: tl.constexpr, KE: tl.constexpr,
                  ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr):
    """Row rr's MoE output columns [n0, n0 + BLOCK_N): y2 (TP 1) or this rank's xd slot (TP > 1)."""
    d0 = moe_down_prefetch(W_d, n0, H, I, BLOCK_N, PF_K)
    acc = moe_down_finish(d0, W_d, S_d, act_at(scratch, meta, M_H, ACT_F32) + rr * I,
                          i32_at(scratch, meta, M_IDS) + rr * KE, f32_at(scratch, meta, M_RW) + rr * KE,
                          act_at(scratch, meta, M_ACTE, ACT_F32) + rr * KE * I_E, w_de, s_de, n0, E, H, I_E, I,
                          ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, KE)
    if tp_size == 1:
        gemv_store(f32_at(scratch, meta, M_Y2) + rr * H, 0, acc, 1, n0, H, ROWS_PAD, BLOCK_N)
    else:
        xchg_publish(xd + rr * H, acc, n0, 1, width, tp_rank, tp_size, tag, tl.load(meta + M_SITE_XD), fault_site, H,
                     ROWS_PAD, BLOCK_N)


@triton.jit(noinline=True)
def moe_down_task(W_d, S_d, w_de, s_de, X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, rdy,
                  pid, tag, hdr, timeout_ns, fault_site, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                  I_E: tl.constexpr, KE: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr,
                  NEXTN: tl.constexpr, B_Z: tl.constexpr):
    """MoE down tiles a0 .. a0 + a1 - 1, row by row (routed experts in rank order, then the shared
    expert), after the h and xe waits. TP 1: y2, then _post_ffn (producer a2). TP > 1: xd. -> (ok, rdy)."""
    l2_prefetch_rows(W_d, a0 * BLOCK_N, H, I, BLOCK_N)                  # shared expert's weights
    ok, rdy = waitb(scratch, meta, B_H, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        ok, rdy = waitb(scratch, meta, B_XE, rdy, pid, tag, hdr, timeout_ns)
    j = 0
    while (j < a1) & (ok != 0):
        n0 = (a0 + j) * BLOCK_N
        rr = 0
        while rr < rows:
            _moe_down_row(W_d, S_d, w_de, s_de, xd, scratch, meta, rr, n0, width, tp_rank, tp_size, tag, fault_site, E,
                          H, I, I_E, KE, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, ACT_F32)
            rr += 1
        j += 1
    if (ok != 0) & (tp_size == 1):
        _post_ffn(X_out, scratch, meta, rows, a0, a1, a2, tag, fault_site, H, BLOCK_N, NEXTN, B_Z)
    return ok, rdy
