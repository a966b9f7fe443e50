"""Device side of the hand-off protocols (DESIGN.md §4): launch tags, guarded waits, publishes.

Every function here is a `@triton.jit` device function with one compiled form (inline PTX from
`sync.asm`) and one interpreter form (`tl.atomic_*`), chosen at compile time by `in_interpreter()`.

Uniformity rule: every value that steers control flow containing a CTA barrier must be the same in
all threads. A thread-0 spin produces a per-thread value, so after it the CTA re-derives the outcome
with reductions (`tl.sum`/`tl.max`, whose result every thread shares) or with scalar atomics (thread 0
executes, the result is broadcast through shared memory).

Guarded waits: each wait has a numbered site. It spins until satisfied, until the launch-wide abort
word carries this launch's tag, or until `budget_ns` of %globaltimer pass. On failure it records
{site, cta, wanted, seen} (first writer of the launch wins) and sets abort; it returns ok=0 and the
caller's CTA skips its remaining tasks. Under the interpreter programs run one after another, so a
wait that is not satisfied at once can never be: the budget is zero and the error is recorded at once.
"""
import os

import triton
import triton.language as tl

from .asm import (SIGNAL_WARP0_PTX, SPIN2_CHUNKS_PTX, SPIN2_WARP0_PTX, SPIN_CHUNKS_PTX, SPIN_WARP0_PTX, clock64,
                  cta_any, fence_acquire, fence_release, globaltimer, grid_dep_launch, grid_dep_wait, in_interpreter,
                  ld_const_u32, ld_relaxed_u32, ld_relaxed_u64, signal_warp0, smid, spin2_lines_warp0,
                  spin_lines_warp0, st_relaxed_u32, st_relaxed_u64)
from .header import H_ABORT, H_DONE, H_EPOCH, H_ERR, H_LAST_TAG, H_WAIT_CLK

TAG_MASK: tl.constexpr = tl.constexpr(0xFFFFFFFF)
# where a CTA lets the stream's next kernel start under PDL (launch_begin): "start" or "end"; read at import,
# a compile-time choice
_TRIGGER = os.environ.get("GLM53_PDL_TRIGGER", "end")
if _TRIGGER not in ("start", "end"):
    raise ValueError(f"GLM53_PDL_TRIGGER={_TRIGGER!r} must be start or end")
PDL_TRIGGER_END: tl.constexpr = tl.constexpr(_TRIGGER == "end")
# launch-constant words (meta, task table) through the read-only path (const_word); GLM53_META_NC=0 reads them with
# plain loads, for an A/B on one tree (a compile-time choice, read at import)
META_NC: tl.constexpr = tl.constexpr(os.environ.get("GLM53_META_NC", "1") != "0")
# the box spins' polls: "chunks" (16 bytes a lane, sync.asm _spin_chunks_ptx: one load a lane up to 128 producers,
# whatever registers ptxas leaves the wait; H100 kda TP8 1 row -1.8 us against lines in four pairs, sparse / dense
# within noise, bench/RESULTS.md tenth session) or "lines" (a 128-byte line a lane, 8 loads: the A/B); read at import
_SPIN = os.environ.get("GLM53_SPIN", "chunks")
if _SPIN not in ("lines", "chunks"):
    raise ValueError(f"GLM53_SPIN={_SPIN!r} must be lines or chunks")
SPIN_CHUNKS: tl.constexpr = tl.constexpr(_SPIN == "chunks")
# launch_begin's two header words in one round trip (1, launch_begin LOADS) or one after the other (0: the A/B); read
# at import
BEGIN_LOADS: tl.constexpr = tl.constexpr(os.environ.get("GLM53_BEGIN_LOADS", "1") != "0")


# The switch is read in the spins' bodies, never as a default argument: Triton's cache key hashes the globals a
# function body uses, not the values of default arguments (a `CHUNKS: tl.constexpr = SPIN_CHUNKS` default gave the
# chunked and the line builds one cache key, offline, 2026-12-06).
@triton.jit
def _spin1(block, n_prod, tag, abort_ptr, budget_ns, pin, POLLS: tl.constexpr):
    # POLLS: 0 = GLM53_SPIN's choice, 1 = chunks, 2 = lines
    if (POLLS == 1) or ((POLLS == 0) and SPIN_CHUNKS):
        return spin_lines_warp0(block, n_prod, tag, abort_ptr, budget_ns, pin, SPIN_CHUNKS_PTX)
    else:
        return spin_lines_warp0(block, n_prod, tag, abort_ptr, budget_ns, pin, SPIN_WARP0_PTX)


