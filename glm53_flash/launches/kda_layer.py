"""The persistent kernel shared by the `embed`, `dense` and `kda` launches: one layer = a KDA mixer
and an FFN, each inside its mHC, in one launch. The host side (graph, scratch, arguments, run) is
launches/layer_host.py; the per-kind classes are thin (embed.py, dense.py, kda.py).

Stages (each task family is a branch of the one kernel; every hand-off is plain rows + a box, or
tagged pairs across TP ranks; every wait is a named site `<kind>.<region>`):
  0 hc_pre    column tiles of the 4 streams -> hc_pre partial slots (24 GEMV sums + Gram matrix);
              embed: the task first gathers its columns of the embedding rows into 4 streams (x0).
  1 gate_in   [waits hp1] (row, column tile) of the attention gate row a_in (bf16): each task joins the
              slots for pre and rstd (no Sinkhorn). coef1 (one task per row, on a CTA of its own): the same
              join, the Sinkhorn -> coef1 (pre | post | comb), box cf1; hc_post waits on cf1.
  2 inproj    [waits a_in] GEMV tiles of the fused q|k|v|b|f_a|g_a rows, split-K into KS_IN slices
              (schedule.py choose_k_split) -> yin planes [KS_IN, width, N_IN] fp32; the tiles' first lines
              move toward L2 before the wait; the KDA tasks join the planes in plane order.
  3 kda       [waits yin] (row, head, value block) tasks: conv + gate + delta rule into the SECOND
              state / window buffers; f and the output gate formed in-task from f_a / g_a. One block
              per head (BV = DV): the gated norm too -> o (bf16). Otherwise raw blocks -> oraw.
  3b kda_norm [waits yin, then oraw] (BV < DV) the block's output gate from yin before the oraw wait, then
              joins the blocks' sums of squares, gated norm -> o.
  4 o_proj    [waits o] GEMV tiles over this rank's heads, in KS_O K slices (layer_host.py _oproj_split:
              4 at TP 1, 1 at TP > 1). TP 1, one slice: the tile's owner runs hc_post on its columns
              (X -> xmid) fused with the FFN hc_pre partials of the same columns (hp2). Otherwise the
              partial tile goes to the exchange slots as source (rank, slice) (tagged pairs, xo) and
  4b o_sum    [waits xo] the tile's owner sums the sources' partials in order, then as above.
  5 gate_ffn  [waits hp2] FFN gate row a (bf16), and coef2 -> box cf2, as gate_in; the FFN's hc_post
              tasks (down at TP 1, moe_down / down_join) wait on cf2 before they publish xd or X_out.
  6 gate_up   [waits a] gate|up tile pairs, K slices -> raw partial planes (hg); kda: the MoE stages
              instead (launches/kda.py, launches/ffn_tasks.py)
  6b act      [waits hg] the planes joined, clamped SwiGLU -> h (bf16).
  7 down      [waits h] GEMV tiles; TP 1: hc_post of the tile's columns -> X_out. TP > 1: xd, and
  7b down_sum [waits xd] rank-order sum, hc_post -> X_out.
              Dense down in KG K slices (KG > 1, schedule.py choose_groups: 3 at the real TP1 shapes): the
              slices write dpart planes (dp), which down_join adds in order before hc_post / xd.
Data read after a wait but written earlier than the region waited on (x0, xmid) is
ordered by the chain of release/acquire hand-offs in between (happens-before is transitive).
Pad rows (rows <= r < width) compute nothing and write nothing, but their tasks still signal.
A fault anywhere on one rank reaches every rank: the last exchange (xd) follows every local site, so a
rank that stops early starves the others' down_sum and every rank raises (none commits its state).

Registers (sm_90, Triton 3.6's bundled ptxas, offline: tests/test_launch_kda.py test_sm90_compile_*; real
shapes, BLOCK_N 64, 3 stages, 4 warps). The families shared with the sparse kernel live in launches/ffn.py.
Before: every build 255 with spills (dense 56-116 B, embed 56-112 B, kda 184-524 B): the families were
inlined into the one while loop, whose hoisted loop invariants stayed live through every GEMV, and the
GEMV tasks held a register prefetch (gate|up: two chunks, 64 registers) across the wait and, for the
up chunk, through the whole gate GEMV. Alone, gate|up took 168 and moe_down 184. Now: every family is
a noinline function, GEMV and gate|up tiles are calls of their own (gemv_tile, gateup_tile), a task
moves its first tile toward L2 (prefetch.global.L2) and waits once before its tile loop, the up chunk
loads after the gate GEMV. The ptxas cap was 128 (4 CTAs per SM by registers, while the launch runs 2):
dense / embed 128 with 16-104 B of local stores (bf16), kda 120-228 B. A spilled register is reloaded from
local memory, and a reload after a wait's fence (MEMBAR + CCTL.IVALL: L1 emptied) is an L2 round trip on the
task's path: the tensor min that reduced a spin's outcome spilled in every wait instance until 2026-12-01
(sync.device cta_any; H200, kda TP8 1 row -9 us). Now the cap is what two resident CTAs of 4 warps allow,
255 (layer_host.py maxnreg_for; GLM53_MAXNREG=128 restores the old cap for an A/B): kda 212-246 registers,
dense / embed 196-238, no spills at TP1 / TP8, bf16 / FP8 (`python -m glm53_flash build --report`). Still in
local memory (ptxas counts it as stack, not spill): the register of each CTA-wide reduction's predicated
shared-memory load in a noinline family (route, gate, coef, post1, kda: 22 reloads in the kda TP8 kernel).
"""
import os

