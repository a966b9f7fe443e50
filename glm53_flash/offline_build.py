"""Build the GPU kernels of launches on a machine without a GPU, into a Triton cache the GPU machine reuses.

Host code. A device call that finds a layer kernel's source changed spends minutes of its budget compiling
(a layer launch is ~100k lines of TTGIR); Triton compiles for sm_90 here as well (sm90_regs.py), and its disk
cache is keyed only by what the compile depends on: `triton_key()` (the Triton wheel's Python files and its
libtriton binary), the kernel's source and specialisation, the backend (ptxas version, arch), the options and the
cache-invalidating environment. So a cache built here is a cache hit there if

- the key uses the GPU machine's libtriton: the Triton wheel there is the same release built for another Python
  (3.12 there, 3.11 here), whose Python files are byte-identical and whose libtriton differs, so
  `device_key(wheel)` is this machine's key with that one hash replaced (read from the wheel file);
- the launch is specialised as it would be there: the launch host code builds its tensors on the CPU, takes the
  GPU branches (grid = SMs x CTAs per SM from `sm_count()`, not the interpreter's small grid) and, instead of
  launching, calls `warmup` (Launch.enqueue_span), which compiles and stores the kernel.

`enable()` must run before any kernel module is imported, with TRITON_INTERPRET unset (the decorator picks the
interpreter at import). scripts/prebuild_cache.py is the command; checked 2026-12-05 against a cache the H200
wrote (four specialisations of bench_timing._read_kernel, the same hashes).
"""
from __future__ import annotations

import hashlib
import os
import sys
import zipfile

_STATE: dict = {}

H100_H200_SMS = 132           # both Hopper parts the device tool lends have 132 SMs


def active() -> bool:
    """True while kernels are built for a GPU this process does not have (launches compile instead of run)."""
    return bool(_STATE)


def sm_count() -> int | None:
    """The target's SM count while active (schedule.device_sm_count uses it), else None."""
    return _STATE.get("sms")


def kernel_resources(compiled) -> dict:
    """schedule.kernel_resources of a kernel compiled here for the device, which this machine cannot load: registers
    and stack bytes (n_spills: spills and call frames) from cuobjdump's resource report of its cubin, shared memory
    and warps from its metadata. The tail's grid is fitted from them (launches/tail.py _fit_grid)."""
    import re
    import subprocess
    import tempfile

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    name = compiled.metadata.name
    m = re.search(rf"Function {re.escape(name)}:\s*\n\s*REG:(\d+) STACK:(\d+)", out)
    if m is None:
        raise RuntimeError(f"offline_build: no resource line for {name} in cuobjdump's report")
    return {"n_regs": int(m.group(1)), "n_spills": int(m.group(2)), "shared": compiled.metadata.shared,
            "num_warps": compiled.metadata.num_warps}


def wheel_libtriton_hash(wheel: str) -> tuple[str, str]:
    """(version, sha256 hex of triton/_C/libtriton*.so) of a Triton wheel file, read without installing it."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.startswith("triton/_C/libtriton") and n.endswith(".so")]
        if len(names) != 1:
            raise ValueError(f"{wheel}: expected one triton/_C/libtriton*.so, found {names}")
        h = hashlib.sha256()
        with z.open(names[0]) as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        version = meta.split("/")[0][len("triton-"):-len(".dist-info")]
    return version, h.hexdigest()


def device_key(wheel: str) -> str:
    """This machine's triton_key() with its libtriton hash replaced by the wheel's (the GPU machine's key)."""
    import triton
    from triton.runtime import cache

    version, lib = wheel_libtriton_hash(wheel)
    if version != triton.__version__:
        raise ValueError(f"{wheel} is Triton {version}, this machine has {triton.__version__}: the Python files differ")
    local = cache.triton_key()
    import sysconfig
    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    here = os.path.join(os.path.dirname(triton.__file__), "_C", f"libtriton.{ext}")
    with open(here, "rb") as f:
        mine = hashlib.file_digest(f, "sha256").hexdigest()
    parts = local.split("-")
    if parts.count(mine) != 1:
        raise RuntimeError("this Triton's key does not hold its libtriton hash once: the key's layout changed")
    return "-".join(lib if p == mine else p for p in parts)


def fix_groups(cache_dir: str) -> int:
    """Point every entry's group file (`__grp__<kernel>.json`: the absolute paths of its files, which Triton checks
    before it calls an entry a hit) at `cache_dir`, where an archive built elsewhere was unpacked. Returns the number
    of group files rewritten."""
    import json
    n = 0
    for entry in os.listdir(cache_dir):
        d = os.path.join(cache_dir, entry)
        if not os.path.isdir(d):
            continue
        for f in os.listdir(d):
            if not (f.startswith("__grp__") and f.endswith(".json")):
                continue
            p = os.path.join(d, f)
            with open(p) as fh:
                g = json.load(fh)
            paths = g.get("child_paths") or {}
            new = {name: os.path.join(os.path.abspath(d), os.path.basename(path)) for name, path in paths.items()}
            if new != paths:
                with open(p, "w") as fh:
                    json.dump({"child_paths": new}, fh)
                n += 1
    return n


class _OfflineDriver:
    """The part of a Triton GPU driver that JITFunction.run(warmup=True) touches: the target, device and stream."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch
        return torch.device("cpu")

    def is_active(self):
        return True


def enable(wheel: str | None, *, arch: int = 90, sms: int = H100_H200_SMS) -> None:
    """Compile for cuda sm_`arch` with `sms` SMs from here on. `wheel`: the GPU machine's Triton wheel (its key);
    None keeps this machine's key (a cache only this Python can reuse: for tests)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("offline_build.enable: unset TRITON_INTERPRET before importing triton")
    if any(m.startswith("glm53_flash.kernels") or m.startswith("glm53_flash.launches.") for m in sys.modules):
        raise RuntimeError("offline_build.enable: call it before the kernel modules are imported")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import cache
    from triton.runtime.driver import driver

    if triton.knobs.runtime.interpret:
        raise RuntimeError("offline_build.enable: the interpreter is on")
    os.environ["TRITON_INTERPRET"] = "0"        # pinned: scripts that setdefault it on a GPU-less machine keep off
    if wheel is not None:
        key = device_key(wheel)
        cache.triton_key = lambda: key          # get_cache_key reads the module global
    driver.set_active(_OfflineDriver(GPUTarget("cuda", arch, 32)))
    _STATE.update(sms=sms)


if __name__ == "__main__":                      # python glm53_flash/offline_build.py fix-groups DIR (gpu_perf.sh)
    if sys.argv[1:2] != ["fix-groups"] or len(sys.argv) != 3:
        raise SystemExit("usage: python glm53_flash/offline_build.py fix-groups CACHE_DIR")
    print(f"{fix_groups(sys.argv[2])} cache group files pointed at {sys.argv[2]}")
