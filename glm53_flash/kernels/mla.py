"""Absorbed NoPE MLA decode task family (DSA layers): query absorption, split attention over the
indexer's selected latents, and the split-softmax join fused with the value up-projection, as
`@triton.jit` device functions. Spec: reference/ops.py mla_absorbed (research/model.md §3.3).

Math per row and head h (W_UK,h, W_UV,h = kv_b rows [h (dn+dv), h (dn+dv) + dn) and the dv after,
each [dn, C] with C = kv_lora): q~_h = q_h @ W_UK,h [C]; p = softmax_t(q~_h . c_t * qk_head_dim^-0.5)
over the selected tokens t (<= topk + kpool - 1 = 2051 indices, -1 padded); o_h = W_UV,h (sum_t p_t c_t).

Three tasks, so each reads its bytes once:
- absorb (`mla_absorb_prefetch/finish`, task = (head, BLOCK_C columns), all rows): W_UK,h is streamed
  once for every row; acc[BLOCK_C, ROWS_PAD] += W_UK,h^T[BLOCK_C, CK] @ q^T[CK, ROWS_PAD] with the GEMV
  family's MMA helper (bf16 weights, fp32 q split hi + lo). W_UK,h^T is read straight from kv_b's
  row-major [dn, C] layout (coalesced along C), so the GEMV family's row-major tile does not apply here.
  Output q~ [rows, nh, C] fp32 (unscaled).
- attend (task = (row, HB heads, token split)): the latents are shared by all heads (MQA), so one task
  scores HB heads against each gathered latent tile with one product, s^T[BLOCK_T, HB] = c @ q~^T, and
  writes its partial (m [HB], l [HB], acc [HB, C] relative to m) to scratch. `mla_attend` keeps an
  online softmax over whole [BLOCK_T, C] tiles (acc^T [C, HB] live; the reference form);
  `mla_attend_tile`, the launches' form, takes one tile per task in CK-wide column chunks (scores in
  registers, then one acc chunk at a time), which keeps both the registers and the dependent round
  trips down. Tokens past the row's count (n_sel = KP * min(P, TOPK) + the tail) or at -1 are masked;
  a split without tokens writes m = -inf, l = 0, acc = 0.
- join + out (`mla_join_out`, task = (head, BLOCK_N output columns), all rows): prefetch the first W_UV,h
  chunk (before the wait), join the splits of every row: M = max m_s, L = sum l_s e^(m_s - M),
  ctx = sum (e^(m_s - M) / L) acc_s, the splits as one padded vector (fixed tree order), store ctx
  [rows, C] to the task's scratch, CTA barrier, then o = W_UV,h ctx through gemv_finish / gemv_store
  (W_UV,h is row-major [dv, C]: the GEMV family's layout). Join and projection share a task: no hop.

The split (heads per task, token tile = tokens per task, number of splits) comes from the host-side
`choose_attention_split`: the smallest tile whose tasks fit the grid. The bits of a row depend on the
split, so a launch chooses it from width-independent inputs (the index width, the launch's grid),
never from the rows of a step: that keeps batch invariance (DESIGN.md §7).

Registers (sm_90, Triton 3.6's bundled ptxas offline: tests/test_kernels_mla.py test_offline_sm90_registers;
real shapes C = 512, HB = 16 heads, bf16 latents; (BLOCK_T, warps) -> registers, no spills unless said):
  online `mla_attend`:        (32, 4) 251, (32, 8) 210, (64, 8) 255 + 824 B spilled   - too heavy for a
                              persistent kernel whose families share the register count;
  one-tile `mla_attend_tile`:  (HB 8, BLOCK_T 32, CK 64) 116, (HB 16, BLOCK_T 64, CK 32) 152 (att_chunk).
  So a launch builds the one-tile chunked form (the online form stays as the simple
  reference and for narrow C). absorb (BLOCK_C 64, 4 warps) 60 (FP8 kv_b 62); join + out: BUDGETS.

Numerics: fp32 softmax and accumulation; latents bf16 or fp32 (fp32: tf32x3 products compiled, exact
per-element product sums under the interpreter); every sum in a fixed order; a row never reads
another row's data. kv_b bf16, or FP8 e4m3 with 128 x 128 block scales (real shapes: every head part is
whole scale blocks), each chunk's products exact in f16 then scaled once, as the GEMV family.

Layouts (the caller offsets pointers to the row / slot where noted):
  q [rows, nh, dn] (row stride stride_q)   kv_b [nh (dn + dv), C] bf16   qlat [rows, nh, C] fp32
  idx [WIDTH] int32 (row's)   latent [max_len, C] (slot's)   pm, pl [nh, S], pacc [nh, S, C] fp32 (row's)
  ctx [ROWS_PAD, C] fp32 (task's scratch)   out [rows, nh, dv] (row stride stride_o)
  s_kv: kv_b's fp32 block scales [cdiv(nh (dn + dv), 128), cdiv(C, 128)] when FP8 (else any pointer)

Device API (constexprs in CAPS):
  w0 = mla_absorb_prefetch(kv_b, h, c0, DN, DV, C, BLOCK_C, CK)
  mla_absorb_finish(w0, kv_b, s_kv, q, stride_q, qlat, rows, h, c0, NH, DN, DV, C, ROWS_PAD, BLOCK_C, CK)
  mla_attend(qlat, idx, latent, pm, pl, pacc, h0, s, t0, t1, n_sel, n_splits, scale, NH, C, HB, BLOCK_T)
  mla_attend_tile(qlat, idx, latent, pm, pl, pacc, h0, s, t0, n_sel, n_splits, scale, NH, C, HB, BLOCK_T, CK, t_hi)
  w0 = mla_out_prefetch(kv_b, h, n0, DN, DV, C, BLOCK_N, PF_K)
  mla_join_out(w0, kv_b, s_kv, pm, pl, pacc, stride_part, ctx, out, stride_o, rows, h, n0, n_splits,
               NH, DN, DV, C, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, NS_PAD, SB)   # join_chunk()
    = mla_join_ctx(pm, pl, pacc, stride_part, ctx, rows, h, n_splits, C, NS_PAD, SB), then
      mla_out_ctx(w0, kv_b, s_kv, ctx, out, stride_o, rows, h, n0, DN, DV, C, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K,
                  NUM_STAGES)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .gemv import _dot_x, _interpreting, _mma, gemv_finish, gemv_prefetch, gemv_store


ATT_STAGES = tl.constexpr(8)        # mla_attend_tile: 7 chunks of the latent tile in flight (all of it at C 512, CK 64)


# ---------------------------------------------------------------------------- split chooser (host)
@dataclass(frozen=True)
class AttentionSplit:
    heads_per_task: int     # HB: heads scored together against one latent tile
    block_t: int            # BLOCK_T: tokens per tile (constexpr of the build)
    tokens_per_task: int    # a multiple of block_t
    n_splits: int           # token splits per (row, head group); the join adds them in this order

    def tasks_per_row(self, n_heads_rank: int) -> int:
        return n_heads_rank // self.heads_per_task * self.n_splits


def choose_attention_split(n_tokens: int, n_heads_rank: int, grid: int, sm_count: int, *,
                           max_heads_per_task: int = 16, block_ts: tuple = (32, 64, 128)) -> AttentionSplit:
    """Attention split for `n_tokens` selected tokens (pass the index width, 2051, not a row's count:
    the split must not depend on the step's rows), `n_heads_rank` heads of this rank, a launch of
    `grid` CTAs on `sm_count` SMs.

    Heads per task: the largest power of two <= max_heads_per_task dividing n_heads_rank (registers).
    One token tile per task (mla_attend_tile): the smallest tile of block_ts whose tasks (head groups x
    splits) fit the grid, else the largest. Narrower than 32 buys no time (a task is ~3 round trips
    whatever its tile) and doubles the partials the join reads. sm_count: kept for the callers; the
    choice depends only on the grid."""
    for name, v in (("n_tokens", n_tokens), ("n_heads_rank", n_heads_rank), ("grid", grid), ("sm_count", sm_count)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}={v!r}: must be a positive integer")
    hb = 1
    while hb * 2 <= max_heads_per_task and n_heads_rank % (hb * 2) == 0:
        hb *= 2
    groups = n_heads_rank // hb
    block_t = next((t for t in block_ts if groups * -(-n_tokens // t) <= grid), block_ts[-1])
    return AttentionSplit(hb, block_t, block_t, -(-n_tokens // block_t))


# ---------------------------------------------------------------------------- absorb
@triton.jit
def _load_wuk_t(kv_b, h, d0, c0, DN: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr,
                CK: tl.constexpr):
    """W_UK,h^T[c0:c0+BLOCK_C, d0:d0+CK] from kv_b's row-major [dn, C] block of head h: [BLOCK_C, CK]."""
    d = d0 + tl.arange(0, CK)
    c = c0 + tl.arange(0, BLOCK_C)
    base = kv_b + h.to(tl.int64) * (DN + DV) * C
    return tl.load(base + d[None, :] * C + c[:, None], eviction_policy="evict_first")


@triton.jit
def mla_absorb_prefetch(kv_b, h, c0, DN: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BLOCK_C: tl.constexpr,
                        CK: tl.constexpr):
    """The first CK rows of W_UK,h for columns [c0, c0 + BLOCK_C): issue before waiting on q."""
    return _load_wuk_t(kv_b, h, 0, c0, DN, DV, C, BLOCK_C, CK)


@triton.jit
def _wuk_chunk(acc, w, xt, s_ptr, h, d0, c0, DN: tl.constexpr, DV: tl.constexpr, C: tl.constexpr):
    """acc += w @ xt for one W_UK,h^T chunk w [BLOCK_C, CK]; FP8 w: exact f16 products, then the chunk's
    one block scale (the chunk lies in one 128 x 128 block of kv_b), fused as the GEMV family does."""
    if w.dtype == tl.float8e4nv:
        s = tl.load(s_ptr + ((h * (DN + DV) + d0) // 128) * tl.cdiv(C, 128) + c0 // 128)
        return tl.fma(_dot_x(tl.zeros(acc.shape, dtype=tl.float32), w.to(tl.float16), xt), s, acc)
    else:
        return _dot_x(acc, w, xt)


@triton.jit
def mla_absorb_finish(w0, kv_b, s_ptr, q, stride_q, qlat, rows, h, c0, NH: tl.constexpr, DN: tl.constexpr,
                      DV: tl.constexpr, C: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_C: tl.constexpr,
                      CK: tl.constexpr):
    """qlat[r, h, c0 + j] = sum_d q[r, h, d] W_UK,h[d, c0 + j] for r < rows (fp32, unscaled).
    q: bf16/fp32 [rows, NH, DN] with row stride stride_q (.cg: written by other CTAs). kv_b bf16, or FP8
    e4m3 with s_ptr its fp32 block scales [cdiv(NH (DN + DV), 128), cdiv(C, 128)] (ignored for bf16)."""
    tl.static_assert(DN % CK == 0, "CK must divide DN")
    if w0.dtype == tl.float8e4nv:
        tl.static_assert((DN % 128 == 0) & (DV % 128 == 0), "FP8 kv_b: head parts must be whole 128-row blocks")
        tl.static_assert((128 % CK == 0) & (128 % BLOCK_C == 0), "FP8 kv_b: a chunk lies in one scale block")
    r = tl.arange(0, ROWS_PAD)
    rm = r < rows
    acc = tl.zeros([BLOCK_C, ROWS_PAD], dtype=tl.float32)
    for i in tl.static_range(DN // CK):
        d = i * CK + tl.arange(0, CK)
        xt = tl.load(q + r[None, :] * stride_q + h * DN + d[:, None], mask=rm[None, :], other=0.0,
                     cache_modifier=".cg")                                  # [CK, ROWS_PAD]
        if i == 0:
            acc = _wuk_chunk(acc, w0, xt, s_ptr, h, 0, c0, DN, DV, C)
        else:
            w = _load_wuk_t(kv_b, h, i * CK, c0, DN, DV, C, BLOCK_C, CK)
            acc = _wuk_chunk(acc, w, xt, s_ptr, h, i * CK, c0, DN, DV, C)
    c = c0 + tl.arange(0, BLOCK_C)
    tl.store(qlat + r[None, :] * (NH * C) + h * C + c[:, None], acc, mask=rm[None, :])


# ---------------------------------------------------------------------------- attend
@triton.jit
def _dot_any(acc, a, bt):
    """acc [M, N] += a [M, K] @ bt [K, N], bt fp32: a bf16 via the GEMV family's MMA (bt split hi + lo),
    a fp32 via tf32x3 (a per-element product sum under the interpreter, whose fp32 dot is BLAS)."""
    if a.dtype == tl.float32:
        if _interpreting():
            return acc + tl.sum(a[:, :, None] * bt[None, :, :], axis=1)
        else:
            return tl.dot(a, bt, acc, input_precision="tf32x3")
    else:
        return _dot_x(acc, a, bt)


@triton.jit
def _dot_split(acc, a, bt, bt_hi, bt_lo):
    """_dot_any with bt split into bf16 hi + lo once by the caller (outside its loop): a 16-bit a takes
    the two MMAs of the split (the same sum as _dot_x), an fp32 a the fp32 bt."""
    if a.dtype == tl.float32:
        return _dot_any(acc, a, bt)
    else:
        return _mma(a, bt_lo.to(a.dtype), _mma(a, bt_hi.to(a.dtype), acc))


@triton.jit
def mla_attend(qlat, idx, latent, pm, pl, pacc, h0, s, t0, t1, n_sel, n_splits, scale, NH: tl.constexpr,
               C: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr):
    """Partial softmax attention of heads [h0, h0 + HB) of one row over its selected tokens [t0, t1)
    (of n_sel valid ones) -> split s of the row's partials pm/pl [NH, n_splits], pacc [NH, n_splits, C].
    qlat [NH, C] fp32 (the row's absorbed queries); idx [>= t1] int32; latent [max_len, C] (bf16/fp32)."""
    hh = h0 + tl.arange(0, HB)
    c = tl.arange(0, C)
    qt = tl.load(qlat + hh[None, :] * C + c[:, None], cache_modifier=".cg") * scale        # [C, HB]
    q_hi = qt.to(tl.bfloat16)                   # split once, not per tile: fewer live registers
    q_lo = (qt - q_hi.to(tl.float32)).to(tl.bfloat16)
    m = tl.full([HB], float("-inf"), dtype=tl.float32)
    l = tl.zeros([HB], dtype=tl.float32)
    acc = tl.zeros([C, HB], dtype=tl.float32)                               # acc^T
    t1 = tl.minimum(t1, n_sel)
    t = t0
    while t < t1:
        offs = t + tl.arange(0, BLOCK_T)
        tok = tl.load(idx + offs, mask=offs < t1, other=-1, cache_modifier=".cg")
        ok = tok >= 0
        lat = tl.load(latent + tl.maximum(tok, 0).to(tl.int64)[:, None] * C + c[None, :], mask=ok[:, None],
                      other=0.0)                                             # [BLOCK_T, C]
        st = _dot_split(tl.zeros([BLOCK_T, HB], dtype=tl.float32), lat, qt, q_hi, q_lo)    # [BLOCK_T, HB]
        st = tl.where(ok[:, None], st, float("-inf"))
        m_new = tl.maximum(m, tl.max(st, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(st - m_safe[None, :])                                    # 0 where masked
        l = l * alpha + tl.sum(p, axis=0)
        acc = _dot_any(acc * alpha[None, :], tl.trans(lat), p)              # [C, HB]
        m = m_new
        t += BLOCK_T
    tl.store(pm + hh * n_splits + s, m)
    tl.store(pl + hh * n_splits + s, l)
    tl.store(pacc + (hh[None, :] * n_splits + s) * C + c[:, None], acc)


@triton.jit
def mla_attend_tile(qlat, idx, latent, pm, pl, pacc, h0, s, t0, n_sel, n_splits, scale, NH: tl.constexpr,
                    C: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr, CK: tl.constexpr, t_hi):
    """Split s = the one token tile [t0, t0 + BLOCK_T) of heads [h0, h0 + HB): the same partials as
    mla_attend over that tile, in CK-wide column chunks for registers. The tile's token ids load once;
    pass 1 scores every [BLOCK_T, CK] latent chunk against the matching q~ chunk, the scores stay in
    registers; pass 2 re-reads each chunk (now in L1 / L2) for its acc chunk. Both passes are cp.async
    pipelines (ATT_STAGES chunks in flight): unrolled, each chunk's product went through shared memory
    behind barriers, so its loads waited for the chunk before (the sm_90 SASS: one round trip a chunk and
    pass, ~11.5 us of the launches' attend task on the H200). A multi-tile loop costs two trips per tile
    and chunk (measured: 98 us for 4 tiles x 16 chunks on the H200). Token ids clamp to t_hi: the row's position
    (no selected id is larger), or -1, which masks every gather off (a launch's dry run: the code runs, on
    whatever idx holds, and reads no latent row)."""
    tl.static_assert(C % CK == 0, "CK must divide C")
    hl = tl.arange(0, HB)
    hh = h0 + hl
    offs = t0 + tl.arange(0, BLOCK_T)
    tok = tl.minimum(tl.load(idx + offs, mask=offs < n_sel, other=-1, cache_modifier=".cg"), t_hi)
    ok = tok >= 0
    rowp = latent + tl.maximum(tok, 0).to(tl.int64)[:, None] * C
    st = tl.zeros([BLOCK_T, HB], dtype=tl.float32)
    for i in tl.range(0, C // CK, num_stages=ATT_STAGES):
        cc = i * CK + tl.arange(0, CK)
        lat = tl.load(rowp + cc[None, :], mask=ok[:, None], other=0.0)                       # [BLOCK_T, CK]
        qt = tl.load(qlat + hh[None, :] * C + cc[:, None], cache_modifier=".cg") * scale      # [CK, HB]
        st = _dot_any(st, lat, qt)
    st = tl.where(ok[:, None], st, float("-inf"))
    m = tl.max(st, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    p = tl.exp(st - m_safe[None, :])                                        # 0 where masked
    for i in tl.range(0, C // CK, num_stages=ATT_STAGES):
        cc = i * CK + tl.arange(0, CK)
        lat = tl.load(rowp + cc[None, :], mask=ok[:, None], other=0.0)
        acc = _dot_any(tl.zeros([CK, HB], dtype=tl.float32), tl.trans(lat), p)                # [CK, HB]
        tl.store(pacc + (hh[None, :] * n_splits + s) * C + cc[:, None], acc)
    tl.store(pm + hh * n_splits + s, m)
    tl.store(pl + hh * n_splits + s, tl.sum(p, axis=0))


# ---------------------------------------------------------------------------- join + out
@triton.jit
def mla_out_prefetch(kv_b, h, n0, DN: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BLOCK_N: tl.constexpr,
                     PF_K: tl.constexpr):
    """The first PF_K columns of W_UV,h rows [n0, n0 + BLOCK_N): issue before waiting on the partials."""
    return gemv_prefetch(kv_b + (h.to(tl.int64) * (DN + DV) + DN) * C, n0, 0, C, DV, C, BLOCK_N, PF_K)


@triton.jit
def _join_tile(acc, pm, pacc, base, s0, n_splits, M, L, C: tl.constexpr, SB: tl.constexpr):
    """acc [C] += the weighted partials of splits [s0, s0 + SB) (weights e / L, as mla_join_out's)."""
    ss = s0 + tl.arange(0, SB)
    ls = ss < n_splits
    m_c = tl.load(pm + base + ss, mask=ls, other=float("-inf"), cache_modifier=".cg")
    w_c = tl.exp(m_c - M) / L
    a = tl.load(pacc + (base + ss)[:, None] * C + tl.arange(0, C)[None, :], mask=ls[:, None], other=0.0,
                cache_modifier=".cg")                                                   # [SB, C]
    return acc + tl.sum(a * w_c[:, None], axis=0)


@triton.jit
def mla_join_ctx(pm, pl, pacc, stride_part, ctx, rows, h, n_splits, C: tl.constexpr, NS_PAD: tl.constexpr,
                 SB: tl.constexpr):
    """Join head h's splits for every row into ctx (this task's fp32 scratch [ROWS_PAD, C]). pm/pl/pacc: row
    r's partials at + r * stride_part (mla_attend's layout). The split maxima and sums load as one [NS_PAD] vector
    (NS_PAD >= n_splits); pacc streams as [SB, C] tiles of SB whole splits through a cp.async pipeline.
    A tile's layout keeps a column's SB splits in one thread (16-byte copies along C fill the 4 warps'
    128 threads at C = 512), so the split sum is a thread's own adds: no shuffle, no barrier, and the
    next tiles' copies stay in flight (a [NS_PAD, JC] tile summed across warps cost two barriers a chunk:
    16 serial steps, the join task's ~16 us traced on the H200). The order is fixed (tiles in split order,
    each tile's SB splits in order; pads weigh 0): deterministic, and the same for any rows."""
    sv = tl.arange(0, NS_PAD)
    live = sv < n_splits
    cc = tl.arange(0, C)
    r = 0
    while r < rows:
        base = r * stride_part + h * n_splits
        m_s = tl.load(pm + base + sv, mask=live, other=float("-inf"), cache_modifier=".cg")
        M = tl.max(m_s, axis=0)                                  # split 0 always holds the token pos: finite
        e = tl.exp(m_s - M)                                      # 0 for pads and empty splits
        L = tl.sum(tl.load(pl + base + sv, mask=live, other=0.0, cache_modifier=".cg") * e, axis=0)
        acc = tl.zeros([C], dtype=tl.float32)
        if _interpreting():     # the interpreter's program ids are 1-element arrays that `range` rejects
            s0 = 0
            while s0 < n_splits:
                acc = _join_tile(acc, pm, pacc, base, s0, n_splits, M, L, C, SB)
                s0 += SB
        else:
            for s0 in tl.range(0, n_splits, SB, num_stages=3):     # 2 tiles (32 KB) in flight
                acc = _join_tile(acc, pm, pacc, base, s0, n_splits, M, L, C, SB)
        tl.store(ctx + r * C + cc, acc)
        r += 1


@triton.jit
def mla_out_ctx(w0, kv_b, s_ptr, ctx, out, stride_o, rows, h, n0, DN: tl.constexpr, DV: tl.constexpr,
                C: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PF_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """out[r, h, n0:n0+BLOCK_N] = W_UV,h ctx_r (ctx from mla_join_ctx; out [rows, NH, DV], row stride
    stride_o). kv_b bf16, or FP8 with s_ptr its block scales (as mla_absorb_finish; FP8 needs PF_K == 128,
    BLOCK_K % 128 == 0)."""
    tl.debug_barrier()                          # ctx rows stored by every thread, read back by every warp
    w_uv = kv_b + (h.to(tl.int64) * (DN + DV) + DN) * C
    s_uv = s_ptr + ((h * (DN + DV) + DN) // 128) * tl.cdiv(C, 128)     # W_UV,h's scale rows (FP8 only)
    acc = gemv_finish(w0, w_uv, s_uv, ctx, C, rows, n0, 0, C, DV, C, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
    gemv_store(out + h * DV, stride_o, acc, rows, n0, DV, ROWS_PAD, BLOCK_N)


@triton.jit
def mla_join_out(w0, kv_b, s_ptr, pm, pl, pacc, stride_part, ctx, out, stride_o, rows, h, n0, n_splits,
                 NH: tl.constexpr, DN: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, ROWS_PAD: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                 NS_PAD: tl.constexpr, SB: tl.constexpr):
    """mla_join_ctx then mla_out_ctx: head h's splits joined for every row, then its W_UV tile."""
    mla_join_ctx(pm, pl, pacc, stride_part, ctx, rows, h, n_splits, C, NS_PAD, SB)
    mla_out_ctx(w0, kv_b, s_ptr, ctx, out, stride_o, rows, h, n0, DN, DV, C, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K,
                NUM_STAGES)


# ---------------------------------------------------------------------------- test kernels
@triton.jit
def mla_absorb_kernel(q, kv_b, s_kv, qlat, rows, NH: tl.constexpr, DN: tl.constexpr, DV: tl.constexpr,
                      C: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_C: tl.constexpr, CK: tl.constexpr):
    """Grid (NH, C // BLOCK_C): one absorb task, all rows."""
    h = tl.program_id(0)
    c0 = tl.program_id(1) * BLOCK_C
    w0 = mla_absorb_prefetch(kv_b, h, c0, DN, DV, C, BLOCK_C, CK)
    mla_absorb_finish(w0, kv_b, s_kv, q, NH * DN, qlat, rows, h, c0, NH, DN, DV, C, ROWS_PAD, BLOCK_C, CK)


@triton.jit
def mla_attend_kernel(qlat, idx, latent, positions, pm, pl, pacc, stride_lat, width, n_splits, tpt, scale, TOPK,
                      NH: tl.constexpr, C: tl.constexpr, KP: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr,
                      CK: tl.constexpr):
    """Grid (rows, NH // HB, n_splits): one attend task; slot = row. CK < C: the one-tile chunked form
    (tpt == BLOCK_T)."""
    r = tl.program_id(0)
    h0 = tl.program_id(1) * HB
    s = tl.program_id(2)
    pos = tl.load(positions + r)
    P = (pos + 1) // KP
    n_sel = tl.minimum(P, TOPK) * KP + pos + 1 - P * KP
    part = r * NH * n_splits
    if CK == C:
        mla_attend(qlat + r * NH * C, idx + r * width, latent + r.to(tl.int64) * stride_lat, pm + part, pl + part,
                   pacc + part.to(tl.int64) * C, h0, s, s * tpt, s * tpt + tpt, n_sel, n_splits, scale, NH, C, HB,
                   BLOCK_T)
    else:
        mla_attend_tile(qlat + r * NH * C, idx + r * width, latent + r.to(tl.int64) * stride_lat, pm + part,
                        pl + part, pacc + part.to(tl.int64) * C, h0, s, s * tpt, n_sel, n_splits, scale, NH, C, HB,
                        BLOCK_T, CK, pos)


@triton.jit
def mla_out_kernel(kv_b, s_kv, pm, pl, pacc, ctx, out, rows, n_splits, NH: tl.constexpr, DN: tl.constexpr,
                   DV: tl.constexpr, C: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NS_PAD: tl.constexpr, SB: tl.constexpr):
    """Grid (NH, DV // BLOCK_N): one join + out task, all rows; ctx scratch per task."""
    h = tl.program_id(0)
    nb = tl.program_id(1)
    w0 = mla_out_prefetch(kv_b, h, nb * BLOCK_N, DN, DV, C, BLOCK_N, PF_K)
    task = h * tl.num_programs(1) + nb
    mla_join_out(w0, kv_b, s_kv, pm, pl, pacc, NH * n_splits, ctx + task * ROWS_PAD * C, out, NH * DV, rows, h,
                 nb * BLOCK_N, n_splits, NH, DN, DV, C, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, 2, NS_PAD, SB)


def att_chunk(block_t: int, C: int) -> int:
    """CK of mla_attend_tile for a BLOCK_T tile: [BLOCK_T, CK] latent chunks of 2048 values (measured
    offline, 4 warps: (32, 64) 116 registers, (64, 32) 152; (32, 32) spilled 4 B at 72)."""
    return max(1, min(C, 2048 // block_t))


def join_chunk(n_splits: int, C: int) -> tuple[int, int]:
    """(NS_PAD, SB) of mla_join_out for n_splits: the padded split axis, and the splits per pacc tile that
    keep one [SB, C] fp32 tile at 4096 values (32 registers a thread at 4 warps), SB <= NS_PAD."""
    ns_pad = triton.next_power_of_2(max(n_splits, 2))
    return ns_pad, max(1, min(ns_pad, 4096 // triton.next_power_of_2(C)))


# ---------------------------------------------------------------------------- host wrapper (tests)
def mla_decode(q, kv_b, latent, idx, positions, cfg, split: AttentionSplit, *, rows_pad: int = 8,
               block_c: int = 64, block_n: int = 32, chunk_c: int | None = None, kv_b_scale=None):
    """One decode token per row through the three task stages (one launch each, one program per task).

    q [rows, nh, dn] (bf16/fp32); kv_b [nh (dn + dv), C] bf16; latent [rows, max_len, C] (row r's slot,
    bf16/fp32); idx [rows, WIDTH] int32 (indexer selection, -1 padded); positions [rows] int32.
    chunk_c: None for the online-softmax attend task, else the one-tile task's column chunk CK (then
    split.tokens_per_task must equal split.block_t).
    kv_b FP8 e4m3: kv_b_scale its fp32 block scales (fp8.quantize_fp8's grid).
    Returns dict: out [rows, nh, dv] fp32, qlat, pm, pl, pacc (partials), all NaN-poisoned first."""
    rows, nh, dn = q.shape
    C, dv = latent.shape[-1], cfg.v_head_dim
    if nh % split.heads_per_task or split.tokens_per_task % split.block_t or rows > rows_pad:
        raise ValueError(f"bad split {split} for {nh} heads / rows {rows} > rows_pad {rows_pad}")
    if chunk_c is not None and split.tokens_per_task != split.block_t:
        raise ValueError(f"split {split}: the chunked attend task takes one tile (tokens_per_task == block_t)")
    if split.tokens_per_task * split.n_splits < idx.shape[1]:
        raise ValueError(f"split {split} covers fewer than the {idx.shape[1]} index slots")
    if C % block_c or dv % block_n:
        raise ValueError(f"block_c={block_c} must divide C={C}, block_n={block_n} must divide dv={dv}")
    dev, nan, S = q.device, float("nan"), split.n_splits
    o = dict(qlat=torch.full((rows, nh, C), nan, device=dev), pm=torch.full((rows, nh, S), nan, device=dev),
             pl=torch.full((rows, nh, S), nan, device=dev), pacc=torch.full((rows, nh, S, C), nan, device=dev),
             out=torch.full((rows, nh, dv), nan, device=dev))
    ctx = torch.full((nh * (dv // block_n), rows_pad, C), nan, device=dev)
    q = q.contiguous()
    ck = min(dn, 64)
    s_kv = kv_b if kv_b_scale is None else kv_b_scale
    mla_absorb_kernel[(nh, C // block_c)](q, kv_b, s_kv, o["qlat"], rows, NH=nh, DN=dn, DV=dv, C=C,
                                          ROWS_PAD=rows_pad, BLOCK_C=block_c, CK=ck)
    grid = (rows, nh // split.heads_per_task, S)
    mla_attend_kernel[grid](
        o["qlat"], idx, latent, positions, o["pm"], o["pl"], o["pacc"], latent.stride(0), idx.shape[1], S,
        split.tokens_per_task, cfg.qk_head_dim ** -0.5, cfg.index_topk_pools, NH=nh, C=C, KP=cfg.index_kpool,
        HB=split.heads_per_task, BLOCK_T=split.block_t, CK=chunk_c or C)
    pf = min(C, 128)
    ns_pad, sb = join_chunk(S, C)
    mla_out_kernel[(nh, dv // block_n)](kv_b, s_kv, o["pm"], o["pl"], o["pacc"], ctx, o["out"], rows, S, NH=nh, DN=dn,
                                        DV=dv, C=C, ROWS_PAD=rows_pad, BLOCK_N=block_n, BLOCK_K=pf, PF_K=pf,
                                        NS_PAD=ns_pad, SB=sb)
    return o
