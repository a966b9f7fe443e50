"""Greedy sampling across CTAs and ranks: per-tile argmax, candidate mailboxes, fixed-order reduction.

A candidate is (value fp32, global vocab index int32) per row, rows padded to ROWS_PAD = 8 (the widest
build). Candidates are
compared by value, then by the lower index, a total order, so the reduction gives the same answer
in any order; it still runs in a fixed order (slot 0, 1, ...) and needs no float atomics.

Mailbox layout of one slot (16 int64 tagged pairs, 128 bytes: one line): words 0..7 hold the values'
bits of rows 0..7, words 8..15 their indices. Each word is one 8-byte store carrying its launch tag, so a
reader needs no flag: it re-reads until every word it needs carries the current tag (sync.device).
"""
import triton
import triton.language as tl

from sync.asm import fence_acquire, globaltimer, in_interpreter, ld_relaxed_u32
from sync.device import TAG_MASK, _load_pairs, publish_pairs, record_timeout
from sync.header import H_ABORT

ROWS_PAD: tl.constexpr = tl.constexpr(8)
SLOT_WORDS: tl.constexpr = tl.constexpr(16)
INT_MAX: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def tile_argmax(acc, n0, N, idx_off, BLOCK_N: tl.constexpr):
    """acc [BLOCK_N, ROWS_PAD] (acc[j, r] = logit of row r, column n0 + j; only columns < N count)
    -> (value [ROWS_PAD], index [ROWS_PAD]); index = idx_off + column, the lowest among equal maxima."""
    cols = n0 + tl.arange(0, BLOCK_N)
    a = tl.where((cols < N)[:, None], acc, float("-inf"))
    v = tl.max(a, axis=0)
    i = tl.min(tl.where(a == v[None, :], (cols + idx_off)[:, None], INT_MAX), axis=0)
    return v, i


@triton.jit
def argmax_merge(bv, bi, v, i):
    """Keep the better of two candidates per row: larger value, then lower index."""
    take = (v > bv) | ((v == bv) & (i < bi))
    return tl.where(take, v, bv), tl.where(take, i, bi)


@triton.jit
def empty_candidate(RP: tl.constexpr = ROWS_PAD):
    """A candidate that loses to any other, for RP rows."""
    return tl.full([RP], float("-inf"), tl.float32), tl.full([RP], INT_MAX, tl.int32)


@triton.jit
def publish_candidate(slot_ptr, bv, bi, rows, tag, site, fault_site):
    """Write one slot (int64 pointer) of tagged pairs for rows < rows."""
    r = tl.arange(0, ROWS_PAD)
    publish_pairs(slot_ptr + r, bv.to(tl.int32, bitcast=True), tag, r < rows, site, fault_site)
    publish_pairs(slot_ptr + ROWS_PAD + r, bi, tag, r < rows, site, fault_site)


@triton.jit
def _await_two(pv, pi, mask, tag, hdr, site, cta, budget_ns):
    """sync.device.await_pairs over two pointer tensors (a slot's values and indices) in one poll: both
    loads are in flight together, so a step costs one L2 round trip, not two. -> (vbits, ibits, ok)."""
    wv = _load_pairs(pv, mask)
    wi = _load_pairs(pi, mask)
    pend = mask & (((wv & TAG_MASK).to(tl.int32) != tag) | ((wi & TAG_MASK).to(tl.int32) != tag))
    if not in_interpreter():
        t0 = globaltimer()
        go = tl.max(pend.to(tl.int32), axis=0)
        while go == 1:
            wv = _load_pairs(pv, mask)
            wi = _load_pairs(pi, mask)
            pend = mask & (((wv & TAG_MASK).to(tl.int32) != tag) | ((wi & TAG_MASK).to(tl.int32) != tag))
            stop = (ld_relaxed_u32(hdr + H_ABORT) == tag) | ((globaltimer() - t0) > budget_ns)
            go = tl.max(pend.to(tl.int32) | (stop.to(tl.int32) * 2), axis=0)
        fence_acquire()
    npend = tl.sum(pend.to(tl.int32), axis=0)
    ok = (npend == 0).to(tl.int32)
    if npend != 0:
        idx = tl.arange(0, pv.shape[0])
        first = tl.min(tl.where(pend, idx, pv.shape[0]), axis=0)
        wbad = tl.where((wv & TAG_MASK).to(tl.int32) != tag, wv, wi)
        seen = tl.sum(tl.where(idx == first, (wbad & TAG_MASK).to(tl.int32), 0), axis=0)
        record_timeout(hdr, tag, site, cta, tag, seen)
    return (wv >> 32).to(tl.int32), (wi >> 32).to(tl.int32), ok


@triton.jit
def reduce_candidates(base_ptr, n_slots, rows, tag, hdr, site, cta, budget_ns, SLOTS: tl.constexpr,
                      RP: tl.constexpr = ROWS_PAD):
    """Wait for slots 0..n_slots-1 (int64 base pointer) and reduce them in slot order.

    -> (value [ROWS_PAD], index [ROWS_PAD], ok). SLOTS slots are awaited per step, rows 0..RP-1 of each (RP: a
    power of two >= the rows a launch is built for), values and indices in one poll: each step costs an L2
    round trip, and this runs in one CTA after its GEMVs, so the step count (n_slots / SLOTS) sits on the
    launch's critical path (SLOTS=16 and two polls per step took 66 round trips at 528 slots; SLOTS x RP
    words is the poll's register cost, so a 1-row build awaits 8x the slots of an 8-row one per step).
    The pick (larger value, then lower index) is a total order: how the slots are grouped into steps does
    not change the result."""
    bv, bi = empty_candidate(RP)
    ok = 1
    offs = tl.arange(0, SLOTS * RP)
    s0 = 0
    while (s0 < n_slots) & (ok != 0):
        s = s0 + offs // RP
        r = offs % RP
        m = (s < n_slots) & (r < rows)
        p = base_ptr + s * SLOT_WORDS + r
        vb, ib, ok = _await_two(p, p + ROWS_PAD, m, tag, hdr, site, cta, budget_ns)
        if ok != 0:
            v2 = tl.reshape(tl.where(m, vb.to(tl.float32, bitcast=True), float("-inf")), (SLOTS, RP))
            i2 = tl.reshape(tl.where(m, ib, INT_MAX), (SLOTS, RP))
            cv = tl.max(v2, axis=0)
            ci = tl.min(tl.where(v2 == cv[None, :], i2, INT_MAX), axis=0)
            bv, bi = argmax_merge(bv, bi, cv, ci)
        s0 += SLOTS
    if RP == ROWS_PAD:
        return bv, bi, ok
    else:                                       # rows RP .. ROWS_PAD - 1 as an empty candidate's
        eq = tl.arange(0, RP)[:, None] == tl.arange(0, ROWS_PAD)[None, :]
        return (tl.max(tl.where(eq, bv[:, None], float("-inf")), axis=0),
                tl.min(tl.where(eq, bi[:, None], INT_MAX), axis=0), ok)
