"""kpool indexer task family (DSA layers): pooled index keys, pool scores and a multi-task top-k
selection, as `@triton.jit` device functions. Spec: reference/ops.py layer_norm, indexer_pool,
indexer_scores, topk_lower_index, indexer_select (research/model.md §3.2).

Pool key task (`idx_pool_task`, one per row): LayerNorm the raw wk row (with bias, eps 1e-6), store
[key | gate] as tail row pos % KP (fp32, as reference/caches.py), and when the token completes its pool
((pos + 1) % KP == 0) form the pooled key: per channel, softmax over the KP members of (gate + ape),
weighting the keys (fp32 throughout, as the reference; HF's bf16 cast of the probabilities is left out).
The fresh row is used from registers, the KP - 1 older rows are read back: no read of a word written
in the same step. Writing in place is still all-or-nothing (DESIGN.md §6): ring row pos % KP only ever
held token pos - KP, whose pool completed at or before pos - 1, and pool pos // KP is new.

Scoring task (`idx_score_pools`, pools [p0, p1) of one row; the split is a runtime parameter):
score_p = sum_h (w_h NH^-0.5) ReLU(iq_h . pk_p D^-0.5). One tensor-core product per BLOCK_P pools,
acc[BLOCK_P, NH] = pk[BLOCK_P, D] @ iq^T[D, NH] (bf16 keys: iq split hi + lo as the GEMV family does;
fp32 keys: tf32x3), then the per-head epilogue (scale, ReLU, weight, sum over NH in registers) - the
part seed 000 found to bind, so the head sum runs once per tile on the accumulator, nothing is stored
per head. A pool's bits depend only on its position inside its BLOCK_P-aligned tile, so any split into
BLOCK_P multiples gives the same scores.

Top-k over up to 32768 pools (positions up to 131071), multi-task and deterministic (ties toward the
lower pool index, as torch's stable sort in the reference): a radix select on the fp32 bits.
  key   = order-preserving int32 of the score (-0.0 folded into +0.0, so it ties with +0.0 as in torch).
  pass j (j = 0 .. PASSES-1, digit = BITS bits of the unsigned key from the top; BITS 8 -> 4 passes,
         11 -> 3 passes of 11, 11, 10 bits): every selection task t histograms the digit of its pools
         whose higher digits equal the prefix chosen so far -> hist[j, t, :] (int32 counts).
  join  (`_join_from`, run redundantly by every task that needs it, no hop of its own): add the
         task histograms (integers: exact in any order), take the highest digit whose count from the
         top reaches the k still needed, subtract the count strictly above it; it starts from the join
         of the earlier passes that task 0 of the previous pass stored (`state`). After the last pass the
         k-th key T is known exactly, with need = how many keys equal to T are taken, and per task
         gt_t = its keys > T and eq_t = its keys == T.
  write (`topk_write`): task t takes its keys > T and its ties == T whose tie rank (ties of tasks
         < t, then index order inside t) is < need, and stores them at fixed positions: base_t = the
         number selected by tasks < t (a prefix over tasks of gt_t + its taken ties) plus the rank
         inside the task (a cumsum). So the pools come out in ascending index order - the reference's
         order - each expanded to its KP tokens, then the tail tokens [KP * P, pos], then -1 up to
         WIDTH = topk_tokens + KP - 1 (written by task 0). Every output word is written exactly once.
  While P <= TOPK (the dense regime) every pool is selected: `topk_write` skips the join and the
  histogram passes are not needed. The score task of range t can run hist pass 0 itself (after its
  score stores and a CTA barrier) when the score and selection splits agree, so a launch pays PASSES
  hops after the scores (one per further pass, one before the write).
The result is the reference's selection exactly (same order) whenever the scores are the same bits.

Registers (sm_90, Triton 3.6's bundled ptxas offline: tests/test_kernels_mla.py test_offline_sm90_registers;
4 warps, NH = 32, D = 128, no spills): pool task 32; scoring BLOCK_P = 64: 128 (117 at 8 warps; 32 -> 254);
hist pass BITS = 8, BLOCK = 1024: 64; write BITS = 8, T_MAX = 16, BLOCK = 1024: 138 (the joins' [T_MAX, 2^BITS]
histogram tiles; 72 while they walked the tasks row by row, at ~30x the round trips). BITS = 8 (4 passes):
an 11-bit digit would make those tiles 8x larger.

Layouts (per row; the caller offsets pointers to the row / slot):
  kraw, graw [D]       wk x and the kpool gate projection (bf16/fp32; GEMV outputs)
  tail [KP, 2D] fp32   ring of [LayerNorm'd key | gate];  pool_keys [Pmax, D] (fp32/bf16)
  iq [NH, D], w [NH]   index queries and raw weights_proj output (bf16/fp32)
  scores [>= P] fp32;  hist [PASSES, T_MAX, 2^BITS] int32;  out [WIDTH] int32 token indices
  state [PASSES, T_MAX + 2] int32   row j: the join of passes 0 .. j (prefix, k_rem, gt per task), by task 0
                                    of pass j + 1, so each later task joins one pass, not all before it

Device API (constexprs in CAPS):
  idx_pool_task(kraw, graw, ln_w, ln_b, ape, tail, pool_keys, pos, eps, D, KP)
  (= idx_pool_prefetch(ln_w, ln_b, ape, tail, pos, D, KP), issued before a wait, then
     idx_pool_finish(x, g, <its four tensors>, ape, tail, pool_keys, pos, eps, D, KP) on the raw rows)
  idx_score_pools(iq, w, pool_keys, scores, p0, p1, NH, D, BLOCK_P)
  topk_hist_pass(scores, hist, state, t, j, chunk, P, TOPK, T_MAX, BITS, BLOCK)    # j = 0 .. PASSES-1
  topk_write(scores, hist, state, out, t, chunk, P, pos, TOPK, KP, WIDTH, T_MAX, BITS, BLOCK, live)
  (live = 0: the same code runs and stores nothing; a launch warms the code that way before its wait)
  (task t covers pools [t * chunk, min((t + 1) * chunk, P)); max(1, cdiv(P, chunk)) <= T_MAX tasks)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import _dot_x, _interpreting

INDEX_LAYERNORM_EPS = 1e-6           # reference/ops.py INDEX_LAYERNORM_EPS
_MIN_I32 = tl.constexpr(-2147483648)


# ---------------------------------------------------------------------------- pool keys
@triton.jit
def idx_pool_prefetch(ln_w, ln_b, ape, tail, pos, D: tl.constexpr, KP: tl.constexpr):
    """What the pool key task reads besides its raw row, all written before this launch (the LayerNorm
    weights, ape, the slot's ring rows of the open pool's earlier tokens): issued before the caller's wait.
    -> (ln_w, ln_b [D], old keys, old gates + ape [KP, D]; the ring rows only when pos completes its pool,
    the fresh row's entries 0)."""
    c = tl.arange(0, D)
    j = tl.arange(0, KP)
    ring = (j < KP - 1)[:, None] & (pos % KP == KP - 1)
    old = tail + j[:, None] * 2 * D + c[None, :]
    keys = tl.load(old, mask=ring, other=0.0)
    z = tl.load(old + D, mask=ring, other=0.0) + tl.load(ape + j[:, None] * D + c[None, :]).to(tl.float32)
    return tl.load(ln_w + c).to(tl.float32), tl.load(ln_b + c).to(tl.float32), keys, z


@triton.jit
def idx_pool_finish(x, g, lw, lb, keys, z, ape, tail, pool_keys, pos, eps, D: tl.constexpr, KP: tl.constexpr,
                    live=1):
    """The pool key task on the raw key x and gate g [D] fp32 (idx_pool_prefetch's outputs beside them).
    live == 0: every store masked off (a launch's dry run: the caches are written in place)."""
    c = tl.arange(0, D)
    mean = tl.sum(x, axis=0) / D
    xc = x - mean
    var = tl.sum(xc * xc, axis=0) / D
    k = xc / tl.sqrt(var + eps) * lw + lb
    slot = pos % KP
    tl.store(tail + slot * 2 * D + c, k, mask=(c < D) & (live != 0))
    tl.store(tail + slot * 2 * D + D + c, g, mask=(c < D) & (live != 0))
    if slot == KP - 1:
        j = tl.arange(0, KP)
        fresh = (j == KP - 1)[:, None]
        keys = tl.where(fresh, k[None, :], keys)                                        # [KP, D]
        z = tl.where(fresh, g[None, :] + tl.load(ape + (KP - 1) * D + c).to(tl.float32)[None, :], z)
        e = tl.exp(z - tl.max(z, axis=0)[None, :])
        p = e / tl.sum(e, axis=0)[None, :]
        pk = tl.sum(p * keys, axis=0)                                      # [D]
        tl.store(pool_keys + (pos // KP).to(tl.int64) * D + c, pk.to(pool_keys.dtype.element_ty),
                 mask=(c < D) & (live != 0))


@triton.jit
def idx_pool_task(kraw, graw, ln_w, ln_b, ape, tail, pool_keys, pos, eps, D: tl.constexpr, KP: tl.constexpr):
    """LayerNorm'd key and gate of token `pos` -> tail row pos % KP; the pooled key when it completes
    pool pos // KP. tail [KP, 2D] fp32 (the slot's ring), pool_keys [Pmax, D] (the slot's, any float).
    One round trip: the prefetch's loads and the raw row's together."""
    c = tl.arange(0, D)
    lw, lb, keys, z = idx_pool_prefetch(ln_w, ln_b, ape, tail, pos, D, KP)
    x = tl.load(kraw + c, cache_modifier=".cg").to(tl.float32)
    g = tl.load(graw + c, cache_modifier=".cg").to(tl.float32)
    idx_pool_finish(x, g, lw, lb, keys, z, ape, tail, pool_keys, pos, eps, D, KP)


# ---------------------------------------------------------------------------- scores
@triton.jit
def _dot_any(acc, a, bt):
    """acc [M, N] += a [M, K] @ bt [K, N]: a bf16/f16 via the GEMV family's MMA (bt fp32 split hi + lo),
    a fp32 via tf32x3 (a per-element product sum under the interpreter, whose fp32 dot is BLAS)."""
    if a.dtype == tl.float32:
        if _interpreting():
            return acc + tl.sum(a[:, :, None] * bt.to(tl.float32)[None, :, :], axis=1)
        else:
            return tl.dot(a, bt.to(tl.float32), acc, input_precision="tf32x3")
    else:
        return _dot_x(acc, a, bt)


@triton.jit
def idx_score_pools(iq, w, pool_keys, scores, p0, p1, NH: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr):
    """scores[p] for pools p in [p0, p1) of one row (p0 a multiple of BLOCK_P for split-independent bits).
    iq [NH, D], w [NH] (bf16/fp32, .cg: written by other CTAs); pool_keys [>= p1, D]; scores fp32."""
    h = tl.arange(0, NH)
    c = tl.arange(0, D)
    iqt = tl.load(iq + h[None, :] * D + c[:, None], cache_modifier=".cg").to(tl.float32)   # [D, NH]
    wh = tl.load(w + h, cache_modifier=".cg").to(tl.float32) * (NH ** -0.5)
    if _interpreting():
        p = p0
        while p < p1:
            _score_tile(pool_keys, scores, iqt, wh, p, p1, NH, D, BLOCK_P)
            p += BLOCK_P
    else:       # the pool keys stream through a cp.async pipeline: a serial loop paid ~1.6 us (one HBM trip) a tile
        for p in tl.range(p0, p1, BLOCK_P, num_stages=3):
            _score_tile(pool_keys, scores, iqt, wh, p, p1, NH, D, BLOCK_P)


@triton.jit
def _score_tile(pool_keys, scores, iqt, wh, p, p1, NH: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr):
    """scores of pools [p, min(p + BLOCK_P, p1)) (idx_score_pools)."""
    c = tl.arange(0, D)
    offs = p + tl.arange(0, BLOCK_P)
    m = offs < p1
    pk = tl.load(pool_keys + offs[:, None].to(tl.int64) * D + c[None, :], mask=m[:, None], other=0.0)
    acc = _dot_any(tl.zeros([BLOCK_P, NH], dtype=tl.float32), pk, iqt)                 # [BLOCK_P, NH]
    s = tl.maximum(acc * (D ** -0.5), 0.0)
    tl.store(scores + offs, tl.sum(s * wh[None, :], axis=1), mask=m)


# ---------------------------------------------------------------------------- top-k (radix select)
@triton.jit
def _key(s):
    """fp32 -> int32 whose signed order is the float order; -0.0 maps to +0.0's key (they tie)."""
    b = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _shift(j, BITS: tl.constexpr):
    return tl.maximum(32 - BITS * (j + 1), 0)


@triton.jit
def _join_from(hist, state, jj, n_tasks, k, T_MAX: tl.constexpr, BITS: tl.constexpr):
    """The join of passes 0 .. jj: the stored join of passes < jj (state row jj - 1, written by task 0 of pass
    jj; none for jj = 0) and pass jj's histograms of every task as one [T_MAX, 2^BITS] tile, both loads in
    one round trip. Returns (prefix: the chosen digits in unsigned-key bits, k_rem: keys still needed inside
    the chosen bin, gt [T_MAX]: per task keys above the bin, eq [T_MAX]: per task keys in pass jj's chosen
    bin). Integer sums only: exact, order-free. (Replaying every earlier pass's tile cost one dependent
    L2 trip and ~12 shared-memory round trips a pass: the write task's 19 us, traced on the H200.)"""
    NB: tl.constexpr = 1 << BITS
    SW: tl.constexpr = T_MAX + 2
    tt = tl.arange(0, T_MAX)
    d = tl.arange(0, NB)
    h = tl.load(hist + jj * T_MAX * NB + tt[:, None] * NB + d[None, :], mask=(tt < n_tasks)[:, None], other=0,
                cache_modifier=".cg")                                      # [T_MAX, NB]
    prev = state + (jj - 1) * SW
    has = jj > 0
    prefix = tl.load(prev, mask=has, other=0, cache_modifier=".cg")
    k_rem = tl.load(prev + 1, mask=has, other=k, cache_modifier=".cg")
    gt = tl.load(prev + 2 + tt, mask=has, other=0, cache_modifier=".cg")
    tot = tl.sum(h, axis=0)
    incl = tl.sum(tot, axis=0) - tl.cumsum(tot, axis=0) + tot           # count of digits >= d
    dstar = tl.sum((incl >= k_rem).to(tl.int32), axis=0) - 1
    k_rem -= tl.sum(tl.where(d > dstar, tot, 0), axis=0)
    gt += tl.sum(tl.where(d[None, :] > dstar, h, 0), axis=1)
    eq = tl.sum(tl.where(d[None, :] == dstar, h, 0), axis=1)
    prefix = prefix | (dstar << _shift(jj, BITS))
    return prefix, k_rem, gt, eq


@triton.jit
def _join_store(state, jj, prefix, k_rem, gt, T_MAX: tl.constexpr):
    """State row jj = the join of passes 0 .. jj (prefix, k_rem, gt [T_MAX])."""
    SW: tl.constexpr = T_MAX + 2
    row = state + jj * SW
    tl.store(row, prefix)
    tl.store(row + 1, k_rem)
    tl.store(row + 2 + tl.arange(0, T_MAX), gt)


@triton.jit
def topk_hist_pass(scores, hist, state, t, j, chunk, P, TOPK, T_MAX: tl.constexpr, BITS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Radix pass j of selection task t (pools [t * chunk, min((t + 1) * chunk, P))): histogram of digit j
    of the keys whose digits < j match the prefix chosen by passes < j -> hist[j, t, :]. Needs every
    task's hist[j - 1] and the join state of passes < j - 1 (one hop per pass); task 0 stores the join of
    passes < j as state row j - 1 for the next pass. Not needed while P <= TOPK."""
    NB: tl.constexpr = 1 << BITS
    n_tasks = tl.maximum(tl.cdiv(P, chunk), 1)
    prefix = 0 * P
    if j > 0:
        prefix, k_rem, gt, eq = _join_from(hist, state, j - 1, n_tasks, tl.minimum(P, TOPK), T_MAX, BITS)
        if t == 0:
            _join_store(state, j - 1, prefix, k_rem, gt, T_MAX)
    sh = _shift(j, BITS)
    hmask = tl.where(j == 0, 0, -1 << tl.minimum(32 - BITS * j, 31))       # bits of the digits above pass j
    acc = tl.zeros([NB], dtype=tl.int32)
    p1 = tl.minimum(t * chunk + chunk, P)
    p = t * chunk
    while p < p1:
        offs = p + tl.arange(0, BLOCK)
        m = offs < p1
        u = _key(tl.load(scores + offs, mask=m, other=0.0, cache_modifier=".cg")) ^ _MIN_I32    # unsigned bits
        m = m & (((u ^ prefix) & hmask) == 0)
        # a narrower last digit (BITS not dividing 32) also holds low bits of the one above: they are
        # fixed by the prefix, so the order inside the bin and prefix | digit stay right
        acc += tl.histogram((u >> sh) & (NB - 1), NB, mask=m)
        p += BLOCK
    tl.store(hist + (j * T_MAX + t) * NB + tl.arange(0, NB), acc)


@triton.jit
def topk_write(scores, hist, state, out, t, chunk, P, pos, TOPK, KP: tl.constexpr, WIDTH, T_MAX: tl.constexpr,
               BITS: tl.constexpr, BLOCK: tl.constexpr, live):
    """Selected pools of task t, expanded to tokens, at their final positions of out [WIDTH] (ascending
    pool order); task 0 also writes the tail tokens [KP * P, pos] and the -1 padding. Needs every task's
    hist of the last pass and the join state of the passes before it (unless P <= TOPK). live == 0: every
    store masked off (a dry run on whatever hist / state hold, whose ranks may point anywhere)."""
    PASSES: tl.constexpr = (32 + BITS - 1) // BITS
    n_tasks = tl.maximum(tl.cdiv(P, chunk), 1)
    k = tl.minimum(P, TOPK)
    p0 = t * chunk
    thr = _MIN_I32 + 0 * P                      # dense regime: every valid key is above
    need = 0 * P
    base = p0
    eq_before = 0 * P
    if P > TOPK:
        prefix, need, gt, eq = _join_from(hist, state, PASSES - 1, n_tasks, k, T_MAX, BITS)
        thr = prefix ^ _MIN_I32
        tt = tl.arange(0, T_MAX)
        eqb = tl.cumsum(eq, axis=0) - eq                                    # ties in tasks before
        sel = gt + tl.minimum(tl.maximum(need - eqb, 0), eq)
        base = tl.sum(tl.where(tt < t, sel, 0), axis=0)
        eq_before = tl.sum(tl.where(tt == t, eqb, 0), axis=0)
    p1 = tl.minimum(p0 + chunk, P)
    j = tl.arange(0, KP)
    run_eq = 0 * P
    run_sel = 0 * P
    p = p0
    while p < p1:
        offs = p + tl.arange(0, BLOCK)
        m = offs < p1
        key = _key(tl.load(scores + offs, mask=m, other=0.0, cache_modifier=".cg"))
        gtm = m & (key > thr)
        eqm = m & (key == thr)
        tie = eq_before + run_eq + tl.cumsum(eqm.to(tl.int32), axis=0) - 1
        selm = gtm | (eqm & (tie < need))
        rank = base + run_sel + tl.cumsum(selm.to(tl.int32), axis=0) - 1
        tl.store(out + rank[:, None] * KP + j[None, :], offs[:, None] * KP + j[None, :],
                 mask=(selm & (live != 0))[:, None])
        run_eq += tl.sum(eqm.to(tl.int32), axis=0)
        run_sel += tl.sum(selm.to(tl.int32), axis=0)
        p += BLOCK
    if t == 0:                                  # tail tokens, then padding
        start = k * KP
        n_tail = pos + 1 - P * KP
        wb = (start // BLOCK) * BLOCK
        while wb < WIDTH:
            w = wb + tl.arange(0, BLOCK)
            v = tl.where(w - start < n_tail, P * KP + (w - start), -1)
            tl.store(out + w, v, mask=(w >= start) & (w < WIDTH) & (live != 0))
            wb += BLOCK


def topk_passes(bits: int) -> int:
    return -(-32 // bits)


# ---------------------------------------------------------------------------- test kernels
@triton.jit
def idx_pool_kernel(kraw, graw, ln_w, ln_b, ape, tail, pool_keys, positions, stride_pk, eps,
                    D: tl.constexpr, KP: tl.constexpr):
    """Grid (rows,): one pool key task per row; slot = row."""
    r = tl.program_id(0)
    idx_pool_task(kraw + r * D, graw + r * D, ln_w, ln_b, ape, tail + r * KP * 2 * D,
                  pool_keys + r.to(tl.int64) * stride_pk, tl.load(positions + r), eps, D, KP)


@triton.jit
def idx_score_kernel(iq, w, pool_keys, scores, positions, stride_pk, stride_s, chunk, NH: tl.constexpr,
                     D: tl.constexpr, KP: tl.constexpr, BLOCK_P: tl.constexpr):
    """Grid (rows, tasks): scoring task over pools [t * chunk, (t + 1) * chunk) of the row's P pools."""
    r = tl.program_id(0)
    t = tl.program_id(1)
    P = (tl.load(positions + r) + 1) // KP
    idx_score_pools(iq + r * NH * D, w + r * NH, pool_keys + r.to(tl.int64) * stride_pk, scores + r * stride_s,
                    t * chunk, tl.minimum(t * chunk + chunk, P), NH, D, BLOCK_P)


@triton.jit
def topk_hist_kernel(scores, hist, state, positions, stride_s, j, chunk, TOPK, KP: tl.constexpr, T_MAX: tl.constexpr,
                     BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows, T_MAX): radix pass j; tasks past the row's task count do nothing."""
    r = tl.program_id(0)
    t = tl.program_id(1)
    P = (tl.load(positions + r) + 1) // KP
    PASSES: tl.constexpr = (32 + BITS - 1) // BITS
    if t < tl.maximum(tl.cdiv(P, chunk), 1):
        topk_hist_pass(scores + r * stride_s, hist + r * PASSES * T_MAX * (1 << BITS), state + r * PASSES * (T_MAX + 2),
                       t, j, chunk, P, TOPK, T_MAX, BITS, BLOCK)


@triton.jit
def topk_write_kernel(scores, hist, state, out, positions, stride_s, chunk, TOPK, WIDTH, live, KP: tl.constexpr,
                      T_MAX: tl.constexpr, BITS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows, T_MAX): the write task of every selection task of the row (live = 0: a dry run)."""
    r = tl.program_id(0)
    t = tl.program_id(1)
    pos = tl.load(positions + r)
    P = (pos + 1) // KP
    PASSES: tl.constexpr = (32 + BITS - 1) // BITS
    if t < tl.maximum(tl.cdiv(P, chunk), 1):
        topk_write(scores + r * stride_s, hist + r * PASSES * T_MAX * (1 << BITS), state + r * PASSES * (T_MAX + 2),
                   out + r * WIDTH, t, chunk, P, pos, TOPK, KP, WIDTH, T_MAX, BITS, BLOCK, live)


# ---------------------------------------------------------------------------- host wrappers (tests)
def pool_step(kraw, graw, ln_w, ln_b, ape, tail, pool_keys, positions, *, eps: float = INDEX_LAYERNORM_EPS):
    """One token per row: kraw, graw [rows, D]; tail [rows, KP, 2D] fp32 and pool_keys [rows, Pmax, D]
    (the rows' slots) are written in place; positions [rows] int32."""
    rows, D = kraw.shape
    KP = ape.shape[0]
    assert tail.shape == (rows, KP, 2 * D) and tail.dtype == torch.float32 and tail.is_contiguous()
    assert pool_keys.shape[0] == rows and pool_keys.shape[2] == D and pool_keys.stride(1) == D
    idx_pool_kernel[(rows,)](kraw.contiguous(), graw.contiguous(), ln_w, ln_b, ape, tail, pool_keys,
                             positions, pool_keys.stride(0), eps, D=D, KP=KP)


def score_pools(iq, w, pool_keys, positions, kpool: int, *, chunk: int = 64, block_p: int = 16):
    """Pool scores [rows, Pmax] fp32 (NaN past each row's P pools): iq [rows, NH, D], w [rows, NH]."""
    rows, NH, D = iq.shape
    if chunk % block_p:
        raise ValueError(f"chunk={chunk} must be a multiple of block_p={block_p}")
    Pmax = pool_keys.shape[1]
    P = (int(positions.max()) + 1) // kpool
    scores = torch.full((rows, Pmax), float("nan"), device=iq.device)
    idx_score_kernel[(rows, max(1, -(-P // chunk)))](iq.contiguous(), w.contiguous(), pool_keys, scores, positions,
                                                     pool_keys.stride(0), Pmax, chunk, NH=NH, D=D, KP=kpool,
                                                     BLOCK_P=block_p)
    return scores


def select(scores, positions, cfg, *, chunk: int = 64, bits: int = 8, block: int = 64, t_max: int | None = None,
           state_in=None):
    """Token indices [rows, index_width] int32 (-1 padded) of each row's selection from its pool scores
    [rows, >= P] fp32: the radix passes and the write, one launch (stage) each, one program per task.
    state_in = (hist, state): skip the passes and run the write dry (live = 0) on those tensors as they are,
    into a -7-filled out (tests: a dry write stores nothing whatever the histograms hold)."""
    rows = scores.shape[0]
    KP, TOPK, WIDTH = cfg.index_kpool, cfg.index_topk_pools, cfg.index_width
    P = (int(positions.max()) + 1) // KP
    n_tasks = max(1, -(-P // chunk))
    T_MAX = t_max or triton.next_power_of_2(n_tasks)
    if n_tasks > T_MAX or T_MAX & (T_MAX - 1):
        raise ValueError(f"{n_tasks} selection tasks do not fit T_MAX={T_MAX} (a power of two)")
    passes = topk_passes(bits)
    hist = torch.full((rows, passes, T_MAX, 1 << bits), -7, dtype=torch.int32, device=scores.device)
    state = torch.full((rows, passes, T_MAX + 2), -7, dtype=torch.int32, device=scores.device)
    out = torch.full((rows, WIDTH), -7, dtype=torch.int32, device=scores.device)
    scores = scores.contiguous()
    grid = (rows, T_MAX)
    if state_in is not None:
        hist, state = state_in
    elif P > TOPK:
        for j in range(passes):
            topk_hist_kernel[grid](scores, hist, state, positions, scores.stride(0), j, chunk, TOPK, KP=KP, T_MAX=T_MAX,
                                   BITS=bits, BLOCK=block)
    topk_write_kernel[grid](scores, hist, state, out, positions, scores.stride(0), chunk, TOPK, WIDTH,
                            int(state_in is None), KP=KP, T_MAX=T_MAX, BITS=bits, BLOCK=block)
    return out
