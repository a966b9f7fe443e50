"""Device pieces of the KDA-mixer half of a layer launch (dense / kda / embed kinds): the token
gather, the mHC gate row, the KDA block task with its in-task low-rank f / output gate, and the
cross-rank exchange of a GEMV tile. Pure compute; the waits and publishes stay in the task functions
(launches/ffn.py, launches/kda_layer.py), which own the control flow and the error path.

Why these shapes:
- The gate row (`gate_rows`) is written by a few column-tile tasks after a box wait on every hc_pre
  partial, and handed to the GEMV tasks through a second box (plain bf16 rows + release drain).
  The alternative, every consumer CTA forming the whole row itself from the joined partials, costs
  each consumer a pass over X (rows x 64 KB at H = 4096) before its first GEMV: ~8 MB of L2 reads per
  row over 132 CTAs, several us, against one ~1 us hop that hides behind the weight chunk every GEMV
  task issues before its wait. The Sinkhorn itself is redundant per gate task (hc_coeffs).
- f and the output gate are formed inside the KDA block task from the inproj's f_a / g_a rows
  (kernels/kda.py kda_lowrank): no f_b / g_b stage, no hop.
- A GEMV tile that needs a cross-rank sum (o_proj, down) is published as tagged pairs into every
  rank's exchange slot (`xchg_publish`) and summed by the column tile's owner in rank order
  (`xchg_sum`), so every rank gets the same bits. One buffer per mailbox is enough: a rank publishes
  launch N+1's xo only after it finished launch N, which needed every peer's xd of launch N, which
  each peer publishes only after it read all of launch N's xo (and likewise for xd).
"""
import triton
import triton.language as tl

from sync.device import await_pairs, publish_pairs, trace_mark

from ..kernels.kda import (kda_head_finish, kda_lowrank, kda_norm_apply, kda_norm_block, kda_state_prefetch,
                           kda_store_o)
from ..kernels.mhc import hc_derive, hc_join, hc_pre_rstd, hc_store_coef, hc_weights

SLOT_W: tl.constexpr = tl.constexpr(40)       # kernels/mhc.py HC_SLOT


@triton.jit
def embed_gather(tokens, embed_w, x0, rows, c0, c1, H: tl.constexpr, BLOCK_C: tl.constexpr):
    """x0[r, j, c] = embed_w[tokens[r], c] (fp32) for the 4 streams j, columns [c0, c1), rows < rows."""
    j = tl.arange(0, 4)
    c = c0
    while c < c1:
        cc = c + tl.arange(0, BLOCK_C)
        m = cc < c1
        r = 0
        while r < rows:
            tok = tl.load(tokens + r).to(tl.int64)
            e = tl.load(embed_w + tok * H + cc, mask=m, other=0.0).to(tl.float32)
            tl.store(x0 + r * 4 * H + j[:, None] * H + cc[None, :], e[None, :] + tl.zeros([4, BLOCK_C], tl.float32),
                     mask=m[None, :])
            r += 1
        c += BLOCK_C


