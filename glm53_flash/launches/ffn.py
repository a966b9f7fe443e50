"""Task families and hand-off helpers shared by the layer kernels (launches/kda_layer.py for the
embed / dense / kda kinds, launches/sparse_layer.py for sparse / nextn): the meta layout, the box and
region helpers, the mHC pre / gate / post glue, o_proj with its cross-rank sum and the loopback peer
tasks. The FFN half (gate|up, act, router, experts, down) is launches/ffn_tasks.py. Both kernels call
these functions; they differ only in their mixer families.

Meta words (one int32 vector per launch, host side: layer_host.py `KdaLayerLaunch._meta`): region
offsets and scalars at words 0 .. BOX_BASE - 1, the COMMON_* names first (so a shared family finds
them at the same word in both kernels), box b's (offset, words, producers, site) at BOX_BASE + 4b,
COMMON_BOXES first.

Registers: each family is a `noinline` function (its own PTX .func). Inlined into the persistent
kernel's one while loop, the families' loop-invariant index tensors and pointers were hoisted to the
loop top and stayed live through every GEMV, and every build reached 255 registers with spills
(launches/tail.py found the same). The waits are noinline too (spin loops with inline asm).
"""
import os

import triton
import triton.language as tl

from sync.device import const_word, signal_box, trace_mark, wait_box, wait_box2

from ..kernels.gemv import gemv_store, gemv_stream
from ..kernels.mhc import hc_partial_finish, hc_partial_prefetch, hc_post_partial, hc_post_tile
from .tail import _l2_prefetch
from .mixer_kda import SLOT_W, coef_row, embed_gather, gate_row, peer_publish, xchg_publish, xchg_sum

# ---------------------------------------------------------------------------- meta layout
BOX_BASE_H = 64
BOX_BASE: tl.constexpr = tl.constexpr(BOX_BASE_H)
COMMON_BOXES = ("hp1", "a_in", "o", "hp2", "a", "h", "rl", "xe", "hg", "sel", "dp", "cf1", "cf2")
COMMON_ROWS = ("part1", "part2", "coef1", "coef2", "a_in_rows", "a_rows", "o_rows", "y1", "xmid", "h_rows", "y2",
               "part_r", "ids_rec", "rw_rec", "act_e", "hpart", "epart", "dpart", "act_cta")
COMMON_SCALARS = ("hdr", "site_xo", "site_xd", "npart1", "npart2", "nrpart", "act_fold")


def meta_layout(boxes: tuple, rows_regions: tuple):
    """-> (META name -> word, META_WORDS) for a kernel whose boxes / row regions start with COMMON_*."""
    assert boxes[:len(COMMON_BOXES)] == COMMON_BOXES and rows_regions[:len(COMMON_ROWS)] == COMMON_ROWS
    names = COMMON_ROWS + COMMON_SCALARS + rows_regions[len(COMMON_ROWS):]
    assert len(names) <= BOX_BASE_H
    return {n: i for i, n in enumerate(names)}, BOX_BASE_H + 4 * len(boxes)


_META, _ = meta_layout(COMMON_BOXES, COMMON_ROWS)
(M_PART1, M_PART2, M_COEF1, M_COEF2, M_AIN, M_A, M_ON, M_Y1, M_XMID, M_H, M_Y2, M_PART_R, M_IDS, M_RW, M_ACTE, M_HPART,
 M_EPART, M_DPART, M_ACT_CTA, M_HDR, M_SITE_XO, M_SITE_XD, M_NPART1, M_NPART2, M_NRPART,
 M_ACT_FOLD) = (tl.constexpr(_META[n])
                                                                      for n in COMMON_ROWS + COMMON_SCALARS)
(B_HP1, B_AIN, B_O, B_HP2, B_A, B_H, B_RL, B_XE, B_HG, B_SEL, B_DP, B_CF1,
 B_CF2) = (tl.constexpr(i) for i in range(len(COMMON_BOXES)))


# ---------------------------------------------------------------------------- hand-off helpers
@triton.jit
def box_at(scratch, meta, b):
    m = meta + BOX_BASE + 4 * b
    return scratch + const_word(m), const_word(m + 1), const_word(m + 2), const_word(m + 3)