import triton
import triton.language as tl

from sync.device import const_word, launch_begin, launch_end, trace_clock, trace_cycles, trace_store

from .ffn import (B_AIN, B_O, COMMON_BOXES, COMMON_ROWS, M_AIN, M_HDR, M_ON, M_SITE_XD, M_SITE_XO, M_XMID, act_at,
                  coef_task, f32_at, gate_task, gemv_tile, hc_pre_task, l2_prefetch_rows, meta_layout, oproj_task,
                  peer_task, post1_task, runtime_i32, sig_words, signal_at, task_entry, waitb, warm_before)
from .ffn_tasks import FFN_BASE, ffn_task, with_ffn_families
from .mixer_kda import kda_block, kda_norm_gate, kda_norm_task, kda_prefetch

FAMILIES = with_ffn_families({"part": 0, "gate1": 1, "inproj": 2, "kda": 3, "kda_norm": 4, "oproj": 5, "post1": 6,
                               "gate2": 7, "coef1": 8, "coef2": 9, "peer_o": 11, "peer_d": 12})
BOXES = COMMON_BOXES + ("yin", "oraw")      # box b: meta words BOX_BASE + 4b .. = offset, words, producers, site
ROWS_REGIONS = COMMON_ROWS + ("x0", "yin_rows", "oraw_rows", "ssq", "ogate")
META, META_WORDS = meta_layout(BOXES, ROWS_REGIONS)

B_YIN, B_ORAW = (tl.constexpr(BOXES.index(n)) for n in ("yin", "oraw"))
M_X0, M_YIN, M_ORAW, M_SSQ, M_OGATE = (tl.constexpr(META[n]) for n in ("x0", "yin_rows", "oraw_rows", "ssq", "ogate"))


@triton.jit
def _streams(X, scratch, meta, EMBED: tl.constexpr):
    """The layer's input streams [width, 4, H] fp32: X, or the gathered x0 of the embed launch."""
    if EMBED:
        return f32_at(scratch, meta, M_X0)
    else:
        return X


