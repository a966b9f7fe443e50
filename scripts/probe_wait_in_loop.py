"""Offline probe (no GPU): does Triton's software pipeliner keep a GEMV loop's weight copies ahead of a
hand-off wait placed INSIDE the loop?

The persistent launches wait for a task's input (a noinline spin) and only then enter the pipelined GEMV loop,
so a task's weights move to shared memory only after the hand-off (before it, at most an L2 prefetch). This
probe compiles, for sm_90 with the device's Triton key (glm53_flash/offline_build.py), a 64 x 1024 bf16 tile
loop whose body calls a noinline wait on its first step (the callee does nothing on later steps) and loads x
at an address that depends on the wait's result. It prints where the prologue's cp.async (LDGSTS) copies sit
against the CALL in the SASS: "ahead" means the first NUM_STAGES - 1 weight steps are in flight while the CTA
waits, and x is read after it.

    python scripts/probe_wait_in_loop.py [--stages 4] [--sass]

Finding (2026-12-06, Triton 3.6.0): ahead. NUM_STAGES 4 / 5 -> 24 / 32 LDGSTS.128 (48 / 64 KB) before the
CALL, x loads after it (an `if kk == 0:` spin in the loop body itself pipelines the same way). The pointers
need their 16-byte divisibility (the launches' region_off gives it): without it there is no cp.async at all.
What this probe leaves to a design: x here is one synchronous L2 load per step, after the wait; a launch
would read it once after the wait (through L1, which the wait's fence has just invalidated) or keep it in
registers.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
os.environ.pop("TRITON_INTERPRET", None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--stages", type=int, default=4, help="the loop's num_stages")
    ap.add_argument("--sass", action="store_true", help="print the SASS lines around the call")
    a = ap.parse_args(argv)
    from glm53_flash import offline_build
    offline_build.enable(None)
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    @triton.jit
    def _spin_first(flag, kk):
        # polls *flag until non-zero when kk == 0; returns 0, opaque to the compiler
        return tl.inline_asm_elementwise(
            "{ .reg .pred p, q; .reg .b32 t; setp.ne.s32 q, $2, 0; @q bra DONE; SPIN: "
            "ld.relaxed.gpu.global.b32 t, [$1]; setp.eq.s32 p, t, 0; @p bra SPIN; DONE: mov.u32 $0, 0; }",
            "=r,l,r", [flag, kk], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit(noinline=True)
    def _wait(flag, kk):
        r = 0
        if kk == 0:
            r = tl.max(_spin_first(flag + tl.zeros((4,), tl.int32), kk), axis=0)
        return r

    @triton.jit
    def _tile(W, X, flag, Y, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NS: tl.constexpr):
        offs_n = tl.arange(0, BN)
        offs_r = tl.arange(0, 16)
        acc = tl.zeros((BN, 16), tl.float32)
        for kk in tl.range(0, K, BK, num_stages=NS):
            w = tl.load(W + offs_n[:, None] * K + kk + tl.arange(0, BK)[None, :])
            z = _wait(flag, kk)                                   # the hand-off, on the first step only
            xt = tl.load(X + z + offs_r[None, :] * K + kk + tl.arange(0, BK)[:, None], cache_modifier=".cg")
            acc = tl.dot(w, xt, acc)
        tl.store(Y + offs_n[:, None] * 16 + offs_r[None, :], acc)

    src = triton.compiler.ASTSource(
        fn=_tile, signature={"W": "*bf16", "X": "*bf16", "flag": "*i32", "Y": "*fp32", "K": "constexpr",
                             "BN": "constexpr", "BK": "constexpr", "NS": "constexpr"},
        constexprs={"K": 1024, "BN": 64, "BK": 128, "NS": a.stages},
        attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (3,): [["tt.divisibility", 16]]})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    body = []                                 # the kernel's own instructions (the callee's spin load is not x)
    for ln in sass.splitlines()[next(i for i, ln in enumerate(sass.splitlines()) if ln.startswith("_tile")):]:
        if ln.startswith("$"):                # the next function's label
            break
        body.append(ln)
    lines = [ln for ln in body if "/*" in ln]
    call = next((i for i, ln in enumerate(lines) if "CALL" in ln and "_wait" in ln), None)
    if call is None:
        print("no CALL to the wait in the SASS (inlined?)")
        return 1
    before = sum("LDGSTS" in ln for ln in lines[:call])
    after_x = sum(("LDG.E" in ln and "LDGSTS" not in ln) for ln in lines[call:])
    print(f"num_stages {a.stages}: {before} LDGSTS before the wait's CALL ({before * 16 * 128 // 1024} KB of weights "
          f"at 128 threads), {after_x} x loads after it: {'ahead' if before else 'NOT ahead'}")
    if a.sass:
        print("\n".join(lines[max(0, call - 6):call + 6]))
    return 0 if before else 1


if __name__ == "__main__":
    raise SystemExit(main())
