"""Registers and spills of Triton kernels compiled for sm_90 on a machine without a GPU.

A persistent launch inherits the register count of its heaviest task family, and registers decide how
many CTAs fit per SM, so every family keeps a budget that CPU tests check. Triton can compile for a
target it does not run on, and its wheel ships NVIDIA's ptxas, whose `-v` report gives registers and
spill bytes. The compile runs in a subprocess because TRITON_INTERPRET (set for CPU tests) must be off
when the kernels are defined.

A spec is (module, kernel name, signature {arg: type}, constexprs {name: value}, num_warps[, divisible
[, options[, ptx_grep]]]): `divisible` names the int args a launch passes as multiples of 16 (pointers are
always taken 16-byte aligned), as Triton would specialise them at a real launch; `options` more compile options
(e.g. {"maxnreg": 128}, the launches' ptxas cap); `ptx_grep` strings whose occurrences in the PTX are counted
(result "ptx_counts"). Each result also carries the kernel's shared memory bytes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

_SCRIPT = r'''
import importlib, json, os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
out = []
for spec in json.loads(sys.argv[1]):
    mod, name, sig, consts, warps = spec[:5]
    divisible = set(spec[5]) if len(spec) > 5 else set()
    options = dict(spec[6]) if len(spec) > 6 else {}
    grep = list(spec[7]) if len(spec) > 7 else []
    fn = getattr(importlib.import_module(mod), name)
    assert list(sig) == fn.arg_names, (name, list(sig), fn.arg_names)
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if sig[n].startswith("*") or n in divisible}
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, **options))
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(c.asm["ptx"])
    log = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True,
                         text=True, check=True).stderr
    os.unlink(f.name)
    # noinline device functions get their own ptxas lines: registers = the largest, spills = the sum
    regs = max(int(m) for m in re.findall(r"Used (\d+) registers", log))
    spill = sum(int(m) for m in re.findall(r"(\d+) bytes spill stores", log))
    out.append(dict(kernel=name, consts=consts, warps=warps, regs=regs, spill=spill, shared=c.metadata.shared,
                    ptx_counts={g: c.asm["ptx"].count(g) for g in grep}))
print(json.dumps(out))
'''


def ptxas_available() -> bool:
    import triton
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def kernel_registers(specs: list, timeout: float = 300) -> list[dict]:
    """[{kernel, consts, warps, regs, spill}] for each spec, compiled for sm_90 in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(specs)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    if res.returncode != 0:
        err = res.stderr if len(res.stderr) <= 6000 else res.stderr[:3500] + "\n[...]\n" + res.stderr[-2500:]
        raise RuntimeError(f"offline sm_90 compile failed (the root cause first):\n{err}")
    return json.loads(res.stdout.strip().splitlines()[-1])
