"""MoE task family (layers 3-44 and the MTP block): the router, the routed-expert gate|up slots and the
down tile that joins the k experts and the shared expert, as `@triton.jit` device functions.

Why this shape (DESIGN.md §5: routing happens inside the launch; expert tasks are static slots):
- Router, two steps. Partial tiles (router_prefetch / router_finish: BLOCK_E experts x one K range
  of H) compute fp32 logits
  of every row against the fp32 router weight [E, H] (4.7 MB at E = 288: one CTA would need tens of
  us, so E / BLOCK_E x n_parts tasks share it); each writes its logits partial part[p, r, e]. No
  float atomics: `router_select` adds the n_parts partials of a row in part order p = 0, 1, ... (bits
  fixed by n_parts), then sigmoid, + e_score_correction_bias, top-k with ties to the lower expert
  index, renormalised, x routed_scaling_factor, and writes the row's record: k expert ids (int32) and
  k weights (fp32). The router is replicated across TP ranks, so every rank computes the same record.
  `router_select` returns ids / weights in registers, so a launch may also call it redundantly in
  every expert slot (reading the partials) and drop the select hop: E + n_parts * E words a slot.
- Expert slot (row r, rank j, intermediate tile): reads e = ids[r, j] from the record, then streams
  expert e's gate and up tiles (kernels/mlp.py gateup_finish, i.e. the gemv.py device functions) and
  writes the clamped-SwiGLU activation act_e[r, j, i0 : i0 + BLOCK_I]. Its weights depend on the
  router's choice, so it has no prefetch split (its weights cannot be issued before the record wait).
- Down tile (row r, H tile): y[r, n0 : n0 + BLOCK_N] = sum_{j=0..k-1} w_j * (act_e[r, j] @ Wd_e_j^T)
  + act_s[r] @ Wd_shared^T, added in exactly that order (k = 0..7, then the shared expert), as
  reference/ops.py moe does (each routed mlp output times its weight, then summed in rank order).
  The routing weight scales the fp32 down output, after down, as the reference does: it never meets
  the bf16 activation hand-off. The shared expert's down weights are known before anything: the
  `moe_down_prefetch` chunk is issued before the wait (the task computes the shared part first, while
  the chunk is live, and adds it last). The routed experts' down weights depend only on the record,
  which is complete long before the activations are, so a launch can read the record first.
  Bits per row never depend on other rows (each row is its own GEMV): batch invariant. Cost: a task
  streams K + 1 down tiles for one row (the MMA's 8 columns carry that one row; the shared tile is
  re-read per row, from L2 after the first): bytes, not flops, decide it.
- The shared expert's gate|up is the dense gate|up tile (kernels/mlp.py) over all rows.

Expert weights: packed banks, not a pointer table. The checkpoint stores each expert as separate
tensors; the launch packs them once at load into w_gu [E, 2I, H] (expert e's gate_proj rows, then its
up_proj rows) and w_d [E, H, I], and an expert is base + e * stride (int64 offsets). FP8 scales pack
the same way: s_gu [E, 2I/128, H/128] (gate blocks then up blocks: FP8 needs I % 128 == 0 so no
block straddles gate and up) and s_d [E, H/128, I/128]. At TP > 1, I is the rank's shard (gate/up
rows and down columns of the rank) and y is a per-rank partial. Why not a pointer table: one base
pointer keeps the kernel's signature fixed for any E and works under the interpreter (which copies
tensor arguments, so raw addresses in a table would be wrong there). Ids are clamped to [0, E).

Router numerics: x (bf16/fp32) times fp32 weights. Compiled with bf16 x: W split into three bf16 parts
(hi + mid + lo = all 24 mantissa bits), three bf16 MMAs with exact products and fp32 accumulation;
with fp32 x a tl.dot with input_precision "tf32x3" (~fp32 products; plain tf32 would round the
weights to 10 bits and flip near-tied choices); under the interpreter a per-element fp32 product sum.
Either way each logit is computed on its own, in a fixed K order: deterministic and batch invariant.

Layouts (row-major): x [rows, H]; wr [E, H] fp32; bias [E] fp32; part [n_parts, rows, E] fp32;
ids [rows, K] int32, rw [rows, K] fp32; act_e [rows, K, I]; act_s [rows, I_s]; y [rows, H] fp32.

Device API (constexprs in CAPS):
  w0 = router_prefetch(wr, e0, k0, k1, E, H, BLOCK_E, CK)                      # before the wait on x
  lg = router_finish(w0, wr, x, stride_x, rows, e0, k0, k1, E, H, ROWS_PAD, BLOCK_E, CK, NUM_STAGES)
  router_store_partial(part + p * stride_p, lg, rows, e0, E, ROWS_PAD, BLOCK_E)   # part[p, r, e0 + i]
  ids, w = router_select(part + r * E, stride_p, n_parts, bias, E, scaling, K, E_PAD, K_PAD, RENORM)
  router_store_record(ids_out + r * K, rw_out + r * K, ids, w, K, K_PAD)
  a = expert_gateup(ids_rec, slot, E, w_gu, s_gu, x_row, i0, I, H, limit,
                    ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)       # [BLOCK_I, ROWS_PAD], column 0
  (or, selecting in the slot: e, _ = pick(ids, w, j, K_PAD); a = expert_gateup_at(e, w_gu, s_gu, x_row, ...))
  d0 = moe_down_prefetch(wd_s, n0, H, I_s, BLOCK_N, PF_K)                     # before the wait on act
  y_t = moe_down_finish(d0, wd_s, sd_s, act_s_row, ids_rec + r * K, rw_rec + r * K, act_e_row, w_d, s_d,
                        n0, E, H, I, I_s, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, K
                        [, K_PAD, ids, w])        # ids, w: router_select's, when the task selects itself
  (slot = r * K + j; x_row, act_s_row, act_e_row = the row's pointers; outputs via gemv_store, 1 row)
Prefetch split: router (router_prefetch), shared-expert down (moe_down_prefetch), shared gate|up
(mlp.gateup_prefetch); none for the routed experts' gate|up and down (their weights follow the record).

Registers (sm_90, Triton 3.6's bundled ptxas, offline: tests/test_kernels_moe.py test_offline_sm90_registers;
4 warps, 64-wide tiles, BLOCK_K 128, PF_K 128, 3 stages, no spills): router partial 64 (BLOCK_E 32,
CK 32), select 48, expert gate|up 144 bf16 / 128 FP8, MoE down 146 bf16 (2 stages: 114) / 120 FP8.
The two gate|up GEMVs per task (two prefetched chunks, two pipelines) cost the most; PF_K 64 with 2
stages brings the dense gate|up to 80 (kernels/mlp.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import FP8_BLOCK, GemvConfig, _chunk, _load_w, _mult16, gemv_finish, gemv_prefetch, gemv_store, gemv_stream
from .mlp import TEST_CFG, check_cfg, check_weight, gateup_finish, gateup_prefetch, mlp_gateup_kernel

ROUTER_DENOM_EPS = tl.constexpr(1e-20)      # reference/ops.py ROUTER_DENOM_EPS
LOW32 = tl.constexpr(0xFFFFFFFF)            # router_select's key: low word = 0xFFFFFFFF - expert index
KEY_MIN = tl.constexpr(-(2 ** 63))          # a removed expert's key
ROUTER_CK = 32      # router K step: 64 registers at BLOCK_E 32 (CK 64: 114), sm_90 offline compile


@triton.constexpr_function
def _interpreting():
    return bool(triton.knobs.runtime.interpret)


# ---------------------------------------------------------------------------- router
@triton.jit
def router_prefetch(wr, e0, k0, k1, E, H, BLOCK_E: tl.constexpr, CK: tl.constexpr):
    """wr[e0 : e0 + BLOCK_E, k0 : k0 + CK] fp32 (zero outside e < E, k < k1). No activation needed."""
    offs_e = e0 + tl.arange(0, BLOCK_E)
    offs_k = _mult16(k0) + tl.arange(0, CK)       # K ranges start and end on multiples of CK: 16-byte copies
    m = (offs_e[:, None] < E) & (offs_k[None, :] < _mult16(k1))
    return tl.load(wr + offs_e[:, None].to(tl.int64) * H + offs_k[None, :], mask=m, other=0.0)


@triton.jit
def _router_chunk(acc, w, x, stride_x, rows, k, k1, ROWS_PAD: tl.constexpr, CK: tl.constexpr):
    """acc [BE, R] += w [BE, CK] (fp32) @ x[:, k : k + CK]^T (as fp32)."""
    offs_r = tl.arange(0, ROWS_PAD)
    offs_k = _mult16(k) + tl.arange(0, CK)        # aligned, and the mask constant over 16 k (k1 too): x
    xm = (offs_k[:, None] < _mult16(k1)) & (offs_r[None, :] < rows)     # streams as cp.async copies, not per step
    xt = tl.load(x + offs_r[None, :] * stride_x + offs_k[:, None], mask=xm, other=0.0,
                 cache_modifier=".cg")                                          # [CK, R]
    if _interpreting():
        return acc + tl.sum(w[:, :, None] * xt.to(tl.float32)[None, :, :], axis=1)
    elif xt.dtype == tl.bfloat16:
        # bf16 x is exact in bf16, so split only W: w = hi + mid + lo, three bf16 parts (24 mantissa bits,
        # all of fp32's), each product exact, fp32 accumulation, small terms first. x then feeds the MMA in
        # bf16 as in the GEMV, and Triton's pipeliner streams it with the weights (cp.async); through the
        # tf32x3 form the converted x stayed a synchronous load in every K step.
        hi = w.to(tl.bfloat16)
        r1 = w - hi.to(tl.float32)
        mid = r1.to(tl.bfloat16)
        lo = (r1 - mid.to(tl.float32)).to(tl.bfloat16)
        acc = tl.dot(lo, xt, acc)
        acc = tl.dot(mid, xt, acc)
        return tl.dot(hi, xt, acc)
    else:
        return tl.dot(w, xt.to(tl.float32), acc, input_precision="tf32x3")


@triton.jit
def router_finish(w0, wr, x, stride_x, rows, e0, k0, k1, E, H, ROWS_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
                  CK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Logits of experts [e0, e0 + BLOCK_E) over k in [k0, k1): [BLOCK_E, ROWS_PAD] fp32, column r =
    row r (rows >= `rows` are 0). w0: router_prefetch's chunk at k0. CK-wide steps in K order."""
    acc = tl.zeros((BLOCK_E, ROWS_PAD), dtype=tl.float32)
    acc = _router_chunk(acc, w0, x, stride_x, rows, k0, k1, ROWS_PAD, CK)
    if _interpreting():
        k = k0 + CK
        while k < k1:
            w = router_prefetch(wr, e0, k, k1, E, H, BLOCK_E, CK)
            acc = _router_chunk(acc, w, x, stride_x, rows, k, k1, ROWS_PAD, CK)
            k += CK
    else:
        for k in tl.range(k0 + CK, k1, CK, num_stages=NUM_STAGES):
            w = router_prefetch(wr, e0, k, k1, E, H, BLOCK_E, CK)
            acc = _router_chunk(acc, w, x, stride_x, rows, k, k1, ROWS_PAD, CK)
    return acc


