"""TP split rules (glm53_flash.tp) and TP-rank loading of checkpoints (DESIGN.md §6).

Shards of every tensor reassemble to the full tensor; FP8 scale grids slice with their weight when the
split is 128-aligned (a cut-down config with 1024-multiple dims) and otherwise the rank gets bf16; a
checkpoint loaded at (rank r, size t) holds exactly shard(spec, full, r, t).
"""
from __future__ import annotations

import pytest
import torch

from glm53_flash import tp
from glm53_flash.checkpoint import CheckpointError, load_checkpoint, make_random_checkpoint
from glm53_flash.config import ConfigError, preset
from glm53_flash.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8
from glm53_flash.weights import RandomWeights, weight_specs


def aligned_config():
    """Two layers (KDA + dense, DSA + MoE), 8 experts, every split dim a multiple of 1024: 128-aligned at TP8."""
    return preset("tiny").replace(
        vocab_size=1024, hidden_size=1024, num_hidden_layers=2, layer_types=["kda", "dsa"],
        mlp_layer_types=["dense", "moe"], linear_num_heads=8, linear_head_dim=128, num_attention_heads=8,
        num_key_value_heads=8, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=1024,
        moe_intermediate_size=1024, n_routed_experts=8, q_lora_rank=256, kv_lora_rank=128)


def _skip_middle_experts(name):
    # experts 1..6 of the aligned config repeat experts 0 and 7; skipping them keeps the tests fast
    return any(f"experts.{e}." in name for e in range(1, 7))


class Quantized(dict):
    """name -> quantize_fp8(weights[name]), computed once per name."""

    def __init__(self, rw):
        super().__init__()
        self.rw = rw

    def __missing__(self, name):
        self[name] = quantize_fp8(self.rw[name])
        return self[name]


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    return cfg, weight_specs(cfg), RandomWeights(cfg, seed=11, cache=True)


@pytest.fixture(scope="module")
def aligned():
    cfg = aligned_config()
    rw = RandomWeights(cfg, seed=6, cache=True)
    return cfg, weight_specs(cfg), rw, Quantized(rw)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    cfg = preset("tiny")
    root = tmp_path_factory.mktemp("tp_tiny")
    return {w: make_random_checkpoint(cfg, root / w, seed=5, weights=w, progress=False) for w in ("bf16", "fp8")}


@pytest.fixture(scope="session")
def aligned_fp8_dir(tmp_path_factory):
    return make_random_checkpoint(aligned_config(), tmp_path_factory.mktemp("tp_aligned") / "fp8", seed=6,
                                  weights="fp8", progress=False)


def _rule(spec):
    return f"split{spec.split}-{len(spec.shape)}d"


@pytest.mark.parametrize("size", [2, 4])
def test_tiny_shards_reassemble(tiny, size):
    cfg, specs, rw = tiny
    cfg.check_tp(size)
    rules = set()
    for name, spec in specs.items():
        full = rw[name]
        pieces = [tp.shard(spec, full, r, size) for r in range(size)]
        assert torch.equal(tp.unshard(spec, pieces), full), name
        rules.add(_rule(spec))
        if spec.split is None:
            assert all(p is full for p in pieces)
            continue
        n = spec.shape[spec.split] // size
        for r, p in enumerate(pieces):
            assert p.shape[spec.split] == n and p.is_contiguous()
            dim, start, stop = tp.shard_range(spec, r, size)
            assert (dim, start, stop) == (spec.split, r * n, (r + 1) * n)
            assert torch.equal(p, full.narrow(dim, start, n))
        assert not torch.equal(pieces[0], pieces[1]), name     # distinct pieces, not copies
    # every kind of split the model uses: replicated, rows, columns, 1-D vectors, 3-D conv weights
    assert {"splitNone-1d", "splitNone-2d", "split0-1d", "split0-2d", "split1-2d", "split0-3d"} <= rules


@pytest.mark.parametrize("size", [2, 4, 8])
def test_aligned_shards_reassemble(aligned, size):
    cfg, specs, rw, _ = aligned
    cfg.check_tp(size)
    for name, spec in specs.items():
        if _skip_middle_experts(name):
            continue
        full = rw[name]
        assert torch.equal(tp.unshard(spec, [tp.shard(spec, full, r, size) for r in range(size)]), full), name