@triton.jit
def runtime_i32(v):
    """v as a runtime i32 scalar. A noinline function called with a constexpr argument is compiled once per value
    (the kda kernel held 15 copies of the ~200-instruction wait spin, one per box index, and two of the gate and
    coef tasks); called with a runtime value, once. Code a task runs that is not in its SM's instruction cache
    costs ~6 cycles an instruction to fetch (H200: the route's top-k, bench/RESULTS.md step 23), so every copy
    the SM's cache must hold beside the others is paid for on the critical path."""
    return v + tl.zeros([], tl.int32)


@triton.jit(noinline=True)
def _wait_box(scratch, meta, b, pid, tag, hdr, timeout_ns):
    box, words, nprod, site = box_at(scratch, meta, b)
    return wait_box(box, pid, words, nprod, tag, hdr, site, pid, timeout_ns)


# Code warming (on unless GLM53_WARM_CODE=0 when this module is imported). A task's code that is not in its SM's
# instruction cache costs ~6 cycles an instruction to fetch (H200, bench/RESULTS.md steps 23-24), and a task
# runs once per launch on its CTA, so its whole body is cold, on the critical path, right after its wait. A family
# whose body is safe to run twice calls it (one noinline function, so both calls run the same code) once before
# waiting, on whatever its inputs hold then: the fetch happens while the CTA would only spin. Safe means: the
# body's addresses do not depend on the awaited data (or are clamped), it writes no tagged pairs, no persistent
# state in place and nothing it reads, and every word it writes is written again by the real call before the
# signal (consumers read only after the signal); or, where an address or a store would depend on the awaited data,
# the body takes a live flag that masks those loads / stores off in the dry run. The families that do: kda, kda_norm,
# the gate rows, the route, post1's hc_post, and the DSA families score, hist, select (its stores masked off),
# attend (its latent gathers masked off) and join (launches/sparse_layer.py). Worth it only where the dry run reads
# little or nothing on the critical path streams during its wait: the router's (144 tasks x 32 KB while in_proj and
# o_proj stream) and moe_down's (during the experts) cost 2-7 us a launch (bench/RESULTS.md steps 38, 40).
WARM_CODE: tl.constexpr = tl.constexpr(os.environ.get("GLM53_WARM_CODE", "1") != "0")


@triton.jit
def warm_before(ready, b):
    """Whether a task should run its body once before waiting on box b: WARM_CODE and this CTA has not passed b
    yet (a wait ahead hides the cold fetch; with b passed the dry run would only add time)."""
    return (((ready >> b) & 1) == 0) & WARM_CODE


@triton.jit
def waitb(scratch, meta, b, ready, pid, tag, hdr, timeout_ns):
    """Wait once per CTA for every producer of box b; ready: bit b set = this CTA already passed it.
    -> (ok, ready | ok << b). A wait's fence invalidates the SM's L1, so a meta word loaded after it is an
    L2 round trip on the task's critical path: families load the meta words they need before waitb."""
    ok = (ready >> b) & 1
    if ok == 0:
        ok = _wait_box(scratch, meta, runtime_i32(b), pid, tag, hdr, timeout_ns)
    return ok, ready | (ok << b)


@triton.jit(noinline=True)
def _wait_box2(scratch, meta, b1, b2, pid, tag, hdr, timeout_ns):
    box1, words1, nprod1, site1 = box_at(scratch, meta, b1)
    box2, words2, nprod2, site2 = box_at(scratch, meta, b2)
    return wait_box2(box1, words1, nprod1, site1, box2, words2, nprod2, site2, pid, tag, hdr, pid, timeout_ns)


@triton.jit
def waitb2(scratch, meta, b1, b2, ready, pid, tag, hdr, timeout_ns):
    """waitb for boxes b1 and b2 together: one spin when this CTA passed neither before (sync.device
    wait_box2), else waitb of the one left. -> (ok, ready with both bits set when ok)."""
    if ((ready >> b1) & 1) != 0:
        ok, ready = waitb(scratch, meta, b2, ready, pid, tag, hdr, timeout_ns)
    elif ((ready >> b2) & 1) != 0:
        ok, ready = waitb(scratch, meta, b1, ready, pid, tag, hdr, timeout_ns)
    else:
        ok = _wait_box2(scratch, meta, runtime_i32(b1), runtime_i32(b2), pid, tag, hdr, timeout_ns)
        ready = ready | (ok << b1) | (ok << b2)
    return ok, ready


