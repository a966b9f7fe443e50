"""Hand-off latency on the GPU: a box ping-pong between two CTAs, per wait / signal variant.

Why: the in-kernel trace (launches/trace.py) shows 2-4 us from a producer task's end to its consumer's
wait end, and that is ~13 times on the critical path of a layer launch. This measures one hop alone:
CTA 0 signals CTA `peer` (on another SM), which waits and signals back, n_iter times; per hop = time /
(2 n_iter). `--pollers` makes every other CTA of the grid poll its own block meanwhile (as in a launch,
where most CTAs wait on the next stage), so hot lines (the abort word) show up.

Variants (WAIT, SIG):
  wait 0  the wait of 8bea23a^ (warp-0 lanes poll, the abort word loaded after a stale line, fence, CTA
          barrier, then the whole CTA re-reads the words line by line)
  wait 1  the wait of 8bea23a (every thread polls a line, each loads the abort word every cycle, fence in
          every thread, one reduction)
  wait 2  sync.device.wait_box since then: warp 0 polls with warp votes, lane 0 alone loads the abort
          word, one reduction
  wait 3  wait 2 with the CTA's outcome by one bar.red.or.pred (sync.asm cta_any) instead of a tensor min
          (in the launches' kernels the min spilled a register whose reload followed the fence; branch
          next/cta-any-wait)
  wait 4  wait 3 without the fence after the spin (not an acquire: what the consumer's fence costs)
  wait 5  wait 3 with the budget on %clock64 instead of %globaltimer (what the timer read costs a poll cycle)
  wait 6  tagged pairs (sync.device.await_pairs: every thread polls its 8-byte words, one fence); with sig 3
  sig 0   the signal before (barrier, fence in every thread, every thread stores)
  sig 1   sync.device.signal_box since then: barrier, then warp 0 fences and stores (sync.asm.signal_warp0)
  sig 2   sig 1 without the fence (not a release: what the producer's fence costs)
  sig 3   tagged pairs (sync.device.publish_pairs: one 8-byte relaxed store a word, no barrier, no fence); with wait 6

--pollers: 0 the other CTAs exit; 1 they poll their own blocks (hot lines); 2 they stream a buffer larger than
L2 from HBM (32 KB of loads in flight a CTA, as the launches' GEMV stages keep) until released: a hop in a loaded
memory system, where the trace puts waits of 4-6 us on boxes already complete.

Usage (GPU): python scripts/bench_hop.py [--iters 2000] [--words 32,256] [--pollers 0,1,2] [--json-out F]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sync.asm import (_signal_warp0_ptx, _spin_warp0_ptx, cta_any, fence_acq_rel, globaltimer,  # noqa: E402
                      ld_relaxed_u32, line_loads_ptx, line_match_ptx, signal_warp0, spin_lines_warp0, tid_x)
from sync.device import (await_pairs, publish_pairs, release_cta, signal_box, staggered_budget,  # noqa: E402
                         store_words, wait_box)
from sync.header import H_ABORT, HEADER_WORDS  # noqa: E402


def _line_match_ptx() -> str:
    # the 8bea23a^ helper: bit i set when word i of a 128-byte line equals the tag
    w = [f"%lw{i}" for i in range(32)]
    a = ["{", f".reg .b32 {', '.join(w)};", ".reg .b32 %lm, %lb;", ".reg .pred %lq;"]
    a += line_loads_ptx(w, "$1") + line_match_ptx(w, "$2", "%lm", "%lb", "%lq") + ["mov.u32 $0, %lm;", "}"]
    return "\n".join(a)


LINE_MATCH: tl.constexpr = tl.constexpr(_line_match_ptx())


def _spin_all_ptx() -> str:
    # the 8bea23a poll: thread t polls lines t, t + nthreads, ... of the block and loads the abort word
    # every cycle, in the same round trip as its line
    # $0 live (out) | $1 block | $2 n_prod | $3 tag | $4 abort word | $5 budget ns | $6 threads per CTA
    w = [f"%sw{i}" for i in range(32)]
    a = ["{", ".reg .pred %sp<4>;", f".reg .b32 {', '.join(w)};",
         ".reg .b32 %sline, %sfirst, %sab, %sm, %sb, %swant, %sacc;", ".reg .b64 %st0, %st1, %sa;",
         "mov.u32 $0, 1;", "mov.u64 %st0, %globaltimer;", "mov.u32 %sline, %tid.x;",
         "SPIN_TOP:",
         "shl.b32 %sfirst, %sline, 5;",
         "setp.ge.s32 %sp0, %sfirst, $2;",
         "@%sp0 bra SPIN_DONE;",
         "mul.wide.u32 %sa, %sline, 128;",
         "add.u64 %sa, %sa, $1;",
         "ld.relaxed.gpu.global.u32 %sab, [$4];"]
    a += line_loads_ptx(w, "%sa")
    a += ["sub.s32 %swant, $2, %sfirst;",              # words of this line that have a producer
          "setp.ge.s32 %sp1, %swant, 32;",
          "shl.b32 %sm, 1, %swant;",
          "sub.u32 %sm, %sm, 1;",
          "selp.b32 %sm, -1, %sm, %sp1;"]
    a += line_match_ptx(w, "$3", "%sacc", "%sb", "%sp2")
    a += ["and.b32 %sacc, %sacc, %sm;",
          "setp.eq.u32 %sp2, %sacc, %sm;",
          "@!%sp2 bra SPIN_STALE;",
          "add.u32 %sline, %sline, $6;",                # this line is complete: the thread's next one
          "bra SPIN_TOP;",
          "SPIN_STALE:",
          "setp.eq.u32 %sp3, %sab, $3;",                # the launch aborted
          "@%sp3 bra SPIN_FAIL;",
          "mov.u64 %st1, %globaltimer;",
          "sub.s64 %st1, %st1, %st0;",
          "setp.gt.s64 %sp3, %st1, $5;",                # the budget ran out
          "@%sp3 bra SPIN_FAIL;",
          "bra SPIN_TOP;",
          "SPIN_FAIL:",
          "mov.u32 $0, 0;",
          "SPIN_DONE:",
          "fence.acq_rel.gpu;",                          # acquire: the relaxed loads above + this fence
          "}"]
    return "\n".join(a)


SPIN_ALL: tl.constexpr = tl.constexpr(_spin_all_ptx())
SPIN_NOFENCE: tl.constexpr = tl.constexpr(_spin_warp0_ptx(fence=False))
SPIN_CLOCK: tl.constexpr = tl.constexpr(_spin_warp0_ptx(timer="%clock64"))
SIGNAL_NOFENCE: tl.constexpr = tl.constexpr(_signal_warp0_ptx(fence=False))


@triton.jit
def _old_spin(block, n_prod, tag, abort_ptr, budget_ns):
    t0 = globaltimer()
    line = tid_x()
    live = 1
    while (line * 32 < n_prod) & (live != 0):
        want = n_prod - line * 32
        m = tl.where(want >= 32, -1, (1 << tl.minimum(want, 31)) - 1)
        bits = tl.inline_asm_elementwise(LINE_MATCH, "=r,l,r", [block + line * 32, tag], dtype=tl.int32,
                                         is_pure=False, pack=1)
        if (bits & m) == m:
            line += 32
        else:
            live = ((ld_relaxed_u32(abort_ptr) != tag) & ((globaltimer() - t0) <= budget_ns)).to(tl.int32)
    fence_acq_rel()


@triton.jit
def _old_wait(block, n_prod, tag, hdr, budget_ns):
    if tid_x() < 32:
        _old_spin(block, n_prod, tag, hdr + H_ABORT, budget_ns)
    tl.debug_barrier()
    offs = tl.arange(0, 32)
    nbad = 0
    line = 0
    while line * 32 < n_prod:
        m = line * 32 + offs < n_prod
        w = tl.load(block + line * 32 + offs, mask=m, other=0, cache_modifier=".cg")
        nbad += tl.sum((m & (w != tag)).to(tl.int32), axis=0)
        line += 1
    return (nbad == 0).to(tl.int32)


@triton.jit
def _wait(box, pairs, c, block_words, n_prod, tag, hdr, budget_ns, WAIT: tl.constexpr):
    if WAIT == 0:
        ok = _old_wait(box + c * block_words, n_prod, tag, hdr, budget_ns)
    elif WAIT == 1:
        live = tl.inline_asm_elementwise(SPIN_ALL, "=r,l,r,r,l,l,r", [box + c * block_words, n_prod, tag, hdr + H_ABORT,
                                         staggered_budget(budget_ns, 0), tl.extra.cuda.num_threads()],
                                         dtype=tl.int32, is_pure=False, pack=1)
        ok = tl.min(tl.zeros([tl.extra.cuda.num_threads()], tl.int32) + live, axis=0)
    elif WAIT == 2:
        ok = wait_box(box, c, block_words, n_prod, tag, hdr, 0, c, budget_ns)
    elif WAIT == 3:                      # wait_box's spin, the outcome by bar.red.or.pred
        live = spin_lines_warp0(box + c * block_words, n_prod, tag, hdr + H_ABORT, staggered_budget(budget_ns, 0), 0)
        ok = 1 - cta_any(1 - live)
    elif WAIT == 4:                      # no fence after the spin
        live = spin_lines_warp0(box + c * block_words, n_prod, tag, hdr + H_ABORT, staggered_budget(budget_ns, 0), 0,
                                SPIN_NOFENCE)
        ok = 1 - cta_any(1 - live)
    elif WAIT == 5:                      # budget on %clock64 (2 cycles a ns: at most 2 GHz, so never shorter)
        live = spin_lines_warp0(box + c * block_words, n_prod, tag, hdr + H_ABORT, 2 * staggered_budget(budget_ns, 0),
                                0, SPIN_CLOCK)
        ok = 1 - cta_any(1 - live)
    else:                                # tagged pairs: block c of the pair region, n_prod 8-byte words
        offs = tl.arange(0, 256)
        _, ok = await_pairs(pairs + c * 256 + offs, offs < n_prod, tag, hdr, 0, c, budget_ns)
    return ok


STREAM: tl.constexpr = tl.constexpr(1 << 14)     # bf16 elements a streaming CTA loads per step (32 KB in flight)


@triton.jit
def _stream_until_released(src, n_src, out, box, c, block_words, tag):
    """--pollers 2: load this CTA's slice of src (bf16, larger than L2) in STREAM-element steps, wrapping, until
    word 0 of block c carries `tag`; the sum goes to out[3] only if it is exactly 12345 (never), so the loads stay."""
    steps = (n_src // tl.num_programs(0)) >> 14         # STREAM-element steps in this CTA's slice
    acc = tl.zeros([STREAM], dtype=tl.float32)
    k = 0
    while ld_relaxed_u32(box + c * block_words) != tag:
        blk = (c * steps + k % steps).to(tl.int64)
        # the shift says "a multiple of 16384 elements" to the alignment analysis: 16-byte vector loads
        acc += tl.load(src + (blk << 14) + tl.arange(0, STREAM), eviction_policy="evict_first").to(tl.float32)
        k += 1
    total = tl.sum(acc, axis=0)
    if total == 12345.0:
        tl.store(out + 3, total.to(tl.int64))


@triton.jit
def _signal(box, pairs, c, block_words, n_words, tag, SIG: tl.constexpr):
    """Words 0 .. n_words - 1 of consumer c's block (as n_words producers arriving at once)."""
    if SIG == 0:
        release_cta()
        offs = tl.arange(0, 256)
        store_words(box + c * block_words + offs, tl.zeros([256], tl.int32) + tag, offs < n_words)
    elif SIG == 1:
        # sync.device.signal_box's GPU path; one consumer, n_words "producers": lane l of warp 0 stores words
        # l, l + 32, ... (block_words 1: word = consumer index)
        tl.debug_barrier()
        signal_warp0(box + c * block_words, n_words, 1, 0, tag)
    elif SIG == 2:                       # without the fence
        tl.debug_barrier()
        signal_warp0(box + c * block_words, n_words, 1, 0, tag, SIGNAL_NOFENCE)
    else:                                # tagged pairs: payload = the tag's low bits, as data would be
        offs = tl.arange(0, 256)
        publish_pairs(pairs + c * 256 + offs, offs + tag, tag, offs < n_words, 0, -1)


