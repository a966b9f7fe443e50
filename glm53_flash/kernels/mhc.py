"""mHC task family (hyper-connections around every sub-layer) as `@triton.jit` device functions:
hc_pre split into column-tile partials and a tiny redundant finish, the gate row by column tiles, and
the hc_post stream mix, alone or fused with the next hc_pre's partials.

Why this split (DESIGN.md §5, §8: hops, not bytes, decide the step):
- hc_pre needs a 24 x 4H fp32 GEMV over the flattened streams (1.5 MB of `hc_fn` at H=4096) and
  the RMS of the same 4H row. A partial task owns a column tile [c0, c1) of all 4 streams (flat
  indices j*H + c) and reduces it to 40 numbers per row in its own scratch slot: the 24 GEMV sums
  and the 4x4 Gram matrix G[j, j'] = sum_c X[j, c] X[j', c]. Consumers join the slots in a fixed
  order (chunks of JOIN_CHUNK slots, each summed as a tree, chunks in task order: every CTA gets the
  same bits, on any grid) and run the 4x4 Sinkhorn themselves
  (`hc_coeffs`): a few hundred flops instead of another hop.
- The Gram matrix gives both norms for free: the flat row's sum of squares is trace(G), and the
  collapsed row x_in = sum_j pre[j] X[j] has sum of squares pre^T G pre. So the gate row
  a = RMSNorm(x_in) * w needs no row-wide pass: `hc_gate_tile` writes any column tile in one pass,
  and many CTAs can share a row.
- The partial's tile is the same column tile as hc_post's, so the task that forms X' for columns
  [c0, c1) (`hc_post_partial`) reduces them for the next hc_pre while they are in registers: the
  next mHC needs no extra stage (o_proj -> hc_post + partials -> gate row -> next GEMV).

Numerics: fp32 throughout, as the reference (reference/ops.py hc_coeffs / hc_pre / hc_post). The
reference normalises the flat row before the GEMV; we scale the raw sums by the same 1/rms after
(equal up to rounding). pre^T G pre equals sum_c x_in[c]^2 up to rounding; it loses relative
accuracy only where the weighted streams cancel (|x_in| << sum_j pre[j] |X[j]|), unlikely with pre > 0
and streams that start as copies of one row; the tests check it against the direct sum. Every sum
runs in a fixed order and a row never reads another row's data: bitwise reproducible and batch
invariant.

Registers (sm_90, Triton 3.6's bundled ptxas, compiled offline without a GPU: tests/test_kernels_kda.py
test_offline_sm90_registers; 4 warps, H = 4096, no spills): hc_partial 117 and hc_post_partial 116 at
BLOCK_C=32 (72 / 96 at BLOCK_C=16, 77 / 100 at BLOCK_C=32 and 8 warps): they hold two [32, 4 * BLOCK_C]
fn tiles (the next one loads while the current one is used); the finish (hc_coeffs + a 512-column gate
tile) 32; hc_post_tile (512 columns) 48.

Layouts (fp32 unless noted; rows of X contiguous [4, H], row stride given by the caller):
  hc_fn  [24, 4H]  rows 0-3 pre, 4-7 post, 8-23 comb (comb[j, i] at 8 + 4j + i); column j*H + c
  part   [tasks, rows_max, HC_SLOT]: words 0-23 the GEMV partial sums, 24-39 G (24 + 4j + j')
  coef   [rows, 24]  pre 0-3, post 4-7, comb 8-23 (hc_store_coef; what hc_post_partial reads)
  base [24], scale [3]; norm weight [H] (bf16 or fp32); y, the sub-layer output [rows, H] (bf16/fp32)

Device API (constexprs in CAPS; tiles are column ranges [c0, c1) of all 4 streams):
  w0 = hc_partial_prefetch(fn_ptr, c0, c1, H, BLOCK_C)                # before waiting on X
  hc_partial_finish(w0, fn_ptr, x_ptr, stride_x, part_ptr, stride_p, rows, c0, c1, H, ROWS_PAD, BLOCK_C)
  hc_post_partial(w0, fn_ptr, x_ptr, y_ptr, stride_y, coef_ptr, stride_c, out_ptr, stride_x, part_ptr,
                  stride_p, rows, c0, c1, H, ROWS_PAD, BLOCK_C)      # X' = hc_post(X), next partials
  pre, post, comb, rstd = hc_coeffs(part_ptr, stride_task, n_parts, base_ptr, scale_ptr, H, eps, hc_eps, ITERS)
  hc_gate_tile(x_ptr, pre, rstd, w_ptr, out_ptr, out32_ptr, c0, H, BLOCK_H, WRITE_F32)
  hc_store_coef(coef_ptr, pre, post, comb)
  hc_post_tile(x_ptr, y_ptr, out_ptr, c0, H, post, comb, BLOCK_H)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from sync.asm import in_interpreter

HC_SLOT = 40      # fp32 words per (task, row) partial: 24 GEMV sums + the 4x4 Gram matrix
JOIN_CHUNK = tl.constexpr(64)   # partial slots hc_coeffs loads per round (64 column tiles at H 4096: one)
_SLOT = tl.constexpr(HC_SLOT)   # the same, visible inside @triton.jit code


# ---------------------------------------------------------------------------- partials
@triton.jit
def _fn_cols(fn_ptr, c, c1, H, BLOCK_C: tl.constexpr):
    """hc_fn[n, j*H + c + t] for n < 32 (>= 24 read as 0) at tile column m = j * BLOCK_C + t (j < 4, t < BLOCK_C;
    c + t >= c1 read as 0): [32, 4 * BLOCK_C] fp32. Two-dimensional on purpose: a [32, 4, BLOCK_C] tile
    made the compiler convert the whole product between layouts (through shared memory)."""
    n = tl.arange(0, 32)
    m = tl.arange(0, 4 * BLOCK_C)
    cc = c + m % BLOCK_C
    col = (m // BLOCK_C) * H + cc
    return tl.load(fn_ptr + n[:, None] * (4 * H) + col[None, :], mask=(n[:, None] < 24) & (cc[None, :] < c1),
                   other=0.0, eviction_policy="evict_first")


@triton.jit
def _mul_rn(a, b):
    """a * b rounded on its own (mul.rn.f32: never fused into an FMA with a later add)."""
    if in_interpreter():
        return a * b
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _accumulate(accm, accg, r, w, X, ROWS_PAD: tl.constexpr):
    """Row r's sums of one chunk: accm[r] += fn . X ([32]), accg[r] += X X^T ([4, 4]). X [4, BLOCK_C].

    The Gram products are rounded before the sum (_mul_rn): in G's layout each lane holds one product of the
    reduced axis, and ptxas fused the first butterfly step into an FMA (x_l y_l + the partner's rounded
    product), so lanes l and l ^ 16 ended with sums rounded differently; the 32 lanes then stored G to the
    same shared address in one instruction (its layout change), and which lane's value landed is undefined:
    G's last bits could change run to run (compute-sanitizer racecheck's write-after-write in hc_pre_task and
    hc_post_partial; found offline in the sm_90 SASS). Rounded products make the butterfly symmetric: every
    lane holds the same bits. The fn . X sums have several products per thread and a plain first step."""
    offs_r = tl.arange(0, ROWS_PAD)
    xf = tl.reshape(X, [X.shape[0] * X.shape[1]])                          # [4 * BLOCK_C], m = j * BLOCK_C + t
    mix = tl.sum(w * xf[None, :], axis=1)                                  # [32]
    G = tl.sum(_mul_rn(X[:, None, :], X[None, :, :]), axis=2)              # [4, 4]
    accm = tl.where(offs_r[:, None] == r, accm + mix[None, :], accm)
    accg = tl.where(offs_r[:, None, None] == r, accg + G[None, :, :], accg)
    return accm, accg


@triton.jit
def _store_slot(part_ptr, stride_p, accm, accg, rows, ROWS_PAD: tl.constexpr):
    offs_r = tl.arange(0, ROWS_PAD)
    n = tl.arange(0, 32)
    i4 = tl.arange(0, 4)
    tl.store(part_ptr + offs_r[:, None] * stride_p + n[None, :], accm,
             mask=(offs_r[:, None] < rows) & (n[None, :] < 24))
    gofs = 24 + i4[:, None] * 4 + i4[None, :]
    tl.store(part_ptr + offs_r[:, None, None] * stride_p + gofs[None, :, :], accg,
             mask=(offs_r[:, None, None] < rows) & (gofs[None, :, :] >= 0))


@triton.jit
def hc_partial_prefetch(fn_ptr, c0, c1, H, BLOCK_C: tl.constexpr):
    """First fn chunk of the tile: columns [c0, c0 + BLOCK_C) of every stream, [32, 4 * BLOCK_C] fp32.
    fn_ptr: hc_fn [24, 4H] fp32 row-major. Depends on no activation: issue it before the wait."""
    return _fn_cols(fn_ptr, c0, c1, H, BLOCK_C)


@triton.jit
def _x_cols(x_ptr, stride_x, r, c, c1, H, BLOCK_C: tl.constexpr):
    """X[r, j, c + t] of the 4 streams, [4, BLOCK_C] (0 for c + t >= c1). .cg: X may come from another CTA of the
    same launch; never a stale L1 line."""
    j = tl.arange(0, 4)
    cc = c + tl.arange(0, BLOCK_C)
    return tl.load(x_ptr + r * stride_x + j[:, None] * H + cc[None, :], mask=cc[None, :] < c1, other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _next_step(r, c, rows, BLOCK_C: tl.constexpr):
    """The (row, chunk start) after step (r, c) of a tile's (chunk, row) walk: rows of a chunk, then the next chunk."""
    rn = r + 1
    cn = c
    if rn == rows:
        rn = 0
        cn = c + BLOCK_C
    return rn, cn


