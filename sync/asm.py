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
import triton
import triton.language as tl


@triton.constexpr_function
def in_interpreter():
    """True under TRITON_INTERPRET=1, False when compiled (a compile-time constant either way)."""
    return bool(triton.knobs.runtime.interpret)


@triton.jit
def tid_x():
    """This thread's %tid.x (used only for 'one thread does X' branches)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def globaltimer():
    """Nanosecond wall clock of the GPU (%globaltimer, int64; ticks about every microsecond)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def ld_relaxed_u32(ptr):
    """Strong (L2, no stale L1) relaxed 32-bit load at gpu scope."""
    return tl.inline_asm_elementwise("ld.relaxed.gpu.global.u32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


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
    """fence.acq_rel.gpu in every calling thread: release for its earlier stores, acquire for later loads."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)


def _line_match_ptx() -> str:
    # 8 independent 16-byte relaxed loads cover one 128-byte box line (they pipeline; acquire loads would
    # serialise and each invalidate L1). Bit i of the result is set when word i equals the tag. A vector
    # load is not atomic as a whole; that is fine, every word is checked on its own.
    lines = ["{", ".reg .b32 %lw<32>;", ".reg .b32 %lm, %lb;", ".reg .pred %lq;"]
    for v in range(8):
        regs = ",".join(f"%lw{4 * v + j}" for j in range(4))
        lines.append(f"ld.relaxed.gpu.global.v4.u32 {{{regs}}}, [$1+{16 * v}];")
    lines.append("mov.u32 %lm, 0;")
    for i in range(32):
        lines.append(f"setp.eq.u32 %lq, %lw{i}, $2;")
        lines.append(f"selp.u32 %lb, {1 << i}, 0, %lq;")
        lines.append("or.b32 %lm, %lm, %lb;")
    lines.append("mov.u32 $0, %lm;")
    lines.append("}")
    return "\n".join(lines)


LINE_MATCH_PTX: tl.constexpr = tl.constexpr(_line_match_ptx())


@triton.jit
def line_match_bits(line_ptr, tag):
    """Bitmask of the words of one 128-byte line (32 u32 words, 128-byte aligned) that equal `tag`."""
    return tl.inline_asm_elementwise(LINE_MATCH_PTX, "=r,l,r", [line_ptr, tag], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def nanosleep_if_not_warp0(ns):
    """Warps 1.. sleep `ns` nanoseconds (stress tests: payload stores land late, after warp 0 is done)."""
    return tl.inline_asm_elementwise(
        "{\n.reg .pred %ps;\n.reg .u32 %ts;\nmov.u32 %ts, %tid.x;\nsetp.ge.u32 %ps, %ts, 32;\n"
        "@%ps nanosleep.u32 $1;\nmov.u32 $0, 0;\n}",
        "=r,r", [ns], dtype=tl.int32, is_pure=False, pack=1)
