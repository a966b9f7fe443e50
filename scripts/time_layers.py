"""Kernel-only time per launch at one rank's real shapes, beside its floor (DESIGN.md §8).

Why: a launch is judged against the bytes it must read over the measured HBM read bandwidth, so every
timing here is printed beside that floor. Random weights at real shapes (preset glm53-flash) are made
directly on the GPU (torch.randn, scaled), several copies of each, and the timed graph rotates among
them so the 60 MB L2 never holds a weight. Each case is captured once as a CUDA graph of `--reps`
launches; windows of all cases are interleaved and the median per-launch time is reported.

Kinds: `gemv` times the GEMVs of one rank (our GEMV family beside cuBLAS); `tail` times the tail launch
(glm53_flash/launches/tail.py, one rank, loopback for TP > 1) beside the same math as torch ops. A
kind is a builder returning [BenchCase] (name, one callable per weight copy, bytes read); later kinds
(model, step, embed, dense, kda, sparse, nextn) plug in the same way.

Output: a header card, a table (us, floor us, % of floor, GB/s), then one JSON line.
The timing helpers (read bandwidth, interleaved graph timing, card) are reused by bench_gemv.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch                     # noqa: E402
import triton                    # noqa: E402
import triton.language as tl     # noqa: E402

L2_BYTES = 60 * 2 ** 20          # H200; read from the device when available
LATER_KINDS = ("model", "step", "embed", "dense", "kda", "sparse", "nextn")


@dataclass
class BenchCase:
    name: str
    fns: list[Callable[[], object]]   # one launch each; rotated so no weight copy stays in L2
    bytes_read: int                   # bytes one launch must read (weights + scales + activations)
    info: dict = field(default_factory=dict)   # extra columns (shape, config, registers...)
    floor: bool = True                # False: a baseline shown beside, not judged


# ------------------------------------------------------------------------------------- measuring
@triton.jit
def _read_kernel(p, out, chunk, BLOCK: tl.constexpr):
    # every program sums `chunk` int32 words; the sum is stored so the loads cannot be removed
    base = tl.program_id(0).to(tl.int64) * chunk
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, chunk, BLOCK):
        acc += tl.load(p + base + i + tl.arange(0, BLOCK))
    tl.store(out + tl.program_id(0), tl.sum(acc, 0))


def read_cases(bufs: list[torch.Tensor]) -> list[BenchCase]:
    """Pure-read kernels over the given buffers (int32 views, numel divisible by 2**15)."""
    cases = []
    words = bufs[0].numel()
    out = torch.empty(words // 2 ** 12, dtype=torch.int32, device=bufs[0].device)
    for chunk, block, warps in ((2 ** 15, 2048, 8), (2 ** 14, 2048, 8), (2 ** 16, 4096, 8), (2 ** 15, 1024, 4),
                                (2 ** 15, 8192, 8)):
        grid = (words // chunk,)
        fns = [lambda b=b, c=chunk, k=block, w=warps, g=grid: _read_kernel[g](b, out, c, BLOCK=k, num_warps=w)
               for b in bufs]
        cases.append(BenchCase(f"read c{chunk} b{block} w{warps}", fns, words * 4, floor=False))
    return cases


def time_interleaved(cases: list[BenchCase], reps: int = 16, windows: int = 15) -> dict[str, float]:
    """Median microseconds per launch of each case: graphs of `reps` launches, windows interleaved."""
    graphs = {}
    stream = torch.cuda.Stream()
    for c in cases:
        for f in c.fns:                    # warm up: compile and autotune outside the capture
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=stream):
            for i in range(reps):
                c.fns[i % len(c.fns)]()
        graphs[c.name] = g
    for g in graphs.values():
        g.replay()
    torch.cuda.synchronize()
    samples = {c.name: [] for c in cases}
    names = [c.name for c in cases]
    for w in range(windows):
        order = names[w % len(names):] + names[:w % len(names)]   # rotate who goes first
        evs = []
        for n in order:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graphs[n].replay()
            e.record()
            evs.append((n, s, e))
        torch.cuda.synchronize()
        for n, s, e in evs:
            samples[n].append(s.elapsed_time(e) * 1e3 / reps)
    return {n: statistics.median(v) for n, v in samples.items()}


def measure_read_bw(device: str = "cuda", reps: int = 16, windows: int = 9) -> tuple[float, dict]:
    """Best pure-read bandwidth (bytes/s) over a few kernel shapes, on 4 buffers of 2**28 bytes."""
    bufs = [torch.randint(-2 ** 30, 2 ** 30, (2 ** 26,), dtype=torch.int32, device=device) for _ in range(4)]
    cases = read_cases(bufs)
    t = time_interleaved(cases, reps, windows)
    detail = {c.name: round(c.bytes_read / t[c.name] / 1e3, 1) for c in cases}   # GB/s
    del bufs
    return max(detail.values()) * 1e9, detail


def env_card() -> dict:
    p = torch.cuda.get_device_properties(0)
    try:
        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
        commit = (head or "unknown") + (" + uncommitted" if dirty.strip() else "")
    except OSError:
        commit = "unknown"
    return {"gpu": p.name, "sms": p.multi_processor_count, "l2_mb": round(getattr(p, "L2_cache_size", L2_BYTES) / 2 ** 20),
            "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def report(title: str, card: dict, bw: float, cases: list[BenchCase], us: dict[str, float],
           extra_cols: tuple[str, ...] = (), extra: dict | None = None) -> dict:
    """Print the header card and the table; return the JSON record (also printed, last line)."""
    judged = [c for c in cases if c.floor]
    total_bytes = sum(c.bytes_read for c in judged)
    print(f"== {title}")
    for k, v in card.items():
        print(f"   {k:10s} {v}")
    print(f"   {'read bw':10s} {bw / 1e12:.3f} TB/s (best pure-read kernel, same run)")
    print(f"   {'bytes':10s} {total_bytes / 1e6:.1f} MB over {len(judged)} judged cases; floor "
          f"{total_bytes / bw * 1e6:.1f} us")
    hdr = f"{'case':44s} {'us':>9s} {'floor us':>9s} {'% floor':>8s} {'GB/s':>8s}"
    for col in extra_cols:
        hdr += f" {col:>12s}"
    print(hdr)
    rows = []
    for c in cases:
        t = us[c.name]
        floor = c.bytes_read / bw * 1e6
        line = f"{c.name:44s} {t:9.2f} {floor:9.2f} {100 * floor / t:7.1f}% {c.bytes_read / t / 1e3:8.0f}"
        for col in extra_cols:
            line += f" {str(c.info.get(col, '')):>12s}"
        print(line)
        rows.append({"case": c.name, "us": round(t, 3), "floor_us": round(floor, 3),
                     "pct_floor": round(100 * floor / t, 1), "gbps": round(c.bytes_read / t / 1e3, 1),
                     "bytes": c.bytes_read, "judged": c.floor, **c.info})
    rec = {"title": title, **card, "read_bw_tbps": round(bw / 1e12, 4), "bytes": total_bytes,
           "floor_us": round(total_bytes / bw * 1e6, 3), "rows": rows, **(extra or {})}
    print(json.dumps(rec, default=str))
    return rec


# ------------------------------------------------------------------------------------ kind: gemv
def copies_for(nbytes: int) -> int:
    """Weight copies so the rotation spans at least 3x the L2."""
    return max(2, min(64, math.ceil(3 * L2_BYTES / max(nbytes, 1))))


def random_weight(n: int, k: int, fp8: bool, device: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """N(0, 1/k) weights made on the GPU; FP8 as e4m3 codes with random positive block scales."""
    w = torch.randn(n, k, device=device) * k ** -0.5
    if not fp8:
        return w.bfloat16(), None
    s = torch.rand((n + 127) // 128, (k + 127) // 128, device=device) * 0.01 + 0.005
    return (w * 64).clamp(-448, 448).to(torch.float8_e4m3fn), s


def gemv_shapes(cfg, tp: int) -> list[tuple[str, int, int, list[str]]]:
    """(label, N, K, checkpoint names whose FP8-ness applies) of the GEMVs one rank runs per step."""
    from glm53_flash.weights import LM_HEAD, PREFIX
    H, D, d, nh = cfg.hidden_size, cfg.kda_dim, cfg.linear_head_dim, cfg.linear_num_heads
    L = lambda i, s: f"{PREFIX}layers.{i}.{s}"           # noqa: E731
    kda, dsa, dense, moe = 1, 3, 1, 4                     # representative layers of each kind
    return [
        ("kda.inproj q|k|v|b|f_a|g_a", (3 * D + nh) // tp + 2 * d, H, [L(kda, "self_attn.q_proj.weight")]),
        ("kda.f_b|g_b", 2 * D // tp, d, [L(kda, "self_attn.f_b_proj.weight")]),
        ("kda.o_proj", H, D // tp, [L(kda, "self_attn.o_proj.weight")]),
        ("dsa.q_a|kv_a", cfg.q_lora_rank + cfg.kv_lora_rank, H, [L(dsa, "self_attn.q_a_proj.weight")]),
        ("dsa.q_b", cfg.num_attention_heads * cfg.qk_head_dim // tp, cfg.q_lora_rank,
         [L(dsa, "self_attn.q_b_proj.weight")]),
        ("dsa.o_proj", H, cfg.num_attention_heads * cfg.v_head_dim // tp, [L(dsa, "self_attn.o_proj.weight")]),
        ("dense.gate|up", 2 * cfg.intermediate_size // tp, H, [L(dense, "mlp.gate_proj.weight")]),
        ("dense.down", H, cfg.intermediate_size // tp, [L(dense, "mlp.down_proj.weight")]),
        ("moe.expert gate|up (one)", 2 * cfg.moe_intermediate_size // tp, H,
         [L(moe, "mlp.shared_experts.gate_proj.weight")]),
        ("moe.expert down (one)", H, cfg.moe_intermediate_size // tp, [L(moe, "mlp.shared_experts.down_proj.weight")]),
        ("tail.lm_head", cfg.vocab_size // tp, H, [LM_HEAD]),
    ]


def pick_gemv_config(n: int, k: int, fp8: bool):
    """Tile config for a standalone GEMV: the benchmarked default, split-K when column tiles are few."""
    from glm53_flash.kernels.gemv import TUNED
    base = TUNED["fp8" if fp8 else "bf16"]
    block_k = base.block_k if k >= base.block_k else 128
    tiles = triton.cdiv(n, base.block_n) * base.k_split
    split = 1
    while tiles * split * 2 <= 2 * 132 and k // (split * 2) >= 4 * block_k:
        split *= 2
    return dataclasses.replace(base, block_k=block_k, split_k=split)


def build_gemv(cfg, tp: int, rows: int, weights: str, device: str) -> list[BenchCase]:
    from glm53_flash.kernels.gemv import gemv
    from glm53_flash.weights import weight_specs
    specs = weight_specs(cfg)
    cases = []
    for label, n, k, names in gemv_shapes(cfg, tp):
        fp8 = weights == "fp8" and all(specs[nm].fp8 for nm in names)
        one = n * k * (1 if fp8 else 2) + (((n + 127) // 128) * ((k + 127) // 128) * 4 if fp8 else 0)
        ws = [random_weight(n, k, fp8, device) for _ in range(copies_for(one))]
        x = torch.randn(rows, k, device=device).bfloat16()
        y = torch.empty(rows, n, device=device, dtype=torch.bfloat16)
        gcfg = pick_gemv_config(n, k, fp8)
        fns = [lambda w=w, s=s, x=x, y=y, c=gcfg: gemv(x, w, s, cfg=c, out=y) for w, s in ws]
        info = {"N": n, "K": k, "fmt": "fp8" if fp8 else "bf16", "split": gcfg.split_k}
        cases.append(BenchCase(f"{label} {n}x{k}", fns, one + rows * k * 2, info))
        if not fp8:                                   # cuBLAS beside it (bf16 only)
            fns = [lambda w=w, x=x, y=y: torch.matmul(x, w.T, out=y) for w, _ in ws]
            cases.append(BenchCase(f"  cuBLAS {n}x{k}", fns, one + rows * k * 2, dict(info, split="-"),
                                   floor=False))
    return cases


def build_tail(cfg, tp: int, rows: int, weights: str, device: str, opts: dict | None = None) -> list[BenchCase]:
    """The tail launch (glm53_flash/launches/tail.py) of one rank (TP > 1: loopback mode), beside the
    same math as plain torch ops (mean of streams, RMSNorm, lm_head, argmax), both in CUDA graphs."""
    from glm53_flash.launches.tail import TailLaunch
    opts = {k: v for k, v in (opts or {}).items() if v is not None}
    H, V = cfg.hidden_size, cfg.vocab_size // tp
    fp8 = weights == "fp8"            # FP8 lm_head: a launch option (the vendor ships lm_head in bf16)
    one = V * H * (1 if fp8 else 2) + (((V + 127) // 128) * (H // 128) * 4 if fp8 else 0)
    norm_w = (1 + 0.1 * torch.randn(H, device=device)).bfloat16()
    X = torch.randn(rows, cfg.hc_mult, H, device=device)
    launches = []
    for _ in range(copies_for(one)):
        w, s = random_weight(V, H, fp8, device)
        L = TailLaunch(cfg, w, norm_w, s, tp_rank=0, tp_size=tp, width=rows, device=device, **opts)
        L.set_input(X)
        launches.append(L)
    L0 = launches[0]
    logits, _ = L0.run(X)                                    # checked launch: raises on a hand-off timeout
    wf = L0.W.float() if not fp8 else L0.W.float() * L0.S.repeat_interleave(128, 0)[:V].repeat_interleave(128, 1)
    xm = X.mean(1)
    xn = xm * torch.rsqrt(xm.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * norm_w.float()
    ref = xn.double() @ wf.double().T
    err = float((logits.double() - ref).norm() / ref.norm())
    info = {"fmt": "fp8" if fp8 else "bf16", "grid": L0.grid, "warps": L0.num_warps, "block_n": L0.block_n,
            "err": f"{err:.1e}"}
    bytes_read = one + rows * cfg.hc_mult * H * 4 + H * 2
    cases = [BenchCase(f"tail launch tp{tp} rows{rows} {info['fmt']}", [lambda L=L: L.enqueue() for L in launches],
                       bytes_read, info)]
    if not fp8:                                              # what an engine does today, in a graph
        def torch_tail(W, X=X, out=torch.empty(rows, V, device=device, dtype=torch.bfloat16)):
            m = X.mean(1)
            n = (m * torch.rsqrt(m.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * norm_w.float()).bfloat16()
            torch.matmul(n, W.T, out=out)
            return out.argmax(-1)
        cases.append(BenchCase("  torch ops (mean, norm, matmul, argmax)", [lambda L=L: torch_tail(L.W) for L in launches],
                               bytes_read, {"fmt": "bf16"}, floor=False))
    return cases


KINDS = {"gemv": build_gemv, "tail": build_tail}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Needs a CUDA GPU. Later kinds: " + ", ".join(LATER_KINDS) + " (not built yet).")
    ap.add_argument("--kind", choices=sorted(KINDS), default="gemv",
                    help="launch kind: gemv = the GEMVs of one rank (our family beside cuBLAS); "
                         "tail = the tail launch (mean of streams, RMSNorm, lm_head, argmax) beside torch ops")
    ap.add_argument("--tp", type=int, choices=(1, 2, 4, 8), default=1,
                    help="tensor-parallel degree: time one rank's shapes (heads/rows split by TP)")
    ap.add_argument("--rows", type=int, choices=(1, 2, 4, 8), default=1,
                    help="batch width: activation rows per launch")
    ap.add_argument("--weights", choices=("bf16", "fp8"), default="bf16",
                    help="weight format: fp8 = e4m3 + 128x128 block scales for the tensors the vendor ships "
                         "in FP8 (gemv: KDA and lm_head stay bf16; tail: the lm_head itself in FP8)")
    ap.add_argument("--preset", default="glm53-flash", help="model preset for the shapes (default glm53-flash)")
    ap.add_argument("--reps", type=int, default=16, help="launches per timed CUDA graph (rotating weight copies)")
    ap.add_argument("--windows", type=int, default=15, help="interleaved timing windows; the median is reported")
    ap.add_argument("--num-warps", type=int, default=None, help="tail: warps per CTA (default: the launch's)")
    ap.add_argument("--block-n", type=int, default=None, help="tail: lm_head rows per GEMV tile (default: the launch's)")
    ap.add_argument("--block-k", type=int, default=None, help="tail: K chunk per pipelined GEMV step")
    ap.add_argument("--num-stages", type=int, default=None, help="tail: GEMV software-pipeline depth")
    ap.add_argument("--ctas-per-sm", type=int, default=None,
                    help="tail: persistent grid = this many CTAs per SM (default: the launch's)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("time_layers.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from glm53_flash.config import preset
    cfg = preset(args.preset)
    cfg.check_tp(args.tp)
    bw, bw_detail = measure_read_bw()
    if args.kind == "tail":
        opts = dict(num_warps=args.num_warps, block_n=args.block_n, block_k=args.block_k, num_stages=args.num_stages,
                    grid=(args.ctas_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
                          if args.ctas_per_sm else None))
        cases = build_tail(cfg, args.tp, args.rows, args.weights, "cuda", opts)
    else:
        cases = KINDS[args.kind](cfg, args.tp, args.rows, args.weights, "cuda")
    us = time_interleaved(cases, args.reps, args.windows)
    card = {**env_card(), "kind": args.kind, "tp": args.tp, "rows": args.rows, "weights": args.weights,
            "preset": args.preset, "read_kernels_gbps": bw_detail}
    cols = ("fmt", "grid", "warps", "block_n", "err") if args.kind == "tail" else ("fmt", "split")
    report(f"time_layers --kind {args.kind}", card, bw, cases, us, extra_cols=cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