@triton.jit
def _slice_x(x, stride_x, r: tl.constexpr, rows, k, k1, ROWS_PAD: tl.constexpr, CK: tl.constexpr):
    """Row r's x[k : k + CK] (bf16 or fp32, as stored) as a [4, CK] tile, one copy a warp, in the layout of
    router_prefetch's [BLOCK_E, CK] tile (4 a thread, lanes along K, warps along the experts: the tile's row j sits
    in warp j % 4), so it meets w (viewed as [BLOCK_E / 4, 4, CK]) with no shared-memory conversion and no barrier. A
    [1, CK] load would get 1 element a thread and warps along K (Triton's coalescing spreads 128 elements over 128
    threads), and w would follow it into a cross-warp reduction; a [BLOCK_E, CK] broadcast load loads each address 8
    times a thread (no CSE). The offsets claim a contiguity of 4: a bf16 load would otherwise take 8 a thread."""
    offs_k = tl.max_contiguous(_mult16(k) + tl.arange(0, CK), 4)
    zero = tl.zeros([4, 1], tl.int32)
    m = (offs_k[None, :] + zero < _mult16(k1)) & (r < rows) & (r < ROWS_PAD)
    return tl.load(x + r * stride_x + offs_k[None, :] + zero, mask=m, other=0.0, cache_modifier=".cg")