@triton.jit
def task_entry(table, i):
    """Task i of the table (8 int32 words: family, stage, a0 .. a4, pad)."""
    t = table + i * 8
    return (const_word(t), const_word(t + 1), const_word(t + 2), const_word(t + 3), const_word(t + 4),
            const_word(t + 5), const_word(t + 6))


@triton.jit
def sig_words(scratch, meta, b):
    """(box base, words per consumer line, site) of box b: what a signal of b needs, loaded where a task starts,
    before its wait. Loaded at the signal, they were three dependent loads after the wait's fence (the site
    decides the fault branch, then the offset, then the line width) right before the release fence; mostly L1
    hits after all: -0.5 to -3 us a launch (H200, bench/RESULTS.md step 20)."""
    box, words, _, site = box_at(scratch, meta, b)
    return box, words, site


@triton.jit(noinline=True)
def _signal_at(box, words, site, producer, tag, fault_site):
    signal_box(box, tl.num_programs(0), words, producer, tag, site, fault_site, 128)


@triton.jit
def signal_at(box, words, site, producer, tag, fault_site):
    """Producer `producer` signals the box whose sig_words are (box, words, site). One compiled copy for every
    family (noinline, runtime producer: runtime_i32): the ~75 instructions of the barrier, fence and store loop
    stay in the SM's instruction cache from one task's signal to the next instead of one cold copy a family."""
    _signal_at(box, words, site, runtime_i32(producer), tag, fault_site)


@triton.jit
def signal(scratch, meta, b, producer, tag, fault_site):
    """signal_at with box b's words loaded here (for a task with no wait, or one whose work hides them)."""
    box, words, site = sig_words(scratch, meta, b)
    signal_at(box, words, site, producer, tag, fault_site)


@triton.jit
def region_off(meta, m):
    """Meta word m, a region offset in elements of the region's dtype. Every region starts on a 128-byte
    line (layout/plan.py), so the offset is a multiple of 16 elements for any dtype of <= 8 bytes; the
    shift pair says so to the alignment analysis (tl.multiple_of is lost on scalars). Without it an
    activation row's address was only known 2-byte aligned: the GEMV K loop loaded x with scalar
    synchronous loads in every step instead of 16-byte cp.async copies in the weights' pipeline."""
    return (const_word(meta + m) >> 4) << 4


@triton.jit
def f32_at(scratch, meta, m):
    return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + region_off(meta, m)


@triton.jit
def i32_at(scratch, meta, m):
    return scratch + region_off(meta, m)


@triton.jit
def act_at(scratch, meta, m, ACT_F32: tl.constexpr):
    """A hand-off row region in the activation dtype (bf16; fp32 for diagnostics)."""
    if ACT_F32:
        return scratch.to(tl.pointer_type(tl.float32), bitcast=True) + region_off(meta, m)
    else:
        return scratch.to(tl.pointer_type(tl.bfloat16), bitcast=True) + region_off(meta, m)


# ---------------------------------------------------------------------------- compute pieces
# GLM53_L2_PREFETCH=0 drops the tasks' L2 prefetches before their waits (A/B on one tree: how much the burst of
# prefetches at a stage's start delays the critical path's own loads and polls behind it)
L2_PREFETCH: tl.constexpr = tl.constexpr(os.environ.get("GLM53_L2_PREFETCH", "1") != "0")


@triton.jit
def l2_prefetch_rows(W, n0, N, K: tl.constexpr, BLOCK_N: tl.constexpr):
    """prefetch.global.L2 of the first 512 bytes of rows n0 .. n0 + BLOCK_N - 1 (< N) of W [N, K]: a task
    moves its first tile toward L2 before it waits, holding no registers across the wait (a register
    prefetch held 32-64 registers per thread across the wait and the loops; launches/tail.py)."""
    EPL: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth      # elements per 128-byte line
    if L2_PREFETCH:
        _l2_prefetch(W, n0, N, K, BLOCK_N, 4, EPL)