@triton.jit
def hc_partial_finish(w0, fn_ptr, x_ptr, stride_x, part_ptr, stride_p, rows, c0, c1, H,
                      ROWS_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    """Partial hc_pre sums of columns [c0, c1) of the 4 streams for rows 0..rows-1, into this task's slot.

    x_ptr: streams X [rows, 4, H] fp32 (row stride stride_x). part_ptr: this task's slot [rows, HC_SLOT]
    (row stride stride_p): words 0-23 sum_{j, c} fn[n, j*H + c] X[j, c], words 24-39 G[j, j'].
    1 <= rows <= ROWS_PAD. Chunks add in column order, each row on its own (its bits do not depend on
    `rows`); each step's inputs load during the step before (below).
    """
    accm = tl.zeros([ROWS_PAD, 32], dtype=tl.float32)
    accg = tl.zeros([ROWS_PAD, 4, 4], dtype=tl.float32)
    # one (chunk, row) step after another, each step's X loaded during the step before (its sums), so the X
    # round trips overlap instead of one per step after the previous step's sums (2 x rows of them per tile,
    # on the launch's first task); the fn chunk likewise, at its chunk's first row. Same sums in the same order.
    w = w0
    w_next = w0
    c = c0
    r = 0
    X = _x_cols(x_ptr, stride_x, 0, c, c1, H, BLOCK_C)
    while c < c1:
        if r == 0:
            w_next = _fn_cols(fn_ptr, c + BLOCK_C, c1, H, BLOCK_C)    # all-masked past c1: touches nothing
        rn, cn = _next_step(r, c, rows, BLOCK_C)
        X_next = _x_cols(x_ptr, stride_x, rn, cn, c1, H, BLOCK_C)   # all-masked past c1
        accm, accg = _accumulate(accm, accg, r, w, X, ROWS_PAD)
        X = X_next
        if rn == 0:
            w = w_next
        r = rn
        c = cn
    _store_slot(part_ptr, stride_p, accm, accg, rows, ROWS_PAD)


# ---------------------------------------------------------------------------- finish
@triton.jit
def hc_coeffs(part_ptr, stride_task, n_parts, base_ptr, scale_ptr, H, eps, hc_eps, ITERS: tl.constexpr):
    """Join the n_parts slots of one row (fixed order, see above); derive the mHC coefficients and the
    gate-row rstd.

    part_ptr: task 0's slot for this row; task t's at part_ptr + t * stride_task. eps = rms_norm_eps,
    hc_eps = cfg.hc_eps, ITERS = Sinkhorn iterations (20). Returns pre [4], post [4], comb [4, 4]
    (comb[j, i]: weight of stream j in output stream i), ordered as reference/ops.py hc_coeffs (sigmoid
    + eps, 2 * sigmoid, row softmax + eps, one column normalisation then ITERS - 1 (rows, columns)
    rounds, eps in every denominator), and rstd = 1 / sqrt(mean(x_in^2) + eps) of the collapsed row from
    pre^T G pre. Cheap enough to run redundantly in every CTA that needs it. The three steps
    (hc_weights, hc_join, hc_derive) are separate so a caller can trace between them.
    """
    w = hc_weights(base_ptr, scale_ptr)
    j = hc_join(part_ptr, stride_task, n_parts)
    return hc_derive(w, j, H, eps, hc_eps, ITERS)


@triton.jit
def hc_weights(base_ptr, scale_ptr):
    """(scale [3] as scalars, base pre [4], post [4], comb [4, 4]): loaded before the join, so their round
    trip overlaps the join's (no CTA barrier in between to stop that)."""
    i4 = tl.arange(0, 4)
    ij = i4[:, None] * 4 + i4[None, :]
    return (tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2), tl.load(base_ptr + i4),
            tl.load(base_ptr + 4 + i4), tl.load(base_ptr + 8 + ij))


