"""DSA (sparse NoPE MLA + kpool indexer) sub-layer of the reference, prefill and decode forms.

Prefill attends with per-head expanded keys/values under a [T, T] selection mask built for all
queries at once; decode attends one row at a time in the absorbed form over the gathered latents,
selecting pools from the cached pooled keys. The two share only the projections, so the
decode==prefill test checks absorption, pooling-from-cache and selection-from-cache.

Per DSA layer and slot the decode state is: the latent c_t of every token, the pooled index key of
every complete pool, and the raw [key | gate] index rows of the pool still being filled.
`get(name)` returns an fp32 weight by its HF checkpoint name; `p` is the `...self_attn.` prefix.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import ops

Tensor = torch.Tensor
Getter = Callable[[str], Tensor]


@dataclass
class DsaRows:
    q: Tensor      # [rows, nh, qk_head_dim] MLA queries
    c: Tensor      # [rows, kv_lora] RMSNorm'd latents (the cache rows)
    iq: Tensor     # [rows, n_idx, d_idx] index queries
    ik: Tensor     # [rows, d_idx] LayerNorm'd index keys
    ig: Tensor     # [rows, d_idx] kpool gate logits
    hw: Tensor     # [rows, n_idx] raw weights_proj output (per-head score weights)


def project(get: Getter, p: str, cfg, a: Tensor) -> DsaRows:
    """a [rows, H] (input_layernorm output) -> the per-token quantities of attention and indexer."""
    ix = p + "indexer."
    q_resid = ops.rms_norm(a @ get(p + "q_a_proj.weight").t(), get(p + "q_a_layernorm.weight"), cfg.rms_norm_eps)
    q = (q_resid @ get(p + "q_b_proj.weight").t()).view(a.shape[0], cfg.num_attention_heads, cfg.qk_head_dim)
    c = ops.rms_norm(a @ get(p + "kv_a_proj_with_mqa.weight").t(), get(p + "kv_a_layernorm.weight"),
                     cfg.rms_norm_eps)
    iq = (q_resid @ get(ix + "wq_b.weight").t()).view(a.shape[0], cfg.index_n_heads, cfg.index_head_dim)
    ik = ops.layer_norm(a @ get(ix + "wk.weight").t(), get(ix + "k_norm.weight"), get(ix + "k_norm.bias"))
    ig = a @ get(ix + "index_kpool_compress_gate").t()
    hw = a @ get(ix + "weights_proj.weight").t()
    return DsaRows(q, c, iq, ik, ig, hw)


def _scale(cfg) -> float:
    return cfg.qk_head_dim ** -0.5      # softmax scale uses qk_head_dim, not the latent width


def prefill_mask(get: Getter, p: str, cfg, r: DsaRows) -> tuple[Tensor, Tensor]:
    """The indexer's selection for every query of a prompt: (mask [T, T] (True = attend),
    pool scores [T, T // kpool], unmasked)."""
    T, kp, d = r.c.shape[0], cfg.index_kpool, cfg.index_head_dim
    P = T // kp
    ape = get(p + "indexer.index_kpool_compress_ape")
    pk = ops.indexer_pool(r.ik[:P * kp].view(P, kp, d), r.ig[:P * kp].view(P, kp, d), ape)   # [P, d]
    scores = ops.indexer_scores(r.iq, r.hw, pk)                                                  # [T, P]
    return ops.indexer_mask(scores, cfg.index_topk_pools, kp), scores


def dsa_prefill(get: Getter, p: str, cfg, a: Tensor, trace: dict | None = None) -> tuple[Tensor, DsaRows]:
    """Whole prompt a [T, H]. Returns (y [T, H], the projected rows, for the caller to cache).
    `trace`, if given, receives "mask" [T, T] and "scores" [T, P] (pool scores before masking)."""
    r = project(get, p, cfg, a)
    mask, scores = prefill_mask(get, p, cfg, r)
    if trace is not None:
        trace.update(mask=mask, scores=scores)
    o = ops.mla_expanded(r.q, get(p + "kv_b_proj.weight"), r.c, mask, _scale(cfg))   # [T, nh, dv]
    return o.reshape(a.shape[0], -1) @ get(p + "o_proj.weight").t(), r


def write_prompt(cfg, r: DsaRows, ape: Tensor, latent: Tensor, pool_keys: Tensor, tail_rows: Tensor) -> None:
    """Store a prompt's rows into one slot's caches (views): latent [max_len, C], pool_keys [Pmax, d],
    tail_rows [kpool, 2d]. Pool keys are computed from the raw rows as decode would."""
    T, kp, d = r.c.shape[0], cfg.index_kpool, cfg.index_head_dim
    P = T // kp
    latent[:T] = r.c
    if P:
        pool_keys[:P] = ops.indexer_pool(r.ik[:P * kp].view(P, kp, d), r.ig[:P * kp].view(P, kp, d), ape)
    for t in range(max(0, T - kp), T):        # the ring as decode leaves it: last kpool tokens
        tail_rows[t % kp] = torch.cat([r.ik[t], r.ig[t]])


def decode_select(cfg, iq: Tensor, hw: Tensor, pool_keys: Tensor, pos: int) -> Tensor:
    """Tokens a query at `pos` attends to, from the cached pooled keys [>= P, d]. iq [n, d], hw [n]."""
    P = (pos + 1) // cfg.index_kpool
    scores = ops.indexer_scores(iq, hw, pool_keys[:P])          # [P]
    return ops.indexer_select(scores, pos, cfg.index_topk_pools, cfg.index_kpool)


def dsa_decode(get: Getter, p: str, cfg, a: Tensor, positions: list[int], latent, pool_keys, tail_rows,
               trace: list | None = None) -> Tensor:
    """One token per row. a [w, H]; positions[i] the row's position; latent[i] [max_len, C],
    pool_keys[i] [Pmax, d], tail_rows[i] [kpool, 2d] are the row's cache views, written in place
    (this token's latent and index row; the pool key when this token completes its pool).
    `trace`, if given, receives each row's selected token indices. Returns y [w, H]."""
    r = project(get, p, cfg, a)
    kp, d = cfg.index_kpool, cfg.index_head_dim
    ape = get(p + "indexer.index_kpool_compress_ape")
    kv_b = get(p + "kv_b_proj.weight")
    outs = []
    for i, pos in enumerate(positions):
        latent[i][pos] = r.c[i]
        tail_rows[i][pos % kp] = torch.cat([r.ik[i], r.ig[i]])
        if (pos + 1) % kp == 0:                                 # this token completes pool pos // kp
            rows = tail_rows[i]
            pool_keys[i][pos // kp] = ops.indexer_pool(rows[:, :d], rows[:, d:], ape)
        toks = decode_select(cfg, r.iq[i], r.hw[i], pool_keys[i], pos)
        if trace is not None:
            trace.append(toks)
        o = ops.mla_absorbed(r.q[i], kv_b, latent[i][toks], _scale(cfg))   # [nh, dv]
        outs.append(o.reshape(-1))
    return torch.stack(outs) @ get(p + "o_proj.weight").t()
