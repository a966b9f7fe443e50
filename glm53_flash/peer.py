"""Mailboxes shared by TP ranks that run in separate processes (issue 6: host side; the launches do
not use it yet).

A cross-rank mailbox region (a layer launch's xo / xd, the tail's xchg) becomes one inbox per rank,
allocated by its owner: int64 tagged pairs [tp (src), width, N]. Rank r publishes into rank d's
inbox at rank d's base address, so every process holds an int64 table of all inbox addresses as
mapped in that process (CUDA IPC and shared memory map the same storage at different addresses in
different processes). A kernel turns a table word into a pointer with
`tl.load(table + d).to(tl.pointer_type(tl.int64), bitcast=True)`; tests/test_peer.py runs the real
pair code through it, in one process and across processes.

One process (loopback, and the single-GPU tests) builds the table from the slices of one
[tp (dest), ...] buffer (`loopback_inboxes`), so the same addressing is exercised everywhere.
Across GPUs the inboxes arrive through CUDA IPC (torch.multiprocessing); torch opens IPC handles with
lazy peer access, so a kernel on another GPU of the host can store into them.
"""
from __future__ import annotations

import torch


def inbox_table(inboxes: list[torch.Tensor]) -> torch.Tensor:
    """int64 [tp] of each rank's inbox base address in this process, on the inboxes' device."""
    if not inboxes:
        raise ValueError("inbox_table: no inboxes")
    first = inboxes[0]
    for d, b in enumerate(inboxes):
        if b.dtype != torch.int64 or not b.is_contiguous():
            raise ValueError(f"inbox_table: rank {d}'s inbox must be a contiguous int64 tensor, got {b.dtype}")
        if b.numel() != first.numel() or b.device.type != first.device.type:
            raise ValueError(f"inbox_table: rank {d}'s inbox ({b.numel()} words on {b.device}) differs from "
                             f"rank 0's ({first.numel()} words on {first.device})")
    return torch.tensor([b.data_ptr() for b in inboxes], dtype=torch.int64, device=first.device)


def loopback_inboxes(buf: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """Rank d's inbox = row d of one [tp (dest), ...] buffer: every rank in one process."""
    if buf.numel() % tp_size:
        raise ValueError(f"loopback_inboxes: {buf.numel()} words do not split into {tp_size} inboxes")
    return list(buf.view(tp_size, -1).unbind(0))


def share_inboxes(rank: int, inbox: torch.Tensor, queues: list) -> list[torch.Tensor]:
    """Exchange inboxes among the tp = len(queues) processes of a TP group (torch.multiprocessing
    queues, one per rank). Sends this rank's inbox to every other rank and receives theirs: CPU
    tensors travel as shared memory, CUDA tensors as IPC handles, and arrive mapped in this process.
    The caller keeps its own inbox alive while any rank may still use it. -> inboxes in rank order."""
    tp = len(queues)
    if not 0 <= rank < tp:
        raise ValueError(f"share_inboxes: rank {rank} outside a group of {tp}")
    if inbox.device.type == "cpu":
        inbox.share_memory_()
    for d in range(tp):
        if d != rank:
            queues[d].put((rank, inbox))
    out: list[torch.Tensor | None] = [None] * tp
    out[rank] = inbox
    for _ in range(tp - 1):
        src, t = queues[rank].get(timeout=120)
        out[src] = t
    return out
