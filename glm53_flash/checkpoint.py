"""Checkpoint directories in the vendor layout of GLM-5.3-Flash: write random ones, validate, load a TP rank.

Layout (research/model.md §6.1): `config.json`, shards `model-0000i-of-0000N.safetensors` and
`model.safetensors.index.json` ({"metadata": {"total_size": bytes}, "weight_map": {name: shard}}), HF names
from `weights.weight_specs` (the MTP block is layer `num_hidden_layers`). Weights are bf16 (fp32 where the
spec says so), or FP8 e4m3 plus an fp32 `<name>_scale_inv` 128x128 block grid for exactly the tensors
whose spec has fp8=True. A single `model.safetensors` without index is accepted too. Tensors under
`model.visual.` (the vendor's vision tower) are ignored.

Validation reads only the safetensors headers (8-byte length + JSON), never tensor data, and fails
before any tensor is used, with a `CheckpointError` naming the tensor, the file and, when the config and
the tensors disagree, the config field. Loading is lazy and memory-mapped: `Checkpoint.weights[name]`
reads only this TP rank's piece (`tp.shard_range`) through `safe_open(...).get_slice`. Loading to a
device (or with lazy=False) reads every tensor once, eagerly, with a progress bar.
"""
from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from . import tp
from .config import ConfigError, GlmConfig
from .fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8, scale_grid
from .weights import PREFIX, RandomWeights, TensorSpec, layer_specs, scale_name, weight_specs

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
IGNORED_PREFIXES = ("model.visual.",)
FORMATS = ("bf16", "fp8")
SHARD_BYTES_CAP = 5 * 10**9       # ~5 GB shards for the big configs, as the vendor ships them
_SHARD_RE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_LAYER_RE = re.compile(re.escape(PREFIX) + r"layers\.(\d+)\.")
_EXPERT_RE = re.compile(re.escape(PREFIX) + r"layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_ST_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "F8_E4M3": FP8_DTYPE,
              "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint directory is malformed or disagrees with its config; names tensor, file (and field)."""


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def stored_tensors(spec: TensorSpec, fmt: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """On-disk (name, shape, dtype) of one spec: the weight, plus its scale grid when stored FP8."""
    if fmt == "fp8" and spec.fp8:
        return [(spec.name, spec.shape, FP8_DTYPE), (scale_name(spec.name), scale_grid(*spec.shape), torch.float32)]
    return [(spec.name, spec.shape, spec.dtype)]


def _nbytes(shape, dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * dtype.itemsize


def _check_format(weights: str) -> None:
    if weights not in FORMATS:
        raise CheckpointError(f"weights={weights!r}: expected one of {FORMATS}")


# ---------------------------------------------------------------------- writing
def plan_shards(cfg: GlmConfig, weights: str = "bf16", max_shard_bytes: int | None = None) -> list[list[TensorSpec]]:
    """Specs of each shard, in file order: greedy packing up to max_shard_bytes (default: a quarter of the
    total, so >= 4 shards for small configs, capped at 5 GB); a weight and its scale always share a shard."""
    _check_format(weights)
    specs = list(weight_specs(cfg).values())
    sizes = [sum(_nbytes(s, d) for _, s, d in stored_tensors(spec, weights)) for spec in specs]
    if max_shard_bytes is None:
        max_shard_bytes = min(SHARD_BYTES_CAP, max(1 << 20, sum(sizes) // 4))
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes={max_shard_bytes!r}: must be a positive integer")
    shards, cur, cur_bytes = [], [], 0
    for spec, b in zip(specs, sizes):
        if cur and cur_bytes + b > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(spec)
        cur_bytes += b
    if cur:
        shards.append(cur)
    return shards


def _write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def make_random_checkpoint(cfg: GlmConfig, out_dir, seed: int = 0, weights: str = "bf16",
                           max_shard_bytes: int | None = None, progress: bool = True) -> Path:
    """Write a checkpoint of `RandomWeights(cfg, seed)` to out_dir, shard by shard; returns out_dir.

    weights="fp8" stores every fp8=True spec as e4m3 + 128x128 `weight_scale_inv`; shards as `plan_shards`.
    Values are generated per shard, so only one shard is ever in memory. The index is removed first
    and written last (atomically), so a crash mid-way never leaves a valid-looking checkpoint.
    """
    plan = plan_shards(cfg, weights, max_shard_bytes)
    total = sum(_nbytes(s, d) for group in plan for spec in group for _, s, d in stored_tensors(spec, weights))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / INDEX).unlink(missing_ok=True)
    (out / SINGLE).unlink(missing_ok=True)
    hf = cfg.to_hf_dict()
    if weights == "fp8":
        hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    _write_json(out / CONFIG, hf)

    rw = RandomWeights(cfg, seed)
    weight_map = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {out.name}", disable=not progress)
    for i, group in enumerate(plan, 1):
        fname = shard_file_name(i, len(plan))
        tensors = {}
        for spec in group:
            w = rw[spec.name]
            if weights == "fp8" and spec.fp8:
                q, s = quantize_fp8(w)
                tensors[spec.name], tensors[scale_name(spec.name)] = q, s
            else:
                tensors[spec.name] = w
        tmp = out / (fname + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, out / fname)
        for name, t in tensors.items():
            weight_map[name] = fname
            bar.update(t.numel() * t.element_size())
        del tensors
    bar.close()
    written = set(weight_map.values())
    for stale in out.iterdir():          # shards of an earlier checkpoint written to the same directory
        if _SHARD_RE.fullmatch(stale.name) and stale.name not in written:
            stale.unlink()
    _write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return out


# ---------------------------------------------------------------------- headers and index
def read_header(path: Path, some_tensor: str = "?") -> dict[str, tuple[str, list[int], int]]:
    """{name: (dtype, shape, data end offset)} from a safetensors header, checking the file is long enough."""
    def bad(why, tensor=some_tensor):
        return CheckpointError(f"tensor {tensor} in file {path.name}: {why}")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad(f"file is {size} bytes, too short for a safetensors header (truncated)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise bad(f"header says {n} header bytes but the file has {size} (truncated)")
            raw = f.read(n)
    except OSError as e:
        raise bad(f"cannot read ({e})") from None
    try:
        hdr = json.loads(raw)
        hdr.pop("__metadata__", None)
        out = {k: (v["dtype"], list(v["shape"]), int(v["data_offsets"][1])) for k, v in hdr.items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise bad(f"malformed safetensors header ({e})") from None
    data = size - 8 - n
    for k, (_, _, end) in out.items():
        if end > data:
            raise bad(f"data ends at byte {end} but the file holds only {data} (truncated)", k)
    return out


def read_index(root: Path) -> tuple[dict[str, str], str]:
    """(weight_map, index file name); a lone model.safetensors serves as its own index."""
    ip = root / INDEX
    if not ip.exists():
        if (root / SINGLE).exists():
            return {k: SINGLE for k in read_header(root / SINGLE)}, SINGLE
        raise CheckpointError(f"{root}: no {INDEX} (and no {SINGLE}); not a checkpoint directory")
    try:
        idx = json.loads(ip.read_text())
    except (ValueError, OSError) as e:
        raise CheckpointError(f"file {INDEX} in {root}: malformed index JSON ({e})") from None
    wm = idx.get("weight_map") if isinstance(idx, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(f"file {INDEX} in {root}: malformed index, needs a non-empty 'weight_map' object")
    for name, f in wm.items():
        if not isinstance(f, str) or not f or os.path.basename(f) != f:
            raise CheckpointError(f"tensor {name} in file {INDEX}: malformed index entry {f!r} (a shard file name)")
    return wm, INDEX


# ---------------------------------------------------------------------- validation
_HF_FIELD = {"linear_num_heads": "linear_attn_config.num_heads", "linear_head_dim": "linear_attn_config.head_dim",
             "linear_conv_kernel_dim": "linear_attn_config.short_conv_kernel_size"}
# fields that set tensor shapes, with the fields that must change alongside to stay valid
_SHAPE_FIELDS = {"vocab_size": (), "hidden_size": (), "linear_num_heads": (), "linear_head_dim": (),
                 "linear_conv_kernel_dim": (), "num_attention_heads": ("num_key_value_heads",),
                 "q_lora_rank": (), "kv_lora_rank": (), "qk_nope_head_dim": ("v_head_dim",), "index_n_heads": (),
                 "index_head_dim": (), "index_kpool": ("index_topk",), "intermediate_size": (),
                 "moe_intermediate_size": (), "n_routed_experts": ()}


def _spec_in(cfg: GlmConfig, name: str) -> TensorSpec | None:
    m = _LAYER_RE.match(name)
    if m and int(m.group(1)) <= cfg.num_hidden_layers:
        return {s.name: s for s in layer_specs(cfg, int(m.group(1)))}.get(name)
    small = cfg.replace(num_hidden_layers=1, num_nextn_predict_layers=0, layer_types=["kda"], mlp_layer_types=["dense"])
    return weight_specs(small).get(name)


def blame_fields(cfg: GlmConfig, spec: TensorSpec, got: list[int]) -> list[str]:
    """Config fields that set the dims where `got` disagrees with spec.shape (found by doubling each field)."""
    bad = [d for d in range(len(spec.shape)) if d >= len(got) or got[d] != spec.shape[d]]
    out = []
    for f, tied in _SHAPE_FIELDS.items():
        try:
            alt = _spec_in(cfg.replace(**{k: 2 * getattr(cfg, k) for k in (f, *tied)}), spec.name)
        except ConfigError:
            continue
        if alt is not None and any(alt.shape[d] != spec.shape[d] for d in bad):
            out.append(f)
    return out


def _field(cfg: GlmConfig, f: str) -> str:
    return f"{_HF_FIELD.get(f, f)}={getattr(cfg, f)!r}"


def _check_structure(cfg: GlmConfig, wm: dict[str, str], idx_file: str) -> None:
    """Layer count, layer kinds and expert count implied by the tensor names, against the config."""
    n, n_all = cfg.num_hidden_layers, cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    where = f"(+ num_nextn_predict_layers={cfg.num_nextn_predict_layers})"
    by_layer: dict[int, list[str]] = {}
    for name in wm:
        m = _LAYER_RE.match(name)
        if m:
            by_layer.setdefault(int(m.group(1)), []).append(name)
    for i in sorted(by_layer):
        if i >= n_all:
            t = by_layer[i][0]
            raise CheckpointError(f"config field num_hidden_layers={n} {where} disagrees with the checkpoint: "
                                  f"tensor {t} in file {wm[t]} belongs to layer {i}")
    for i in range(n_all):
        if i not in by_layer:
            t = f"{PREFIX}layers.{i}.input_layernorm.weight"
            raise CheckpointError(f"config field num_hidden_layers={n} {where} disagrees with the checkpoint: "
                                  f"layer {i} is missing (e.g. tensor {t} is not in file {idx_file})")
        p = f"{PREFIX}layers.{i}."
        mixer, ffn = ("dsa", "moe") if i == n else (cfg.layer_types[i], cfg.mlp_layer_types[i])
        for fld, kind, marks in (("layer_types", mixer, {"kda": "self_attn.q_proj.weight",
                                                         "dsa": "self_attn.q_a_proj.weight"}),
                                 ("mlp_layer_types", ffn, {"dense": "mlp.gate_proj.weight",
                                                           "moe": "mlp.gate.weight"})):
            other = next(k for k in marks if k != kind)
            if p + marks[kind] not in wm and p + marks[other] in wm:
                t = p + marks[other]
                see = " (linear_attn_config.kda_layers)" if fld == "layer_types" else ""
                what = (f"config field {fld}[{i}]={kind!r}{see}" if i < n else
                        f"layer {i} (the MTP block, always dsa + moe)")
                raise CheckpointError(f"{what} disagrees with the checkpoint: tensor {t} in file {wm[t]} "
                                      f"is a {other} tensor")
    experts: dict[int, set[int]] = {}
    for name in wm:
        m = _EXPERT_RE.match(name)
        if m:
            experts.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
            e = int(m.group(2))
            if e >= cfg.n_routed_experts:
                raise CheckpointError(f"config field n_routed_experts={cfg.n_routed_experts} disagrees with the "
                                      f"checkpoint: tensor {name} in file {wm[name]} is expert {e}")
    for layer, es in experts.items():
        if len(es) != cfg.n_routed_experts:
            e = min(set(range(cfg.n_routed_experts)) - es)
            t = f"{PREFIX}layers.{layer}.mlp.experts.{e}.gate_proj.weight"
            raise CheckpointError(f"config field n_routed_experts={cfg.n_routed_experts} disagrees with the "
                                  f"checkpoint: layer {layer} holds {len(es)} experts (tensor {t} is missing, not "
                                  f"in file {idx_file})")


def _check_tensor(cfg: GlmConfig, spec: TensorSpec, name: str, shape, dtype: torch.dtype, hdr, file: str) -> None:
    got_dtype, got_shape, _ = hdr
    if list(got_shape) != list(shape):
        fields = blame_fields(cfg, spec, got_shape) if name == spec.name else []
        msg = f"tensor {name} in file {file}: shape {got_shape}, expected {list(shape)}"
        if fields:
            msg = (f"config field {' / '.join(_field(cfg, f) for f in fields)} disagrees with the checkpoint: "
                   + msg)
        raise CheckpointError(msg)
    if _ST_DTYPES.get(got_dtype) != dtype:
        raise CheckpointError(f"tensor {name} in file {file}: dtype {got_dtype}, expected {_ST_NAMES[dtype]}")


def validate_checkpoint(cfg: GlmConfig, root: Path, wm: dict[str, str], idx_file: str) -> str:
    """Check index, shard headers and every tensor against the config; returns the format ("bf16"|"fp8")."""
    headers: dict[str, dict] = {}
    for name, f in wm.items():
        if f not in headers:
            if not (root / f).is_file():
                raise CheckpointError(f"tensor {name} in file {idx_file}: the index points at file {f}, "
                                      f"which does not exist")
            headers[f] = read_header(root / f, name)
        if name not in headers[f]:
            raise CheckpointError(f"tensor {name}: the index says file {f}, but that file does not contain it")
    fmt = detect_format(cfg, wm)
    _check_structure(cfg, wm, idx_file)
    specs = weight_specs(cfg)
    expected = set()
    for spec in specs.values():
        for name, shape, dtype in stored_tensors(spec, fmt):
            expected.add(name)
            if name not in wm:
                if name != spec.name:
                    raise CheckpointError(f"tensor {name} missing: the FP8 weight {spec.name} in file "
                                          f"{wm[spec.name]} has no scale (weight_scale_inv) in {idx_file}")
                raise CheckpointError(f"tensor {name} is missing from the checkpoint (not in file {idx_file})")
            _check_tensor(cfg, spec, name, shape, dtype, headers[wm[name]][name], wm[name])
    for name, f in wm.items():
        if name not in expected and not name.startswith(IGNORED_PREFIXES):
            raise CheckpointError(f"unexpected tensor {name} in file {f}: not part of a {fmt} checkpoint of "
                                  f"this config")
    return fmt


def detect_format(cfg: GlmConfig, wm: Mapping[str, str]) -> str:
    """fp8 if config.json has an fp8 quantization_config or any weight_scale_inv tensor exists."""
    qc = cfg.raw.get("quantization_config") if isinstance(cfg.raw, dict) else None
    if isinstance(qc, dict) and qc.get("quant_method") == "fp8":
        return "fp8"
    return "fp8" if any(k.endswith("_scale_inv") for k in wm) else "bf16"


# ---------------------------------------------------------------------- loading
class _Files:
    """Open (memory-mapped) shard handles, and rank-piece reads that name tensor and file on failure."""

    def __init__(self, root: Path, wm: dict[str, str], device="cpu"):
        self.root, self.wm, self.device, self._open = root, wm, torch.device(device), {}

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int = 0) -> torch.Tensor:
        f = self.wm[name]
        try:
            h = self._open.get(f)
            if h is None:
                h = self._open[f] = safe_open(str(self.root / f), framework="pt")
            sl = h.get_slice(name)
            t = sl[:] if dim is None else sl[(slice(None),) * dim + (slice(start, stop),)]
            return t if self.device.type == "cpu" else t.to(self.device)
        except CheckpointError:
            raise
        except Exception as e:   # safetensors raises its own SafetensorError (and OSError)
            raise CheckpointError(f"tensor {name} in file {f}: cannot read ({e})") from e


class _RankWeights(Mapping):
    """name -> this rank's piece (FP8 when its scale slice stays block-aligned, else dequantized bf16)."""

    def __init__(self, files: _Files, specs: dict[str, TensorSpec], fmt: str, rank: int, size: int):
        self.files, self.specs, self.fmt, self.rank, self.size = files, specs, fmt, rank, size

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"no tensor named {name!r} in this checkpoint")
        if self.fmt == "fp8" and spec.fp8 and not tp.fp8_keeps_scales(spec, self.size):
            dim, start, stop = tp.shard_range(spec, self.rank, self.size)
            sdim, b0, b1 = tp.scale_piece_range(spec, self.rank, self.size)
            q = self.files.read(name, dim, start, stop)
            s = self.files.read(scale_name(name), sdim, b0, b1)
            return tp.dequantize_piece(q, s, dim, start, spec.shape[1 - dim])
        return self.files.read(name, *tp.shard_range(spec, self.rank, self.size))

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


class _RankScales(Mapping):
    """weight name -> this rank's slice of its weight_scale_inv grid (FP8 tensors that stay FP8)."""

    def __init__(self, files: _Files, specs: dict[str, TensorSpec], rank: int, size: int):
        self.files, self.rank, self.size = files, rank, size
        self.specs = {n: s for n, s in specs.items() if s.fp8 and tp.fp8_keeps_scales(s, size)}

    def __getitem__(self, name: str) -> torch.Tensor:
        spec = self.specs.get(name)
        if spec is None:
            raise KeyError(f"no FP8 scale for {name!r} on this rank")
        return self.files.read(scale_name(name), *tp.scale_shard_range(spec, self.rank, self.size))

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


class _Dequantized(Mapping):
    def __init__(self, weights: Mapping, scales: Mapping, dtype: torch.dtype):
        self.weights, self.scales, self.dtype = weights, scales, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        w = self.weights[name]
        if name in self.scales:
            return dequantize_fp8(w, self.scales[name], dtype=self.dtype)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def dequantized_view(weights: Mapping, scales: Mapping, dtype: torch.dtype = torch.float32) -> Mapping:
    """weights with every tensor that has a scale (FP8) dequantized to dtype on access; the rest as stored."""
    return _Dequantized(weights, scales, dtype)


@dataclass
class Checkpoint:
    """One TP rank's view of a checkpoint directory (see load_checkpoint). At tp_size=1 `weights` (or
    `dequantized()`) has exactly the `weight_specs` names, ready for `ReferenceModel(config, ...)`."""

    config: GlmConfig
    format: str                      # "bf16" | "fp8"
    tp_rank: int
    tp_size: int
    path: Path
    weights: Mapping[str, torch.Tensor]   # weight_specs names -> this rank's piece
    scales: Mapping[str, torch.Tensor]    # weight name -> weight_scale_inv slice (FP8 tensors kept FP8)
    files: dict[str, str] = field(default_factory=dict, repr=False)   # on-disk name -> shard file

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Mapping[str, torch.Tensor]:
        """FP8 weights dequantized to `dtype`; every other tensor as stored. Lazy; keys = weight_specs names."""
        return _Dequantized(self.weights, self.scales, dtype)


def load_checkpoint(path, tp_rank: int = 0, tp_size: int = 1, device="cpu", validate: bool = True,
                    progress: bool = True, lazy: bool | None = None) -> Checkpoint:
    """Open a checkpoint directory for one TP rank.

    lazy (default: True on CPU, False for other devices): lazy mappings read each piece on access from the
    memory-mapped shards; eager loading reads every piece of this rank once and moves it to `device`.
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} is not a directory")
    try:
        cfg = GlmConfig.from_json(root / CONFIG)
        cfg.check_tp(tp_size)
    except ConfigError as e:
        raise CheckpointError(f"file {CONFIG} in {root}: {e}") from None
    if not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise CheckpointError(f"tp_rank={tp_rank!r}: must lie in [0, tp_size={tp_size})")
    wm, idx_file = read_index(root)
    fmt = validate_checkpoint(cfg, root, wm, idx_file) if validate else detect_format(cfg, wm)
    specs = weight_specs(cfg)
    if lazy is None:
        lazy = torch.device(device).type == "cpu"
    files = _Files(root, wm, device if lazy else "cpu")
    weights = _RankWeights(files, specs, fmt, tp_rank, tp_size)
    scales = _RankScales(files, specs, tp_rank, tp_size) if fmt == "fp8" else {}
    if not lazy:
        bar = tqdm(total=len(weights) + len(scales), desc=f"loading {root.name} rank {tp_rank}/{tp_size}",
                   disable=not progress)

        def pull(src: Mapping) -> dict[str, torch.Tensor]:
            out = {}
            for name in src:
                out[name] = src[name].to(device)
                bar.update(1)
            return out
        weights, scales = pull(weights), pull(scales)
        bar.close()
    return Checkpoint(cfg, fmt, tp_rank, tp_size, root, weights, scales, dict(wm))