@triton.jit
def hop_kernel(box, pairs, hdr, out, src, n_src, n_iter, n_words, block_words, peer, tag0, budget_ns, POLLERS: tl.constexpr,
               WAIT: tl.constexpr, SIG: tl.constexpr):
    pid = tl.program_id(0)
    ok = 1
    if pid == 0:
        t0 = globaltimer()
        k = 0
        while (k < n_iter) & (ok != 0):
            _signal(box, pairs, peer, block_words, n_words, tag0 + 2 * k, SIG)
            ok = _wait(box, pairs, 0, block_words, n_words, tag0 + 2 * k + 1, hdr, budget_ns, WAIT)
            k += 1
        t1 = globaltimer()
        if POLLERS:                      # release the pollers: word 0 of every other block
            nc = tl.num_programs(0)
            c = 1
            while c < nc:
                if c != peer:
                    if POLLERS == 2:     # the streams poll box word 0 (sync.device.signal_box's path)
                        _signal(box, pairs, c, block_words, 1, tag0 + 2 * n_iter, 1)
                    else:
                        _signal(box, pairs, c, block_words, 1, tag0 + 2 * n_iter, SIG)
                c += 1
        tl.store(out, t1 - t0)
        tl.store(out + 1, ok)
    elif pid == peer:
        k = 0
        while (k < n_iter) & (ok != 0):
            ok = _wait(box, pairs, peer, block_words, n_words, tag0 + 2 * k, hdr, budget_ns, WAIT)
            _signal(box, pairs, 0, block_words, n_words, tag0 + 2 * k + 1, SIG)
            k += 1
        tl.store(out + 2, ok)
    elif POLLERS == 1:
        _wait(box, pairs, pid, block_words, 1, tag0 + 2 * n_iter, hdr, budget_ns, WAIT)
    elif POLLERS == 2:
        _stream_until_released(src, n_src, out, box, pid, block_words, tag0 + 2 * n_iter)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--words", default="32,256", help="words per hop (producers arriving at once), <= 256")
    ap.add_argument("--grid", type=int, default=None, help="default 2 CTAs per SM")
    ap.add_argument("--pollers", default="0,1,2",
                    help="0: the other CTAs exit; 1: they poll their blocks; 2: they stream a buffer from HBM")
    ap.add_argument("--variants", default="0:0,1:0,2:0,2:1,3:1",
                    help="WAIT:SIG pairs (2:1 = the launches' hop, 3:1 = with the bar.red outcome; 4:1, 3:2, 4:2, 5:1, 6:3: "
                         "the fences, the timer, tagged pairs)")
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args(argv)
    dev = "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = a.grid or 2 * sms
    peer = sms + 1 if grid > sms + 1 else grid - 1            # another SM than CTA 0's (CTAs fill SMs in order)
    block_words = 256
    box = torch.zeros(grid * block_words, dtype=torch.int32, device=dev)
    pairs = torch.zeros(grid * 256, dtype=torch.int64, device=dev)
    hdr = torch.zeros(HEADER_WORDS, dtype=torch.int32, device=dev)
    out = torch.zeros(4, dtype=torch.int64, device=dev)
    src = torch.ones(512 << 20, dtype=torch.bfloat16, device=dev)   # 1 GB: --pollers 2 streams it (> L2)
    tag = 1
    rows = []
    for pollers in [int(p) for p in a.pollers.split(",")]:
        for words in [int(w) for w in a.words.split(",")]:
            for v in a.variants.split(","):
                wait, sig = (int(x) for x in v.split(":"))
                if (wait == 6) != (sig == 3):
                    raise SystemExit(f"variant {v}: tagged pairs are wait 6 with sig 3")
                res = []
                for rep in range(4):                     # rep 0 compiles and warms up
                    hop_kernel[(grid,)](box, pairs, hdr, out, src, src.numel(), a.iters, words, block_words, peer, tag,
                                        int(1e9), POLLERS=pollers, WAIT=wait, SIG=sig, num_warps=4)
                    tag += 2 * a.iters + 2
                    o = out.tolist()
                    if o[1] != 1 or o[2] != 1:
                        raise RuntimeError(f"variant {v} words {words}: a wait failed ({o})")
                    if rep:
                        res.append(o[0] / (2 * a.iters))
                res.sort()
                r = dict(wait=wait, sig=sig, words=words, pollers=pollers, hop_ns=round(res[len(res) // 2], 1),
                         hop_ns_all=[round(x, 1) for x in res], grid=grid, iters=a.iters)
                rows.append(r)
                print(f"wait {wait} sig {sig} words {words:4d} pollers {pollers}: {r['hop_ns']:8.1f} ns per hop "
                      f"({', '.join(f'{x:.0f}' for x in res)})", flush=True)
    if a.json_out:
        with open(a.json_out, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "hop", "gpu": torch.cuda.get_device_name(), **r}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
