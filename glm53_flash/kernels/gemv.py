"""GEMV task family: y[r, n] = sum_k x[r, k] * W[n, k] for 1..8 activation rows, bf16 or FP8 weights.

Why this module exists: every persistent launch (DESIGN.md §5) streams weights through the same tiled
GEMV, so the tile math lives here once, as `@triton.jit` device functions, and a plain grid kernel
(`gemv_kernel` + host `gemv`) reuses them for tests and the benchmark.

Design choices (DESIGN.md §8, research/triton.md §3):
- Tensor cores, weights as the MMA's A operand: acc[BLOCK_N, ROWS_PAD] += W[BLOCK_N, CK] @ x^T[CK, ROWS_PAD]
  (m16n8k16, rows padded to ROWS_PAD = 8). Warps split the weight rows, so each warp reads only its
  own weights plus one small x^T fragment. A broadcast multiply-sum over 8 rows needed ~255
  registers; here the accumulator of a [64, 8] tile is 4 registers per thread.
- Batch invariance: an MMA computes every output element on its own and adds the K products in a
  fixed order (16-wide k steps, chunk after chunk), so row r's bits do not depend on `rows`, on the
  values of other rows or on which CTA runs the tile. They do depend on the K constexprs (BLOCK_K,
  PF_K, KSPLIT), on a split-K and on the MMA kind: ROWS_PAD = 8 compiles to mma.sync, ROWS_PAD = 16
  (with 4 warps) to Hopper's wgmma, and the two gave different FP8 (f16) bits on the H200 (bf16 ones
  matched). Build every width of a launch with the same constexprs; ROWS_PAD = 8 serves 1..8 rows.
- fp32 activations are split into hi + lo halves in the MMA type and multiplied twice (~16 mantissa
  bits with bf16, ~21 with f16), so weights are never widened in registers.
- FP8 e4m3 weights: W ~= q * s with one fp32 scale per 128x128 block. Each 128-wide K step (one
  block column) is its own MMA, whose exact-product partials are scaled once per weight row and
  added, in K order. The MMA runs in f16: e4m3 -> f16
  is one instruction per 2 weights (-> bf16 costs ~3), which decides FP8 speed. So for FP8 weights
  |x| must stay below 65504 (f16 range; beyond it the output is inf, never silently wrong); values
  under 2^-14 lose relative precision (f16 subnormals): an absolute error below 2^-25 |W| per product.
- Prefetch/finish split: a task loads its first PF_K weight columns (`gemv_prefetch`) before it waits
  for its input row, then `gemv_finish` consumes them and streams the rest in BLOCK_K chunks through a
  software-pipelined loop. Prefetch only one register-sized chunk: a whole 32x4096 tile spilled.

Device API (all tile sizes constexpr; n0 a multiple of BLOCK_N; k0, k1 multiples of 16 (FP8: k0 of
128); W row-major [N, K], row stride K; x row-major [rows, K] with row stride stride_x):
    w0  = gemv_prefetch(w_ptr, n0, k0, k1, N, K, BLOCK_N, PF_K)      # [BLOCK_N, PF_K], W's dtype
    ... wait for x ...
    acc = gemv_finish(w0, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K,
                      ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)   # [BLOCK_N, ROWS_PAD] fp32
    gemv_store(y_ptr, stride_y, acc, rows, n0, N, ROWS_PAD, BLOCK_N)   # y[r, n0 + j] = acc[j, r]
The persistent launches use instead (no prefetched chunk; the tile's first lines go to L2 before the wait):
    acc = gemv_stream(w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES)
    v   = plane_sum(ptr, offs, mask, plane_stride, KS)     # a split-K stage's KS partial planes, in plane order
acc is column-major on purpose (acc[j, r] = y[r, n0 + j]): it is the MMA's own layout, no shuffle.
Both device functions take an optional trailing KSPLIT (1 or 2, the same for both): the K range runs as
two parts batched in one MMA (more warps per tile), added at the end; and then EVEN (default False):
the caller promises whole tiles (n0 + BLOCK_N <= N, k1 - k0 - PF_K a multiple of BLOCK_K), so the K
loop runs without masks (same bits; `is_even` decides it for the standalone wrapper).
FP8 K loop (sm_90 SASS, BLOCK_N 64, 4 warps, per 128-wide step per warp): 213 instructions before
2026-11-30's diet, 148 after (x -> f16 once per thread in `_x_f16` instead of per warp in the MMA
layout: 64 -> ~16; EVEN: ~25 fewer masks; one scalar scale per step). It did not change the FP8 time
(bench/RESULTS.md): the K loop is not issue-bound.
Sizing: warps split the weight rows in m16 slices, so keep BLOCK_N >= 16 * num_warps: Triton lays 8
warps over a 64-row tile as 8 m16 slices, and warps 4-7 redo the work of 0-3. Fastest on the H200 (bench/RESULTS.md): BLOCK_N 64, BLOCK_K 128, PF_K 128, 4 warps,
3 (bf16) or 4 (FP8) stages: 48-63 registers, 32-37 KB shared memory, 94% (bf16) / 84% (FP8) of the
read-bandwidth floor at 24896 x 4096 through gemv_prefetch + gemv_finish.
Standalone kernel only (GemvConfig.k_rotate >= 0, `_finish_rot`): one pipelined loop over all K steps,
tile t starting at step (t * k_rotate) mod n_steps and wrapping. In the SASS the weight loads of the
pipelined loop are cp.async.cg (LDGSTS.BYPASS.128) whatever the hint: L1 bypassed, evict_first dropped.
k_rotate 0 (same bits as the device functions) already reached 85.9% of the floor (FP8, 1 row; the old
path 83.9%: its prefetched chunk is a register load outside the cp.async pipeline, a likely reason);
k_rotate 1 (the FP8 default of gemv(), so not all tiles read the same 128 B column of their 4 KB rows at
once) 86.9%.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8_BLOCK = 128  # weight_scale_inv block edge (fp8.py); written as a literal 128 inside the kernels


@triton.constexpr_function
def _interpreting():
    # True under TRITON_INTERPRET=1 (CPU tests), False when compiled
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def _mma(w, xt, acc):
    """acc [BN, R] += w [BN, CK] @ xt [CK, R]; w and xt of one 16-bit type (bf16 or f16)."""
    if _interpreting():
        # the interpreter's bf16 tl.dot multiplies raw bits, and its fp32 one (BLAS) gives an element bits
        # that depend on its position in the tile: a per-element product sum keeps rows independent
        if len(w.shape) == 3:                     # K parts as a batch: [KS, BN, CK] @ [KS, CK, R]
            prod3 = w.to(tl.float32)[:, :, :, None] * xt.to(tl.float32)[:, None, :, :]
            return acc + tl.sum(prod3, axis=2)
        prod = w.to(tl.float32)[:, :, None] * xt.to(tl.float32)[None, :, :]   # [BN, CK, R]
        return acc + tl.sum(prod, axis=1)
    else:
        return tl.dot(w, xt, acc)


@triton.jit
def _mult16(v):
    # k bounds are multiples of 16 (API precondition). tl.multiple_of is lost on scalars; a shift pair
    # tells the alignment analysis, which keeps weight and activation loads 16-byte vectors.
    return (v >> 4) << 4


@triton.jit
def _tile_rows(n0, N, BLOCK_N: tl.constexpr, GAP: tl.constexpr):
    """(rows of W, valid) of a tile's BLOCK_N rows. GAP == 0: rows n0 .. n0 + BLOCK_N - 1, valid below N. GAP > 0
    (a pair tile): the first half is rows n0 + j of one matrix and the second half rows GAP + n0 + j of the next
    (e.g. gate rows, then up rows GAP = I further in a packed [2I, K] bank), each half valid for n0 + j < N."""
    j = tl.arange(0, BLOCK_N)
    if GAP == 0:
        return n0 + j, n0 + j < N
    else:
        HALF: tl.constexpr = BLOCK_N // 2
        loc = n0 + j % HALF
        return loc + (j // HALF) * GAP, loc < N


@triton.jit
def _load_w(w_ptr, n0, k, k1, N, K, BLOCK_N: tl.constexpr, CK: tl.constexpr, EVEN: tl.constexpr = False,
            GAP: tl.constexpr = 0):
    k = _mult16(k)
    k1 = _mult16(k1)
    offs_n, valid_n = _tile_rows(n0, N, BLOCK_N, GAP)
    offs_k = k + tl.arange(0, CK)
    ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    # streamed once: do not let it push the activations and hand-off lines out of L2. (Inside a pipelined
    # tl.range the load becomes cp.async.cg = LDGSTS.BYPASS.128, which bypasses L1 and drops the L2 hint:
    # sm_90 SASS shows the same loop for evict_first, evict_first + .cg and no hint.)
    if EVEN:    # caller guarantees n0 + BLOCK_N <= N and k + CK <= k1: no predicates in the K loop
        return tl.load(ptrs, eviction_policy="evict_first")
    else:
        mask = valid_n[:, None] & (offs_k[None, :] < k1)
        return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")  # [BLOCK_N, CK]


@triton.jit
def _x_f16(xt):
    """bf16 x -> f16 with xt.to(tl.float16)'s bits (bf16 -> f32 -> f16, rn), 3 instructions per 2 values.
    is_pure=False on purpose: it keeps Triton from moving the conversion after the layout change into
    the MMA operand, where every warp converted the whole x step again (64 of ~213 K-loop instructions
    per warp at BLOCK_N 64, 4 warps); here each thread converts only its 8 values once per step."""
    if _interpreting():
        return xt.to(tl.float16)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .b32 hi, lo; and.b32 hi, $1, 0xffff0000; shl.b32 lo, $1, 16; cvt.rn.f16x2.f32 $0, hi, lo; }",
            "=r,r", [xt], dtype=tl.float16, is_pure=False, pack=2)


@triton.jit
def _dot_x(acc, w, xt):
    """acc += w @ xt with w in the MMA type and xt [CK, R] bf16/fp32 (fp32: hi + lo, two MMAs)."""
    if xt.dtype == tl.float32:
        hi = xt.to(w.dtype)
        lo = (xt - hi.to(tl.float32)).to(w.dtype)
        acc = _mma(w, hi, acc)
        acc = _mma(w, lo, acc)
    else:
        acc = _mma(w, xt.to(w.dtype), acc)
    return acc


@triton.jit
def _chunk(acc, w, s_ptr, x_ptr, stride_x, rows, n0, k, k1, N, K, ROWS_PAD: tl.constexpr, CK: tl.constexpr,
           EVEN: tl.constexpr = False, GAP: tl.constexpr = 0):
    """acc += W[n0:, k:k+CK] @ x[:, k:k+CK]^T for one chunk already in registers (w [BLOCK_N, CK])."""
    k = _mult16(k)
    k1 = _mult16(k1)
    offs_r = tl.arange(0, ROWS_PAD)
    offs_k = k + tl.arange(0, CK)
    if EVEN:
        xm = offs_r[None, :] < rows                              # pad rows read nothing
    else:
        xm = (offs_k[:, None] < k1) & (offs_r[None, :] < rows)
    # x^T [CK, ROWS_PAD]. .cg: x is written by other CTAs of the same launch; read it from L2, never
    # from a stale L1 line
    xt = tl.load(x_ptr + offs_r[None, :] * stride_x + offs_k[:, None], mask=xm, other=0.0, cache_modifier=".cg")
    if w.dtype == tl.float8e4nv:
        # one 128-wide scale block column: exact q products (e4m3 -> f16 is exact), then one fp32 scale
        # per weight row (constant over each 128 rows)
        tl.static_assert(CK == 128, "FP8 chunks are one 128-wide scale block")
        if EVEN and w.shape[0] <= 128 and GAP == 0:
            s = tl.load(s_ptr + (n0 // 128) * tl.cdiv(K, 128) + k // 128)
        elif w.shape[0] <= 128 and GAP == 0:
            # n0 is a multiple of BLOCK_N, so the tile lies in one 128-row scale block: one scalar
            s = tl.load(s_ptr + (n0 // 128) * tl.cdiv(K, 128) + k // 128, mask=(n0 < N) & (k < k1), other=0.0)
        else:
            offs_n, valid_n = _tile_rows(n0, N, w.shape[0], GAP)
            s = tl.load(s_ptr + (offs_n // 128) * tl.cdiv(K, 128) + k // 128, mask=valid_n & (k < k1),
                        other=0.0)[:, None]                       # [BLOCK_N, 1]
        if xt.dtype == tl.bfloat16:
            xt = _x_f16(xt)
        part = _dot_x(tl.zeros(acc.shape, dtype=tl.float32), w.to(tl.float16), xt)
        acc = tl.fma(part, s, acc)                  # pinned: one rounding, whatever the build
    else:
        acc = _dot_x(acc, w, xt)
    return acc


@triton.jit
def _parts(k0, k1, KSPLIT: tl.constexpr):
    """K range split into KSPLIT parts of equal length L (a multiple of 128): starts hs, ends he [KSPLIT]."""
    k0 = _mult16(k0)
    L = ((k1 - k0 + KSPLIT * 128 - 1) // (KSPLIT * 128)) * 128
    hs = k0 + tl.arange(0, KSPLIT) * L
    he = _mult16(tl.minimum(hs + L, k1))
    return hs, he, L


@triton.jit
def _load_w3(w_ptr, n0, ks, ke, N, K, BLOCK_N: tl.constexpr, CK: tl.constexpr):
    """W chunks of every K part: [KSPLIT, BLOCK_N, CK] from k = ks[h] (masked to k < ke[h], n < N)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = ks[:, None] + tl.arange(0, CK)[None, :]                            # [KS, CK]
    mask = (offs_n[None, :, None] < N) & (offs_k[:, None, :] < ke[:, None, None])
    ptrs = w_ptr + offs_n[None, :, None].to(tl.int64) * K + offs_k[:, None, :]
    return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")


