"""Device side of the FFN half of a layer launch (dense MLP or MoE), shared by both layer kernels
(launches/kda_layer.py, launches/sparse_layer.py): the task families and `ffn_task`, the one
dispatcher both kernels call for every FFN family (codes FFN_FAMILIES, the same in both kernels), so
adding or changing an FFN family edits this file and the host graph only.

Stages (host side: layer_host.py _ffn_graph for dense, kda.py _ffn_graph for the MoE):
  gate_up   dense / shared-expert gate|up tiles, split-K (KS_GU slices, schedule.py choose_k_split):
            raw fp32 gate and up partial planes -> hpart [KS_GU, width, 2, I]               box hg
  router    (MoE) logit partials over ROUTER_PARTS K ranges -> part_r                        box rl
  route     (MoE) one task per row: joins the row's partials, top-k -> the record (ids, w)  box sel
  expert    (MoE) slots over the (distinct expert, tile, K slice of KS_E) items the record names:
            an expert's gate|up K slice once, for every row that chose it -> epart [KS_E, width, KE, 2, I_E]
                                                                                             box xe
  act       joins the planes in plane order, clamped SwiGLU, bf16: kind 0 the dense / shared h
            columns (waits hg), kind 1 a row's expert activations act_e (waits xe)           box h
            (act_fold, 1-2 rows: no kind 1 tasks; moe_down waits xe and joins its group's itself)
  down      dense down tiles, or moe_down (routed experts in rank order, then the shared one),
            after h; TP 1: y2 + hc_post -> X_out; TP > 1: xd pairs. With KG > 1 (schedule.py
            choose_groups) moe_down tasks are (tile, expert group, row group) and dense down tasks
            (tile, K slice) -> dpart planes                                                   box dp
  down_join (KG > 1) the groups' planes in group order -> y2 + hc_post, or xd; then
  post2     (TP > 1) rank-order sum of xd -> y2, hc_post (NEXTN: X_out = xmid + y2, box z).
Why split-K with a join stage: a gate|up tile is a 2 x 64-row x 4096 GEMV (1 MB bf16). Whole-K tasks
gave a TP8 stage of 24 (dense) or 4 (shared expert) tasks, each a chain of 64 serial K steps: one
CTA's ~30 GB/s, 35-54 us (in-kernel trace, 2026-12-01). Split K, every CTA streams a slice; SwiGLU is
not linear, so the slices join before it, in a small act stage (one hop, ~1-2 us).
"""
import os

import triton
import triton.language as tl

from sync.asm import fence_acq_rel
from sync.device import const_word, trace_mark

from ..kernels.gemv import gemv_store, gemv_store_at, gemv_stream, plane_sum
from ..kernels.mlp import swiglu_clamped
from ..kernels.moe import (ROUTER_CK as MOE_ROUTER_CK, moe_down_group, router_bias, router_logits,
                           router_prefetch, router_slice_partial, router_store_record,
                           router_topk)
from .ffn import (B_A, B_CF2, B_DP, B_H, B_HG, B_RL, B_SEL, B_XE, M_A, M_ACT_CTA, M_ACT_FOLD, M_ACTE, M_COEF2, M_DPART,
                  M_EPART, M_H, M_HPART, M_IDS, M_NRPART, M_PART_R, M_RW, M_SITE_XD, M_XMID, M_Y2, _rank_sum_tiles,
                  act_at, add_cols, f32_at, gemv_tile, i32_at, l2_prefetch_rows, post_cols,
                  sig_words, signal_at, waitb, waitb2, warm_before)
from .mixer_kda import xchg_publish

FFN_BASE = tl.constexpr(40)
FFN_FAMILIES = {"gu": 40, "act": 41, "router": 42, "expert": 43, "down": 44, "moe_down": 45, "post2": 46,
                "route": 47, "down_join": 48}


def with_ffn_families(own: dict) -> dict:
    """A kernel's family codes: its own plus FFN_FAMILIES; a name or code both use is an error (the DSA
    kernel's top-k `select` once shadowed an FFN family of the same name)."""
    clash = (own.keys() & FFN_FAMILIES.keys()) | ({c for c in own.values()} & set(FFN_FAMILIES.values()))
    if clash:
        raise ValueError(f"task families clash with the FFN families: {sorted(map(str, clash))}")
    return {**own, **FFN_FAMILIES}


# GLM53_ACT_FENCE=1 (A/B timings only): _group_act fences its stores at gpu scope before the barrier, as it did
ACT_FENCE: tl.constexpr = tl.constexpr(os.environ.get("GLM53_ACT_FENCE", "") == "1")

ACT_COLS = 256              # act columns per task (expert activations) and per vector step
ACT_BLOCK = tl.constexpr(ACT_COLS)
ROUTER_BLOCK_E = 32         # experts per router task (launches/kda.py _ffn_graph): 144 tasks of 32 KB at E = 288,
                            # one wave on 264 CTAs (16: 288 tasks, 24 CTAs ran two in a row, +6 us traced)
