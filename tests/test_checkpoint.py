"""Checkpoint directories: vendor layout round trips (bf16, FP8), shards and index, validation errors,
lazy loading that reads only what it needs.

FP8 error bound used: e4m3 keeps 3 mantissa bits, so rounding w/s to the nearest e4m3 value errs by at
most 2^-4 of |w/s| for normal values and by half the subnormal step, 2^-10, below 2^-6; hence
|dequant - w| <= 2^-4 |w| + 2^-10 s elementwise, s the block's scale_inv.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from glm53_flash import checkpoint as ck_mod
from glm53_flash.checkpoint import (INDEX, CheckpointError, load_checkpoint, make_random_checkpoint, plan_shards,
                                    read_header)
from glm53_flash.config import GlmConfig, preset
from glm53_flash.fp8 import FP8_DTYPE, expand_scales, scale_grid
from glm53_flash.weights import PREFIX, RandomWeights, scale_name, weight_specs

SEED = 7
L0 = PREFIX + "layers.0."


@pytest.fixture(scope="session")
def cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def rw(cfg):
    return RandomWeights(cfg, seed=SEED, cache=True)


@pytest.fixture(scope="session")
def dirs(cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {w: make_random_checkpoint(cfg, root / w, seed=SEED, weights=w, progress=False) for w in ("bf16", "fp8")}


def _index(d):
    return json.loads((d / INDEX).read_text())


# ---------------------------------------------------------------------- layout and round trips
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_layout_shards_and_index(cfg, dirs, fmt):
    d = dirs[fmt]
    specs = weight_specs(cfg)
    idx = _index(d)
    wm = idx["weight_map"]
    files = sorted(set(wm.values()))
    n = len(files)
    assert n >= 3
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(d)) == sorted(files + ["config.json", INDEX])      # no temporaries left
    want = set(specs) | ({scale_name(s) for s, sp in specs.items() if sp.fp8} if fmt == "fp8" else set())
    assert set(wm) == want
    total = 0
    for f in files:
        with safe_open(str(d / f), framework="pt") as h:
            assert set(h.keys()) == {k for k, v in wm.items() if v == f}
            for k in h.keys():
                t = h.get_slice(k)
                numel = 1
                for x in t.get_shape():
                    numel *= x
                total += numel * {"BF16": 2, "F32": 4, "F8_E4M3": 1}[t.get_dtype()]
    assert idx["metadata"]["total_size"] == total
    hf = json.loads((d / "config.json").read_text())
    assert hf["model_type"] == "glm5_next" and GlmConfig.from_hf_dict(hf) == cfg
    assert ("quantization_config" in hf) == (fmt == "fp8")


def test_bf16_round_trip_is_bitwise(cfg, dirs, rw):
    ck = load_checkpoint(dirs["bf16"], progress=False)
    assert ck.format == "bf16" and ck.config == cfg and len(ck.scales) == 0
    assert list(ck.weights) == list(weight_specs(cfg))
    for name in rw:
        got = ck.weights[name]
        assert got.dtype == rw[name].dtype and torch.equal(got, rw[name]), name
    deq = ck.dequantized()
    assert set(deq) == set(rw) and all(torch.equal(deq[n], rw[n]) for n in list(rw)[:40])


def test_fp8_round_trip_within_e4m3_bound(cfg, dirs, rw):
    ck = load_checkpoint(dirs["fp8"], lazy=False, progress=False)
    specs = weight_specs(cfg)
    assert ck.format == "fp8" and set(ck.scales) == {n for n, s in specs.items() if s.fp8}
    deq = ck.dequantized(torch.float32)
    assert set(deq) == set(specs)
    worst = 0.0
    for name, spec in specs.items():
        if not spec.fp8:
            assert torch.equal(ck.weights[name], rw[name]), name
            assert torch.equal(deq[name], rw[name]), name
            continue
        q, s = ck.weights[name], ck.scales[name]
        assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and tuple(s.shape) == scale_grid(*spec.shape)
        w = rw[name].float()
        err = (deq[name] - w).abs()
        bound = w.abs() * 2 ** -4 + expand_scales(s, *w.shape) * 2 ** -10
        assert deq[name].dtype == torch.float32 and bool((err <= bound).all()), name
        worst = max(worst, float((err / w.abs().clamp_min(1e-6)).median()))
    assert 1e-3 < worst < 2 ** -4          # really quantized, and within the bound


def test_default_shard_sizes_for_big_configs():
    for fmt in ("bf16", "fp8"):
        plan = plan_shards(preset("glm53-flash-e80"), fmt)
        b = [sum(_bytes(spec, fmt) for spec in g) for g in plan]
        assert max(b) <= 5 * 10**9 and sorted(b)[len(b) // 2] >= 4 * 10**9, fmt
    with pytest.raises(CheckpointError, match="max_shard_bytes=0"):
        plan_shards(preset("tiny"), "bf16", 0)
    with pytest.raises(CheckpointError, match="weights='int4'"):
        plan_shards(preset("tiny"), "int4")


def _bytes(spec, fmt):
    return sum(ck_mod._nbytes(s, d) for _, s, d in ck_mod.stored_tensors(spec, fmt))


def test_single_file_checkpoint(cfg, rw, tmp_path):
    d = make_random_checkpoint(cfg, tmp_path / "one", seed=SEED, max_shard_bytes=1 << 40, progress=False)
    (d / "model-00001-of-00001.safetensors").rename(d / "model.safetensors")
    (d / INDEX).unlink()
    ck = load_checkpoint(d, progress=False)
    name = L0 + "mlp.down_proj.weight"
    assert torch.equal(ck.weights[name], rw[name])


def test_crash_midway_leaves_no_valid_index(cfg, tmp_path, monkeypatch):
    d = make_random_checkpoint(cfg, tmp_path / "c", seed=1, progress=False)
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, path, metadata=metadata)
    monkeypatch.setattr(ck_mod, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        make_random_checkpoint(cfg, d, seed=2, progress=False)
    assert not (d / INDEX).exists()
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        load_checkpoint(d, progress=False)


# ---------------------------------------------------------------------- bad checkpoints
def _clone(src, dst):
    """dst with config and index copied, shards symlinked (replace one before editing it)."""
    dst.mkdir()
    for f in os.listdir(src):
        if f.endswith(".json"):
            shutil.copy(src / f, dst / f)
        else:
            os.symlink(src / f, dst / f)
    return dst


def _edit_index(d, fn):
    idx = _index(d)
    fn(idx["weight_map"])
    (d / INDEX).write_text(json.dumps(idx))


def _rewrite_shard(d, name, fn):
    """Apply fn to the tensors of the shard holding `name`; returns that shard's file name."""
    f = _index(d)["weight_map"][name]
    tensors = load_file(str(d / f))
    fn(tensors)
    os.unlink(d / f)
    save_file(tensors, str(d / f), metadata={"format": "pt"})
    return f