@triton.jit
def _chunk3(acc, w, s_ptr, x_ptr, stride_x, rows, n0, ks, ke, N, K, ROWS_PAD: tl.constexpr, CK: tl.constexpr):
    """_chunk for K parts as a batch: acc [KS, BN, R] += w [KS, BN, CK] @ x^T [KS, CK, R]."""
    offs_r = tl.arange(0, ROWS_PAD)
    offs_k = ks[:, None] + tl.arange(0, CK)[None, :]                            # [KS, CK]
    xm = (offs_k[:, :, None] < ke[:, None, None]) & (offs_r[None, None, :] < rows)
    xt = tl.load(x_ptr + offs_r[None, None, :] * stride_x + offs_k[:, :, None], mask=xm, other=0.0,
                 cache_modifier=".cg")                                           # [KS, CK, R]
    if w.dtype == tl.float8e4nv:
        tl.static_assert(CK == 128, "FP8 chunks are one 128-wide scale block")
        offs_n = n0 + tl.arange(0, w.shape[1])
        s = tl.load(s_ptr + (offs_n[None, :] // 128) * tl.cdiv(K, 128) + ks[:, None] // 128,
                    mask=(offs_n[None, :] < N) & (ks[:, None] < ke[:, None]), other=0.0)   # [KS, BN]
        part = _dot_x(tl.zeros(acc.shape, dtype=tl.float32), w.to(tl.float16), xt)
        acc = tl.fma(part, s[:, :, None], acc)
    else:
        acc = _dot_x(acc, w, xt)
    return acc


@triton.jit
def gemv_prefetch(w_ptr, n0, k0, k1, N, K, BLOCK_N: tl.constexpr, PF_K: tl.constexpr,
                  KSPLIT: tl.constexpr = 1, EVEN: tl.constexpr = False):
    """Issue the loads of W[n0:n0+BLOCK_N, k0:k0+PF_K] (masked to n < N, k < k1; zero outside).

    w_ptr: bf16 or float8e4nv, row-major [N, K]. Returns [BLOCK_N, PF_K] in W's dtype (KSPLIT > 1:
    [KSPLIT, BLOCK_N, PF_K], the first chunk of each K part). Depends on no activation, so call it
    before waiting on the input. PF_K <= 128 (FP8: == 128); the tile stays in registers until the
    wait is over (64 x 128 bf16 = 16 KB = 32 registers per thread at 4 warps).
    EVEN (KSPLIT == 1 only; the same for gemv_finish): the caller promises n0 + BLOCK_N <= N and
    k1 - k0 - PF_K a multiple of BLOCK_K, so loads need no masks (fewer instructions, same bits).
    """
    if KSPLIT == 1:
        return _load_w(w_ptr, n0, k0, k1, N, K, BLOCK_N, PF_K, EVEN)
    else:
        hs, he, L = _parts(k0, k1, KSPLIT)
        return _load_w3(w_ptr, n0, hs, he, N, K, BLOCK_N, PF_K)


@triton.jit
def gemv_finish(w0, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K,
                ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, KSPLIT: tl.constexpr = 1,
                EVEN: tl.constexpr = False):
    """Finish the tile started by gemv_prefetch: stream the rest of W's K range and multiply with x.

    w0: gemv_prefetch's result for the same (n0, k0, k1, PF_K). s_ptr: fp32 weight_scale_inv
    [ceil(N/128), ceil(K/128)] when W is FP8 (then PF_K == 128, BLOCK_K % 128 == 0), ignored for bf16
    (pass w_ptr).
    x_ptr: bf16 or fp32 [rows, stride_x], unit stride along k. rows: runtime, 1 <= rows <= ROWS_PAD;
    rows >= `rows` are read from nowhere and come back 0. Returns acc [BLOCK_N, ROWS_PAD] fp32,
    acc[j, r] = sum_{k0<=k<k1} W[n0+j, k] x[r, k]. Contains no wait, so the K loop pipelines.
    KSPLIT (1 or 2, same as gemv_prefetch's): K parts run as a batch of MMAs, one per warp when
    num_warps == KSPLIT, and are added at the end (part 0 + part 1): twice the warps per tile at the
    same work per warp. Bits depend on KSPLIT as on BLOCK_K.
    EVEN: as for gemv_prefetch (mask-free loads; bits do not depend on it).
    """
    tl.static_assert(ROWS_PAD >= 8, "rows are padded to at least 8 (the MMA's n8)")
    tl.static_assert(BLOCK_N >= 16, "BLOCK_N >= 16 (the MMA's m16)")
    tl.static_assert(PF_K <= 128, "the prefetched chunk is one MMA step: PF_K <= 128")
    tl.static_assert(KSPLIT == 1 or KSPLIT == 2, "KSPLIT is 1 or 2 (a two-term sum has one order)")
    tl.static_assert(KSPLIT == 1 or not EVEN, "EVEN is for KSPLIT == 1")
    if w0.dtype == tl.float8e4nv:
        tl.static_assert(BLOCK_K % 128 == 0, "FP8 BLOCK_K must be a multiple of 128")
    # one MMA step covers at most 128 of K (FP8: exactly one scale block): every warp holds the whole
    # x^T step ([128, 8] = 16 registers, twice that for fp32 x) and a wider step doubles it
    CK: tl.constexpr = 128 if BLOCK_K > 128 else BLOCK_K
    if KSPLIT > 1:
        acc = _finish_parts(w0, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K,
                            ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, KSPLIT, CK)
    else:
        acc = _finish_one(w0, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K,
                          ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, CK, EVEN)
    return acc


@triton.jit
def _finish_one(w0, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K, ROWS_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                CK: tl.constexpr, EVEN: tl.constexpr):
    """gemv_finish for one K part: the prefetched chunk, then a pipelined loop over [k0 + PF_K, k1)."""
    acc = tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32)
    acc = _chunk(acc, w0, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K, ROWS_PAD, PF_K, EVEN)
    return _steps(acc, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0 + PF_K, k1, N, K, ROWS_PAD, BLOCK_N, BLOCK_K,
                  NUM_STAGES, CK, EVEN)


