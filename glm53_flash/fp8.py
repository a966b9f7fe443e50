"""FP8 e4m3 weights with 128x128 block scales, as the vendor checkpoint ships them.

A weight W [rows, cols] is stored as q = fp8(W / s) with one fp32 `weight_scale_inv` s per 128x128 block
(grid ceil(rows/128) x ceil(cols/128)); dequantized W ~= q * s. Edge blocks are partial.
"""
from __future__ import annotations

import torch

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def scale_grid(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    return (rows + block - 1) // block, (cols + block - 1) // block


def quantize_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] (any float dtype) -> (q fp8 e4m3 [rows, cols], scale_inv fp32 [grid])."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8 expects a 2-D weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    gr, gc = scale_grid(rows, cols, block)
    wf = w.float()
    pad = torch.zeros(gr * block, gc * block, dtype=torch.float32)
    pad[:rows, :cols] = wf
    blocks = pad.view(gr, block, gc, block)
    amax = blocks.abs().amax(dim=(1, 3))                           # [gr, gc]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(gr * block, gc * block)[:rows, :cols].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


def expand_scales(scale_inv: torch.Tensor, rows: int, cols: int, block: int = BLOCK) -> torch.Tensor:
    """Per-element scale [rows, cols] from the block grid."""
    return scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def dequantize_fp8(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    rows, cols = q.shape
    want = scale_grid(rows, cols, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {want} for a "
                         f"[{rows}, {cols}] FP8 weight with {block}x{block} blocks")
    return (q.float() * expand_scales(scale_inv, rows, cols, block)).to(dtype)
