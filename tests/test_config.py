"""GlmConfig: parsing vendor config.json (nested glm5_next and flat text configs, both sparse-layer
spellings, 0-based kda_layers), every validation error (names the field and the value), presets and
their layer/launch plans, to_hf_dict round trips, and transformers' Glm5NextConfig accepting to_hf_dict.
"""
from __future__ import annotations

import copy
import json
import math
import re

import pytest

from glm53_flash.config import ConfigError, GlmConfig, preset
from glm53_flash.weights import weight_specs

N_TINY = 8


def vendor_tiny() -> dict:
    """The tiny config as a vendor-style glm5_next config.json (research/model.md §5.4), written out by hand."""
    text = {
        "model_type": "glm5_next_text", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_act": "silu",
        "rms_norm_eps": 1e-05, "max_position_embeddings": 4096, "pad_token_id": 0, "eos_token_id": [1],
        "tie_word_embeddings": False, "attention_bias": False, "dtype": "bfloat16",
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 0, "v_head_dim": 32,
        "mla_use_nope": True, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 16, "index_kpool": 4,
        "index_kpool_compress": True, "index_kpool_always_select_tail": True, "indexer_types": ["full"] * 8,
        "layer_types": ["linear_attention"] * 3 + ["deepseek_sparse_attention"] + ["linear_attention"] * 3
                       + ["deepseek_sparse_attention"],
        "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 5, "first_k_dense_replace": 3, "moe_layer_freq": 1,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 128,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 2.5,
        "n_group": 1, "topk_group": 1, "swiglu_limit": 10.0, "mhc": True, "hc_mult": 4, "hc_eps": 1e-06,
        "hc_sinkhorn_iters": 20,
        "linear_attn_config": {"num_heads": 4, "head_dim": 64, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "kda_layers": [0, 1, 2, 4, 5, 6], "full_attn_layers": [3, 7]},
        "num_nextn_predict_layers": 1,
    }
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
            "tie_word_embeddings": False, "text_config": text}


# ---------------------------------------------------------------------- parsing
def test_nested_vendor_config_is_the_tiny_preset():
    cfg = GlmConfig.from_hf_dict(vendor_tiny())
    assert cfg == preset("tiny")
    assert cfg.dsa_layers == [3, 7] and cfg.kda_layers == [0, 1, 2, 4, 5, 6]
    assert cfg.mlp_layer_types == ["dense"] * 3 + ["moe"] * 5
    assert cfg.raw["text_config"]["index_kpool"] == 4           # the raw dict is kept verbatim


def test_flat_text_config():
    flat = vendor_tiny()["text_config"]
    assert GlmConfig.from_hf_dict(flat) == preset("tiny")


@pytest.mark.parametrize("spelling", ["deepseek_sparse_attention", "indexed_attention", "full_attention"])
def test_sparse_layer_spellings(spelling):
    d = vendor_tiny()
    d["text_config"]["layer_types"] = [spelling if t != "linear_attention" else t
                                       for t in d["text_config"]["layer_types"]]
    assert GlmConfig.from_hf_dict(d).layer_types == ["kda"] * 3 + ["dsa"] + ["kda"] * 3 + ["dsa"]


def test_kda_layers_are_zero_based():
    d = vendor_tiny()
    t = d["text_config"]
    del t["layer_types"]
    t["linear_attn_config"]["kda_layers"] = [0, 1, 3, 4, 5, 6]     # 0-based: layers 2 and 7 are DSA
    cfg = GlmConfig.from_hf_dict(d)
    assert cfg.dsa_layers == [2, 7]
    # read 1-based (Kimi's convention), [1..3, 5..7] would make layer 0 DSA; 0-based it is the stated error
    t["linear_attn_config"]["kda_layers"] = [1, 2, 3, 5, 6, 7]
    with pytest.raises(ConfigError, match=re.escape("layer_types[0]='dsa'")):
        GlmConfig.from_hf_dict(d)