@triton.jit
def _spin2(block1, n_prod1, block2, n_prod2, tag, abort_ptr, budget_ns, pin, POLLS: tl.constexpr):
    if (POLLS == 1) or ((POLLS == 0) and SPIN_CHUNKS):
        return spin2_lines_warp0(block1, n_prod1, block2, n_prod2, tag, abort_ptr, budget_ns, pin, SPIN2_CHUNKS_PTX)
    else:
        return spin2_lines_warp0(block1, n_prod1, block2, n_prod2, tag, abort_ptr, budget_ns, pin, SPIN2_WARP0_PTX)


@triton.jit
def const_word(ptr):
    """A launch-constant int32 word (meta words, task-table entries, the task ranges, the header's WAIT_CLK: the host
    writes them before the launch, nothing in it does), through ld.global.nc (sync.asm.ld_const_u32): outside what
    a wait's fence orders, so ptxas may issue it early. The hope was to keep these words out of the L2 round
    trips that follow each fence (MEMBAR + CCTL.IVALL empties L1); measured neutral on the H200 (bench/RESULTS.md,
    wave 2 step 7), kept as the statement of what the words are."""
    if in_interpreter():
        return tl.load(ptr)
    elif META_NC:
        return ld_const_u32(ptr)
    else:
        return tl.load(ptr)


# ---------------------------------------------------------------------- launch begin / end
@triton.jit
def launch_begin(hdr, tag_stride, tag_offset, LOADS: tl.constexpr = True):
    """-> (tag, ok): this launch's tag from the device epoch; ok=0 if the launch already aborted
    (stage-by-stage CPU mode: a later stage of a failed launch does nothing).

    Programmatic Dependent Launch (launches/base.py launch_options): a launch's CTAs may start while the
    previous kernel of the stream still runs (as its CTAs leave the SMs), so everything before this call
    may read only what no earlier kernel writes (meta words, the task table, weights). Here each CTA waits
    for the previous kernel to complete: its header, inputs and scratch are then final and visible. It
    lets the next kernel start here, or with GLM53_PDL_TRIGGER=end in launch_end, once its tasks are done
    (early, the next kernel's CTAs take the SMs' free slots while this one runs). Without PDL both
    instructions return at once.

    LOADS (and GLM53_BEGIN_LOADS, default 1): the epoch and the abort word in one round trip, two relaxed loads
    every thread issues together. The tl.atomic_add(p, 0) reads they replace are lowered by Triton to a load by
    one thread (the epoch's ld.acquire: LDG.STRONG + CCTL.IVALL), broadcast through shared memory behind a
    barrier, one word after the other. The epoch needs no acquire: the previous
    kernel of the stream is complete and its writes visible here (stream order, or griddepcontrol.wait above),
    and nothing in this launch moves it before every CTA has read it. The tail passes LOADS=False: under its
    120-register cap the two words' registers made ptxas serialise its xn spin and spill (offline sm_90)."""
    if not in_interpreter():
        if not PDL_TRIGGER_END:
            grid_dep_launch()
        grid_dep_wait()
    if in_interpreter() or not (LOADS and BEGIN_LOADS):
        e = tl.atomic_add(hdr + H_EPOCH, 0, sem="acquire", scope="gpu")
        ab_first = 0
    else:
        e = ld_relaxed_u32(hdr + H_EPOCH)
        ab_first = ld_relaxed_u32(hdr + H_ABORT)
    tag = e * tag_stride + tag_offset + 1
    if tl.program_id(0) == 0:
        tl.store(hdr + H_LAST_TAG, tag)
    if in_interpreter() or not (LOADS and BEGIN_LOADS):
        ab = tl.atomic_add(hdr + H_ABORT, 0, sem="relaxed", scope="gpu")
    else:
        ab = ab_first
    return tag, (ab != tag).to(tl.int32)