# The router partial's slice form (kernels/moe.py router_slice_partial): a router task loads its whole K range's
# weights (32 experts x 256 columns fp32 at H 4096: two [32, 128] tiles, 64 registers a thread) before its a wait and,
# after it, one fp32 dot a row. RCK is the width of the two tiles (router_rck); the launches' router_ck (layer_host.py,
# ROUTER_MIN_CK by default) is the least tile width. The step form (MMA steps after the wait; switches
# GLM53_ROUTER_SLICE / _CK / _PF) was dropped in the nineteenth session: -2.8 / -3.6 us kda TP8 1 row, -5.0 at 8 rows
# for the slice form (bench/RESULTS.md); the standalone router kernel (kernels/moe.py) keeps its own step loop.
ROUTER_MIN_CK = MOE_ROUTER_CK
# GLM53_EXPERT_DIV (default 2 since the twenty-first session; 1 for A/B timings): expert items of BLOCK_N / 2 gate and
# as many up rows with twice the K step, so a pipeline stage holds the same 16 KB and every weight row is read in
# 256-byte pieces (bf16) instead of 128: the expert stream reached ~2.0 TB/s on the H100 where in_proj (256-byte
# pieces) reached ~2.6. The K split is then chosen for the smaller tiles (expert_bn, launches/kda.py): 4 slices of 1024
# at TP8 instead of 8 of 512. TP8 1 row, H100: kda -0.5..-0.8 us (s19), sparse 8191 -1.1..-1.5, kda FP8 -0.2..+0.3,
# nextn's block -1.2 (s21B).
EXPERT_DIV: tl.constexpr = tl.constexpr(int(os.environ.get("GLM53_EXPERT_DIV", "2")))
if EXPERT_DIV.value not in (1, 2):
    raise ValueError(f"GLM53_EXPERT_DIV={EXPERT_DIV.value} must be 1 or 2")


def expert_bn(block_n: int) -> int:
    """Gate (and up) rows of an expert item for the launch's block_n (EXPERT_DIV)."""
    return block_n // EXPERT_DIV.value


