"""Dense MLP task family (layers 0-2, inter 12288; the MoE's shared expert, inter 2048): a gate|up tile
task and a down tile task, as `@triton.jit` device functions, for 1..8 rows, bf16 or FP8 weights.

Why two tasks: the clamped SwiGLU (reference/ops.py swiglu_clamped: silu(min(g, L)) * clamp(u, -L, L))
is elementwise over the intermediate dim, so a gate|up tile owns intermediate columns [i0, i0 + BLOCK_I)
of both gate_proj and up_proj and writes its activation tile (bf16 hand-off) on its own. The down
projection needs the whole activation row, so it is a second stage of tiles over H output columns.
The weight streaming of both is kernels/gemv.py (gemv_prefetch / gemv_finish): no second GEMV here.

Weights before wait (DESIGN.md §5): dense and shared-expert weights never depend on activations, so
both tasks have a prefetch split: `gateup_prefetch` (first PF_K columns of the gate and up tiles) and,
for the down, `gemv_prefetch` on the down weight, both issued before the task waits on its input.
Routed experts (kernels/moe.py) reuse `gateup_finish` after they have read the router's choice.

Numerics: fp32 accumulation in a fixed K order (gemv.py), SwiGLU in fp32, activation stored in the
dtype of the act buffer (bf16 in a launch; fp32 works too). At TP > 1 the intermediate dim is this
rank's shard (I = inter / TP; gate/up rows and down columns of the rank) and the down output is a
per-rank partial, summed across ranks in rank order by the launch.

Layouts (row-major; the caller offsets pointers to the layer / expert / rank):
  x    [rows, H]  gate row (bf16/fp32), row stride stride_x
  wg, wu [I, H]   gate_proj / up_proj (bf16 or float8e4nv); FP8: sg, su fp32 [ceil(I/128), ceil(H/128)]
  act  [rows, I]  activation (bf16/fp32), row stride stride_a
  wd   [H, I]     down_proj; FP8: sd [ceil(H/128), ceil(I/128)]
  y    [rows, H]  down output (fp32: a TP partial, or the FFN output at TP 1)

Device API (constexprs in CAPS; i0 a multiple of BLOCK_I, n0 of BLOCK_N):
  g0, u0 = gateup_prefetch(wg, wu, i0, I, H, BLOCK_I, PF_K)                   # before the wait on x
  a = gateup_finish(g0, u0, wg, wu, sg, su, x, stride_x, rows, i0, I, H, limit,
                    ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)            # [BLOCK_I, ROWS_PAD] fp32
  gemv_store(act, stride_a, a, rows, i0, I, ROWS_PAD, BLOCK_I)               # act[r, i0 + j] = a[j, r]
  d0 = gemv_prefetch(wd, n0, 0, I, H, I, BLOCK_N, PF_K)                      # before the wait on act
  y_t = gemv_finish(d0, wd, sd, act, stride_a, rows, n0, 0, I, H, I,
                    ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)            # [BLOCK_N, ROWS_PAD] fp32
  gemv_store(y, stride_y, y_t, rows, n0, H, ROWS_PAD, BLOCK_N)
Registers (sm_90, Triton 3.6's bundled ptxas, offline: tests/test_kernels_moe.py test_offline_sm90_registers;
4 warps, 64-wide tiles, BLOCK_K 128, no spills): gate|up 146 bf16 / 134 FP8 at PF_K 128 and 3 stages
(both prefetched chunks, 2 x 32 registers, stay live through the gate GEMV), 108 at 2 stages, 80 at
PF_K 64 and 2 stages; down 72 (bf16 and FP8), as gemv.py's own kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemv import FP8_BLOCK, GemvConfig, gemv_finish, gemv_prefetch, gemv_store


@triton.jit
def swiglu_clamped(g, u, limit):
    """silu(min(g, limit)) * clamp(u, -limit, limit), fp32 (reference/ops.py swiglu_clamped)."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def gateup_prefetch(wg, wu, i0, I, H, BLOCK_I: tl.constexpr, PF_K: tl.constexpr):
    """First PF_K columns of the gate and up tiles (rows [i0, i0 + BLOCK_I)): two [BLOCK_I, PF_K] chunks
    in the weights' dtype. Depends on no activation: issue it before waiting on x."""
    g0 = gemv_prefetch(wg, i0, 0, H, I, H, BLOCK_I, PF_K)
    u0 = gemv_prefetch(wu, i0, 0, H, I, H, BLOCK_I, PF_K)
    return g0, u0


@triton.jit
def gateup_finish(g0, u0, wg, wu, sg, su, x, stride_x, rows, i0, I, H, limit,
                  ROWS_PAD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                  NUM_STAGES: tl.constexpr):
    """Clamped SwiGLU of the intermediate tile [i0, i0 + BLOCK_I): a [BLOCK_I, ROWS_PAD] fp32 with
    a[j, r] = swiglu(x[r] . wg[i0 + j], x[r] . wu[i0 + j]); rows >= `rows` (and j past I) come back as
    swiglu(0, 0) = 0. g0, u0: gateup_prefetch's chunks. sg / su: FP8 scales (pass wg / wu for bf16)."""
    g = gemv_finish(g0, wg, sg, x, stride_x, rows, i0, 0, H, I, H, ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)
    u = gemv_finish(u0, wu, su, x, stride_x, rows, i0, 0, H, I, H, ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)
    return swiglu_clamped(g, u, limit)


