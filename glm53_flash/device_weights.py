"""One TP rank's random weights made on the device at this rank's piece shapes (no files, nothing GB-sized on the
CPU): the layer benchmarks' (scripts/time_layers.py, diag_layers.py) and ModelRunner.from_preset's on the GPU.

`RankSource` is a duck-typed loaded Checkpoint of one TP rank (`weights`, `scales`, `tp_rank`,
`tp_size`, `config`, `format`) whose tensors are generated on first access directly at the rank's piece
shape on the device (torch.randn on the GPU, scaled as weights.random_tensor scales them; FP8 as e4m3
codes with 128x128 block scales ~ 1/64, so dequantized weights keep the bf16 scale). Nothing GB-sized
is ever made on the CPU. The launches take it as they take a Checkpoint (launches/layer_host.py
`rank_tensors`). `piece_bytes` is the size of a rank's piece, for the byte accounting (layer_bytes.py).
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Mapping

import torch

from . import tp as tp_mod
from .weights import PREFIX, weight_specs

EMBED = PREFIX + "embed_tokens.weight"
FP8_SCALE = 1.0 / 64          # block scale of generated FP8 codes: dequantized ~ N(0, 1/fan_in) as bf16


def piece_fp8(spec, tp: int, fmt: str) -> bool:
    """Does this rank hold the tensor in FP8 (tp.py's rule: block-aligned pieces keep FP8)?"""
    return fmt == "fp8" and spec.fp8 and tp_mod.fp8_keeps_scales(spec, tp)


def piece_bytes(spec, tp: int, fmt: str) -> int:
    """Bytes of this rank's piece of `spec` (+ its FP8 scale grid)."""
    shape = tp_mod.local_shape(spec, tp)
    n = math.prod(shape)
    if piece_fp8(spec, tp, fmt):
        return n + math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128) * 4
    return n * spec.dtype.itemsize


def _gen(spec, shape, device, g=None) -> torch.Tensor:
    """fp32 random values at the init rule's scale (weights.random_tensor's rules, made on `device` by
    generator g)."""
    x = torch.randn(shape, device=device, generator=g)
    r, f = spec.init, max(spec.fan_in, 1)
    if r in ("linear", "mirrored_heads"):
        x *= f ** -0.5
    elif r in ("residual", "hc_fn"):
        x *= 0.5 * f ** -0.5
    elif r == "norm":
        x = 1.0 + 0.1 * x
    elif r == "bias":
        x *= 0.1
    elif r in ("small", "conv", "a_log"):
        x *= 0.5
    return x


class _Lazy(Mapping):
    def __init__(self, src: "RankSource", scales: bool):
        self.src, self.is_scales = src, scales

    def __getitem__(self, name):
        w, s = self.src.get(name)
        if self.is_scales:
            if s is None:
                raise KeyError(name)
            return s
        return w

    def __contains__(self, name):
        if not self.is_scales:
            return name in self.src.specs
        return name in self.src.specs and piece_fp8(self.src.specs[name], self.src.tp_size, self.src.format)

    def __iter__(self):
        return iter(n for n in self.src.specs if n in self)

    def __len__(self):
        return sum(1 for _ in self)


class RankSource:
    """One TP rank's random weights, generated on `device` at piece shapes on first access (cached until
    `release()`, so a baseline can be built from the very tensors the launch was given)."""

    def __init__(self, cfg, tp_rank: int, tp_size: int, fmt: str, device, seed: int = 0):
        self.config, self.tp_rank, self.tp_size, self.format = cfg, tp_rank, tp_size, fmt
        self.device, self.seed = torch.device(device), seed
        self.specs = weight_specs(cfg)
        self.weights, self.scales = _Lazy(self, False), _Lazy(self, True)
        self._cache: dict[str, tuple] = {}

    def get(self, name: str):
        if name not in self._cache:
            spec = self.specs[name]
            shape = tp_mod.local_shape(spec, self.tp_size)
            g = self._generator(name)
            x = _gen(spec, shape, self.device, g)
            if piece_fp8(spec, self.tp_size, self.format):
                grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
                s = FP8_SCALE * (1 + 0.05 * torch.rand(grid, device=self.device, generator=g))
                full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
                w = (x / full).clamp(-448, 448).to(torch.float8_e4m3fn)
                self._cache[name] = (w, s)
            else:
                self._cache[name] = (x.to(spec.dtype).contiguous(), None)
        return self._cache[name]

    def _generator(self, name: str) -> torch.Generator:
        """A generator seeded by (seed, name): the same piece has the same values in every process and whatever
        pieces were made before it (the global RNG made them differ from run to run, so two builds could not be
        compared bit for bit: scripts/diag_layers.py --same-as)."""
        key = (self.seed * 1000003 + zlib.crc32(name.encode()) + 7919 * self.tp_rank) % (2 ** 63)
        return torch.Generator(device=self.device).manual_seed(key)

    def bf16(self, name: str) -> torch.Tensor:
        """The piece as bf16 (FP8 dequantized) for the torch baseline."""
        w, s = self.get(name)
        if s is None:
            return w.to(torch.bfloat16) if w.dtype != torch.float32 else w
        full = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        return (w.float() * full).to(torch.bfloat16)

    def release(self) -> None:
        self._cache.clear()