@triton.jit
def hc_join(part_ptr, stride_task, n_parts):
    """The joined slots of one row: (pre sums [4], post sums [4], comb sums [4, 4], G [4, 4])."""
    i4 = tl.arange(0, 4)
    ij = i4[:, None] * 4 + i4[None, :]
    pre_s = tl.zeros([4], dtype=tl.float32)
    post_s = tl.zeros([4], dtype=tl.float32)
    comb_s = tl.zeros([4, 4], dtype=tl.float32)
    G = tl.zeros([4, 4], dtype=tl.float32)
    # JOIN_CHUNK slots per load round instead of one (64 dependent L2 round trips at H 4096). A chunk sums
    # as a tree, chunks in task order
    tc = tl.arange(0, JOIN_CHUNK)
    t = 0
    while t < n_parts:
        # the chunk's four loads go out together, then the four sums: a sum's CTA barrier between them
        # made each load wait for the previous one's round trip
        m = (t + tc) < n_parts
        p = part_ptr + (t + tc).to(tl.int64) * stride_task
        v_pre = tl.load(p[:, None] + i4[None, :], mask=m[:, None], other=0.0, cache_modifier=".cg")
        v_post = tl.load(p[:, None] + 4 + i4[None, :], mask=m[:, None], other=0.0, cache_modifier=".cg")
        m3 = m[:, None, None]
        v_comb = tl.load(p[:, None, None] + 8 + ij[None, :, :], mask=m3, other=0.0, cache_modifier=".cg")
        v_g = tl.load(p[:, None, None] + 24 + ij[None, :, :], mask=m3, other=0.0, cache_modifier=".cg")
        pre_s += tl.sum(v_pre, axis=0)
        post_s += tl.sum(v_post, axis=0)
        comb_s += tl.sum(v_comb, axis=0)
        G += tl.sum(v_g, axis=0)
        t += JOIN_CHUNK
    return pre_s, post_s, comb_s, G


