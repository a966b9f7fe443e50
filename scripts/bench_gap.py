"""How much of a timed layer launch lies outside its in-kernel trace span (GPU only).

time_layers.py's launch time has run 12-20 us over the trace's span (first CTA start to last CTA end), and
the trace runs alone on freshly made weights while time_layers streams cold copies. This replays two
traced launches of the kind, A and B (separate weights and scratch), alternating in one CUDA graph, and
reads the last A's and the last B's per-CTA %globaltimer rows, absolute: per launch, the time from the
graph's events, A's and B's spans, the ramp (first to last CTA start), the drain (first to last CTA end),
and the gap from A's last CTA end to B's first CTA start (what the launch boundary costs). time per
launch = span + gap, so what is left over tells which side the excess is on. --report prints A's last
trace as diag_layers --trace does: the per-stage table of a launch in timing conditions.

  python scripts/bench_gap.py --kind kda --tp 8 [--rows 1] [--ctas-per-sm 2] [--experts 288] [--json-out F]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def cta_rows(L):
    """[(start, end)] absolute %globaltimer ns of each CTA of L's latest traced launch."""
    rows = L.trace_buf.cpu().tolist()
    n = int(L.starts[-1])
    return [(r[0], r[1]) for r in rows[n: n + L.grid] if r[0] >= 0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("embed", "dense", "kda", "sparse", "nextn", "tail"), required=True)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--pos", type=int, default=8191)
    ap.add_argument("--experts", type=int, default=288)
    ap.add_argument("--ctas-per-sm", type=int, default=None)
    ap.add_argument("--num-stages", type=int, default=None, help="layer kinds: GEMV software-pipeline depth "
                    "(time_layers' flag; default the launch's)")
    ap.add_argument("--pairs", type=int, default=8, help="A, B launches per graph replay (pairs)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--report", action="store_true", help="then the trace report (launches/trace.py) of A's last launch")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench_gap: needs a GPU", file=sys.stderr)
        return 2
    from diag_layers import build
    from glm53_flash.config import preset
    cfg = preset("glm53-flash").replace(n_routed_experts=args.experts, num_nextn_predict_layers=1)
    grid = (args.ctas_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
            if args.ctas_per_sm else None)
    kw = {} if args.num_stages is None else {"num_stages": args.num_stages}
    pair = [build(args.kind, cfg, args.tp, args.rows, args.weights, args.pos, "cuda", grid, **kw) for _ in range(2)]
    out = {"kind": args.kind, "tp": args.tp, "rows": args.rows, "weights": args.weights, "grid": pair[0][0].grid}
    for traced in (False, True):
        for L, run in pair:
            L.enable_trace(traced)
            for _ in range(2):
                run()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(args.pairs):
                for L, _ in pair:
                    L.enqueue()
        g.replay()
        torch.cuda.synchronize()
        us = []
        for _ in range(args.replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            us.append(a.elapsed_time(b) * 1e3 / (2 * args.pairs))
        key = "traced" if traced else "plain"
        out[f"us_{key}"] = round(statistics.median(us), 2)
        if traced:
            A, B = (cta_rows(L) for L, _ in pair)
            for name, r in (("A", A), ("B", B)):
                s0, s1 = min(s for s, _ in r), max(s for s, _ in r)
                e0, e1 = min(e for _, e in r), max(e for _, e in r)
                out[f"span_{name}"] = round((e1 - s0) / 1e3, 2)
                out[f"ramp_{name}"] = round((s1 - s0) / 1e3, 2)
                out[f"drain_{name}"] = round((e1 - e0) / 1e3, 2)
            out["gap_A_to_B"] = round((min(s for s, _ in B) - max(e for _, e in A)) / 1e3, 2)
            out["left_over"] = round(out["us_traced"] - out["span_B"] - out["gap_A_to_B"], 2)
        for L, _ in pair:
            L.check()
    print(" ".join(f"{k}={v}" for k, v in out.items()))
    if args.report:
        from glm53_flash.launches.trace import report
        print("-- the trace of the last A launch in the timed graph (cold weights, launches back to back):")
        print(report(pair[0][0]))
    if args.json_out:
        with open(args.json_out, "a") as f:
            f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
