"""Model configuration of GLM-5.3-Flash (`glm5_next`) and the derived layer plan.

The config is built from an HF `config.json` (nested `text_config` of a `glm5_next` model, or a flat
text config) and validated field by field: every value the runtime depends on is checked here, once,
with an error that names the field and the offending value. The layer plan (mixer, FFN and launch kind
of every layer) is derived here so that no other module re-derives it from raw lists.

Layer lists in GLM's config are 0-based (`layer_idx in kda_layers`), unlike Kimi-Linear's 1-based ones.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from dataclasses import dataclass, field

# Both spellings of the sparse layer type occur: the checkpoint's `deepseek_sparse_attention` and the
# newer transformers' `indexed_attention` (older files also say `full_attention`).
SPARSE_LAYER_TYPES = ("deepseek_sparse_attention", "indexed_attention", "full_attention")
LINEAR_LAYER_TYPES = ("linear_attention",)
DENSE_MLP_TYPES = ("dense",)
MOE_MLP_TYPES = ("sparse", "moe")

LAUNCH_KINDS = ("embed", "dense", "kda", "sparse", "tail", "nextn")


class ConfigError(ValueError):
    """A config.json field is missing or holds a value the runtime cannot run."""


@dataclass(frozen=True)
class LayerPlan:
    index: int    # 0-based layer index
    mixer: str    # "kda" | "dsa"
    ffn: str      # "dense" | "moe"
    launch: str   # "embed" | "dense" | "kda" | "sparse"


@dataclass
class GlmConfig:
    # trunk
    vocab_size: int = 154880
    hidden_size: int = 4096
    num_hidden_layers: int = 45
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    pad_token_id: int | None = 154820
    eos_token_id: list[int] = field(default_factory=lambda: [154820, 154827, 154829])
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    # per-layer schedule (normalised: mixers "kda"|"dsa", ffns "dense"|"moe")
    layer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)
    # KDA (linear attention)
    linear_num_heads: int = 64
    linear_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    linear_lower_bound: float = -5.0
    # MLA (sparse attention layers)
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 256
    qk_rope_head_dim: int = 0
    v_head_dim: int = 256
    # kpool indexer
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_kpool: int = 4
    index_kpool_always_select_tail: bool = True
    # FFN
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    n_routed_experts: int = 288
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    swiglu_limit: float = 10.0
    # mHC hyper-connections
    hc_mult: int = 4
    hc_eps: float = 1e-6
    hc_sinkhorn_iters: int = 20
    # NextN / MTP
    num_nextn_predict_layers: int = 1
    # the raw HF dict this was read from (written back verbatim by the checkpoint writer)
    raw: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        n = self.num_hidden_layers
        if not self.layer_types:
            self.layer_types = ["dsa" if i % 4 == 3 else "kda" for i in range(n)]
        if not self.mlp_layer_types:
            self.mlp_layer_types = ["dense" if i < 3 else "moe" for i in range(n)]
        self.validate()

    # ---------------------------------------------------------------- derived shapes
    @property
    def kda_dim(self) -> int:            # width of each of q, k, v in a KDA layer
        return self.linear_num_heads * self.linear_head_dim

    @property
    def kda_inproj_rows(self) -> int:    # fused q|k|v|b|f_a|g_a rows
        return 3 * self.kda_dim + self.linear_num_heads + 2 * self.linear_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def hc_dim(self) -> int:             # rows of hc_fn: pre (m) + post (m) + comb (m*m)
        return self.hc_mult * (2 + self.hc_mult)

    @property
    def index_topk_pools(self) -> int:
        return self.index_topk // self.index_kpool

    @property
    def index_width(self) -> int:        # selected tokens incl. the always-selected tail
        return self.index_topk + self.index_kpool - 1

    # ---------------------------------------------------------------- layer plan
    @property
    def layers(self) -> list[LayerPlan]:
        plans = []
        for i in range(self.num_hidden_layers):
            mixer, ffn = self.layer_types[i], self.mlp_layer_types[i]
            if i == 0:
                launch = "embed"
            elif mixer == "dsa":
                launch = "sparse"
            elif ffn == "dense":
                launch = "dense"
            else:
                launch = "kda"
            plans.append(LayerPlan(i, mixer, ffn, launch))
        return plans

    @property
    def kda_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "kda"]

    @property
    def dsa_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "dsa"]

    @property
    def launch_plan(self) -> list[str]:
        """Launch kinds of one decode step, in order: one per layer, then tail (and nextn)."""
        kinds = [p.launch for p in self.layers] + ["tail"]
        if self.num_nextn_predict_layers:
            kinds.append("nextn")
        return kinds

    # ---------------------------------------------------------------- validation
    def validate(self) -> None:
        json_names = {"linear_num_heads": "linear_attn_config.num_heads",
                      "linear_head_dim": "linear_attn_config.head_dim",
                      "linear_conv_kernel_dim": "linear_attn_config.short_conv_kernel_size"}

        def need(cond: bool, name: str, value, why: str):
            if not cond:   # name the field as config.json spells it
                raise ConfigError(f"config field {json_names.get(name, name)}={value!r}: {why}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "linear_num_heads", "linear_head_dim",
                     "linear_conv_kernel_dim", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
                     "qk_nope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
                     "index_kpool", "intermediate_size", "moe_intermediate_size", "n_routed_experts",
                     "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, v, "must be a positive integer")
        for name in ("rms_norm_eps", "hc_eps", "routed_scaling_factor", "swiglu_limit"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0, name, v,
                 "must be a positive number")
        need(isinstance(self.linear_lower_bound, (int, float)) and self.linear_lower_bound < 0,
             "linear_attn_config.gate_lower_bound", self.linear_lower_bound,
             "must be a negative number (the decay is lower_bound * sigmoid(...))")
        need(self.hidden_act == "silu", "hidden_act", self.hidden_act, "only silu is supported")
        need(not self.tie_word_embeddings, "tie_word_embeddings", self.tie_word_embeddings,
             "GLM-5.3-Flash has an untied lm_head")
        need(self.qk_rope_head_dim == 0, "qk_rope_head_dim", self.qk_rope_head_dim,
             "GLM-5.3-Flash attention is NoPE (must be 0)")
        need(self.num_key_value_heads == self.num_attention_heads, "num_key_value_heads",
             self.num_key_value_heads, f"must equal num_attention_heads={self.num_attention_heads}")
        need(self.v_head_dim == self.qk_nope_head_dim, "v_head_dim", self.v_head_dim,
             f"absorbed MLA needs v_head_dim == qk_nope_head_dim={self.qk_nope_head_dim}")
        need(self.index_topk % self.index_kpool == 0, "index_topk", self.index_topk,
             f"must be divisible by index_kpool={self.index_kpool}")
        need(self.num_experts_per_tok <= self.n_routed_experts, "num_experts_per_tok",
             self.num_experts_per_tok, f"must be <= n_routed_experts={self.n_routed_experts}")
        need(self.n_shared_experts == 1, "n_shared_experts", self.n_shared_experts, "exactly one shared expert")
        need(self.scoring_func == "sigmoid", "scoring_func", self.scoring_func, "only sigmoid routing")
        need(self.n_group == 1, "n_group", self.n_group, "grouped routing is not supported (must be 1)")
        need(self.topk_group == 1, "topk_group", self.topk_group, "grouped routing is not supported (must be 1)")
        need(self.hc_mult == 4, "hc_mult", self.hc_mult, "the kernels are built for 4 mHC streams")
        need(self.num_nextn_predict_layers in (0, 1), "num_nextn_predict_layers", self.num_nextn_predict_layers,
             "0 or 1 MTP block")
        need(self.hidden_size % 128 == 0, "hidden_size", self.hidden_size, "must be a multiple of 128")
        n = self.num_hidden_layers
        need(len(self.layer_types) == n, "layer_types", self.layer_types, f"needs {n} entries")
        need(len(self.mlp_layer_types) == n, "mlp_layer_types", self.mlp_layer_types, f"needs {n} entries")
        for i, t in enumerate(self.layer_types):
            need(t in ("kda", "dsa"), f"layer_types[{i}]", t, "unknown layer type")
        for i, t in enumerate(self.mlp_layer_types):
            need(t in ("dense", "moe"), f"mlp_layer_types[{i}]", t, "unknown mlp type")
        need(self.layer_types[0] == "kda", "layer_types[0]", self.layer_types[0],
             "the embed launch fuses layer 0, which must be a KDA layer")
        if self.eos_token_id is not None:
            for t in self.eos_token_id:
                need(isinstance(t, int) and 0 <= t < self.vocab_size, "eos_token_id", self.eos_token_id,
                     f"ids must lie in [0, vocab_size={self.vocab_size})")
        if self.pad_token_id is not None:
            need(0 <= self.pad_token_id < self.vocab_size, "pad_token_id", self.pad_token_id,
                 f"must lie in [0, vocab_size={self.vocab_size})")

    def check_tp(self, tp: int) -> None:
        """Refuse a tensor-parallel degree the shapes cannot be split by (DESIGN.md §6)."""
        if tp not in (1, 2, 4, 8):
            raise ConfigError(f"tp={tp}: must be 1, 2, 4 or 8")
        for name, v in (("linear_attn_config.num_heads", self.linear_num_heads), ("num_attention_heads", self.num_attention_heads),
                        ("intermediate_size", self.intermediate_size),
                        ("moe_intermediate_size", self.moe_intermediate_size), ("vocab_size", self.vocab_size)):
            if v % tp:
                raise ConfigError(f"config field {name}={v} is not divisible by tp={tp}")

    # ---------------------------------------------------------------- I/O
    @classmethod
    def from_hf_dict(cls, d: dict) -> "GlmConfig":
        """Build from an HF config dict: `glm5_next` (nested `text_config`) or a flat text config."""
        if not isinstance(d, dict):
            raise ConfigError(f"config must be a JSON object, got {type(d).__name__}")
        raw = copy.deepcopy(d)
        top = d
        if "text_config" in d:
            t = d["text_config"]
            if not isinstance(t, dict):
                raise ConfigError(f"config field text_config={t!r}: must be an object")
        else:
            t = d
        mt = top.get("model_type", t.get("model_type"))
        if mt is not None and mt not in ("glm5_next", "glm5_next_text"):
            raise ConfigError(f"config field model_type={mt!r}: expected 'glm5_next' or 'glm5_next_text'")

        kw = {}
        names = {f.name for f in dataclasses.fields(cls)} - {"raw", "layer_types", "mlp_layer_types",
                                                             "eos_token_id"}
        for name in names:
            if name in t:
                kw[name] = t[name]
        if "tie_word_embeddings" in top and "tie_word_embeddings" not in t:
            kw["tie_word_embeddings"] = top["tie_word_embeddings"]
        eos = t.get("eos_token_id", top.get("eos_token_id"))
        if eos is not None:
            kw["eos_token_id"] = [eos] if isinstance(eos, int) else list(eos)
        else:
            kw["eos_token_id"] = []

        la = t.get("linear_attn_config")
        n = t.get("num_hidden_layers", cls.num_hidden_layers)
        if la is not None:
            if not isinstance(la, dict):
                raise ConfigError(f"config field linear_attn_config={la!r}: must be an object")
            for src, dst in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim"),
                             ("short_conv_kernel_size", "linear_conv_kernel_dim"),
                             ("gate_lower_bound", "linear_lower_bound")):
                if src in la and la[src] is not None:
                    kw[dst] = la[src]
        # layer types: explicit list wins; else the 0-based kda_layers list; else the i % 4 == 3 default
        lt = t.get("layer_types")
        if lt is not None:
            if not isinstance(lt, list):
                raise ConfigError(f"config field layer_types={lt!r}: must be a list")
            mixers = []
            for i, x in enumerate(lt):
                if x in LINEAR_LAYER_TYPES:
                    mixers.append("kda")
                elif x in SPARSE_LAYER_TYPES:
                    mixers.append("dsa")
                else:
                    raise ConfigError(f"config field layer_types[{i}]={x!r}: expected one of "
                                      f"{LINEAR_LAYER_TYPES + SPARSE_LAYER_TYPES}")
            kw["layer_types"] = mixers
        elif la is not None and la.get("kda_layers") is not None and isinstance(n, int):
            kl = la["kda_layers"]
            if not all(isinstance(i, int) and 0 <= i < n for i in kl):
                raise ConfigError(f"config field linear_attn_config.kda_layers={kl!r}: 0-based indices in [0, {n})")
            kw["layer_types"] = ["kda" if i in kl else "dsa" for i in range(n)]
        if la is not None and la.get("kda_layers") is not None and "layer_types" in kw:
            kl = la["kda_layers"]
            derived = [i for i, m in enumerate(kw["layer_types"]) if m == "kda"]
            if sorted(kl) != derived:
                raise ConfigError(f"config field linear_attn_config.kda_layers={kl!r} disagrees with layer_types "
                                  f"(KDA at {derived}); GLM lists are 0-based")
        mt_list = t.get("mlp_layer_types")
        if mt_list is not None:
            if not isinstance(mt_list, list):
                raise ConfigError(f"config field mlp_layer_types={mt_list!r}: must be a list")
            ffns = []
            for i, x in enumerate(mt_list):
                if x in DENSE_MLP_TYPES:
                    ffns.append("dense")
                elif x in MOE_MLP_TYPES:
                    ffns.append("moe")
                else:
                    raise ConfigError(f"config field mlp_layer_types[{i}]={x!r}: expected 'dense' or 'sparse'")
            kw["mlp_layer_types"] = ffns
        elif "first_k_dense_replace" in t and isinstance(n, int):
            k = t["first_k_dense_replace"]
            if not isinstance(k, int) or k < 0:
                raise ConfigError(f"config field first_k_dense_replace={k!r}: must be a non-negative integer")
            kw["mlp_layer_types"] = ["dense" if i < k else "moe" for i in range(n)]
        it = t.get("indexer_types")
        if it is not None and any(x != "full" for x in it):
            raise ConfigError(f"config field indexer_types={it!r}: only 'full' indexers are supported")
        try:
            cfg = cls(**kw, raw=raw)
        except TypeError as e:  # wrong types surfacing from derived properties
            raise ConfigError(str(e)) from e
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "GlmConfig":
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d)

    def to_hf_dict(self) -> dict:
        """An HF `glm5_next` config.json dict (nested text_config), loadable by transformers."""
        n = self.num_hidden_layers
        t = {
            "model_type": "glm5_next_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": n,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "hidden_act": self.hidden_act, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings, "pad_token_id": self.pad_token_id,
            "eos_token_id": list(self.eos_token_id), "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False, "attention_dropout": 0.0, "dtype": "bfloat16",
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim, "mla_use_nope": True,
            "index_n_heads": self.index_n_heads, "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk, "index_kpool": self.index_kpool, "index_kpool_compress": True,
            "index_kpool_always_select_tail": self.index_kpool_always_select_tail,
            "index_share_for_mtp_iteration": True, "indexer_rope_interleave": True,
            "indexer_types": ["full"] * n,
            "layer_types": ["linear_attention" if m == "kda" else "deepseek_sparse_attention"
                            for m in self.layer_types],
            "mlp_layer_types": ["dense" if f == "dense" else "sparse" for f in self.mlp_layer_types],
            "first_k_dense_replace": next((i for i, f in enumerate(self.mlp_layer_types) if f == "moe"), n),
            "moe_layer_freq": 1, "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size, "scoring_func": self.scoring_func,
            "topk_method": "noaux_tc", "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor, "n_group": self.n_group,
            "topk_group": self.topk_group, "moe_router_dtype": "float32", "swiglu_limit": self.swiglu_limit,
            "mhc": True, "hc_mult": self.hc_mult, "hc_eps": self.hc_eps, "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "linear_attn_config": {
                "num_heads": self.linear_num_heads, "head_dim": self.linear_head_dim,
                "short_conv_kernel_size": self.linear_conv_kernel_dim, "gate_lower_bound": self.linear_lower_bound,
                "kda_layers": self.kda_layers, "full_attn_layers": self.dsa_layers,
            },
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
        }
        return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
                "tie_word_embeddings": self.tie_word_embeddings, "text_config": t}

    def replace(self, **changes) -> "GlmConfig":
        """A validated copy with some fields changed (e.g. a small swiglu_limit for a test)."""
        d = {f.name: copy.deepcopy(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "raw"}
        d.update(changes)
        n = d["num_hidden_layers"]
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            d["layer_types"] = ["dsa" if i % 4 == 3 else "kda" for i in range(n)]
        if "num_hidden_layers" in changes and "mlp_layer_types" not in changes:
            k = sum(1 for f in self.mlp_layer_types if f == "dense")
            d["mlp_layer_types"] = ["dense" if i < k else "moe" for i in range(n)]
        return GlmConfig(**d)


# ---------------------------------------------------------------------- presets
def _preset_glm53_flash(n_experts: int) -> GlmConfig:
    return GlmConfig(n_routed_experts=n_experts)


def _preset_tiny() -> GlmConfig:
    # research/model.md §5.4: 8 layers (DSA at 3, 7), 3 dense + MoE, index_topk 16 so selection is sparse
    # from pos + 1 >= 20 on.
    return GlmConfig(
        vocab_size=1024, hidden_size=256, num_hidden_layers=8, max_position_embeddings=4096,
        pad_token_id=0, eos_token_id=[1],
        linear_num_heads=4, linear_head_dim=64,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=64,
        qk_nope_head_dim=32, v_head_dim=32,
        index_n_heads=4, index_head_dim=64, index_topk=16, index_kpool=4,
        intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
    )


def _preset_tiny_tp8() -> GlmConfig:
    # tiny with every TP-split dimension divisible by 8 (KDA and attention heads 8, so one head per rank at TP 8):
    # the TP 8 loopback builds of the trust tools (dump, stress) at tiny cost
    return _preset_tiny().replace(linear_num_heads=8, num_attention_heads=8, num_key_value_heads=8)


PRESETS = {
    "glm53-flash": lambda: _preset_glm53_flash(288),
    "glm53-flash-e80": lambda: _preset_glm53_flash(80),
    "tiny": _preset_tiny,
    "tiny-tp8": _preset_tiny_tp8,
}


def preset(name: str) -> GlmConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
