"""Device pieces of the DSA-mixer half of the `sparse` / `nextn` launches: the per-row norm task
(q_a / kv_a RMSNorms, the latent-cache append, the indexer's LayerNorm'd key, tail ring row and pooled
key) and a GEMV tile range over one of several weight matrices. Pure compute: the waits, publishes and
control flow stay in the kernel (launches/sparse_layer.py).

Why a per-row norm task (one hop): q_b, wq_b and the latent cache need the *normed* rows, and a
GEMV reads its input row from memory, so the norms cannot be folded into the consumers' K loops
(the norm weight multiplies each K column). The task is tiny (q_lora + kv_lora + 2 index_head_dim
values per row) and also owns the cache writes of the row, so they happen once, by one CTA.
"""
import triton
import triton.language as tl

from sync.device import signal_box, wait_box

from ..kernels.gemv import gemv_finish, gemv_prefetch, gemv_store
from ..kernels.indexer import idx_pool_task
from ..kernels.mhc import hc_partial_prefetch, hc_post_partial


@triton.jit
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


@triton.jit
def dsa_norm_row(ya_r, qa_ln, kva_ln, kn_w, kn_b, ape, qr_r, lat_row, tail, pool_keys, pos, eps,
                 QL: tl.constexpr, C: tl.constexpr, DI: tl.constexpr, KP: tl.constexpr, BLOCK: tl.constexpr):
    """One row after the qkv_a wait. ya_r = [q_a (QL) | kv_a (C) | wk (DI) | gate (DI) | weights_proj]
    (fp32). -> q_resid into qr_r (activation dtype), the latent c into the slot's cache row lat_row
    (the cache's dtype), and the indexer's tail row / pooled key into the slot's ring and pool keys."""
    rms_row(ya_r, qa_ln, qr_r, QL, eps, BLOCK)
    rms_row(ya_r + QL, kva_ln, lat_row, C, eps, BLOCK)
    idx_pool_task(ya_r + QL + C, ya_r + QL + C + DI, kn_w, kn_b, ape, tail, pool_keys, pos, 1e-6, DI, KP)


@triton.jit
def gemv_tiles(w0, W, S, x, stride_x, y, stride_y, rows, t0, nt, N: tl.constexpr, K: tl.constexpr,
               ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
               NUM_STAGES: tl.constexpr):
    """Tiles t0 .. t0 + nt - 1 of y[r, n] = sum_k W[n, k] x[r, k] (W bf16 or FP8 with scales S); w0: tile
    t0's first chunk, prefetched by the caller before its wait. y fp32 rows (row stride stride_y)."""
    acc = gemv_finish(w0, W, S, x, stride_x, rows, t0 * BLOCK_N, 0, K, N, K, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K,
                      NUM_STAGES)
    gemv_store(y, stride_y, acc, rows, t0 * BLOCK_N, N, ROWS_PAD, BLOCK_N)
    j = 1
    while j < nt:                       # further tiles: prefetch and finish in one iteration (no carried tile)
        n0 = (t0 + j) * BLOCK_N
        w1 = gemv_prefetch(W, n0, 0, K, N, K, BLOCK_N, PF_K)
        acc = gemv_finish(w1, W, S, x, stride_x, rows, n0, 0, K, N, K, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
        gemv_store(y, stride_y, acc, rows, n0, N, ROWS_PAD, BLOCK_N)
        j += 1


# the meta-word helpers follow launches/kda_layer.py's layout (box b: words 4b..4b+3 = offset, words,
# producers, site); kept here so that kernel's private helpers can change on their own
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
def _waitb(scratch, meta, b, ready, pid, tag, hdr, timeout_ns):
    """_wait with the CTA's passed boxes as bits of one int (ready) -> (ok, ready | ok << b)."""
    ok = (ready >> b) & 1
    if ok == 0:
        box, words, nprod, site = _box(scratch, meta, b)
        ok = wait_box(box, pid, words, nprod, tag, hdr, site, pid, timeout_ns)
    return ok, ready | (ok << b)


@triton.jit
def _signal(scratch, meta, b, producer, tag, fault_site):
    box, words, nprod, site = _box(scratch, meta, b)
    signal_box(box, tl.num_programs(0), words, producer, tag, site, fault_site, 128)


@triton.jit
def _f32(scratch, meta, m):
    return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + tl.load(meta + m)


@triton.jit
def _i32(scratch, meta, m):
    return scratch + tl.load(meta + m)


@triton.jit
def _act(scratch, meta, m, ACT_F32: tl.constexpr):
    """A hand-off row region in the activation dtype (bf16; fp32 for diagnostics)."""
    if ACT_F32:
        return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + tl.load(meta + m)
    else:
        return scratch.to(tl.pointer_type(tl.bfloat16), bitcast=True) + tl.load(meta + m)


@triton.jit
def _post_partials(fn2, X, y1, coef1, xmid, part2, rows, t0, nt, H: tl.constexpr, ROWS_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """hc_post of the mixer on column tiles t0 .. t0 + nt - 1 (X -> xmid) fused with the FFN hc_pre
    partials, one slot (40 words) per BLOCK_N tile: the join order does not depend on the grid."""
    j = 0
    while j < nt:
        c0 = (t0 + j) * BLOCK_N
        wf = hc_partial_prefetch(fn2, c0, c0 + BLOCK_N, H, BLOCK_C)
        hc_post_partial(wf, fn2, X, y1, H, coef1, 24, xmid, 4 * H, part2 + (t0 + j) * ROWS_PAD * 40, 40, rows,
                        c0, c0 + BLOCK_N, H, ROWS_PAD, BLOCK_C)
        j += 1


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
