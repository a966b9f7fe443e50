"""KDA decode task family: one token of one head's conv + gate + delta rule on a column block of its
fp32 state, and the gated RMSNorm of the head output, as `@triton.jit` device functions.

Why column blocks (DESIGN.md §5): the state of a head is S [DV, DK] fp32, value-first (as fla /
SGLang / reference/ops.py kda_recurrent_step). For given q, k, g, beta every value index i is updated
on its own: S[i, :] *= exp(g); S[i, :] += beta (v[i] - S[i, :] . k) k; o[i] = S[i, :] . q. So a task
owns the value rows [v0, v0 + BV) of one (row, head): a [BV, DK] tile instead of 128 x 128 fp32 (which
lifted a whole branchy kernel to 176 registers), and TP8's 8 heads per rank still make 8 * DV / BV
tasks per row. The state rows of a block are contiguous in memory (v-first).

What a block task recomputes redundantly: the conv + SiLU of the full q and k of its head (l2norm
needs all DK channels) and the decay exp(g) over DK: 2 * DK * K loads and a few hundred flops, far
cheaper than a hop. Each task writes back only the conv-window channels of its own block (q, k and v
channels [v0, v0 + BV) of the head; DK == DV), so every window word is written exactly once.

How column blocks join for the gated RMSNorm (it needs the sum of squares of all DV outputs): each
block task stores its raw o block (fp32) and its partial sum of squares (one fp32 per block, in a
[rows, nh, NB] scratch); the consumer (`kda_norm_block`: a later stage, or the o_proj tile that reads
o as its input) adds the NB partials in block order 0, 1, ... and scales. With BV == DV (NB = 1) the
task normalises in place (FUSE_NORM) and no join is needed (the same operations as the joined path).

f and the output gate: either loaded from the f_b / g_b GEMV outputs (kda_load_vec), or formed in the
task from the inproj's rank-128 f_a / g_a rows (kda_lowrank: f_b rows of the head, 128 x 128, and g_b
rows of the block, BV x 128). The second removes the f_b / g_b stage and its hop from the critical path
(inproj -> kda blocks directly) at the price of re-reading the head's f_b slice once per block task
(32 KB bf16; NB - 1 of the NB reads hit L2) - a trade for the launch to measure.

All-or-nothing step (DESIGN.md §6): the new state and the new window go to buffers separate from the
old ones; the old ones are only read, so a faulted step leaves them intact until the runner commits.

Numerics follow reference/ops.py (fp32 everywhere, eps inside the l2norm sqrt, q scaled by DK^-0.5,
gate g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias))). Every reduction is a fixed-order
tl.sum or a block-ordered loop, and a row never reads another row's data: bitwise reproducible and
batch invariant (for fixed BV).

Layouts (per row r / slot s; D = heads_local * DK; the caller offsets pointers to the row / slot):
  qkv  [3D]          raw inproj q|k|v (bf16/fp32): q of head h at h*DK, k at D + h*DK, v at 2D + h*DV
  b    [nh]          beta logits;  f [D], gate [D]: f_b(f_a x) and g_b(g_a x) (head h at h*DK)
  win  [KC-1, 3D]    fp32 conv window, oldest first (same channel index as qkv)
  conv_w [3D, KC]    fp32 depthwise conv weights q|k|v (conv_w[c, KC-1] multiplies the newest input)
  S    [nh, DV, DK]  fp32 state;  A_log [nh];  dt_bias [D];  norm_w [DV] (bf16/fp32)
  (at TP, every per-head tensor is this rank's shard and h, nh, D are rank-local)
  o    [D]           raw head outputs (fp32);  ssq [nh, NB] fp32 partials;  on [D] normed output

Registers (sm_90, Triton 3.6's bundled ptxas, compiled offline without a GPU: tests/test_kernels_kda.py
test_offline_sm90_registers; 4 warps, real shapes DK = DV = 128, no spills): BV=16 72 registers with the
state block prefetched before the conv (56 loaded after it), BV=32 128 (80), BV=64 180, BV=128 254 (152 at
8 warps). The prefetched [BV, DK] tile stays live across the conv: BV=16 prefetched or BV=32 loaded late
keeps this family well under the 255 the tail's GEMV reaches (launches/tail.py); BV=16 at TP8 gives
8 heads * 8 blocks = 64 tasks a row.

Device API (constexprs in CAPS; v0 = cb * BV):
  S_blk = kda_state_prefetch(S_in, h, v0, DV, DK, BV)                 # before waiting on the inproj
  fv = kda_load_vec(f, h * DK, DK)  or  kda_lowrank(f_b, f_a_row, h * DK, R, DK, CK)     # [DK] fp32
  q, k, v, decay, beta = kda_head_inputs(qkv, b, fv, win_in, win_out, conv_w, A_log, dt_bias,
                                         h, v0, D, lower_bound, DK, DV, BV, KC)
  o_blk, ss = kda_state_update(S_blk, q, k, v, decay, beta, S_out, h, v0, DV, DK, BV)
  (kda_head_finish(S_blk, qkv, b, fv, ..., KC) = the two calls above)
  kda_store_o(o, ssq, o_blk, ss, h, v0, NB, DV, BV)                   # raw block + partial for the join
  gv = kda_load_vec(gate, h * DV + v0, BV)  or  kda_lowrank(g_b, g_a_row, h * DV + v0, R, BV, CK)
  kda_norm_block(o, ssq, gv, norm_w, on, on32, h, v0, eps, NB, DV, BV, WRITE_F32)     # after all blocks
  kda_norm_apply(o_blk, ss_total, gv, norm_w, on, on32, h, v0, eps, DV, BV, WRITE_F32)  # FUSE_NORM form
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import plane_sum

L2NORM_EPS = tl.constexpr(1e-6)     # reference/ops.py L2NORM_EPS


# ---------------------------------------------------------------------------- pieces
@triton.jit
def _conv_step(qkv, win_in, win_out, conv_w, ch, wmask, C3, KC: tl.constexpr, PS=0, KS: tl.constexpr = 1):
    """silu(sum_t win[t, ch] * w[ch, t] + x[ch] * w[ch, KC-1]) for a vector of channels ch.

    Writes the shifted window (win[1:], x) to win_out for lanes where wmask (each word once per step).
    KS > 1: x is the sum of KS split-K planes of the inproj, PS elements apart (gemv.py plane_sum)."""
    x = plane_sum(qkv, ch, ch >= 0, PS, KS)
    acc = tl.zeros(ch.shape, dtype=tl.float32)
    for t in tl.static_range(KC - 1):
        wt = tl.load(win_in + t * C3 + ch)
        acc += wt * tl.load(conv_w + ch * KC + t)
        if t >= 1:
            tl.store(win_out + (t - 1) * C3 + ch, wt, mask=wmask)
    acc += x * tl.load(conv_w + ch * KC + (KC - 1))
    tl.store(win_out + (KC - 2) * C3 + ch, x, mask=wmask)
    return acc * tl.sigmoid(acc)


@triton.jit
def kda_state_prefetch(S_in, h, v0, DV: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr):
    """State rows [v0, v0 + BV) of head h: [BV, DK] fp32. S_in: the slot's old state [nh, DV, DK].
    Depends on no activation of this step: issue it before waiting on the inproj outputs."""
    i = v0 + tl.arange(0, BV)
    c = tl.arange(0, DK)
    base = S_in + h.to(tl.int64) * DV * DK
    return tl.load(base + i[:, None] * DK + c[None, :], eviction_policy="evict_first")


@triton.jit
def kda_load_vec(ptr, n0, N: tl.constexpr):
    """ptr[n0 : n0 + N] as fp32 (bf16/fp32 source; .cg: written by another CTA of the launch)."""
    return tl.load(ptr + n0 + tl.arange(0, N), cache_modifier=".cg").to(tl.float32)


@triton.jit
def kda_lowrank(w_ptr, x_ptr, n0, R: tl.constexpr, BN: tl.constexpr, CK: tl.constexpr, PS=0, KS: tl.constexpr = 1):
    """Rows [n0, n0 + BN) of W @ x for a rank-R up-projection W [N, R] (f_b or g_b, bf16/fp32) and the
    rank-R row x (the f_a / g_a output of the inproj, bf16/fp32): [BN] fp32, CK-wide chunks added in order.
    Lets a KDA task form its own f (DK values) and output gate (BV values) from the inproj output, so
    the f_b / g_b GEMVs need no stage and no hop of their own (R * (DK + BV) weights per task)."""
    j = n0 + tl.arange(0, BN)
    acc = tl.zeros([BN], dtype=tl.float32)
    for k in tl.static_range(0, R, CK):
        kk = k + tl.arange(0, CK)
        w = tl.load(w_ptr + j[:, None].to(tl.int64) * R + kk[None, :]).to(tl.float32)     # [BN, CK]
        x = plane_sum(x_ptr, kk, kk >= 0, PS, KS)                                           # x: KS planes
        acc += tl.sum(w * x[None, :], axis=1)
    return acc


@triton.jit
def kda_head_inputs(qkv, b, fv, win_in, win_out, conv_w, A_log, dt_bias, h, v0, D, lower_bound,
                    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, PS=0, KS: tl.constexpr = 1):
    """Conv + SiLU, l2norm, gate and beta of head h for the block task [v0, v0 + BV).

    fv [DK] fp32: f = f_b(f_a x) of head h (kda_load_vec of the f_b output, or kda_lowrank in-task).
    Returns q [DK] (l2-normalised, times DK^-0.5), k [DK] (l2-normalised), v [BV] (this block's value
    rows), decay [DK] = exp(g) and beta (scalar). Writes this block's conv-window channels (q, k and v
    channels [v0, v0 + BV) of the head) to win_out. D = heads * DK of this rank (the q|k|v section
    width); lower_bound = cfg.linear_lower_bound (< 0).
    """
    tl.static_assert(DK == DV, "window ownership by block assumes DK == DV")
    tl.static_assert(DV % BV == 0, "BV must divide DV")
    C3 = 3 * D
    c = tl.arange(0, DK)
    i = v0 + tl.arange(0, BV)
    mine = (c >= v0) & (c < v0 + BV)                           # window channels this task owns
    # conv + SiLU: full q, k of the head (for the l2norm), v only for this block
    q = _conv_step(qkv, win_in, win_out, conv_w, h * DK + c, mine, C3, KC, PS, KS)            # [DK]
    k = _conv_step(qkv, win_in, win_out, conv_w, D + h * DK + c, mine, C3, KC, PS, KS)        # [DK]
    v = _conv_step(qkv, win_in, win_out, conv_w, 2 * D + h * DV + i, i >= 0, C3, KC, PS, KS)  # [BV]
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + L2NORM_EPS) * (DK ** -0.5)
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + L2NORM_EPS)
    # gate: g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)) per key channel; beta = sigmoid(b[h])
    z = fv + tl.load(dt_bias + h * DK + c)
    g = lower_bound * tl.sigmoid(tl.exp(tl.load(A_log + h)) * z)
    beta = tl.sigmoid(tl.sum(plane_sum(b, h + tl.arange(0, 1), h >= 0, PS, KS), axis=0))
    return q, k, v, tl.exp(g), beta


@triton.jit
def kda_state_update(S_blk, q, k, v, decay, beta, S_out, h, v0, DV: tl.constexpr, DK: tl.constexpr,
                     BV: tl.constexpr):
    """Delta rule on value rows [v0, v0 + BV) of head h; returns (o [BV], sum of o^2 over the block).

    S_blk [BV, DK]: the old rows (kda_state_prefetch). Writes the new rows to S_out (the slot's new
    state [nh, DV, DK], a buffer separate from the old one)."""
    c = tl.arange(0, DK)
    i = v0 + tl.arange(0, BV)
    S = S_blk * decay[None, :]                                 # decay per key channel
    kv = tl.sum(S * k[None, :], axis=1)                        # [BV] = (S k)[i]
    delta = beta * (v - kv)
    S = S + delta[:, None] * k[None, :]
    o = tl.sum(S * q[None, :], axis=1)                         # [BV] = (S q)[i]
    tl.store(S_out + h.to(tl.int64) * DV * DK + i[:, None] * DK + c[None, :], S)
    return o, tl.sum(o * o, axis=0)


@triton.jit
def kda_head_finish(S_blk, qkv, b, fv, win_in, win_out, conv_w, A_log, dt_bias, S_out, h, v0, D, lower_bound,
                    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, PS=0,
                    KS: tl.constexpr = 1):
    """kda_head_inputs then kda_state_update: one token of head h on value rows [v0, v0 + BV).
    Returns (o [BV], sum o^2). S_blk: kda_state_prefetch's tile, issued before the inproj wait."""
    q, k, v, decay, beta = kda_head_inputs(qkv, b, fv, win_in, win_out, conv_w, A_log, dt_bias, h, v0, D,
                                           lower_bound, DK, DV, BV, KC, PS, KS)
    return kda_state_update(S_blk, q, k, v, decay, beta, S_out, h, v0, DV, DK, BV)


