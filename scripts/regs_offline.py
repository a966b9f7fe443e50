"""Offline sm_90 register/spill report for the tail kernel and the standalone GEMV (no GPU needed).

Compiles with Triton for GPUTarget("cuda", 90, 32) and runs Triton's bundled ptxas -v on the PTX.
Usage: python scripts/regs_offline.py [name ...]   (names: see VARIANTS; default: all)
TRITON_INTERPRET must not be set (it is removed here before triton is imported).
"""
import json
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")

from glm53_flash.build_report import TAIL_DIV16, TAIL_TYPES as TAIL_P  # noqa: E402  (the tail's argument types)
from glm53_flash.build_report import tail_consts as _tail_consts  # noqa: E402


def compile_stats(fn, sig, consts, warps, div16=(), maxnreg=None):
    names = list(fn.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig.get(n, "").startswith("*") or n in div16}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=warps, **({} if maxnreg is None else dict(maxnreg=maxnreg))))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(c.asm["ptx"])
    log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True, check=True).stderr
    os.unlink(f.name)
    return dict(regs=int(re.search(r"Used (\d+) registers", log)[1]),
                spill=int(re.search(r"(\d+) bytes spill stores", log)[1]),
                stack=int(re.search(r"(\d+) bytes stack frame", log)[1]), shared=c.metadata.shared)


def tail(fp8=False, warps=4, maxnreg=None, **kw):
    from glm53_flash.launches.tail import tail_kernel as k
    C = tail_consts(k, fp8, kw)
    sig = {n: ("constexpr" if n in C else TAIL_P.get(n, "i32")) for n in k.arg_names}
    sig["W"], sig["S"] = ("*fp8e4nv", "*fp32") if fp8 else ("*bf16", "*bf16")
    return compile_stats(k, sig, C, warps, TAIL_DIV16, maxnreg)


def tail_consts(k, fp8, kw):
    """The launch's constexprs at width 1-4 (build_report.tail_consts), overridden by kw; only k's own (k may be
    an edited copy of the kernel, tail_edit)."""
    return {n: v for n, v in _tail_consts(fp8, 1, **kw).items() if n in k.arg_names}


def gemv(fp8=False, x="*fp32", warps=4, stages=3, bn=64):
    from glm53_flash.kernels.gemv import gemv_kernel as k
    C = dict(ROWS_PAD=8, BLOCK_N=bn, BLOCK_K=128, PF_K=128, NUM_STAGES=stages, KSPLIT=1, EVEN=False)
    C = {n: v for n, v in C.items() if n in k.arg_names}
    sig = {n: ("constexpr" if n in C else "i32") for n in k.arg_names}
    sig.update(x_ptr=x, w_ptr="*fp8e4nv" if fp8 else "*bf16", s_ptr="*fp32" if fp8 else "*bf16", y_ptr="*fp32")
    return compile_stats(k, sig, C, warps, ("K", "stride_x", "stride_y", "N"))


VARIANTS = {
    "gemv_bf16x": lambda: gemv(x="*bf16"),
    "gemv_fp32x": lambda: gemv(x="*fp32"),
    "tail_bf16": lambda: tail(),
    "tail_fp8": lambda: tail(fp8=True),
    "tail_bf16_s3": lambda: tail(NUM_STAGES=3),
    "tail_bf16_w8rows": lambda: tail(XR=8),
    "tail_fp8_w8rows": lambda: tail(fp8=True, XR=8),
    "tail_bf16_max96": lambda: tail(maxnreg=96),
    "tail_bf16_max112": lambda: tail(maxnreg=112),
    "tail_fp8_max96": lambda: tail(fp8=True, maxnreg=96),
    "tail_fp8_max112": lambda: tail(fp8=True, maxnreg=112),
    "tail_bf16_max120": lambda: tail(maxnreg=120),
    "tail_fp8_max120": lambda: tail(fp8=True, maxnreg=120),
    "tail_bf16_bn32": lambda: tail(BLOCK_N=32),
    "tail_bf16_noxpf": lambda: tail(XPF=False),
    "tail_bf16_local": lambda: tail(LOCAL_NORM=True),
    "tail_bf16_w8_bn128": lambda: tail(warps=8, BLOCK_N=128),
}



def tail_edit(repl, fp8=False, warps=4, **kw):
    """The tail kernel with source edits (old, new) applied: for bisecting what costs registers."""
    import importlib.util
    import hashlib
    src = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "glm53_flash", "launches", "tail.py")).read()
    src = src.replace("from ..", "from glm53_flash.").replace("from .base", "from glm53_flash.launches.base")
    for old, new in repl:
        assert old in src, old
        src = src.replace(old, new)
    path = os.path.join(tempfile.gettempdir(), "tail_v_" + hashlib.md5(src.encode()).hexdigest()[:10] + ".py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    k = mod.tail_kernel
    C = tail_consts(k, fp8, kw)
    sig = {n: ("constexpr" if n in C else TAIL_P.get(n, "i32")) for n in k.arg_names}
    sig["W"], sig["S"] = ("*fp8e4nv", "*fp32") if fp8 else ("*bf16", "*bf16")
    return compile_stats(k, sig, C, warps, TAIL_DIV16)


XN_BF16 = ("xn = scratch.to(tl.pointer_type(tl.float32), bitcast=True) + o_xn",
           "xn = scratch.to(tl.pointer_type(tl.bfloat16), bitcast=True) + 2 * o_xn")
NO_NORM = ("if fam == 0:", "if False:")
NO_NORML = ("elif fam == 1:", "elif False:")
NO_RED = ("elif fam == 3:", "elif False:")
NO_PEER = ("elif fam == 4:", "elif False:")
NO_FINAL = ("elif fam == 5:", "elif False:")
NO_ARGMAX = ("bv, bi = argmax_merge(bv, bi, v, ix)", "pass")
NO_WAIT = ("ok = wait_box(box, pid, box_words, n_norm, tag, hdr, site_xn, pid, timeout_ns)", "ok = 1")
VARIANTS.update({
    "t_xnbf16": lambda: tail_edit([XN_BF16]),
    "t_nonorm": lambda: tail_edit([NO_NORM, NO_NORML]),
    "t_nored": lambda: tail_edit([NO_RED, NO_PEER, NO_FINAL]),
    "t_noargmax": lambda: tail_edit([NO_ARGMAX]),
    "t_gemvonly": lambda: tail_edit([NO_NORM, NO_NORML, NO_RED, NO_PEER, NO_FINAL, NO_ARGMAX]),
    "t_gemvonly_nowait": lambda: tail_edit([NO_NORM, NO_NORML, NO_RED, NO_PEER, NO_FINAL, NO_ARGMAX, NO_WAIT]),
    "t_xnbf16_gemvonly": lambda: tail_edit([XN_BF16, NO_NORM, NO_NORML, NO_RED, NO_PEER, NO_FINAL, NO_ARGMAX]),
})

if __name__ == "__main__":
    for name in sys.argv[1:] or list(VARIANTS):
        print(json.dumps(dict(variant=name, **VARIANTS[name]())), flush=True)