def _edit_config(d, **text_fields):
    hf = json.loads((d / "config.json").read_text())
    hf["text_config"].update(text_fields)
    (d / "config.json").write_text(json.dumps(hf))


def _expect(d, *parts):
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(d, progress=False)
    msg = str(e.value)
    for p in parts:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg


def test_missing_tensor(dirs, tmp_path):
    d = _clone(dirs["bf16"], tmp_path / "x")
    name = L0 + "self_attn.b_proj.weight"
    _edit_index(d, lambda wm: wm.pop(name))
    _expect(d, name, INDEX, "missing")


def test_unexpected_tensor(dirs, tmp_path):
    d = _clone(dirs["bf16"], tmp_path / "x")
    extra = L0 + "self_attn.extra_proj.weight"
    f = _rewrite_shard(d, L0 + "self_attn.b_proj.weight", lambda t: t.__setitem__(extra, torch.randn(4, 4)))
    _edit_index(d, lambda wm: wm.__setitem__(extra, f))
    _expect(d, extra, f, "unexpected")


def test_wrong_shape(dirs, tmp_path):
    d = _clone(dirs["bf16"], tmp_path / "x")
    name = L0 + "hc_attn_scale"
    f = _rewrite_shard(d, name, lambda t: t.__setitem__(name, torch.randn(4)))
    _expect(d, name, f, "shape [4], expected [3]")


def test_wrong_dtype(dirs, tmp_path):
    d = _clone(dirs["bf16"], tmp_path / "x")
    name = L0 + "self_attn.q_proj.weight"
    f = _rewrite_shard(d, name, lambda t: t.__setitem__(name, t[name].float()))
    _expect(d, name, f, "dtype F32, expected BF16")


