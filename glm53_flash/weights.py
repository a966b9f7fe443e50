"""The tensor list of a GLM-5.3-Flash checkpoint (HF names, shapes, dtypes, FP8-ness, TP split rule)
and deterministic random weights for it.

`weight_specs(config)` is the single source of truth for what a checkpoint holds: the writer, the
loader's validation, TP sharding and the reference all read it. Names follow the vendor layout
(research/model.md §6.1): text tower under `model.language_model.`, `lm_head.weight` at top level,
the MTP block stored as layer `num_hidden_layers`.

`RandomWeights(config, seed)` is a lazy mapping name -> tensor: each tensor is generated on first
access from (seed, name) alone, so a 288-expert layer never has to exist in memory at once and the
same name always gives the same values. Scales keep activations O(1) through all layers: linear
weights ~ N(0, 1/fan_in), residual-writing projections a little smaller, norms near 1, mHC
projections small, and indexer query heads as sign-mirrored pairs plus noise (ReLU then rarely makes
exact-zero pool scores, so top-k ties are improbable; DESIGN.md §7).
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from .config import GlmConfig

PREFIX = "model.language_model."
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype          # on-disk dtype in a bf16 checkpoint (bf16 or fp32)
    fp8: bool                   # stored FP8 e4m3 + weight_scale_inv in an FP8 checkpoint
    split: int | None           # TP: dimension split contiguously across ranks, None = replicated
    init: str                   # random init rule (see _init)
    fan_in: int = 1


def _layer(i: int) -> str:
    return f"{PREFIX}layers.{i}."


def _mha_specs(cfg: GlmConfig, p: str) -> list[TensorSpec]:
    """DSA sub-layer: low-rank q / kv, absorbed NoPE MLA, kpool indexer."""
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    bf = torch.bfloat16
    a = p + "self_attn."
    ix = a + "indexer."
    return [
        TensorSpec(a + "q_a_proj.weight", (cfg.q_lora_rank, H), bf, True, None, "linear", H),
        TensorSpec(a + "q_a_layernorm.weight", (cfg.q_lora_rank,), bf, False, None, "norm"),
        TensorSpec(a + "q_b_proj.weight", (nh * cfg.qk_head_dim, cfg.q_lora_rank), bf, True, 0, "linear",
                   cfg.q_lora_rank),
        TensorSpec(a + "kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), bf, True, None,
                   "linear", H),
        TensorSpec(a + "kv_a_layernorm.weight", (cfg.kv_lora_rank,), bf, False, None, "norm"),
        TensorSpec(a + "kv_b_proj.weight", (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), bf,
                   False, 0, "linear", cfg.kv_lora_rank),
        TensorSpec(a + "o_proj.weight", (H, nh * cfg.v_head_dim), bf, True, 1, "residual", nh * cfg.v_head_dim),
        TensorSpec(ix + "wq_b.weight", (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank), bf, False, None,
                   "mirrored_heads", cfg.q_lora_rank),
        TensorSpec(ix + "wk.weight", (cfg.index_head_dim, H), bf, False, None, "linear", H),
        TensorSpec(ix + "k_norm.weight", (cfg.index_head_dim,), bf, False, None, "norm"),
        TensorSpec(ix + "k_norm.bias", (cfg.index_head_dim,), bf, False, None, "bias"),
        TensorSpec(ix + "weights_proj.weight", (cfg.index_n_heads, H), bf, False, None, "linear", H),
        TensorSpec(ix + "index_kpool_compress_gate", (cfg.index_head_dim, H), bf, False, None, "linear", H),
        TensorSpec(ix + "index_kpool_compress_ape", (cfg.index_kpool, cfg.index_head_dim), bf, False, None, "small"),
    ]


def _kda_specs(cfg: GlmConfig, p: str) -> list[TensorSpec]:
    H, nh, d, D = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.kda_dim
    f32, bf = torch.float32, torch.bfloat16
    a = p + "self_attn."
    out = []
    for n in "qkv":
        out.append(TensorSpec(a + f"{n}_proj.weight", (D, H), bf, False, 0, "linear", H))
    for n in "qkv":
        out.append(TensorSpec(a + f"{n}_conv1d.weight", (D, 1, cfg.linear_conv_kernel_dim), f32, False, 0, "conv"))
    out += [
        TensorSpec(a + "f_a_proj.weight", (d, H), bf, False, None, "linear", H),
        TensorSpec(a + "f_b_proj.weight", (D, d), bf, False, 0, "linear", d),
        TensorSpec(a + "g_a_proj.weight", (d, H), bf, False, None, "linear", H),
        TensorSpec(a + "g_b_proj.weight", (D, d), bf, False, 0, "linear", d),
        TensorSpec(a + "b_proj.weight", (nh, H), bf, False, 0, "linear", H),
        TensorSpec(a + "A_log", (nh,), f32, False, 0, "a_log"),
        TensorSpec(a + "dt_bias", (D,), f32, False, 0, "small"),
        TensorSpec(a + "o_norm.weight", (d,), bf, False, None, "norm"),
        TensorSpec(a + "o_proj.weight", (H, D), bf, False, 1, "residual", D),
    ]
    return out


def _mlp_specs(p: str, H: int, inter: int) -> list[TensorSpec]:
    bf = torch.bfloat16
    return [
        TensorSpec(p + "gate_proj.weight", (inter, H), bf, True, 0, "linear", H),
        TensorSpec(p + "up_proj.weight", (inter, H), bf, True, 0, "linear", H),
        TensorSpec(p + "down_proj.weight", (H, inter), bf, True, 1, "residual", inter),
    ]


def _moe_specs(cfg: GlmConfig, p: str) -> list[TensorSpec]:
    H, E = cfg.hidden_size, cfg.n_routed_experts
    f32 = torch.float32
    m = p + "mlp."
    out = [
        TensorSpec(m + "gate.weight", (E, H), f32, False, None, "linear", H),
        TensorSpec(m + "gate.e_score_correction_bias", (E,), f32, False, None, "small"),
    ]
    for e in range(E):
        out += _mlp_specs(f"{m}experts.{e}.", H, cfg.moe_intermediate_size)
    out += _mlp_specs(m + "shared_experts.", H, cfg.moe_intermediate_size * cfg.n_shared_experts)
    return out


def _hc_specs(cfg: GlmConfig, p: str) -> list[TensorSpec]:
    f32 = torch.float32
    out = []
    for site in ("attn", "ffn"):
        out += [
            TensorSpec(p + f"hc_{site}_fn", (cfg.hc_dim, cfg.hc_mult * cfg.hidden_size), f32, False, None, "hc_fn",
                       cfg.hc_mult * cfg.hidden_size),
            TensorSpec(p + f"hc_{site}_base", (cfg.hc_dim,), f32, False, None, "small"),
            TensorSpec(p + f"hc_{site}_scale", (3,), f32, False, None, "norm"),
        ]
    return out


def layer_specs(cfg: GlmConfig, i: int) -> list[TensorSpec]:
    """Tensors of trunk layer i (0 <= i < num_hidden_layers) or of the MTP block (i == num_hidden_layers)."""
    H, bf = cfg.hidden_size, torch.bfloat16
    p = _layer(i)
    out = [TensorSpec(p + "input_layernorm.weight", (H,), bf, False, None, "norm"),
           TensorSpec(p + "post_attention_layernorm.weight", (H,), bf, False, None, "norm")]
    if i == cfg.num_hidden_layers:       # MTP block: DSA + MoE, no mHC
        out += [TensorSpec(p + "enorm.weight", (H,), bf, False, None, "norm"),
                TensorSpec(p + "hnorm.weight", (H,), bf, False, None, "norm"),
                TensorSpec(p + "eh_proj.weight", (H, 2 * H), bf, False, None, "linear", 2 * H),
                TensorSpec(p + "shared_head.norm.weight", (H,), bf, False, None, "norm")]
        return out + _mha_specs(cfg, p) + _moe_specs(cfg, p)
    out += _hc_specs(cfg, p)
    out += _kda_specs(cfg, p) if cfg.layer_types[i] == "kda" else _mha_specs(cfg, p)
    if cfg.mlp_layer_types[i] == "dense":
        out += _mlp_specs(p + "mlp.", H, cfg.intermediate_size)
    else:
        out += _moe_specs(cfg, p)
    return out


def weight_specs(cfg: GlmConfig) -> dict[str, TensorSpec]:
    """Every tensor of a checkpoint, in file order (embed, layers, MTP, norm, lm_head)."""
    H, V, bf = cfg.hidden_size, cfg.vocab_size, torch.bfloat16
    specs = [TensorSpec(PREFIX + "embed_tokens.weight", (V, H), bf, False, None, "embed")]
    n_layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    for i in range(n_layers):
        specs += layer_specs(cfg, i)
    specs += [TensorSpec(PREFIX + "norm.weight", (H,), bf, False, None, "norm"),
              TensorSpec(LM_HEAD, (V, H), bf, False, 0, "linear", H)]
    return {s.name: s for s in specs}


def scale_name(name: str) -> str:
    """Companion FP8 scale of `...weight`: `...weight_scale_inv`."""
    return name + "_scale_inv"


# ---------------------------------------------------------------------- random init
def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF)
    return g


def _randn(shape, g) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float32)


def random_tensor(spec: TensorSpec, seed: int, cfg: GlmConfig) -> torch.Tensor:
    """Deterministic random value of one tensor (a function of seed and name only)."""
    g = _generator(seed, spec.name)
    s = spec.shape
    r = spec.init
    if r == "linear":
        w = _randn(s, g) / math.sqrt(spec.fan_in)
    elif r == "residual":                      # writes into the mHC streams: keep the increments modest
        w = _randn(s, g) * (0.5 / math.sqrt(spec.fan_in))
    elif r == "embed":
        w = _randn(s, g)
    elif r == "norm":
        w = 1.0 + 0.1 * _randn(s, g)
    elif r == "bias":
        w = 0.1 * _randn(s, g)
    elif r == "small":
        w = 0.5 * _randn(s, g)
    elif r == "conv":
        w = 0.5 * _randn(s, g)
    elif r == "a_log":
        w = 0.5 * _randn(s, g)
    elif r == "hc_fn":
        w = _randn(s, g) * (0.5 / math.sqrt(spec.fan_in))
    elif r == "mirrored_heads":
        # head 2j+1 = -(head 2j) + noise: for every pool one of the pair scores > 0 after ReLU
        d = cfg.index_head_dim
        w = _randn(s, g) / math.sqrt(spec.fan_in)
        heads = w.view(-1, d, s[1])
        n_pairs = heads.shape[0] // 2
        noise = 0.1 * _randn((n_pairs, d, s[1]), g) / math.sqrt(spec.fan_in)
        heads[1:2 * n_pairs:2] = -heads[0:2 * n_pairs:2] + noise
        w = heads.view(s)
    else:
        raise AssertionError(f"unknown init rule {r!r} for {spec.name}")
    return w.to(spec.dtype).contiguous()


class RandomWeights(Mapping):
    """Lazy name -> tensor mapping of random weights (bf16/fp32 as `weight_specs` says).

    Tensors are generated on access and cached only if `cache=True`.
    """

    def __init__(self, cfg: GlmConfig, seed: int = 0, cache: bool = False):
        self.cfg, self.seed, self.specs = cfg, seed, weight_specs(cfg)
        self._cache: dict[str, torch.Tensor] | None = {} if cache else None

    def __getitem__(self, name: str) -> torch.Tensor:
        if self._cache is not None and name in self._cache:
            return self._cache[name]
        try:
            spec = self.specs[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this config") from None
        t = random_tensor(spec, self.seed, self.cfg)
        if self._cache is not None:
            self._cache[name] = t
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


class Fp8Weights(Mapping):
    """The FP8 checkpoint of `source` in memory: every fp8=True spec as e4m3 (fp8.quantize_fp8, 128x128
    blocks), every other tensor as `source` has it; `scales` maps each FP8 name to its weight_scale_inv
    grid (what the launches' `scales=` takes). The same values make_random_checkpoint(weights="fp8")
    writes, without the files. Lazy and cached."""

    def __init__(self, source: Mapping, cfg: GlmConfig):
        self.source, self.specs = source, weight_specs(cfg)
        self._q: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scales = _Fp8Scales(self)

    def _quant(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        if name not in self._q:
            from .fp8 import quantize_fp8
            self._q[name] = quantize_fp8(self.source[name])
        return self._q[name]

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self.specs.get(name)
        if spec is not None and spec.fp8:
            return self._quant(name)[0]
        return self.source[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.source)

    def __len__(self) -> int:
        return len(self.source)


class _Fp8Scales(Mapping):
    def __init__(self, w: Fp8Weights):
        self.w = w

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self.w.specs.get(name)
        if spec is None or not spec.fp8:
            raise KeyError(name)
        return self.w._quant(name)[1]

    def __contains__(self, name) -> bool:
        spec = self.w.specs.get(name)
        return spec is not None and spec.fp8

    def __iter__(self) -> Iterator[str]:
        return (n for n, s in self.w.specs.items() if s.fp8)

    def __len__(self) -> int:
        return sum(1 for s in self.w.specs.values() if s.fp8)