@triton.jit
def _slice_x2(x, stride_x, r: tl.constexpr, rows, k0, k1, ROWS_PAD: tl.constexpr, CK: tl.constexpr):
    """Row r's two CK-wide x tiles at k0 and k0 + CK (_slice_x): a router partial's whole K range."""
    return (_slice_x(x, stride_x, r, rows, k0, k1, ROWS_PAD, CK),
            _slice_x(x, stride_x, r, rows, k0 + CK, k1, ROWS_PAD, CK))


@triton.jit
def _pick8(r, v0, v1, v2, v3, v4, v5, v6, v7):
    """v_r of eight same-shape tiles (r a runtime row index < 8): selects in registers, one copy of the row code."""
    a = tl.where(r == 0, v0, v1)
    b = tl.where(r == 2, v2, v3)
    c = tl.where(r == 4, v4, v5)
    d = tl.where(r == 6, v6, v7)
    return tl.where(r < 4, tl.where(r < 2, a, b), tl.where(r < 6, c, d))


@triton.jit
def router_slice_partial(part, w0, w1, x, stride_x, rows, e0, k0, k1, E, live, ROWS_PAD: tl.constexpr,
                         BLOCK_E: tl.constexpr, CK: tl.constexpr):
    """The slice form of a router partial: w0, w1 = router_prefetch's [BLOCK_E, CK] fp32 tiles at k0 and k0 + CK,
    the task's WHOLE K range [k0, k1) (k1 - k0 <= 2 CK), loaded before the task's wait; part[r, e0 + i] =
    w[i] . x[r, k0:k1] for r < rows in fp32 (per thread w0 * x + w1 * x over its 4 columns of each tile, then the
    warp's shuffle tree: the same code for every row, so a row's bits depend neither on the other rows nor on the
    row count). CK <= 128 keeps a tile's K inside one warp (no cross-warp step); every row's x is loaded before any
    row's sum (8 rows: one round trip), and the rows then run one loop body (one copy of the code: unrolled, 8
    rows' cold code cost the 8-row launch +4.8 us, H100). live = 0: a dry run that stores nothing (the caller's
    code warming, before its wait; x may be stale then). The step form (router_finish: CK-wide MMA steps after the
    wait, each weight split into three bf16 parts) spent 5.4 us of own time on the TP8 path (H100 trace)."""
    tl.static_assert(ROWS_PAD <= 8)
    tl.static_assert(CK <= 128)
    offs_e = e0 + tl.arange(0, BLOCK_E // 4)[:, None] * 4 + tl.arange(0, 4)[None, :]       # [BLOCK_E / 4, 4]
    w0 = tl.reshape(w0, [BLOCK_E // 4, 4, CK])          # row j = 4 i + (j % 4): the warp index last, as held
    w1 = tl.reshape(w1, [BLOCK_E // 4, 4, CK])
    xa0, xb0 = _slice_x2(x, stride_x, 0, rows, k0, k1, ROWS_PAD, CK)      # every row's x, loaded together
    xa1, xb1 = _slice_x2(x, stride_x, 1, rows, k0, k1, ROWS_PAD, CK)
    xa2, xb2 = _slice_x2(x, stride_x, 2, rows, k0, k1, ROWS_PAD, CK)
    xa3, xb3 = _slice_x2(x, stride_x, 3, rows, k0, k1, ROWS_PAD, CK)
    xa4, xb4 = _slice_x2(x, stride_x, 4, rows, k0, k1, ROWS_PAD, CK)
    xa5, xb5 = _slice_x2(x, stride_x, 5, rows, k0, k1, ROWS_PAD, CK)
    xa6, xb6 = _slice_x2(x, stride_x, 6, rows, k0, k1, ROWS_PAD, CK)
    xa7, xb7 = _slice_x2(x, stride_x, 7, rows, k0, k1, ROWS_PAD, CK)
    r = 0
    while r < tl.minimum(rows, ROWS_PAD):
        xa = _pick8(r, xa0, xa1, xa2, xa3, xa4, xa5, xa6, xa7).to(tl.float32)
        xb = _pick8(r, xb0, xb1, xb2, xb3, xb4, xb5, xb6, xb7).to(tl.float32)
        s = tl.sum(w0 * xa[None, :, :] + w1 * xb[None, :, :], axis=2)                # [BLOCK_E / 4, 4]
        tl.store(part + r * E + offs_e, s, mask=(offs_e < E) & (live != 0))   # 2-D, as s is held
        r += 1


@triton.jit
def router_store_partial(part, lg, rows, e0, E, ROWS_PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    """part[r, e0 + i] = lg[i, r] for r < rows, e0 + i < E (part: this K part's [rows, E] plane)."""
    offs_e = e0 + tl.arange(0, BLOCK_E)
    offs_r = tl.arange(0, ROWS_PAD)
    m = (offs_e[:, None] < E) & (offs_r[None, :] < rows)
    tl.store(part + offs_r[None, :] * E + offs_e[:, None], lg, mask=m)


@triton.jit
def _order_key(v, e):
    """int64 keys whose signed order is (v descending, e ascending): the float's bits made monotonic in
    the high word (negative floats flipped), 0xFFFFFFFF - e in the low word. One max over keys then
    gives the best value and, among equals, the lowest index."""
    b = v.to(tl.int32, bitcast=True)
    b = b ^ ((b >> 31) & 0x7FFFFFFF)
    return (b.to(tl.int64) << 32) | (LOW32 - e.to(tl.int64))


@triton.jit
def router_select(part, stride_p, n_parts, bias, E, scaling, K: tl.constexpr, E_PAD: tl.constexpr,
                  K_PAD: tl.constexpr, RENORM: tl.constexpr):
    """One row's routing from its logit partials (part: row r of part plane 0; planes stride_p apart).

    Returns ids [K_PAD] int32 (entries >= K are 0) and weights [K_PAD] fp32: the top-K of
    sigmoid(logit) + bias, ties to the lower expert index (the reference's stable descending sort),
    ordered by descending choice score; weights = sigmoid scores of the chosen experts / (their sum +
    1e-20) (RENORM) * scaling. Partials join in part order 0, 1, ..., n_parts - 1.

    Round trips: the bias and the planes are loaded together, 16 planes at a time (all loads issued, then the
    planes added in part order: a masked plane adds +0.0, which changes no bits), so up to 16 parts cost one
    dependent L2 round trip. Each pick is ONE CTA-wide reduction (max of _order_key: value and lowest index
    together) instead of three (max, argmin, gather); the weights are gathered once after the loop."""
    b = router_bias(bias, E, E_PAD)
    logit = router_logits(part, stride_p, n_parts, E, E_PAD)
    return router_topk(logit, b, E, scaling, K, E_PAD, K_PAD, RENORM)


@triton.jit
def router_bias(bias, E, E_PAD: tl.constexpr):
    """The routing bias [E_PAD] fp32 (0 past E): load it before router_logits, so its round trip is the planes'."""
    e = tl.arange(0, E_PAD)
    return tl.load(bias + e, mask=e < E, other=0.0)


@triton.jit
def _plane(part, p, stride_p, n_parts, e, m):
    return tl.load(part + p * stride_p + e, mask=m & (p < n_parts), other=0.0, cache_modifier=".cg")


@triton.jit
def router_logits(part, stride_p, n_parts, E, E_PAD: tl.constexpr):
    """router_select's first half: one row's logits [E_PAD] fp32 (0 past E), its n_parts partial planes added in
    part order, 16 loads in flight (TP8's 16 K parts in one round trip; 8 took two, ~0.4 us on the route's path)."""
    e = tl.arange(0, E_PAD)
    m = e < E
    logit = tl.zeros([E_PAD], dtype=tl.float32)
    p = 0
    while p < n_parts:
        v0 = _plane(part, p, stride_p, n_parts, e, m)
        v1 = _plane(part, p + 1, stride_p, n_parts, e, m)
        v2 = _plane(part, p + 2, stride_p, n_parts, e, m)
        v3 = _plane(part, p + 3, stride_p, n_parts, e, m)
        v4 = _plane(part, p + 4, stride_p, n_parts, e, m)
        v5 = _plane(part, p + 5, stride_p, n_parts, e, m)
        v6 = _plane(part, p + 6, stride_p, n_parts, e, m)
        v7 = _plane(part, p + 7, stride_p, n_parts, e, m)
        v8 = _plane(part, p + 8, stride_p, n_parts, e, m)
        v9 = _plane(part, p + 9, stride_p, n_parts, e, m)
        v10 = _plane(part, p + 10, stride_p, n_parts, e, m)
        v11 = _plane(part, p + 11, stride_p, n_parts, e, m)
        v12 = _plane(part, p + 12, stride_p, n_parts, e, m)
        v13 = _plane(part, p + 13, stride_p, n_parts, e, m)
        v14 = _plane(part, p + 14, stride_p, n_parts, e, m)
        v15 = _plane(part, p + 15, stride_p, n_parts, e, m)
        logit += v0                         # (0.0 + v0 can only turn -0.0 into +0.0: same sigmoid)
        logit += v1
        logit += v2
        logit += v3
        logit += v4
        logit += v5
        logit += v6
        logit += v7
        logit += v8
        logit += v9
        logit += v10
        logit += v11
        logit += v12
        logit += v13
        logit += v14
        logit += v15
        p += 16
    return logit


@triton.jit
def router_topk(logit, b, E, scaling, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                RENORM: tl.constexpr):
    """router_select's second half: (ids, weights) from the row's logits and its bias values b (router_bias)."""
    e = tl.arange(0, E_PAD)
    m = e < E
    s = tl.sigmoid(logit)                                                     # [E_PAD] fp32
    choice = tl.where(m, s + b, float("-inf"))
    kk = tl.arange(0, K_PAD)
    ids = _topk_loop(choice, e, K, K_PAD)
    # weights: s of each chosen expert, one 2-D gather (entries >= K stay 0)
    w = tl.sum(tl.where((e[None, :] == ids[:, None]) & (kk[:, None] < K), s[None, :], 0.0), axis=1)
    if RENORM:
        w = w / (tl.sum(w, axis=0) + ROUTER_DENOM_EPS)
    return ids, w * scaling


@triton.jit
def _top2(a1, a2, b1, b2):
    """tl.reduce combine: the top two of two (best, second) key pairs (keys are distinct but for KEY_MIN)."""
    return tl.maximum(a1, b1), tl.where(a1 > b1, tl.maximum(b1, a2), tl.maximum(a1, b2))


@triton.jit
def _topk_loop(choice, e, K: tl.constexpr, K_PAD: tl.constexpr):
    """The top-K expert ids of `choice` in descending order, ties to the lower index (_order_key): CTA-wide
    reductions over one tensor, each taking the best TWO keys (a (best, second) pair per element, _top2), so K
    picks are K / 2 dependent reduction chains (shuffle levels, shared-memory rounds, barriers) instead of K:
    the route's warm top-k was 2.7 us of a 4.2 us task on the TP8 critical path (marks, seventeenth session). The
    same ids by construction (the top two of a set are its first two maxima). A runtime loop, not static_range:
    one copy of the reduction's code (cold code costs ~6 cycles an instruction)."""
    key = _order_key(choice, e)
    kk = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    j = 0
    while j < K:
        b1, b2 = tl.reduce((key, tl.full(key.shape, KEY_MIN, tl.int64)), 0, _top2)
        i1 = (~b1 & LOW32).to(tl.int32)                                       # lowest index among equals
        i2 = (~b2 & LOW32).to(tl.int32)
        ids = tl.where(kk == j, i1, ids)
        ids = tl.where((kk == j + 1) & (j + 1 < K), i2, ids)
        key = tl.where((e == i1) | (e == i2), KEY_MIN, key)
        j += 2
    return ids


@triton.jit
def router_store_record(ids_out, w_out, ids, w, K: tl.constexpr, K_PAD: tl.constexpr):
    """The row's record: ids_out[j] (int32), w_out[j] (fp32) for j < K."""
    kk = tl.arange(0, K_PAD)
    tl.store(ids_out + kk, ids, mask=kk < K)
    tl.store(w_out + kk, w, mask=kk < K)


# ---------------------------------------------------------------------------- expert slots
@triton.jit
def expert_id(ids_rec, slot, E):
    """Expert chosen for slot (= r * K + j), clamped to [0, E) so a bad record cannot read out of
    bounds. .cg: the record is written by another CTA of the launch."""
    e = tl.load(ids_rec + slot, cache_modifier=".cg")
    return tl.minimum(tl.maximum(e, 0), E - 1).to(tl.int64)


@triton.jit
def pick(ids, w, j, K_PAD: tl.constexpr):
    """Entry j of router_select's (ids, w): (expert id int64 clamped to >= 0, weight fp32)."""
    kk = tl.arange(0, K_PAD)
    return tl.sum(tl.where(kk == j, ids, 0), axis=0).to(tl.int64), tl.sum(tl.where(kk == j, w, 0.0), axis=0)


@triton.jit
def expert_gateup(ids_rec, slot, E, w_gu, s_gu, x_row, i0, I, H, limit, ROWS_PAD: tl.constexpr,
                  BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Activation tile [i0, i0 + BLOCK_I) of the expert chosen for `slot` (read from the record ids_rec),
    for one row (x_row [H]): [BLOCK_I, ROWS_PAD] fp32, column 0 valid (the others are 0). Call after the
    record wait. w_gu, s_gu: see expert_gateup_at."""
    return expert_gateup_at(expert_id(ids_rec, slot, E), w_gu, s_gu, x_row, i0, I, H, limit,
                            ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)


@triton.jit
def expert_gateup_at(e, w_gu, s_gu, x_row, i0, I, H, limit, ROWS_PAD: tl.constexpr, BLOCK_I: tl.constexpr,
                     BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """expert_gateup for a known expert e (int64; e.g. from router_select + pick in the task itself).
    w_gu: packed bank [E, 2I, H]; s_gu: its FP8 scales [E, 2I/128, ceil(H/128)] (pass w_gu for bf16)."""
    wg = w_gu + e * 2 * I * H
    wu = wg + I * H
    if w_gu.dtype.element_ty == tl.float8e4nv:
        nkb = tl.cdiv(H, 128)
        sg = s_gu + e * (2 * (I // 128) * nkb)
        su = sg + (I // 128) * nkb
    else:
        sg = wg
        su = wu
    g0, u0 = gateup_prefetch(wg, wu, i0, I, H, BLOCK_I, PF_K)
    return gateup_finish(g0, u0, wg, wu, sg, su, x_row, 0, 1, i0, I, H, limit,
                         ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)


@triton.jit
def moe_down_prefetch(wd_s, n0, H, I_s, BLOCK_N: tl.constexpr, PF_K: tl.constexpr):
    """First PF_K columns of the shared expert's down tile (rows [n0, n0 + BLOCK_N) of wd_s [H, I_s])."""
    return gemv_prefetch(wd_s, n0, 0, I_s, H, I_s, BLOCK_N, PF_K)


@triton.jit
def moe_down_finish(d0, wd_s, sd_s, act_s_row, ids_row, rw_row, act_e_row, w_d, s_d, n0, E, H, I, I_s,
                    ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr = 8, ids_sel=None, w_sel=None):
    """One row's MoE output columns [n0, n0 + BLOCK_N): [BLOCK_N, ROWS_PAD] fp32, column 0 valid.

    y = w_0 * D_0 + w_1 * D_1 + ... + w_{K-1} * D_{K-1} + S, added in that order, where D_j = act_e_row[j]
    @ Wd_{ids_row[j]}[n0 : n0 + BLOCK_N]^T and S = act_s_row @ wd_s[n0 : ...]^T (d0: moe_down_prefetch's
    chunk; S is computed first, while d0 is live, and added last). act_e_row [K, I], act_s_row [I_s]
    (bf16/fp32); w_d packed [E, H, I], s_d its FP8 scales [E, ceil(H/128), I/128] (pass w_d for bf16);
    sd_s: wd_s's scales (pass wd_s for bf16). ids_row / rw_row: the row's record; or, when the task ran
    router_select itself, its (ids, w) as ids_sel / w_sel ([K_PAD]; the record pointers are then unused)."""
    shared = gemv_finish(d0, wd_s, sd_s, act_s_row, 0, 1, n0, 0, I_s, H, I_s,
                         ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
    y = tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32)
    for j in range(K):
        if ids_sel is None:
            e = expert_id(ids_row, j, E)
            wj = tl.load(rw_row + j, cache_modifier=".cg")
        else:
            e, wj = pick(ids_sel, w_sel, j, K_PAD)
            e = tl.minimum(e, E - 1)
        y = y + _expert_down(e, wj, w_d, s_d, act_e_row + j * I, n0, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES)
    return y + shared


@triton.jit
def _expert_down(e, wj, w_d, s_d, act, n0, H, I, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """wj * (act @ Wd_e[n0 : n0 + BLOCK_N]^T): one routed expert's down tile (w_d packed [E, H, I])."""
    wd = w_d + e * H * I
    if w_d.dtype.element_ty == tl.float8e4nv:
        sd = s_d + e * (tl.cdiv(H, 128) * (I // 128))
    else:
        sd = wd
    return gemv_stream(wd, sd, act, 0, 1, n0, 0, I, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES) * wj


@triton.jit
def _pick3(t, a0, a1, a2):
    """a_t of three same-shaped values, by selects (exact)."""
    return tl.where(t == 0, a0, tl.where(t == 1, a1, a2))


@triton.jit
def _merged_step(s, a0, a1, a2, e0, e1, e2, w_d, s_d, act_e_row, wd_s, sd_s, act_s_row, ts, n0, j0, SB, H,
                 I: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NS: tl.constexpr, CK: tl.constexpr):
    """K step s of _routed_down_merged (slot t = s // NS of the group: a routed expert, or the shared expert
    when t == ts) into its accumulator -> (a0, a1, a2)."""
    t = s // NS
    e = _pick3(t, e0, e1, e2)
    shared = t == ts
    wd = tl.where(shared, wd_s, w_d + e * H * I)
    if w_d.dtype.element_ty == tl.float8e4nv:
        sd = tl.where(shared, sd_s, s_d + e * SB)
    else:
        sd = wd
    x = tl.where(shared, act_s_row, act_e_row + (j0 + t) * I)
    cur = _pick3(t, a0, a1, a2)
    for c in tl.static_range(BLOCK_K // CK):
        k = (s % NS) * BLOCK_K + c * CK
        w = _load_w(wd, n0, k, I, H, I, BLOCK_N, CK)
        cur = _chunk(cur, w, sd, x, 0, 1, n0, k, I, H, I, ROWS_PAD, CK)
    return tl.where(t == 0, cur, a0), tl.where(t == 1, cur, a1), tl.where(t == 2, cur, a2)


@triton.jit
def _routed_down_merged(ids_row, rw_row, act_e_row, w_d, s_d, wd_s, sd_s, act_s_row, n0, j0, nr, with_s, E, H,
                        I: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        NUM_STAGES: tl.constexpr, G: tl.constexpr, K: tl.constexpr):
    """y = sum_{t < nr} w_t * D_t (t in order) for routed slots j0 .. j0 + nr - 1 (nr <= G <= 3), then, with_s
    (nr < G, the shared expert's I == I), + S, the shared expert's GEMV, as slot nr: the same MMAs into the same
    accumulators in the same order as one gemv_stream per GEMV (so the same bits; S's weight is 1.0, exact),
    but ONE pipelined loop over every GEMV's K steps. Per GEMV, a gemv_stream of I = 256 columns is 2 steps:
    all prologue and drain, one round trip each, three in a row (moe_down own ~5.5 us for ~96 KB, H200 kda
    trace); the group holding the shared expert ran its S as a second pipeline after the loop (the critical
    moe_down of the kda TP8 trace is that group)."""
    tl.static_assert(G <= 3, "the merged loop keeps three accumulators")
    CK: tl.constexpr = 128 if BLOCK_K > 128 else BLOCK_K
    NS: tl.constexpr = (I + BLOCK_K - 1) // BLOCK_K           # K steps per expert (the last one masked, as gemv_stream)
    last = tl.minimum(j0 + tl.maximum(nr, 1) - 1, K - 1)       # the ids read stay inside the row's record
    e0 = expert_id(ids_row, tl.minimum(j0, last), E)
    e1 = expert_id(ids_row, tl.minimum(j0 + 1, last), E)
    e2 = expert_id(ids_row, tl.minimum(j0 + 2, last), E)
    ts = tl.where(with_s, nr, G)                                # the shared expert's slot (G: none)
    w0 = tl.load(rw_row + tl.minimum(j0, last), cache_modifier=".cg")     # with the ids: one round trip, not a
    w1 = tl.load(rw_row + tl.minimum(j0 + 1, last), cache_modifier=".cg")  # second one after the loop
    w2 = tl.load(rw_row + tl.minimum(j0 + 2, last), cache_modifier=".cg")
    w0 = tl.where(ts == 0, 1.0, w0)
    w1 = tl.where(ts == 1, 1.0, w1)
    w2 = tl.where(ts == 2, 1.0, w2)
    nr = tl.where(with_s, nr + 1, nr)
    a0 = tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32)
    a1 = tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32)
    a2 = tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32)
    if w_d.dtype.element_ty == tl.float8e4nv:
        SB = tl.cdiv(H, 128) * (I // 128)                        # scale blocks per expert
    else:
        SB = 0
    n_steps = nr * NS
    if _interpreting():
        s = 0
        while s < n_steps:
            a0, a1, a2 = _merged_step(s, a0, a1, a2, e0, e1, e2, w_d, s_d, act_e_row, wd_s, sd_s, act_s_row, ts,
                                      n0, j0, SB, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, NS, CK)
            s += 1
    else:
        for s in tl.range(0, n_steps, 1, num_stages=NUM_STAGES):
            a0, a1, a2 = _merged_step(s, a0, a1, a2, e0, e1, e2, w_d, s_d, act_e_row, wd_s, sd_s, act_s_row, ts,
                                      n0, j0, SB, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, NS, CK)
    y = tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32)
    if nr > 0:
        y = y + a0 * w0
    if nr > 1:
        y = y + a1 * w1
    if nr > 2:
        y = y + a2 * w2
    return y


@triton.jit
def moe_down_group(wd_s, sd_s, act_s_row, ids_row, rw_row, act_e_row, w_d, s_d, n0, j0, j1, E, H, I, I_s,
                   ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                   K: tl.constexpr, MERGED: tl.constexpr = 0):
    """The launches' MoE down tile: a group of moe_down_finish's K + 1 GEMVs (j0 = 0, j1 = K + 1: all of
    them, in its order), y = sum_{j0 <= j < min(j1, K)} w_j * D_j (in j order), plus the shared expert's S
    when j1 > K; one gemv_stream loop per GEMV, no prefetched chunk. A launch splits the K + 1 GEMVs of a
    tile into groups over more CTAs (a TP1 tile is 9 x 512 KB) and joins the groups' rows in group order."""
    y = tl.zeros((BLOCK_N, ROWS_PAD), dtype=tl.float32)
    with_s = j1 < 0                                     # the shared expert inside the merged loop
    if MERGED > 0:          # MERGED = the group's slot count (<= 3) and I constexpr: one loop (same bits)
        nr = tl.maximum(tl.minimum(j1, K) - j0, 0)
        with_s = (j1 > K) & (nr < MERGED) & (I_s == I)
        y = _routed_down_merged(ids_row, rw_row, act_e_row, w_d, s_d, wd_s, sd_s, act_s_row, n0, j0, nr, with_s,
                                E, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES, MERGED, K)
    else:
        j = j0
        while j < tl.minimum(j1, K):
            y = y + _expert_down(expert_id(ids_row, j, E), tl.load(rw_row + j, cache_modifier=".cg"), w_d, s_d,
                                 act_e_row + j * I, n0, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES)
            j += 1
    if (j1 > K) & (with_s == 0):
        y = y + gemv_stream(wd_s, sd_s, act_s_row, 0, 1, n0, 0, I_s, H, I_s, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES)
    return y


# ---------------------------------------------------------------------------- standalone test kernels
@triton.jit(do_not_specialize=["rows"])
def router_partial_kernel(x, stride_x, wr, part, rows, E, H, split_len, ROWS_PAD: tl.constexpr,
                          BLOCK_E: tl.constexpr, CK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Grid (cdiv(E, BLOCK_E), n_parts): logits of one expert tile over one K range, all rows."""
    e0 = tl.program_id(0) * BLOCK_E
    p = tl.program_id(1)
    k0 = p * split_len
    k1 = tl.minimum(k0 + split_len, H)
    w0 = router_prefetch(wr, e0, k0, k1, E, H, BLOCK_E, CK)
    lg = router_finish(w0, wr, x, stride_x, rows, e0, k0, k1, E, H, ROWS_PAD, BLOCK_E, CK, NUM_STAGES)
    router_store_partial(part + p * rows * E, lg, rows, e0, E, ROWS_PAD, BLOCK_E)


@triton.jit
def router_select_kernel(part, n_parts, rows, bias, ids_out, w_out, E, scaling, K: tl.constexpr,
                         E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr):
    """Grid (rows,): one row's record."""
    r = tl.program_id(0)
    ids, w = router_select(part + r * E, rows * E, n_parts, bias, E, scaling, K, E_PAD, K_PAD, RENORM)
    router_store_record(ids_out + r * K, w_out + r * K, ids, w, K, K_PAD)


@triton.jit
def expert_gateup_kernel(x, stride_x, ids_rec, w_gu, s_gu, act_e, E, I, H, limit, part, n_parts, rows, bias,
                         scaling, K: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_I: tl.constexpr,
                         BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                         SELECT: tl.constexpr = False, E_PAD: tl.constexpr = 16, K_PAD: tl.constexpr = 8,
                         RENORM: tl.constexpr = True):
    """Grid (rows, K, cdiv(I, BLOCK_I)): one expert slot (row, rank, tile). SELECT: the slot runs
    router_select on the logit partials itself instead of reading the record (no select hop)."""
    r = tl.program_id(0)
    j = tl.program_id(1)
    slot = r * K + j
    i0 = tl.program_id(2) * BLOCK_I
    if SELECT:
        ids, w = router_select(part + r * E, rows * E, n_parts, bias, E, scaling, K, E_PAD, K_PAD, RENORM)
        e, _ = pick(ids, w, j, K_PAD)
        a = expert_gateup_at(tl.minimum(e, E - 1), w_gu, s_gu, x + r * stride_x, i0, I, H, limit,
                             ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)
    else:
        a = expert_gateup(ids_rec, slot, E, w_gu, s_gu, x + r * stride_x, i0, I, H, limit,
                          ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)
    gemv_store(act_e + slot * I, 0, a, 1, i0, I, ROWS_PAD, BLOCK_I)


@triton.jit
def moe_down_kernel(act_s, ids_rec, rw_rec, act_e, wd_s, sd_s, w_d, s_d, y, E, H, I, I_s, part, n_parts, rows,
                    bias, scaling, K: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                    SELECT: tl.constexpr = False, E_PAD: tl.constexpr = 16, K_PAD: tl.constexpr = 8,
                    RENORM: tl.constexpr = True):
    """Grid (rows, cdiv(H, BLOCK_N)): one row's down tile, k experts then the shared expert. SELECT:
    the routing comes from router_select on the partials in the task (as in expert_gateup_kernel)."""
    r = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    d0 = moe_down_prefetch(wd_s, n0, H, I_s, BLOCK_N, PF_K)
    # (a launch waits on act_s / act_e here; the record is already in)
    if SELECT:
        ids, w = router_select(part + r * E, rows * E, n_parts, bias, E, scaling, K, E_PAD, K_PAD, RENORM)
        acc = moe_down_finish(d0, wd_s, sd_s, act_s + r * I_s, ids_rec, rw_rec, act_e + r * K * I, w_d, s_d,
                              n0, E, H, I, I_s, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, K, K_PAD, ids, w)
    else:
        acc = moe_down_finish(d0, wd_s, sd_s, act_s + r * I_s, ids_rec + r * K, rw_rec + r * K,
                              act_e + r * K * I, w_d, s_d, n0, E, H, I, I_s, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K,
                              NUM_STAGES, K)
    gemv_store(y + r * H, 0, acc, 1, n0, H, ROWS_PAD, BLOCK_N)


# ---------------------------------------------------------------------------- host wrappers (tests)
def pack_experts(experts):
    """Per-expert (gate [I, H], up [I, H], down [H, I]) -> the packed banks (w_gu [E, 2I, H], w_d [E, H, I]).
    Each entry is a tensor, or a (q, scale_inv) pair for FP8; FP8 returns ((w_gu, s_gu), (w_d, s_d))."""
    fp8 = isinstance(experts[0][0], tuple)
    if not fp8:
        return (torch.stack([torch.cat([g, u]) for g, u, _ in experts]).contiguous(),
                torch.stack([d for _, _, d in experts]).contiguous())
    I = experts[0][0][0].shape[0]
    if I % FP8_BLOCK:
        raise ValueError(f"packed FP8 experts need I % {FP8_BLOCK} == 0 (a scale block must not straddle "
                         f"gate and up), got I={I}")
    w_gu = torch.stack([torch.cat([g[0], u[0]]) for g, u, _ in experts]).contiguous()
    s_gu = torch.stack([torch.cat([g[1], u[1]]) for g, u, _ in experts]).contiguous()
    return (w_gu, s_gu), (torch.stack([d[0] for _, _, d in experts]).contiguous(),
                          torch.stack([d[1] for _, _, d in experts]).contiguous())


def moe_forward(x, wr, bias, gu, down, shared, model_cfg, *, cfg: GemvConfig = TEST_CFG, n_parts: int = 1,
                block_e: int = 16, block_i: int | None = None, act_dtype=torch.bfloat16,
                select_in_task: bool = False):
    """The MoE FFN through the task kernels, stage by stage: router partials -> select -> shared gate|up
    and expert slots -> down tiles.

    x [rows, H] bf16/fp32 (rows <= cfg.rows_pad); wr [E, H] fp32; bias [E] fp32; gu / down: packed banks
    (pack_experts: tensors, or (q, scale) pairs for FP8); shared: (wg, wu, wd) tensors or (q, s) pairs.
    n_parts: K ranges of the router (logit partials joined in part order). select_in_task: the expert
    slots and down tiles run router_select themselves from the partials (the record is still written,
    by the select stage, for comparison). Returns a dict of every
    output (each starts as NaN / -1): part, ids, rw, act_s, act_e, y."""
    rows, H = x.shape
    E, K = model_cfg.n_routed_experts, model_cfg.num_experts_per_tok
    limit, dev, nan = float(model_cfg.swiglu_limit), x.device, float("nan")
    if not 1 <= rows <= cfg.rows_pad or x.stride(1) != 1:
        raise ValueError(f"x must be [rows <= {cfg.rows_pad}, H] with unit stride")
    if tuple(wr.shape) != (E, H) or wr.dtype != torch.float32 or not wr.is_contiguous():
        raise ValueError(f"router weight must be contiguous fp32 [{E}, {H}]")
    if tuple(bias.shape) != (E,) or bias.dtype != torch.float32:
        raise ValueError(f"correction bias must be fp32 [{E}]")
    (w_gu, s_gu), (w_d, s_d) = (t if isinstance(t, tuple) else (t, None) for t in (gu, down))
    I = w_gu.shape[1] // 2
    s_gu = check_weight(w_gu, s_gu, (E, 2 * I, H), "w_gu")
    s_d = check_weight(w_d, s_d, (E, H, I), "w_d")
    (wg, sg), (wu, su), (wd, sd) = (t if isinstance(t, tuple) else (t, None) for t in shared)
    I_s = wg.shape[0]
    sg, su = check_weight(wg, sg, (I_s, H), "shared gate"), check_weight(wu, su, (I_s, H), "shared up")
    sd = check_weight(wd, sd, (H, I_s), "shared down")
    fp8 = w_gu.dtype == torch.float8_e4m3fn
    check_cfg(cfg, fp8)
    if fp8 and I % FP8_BLOCK:
        raise ValueError(f"packed FP8 experts need I % {FP8_BLOCK} == 0")
    ck = ROUTER_CK
    if x.is_cuda and block_e < 16:
        raise ValueError(f"block_e={block_e}: the router's MMA needs >= 16 experts a tile")
    split_len = triton.cdiv(triton.cdiv(H, n_parts), ck) * ck
    n_parts = triton.cdiv(H, split_len)
    out = dict(part=torch.full((n_parts, rows, E), nan, device=dev),
               ids=torch.full((rows, K), -1, dtype=torch.int32, device=dev),
               rw=torch.full((rows, K), nan, device=dev),
               act_s=torch.full((rows, I_s), nan, dtype=act_dtype, device=dev),
               act_e=torch.full((rows, K, I), nan, dtype=act_dtype, device=dev),
               y=torch.full((rows, H), nan, device=dev))
    gk = dict(ROWS_PAD=cfg.rows_pad, BLOCK_K=cfg.block_k, PF_K=cfg.pf_k, NUM_STAGES=cfg.num_stages,
              num_warps=cfg.num_warps)
    router_partial_kernel[(triton.cdiv(E, block_e), n_parts)](
        x, x.stride(0), wr, out["part"], rows, E, H, split_len, ROWS_PAD=cfg.rows_pad, BLOCK_E=block_e, CK=ck,
        NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps)
    scaling = float(model_cfg.routed_scaling_factor)
    sel = dict(E_PAD=triton.next_power_of_2(E), K_PAD=triton.next_power_of_2(K), RENORM=bool(model_cfg.norm_topk_prob))
    router_select_kernel[(rows,)](out["part"], n_parts, rows, bias, out["ids"], out["rw"], E, scaling, K=K, **sel)
    ids_rec, rw_rec = out["ids"], out["rw"]
    if select_in_task:       # the tasks must not read the record: hand them poisoned copies
        ids_rec, rw_rec = torch.full_like(ids_rec, -1), torch.full_like(rw_rec, nan)
    tail = (out["part"], n_parts, rows, bias, scaling)
    bi = block_i or cfg.block_n
    mlp_gateup_kernel[(triton.cdiv(I_s, bi),)](x, x.stride(0), wg, wu, sg, su, out["act_s"], I_s, rows, I_s, H,
                                               limit, BLOCK_I=bi, **gk)
    expert_gateup_kernel[(rows, K, triton.cdiv(I, bi))](x, x.stride(0), ids_rec, w_gu, s_gu, out["act_e"],
                                                        E, I, H, limit, *tail, K=K, BLOCK_I=bi,
                                                        SELECT=select_in_task, **sel, **gk)
    moe_down_kernel[(rows, triton.cdiv(H, cfg.block_n))](
        out["act_s"], ids_rec, rw_rec, out["act_e"], wd, sd, w_d, s_d, out["y"], E, H, I, I_s, *tail, K=K,
        BLOCK_N=cfg.block_n, SELECT=select_in_task, **sel, **gk)
    return out