@triton.jit(noinline=True)
def _inproj_task(W_in, scratch, meta, rows, width, a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns, fault_site,
                 H: tl.constexpr, N_IN: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr,
                 KS: tl.constexpr):
    """inproj tiles a0 .. a0 + a1 - 1, K slice a3 of KS, after the a_in wait -> yin plane a3, producer a2.
    -> (ok, rdy)."""
    KL: tl.constexpr = H // KS
    k0 = a3 * KL
    l2_prefetch_rows(W_in + k0, a0 * BLOCK_N, N_IN, H, BLOCK_N)        # weights before the wait
    y = f32_at(scratch, meta, M_YIN) + a3 * width * N_IN                # meta words too (see ffn.waitb)
    x = act_at(scratch, meta, M_AIN, ACT_F32)
    sb, sw, ss = sig_words(scratch, meta, B_YIN)
    ok, rdy = waitb(scratch, meta, B_AIN, rdy, pid, tag, hdr, timeout_ns)
    j = 0
    while (j < a1) & (ok != 0):
        gemv_tile(W_in, W_in, x, H, (a0 + j) * BLOCK_N, k0, k0 + KL, rows, 1, 0, 1, 1,
                  y, N_IN, W_in, 0, 0, fault_site, N_IN, H, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, False)
        j += 1
    if ok != 0:
        signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _kda_body(S_in, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, yin, o, oraw, ssq, a0, a1, a2,
              PS, eps, lower_bound, hdr, pid, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr, N_IN: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr, CK: tl.constexpr,
              KS: tl.constexpr):
    """The KDA step of row a0, head a1, value block a2 (mixer_kda.kda_block). noinline: _kda_task runs it once
    before its wait too (ffn.WARM_CODE): it writes only the new state / window buffers and o / oraw / ssq."""
    S_blk = kda_prefetch(S_in, a0, a1, a2 * BV, NH, DK, DV, BV)
    kda_block(S_blk, a0, a1, a2 * BV, yin, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, o, oraw,
              ssq, eps, lower_bound, PS, hdr, pid, D, NH, R, N_IN, DK, DV, BV, KC, CK, KS)


@triton.jit(noinline=True)
def _kda_task(S_in, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, scratch, meta, rows, width,
              a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns, fault_site, eps, lower_bound, D: tl.constexpr,
              NH: tl.constexpr, R: tl.constexpr, N_IN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
              BV: tl.constexpr, KC: tl.constexpr, CK: tl.constexpr, ACT_F32: tl.constexpr, KS: tl.constexpr):
    """kda: row a0, head a1, value block a2, producer a3 (of o when BV == DV, else of oraw). -> (ok, rdy)."""
    NB: tl.constexpr = DV // BV
    sb, sw, ss = sig_words(scratch, meta, B_O if NB == 1 else B_ORAW)
    ok = 1
    if a0 < rows:
        v0 = a1 * DV + a2 * BV                                          # the state block toward L2 before the wait
        l2_prefetch_rows(S_in + a0.to(tl.int64) * NH * DV * DK, v0, v0 + BV, DK, BV)
        l2_prefetch_rows(f_b, a1 * DK, NH * DK, R, DK)                   # the head's f_b rows and the block's g_b
        l2_prefetch_rows(g_b, v0, NH * DV, R, BV)                        # rows (kda_lowrank), likewise
        yin = f32_at(scratch, meta, M_YIN)                              # meta words before the wait (ffn.waitb)
        o = act_at(scratch, meta, M_ON, ACT_F32)
        oraw = f32_at(scratch, meta, M_ORAW)
        ssq = f32_at(scratch, meta, M_SSQ)
        if warm_before(rdy, B_YIN):                                     # the block's code, warm (ffn.WARM_CODE)
            _kda_body(S_in, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, yin, o, oraw, ssq, a0,
                      a1, a2, width * N_IN, eps, lower_bound, hdr, pid, D, NH, R, N_IN, DK, DV, BV, KC, CK, KS)
        ok, rdy = waitb(scratch, meta, B_YIN, rdy, pid, tag, hdr, timeout_ns)
        if ok != 0:
            _kda_body(S_in, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, yin, o, oraw, ssq, a0,
                      a1, a2, width * N_IN, eps, lower_bound, hdr, pid, D, NH, R, N_IN, DK, DV, BV, KC, CK, KS)
    if ok != 0:
        signal_at(sb, sw, ss, a3, tag, fault_site)
    return ok, rdy


