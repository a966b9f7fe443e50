"""Measuring on the GPU, shared by time_layers.py and bench_gemv.py: a timed case (BenchCase), the
interleaved CUDA-graph timer, the pure-read bandwidth the floors divide by, the header card and the
report table + JSON line. Why a module of its own: these decide what every number in
bench/RESULTS.md means, and they do not depend on which kernel is timed.

Every number is kernel time per launch: CUDA events around CUDA-graph replays of `reps` launches,
warm-up first, median of `windows` interleaved windows (the order rotates so no case always goes
first), and a case whose launches recorded a stall is refused (check_launches).
"""
from __future__ import annotations

import datetime
import json
import statistics
from dataclasses import dataclass, field
from typing import Callable

import torch
import triton
import triton.language as tl

from glm53_flash.provenance import source_commit

L2_BYTES = 60 * 2 ** 20          # H200; read from the device when available


@dataclass
class BenchCase:
    name: str
    fns: list[Callable[[], object]]   # one launch each; rotated so no weight copy stays in L2
    bytes_read: int                   # bytes one launch must read (weights + scales + activations)
    info: dict = field(default_factory=dict)   # extra columns (shape, config, registers...)
    floor: bool = True                # False: a baseline shown beside, not judged
    checks: list[Callable[[], object]] = field(default_factory=list)   # raise if a timed launch stalled


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
    check_launches(cases)
    return {n: statistics.median(v) for n, v in samples.items()}


def check_launches(cases: list[BenchCase]) -> None:
    """Raise (HandoffTimeout) if a timed launch recorded a stall: a stalled launch ends early, so its time
    is no launch's time (a 1 s budget once overflowed at the late wait sites and every timed sparse TP 8
    and nextn launch aborted; docs/DECISIONS.md)."""
    for c in cases:
        for check in c.checks:
            check()


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
    commit = source_commit()
    return {"gpu": p.name, "sms": p.multi_processor_count, "l2_mb": round(getattr(p, "L2_cache_size", L2_BYTES) / 2 ** 20),
            "torch": torch.__version__, "triton": triton.__version__, "commit": commit,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def report(title: str, card: dict, bw: float, cases: list[BenchCase], us: dict[str, float],
           extra_cols: tuple[str, ...] = (), extra: dict | None = None, notes=(), post=()) -> dict:
    """Print the header card and the table; return the JSON record (also printed, last line)."""
    judged = [c for c in cases if c.floor]
    total_bytes = sum(c.bytes_read for c in judged)
    print(f"== {title}")
    for k, v in card.items():
        print(f"   {k:10s} {v}")
    print(f"   {'read bw':10s} {bw / 1e12:.3f} TB/s (best pure-read kernel, same run)")
    print(f"   {'bytes':10s} {total_bytes / 1e6:.1f} MB over {len(judged)} judged cases; floor "
          f"{total_bytes / bw * 1e6:.1f} us")
    for line in notes:                       # per-launch byte accounting (layer kinds)
        print(line)
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
    for line in post:                        # e.g. the step summary; the JSON line stays last
        print(line)
    rec = {"title": title, **card, "width": card.get("rows"), "read_bw_tbps": round(bw / 1e12, 4), "bytes": total_bytes,
           "floor_us": round(total_bytes / bw * 1e6, 3), "rows": rows, **(extra or {})}
    print(json.dumps(rec, default=str))
    return rec
