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