@triton.jit(noinline=True)
def gate_row(X, part, n_parts, base, scale, ln_w, a, r, rows, c0, eps, hc_eps, hdr, cta, H: tl.constexpr,
             ROWS_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Gate-row tile [c0, c0 + BLOCK_H) of row r (nothing for a pad row r >= rows): join the hc_pre
    partial slots (task order), a[r, c] = rms_norm(sum_j pre[j] X[r, j, c]) * ln_w[c]. No Sinkhorn: the
    row needs only pre and rstd; hc_post's post / comb come from the coef task (coef_row), off this
    stage's critical path. The norm weight and the X tile are loaded first, so their round trip
    overlaps the join's. noinline: gate_task runs it once before its wait too (ffn.WARM_CODE)."""
    if r < rows:
        i4 = tl.arange(0, 4)
        offs = c0 + tl.arange(0, BLOCK_H)
        m = offs < H
        lnw = tl.load(ln_w + offs, mask=m, other=0.0).to(tl.float32)
        Xr = tl.load(X + r * 4 * H + i4[:, None] * H + offs[None, :], mask=m[None, :], other=0.0, cache_modifier=".cg")
        w = hc_weights(base, scale)
        j = hc_join(part + r * SLOT_W, ROWS_PAD * SLOT_W, n_parts)
        trace_mark(hdr, cta, 1)                                      # the join's loads are in
        pre, rstd = hc_pre_rstd(w, j, H, eps, hc_eps)
        trace_mark(hdr, cta, 2)                                      # pre and rstd
        g = tl.sum(pre[:, None] * Xr, axis=0) * rstd * lnw          # hc_gate_tile's operations, in its order
        tl.store(a + r * H + offs, g.to(a.dtype.element_ty), mask=m)
        trace_mark(hdr, cta, 3)                                      # the row tile is stored


@triton.jit
def coef_row(part, n_parts, base, scale, coef, r, rows, eps, hc_eps, H: tl.constexpr, ROWS_PAD: tl.constexpr,
             ITERS: tl.constexpr):
    """Row r's mHC coefficients (pre | post | comb, the Sinkhorn) from the joined hc_pre partial slots ->
    coef[r] (hc_store_coef's layout, what hc_post reads); nothing for a pad row. The gate tasks of the
    same row run the same join and pre, so both get the same bits."""
    if r < rows:
        pre, post, comb, rstd = hc_derive(hc_weights(base, scale), hc_join(part + r * SLOT_W, ROWS_PAD * SLOT_W,
                                                                           n_parts), H, eps, hc_eps, ITERS)
        hc_store_coef(coef + r * 24, pre, post, comb)


@triton.jit
def kda_block(S_blk, r, h, v0, yin, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, on,
              o_raw, ssq, eps, lower_bound, PS, hdr, cta, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr,
              N_IN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
              CK: tl.constexpr, KS: tl.constexpr):
    """One (row, head, value block) of the KDA step, after the inproj wait. S_blk: the prefetched old
    state rows. yin row r = q | k | v | b | f_a | g_a (fp32), the sum of KS split-K planes PS elements
    apart (joined here, in plane order). NB = DV // BV == 1: the gated norm runs here (on, the o_proj
    input); otherwise the raw block and its sum of squares go to o_raw / ssq for the kda_norm stage."""
    NB: tl.constexpr = DV // BV
    yr = yin + r * N_IN
    wr = r * (KC - 1) * 3 * D
    fv = kda_lowrank(f_b, yr + 3 * D + NH, h * DK, R, DK, CK, PS, KS)
    trace_mark(hdr, cta, 1)                                          # the forget gate f is formed
    S_new = S_out + r.to(tl.int64) * NH * DV * DK
    o_blk, ss = kda_head_finish(S_blk, yr, yr + 3 * D, fv, win_in + wr, win_out + wr, conv_w, A_log, dt_bias, S_new,
                                h, v0, D, lower_bound, DK, DV, BV, KC, PS, KS)
    trace_mark(hdr, cta, 2)                                          # the delta rule step is done
    if NB == 1:
        gv = kda_lowrank(g_b, yr + 3 * D + NH + R, h * DV + v0, R, BV, CK, PS, KS)
        kda_norm_apply(o_blk, ss, gv, onorm_w, on + r * D, on + r * D, h, v0, eps, DV, BV, False)
    else:
        kda_store_o(o_raw + r * D, ssq + r * NH * NB, o_blk, ss, h, v0, NB, DV, BV)
    trace_mark(hdr, cta, 3)                                          # o (or the raw block) is stored


@triton.jit
def kda_prefetch(S_in, r, h, v0, NH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    return kda_state_prefetch(S_in + r.to(tl.int64) * NH * DV * DK, h, v0, DV, DK, BV)


@triton.jit
def kda_norm_gate(r, h, v0, yin, g_b, PS, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr, N_IN: tl.constexpr,
                  DV: tl.constexpr, BV: tl.constexpr, CK: tl.constexpr, KS: tl.constexpr):
    """The output gate's pre-activation g_b(g_a x) of block v0 of row r, head h: [BV] fp32. It needs only yin
    (the inproj output), so the kda_norm task forms it before its oraw wait."""
    return kda_lowrank(g_b, yin + r * N_IN + 3 * D + NH + R, h * DV + v0, R, BV, CK, PS, KS)


@triton.jit
def kda_norm_task(r, h, v0, gv, onorm_w, on, o_raw, ssq, eps, D: tl.constexpr, NH: tl.constexpr, DV: tl.constexpr,
                  BV: tl.constexpr):
    """Join of a head's block partial sums (block order) and the gated norm of block v0 of row r (gate gv)."""
    NB: tl.constexpr = DV // BV
    kda_norm_block(o_raw + r * D, ssq + r * NH * NB, gv, onorm_w, on + r * D, on + r * D, h, v0, eps, NB, DV, BV,
                   False)


@triton.jit
def xchg_publish(xchg, acc, n0, rows, width, src, n_src, n_dest, tag, site, fault_site, N: tl.constexpr,
                 ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Partial tile acc [BLOCK_N, ROWS_PAD] (acc[j, r] = y[r, n0 + j]) of source src into slot (dest d, src)
    of every dest d < n_dest: xchg [n_dest, n_src, width, N] tagged pairs. A source is a TP rank, or a
    (rank, K slice) of a split-K GEMV whose slices join in the same rank sum (src = rank * KS + slice,
    n_src = tp * KS; at TP 1 the one dest is this rank)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS_PAD)
    m = (offs_n[:, None] < N) & (offs_r[None, :] < rows)
    d = 0
    while d < n_dest:
        base = xchg + (d * n_src + src).to(tl.int64) * width * N
        publish_pairs(base + offs_r[None, :] * N + offs_n[:, None], acc, tag, m, site, fault_site)
        d += 1


TP_MAX: tl.constexpr = tl.constexpr(8)     # the largest TP degree (config.check_tp)


@triton.jit
def xchg_sum(xchg, y, n0, rows, width, dest, n_src, tag, hdr, site, cta, budget_ns, N: tl.constexpr,
             ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Await every source's partial of columns [n0, n0 + BLOCK_N) in dest's slots (xchg_publish) and store
    their sum to y [rows, N] fp32; n_src <= TP_MAX.

    One poll covers all sources' pairs of a row ([TP_MAX, BLOCK_N], sources >= n_src masked), so a row
    costs one round trip, not one per rank (8 dependent polls with a fence each: ~6 us traced at TP8).
    The sources are added by one reduction over the source axis: a fixed order, the same code and layout
    on every rank, so every rank gets the same bits. -> ok."""
    k = tl.arange(0, TP_MAX * BLOCK_N)
    src = k // BLOCK_N
    n = n0 + k % BLOCK_N
    ok = 1
    r = 0
    while (r < rows) & (ok != 0):
        m = (src < n_src) & (n < N)
        base = xchg + (dest * n_src + src).to(tl.int64) * width * N + r * N
        vals, ok = await_pairs(base + n, m, tag, hdr, site, cta, budget_ns)
        v = tl.reshape(tl.where(m, vals.to(tl.float32, bitcast=True), 0.0), [TP_MAX, BLOCK_N])
        if ok != 0:
            cols = n0 + tl.arange(0, BLOCK_N)
            tl.store(y + r * N + cols, tl.sum(v, axis=0), mask=cols < N)
        r += 1
    return ok


@triton.jit
def peer_publish(xchg, peer, p, n0, rows, width, tp_rank, tp_size, tag, site, fault_site, N: tl.constexpr,
                 ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Loopback (one GPU, TP > 1): rank p's partial of columns [n0, n0 + BLOCK_N), taken from
    peer [tp, width, N] fp32, into this rank's slot for source p."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS_PAD)
    m = (offs_n[:, None] < N) & (offs_r[None, :] < rows)
    v = tl.load(peer + (p * width + offs_r[None, :]) * N + offs_n[:, None], mask=m, other=0.0)
    base = xchg + (tp_rank * tp_size + p).to(tl.int64) * width * N
    publish_pairs(base + offs_r[None, :] * N + offs_n[:, None], v, tag, m, site, fault_site)
