"""Tensor-parallel split rules: which slice of each checkpoint tensor a TP rank holds (DESIGN.md §6).

`weights.TensorSpec.split` names the one dimension a tensor is cut along (KDA/MLA heads, q_b/kv_b rows,
FFN and expert intermediate dims, the input columns of o_proj/down, lm_head rows) or None when every
rank holds the whole tensor (mHC, router, indexer, q_a/kv_a, norms, embeddings). Rank r of t gets the
r-th of t equal contiguous pieces; the loader uses `shard_range` to read exactly that piece from disk.

FP8 rule. An FP8 weight carries one fp32 `weight_scale_inv` per 128x128 block. When a rank's piece
starts and ends on block boundaries (piece length a multiple of 128 along the split dim, always so at
the real shapes), the scale grid is cut along the same dim and the rank keeps FP8 + its slice of the
grid. When it does not (tiny test shapes at TP>1), one block's scale would straddle two ranks, so the
rank instead gets its piece dequantized to bf16 and no scale at all (`Checkpoint.scales` then lacks
that name). Replicated FP8 tensors and TP=1 always keep FP8.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .fp8 import BLOCK, scale_grid
from .weights import TensorSpec

TP_SIZES = (1, 2, 4, 8)


class TPError(ValueError):
    """A tensor cannot be split (or reassembled) the way it was asked to be."""


def _check_rank(spec: TensorSpec, rank: int, size: int) -> None:
    if size not in TP_SIZES:
        raise TPError(f"tp_size={size!r}: must be one of {TP_SIZES} (tensor {spec.name})")
    if not isinstance(rank, int) or not 0 <= rank < size:
        raise TPError(f"tp_rank={rank!r}: must lie in [0, tp_size={size}) (tensor {spec.name})")


def shard_range(spec: TensorSpec, rank: int, size: int) -> tuple[int | None, int, int]:
    """(dim, start, stop) of rank's piece. A replicated tensor gives (None, 0, shape[0]): the whole tensor."""
    _check_rank(spec, rank, size)
    if spec.split is None:
        return None, 0, (spec.shape[0] if spec.shape else 1)
    n = spec.shape[spec.split]
    if n % size:
        raise TPError(f"tensor {spec.name}: dim {spec.split} of shape {list(spec.shape)} ({n}) is not "
                      f"divisible by tp_size={size}")
    step = n // size
    return spec.split, rank * step, (rank + 1) * step


def local_shape(spec: TensorSpec, size: int) -> tuple[int, ...]:
    """Shape of every rank's piece."""
    shape = list(spec.shape)
    if spec.split is not None:
        dim, start, stop = shard_range(spec, 0, size)
        shape[dim] = stop - start
    return tuple(shape)


def _check_tensor(spec: TensorSpec, tensor: torch.Tensor) -> None:
    if tuple(tensor.shape) != tuple(spec.shape):
        raise TPError(f"tensor {spec.name}: shape {list(tensor.shape)}, expected {list(spec.shape)}")


def shard(spec: TensorSpec, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's contiguous piece of the full `tensor` (the whole tensor when replicated)."""
    _check_tensor(spec, tensor)
    dim, start, stop = shard_range(spec, rank, size)
    if dim is None:
        return tensor
    return tensor.narrow(dim, start, stop - start).contiguous()


def unshard(spec: TensorSpec, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard` over all ranks in order (a replicated tensor: rank 0's copy)."""
    if len(shards) not in TP_SIZES:
        raise TPError(f"tensor {spec.name}: got {len(shards)} shards, expected one of {TP_SIZES}")
    want = local_shape(spec, len(shards))
    for r, s in enumerate(shards):
        if tuple(s.shape) != want:
            raise TPError(f"tensor {spec.name}: shard {r} has shape {list(s.shape)}, expected {list(want)}")
    if spec.split is None:
        return shards[0]
    return torch.cat(list(shards), dim=spec.split)


# ---------------------------------------------------------------------- FP8
def fp8_keeps_scales(spec: TensorSpec, size: int) -> bool:
    """True if a rank of `size` can keep this FP8 weight as FP8 + a slice of its scale grid."""
    if spec.split is None or size == 1:
        return True
    dim, start, stop = shard_range(spec, 0, size)
    return (stop - start) % BLOCK == 0


def scale_shard_range(spec: TensorSpec, rank: int, size: int) -> tuple[int | None, int, int]:
    """(dim, start, stop) of rank's rows/cols of the scale grid; only for block-aligned splits."""
    if not fp8_keeps_scales(spec, size):
        raise TPError(f"tensor {spec.name}: the tp_size={size} split of dim {spec.split} (shape "
                      f"{list(spec.shape)}) does not fall on {BLOCK}-wide block boundaries")
    dim, start, stop = shard_range(spec, rank, size)
    grid = scale_grid(*spec.shape)
    if dim is None:
        return None, 0, grid[0]
    return dim, start // BLOCK, stop // BLOCK


def shard_scale(spec: TensorSpec, scale_inv: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's slice of the [ceil(rows/128), ceil(cols/128)] scale grid (block-aligned splits only)."""
    grid = scale_grid(*spec.shape)
    if tuple(scale_inv.shape) != grid:
        raise TPError(f"tensor {spec.name}: weight_scale_inv shape {list(scale_inv.shape)}, expected {list(grid)}")
    dim, start, stop = scale_shard_range(spec, rank, size)
    if dim is None:
        return scale_inv
    return scale_inv.narrow(dim, start, stop - start).contiguous()


def dequantize_piece(q: torch.Tensor, scale_rows: torch.Tensor, dim: int, start: int,
                     cols_or_rows: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dequantize a piece of an FP8 weight cut at an arbitrary (unaligned) offset.

    q: the piece, [n, cols] when dim == 0 or [rows, n] when dim == 1, starting at element `start` of `dim`.
    scale_rows: the scale grid restricted along `dim` to blocks start//128 .. (start+n-1)//128.
    cols_or_rows: the full length of the other dim (for the usual edge-block expansion).
    """
    n = q.shape[dim]
    # block of every element of the piece, relative to the first block in scale_rows
    idx = torch.arange(start, start + n, device=scale_rows.device) // BLOCK - start // BLOCK
    s = scale_rows.float().index_select(dim, idx)
    other = 1 - dim
    s = s.repeat_interleave(BLOCK, other).narrow(other, 0, cols_or_rows)
    return (q.float() * s).to(dtype)


def scale_piece_range(spec: TensorSpec, rank: int, size: int) -> tuple[int, int, int]:
    """(dim, first block, last block + 1) of the scale grid covering rank's (possibly unaligned) piece."""
    dim, start, stop = shard_range(spec, rank, size)
    if dim is None:
        return 0, 0, scale_grid(*spec.shape)[0]
    return dim, start // BLOCK, (stop - 1) // BLOCK + 1


def shard_fp8(spec: TensorSpec, q: torch.Tensor, scale_inv: torch.Tensor, rank: int,
              size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank's piece of an FP8 weight: (fp8 piece, scale slice) when aligned, else (bf16 dequantized piece, None)."""
    _check_tensor(spec, q)
    if fp8_keeps_scales(spec, size):
        return shard(spec, q, rank, size), shard_scale(spec, scale_inv, rank, size)
    dim, start, stop = shard_range(spec, rank, size)
    sdim, b0, b1 = scale_piece_range(spec, rank, size)
    piece = q.narrow(dim, start, stop - start)
    return dequantize_piece(piece, scale_inv.narrow(sdim, b0, b1 - b0), dim, start,
                            spec.shape[1 - dim]), None