@pytest.mark.parametrize("size", [2, 4, 8])
def test_fp8_scales_slice_with_aligned_weight(aligned, size):
    cfg, specs, rw, quant = aligned
    fp8 = [s for s in specs.values() if s.fp8]
    assert {s.split for s in fp8} == {None, 0, 1}
    for spec in fp8:
        assert tp.fp8_keeps_scales(spec, size)
        if _skip_middle_experts(spec.name):
            continue
        w = rw[spec.name]
        q, s = quant[spec.name]
        qs, ss = zip(*(tp.shard_fp8(spec, q, s, r, size) for r in range(size)))
        for r in range(size):
            assert qs[r].dtype == FP8_DTYPE and ss[r] is not None
            if r not in (0, size - 1):
                continue
            # blocks do not straddle ranks: quantizing the rank's piece alone gives the same bits and scales
            q_r, s_r = quantize_fp8(tp.shard(spec, w, r, size))
            assert torch.equal(qs[r].view(torch.uint8), q_r.view(torch.uint8)), spec.name
            assert torch.equal(ss[r], s_r), spec.name
            assert torch.equal(dequantize_fp8(qs[r], ss[r]), tp.shard(spec, dequantize_fp8(q, s), r, size))
        if spec.split is not None:
            assert torch.equal(torch.cat(ss, spec.split), s)
            assert torch.equal(tp.unshard(spec, [x.view(torch.uint8) for x in qs]), q.view(torch.uint8))


def test_fp8_unaligned_split_dequantizes_to_bf16(tiny):
    cfg, specs, rw = tiny
    unaligned = [s for s in specs.values() if s.fp8 and not tp.fp8_keeps_scales(s, 2)]
    assert {s.split for s in unaligned} == {0, 1}          # e.g. q_b rows, expert down columns
    for spec in unaligned:
        q, s = quantize_fp8(rw[spec.name])
        ref = dequantize_fp8(q, s)
        with pytest.raises(tp.TPError, match=spec.name.replace(".", r"\.")):
            tp.shard_scale(spec, s, 0, 2)
        for r in range(2):
            piece, scale = tp.shard_fp8(spec, q, s, r, 2)
            assert scale is None and piece.dtype == torch.bfloat16
            assert torch.equal(piece, tp.shard(spec, ref, r, 2).to(torch.bfloat16)), spec.name
    # TP=1 and replicated FP8 tensors always keep their scales
    assert all(tp.fp8_keeps_scales(s, 1) for s in specs.values() if s.fp8)
    assert all(tp.fp8_keeps_scales(s, 8) for s in specs.values() if s.fp8 and s.split is None)


def test_dequantize_piece_at_odd_offsets():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(300, 260, generator=g) * torch.rand(300, 1, generator=g) * 4
    q, s = quantize_fp8(w)
    ref = dequantize_fp8(q, s)
    for dim, start, stop in ((0, 70, 200), (1, 5, 259), (0, 127, 129), (1, 128, 256)):
        b0, b1 = start // 128, (stop - 1) // 128 + 1
        got = tp.dequantize_piece(q.narrow(dim, start, stop - start), s.narrow(dim, b0, b1 - b0), dim, start,
                                  q.shape[1 - dim], dtype=torch.float32)
        assert torch.equal(got, ref.narrow(dim, start, stop - start))


def test_bad_splits_are_refused(tiny):
    cfg, specs, rw = tiny
    b_proj = next(s for n, s in specs.items() if n.endswith("layers.0.self_attn.b_proj.weight"))
    with pytest.raises(ConfigError, match="linear_attn_config.num_heads=4"):
        cfg.check_tp(8)
    with pytest.raises(tp.TPError, match=r"b_proj.*not divisible by tp_size=8"):
        tp.shard(b_proj, rw[b_proj.name], 0, 8)
    with pytest.raises(tp.TPError, match="tp_size=3"):
        tp.shard_range(b_proj, 0, 3)
    with pytest.raises(tp.TPError, match="tp_rank=2"):
        tp.shard_range(b_proj, 2, 2)
    with pytest.raises(tp.TPError, match=r"shape \[4, 255\]"):
        tp.shard(b_proj, torch.randn(4, 255), 0, 2)
    pieces = [tp.shard(b_proj, rw[b_proj.name], r, 2) for r in range(2)]
    with pytest.raises(tp.TPError, match="got 3 shards"):
        tp.unshard(b_proj, pieces + pieces[:1])
    with pytest.raises(tp.TPError, match="shard 1 has shape"):
        tp.unshard(b_proj, [pieces[0], pieces[1][:1]])


