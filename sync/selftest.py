"""A protocol kernel that exercises every hand-off of `sync.device` and counts wrong words.

Three stages over G CTAs:
  0. producers (CTAs 0..P-1) store a plain row of N words (payload depends on the launch tag), publish
     M tagged pairs, and signal box `rows_box` (plain-row drain) to every consumer;
  1. consumers (CTAs G-C..G-1) wait on `rows_box`, read every producer's row with L1-bypassing loads,
     await every producer's pairs, count wrong words, then send their count back as a tagged pair and
     a word of box `back_box` (C producers: several lines once C > 32) to CTA 0;
  2. CTA 0 waits on `back_box` and the count pairs and writes the total.
Every payload is a function of the launch tag, so a stale word from an earlier launch counts as wrong.
`corrupt=1` flips one word of producer 0's row (positive control: every consumer must count it).
The kernel is model-agnostic; tests, scripts/stress.py and the GPU tests use it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from layout import Planner

from . import guard
from .asm import in_interpreter, nanosleep_if_not_warp0
from .device import await_pairs, launch_begin, launch_end, publish_pairs, signal_box, wait_box
from .header import HEADER_LINES

SITES = ("selftest.rows_box", "selftest.pairs", "selftest.back_box", "selftest.back_pairs")
N_STAGES = 3


@triton.jit
def _row_val(tag, p, i):
    return tag * 1000003 + p * 7919 + i * 13 + 5


@triton.jit
def _pair_val(tag, p, j):
    return (tag * 31 + p * 131 + j * 7 + 1) ^ 0x5A5A5A5A


@triton.jit(do_not_specialize=["stage_lo", "stage_hi", "bump", "fault_site", "corrupt", "timeout_ns",
                               "tag_stride", "tag_offset"])
def selftest_kernel(scratch, bad, o_hdr, o_rows, o_pairs, o_box1, o_back, o_box2,
                    n_prod, n_cons, n_words, n_pairs, box1_words, box2_words,
                    stage_lo, stage_hi, bump, tag_stride, tag_offset, fault_site, corrupt, timeout_ns, sleep_ns,
                    BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    s64 = scratch.to(tl.pointer_type(tl.int64), bitcast=True)
    hdr = scratch + o_hdr
    tag, ok = launch_begin(hdr, tag_stride, tag_offset)
    offs = tl.arange(0, BLOCK)
    cons0 = G - n_cons
    # ---- stage 0: producers
    if (stage_lo <= 0) & (stage_hi > 0) & (pid < n_prod) & (ok != 0):
        if not in_interpreter():
            if sleep_ns > 0:
                nanosleep_if_not_warp0(sleep_ns)        # warps 1.. store late: the barrier must cover them
        i = 0
        while i < n_words:
            m = i + offs < n_words
            v = _row_val(tag, pid, i + offs)
            v = tl.where((corrupt != 0) & (pid == 0) & (i + offs == 0), v ^ 1, v)
            tl.store(scratch + o_rows + pid * n_words + i + offs, v, mask=m)
            i += BLOCK
        j = 0
        while j < n_pairs:
            m = j + offs < n_pairs
            publish_pairs(s64 + o_pairs + pid * n_pairs + j + offs, _pair_val(tag, pid, j + offs), tag, m, 1,
                          fault_site)
            j += BLOCK
        signal_box(scratch + o_box1, n_cons, box1_words, pid, tag, 0, fault_site, BLOCK)
    # ---- stage 1: consumers
    if (stage_lo <= 1) & (stage_hi > 1) & (pid >= cons0) & (ok != 0):
        c = pid - cons0
        cnt = 0
        ok = wait_box(scratch + o_box1, c, box1_words, n_prod, tag, hdr, 0, pid, timeout_ns)
        if ok != 0:
            p = 0
            while p < n_prod:
                i = 0
                while i < n_words:
                    m = i + offs < n_words
                    v = tl.load(scratch + o_rows + p * n_words + i + offs, mask=m, other=0, cache_modifier=".cg")
                    cnt += tl.sum((m & (v != _row_val(tag, p, i + offs))).to(tl.int32), axis=0)
                    i += BLOCK
                j = 0
                while (j < n_pairs) & (ok != 0):
                    m = j + offs < n_pairs
                    pv, ok = await_pairs(s64 + o_pairs + p * n_pairs + j + offs, m, tag, hdr, 1, pid, timeout_ns)
                    cnt += tl.sum((m & (pv != _pair_val(tag, p, j + offs))).to(tl.int32), axis=0)
                    j += BLOCK
                p += 1
        if ok != 0:
            tl.atomic_add(bad + pid, cnt)       # integer, accumulates over replays; one word per CTA
            publish_pairs(s64 + o_back + c + offs, tl.zeros([BLOCK], tl.int32) + cnt, tag, offs < 1, 3,
                          fault_site)
            signal_box(scratch + o_box2, 1, box2_words, c, tag, 2, fault_site, BLOCK)
    # ---- stage 2: CTA 0 totals the consumers' counts
    if (stage_lo <= 2) & (stage_hi > 2) & (pid == 0) & (ok != 0):
        ok = wait_box(scratch + o_box2, 0, box2_words, n_cons, tag, hdr, 2, pid, timeout_ns)
        tot = 0
        c = 0
        while (c < n_cons) & (ok != 0):
            m = c + offs < n_cons
            cv, ok = await_pairs(s64 + o_back + c + offs, m, tag, hdr, 3, pid, timeout_ns)
            tot += tl.sum(tl.where(m, cv, 0), axis=0)
            c += BLOCK
        if ok != 0:
            tl.atomic_add(bad + G, tot)
    launch_end(hdr, bump)


class SelfTest:
    """Host driver of `selftest_kernel`: owns the scratch layout and decodes errors.

    grid: CTAs; producers/consumers: how many CTAs play each role (consumers are the last ones);
    words/pairs: plain words and tagged pairs per producer."""

    def __init__(self, grid: int, producers: int, consumers: int, words: int = 64, pairs: int = 8, *,
                 device="cpu", timeout_s: float = guard.DEFAULT_TIMEOUT_S, block: int = 128, num_warps: int = 4):
        if not (1 <= producers <= grid and 1 <= consumers <= grid):
            raise ValueError(f"producers={producers}, consumers={consumers}: each must be in [1, grid={grid}]")
        self.grid, self.P, self.C, self.N, self.M = grid, producers, consumers, words, pairs
        self.block, self.num_warps, self.device = block, num_warps, device
        self.timeout_ns = guard.timeout_ns(timeout_s)
        pl = Planner("selftest")
        pl.header("hdr", HEADER_LINES)
        pl.rows("rows", (producers, words), "int32")
        pl.pairs("pairs", (producers, pairs))
        pl.box("box1", consumers, producers)
        pl.pairs("back", consumers)
        pl.box("box2", 1, consumers)
        self.layout = pl.build()
        self.scratch = self.layout.alloc(device)
        self.bad = torch.zeros(grid + 1, dtype=torch.int32, device=device)   # per-CTA wrong words, [G]: total
        self.sites = guard.SiteRegistry(SITES)

    def args(self, stage_lo, stage_hi, bump, fault_site, corrupt, sleep_ns):
        L = self.layout
        return (self.scratch, self.bad, L["hdr"].elem_offset(), L["rows"].elem_offset(), L["pairs"].elem_offset(),
                L["box1"].elem_offset(), L["back"].elem_offset(), L["box2"].elem_offset(),
                self.P, self.C, self.N, self.M, L["box1"].shape[1], L["box2"].shape[1],
                stage_lo, stage_hi, bump, 1, 0, fault_site, corrupt, self.timeout_ns, sleep_ns)

    def launch(self, fault_site: int = -1, corrupt: int = 0, stagewise: bool | None = None, sleep_ns: int = 0):
        """Enqueue one logical launch (stage by stage under the interpreter); no sync, no check."""
        if stagewise is None:
            stagewise = bool(triton.knobs.runtime.interpret)
        kw = dict(BLOCK=self.block, num_warps=self.num_warps)
        if not triton.knobs.runtime.interpret:
            kw["launch_cooperative_grid"] = True
        spans = [(s, s + 1) for s in range(N_STAGES)] if stagewise else [(0, N_STAGES)]
        for k, (lo, hi) in enumerate(spans):
            selftest_kernel[(self.grid,)](*self.args(lo, hi, int(k == len(spans) - 1), fault_site, corrupt,
                                                     sleep_ns), **kw)

    def run(self, fault: str | None = None, corrupt: bool = False, stagewise: bool | None = None,
            sleep_ns: int = 0) -> dict:
        """One launch, checked: -> {consumer_bad, total, epoch}; raises HandoffTimeout on a timeout."""
        fault_site = -1 if fault is None else self.sites.id(fault)
        before = self.bad.clone()
        self.launch(fault_site, int(corrupt), stagewise, sleep_ns)
        guard.check_record(self.layout.view(self.scratch, "hdr"), self.sites, "selftest")
        d = (self.bad - before).cpu()
        return {"consumer_bad": int(d[: self.grid].sum()), "total": int(d[self.grid]),
                "epoch": guard.read_record(self.layout.view(self.scratch, "hdr")).epoch}