def test_truncated_shard(dirs, tmp_path):
    d = _clone(dirs["bf16"], tmp_path / "x")
    f = _index(d)["weight_map"][L0 + "mlp.up_proj.weight"]
    os.unlink(d / f)
    shutil.copy(dirs["bf16"] / f, d / f)
    hdr = read_header(d / f)
    size = os.path.getsize(d / f)
    os.truncate(d / f, size - 100)
    data_len = max(end for _, _, end in hdr.values()) - 100     # the file has no padding after the data
    cut = [k for k, (_, _, end) in hdr.items() if end > data_len]
    msg = _expect(d, f, "truncated")
    assert any(k in msg for k in cut)
    os.truncate(d / f, 5)                     # even the header is gone: name a tensor the index puts there
    msg = _expect(d, f, "truncated")
    assert re.search(r"tensor \S+ in file", msg).group(0).split()[1] in _index(d)["weight_map"]


def test_index_points_at_missing_file(dirs, tmp_path):
    d = _clone(dirs["bf16"], tmp_path / "x")
    name = L0 + "mlp.gate_proj.weight"
    _edit_index(d, lambda wm: wm.__setitem__(name, "model-00009-of-00009.safetensors"))
    _expect(d, name, "model-00009-of-00009.safetensors", "does not exist")


def test_index_lists_tensor_not_in_shard(dirs, tmp_path):
    d = _clone(dirs["bf16"], tmp_path / "x")
    wm = _index(d)["weight_map"]
    name = L0 + "mlp.gate_proj.weight"
    other = next(f for f in sorted(set(wm.values())) if f != wm[name])
    _edit_index(d, lambda m: m.__setitem__(name, other))
    _expect(d, name, other, "does not contain")


@pytest.mark.parametrize("text", ['{"weight_map": ', '[1, 2]', '{"weight_map": {}}',
                                  '{"weight_map": {"lm_head.weight": "../x.safetensors"}}'])
def test_malformed_index(dirs, tmp_path, text):
    d = _clone(dirs["bf16"], tmp_path / "x")
    (d / INDEX).write_text(text)
    _expect(d, INDEX, "malformed")


@pytest.mark.parametrize("field, value, parts", [
    ("n_routed_experts", 4, ["n_routed_experts=4", "mlp.experts.4."]),       # tensors hold 8 experts
    ("n_routed_experts", 16, ["n_routed_experts=16", "mlp.experts.8."]),
    ("moe_intermediate_size", 64, ["moe_intermediate_size=64", "mlp.experts.0.gate_proj.weight"]),
    ("linear_attn_config", {"num_heads": 2, "head_dim": 64}, ["linear_attn_config.num_heads=2", L0]),
    ("vocab_size", 2048, ["vocab_size=2048", "embed_tokens.weight"]),
    ("layer_types", ["linear_attention"] * 7 + ["deepseek_sparse_attention"],
     ["layer_types[3]='kda'", "kda_layers", "layers.3.self_attn.q_a_proj.weight"]),
    ("mlp_layer_types", ["dense"] * 4 + ["sparse"] * 4, ["mlp_layer_types[3]='dense'", "layers.3.mlp.gate.weight"]),
    ("num_nextn_predict_layers", 0, ["num_hidden_layers=8", "layers.8."]),
], ids=lambda x: x if isinstance(x, str) else None)
def test_config_disagrees_with_tensors(dirs, tmp_path, field, value, parts):
    d = _clone(dirs["bf16"], tmp_path / "x")
    if field == "layer_types":
        kda = [i for i, t in enumerate(value) if t == "linear_attention"]
        _edit_config(d, layer_types=value, linear_attn_config={"num_heads": 4, "head_dim": 64, "kda_layers": kda})
    else:
        _edit_config(d, **{field: value})
    msg = _expect(d, "config field", *parts)
    assert re.search(r"in file model-\d{5}-of-\d{5}\.safetensors|in file " + re.escape(INDEX), msg), msg


def test_fp8_scale_missing(dirs, tmp_path):
    d = _clone(dirs["fp8"], tmp_path / "x")
    name = PREFIX + "layers.3.self_attn.q_b_proj.weight"
    f = _index(d)["weight_map"][name]
    _edit_index(d, lambda wm: wm.pop(scale_name(name)))
    _expect(d, scale_name(name), f, "no scale")


def test_fp8_scale_grid_wrong(dirs, tmp_path):
    d = _clone(dirs["fp8"], tmp_path / "x")
    name = L0 + "mlp.down_proj.weight"
    sn = scale_name(name)
    f = _rewrite_shard(d, sn, lambda t: t.__setitem__(sn, torch.rand(1, 1) + 0.5))
    _expect(d, sn, f, "shape [1, 1], expected [2, 4]")


