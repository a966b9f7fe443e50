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
(result "ptx_counts"). Each result also carries the kernel's shared memory bytes and its code: "functions",
{short name: [compiled copies, SASS instructions]} from the cubin's symbol table (the kernel and each noinline
function; Triton compiles a noinline function once per set of constexpr arguments, so copies > 1 is code the
SM's instruction cache holds twice), and "code_instructions", their sum. A task's code that is not in that cache
costs ~6 cycles an instruction on the H200 (bench/RESULTS.md steps 23-25): code size is a budget like registers.
"calls": {short name: CALL instructions targeting it in the SASS}: a warmed body (launches/ffn.py WARM_CODE) must
be called twice, the dry run and the real call, through one copy. "spins": {short name: [poll loads, distinct
destination registers]} of each function holding a box spin: fewer registers than loads is a spin whose polls
ptxas serialised (a noinline wait called where the caller holds many registers; sync/asm.py, chunked polls).
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


def functions(cubin):
    """({short name: [copies, instructions]}, total instructions) of the ELF's code (16-byte sm_90 instructions).
    A mangled name is $kernel$module_$_path_$_name__<signature and constexprs>: the short name is `name`. The
    kernel's own symbol spans its whole .text section: its count is what its noinline functions leave."""
    import struct
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    name_at = lambda tab, o: cubin[tab[4] + o:cubin.index(b"\0", tab[4] + o)].decode()
    total = sum(sec[5] for sec in secs if name_at(secs[shstrndx], sec[0]).startswith(".text")) // 16
    fns, kernels = {}, []
    for sec in secs:
        if sec[1] != 2:                                    # SHT_SYMTAB
            continue
        for off in range(sec[4], sec[4] + sec[5], 24):
            st_name, st_info, _, _, _, st_size = struct.unpack_from("<IBBHQQ", cubin, off)
            if st_info & 0xF != 2 or st_size == 0:        # STT_FUNC with code
                continue
            short = name_at(secs[sec[6]], st_name).split("__P")[0].split("_$_")[-1].strip("$")
            if st_info >> 4 == 1:                          # STB_GLOBAL: the kernel
                kernels.append(short)
                continue
            c = fns.setdefault(short, [0, 0])
            c[0] += 1
            c[1] += st_size // 16
    for k in kernels:
        fns[k] = [1, total - sum(v[1] for v in fns.values())]
    return fns, total


def sass_of(cubin):
    nvdisasm = os.path.join(os.path.dirname(PTXAS), "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    return sass


def spin_polls(sass):
    """{short name: [poll loads, distinct destination registers]} of every function that holds a box spin (a warp
    vote, VOTE.ALL, beside 16-byte strong loads: sync.asm's spins; of a function compiled more than once, its worst
    copy). Fewer registers than loads: ptxas gave the polls of one cycle the same registers, so each waits for the
    one before (a round trip each, not one a cycle)."""
    out, name, polls = {}, None, []
    for ln in sass.splitlines() + ["END:"]:
        m = re.match(r"^(\S+):\s*$", ln)
        if m and not m.group(1).startswith(".L"):
            if name and any("VOTE.ALL" in p for p in polls):
                regs = [re.search(r"LDG\.E\.128\.STRONG\.GPU\s+(R\d+)", p).group(1) for p in polls if "LDG" in p]
                got = [len(regs), len(set(regs))]
                if name not in out or got[0] - got[1] > out[name][0] - out[name][1]:
                    out[name] = got                        # copies of one function: the worst
            name, polls = m.group(1).split("__P")[0].split("_$_")[-1].strip("$"), []
        elif "LDG.E.128.STRONG.GPU" in ln or "VOTE.ALL" in ln:
            polls.append(ln)
    return out


def call_sites(sass):
    """{short name: CALL instructions that target it} in the sm_90 SASS (nvdisasm of the cubin): a noinline function
    whose every call site survived to the SASS. One symbol with fewer calls than call sites in the source means a
    call was inlined (a second specialisation compiled into its caller), which the symbol count cannot see."""
    calls = {}
    for m in re.finditer(r"CALL\.REL\.NOINC\s+`\(([^)`]*)\)", sass):
        short = m.group(1).split("__P")[0].split("_$_")[-1].strip("$")
        calls[short] = calls.get(short, 0) + 1
    return calls


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
    fns, total = functions(c.asm["cubin"])
    sass = sass_of(c.asm["cubin"])
    out.append(dict(kernel=name, consts=consts, warps=warps, regs=regs, spill=spill, shared=c.metadata.shared,
                    ptx_counts={g: c.asm["ptx"].count(g) for g in grep}, functions=fns, code_instructions=total,
                    calls=call_sites(sass), spins=spin_polls(sass)))
print(json.dumps(out))
'''


def ptxas_available() -> bool:
    import triton
    return os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))


def kernel_registers(specs: list, timeout: float = 300) -> list[dict]:
    """[{kernel, consts, warps, regs, spill, shared, ptx_counts, functions, code_instructions, calls}] for each spec,
    compiled for sm_90 in a subprocess."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(specs)], env=env, capture_output=True,
                         text=True, timeout=timeout)
    if res.returncode != 0:
        err = res.stderr if len(res.stderr) <= 6000 else res.stderr[:3500] + "\n[...]\n" + res.stderr[-2500:]
        raise RuntimeError(f"offline sm_90 compile failed (the root cause first):\n{err}")
    return json.loads(res.stdout.strip().splitlines()[-1])
