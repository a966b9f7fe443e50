"""The persistent kernel of the `sparse` launch (one DSA layer: sparse NoPE MLA + kpool indexer,
then the MoE FFN, both inside mHC). Host side: launches/sparse.py. The mHC, o_proj and MoE families
are the KDA layer kernel's: the same noinline task functions (launches/ffn.py), the same meta layout
for their regions and boxes; the DSA families (absorb .. join) are noinline task functions here, the GEMV
tiles and row norms calls. Stages (every hand-off is plain rows + a box; every wait a site `sparse.<region>`):
  0 hc_pre     column tiles of the streams -> hc_pre partial slots                       -> hp1
  1 gate_in    [hp1] gate row a_in (bf16)                                                   -> a_in
  2 qkv_a      [a_in] GEMV tiles of q_a (QL) | kv_a (C) | wk, kpool gate, weights_proj, in KS_A K slices
               -> ya planes [KS_A, width, NA] (fp32)
  3 dsa_norm   [ya] per row: the planes joined in order; q_resid (bf16); latent c -> cache[slot, pos];
               LayerNorm'd key | gate -> tail ring row pos % KP; pooled key when pos completes a pool -> qr
               + the coef1 task [hp1]: Sinkhorn -> coef1 (hc_post waits cf1; here, not beside the gate,
               so no qkv_a task waits behind it)                                              -> cf1
  4 q_b        [qr] GEMV tiles of this rank's q_b heads | wq_b (index queries) -> yq (fp32)  -> q
  5 absorb     [q] (head, C tile): q~ = q_h W_UK,h (fp32)                                   -> ql
    score      [q] (row, pool chunk t): pool scores, then radix pass 0 of the top-k          -> hs0
  6-8 hist     [hs(j-1)] (row, t): radix pass j = 1..3 (nothing while P <= TOPK)            -> hs(j)
  9 select     [hs3] (row, t): selected pools -> token indices (ascending) + tail, -1 pad   -> idx
 10 attend     [idx, ql] (row, head group, token tile): split softmax partials of the tile   -> att
 11 join       [att] (head, DV tile): split join + W_UV -> o (bf16)                           -> o
 12 o_proj     [o] as the KDA launch (TP 1: hc_post + FFN hc_pre partials -> hp2; TP > 1: xo, o_sum)
 13.. gate_ffn, moe_route (router, shared gate|up), experts, down (+ down_sum): the KDA launch's MoE.
Pad rows (rows <= r < width) compute and write nothing (no cache writes either) but still signal.
NEXTN (the MTP block, launches/nextn.py; no mHC): stages 0-1 become eh (eh_proj tiles in KS_EH K slices, each
first norming its own slice of [enorm(embed(t)) | hnorm(h)] into its CTA's slot (EH_FOLD; else an eh_in task a
row norms the whole input and the tiles wait on it) -> x0's planes 1..KS_EH, box x) -> qkv_a's tasks wait on x,
each norming its own K slice of input_layernorm(x) (the planes joined in order; producer 0 stores x0's plane 0)
into its CTA's slot (AIN_FOLD; else an ln_row 0 task a row -> a_in). The folds are the host's choice by width
(nextn.py norm_folds); o_proj adds x (y = x + attn,
xmid) instead of hc_post; ln_row 1 (post_attention_layernorm) replaces gate_ffn; down adds y
(z = y + ffn -> X_out [width, H]) and signals z; ln_row 2 writes n = shared_head.norm(z).
"""
import triton
import triton.language as tl

from sync.device import const_word, launch_begin, launch_end, trace_clock, trace_cycles, trace_mark, trace_store

from ..kernels.indexer import idx_score_pools, topk_hist_pass, topk_write
from ..kernels.mla import (mla_absorb_finish, mla_absorb_prefetch, mla_attend_tile, mla_join_ctx, mla_out_ctx,
                           mla_out_prefetch)
from .ffn import (B_A, B_AIN, B_HP2, B_O, COMMON_BOXES, COMMON_ROWS, M_A, M_AIN, M_HDR, M_ON, M_SITE_XD, M_SITE_XO,
                  M_XMID, act_at, coef_task, f32_at, gate_task, hc_pre_task, i32_at, l2_prefetch_rows, meta_layout,
                  oproj_task, peer_task, post1_task, runtime_i32, sig_words, signal, signal_at, task_entry,
                  waitb, warm_before)
from .ffn_tasks import FFN_BASE, ffn_task, with_ffn_families
from .mixer_dsa import (dsa_norm_finish, dsa_norm_prefetch, eh_x_slice, gemv_tiles, rms_row, rms_row_planes,
                        rms_slice_planes)

FAMILIES = with_ffn_families({"part": 0, "gate1": 1, "mat_a": 2, "dsa_norm": 3, "mat_q": 4, "absorb": 5, "score": 6,
                               "hist": 7, "select": 8, "attend": 9, "join": 10, "oproj": 11, "post1": 12, "gate2": 13,
                               "coef1": 14, "coef2": 15,
                               "peer_o": 19, "peer_d": 20, "eh_in": 21, "eh": 22, "ln_row": 23})
BOXES = COMMON_BOXES + ("ya", "qr", "q", "ql", "hs0", "hs1", "hs2", "hs3", "idx", "att", "ein", "x", "z")
ROWS_REGIONS = COMMON_ROWS + ("ya", "qr_rows", "yq", "qlat", "scores", "hist", "idx_rows", "pm", "pl", "pacc",
                              "ctx", "ein_rows", "x0", "jstate")
META, META_WORDS = meta_layout(BOXES, ROWS_REGIONS)

