"""offline_build / scripts/prebuild_cache.py: GPU kernels compiled here land in a Triton cache keyed for the device.

The key arithmetic is checked on a stand-in wheel; the build itself on the tiny preset's dense launch, in a child
process (the interpreter must be off before the kernels are imported): it compiles for sm_90 at the device's grid
and launches nothing.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest
import triton

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from glm53_flash import offline_build  # noqa: E402
from glm53_flash.config import preset  # noqa: E402


def _fake_wheel(path, version, lib_bytes):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"triton-{version}.dist-info/METADATA", f"Name: triton\nVersion: {version}\n")
        z.writestr("triton/_C/libtriton.so", lib_bytes)
        z.writestr("triton/__init__.py", "")
    return str(path)


def test_device_key_swaps_only_the_libtriton_hash(tmp_path):
    from triton.runtime import cache
    lib = os.urandom(4096)
    w = _fake_wheel(tmp_path / "t.whl", triton.__version__, lib)
    assert offline_build.wheel_libtriton_hash(w) == (triton.__version__, hashlib.sha256(lib).hexdigest())
    local, dev = cache.triton_key().split("-"), offline_build.device_key(w).split("-")
    assert len(local) == len(dev)
    diff = [i for i, (a, b) in enumerate(zip(local, dev)) if a != b]
    assert len(diff) == 1 and dev[diff[0]] == hashlib.sha256(lib).hexdigest()


def test_device_key_refuses_another_release(tmp_path):
    w = _fake_wheel(tmp_path / "t.whl", "9.9.9", b"x")
    with pytest.raises(ValueError, match="9.9.9"):
        offline_build.device_key(w)


def test_prebuild_compiles_a_launch_for_sm90_without_running_it(tmp_path):
    """The tiny dense launch at TP1, built offline: one cache entry of its kernel, for cuda sm_90, with the
    cooperative launch option the GPU path passes, packed into the archive; the child reports the compile."""
    cache, out = tmp_path / "cache", tmp_path / "c.tgz"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prebuild_cache.py"), "--kinds", "dense",
                        "--tp", "1", "--preset", "tiny", "--experts", "16", "--pos", "27", "--local-key",
                        "--cache-dir", str(cache), "--out", str(out)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "built  dense tp1" in r.stdout
    assert f"grid {2 * offline_build.H100_H200_SMS} CTAs" in r.stdout      # the GPU grid, not the interpreter's 4
    metas = [m for m in glob.glob(str(cache / "*" / "*.json")) if not os.path.basename(m).startswith("__grp__")]
    assert len(metas) == 1, metas
    m = json.load(open(metas[0]))
    assert m["name"] == "kda_layer_kernel" and m["target"] == {"backend": "cuda", "arch": 90, "warp_size": 32}
    assert m["launch_cooperative_grid"] is True
    assert glob.glob(str(cache / "*" / "kda_layer_kernel.cubin"))
    with tarfile.open(out) as t:
        names = t.getnames()
        assert any(n.endswith("kda_layer_kernel.cubin") for n in names)
        t.extractall(tmp_path / "there")                 # unpacked elsewhere, as on the device
    assert offline_build.fix_groups(str(tmp_path / "there")) == 1
    grp = json.load(open(glob.glob(str(tmp_path / "there" / "*" / "__grp__kda_layer_kernel.json"))[0]))["child_paths"]
    assert len(grp) >= 3 and all(os.path.exists(p) and p.startswith(str(tmp_path / "there")) for p in grp.values())
    assert offline_build.fix_groups(str(tmp_path / "there")) == 0             # already pointing there


def test_tail_fits_its_grid_offline(tmp_path):
    """The tail launch fits its grid to its compiled kernel's registers and shared memory (launches/tail.py
    _fit_grid); offline no driver can load the cubin, so offline_build.kernel_resources reads them from cuobjdump's
    report: the nextn launch, which builds a tail, prebuilds too. Checked in a child (kernels not imported here)."""
    script = """
import sys, torch
from glm53_flash import offline_build
offline_build.enable(None)
from glm53_flash.config import preset
from glm53_flash.launches.tail import TailLaunch
from glm53_flash.schedule import kernel_resources
cfg = preset("tiny")
H, V = cfg.hidden_size, cfg.vocab_size
L = TailLaunch(cfg, torch.randn(V, H).bfloat16(), torch.ones(H).bfloat16(), None, tp_rank=0, tp_size=1, width=1,
               device="cpu")
L.X, L.rows = torch.zeros(1, cfg.hc_mult, H), 1         # as _fit_grid compiles it
args, const = L.kernel_args(0, L.n_stages, 1, -1)
res = kernel_resources(L.kernel().warmup(*args, grid=(L.grid,), **const, num_warps=L.num_warps))
print("grid", L.grid, "regs", res["n_regs"], "warps", res["num_warps"], "shared", res["shared"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    words = r.stdout.split()
    grid, regs, warps = int(words[words.index("grid") + 1]), int(words[words.index("regs") + 1]), \
        int(words[words.index("warps") + 1])
    assert 16 <= regs <= 255 and warps == 4
    assert grid == min(-(-preset("tiny").vocab_size // 16), 4 * offline_build.H100_H200_SMS)   # the GPU's fit


def test_enable_refuses_the_interpreter_and_loaded_kernels(monkeypatch):
    """The interpreter on: refused; off but the kernel modules already imported (their decorators chose the
    interpreter): refused too; neither leaves the offline mode on."""
    import importlib
    importlib.import_module("glm53_flash.launches.dense")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        offline_build.enable(None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="before the kernel modules"):
        offline_build.enable(None)
    assert not offline_build.active()


def test_prebuild_launch_kw_parses_and_refuses_bad_input(tmp_path):
    """--launch-kw: 'num_stages=3 block_n=32' -> constructor keywords (ints parsed); a set that is not NAME=VALUE
    stops the run before any compile, and nothing is written."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import prebuild_cache
    assert prebuild_cache.launch_kw("num_stages=3 block_n=32") == {"num_stages": 3, "block_n": 32}
    assert prebuild_cache.launch_kw("") == {}
    out = tmp_path / "c.tgz"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "prebuild_cache.py"), "--kinds", "dense",
                        "--launch-kw", "num_stages=5|stages", "--local-key", "--cache-dir", str(tmp_path / "cache"),
                        "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "'stages' is not NAME=VALUE" in r.stderr + r.stdout
    assert not out.exists() and not any((tmp_path / "cache").glob("*/*.cubin"))