def router_rck(H: int, parts: int, ck: int = ROUTER_MIN_CK) -> int:
    """The kernels' RCK for hidden size H over `parts` router K ranges: the width of the two register tiles that
    cover one K range (a power of two, at least ck; the ranges, rounded up to a multiple of it, then span at most
    two: 128 at H 4096)."""
    span = -(-(-(-H // parts)) // ck) * ck
    return max(ck, triton.next_power_of_2(span) // 2)


# ---------------------------------------------------------------------------- compute pieces
@triton.jit(noinline=True)
def gateup_part_tile(wgu, sgu, x, stride_x, part, rows, i0, k0, k1, I: tl.constexpr, H: tl.constexpr,
                     ROWS_PAD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """K slice [k0, k1) of a gate|up tile: part[r, 0, i0 + j] = x[r] . gate[i0 + j], part[r, 1, i0 + j] =
    x[r] . up[i0 + j] (raw fp32 partial plane [rows, 2, I]; the act stage joins the slices, then SwiGLU).
    wgu: a packed bank [2I, H] (gate rows, then up rows; sgu its FP8 scales [2I/128, H/128], or wgu for
    bf16): both halves as one pair tile in one pipeline (gemv_stream GAP = I), whose stage holds the bytes
    of a single tile's: half the K step for bf16 (same bits: the MMAs add the same k16 products in the same
    order), the one 128-wide scale block for FP8. A call: the tile loop around it keeps no hoisted index
    tensors of the K loop live."""
    PK: tl.constexpr = BLOCK_K if wgu.dtype.element_ty == tl.float8e4nv else BLOCK_K // 2
    acc = gemv_stream(wgu, sgu, x, stride_x, rows, i0, k0, k1, I, H, ROWS_PAD, 2 * BLOCK_I, PK, NUM_STAGES, False, I)
    gemv_store(part, 2 * I, acc, rows, i0, I, ROWS_PAD, 2 * BLOCK_I, I)


@triton.jit
def swiglu_join(part, PS, out, c0, c1, limit, IW: tl.constexpr, KS: tl.constexpr, BLOCK: tl.constexpr):
    """out[c] = swiglu(sum_s g_s, sum_s u_s) for columns c in [c0, c1) of a [groups, IW] activation row
    (group c // IW, its gate at part[group * 2 * IW + c % IW], its up IW further; KS planes PS apart,
    joined in plane order)."""
    c = c0
    while c < c1:
        cc = c + tl.arange(0, BLOCK)
        m = cc < c1
        base = (cc // IW) * 2 * IW + cc % IW
        g = plane_sum(part, base, m, PS, KS)
        u = plane_sum(part, base + IW, m, PS, KS)
        tl.store(out + cc, swiglu_clamped(g, u, limit).to(out.dtype.element_ty), mask=m)
        c += BLOCK


@triton.jit
def _post_ffn_at(X_out, xmid, y2, coef2, sb, sw, ss, rows, a0, a1, a2, tag, fault_site, H: tl.constexpr,
                 BLOCK_N: tl.constexpr, NEXTN: tl.constexpr):
    """After the FFN's output tiles a0 .. a0 + a1 - 1 (y2) are complete: hc_post of the FFN (xmid, y2 ->
    X_out); NEXTN: X_out [width, H] = xmid + y2 and signal box z (sb, sw, ss: its sig_words; producer a2)."""
    tl.debug_barrier()
    if NEXTN:
        add_cols(xmid, y2, X_out, rows, a0 * BLOCK_N, tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
        signal_at(sb, sw, ss, a2, tag, fault_site)
    else:
        post_cols(xmid, y2, coef2, X_out, rows, a0 * BLOCK_N, tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)


@triton.jit
def _ffn_rows(scratch, meta):
    """The rows _post_ffn_at reads (xmid, y2, coef2)."""
    return f32_at(scratch, meta, M_XMID), f32_at(scratch, meta, M_Y2), f32_at(scratch, meta, M_COEF2)


@triton.jit
def _post_ffn(X_out, scratch, meta, rows, a0, a1, a2, tag, fault_site, H: tl.constexpr, BLOCK_N: tl.constexpr,
              NEXTN: tl.constexpr, B_Z: tl.constexpr):
    """_post_ffn_at with its rows and box words loaded here (post2_task loads them before its waits)."""
    xmid, y2, coef2 = _ffn_rows(scratch, meta)
    sb, sw, ss = sig_words(scratch, meta, B_Z)
    _post_ffn_at(X_out, xmid, y2, coef2, sb, sw, ss, rows, a0, a1, a2, tag, fault_site, H, BLOCK_N, NEXTN)


# ---------------------------------------------------------------------------- task families
@triton.jit(noinline=True)
def gu_task(W_g, S_g, W_u, S_u, scratch, meta, rows, width, a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns,
            fault_site, H: tl.constexpr, I: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr, KS: tl.constexpr):
    """gate|up tiles a0 .. a0 + a1 - 1 (dense MLP or shared expert), K slice a3 of KS, after the a wait ->
    hpart plane a3, producer a2 of hg. W_g / S_g are the packed [2I, H] bank (layer_host.py _gate_up; W_u and
    S_u are views into it, for the weights' L2 prefetch). -> (ok, rdy)."""
    KL: tl.constexpr = H // KS
    k0 = a3 * KL
    l2_prefetch_rows(W_g + k0, a0 * BLOCK_N, I, H, BLOCK_N)             # weights before the wait
    l2_prefetch_rows(W_u + k0, a0 * BLOCK_N, I, H, BLOCK_N)
    part = f32_at(scratch, meta, M_HPART) + a3 * width * 2 * I        # meta words before the wait (see waitb)
    x = act_at(scratch, meta, M_A, ACT_F32)
    sb, sw, ss = sig_words(scratch, meta, B_HG)
    ok, rdy = waitb(scratch, meta, B_A, rdy, pid, tag, hdr, timeout_ns)
    j = 0
    while (j < a1) & (ok != 0):
        gateup_part_tile(W_g, S_g, x, H, part, rows, (a0 + j) * BLOCK_N, k0, k0 + KL, I, H, ROWS_PAD, BLOCK_N,
                         BLOCK_K, NUM_STAGES)
        j += 1
    if ok != 0:
        signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def act_task(scratch, meta, rows, width, a0, a1, a2, a3, a4, rdy, pid, tag, hdr, timeout_ns, fault_site,
             swiglu_limit, I: tl.constexpr, KE: tl.constexpr, I_E: tl.constexpr, ACT_F32: tl.constexpr,
             KS_GU: tl.constexpr, KS_E: tl.constexpr):
    """act kind a0 = 0: columns [a2, a3) of every row's h from the hpart planes (waits hg); a0 = 1: row
    a1's expert activations act_e, flat columns [a2, a3) of its [KE, I_E] (waits xe). Producer a4 of h.
    -> (ok, rdy)."""
    sb, sw, ss = sig_words(scratch, meta, B_H)
    if a0 == 0:
        hpart = f32_at(scratch, meta, M_HPART)                          # meta words before the wait (ffn.waitb)
        h = act_at(scratch, meta, M_H, ACT_F32)
        ok, rdy = waitb(scratch, meta, B_HG, rdy, pid, tag, hdr, timeout_ns)
        if ok != 0:
            r = 0
            while r < rows:
                swiglu_join(hpart + r * 2 * I, width * 2 * I, h + r * I, a2, a3, swiglu_limit, I, KS_GU, ACT_BLOCK)
                r += 1
    else:
        epart = f32_at(scratch, meta, M_EPART) + a1 * KE * 2 * I_E
        acte = act_at(scratch, meta, M_ACTE, ACT_F32) + a1 * KE * I_E
        ok, rdy = waitb(scratch, meta, B_XE, rdy, pid, tag, hdr, timeout_ns)
        if (ok != 0) & (a1 < rows):
            swiglu_join(epart, width * KE * 2 * I_E, acte, a2, a3, swiglu_limit, I_E, KS_E, ACT_BLOCK)
    if ok != 0:
        signal_at(sb, sw, ss, a4, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def down_task(W_d, S_d, X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, a3, rdy, pid, tag, hdr,
              timeout_ns, fault_site, H: tl.constexpr, I: tl.constexpr, ROWS_PAD: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
              ACT_F32: tl.constexpr, KG: tl.constexpr):
    """Dense down tiles a0 .. a0 + a1 - 1 after the h wait. KG == 1: TP 1 y2, then hc_post -> X_out; TP > 1
    xd. KG > 1: K slice a3 of KG -> dpart plane a3, producer a2 of dp; down_join adds the planes in order
    (the moe_down groups' join: 64 tiles of full K kept 64 of 264 CTAs busy, ~44 us at TP 1). -> (ok, rdy)."""
    KL: tl.constexpr = I // KG
    k0 = a3 * KL
    l2_prefetch_rows(W_d + k0, a0 * BLOCK_N, H, I, BLOCK_N)             # weights before the wait
    x = act_at(scratch, meta, M_H, ACT_F32)                             # meta words too (see waitb)
    if KG == 1:
        y = f32_at(scratch, meta, M_Y2)
    else:
        y = f32_at(scratch, meta, M_DPART) + a3 * width * H
    site = const_word(meta + M_SITE_XD)
    if KG > 1:
        sb, sw, ss = sig_words(scratch, meta, B_DP)                     # the plane's signal, before the wait
    if KG == 1:
        # h and hc_post's coefficients in one spin (ffn.waitb2), before this rank's xd (a stall of either still
        # starves every rank)
        ok, rdy = waitb2(scratch, meta, B_CF2, B_H, rdy, pid, tag, hdr, timeout_ns)
    else:
        ok, rdy = waitb(scratch, meta, B_H, rdy, pid, tag, hdr, timeout_ns)
    n_src = tp_size if KG == 1 else 1
    j = 0
    while (j < a1) & (ok != 0):
        gemv_tile(W_d, S_d, x, I, (a0 + j) * BLOCK_N, k0, k0 + KL, rows, width, tp_rank, n_src, tp_size, y, H, xd,
                  tag, site, fault_site, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, True)
        j += 1
    if KG == 1:
        if (ok != 0) & (tp_size == 1):
            _post_ffn(X_out, scratch, meta, rows, a0, a1, 0, tag, fault_site, H, BLOCK_N, False, 0)
    elif ok != 0:
        signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def post2_task(X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, a3, a4, pid, tag, hdr, timeout_ns,
               fault_site, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NEXTN: tl.constexpr,
               B_Z: tl.constexpr):
    """down_sum (TP > 1): rows a3 .. a3 + a4 - 1 (those below `rows`) of tiles a0 .. a0 + a1 - 1: the rank-order
    sum of their xd partials -> y2, then _post_ffn. A row's work and bits do not depend on its group; split, the
    rows run on separate CTAs instead of one after another (8 rows: post2 own 10.6 us where 1 row takes 1.9, H100
    trace). NEXTN: producer a2 of box z, which it signals whatever its rows (the box counts every task). -> ok."""
    xmid, y2, coef2 = _ffn_rows(scratch, meta)                          # meta words before the waits (ffn.waitb)
    sb, sw, ss = sig_words(scratch, meta, B_Z)
    RS: tl.constexpr = H if NEXTN else 4 * H                            # row stride of xmid and X_out
    nr = tl.maximum(tl.minimum(a4, rows - a3), 0)
    ok = _rank_sum_tiles(xd + a3 * H, y2 + a3 * H, a0, a1, nr, width, tp_rank, tp_size, tag, hdr,
                         const_word(meta + M_SITE_XD), pid, timeout_ns, H, ROWS_PAD, BLOCK_N)
    if ok != 0:
        if nr > 0:
            _post_ffn_at(X_out + a3 * RS, xmid + a3 * RS, y2 + a3 * H, coef2 + a3 * 24, sb, sw, ss, nr, a0, a1, a2,
                         tag, fault_site, H, BLOCK_N, NEXTN)
        elif NEXTN:                 # a group past the launch's rows: nothing to add, box z still counts it
            signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok


@triton.jit(noinline=True)
def router_task(W_r, scratch, meta, rows, width, a0, a1, a2, a3, a4, rdy, pid, tag, hdr, timeout_ns, fault_site,
                E: tl.constexpr, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_E: tl.constexpr, RCK: tl.constexpr,
                ACT_F32: tl.constexpr):
    """Router logit partial: experts [a0, a0 + BLOCK_E), K range [a1, a2), K part a4, producer a3 of rl: two
    RCK-wide tiles cover the K range, both in registers before the wait. -> (ok, rdy)."""
    w0 = router_prefetch(W_r, a0, a1, a2, E, H, BLOCK_E, RCK)
    w1 = router_prefetch(W_r, a0, a1 + RCK, a2, E, H, BLOCK_E, RCK)          # the range's second tile
    x = act_at(scratch, meta, M_A, ACT_F32)                             # meta words before the wait (see waitb)
    part = f32_at(scratch, meta, M_PART_R) + a4 * width * E
    sb, sw, ss = sig_words(scratch, meta, B_RL)
    # two passes of one copy of the code: a dry run before the wait (its code warm, nothing stored: ffn.WARM_CODE;
    # the weights are already in registers, so it reads only x), then the real one
    ok = 1
    it = tl.where(warm_before(rdy, B_A), 0, 1)
    while it < 2:
        if it == 1:
            ok, rdy = waitb(scratch, meta, B_A, rdy, pid, tag, hdr, timeout_ns)
        if ok != 0:
            router_slice_partial(part, w0, w1, x, H, tl.where(it == 1, rows, 1), a0, a1, a2, E, it, ROWS_PAD,
                                 BLOCK_E, RCK)
        it += 1
    if ok != 0:
        signal_at(sb, sw, ss, a3, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def route_task(bias_r, scratch, meta, rows, width, a0, a1, rdy, pid, tag, hdr, timeout_ns, fault_site, scaling,
                E: tl.constexpr, KE: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr):
    """Row a0's routing after the rl wait: join its logit partials (kernels/moe.py router_select), write its
    record (ids, weights), producer a1 of sel. One task per row: an expert slot then reads one id instead
    of repeating the join and the top-k (which cost every slot ~3-4 us; 2048 slots at 8 rows). -> (ok, rdy)."""
    part = f32_at(scratch, meta, M_PART_R) + a0 * E                     # meta words before the wait (see waitb)
    nrpart = const_word(meta + M_NRPART)
    ids_out = i32_at(scratch, meta, M_IDS) + a0 * KE
    w_out = f32_at(scratch, meta, M_RW) + a0 * KE
    sb, sw, ss = sig_words(scratch, meta, B_SEL)
    if warm_before(rdy, B_RL) & (a0 < rows):                            # the record's code, warm (ffn.WARM_CODE)
        _route_record(part, nrpart, ids_out, w_out, bias_r, width, scaling, hdr, pid, E, KE, E_PAD, K_PAD, RENORM)
    ok, rdy = waitb(scratch, meta, B_RL, rdy, pid, tag, hdr, timeout_ns)
    if (ok != 0) & (a0 < rows):
        _route_record(part, nrpart, ids_out, w_out, bias_r, width, scaling, hdr, pid, E, KE, E_PAD, K_PAD, RENORM)
    if ok != 0:
        signal_at(sb, sw, ss, a1, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _route_record(part, nrpart, ids_out, w_out, bias_r, width, scaling, hdr, pid, E: tl.constexpr, KE: tl.constexpr,
                  E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr):
    """Join the row's logit partials (kernels/moe.py router_select, with marks between), pick its top-k, store
    its record (ids, weights). noinline: route_task runs it once before its wait too (ffn.WARM_CODE)."""
    b = router_bias(bias_r, E, E_PAD)                                    # in the planes' round trip
    logit = router_logits(part, width * E, nrpart, E, E_PAD)
    trace_mark(hdr, pid, 1)                                              # the partials are joined
    ids, w = router_topk(logit, b, E, scaling, KE, E_PAD, K_PAD, RENORM)
    trace_mark(hdr, pid, 2)                                              # the top-k is picked
    router_store_record(ids_out, w_out, ids, w, KE, K_PAD)
    trace_mark(hdr, pid, 3)                                              # the record is stored


@triton.jit
def _distinct_experts(ids, rows, E, KE: tl.constexpr, ROWS_PAD: tl.constexpr, K_PAD: tl.constexpr):
    """The record's distinct experts in order of first choice ((row, rank) order): (v, first, rank) over the
    flat [ROWS_PAD * K_PAD] (row, rank) entries: v the expert (clamped into [0, E) so a bad record cannot read
    out of bounds; -1 past the rows), first whether the entry is its expert's first choice, rank the number of
    first choices before it (the distinct expert's index d where first). .cg: another CTA wrote the record."""
    N: tl.constexpr = ROWS_PAD * K_PAD
    i = tl.arange(0, N)
    r = i // K_PAD
    j = i % K_PAD
    v = tl.load(ids + r * KE + j, mask=(r < rows) & (j < KE), other=-1, cache_modifier=".cg")
    v = tl.where(v < 0, tl.where((r < rows) & (j < KE), 0, -1), tl.minimum(v, E - 1))
    earlier = (v[:, None] == v[None, :]) & (i[None, :] < i[:, None])
    first = (v >= 0) & (tl.max(earlier.to(tl.int32), axis=1) == 0)
    rank = tl.cumsum(first.to(tl.int32), axis=0) - first.to(tl.int32)
    return v, first, rank


@triton.jit(noinline=True)
def expert_item(w_gu, s_gu, x, part, ids, rows, e, j1, i0, k0, E: tl.constexpr, KE: tl.constexpr,
                I_E: tl.constexpr, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, KL: tl.constexpr, K_PAD: tl.constexpr):
    """K slice [k0, k0 + KL) of expert e's gate|up tile i0 against every row's x (x [rows, H]), stored for each
    row that chose e at its (row, rank) place of the plane part [width, KE, 2, I_E] (j1 >= 0: one row, which
    chose e at rank j1). A call (as gateup_part_tile): the item loop around it keeps no index tensors of the K
    loop live."""
    rr = tl.arange(0, ROWS_PAD)
    if j1 >= 0:
        row_ok = rr == 0
        row_off = rr * 0 + j1 * (2 * I_E)
    else:
        jj = tl.arange(0, K_PAD)
        rec = tl.load(ids + rr[:, None] * KE + jj[None, :], mask=(rr[:, None] < rows) & (jj[None, :] < KE),
                      other=-1, cache_modifier=".cg")
        hit = tl.minimum(tl.maximum(rec, 0), E - 1) == e                # as _distinct_experts clamps: at most
        hit = hit & (rr[:, None] < rows) & (jj[None, :] < KE)           # one rank a row (top-k picks differ)
        row_ok = tl.max(hit.to(tl.int32), axis=1) != 0
        row_off = (rr * KE + tl.sum(tl.where(hit, jj[None, :], 0), axis=1)) * (2 * I_E)
    e64 = e.to(tl.int64)
    wgu = w_gu + e64 * 2 * I_E * H
    if w_gu.dtype.element_ty == tl.float8e4nv:
        nkb: tl.constexpr = (H + 127) // 128
        sgu = s_gu + e64 * (2 * (I_E // 128) * nkb)
    else:
        sgu = wgu
    PK: tl.constexpr = BLOCK_K if w_gu.dtype.element_ty == tl.float8e4nv else BLOCK_K // 2
    acc = gemv_stream(wgu, sgu, x, H, rows, i0, k0, k0 + KL, I_E, H, ROWS_PAD, 2 * BLOCK_N, PK, NUM_STAGES, False,
                      I_E)
    gemv_store_at(part, row_off, row_ok, acc, i0, I_E, ROWS_PAD, 2 * BLOCK_N, I_E)


@triton.jit(noinline=True)
def expert_task(w_gu, s_gu, scratch, meta, rows, width, a0, a1, a4, rdy, pid, tag, hdr, timeout_ns, fault_site,
                E: tl.constexpr, KE: tl.constexpr, I_E: tl.constexpr, H: tl.constexpr, ROWS_PAD: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr,
                KS: tl.constexpr, K_PAD: tl.constexpr):
    """Expert slot a0 of a1 after the sel wait, producer a4 of xe: work items a0, a0 + a1, ... of the (distinct
    expert d, tile t, K slice ks) items the record names (launches/kda.py expert_slots). An item streams its K
    slice of expert d's gate|up tile once, every row's x against it, and stores each row that chose d at its
    (row, rank) place of epart plane ks: a row's tile is the same MMA column work it was alone, so the same bits,
    and the expert's weights are read once however many rows chose it (8 rows: ~23 distinct of 64 picks in
    time_layers' routing). -> (ok, rdy)."""
    ids = i32_at(scratch, meta, M_IDS)                                  # meta words before the wait (see waitb)
    x = act_at(scratch, meta, M_A, ACT_F32)
    epart = f32_at(scratch, meta, M_EPART)
    KL: tl.constexpr = H // KS
    EBN: tl.constexpr = BLOCK_N // EXPERT_DIV                          # an item's gate rows (expert_bn)
    EBK: tl.constexpr = BLOCK_K * EXPERT_DIV                           # and its K step: 16 KB a stage either way
    TPE: tl.constexpr = ((I_E + EBN - 1) // EBN) * KS                  # items of one expert
    sb, sw, ss = sig_words(scratch, meta, B_XE)
    ok, rdy = waitb(scratch, meta, B_SEL, rdy, pid, tag, hdr, timeout_ns)
    if (ok != 0) & (rows == 1):     # one row: its picks differ, so expert d is its rank d (no record join, whose
        w = a0                      # cross-warp reductions cost the 1-row path ~2-4 us, H100 trace)
        while w < KE * TPE:
            d = w // TPE
            e = tl.minimum(tl.maximum(tl.load(ids + d, cache_modifier=".cg"), 0), E - 1)
            ks = w % KS
            expert_item(w_gu, s_gu, x, epart + ks * (width * KE * 2 * I_E), ids, rows, e, d,
                        ((w % TPE) // KS) * EBN, ks * KL, E, KE, I_E, H, ROWS_PAD, EBN, EBK, NUM_STAGES, KL, K_PAD)
            w += a1
    elif ok != 0:
        v, first, rank = _distinct_experts(ids, rows, E, KE, ROWS_PAD, K_PAD)
        n_items = tl.sum(first.to(tl.int32), axis=0) * TPE
        w = a0
        while w < n_items:
            d = w // TPE
            e = tl.sum(tl.where(first & (rank == d), v, 0), axis=0)
            ks = w % KS
            expert_item(w_gu, s_gu, x, epart + ks * (width * KE * 2 * I_E), ids, rows, e, -1,
                        ((w % TPE) // KS) * EBN, ks * KL, E, KE, I_E, H, ROWS_PAD, EBN, EBK, NUM_STAGES, KL, K_PAD)
            w += a1
    trace_mark(hdr, pid, 1)                                          # the slot's partial tiles are stored
    if ok != 0:
        signal_at(sb, sw, ss, a4, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _group_act(scratch, meta, rr, g, pid, width, swiglu_limit, KE: tl.constexpr, I_E: tl.constexpr, KG: tl.constexpr,
               KS_E: tl.constexpr, ACT_F32: tl.constexpr):
    """act_fold: row rr's activations of expert group g's routed experts, joined from the epart planes exactly
    as the act stage does (swiglu_join, plane order), into this CTA's act_cta row (_group_src: where it lies).
    The CTA barrier after the stores is all the GEMV's cp.async reads of the row need: a barrier makes every
    thread's earlier global accesses visible to the CTA's threads whatever the cache operator of the later
    loads (CTA scope; nothing outside the CTA reads the row). The fence.acq_rel.gpu every thread ran here
    before waited for the stores to reach gpu scope, which only other CTAs need (H200, kda TP8: moe_down's own
    time on the critical path 10.1 -> 8.9 us)."""
    PG: tl.constexpr = (KE + 1) // KG
    src = _group_src(scratch, meta, g, pid, KE, I_E, KG, ACT_F32)
    tl.debug_barrier()                                  # the previous row's GEMVs are done with the row
    swiglu_join(f32_at(scratch, meta, M_EPART) + rr * KE * 2 * I_E, width * KE * 2 * I_E, src, g * PG * I_E,
                tl.minimum(g * PG + PG, KE) * I_E, swiglu_limit, I_E, KS_E, ACT_BLOCK)
    if ACT_FENCE:
        fence_acq_rel()                                 # A/B only (GLM53_ACT_FENCE=1): the fence this fold had
    tl.debug_barrier()


@triton.jit
def _group_src(scratch, meta, g, pid, KE: tl.constexpr, I_E: tl.constexpr, KG: tl.constexpr, ACT_F32: tl.constexpr):
    """act_e-shaped pointer into this CTA's act_cta row (expert j of group g at + j * I_E), formed from the meta
    word where it is used, so the GEMV's x loads stay provably 16-byte aligned (vector copies)."""
    PG: tl.constexpr = (KE + 1) // KG
    return act_at(scratch, meta, M_ACT_CTA, ACT_F32) + pid * (PG * I_E) - g * (PG * I_E)


@triton.jit(noinline=True)
def _moe_down_row(W_d, S_d, w_de, s_de, xd, scratch, meta, rr, n0, g, width, tp_rank, tp_size, tag, fault_site, fold, pid,
                  hdr, E: tl.constexpr, H: tl.constexpr, I: tl.constexpr, I_E: tl.constexpr, KE: tl.constexpr,
                  ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr, KG: tl.constexpr):
    """Row rr's MoE output columns [n0, n0 + BLOCK_N) from expert group g of KG (kernels/moe.py
    moe_down_group; KG == 1: all K + 1 GEMVs, moe_down_finish's sum); the routed activations from act_e's row,
    or (fold) from _group_act's. KG == 1: y2 (TP 1) or this rank's xd slot (TP > 1); KG > 1: partial plane g
    of dpart, which down_join adds up."""
    PG: tl.constexpr = (KE + 1) // KG
    if fold != 0:
        act_src = _group_src(scratch, meta, g, pid, KE, I_E, KG, ACT_F32)
    else:
        act_src = act_at(scratch, meta, M_ACTE, ACT_F32) + rr * KE * I_E
    acc = moe_down_group(W_d, S_d, act_at(scratch, meta, M_H, ACT_F32) + rr * I,
                         i32_at(scratch, meta, M_IDS) + rr * KE, f32_at(scratch, meta, M_RW) + rr * KE,
                         act_src, w_de, s_de, n0, g * PG, g * PG + PG,
                         E, H, I_E, I, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES, KE, PG if PG <= 3 else 0)
    trace_mark(hdr, pid, 2)                                          # the group's GEMVs are done
    if KG > 1:
        gemv_store(f32_at(scratch, meta, M_DPART) + (g * width + rr) * H, 0, acc, 1, n0, H, ROWS_PAD, BLOCK_N)
    elif tp_size == 1:
        gemv_store(f32_at(scratch, meta, M_Y2) + rr * H, 0, acc, 1, n0, H, ROWS_PAD, BLOCK_N)
    else:
        xchg_publish(xd + rr * H, acc, n0, 1, width, tp_rank, tp_size, tp_size, tag, const_word(meta + M_SITE_XD),
                     fault_site, H, ROWS_PAD, BLOCK_N)
    trace_mark(hdr, pid, 3)                                          # stored / published


@triton.jit(noinline=True)
def moe_down_task(W_d, S_d, w_de, s_de, X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, a3, a4,
                  rdy, pid, tag, hdr, timeout_ns, fault_site, swiglu_limit, E: tl.constexpr, H: tl.constexpr,
                  I: tl.constexpr, I_E: tl.constexpr, KE: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr,
                  NEXTN: tl.constexpr, B_Z: tl.constexpr, KG: tl.constexpr, KS_E: tl.constexpr):
    """MoE down tiles a0 .. a0 + a1 - 1, expert group a3 of KG, row by row (routed experts in rank order,
    then the shared expert), after the h wait (every activation and the record are in), rows of a4 = first << 8
    | count (0: every row; launches/kda.py row groups; a row's work and bits do not depend on its group).
    KG == 1: TP 1 y2, then _post_ffn (producer a2; every row: never split); TP > 1 xd. KG > 1: partial planes,
    producer a2 of dp. -> (ok, rdy).
    No routed down tile moves toward L2 ahead (after a sel wait, as it did): the expert stage's gate|up stream
    pushed most of them out again, and the 16 MB burst beside it cost kda TP8 1.9 us and sparse 1.2 (H100,
    bench/RESULTS.md sixteenth session; with evict_last, +0.4 and +2.3).
    act_fold (meta word; launches/kda.py, small widths): there is no act stage for the routed experts; h holds
    the shared expert's activations only, and the task waits on xe and joins its group's routed activations
    per row itself (_group_act: the same code and order, so the same bits)."""
    r0 = a4 >> 8
    r1 = tl.where((a4 & 255) == 0, rows, tl.minimum(r0 + (a4 & 255), rows))
    l2_prefetch_rows(W_d, a0 * BLOCK_N, H, I, BLOCK_N)                  # shared expert's weights
    fold = const_word(meta + M_ACT_FOLD)
    sb, sw, ss = sig_words(scratch, meta, B_DP)                         # KG > 1: the group plane's signal
    if (KG == 1) and (not NEXTN):       # with hc_post's coefficients, as down_task
        ok, rdy = waitb2(scratch, meta, B_CF2, B_H, rdy, pid, tag, hdr, timeout_ns)
        if (ok != 0) & (fold != 0):
            ok, rdy = waitb(scratch, meta, B_XE, rdy, pid, tag, hdr, timeout_ns)
    elif fold != 0:                     # h and the routed partials in one spin (a second wait: ~1.5 us)
        ok, rdy = waitb2(scratch, meta, B_H, B_XE, rdy, pid, tag, hdr, timeout_ns)
    else:
        ok, rdy = waitb(scratch, meta, B_H, rdy, pid, tag, hdr, timeout_ns)
    j = 0
    while (j < a1) & (ok != 0):
        n0 = (a0 + j) * BLOCK_N
        rr = r0
        while rr < r1:
            if fold != 0:
                _group_act(scratch, meta, rr, a3, pid, width, swiglu_limit, KE, I_E, KG, KS_E, ACT_F32)
            trace_mark(hdr, pid, 1)                                  # the row's activations are joined (fold)
            _moe_down_row(W_d, S_d, w_de, s_de, xd, scratch, meta, rr, n0, a3, width, tp_rank, tp_size, tag,
                          fault_site, fold, pid, hdr, E, H, I, I_E, KE, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES,
                          ACT_F32, KG)
            rr += 1
        j += 1
    if KG == 1:
        if (ok != 0) & (tp_size == 1):
            _post_ffn(X_out, scratch, meta, rows, a0, a1, a2, tag, fault_site, H, BLOCK_N, NEXTN, B_Z)
    elif ok != 0:
        signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def down_join_task(X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, rdy, pid, tag, hdr,
                   timeout_ns, fault_site, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                   NEXTN: tl.constexpr, B_Z: tl.constexpr, KG: tl.constexpr):
    """down_join (KG > 1): tiles a0 .. a0 + a1 - 1 of every row = its KG group planes added in group order;
    TP 1: y2, then _post_ffn (producer a2); TP > 1: this rank's xd slot. -> (ok, rdy)."""
    dpart = f32_at(scratch, meta, M_DPART)                              # meta words before the wait (ffn.waitb)
    y2 = f32_at(scratch, meta, M_Y2)
    site = const_word(meta + M_SITE_XD)
    if NEXTN:
        ok, rdy = waitb(scratch, meta, B_DP, rdy, pid, tag, hdr, timeout_ns)
    else:           # with hc_post's coefficients, before this rank's xd (a stall here starves every rank)
        ok, rdy = waitb2(scratch, meta, B_CF2, B_DP, rdy, pid, tag, hdr, timeout_ns)
    offs_r = tl.arange(0, ROWS_PAD)
    j = 0
    while (j < a1) & (ok != 0):
        n0 = (a0 + j) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        m = (offs_n[:, None] < H) & (offs_r[None, :] < rows)
        acc = plane_sum(dpart, offs_r[None, :] * H + offs_n[:, None], m, width * H, KG)
        if tp_size == 1:
            gemv_store(y2, H, acc, rows, n0, H, ROWS_PAD, BLOCK_N)
        else:
            xchg_publish(xd, acc, n0, rows, width, tp_rank, tp_size, tp_size, tag, site, fault_site, H, ROWS_PAD,
                         BLOCK_N)
        j += 1
    if (ok != 0) & (tp_size == 1):
        _post_ffn(X_out, scratch, meta, rows, a0, a1, a2, tag, fault_site, H, BLOCK_N, NEXTN, B_Z)
    return ok, rdy


# ---------------------------------------------------------------------------- the dispatcher
@triton.jit
def ffn_task(fam, a0, a1, a2, a3, a4, ok, rdy, pid, tag, hdr, timeout_ns, fault_site, scratch, meta, rows, width,
             tp_rank, tp_size, X_out, xd, W_g, S_g, W_u, S_u, W_d, S_d, W_r, bias_r, w_gu, s_gu, w_de, s_de,
             swiglu_limit, scaling, H: tl.constexpr, I: tl.constexpr, E: tl.constexpr, KE: tl.constexpr,
             I_E: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr,
             ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
             NUM_STAGES: tl.constexpr, BLOCK_E: tl.constexpr, RCK: tl.constexpr, ACT_F32: tl.constexpr,
             MOE: tl.constexpr, NEXTN: tl.constexpr, B_Z: tl.constexpr, KS_GU: tl.constexpr, KS_E: tl.constexpr,
             KG: tl.constexpr):
    """Run FFN task `fam` (FFN_FAMILIES) with its args a0 .. a4. -> (ok, rdy)."""
    if fam == 40:                                      # gu: tiles a0 .. a0 + a1 - 1, producer a2, K slice a3
        ok, rdy = gu_task(W_g, S_g, W_u, S_u, scratch, meta, rows, width, a0, a1, a2, a3, rdy, pid, tag, hdr,
                          timeout_ns, fault_site, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES, ACT_F32, KS_GU)
    elif fam == 41:                                    # act: kind a0, row a1, columns [a2, a3), producer a4
        ok, rdy = act_task(scratch, meta, rows, width, a0, a1, a2, a3, a4, rdy, pid, tag, hdr, timeout_ns, fault_site,
                           swiglu_limit, I, KE, I_E, ACT_F32, KS_GU, KS_E)
    elif fam == 42:                                    # router: experts [a0, +BLOCK_E), k in [a1, a2), producer a3
        if MOE:
            ok, rdy = router_task(W_r, scratch, meta, rows, width, a0, a1, a2, a3, a4, rdy, pid, tag, hdr, timeout_ns,
                                  fault_site, E, H, ROWS_PAD, BLOCK_E, RCK, ACT_F32)
    elif fam == 43:                                    # expert slot a0 of a1 (its items), producer a4
        if MOE:
            ok, rdy = expert_task(w_gu, s_gu, scratch, meta, rows, width, a0, a1, a4, rdy, pid, tag, hdr, timeout_ns,
                                  fault_site, E, KE, I_E, H, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES, ACT_F32, KS_E,
                                  K_PAD)
    elif fam == 47:                                    # route: row a0's expert choice, producer a1
        if MOE:
            ok, rdy = route_task(bias_r, scratch, meta, rows, width, a0, a1, rdy, pid, tag, hdr, timeout_ns,
                                  fault_site, scaling, E, KE, E_PAD, K_PAD, RENORM)
    elif fam == 44:                                    # down (dense): tiles a0 .. a0 + a1 - 1, K slice a3 of KG
        ok, rdy = down_task(W_d, S_d, X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, a3, rdy,
                            pid, tag, hdr, timeout_ns, fault_site, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES,
                            ACT_F32, KG)
    elif fam == 45:                                    # moe_down: tiles a0 .. a0 + a1 - 1, rows of a4, row by row
        if MOE:
            ok, rdy = moe_down_task(W_d, S_d, w_de, s_de, X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0,
                                    a1, a2, a3, a4, rdy, pid, tag, hdr, timeout_ns, fault_site, swiglu_limit, E, H, I,
                                    I_E, KE, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, ACT_F32, NEXTN, B_Z, KG, KS_E)
    elif fam == 48:                                    # down_join: tiles a0 .. a0 + a1 - 1, producer a2
        ok, rdy = down_join_task(X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, rdy, pid, tag,
                                 hdr, timeout_ns, fault_site, H, ROWS_PAD, BLOCK_N, NEXTN, B_Z, KG)
    elif fam == 46:                                    # post2: rank sum of tiles a0 .., hc_post
        ok = post2_task(X_out, xd, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, a3, a4, pid, tag, hdr,
                        timeout_ns, fault_site, H, ROWS_PAD, BLOCK_N, NEXTN, B_Z)
    return ok, rdy
