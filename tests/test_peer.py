"""glm53_flash/peer.py: tagged pairs exchanged between TP ranks through a table of inbox addresses,
the mechanism TP across GPUs needs (issue 6, docs/DECISIONS.md). Real sync code (publish_pairs /
await_pairs) under the interpreter: every rank in one process (loopback table), and one process per
rank (inboxes in shared memory, exchanged with torch.multiprocessing, as CUDA IPC will carry them);
plus the sm_90 compile of the table bitcast. The launches do not use the table yet."""
import pytest
import torch
import triton
import triton.language as tl

from glm53_flash.peer import inbox_table, loopback_inboxes, share_inboxes
from sync import read_record, timeout_ns
from sync.asm import PAIR_LOAD
from sync.device import await_pairs, publish_pairs
from sync.header import HEADER_WORDS
from test_sync import sm90_ptx

N = 16


@triton.jit
def peer_table_kernel(inbox_addr, n_ranks, rank0, hdr, got, ok_out, tag, budget_ns, phase, N: tl.constexpr):
    """Program i plays TP rank r = rank0 + i. Phase 0: publish r's N values into slot r of every rank's
    inbox, each inbox found through the address table. Phase 1: await its own inbox's slots in rank
    order; got[i, s] = the payload from rank s, ok_out[i, s] = 1 if it arrived."""
    i = tl.program_id(0)
    r = rank0 + i
    j = tl.arange(0, N)
    if phase == 0:
        d = 0
        while d < n_ranks:
            inbox = tl.load(inbox_addr + d).to(tl.pointer_type(tl.int64), bitcast=True)
            publish_pairs(inbox + r * N + j, r * 1000 + d * 100 + j, tag, j < N, 0, -1)
            d += 1
    else:
        inbox = tl.load(inbox_addr + r).to(tl.pointer_type(tl.int64), bitcast=True)
        s = 0
        while s < n_ranks:
            vals, ok = await_pairs(inbox + s * N + j, j < N, tag, hdr, 0, r, budget_ns)
            tl.store(got + (i * n_ranks + s) * N + j, vals)
            tl.store(ok_out + i * n_ranks + s, ok)
            s += 1


def expected(ranks_here, tp):
    return torch.tensor([[[s * 1000 + d * 100 + j for j in range(N)] for s in range(tp)] for d in ranks_here],
                        dtype=torch.int32)


def run_phase(table, tp, rank0, n_here, tag, phase):
    hdr = torch.zeros(HEADER_WORDS, dtype=torch.int32)
    got = torch.full((n_here, tp, N), -1, dtype=torch.int32)
    ok = torch.zeros(n_here, tp, dtype=torch.int32)
    peer_table_kernel[(n_here,)](table, tp, rank0, hdr, got, ok, tag, timeout_ns(1.0), phase, N=N)
    return got, ok, read_record(hdr)


def test_loopback_table_exchange():
    """Four ranks in one process, inboxes = rows of one buffer: every rank receives every rank's values,
    every word carries the tag, and awaiting a tag nobody published times out with the record set."""
    tp, tag = 4, 7
    buf = torch.zeros(tp * tp * N, dtype=torch.int64)
    table = inbox_table(loopback_inboxes(buf, tp))
    assert table.tolist() == [buf.data_ptr() + d * tp * N * 8 for d in range(tp)]
    run_phase(table, tp, 0, tp, tag, 0)
    got, ok, _ = run_phase(table, tp, 0, tp, tag, 1)
    assert ok.eq(1).all() and torch.equal(got, expected(range(tp), tp))
    assert ((buf & 0xFFFFFFFF) == tag).all()
    got, ok, rec = run_phase(table, tp, 0, tp, tag + 1, 1)
    assert ok.eq(0).all() and rec.err_tag == tag + 1 and rec.wanted == tag + 1 and rec.seen == tag


def test_inbox_table_refuses_mismatched_inboxes():
    with pytest.raises(ValueError, match="int64"):
        inbox_table([torch.zeros(4, dtype=torch.int32)])
    with pytest.raises(ValueError, match="differs"):
        inbox_table([torch.zeros(4, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)])
    with pytest.raises(ValueError, match="split"):
        loopback_inboxes(torch.zeros(10, dtype=torch.int64), 4)


def _rank_main(rank, tp, tag, queues, barrier, results):
    inbox = torch.zeros(tp * N, dtype=torch.int64)
    inboxes = share_inboxes(rank, inbox, queues)
    table = inbox_table(inboxes)
    run_phase(table, tp, rank, 1, tag, 0)
    barrier.wait(timeout=120)                       # every rank has published (the launches' stage order)
    got, ok, _ = run_phase(table, tp, rank, 1, tag, 1)
    results.put((rank, got.tolist(), ok.tolist(), (inbox & 0xFFFFFFFF).eq(tag).all().item()))
    barrier.wait(timeout=120)                       # keep this inbox mapped until every rank has read


def test_one_process_per_rank_exchange():
    """Two ranks in two processes (spawned, interpreter): each allocates its inbox, the inboxes are
    exchanged through torch.multiprocessing (shared memory here; CUDA IPC on GPUs), each builds its own
    table and publishes into the other's inbox; each receives both ranks' values, tag-checked."""
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    tp, tag = 2, 5
    queues = [ctx.Queue() for _ in range(tp)]
    barrier, results = ctx.Barrier(tp), ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, tp, tag, queues, barrier, results)) for r in range(tp)]
    for p in procs:
        p.start()
    try:
        out = dict((r, (g, o, t)) for r, g, o, t in (results.get(timeout=300) for _ in range(tp)))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    for r in range(tp):
        got, ok, tagged = out[r]
        assert ok == [[1] * tp] and torch.equal(torch.tensor(got, dtype=torch.int32), expected([r], tp)) and tagged


_COMPILE_PEER = r"""
import json, sys, triton
sys.path.insert(0, "tests")
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from test_peer import peer_table_kernel as k
sig = {"inbox_addr": "*i64", "n_ranks": "i32", "rank0": "i32", "hdr": "*i32", "got": "*i32", "ok_out": "*i32",
       "tag": "i32", "budget_ns": "i64", "phase": "i32", "N": "constexpr"}
ck = triton.compile(ASTSource(fn=k, signature=sig, constexprs={"N": 16}), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": 4})
print(json.dumps({"ptx": ck.asm["ptx"]}))
"""


def test_sm90_peer_table_compiles_to_pair_stores_and_polls():
    """The table bitcast compiles for sm_90 into the same relaxed 8-byte pair stores and polls a local
    mailbox uses, at the loaded table word's address (a peer-mapped address is an ordinary global
    address; across GPUs only the scope of those stores and polls changes)."""
    ptx = sm90_ptx(_COMPILE_PEER)
    assert "st.relaxed.gpu.global.b64" in ptx and PAIR_LOAD in ptx
    assert any(f"ld.global{s}.b64" in ptx for s in ("", ".nc")) or "ld.global.u64" in ptx    # the table word

