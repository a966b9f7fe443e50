"""The checkpoint tensor list and the deterministic random weights."""
import torch

from glm53_flash.config import preset
from glm53_flash.fp8 import dequantize_fp8, quantize_fp8
from glm53_flash.weights import LM_HEAD, PREFIX, RandomWeights, weight_specs


def test_real_tensor_count_and_params():
    specs = weight_specs(preset("glm53-flash"))
    assert len(specs) == 38423                      # the vendor index's text tensors (research/model.md §2.1)
    n = sum(torch.Size(s.shape).numel() for s in specs.values())
    assert abs(n / 1e9 - 320.76) < 0.01             # 320.76 B params with E=288 (§5.1)
    assert LM_HEAD in specs and PREFIX + "layers.45.eh_proj.weight" in specs


def test_fp8_set_is_the_vendor_set():
    specs = weight_specs(preset("tiny"))
    fp8 = {n.split("layers.")[-1].split(".", 1)[-1] for n, s in specs.items() if s.fp8}
    assert "self_attn.q_proj.weight" not in fp8     # all KDA tensors stay bf16
    assert {"self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
            "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.down_proj.weight",
            "mlp.shared_experts.up_proj.weight"} <= fp8
    assert not specs[PREFIX + "layers.3.self_attn.kv_b_proj.weight"].fp8
    assert not specs[PREFIX + "layers.0.self_attn.o_proj.weight"].fp8  # KDA o_proj


def test_random_weights_deterministic_and_distinct():
    cfg = preset("tiny")
    a, b, c = RandomWeights(cfg, 1), RandomWeights(cfg, 1), RandomWeights(cfg, 2)
    name = PREFIX + "layers.1.self_attn.q_proj.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], c[name])
    assert not torch.equal(a[name], a[PREFIX + "layers.1.self_attn.k_proj.weight"])
    for n, s in a.specs.items():
        t = a[n]
        assert tuple(t.shape) == s.shape and t.dtype == s.dtype and torch.isfinite(t.float()).all(), n


def test_index_heads_are_mirrored_pairs():
    cfg = preset("tiny")
    w = RandomWeights(cfg, 0)[PREFIX + "layers.3.self_attn.indexer.wq_b.weight"].float()
    heads = w.view(cfg.index_n_heads, cfg.index_head_dim, -1)
    s = heads[1] + heads[0]                          # mirrored: small residual noise only
    assert s.norm() < 0.2 * heads[0].norm()
    assert s.norm() > 0                              # ... but not exact, so ties stay improbable


def test_fp8_roundtrip_bound():
    w = torch.randn(300, 260) * 3
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    err = (dequantize_fp8(q, s) - w).abs()
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 of the element, <= 2^-4 * block amax
    amax = w.abs().max()
    assert err.max() <= 2 ** -4 * amax


def test_rank_source_is_seeded():
    """device_weights.RankSource (time_layers' / diag_layers' random weights): a piece has the same values in every
    process and whatever pieces were made before it (diag_layers --same-as compares two processes' builds bit for
    bit), and another seed or rank gives other values."""
    import torch
    from glm53_flash.config import preset
    from glm53_flash.device_weights import RankSource
    cfg = preset("tiny")
    a, b = RankSource(cfg, 0, 2, "fp8", "cpu"), RankSource(cfg, 0, 2, "fp8", "cpu")
    names = list(a.specs)[:4]
    for n in names:                                         # made in the opposite order in b
        a.get(n)
    for n in reversed(names):
        assert torch.equal(b.get(n)[0].view(torch.uint8), a.get(n)[0].view(torch.uint8))
        if a.get(n)[1] is not None:
            assert torch.equal(b.get(n)[1], a.get(n)[1])
    for other in (RankSource(cfg, 0, 2, "fp8", "cpu", seed=1), RankSource(cfg, 1, 2, "fp8", "cpu")):
        assert not torch.equal(other.get(names[0])[0].float(), a.get(names[0])[0].float())