@triton.jit
def launch_end(hdr, bump):
    """Every CTA calls this once, last. With `bump`, the last CTA to arrive advances the epoch."""
    if PDL_TRIGGER_END and not in_interpreter():
        grid_dep_launch()
    if bump != 0:
        tl.debug_barrier()          # every warp of this CTA is done with this launch's tag and words
        old = tl.atomic_add(hdr + H_DONE, 1, sem="acq_rel", scope="gpu")
        if old == tl.num_programs(0) - 1:
            # all CTAs have read the epoch (each read it before arriving): safe to move it on
            tl.atomic_xchg(hdr + H_DONE, 0, sem="relaxed", scope="gpu")
            tl.atomic_add(hdr + H_EPOCH, 1, sem="release", scope="gpu")


# ---------------------------------------------------------------------- error record
@triton.jit
def record_timeout(hdr, tag, site, cta, wanted, seen):
    """Set abort; the first writer of this launch fills the error record. Call with uniform args."""
    prev = tl.atomic_xchg(hdr + H_ABORT, tag, sem="acq_rel", scope="gpu")
    if prev != tag:
        tl.store(hdr + H_ERR + 1, site)
        tl.store(hdr + H_ERR + 2, cta)
        tl.store(hdr + H_ERR + 3, wanted)
        tl.store(hdr + H_ERR + 4, seen)
        # the record's tag goes last, with release, so a reader that sees the tag sees the fields
        tl.atomic_xchg(hdr + H_ERR, tag, sem="release", scope="gpu")


@triton.jit
def aborted(hdr, tag):
    """1 if some CTA of this launch has set abort (uniform)."""
    return (tl.atomic_add(hdr + H_ABORT, 0, sem="relaxed", scope="gpu") == tag).to(tl.int32)


# ---------------------------------------------------------------------- release side
@triton.jit
def release_cta():
    """Make every store this CTA made so far visible at gpu scope before the stores that follow:
    CTA barrier (other warps' stores happen-before), then a release fence in every thread."""
    tl.debug_barrier()
    if not in_interpreter():
        fence_release()


@triton.jit
def store_words(ptr, val, mask):
    """u32 flag stores that pollers read (relaxed, strong); caller has run release_cta()."""
    if in_interpreter():
        tl.atomic_xchg(ptr, val, mask=mask, sem="relaxed", scope="gpu")
    else:
        st_relaxed_u32(ptr, val, mask)


@triton.jit
def signal_box(box, n_cons, block_words, producer, tag, site, fault_site, BLOCK: tl.constexpr):
    """Producer `producer` writes `tag` into its word of all `n_cons` consumers' blocks.

    box: int32 base of the box region [consumers, block_words]. Everything the CTA stored before is
    released first (plain-row drain): a CTA barrier, then warp 0 alone fences and stores the words
    (sync.asm.signal_warp0; a fence in one warp after the barrier releases the whole CTA's stores, as in
    a cooperative-groups grid sync). Skipped entirely when `site == fault_site` (fault injection).
    """
    if site != fault_site:
        if not in_interpreter():
            tl.debug_barrier()      # the CTA's stores before warp 0's fence (one warp fences, not four)
            signal_warp0(box, n_cons, block_words, producer, tag, SIGNAL_WARP0_PTX)   # named here: in the cache key
        else:
            release_cta()
            c = 0
            while c < n_cons:
                offs = c + tl.arange(0, BLOCK)
                store_words(box + offs * block_words + producer, tl.zeros([BLOCK], tl.int32) + tag, offs < n_cons)
                c += BLOCK


