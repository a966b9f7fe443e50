"""Device pieces of the DSA-mixer half of the `sparse` / `nextn` launches: the per-row norm task
(q_a / kv_a RMSNorms, the latent-cache append, the indexer's LayerNorm'd key, tail ring row and pooled
key) and a GEMV tile range over one of several weight matrices. Pure compute: the waits, publishes and
control flow stay in the kernel (launches/sparse_layer.py); the hand-off helpers and the families it
shares with the KDA layer kernel are launches/ffn.py's.

Why a per-row norm task (one hop): q_b, wq_b and the latent cache need the *normed* rows, and a
GEMV reads its input row from memory, so the norms cannot be folded into the consumers' K loops
(the norm weight multiplies each K column). The task is tiny (q_lora + kv_lora + 2 index_head_dim
values per row) and also owns the cache writes of the row, so they happen once, by one CTA. It also
joins qkv_a's split-K planes (in plane order), and costs one L2 round trip after its wait: every
load that does not wait (norm weights, the open pool's ring rows) is issued before it, every plane
of the row in one batch after it (a loop of 256-wide chunks cost ~10 dependent trips: 9.6 us traced).
"""
import triton
import triton.language as tl

from ..kernels.gemv import plane_sum
from ..kernels.indexer import idx_pool_finish, idx_pool_prefetch
from .ffn import gemv_tile


