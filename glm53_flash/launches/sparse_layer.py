"""The persistent kernel of the `sparse` launch (one DSA layer: sparse NoPE MLA + kpool indexer,
then the MoE FFN, both inside mHC). Host side: launches/sparse.py. The mHC, o_proj and MoE branches
are the KDA layer kernel's (launches/kda_layer.py) with the same device functions; the mixer
branches are new. Stages (every hand-off is plain rows + a box; every wait a site `sparse.<region>`):
  0 hc_pre     column tiles of the streams -> hc_pre partial slots                       -> hp1
  1 gate_in    [hp1] gate row a_in (bf16) + coef1                                         -> a_in
  2 qkv_a      [a_in] GEMV tiles of q_a (QL) | kv_a (C) | wk, kpool gate, weights_proj -> ya (fp32)
  3 dsa_norm   [ya] per row: q_resid (bf16); latent c -> cache[slot, pos]; LayerNorm'd key | gate
               -> tail ring row pos % KP; pooled key when pos completes a pool              -> qr
  4 q_b        [qr] GEMV tiles of this rank's q_b heads | wq_b (index queries) -> yq (fp32)  -> q
  5 absorb     [q] (head, C tile): q~ = q_h W_UK,h (fp32)                                   -> ql
    score      [q] (row, pool chunk t): pool scores, then radix pass 0 of the top-k          -> hs0
  6-8 hist     [hs(j-1)] (row, t): radix pass j = 1..3 (nothing while P <= TOPK)            -> hs(j)
  9 select     [hs3] (row, t): selected pools -> token indices (ascending) + tail, -1 pad   -> idx
 10 attend     [idx, ql] (row, head group, token split): two-pass split softmax partials     -> att
 11 join       [att] (head, DV tile): split join + W_UV -> o (bf16)                           -> o
 12 o_proj     [o] as the KDA launch (TP 1: hc_post + FFN hc_pre partials -> hp2; TP > 1: xo, o_sum)
 13.. gate_ffn, moe_route (router, shared gate|up), experts, down (+ down_sum): the KDA launch's MoE.
Pad rows (rows <= r < width) compute and write nothing (no cache writes either) but still signal.
NEXTN (the MTP block, launches/nextn.py; no mHC): stages 0-1 become eh_in [per row: enorm(embed(t)) |
hnorm(h)] -> eh (eh_proj tiles, x) -> ln_row 0 (input_layernorm -> a_in); o_proj adds x (y = x + attn,
xmid) instead of hc_post; ln_row 1 (post_attention_layernorm) replaces gate_ffn; down adds y
(z = y + ffn -> X_out [width, H]) and signals z; ln_row 2 writes n = shared_head.norm(z).
"""
import triton
import triton.language as tl

from sync.device import launch_begin, launch_end

from ..kernels.gemv import gemv_finish, gemv_prefetch, gemv_store
from ..kernels.indexer import idx_score_pools, topk_hist_pass, topk_write
from ..kernels.mhc import hc_partial_finish, hc_partial_prefetch
from ..kernels.mlp import gateup_finish, gateup_prefetch
from ..kernels.mla import mla_absorb_finish, mla_absorb_prefetch, mla_attend_2pass, mla_join_out, mla_out_prefetch
from ..kernels.moe import moe_down_finish, moe_down_prefetch, router_finish, router_prefetch, router_store_partial
from .ffn import expert_slot, post_cols
from .mixer_dsa import _act, _f32, _i32, _post_partials, _signal, _waitb, add_cols, dsa_norm_row, gemv_tiles, rms_row
from .mixer_kda import gate_rows, peer_publish, xchg_publish, xchg_sum

FAMILIES = {"part": 0, "gate1": 1, "mat_a": 2, "dsa_norm": 3, "mat_q": 4, "absorb": 5, "score": 6, "hist": 7,
            "select": 8, "attend": 9, "join": 10, "oproj": 11, "post1": 12, "gate2": 13, "gu": 14, "router": 15,
            "expert": 16, "moe_down": 17, "post2": 18, "peer_o": 19, "peer_d": 20, "eh_in": 21, "eh": 22,
            "ln_row": 23}
BOXES = ("hp1", "a_in", "ya", "qr", "q", "ql", "hs0", "hs1", "hs2", "hs3", "idx", "att", "o", "hp2", "a", "rl", "h",
         "xe", "ein", "x", "z")
