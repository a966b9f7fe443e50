"""Compile layer launches' GPU kernels on this machine (no GPU) into a Triton cache the device call reuses.

A device call whose kernels changed spends minutes of its budget compiling them; Triton compiles for sm_90
here too, and with the GPU machine's Triton key (glm53_flash/offline_build.py) the cache entries written here
are hits there. Each (environment, kind, trace) runs in its own process: switches such as GLM53_XIN are read
when a launch is built, and the interpreter must be off before the kernels are imported.

  python scripts/prebuild_cache.py --kinds kda,dense,sparse --tp 8 --env "GLM53_XIN=1|GLM53_XIN=0" --trace
  python scripts/prebuild_cache.py --kinds kda --tp 8 --rows 8 --merge      (adds to .triton_cache.tgz)

The launches are built as diag_layers.py / bench_gap.py / time_layers.py build them (preset glm53-flash,
--experts routed experts, cache length from --pos), so their kernels are the ones those scripts ask for at the
same flags. The wheel: the GPU machine's Triton (3.6.0 for Python 3.12); without --wheel it is looked for in
.device_wheels/ and downloaded there with pip if missing (~190 MB, once; not .whl/, whose wheels travel to the
device). Writes --out (default .triton_cache.tgz: carry it; scripts/gpu_perf.sh unpacks it into the device's
TRITON_CACHE_DIR), newest entries first, the old archive's entries after them with --merge. A kernel that fails
to compile is an error (exit 1), with its log.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WHEEL_GLOB = "triton-{v}-cp312-cp312-manylinux*.whl"


def find_wheel(version: str, where: str) -> str:
    """The GPU machine's Triton wheel in `where`, downloaded with pip if absent."""
    hits = glob.glob(os.path.join(where, WHEEL_GLOB.format(v=version)))
    if hits:
        return hits[0]
    print(f"downloading triton {version} for Python 3.12 into {where} (once, ~190 MB) ...", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                    "--platform", "manylinux_2_27_x86_64", "-d", where, f"triton=={version}"], check=True)
    hits = glob.glob(os.path.join(where, WHEEL_GLOB.format(v=version)))
    if not hits:
        raise SystemExit(f"pip left no {WHEEL_GLOB.format(v=version)} in {where}")
    return hits[0]


def launch_kw(spec: str) -> dict:
    """'num_stages=5 block_n=32' -> the launch constructor's keyword arguments (ints where they parse)."""
    kw = {}
    for kv in spec.split():
        k, _, v = kv.partition("=")
        if not k or not v:
            raise SystemExit(f"--launch-kw: {kv!r} is not NAME=VALUE")
        kw[k] = int(v) if v.lstrip("-").isdigit() else v
    return kw