def test_fp8_weight_not_fp8(dirs, tmp_path):
    d = _clone(dirs["fp8"], tmp_path / "x")
    name = L0 + "mlp.up_proj.weight"
    f = _rewrite_shard(d, name, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    _expect(d, name, f, "dtype BF16, expected F8_E4M3")


def test_fp8_scale_for_a_bf16_tensor(dirs, tmp_path):
    d = _clone(dirs["fp8"], tmp_path / "x")
    name = L0 + "self_attn.q_proj.weight"          # KDA projections are never FP8
    sn = scale_name(name)
    f = _rewrite_shard(d, name, lambda t: t.__setitem__(sn, torch.rand(2, 2)))
    _edit_index(d, lambda wm: wm.__setitem__(sn, f))
    _expect(d, sn, f, "unexpected")


def test_visual_tensors_are_ignored(dirs, tmp_path):
    d = _clone(dirs["bf16"], tmp_path / "x")
    vis = "model.visual.patch_embed.proj.weight"
    f = _rewrite_shard(d, L0 + "mlp.up_proj.weight", lambda t: t.__setitem__(vis, torch.randn(8, 3)))
    _edit_index(d, lambda wm: wm.__setitem__(vis, f))
    ck = load_checkpoint(d, progress=False)
    assert vis not in ck.weights


# ---------------------------------------------------------------------- reading only what is needed
class Recorder:
    """Stands in for safetensors.safe_open and logs every tensor read (name, slice key)."""

    def __init__(self):
        self.opened, self.reads = [], []

    def __call__(self, path, framework="pt", device="cpu"):
        self.opened.append(os.path.basename(path))
        h = safe_open(path, framework=framework, device=device)
        rec = self

        class Handle:
            def get_slice(self, name):
                sl = h.get_slice(name)

                class Slice:
                    def __getitem__(self, key):
                        rec.reads.append((name, key))
                        return sl[key]
                return Slice()
        return Handle()


class ByteCounter:
    """Stands in for open() in the checkpoint module: counts the bytes validation reads."""

    def __init__(self):
        self.bytes = 0

    def __call__(self, path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)
        counter = self

        class F:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()

            def read(self, n=-1):
                b = f.read(n)
                counter.bytes += len(b)
                return b
        return F()


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_validation_reads_headers_only(cfg, dirs, monkeypatch, fmt):
    rec, cnt = Recorder(), ByteCounter()
    monkeypatch.setattr(ck_mod, "safe_open", rec)
    monkeypatch.setattr(ck_mod, "open", cnt, raising=False)
    ck = load_checkpoint(dirs[fmt], tp_rank=1, tp_size=2, progress=False)
    files = sorted(set(_index(dirs[fmt])["weight_map"].values()))
    header_bytes = 0
    for f in files:
        with open(dirs[fmt] / f, "rb") as h:
            header_bytes += 8 + int.from_bytes(h.read(8), "little")
    assert rec.reads == [] and rec.opened == []
    assert 0 < cnt.bytes <= header_bytes
    # one lazy access reads exactly this rank's piece of that one tensor
    name = L0 + "mlp.down_proj.weight"                        # split along dim 1 (512 -> 2 x 256)
    w = ck.weights[name]
    assert rec.reads == [(name, (slice(None), slice(256, 512)))]
    assert tuple(w.shape) == (cfg.hidden_size, 256)
    rec.reads.clear()
    ck.weights[PREFIX + "norm.weight"]
    assert rec.reads == [(PREFIX + "norm.weight", slice(None))]


def test_eager_load_reads_each_piece_once(cfg, dirs, monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(ck_mod, "safe_open", rec)
    ck = load_checkpoint(dirs["fp8"], tp_rank=0, tp_size=2, lazy=False, progress=False)
    names = [n for n, _ in rec.reads]
    specs = weight_specs(cfg)
    assert len(names) == len(set(names))                      # each piece read once
    assert set(names) == set(specs) | {scale_name(n) for n, s in specs.items() if s.fp8}
    assert 0 < len(ck.scales) < sum(s.fp8 for s in specs.values())   # unaligned ones came back as bf16
    assert len(set(rec.opened)) == len(rec.opened)            # every shard opened once
    # split tensors are read as their piece only, never whole
    for name, key in rec.reads:
        spec = specs.get(name)
        if spec is not None and spec.split is not None:
            assert key != slice(None), name
    assert isinstance(ck.weights, dict) and isinstance(ck.scales, dict)
