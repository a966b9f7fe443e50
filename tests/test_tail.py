"""The tail launch (real kernel code, interpreter, stage by stage) against the torch reference:
widths 1/2/4/8, bf16 and FP8, both norm modes, simulated and loopback TP2, tie-breaking, batch
invariance, fault injection at every wait site, input validation, and the sm_90 compile."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from glm53_flash.config import ConfigError
from glm53_flash.fp8 import dequantize_fp8, quantize_fp8
from glm53_flash.launches import available, sites
from glm53_flash.kernels.sample import reduce_candidates
from glm53_flash.launches.tail import TailLaunch, new_xchg, run_tp
from glm53_flash.schedule import max_resident_ctas
from glm53_flash.reference.ops import tail_logits
from sync import HandoffTimeout
from sync.asm import SPIN_LINE_LOAD

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-4          # measured ~1e-5: xn as bf16 hi + lo rows (~16 mantissa bits), fp32 accumulation


def _weights(cfg, gen, fp8=False):
    H, V = cfg.hidden_size, cfg.vocab_size
    W = (torch.randn(V, H, generator=gen) / H ** 0.5).to(torch.bfloat16)
    nw = (1 + 0.1 * torch.randn(H, generator=gen)).to(torch.bfloat16)
    if fp8:
        q, s = quantize_fp8(W)
        return q, s, dequantize_fp8(q, s), nw
    return W, None, W.float(), nw


def _check(cfg, logits, tokens, X, nw, Wref, rows, vocab_off=0):
    ref = tail_logits(X, nw.float(), Wref, cfg.rms_norm_eps)
    assert logits.shape == ref.shape and bool(torch.isfinite(logits).all()), "unwritten (NaN) logits"
    err = ((logits - ref).norm() / ref.norm()).item()
    assert err <= TOL, f"relative error {err:.2e}"
    # the token is the kernel's own argmax (first max = lowest index) and a maximum of the reference
    assert tokens.tolist() == (logits.argmax(-1) + vocab_off).tolist()
    # the token is a near-maximum of the reference: within twice the kernel's largest logit error
    top = ref.max(-1).values
    got = ref.gather(1, (tokens.long() - vocab_off).view(-1, 1)).squeeze(1)
    slack = 2 * (logits - ref).abs().max(-1).values
    assert bool((top - got <= slack).all())
    return err


def _poisoned(L):
    L.logits.fill_(float("nan"))
    L.tokens.fill_(-1)
    return L


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_tail_vs_reference(tiny_cfg, gen, width, fp8):
    W, S, Wref, nw = _weights(tiny_cfg, gen, fp8)
    X = torch.randn(width, 4, tiny_cfg.hidden_size, generator=gen)
    L = _poisoned(TailLaunch(tiny_cfg, W, nw, S, width=width))
    logits, tokens = L.run(X)
    _check(tiny_cfg, logits, tokens, X, nw, Wref, width)
    assert L.canaries() == [] and not L.record().failed


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_tail_odd_grid_task_ranges(tiny_cfg, gen, fp8):
    # grid 3: 1024 / 3 rows per task, so bf16 ranges start off the 64-row tile grid (16-row aligned) and
    # FP8 ranges must stay on it (one scale per tile, kernels/gemv.py)
    W, S, Wref, nw = _weights(tiny_cfg, gen, fp8)
    X = torch.randn(2, 4, tiny_cfg.hidden_size, generator=gen)
    L = _poisoned(TailLaunch(tiny_cfg, W, nw, S, width=2, grid=3))
    starts = [t.args[0] for t in L.schedule.tasks if t.family == "gemv"]
    assert len(starts) == 3 and all(s % (64 if fp8 else 16) == 0 for s in starts)
    assert fp8 or any(s % 64 for s in starts)
    logits, tokens = L.run(X)
    _check(tiny_cfg, logits, tokens, X, nw, Wref, 2)


@pytest.mark.parametrize("width, rows, fp8", [(8, 5, False), (4, 4, True)], ids=["w8-rows5-bf16", "w4-fp8"])
def test_tail_local_norm_and_partial_batch(tiny_cfg, gen, width, rows, fp8):
    W, S, Wref, nw = _weights(tiny_cfg, gen, fp8)
    X = torch.randn(rows, 4, tiny_cfg.hidden_size, generator=gen)
    L = _poisoned(TailLaunch(tiny_cfg, W, nw, S, width=width, norm_mode="local"))
    logits, tokens = L.run(X)
    _check(tiny_cfg, logits, tokens, X, nw, Wref, rows)
    assert bool(torch.isnan(L.logits[rows:]).all()) and bool((L.tokens[rows:] == -1).all())   # pad rows untouched
    assert L.sites.names == ["tail.cand"]
    box = TailLaunch(tiny_cfg, W, nw, S, width=width)               # the same chunks in the same order: same bits
    norm_args = [t.args for t in box.schedule.tasks if t.family == "norm"]
    assert norm_args == [(r, c) for r in range(width) for c in range(8)]
    lb, tb = box.run(X)
    assert torch.equal(lb, logits) and torch.equal(tb, tokens)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_tail_tp2_simulated(tiny_cfg, gen, fp8):
    H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
    W, _, Wref, nw = _weights(tiny_cfg, gen, False)
    X = torch.randn(4, 4, H, generator=gen)
    xchg = new_xchg(2, "cpu")
    Ls = []
    for r in range(2):
        shard = W[r * V // 2:(r + 1) * V // 2]
        q, s = quantize_fp8(shard) if fp8 else (shard, None)
        Ls.append(_poisoned(TailLaunch(tiny_cfg, q, nw, s, tp_rank=r, tp_size=2, width=4, xchg=xchg)))
    ref_w = torch.cat([dequantize_fp8(L.W, L.S) if fp8 else L.W.float() for L in Ls])
    out = run_tp(Ls, X)
    logits = torch.cat([o[0] for o in out], 1)
    assert out[0][1].tolist() == out[1][1].tolist()                   # every rank agrees on the token
    _check(tiny_cfg, logits, out[0][1], X, nw, ref_w, 4)
    assert Ls[0].sites.names == ["tail.xn", "tail.cand", "tail.xchg"] and not Ls[0].loopback


def test_tail_tp2_loopback(tiny_cfg, gen):
    H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
    W, _, Wref, nw = _weights(tiny_cfg, gen)
    X = torch.randn(2, 4, H, generator=gen)
    L1 = TailLaunch(tiny_cfg, W[V // 2:], nw, tp_rank=1, tp_size=2, width=2)
    L0 = TailLaunch(tiny_cfg, W[:V // 2], nw, tp_rank=0, tp_size=2, width=2)
    assert L0.loopback and L1.loopback
    lg1, alone1 = L1.run(X)                                             # no peers: its own candidate wins
    assert alone1.tolist() == (lg1.argmax(-1) + V // 2).tolist()
    lg0, tok = L0.run(X, peer={1: L1.candidate()})
    _check(tiny_cfg, torch.cat([lg0, lg1], 1), tok, X, nw, Wref, 2)


def test_ties_break_to_lower_index(tiny_cfg, gen):
    # equal weight rows at the same column of different tiles (other CTAs, other rank) give bitwise equal
    # logits; make them the maximum and check the lower vocabulary index wins everywhere
    H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
    W, _, _, nw = _weights(tiny_cfg, gen)
    X = torch.randn(2, 4, H, generator=gen)
    d = tail_logits(X, nw.float(), torch.eye(H), tiny_cfg.rms_norm_eps)[0]
    big = (8 * d / d.norm()).to(torch.bfloat16)
    i, j, k = 3 + 64, 3 + 64 * 6, 3 + V // 2 + 64 * 2                   # CTAs 0 and 2 of rank 0; rank 1
    for n in (i, j, k):
        W[n] = big
    L = TailLaunch(tiny_cfg, W, nw, width=2)
    logits, tokens = L.run(X)
    assert logits[0, i] == logits[0, j] == logits[0, k] == logits[0].max()
    assert tokens[0].item() == i
    xchg = new_xchg(2, "cpu")
    Ls = [TailLaunch(tiny_cfg, W[r * V // 2:(r + 1) * V // 2], nw, tp_rank=r, tp_size=2, width=2, xchg=xchg)
          for r in range(2)]
    assert [o[1][0].item() for o in run_tp(Ls, X)] == [i, i]
    W2 = W.clone()
    W2[i] = 0
    W2[j] = 0
    Ls = [TailLaunch(tiny_cfg, W2[r * V // 2:(r + 1) * V // 2], nw, tp_rank=r, tp_size=2, width=2, xchg=xchg)
          for r in range(2)]
    assert [o[1][0].item() for o in run_tp(Ls, X)] == [k, k]


def test_batch_invariance_and_determinism(tiny_cfg, gen):
    W, _, _, nw = _weights(tiny_cfg, gen)
    X = torch.randn(4, 4, tiny_cfg.hidden_size, generator=gen)
    L4 = TailLaunch(tiny_cfg, W, nw, width=4)
    a, ta = L4.run(X)
    b, tb = L4.run(X)
    assert torch.equal(a, b) and torch.equal(ta, tb)
    L1 = TailLaunch(tiny_cfg, W, nw, width=1, grid=3)                  # other width and grid
    c, tc = L1.run(X[2:3].clone())
    assert torch.equal(c[0], a[2]) and tc[0] == ta[2]


def test_fault_injection_every_site_then_clean(tiny_cfg, gen):
    H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
    W, _, _, nw = _weights(tiny_cfg, gen)
    X = torch.randn(3, 4, H, generator=gen)
    L = TailLaunch(tiny_cfg, W, nw, width=4)
    good = L.run(X)
    for site in L.sites:
        with pytest.raises(HandoffTimeout, match=f"wait site '{site}'") as ei:
            L.run(X, inject_fault=site)
        assert ei.value.wanted != ei.value.seen
        again = L.run(X)
        assert torch.equal(again[0], good[0]) and torch.equal(again[1], good[1])
    xchg = new_xchg(2, "cpu")
    Ls = [TailLaunch(tiny_cfg, W[r * V // 2:(r + 1) * V // 2], nw, tp_rank=r, tp_size=2, width=4, xchg=xchg)
          for r in range(2)]
    ref = run_tp(Ls, X)
    with pytest.raises(HandoffTimeout, match="'tail.xchg'"):
        run_tp(Ls, X, inject_fault="tail.xchg", fault_rank=1)       # rank 1 skips its publish; rank 0 waits
    assert [o[1].tolist() for o in run_tp(Ls, X)] == [o[1].tolist() for o in ref]
    with pytest.raises(KeyError, match="unknown wait site 'tail.nope'"):
        L.run(X, inject_fault="tail.nope")


def test_bad_inputs_are_refused(tiny_cfg, gen):
    H, V = tiny_cfg.hidden_size, tiny_cfg.vocab_size
    W, _, Wref, nw = _weights(tiny_cfg, gen)
    q, s = quantize_fp8(W)
    with pytest.raises(ValueError, match="width=3"):
        TailLaunch(tiny_cfg, W, nw, width=3)
    with pytest.raises(ConfigError, match="tp=3"):
        TailLaunch(tiny_cfg, W, nw, tp_size=3)
    with pytest.raises(ValueError, match=r"shape \(1024, 256\), expected \[512, 256\]"):
        TailLaunch(tiny_cfg, W, nw, tp_size=2, tp_rank=1)
    with pytest.raises(ValueError, match="FP8 lm_head needs fp32 scales of shape \\(8, 2\\)"):
        TailLaunch(tiny_cfg, q, nw)
    with pytest.raises(ValueError, match="norm_mode='x'"):
        TailLaunch(tiny_cfg, W, nw, norm_mode="x")
    L = TailLaunch(tiny_cfg, W, nw, width=2)
    X = torch.randn(3, 4, H, generator=gen)
    with pytest.raises(ValueError, match="X has 3 rows; this launch is built for 1..2"):
        L.run(X)
    with pytest.raises(ValueError, match=r"X must be fp32 \[rows, 4, 256\]"):
        L.run(X[:2].double())
    with pytest.raises(ValueError, match="timeout_s=0"):
        L.timeout_s = 0
    logits, tokens = L.run(X[:2])                                       # nothing above changed its state
    _check(tiny_cfg, logits, tokens, X[:2], nw, Wref, 2)


def test_sites_api():
    assert "tail" in available()
    assert sites("tail") == ["tail.xn", "tail.cand"]
    assert sites("tail", tp=2) == ["tail.xn", "tail.cand", "tail.xchg"]
    with pytest.raises(ValueError, match="launch kind 'nope' is not implemented"):
        sites("nope")


_COMPILE = r"""
import json, triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from glm53_flash.launches.tail import tail_kernel as k
P = dict(table="*i32", starts="*i32", X="*fp32", norm_w="*bf16", logits="*fp32", tokens="*i32", best="*i32",
         scratch="*i32", xchg="*i64", peer_src="*i32", trace="*i64", eps="fp32", timeout_ns="i64")
