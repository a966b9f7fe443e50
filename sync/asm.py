"""Every inline-assembly instruction of the runtime, behind small `@triton.jit` helpers (NVIDIA PTX, sm_90).

Why one file: the memory-model details (acquire/relaxed/release, fences, the timer) are the only
architecture-specific code of the hand-off protocols; an AMD backend is one more file like this one.

Rules that every helper here follows (research/triton.md §0-§2):
- `is_pure=False` on every memory or timer access, or the compiler hoists/deletes it (a pure load
  inside a spin loop is removed and the loop never waits).
- A 0-d (scalar) asm runs in every thread of the CTA; callers that want "one thread" wrap it in
  `if tid_x() == 0:` and put nothing that emits `bar.sync` inside that branch.
- Tensor stores/loads take a mask as a predicate register, since inline asm has no mask argument.
- None of these run under TRITON_INTERPRET=1 (the interpreter raises on inline asm); callers branch on
  `in_interpreter()` and use `tl.atomic_*` there.
"""
import os

import triton
import triton.language as tl

# The two halves of a hand-off's ordering (PTX ISA 8.6+, sm_90; Triton 3.6 emits .version 8.7). fence.acq_rel.gpu is
# MEMBAR.ALL.GPU + CCTL.IVALL in the sm_90 SASS; fence.release.gpu is the MEMBAR alone and fence.acquire.gpu the
# CCTL.IVALL alone (offline, the bundled ptxas 12.8). A consumer after its relaxed polls needs only the acquire half
# (later loads see what the producers released; C++'s atomic_thread_fence(acquire) maps to it), a producer before its
# box words only the release half (cumulative: the CTA barrier before it brings the other warps' stores in). So a
# wait no longer waits for its own warp's outstanding memory operations (its L2 prefetches, issued just before), and
# a signal no longer empties its SM's L1 (the co-resident CTA's lines too). GLM53_SPLIT_FENCES=0: acq_rel on both
# sides (the A/B; read at import, a compile-time choice).
SPLIT_FENCES = os.environ.get("GLM53_SPLIT_FENCES", "1") != "0"
FENCE_ACQUIRE = "fence.acquire.gpu;" if SPLIT_FENCES else "fence.acq_rel.gpu;"
FENCE_RELEASE = "fence.release.gpu;" if SPLIT_FENCES else "fence.acq_rel.gpu;"
_FENCE_ACQUIRE_PTX: tl.constexpr = tl.constexpr(FENCE_ACQUIRE + "\nmov.u32 $0, 0;")
_FENCE_RELEASE_PTX: tl.constexpr = tl.constexpr(FENCE_RELEASE + "\nmov.u32 $0, 0;")

# The polls' loads as they appear in the PTX (the tests look for them). Relaxed, with one acquire fence after the
# spin: acquire polls (ld.acquire: LDG.STRONG + CCTL.IVALL per load, no MEMBAR) measured 9-10 us slower per layer
# launch (H200, kda / dense TP8; docs/DECISIONS.md, "acquire polls"): every poll cycle then empties the SM's L1.
SPIN_LINE_LOAD = "ld.relaxed.gpu.global.v4.u32"     # a box spin's line loads
PAIR_LOAD = "ld.relaxed.gpu.global.b64"             # a tagged-pair poll's loads