ROWS_REGIONS = ("part1", "part2", "coef1", "coef2", "a_in_rows", "a_rows", "ya", "qr_rows", "yq", "qlat", "scores",
                "hist", "idx_rows", "pm", "pl", "pacc", "sbuf", "ctx", "o_rows", "y1", "xmid", "h_rows", "y2",
                "part_r", "ids_rec", "rw_rec", "act_e", "ein_rows", "x0")
META_NAMES = ROWS_REGIONS + ("hdr", "site_xo", "site_xd", "npart1", "npart2", "nrpart")
META_BASE = 4 * len(BOXES)
META = {n: META_BASE + i for i, n in enumerate(META_NAMES)}
META_WORDS = META_BASE + len(META_NAMES)

_B = {n: tl.constexpr(i) for i, n in enumerate(BOXES)}
(B_HP1, B_AIN, B_YA, B_QR, B_Q, B_QL, B_HS0, B_HS1, B_HS2, B_HS3, B_IDX, B_ATT, B_O, B_HP2, B_A, B_RL, B_H,
 B_XE, B_EIN, B_X, B_Z) = (_B[n] for n in BOXES)
_M = {n: tl.constexpr(v) for n, v in META.items()}
(M_PART1, M_PART2, M_COEF1, M_COEF2, M_AIN, M_A, M_YA, M_QR, M_YQ, M_QLAT, M_SC, M_HIST, M_IDX, M_PM, M_PL, M_PACC,
 M_SBUF, M_CTX, M_ON, M_Y1, M_XMID, M_H, M_Y2, M_PART_R, M_IDS, M_RW, M_ACTE, M_EIN, M_X0) = (_M[n] for n in
                                                                                        ROWS_REGIONS)
M_HDR, M_SITE_XO, M_SITE_XD, M_NPART1, M_NPART2, M_NRPART = (_M[n] for n in ("hdr", "site_xo", "site_xd", "npart1",
                                                                             "npart2", "nrpart"))


@triton.jit(do_not_specialize=["rows", "width", "tp_rank", "tp_size", "stage_lo", "stage_hi", "bump", "tag_stride",
                               "tag_offset", "fault_site", "timeout_ns", "lat_ss", "pk_ss", "tail_ss", "pmax",
                               "sel_chunk", "n_splits", "tpt"])