@triton.jit
def kda_store_o(o, ssq, o_blk, ss, h, v0, NB: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """Raw o block -> o[h*DV + v0 :][:BV] (fp32) and its sum of squares -> ssq[h*NB + v0 // BV]."""
    i = v0 + tl.arange(0, BV)
    tl.store(o + h * DV + i, o_blk)
    tl.store(ssq + h * NB + v0 // BV, ss)


@triton.jit
def kda_norm_apply(o_blk, ss_total, gv, norm_w, on, on32, h, v0, eps, DV: tl.constexpr, BV: tl.constexpr,
                   WRITE_F32: tl.constexpr):
    """on[h*DV + i] = o[i] / sqrt(ss_total / DV + eps) * w[i] * sigmoid(gv[i - v0]) for i in the block.

    gv [BV] fp32: the output-gate pre-activation g_b(g_a x) of the block (kda_load_vec / kda_lowrank).
    on: output in its dtype (bf16 for the o_proj hand-off); on32: fp32 copy if WRITE_F32."""
    i = v0 + tl.arange(0, BV)
    rstd = 1.0 / tl.sqrt(ss_total / DV + eps)
    y = o_blk * rstd * tl.load(norm_w + i).to(tl.float32) * tl.sigmoid(gv)
    tl.store(on + h * DV + i, y.to(on.dtype.element_ty))
    if WRITE_F32:
        tl.store(on32 + h * DV + i, y)


@triton.jit
def kda_norm_block(o, ssq, gv, norm_w, on, on32, h, v0, eps, NB: tl.constexpr, DV: tl.constexpr,
                   BV: tl.constexpr, WRITE_F32: tl.constexpr):
    """Join the NB partial sums of squares of head h in block order, then normalise block v0 (reads the raw
    o block that kda_store_o wrote). Run after every block task of the (row, head) has published."""
    total = tl.load(ssq + h * NB, cache_modifier=".cg")
    for j in tl.static_range(1, NB):
        total += tl.load(ssq + h * NB + j, cache_modifier=".cg")
    o_blk = tl.load(o + h * DV + v0 + tl.arange(0, BV), cache_modifier=".cg")
    kda_norm_apply(o_blk, total, gv, norm_w, on, on32, h, v0, eps, DV, BV, WRITE_F32)


# ---------------------------------------------------------------------------- test kernels
@triton.jit
def _head_f(f, fb, h, DK: tl.constexpr, R: tl.constexpr, LOWRANK: tl.constexpr):
    if LOWRANK:
        return kda_lowrank(fb, f, h * DK, R, DK, 32)           # f: the f_a row [R]
    else:
        return kda_load_vec(f, h * DK, DK)                     # f: the f_b output row [D]


@triton.jit
def _block_gate(gate, gb, h, v0, DV: tl.constexpr, BV: tl.constexpr, R: tl.constexpr, LOWRANK: tl.constexpr):
    if LOWRANK:
        return kda_lowrank(gb, gate, h * DV + v0, R, BV, 32)    # gate: the g_a row [R]
    else:
        return kda_load_vec(gate, h * DV + v0, BV)              # gate: the g_b output row [D]


@triton.jit
def kda_block_kernel(qkv, stride_qkv, b, stride_b, f, gate, stride_fg, fb, gb, win_in, win_out, S_in, S_out,
                     conv_w, A_log, dt_bias, norm_w, o, ssq, on, on32, D, lower_bound, eps,
                     DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, R: tl.constexpr,
                     FUSE_NORM: tl.constexpr, PREFETCH: tl.constexpr, LOWRANK: tl.constexpr):
    """Grid (rows, heads, DV // BV): one (row, head, column block) task; slot = row.
    PREFETCH: load the state block first (where a launch issues it, before its wait), else after the
    conv (fewer live registers; the same math). LOWRANK: f / gate are the f_a / g_a rows [R] and the
    task applies fb / gb (kda_lowrank); else they are the f_b / g_b outputs [D]."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    NB: tl.constexpr = DV // BV
    nh = D // DK
    S_old = S_in + r.to(tl.int64) * nh * DV * DK
    S_new = S_out + r.to(tl.int64) * nh * DV * DK
    win = r * (KC - 1) * 3 * D
    if PREFETCH:
        S_blk = kda_state_prefetch(S_old, h, v0, DV, DK, BV)
        fv = _head_f(f + r * stride_fg, fb, h, DK, R, LOWRANK)
        o_blk, ss = kda_head_finish(S_blk, qkv + r * stride_qkv, b + r * stride_b, fv, win_in + win, win_out + win,
                                    conv_w, A_log, dt_bias, S_new, h, v0, D, lower_bound, DK, DV, BV, KC)
    else:
        fv = _head_f(f + r * stride_fg, fb, h, DK, R, LOWRANK)
        q, k, v, decay, beta = kda_head_inputs(qkv + r * stride_qkv, b + r * stride_b, fv, win_in + win,
                                               win_out + win, conv_w, A_log, dt_bias, h, v0, D, lower_bound,
                                               DK, DV, BV, KC)
        S_blk = kda_state_prefetch(S_old, h, v0, DV, DK, BV)
        o_blk, ss = kda_state_update(S_blk, q, k, v, decay, beta, S_new, h, v0, DV, DK, BV)
    kda_store_o(o + r * D, ssq + r * nh * NB, o_blk, ss, h, v0, NB, DV, BV)
    if FUSE_NORM:
        tl.static_assert(NB == 1, "the in-task norm needs the whole head in one block")
        gv = _block_gate(gate + r * stride_fg, gb, h, v0, DV, BV, R, LOWRANK)
        kda_norm_apply(o_blk, ss, gv, norm_w, on + r * D, on32 + r * D, h, v0, eps, DV, BV, True)


@triton.jit
def kda_norm_kernel(o, ssq, gate, stride_fg, gb, norm_w, on, on32, D, eps, DK: tl.constexpr, DV: tl.constexpr,
                    BV: tl.constexpr, R: tl.constexpr, LOWRANK: tl.constexpr):
    """Grid (rows, heads, DV // BV): the join stage for the block split."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    NB: tl.constexpr = DV // BV
    nh = D // DK
    gv = _block_gate(gate + r * stride_fg, gb, h, v0, DV, BV, R, LOWRANK)
    kda_norm_block(o + r * D, ssq + r * nh * NB, gv, norm_w, on + r * D, on32 + r * D, h, v0, eps, NB, DV, BV, True)


# ---------------------------------------------------------------------------- host wrapper (tests)
def kda_step(qkv, b, f, gate, window, S, conv_w, A_log, dt_bias, norm_w, cfg, *, block_v: int = 32,
             fuse_norm: bool | None = None, prefetch: bool = True, lowrank=None):
    """One decode token for `rows` rows (slot r = row r) through the task functions.

    qkv [rows, 3D] raw inproj (bf16/fp32); b [rows, nh]; f, gate [rows, D] the f_b / g_b outputs, or with
    lowrank = (f_b weight [D, R], g_b weight [D, R]) the f_a / g_a rows [rows, R] (the task up-projects);
    window [rows, KC-1, 3D] fp32; S [rows, nh, DV, DK] fp32; conv_w [3D, KC] fp32; A_log [nh]; dt_bias [D];
    norm_w [DV]. fuse_norm (default: block_v == DV) normalises inside the block task; otherwise the join
    runs as a second stage (kda_norm_kernel), as it must when block_v < DV. prefetch: where the state
    block is loaded (kda_block_kernel's PREFETCH).
    Returns dict: on (bf16 [rows, nh, DV]), on32, o (raw fp32), ssq [rows, nh, NB], S (new), window (new).
    Inputs are never written (the all-or-nothing contract)."""
    rows, nh = b.shape
    DK = DV = cfg.linear_head_dim
    D, KC = nh * DK, conv_w.shape[1]
    if DV % block_v or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v}: must be a power of two dividing {DV}")
    fb, gb = lowrank if lowrank is not None else (qkv, qkv)     # unused without lowrank
    R = fb.shape[1] if lowrank is not None else 32
    fg_w = R if lowrank is not None else D
    if lowrank is not None and (tuple(fb.shape) != (D, R) or tuple(gb.shape) != (D, R) or R % 32
                                or not fb.is_contiguous() or not gb.is_contiguous()):
        raise ValueError(f"lowrank weights must be contiguous [{D}, R] with R a multiple of 32")
    for name, t, shape in (("qkv", qkv, (rows, 3 * D)), ("f", f, (rows, fg_w)), ("gate", gate, (rows, fg_w)),
                           ("window", window, (rows, KC - 1, 3 * D)), ("S", S, (rows, nh, DV, DK))):
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous {shape}, got {tuple(t.shape)}")
    if b.stride(1) != 1:
        raise ValueError("b needs unit stride along heads")
    NB = DV // block_v
    dev, nan = qkv.device, float("nan")
    out = dict(on=torch.full((rows, nh, DV), nan, dtype=torch.bfloat16, device=dev),
               on32=torch.full((rows, nh, DV), nan, device=dev), o=torch.full((rows, nh, DV), nan, device=dev),
               ssq=torch.full((rows, nh, NB), nan, device=dev), S=torch.full_like(S, nan),
               window=torch.full_like(window, nan))
    grid = (rows, nh, NB)
    fuse = NB == 1 if fuse_norm is None else fuse_norm
    if fuse and NB != 1:
        raise ValueError(f"fuse_norm needs block_v == {DV}, got {block_v}")
    lr = lowrank is not None
    kda_block_kernel[grid](qkv, qkv.stride(0), b, b.stride(0), f, gate, fg_w, fb, gb, window, out["window"], S,
                           out["S"], conv_w, A_log, dt_bias, norm_w, out["o"], out["ssq"], out["on"], out["on32"], D,
                           cfg.linear_lower_bound, cfg.rms_norm_eps, DK=DK, DV=DV, BV=block_v, KC=KC, R=R,
                           FUSE_NORM=fuse, PREFETCH=prefetch, LOWRANK=lr)
    if not fuse:
        kda_norm_kernel[grid](out["o"], out["ssq"], gate, fg_w, gb, norm_w, out["on"], out["on32"], D,
                              cfg.rms_norm_eps, DK=DK, DV=DV, BV=block_v, R=R, LOWRANK=lr)
    return out