out = {}
for fp8 in (False, True):
    C = dict(H=4096, BLOCK_N=64, BLOCK_K=128, PF_K=128, NUM_STAGES=4, LOCAL_NORM=False, SLOTS=1024,
             L2_LINES=2 if fp8 else 4, EPL=128 if fp8 else 64, XPF=True, ROW16=True, XR=4, RP=1, TRACE=False)
    sig = {n: ("constexpr" if n in C else P.get(n, "i32")) for n in k.arg_names}
    sig["W"], sig["S"] = ("*fp8e4nv", "*fp32") if fp8 else ("*bf16", "*bf16")
    ck = triton.compile(ASTSource(fn=k, signature=sig, constexprs=C), target=GPUTarget("cuda", 90, 32),
                        options={"num_warps": 4, "maxnreg": 120})
    out[str(fp8)] = ck.asm["ptx"]
print(json.dumps(out))
"""


def test_sm90_compile_and_spin_regions():
    from test_sync import spin_regions_without_barrier
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    for fp8, ptx in json.loads(out.stdout.strip().splitlines()[-1]).items():
        assert "mma.sync" in ptx and ptx.count(SPIN_LINE_LOAD) == 8, fp8
        assert spin_regions_without_barrier(ptx) == [], fp8


def test_sm90_registers_offline():
    """The tail at the real shape (H 4096, 4 warps, the launch's constexprs) fits 4 CTAs per SM: <= 120
    registers (the default maxnreg; 128 is the 4-per-SM limit), nothing spilled (scripts/regs_offline.py; no GPU
    needed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "regs_offline.py"), "tail_bf16_max120",
                          "tail_fp8_max120"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    for line in out.stdout.strip().splitlines():
        r = json.loads(line)
        assert r["regs"] <= 120 and r["spill"] == 0, r
        assert max_resident_ctas(r["regs"], 4, r.get("shared", 0), 132) >= 4 * 132, r


@triton.jit
def _reduce_probe(slots, n_slots, rows, hdr, out, SLOTS: tl.constexpr, RP: tl.constexpr):
    bv, bi, ok = reduce_candidates(slots, n_slots, rows, 5, hdr, 0, 0, 1000000, SLOTS, RP)
    r = tl.arange(0, 8)
    tl.store(out + r, bv.to(tl.int32, bitcast=True))
    tl.store(out + 8 + r, bi)
    tl.store(out + 16, ok)


@pytest.mark.parametrize("rows, slots_per_step, rp", [(1, 4, 1), (2, 4, 2), (3, 2, 4), (8, 2, 8)])
def test_reduce_steps_and_row_pad_pick_the_same(gen, rows, slots_per_step, rp):
    """reduce_candidates over 11 slots in steps of SLOTS slots x RP rows (the tail's 1-row build awaits 1024
    slots a step, its 8-row build 64): the larger value, then the lower index, whatever the steps; ties planted
    across steps and inside one; rows >= RP come back as the empty candidate."""
    n = 11
    v = torch.randn(n, 8, generator=gen)
    ix = torch.randperm(1000, generator=gen)[: n * 8].view(n, 8).int() + 7
    v[2, 0] = v[9, 0] = v[5, 0] = 10.0                       # a three-way tie in row 0, slots in different steps
    ix[2, 0], ix[9, 0], ix[5, 0] = 40, 30, 35
    if rows > 1:
        v[6, 1] = v[7, 1] = 11.0                             # inside one step (slots 6, 7)
        ix[6, 1], ix[7, 1] = 900, 800
    words = torch.zeros(n, 16, dtype=torch.int64)
    tag = 5
    words[:, :8] = (v.view(torch.int32).long() << 32) | tag
    words[:, 8:] = (ix.long() << 32) | tag
    hdr = torch.zeros(256, dtype=torch.int32)
    out = torch.full((17,), -1, dtype=torch.int32)
    _reduce_probe[(1,)](words.view(-1), n, rows, hdr, out, SLOTS=slots_per_step, RP=rp)
    got_v, got_i = out[:8].view(torch.float32), out[8:16]
    assert out[16].item() == 1
    for r in range(8):
        if r < min(rows, rp):
            best = v[:, r].max()
            want = ix[:, r][v[:, r] == best].min()
            assert got_v[r].item() == best.item() and got_i[r].item() == want.item(), r
        else:
            assert got_v[r].item() == float("-inf") and got_i[r].item() == 2147483647, r
    assert got_i[0].item() == 30


def test_tail_trace_every_task_same_bits(tiny_cfg, gen):
    """A traced tail launch (TRACE build; diag_layers / bench_gap --kind tail) gives the same bits and a
    (start, end) row for every task and CTA; the report names every stage."""
    from glm53_flash.launches.trace import read, report
    W, _, _, nw = _weights(tiny_cfg, gen)
    X = torch.randn(2, 4, tiny_cfg.hidden_size, generator=gen)
    L = TailLaunch(tiny_cfg, W[: tiny_cfg.vocab_size // 2], nw, tp_rank=0, tp_size=2, width=2)
    plain = [t.clone() for t in L.run(X)]
    L.enable_trace()
    traced = L.run(X)
    assert all(torch.equal(a, b) for a, b in zip(plain, traced))
    tb = L.trace_buf
    assert bool((tb[:, :4] >= 0).all()) and bool((tb[:, 0] <= tb[:, 1]).all())
    times, ctas = read(L)
    assert sorted(t.task for t in times) == list(range(len(L.schedule.tasks))) and len(ctas) == L.grid
    text = report(L)
    assert all(n in text for n in L.schedule.stage_names) and "critical path" in text
    L.enable_trace(False)