# ---------------------------------------------------------------------------- standalone test kernels
@triton.jit(do_not_specialize=["rows"])
def mlp_gateup_kernel(x, stride_x, wg, wu, sg, su, act, stride_a, rows, I, H, limit,
                      ROWS_PAD: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                      NUM_STAGES: tl.constexpr):
    """Grid (cdiv(I, BLOCK_I),): one gate|up tile task over all rows."""
    i0 = tl.program_id(0) * BLOCK_I
    g0, u0 = gateup_prefetch(wg, wu, i0, I, H, BLOCK_I, PF_K)
    # (a launch waits on x here)
    a = gateup_finish(g0, u0, wg, wu, sg, su, x, stride_x, rows, i0, I, H, limit,
                      ROWS_PAD, BLOCK_I, BLOCK_K, PF_K, NUM_STAGES)
    gemv_store(act, stride_a, a, rows, i0, I, ROWS_PAD, BLOCK_I)


@triton.jit(do_not_specialize=["rows"])
def mlp_down_kernel(act, stride_a, wd, sd, y, stride_y, rows, I, H,
                    ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    """Grid (cdiv(H, BLOCK_N),): one down tile task over all rows; K = I in a fixed order."""
    n0 = tl.program_id(0) * BLOCK_N
    d0 = gemv_prefetch(wd, n0, 0, I, H, I, BLOCK_N, PF_K)
    # (a launch waits on act here)
    acc = gemv_finish(d0, wd, sd, act, stride_a, rows, n0, 0, I, H, I, ROWS_PAD, BLOCK_N, BLOCK_K, PF_K, NUM_STAGES)
    gemv_store(y, stride_y, acc, rows, n0, H, ROWS_PAD, BLOCK_N)


# ---------------------------------------------------------------------------- host wrapper (tests)
def check_weight(w: torch.Tensor, s: torch.Tensor | None, shape: tuple, name: str):
    """Validate a bf16 / FP8 weight of `shape` (leading dims allowed for banks) and return the scale
    pointer argument (the weight itself for bf16, the kernel ignores it)."""
    if tuple(w.shape) != tuple(shape) or not w.is_contiguous():
        raise ValueError(f"{name} must be contiguous {tuple(shape)}, got {tuple(w.shape)}")
    if w.dtype == torch.bfloat16:
        return w
    if w.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: dtype {w.dtype}, expected bfloat16 or float8_e4m3fn")
    want = tuple(shape[:-2]) + (triton.cdiv(shape[-2], FP8_BLOCK), triton.cdiv(shape[-1], FP8_BLOCK))
    if s is None or tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
        raise ValueError(f"{name}: FP8 needs contiguous fp32 scales {want}")
    return s


def check_cfg(cfg: GemvConfig, fp8: bool):
    if fp8 and (cfg.pf_k != FP8_BLOCK or cfg.block_k % FP8_BLOCK):
        raise ValueError(f"FP8 needs pf_k == {FP8_BLOCK} and block_k a multiple of it; got {cfg}")


TEST_CFG = GemvConfig(block_n=64, block_k=128, pf_k=128, num_stages=2)   # interpreter-friendly tiles


def mlp_forward(x, wg, wu, wd, limit, scales=(None, None, None), *, cfg: GemvConfig = TEST_CFG,
                act_dtype=torch.bfloat16, block_i: int | None = None):
    """down(swiglu_clamped(x wg^T, x wu^T)) through the two task kernels (stage by stage).

    x [rows, H] bf16/fp32 (rows <= cfg.rows_pad); wg, wu [I, H], wd [H, I] bf16 or FP8 with
    scales = (sg, su, sd). Returns (y fp32 [rows, H], act [rows, I] act_dtype); outputs start as NaN."""
    rows, H = x.shape
    I = wg.shape[0]
    if not 1 <= rows <= cfg.rows_pad or x.stride(1) != 1:
        raise ValueError(f"x must be [rows <= {cfg.rows_pad}, H] with unit stride")
    sg = check_weight(wg, scales[0], (I, H), "wg")
    su = check_weight(wu, scales[1], (I, H), "wu")
    sd = check_weight(wd, scales[2], (H, I), "wd")
    check_cfg(cfg, wg.dtype == torch.float8_e4m3fn)
    bi = block_i or cfg.block_n
    act = torch.full((rows, I), float("nan"), dtype=act_dtype, device=x.device)
    y = torch.full((rows, H), float("nan"), dtype=torch.float32, device=x.device)
    kw = dict(ROWS_PAD=cfg.rows_pad, BLOCK_K=cfg.block_k, PF_K=cfg.pf_k, NUM_STAGES=cfg.num_stages,
              num_warps=cfg.num_warps)
    mlp_gateup_kernel[(triton.cdiv(I, bi),)](x, x.stride(0), wg, wu, sg, su, act, I, rows, I, H, float(limit),
                                             BLOCK_I=bi, **kw)
    mlp_down_kernel[(triton.cdiv(H, cfg.block_n),)](act, I, wd, sd, y, H, rows, I, H, BLOCK_N=cfg.block_n, **kw)
    return y, act