@triton.jit
def _steps(acc, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, ks, k1, N, K, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, CK: tl.constexpr, EVEN: tl.constexpr, GAP: tl.constexpr = 0):
    """acc += the pipelined BLOCK_K steps of [ks, k1), CK-wide chunks in K order."""
    if _interpreting():
        # the interpreter's program ids are 1-element arrays that `range` rejects; a while loop is fine
        k = ks
        while k < k1:
            for j in tl.static_range(BLOCK_K // CK):
                w = _load_w(w_ptr, n0, k + j * CK, k1, N, K, BLOCK_N, CK, EVEN, GAP)
                acc = _chunk(acc, w, s_ptr, x_ptr, stride_x, rows, n0, k + j * CK, k1, N, K, ROWS_PAD, CK, EVEN, GAP)
            k += BLOCK_K
    else:
        for k in tl.range(ks, k1, BLOCK_K, num_stages=NUM_STAGES):
            for j in tl.static_range(BLOCK_K // CK):
                w = _load_w(w_ptr, n0, k + j * CK, k1, N, K, BLOCK_N, CK, EVEN, GAP)
                acc = _chunk(acc, w, s_ptr, x_ptr, stride_x, rows, n0, k + j * CK, k1, N, K, ROWS_PAD, CK, EVEN, GAP)
    return acc


@triton.jit
def plane_sum(ptr, offs, mask, plane_stride, KS: tl.constexpr):
    """sum over s < KS of ptr[s * plane_stride + offs] (fp32), added in plane order s = 0, 1, ...: the
    consumer's join of a split-K stage's partial planes (launches/layer_host.py _gemv_stage). The KS
    loads are independent, so they are in flight together: one round trip, not KS."""
    v = tl.load(ptr + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    for s in tl.static_range(1, KS):
        v += tl.load(ptr + s * plane_stride + offs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return v


@triton.jit
def gemv_stream(w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K, ROWS_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr = False,
                GAP: tl.constexpr = 0):
    """acc [BLOCK_N, ROWS_PAD] fp32 = W[n0:n0+BLOCK_N, k0:k1] @ x[:, k0:k1]^T in ONE pipelined loop: the
    persistent launches' GEMV (same K order, and so the same bits, as gemv_prefetch + gemv_finish with
    PF_K = 128). Call it after the wait on x (move the weights toward L2 before the wait instead).

    Why not prefetch + finish: the prefetched chunk is a register load outside the cp.async pipeline,
    and its x is a synchronous load, so the loop's first NUM_STAGES - 1 copies were issued only after
    one full round trip. Here the prologue issues them at once; W and x travel in the same cp.async
    stages (x as 16-byte copies when x_ptr is 16-byte aligned: region offsets from meta words must go
    through launches/ffn.py region_off, or x falls back to scalar loads outside the pipeline).
    Stages hold (BLOCK_N + ROWS_PAD) * min(BLOCK_K, 128) * 2 bytes each (bf16): 18 KB at 64 x 128.
    GAP > 0: a pair tile (_tile_rows): rows n0 .. of W and rows GAP + n0 .. in one pipeline (gate and up of a
    packed bank: one fill and one drain instead of two); acc's first BLOCK_N / 2 rows are the first half."""
    CK: tl.constexpr = 128 if BLOCK_K > 128 else BLOCK_K
    return _steps(tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32), w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N,
                  K, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES, CK, EVEN, GAP)


@triton.jit
def _finish_rot(w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K, start, ROWS_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, EVEN: tl.constexpr):
    """Standalone-kernel K loop (GemvConfig.k_rotate >= 0): one pipelined loop over all n_steps =
    cdiv(k1 - k0, BLOCK_K) steps, beginning at step `start` and wrapping around (start 0: the K order,
    and the bits, of gemv_prefetch + gemv_finish). A per-tile start spreads the tiles that run at the
    same time over different K offsets (DRAM channels) instead of all reading the same 128 B column of
    every 4 KB row. The bits of a tile depend on its start (FP8 and bf16 both), nothing else."""
    CK: tl.constexpr = 128 if BLOCK_K > 128 else BLOCK_K
    n_steps = tl.cdiv(k1 - k0, BLOCK_K)
    span = n_steps * BLOCK_K
    kb = k0 + start * BLOCK_K
    acc = tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32)
    if _interpreting():
        i = 0
        while i < n_steps:
            k = kb + i * BLOCK_K
            k = tl.where(k >= k0 + span, k - span, k)
            for j in tl.static_range(BLOCK_K // CK):
                w = _load_w(w_ptr, n0, k + j * CK, k1, N, K, BLOCK_N, CK, EVEN)
                acc = _chunk(acc, w, s_ptr, x_ptr, stride_x, rows, n0, k + j * CK, k1, N, K, ROWS_PAD, CK, EVEN)
            i += 1
    else:
        for i in tl.range(0, n_steps, num_stages=NUM_STAGES):
            k = kb + i * BLOCK_K
            k = tl.where(k >= k0 + span, k - span, k)
            for j in tl.static_range(BLOCK_K // CK):
                w = _load_w(w_ptr, n0, k + j * CK, k1, N, K, BLOCK_N, CK, EVEN)
                acc = _chunk(acc, w, s_ptr, x_ptr, stride_x, rows, n0, k + j * CK, k1, N, K, ROWS_PAD, CK, EVEN)
    return acc


@triton.jit
def _finish_parts(w0, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K, ROWS_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                  KSPLIT: tl.constexpr, CK: tl.constexpr):
    """gemv_finish for KSPLIT > 1: every K part streams [PF_K, L) of its range in lock step."""
    hs, he, L = _parts(k0, k1, KSPLIT)
    acc = tl.zeros((KSPLIT, BLOCK_N, ROWS_PAD), dtype=tl.float32)
    acc = _chunk3(acc, w0, s_ptr, x_ptr, stride_x, rows, n0, hs, he, N, K, ROWS_PAD, PF_K)
    if _interpreting():
        k = PF_K
        while k < L:
            for j in tl.static_range(BLOCK_K // CK):
                w = _load_w3(w_ptr, n0, hs + k + j * CK, he, N, K, BLOCK_N, CK)
                acc = _chunk3(acc, w, s_ptr, x_ptr, stride_x, rows, n0, hs + k + j * CK, he, N, K, ROWS_PAD, CK)
            k += BLOCK_K
    else:
        for k in tl.range(PF_K, L, BLOCK_K, num_stages=NUM_STAGES):
            for j in tl.static_range(BLOCK_K // CK):
                w = _load_w3(w_ptr, n0, hs + k + j * CK, he, N, K, BLOCK_N, CK)
                acc = _chunk3(acc, w, s_ptr, x_ptr, stride_x, rows, n0, hs + k + j * CK, he, N, K, ROWS_PAD, CK)
    return tl.sum(acc, axis=0)                                  # [BLOCK_N, ROWS_PAD]


@triton.jit
def gemv_store(y_ptr, stride_y, acc, rows, n0, N, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               GAP: tl.constexpr = 0):
    """Store acc [BLOCK_N, ROWS_PAD] to y[r, n0 + j] = acc[j, r] (y's dtype), for r < rows, n0 + j < N
    (GAP > 0: a pair tile's rows, gemv_stream; the second half to y[r, GAP + n0 + j])."""
    offs_n, valid_n = _tile_rows(n0, N, BLOCK_N, GAP)
    offs_r = tl.arange(0, ROWS_PAD)
    mask = valid_n[:, None] & (offs_r[None, :] < rows)
    tl.store(y_ptr + offs_r[None, :] * stride_y + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemv_store_at(y_ptr, row_off, row_ok, acc, n0, N, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  GAP: tl.constexpr = 0):
    """gemv_store with a place per row: y[row_off[r] + n0 + j] = acc[j, r] for rows where row_ok[r] (row_off,
    row_ok: [ROWS_PAD] tensors), n0 + j < N; GAP as gemv_store's."""
    offs_n, valid_n = _tile_rows(n0, N, BLOCK_N, GAP)
    mask = valid_n[:, None] & row_ok[None, :]
    tl.store(y_ptr + row_off[None, :] + offs_n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["rows", "split_len"])
def gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, rows, N, K, stride_x, stride_y, stride_ys, split_len,
                ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                NUM_STAGES: tl.constexpr, KSPLIT: tl.constexpr = 1, EVEN: tl.constexpr = False,
                ROT: tl.constexpr = -1):
    """Grid (cdiv(N, BLOCK_N), splits): one column tile and one K range [k0, k0 + split_len) per program.
    y: [splits, rows, N] partials (stride_ys between splits; one split writes the result directly).
    `rows` is not specialised, so one compiled variant serves every row count <= ROWS_PAD.
    ROT < 0: gemv_prefetch + gemv_finish (the persistent launches' path). ROT >= 0 (KSPLIT 1 only):
    _finish_rot, tile t starting at K step (t * ROT) mod n_steps."""
    n0 = tl.program_id(0) * BLOCK_N
    k0 = tl.program_id(1) * split_len
    k1 = tl.minimum(k0 + split_len, K)
    if ROT >= 0:
        tl.static_assert(KSPLIT == 1, "k_rotate needs k_split == 1")
        start = (tl.program_id(0) * ROT) % tl.cdiv(k1 - k0, BLOCK_K)
        acc = _finish_rot(w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K, start,
                          ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES, EVEN)
    else:
        w0 = gemv_prefetch(w_ptr, n0, k0, k1, N, K, BLOCK_N, PF_K, KSPLIT, EVEN)
        acc = gemv_finish(w0, w_ptr, s_ptr, x_ptr, stride_x, rows, n0, k0, k1, N, K,
                          ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, KSPLIT, EVEN)
    gemv_store(y_ptr + tl.program_id(1) * stride_ys, stride_y, acc, rows, n0, N, ROWS_PAD, BLOCK_N)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64      # output columns per tile
    block_k: int = 128     # K chunk per pipelined step
    pf_k: int = 128        # K columns prefetched before the input wait (<= 128: one MMA step)
    rows_pad: int = 8      # rows padded to this (the MMA's n8); bits do not depend on it
    num_stages: int = 3    # software-pipeline depth of the K loop
    num_warps: int = 4
    split_k: int = 1       # K ranges per column tile (separate programs, for small N); fixed-order sum
    k_split: int = 1       # K parts inside one program (a batch of MMAs, one per warp): 1 or 2
    even: bool = True      # mask-free loads where the shape allows it (is_even); False: always masked
    # standalone kernel only (gemv_kernel; the device functions never see these):
    # k_rotate >= 0: one K loop per tile starting at step (tile * k_rotate) mod n_steps, wrapping around
    # (0: the same bits as -1). Changes the bits per tile (summation order) but stays deterministic and
    # batch invariant; bits then depend on block_n and block_k (the tile index and the step size).
    k_rotate: int = -1

    def __post_init__(self):
        for name in ("block_n", "block_k", "pf_k", "rows_pad"):
            v = getattr(self, name)
            if v < (8 if name == "rows_pad" else 16) or v & (v - 1):
                raise ValueError(f"GemvConfig.{name}={v}: must be a power of two >= 16 (rows_pad >= 8)")
        if self.pf_k > 128:
            raise ValueError(f"GemvConfig.pf_k={self.pf_k}: the prefetched chunk is one MMA step (<= 128)")
        if self.k_split not in (1, 2):
            raise ValueError(f"GemvConfig.k_split={self.k_split}: must be 1 or 2")
        if self.split_k < 1:
            raise ValueError(f"GemvConfig.split_k={self.split_k}: must be >= 1")
        if self.k_rotate >= 0 and self.k_split != 1:
            raise ValueError("GemvConfig.k_rotate needs k_split == 1")


# Fastest spill-free configs measured on the H200 at 24896 x 4096 (bench/RESULTS.md, 2026-11-30 sweep);
# both 4 warps, 48-63 registers, 32-37 KB shared memory.
TUNED = {
    "bf16": GemvConfig(block_n=64, block_k=128, pf_k=128, num_warps=4, num_stages=3),
    # k_rotate=1 (bench/RESULTS.md "FP8 K rotation", 2026-11-30): 83.9% -> 86.9% of the read floor at 1 row,
    # 82.1% -> 85.5% at 8 rows; the standalone gemv()'s FP8 bits differ from the device functions' per tile
    # (summation order), both deterministic and batch invariant. mlp/moe take only the tile fields.
    "fp8": GemvConfig(block_n=64, block_k=128, pf_k=128, num_warps=4, num_stages=4, k_rotate=1),
}


def is_even(N: int, K: int, split_len: int, cfg: GemvConfig) -> bool:
    """True when every tile of an N x K GEMV in K ranges of split_len is whole: no masks needed (EVEN)."""
    if cfg.k_rotate >= 0:       # _finish_rot: no prefetched chunk, whole BLOCK_K steps
        whole = lambda L: L % cfg.block_k == 0                                       # noqa: E731
    else:
        whole = lambda L: L >= cfg.pf_k and (L - cfg.pf_k) % cfg.block_k == 0      # noqa: E731
    return cfg.k_split == 1 and N % cfg.block_n == 0 and whole(split_len) and whole(K - (K - 1) // split_len * split_len)


def default_config(w: torch.Tensor) -> GemvConfig:
    """The tuned standalone config for a weight of this dtype."""
    return TUNED["fp8" if w.dtype == torch.float8_e4m3fn else "bf16"]


def gemv(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None, *,
         out_dtype: torch.dtype = torch.float32, cfg: GemvConfig | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T through the device functions above.

    x: [rows, K] (or [K]) bf16/fp32, rows <= cfg.rows_pad, unit stride along K.
    w: [N, K] contiguous bf16, or float8_e4m3fn with scales = weight_scale_inv fp32 [ceil(N/128), ceil(K/128)].
    Returns y [rows, N] (or [N]) in out_dtype (or written into `out`, contiguous [rows, N]).
    cfg: tile config; None = default_config(w).
    """
    cfg = cfg if cfg is not None else default_config(w)
    squeeze = x.dim() == 1
    x2 = x.unsqueeze(0) if squeeze else x
    if x2.dim() != 2 or x2.stride(-1) != 1 or x2.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be [rows, K] bf16/fp32 with unit stride along K, got {tuple(x.shape)} {x.dtype}")
    rows, K = x2.shape
    if w.dim() != 2 or w.shape[1] != K or not w.is_contiguous():
        raise ValueError(f"w must be contiguous [N, {K}], got {tuple(w.shape)}")
    N = w.shape[0]
    if not 1 <= rows <= cfg.rows_pad:
        raise ValueError(f"rows={rows}: must be in 1..{cfg.rows_pad}")
    fp8 = w.dtype == torch.float8_e4m3fn
    if fp8:
        want = ((N + FP8_BLOCK - 1) // FP8_BLOCK, (K + FP8_BLOCK - 1) // FP8_BLOCK)
        if scales is None or tuple(scales.shape) != want or scales.dtype != torch.float32 \
                or not scales.is_contiguous():
            raise ValueError(f"FP8 weight needs contiguous fp32 scales {want}, got "
                             f"{None if scales is None else (tuple(scales.shape), scales.dtype)}")
        if cfg.pf_k != FP8_BLOCK or cfg.block_k % FP8_BLOCK:
            raise ValueError(f"FP8 needs pf_k == {FP8_BLOCK} and block_k a multiple of it; got {cfg}")
        s = scales
    elif w.dtype == torch.bfloat16:
        s = w                                   # unused by the bf16 path
    else:
        raise ValueError(f"w dtype {w.dtype}: expected bfloat16 or float8_e4m3fn")
    # split K into ranges that are whole chunks, so the FP8 scale lookup and vector loads stay aligned
    split = max(1, cfg.split_k)
    step = max(cfg.block_k, cfg.pf_k)
    split_len = triton.cdiv(triton.cdiv(K, split), step) * step
    split = triton.cdiv(K, split_len)
    if split == 1:
        y = out if out is not None else torch.empty(rows, N, dtype=out_dtype, device=x.device)
        if tuple(y.shape) != (rows, N) or not y.is_contiguous():
            raise ValueError(f"out must be contiguous [{rows}, {N}]")
        part = y
    else:
        part = torch.empty(split, rows, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, cfg.block_n), split)
    gemv_kernel[grid](x2, w, s, part, rows, N, K, x2.stride(0), N, rows * N, split_len,
                      ROWS_PAD=cfg.rows_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PF_K=cfg.pf_k,
                      NUM_STAGES=cfg.num_stages, KSPLIT=cfg.k_split,
                      EVEN=cfg.even and is_even(N, K, split_len, cfg), ROT=cfg.k_rotate,
                      num_warps=cfg.num_warps)
    if split > 1:
        # torch's reduction over a dim uses no atomics: a fixed order for a given shape, reproducible
        y = out if out is not None else torch.empty(rows, N, dtype=out_dtype, device=x.device)
        y.copy_(part.sum(0))
    return y[0] if squeeze else y
