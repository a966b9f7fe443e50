"""Protocol stress: thousands of launches of the hand-off self-test (and of the tail launch), every word
checked after every launch, plus CUDA-graph replays that take their tags from the device epoch.

  python3 scripts/stress.py [--launches N] [--graph-replays R] [--tail-launches T] [--quick]

Phases (GPU): eager self-test launches over several shapes (warps 1.. of the producers sleep before
storing, so the CTA barrier + release must cover them), a graph of 50 launches replayed R times (the
accumulated wrong-word counters and the epoch are checked at the end), a positive control (one word
flipped: every consumer must count it), and tail launches with random widths, each compared bitwise with
the first result for its input. CPU (TRITON_INTERPRET=1): a short self-test run, stage by stage.
Prints one JSON line last: {"wrong_words": 0, ...}; exit status 1 if any word was wrong.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sync import read_record  # noqa: E402
from sync.selftest import SelfTest  # noqa: E402


def selftest_phase(shapes, launches: int, device) -> dict:
    wrong = 0
    n = 0
    for grid, P, C, words, pairs in shapes:
        st = SelfTest(grid, P, C, words, pairs, device=device)
        for i in range(launches):
            r = st.run(sleep_ns=(i % 4) * 1500 if device != "cpu" else 0)
            wrong += r["consumer_bad"] + r["total"]
            n += 1
        assert st.layout.check_canaries(st.scratch) == [], "canary overwritten"
    return {"selftest_launches": n, "selftest_wrong": wrong}


def graph_phase(grid, replays: int, per_graph: int = 50) -> dict:
    st = SelfTest(grid, 8, grid, 2048, 32, device="cuda")
    st.run()                                                   # compile + warm
    hdr = st.layout.view(st.scratch, "hdr")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        st.launch(sleep_ns=1000)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    e0 = read_record(hdr).epoch
    base = st.bad.clone()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            st.launch(sleep_ns=1000)
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    rec = read_record(hdr)
    wrong = int((st.bad - base).sum())
    launches = replays * per_graph
    return {"graph_launches": launches, "graph_wrong": wrong, "graph_epoch_ok": rec.epoch - e0 == launches,
            "graph_error_record": rec.failed}


def control_phase(device) -> dict:
    st = SelfTest(8 if device == "cpu" else 132, 3, 5 if device == "cpu" else 132, 64, 4, device=device)
    r = st.run(corrupt=True)
    return {"control_detected": r["consumer_bad"] == st.C and r["total"] == st.C}


def tail_phase(launches: int) -> dict:
    from glm53_flash.config import preset
    from glm53_flash.launches.tail import TailLaunch
    cfg = preset("glm53-flash")
    g = torch.Generator(device="cuda").manual_seed(7)
    W = (torch.randn(cfg.vocab_size, cfg.hidden_size, device="cuda", generator=g) / 64).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(cfg.hidden_size, device="cuda", generator=g)).to(torch.bfloat16)
    L = TailLaunch(cfg, W, nw, width=8, device="cuda")
    inputs = [torch.randn(r, 4, cfg.hidden_size, device="cuda", generator=g) for r in (1, 2, 3, 4, 5, 6, 7, 8)]
    first = {}
    wrong = 0
    for i in range(launches):
        k = int(torch.randint(0, len(inputs), (1,), generator=torch.Generator().manual_seed(i)))
        lg, tok = L.run(inputs[k])
        if k not in first:
            first[k] = (lg, tok)
        else:
            wrong += int((lg != first[k][0]).sum()) + int((tok != first[k][1]).sum())
    return {"tail_launches": launches, "tail_wrong": wrong}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=1000, help="eager self-test launches per shape")
    ap.add_argument("--graph-replays", type=int, default=40, help="replays of a 50-launch graph")
    ap.add_argument("--tail-launches", type=int, default=200)
    ap.add_argument("--quick", action="store_true", help="a few launches (smoke run)")
    a = ap.parse_args(argv)
    t0 = time.time()
    out: dict = {}
    if torch.cuda.is_available():
        n_sm = torch.cuda.get_device_properties(0).multi_processor_count
        n = 20 if a.quick else a.launches
        shapes = [(n_sm, 8, n_sm, 4096, 64), (4 * n_sm, 16, 4 * n_sm, 256, 8), (2 * n_sm, 33, n_sm, 1024, 16)]
        out.update(selftest_phase(shapes, n, "cuda"))
        out.update(graph_phase(2 * n_sm, 2 if a.quick else a.graph_replays))
        out.update(control_phase("cuda"))
        out.update(tail_phase(10 if a.quick else a.tail_launches))
    else:
        out.update(selftest_phase([(6, 2, 4, 40, 3), (40, 3, 36, 16, 2)], 2 if a.quick else 5, "cpu"))
        out.update(control_phase("cpu"))
    wrong = sum(v for k, v in out.items() if k.endswith("_wrong"))
    ok = wrong == 0 and out.get("control_detected", False) and out.get("graph_epoch_ok", True) \
        and not out.get("graph_error_record", False)
    out.update(wrong_words=wrong, ok=bool(ok), seconds=round(time.time() - t0, 1))
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
