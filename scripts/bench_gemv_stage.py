"""One GEMV stage of a persistent launch, alone: is its K step paced by memory or by the loop?

Why: inside the layer launches a streaming stage (KDA in_proj, the routed expert items, moe_down) runs at
~1 us a 16 KB K step per task, and in the twelfth session a stage whose weights sat in L2 ran only ~1 us
shorter over 8 steps (docs/DECISIONS.md). This script times the launches' own device function
(kernels/gemv.py gemv_stream: one pipelined cp.async loop per task, x in the same stages) as one plain
grid, one task per CTA, a (tile, K slice) per task with partial planes, exactly as layer_host plans a
stage: once with the weight L2-resident (one copy, reused) and once from HBM (copies rotated). If the
L2 case is not much faster than the HBM one, the step itself is the limit; if it is, the launches lose
their time to what runs around the stage (hops, skew, the latency-bound tasks beside it).

Each case is a CUDA graph of --reps launches; an empty kernel on the same grid is timed beside them (its
time is the per-launch overhead in a graph). Prints the table and one JSON line (bench_timing.report).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch                     # noqa: E402
import triton                    # noqa: E402
import triton.language as tl     # noqa: E402

from bench_timing import BenchCase, env_card, measure_read_bw, read_cases, report, time_interleaved  # noqa: E402
from time_layers import random_weight                                                                # noqa: E402
from glm53_flash.kernels.gemv import gemv_store, gemv_stream                                          # noqa: E402


@triton.jit
def stage_kernel(x_ptr, w_ptr, y_ptr, rows, N, K, KL, n_tiles, ROWS_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Program p: tile p % n_tiles over K slice p // n_tiles (KL wide) -> partial plane p // n_tiles of y
    [planes, ROWS_PAD, N] fp32. Whole tiles only (the caller checks), so the loop runs mask-free (EVEN)."""
    pid = tl.program_id(0)
    t = pid % n_tiles
    ks = pid // n_tiles
    acc = gemv_stream(w_ptr, w_ptr, x_ptr, K, rows, t * BLOCK_N, ks * KL, ks * KL + KL, N, K, ROWS_PAD, BLOCK_N,
                      BLOCK_K, NUM_STAGES, True)
    gemv_store(y_ptr + ks * (ROWS_PAD * N), N, acc, rows, t * BLOCK_N, N, ROWS_PAD, BLOCK_N)


@triton.jit
def empty_kernel(y_ptr):
    tl.store(y_ptr + tl.program_id(0), 0.0)


# (label, N, K (0: --k), block_n, block_k, k slices, stages): tasks = N / block_n * k slices, one CTA each (<= 2 an SM)
CASES = [
    ("inproj bn64 bk128 ks4 s5", 3136, 0, 64, 128, 4, 5),      # KDA in_proj at TP8 as the launch cuts it
    ("inproj bn64 bk128 ks4 s3", 3136, 0, 64, 128, 4, 3),
    ("inproj bn64 bk256 ks4 s3", 3136, 0, 64, 256, 4, 3),      # half the steps, 32 KB each
    ("inproj bn32 bk128 ks2 s5", 3136, 0, 32, 128, 2, 5),      # 16 steps of 8 KB
    ("experts bn128 bk64 ks8 s5", 4096, 0, 128, 64, 8, 5),     # the routed expert items (128 B a row a step)
    ("experts bn64 bk128 ks4 s5", 4096, 0, 64, 128, 4, 5),     # same bytes a step, 256 B a row
    ("down bn64 bk128 ks4 s5", 4096, 2048, 64, 128, 4, 5),     # 8 experts' down rows (K = 8 x 256): moe_down's bytes
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4096, help="reduction length (hidden size)")
    ap.add_argument("--copies", type=int, default=8, help="weight copies rotated through for the HBM cases")
    ap.add_argument("--rows", type=int, default=1, help="activation rows (1..8)")
    ap.add_argument("--reps", type=int, default=16, help="launches per timed graph")
    ap.add_argument("--windows", type=int, default=9, help="interleaved windows (median reported)")
    ap.add_argument("--only", default="", help="comma-separated substrings: time only the cases they match")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv_stage.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = "cuda"
    cases_def = [(lb, n, k or args.k, *rest) for lb, n, k, *rest in CASES
                 if not args.only or any(s in lb for s in args.only.split(","))]
    xs = {k: torch.randn(args.rows, k, device=dev).bfloat16() for k in sorted({c[2] for c in cases_def})}
    ws = {(n, k): [random_weight(n, k, False, dev)[0] for _ in range(args.copies)]
          for n, k in sorted({(c[1], c[2]) for c in cases_def})}
    bw, bw_detail = measure_read_bw()
    cases, errs = [], {}
    for label, n, K, bn, bk, ks, ns in cases_def:
        assert n % bn == 0 and K % (ks * bk) == 0, label
        x = xs[K]
        n_tiles, kl = n // bn, K // ks
        grid = (n_tiles * ks,)
        y = torch.empty(ks, 8, n, device=dev)
        y.fill_(float("nan"))

        def launch(w, y=y, x=x, n=n, K=K, bn=bn, bk=bk, ns=ns, n_tiles=n_tiles, kl=kl, grid=grid):
            stage_kernel[grid](x, w, y, args.rows, n, K, kl, n_tiles, ROWS_PAD=8, BLOCK_N=bn, BLOCK_K=bk,
                               NUM_STAGES=ns, num_warps=4)
        w0 = ws[(n, K)][0]
        launch(w0)
        ref = x.double() @ w0.double().T
        got = y[:, :args.rows].double().sum(0)
        errs[label] = float((got - ref).norm() / ref.norm())
        assert errs[label] < 1e-5, (label, errs[label])
        nbytes = w0.numel() * 2 + x.numel() * 2
        info = {"tasks": grid[0], "steps": kl // bk, "step_kb": bn * min(bk, 128) * 2 * (bk // min(bk, 128)) // 1024}
        cases.append(BenchCase(f"{label} L2", [lambda w0=w0, f=launch: f(w0)], nbytes, {**info, "src": "L2"}))
        cases.append(BenchCase(f"{label} HBM", [lambda w=w, f=launch: f(w) for w in ws[(n, K)]], nbytes,
                               {**info, "src": "HBM"}))
    for g in sorted({c.info["tasks"] for c in cases}):
        ye = torch.empty(g, device=dev)
        cases.append(BenchCase(f"empty kernel grid {g}", [lambda g=g, ye=ye: empty_kernel[(g,)](ye)], 0,
                               {"tasks": g}, floor=False))
    big = max(ws, key=lambda nk: nk[0] * nk[1])
    words = ws[big][0].numel() // 2
    if words % 2 ** 15 == 0:
        rc = read_cases([w.view(torch.int32).view(-1) for w in ws[big]])[0]
        cases.append(BenchCase(f"pure read {big[0]}x{big[1]} HBM", rc.fns, words * 4, floor=False))
    us = time_interleaved(cases, reps=args.reps, windows=args.windows)
    card = {**env_card(), "k": args.k, "rows": args.rows, "copies": args.copies, "reps": args.reps,
            "windows": args.windows, "read_kernels_gbps": bw_detail, "rel_err_vs_fp64": errs}
    report("bench_gemv_stage", card, bw, cases, us, extra_cols=("tasks", "steps", "step_kb", "src"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
