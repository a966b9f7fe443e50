"""GPU check of the ModelRunner's CUDA graphs (issue 13): a graph runner (eager=False) and an eager runner on the
same prompts, decode steps of varying batch and slot order compared bitwise (logits and caches), each against the
reference's decode step, a fault rolled back with every cache unchanged, and a rough step time (tiny model, host
checks included: not a performance figure). Run on the GPU machine:

    PYTHONPATH=. python3 scripts/graph_check.py          (exit status 1 on any mismatch)
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from glm53_flash.model_runner import ModelRunner  # noqa: E402
from sync import HandoffTimeout  # noqa: E402


def ids(*v, dtype=torch.int64):
    return torch.tensor(v, dtype=dtype)


def main() -> int:
    kw = dict(device="cuda", max_slots=2, max_len=64, widths=(1, 2), progress=False, reference=True)
    t0 = time.time()
    graph = ModelRunner.from_preset("tiny", eager=False, **kw)
    print(f"graph runner built + captured in {time.time() - t0:.1f} s", flush=True)
    eager = ModelRunner.from_preset("tiny", eager=True, **kw)
    ok = True
    for r in (graph, eager):
        r.prefill(0, [3, 17, 42])
        r.prefill(1, [5, 6])
    steps = [((7, 9), (0, 1)), ((11,), (1,)), ((13, 2), (1, 0)), ((4, 4), (0, 1))]
    for n, (toks, sl) in enumerate(steps):
        outs = []
        for name, r in (("graph", graph), ("eager", eager)):
            pos = ids(*[r.length(s) for s in sl])
            snap = r.caches.clone()
            o = r.decode(ids(*toks), pos, ids(*sl, dtype=torch.int32))
            want = r.ref.decode_step(snap, ids(*toks).cuda(), pos.cuda(), ids(*sl).cuda()).logits
            rel = float((o.double() - want.double()).norm() / want.double().norm())
            print(f"step {n} {name} B={len(toks)} relative error vs the reference {rel:.2e}", flush=True)
            ok &= rel < 2e-2
            outs.append(o)
        same = torch.equal(outs[0], outs[1])
        print(f"step {n}: graph == eager bitwise: {same}", flush=True)
        ok &= same
    same = all(torch.equal(a, b) for a, b in zip(graph.caches.tensors().values(), eager.caches.tensors().values()))
    print("caches graph == eager bitwise:", same)
    ok &= same
    snap = {k: v.clone() for k, v in graph.caches.tensors().items()}
    try:
        graph.decode(ids(5), ids(graph.length(0)), ids(0, dtype=torch.int32), inject_fault="kda:kda.xe")
        print("fault: no HandoffTimeout raised")
        ok = False
    except HandoffTimeout as e:
        untouched = all(torch.equal(v, snap[k]) for k, v in graph.caches.tensors().items())
        print(f"fault: {str(e)[:80]} | caches untouched: {untouched}")
        ok &= untouched
    n = 50
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        graph.decode(ids(5, 6), ids(graph.length(0), graph.length(1)), ids(0, 1, dtype=torch.int32))
    torch.cuda.synchronize()
    print(f"tiny graph decode B=2: {(time.perf_counter() - t0) / n * 1e3:.2f} ms a step (host checks included)")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