# kda_norm's output gate (g_b x yin) formed before its oraw wait, behind a yin wait (the same bits:
# tests/test_launch_dense.py); kda TP8 -0.8 / -2.1 us (H100, s20A). GLM53_KDA_GATE_EARLY=0: after the oraw wait, as
# before (read at import, for A/B runs).
GATE_EARLY: tl.constexpr = tl.constexpr(os.environ.get("GLM53_KDA_GATE_EARLY", "1") != "0")


@triton.jit(noinline=True)
def _kda_norm_body(g_b, onorm_w, yin, o, oraw, ssq, ogate, a0, a1, a2, PS, eps, D: tl.constexpr, NH: tl.constexpr,
                   R: tl.constexpr, N_IN: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, CK: tl.constexpr,
                   KS: tl.constexpr):
    """kda_norm of row a0, head a1, block a2 (mixer_kda.kda_norm_task); noinline, run twice (see _kda_body). Its
    gate: GATE_EARLY, the one _kda_norm_task left in ogate (a noinline function takes no tensor argument);
    else formed here from yin."""
    v0 = a1 * DV + a2 * BV
    if GATE_EARLY:
        gv = tl.load(ogate + a0 * D + v0 + tl.arange(0, BV), cache_modifier=".cg")
    else:
        gv = kda_norm_gate(a0, a1, a2 * BV, yin, g_b, PS, D, NH, R, N_IN, DV, BV, CK, KS)
    kda_norm_task(a0, a1, a2 * BV, gv, onorm_w, o, oraw, ssq, eps, D, NH, DV, BV)