@triton.jit
def _hc_pre(w, j, H, eps, hc_eps):
    """(pre, inv) from hc_weights' w and hc_join's j: inv = 1 / rms of the flat 4H row (from trace(G))."""
    s0, s1, s2, b_pre, b_post, b_comb = w
    pre_s, post_s, comb_s, G = j
    i4 = tl.arange(0, 4)
    ss = tl.sum(tl.sum(tl.where(i4[:, None] == i4[None, :], G, 0.0), axis=1), axis=0)   # trace(G)
    inv = 1.0 / tl.sqrt(ss / (4 * H) + eps)
    return tl.sigmoid(pre_s * inv * s0 + b_pre) + hc_eps, inv


@triton.jit
def _hc_rstd(pre, G, H, eps):
    """rstd of the collapsed row x_in = sum_j pre[j] X[j]: its sum of squares is pre^T G pre."""
    ss_in = tl.sum(tl.sum(pre[:, None] * G * pre[None, :], axis=1), axis=0)
    return 1.0 / tl.sqrt(ss_in / H + eps)


@triton.jit
def hc_pre_rstd(w, j, H, eps, hc_eps):
    """(pre, rstd) alone, as hc_derive computes them: all the gate row needs (no Sinkhorn)."""
    pre_s, post_s, comb_s, G = j
    pre, inv = _hc_pre(w, j, H, eps, hc_eps)
    return pre, _hc_rstd(pre, G, H, eps)


@triton.jit
def hc_derive(w, j, H, eps, hc_eps, ITERS: tl.constexpr):
    """(pre, post, comb, rstd) from hc_weights' w and hc_join's j (hc_coeffs)."""
    s0, s1, s2, b_pre, b_post, b_comb = w
    pre_s, post_s, comb_s, G = j
    pre, inv = _hc_pre(w, j, H, eps, hc_eps)
    post = 2.0 * tl.sigmoid(post_s * inv * s1 + b_post)
    logits = comb_s * inv * s2 + b_comb                                        # [4, 4]
    comb = _sinkhorn(logits, hc_eps, ITERS)
    return pre, post, comb, _hc_rstd(pre, G, H, eps)


@triton.jit
def _split4(t):
    """[4] -> its 4 entries as scalars, in index order. tl.split keeps each pair in one thread, so the
    entries end up in every thread: arithmetic on them needs no reduction and no CTA barrier."""
    a, b = tl.split(tl.reshape(t, [2, 2]))          # a = t[0::2], b = t[1::2]
    a0, a1 = tl.split(a)
    b0, b1 = tl.split(b)
    return a0, b0, a1, b1


@triton.jit
def _join4(t0, t1, t2, t3):
    """_split4 inverse: 4 scalars -> [4]."""
    return tl.reshape(tl.join(tl.join(t0, t2), tl.join(t1, t3)), [4])


