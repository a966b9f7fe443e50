"""sync/: launch tags, tagged pairs, boxes (multi-line), plain rows + drain, guarded waits, fault
injection and the error record, run as real kernel code under the interpreter (stage by stage), plus a
compile-only check of the sm_90 PTX (no GPU needed): no CTA barrier inside the one-thread spin."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from sync import HandoffTimeout, SiteRegistry, read_record, timeout_ns
from sync.asm import FENCE_ACQUIRE, PAIR_LOAD, SPIN_LINE_LOAD
from sync.device import staggered_budget
from sync.selftest import SITES, SelfTest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def proto():
    # 40 CTAs: 3 producers, 36 consumers (so the back box has 36 producers: two lines per consumer)
    return SelfTest(grid=40, producers=3, consumers=36, words=40, pairs=5)


def test_pairs_boxes_drains_many_ctas(proto):
    rec0 = read_record(proto.layout.view(proto.scratch, "hdr"))
    for _ in range(2):
        r = proto.run()
        assert r == {"consumer_bad": 0, "total": 0, "epoch": r["epoch"]}
    rec = read_record(proto.layout.view(proto.scratch, "hdr"))
    assert rec.epoch == rec0.epoch + 2 and rec.last_tag == rec.epoch      # tag = epoch at start + 1
    # nothing is cleared: every consumer's box word of every producer holds the latest tag
    box1 = proto.layout.view(proto.scratch, "box1")[:, :3]
    assert bool((box1 == rec.last_tag).all())
    box2 = proto.layout.view(proto.scratch, "box2")[0, :36]
    assert bool((box2 == rec.last_tag).all())
    assert proto.layout.check_canaries(proto.scratch) == []


def test_positive_control_counts_the_flipped_word(proto):
    r = proto.run(corrupt=True)
    assert r["consumer_bad"] == 36 and r["total"] == 36          # every consumer saw the one bad word
    assert proto.run()["consumer_bad"] == 0


@pytest.mark.parametrize("site", SITES)
def test_fault_names_site_then_next_launch_clean(proto, site):
    before = read_record(proto.layout.view(proto.scratch, "hdr"))
    with pytest.raises(HandoffTimeout) as ei:
        proto.run(fault=site)
    e = ei.value
    assert e.site == site and site in str(e)
    assert e.wanted == before.epoch + 1 and e.seen != e.wanted     # saw an older tag
    assert f"CTA {e.cta}" in str(e)
    expect_cta = 0 if "back" in site else 40 - 36                  # first consumer to wait
    assert e.cta == expect_cta
    r = proto.run()
    assert r["consumer_bad"] == 0 and r["total"] == 0
    assert read_record(proto.layout.view(proto.scratch, "hdr")).epoch == before.epoch + 2


def test_schedule_bug_fails_at_once_under_interpreter():
    # all stages in one launch: CTA 0 (stage 2) waits on consumers that the interpreter runs later;
    # the spin budget is zero there, so it is recorded at once instead of hanging
    st = SelfTest(grid=6, producers=2, consumers=3, words=8, pairs=2)
    with pytest.raises(HandoffTimeout, match="selftest.back_box"):
        st.run(stagewise=False)
    assert st.run()["consumer_bad"] == 0                          # stage by stage it is fine


def test_host_guard_errors():
    reg = SiteRegistry(["a.x", "a.y"])
    assert reg.id("a.y") == 1 and reg.name(0) == "a.x" and "unknown" in reg.name(7)
    with pytest.raises(KeyError, match="unknown wait site 'a.z'"):
        reg.id("a.z")
    with pytest.raises(ValueError, match="repeated"):
        SiteRegistry(["a", "a"])
    for bad in (0, -1, 61, "1"):
        with pytest.raises(ValueError, match="timeout_s="):
            timeout_ns(bad)
    e = HandoffTimeout("tail.xn", 7, 5, 4, site_id=0, launch="tail")
    assert str(e) == ("hand-off timeout at wait site 'tail.xn' (#0) in launch 'tail': CTA 7 wanted tag "
                      "0x00000005, saw 0x00000004")


_COMPILE = r"""
import json, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from sync.selftest import selftest_kernel as k
sig = {n: ("*i32" if n in ("scratch", "bad") else "i64" if n == "timeout_ns" else "i32") for n in k.arg_names}
sig["BLOCK"] = "constexpr"
ck = triton.compile(ASTSource(fn=k, signature=sig, constexprs={"BLOCK": 128}), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": 4})
print(json.dumps({"ptx": ck.asm["ptx"]}))
"""


def _ptx_blocks(lines: list[str]):
    """Basic blocks of a PTX listing: (first line, last line) per block and their successor block ids.
    Labels are scoped by { } (an inline-asm statement's labels are its own, so the same asm may appear
    many times): a branch goes to its name in the innermost enclosing scope that has it."""
    starts = sorted({0} | {k for k, ln in enumerate(lines) if re.match(r"\s*\$?[\w$]+:", ln)}
                    | {k + 1 for k, ln in enumerate(lines) if re.search(r"\b(bra|ret|exit)\b", ln)})
    starts = [k for k in starts if k < len(lines)]
    blocks = [(a, b - 1) for a, b in zip(starts, starts[1:] + [len(lines)])]
    block_of = {}
    for n, (a, b) in enumerate(blocks):
        for k in range(a, b + 1):
            block_of[k] = n
    scopes, stack, nxt, label = [], [0], 1, {}
    for k, ln in enumerate(lines):                   # scopes[k]: the scope chain at line k, innermost first
        t = ln.strip()
        if t.endswith("{") and not t.startswith("//"):
            stack.append(nxt)
            nxt += 1
        scopes.append(tuple(reversed(stack)))
        if (m := re.match(r"\s*(\$?[\w$]+):", ln)):
            label[(stack[-1], m.group(1))] = block_of[k]
        if t.startswith("}") and len(stack) > 1:
            stack.pop()
    succ = []
    for n, (a, b) in enumerate(blocks):
        out, falls = set(), True
        for k in range(a, b + 1):
            ln = lines[k]
            m = re.search(r"\bbra(?:\.uni)?\s+([\w$]+);", ln)
            if m:
                to = next((label[(sc, m.group(1))] for sc in scopes[k] if (sc, m.group(1)) in label), None)
                if to is not None:
                    out.add(to)
                    falls = falls and ln.lstrip().startswith("@")        # a predicated branch falls through
            if re.search(r"\b(ret|exit);", ln):
                falls = False
        if falls and n + 1 < len(blocks):
            out.add(n + 1)
        succ.append(out)
    return blocks, succ


def spin_regions_without_barrier(ptx: str) -> list[int]:
    """Line numbers of box polls (relaxed v4 loads) whose spin loop (the blocks on a cycle through the
    load's block) holds a bar.sync: lanes that spin alone would wait there forever."""
    lines = ptx.splitlines()
    blocks, succ = _ptx_blocks(lines)

    def reach(src):
        seen, todo = set(), [src]
        while todo:
            for s in succ[todo.pop()]:
                if s not in seen:
                    seen.add(s)
                    todo.append(s)
        return seen
    fwd = [None] * len(blocks)
    bad = []
    for i, ln in enumerate(lines):
        if SPIN_LINE_LOAD not in ln:
            continue
        b = next(n for n, (lo, hi) in enumerate(blocks) if lo <= i <= hi)
        fwd[b] = fwd[b] if fwd[b] is not None else reach(b)
        loop = {x for x in fwd[b] if b in (fwd[x] if fwd[x] is not None else reach(x))} | {b}
        if any(re.search(r"\b(bar|barrier)\.sync\b", lines[k]) for x in loop for k in range(blocks[x][0],
                                                                                            blocks[x][1] + 1)):
            bad.append(i)
    return bad


def test_spin_check_catches_a_barrier():
    ptx = ("mov.u32 %r1, %tid.x;\nbar.sync 0;\n$L__spin:\n" + SPIN_LINE_LOAD + " {%a,%b,%c,%d}, [%rd1];\n"
           "bar.sync 0;\n@%p1 bra $L__spin;\nfence.acq_rel.gpu;\nbar.sync 0;")
    assert spin_regions_without_barrier(ptx) == [3]                     # the barrier inside the loop
    assert spin_regions_without_barrier(ptx.replace("bar.sync 0;\n@%p1", "add.s32 %r2, %r1, 1;\n@%p1")) == []
    # the same asm statement twice, each with its own TOP label: each loop is resolved inside its own { }
    asm = "{\nTOP:\n" + SPIN_LINE_LOAD + " {%a,%b,%c,%d}, [%rd1];\n@%p1 bra TOP;\n}\n"
    assert spin_regions_without_barrier(asm + "bar.sync 0;\n" + asm) == []
    assert spin_regions_without_barrier(asm + "bar.sync 0;\n" + asm.replace("@%p1", "bar.sync 0;\n@%p1")) == [8]


def sm90_ptx(script: str, **env_over) -> str:
    """PTX printed (as JSON {"ptx": ...}) by a compile script run without TRITON_INTERPRET (env_over: more
    environment, e.g. a switch read at import)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    env.update(env_over)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["ptx"]


def test_sm90_ptx_spin_has_no_cta_barrier():
    ptx = sm90_ptx(_COMPILE, GLM53_SPIN="lines")
    assert ptx.count(SPIN_LINE_LOAD) >= 16         # two box waits, 8 vector loads each
    assert "st.relaxed.gpu.global.b64" in ptx and PAIR_LOAD in ptx
    assert "%globaltimer" in ptx
    assert spin_regions_without_barrier(ptx) == []


def test_sm90_ptx_chunked_spin():
    """GLM53_SPIN=chunks, the default (sync.asm._spin_chunks_ptx): each wait polls CHUNKS_PER_CYCLE 16-byte chunks a
    lane (not 8 loads of a line), with no CTA barrier inside the spin; GLM53_SPIN=lines keeps its 8. The chunk math
    itself runs on the GPU only (the interpreter waits through _box_check): scripts/stress.py, the GPU tests."""
    from sync.asm import CHUNKS_PER_CYCLE, _spin_chunks_ptx
    ptx = sm90_ptx(_COMPILE, GLM53_SPIN="chunks")
    assert sm90_ptx(_COMPILE) == ptx                                    # the default
    assert ptx.count(SPIN_LINE_LOAD) == 2 * CHUNKS_PER_CYCLE         # the self-test's two box waits
    assert spin_regions_without_barrier(ptx) == []
    assert "CH_ADV" in ptx and "+16]" not in _spin_chunks_ptx()       # 16-byte steps come from the chunk index
    two = _spin_chunks_ptx(two=True)
    assert two.count(SPIN_LINE_LOAD) == CHUNKS_PER_CYCLE and "$7" in two and "$8" in two


_COMPILE_SASS = _COMPILE.replace('print(json.dumps({"ptx": ck.asm["ptx"]}))', """
import os, subprocess, tempfile
nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
    f.write(ck.asm["cubin"])
sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
print(json.dumps({"ptx": json.dumps({"ptx": ck.asm["ptx"], "sass": sass})}))
""")


def test_sm90_split_fences():
    """A wait's fence is the acquire half and a signal's the release half (sync.asm SPLIT_FENCES). In the sm_90 SASS
    of the self-test kernel (two box waits, a box signal, tagged pairs), against the same kernel with
    GLM53_SPLIT_FENCES=0 (fence.acq_rel on both sides: MEMBAR + CCTL.IVALL each): one MEMBAR fewer for every acquire
    fence (no wait waits for its warp's earlier memory operations) and one CCTL.IVALL fewer for every release fence
    (no signal empties L1). The atomics' own acquire / release (launch_begin / launch_end) are the same in both."""
    split = json.loads(sm90_ptx(_COMPILE_SASS))
    both = json.loads(sm90_ptx(_COMPILE_SASS, GLM53_SPLIT_FENCES="0"))
    assert "fence.acq_rel" not in split["ptx"]
    assert "fence.acquire" not in both["ptx"] and "fence.release" not in both["ptx"]
    n_acq, n_rel = split["ptx"].count("fence.acquire.gpu;"), split["ptx"].count("fence.release.gpu;")
    assert n_acq >= 3 and n_rel >= 1                                     # two box waits + the pair poll; a signal
    assert both["ptx"].count("fence.acq_rel.gpu;") == n_acq + n_rel
    assert both["sass"].count("MEMBAR") - split["sass"].count("MEMBAR") == n_acq
    assert both["sass"].count("CCTL.IVALL") - split["sass"].count("CCTL.IVALL") == n_rel


def test_sm90_begin_loads():
    """launch_begin reads the epoch and the abort word with two relaxed loads every thread issues together
    (GLM53_BEGIN_LOADS, default 1); =0 keeps the tl.atomic_add(p, 0) reads, which Triton lowers to one thread's
    ld.acquire (epoch) and ld.relaxed (abort), each broadcast through shared memory behind a barrier."""
    loads = sm90_ptx(_COMPILE)
    serial = sm90_ptx(_COMPILE, GLM53_BEGIN_LOADS="0")
    assert "ld.global.gpu.acquire" in serial and "ld.global.gpu.acquire" not in loads
    assert loads.count("ld.relaxed.gpu.global.u32") == serial.count("ld.relaxed.gpu.global.u32") + 2
    assert loads.count("bar.sync") < serial.count("bar.sync")


@triton.jit
def budget_kernel(out, budget_ns, site):
    tl.store(out + tl.program_id(0), staggered_budget(budget_ns, site + tl.program_id(0)))


@pytest.mark.parametrize("budget_s", [1.0, 2.0, 60.0])
def test_staggered_budget_does_not_overflow(budget_s):
    """The stagger is computed in 64 bits: a budget under 2.147 s reaches the kernel as an i32 argument,
    and at 1 s the sites from #19 on overflowed int32 into a negative budget. On the H200 every wait at
    those sites (sparse.xd, nextn.z/xe/xd) then "timed out" at once, while the schedules with at most
    19 sites passed (docs/DECISIONS.md)."""
    ns = timeout_ns(budget_s)
    out = torch.zeros(64, dtype=torch.int64)
    budget_kernel[(64,)](out, ns, 0)
    want = [ns + s * (ns >> 4) for s in range(64)]
    assert out.tolist() == want



_COMPILE_HOP = r"""
import json, sys, triton
sys.path.insert(0, "scripts")
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from bench_hop import hop_kernel as k
sig = {n: "i32" for n in k.arg_names}
sig.update(box="*i32", pairs="*i64", hdr="*i32", out="*i64", src="*bf16", budget_ns="i64", POLLERS="constexpr",
           WAIT="constexpr", SIG="constexpr")
out = {}
for pollers, wait, s in ((2, 3, 1), (1, 2, 1), (0, 4, 2), (0, 5, 1), (0, 6, 3)):
    attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("box", "pairs", "hdr", "out", "src")}
    ck = triton.compile(ASTSource(fn=k, signature=sig, constexprs={"POLLERS": pollers, "WAIT": wait, "SIG": s},
                                  attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    out[f"{pollers}{wait}" + ("" if s == 1 else str(s))] = ck.asm["ptx"]
print(json.dumps({"ptx": json.dumps(out)}))
"""


def test_sm90_bench_hop_variants_compile():
    """scripts/bench_hop.py compiles for sm_90 with the streaming load (--pollers 2) and the bar.red.or.pred outcome
    (wait 3): the streamers' loads are 16-byte vector loads and survive (their sum is stored under a condition the
    compiler cannot decide), and wait 3 reduces each wait's outcome with one bar.red.or.pred."""
    ptx = json.loads(sm90_ptx(_COMPILE_HOP))
    # wait 3 has no failure path (_box_check, whose own bar.red wait 2 carries): each of its two waits (CTA 0's and
    # the peer's) reduces the outcome with one bar.red.or.pred
    assert "_box_check" not in ptx["23"] and ptx["23"].count("bar.red.or.pred") == 2 and "_box_check" in ptx["12"]
    stream = [ln for ln in ptx["23"].splitlines() if "ld.global" in ln and "evict_first" in ln]
    assert len(stream) == 16 and all(".v4." in ln for ln in stream)     # 16384 bf16 / 128 threads in 16-byte loads
    assert ptx["23"].count(SPIN_LINE_LOAD) >= 8
    # the measurement-only variants: 4:2 has no fence on either side, 5:1 times its budget on %clock64, 6:3 hands
    # off through 8-byte tagged pairs (relaxed stores, relaxed polls, the consumer's one fence)
    assert "fence" not in ptx["042"] and ptx["042"].count(SPIN_LINE_LOAD) >= 8
    assert "%clock64" in ptx["05"] and FENCE_ACQUIRE in ptx["05"]
    assert PAIR_LOAD in ptx["063"] and "st.relaxed.gpu.global.b64" in ptx["063"] and SPIN_LINE_LOAD not in ptx["063"]