@triton.jit(noinline=True)
def _kda_norm_task(g_b, onorm_w, scratch, meta, rows, width, a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns,
                   fault_site, eps, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr, N_IN: tl.constexpr,
                   DV: tl.constexpr, BV: tl.constexpr, CK: tl.constexpr, ACT_F32: tl.constexpr, KS: tl.constexpr):
    """kda_norm: row a0, head a1, block a2, producer a3 of o. The gate needs only yin, complete before any KDA task
    ends: under GATE_EARLY it is formed after a yin wait, before the oraw wait, into ogate (~1 us of the task's own
    time off the path: H100 trace s19C, own 2.0 us after a wait of 18.4); after oraw only the join and the norm.
    -> (ok, rdy)."""
    sb, sw, ss = sig_words(scratch, meta, B_O)
    yin = f32_at(scratch, meta, M_YIN)                                  # meta words before the wait (ffn.waitb)
    o = act_at(scratch, meta, M_ON, ACT_F32)
    oraw = f32_at(scratch, meta, M_ORAW)
    ssq = f32_at(scratch, meta, M_SSQ)
    ogate = f32_at(scratch, meta, M_OGATE)
    PS = width * N_IN
    ok = 1
    if GATE_EARLY:
        ok, rdy = waitb(scratch, meta, B_YIN, rdy, pid, tag, hdr, timeout_ns)
        if (ok != 0) & (a0 < rows):
            v0 = a1 * DV + a2 * BV
            tl.store(ogate + a0 * D + v0 + tl.arange(0, BV),
                     kda_norm_gate(a0, a1, a2 * BV, yin, g_b, PS, D, NH, R, N_IN, DV, BV, CK, KS))
            tl.debug_barrier()          # the body's threads read it back (with oraw passed already: no wait between)
    if ok != 0:
        if warm_before(rdy, B_ORAW) & (a0 < rows):                      # the join's code, warm (ffn.WARM_CODE)
            _kda_norm_body(g_b, onorm_w, yin, o, oraw, ssq, ogate, a0, a1, a2, PS, eps, D, NH, R, N_IN, DV, BV, CK, KS)
        ok, rdy = waitb(scratch, meta, B_ORAW, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        if a0 < rows:
            _kda_norm_body(g_b, onorm_w, yin, o, oraw, ssq, ogate, a0, a1, a2, PS, eps, D, NH, R, N_IN, DV, BV, CK, KS)
        signal_at(sb, sw, ss, a3, tag, fault_site)
    return ok, rdy


@triton.jit(do_not_specialize=["rows", "width", "tp_rank", "tp_size", "stage_lo", "stage_hi", "bump", "tag_stride",
                               "tag_offset", "fault_site", "timeout_ns"])
def kda_layer_kernel(table, starts, meta, scratch, xo, xd, peer_o, peer_d, X, X_out, tokens, embed_w,
                     fn1, base1, scale1, ln1, fn2, base2, scale2, ln2,
                     W_in, S_in, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, W_o,
                     W_g, S_g, W_u, S_u, W_d, S_d, W_r, bias_r, w_gu, s_gu, w_de, s_de,
                     rows, width, tp_rank, tp_size, eps, hc_eps, lower_bound, swiglu_limit, scaling,
                     stage_lo, stage_hi, bump, tag_stride, tag_offset, fault_site, timeout_ns, trace,
                     H: tl.constexpr, D: tl.constexpr, NH: tl.constexpr, R: tl.constexpr, N_IN: tl.constexpr,
                     I: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, KC: tl.constexpr,
                     CK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr, BLOCK_C: tl.constexpr, GATE_BH: tl.constexpr, ITERS: tl.constexpr,
                     ROWS_PAD: tl.constexpr, EMBED: tl.constexpr, ACT_F32: tl.constexpr, MOE: tl.constexpr,
                     E: tl.constexpr, KE: tl.constexpr, I_E: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr,
                     RENORM: tl.constexpr, BLOCK_E: tl.constexpr, RCK: tl.constexpr, TRACE: tl.constexpr,
                     KS_IN: tl.constexpr, KS_GU: tl.constexpr, KS_E: tl.constexpr, KG: tl.constexpr,
                     KS_O: tl.constexpr):
    pid = tl.program_id(0)
    # Region pointers are formed inside each family from the meta words (cheap cached loads), never
    # hoisted here: ~25 pointers live across the task loop cost ~50 registers in every family.
    hdr = scratch + const_word(meta + M_HDR)
    if TRACE:
        t_cta = trace_clock(pid)
        c_cta = trace_cycles(pid)
    # the task range before launch_begin: constant, and not ordered after its acquire (PDL: before the
    # previous kernel is done)
    i = const_word(starts + pid)
    end = const_word(starts + pid + 1)
    tag, ok = launch_begin(hdr, tag_stride, tag_offset)
    rdy = 0            # bit b: this CTA already passed the wait on box b
    while (i < end) & (ok != 0):
        fam, st, a0, a1, a2, a3, a4 = task_entry(table, i)
        if (st >= stage_lo) & (st < stage_hi):
            if TRACE:                                      # where the launch's time goes
                t_task = trace_clock(i)
                c_task = trace_cycles(i)
            if fam == 0:                                   # part: column tiles a0 .. + a1, producer a2, rows a3 .. + a4
                hc_pre_task(_streams(X, scratch, meta, EMBED), fn1, tokens, embed_w, scratch, meta, rows, a0, a1, a2,
                            a3, a4, tag, fault_site, H, ROWS_PAD, BLOCK_N, BLOCK_C, EMBED)
            elif fam == 1:                                 # gate1: columns [a0, a0 + GATE_BH), producer a1
                ok, rdy = gate_task(_streams(X, scratch, meta, EMBED), base1, scale1, ln1, scratch, meta, rows, a0, a1,
                                    a2, rdy, pid, tag, hdr, timeout_ns, fault_site, eps, hc_eps, runtime_i32(0), H,
                                    ROWS_PAD, GATE_BH, ACT_F32)
            elif fam == 2:                                 # inproj: tiles a0 .. a0 + a1 - 1, producer a2
                ok, rdy = _inproj_task(W_in, scratch, meta, rows, width, a0, a1, a2, a3, rdy, pid, tag, hdr,
                                       timeout_ns, fault_site, H, N_IN, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES,
                                       ACT_F32, KS_IN)
            elif fam == 3:                                 # kda: row a0, head a1, block a2, producer a3
                ok, rdy = _kda_task(S_in, S_out, win_in, win_out, conv_w, A_log, dt_bias, f_b, g_b, onorm_w, scratch,
                                    meta, rows, width, a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns, fault_site, eps,
                                    lower_bound, D, NH, R, N_IN, DK, DV, BV, KC, CK, ACT_F32, KS_IN)
            elif fam == 4:                                 # kda_norm: row a0, head a1, block a2, producer a3
                ok, rdy = _kda_norm_task(g_b, onorm_w, scratch, meta, rows, width, a0, a1, a2, a3, rdy, pid, tag, hdr,
                                         timeout_ns, fault_site, eps, D, NH, R, N_IN, DV, BV, CK, ACT_F32, KS_IN)
            elif fam == 5:                                 # oproj: tiles a0 .. a0 + a1 - 1, producer a2, K slice a3
                ok, rdy = oproj_task(W_o, W_o, _streams(X, scratch, meta, EMBED), fn2, xo, scratch, meta, rows, width,
                                     tp_rank, tp_size, a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns, fault_site, H, D,
                                     ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, BLOCK_C, ACT_F32, False, KS_O)
            elif fam == 6:                                 # post1: rank sum of tiles a0 .., producer a2
                ok, rdy = post1_task(_streams(X, scratch, meta, EMBED), fn2, xo, scratch, meta, rows, width, tp_rank,
                                     tp_size, a0, a1, a2, a3, a4, rdy, pid, tag, hdr, timeout_ns, fault_site, H,
                                     ROWS_PAD, BLOCK_N, BLOCK_C, False, KS_O)
            elif fam == 7:                                 # gate2: columns [a0, a0 + GATE_BH), producer a1
                ok, rdy = gate_task(f32_at(scratch, meta, M_XMID), base2, scale2, ln2, scratch, meta, rows, a0, a1,
                                    a2, rdy, pid, tag, hdr, timeout_ns, fault_site, eps, hc_eps, runtime_i32(1), H,
                                    ROWS_PAD, GATE_BH, ACT_F32)
            elif fam == 8:                                 # coef1: row a0's hc_post coefficients, producer a1
                ok, rdy = coef_task(base1, scale1, scratch, meta, rows, a0, a1, rdy, pid, tag, hdr, timeout_ns,
                                    fault_site, eps, hc_eps, runtime_i32(0), H, ROWS_PAD, ITERS)
            elif fam == 9:                                 # coef2
                ok, rdy = coef_task(base2, scale2, scratch, meta, rows, a0, a1, rdy, pid, tag, hdr, timeout_ns,
                                    fault_site, eps, hc_eps, runtime_i32(1), H, ROWS_PAD, ITERS)
            elif fam == 11:                                # peer_o (loopback): rank a0's tiles a1 .. a1 + a2 - 1
                peer_task(xo, peer_o, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, tag, fault_site,
                          runtime_i32(M_SITE_XO), H, ROWS_PAD, BLOCK_N)
            elif fam == 12:                                # peer_d (loopback)
                peer_task(xd, peer_d, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, tag, fault_site,
                          runtime_i32(M_SITE_XD), H, ROWS_PAD, BLOCK_N)
            elif fam >= FFN_BASE:                          # the FFN families (launches/ffn_tasks.py)
                ok, rdy = ffn_task(fam, a0, a1, a2, a3, a4, ok, rdy, pid, tag, hdr, timeout_ns, fault_site, scratch,
                                   meta, rows, width, tp_rank, tp_size, X_out, xd, W_g, S_g, W_u, S_u, W_d, S_d, W_r,
                                   bias_r, w_gu, s_gu, w_de, s_de, swiglu_limit, scaling, H, I, E, KE, I_E, E_PAD,
                                   K_PAD, RENORM, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, BLOCK_E, RCK, ACT_F32,
                                   MOE, False, 0, KS_GU, KS_E, KG)
            if TRACE:
                trace_store(trace, i, t_task, c_task, hdr, pid, i)
        i += 1
    if TRACE:                                          # this CTA's whole run: row n_tasks + pid
        trace_store(trace, tl.load(starts + tl.num_programs(0)) + pid, t_cta, c_cta, hdr, pid, pid)
    launch_end(hdr, bump)