def test_defaults_when_lists_are_absent():
    d = vendor_tiny()
    t = d["text_config"]
    for k in ("layer_types", "mlp_layer_types"):
        del t[k]
    del t["linear_attn_config"]["kda_layers"]
    t["first_k_dense_replace"] = 1
    t["eos_token_id"] = 1                                 # a bare int is accepted
    cfg = GlmConfig.from_hf_dict(d)
    assert cfg.dsa_layers == [3, 7] and cfg.mlp_layer_types == ["dense"] + ["moe"] * 7
    assert cfg.eos_token_id == [1]


# ---------------------------------------------------------------------- validation errors
POSITIVE_INTS = ["vocab_size", "hidden_size", "num_hidden_layers", "linear_num_heads", "linear_head_dim",
                 "linear_conv_kernel_dim", "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                 "v_head_dim", "index_n_heads", "index_head_dim", "index_topk", "index_kpool", "intermediate_size",
                 "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult", "hc_sinkhorn_iters",
                 "max_position_embeddings"]
JSON_NAMES = {"linear_num_heads": "linear_attn_config.num_heads", "linear_head_dim": "linear_attn_config.head_dim",
              "linear_conv_kernel_dim": "linear_attn_config.short_conv_kernel_size"}
BAD_VALUES = [(f, 0, JSON_NAMES.get(f, f)) for f in POSITIVE_INTS] + [
    ("hidden_size", 256.0, "hidden_size"),                     # a float is not an int
    ("n_routed_experts", True, "n_routed_experts"),            # nor is a bool
    ("rms_norm_eps", 0.0, "rms_norm_eps"), ("hc_eps", -1e-6, "hc_eps"),
    ("routed_scaling_factor", 0, "routed_scaling_factor"), ("swiglu_limit", -10.0, "swiglu_limit"),
    ("linear_lower_bound", 1.0, "linear_attn_config.gate_lower_bound"),
    ("hidden_act", "gelu", "hidden_act"), ("tie_word_embeddings", True, "tie_word_embeddings"),
    ("qk_rope_head_dim", 64, "qk_rope_head_dim"), ("num_key_value_heads", 2, "num_key_value_heads"),
    ("v_head_dim", 64, "v_head_dim"), ("index_topk", 18, "index_topk"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"), ("n_shared_experts", 2, "n_shared_experts"),
    ("scoring_func", "softmax", "scoring_func"), ("n_group", 2, "n_group"), ("topk_group", 2, "topk_group"),
    ("hc_mult", 2, "hc_mult"), ("num_nextn_predict_layers", 2, "num_nextn_predict_layers"),
    ("hidden_size", 200, "hidden_size"), ("eos_token_id", [1, 5000], "eos_token_id"),
    ("pad_token_id", 1024, "pad_token_id"),
    ("layer_types", ["kda"] * 7, "layer_types"), ("mlp_layer_types", ["dense"] * 9, "mlp_layer_types"),
]


@pytest.mark.parametrize("field, value, name", BAD_VALUES,
                         ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_validate_names_field_and_value(field, value, name):
    with pytest.raises(ConfigError) as e:
        preset("tiny").replace(**{field: value})
    assert f"{name}={value!r}" in str(e.value)


@pytest.mark.parametrize("field, value, name", [
    ("layer_types", ["kda", "kda", "mamba"] + ["kda"] * 5, "layer_types[2]='mamba'"),
    ("layer_types", ["dsa"] + ["kda"] * 7, "layer_types[0]='dsa'"),
    ("mlp_layer_types", ["dense", "mixture"] + ["moe"] * 6, "mlp_layer_types[1]='mixture'"),
])
def test_validate_names_list_entry(field, value, name):
    with pytest.raises(ConfigError, match=re.escape(name)):
        preset("tiny").replace(**{field: value})


def _with(path: str, value):
    """vendor_tiny() with the text_config entry at `path` (dots into nested objects) set to value."""
    d = vendor_tiny()
    node, keys = d["text_config"], path.split(".")
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    return d


PARSE_ERRORS = [
    (lambda: _with("hidden_size", "256"), "hidden_size='256'"),
    (lambda: {**vendor_tiny(), "text_config": 5}, "text_config=5"),
    (lambda: {**vendor_tiny(), "model_type": "llama"}, "model_type='llama'"),
    (lambda: _with("linear_attn_config", []), "linear_attn_config=[]"),
    (lambda: _with("linear_attn_config.num_heads", 0), "linear_attn_config.num_heads=0"),
    (lambda: _with("linear_attn_config.gate_lower_bound", 0.5), "gate_lower_bound=0.5"),
    (lambda: _with("layer_types", "kda"), "layer_types='kda'"),
    (lambda: _with("layer_types", ["linear_attention"] * 7 + ["mamba"]), "layer_types[7]='mamba'"),
    (lambda: _with("linear_attn_config.kda_layers", [0, 1, 2, 4, 5]),
     "linear_attn_config.kda_layers=[0, 1, 2, 4, 5]"),
    (lambda: _with("mlp_layer_types", 3), "mlp_layer_types=3"),
    (lambda: _with("mlp_layer_types", ["dense"] * 7 + ["mixture"]), "mlp_layer_types[7]='mixture'"),
    (lambda: _with("indexer_types", ["full"] * 7 + ["shared"]), "indexer_types="),
    (lambda: _with("num_hidden_layers", 0), "num_hidden_layers=0"),
]


@pytest.mark.parametrize("make, needle", PARSE_ERRORS, ids=[n for _, n in PARSE_ERRORS])
def test_from_hf_dict_names_field_and_value(make, needle):
    with pytest.raises(ConfigError) as e:
        GlmConfig.from_hf_dict(make())
    assert needle in str(e.value)


def test_parse_errors_without_lists():
    d = _with("first_k_dense_replace", -1)
    del d["text_config"]["mlp_layer_types"]
    with pytest.raises(ConfigError, match="first_k_dense_replace=-1"):
        GlmConfig.from_hf_dict(d)
    d = _with("linear_attn_config.kda_layers", [0, 9])
    del d["text_config"]["layer_types"]
    with pytest.raises(ConfigError, match=re.escape("linear_attn_config.kda_layers=[0, 9]")):
        GlmConfig.from_hf_dict(d)
    with pytest.raises(ConfigError, match="must be a JSON object, got list"):
        GlmConfig.from_hf_dict([vendor_tiny()])


def test_from_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(vendor_tiny()))
    assert GlmConfig.from_json(tmp_path) == GlmConfig.from_json(tmp_path / "config.json") == preset("tiny")
    with pytest.raises(ConfigError, match="no config.json"):
        GlmConfig.from_json(tmp_path / "absent")
    (tmp_path / "config.json").write_text('{"text_config": ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        GlmConfig.from_json(tmp_path)


def test_check_tp():
    tiny = preset("tiny")
    for tp in (1, 2, 4):
        tiny.check_tp(tp)
    with pytest.raises(ConfigError, match="tp=3"):
        tiny.check_tp(3)
    with pytest.raises(ConfigError, match="linear_attn_config.num_heads=4 is not divisible by tp=8"):
        tiny.check_tp(8)
    big = preset("glm53-flash")
    for tp in (1, 2, 4, 8):
        big.check_tp(tp)


# ---------------------------------------------------------------------- presets and plans
def test_glm53_flash_preset():
    cfg = preset("glm53-flash")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (45, 4096, 154880)
    assert cfg.dsa_layers == [i for i in range(45) if i % 4 == 3] and len(cfg.dsa_layers) == 11
    assert len(cfg.kda_layers) == 34 and cfg.kda_layers[-1] == 44
    assert cfg.mlp_layer_types == ["dense"] * 3 + ["moe"] * 42
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.index_kpool) == (288, 8, 4)
    assert (cfg.kda_dim, cfg.kda_inproj_rows, cfg.hc_dim, cfg.index_width) == (8192, 24896, 24, 2051)
    specs = weight_specs(cfg)
    assert len(specs) == 38423                                  # research/model.md §2.1
    assert sum(s.fp8 for s in specs.values()) == 37338          # weight_scale_inv tensors of the FP8 checkpoint
    assert round(sum(math.prod(s.shape) for s in specs.values()) / 1e9, 1) == 320.8


def test_layer_and_launch_plan():
    cfg = preset("glm53-flash")
    plan = cfg.layers
    assert [p.index for p in plan] == list(range(45))
    want = ["embed", "dense", "dense"] + ["sparse" if i % 4 == 3 else "kda" for i in range(3, 45)]
    assert [p.launch for p in plan] == want
    assert all(p.mixer == ("dsa" if p.index % 4 == 3 else "kda") for p in plan)
    assert all(p.ffn == ("dense" if p.index < 3 else "moe") for p in plan)
    assert cfg.launch_plan == want + ["tail", "nextn"] and len(cfg.launch_plan) == 47
    assert preset("tiny").launch_plan == ["embed", "dense", "dense", "sparse", "kda", "kda", "kda", "sparse", "tail",
                                          "nextn"]
    assert preset("tiny").replace(num_nextn_predict_layers=0).launch_plan[-1] == "tail"


def test_e80_preset_differs_only_in_experts():
    a, b = preset("glm53-flash").to_hf_dict(), preset("glm53-flash-e80").to_hf_dict()
    assert b["text_config"].pop("n_routed_experts") == 80 and a["text_config"].pop("n_routed_experts") == 288
    assert a == b
    assert round(sum(math.prod(s.shape) for s in weight_specs(preset("glm53-flash-e80")).values()) / 1e9, 1) == 95.6


def test_tiny_preset_and_unknown_preset():
    t = preset("tiny")
    assert (t.num_hidden_layers, t.hidden_size, t.n_routed_experts, t.num_experts_per_tok) == (N_TINY, 256, 8, 2)
    assert preset("tiny") is not preset("tiny")                  # fresh objects: callers may mutate
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


# ---------------------------------------------------------------------- round trips
def _custom():
    return preset("tiny").replace(num_hidden_layers=6, layer_types=["kda", "dsa", "kda", "kda", "dsa", "dsa"],
                                  mlp_layer_types=["dense", "moe", "dense", "moe", "moe", "moe"],
                                  num_nextn_predict_layers=0, swiglu_limit=0.5, n_routed_experts=16,
                                  eos_token_id=[1, 2, 3])


@pytest.mark.parametrize("make", [lambda: preset("tiny"), lambda: preset("glm53-flash"),
                                  lambda: preset("glm53-flash-e80"), _custom],
                         ids=["tiny", "glm53-flash", "e80", "custom"])
def test_to_hf_dict_round_trip(make, tmp_path):
    cfg = make()
    d = cfg.to_hf_dict()
    snapshot = copy.deepcopy(d)
    assert GlmConfig.from_hf_dict(d) == cfg
    assert d == snapshot                                        # parsing does not mutate its input
    assert d["text_config"]["linear_attn_config"]["kda_layers"] == cfg.kda_layers
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert GlmConfig.from_json(tmp_path) == cfg


@pytest.mark.parametrize("name", ["tiny", "glm53-flash"])
def test_transformers_accepts_to_hf_dict(name):
    tr = pytest.importorskip("transformers")
    Glm5NextConfig = getattr(tr, "Glm5NextConfig", None)
    if Glm5NextConfig is None:
        pytest.skip(f"transformers {tr.__version__} has no Glm5NextConfig")
    cfg = preset(name)
    hf = Glm5NextConfig(**cfg.to_hf_dict())
    t = hf.text_config
    assert t.num_hidden_layers == cfg.num_hidden_layers and t.hidden_size == cfg.hidden_size
    assert [x == "linear_attention" for x in t.layer_types] == [m == "kda" for m in cfg.layer_types]
    assert [x == "dense" for x in t.mlp_layer_types] == [f == "dense" for f in cfg.mlp_layer_types]
    assert (t.linear_num_heads, t.linear_head_dim, t.linear_lower_bound) == (cfg.linear_num_heads,
                                                                               cfg.linear_head_dim, -5.0)
    assert (t.index_kpool, t.index_topk, t.n_routed_experts, t.qk_rope_head_dim) == (
        cfg.index_kpool, cfg.index_topk, cfg.n_routed_experts, 0)     # kpool 4, not HF's class default 16
    assert GlmConfig.from_hf_dict(hf.to_dict()) == cfg                 # and back through HF's own dict