@triton.jit(noinline=True)
def gemv_tile(W, S, x, stride_x, n0, k0, k1, rows, width, src, n_src, n_dest, y, stride_y, xchg, tag, site,
              fault_site, N: tl.constexpr, K: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr, XCHG: tl.constexpr):
    """One GEMV tile y[r, n0:n0 + BLOCK_N] = W[n0:, k0:k1] @ x[r, k0:k1] (x rows of stride_x, y fp32 rows of
    stride_y; a K slice of a split-K stage writes its own partial plane); XCHG and n_src > 1: published as
    source src to the exchange slots of n_dest ranks instead (xchg_publish: TP ranks, or split-K slices
    that the rank sum joins). A call: the tile loop around it keeps no hoisted index tensors of the K loop
    live."""
    acc = gemv_stream(W, S, x, stride_x, rows, n0, k0, k1, N, K, ROWS_PAD, BLOCK_N, BLOCK_K, NUM_STAGES)
    if XCHG:
        if n_src == 1:
            gemv_store(y, stride_y, acc, rows, n0, N, ROWS_PAD, BLOCK_N)
        else:
            xchg_publish(xchg, acc, n0, rows, width, src, n_src, n_dest, tag, site, fault_site, N, ROWS_PAD, BLOCK_N)
    else:
        gemv_store(y, stride_y, acc, rows, n0, N, ROWS_PAD, BLOCK_N)


