"""Every rank of a TP group on one device (host code): the cross-rank exchange fed by the host.

A layer launch at TP > 1 built without a shared exchange mailbox runs in loopback mode: its peer tasks copy
the other ranks' partial sums from `peer` (launches/layer_host.py set_peers) instead of waiting for them. So
one process can run a whole TP group on one device, one rank after another, each launch standalone (no two
persistent launches need to be resident together), in three passes per layer:
  1. every rank alone: its own o_proj partial (own_partials()[0]);
  2. every rank with the others' o_proj partials: its own down partial, now over the true attention sum;
  3. every rank with both: the layer's output X' (and new state), the bits a real TP group computes, since
     every pass of a rank ran on the same inputs and the sums join the ranks in the same fixed order.
The tail takes two passes: every rank's own best candidate, then each rank with the others' candidates.
Every rank's X' (and the tail's greedy ids) must be the same bits: the caller checks that.

KDA state at TP: rank r holds heads [r n, (r + 1) n) of the state and its 1/T column slice of each of the
conv window's three parts (q | k | v); `rank_state` cuts them out, `commit_rank_state` puts them back.
"""
from __future__ import annotations

import torch


def rank_state(cfg, S: torch.Tensor, W: torch.Tensor, rank: int, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s (state, window) from the whole [B, heads, ...] state and [B, taps, 3 D] window (copies)."""
    n, D = S.shape[1] // tp, cfg.kda_dim
    d = D // tp
    Wr = torch.cat([W[..., s * D + rank * d: s * D + (rank + 1) * d] for s in range(3)], -1)
    return S[:, rank * n:(rank + 1) * n].contiguous(), Wr.contiguous()


def commit_rank_state(cfg, kda_state, conv_window, sl, j: int, S_r, W_r, rank: int, tp: int) -> None:
    """The inverse of rank_state: rank `rank`'s new state / window rows into the caches' slots `sl`, layer j."""
    n, D = S_r.shape[1], cfg.kda_dim
    d = D // tp
    kda_state[sl, j, rank * n:(rank + 1) * n] = S_r
    for s in range(3):
        conv_window[sl, j, :, s * D + rank * d: s * D + (rank + 1) * d] = W_r[..., s * d:(s + 1) * d]


def run_layer(launches: list, run_one, inject_fault: str | None = None) -> list[torch.Tensor]:
    """The three passes over a layer's rank launches. run_one(L, peer, fault) runs rank L once and returns its
    X'; the fault (a wait site) goes to rank 0's first pass. -> every rank's X' of the last pass."""
    if len(launches) == 1:
        return [run_one(launches[0], None, inject_fault)]
    po, pd = {}, {}
    for L in launches:
        run_one(L, None, inject_fault if L.tp_rank == 0 else None)
        po[L.tp_rank] = L.own_partials()[0]
    for L in launches:
        run_one(L, {p: (po[p], torch.zeros_like(po[p])) for p in po if p != L.tp_rank}, None)
        pd[L.tp_rank] = L.own_partials()[1]
    return [run_one(L, {p: (po[p], pd[p]) for p in po if p != L.tp_rank}, None) for L in launches]


def run_tail(launches: list, X: torch.Tensor, inject_fault: str | None = None):
    """The two passes over the tail's rank launches (each rank's vocabulary shard). -> (logits [rows, V] fp32:
    the ranks' shards side by side, [ids [rows] int32 per rank])."""
    if len(launches) == 1:
        logits, ids = launches[0].run(X, inject_fault=inject_fault)
        return logits, [ids]
    cand = {}
    for L in launches:
        L.run(X, inject_fault=inject_fault if L.tp_rank == 0 else None)
        cand[L.tp_rank] = L.candidate()
    outs = [L.run(X, peer={p: cand[p] for p in cand if p != L.tp_rank}) for L in launches]
    return torch.cat([lg for lg, _ in outs], dim=-1), [ids for _, ids in outs]