def test_load_refuses_tp_the_config_cannot_split(tiny_dirs):
    with pytest.raises(CheckpointError, match="linear_attn_config.num_heads=4 is not divisible by tp=8"):
        load_checkpoint(tiny_dirs["bf16"], tp_rank=0, tp_size=8)
    with pytest.raises(CheckpointError, match="tp_rank=2"):
        load_checkpoint(tiny_dirs["bf16"], tp_rank=2, tp_size=2)


@pytest.fixture(scope="module")
def tiny5():
    cfg = preset("tiny")
    rw = RandomWeights(cfg, seed=5, cache=True)
    return weight_specs(cfg), rw, Quantized(rw)


@pytest.mark.parametrize("size", [2, 4])
def test_load_rank_bf16_is_shard_of_full(tiny_dirs, tiny5, size):
    specs, rw, _ = tiny5
    for r in range(size):
        ck = load_checkpoint(tiny_dirs["bf16"], tp_rank=r, tp_size=size, lazy=r % 2 == 0, progress=False)
        assert (ck.tp_rank, ck.tp_size, ck.format) == (r, size, "bf16")
        assert set(ck.weights) == set(specs) and len(ck.scales) == 0
        for name, spec in specs.items():
            assert torch.equal(ck.weights[name], tp.shard(spec, rw[name], r, size)), (name, r)


def test_load_rank_fp8_unaligned(tiny_dirs, tiny5):
    specs, rw, quant = tiny5
    for r in range(2):
        ck = load_checkpoint(tiny_dirs["fp8"], tp_rank=r, tp_size=2, progress=False)
        assert set(ck.scales) == {n for n, s in specs.items() if s.fp8 and tp.fp8_keeps_scales(s, 2)}
        assert 0 < len(ck.scales) < sum(s.fp8 for s in specs.values())
        deq = ck.dequantized()
        for name, spec in specs.items():
            if not spec.fp8:
                assert torch.equal(ck.weights[name], tp.shard(spec, rw[name], r, 2)), name
                continue
            q, s = quant[name]
            piece, scale = tp.shard_fp8(spec, q, s, r, 2)
            got = ck.weights[name]
            assert got.dtype == piece.dtype
            assert torch.equal(got.view(torch.uint8) if got.dtype == FP8_DTYPE else got,
                               piece.view(torch.uint8) if piece.dtype == FP8_DTYPE else piece), name
            if scale is not None:
                assert torch.equal(ck.scales[name], scale), name
            assert torch.allclose(deq[name].float(), tp.shard(spec, dequantize_fp8(q, s), r, 2), rtol=2 ** -8,
                                  atol=0), name


@pytest.mark.parametrize("size", [2, 8])
def test_load_rank_fp8_aligned(aligned, aligned_fp8_dir, size):
    cfg, specs, rw, quant = aligned
    for r in (0, size - 1):
        ck = load_checkpoint(aligned_fp8_dir, tp_rank=r, tp_size=size, lazy=r == 0, progress=False)
        assert set(ck.scales) == {n for n, s in specs.items() if s.fp8}
        for name in ck.scales:
            if _skip_middle_experts(name):
                continue
            spec = specs[name]
            q, s = quant[name]
            assert torch.equal(ck.weights[name].view(torch.uint8), tp.shard(spec, q, r, size).view(torch.uint8))
            assert torch.equal(ck.scales[name], tp.shard_scale(spec, s, r, size)), name
        for name, spec in specs.items():
            if not spec.fp8 and not _skip_middle_experts(name):
                assert torch.equal(ck.weights[name], tp.shard(spec, rw[name], r, size)), name