@triton.constexpr_function
def in_interpreter():
    """True under TRITON_INTERPRET=1, False when compiled (a compile-time constant either way)."""
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def cta_any(v):
    """1 in every thread of the CTA if any thread's v (int32) is nonzero, else 0: bar.red.or.pred, a CTA barrier and
    the reduction in one instruction (every thread of the CTA must reach it, as a barrier)."""
    return tl.inline_asm_elementwise("{\n.reg .pred %ap;\nsetp.ne.s32 %ap, $1, 0;\nbar.red.or.pred %ap, 0, %ap;\n"
                                     "selp.s32 $0, 1, 0, %ap;\n}", "=r,r", [v], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def tid_x():
    """This thread's %tid.x (used only for 'one thread does X' branches)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def globaltimer():
    """Nanosecond wall clock of the GPU (%globaltimer, int64; ticks about every microsecond)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def clock64():
    """This SM's cycle counter (%clock64): fine-grained durations inside one CTA (the trace's wait / work
    split); not comparable across SMs."""
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def smid():
    """The SM this CTA runs on (%smid): which CTAs of a persistent grid share an SM (the trace's co-residents)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def ld_relaxed_u32(ptr):
    """Strong (L2, no stale L1) relaxed 32-bit load at gpu scope."""
    return tl.inline_asm_elementwise("ld.relaxed.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def ld_const_u32(ptr):
    """A 32-bit word that nothing writes while the launch runs (meta words, the task table), through the
    non-coherent read-only path (ld.global.nc). ptxas does not order such loads after fences (a wait's
    acquire fence is CCTL.IVALL, which empties L1 for coherent loads), so it may issue them early;
    pure, so the compiler may also merge repeats. Not for anything another CTA or an earlier kernel of the
    launch's stream may still be writing."""
    return tl.inline_asm_elementwise("ld.global.nc.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=True,
                                     pack=1)


@triton.jit
def ld_acquire_u32(ptr):
    """Acquire 32-bit load at gpu scope (later loads of this thread cannot pass it)."""
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def ld_relaxed_u64(ptr, mask):
    """Relaxed 64-bit loads (one single-copy-atomic access per element); masked-off elements read 0."""
    return tl.inline_asm_elementwise(
        "{\n.reg .pred %pm;\nsetp.ne.b32 %pm, $2, 0;\nmov.b64 $0, 0;\n"
        "@%pm ld.relaxed.gpu.global.b64 $0, [$1];\n}",
        "=l,l,r", [ptr, mask.to(tl.int32)], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def st_relaxed_u64(ptr, val, mask):
    """Relaxed 64-bit stores: one 8-byte single-copy-atomic store per element (a tagged pair)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .pred %pm;\nsetp.ne.b32 %pm, $3, 0;\n@%pm st.relaxed.gpu.global.b64 [$1], $2;\nmov.u32 $0, 0;\n}",
        "=r,l,l,r", [ptr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def st_relaxed_u32(ptr, val, mask):
    """Relaxed 32-bit stores (box words); ordering comes from the fence the caller ran before."""
    return tl.inline_asm_elementwise(
        "{\n.reg .pred %pm;\nsetp.ne.b32 %pm, $3, 0;\n@%pm st.relaxed.gpu.global.u32 [$1], $2;\nmov.u32 $0, 0;\n}",
        "=r,l,r,r", [ptr, val, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_acq_rel():
    """fence.acq_rel.gpu in every calling thread: release for its earlier stores, acquire for later loads
    (scripts/bench_hop.py's old variants; the launches use the halves below)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def fence_acquire():
    """The acquire half (FENCE_ACQUIRE) in every calling thread: after relaxed loads that saw a release, later
    loads see what it released."""
    return tl.inline_asm_elementwise(_FENCE_ACQUIRE_PTX, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def fence_release():
    """The release half (FENCE_RELEASE) in every calling thread: its earlier stores (and those a CTA barrier
    ordered before it) become visible before its later stores."""
    return tl.inline_asm_elementwise(_FENCE_RELEASE_PTX, "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def grid_dep_launch():
    """griddepcontrol.launch_dependents: the next kernel of the stream, launched with Programmatic Dependent
    Launch, may start its CTAs as this grid's CTAs leave the SMs (no effect without PDL)."""
    return tl.inline_asm_elementwise("griddepcontrol.launch_dependents;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def grid_dep_wait():
    """griddepcontrol.wait: block until the stream's previous grid has completed and its memory is visible
    (returns at once without PDL)."""
    return tl.inline_asm_elementwise("griddepcontrol.wait;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


def line_loads_ptx(w: list[str], addr: str) -> list[str]:
    """PTX: the 128-byte box line at [addr] into the 32 registers w, as 8 independent 16-byte relaxed loads
    (they pipeline; acquire loads would serialise and each invalidate L1). A vector load is not atomic as a
    whole; that is fine, every word is checked on its own (line_match_ptx)."""
    return [f"{SPIN_LINE_LOAD} {{{', '.join(w[4 * v: 4 * v + 4])}}}, [{addr}+{16 * v}];" for v in range(8)]


def line_match_ptx(w: list[str], tag: str, acc: str, bit: str, pred: str) -> list[str]:
    """PTX: acc = the bitmask of the registers w that equal tag (bit i for w[i])."""
    a = [f"mov.u32 {acc}, 0;"]
    for i in range(32):
        a += [f"setp.eq.u32 {pred}, {w[i]}, {tag};", f"selp.u32 {bit}, {1 << i}, 0, {pred};",
              f"or.b32 {acc}, {acc}, {bit};"]
    return a


def _line_check_ptx(w: list[str], n_prod: str) -> list[str]:
    # after the line's loads: want = its words (n_prod - first, at most 32) -> a mask; the lane moves to its next
    # line (+ 32) once every wanted word carries the tag
    return (["sub.s32 %vwant, " + n_prod + ", %vfirst;",
             "setp.ge.s32 %vp2, %vwant, 32;",
             "shl.b32 %vm, 1, %vwant;",
             "sub.u32 %vm, %vm, 1;",
             "selp.b32 %vm, -1, %vm, %vp2;"]
            + line_match_ptx(w, "$3", "%vacc", "%vb", "%vp2")
            + ["and.b32 %vacc, %vacc, %vm;",
               "setp.eq.u32 %vp2, %vacc, %vm;",
               "@%vp2 add.u32 %vline, %vline, 32;"])


def _vote_end_ptx(fence: bool = True, timer: str = "%globaltimer") -> list[str]:
    # %vp1 = this lane is past its lines: all lanes past -> fence and leave; else lane 0's abort word or the
    # budget ends the spin (any lane: the warp leaves together, $0 = 0), or the next poll cycle.
    # fence=False / timer="%clock64" (budget in cycles): variants for scripts/bench_hop.py only (what the
    # fence and the timer read cost per hop); without the fence the spin is not an acquire.
    return ["vote.sync.all.pred %vp3, %vp1, 0xffffffff;",
            "@%vp3 bra VOTE_FENCE;",
            "setp.eq.u32 %vp4, %vab, $3;",                # lane 0: the launch aborted
            f"mov.u64 %vt1, {timer};",
            "sub.s64 %vt1, %vt1, %vt0;",
            "setp.gt.s64 %vp5, %vt1, $5;",                # out of time
            "or.pred %vp4, %vp4, %vp5;",
            "vote.sync.any.pred %vp4, %vp4, 0xffffffff;",
            "@!%vp4 bra VOTE_TOP;",
            "mov.u32 $0, 0;",
            "VOTE_FENCE:"] + ([FENCE_ACQUIRE] if fence else []) + [
            "VOTE_OUT:",
            "}"]


def _spin_warp0_ptx(fence: bool = True, timer: str = "%globaltimer") -> str:
    # Warp 0 polls, the other warps return at once (they wait at the caller's barrier). Lane l polls lines
    # l, l + 32, ... (one at a time, the next once the current one is complete); lane 0 alone loads the
    # abort word, in the same round trip as the lines; each cycle ends with two warp votes (every lane
    # past its lines / any lane out of time or aborted), so the warp leaves together and one abort load
    # per CTA per cycle reaches the abort word's L2 line (every polling thread of every CTA loaded it).
    # $0 live (out: warp 0 the outcome, others 1) | $1 block | $2 n_prod | $3 tag | $4 abort word | $5 budget
    # | $6 unused: a value loaded with the box's meta words, so its load is issued before the spin
    w = [f"%vw{i}" for i in range(32)]
    a = ["{", ".reg .pred %vp<7>;", f".reg .b32 {', '.join(w)};",
         ".reg .b32 %vtid, %vline, %vfirst, %vab, %vm, %vb, %vwant, %vacc;", ".reg .b64 %vt0, %vt1, %va;",
         "mov.u32 $0, 1;", "mov.u32 %vtid, %tid.x;",
         "setp.ge.u32 %vp0, %vtid, 32;",
         "@%vp0 bra VOTE_OUT;",
         f"mov.u64 %vt0, {timer};", "mov.u32 %vline, %vtid;", "setp.eq.u32 %vp6, %vtid, 0;",
         "VOTE_TOP:",
         "mov.u32 %vab, 0;",
         "@%vp6 ld.relaxed.gpu.global.u32 %vab, [$4];",
         "shl.b32 %vfirst, %vline, 5;",
         "setp.ge.s32 %vp1, %vfirst, $2;",
         "@%vp1 bra VOTE_JOIN;",
         "mul.wide.u32 %va, %vline, 128;",
         "add.u64 %va, %va, $1;"]
    a += line_loads_ptx(w, "%va") + _line_check_ptx(w, "$2")
    a += ["VOTE_JOIN:",
          "shl.b32 %vfirst, %vline, 5;",
          "setp.ge.s32 %vp1, %vfirst, $2;"]
    return "\n".join(a + _vote_end_ptx(fence, timer))


SPIN_WARP0_PTX: tl.constexpr = tl.constexpr(_spin_warp0_ptx())


def _spin2_warp0_ptx() -> str:
    # The spin of _spin_warp0_ptx over two blocks at once (two boxes a task needs together): their lines are
    # one list, block 1's first, so the boxes cost one round trip per poll cycle and one fence, not two
    # waits. Per line i: block 1 line i while i < n1 lines, else block 2 line i - n1.
    # $0 live | $1 block 1 | $2 n_prod 1 | $3 tag | $4 abort word | $5 budget | $6 pin | $7 block 2 | $8 n_prod 2
    w = [f"%vw{i}" for i in range(32)]

    def line_of(done_pred: str) -> list[str]:
        # %vloc = the line's index in its block, %vbase / %vnp = its block and producer count,
        # %vfirst = its first word; done_pred = no such line (past block 2's last)
        return ["setp.lt.u32 %vq, %vline, %vn1;",
                "sub.u32 %vloc, %vline, %vn1;",
                "selp.b32 %vloc, %vline, %vloc, %vq;",
                "selp.b64 %vbase, $1, $7, %vq;",
                "selp.b32 %vnp, $2, $8, %vq;",
                "shl.b32 %vfirst, %vloc, 5;",
                f"setp.ge.s32 {done_pred}, %vfirst, %vnp;"]

    a = ["{", ".reg .pred %vp<7>, %vq;", f".reg .b32 {', '.join(w)};",
         ".reg .b32 %vtid, %vline, %vfirst, %vab, %vm, %vb, %vwant, %vacc, %vn1, %vloc, %vnp;",
         ".reg .b64 %vt0, %vt1, %va, %vbase;",
         "mov.u32 $0, 1;", "mov.u32 %vtid, %tid.x;",
         "setp.ge.u32 %vp0, %vtid, 32;",
         "@%vp0 bra VOTE_OUT;",
         "add.s32 %vn1, $2, 31;", "shr.s32 %vn1, %vn1, 5;",       # lines of block 1
         "mov.u64 %vt0, %globaltimer;", "mov.u32 %vline, %vtid;", "setp.eq.u32 %vp6, %vtid, 0;",
         "VOTE_TOP:",
         "mov.u32 %vab, 0;",
         "@%vp6 ld.relaxed.gpu.global.u32 %vab, [$4];"]
    a += line_of("%vp1")
    a += ["@%vp1 bra VOTE_JOIN;",
          "mul.wide.u32 %va, %vloc, 128;",
          "add.u64 %va, %va, %vbase;"]
    a += line_loads_ptx(w, "%va") + _line_check_ptx(w, "%vnp")
    a += ["VOTE_JOIN:"] + line_of("%vp1")
    a += ["setp.lt.u32 %vq, %vline, %vn1;",             # a block-1 line is never past the end
          "and.pred %vp1, %vp1, !%vq;"]
    return "\n".join(a + _vote_end_ptx())


SPIN2_WARP0_PTX: tl.constexpr = tl.constexpr(_spin2_warp0_ptx())


# Chunked polls. A lane that polls a whole 128-byte line holds its 8 vector loads in 32 registers at once; where a
# noinline wait is also called with many registers live (any call site of a noinline function limits what the
# callee may use), ptxas gave all 8 loads the same 4 registers, so each line cost 8 dependent L2 round trips per
# poll cycle: the wait-in-loop build of 2026-12-06 (every hop 1-3 us longer, the whole launch +14 / +31 us, kda /
# sparse TP8; `python -m glm53_flash build --report` column "spins"). Here lane l polls 16-byte chunks
# l, l + 32, l + 64, l + 96 (4 words each; 512 producers) with one load each, then the next four once those
# match: a box of up to 128 producers is one load per lane whatever the register budget, up to 512 four
# independent loads. The default of the launches' waits (sync/device.py GLM53_SPIN).
CHUNKS_PER_CYCLE = 4


def _chunk_loads_checks(two: bool) -> list[str]:
    """PTX of one poll cycle of a lane at chunk %vcur: CHUNKS_PER_CYCLE loads (chunks %vcur + 32 k), then their
    checks, then %vcur advanced past the matched prefix. two: chunk ids run over block 1's chunks, then block 2's
    ($7 / $8)."""
    n = CHUNKS_PER_CYCLE
    a = []
    for k in range(n):
        a += [f"add.s32 %vk{k}, %vcur, {32 * k};",
              f"setp.lt.s32 %vv{k}, %vk{k}, %vnch;"]
        if two:
            a += [f"setp.lt.s32 %vq, %vk{k}, %vn1;",
                  f"sub.s32 %vloc{k}, %vk{k}, %vn1;",
                  f"selp.b32 %vloc{k}, %vk{k}, %vloc{k}, %vq;",
                  "selp.b64 %vbase, $1, $7, %vq;",
                  f"selp.b32 %vnp{k}, $2, $8, %vq;"]
        else:
            a += [f"mov.u32 %vloc{k}, %vk{k};", "mov.u64 %vbase, $1;", f"mov.u32 %vnp{k}, $2;"]
        regs = ", ".join(f"%vc{4 * k + j}" for j in range(4))
        a += [f"mul.wide.u32 %va, %vloc{k}, 16;",
              "add.u64 %va, %va, %vbase;",
              f"@%vv{k} {SPIN_LINE_LOAD} {{{regs}}}, [%va];"]
    for k in range(n):
        # wanted words of the chunk: np - 4 loc (at most 4) -> mask; a chunk past the end counts as matched
        a += [f"shl.b32 %vwant, %vloc{k}, 2;",
              f"sub.s32 %vwant, %vnp{k}, %vwant;",
              "setp.ge.s32 %vp2, %vwant, 4;",
              "shl.b32 %vm, 1, %vwant;",
              "sub.u32 %vm, %vm, 1;",
              "selp.b32 %vm, 15, %vm, %vp2;",
              "mov.u32 %vacc, 0;"]
        for j in range(4):
            a += [f"setp.eq.u32 %vp2, %vc{4 * k + j}, $3;", f"selp.u32 %vb, {1 << j}, 0, %vp2;",
                  "or.b32 %vacc, %vacc, %vb;"]
        a += ["and.b32 %vacc, %vacc, %vm;",
              f"setp.eq.u32 %vm{k}, %vacc, %vm;",
              f"or.pred %vm{k}, %vm{k}, !%vv{k};"]
    for k in range(n):
        a += [f"@!%vm{k} bra CH_ADV;", "add.u32 %vcur, %vcur, 32;"]
    return a + ["CH_ADV:"]


def _spin_chunks_ptx(two: bool = False) -> str:
    """The spin of _spin_warp0_ptx (two: _spin2_warp0_ptx, the same operands) with chunked polls (above)."""
    n = CHUNKS_PER_CYCLE
    c = [f"%vc{i}" for i in range(4 * n)]
    a = ["{", f".reg .pred %vp<7>, %vq, {', '.join(f'%vv{k}' for k in range(n))}, "
              f"{', '.join(f'%vm{k}' for k in range(n))};",
         f".reg .b32 {', '.join(c)};",
         f".reg .b32 %vtid, %vcur, %vnch, %vn1, %vab, %vm, %vb, %vwant, %vacc, "
         f"{', '.join(f'%vk{k}, %vloc{k}, %vnp{k}' for k in range(n))};",
         ".reg .b64 %vt0, %vt1, %va, %vbase;",
         "mov.u32 $0, 1;", "mov.u32 %vtid, %tid.x;",
         "setp.ge.u32 %vp0, %vtid, 32;",
         "@%vp0 bra VOTE_OUT;",
         "add.s32 %vn1, $2, 3;", "shr.s32 %vn1, %vn1, 2;"]           # block 1's chunks
    if two:
        a += ["add.s32 %vnch, $8, 3;", "shr.s32 %vnch, %vnch, 2;", "add.s32 %vnch, %vnch, %vn1;"]
    else:
        a += ["mov.u32 %vnch, %vn1;"]
    a += ["mov.u64 %vt0, %globaltimer;", "mov.u32 %vcur, %vtid;", "setp.eq.u32 %vp6, %vtid, 0;",
          "VOTE_TOP:",
          "mov.u32 %vab, 0;",
          "@%vp6 ld.relaxed.gpu.global.u32 %vab, [$4];",
          "setp.ge.s32 %vp1, %vcur, %vnch;",
          "@%vp1 bra VOTE_JOIN;"]
    a += _chunk_loads_checks(two)
    a += ["VOTE_JOIN:", "setp.ge.s32 %vp1, %vcur, %vnch;"]
    return "\n".join(a + _vote_end_ptx())


SPIN_CHUNKS_PTX: tl.constexpr = tl.constexpr(_spin_chunks_ptx())
SPIN2_CHUNKS_PTX: tl.constexpr = tl.constexpr(_spin_chunks_ptx(two=True))


@triton.jit
def spin2_lines_warp0(block1, n_prod1, block2, n_prod2, tag, abort_ptr, budget_ns, pin,
                      PTX: tl.constexpr = SPIN2_WARP0_PTX):
    """spin_lines_warp0 over two box blocks in one loop (n_prod1 words of block1, n_prod2 of block2): one
    round trip per poll cycle for both, one fence. -> 1 (both complete) or 0 (abort / out of time).
    PTX: SPIN2_CHUNKS_PTX for chunked polls."""
    return tl.inline_asm_elementwise(PTX, "=r,l,r,r,l,l,r,l,r",
                                     [block1, n_prod1, tag, abort_ptr, budget_ns.to(tl.int64), pin, block2, n_prod2],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def spin_lines_warp0(block, n_prod, tag, abort_ptr, budget_ns, pin, PTX: tl.constexpr = SPIN_WARP0_PTX):
    """Warp 0: poll lines lane, lane + 32, ... of a box block (128-byte aligned, n_prod words wanted) until
    each carries `tag` -> 1, or until the abort word carries `tag` or `budget_ns` passed -> 0, then
    the acquire fence; the other warps get 1 at once. The caller joins the outcomes (a reduction, whose CTA
    barrier holds the other warps until warp 0 is done). No CTA barrier inside. `pin` (int32) is not
    read: passing a loaded value keeps its load before the spin (a load the compiler sank past the spin
    cost a round trip after the fence, ~0.24 us per hop in scripts/bench_hop.py). PTX: another
    _spin_warp0_ptx(...) form (bench_hop's measurement variants); the launches use the default."""
    return tl.inline_asm_elementwise(PTX, "=r,l,r,r,l,l,r",
                                     [block, n_prod, tag, abort_ptr, budget_ns.to(tl.int64), pin],
                                     dtype=tl.int32, is_pure=False, pack=1)


def _signal_warp0_ptx(fence: bool = True) -> str:
    # Warp 0: the release fence (for every store the CTA made before the caller's barrier), then lane l
    # stores the tag into word `producer` of consumer blocks l, l + 32, ... The other warps do nothing: one
    # warp fences instead of all four.
    # $0 dummy | $1 box | $2 n_cons | $3 block_words | $4 producer | $5 tag
    return "\n".join([
        "{", ".reg .pred %gp<2>;", ".reg .b32 %gtid, %gc;", ".reg .b64 %ga, %gs;",
        "mov.u32 $0, 0;", "mov.u32 %gtid, %tid.x;",
        "setp.ge.u32 %gp0, %gtid, 32;",
        "@%gp0 bra SIG_OUT;"] + ([FENCE_RELEASE] if fence else []) + [   # fence=False: bench_hop only
        "mov.u32 %gc, %gtid;",
        "SIG_TOP:",
        "setp.ge.s32 %gp1, %gc, $2;",
        "@%gp1 bra SIG_OUT;",
        "mul.wide.s32 %ga, %gc, $3;",
        "cvt.s64.s32 %gs, $4;",
        "add.s64 %ga, %ga, %gs;",
        "shl.b64 %ga, %ga, 2;",
        "add.s64 %ga, %ga, $1;",
        "st.relaxed.gpu.global.u32 [%ga], $5;",
        "add.u32 %gc, %gc, 32;",
        "bra SIG_TOP;",
        "SIG_OUT:",
        # warp 0's lanes leave the loop at different times (consumers l, l + 32, ... < n_cons): they meet here,
        # so the warp leaves the asm whole. Without it ptxas turned the exit branches into early returns of the
        # enclosing function for some lanes, and compute-sanitizer synccheck reported divergent threads at the
        # next CTA barrier (launch_end's). The other warps arrive here whole.
        "bar.warp.sync -1;",
        "}"])


SIGNAL_WARP0_PTX: tl.constexpr = tl.constexpr(_signal_warp0_ptx())


@triton.jit
def signal_warp0(box, n_cons, block_words, producer, tag, PTX: tl.constexpr = SIGNAL_WARP0_PTX):
    """Warp 0 fences, then stores `tag` into word `producer` of every consumer block (lane l: consumers l,
    l + 32, ...). The caller runs a CTA barrier first, so the other warps' stores come before the fence.
    PTX: another _signal_warp0_ptx(...) form (bench_hop's variants); the launches use the default."""
    return tl.inline_asm_elementwise(PTX, "=r,l,r,r,r,r", [box, n_cons, block_words, producer, tag],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def nanosleep_if_not_warp0(ns):
    """Warps 1.. sleep `ns` nanoseconds (stress tests: payload stores land late, after warp 0 is done)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .pred %ps;\n.reg .u32 %ts;\nmov.u32 %ts, %tid.x;\nsetp.ge.u32 %ps, %ts, 32;\n"
        "@%ps nanosleep.u32 $1;\nmov.u32 $0, 0;\n}",
        "=r,r", [ns], dtype=tl.int32, is_pure=False, pack=1)