@triton.jit
def _rcp(d):
    """1 / d by one MUFU.RCP (rcp.approx.ftz, ~1 ulp): one per denominator, then products. With IEEE a / d
    per entry (an RCP, dependent FMAs and a slow-path check each) or div.full (range fix-ups around the
    RCP) the Sinkhorn's 20 rounds sat on one long dependent chain: 7 of the gate task's ~13 us of own time
    (trace marks, H200, kda TP8, 1230e01). Sums are d > 0 (exp + eps)."""
    if in_interpreter():
        return 1.0 / d
    else:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [d], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _rownorm(a, b, c, d, hc_eps):
    """One Sinkhorn normalisation of 4 entries: each times 1 / (their sum + eps); the sum as a tree (two
    dependent adds, not three)."""
    r = _rcp((a + b) + (c + d) + hc_eps)
    return a * r, b * r, c * r, d * r


@triton.jit
def _softmax4(a, b, c, d, hc_eps):
    """softmax of 4 scalars, + eps each (the reference's row softmax + eps)."""
    m = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - m), tl.exp(b - m), tl.exp(c - m), tl.exp(d - m)
    r = _rcp((a + b) + (c + d))
    return a * r + hc_eps, b * r + hc_eps, c * r + hc_eps, d * r + hc_eps