@triton.jit
def pack_pairs(payload, tag):
    """int64 tagged pairs: payload (any 32-bit bits) in the high half, tag in the low half."""
    return (payload.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (tag.to(tl.int64) & TAG_MASK)


@triton.jit
def publish_pairs(ptr, payload, tag, mask, site, fault_site):
    """One 8-byte store per element (ptr: int64 pointers, payload: 32-bit values of the same shape).

    A pair proves itself, so no barrier or fence is needed for the pair's own payload."""
    if site != fault_site:
        w = pack_pairs(payload, tag)
        if in_interpreter():
            tl.atomic_xchg(ptr, w, mask=mask, sem="relaxed", scope="gpu")
        else:
            st_relaxed_u64(ptr, w, mask)


# ---------------------------------------------------------------------- acquire side
@triton.jit
def staggered_budget(budget_ns, site):
    """The spin budget of wait site `site`: budget * (1 + site / 16).

    Sites are numbered in schedule order, so a stalled hand-off's direct consumers wait at a lower
    site than the consumers further downstream, which stall only because of it. Every waiter starts
    at about the same time, so without the stagger whichever CTA's clock ran out first claimed the
    error record, often a downstream one (seen on the H200: a fault at dense.hp1 reported dense.a_in).
    With it the waiter at the stalled site times out first, records the site, and aborts the rest.

    In 64 bits: a budget under 2.147 s arrives as an i32 argument, and at 1 s the sum overflowed int32
    from site #19 on, into a negative budget that failed those waits at once (tests/test_sync.py)."""
    b = tl.full([], 0, tl.int64) + budget_ns
    return b + site * (b >> 4)


@triton.jit
def _load_pairs(ptr, mask):
    if in_interpreter():
        w = tl.atomic_add(ptr, tl.zeros(ptr.shape, tl.int64), mask=mask, sem="acquire", scope="gpu")
    else:
        w = ld_relaxed_u64(ptr, mask)
    return tl.where(mask, w, 0)


@triton.jit
def await_pairs(ptr, mask, tag, hdr, site, cta, budget_ns):
    """Wait until every masked pair word (1-D tensor of int64 pointers) carries `tag`.

    -> (payload int32 tensor (bits; bitcast as needed), ok). ok=0: timed out or the launch aborted."""
    budget_ns = staggered_budget(budget_ns, site)
    clk = const_word(hdr + H_WAIT_CLK)              # loaded before the polls
    w = _load_pairs(ptr, mask)
    pend = mask & ((w & TAG_MASK).to(tl.int32) != tag)
    if not in_interpreter():
        t0 = globaltimer()
        go = tl.max(pend.to(tl.int32), axis=0)
        while go == 1:
            ab = ld_relaxed_u32(hdr + H_ABORT)      # issued with the pair loads: one round trip per poll cycle
            w = _load_pairs(ptr, mask)
            pend = mask & ((w & TAG_MASK).to(tl.int32) != tag)
            stop = (ab == tag) | ((globaltimer() - t0) > budget_ns)
            # max over (pending | stop << 1): 1 <=> no thread wants to stop and some word is pending
            go = tl.max(pend.to(tl.int32) | (stop.to(tl.int32) * 2), axis=0)
        fence_acquire()             # relaxed polls + one fence = acquire for whatever the caller reads next
    npend = tl.sum(pend.to(tl.int32), axis=0)
    ok = (npend == 0).to(tl.int32)
    if npend != 0:
        idx = tl.arange(0, ptr.shape[0])
        first = tl.min(tl.where(pend, idx, ptr.shape[0]), axis=0)
        seen = tl.sum(tl.where(idx == first, (w & TAG_MASK).to(tl.int32), 0), axis=0)
        record_timeout(hdr, tag, site, cta, tag, seen)
    else:
        note_wait_end(hdr, clk, cta)
    return (w >> 32).to(tl.int32), ok


@triton.jit(noinline=True)
def _box_check(block, n_prod, tag, hdr, site, cta):
    """Re-read the first n_prod words of a box block -> ok (uniform); not ok: record the first stale word.
    The interpreter's whole wait; on the GPU only after a failed spin (abort or timeout)."""
    offs = tl.arange(0, 32)
    nbad = 0
    seen = 0
    line = 0
    while line * 32 < n_prod:
        m = line * 32 + offs < n_prod
        if in_interpreter():
            w = tl.atomic_add(block + line * 32 + offs, 0, mask=m, sem="acquire", scope="gpu")
        else:
            w = tl.load(block + line * 32 + offs, mask=m, other=0, cache_modifier=".cg")
        bad = m & (w != tag)
        nb = tl.sum(bad.to(tl.int32), axis=0)
        first = tl.min(tl.where(bad, offs, 32), axis=0)
        s = tl.sum(tl.where(offs == first, w, 0), axis=0)
        seen = tl.where(nbad == 0, s, seen)
        nbad += nb
        line += 1
    if not in_interpreter():
        # each warp loaded the words itself (a [32] tensor is replicated per warp) and counted them within the
        # warp, so a producer's store landing between two warps' loads gave warps different counts: the CTA's
        # outcome (any warp saw a stale word) before it steers barriers (record_timeout) and the task loop
        nbad = cta_any(nbad)
    ok = (nbad == 0).to(tl.int32)
    if nbad != 0:
        record_timeout(hdr, tag, site, cta, tag, seen)
    return ok


@triton.jit
def wait_box(box, consumer, block_words, n_prod, tag, hdr, site, cta, budget_ns, POLLS: tl.constexpr = 0):
    """Wait until the first `n_prod` words of block `consumer` of the box carry `tag` -> ok (uniform).
    `cta` (this CTA's id) only goes into the error record.

    POLLS: 0 = GLM53_SPIN's choice (chunked by default), 1 = chunked, 2 = line polls (the tail's wait: the
    chunked spin spilled under its 120-register cap).
    Warp 0 polls the block's 128-byte lines (a line per lane, relaxed vector loads; lane 0 loads the abort
    word in the same round trip; warp votes end the loop; one fence: sync.asm.spin_lines_warp0); then one
    reduction over the threads' outcomes, whose CTA barrier orders every thread after warp 0's acquire.
    Only a failed spin re-reads the words (to record the first stale one): before, every wait re-read
    them line after line, one L2 round trip per 32 producers (7-9 for the in_proj and expert boxes).
    scripts/bench_hop.py (H200, box ping-pong, 2 CTAs on two SMs, 256 producers): 1.93 us per hop before,
    1.54 us for the warp-0 spin alone, 1.77 us for this wait (the 0.24 us between: not explained yet)."""
    block = box + consumer * block_words
    budget_ns = staggered_budget(budget_ns, site)
    clk = const_word(hdr + H_WAIT_CLK)              # loaded before the spin (its pin)
    if in_interpreter():
        ok = _box_check(block, n_prod, tag, hdr, site, cta)
    else:
        live = _spin1(block, n_prod, tag, hdr + H_ABORT, budget_ns, clk, POLLS)  # warp 0: outcome; others 1
        # the CTA's outcome in every thread in one bar.red.or.pred, a CTA barrier that also orders every thread
        # after warp 0's fence. The tensor min it replaces went through shared memory with a predicated load,
        # whose register ptxas kept in local memory, reloaded (LDL) right after the fence's CCTL.IVALL (offline
        # sm_90 SASS). H200, kda / dense TP8 1 row: -9.0 / -3.9 us (bench/RESULTS.md "Wave 2, step 8").
        ok = 1 - cta_any(1 - live)
        if ok == 0:
            ok = _box_check(block, n_prod, tag, hdr, site, cta)
    if ok != 0:
        note_wait_end(hdr, clk, cta)
    return ok


@triton.jit
def wait_box2(box1, words1, n_prod1, site1, box2, words2, n_prod2, site2, consumer, tag, hdr, cta, budget_ns,
              POLLS: tl.constexpr = 0):
    """wait_box for two boxes a task needs together, in one spin (sync.asm.spin2_lines_warp0): one round trip
    per poll cycle and one fence for both, where two waits cost two of each (~1.5 us a wait, even when
    its box is long complete). The budget is the earlier site's (staggered_budget): a consumer of a stalled
    box still times out before its own consumers. After a failed spin the boxes are re-read in order and
    the first stale one is recorded at its site. -> ok (uniform)."""
    block1 = box1 + consumer * words1
    block2 = box2 + consumer * words2
    budget_ns = staggered_budget(budget_ns, tl.minimum(site1, site2))
    clk = const_word(hdr + H_WAIT_CLK)
    if in_interpreter():
        ok = _box_check(block1, n_prod1, tag, hdr, site1, cta)
        if ok != 0:
            ok = _box_check(block2, n_prod2, tag, hdr, site2, cta)
    else:
        live = _spin2(block1, n_prod1, block2, n_prod2, tag, hdr + H_ABORT, budget_ns, clk, POLLS)
        ok = 1 - cta_any(1 - live)
        if ok == 0:
            ok = _box_check(block1, n_prod1, tag, hdr, site1, cta)
            if ok != 0:
                ok = _box_check(block2, n_prod2, tag, hdr, site2, cta)
    if ok != 0:
        note_wait_end(hdr, clk, cta)
    return ok


# ---------------------------------------------------------------------- trace (where a launch's time goes)
@triton.jit
def trace_clock(i):
    """A trace timestamp: %globaltimer ns on the GPU. The interpreter has no clock; it stores i + 1, which
    keeps the CPU tests' checks (every traced row written, start <= end) meaningful."""
    if in_interpreter():
        return (i + 1).to(tl.int64)
    else:
        return globaltimer()


@triton.jit
def trace_cycles(i):
    """This SM's %clock64 (the interpreter: i + 1, as trace_clock)."""
    if in_interpreter():
        return (i + 1).to(tl.int64)
    else:
        return clock64()


@triton.jit
def note_wait_end(hdr, clk, cta):
    """Tracing (clk = the header's WAIT_CLK word, loaded before the wait, is not 0): store this CTA's cycle
    count into slot 0 of its clock slots, which the task's trace row reads at its end."""
    if clk != 0:
        tl.store((hdr + clk).to(tl.pointer_type(tl.int64), bitcast=True) + CLK_SLOTS * cta, trace_cycles(cta))


CLK_SLOTS: tl.constexpr = tl.constexpr(4)    # int64 clock slots per CTA: 0 the last wait's end, 1-3 marks
# Marks inside a task (trace_mark) are compiled in only with GLM53_TRACE_MARKS=1 in the environment when
# this module is imported: off, a mark is no code at all (not even the header load).
TRACE_MARKS: tl.constexpr = tl.constexpr(os.environ.get("GLM53_TRACE_MARKS", "") == "1")


@triton.jit
def trace_mark(hdr, cta, k: tl.constexpr):
    """Mark k (1-3) of the running task: this CTA's cycle count into its clock slot k, when tracing and
    TRACE_MARKS (launches/trace.py splits the task's own time at its marks)."""
    if TRACE_MARKS:
        tl.debug_barrier()                          # every warp has reached this point
        clk = const_word(hdr + H_WAIT_CLK)
        if clk != 0:
            tl.store((hdr + clk).to(tl.pointer_type(tl.int64), bitcast=True) + CLK_SLOTS * cta + k,
                     trace_cycles(cta))


@triton.jit
def trace_sm(i):
    """This CTA's SM (%smid) as int64; the interpreter has none: -1 (launches/trace.py then names no
    co-residents)."""
    if in_interpreter():
        return (i * 0 - 1).to(tl.int64)
    else:
        return smid().to(tl.int64)


@triton.jit
def trace_store(trace, row, t_start, c_start, hdr, pid, i):
    """Row `row` of the trace buffer [rows, 8] int64: (start ns, end ns, then in cycles from the start: the
    end of the task's last wait (0: it waited on nothing), the end, marks 1-3 (-1: not reached in this
    task), then the SM it ran on (-1: unknown)). Cycles are this SM's %clock64 (ns ticks about every microsecond; cycles do not):
    launches/trace.py converts them with the CTA's own cycles per ns."""
    t_end = trace_clock(i)
    c_end = trace_cycles(i)
    tl.debug_barrier()                              # thread 0's clock-slot stores before every thread's loads
    slots = (hdr + tl.load(hdr + H_WAIT_CLK)).to(tl.pointer_type(tl.int64), bitcast=True) + CLK_SLOTS * pid
    c_wait = tl.load(slots)
    tl.store(trace + 8 * row, t_start)
    tl.store(trace + 8 * row + 1, t_end)
    tl.store(trace + 8 * row + 2, tl.maximum(c_wait - c_start, 0))
    tl.store(trace + 8 * row + 3, c_end - c_start)
    for k in tl.static_range(1, 4):
        c = tl.load(slots + k)
        tl.store(trace + 8 * row + 3 + k, tl.where(c >= c_start, c - c_start, -1))
    tl.store(trace + 8 * row + 7, trace_sm(i))
    # the slots back to 0 (< any start): a later task without a wait or a mark must not read these, nor one of
    # the next launch, whose CTA may run on another SM with another %clock64 (a tail norm task showed a
    # "wait" of 8951 us)
    tl.debug_barrier()
    tl.store(slots + tl.arange(0, 4), tl.zeros([4], tl.int64))