def build_one(a) -> int:
    """Child process: build one launch on the CPU with GPU specialisation and compile it (never run)."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from glm53_flash import offline_build
    offline_build.enable(a.wheel or None)
    import triton
    compiled = []
    triton.knobs.runtime.jit_post_compile_hook = lambda *x, **kw: compiled.append(kw.get("fn") or x) or False
    from diag_layers import build
    from glm53_flash.config import preset
    cfg = preset(a.preset).replace(n_routed_experts=a.experts, num_nextn_predict_layers=1)
    L, run = build(a.kinds, cfg, a.tp, a.rows, a.weights, a.pos, "cpu", None, **launch_kw(a.launch_kw))
    if a.trace:
        L.enable_trace(True)
    try:
        run(None)
    except Exception as e:        # after the compile: the checks read a launch that never ran
        if not compiled:
            raise
        print(f"  (after the compile, as expected without a GPU: {type(e).__name__})")
    if not compiled:
        raise SystemExit("no kernel was compiled")
    print(f"  grid {L.grid} CTAs, {len(compiled)} kernel(s) compiled")
    return 0


def pack(cache: str, out: str, merge: bool) -> int:
    """Write `cache`'s entries into `out` (tar.gz), then, with merge, the old archive's other entries."""
    entries = sorted(os.listdir(cache), key=lambda d: -os.path.getmtime(os.path.join(cache, d)))
    tmp = out + ".tmp"
    with tarfile.open(tmp, "w:gz") as t:
        for d in entries:
            t.add(os.path.join(cache, d), arcname=d)
        if merge and os.path.exists(out):
            try:
                with tarfile.open(out, "r:gz") as old:
                    for m in old:
                        if m.name.split("/")[0] not in entries:
                            t.addfile(m, old.extractfile(m) if m.isfile() else None)
            except (tarfile.ReadError, EOFError) as e:        # a truncated archive: keep what was read
                print(f"  {out}: old archive ends early ({e}); its entries read so far are kept")
    os.replace(tmp, out)
    return len(entries)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default="kda,dense,sparse", help="comma-separated: embed, dense, kda, sparse, nextn")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--pos", type=int, default=8191)
    ap.add_argument("--experts", type=int, default=288, help="routed experts (time_layers / bench_gap use 288)")
    ap.add_argument("--preset", default="glm53-flash")
    ap.add_argument("--env", default="", help="'|'-separated K=V sets, one build of each kind per set, "
                                               "e.g. 'GLM53_XIN=1|GLM53_XIN=0'")
    ap.add_argument("--launch-kw", default="",
                    help="'|'-separated sets of launch constructor arguments, one build of each kind per set, as "
                         "time_layers' flags set them, e.g. 'num_stages=3|num_stages=5' (--num-stages)")
    ap.add_argument("--trace", action="store_true", help="also the TRACE builds (diag_layers / bench_gap --trace)")
    ap.add_argument("--wheel", default=None,
                    help="the GPU machine's Triton wheel (default: found or fetched in .device_wheels/)")
    ap.add_argument("--local-key", action="store_true",
                    help="keep this machine's Triton key (a cache only this Python reuses; for tests)")
    ap.add_argument("--cache-dir", default=None, help="Triton cache to write (default a fresh temporary one)")
    ap.add_argument("--out", default=os.path.join(ROOT, ".triton_cache.tgz"))
    ap.add_argument("--merge", action="store_true", help="keep the old --out archive's other entries after the new")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)     # the child process
    a = ap.parse_args(argv)
    if a.one:
        return build_one(a)
    import triton
    wheel = "" if a.local_key else (a.wheel or find_wheel(triton.__version__, os.path.join(ROOT, ".device_wheels")))
    cache = a.cache_dir or tempfile.mkdtemp(prefix="prebuild_cache_")
    os.makedirs(cache, exist_ok=True)
    envs = [dict(kv.split("=", 1) for kv in s.split()) for s in a.env.split("|")] if a.env else [{}]
    kws = a.launch_kw.split("|") if not a.one else [a.launch_kw]
    for spec in kws:
        launch_kw(spec)                                             # bad input fails before any compile
    failed = 0
    for env, spec in [(e, k) for e in envs for k in kws]:
        for kind in a.kinds.split(","):
            for trace in ((False, True) if a.trace else (False,)):
                label = (f"{kind} tp{a.tp} rows{a.rows} {a.weights}{' trace' if trace else ''} {env or ''}"
                         f"{' ' + spec if spec else ''}")
                t0 = time.time()
                cmd = [sys.executable, os.path.abspath(__file__), "--one", "--kinds", kind, "--tp", str(a.tp),
                       "--rows", str(a.rows), "--weights", a.weights, "--pos", str(a.pos), "--experts",
                       str(a.experts), "--preset", a.preset, "--wheel", wheel, "--launch-kw", spec] + \
                    (["--trace"] if trace else [])
                e = dict(os.environ, TRITON_CACHE_DIR=cache, **env)
                e.pop("TRITON_INTERPRET", None)
                r = subprocess.run(cmd, env=e, capture_output=True, text=True)
                ok = r.returncode == 0
                failed += not ok
                grid = [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("grid ")]
                where = f", {grid[0]}" if grid else ""
                print(f"{'built ' if ok else 'FAILED'} {label} ({time.time() - t0:.0f} s{where})", flush=True)
                if not ok:
                    print(r.stdout[-3000:] + r.stderr[-3000:])
    n = pack(cache, a.out, a.merge)
    print(f"{n} cache entries -> {a.out} ({os.path.getsize(a.out) / 2**20:.1f} MiB){' (merged)' if a.merge else ''}")
    if not a.cache_dir:
        shutil.rmtree(cache, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