@triton.jit
def _sinkhorn(logits, hc_eps, ITERS: tl.constexpr):
    """comb [4, 4] from the logits, ordered exactly as reference/ops.py hc_coeffs: row softmax + eps, one
    column normalisation, then ITERS - 1 (rows, columns) rounds, eps in every denominator.

    On 16 scalars held by every thread (_split4 of the rows): as [4, 4] tensors each of the ~40 row / column
    sums was a CTA-wide reduction behind shared-memory barriers, ~3 us of the gate task's critical path
    (sm_90 SASS: 4 BAR.SYNC per round). The reference's steps; each normalisation multiplies by one
    approximate reciprocal of its sum (_rcp) instead of dividing every entry, and sums as a tree, so the
    bits differ from the reference's in the last places (tests/test_kernels_mhc.py compares the
    coefficients within 1e-5)."""
    i4 = tl.arange(0, 4)
    e, o = tl.split(tl.reshape(logits, [8, 2]))             # row-major entries 0::2 and 1::2
    ee, eo = tl.split(tl.reshape(e, [4, 2]))                # entries 0::4, 2::4
    oe, oo = tl.split(tl.reshape(o, [4, 2]))                # entries 1::4, 3::4
    c00, c10, c20, c30 = _split4(ee)
    c02, c12, c22, c32 = _split4(eo)
    c01, c11, c21, c31 = _split4(oe)
    c03, c13, c23, c33 = _split4(oo)
    # row softmax + eps
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, hc_eps)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, hc_eps)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, hc_eps)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, hc_eps)
    # columns
    c00, c10, c20, c30 = _rownorm(c00, c10, c20, c30, hc_eps)
    c01, c11, c21, c31 = _rownorm(c01, c11, c21, c31, hc_eps)
    c02, c12, c22, c32 = _rownorm(c02, c12, c22, c32, hc_eps)
    c03, c13, c23, c33 = _rownorm(c03, c13, c23, c33, hc_eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _rownorm(c00, c01, c02, c03, hc_eps)       # rows
        c10, c11, c12, c13 = _rownorm(c10, c11, c12, c13, hc_eps)
        c20, c21, c22, c23 = _rownorm(c20, c21, c22, c23, hc_eps)
        c30, c31, c32, c33 = _rownorm(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _rownorm(c00, c10, c20, c30, hc_eps)       # columns
        c01, c11, c21, c31 = _rownorm(c01, c11, c21, c31, hc_eps)
        c02, c12, c22, c32 = _rownorm(c02, c12, c22, c32, hc_eps)
        c03, c13, c23, c33 = _rownorm(c03, c13, c23, c33, hc_eps)
    r0 = _join4(c00, c01, c02, c03)
    r1 = _join4(c10, c11, c12, c13)
    r2 = _join4(c20, c21, c22, c23)
    r3 = _join4(c30, c31, c32, c33)
    return tl.where(i4[:, None] == 0, r0[None, :], tl.where(i4[:, None] == 1, r1[None, :],
                    tl.where(i4[:, None] == 2, r2[None, :], r3[None, :])))


@triton.jit
def hc_gate_tile(x_ptr, pre, rstd, w_ptr, out_ptr, out32_ptr, c0, H, BLOCK_H: tl.constexpr,
                 WRITE_F32: tl.constexpr):
    """Gate row tile: a[c] = (sum_j pre[j] X[j, c]) * rstd * w[c] for c in [c0, c0 + BLOCK_H) (< H).

    x_ptr: this row's streams [4, H] fp32; pre, rstd from hc_coeffs; w_ptr: norm weight [H]. out_ptr: the
    row [H] in its dtype (bf16 for the hand-off); out32_ptr: fp32 copy, written only if WRITE_F32."""
    i4 = tl.arange(0, 4)
    offs = c0 + tl.arange(0, BLOCK_H)
    m = offs < H
    X = tl.load(x_ptr + i4[:, None] * H + offs[None, :], mask=m[None, :], other=0.0, cache_modifier=".cg")
    a = tl.sum(pre[:, None] * X, axis=0) * rstd * tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, a.to(out_ptr.dtype.element_ty), mask=m)
    if WRITE_F32:
        tl.store(out32_ptr + offs, a, mask=m)


@triton.jit
def hc_store_coef(coef_ptr, pre, post, comb):
    """coef row [24]: pre 0-3, post 4-7, comb 8-23 (what hc_post_partial reads)."""
    i4 = tl.arange(0, 4)
    tl.store(coef_ptr + i4, pre)
    tl.store(coef_ptr + 4 + i4, post)
    tl.store(coef_ptr + 8 + i4[:, None] * 4 + i4[None, :], comb)


# ---------------------------------------------------------------------------- hc_post
@triton.jit
def _post_mix(X, y, post, comb):
    """X'[i] = sum_j comb[j, i] X[j] (j = 0..3 in order) + post[i] y. X [4, B], y [B] -> [4, B]."""
    i4 = tl.arange(0, 4)
    acc = tl.zeros(X.shape, dtype=tl.float32)
    for j in tl.static_range(4):
        cj = tl.sum(tl.where(i4[:, None] == j, comb, 0.0), axis=0)                 # comb[j, :] as [4]
        xj = tl.sum(tl.where(i4[:, None] == j, X, 0.0), axis=0)                    # X[j] as [B]
        acc += cj[:, None] * xj[None, :]
    return acc + post[:, None] * y[None, :]


@triton.jit
def hc_post_tile(x_ptr, y_ptr, out_ptr, c0, H, post, comb, BLOCK_H: tl.constexpr):
    """X'[i, c] = post[i] * y[c] + sum_j comb[j, i] * X[j, c] for columns c0 .. c0 + BLOCK_H - 1 (< H).

    x_ptr / out_ptr: this row's streams [4, H] fp32 before / after (a separate buffer: other CTAs may
    still read X); y_ptr: the sub-layer output row [H] (bf16/fp32); post [4], comb [4, 4] from hc_coeffs."""
    i4 = tl.arange(0, 4)
    offs = c0 + tl.arange(0, BLOCK_H)
    m = offs < H
    X = tl.load(x_ptr + i4[:, None] * H + offs[None, :], mask=m[None, :], other=0.0, cache_modifier=".cg")
    y = tl.load(y_ptr + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + i4[:, None] * H + offs[None, :], _post_mix(X, y, post, comb), mask=m[None, :])


@triton.jit
def hc_post_partial(w0, fn_ptr, x_ptr, y_ptr, stride_y, coef_ptr, stride_c, out_ptr, stride_x, part_ptr, stride_p,
                    rows, c0, c1, H, ROWS_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    """hc_post on columns [c0, c1) of every row, fused with the next hc_pre's partial of the same tile.

    x_ptr / out_ptr: X / X' [rows, 4, H] fp32 (row stride stride_x); y_ptr: sub-layer output [rows, H]
    (row stride stride_y); coef_ptr: this sub-layer's coefficients [rows, 24] (row stride stride_c,
    hc_store_coef's layout). w0 / fn_ptr: the NEXT hc_pre's fn (hc_partial_prefetch of this tile).
    part_ptr: this task's slot for the next hc_pre, as hc_partial_finish writes it. Same operations as
    hc_post_tile then hc_partial_finish on X' (same bits under the interpreter). (chunk, row) steps pipelined as
    in hc_partial_finish: each step's X, y and coefficients load during the step before."""
    i = tl.arange(0, BLOCK_C)
    accm = tl.zeros([ROWS_PAD, 32], dtype=tl.float32)
    accg = tl.zeros([ROWS_PAD, 4, 4], dtype=tl.float32)
    w = w0
    w_next = w0
    c = c0
    r = 0
    X, y, post, comb = _post_in(x_ptr, y_ptr, coef_ptr, stride_x, stride_y, stride_c, 0, c, c1, H, BLOCK_C)
    while c < c1:
        if r == 0:
            w_next = _fn_cols(fn_ptr, c + BLOCK_C, c1, H, BLOCK_C)
        rn, cn = _next_step(r, c, rows, BLOCK_C)
        Xq, yq, pq, cq = _post_in(x_ptr, y_ptr, coef_ptr, stride_x, stride_y, stride_c, rn, cn, c1, H, BLOCK_C)
        Xn = _post_mix(X, y, post, comb)                                      # [4, BLOCK_C]; 0 past c1
        cc = c + i
        tl.store(out_ptr + r * stride_x + tl.arange(0, 4)[:, None] * H + cc[None, :], Xn, mask=(cc < c1)[None, :])
        accm, accg = _accumulate(accm, accg, r, w, Xn, ROWS_PAD)
        X, y, post, comb = Xq, yq, pq, cq
        if rn == 0:
            w = w_next
        r = rn
        c = cn
    _store_slot(part_ptr, stride_p, accm, accg, rows, ROWS_PAD)


@triton.jit
def _post_in(x_ptr, y_ptr, coef_ptr, stride_x, stride_y, stride_c, r, c, c1, H, BLOCK_C: tl.constexpr):
    """One hc_post_partial step's inputs, row r, columns [c, c + BLOCK_C) (0 past c1): X [4, BLOCK_C], y [BLOCK_C]
    (fp32), post [4], comb [4, 4]. .cg: all of them come from other CTAs of the launch."""
    j = tl.arange(0, 4)
    cc = c + tl.arange(0, BLOCK_C)
    X = _x_cols(x_ptr, stride_x, r, c, c1, H, BLOCK_C)
    y = tl.load(y_ptr + r * stride_y + cc, mask=cc < c1, other=0.0, cache_modifier=".cg").to(tl.float32)
    post = tl.load(coef_ptr + r * stride_c + 4 + j, cache_modifier=".cg")
    comb = tl.load(coef_ptr + r * stride_c + 8 + j[:, None] * 4 + j[None, :], cache_modifier=".cg")
    return X, y, post, comb


# ---------------------------------------------------------------------------- test kernels
@triton.jit(do_not_specialize=["rows", "chunk"])
def hc_partial_kernel(X, fn, part, rows, chunk, H, ROWS_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    """Grid (tasks,): task t reduces columns [t * chunk, (t + 1) * chunk) of the streams into part[t]."""
    t = tl.program_id(0)
    c0 = t * chunk
    c1 = tl.minimum(c0 + chunk, H)
    w0 = hc_partial_prefetch(fn, c0, c1, H, BLOCK_C)
    hc_partial_finish(w0, fn, X, 4 * H, part + t * ROWS_PAD * _SLOT, _SLOT, rows, c0, c1, H, ROWS_PAD, BLOCK_C)


@triton.jit(do_not_specialize=["rows", "chunk"])
def hc_post_partial_kernel(X, Y, coef, fn, out, part, rows, chunk, H, ROWS_PAD: tl.constexpr,
                           BLOCK_C: tl.constexpr):
    """Grid (tasks,): X' = hc_post(X) on task t's columns, and the next hc_pre's partials into part[t]."""
    t = tl.program_id(0)
    c0 = t * chunk
    c1 = tl.minimum(c0 + chunk, H)
    w0 = hc_partial_prefetch(fn, c0, c1, H, BLOCK_C)
    hc_post_partial(w0, fn, X, Y, H, coef, 24, out, 4 * H, part + t * ROWS_PAD * _SLOT, _SLOT, rows, c0, c1, H,
                    ROWS_PAD, BLOCK_C)


@triton.jit(do_not_specialize=["n_parts"])
def hc_finish_kernel(X, part, base, scale, norm_w, out, out32, coef, n_parts, H, eps, hc_eps,
                     ROWS_PAD: tl.constexpr, ITERS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Grid (rows, cdiv(H, BLOCK_H)): every program joins row r's slots itself (as consumer CTAs do),
    writes its gate-row tile; tile 0 also writes coef[r]."""
    r = tl.program_id(0)
    tile = tl.program_id(1)
    pre, post, comb, rstd = hc_coeffs(part + r * _SLOT, ROWS_PAD * _SLOT, n_parts, base, scale, H, eps, hc_eps,
                                      ITERS)
    if tile == 0:
        hc_store_coef(coef + r * 24, pre, post, comb)
    hc_gate_tile(X + r * 4 * H, pre, rstd, norm_w, out + r * H, out32 + r * H, tile * BLOCK_H, H, BLOCK_H, True)


@triton.jit
def hc_post_kernel(X, Y, coef, out, H, BLOCK_H: tl.constexpr):
    """Grid (rows, cdiv(H, BLOCK_H)): one column tile of one row; post/comb read from coef[r]."""
    r = tl.program_id(0)
    c0 = tl.program_id(1) * BLOCK_H
    i4 = tl.arange(0, 4)
    post = tl.load(coef + r * 24 + 4 + i4)
    comb = tl.load(coef + r * 24 + 8 + i4[:, None] * 4 + i4[None, :])
    hc_post_tile(X + r * 4 * H, Y + r * H, out + r * 4 * H, c0, H, post, comb, BLOCK_H)


# ---------------------------------------------------------------------------- host wrappers (tests)
def _check_streams(X, rows_pad):
    rows, m, H = X.shape
    if m != 4 or not X.is_contiguous() or X.dtype != torch.float32:
        raise ValueError(f"X must be contiguous fp32 [rows, 4, H], got {tuple(X.shape)} {X.dtype}")
    if not 1 <= rows <= rows_pad:
        raise ValueError(f"rows={rows}: must be in 1..{rows_pad}")
    return rows, H


def hc_finish(X, part, base, scale, norm_w, cfg, *, rows_pad: int = 8, block_h: int = 256):
    """Gate rows and coefficients from joined slots. Returns (a bf16 [rows, H], a fp32, coef [rows, 24])."""
    rows, H = _check_streams(X, rows_pad)
    nan, dev = float("nan"), X.device
    out = torch.full((rows, H), nan, dtype=torch.bfloat16, device=dev)
    out32 = torch.full((rows, H), nan, device=dev)
    coef = torch.full((rows, 24), nan, device=dev)
    hc_finish_kernel[(rows, triton.cdiv(H, block_h))](X, part, base, scale, norm_w, out, out32, coef, part.shape[0],
                                                      H, cfg.rms_norm_eps, cfg.hc_eps, ROWS_PAD=rows_pad,
                                                      ITERS=cfg.hc_sinkhorn_iters, BLOCK_H=block_h)
    return out, out32, coef


def hc_pre(X, fn, base, scale, norm_w, cfg, *, chunk: int = 64, block_c: int = 32, block_h: int = 256,
           rows_pad: int = 8):
    """hc_partial (one program per column tile of `chunk`) then hc_finish (one program per row and tile).

    X [rows, 4, H] fp32 contiguous; fn [24, 4H] fp32; base [24]; scale [3]; norm_w [H].
    Returns (a bf16 [rows, H], a fp32 [rows, H], coef [rows, 24] = pre|post|comb, part slots)."""
    rows, H = _check_streams(X, rows_pad)
    tasks = triton.cdiv(H, chunk)
    part = torch.full((tasks, rows_pad, HC_SLOT), float("nan"), device=X.device)
    hc_partial_kernel[(tasks,)](X, fn, part, rows, chunk, H, ROWS_PAD=rows_pad, BLOCK_C=block_c)
    return (*hc_finish(X, part, base, scale, norm_w, cfg, rows_pad=rows_pad, block_h=block_h), part)


def hc_post(X, y, coef, *, block_h: int = 128):
    """X' [rows, 4, H] = post * y + comb^T X, post/comb from coef [rows, 24] (hc_store_coef's layout)."""
    rows, _, H = X.shape
    out = torch.full_like(X, float("nan"))
    hc_post_kernel[(rows, triton.cdiv(H, block_h))](X, y, coef, out, H, BLOCK_H=block_h)
    return out


def hc_post_fused(X, y, coef, fn_next, *, chunk: int = 64, block_c: int = 32, rows_pad: int = 8):
    """hc_post fused with the next hc_pre's partials. X, y, coef as hc_post; fn_next [24, 4H] fp32.
    Returns (X' [rows, 4, H], part slots of X' for hc_finish)."""
    rows, H = _check_streams(X, rows_pad)
    if y.shape != (rows, H) or not y.is_contiguous() or coef.shape != (rows, 24) or not coef.is_contiguous():
        raise ValueError(f"y must be contiguous [{rows}, {H}] and coef [{rows}, 24]")
    tasks = triton.cdiv(H, chunk)
    out = torch.full_like(X, float("nan"))
    part = torch.full((tasks, rows_pad, HC_SLOT), float("nan"), device=X.device)
    hc_post_partial_kernel[(tasks,)](X, y, coef, fn_next, out, part, rows, chunk, H, ROWS_PAD=rows_pad,
                                     BLOCK_C=block_c)
    return out, part