@triton.jit
def post_cols(X, y, coef, X_out, rows, c0, c1, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """X_out[r, i, c] = post[i] y[r, c] + sum_j comb[j, i] X[r, j, c] for columns [c0, c1), rows < rows;
    post / comb from the coefficient rows coef [rows, 24] (hc_store_coef's layout)."""
    i4 = tl.arange(0, 4)
    r = 0
    while r < rows:
        post = tl.load(coef + r * 24 + 4 + i4, cache_modifier=".cg")
        comb = tl.load(coef + r * 24 + 8 + i4[:, None] * 4 + i4[None, :], cache_modifier=".cg")
        c = c0
        while c < c1:
            hc_post_tile(X + r * 4 * H, y + r * H, X_out + r * 4 * H, c, H, post, comb, BLOCK_N)
            c += BLOCK_N
        r += 1


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


@triton.jit(noinline=True)
def post_partials(fn2, X, y1, coef1, xmid, part2, rows, t0, nt, H: tl.constexpr, ROWS_PAD: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """hc_post of the mixer on column tiles t0 .. t0 + nt - 1 (X -> xmid) fused with the FFN hc_pre
    partials, one slot per BLOCK_N tile: the join order (tile order) does not depend on the grid. noinline:
    post1_task runs it once before its waits too (WARM_CODE), and oproj_task (TP 1) shares the copy."""
    j = 0
    while j < nt:
        c0 = (t0 + j) * BLOCK_N
        wf = hc_partial_prefetch(fn2, c0, c0 + BLOCK_N, H, BLOCK_C)
        hc_post_partial(wf, fn2, X, y1, H, coef1, 24, xmid, 4 * H, part2 + (t0 + j) * ROWS_PAD * SLOT_W, SLOT_W, rows,
                        c0, c0 + BLOCK_N, H, ROWS_PAD, BLOCK_C)
        j += 1


# ---------------------------------------------------------------------------- task families
@triton.jit(noinline=True)
def hc_pre_task(xs, fn1, tokens, embed_w, scratch, meta, rows, a0, a1, a2, a3, a4, tag, fault_site, H: tl.constexpr,
                ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, EMBED: tl.constexpr):
    """part: hc_pre partial slots of column tiles a0 .. a0 + a1 - 1 of the streams xs, rows a3 .. a3 + a4 - 1
    (those below `rows`), producer a2 of hp1, which it signals whatever its rows. A row's sums do not depend
    on the other rows (hc_partial_finish), so the rows split over tasks: the (chunk, row) walk took 10-12 us
    at 8 rows against ~5 at 1 row, first on every launch's path (H100 traces). EMBED: the task first gathers
    its columns of its rows' embedding rows into xs (x0)."""
    part1 = f32_at(scratch, meta, M_PART1) + a3 * SLOT_W
    sb, sw, ss = sig_words(scratch, meta, B_HP1)
    nr = tl.maximum(tl.minimum(a4, rows - a3), 0)
    xr = xs + a3 * (4 * H)                                              # streams [rows, 4, H]
    j = 0
    while (j < a1) & (nr > 0):
        c0 = (a0 + j) * BLOCK_N
        w0 = hc_partial_prefetch(fn1, c0, c0 + BLOCK_N, H, BLOCK_C)
        if EMBED:
            embed_gather(tokens + a3, embed_w, xr, nr, c0, c0 + BLOCK_N, H, BLOCK_C)
            tl.debug_barrier()                 # own warps' x0 stores before the partial reads
        hc_partial_finish(w0, fn1, xr, 4 * H, part1 + (a0 + j) * ROWS_PAD * SLOT_W, SLOT_W, nr, c0, c0 + BLOCK_N,
                          H, ROWS_PAD, BLOCK_C)
        j += 1
    trace_mark(scratch + const_word(meta + M_HDR), tl.program_id(0), 1)      # the partial slots are stored
    signal_at(sb, sw, ss, a2, tag, fault_site)


@triton.jit
def _pick(second, first_v, second_v):
    """first_v or second_v by a runtime flag (0 / 1), as arithmetic: one compiled copy serves both mHCs."""
    return first_v + second * (second_v - first_v)


@triton.jit
def _hc_slots(scratch, meta, second):
    """(hc_pre partial slots, their count, coefficient rows) of the mixer's mHC, or with second (1) the FFN's."""
    part = f32_at(scratch, meta, _pick(second, M_PART1, M_PART2))
    n_parts = const_word(meta + _pick(second, M_NPART1, M_NPART2))
    return part, n_parts, f32_at(scratch, meta, _pick(second, M_COEF1, M_COEF2))


@triton.jit(noinline=True)
def gate_task(xs, base, scale, ln, scratch, meta, rows, a0, a1, a2, rdy, pid, tag, hdr, timeout_ns, fault_site, eps,
              hc_eps, second, H: tl.constexpr, ROWS_PAD: tl.constexpr, GATE_BH: tl.constexpr,
              ACT_F32: tl.constexpr):
    """gate1 (second 0: waits hp1, writes a_in) or gate2 (second 1: waits hp2, writes a; a runtime flag:
    runtime_i32): columns [a0, a0 + GATE_BH) of row a2's gate row from the streams xs, producer a1. One task
    per (row, column tile): rows run in parallel, not one after another. -> (ok, rdy)."""
    part, n_parts, _ = _hc_slots(scratch, meta, second)               # meta words before the wait (waitb)
    out = act_at(scratch, meta, _pick(second, M_AIN, M_A), ACT_F32)
    sb, sw, ss = sig_words(scratch, meta, _pick(second, B_AIN, B_A))
    b_in = _pick(second, B_HP1, B_HP2)
    if warm_before(rdy, b_in):                                          # the row's code, warm (WARM_CODE)
        gate_row(xs, part, n_parts, base, scale, ln, out, a2, rows, a0, eps, hc_eps, hdr, pid, H, ROWS_PAD, GATE_BH)
    ok, rdy = waitb(scratch, meta, b_in, rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        gate_row(xs, part, n_parts, base, scale, ln, out, a2, rows, a0, eps, hc_eps, hdr, pid, H, ROWS_PAD, GATE_BH)
        signal_at(sb, sw, ss, a1, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def coef_task(base, scale, scratch, meta, rows, a0, a1, rdy, pid, tag, hdr, timeout_ns, fault_site, eps, hc_eps,
              second, H: tl.constexpr, ROWS_PAD: tl.constexpr, ITERS: tl.constexpr):
    """coef1 (second 0: waits hp1 -> coef1, box cf1) or coef2 (second 1: hp2 -> coef2, cf2): row a0's mHC
    coefficients with the Sinkhorn, producer a1. Beside the gate tasks, on a CTA of its own: only hc_post
    needs post / comb, a few stages later (it waits on cf1 / cf2), so the Sinkhorn (~5 us traced on the
    H200) is off the gate row's critical path. -> (ok, rdy)."""
    part, n_parts, coef = _hc_slots(scratch, meta, second)            # meta words before the wait (waitb)
    sb, sw, ss = sig_words(scratch, meta, _pick(second, B_CF1, B_CF2))
    ok, rdy = waitb(scratch, meta, _pick(second, B_HP1, B_HP2), rdy, pid, tag, hdr, timeout_ns)
    if ok != 0:
        coef_row(part, n_parts, base, scale, coef, a0, rows, eps, hc_eps, H, ROWS_PAD, ITERS)
        signal_at(sb, sw, ss, a1, tag, fault_site)
    return ok, rdy


@triton.jit
def _post_rows(scratch, meta):
    """The rows _post_mixer reads and writes (y1, coef1, xmid, part2), formed before the caller's waits (waitb)."""
    return (f32_at(scratch, meta, M_Y1), f32_at(scratch, meta, M_COEF1), f32_at(scratch, meta, M_XMID),
            f32_at(scratch, meta, M_PART2))


@triton.jit
def _post_mixer(xs, fn2, y1, coef1, xmid, part2, rows, a0, a1, a2, tag, fault_site, sb, sw, ss, H: tl.constexpr,
                ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NEXTN: tl.constexpr):
    """After the mixer's output tiles a0 .. a0 + a1 - 1 (y1) are complete: hc_post (xs -> xmid) fused with
    the FFN hc_pre partials; NEXTN: xmid = x0 + y1 (xs is x0). Signals hp2 (producer a2). The rows (_post_rows)
    and sb, sw, ss (hp2's sig_words) come from the caller, loaded before its waits."""
    tl.debug_barrier()                         # own warps' y1 stores before hc_post reads them
    if NEXTN:
        add_cols(xs, y1, xmid, rows, a0 * BLOCK_N, tl.minimum((a0 + a1) * BLOCK_N, H), H, BLOCK_N)
    else:
        post_partials(fn2, xs, y1, coef1, xmid, part2, rows, a0, a1, H, ROWS_PAD, BLOCK_N, BLOCK_C)
    signal_at(sb, sw, ss, a2, tag, fault_site)


@triton.jit(noinline=True)
def oproj_task(W_o, S_o, xs, fn2, xo, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, a3, rdy, pid, tag,
               hdr, timeout_ns, fault_site, H: tl.constexpr, D: tl.constexpr, ROWS_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr,
               BLOCK_C: tl.constexpr, ACT_F32: tl.constexpr, NEXTN: tl.constexpr, KS_O: tl.constexpr):
    """o_proj tiles a0 .. a0 + a1 - 1, K slice a3 of KS_O, after the o wait, producer a2. TP 1 and one
    slice: y1, then the tile range's hc_post (_post_mixer). Otherwise the partial tiles go to the xo
    slots as source (rank, slice) (xchg_publish), which the o_sum tasks add up in source order. -> (ok, rdy)."""
    KL: tl.constexpr = D // KS_O
    k0 = a3 * KL
    l2_prefetch_rows(W_o + k0, a0 * BLOCK_N, H, D, BLOCK_N)             # weights before the wait
    x = act_at(scratch, meta, M_ON, ACT_F32)                            # meta words too (see waitb)
    y = f32_at(scratch, meta, M_Y1)
    site = const_word(meta + M_SITE_XO)
    sb, sw, ss = sig_words(scratch, meta, B_HP2)                        # TP 1: _post_mixer's signal, rows
    _, coef1, xmid, part2 = _post_rows(scratch, meta)
    ok, rdy = waitb(scratch, meta, B_O, rdy, pid, tag, hdr, timeout_ns)
    j = 0
    while (j < a1) & (ok != 0):
        gemv_tile(W_o, S_o, x, D, (a0 + j) * BLOCK_N, k0, k0 + KL, rows, width, tp_rank * KS_O + a3,
                  tp_size * KS_O, tp_size, y, H, xo, tag, site, fault_site, H, D, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K,
                  NUM_STAGES, True)
        j += 1
    if (ok != 0) & (tp_size * KS_O == 1):
        if not NEXTN:
            ok, rdy = waitb(scratch, meta, B_CF1, rdy, pid, tag, hdr, timeout_ns)     # hc_post's coefficients
        if ok != 0:
            _post_mixer(xs, fn2, y, coef1, xmid, part2, rows, a0, a1, a2, tag, fault_site, sb, sw, ss, H, ROWS_PAD,
                        BLOCK_N, BLOCK_C, NEXTN)
    return ok, rdy


@triton.jit
def _rank_sum_tiles(xchg, y, a0, a1, rows, width, dest, n_src, tag, hdr, site, pid, timeout_ns,
                    H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tiles a0 .. a0 + a1 - 1 of y [rows, H] = the n_src sources' partials in dest's slots of mailbox xchg,
    added in source order (mixer_kda.xchg_sum), stopping at the first stalled tile. -> ok."""
    ok = 1
    j = 0
    while (j < a1) & (ok != 0):
        ok = xchg_sum(xchg, y, (a0 + j) * BLOCK_N, rows, width, dest, n_src, tag, hdr, site, pid, timeout_ns, H,
                      ROWS_PAD, BLOCK_N)
        j += 1
    return ok


@triton.jit(noinline=True)
def post1_task(xs, fn2, xo, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, a3, a4, rdy, pid, tag, hdr,
               timeout_ns, fault_site, H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_C: tl.constexpr, NEXTN: tl.constexpr, KS_O: tl.constexpr):
    """o_sum (TP > 1, or o_proj in KS_O > 1 K slices): rows a3 .. a3 + a4 - 1 (those below `rows`) of tiles
    a0 .. a0 + a1 - 1: the source-order sum of their xo partials (rank-major, then K slice) -> y1, then as
    oproj_task (the cf1 wait first: it comes before this rank's xd, so a stall there starves every rank);
    producer a2 of hp2, which it signals whatever its rows. -> (ok, rdy)."""
    sb, sw, ss = sig_words(scratch, meta, B_HP2)                        # before the waits, as the rows (waitb)
    y1, coef1, xmid, part2 = _post_rows(scratch, meta)
    RS: tl.constexpr = H if NEXTN else 4 * H                            # row stride of xs and xmid
    nr = tl.maximum(tl.minimum(a4, rows - a3), 0)
    xs, y1, coef1, xmid, part2 = xs + a3 * RS, y1 + a3 * H, coef1 + a3 * 24, xmid + a3 * RS, part2 + a3 * SLOT_W
    site = const_word(meta + M_SITE_XO)
    if WARM_CODE:
        if not NEXTN:               # hc_post's code, warm (WARM_CODE): the rank sum's poll below is the long wait
            if nr > 0:
                post_partials(fn2, xs, y1, coef1, xmid, part2, nr, a0, a1, H, ROWS_PAD, BLOCK_N, BLOCK_C)
    if not NEXTN:
        ok, rdy = waitb(scratch, meta, B_CF1, rdy, pid, tag, hdr, timeout_ns)         # hc_post's coefficients
    else:
        ok = 1
    if ok != 0:
        ok = _rank_sum_tiles(xo + a3 * H, y1, a0, a1, nr, width, tp_rank, tp_size * KS_O, tag, hdr, site, pid,
                             timeout_ns, H, ROWS_PAD, BLOCK_N)
    trace_mark(hdr, pid, 1)                                          # the rank sums are stored
    if ok != 0:
        if nr > 0:
            _post_mixer(xs, fn2, y1, coef1, xmid, part2, nr, a0, a1, a2, tag, fault_site, sb, sw, ss, H, ROWS_PAD,
                        BLOCK_N, BLOCK_C, NEXTN)
        else:                       # a row past the launch's rows: nothing to add, the box still counts it
            signal_at(sb, sw, ss, a2, tag, fault_site)
    return ok, rdy


@triton.jit(noinline=True)
def peer_task(xchg, peer, scratch, meta, rows, width, tp_rank, tp_size, a0, a1, a2, tag, fault_site, m_site,
              H: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Loopback (one GPU, TP > 1): rank a0's partial tiles a1 .. a1 + a2 - 1 from peer into xchg; m_site: the meta
    word of the exchange's wait site (a runtime value: peer_o and peer_d run one compiled copy, runtime_i32)."""
    j = 0
    while j < a2:
        peer_publish(xchg, peer, a0, (a1 + j) * BLOCK_N, rows, width, tp_rank, tp_size, tag, const_word(meta + m_site),
                     fault_site, H, ROWS_PAD, BLOCK_N)
        j += 1