(B_YA, B_QR, B_Q, B_QL, B_HS0, B_HS1, B_HS2, B_HS3, B_IDX, B_ATT, B_EIN, B_X, B_Z) = (
    tl.constexpr(BOXES.index(n)) for n in BOXES[len(COMMON_BOXES):])
CACHE_ALIGN_ELEMS = 8      # the caches' slot strides are multiples of it (elements; sparse.py set_input checks)


@triton.jit
def _slot_stride(ss):
    """A cache's slot stride, known to the alignment analysis as a multiple of CACHE_ALIGN_ELEMS (the shift
    pair: tl.multiple_of is lost on scalars), so a slot's rows stay 16-byte aligned and their loads are
    vector / cp.async copies (a plain runtime stride made every latent and pool-key load a 2-byte scalar
    one: 240 of them in the attend task's PTX)."""
    return (ss >> 3) << 3

(M_YA, M_QR, M_YQ, M_QLAT, M_SC, M_HIST, M_IDX, M_PM, M_PL, M_PACC, M_CTX, M_EIN, M_X0, M_JST) = (
    tl.constexpr(META[n]) for n in ROWS_REGIONS[len(COMMON_ROWS):])


# ---------------------------------------------------------------------------------------------------------- DSA tasks
# Each DSA family is a noinline function (its own PTX .func), as the mHC / FFN families are (launches/ffn.py):
# inlined into the task loop, their index tensors and pointers stayed live across the whole loop and the
# kernel body spilled its loop-carried values (sparse TP8 bf16: 304 B of spills). Each task: its wait(s),
# its work, its publish; -> (ok, rdy).