def sparse_layer_kernel(table, starts, meta, scratch, xo, xd, peer_o, peer_d, X, X_out, positions, slots,
                        latent, pool_keys, tail, tokens, embed_w, hid, W_eh, enorm, hnorm, shn, n_out,
                        fn1, base1, scale1, ln1, fn2, base2, scale2, ln2,
                        W_qa, S_qa, W_kva, S_kva, W_ix, qa_ln, kva_ln, kn_w, kn_b, ape, W_qb, S_qb, W_iqb,
                        kv_b, S_kvb, W_o, S_o, W_g, S_g, W_u, S_u, W_d, S_d, W_r, bias_r, w_gu, s_gu, w_de, s_de,
                        rows, width, tp_rank, tp_size, eps, hc_eps, swiglu_limit, scaling, att_scale,
                        lat_ss, pk_ss, tail_ss, pmax, sel_chunk, n_splits, tpt,
                        stage_lo, stage_hi, bump, tag_stride, tag_offset, fault_site, timeout_ns,
                        H: tl.constexpr, QL: tl.constexpr, C: tl.constexpr, DI: tl.constexpr, NI: tl.constexpr,
                        NA: tl.constexpr, NH: tl.constexpr, DN: tl.constexpr, DV: tl.constexpr, NQ: tl.constexpr,
                        KP: tl.constexpr, TOPK: tl.constexpr, WIDTH: tl.constexpr, I: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                        BLOCK_C: tl.constexpr, GATE_BH: tl.constexpr, ITERS: tl.constexpr, ROWS_PAD: tl.constexpr,
                        ACT_F32: tl.constexpr, ABS_C: tl.constexpr, ABS_CK: tl.constexpr, HB: tl.constexpr,
                        BLOCK_T: tl.constexpr, ATT_CK: tl.constexpr, OUT_N: tl.constexpr, OUT_PF: tl.constexpr,
                        BLOCK_P: tl.constexpr, T_MAX: tl.constexpr, BITS: tl.constexpr, SEL_BLOCK: tl.constexpr,
                        NORM_BLOCK: tl.constexpr, E: tl.constexpr, KE: tl.constexpr, I_E: tl.constexpr,
                        E_PAD: tl.constexpr, K_PAD: tl.constexpr, RENORM: tl.constexpr, BLOCK_E: tl.constexpr,
                        RCK: tl.constexpr, NEXTN: tl.constexpr):
    pid = tl.program_id(0)
    DO: tl.constexpr = NH * DV
    PASSES: tl.constexpr = (32 + BITS - 1) // BITS
    HIST_W: tl.constexpr = PASSES * T_MAX * (1 << BITS)
    hdr = scratch + tl.load(meta + M_HDR)
    tag, ok = launch_begin(hdr, tag_stride, tag_offset)
    rdy = 0            # bit b: this CTA already passed the wait on box b (one register, not 21)
    i = tl.load(starts + pid)
    end = tl.load(starts + pid + 1)
    while (i < end) & (ok != 0):
        fam = tl.load(table + i * 8)
        st = tl.load(table + i * 8 + 1)
        a0 = tl.load(table + i * 8 + 2)
        a1 = tl.load(table + i * 8 + 3)
        a2 = tl.load(table + i * 8 + 4)
        a3 = tl.load(table + i * 8 + 5)
        a4 = tl.load(table + i * 8 + 6)
        if (st >= stage_lo) & (st < stage_hi):
            if fam == 0:                                   # part: column tiles a0 .. a0 + a1 - 1, producer a2
                if not NEXTN:
                    j = 0
                    while j < a1:
                        c0 = (a0 + j) * BLOCK_N
                        w0 = hc_partial_prefetch(fn1, c0, c0 + BLOCK_N, H, BLOCK_C)
                        hc_partial_finish(w0, fn1, X, 4 * H, _f32(scratch, meta, M_PART1) + (a0 + j) * ROWS_PAD * 40, 40,
                                          rows, c0, c0 + BLOCK_N, H, ROWS_PAD, BLOCK_C)
                        j += 1
                    _signal(scratch, meta, B_HP1, a2, tag, fault_site)
            elif fam == 1:                                 # gate1: columns [a0, a0 + GATE_BH), producer a1
                if not NEXTN:
                    ok, rdy = _waitb(scratch, meta, B_HP1, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        gate_rows(X, _f32(scratch, meta, M_PART1), tl.load(meta + M_NPART1), base1, scale1, ln1,
                                  _f32(scratch, meta, M_COEF1), _act(scratch, meta, M_AIN, ACT_F32), rows, a0, a1 == 0,
                                  eps, hc_eps, H, ROWS_PAD, ITERS, GATE_BH)
                        _signal(scratch, meta, B_AIN, a1, tag, fault_site)
            elif fam == 2:                                 # mat_a: matrix a0 (q_a, kv_a, ix), tiles a1 .., producer a3
                xin = _act(scratch, meta, M_AIN, ACT_F32)
                ya = _f32(scratch, meta, M_YA)
                if a0 == 0:
                    w_qa = gemv_prefetch(W_qa, a1 * BLOCK_N, 0, H, QL, H, BLOCK_N, PF_K)
                    ok, rdy = _waitb(scratch, meta, B_AIN, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        gemv_tiles(w_qa, W_qa, S_qa, xin, H, ya, NA, rows, a1, a2, QL, H, ROWS_PAD, BLOCK_N, BLOCK_K,
                                   PF_K, NUM_STAGES)
                elif a0 == 1:
                    w_kva = gemv_prefetch(W_kva, a1 * BLOCK_N, 0, H, C, H, BLOCK_N, PF_K)
                    ok, rdy = _waitb(scratch, meta, B_AIN, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        gemv_tiles(w_kva, W_kva, S_kva, xin, H, ya + QL, NA, rows, a1, a2, C, H, ROWS_PAD, BLOCK_N,
                                   BLOCK_K, PF_K, NUM_STAGES)
                else:
                    w_ix = gemv_prefetch(W_ix, a1 * BLOCK_N, 0, H, 2 * DI + NI, H, BLOCK_N, PF_K)
                    ok, rdy = _waitb(scratch, meta, B_AIN, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        gemv_tiles(w_ix, W_ix, W_ix, xin, H, ya + QL + C, NA, rows, a1, a2, 2 * DI + NI, H, ROWS_PAD,
                                   BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                if ok != 0:
                    _signal(scratch, meta, B_YA, a3, tag, fault_site)
            elif fam == 3:                                 # dsa_norm: row a0, producer a1
                ok, rdy = _waitb(scratch, meta, B_YA, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    if a0 < rows:
                        pos = tl.load(positions + a0)
                        slot = tl.load(slots + a0).to(tl.int64)
                        dsa_norm_row(_f32(scratch, meta, M_YA) + a0 * NA, qa_ln, kva_ln, kn_w, kn_b, ape,
                                     _act(scratch, meta, M_QR, ACT_F32) + a0 * QL,
                                     latent + slot * lat_ss + pos.to(tl.int64) * C, tail + slot * tail_ss,
                                     pool_keys + slot * pk_ss, pos, eps, QL, C, DI, KP, NORM_BLOCK)
                    _signal(scratch, meta, B_QR, a1, tag, fault_site)
            elif fam == 4:                                 # mat_q: matrix a0 (q_b, wq_b), tiles a1 .., producer a3
                xin = _act(scratch, meta, M_QR, ACT_F32)
                yq = _f32(scratch, meta, M_YQ)
                if a0 == 0:
                    w_qb = gemv_prefetch(W_qb, a1 * BLOCK_N, 0, QL, NH * DN, QL, BLOCK_N, PF_K)
                    ok, rdy = _waitb(scratch, meta, B_QR, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        gemv_tiles(w_qb, W_qb, S_qb, xin, QL, yq, NQ, rows, a1, a2, NH * DN, QL, ROWS_PAD, BLOCK_N,
                                   BLOCK_K, PF_K, NUM_STAGES)
                else:
                    w_iq = gemv_prefetch(W_iqb, a1 * BLOCK_N, 0, QL, NI * DI, QL, BLOCK_N, PF_K)
                    ok, rdy = _waitb(scratch, meta, B_QR, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        gemv_tiles(w_iq, W_iqb, W_iqb, xin, QL, yq + NH * DN, NQ, rows, a1, a2, NI * DI, QL, ROWS_PAD,
                                   BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                if ok != 0:
                    _signal(scratch, meta, B_Q, a3, tag, fault_site)
            elif fam == 5:                                 # absorb: head a0, C tile a1, producer a2
                w_uk = mla_absorb_prefetch(kv_b, a0, a1 * ABS_C, DN, DV, C, ABS_C, ABS_CK)
                ok, rdy = _waitb(scratch, meta, B_Q, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    mla_absorb_finish(w_uk, kv_b, S_kvb, _f32(scratch, meta, M_YQ), NQ, _f32(scratch, meta, M_QLAT),
                                      rows, a0, a1 * ABS_C, NH, DN, DV, C, ROWS_PAD, ABS_C, ABS_CK)
                    _signal(scratch, meta, B_QL, a2, tag, fault_site)
            elif fam == 6:                                 # score: row a0, pool chunk a1, producer a2
                ok, rdy = _waitb(scratch, meta, B_Q, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    if a0 < rows:
                        pos = tl.load(positions + a0)
                        slot = tl.load(slots + a0).to(tl.int64)
                        P = (pos + 1) // KP
                        sc = _f32(scratch, meta, M_SC) + a0 * pmax
                        yq_r = _f32(scratch, meta, M_YQ) + a0 * NQ
                        idx_score_pools(yq_r + NH * DN, _f32(scratch, meta, M_YA) + a0 * NA + QL + C + 2 * DI,
                                        pool_keys + slot * pk_ss, sc, a1 * sel_chunk,
                                        tl.minimum(a1 * sel_chunk + sel_chunk, P), NI, DI, BLOCK_P)
                        if (P > TOPK) & (a1 < tl.cdiv(P, sel_chunk)):
                            tl.debug_barrier()             # own score stores before the pass reads them
                            topk_hist_pass(sc, _i32(scratch, meta, M_HIST) + a0 * HIST_W, a1, 0, sel_chunk, P, TOPK,
                                           T_MAX, BITS, SEL_BLOCK)
                    _signal(scratch, meta, B_HS0, a2, tag, fault_site)
            elif fam == 7:                                 # hist: row a0, chunk a1, pass a2, producer a3
                ok, rdy = _waitb(scratch, meta, B_HS0 + a2 - 1, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    if a0 < rows:
                        P = (tl.load(positions + a0) + 1) // KP
                        if (P > TOPK) & (a1 < tl.cdiv(P, sel_chunk)):
                            topk_hist_pass(_f32(scratch, meta, M_SC) + a0 * pmax, _i32(scratch, meta, M_HIST) +
                                           a0 * HIST_W, a1, a2, sel_chunk, P, TOPK, T_MAX, BITS, SEL_BLOCK)
                    _signal(scratch, meta, B_HS0 + a2, a3, tag, fault_site)
            elif fam == 8:                                 # select: row a0, chunk a1, producer a2
                ok, rdy = _waitb(scratch, meta, B_HS3, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    if a0 < rows:
                        pos = tl.load(positions + a0)
                        P = (pos + 1) // KP
                        if a1 < tl.maximum(tl.cdiv(P, sel_chunk), 1):
                            topk_write(_f32(scratch, meta, M_SC) + a0 * pmax, _i32(scratch, meta, M_HIST) + a0 * HIST_W,
                                       _i32(scratch, meta, M_IDX) + a0 * WIDTH, a1, sel_chunk, P, pos, TOPK, KP, WIDTH,
                                       T_MAX, BITS, SEL_BLOCK)
                    _signal(scratch, meta, B_IDX, a2, tag, fault_site)
            elif fam == 9:                                 # attend: row a0, head group a1, split a2, producer a3
                ok, rdy = _waitb(scratch, meta, B_IDX, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    ok, rdy = _waitb(scratch, meta, B_QL, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    if a0 < rows:
                        pos = tl.load(positions + a0)
                        slot = tl.load(slots + a0).to(tl.int64)
                        P = (pos + 1) // KP
                        n_sel = tl.minimum(P, TOPK) * KP + pos + 1 - P * KP
                        part = a0 * NH * n_splits
                        tl.debug_barrier()                 # the CTA's score scratch is free (earlier task done)
                        mla_attend_2pass(_f32(scratch, meta, M_QLAT) + a0 * NH * C,
                                         _i32(scratch, meta, M_IDX) + a0 * WIDTH, latent + slot * lat_ss,
                                         _f32(scratch, meta, M_SBUF) + pid * tpt * HB, _f32(scratch, meta, M_PM) + part,
                                         _f32(scratch, meta, M_PL) + part, _f32(scratch, meta, M_PACC) + part * C,
                                         a1 * HB, a2, a2 * tpt, a2 * tpt + tpt, n_sel, n_splits, att_scale, NH, C, HB,
                                         BLOCK_T, ATT_CK)
                    _signal(scratch, meta, B_ATT, a3, tag, fault_site)
            elif fam == 10:                                # join: head a0, DV tile a1, producer a2
                w_uv = mla_out_prefetch(kv_b, a0, a1 * OUT_N, DN, DV, C, OUT_N, OUT_PF)
                ok, rdy = _waitb(scratch, meta, B_ATT, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    tl.debug_barrier()                     # the CTA's ctx scratch is free (earlier task done)
                    mla_join_out(w_uv, kv_b, S_kvb, _f32(scratch, meta, M_PM), _f32(scratch, meta, M_PL),
                                 _f32(scratch, meta, M_PACC), NH * n_splits, _f32(scratch, meta, M_CTX) +
                                 pid * ROWS_PAD * C, _act(scratch, meta, M_ON, ACT_F32), DO, rows, a0, a1 * OUT_N,
                                 n_splits, NH, DN, DV, C, ROWS_PAD, OUT_N, OUT_PF, OUT_PF, 2)   # 2 stages: 138 vs 168 regs
                    _signal(scratch, meta, B_O, a2, tag, fault_site)
            elif fam == 11:                                # oproj: tiles a0 .. a0 + a1 - 1, slot a2
                j = 0
                while (j < a1) & (ok != 0):
                    n0 = (a0 + j) * BLOCK_N
                    w0 = gemv_prefetch(W_o, n0, 0, DO, H, DO, BLOCK_N, PF_K)
                    ok, rdy = _waitb(scratch, meta, B_O, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        acc = gemv_finish(w0, W_o, S_o, _act(scratch, meta, M_ON, ACT_F32), DO, rows, n0, 0, DO, H, DO,
                                          ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        if tp_size == 1:
                            gemv_store(_f32(scratch, meta, M_Y1), H, acc, rows, n0, H, ROWS_PAD, BLOCK_N)
                        else:
                            xchg_publish(xo, acc, n0, rows, width, tp_rank, tp_size, tag, tl.load(meta + M_SITE_XO),
                                         fault_site, H, ROWS_PAD, BLOCK_N)
                    j += 1
                if (ok != 0) & (tp_size == 1):
                    tl.debug_barrier()                     # own warps' y1 stores before hc_post reads them
                    if NEXTN:                              # y = x + attn: xmid
                        add_cols(_f32(scratch, meta, M_X0), _f32(scratch, meta, M_Y1), _f32(scratch, meta, M_XMID),
                                 rows, a0 * BLOCK_N, tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
                    else:
                        _post_partials(fn2, X, _f32(scratch, meta, M_Y1), _f32(scratch, meta, M_COEF1),
                                       _f32(scratch, meta, M_XMID), _f32(scratch, meta, M_PART2), rows, a0, a1, H,
                                       ROWS_PAD, BLOCK_N, BLOCK_C)
                    _signal(scratch, meta, B_HP2, a2, tag, fault_site)
            elif fam == 12:                                # post1: rank sum of tiles a0 .., producer a2
                j = 0
                while (j < a1) & (ok != 0):
                    ok = xchg_sum(xo, _f32(scratch, meta, M_Y1), (a0 + j) * BLOCK_N, rows, width, tp_rank, tp_size,
                                  tag, hdr, tl.load(meta + M_SITE_XO), pid, timeout_ns, H, ROWS_PAD, BLOCK_N)
                    j += 1
                if ok != 0:
                    tl.debug_barrier()
                    if NEXTN:
                        add_cols(_f32(scratch, meta, M_X0), _f32(scratch, meta, M_Y1), _f32(scratch, meta, M_XMID),
                                 rows, a0 * BLOCK_N, tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
                    else:
                        _post_partials(fn2, X, _f32(scratch, meta, M_Y1), _f32(scratch, meta, M_COEF1),
                                       _f32(scratch, meta, M_XMID), _f32(scratch, meta, M_PART2), rows, a0, a1, H,
                                       ROWS_PAD, BLOCK_N, BLOCK_C)
                    _signal(scratch, meta, B_HP2, a2, tag, fault_site)
            elif fam == 13:                                # gate2: columns [a0, a0 + GATE_BH), producer a1
                ok, rdy = _waitb(scratch, meta, B_HP2, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    gate_rows(_f32(scratch, meta, M_XMID), _f32(scratch, meta, M_PART2), tl.load(meta + M_NPART2), base2,
                              scale2, ln2, _f32(scratch, meta, M_COEF2), _act(scratch, meta, M_A, ACT_F32), rows, a0,
                              a1 == 0, eps, hc_eps, H, ROWS_PAD, ITERS, GATE_BH)
                    _signal(scratch, meta, B_A, a1, tag, fault_site)
            elif fam == 14:                                # gu (shared expert): gate|up tiles a0 .., producer a2
                j = 0
                while (j < a1) & (ok != 0):
                    n0 = (a0 + j) * BLOCK_N
                    wg, wu = gateup_prefetch(W_g, W_u, n0, I, H, BLOCK_N, PF_K)
                    ok, rdy = _waitb(scratch, meta, B_A, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        act = gateup_finish(wg, wu, W_g, W_u, S_g, S_u, _act(scratch, meta, M_A, ACT_F32), H, rows,
                                            n0, I, H, swiglu_limit, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        gemv_store(_act(scratch, meta, M_H, ACT_F32), I, act, rows, n0, I, ROWS_PAD, BLOCK_N)
                    j += 1
                if ok != 0:
                    _signal(scratch, meta, B_H, a2, tag, fault_site)
            elif fam == 15:                                # router: experts [a0, +BLOCK_E), k in [a1, a2), producer a3
                w_rt = router_prefetch(W_r, a0, a1, a2, E, H, BLOCK_E, RCK)
                ok, rdy = _waitb(scratch, meta, B_A, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    lg = router_finish(w_rt, W_r, _act(scratch, meta, M_A, ACT_F32), H, rows, a0, a1, a2, E, H, ROWS_PAD,
                                       BLOCK_E, RCK, NUM_STAGES)
                    router_store_partial(_f32(scratch, meta, M_PART_R) + a4 * width * E, lg, rows, a0, E, ROWS_PAD,
                                         BLOCK_E)
                    _signal(scratch, meta, B_RL, a3, tag, fault_site)
            elif fam == 16:                                # expert slot: row a0, rank a1, tile a2, producer a3
                ok, rdy = _waitb(scratch, meta, B_RL, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    if a0 < rows:
                        expert_slot(_f32(scratch, meta, M_PART_R), tl.load(meta + M_NRPART), width, bias_r, w_gu, s_gu,
                                    _act(scratch, meta, M_A, ACT_F32), _act(scratch, meta, M_ACTE, ACT_F32),
                                    _i32(scratch, meta, M_IDS), _f32(scratch, meta, M_RW), a0, a1, a2 * BLOCK_N,
                                    swiglu_limit, scaling, E, KE, I_E, H, E_PAD, K_PAD, RENORM, ROWS_PAD, BLOCK_N,
                                    BLOCK_K, PF_K, NUM_STAGES)
                    _signal(scratch, meta, B_XE, a3, tag, fault_site)
            elif fam == 17:                                # moe_down: tiles a0 .. a0 + a1 - 1, row by row
                j = 0
                while (j < a1) & (ok != 0):
                    n0 = (a0 + j) * BLOCK_N
                    d0 = moe_down_prefetch(W_d, n0, H, I, BLOCK_N, PF_K)          # shared expert's weights
                    ok, rdy = _waitb(scratch, meta, B_H, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        ok, rdy = _waitb(scratch, meta, B_XE, rdy, pid, tag, hdr, timeout_ns)
                    rr = 0
                    while (rr < rows) & (ok != 0):
                        if rr > 0:
                            d0 = moe_down_prefetch(W_d, n0, H, I, BLOCK_N, PF_K)
                        acc = moe_down_finish(d0, W_d, S_d, _act(scratch, meta, M_H, ACT_F32) + rr * I,
                                              _i32(scratch, meta, M_IDS) + rr * KE, _f32(scratch, meta, M_RW) + rr * KE,
                                              _act(scratch, meta, M_ACTE, ACT_F32) + rr * KE * I_E, w_de, s_de, n0, E,
                                              H, I_E, I, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, KE)
                        if tp_size == 1:
                            gemv_store(_f32(scratch, meta, M_Y2) + rr * H, 0, acc, 1, n0, H, ROWS_PAD, BLOCK_N)
                        else:
                            xchg_publish(xd + rr * H, acc, n0, 1, width, tp_rank, tp_size, tag, tl.load(meta + M_SITE_XD),
                                         fault_site, H, ROWS_PAD, BLOCK_N)
                        rr += 1
                    j += 1
                if (ok != 0) & (tp_size == 1):
                    tl.debug_barrier()
                    if NEXTN:                              # z = y + ffn: X_out [width, H]
                        add_cols(_f32(scratch, meta, M_XMID), _f32(scratch, meta, M_Y2), X_out, rows, a0 * BLOCK_N,
                                 tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
                        _signal(scratch, meta, B_Z, a2, tag, fault_site)
                    else:
                        post_cols(_f32(scratch, meta, M_XMID), _f32(scratch, meta, M_Y2), _f32(scratch, meta, M_COEF2),
                                  X_out, rows, a0 * BLOCK_N, tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
            elif fam == 18:                                # post2: rank sum of tiles a0 .., hc_post
                j = 0
                while (j < a1) & (ok != 0):
                    ok = xchg_sum(xd, _f32(scratch, meta, M_Y2), (a0 + j) * BLOCK_N, rows, width, tp_rank, tp_size,
                                  tag, hdr, tl.load(meta + M_SITE_XD), pid, timeout_ns, H, ROWS_PAD, BLOCK_N)
                    j += 1
                if ok != 0:
                    tl.debug_barrier()
                    if NEXTN:
                        add_cols(_f32(scratch, meta, M_XMID), _f32(scratch, meta, M_Y2), X_out, rows, a0 * BLOCK_N,
                                 tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
                        _signal(scratch, meta, B_Z, a2, tag, fault_site)
                    else:
                        post_cols(_f32(scratch, meta, M_XMID), _f32(scratch, meta, M_Y2), _f32(scratch, meta, M_COEF2),
                                  X_out, rows, a0 * BLOCK_N, tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
            elif fam == 19:                                # peer_o (loopback): rank a0's tiles a1 .. a1 + a2 - 1
                j = 0
                while j < a2:
                    peer_publish(xo, peer_o, a0, (a1 + j) * BLOCK_N, rows, width, tp_rank, tp_size, tag,
                                 tl.load(meta + M_SITE_XO), fault_site, H, ROWS_PAD, BLOCK_N)
                    j += 1
            elif fam == 20:                                # peer_d (loopback)
                j = 0
                while j < a2:
                    peer_publish(xd, peer_d, a0, (a1 + j) * BLOCK_N, rows, width, tp_rank, tp_size, tag,
                                 tl.load(meta + M_SITE_XD), fault_site, H, ROWS_PAD, BLOCK_N)
                    j += 1
            elif fam == 21:                                # eh_in (NextN): row a0, producer a1
                if NEXTN:
                    if a0 < rows:
                        ein = _act(scratch, meta, M_EIN, ACT_F32) + a0 * 2 * H
                        tok = tl.load(tokens + a0).to(tl.int64)
                        rms_row(embed_w + tok * H, enorm, ein, H, eps, NORM_BLOCK)          # embedding first
                        rms_row(hid + a0 * H, hnorm, ein + H, H, eps, NORM_BLOCK)
                    _signal(scratch, meta, B_EIN, a1, tag, fault_site)
            elif fam == 22:                                # eh (NextN): eh_proj tiles a1 .., producer a3
                if NEXTN:
                    w_eh = gemv_prefetch(W_eh, a1 * BLOCK_N, 0, 2 * H, H, 2 * H, BLOCK_N, PF_K)
                    ok, rdy = _waitb(scratch, meta, B_EIN, rdy, pid, tag, hdr, timeout_ns)
                    if ok != 0:
                        gemv_tiles(w_eh, W_eh, W_eh, _act(scratch, meta, M_EIN, ACT_F32), 2 * H, _f32(scratch, meta, M_X0),
                                   H, rows, a1, a2, H, 2 * H, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        _signal(scratch, meta, B_X, a3, tag, fault_site)
            elif fam == 23:                                # ln_row (NextN): row a0, norm a1, producer a2
                if NEXTN:
                    if a1 == 0:                                # x -> a_in (input_layernorm)
                        ok, rdy = _waitb(scratch, meta, B_X, rdy, pid, tag, hdr, timeout_ns)
                        if (ok != 0) & (a0 < rows):
                            rms_row(_f32(scratch, meta, M_X0) + a0 * H, ln1, _act(scratch, meta, M_AIN, ACT_F32) + a0 * H,
                                    H, eps, NORM_BLOCK)
                        if ok != 0:
                            _signal(scratch, meta, B_AIN, a2, tag, fault_site)
                    elif a1 == 1:                              # y -> a (post_attention_layernorm)
                        ok, rdy = _waitb(scratch, meta, B_HP2, rdy, pid, tag, hdr, timeout_ns)
                        if (ok != 0) & (a0 < rows):
                            rms_row(_f32(scratch, meta, M_XMID) + a0 * H, ln2, _act(scratch, meta, M_A, ACT_F32) + a0 * H,
                                    H, eps, NORM_BLOCK)
                        if ok != 0:
                            _signal(scratch, meta, B_A, a2, tag, fault_site)
                    else:                                      # z -> n (shared_head.norm): the block's output row
                        ok, rdy = _waitb(scratch, meta, B_Z, rdy, pid, tag, hdr, timeout_ns)
                        if (ok != 0) & (a0 < rows):
                            rms_row(X_out + a0 * H, shn, n_out + a0 * H, H, eps, NORM_BLOCK)
        i += 1
    launch_end(hdr, bump)
