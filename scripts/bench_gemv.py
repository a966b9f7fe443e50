"""GEMV family benchmark: our tiled-MMA GEMV beside cuBLAS, a plain Triton GEMV and a naive FP8 one,
all in one run, against the read-only streaming bandwidth measured in the same run.

Why: the GEMV family streams almost every weight byte of a decode step, so its bandwidth sets the
floor of every launch. Target (task brief): >= 85% of the measured pure-read bandwidth for bf16 at
1 and 8 rows and FP8 at 1 row, at a ~200 MB weight (24896 x 4096: the KDA in-projection at TP1).

Method: 4 weight copies (rotated so L2 never holds one), x fixed (it is L2-resident in a real launch
too); each case is a CUDA graph of --reps launches; --windows interleaved windows, median per launch.
Bytes per launch = weights + scales + x. `--sweep` first screens a grid of tile configs and then
times the best per case beside the default. Prints a header card, a table, then one JSON line.
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

from bench_timing import (BenchCase, env_card, measure_read_bw, read_cases, report,  # noqa: E402
                          time_interleaved)
from time_layers import random_weight                                                                          # noqa: E402
from glm53_flash.kernels.gemv import TUNED, GemvConfig, gemv, gemv_kernel, is_even                             # noqa: E402


# ---------------------------------------------------------------------------------------- baselines
@triton.jit
def plain_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The textbook Triton GEMV: broadcast multiply, sum over K, fp32 accumulator (ROWS a power of 2)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, ROWS)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=offs_n[:, None] < N, other=0.0)
        x = tl.load(x_ptr + offs_r[:, None] * K + offs_k[None, :])
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(y_ptr + offs_r[:, None] * N + offs_n[None, :], acc, mask=offs_n[None, :] < N)


@triton.jit
def naive_fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr):
    """One row, FP8 e4m3 weights: per 128-wide K block, dequantize-free sum times the block scale."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.cdiv(K, 128)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, K, 128):
        offs_k = k + tl.arange(0, 128)
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], mask=offs_n[:, None] < N, other=0.0)
        x = tl.load(x_ptr + offs_k).to(tl.float32)
        s = tl.load(s_ptr + (offs_n // 128) * kb + k // 128, mask=offs_n < N, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1) * s
    tl.store(y_ptr + offs_n, acc, mask=offs_n < N)


# ------------------------------------------------------------------------------------------ configs
DEFAULT = dict(TUNED)
SWEEP = {   # (block_n, block_k, num_warps, num_stages, k_split[, even]); pf_k 128 throughout
    # bf16: a few of the earlier best, to see the mask-free (EVEN) loop did not cost anything
    "bf16": [(64, 128, 4, 3, 1, False), (64, 128, 4, 4, 1), (64, 128, 2, 4, 1)],
    # FP8 after the K-loop diet (x -> f16 once per CTA, scalar scale, EVEN): stages, wider K, wider tiles
    "fp8": [(64, 128, 4, 4, 1, False), (64, 128, 4, 3, 1), (64, 128, 4, 5, 1), (64, 128, 4, 6, 1),
            (64, 256, 4, 3, 1), (64, 256, 4, 4, 1), (128, 128, 8, 4, 1), (128, 128, 8, 5, 1),
            (128, 128, 4, 4, 1), (64, 128, 2, 4, 1), (32, 128, 2, 6, 1)],
}


# --variants (2026-11-30, FP8 memory side): per-tile rotated K start (k_rotate) and long row segments,
# timed beside the defaults in the same interleaved windows. (fmt, block_n, block_k, warps, stages, k_rotate);
# k_rotate -1: the prefetch + finish path (the FP8 default before k_rotate=1 became TUNED["fp8"])
VARIANTS = [
    ("fp8", 64, 128, 4, 4, -1), ("fp8", 64, 128, 4, 4, 0), ("fp8", 64, 128, 4, 4, 5), ("fp8", 64, 128, 4, 4, 13),
    ("fp8", 64, 128, 4, 5, 5), ("fp8", 32, 128, 2, 4, 5), ("fp8", 32, 256, 2, 4, 0), ("fp8", 32, 256, 2, 4, 5),
    ("fp8", 16, 512, 1, 3, 0), ("fp8", 64, 256, 4, 3, 3),
    ("bf16", 64, 128, 4, 3, 5), ("bf16", 64, 128, 4, 3, 1),
]


def cfg_name(c: GemvConfig) -> str:
    return (f"bn{c.block_n} bk{c.block_k} w{c.num_warps} s{c.num_stages}" + (f" ks{c.k_split}" if c.k_split > 1 else "")
            + ("" if c.even else " masked") + (f" rot{c.k_rotate}" if c.k_rotate >= 0 else ""))


def kernel_stats(c: GemvConfig, w, s, x, y) -> dict:
    """Registers / spills / shared memory of the compiled variant (compiles it)."""
    n, k = w.shape
    ck = gemv_kernel.warmup(x, w, s if s is not None else w, y, x.shape[0], n, k, k, n, x.shape[0] * n, k,
                            ROWS_PAD=c.rows_pad, BLOCK_N=c.block_n, BLOCK_K=c.block_k, PF_K=c.pf_k,
                            NUM_STAGES=c.num_stages, KSPLIT=c.k_split, EVEN=c.even and is_even(n, k, k, c),
                            ROT=c.k_rotate, num_warps=c.num_warps, grid=(1,))
    ck._init_handles()
    return {"regs": ck.n_regs, "spills": ck.n_spills, "smem": ck.metadata.shared}


def our_case(fmt, rows, c: GemvConfig, ws, xs, ys, label=None) -> BenchCase:
    x, y = xs[rows], ys[rows]
    fns = [lambda w=w, s=s: gemv(x, w, s, cfg=c, out=y) for w, s in ws[fmt]]
    w0, s0 = ws[fmt][0]
    return BenchCase(label or f"ours {fmt} rows{rows} {cfg_name(c)}", fns, nbytes(w0, s0, x),
                     {"fmt": fmt, "rows": rows, "cfg": cfg_name(c), **kernel_stats(c, w0, s0, x, y)})


def nbytes(w, s, x) -> int:
    return w.numel() * w.element_size() + (s.numel() * 4 if s is not None else 0) + x.numel() * x.element_size()


def baseline_cases(ws, xs) -> list[BenchCase]:
    """cuBLAS and the two plain Triton GEMVs; each is run once and checked against fp64 first."""
    out = []
    n, k = ws["bf16"][0][0].shape
    w0 = ws["bf16"][0][0]
    for rows in (1, 8):
        x = xs[rows]
        ref = x.double() @ w0.double().T
        yb = torch.empty(rows, n, device=x.device, dtype=torch.bfloat16)
        fns = [lambda w=w, x=x, y=yb: torch.matmul(x, w.T, out=y) for w, _ in ws["bf16"]]
        out.append(BenchCase(f"cuBLAS torch.matmul bf16 rows{rows}", fns, nbytes(w0, None, x),
                             {"fmt": "bf16", "rows": rows, "err": _run_err(fns[0], yb, ref)}, floor=False))
        yf = torch.empty(rows, n, device=x.device)
        bn = 16 if rows == 1 else 8
        fns = [lambda w=w, x=x, yf=yf, bn=bn, rows=rows: plain_gemv_kernel[(triton.cdiv(n, bn),)](
            x, w, yf, n, k, ROWS=rows, BLOCK_N=bn, BLOCK_K=512, num_warps=4) for w, _ in ws["bf16"]]
        out.append(BenchCase(f"plain Triton GEMV bf16 rows{rows}", fns, nbytes(w0, None, x),
                             {"fmt": "bf16", "rows": rows, "err": _run_err(fns[0], yf, ref)}, floor=False))
    x = xs[1]
    yf = torch.empty(n, device=x.device)
    q0, s0 = ws["fp8"][0]
    ref = (x.double() @ _dequant(q0, s0).T)[0]
    fns = [lambda q=q, s=s: naive_fp8_gemv_kernel[(triton.cdiv(n, 16),)](x, q, s, yf, n, k, BLOCK_N=16, num_warps=4)
           for q, s in ws["fp8"]]
    out.append(BenchCase("naive Triton FP8 GEMV rows1", fns, nbytes(q0, s0, x),
                         {"fmt": "fp8", "rows": 1, "err": _run_err(fns[0], yf, ref)}, floor=False))
    return out


def _dequant(q, s):
    n, k = q.shape
    return q.double() * s.double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def _run_err(fn, y, ref) -> str:
    y.fill_(float("nan"))
    fn()
    return f"{float((y.double() - ref).norm() / ref.norm()):.1e}"


def check(ws, xs):
    """Correctness of what is timed: ours vs an fp64 reference on the first copy (rows 8)."""
    errs = {}
    for fmt in ("bf16", "fp8"):
        w, s = ws[fmt][0]
        ref = xs[8].double() @ (w.double() if s is None else _dequant(w, s)).T
        y = gemv(xs[8], w, s, cfg=DEFAULT[fmt])
        errs[fmt] = float((y.double() - ref).norm() / ref.norm())
        assert errs[fmt] < 1e-5, (fmt, errs[fmt])
    return errs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=24896, help="output columns (default: KDA in-projection)")
    ap.add_argument("--k", type=int, default=4096, help="reduction length (hidden size)")
    ap.add_argument("--copies", type=int, default=4, help="weight copies rotated through (each > L2)")
    ap.add_argument("--reps", type=int, default=16, help="launches per timed graph")
    ap.add_argument("--windows", type=int, default=21, help="interleaved windows (median reported)")
    ap.add_argument("--sweep", action="store_true", help="screen a grid of tile configs first")
    ap.add_argument("--variants", action="store_true", help="time VARIANTS beside the defaults (same windows)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    dev = "cuda"
    ws = {"bf16": [random_weight(args.n, args.k, False, dev) for _ in range(args.copies)],
          "fp8": [random_weight(args.n, args.k, True, dev) for _ in range(args.copies)]}
    xs = {r: torch.randn(r, args.k, device=dev).bfloat16() for r in (1, 8)}
    ys = {r: torch.empty(r, args.n, device=dev) for r in (1, 8)}
    errs = check(ws, xs)
    bw, bw_detail = measure_read_bw()

    best = {(f, r): DEFAULT[f] for f in ("bf16", "fp8") for r in (1, 8)}
    screen = sweep(ws, xs, ys, best) if args.sweep else []

    cases = []
    for (fmt, rows), c in sorted(best.items()):
        cases.append(our_case(fmt, rows, c, ws, xs, ys))
        if c != DEFAULT[fmt]:
            cases.append(our_case(fmt, rows, DEFAULT[fmt], ws, xs, ys, f"ours {fmt} rows{rows} default"))
    if args.variants:
        cases += variant_cases(ws, xs, ys)
    cases += baseline_cases(ws, xs)
    words = ws["bf16"][0][0].numel() // 2
    if words % 2 ** 15 == 0:                  # the pure-read kernel over the very same weight copies
        rc = read_cases([w.view(torch.int32).view(-1) for w, _ in ws["bf16"]])[0]
        cases.append(BenchCase("pure read (same bf16 copies)", rc.fns, words * 4, floor=False))
    us = time_interleaved(cases, reps=args.reps, windows=args.windows)
    card = {**env_card(), "shape": f"{args.n}x{args.k}", "copies": args.copies, "reps": args.reps,
            "windows": args.windows, "read_kernels_gbps": bw_detail, "rel_err_vs_fp64": errs}
    report("bench_gemv", card, bw, cases, us, extra_cols=("regs", "spills", "smem", "err"),
           extra={"sweep": screen} if screen else None)
    return 0


def variant_cases(ws, xs, ys) -> list[BenchCase]:
    """VARIANTS at 1 and 8 rows, each checked first: error vs fp64 (rows 8), row 0 alone == row 0 of 8
    (batch invariance), two runs equal."""
    out = []
    for fmt, bn, bk, nw, ns, rot in VARIANTS:
        c = GemvConfig(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, k_rotate=rot)
        w, s = ws[fmt][0]
        ref = xs[8].double() @ (w.double() if s is None else _dequant(w, s)).T
        try:
            y8 = gemv(xs[8], w, s, cfg=c)
            err = float((y8.double() - ref).norm() / ref.norm())
            inv = bool(torch.equal(gemv(xs[8][:1], w, s, cfg=c)[0], y8[0]) and torch.equal(gemv(xs[8], w, s, cfg=c), y8))
            print(f"variant {fmt} {cfg_name(c)}: err {err:.1e} batch-invariant+deterministic {inv}")
            for rows in (1, 8):
                case = our_case(fmt, rows, c, ws, xs, ys)
                case.info.update(err=f"{err:.1e}" + ("" if inv else " NOT-INV"))
                out.append(case)
        except Exception as e:
            print(f"skip {fmt} {cfg_name(c)}: {type(e).__name__}: {str(e)[:200]}")
    return out


def sweep(ws, xs, ys, best: dict) -> list[dict]:
    """Screen SWEEP's configs (short windows); put the fastest correct, spill-free one per (fmt, rows)
    in best."""
    cases = []
    for fmt, grid in SWEEP.items():
        w, s = ws[fmt][0]
        ref = xs[8].double() @ (w.double() if s is None else _dequant(w, s)).T
        for bn, bk, nw, ns, ks, *even in grid:
            c = GemvConfig(block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, k_split=ks, even=even[0] if even else True)
            try:
                err = float((gemv(xs[8], w, s, cfg=c).double() - ref).norm() / ref.norm())
                for rows in (1, 8):
                    case = our_case(fmt, rows, c, ws, xs, ys)
                    case.info.update(config=c, err=f"{err:.1e}", ok=err < 1e-5)
                    cases.append(case)
            except Exception as e:              # a config that does not compile or fit is reported, not fatal
                print(f"skip {fmt} {cfg_name(c)}: {type(e).__name__}: {str(e)[:200]}")
    t = time_interleaved(cases, reps=8, windows=5)
    fastest: dict = {}
    screen = []
    for c in cases:
        key, us = (c.info["fmt"], c.info["rows"]), t[c.name]
        screen.append({"case": c.name, "us": round(us, 2), "gbps": round(c.bytes_read / us / 1e3),
                       **{k: v for k, v in c.info.items() if k != "config"}})
        if c.info["ok"] and c.info["spills"] == 0 and (key not in fastest or us < fastest[key][0]):
            fastest[key] = (us, c.info["config"])
    for key, (_, c) in fastest.items():
        best[key] = c
    print("sweep (screening: 5 windows x 8 launches):")
    for r in sorted(screen, key=lambda r: (r["fmt"], r["rows"], r["us"])):
        print(f"   {r['case']:44s} {r['us']:8.2f} us {r['gbps']:6d} GB/s  regs {r['regs']} spills {r['spills']} "
              f"smem {r['smem']} err {r['err']}")
    return screen


if __name__ == "__main__":
    sys.exit(main())