@triton.jit(noinline=True)
def _mat_a_task(W_qa, S_qa, W_kva, S_kva, W_ix, scratch, meta, rows, width, a0, a1, a2, a3, a4, rdy, pid, tag, hdr,
                timeout_ns, fault_site, H: tl.constexpr, QL: tl.constexpr, C: tl.constexpr, DI: tl.constexpr,
                NI: tl.constexpr, NA: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, ACT_F32: tl.constexpr,
                KS: tl.constexpr, ln1, eps, NEXTN: tl.constexpr, KS_EH: tl.constexpr, SLOT_K: tl.constexpr,
                NORM_BLOCK: tl.constexpr, AIN_FOLD: tl.constexpr):
    """mat_a: matrix a0 (q_a, kv_a, the indexer's wk | gate | weights_proj), tiles a1 .. a1 + a2 - 1, K slice
    a4 of KS -> ya plane a4 ([KS, width, NA] fp32, joined by dsa_norm); producer a3. The first tile's
    lines of the slice toward L2 before the wait. NEXTN with AIN_FOLD: waits on x (eh_proj's planes) and norms
    its own K slice of input_layernorm(x) into its CTA's slot (producer 0 also stores the joined x)."""
    KL: tl.constexpr = H // KS
    k0 = a4 * KL
    if a0 == 0:
        l2_prefetch_rows(W_qa + k0, a1 * BLOCK_N, QL, H, BLOCK_N)
    elif a0 == 1:
        l2_prefetch_rows(W_kva + k0, a1 * BLOCK_N, C, H, BLOCK_N)
    else:
        l2_prefetch_rows(W_ix + k0, a1 * BLOCK_N, 2 * DI + NI, H, BLOCK_N)
    ya = f32_at(scratch, meta, M_YA) + a4 * width * NA
    sb, sw, ss = sig_words(scratch, meta, B_YA)
    if NEXTN and AIN_FOLD:
        x0 = f32_at(scratch, meta, M_X0)
        slot = act_at(scratch, meta, M_EIN, ACT_F32) + pid * width * SLOT_K
        ok, rdy = waitb(scratch, meta, B_X, rdy, pid, tag, hdr, timeout_ns)
        if ok != 0:
            tl.debug_barrier()                         # an earlier task of this CTA read its slot
            rms_slice_planes(x0 + width * H, width * H, KS_EH, ln1, slot, x0, a3 == 0, rows, k0, eps, H, KL,
                             NORM_BLOCK)
            tl.debug_barrier()                         # the slot's stores seen by every thread's loads
        xin, sx = slot - k0, KL
    else:
        xin, sx = act_at(scratch, meta, M_AIN, ACT_F32), H
        ok, rdy = waitb(scratch, meta, B_AIN, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        if a0 == 0:
            gemv_tiles(W_qa, S_qa, xin, sx, ya, NA, rows, a1, a2, k0, k0 + KL, QL, H, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K,
                       NUM_STAGES)
        elif a0 == 1:
            gemv_tiles(W_kva, S_kva, xin, sx, ya + QL, NA, rows, a1, a2, k0, k0 + KL, C, H, ROWS_PAD, BLOCK_N, BLOCK_K,
                       PF_K, NUM_STAGES)
        else:
            gemv_tiles(W_ix, W_ix, xin, sx, ya + QL + C, NA, rows, a1, a2, k0, k0 + KL, 2 * DI + NI, H, ROWS_PAD,
                       BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
        signal_at(sb, sw, ss, a3, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _dsa_norm_task(positions, slots, latent, lat_ss, pool_keys, pk_ss, tail, tail_ss, qa_ln, kva_ln, kn_w, kn_b, ape,
                   scratch, meta, rows, width, a0, a1, rdy, pid, tag, hdr, timeout_ns, fault_site, eps,
                   QL: tl.constexpr, C: tl.constexpr, DI: tl.constexpr, NI: tl.constexpr, NA: tl.constexpr,
                   KP: tl.constexpr, ACT_F32: tl.constexpr, KS: tl.constexpr, Q_PAD: tl.constexpr,
                   C_PAD: tl.constexpr, NI_PAD: tl.constexpr):
    """dsa_norm: row a0 (mixer_dsa.py dsa_norm_finish; a pad row writes nothing), producer a1 of qr. The body
    runs once before the wait with every store masked off (it writes the caches and ya's plane 0 in place), so
    its code is warm and its weights and ring rows are on their way; after the wait they load in the same batch
    as the ya planes (one trip either way)."""
    sb, sw, ss = sig_words(scratch, meta, B_QR)
    if warm_before(rdy, B_YA):
        _dsa_norm_body(positions, slots, latent, lat_ss, pool_keys, pk_ss, tail, tail_ss, qa_ln, kva_ln, kn_w, kn_b,
                       ape, scratch, meta, rows, width, a0, runtime_i32(0), eps, QL, C, DI, NI, NA, KP, ACT_F32, KS,
                       Q_PAD, C_PAD, NI_PAD)
    ok, rdy = waitb(scratch, meta, B_YA, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        _dsa_norm_body(positions, slots, latent, lat_ss, pool_keys, pk_ss, tail, tail_ss, qa_ln, kva_ln, kn_w, kn_b,
                       ape, scratch, meta, rows, width, a0, runtime_i32(1), eps, QL, C, DI, NI, NA, KP, ACT_F32, KS,
                       Q_PAD, C_PAD, NI_PAD)
        signal_at(sb, sw, ss, a1, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _dsa_norm_body(positions, slots, latent, lat_ss, pool_keys, pk_ss, tail, tail_ss, qa_ln, kva_ln, kn_w, kn_b, ape,
                   scratch, meta, rows, width, a0, live, eps, QL: tl.constexpr, C: tl.constexpr, DI: tl.constexpr,
                   NI: tl.constexpr, NA: tl.constexpr, KP: tl.constexpr, ACT_F32: tl.constexpr, KS: tl.constexpr,
                   Q_PAD: tl.constexpr, C_PAD: tl.constexpr, NI_PAD: tl.constexpr):
    """dsa_norm's work; live == 0 stores nothing (mixer_dsa.py dsa_norm_finish)."""
    if a0 < rows:
        pos = tl.load(positions + a0)
        slot = tl.load(slots + a0).to(tl.int64)
        ring = tail + slot * _slot_stride(tail_ss)
        wq, wc, lw, lb, keys, z = dsa_norm_prefetch(qa_ln, kva_ln, kn_w, kn_b, ape, ring, pos, QL, C, DI, KP, Q_PAD,
                                                    C_PAD)
        dsa_norm_finish(f32_at(scratch, meta, M_YA) + a0 * NA, width * NA, wq, wc, lw, lb, keys, z, ape,
                        act_at(scratch, meta, M_QR, ACT_F32) + a0 * QL,
                        latent + slot * _slot_stride(lat_ss) + pos.to(tl.int64) * C, ring,
                        pool_keys + slot * _slot_stride(pk_ss), pos, eps, QL, C, DI, NI, KP, KS, Q_PAD, C_PAD, NI_PAD,
                        live)


@triton.jit(noinline=True)
def _absorb_task(kv_b, S_kvb, scratch, meta, rows, a0, a1, a2, rdy, pid, tag, hdr, timeout_ns, fault_site,
                 NQ: tl.constexpr, NH: tl.constexpr, DN: tl.constexpr, DV: tl.constexpr, C: tl.constexpr,
                 ROWS_PAD: tl.constexpr, ABS_C: tl.constexpr, ABS_CK: tl.constexpr):
    """absorb: head a0, C tile a1 -> q~ = q_h W_UK,h (fp32); producer a2 of ql. W_UK's tile loads before the wait."""
    w_uk = mla_absorb_prefetch(kv_b, a0, a1 * ABS_C, DN, DV, C, ABS_C, ABS_CK)
    sb, sw, ss = sig_words(scratch, meta, B_QL)
    ok, rdy = waitb(scratch, meta, B_Q, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        mla_absorb_finish(w_uk, kv_b, S_kvb, f32_at(scratch, meta, M_YQ), NQ, f32_at(scratch, meta, M_QLAT),
                          rows, a0, a1 * ABS_C, NH, DN, DV, C, ROWS_PAD, ABS_C, ABS_CK)
        signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit
def _jstate(scratch, meta, r, T_MAX: tl.constexpr, BITS: tl.constexpr):
    """Row r's radix join states [PASSES, T_MAX + 2] int32 (kernels/indexer.py `state`)."""
    PASSES: tl.constexpr = (32 + BITS - 1) // BITS
    return i32_at(scratch, meta, M_JST) + r * (PASSES * (T_MAX + 2))


@triton.jit(noinline=True)
def _score_body(positions, slots, pool_keys, pk_ss, scratch, meta, rows, pmax, sel_chunk, a0, a1,
                NA: tl.constexpr, NQ: tl.constexpr, NH: tl.constexpr, DN: tl.constexpr, QL: tl.constexpr,
                C: tl.constexpr, DI: tl.constexpr, NI: tl.constexpr, KP: tl.constexpr, TOPK: tl.constexpr,
                T_MAX: tl.constexpr, BITS: tl.constexpr, SEL_BLOCK: tl.constexpr, BLOCK_P: tl.constexpr,
                HIST_W: tl.constexpr):
    """score's work: row a0, pool chunk a1's scores, then radix pass 0 over them. Writes only the chunk's
    scores and its hist[0, a1] row (no join at pass 0): safe to run dry (ffn.WARM_CODE)."""
    if a0 < rows:
        pos = tl.load(positions + a0)
        slot = tl.load(slots + a0).to(tl.int64)
        P = (pos + 1) // KP
        sc = f32_at(scratch, meta, M_SC) + a0 * pmax
        yq_r = f32_at(scratch, meta, M_YQ) + a0 * NQ
        idx_score_pools(yq_r + NH * DN, f32_at(scratch, meta, M_YA) + a0 * NA + QL + C + 2 * DI,
                        pool_keys + slot * _slot_stride(pk_ss), sc, a1 * sel_chunk,
                        tl.minimum(a1 * sel_chunk + sel_chunk, P), NI, DI, BLOCK_P)
        if (P > TOPK) & (a1 < tl.cdiv(P, sel_chunk)):
            tl.debug_barrier()                             # own score stores before the pass reads them
            topk_hist_pass(sc, i32_at(scratch, meta, M_HIST) + a0 * HIST_W, _jstate(scratch, meta, a0, T_MAX, BITS),
                           a1, 0, sel_chunk, P, TOPK, T_MAX, BITS, SEL_BLOCK)


@triton.jit(noinline=True)
def _score_task(positions, slots, pool_keys, pk_ss, scratch, meta, rows, pmax, sel_chunk, a0, a1, a2, rdy, pid, tag,
                hdr, timeout_ns, fault_site, NA: tl.constexpr, NQ: tl.constexpr, NH: tl.constexpr, DN: tl.constexpr,
                QL: tl.constexpr, C: tl.constexpr, DI: tl.constexpr, NI: tl.constexpr, KP: tl.constexpr,
                TOPK: tl.constexpr, T_MAX: tl.constexpr, BITS: tl.constexpr, SEL_BLOCK: tl.constexpr,
                BLOCK_P: tl.constexpr, HIST_W: tl.constexpr):
    """score: row a0, pool chunk a1: the chunk's pool scores, then radix pass 0 of the top-k over them;
    producer a2 of hs0. The body runs once dry before the wait (its code warm)."""
    sb, sw, ss = sig_words(scratch, meta, B_HS0)
    if warm_before(rdy, B_Q):
        _score_body(positions, slots, pool_keys, pk_ss, scratch, meta, rows, pmax, sel_chunk, a0, a1, NA, NQ, NH, DN,
                    QL, C, DI, NI, KP, TOPK, T_MAX, BITS, SEL_BLOCK, BLOCK_P, HIST_W)
    ok, rdy = waitb(scratch, meta, B_Q, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        _score_body(positions, slots, pool_keys, pk_ss, scratch, meta, rows, pmax, sel_chunk, a0, a1, NA, NQ, NH, DN,
                    QL, C, DI, NI, KP, TOPK, T_MAX, BITS, SEL_BLOCK, BLOCK_P, HIST_W)
        signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _hist_task(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns,
               fault_site, KP: tl.constexpr, TOPK: tl.constexpr, T_MAX: tl.constexpr, BITS: tl.constexpr,
               SEL_BLOCK: tl.constexpr, HIST_W: tl.constexpr):
    """hist: row a0, chunk a1, radix pass a2 (1..3; nothing while P <= TOPK); producer a3 of hs(a2). The body
    runs once dry before the wait (its code warm)."""
    sb, sw, ss = sig_words(scratch, meta, B_HS0 + a2)
    if warm_before(rdy, B_HS0 + a2 - 1):
        _hist_body(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, a2, KP, TOPK, T_MAX, BITS, SEL_BLOCK,
                   HIST_W)
    ok, rdy = waitb(scratch, meta, B_HS0 + a2 - 1, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        _hist_body(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, a2, KP, TOPK, T_MAX, BITS, SEL_BLOCK,
                   HIST_W)
        signal_at(sb, sw, ss, a3, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _hist_body(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, a2, KP: tl.constexpr, TOPK: tl.constexpr,
               T_MAX: tl.constexpr, BITS: tl.constexpr, SEL_BLOCK: tl.constexpr, HIST_W: tl.constexpr):
    """hist's work (kernels/indexer.py topk_hist_pass). Writes only its hist[a2, a1] row and (chunk 0) join state
    row a2 - 1, which only pass a2 + 1 and select read, after this task's signal: safe to run dry."""
    if a0 < rows:
        P = (tl.load(positions + a0) + 1) // KP
        if (P > TOPK) & (a1 < tl.cdiv(P, sel_chunk)):
            topk_hist_pass(f32_at(scratch, meta, M_SC) + a0 * pmax, i32_at(scratch, meta, M_HIST) + a0 * HIST_W,
                           _jstate(scratch, meta, a0, T_MAX, BITS), a1, a2, sel_chunk, P, TOPK, T_MAX, BITS, SEL_BLOCK)


@triton.jit(noinline=True)
def _select_task(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, a2, rdy, pid, tag, hdr, timeout_ns,
                 fault_site, KP: tl.constexpr, TOPK: tl.constexpr, WIDTH: tl.constexpr, T_MAX: tl.constexpr,
                 BITS: tl.constexpr, SEL_BLOCK: tl.constexpr, HIST_W: tl.constexpr):
    """select: row a0, chunk a1: its selected pools -> token indices (ascending) + the tail, -1 pad;
    producer a2 of idx. The body runs once before the wait with its stores masked off (its code warm: a dry
    run's ranks come from whatever the histograms hold, so it must store nothing)."""
    sb, sw, ss = sig_words(scratch, meta, B_IDX)
    if warm_before(rdy, B_HS3):
        _select_body(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, runtime_i32(0), KP, TOPK, WIDTH, T_MAX,
                     BITS, SEL_BLOCK, HIST_W)
    ok, rdy = waitb(scratch, meta, B_HS3, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        _select_body(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, runtime_i32(1), KP, TOPK, WIDTH, T_MAX,
                     BITS, SEL_BLOCK, HIST_W)
        signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _select_body(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, live, KP: tl.constexpr, TOPK: tl.constexpr,
                 WIDTH: tl.constexpr, T_MAX: tl.constexpr, BITS: tl.constexpr, SEL_BLOCK: tl.constexpr,
                 HIST_W: tl.constexpr):
    """select's work (kernels/indexer.py topk_write); live == 0 stores nothing."""
    if a0 < rows:
        pos = tl.load(positions + a0)
        P = (pos + 1) // KP
        if a1 < tl.maximum(tl.cdiv(P, sel_chunk), 1):
            topk_write(f32_at(scratch, meta, M_SC) + a0 * pmax, i32_at(scratch, meta, M_HIST) + a0 * HIST_W,
                       _jstate(scratch, meta, a0, T_MAX, BITS), i32_at(scratch, meta, M_IDX) + a0 * WIDTH, a1,
                       sel_chunk, P, pos, TOPK, KP, WIDTH, T_MAX, BITS, SEL_BLOCK, live)


@triton.jit(noinline=True)
def _attend_task(positions, slots, latent, lat_ss, scratch, meta, rows, n_splits, tpt, att_scale, a0, a1, a2, a3, rdy,
                 pid, tag, hdr, timeout_ns, fault_site, NH: tl.constexpr, C: tl.constexpr, KP: tl.constexpr,
                 TOPK: tl.constexpr, WIDTH: tl.constexpr, HB: tl.constexpr, BLOCK_T: tl.constexpr,
                 ATT_CK: tl.constexpr):
    """attend: row a0, head group a1, split a2 = token tile [a2 tpt, a2 tpt + BLOCK_T): split-softmax
    partials over those selected latent rows (tpt == BLOCK_T: one tile a task); producer a3 of att. The body
    runs once dry before the waits (its code warm)."""
    sb, sw, ss = sig_words(scratch, meta, B_ATT)
    if warm_before(rdy, B_IDX):
        _attend_body(positions, slots, latent, lat_ss, scratch, meta, rows, n_splits, tpt, att_scale, a0, a1, a2,
                     runtime_i32(0), NH, C, KP, TOPK, WIDTH, HB, BLOCK_T, ATT_CK)
    ok, rdy = waitb(scratch, meta, B_IDX, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        ok, rdy = waitb(scratch, meta, B_QL, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        _attend_body(positions, slots, latent, lat_ss, scratch, meta, rows, n_splits, tpt, att_scale, a0, a1, a2,
                     runtime_i32(1), NH, C, KP, TOPK, WIDTH, HB, BLOCK_T, ATT_CK)
        signal_at(sb, sw, ss, a3, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _attend_body(positions, slots, latent, lat_ss, scratch, meta, rows, n_splits, tpt, att_scale, a0, a1, a2, live,
                 NH: tl.constexpr, C: tl.constexpr, KP: tl.constexpr, TOPK: tl.constexpr, WIDTH: tl.constexpr,
                 HB: tl.constexpr, BLOCK_T: tl.constexpr, ATT_CK: tl.constexpr):
    """attend's work (kernels/mla.py mla_attend_tile). Writes only its own split's partials. The token ids it
    gathers by clamp to t_hi: the row's position when live, -1 in the dry run (live == 0), whose gathers are
    then all masked off: whatever idx holds (the last launch's selection) is neither read through nor
    prefetched, so the dry run warms the code and nothing else."""
    if a0 < rows:
        pos = tl.load(positions + a0)
        slot = tl.load(slots + a0).to(tl.int64)
        P = (pos + 1) // KP
        n_sel = tl.minimum(P, TOPK) * KP + pos + 1 - P * KP
        part = a0 * NH * n_splits
        mla_attend_tile(f32_at(scratch, meta, M_QLAT) + a0 * NH * C, i32_at(scratch, meta, M_IDX) + a0 * WIDTH,
                        latent + slot * _slot_stride(lat_ss), f32_at(scratch, meta, M_PM) + part,
                        f32_at(scratch, meta, M_PL) + part, f32_at(scratch, meta, M_PACC) + part * C,
                        a1 * HB, a2, a2 * tpt, n_sel, n_splits, att_scale, NH, C, HB, BLOCK_T, ATT_CK,
                        tl.where(live != 0, pos, -1))


@triton.jit(noinline=True)
def _join_task(kv_b, S_kvb, scratch, meta, rows, n_splits, a0, a1, a2, rdy, pid, tag, hdr, timeout_ns, fault_site,
               NH: tl.constexpr, DN: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, ROWS_PAD: tl.constexpr,
               OUT_N: tl.constexpr, OUT_PF: tl.constexpr, ACT_F32: tl.constexpr, NS_PAD: tl.constexpr,
               SB: tl.constexpr):
    """join: head a0, DV tile a1: the splits joined in a fixed order, then W_UV -> o (bf16); producer a2
    of o. The body runs once dry before the wait: its code warm, and W_UV's tile on its way to L2."""
    sb, sw, ss = sig_words(scratch, meta, B_O)
    if warm_before(rdy, B_ATT):
        _join_body(kv_b, S_kvb, scratch, meta, rows, n_splits, a0, a1, pid, hdr, NH, DN, DV, C, ROWS_PAD, OUT_N,
                   OUT_PF, ACT_F32, NS_PAD, SB)
    ok, rdy = waitb(scratch, meta, B_ATT, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        _join_body(kv_b, S_kvb, scratch, meta, rows, n_splits, a0, a1, pid, hdr, NH, DN, DV, C, ROWS_PAD, OUT_N,
                   OUT_PF, ACT_F32, NS_PAD, SB)
        signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def _join_body(kv_b, S_kvb, scratch, meta, rows, n_splits, a0, a1, pid, hdr, NH: tl.constexpr, DN: tl.constexpr,
               DV: tl.constexpr, C: tl.constexpr, ROWS_PAD: tl.constexpr, OUT_N: tl.constexpr, OUT_PF: tl.constexpr,
               ACT_F32: tl.constexpr, NS_PAD: tl.constexpr, SB: tl.constexpr):
    """join's work (kernels/mla.py mla_join_ctx, mla_out_ctx). W_UV's first chunk loads first, in flight during
    the split join. Writes only this CTA's ctx scratch and its own o tile: safe to run dry."""
    DO: tl.constexpr = NH * DV
    w_uv = mla_out_prefetch(kv_b, a0, a1 * OUT_N, DN, DV, C, OUT_N, OUT_PF)
    tl.debug_barrier()                                     # the CTA's ctx scratch is free (earlier task done)
    ctx = f32_at(scratch, meta, M_CTX) + pid * ROWS_PAD * C
    mla_join_ctx(f32_at(scratch, meta, M_PM), f32_at(scratch, meta, M_PL), f32_at(scratch, meta, M_PACC),
                 NH * n_splits, ctx, rows, a0, n_splits, C, NS_PAD, SB)
    trace_mark(hdr, pid, 1)                                # the splits are joined
    mla_out_ctx(w_uv, kv_b, S_kvb, ctx, act_at(scratch, meta, M_ON, ACT_F32), DO, rows, a0, a1 * OUT_N, DN, DV, C,
                ROWS_PAD, OUT_N, OUT_PF, OUT_PF, 2)       # 2 stages: registers
    trace_mark(hdr, pid, 2)                                # W_UV's tile is applied and stored


@triton.jit
def _mixer_in(X, scratch, meta, NEXTN: tl.constexpr):
    """What the mixer's output is added to: the streams X (hc_post), or x0 (NEXTN: y = x + attn)."""
    if NEXTN:
        return f32_at(scratch, meta, M_X0)
    else:
        return X


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
                        stage_lo, stage_hi, bump, tag_stride, tag_offset, fault_site, timeout_ns, trace,
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
                        RCK: tl.constexpr, NEXTN: tl.constexpr, TRACE: tl.constexpr, KS_GU: tl.constexpr,
                        KS_E: tl.constexpr, KG: tl.constexpr, NS_PAD: tl.constexpr, SB: tl.constexpr,
                        KS_A: tl.constexpr, Q_PAD: tl.constexpr, C_PAD: tl.constexpr, NI_PAD: tl.constexpr,
                        KS_O: tl.constexpr, KS_EH: tl.constexpr, EH_FOLD: tl.constexpr, AIN_FOLD: tl.constexpr):
    pid = tl.program_id(0)
    DO: tl.constexpr = NH * DV
    # NextN's CTA slot (ein_rows): width rows of the widest K slice a folding task norms into it (eh, mat_a)
    SLOT_K: tl.constexpr = 2 * H // KS_EH if 2 * H // KS_EH >= H // KS_A else H // KS_A
    PASSES: tl.constexpr = (32 + BITS - 1) // BITS
    HIST_W: tl.constexpr = PASSES * T_MAX * (1 << BITS)
    hdr = scratch + const_word(meta + M_HDR)
    if TRACE:
        t_cta = trace_clock(pid)
        c_cta = trace_cycles(pid)
    # the task range before launch_begin: constant, and not ordered after its acquire (PDL: before the
    # previous kernel is done)
    i = const_word(starts + pid)
    end = const_word(starts + pid + 1)
    tag, ok = launch_begin(hdr, tag_stride, tag_offset)
    rdy = 0            # bit b: this CTA already passed the wait on box b (one register, not 21)
    while (i < end) & (ok != 0):
        fam, st, a0, a1, a2, a3, a4 = task_entry(table, i)
        if (st >= stage_lo) & (st < stage_hi):
            if TRACE:                                      # where the launch's time goes
                t_task = trace_clock(i)
                c_task = trace_cycles(i)
            if fam == 0:                                   # part: column tiles a0 .. + a1, producer a2, rows a3 .. + a4
                if not NEXTN:
                    hc_pre_task(X, fn1, tokens, embed_w, scratch, meta, rows, a0, a1, a2, a3, a4, tag, fault_site, H,
                                ROWS_PAD, BLOCK_N, BLOCK_C, False)
            elif fam == 1:                                 # gate1: columns [a0, a0 + GATE_BH), producer a1
                if not NEXTN:
                    ok, rdy = gate_task(X, base1, scale1, ln1, scratch, meta, rows, a0, a1, a2, rdy, pid, tag, hdr,
                                        timeout_ns, fault_site, eps, hc_eps, runtime_i32(0), H, ROWS_PAD, GATE_BH,
                                        ACT_F32)
            elif fam == 2:                                 # mat_a: matrix a0, tiles a1 .. a1 + a2 - 1, producer a3, K slice a4
                ok, rdy = _mat_a_task(W_qa, S_qa, W_kva, S_kva, W_ix, scratch, meta, rows, width, a0, a1, a2, a3, a4, rdy,
                                      pid, tag, hdr, timeout_ns, fault_site, H, QL, C, DI, NI, NA, ROWS_PAD, BLOCK_N,
                                      BLOCK_K, PF_K, NUM_STAGES, ACT_F32, KS_A, ln1, eps, NEXTN, KS_EH, SLOT_K,
                                      NORM_BLOCK, AIN_FOLD)
            elif fam == 3:                                 # dsa_norm: row a0, producer a1
                ok, rdy = _dsa_norm_task(positions, slots, latent, lat_ss, pool_keys, pk_ss, tail, tail_ss, qa_ln, kva_ln,
                                         kn_w, kn_b, ape, scratch, meta, rows, width, a0, a1, rdy, pid, tag, hdr,
                                         timeout_ns, fault_site, eps, QL, C, DI, NI, NA, KP, ACT_F32, KS_A, Q_PAD, C_PAD,
                                         NI_PAD)
            elif fam == 4:                                 # mat_q: matrix a0 (q_b, wq_b), tiles a1 .., producer a3
                xin = act_at(scratch, meta, M_QR, ACT_F32)
                yq = f32_at(scratch, meta, M_YQ)
                if a0 == 0:
                    l2_prefetch_rows(W_qb, a1 * BLOCK_N, NH * DN, QL, BLOCK_N)
                else:
                    l2_prefetch_rows(W_iqb, a1 * BLOCK_N, NI * DI, QL, BLOCK_N)
                sb, sw, ss = sig_words(scratch, meta, B_Q)
                ok, rdy = waitb(scratch, meta, B_QR, rdy, pid, tag, hdr, timeout_ns)
                if ok != 0:
                    if a0 == 0:
                        gemv_tiles(W_qb, S_qb, xin, QL, yq, NQ, rows, a1, a2, 0, QL, NH * DN, QL, ROWS_PAD, BLOCK_N, BLOCK_K,
                                   PF_K, NUM_STAGES)
                    else:
                        gemv_tiles(W_iqb, W_iqb, xin, QL, yq + NH * DN, NQ, rows, a1, a2, 0, QL, NI * DI, QL, ROWS_PAD,
                                   BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                if ok != 0:
                    signal_at(sb, sw, ss, a3, tag, fault_site)
            elif fam == 5:                                 # absorb: head a0, C tile a1, producer a2
                ok, rdy = _absorb_task(kv_b, S_kvb, scratch, meta, rows, a0, a1, a2, rdy, pid, tag, hdr, timeout_ns,
                                       fault_site, NQ, NH, DN, DV, C, ROWS_PAD, ABS_C, ABS_CK)
            elif fam == 6:                                 # score: row a0, pool chunk a1, producer a2
                ok, rdy = _score_task(positions, slots, pool_keys, pk_ss, scratch, meta, rows, pmax, sel_chunk, a0, a1,
                                      a2, rdy, pid, tag, hdr, timeout_ns, fault_site, NA, NQ, NH, DN, QL, C, DI, NI, KP,
                                      TOPK, T_MAX, BITS, SEL_BLOCK, BLOCK_P, HIST_W)
            elif fam == 7:                                 # hist: row a0, chunk a1, pass a2, producer a3
                ok, rdy = _hist_task(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, a2, a3, rdy, pid, tag, hdr,
                                     timeout_ns, fault_site, KP, TOPK, T_MAX, BITS, SEL_BLOCK, HIST_W)
            elif fam == 8:                                 # select: row a0, chunk a1, producer a2
                ok, rdy = _select_task(positions, scratch, meta, rows, pmax, sel_chunk, a0, a1, a2, rdy, pid, tag, hdr,
                                       timeout_ns, fault_site, KP, TOPK, WIDTH, T_MAX, BITS, SEL_BLOCK, HIST_W)
            elif fam == 9:                                 # attend: row a0, head group a1, split a2, producer a3
                ok, rdy = _attend_task(positions, slots, latent, lat_ss, scratch, meta, rows, n_splits, tpt, att_scale,
                                       a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns, fault_site, NH, C, KP, TOPK,
                                       WIDTH, HB, BLOCK_T, ATT_CK)
            elif fam == 10:                                # join: head a0, DV tile a1, producer a2
                ok, rdy = _join_task(kv_b, S_kvb, scratch, meta, rows, n_splits, a0, a1, a2, rdy, pid, tag, hdr,
                                     timeout_ns, fault_site, NH, DN, DV, C, ROWS_PAD, OUT_N, OUT_PF, ACT_F32, NS_PAD,
                                     SB)
            elif fam == 11:                                # oproj: tiles a0 .. a0 + a1 - 1, slot a2
                ok, rdy = oproj_task(W_o, S_o, _mixer_in(X, scratch, meta, NEXTN), fn2, xo, scratch, meta, rows, width,
                                     tp_rank, tp_size, a0, a1, a2, a3, rdy, pid, tag, hdr, timeout_ns, fault_site, H,
                                     DO, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, BLOCK_C, ACT_F32, NEXTN, KS_O)
            elif fam == 12:                                # post1: rank sum of tiles a0 .., producer a2
                ok, rdy = post1_task(_mixer_in(X, scratch, meta, NEXTN), fn2, xo, scratch, meta, rows, width, tp_rank,
                                     tp_size, a0, a1, a2, a3, a4, rdy, pid, tag, hdr, timeout_ns, fault_site, H,
                                     ROWS_PAD, BLOCK_N, BLOCK_C, NEXTN, KS_O)
            elif fam == 13:                                # gate2: columns [a0, a0 + GATE_BH), producer a1
                ok, rdy = gate_task(f32_at(scratch, meta, M_XMID), base2, scale2, ln2, scratch, meta, rows, a0, a1,
                                    a2, rdy, pid, tag, hdr, timeout_ns, fault_site, eps, hc_eps, runtime_i32(1), H,
                                    ROWS_PAD, GATE_BH, ACT_F32)
            elif fam == 14:                                # coef1: row a0's hc_post coefficients, producer a1
                ok, rdy = coef_task(base1, scale1, scratch, meta, rows, a0, a1, rdy, pid, tag, hdr, timeout_ns,
                                    fault_site, eps, hc_eps, runtime_i32(0), H, ROWS_PAD, ITERS)
            elif fam == 15:                                # coef2
                ok, rdy = coef_task(base2, scale2, scratch, meta, rows, a0, a1, rdy, pid, tag, hdr, timeout_ns,
                                    fault_site, eps, hc_eps, runtime_i32(1), H, ROWS_PAD, ITERS)
            elif fam == 19:                                # peer_o (loopback): rank a0's tiles a1 .. a1 + a2 - 1
                peer_task(xo, peer_o, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, tag, fault_site,
                          runtime_i32(M_SITE_XO), H, ROWS_PAD, BLOCK_N)
            elif fam == 20:                                # peer_d (loopback)
                peer_task(xd, peer_d, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, tag, fault_site,
                          runtime_i32(M_SITE_XD), H, ROWS_PAD, BLOCK_N)
            elif fam >= FFN_BASE:                          # the FFN families (launches/ffn_tasks.py)
                ok, rdy = ffn_task(fam, a0, a1, a2, a3, a4, ok, rdy, pid, tag, hdr, timeout_ns, fault_site, scratch,
                                   meta, rows, width, tp_rank, tp_size, X_out, xd, W_g, S_g, W_u, S_u, W_d, S_d, W_r,
                                   bias_r, w_gu, s_gu, w_de, s_de, swiglu_limit, scaling, H, I, E, KE, I_E, E_PAD,
                                   K_PAD, RENORM, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES, BLOCK_E, RCK, ACT_F32,
                                   True, NEXTN, B_Z, KS_GU, KS_E, KG)
            elif fam == 21:                                # eh_in (NextN): row a0, producer a1
                if NEXTN:
                    if a0 < rows:
                        ein = act_at(scratch, meta, M_EIN, ACT_F32) + a0 * 2 * H
                        tok = tl.load(tokens + a0).to(tl.int64)
                        rms_row(embed_w + tok * H, enorm, ein, eps, H, NORM_BLOCK)          # embedding first
                        rms_row(hid + a0 * H, hnorm, ein + H, eps, H, NORM_BLOCK)
                    signal(scratch, meta, B_EIN, a1, tag, fault_site)
            elif fam == 22:                                # eh (NextN): eh_proj tiles a1 .., producer a3, K slice a4
                if NEXTN:
                    KL_EH: tl.constexpr = 2 * H // KS_EH
                    l2_prefetch_rows(W_eh + a4 * KL_EH, a1 * BLOCK_N, H, 2 * H, BLOCK_N)
                    xp = f32_at(scratch, meta, M_X0) + (1 + a4) * width * H     # plane a4 (x0's plane 0: x)
                    if EH_FOLD:                            # this CTA's slot: rows of the slice, KL_EH apart
                        xs = act_at(scratch, meta, M_EIN, ACT_F32) + pid * width * SLOT_K
                        tl.debug_barrier()                 # a previous eh task of this CTA read its slot
                        eh_x_slice(tokens, embed_w, hid, enorm, hnorm, xs, rows, a4 * KL_EH, eps, H, KL_EH, ROWS_PAD,
                                   NORM_BLOCK)
                        tl.debug_barrier()                 # the slot's stores seen by every thread's loads
                        x_eh, sx_eh = xs - a4 * KL_EH, KL_EH
                    else:
                        ok, rdy = waitb(scratch, meta, B_EIN, rdy, pid, tag, hdr, timeout_ns)
                        x_eh, sx_eh = act_at(scratch, meta, M_EIN, ACT_F32), 2 * H
                    if ok != 0:
                        gemv_tiles(W_eh, W_eh, x_eh, sx_eh, xp, H, rows, a1, a2, a4 * KL_EH, (a4 + 1) * KL_EH, H, 2 * H,
                                   ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
                        signal(scratch, meta, B_X, a3, tag, fault_site)
            elif fam == 23:                                # ln_row (NextN): row a0, norm a1, producer a2
                if NEXTN:
                    if a1 == 0:                                # x -> a_in (input_layernorm)
                        ok, rdy = waitb(scratch, meta, B_X, rdy, pid, tag, hdr, timeout_ns)
                        if (ok != 0) & (a0 < rows):
                            x0 = f32_at(scratch, meta, M_X0) + a0 * H
                            rms_row_planes(x0 + width * H, width * H, KS_EH, x0, ln1,
                                           act_at(scratch, meta, M_AIN, ACT_F32) + a0 * H, eps, H, NORM_BLOCK)
                        if ok != 0:
                            signal(scratch, meta, B_AIN, a2, tag, fault_site)
                    elif a1 == 1:                              # y -> a (post_attention_layernorm)
                        ok, rdy = waitb(scratch, meta, B_HP2, rdy, pid, tag, hdr, timeout_ns)
                        if (ok != 0) & (a0 < rows):
                            rms_row(f32_at(scratch, meta, M_XMID) + a0 * H, ln2, act_at(scratch, meta, M_A, ACT_F32) + a0 * H,
                                    eps, H, NORM_BLOCK)
                        if ok != 0:
                            signal(scratch, meta, B_A, a2, tag, fault_site)
                    else:                                      # z -> n (shared_head.norm): the block's output row
                        ok, rdy = waitb(scratch, meta, B_Z, rdy, pid, tag, hdr, timeout_ns)
                        if (ok != 0) & (a0 < rows):
                            rms_row(X_out + a0 * H, shn, n_out + a0 * H, eps, H, NORM_BLOCK)
            if TRACE:
                trace_store(trace, i, t_task, c_task, hdr, pid, i)
        i += 1
    if TRACE:                                          # this CTA's whole run: row n_tasks + pid
        trace_store(trace, tl.load(starts + tl.num_programs(0)) + pid, t_cta, c_cta, hdr, pid, pid)
    launch_end(hdr, bump)
