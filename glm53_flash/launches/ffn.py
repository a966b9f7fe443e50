"""Device pieces of the FFN half of a layer launch that kernels/mlp.py and kernels/moe.py do not
already provide: the final hc_post of a column range and the self-selecting expert slot. Pure
compute; waits and publishes stay in the kernel (launches/kda_layer.py).

Dense MLP (kernels/mlp.py): a gate|up task owns the same BLOCK_N intermediate rows of both
projections, so the clamped SwiGLU needs no hop (both weight chunks prefetched before the wait); the
down tiles follow. The MoE's shared expert is the same gate|up task over its own weights.

MoE (kernels/moe.py): router partial tasks (expert tile x K range) -> expert slots (row, rank, tile),
each selecting redundantly from the joined partials (`expert_slot`) -> down tiles per row
(kernels/moe.py moe_down_finish: the k routed experts in rank order, then the shared expert).
"""
import triton
import triton.language as tl

from ..kernels.gemv import gemv_store
from ..kernels.mhc import hc_post_tile
from ..kernels.mlp import gateup_finish, gateup_prefetch
from ..kernels.moe import router_select, router_store_record


@triton.jit
def post_cols(X, y, coef, X_out, rows, c0, c1, H: tl.constexpr, BLOCK_N: tl.constexpr):
    """X_out[r, i, c] = post[i] y[r, c] + sum_j comb[j, i] X[r, j, c] for columns [c0, c1), rows < rows;
    post / comb from the coefficient rows coef [rows, 24] (hc_store_coef's layout)."""
    i4 = tl.arange(0, 4)
    r = 0
    while r < rows:
        post = tl.load(coef + r * 24 + 4 + i4, cache_modifier=".cg")
        comb = tl.load(coef + r * 24 + 8 + i4[:, None] * 4 + i4[None, :], cache_modifier=".cg")
        c = c0
        while c < c1:
            hc_post_tile(X + r * 4 * H, y + r * H, X_out + r * 4 * H, c, H, post, comb, BLOCK_N)
            c += BLOCK_N
        r += 1


@triton.jit
def expert_slot(part_r, n_parts, width, bias, w_gu, s_gu, x, act_e, ids_rec, rw_rec, r, j, i0, limit, scaling,
                E: tl.constexpr, K: tl.constexpr, I: tl.constexpr, H: tl.constexpr, E_PAD: tl.constexpr,
                K_PAD: tl.constexpr, RENORM: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_I: tl.constexpr,
                BLOCK_K: tl.constexpr, PF_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Expert slot (row r, rank j, intermediate tile i0) after the router-partial wait: the slot joins
    the row's logit partials and selects itself (kernels/moe.py router_select: the same code and
    inputs in every slot, so every slot of the row gets the same bits), then streams the chosen
    expert's gate|up tile and stores the activation act_e[r, j, i0:]. Slot (r, 0, 0) also writes the
    row's record (ids, weights) that the down tasks read: no separate select stage, no extra hop."""
    ids, w = router_select(part_r + r * E, width * E, n_parts, bias, E, scaling, K, E_PAD, K_PAD, RENORM)
    kk = tl.arange(0, K_PAD)
    if (j == 0) & (i0 == 0):
        router_store_record(ids_rec + r * K, rw_rec + r * K, ids, w, K, K_PAD)
    e = tl.sum(tl.where(kk == j, ids, 0), axis=0)
    e = tl.minimum(tl.maximum(e, 0), E - 1).to(tl.int64)
    wg = w_gu + e * 2 * I * H
    wu = wg + I * H
    if w_gu.dtype.element_ty == tl.float8e4nv:
        nkb: tl.constexpr = (H + 127) // 128
        sg = s_gu + e * (2 * (I // 128) * nkb)
        su = sg + (I // 128) * nkb
    else:
        sg = wg
        su = wu
    g0, u0 = gateup_prefetch(wg, wu, i0, I, H, BLOCK_I, PF_K)
    act = gateup_finish(g0, u0, wg, wu, sg, su, x + r * H, 0, 1, i0, I, H, limit, ROWS_PAD, BLOCK_I, BLOCK_K, PF_K,
                        NUM_STAGES)
    gemv_store(act_e + (r * K + j) * I, 0, act, 1, i0, I, ROWS_PAD, BLOCK_I)
