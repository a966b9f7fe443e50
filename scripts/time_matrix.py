"""Run scripts/time_layers.py over a matrix of cases in one process, one case after another.

Why: a device session is short, and each separate `time_layers.py` call pays Python, torch and CUDA
start-up again. This driver calls `time_layers.main(argv)` for each case of the matrix (same flags as
time_layers; list values comma-separated), prints each case's card and table as time_layers does, and
appends each case's JSON record (time_layers' last line, plus the argv) to --json-out. A case that fails
is recorded with its error and the matrix goes on. --deadline stops starting new cases after that many
seconds, so a device call ends inside its limit; cases not started are listed at the end.

Example: python scripts/time_matrix.py --kinds kda,sparse --tp 1,8 --rows 1,8 --weights bf16,fp8 \\
             --pos 8191 --json-out /tmp/t.jsonl --deadline 400
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def csv(kind):
    return lambda s: [kind(v) for v in s.split(",") if v]


def matrix(args) -> list[list[str]]:
    """argv lists for time_layers.main, in order: kind, then weights, tp, rows, pos (pos only for DSA kinds)."""
    out = []
    for kind, fmt, tp, rows in itertools.product(args.kinds, args.weights, args.tp, args.rows):
        for pos in (args.pos if kind in ("sparse", "nextn") and args.pos else [None]):
            argv = ["--kind", kind, "--weights", fmt, "--tp", str(tp), "--rows", str(rows),
                    "--windows", str(args.windows), "--reps", str(args.reps)]
            if pos is not None:
                argv += ["--pos", str(pos)]
            if args.experts:
                argv += ["--experts", str(args.experts)]
            if args.max_copies:
                argv += ["--max-copies", str(args.max_copies)]
            if args.dry_run:
                argv += ["--dry-run"]
            for v in args.variants:
                out.append(argv + v.split())
    return out


def run_case(time_layers, argv) -> dict:
    buf = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(buf):
            rc = time_layers.main(argv)
        text = buf.getvalue()
        last = text.strip().splitlines()[-1] if text.strip() else "{}"
        rec = json.loads(last) if last.startswith("{") else {"error": f"no JSON record (rc {rc})"}
    except (Exception, SystemExit):             # noqa: BLE001 - record it (argparse exits), go on
        text = buf.getvalue()
        rec = {"error": traceback.format_exc(limit=6)}
    sys.stdout.write(text)
    import gc
    gc.collect()
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        sys.modules["torch"].cuda.empty_cache()        # the next case builds its weights in this one's place
    if "error" in rec:
        print(f"!! {' '.join(argv)}: {rec['error']}")
    rec.update(argv=argv, wall_s=round(time.perf_counter() - t0, 1))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--kinds", type=csv(str), required=True, help="time_layers kinds, e.g. kda,sparse,nextn")
    ap.add_argument("--tp", type=csv(int), default=[1], help="TP degrees, e.g. 1,8")
    ap.add_argument("--rows", type=csv(int), default=[1], help="batch widths, e.g. 1,8")
    ap.add_argument("--weights", type=csv(str), default=["bf16"], help="bf16,fp8")
    ap.add_argument("--pos", type=csv(int), default=[], help="sparse / nextn positions, e.g. 640,8191,65535")
    ap.add_argument("--experts", type=int, default=None, help="passed to time_layers --experts")
    ap.add_argument("--max-copies", type=int, default=None, help="passed to time_layers --max-copies")
    ap.add_argument("--windows", type=int, default=15)
    ap.add_argument("--reps", type=int, default=16)
    ap.add_argument("--dry-run", action="store_true", help="passed to time_layers (CPU, tiny preset, untimed)")
    ap.add_argument("--variants", type=lambda s: s.split("|"), default=[""],
                    help="'|'-separated extra time_layers flags, each case run once per variant, e.g. "
                         "\"|--block-n 32|--ctas-per-sm 2\" (the empty first one: the defaults)")
    ap.add_argument("--json-out", default=None, help="append one JSON record per case to this file")
    ap.add_argument("--deadline", type=float, default=None, help="seconds after which no new case starts")
    args = ap.parse_args(argv)
    import time_layers
    t_start = time.perf_counter()
    cases = matrix(args)
    skipped = []
    for i, case in enumerate(cases):
        if args.deadline is not None and time.perf_counter() - t_start > args.deadline:
            skipped = cases[i:]
            break
        print(f"\n##### [{i + 1}/{len(cases)}] time_layers.py {' '.join(case)}", flush=True)
        rec = run_case(time_layers, case)
        if args.json_out:
            with open(args.json_out, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")
        sys.stdout.flush()
    for case in skipped:
        print(f"not started (deadline): time_layers.py {' '.join(case)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
