"""Device pieces of the DSA-mixer half of the `sparse` / `nextn` launches: the per-row norm task
(q_a / kv_a RMSNorms, the latent-cache append, the indexer's LayerNorm'd key, tail ring row and pooled
key) and a GEMV tile range over one of several weight matrices. Pure compute: the waits, publishes and
control flow stay in the kernel (launches/sparse_layer.py); the hand-off helpers and the families it
shares with the KDA layer kernel are launches/ffn.py's.

Why a per-row norm task (one hop): q_b, wq_b and the latent cache need the *normed* rows, and a
GEMV reads its input row from memory, so the norms cannot be folded into the consumers' K loops
(the norm weight multiplies each K column). The task is tiny (q_lora + kv_lora + 2 index_head_dim
values per row) and also owns the cache writes of the row, so they happen once, by one CTA.
"""
import triton
import triton.language as tl

from ..kernels.indexer import idx_pool_task
from .ffn import gemv_tile


@triton.jit(noinline=True)
def rms_row(src, w, dst, n, eps, BLOCK: tl.constexpr):
    """dst[c] = src[c] / sqrt(mean(src^2) + eps) * w[c] for c < n (src fp32 written by other CTAs: .cg;
    dst in its own dtype). Squares summed per lane in chunk order, then across lanes: fixed order."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    c = 0
    while c < n:
        x = tl.load(src + c + offs, mask=c + offs < n, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc += x * x
        c += BLOCK
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / n + eps)
    c = 0
    while c < n:
        m = c + offs < n
        x = tl.load(src + c + offs, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        y = x * rstd * tl.load(w + c + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(dst + c + offs, y.to(dst.dtype.element_ty), mask=m)
        c += BLOCK


@triton.jit(noinline=True)
def dsa_norm_row(ya_r, qa_ln, kva_ln, kn_w, kn_b, ape, qr_r, lat_row, tail, pool_keys, pos, eps,
                 QL: tl.constexpr, C: tl.constexpr, DI: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """One row after the qkv_a wait. ya_r = [q_a (QL) | kv_a (C) | wk (DI) | gate (DI) | weights_proj]
    (fp32). -> q_resid into qr_r (activation dtype), the latent c into the slot's cache row lat_row
    (the cache's dtype), and the indexer's tail row / pooled key into the slot's ring and pool keys."""
    rms_row(ya_r, qa_ln, qr_r, QL, eps, BLOCK)
    rms_row(ya_r + QL, kva_ln, lat_row, C, eps, BLOCK)
    idx_pool_task(ya_r + QL + C, ya_r + QL + C + DI, kn_w, kn_b, ape, tail, pool_keys, pos, 1e-6, DI, KP)


@triton.jit
def gemv_tiles(W, S, x, stride_x, y, stride_y, rows, t0, nt, N: tl.constexpr, K: tl.constexpr,
               ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
               NUM_STAGES: tl.constexpr):
    """Tiles t0 .. t0 + nt - 1 of y[r, n] = sum_k W[n, k] x[r, k] (W bf16 or FP8 with scales S), after the
    caller's wait; y fp32 rows (row stride stride_y). One call (ffn.py gemv_tile) per tile."""
    j = 0
    while j < nt:
        gemv_tile(W, S, x, stride_x, (t0 + j) * BLOCK_N, 0, K, rows, 1, 0, 1, y, stride_y, y, 0, 0, 0, N, K, ROWS_PAD,
                  BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, False)
        j += 1