@triton.jit(noinline=True)
def rms_row(src, w, dst, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    """dst[c] = src[c] / sqrt(mean(src^2) + eps) * w[c] for c < N (src fp32 written by other CTAs: .cg;
    dst in its own dtype). One round trip: the row and the weights in one load batch (BLOCK >= N, a
    power of two; a loop over 256-wide chunks paid two dependent L2 trips per chunk: 32 for a 4096 row)."""
    tl.static_assert(N <= BLOCK)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(src + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
    wv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + offs, (_rms(x, N, eps) * wv).to(dst.dtype.element_ty), mask=m)


@triton.jit
def eh_x_slice(tokens, embed_w, hid, enorm, hnorm, dst, rows, k0, eps, H: tl.constexpr, KL: tl.constexpr,
               ROWS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """dst[r, c - k0] = [enorm(embed(tokens[r])) | hnorm(hid[r])][c] for k0 <= c < k0 + KL, r < rows (dst rows KL
    apart): an eh_proj task's own K slice of NextN's normed input, by rms_row's arithmetic (the bits of the
    eh_in task's row). Only the halves the slice touches: one row load a row after the tokens and weights."""
    tl.static_assert(H <= BLOCK)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    ro = tl.arange(0, ROWS_PAD)
    toks = tl.load(tokens + ro, mask=ro < rows, other=0).to(tl.int64)
    for half in tl.static_range(2):
        if (k0 < (half + 1) * H) & (k0 + KL > half * H):
            if half == 0:
                wv = tl.load(enorm + offs, mask=m, other=0.0).to(tl.float32)
            else:
                wv = tl.load(hnorm + offs, mask=m, other=0.0).to(tl.float32)
            c = offs + half * H
            keep = m & (c >= k0) & (c < k0 + KL)
            r = 0
            while r < rows:
                if half == 0:                          # the embedding row of token r
                    src = embed_w + tl.sum(tl.where(ro == r, toks, 0), axis=0) * H
                else:
                    src = hid + r * H
                x = tl.load(src + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(dst + r * KL + (c - k0), (_rms(x, H, eps) * wv).to(dst.dtype.element_ty), mask=keep)
                r += 1


@triton.jit
def rms_row_planes(src, plane_stride, KS: tl.constexpr, joined, w, dst, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    """rms_row of the row that KS split-K planes of a GEMV add up to (src: plane 0, planes plane_stride apart, added
    in plane order, as kernels/gemv.py plane_sum): the sum is stored to `joined` (fp32: what the residual reads
    later) and normalised into dst; every plane's load in one batch (one round trip)."""
    tl.static_assert(N <= BLOCK)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = plane_sum(src, offs, m, plane_stride, KS)
    wv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(joined + offs, x, mask=m)
    tl.store(dst + offs, (_rms(x, N, eps) * wv).to(dst.dtype.element_ty), mask=m)


@triton.jit
def rms_slice_planes(src, plane_stride, KS: tl.constexpr, w, dst, joined, join, rows, k0, eps, N: tl.constexpr,
                     KL: tl.constexpr, BLOCK: tl.constexpr):
    """rms_row_planes for rows r < rows (src rows N apart), keeping only columns [k0, k0 + KL) of the normed row:
    dst[r, c - k0] (dst rows KL apart), a consumer GEMV task's own K slice of the row instead of a norm task's
    hop; join != 0: the joined row to joined [rows, N] too (one task of the consumers). rms_row_planes'
    operations, so the bits of the norm task's row; one round trip a row."""
    tl.static_assert(N <= BLOCK)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    keep = m & (offs >= k0) & (offs < k0 + KL)
    wv = tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    r = 0
    while r < rows:
        x = plane_sum(src + r * N, offs, m, plane_stride, KS)
        tl.store(joined + r * N + offs, x, mask=m & (join != 0))
        tl.store(dst + r * KL + (offs - k0), (_rms(x, N, eps) * wv).to(dst.dtype.element_ty), mask=keep)
        r += 1


@triton.jit
def _rms(x, N: tl.constexpr, eps):
    """x / sqrt(mean(x^2) + eps) over N values (x's padding lanes 0)."""
    return x * (1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps))


@triton.jit
def _plane_sum(src, plane, N: tl.constexpr, KS: tl.constexpr, BLOCK: tl.constexpr):
    """gemv.py plane_sum (the KS split-K planes, plane elements apart, added in plane order) of src[c], c < N."""
    offs = tl.arange(0, BLOCK)
    return plane_sum(src, offs, offs < N, plane, KS)


@triton.jit
def dsa_norm_prefetch(qa_ln, kva_ln, kn_w, kn_b, ape, tail, pos, QL: tl.constexpr, C: tl.constexpr,
                      DI: tl.constexpr, KP: tl.constexpr, Q_PAD: tl.constexpr, C_PAD: tl.constexpr):
    """The norm task's loads that do not wait (weights, the ring rows of the row's open pool), issued
    before the ya wait. -> (q_a norm weight, kv_a norm weight, then idx_pool_prefetch's four)."""
    oq = tl.arange(0, Q_PAD)
    oc = tl.arange(0, C_PAD)
    wq = tl.load(qa_ln + oq, mask=oq < QL, other=0.0).to(tl.float32)
    wc = tl.load(kva_ln + oc, mask=oc < C, other=0.0).to(tl.float32)
    lw, lb, keys, z = idx_pool_prefetch(kn_w, kn_b, ape, tail, pos, DI, KP)
    return wq, wc, lw, lb, keys, z


@triton.jit
def dsa_norm_finish(ya_r, plane, wq, wc, lw, lb, keys, z, ape, qr_r, lat_row, tail, pool_keys, pos, eps,
                    QL: tl.constexpr, C: tl.constexpr, DI: tl.constexpr, NI: tl.constexpr, KP: tl.constexpr,
                    KS: tl.constexpr, Q_PAD: tl.constexpr, C_PAD: tl.constexpr, NI_PAD: tl.constexpr, live=1):
    """One row after the ya wait, every load in one batch. ya_r = [q_a (QL) | kv_a (C) | wk (DI) | gate (DI)
    | weights_proj (NI)] fp32, KS split-K planes joined here in plane order -> q_resid into qr_r
    (activation dtype), the latent c into the slot's cache row lat_row (the cache's dtype), the indexer's
    tail row / pooled key into the slot's ring and pool keys; KS > 1: the joined weights_proj values back
    into plane 0 (the scoring tasks read them there, after hand-offs downstream of this task). live == 0: the
    same code stores nothing (a dry run: plane 0 and the caches are written in place)."""
    xq = _plane_sum(ya_r, plane, QL, KS, Q_PAD)
    xc = _plane_sum(ya_r + QL, plane, C, KS, C_PAD)
    xk = _plane_sum(ya_r + QL + C, plane, DI, KS, DI)
    xg = _plane_sum(ya_r + QL + C + DI, plane, DI, KS, DI)
    if KS > 1:
        ow = tl.arange(0, NI_PAD)
        xw = _plane_sum(ya_r + QL + C + 2 * DI, plane, NI, KS, NI_PAD)
        tl.store(ya_r + QL + C + 2 * DI + ow, xw, mask=(ow < NI) & (live != 0))
    oq = tl.arange(0, Q_PAD)
    oc = tl.arange(0, C_PAD)
    tl.store(qr_r + oq, (_rms(xq, QL, eps) * wq).to(qr_r.dtype.element_ty), mask=(oq < QL) & (live != 0))
    tl.store(lat_row + oc, (_rms(xc, C, eps) * wc).to(lat_row.dtype.element_ty), mask=(oc < C) & (live != 0))
    idx_pool_finish(xk, xg, lw, lb, keys, z, ape, tail, pool_keys, pos, 1e-6, DI, KP, live)


@triton.jit
def gemv_tiles(W, S, x, stride_x, y, stride_y, rows, t0, nt, k0, k1, N: tl.constexpr, K: tl.constexpr,
               ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
               NUM_STAGES: tl.constexpr):
    """Tiles t0 .. t0 + nt - 1 of y[r, n] = sum_{k0 <= k < k1} W[n, k] x[r, k] (W bf16 or FP8 with scales S),
    after the caller's wait; y fp32 rows (row stride stride_y; a K slice of a split-K stage: its own plane).
    One call (ffn.py gemv_tile) per tile."""
    j = 0
    while j < nt:
        gemv_tile(W, S, x, stride_x, (t0 + j) * BLOCK_N, k0, k1, rows, 1, 0, 1, 1, y, stride_y, y, 0, 0, 0, N, K,
                  ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, False)
        j += 1
