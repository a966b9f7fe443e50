"""The `dense` launch (KDA mixer + dense clamped-SwiGLU MLP, both inside mHC) against the reference's
`layer_step` on the tiny preset (real kernel code, interpreter, stage by stage): X' and the new KDA
state and conv window, NaN-poisoned outputs and scratch, pad rows untouched, exact math with fp32
hand-offs (and the column-block KDA split with its norm stage), batch invariance, fault injection at
every wait site (named HandoffTimeout, caller's state untouched, next launch bitwise equal), simulated
and loopback TP2, FP8 from a checkpoint, and the GPU checks at real shapes (marker `gpu`).

The shared helpers here are used by test_launch_kda.py and test_launch_embed.py too.
CPU tolerances: bf16 hand-offs 1e-2 (the interpreter truncates fp32 -> bf16 instead of rounding to
nearest, so its error is about twice the GPU's); fp32 hand-offs 1e-4 (measured ~1e-5).
"""
from __future__ import annotations

import functools
import time

import pytest
import torch

from glm53_flash.launches import available, build_launch, sites
from glm53_flash.launches.dense import DenseLaunch
from glm53_flash.launches.layer_host import new_xchg, run_tp
from glm53_flash.reference.model import ReferenceModel
from sync import HandoffTimeout

TOL_BF16 = 1e-2
TOL_F32 = 1e-4
DENSE_LAYER = 1


# ---------------------------------------------------------------------------- helpers (shared)
def rel(a, b) -> float:
    return float((a.double().cpu() - b.double().cpu()).norm() / b.double().cpu().norm())


def rel_rows(a, b) -> str:
    """Each row's relative error (dim 0), for failure reports."""
    return " ".join(f"{rel(x, y):.1e}" for x, y in zip(a, b))


@pytest.fixture(scope="session")
def tiny_ref(tiny_cfg, tiny_weights):
    return ReferenceModel(tiny_cfg, tiny_weights)


def make_step(cfg, ref, layer, rows, gen):
    """Random streams, KDA state and conv window for `rows` rows of `layer` -> (X, caches)."""
    caches = ref.new_caches(rows, 8)
    caches.kda_state.normal_(generator=gen).mul_(0.3)
    caches.conv_window.normal_(generator=gen)
    X = torch.randn(rows, 4, cfg.hidden_size, generator=gen)
    return X, caches


def rank_state(cfg, caches, layer, rank=0, tp=1):
    """This rank's (kda_state, conv_window) of `layer` as contiguous copies (the launch's run layout)."""
    k = cfg.kda_layers.index(layer)
    S, W = caches.kda_state[:, k], caches.conv_window[:, k]
    n, D = S.shape[1] // tp, cfg.kda_dim
    d = D // tp
    Wr = torch.cat([W[..., s * D + rank * d: s * D + (rank + 1) * d] for s in range(3)], -1)
    return S[:, rank * n:(rank + 1) * n].clone().contiguous(), Wr.contiguous()


def ref_step(ref, caches, layer, X):
    """Reference X' and the caches after the layer (a clone; `caches` untouched)."""
    c = caches.clone()
    out = ref.layer_step(c, layer, X, torch.zeros(X.shape[0], dtype=torch.long))
    return out, c


def poison_scratch(L) -> None:
    """NaN (or -1) in every payload region of the scratch: whatever a task reads unwritten shows up."""
    for r in L.layout.regions:
        if r.kind == "rows":
            v = L.layout.view(L.scratch, r.name)
            v.fill_(float("nan") if v.is_floating_point() else -1)


def check_step(L, out, S, W, ref, caches, layer, X, tol, tp=1, rank=0, label=""):
    """Compare a launch's X' and committed state/window with the reference; returns the errors."""
    Xr, c = ref_step(ref, caches, layer, X)
    Sr, Wr = rank_state(ref.cfg, c, layer, rank, tp)
    assert bool(torch.isfinite(out).all()), "unwritten (NaN) X'"
    assert bool(torch.isfinite(S).all()) and bool(torch.isfinite(W).all()), "unwritten state / window"
    errs = {"X": rel(out, Xr), "dX": rel(out - X, Xr - X), "state": rel(S, Sr), "window": rel(W, Wr)}
    print(f"[{L.kind} {label} w{L.width} rows{out.shape[0]} tp{tp}] rel err " +
          " ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    for k, v in errs.items():
        assert v <= tol, f"{k}: relative error {v:.2e} > {tol:.0e}"
    assert L.canaries() == [] and not L.record().failed
    return errs


def check_tp2(Ls, X, ref, caches, layer, label):
    """Simulated TP2 of Ls (a launch per rank, one mailbox): every rank the same bits, each rank's X', state and
    window the reference's. -> the outputs."""
    ins = [(X, *rank_state(ref.cfg, caches, layer, r, 2)) for r in range(2)]
    outs = run_tp(Ls, ins)
    assert torch.equal(outs[0], outs[1])
    for r in range(2):
        check_step(Ls[r], outs[r], ins[r][1], ins[r][2], ref, caches, layer, X, TOL_BF16, tp=2, rank=r, label=label)
    return outs


def fault_every_site(L, X, S, W, expect_sites, clean_after=None):
    """Fault injection at every wait site: the named timeout and the caller's state untouched; after the
    sites in `clean_after` (default: the first and the last; CPU time) a clean launch from the same inputs
    is bitwise equal to the one before the faults, state and window included."""
    assert list(L.sites) == expect_sites
    clean_after = {expect_sites[0], expect_sites[-1]} if clean_after is None else set(clean_after)
    S0, W0 = S.clone(), W.clone()
    good = L.run(X, S, W)
    S_good, W_good = S.clone(), W.clone()
    S.copy_(S0)
    W.copy_(W0)
    for site in L.sites:
        with pytest.raises(HandoffTimeout, match=f"wait site '{site}'") as ei:
            L.run(X, S, W, inject_fault=site)
        assert ei.value.wanted != ei.value.seen
        assert torch.equal(S, S0) and torch.equal(W, W0), f"state changed by the faulted launch at {site}"
        if site in clean_after:
            again = L.run(X, S, W)
            assert torch.equal(again, good) and torch.equal(S, S_good) and torch.equal(W, W_good), site
            S.copy_(S0)
            W.copy_(W0)


# ---------------------------------------------------------------------------- CPU tests
@pytest.mark.parametrize("width, rows", [(1, 1), (4, 3)], ids=["w1", "w4-rows3"])
def test_dense_vs_reference(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, width, rows):
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, rows, gen)
    S, W = rank_state(tiny_cfg, caches, DENSE_LAYER)
    L = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=width)
    poison_scratch(L)
    out = L.run(X, S, W)
    check_step(L, out, S, W, tiny_ref, caches, DENSE_LAYER, X, TOL_BF16, label="bf16")
    assert bool(torch.isnan(L.X_out[rows:]).all()) and bool(torch.isnan(L.S_out[rows:]).all())   # pad rows
    assert bool(torch.isnan(L.W_out[rows:]).all())


def test_dense_exact_with_fp32_handoffs_and_block_split(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    # fp32 hand-offs isolate the launch's math from bf16 rounding; block_v=32 runs the column-block KDA
    # tasks with the kda_norm join stage (the real model's default)
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, 2, gen)
    S, W = rank_state(tiny_cfg, caches, DENSE_LAYER)
    L = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=2, act_dtype="float32", block_v=32)
    poison_scratch(L)
    assert "dense.oraw" in L.sites
    out = L.run(X, S, W)
    check_step(L, out, S, W, tiny_ref, caches, DENSE_LAYER, X, TOL_F32, label="fp32-bv32")


_GATE_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, "tests")
from glm53_flash.config import preset
from glm53_flash.launches.dense import DenseLaunch
from glm53_flash.reference.model import ReferenceModel
from glm53_flash.weights import RandomWeights
from sync import HandoffTimeout
from test_launch_dense import DENSE_LAYER, make_step, poison_scratch, rank_state
torch.set_num_threads(1)
cfg = preset("tiny")
w = RandomWeights(cfg, seed=0, cache=True)
X, caches = make_step(cfg, ReferenceModel(cfg, w), DENSE_LAYER, 2, torch.Generator().manual_seed(11))
S, W = rank_state(cfg, caches, DENSE_LAYER)
L = DenseLaunch(cfg, w, DENSE_LAYER, width=2, block_v=32)
poison_scratch(L)
faults = {}
for site in ("dense.yin", "dense.oraw"):
    try:
        L.run(X, S.clone(), W.clone(), inject_fault=site)
        faults[site] = "no timeout"
    except HandoffTimeout as e:
        faults[site] = str(e)
out = L.run(X, S, W)
torch.save({"out": out, "S": S, "W": W}, sys.argv[1])
print(json.dumps(faults))
"""


def test_kda_norm_gate_early_same_bits(tmp_path):
    """kda_norm's output gate formed before its oraw wait, behind a yin wait (GLM53_KDA_GATE_EARLY=1, read at
    import: one subprocess a value) gives the same bits as the gate formed after it (=0): the same operations on
    the same values, earlier. The column-block KDA (block_v=32, so a kda_norm stage) with bf16 hand-offs,
    NaN-poisoned scratch, and a fault at yin and at oraw named in both (every site: the fault tests, default)."""
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    res = {}
    for v in ("0", "1"):
        env = dict(os.environ, GLM53_KDA_GATE_EARLY=v, TRITON_INTERPRET="1",
                   PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable, "-c", _GATE_SCRIPT, str(tmp_path / f"g{v}.pt")], env=env, cwd=root,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        faults = json.loads(p.stdout.strip().splitlines()[-1])
        for site, msg in faults.items():
            assert f"wait site '{site}'" in msg, (v, site, msg)
        res[v] = torch.load(tmp_path / f"g{v}.pt")
    for k in ("out", "S", "W"):
        assert bool(torch.isfinite(res["1"][k]).all()), k
        assert torch.equal(res["0"][k], res["1"][k]), k


def test_dense_batch_invariance_and_determinism(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    # a row's bits do not depend on the width, the other rows or the grid (join orders are per column
    # tile, not per task), and a launch repeats bit for bit
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, 2, gen)
    S, W = rank_state(tiny_cfg, caches, DENSE_LAYER)
    L2 = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=2)
    a = L2.run(X, S.clone(), W.clone())
    S2, W2 = S.clone(), W.clone()
    b = L2.run(X, S2, W2)
    assert torch.equal(a, b)
    L1 = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=1, grid=3)          # other width and grid
    S1, W1 = S[1:2].clone(), W[1:2].clone()
    c = L1.run(X[1:2].clone(), S1, W1)
    assert torch.equal(c[0], a[1]) and torch.equal(S1[0], S2[1]) and torch.equal(W1[0], W2[1])


def test_dense_fault_every_site_then_clean(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, 1, gen)
    S, W = rank_state(tiny_cfg, caches, DENSE_LAYER)
    L = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=1)
    fault_every_site(L, X, S, W, sites("dense", head_dim=64))
    with pytest.raises(KeyError, match="unknown wait site 'dense.nope'"):
        L.run(X, S, W, inject_fault="dense.nope")


def test_dense_tp2_simulated_and_fault(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, 2, gen)
    xchg = new_xchg(tiny_cfg, 2, 2, "cpu")
    Ls = [DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, tp_rank=r, tp_size=2, width=2, xchg=xchg) for r in range(2)]
    assert [s.split(".")[1] for s in Ls[0].sites] == ["hp1", "a_in", "yin", "o", "xo", "cf1", "hp2", "a", "hg", "h",
                                                     "cf2", "xd"]
    ins = [(X, *rank_state(tiny_cfg, caches, DENSE_LAYER, r, 2)) for r in range(2)]
    before = [(s.clone(), w.clone()) for _, s, w in ins]
    with pytest.raises(HandoffTimeout, match="'dense.xd'"):
        run_tp(Ls, ins, inject_fault="dense.xd", fault_rank=1)        # rank 1 skips its publish; both wait
    assert all(torch.equal(s, b[0]) and torch.equal(w, b[1]) for (_, s, w), b in zip(ins, before))
    outs = run_tp(Ls, ins)
    assert torch.equal(outs[0], outs[1])                               # every rank gets the same bits
    for r in range(2):
        check_step(Ls[r], outs[r], ins[r][1], ins[r][2], tiny_ref, caches, DENSE_LAYER, X, TOL_BF16, tp=2, rank=r,
                   label="tp2")


def test_dense_tp2_row_groups_same_bits(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, monkeypatch):
    """post1 / post2 split their rows over tasks (layer_host.rows_per_task): groups of 2 of a width-4 launch running 3
    rows (the second group has one live row) give the same bits as one task taking every row, on every rank."""
    from glm53_flash.launches import layer_host
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, 3, gen)
    fresh = [(X, *rank_state(tiny_cfg, caches, DENSE_LAYER, r, 2)) for r in range(2)]
    outs, states = {}, {}
    for nominal in (8, 1):          # 4 tile ranges: 8 // 4 = 2 groups of 2 rows; 1: a single group of all 4
        ins = states[nominal] = [(x, s.clone(), w.clone()) for x, s, w in fresh]     # a run commits its state
        monkeypatch.setattr(layer_host, "NOMINAL_GRID", nominal)
        xchg = new_xchg(tiny_cfg, 2, 4, "cpu")
        Ls = [DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, tp_rank=r, tp_size=2, width=4, xchg=xchg) for r in range(2)]
        groups = sorted({(t.args[3], t.args[4]) for t in Ls[0].schedule.tasks if t.family in ("post1", "post2")})
        assert groups == ([(0, 2), (2, 2)] if nominal == 8 else [(0, 4)]), groups
        outs[nominal] = run_tp(Ls, ins)
    for r in range(2):
        assert torch.equal(outs[8][r], outs[1][r])
        assert torch.equal(states[8][r][1], states[1][r][1]) and torch.equal(states[8][r][2], states[1][r][2])
        check_step(Ls[r], outs[1][r], states[1][r][1], states[1][r][2], tiny_ref, caches, DENSE_LAYER, X, TOL_BF16,
                   tp=2, rank=r, label="row groups")


def test_dense_split_k_oproj_and_down(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, monkeypatch):
    """o_proj and the down GEMV in K slices (the real TP1 shapes' choice, layer_host.py _oproj_split / _no_moe):
    o_proj's slices as sources of the xo rank sum (o_sum stage), the down's as dpart planes joined by down_join.
    Pinned at 2 / 2 on the tiny shapes: the reference (3 of 4 rows, poisoned scratch), the unsplit launch up to
    rounding (another sum order), a row's bits whatever the width, grid and other rows, both new wait sites
    faulted with the caller's state untouched and a clean launch after; and the down's slices at simulated TP2
    (down_join publishes xd)."""
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, 3, gen)
    S, W = rank_state(tiny_cfg, caches, DENSE_LAYER)
    unsplit = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=4)
    assert (unsplit.ks_o, unsplit.kg) == (1, 1)          # the tiny shapes' own choice: unsplit
    base = unsplit.run(X, S.clone(), W.clone(), commit=False)
    monkeypatch.setattr(DenseLaunch, "oproj_split", 2)
    monkeypatch.setattr(DenseLaunch, "down_groups", 2)
    L = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=4)
    assert (L.ks_o, L.kg) == (2, 2) and {"o_sum", "down_join"} <= set(L.schedule.stage_names)
    assert list(L.sites) == DenseLaunch.site_names(1, down_groups=2, oproj_split=2)
    assert [s.split(".")[1] for s in L.sites][3:6] == ["o", "xo", "cf1"] and list(L.sites)[-2] == "dense.dp"
    poison_scratch(L)
    S2, W2 = S.clone(), W.clone()
    out = L.run(X, S2, W2)
    assert rel(out, base) < 1e-5
    check_step(L, out, S2, W2, tiny_ref, caches, DENSE_LAYER, X, TOL_BF16, label="split-k")
    L1 = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=1, grid=3)
    S1, W1 = S[1:2].clone(), W[1:2].clone()
    assert torch.equal(L1.run(X[1:2].clone(), S1, W1)[0], out[1]) and torch.equal(S1[0], S2[1])
    S0, W0 = S.clone(), W.clone()
    for site in ("dense.xo", "dense.dp"):
        with pytest.raises(HandoffTimeout, match=f"wait site '{site}'"):
            L.run(X, S, W, inject_fault=site)
        assert torch.equal(S, S0) and torch.equal(W, W0), site
        assert torch.equal(L.run(X, S, W, commit=False), out)
    monkeypatch.setattr(DenseLaunch, "oproj_split", None)
    xchg = new_xchg(tiny_cfg, 2, 4, "cpu")
    Ls = [DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, tp_rank=r, tp_size=2, width=4, xchg=xchg) for r in range(2)]
    assert [s.split(".")[1] for s in Ls[0].sites][-4:] == ["h", "dp", "cf2", "xd"]
    check_tp2(Ls, X, tiny_ref, caches, DENSE_LAYER, "tp2-down-split")
    with pytest.raises(ValueError, match="oproj_split=2 .* needs tp_size 1"):
        monkeypatch.setattr(DenseLaunch, "oproj_split", 2)
        DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, tp_rank=0, tp_size=2, width=4, xchg=xchg)
    with pytest.raises(ValueError, match="down_groups=3 must divide"):
        monkeypatch.setattr(DenseLaunch, "down_groups", 3)
        DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=4)
    # more slices than the placeholder MoE's KE + 1 = 2 (the real TP1 shape chooses 3): the dense plan must not
    # size its unused act_cta region from them (it once planned 0 words and could not be built)
    monkeypatch.setattr(DenseLaunch, "down_groups", 4)
    L4 = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=4)
    assert L4.kg == 4 and rel(L4.run(X, S.clone(), W.clone(), commit=False), base) < 1e-5


def test_dense_tp2_loopback(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    # one "GPU" per rank in loopback: pass 1 gives every rank's o_proj partial (it needs no peer), pass 2
    # with those gives the down partials, pass 3 with both gives the full layer on every rank
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, 1, gen)
    Ls = [DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, tp_rank=r, tp_size=2, width=1) for r in range(2)]
    assert Ls[0].loopback
    ins = [rank_state(tiny_cfg, caches, DENSE_LAYER, r, 2) for r in range(2)]
    po = {}
    for L, (S, W) in zip(Ls, ins):
        L.run(X, S, W, commit=False)
        po[L.tp_rank] = L.own_partials()[0]
    pd = {}
    for L, (S, W) in zip(Ls, ins):
        L.run(X, S, W, peer={p: (po[p], torch.zeros_like(po[p])) for p in po if p != L.tp_rank}, commit=False)
        pd[L.tp_rank] = L.own_partials()[1]
    for L, (S, W) in zip(Ls, ins):
        out = L.run(X, S, W, peer={p: (po[p], pd[p]) for p in po if p != L.tp_rank})
        check_step(L, out, S, W, tiny_ref, caches, DENSE_LAYER, X, TOL_BF16, tp=2, rank=L.tp_rank, label="loopback")


def test_dense_fp8_checkpoint(tiny_cfg, tmp_path, gen, one_thread):
    from glm53_flash.checkpoint import load_checkpoint, make_random_checkpoint
    make_random_checkpoint(tiny_cfg, tmp_path / "ck", seed=3, weights="fp8")
    ck = load_checkpoint(tmp_path / "ck", progress=False)
    ref = ReferenceModel(tiny_cfg, ck.dequantized())
    X, caches = make_step(tiny_cfg, ref, DENSE_LAYER, 2, gen)
    S, W = rank_state(tiny_cfg, caches, DENSE_LAYER)
    L = build_launch("dense", ck, width=2, layer=DENSE_LAYER)
    assert L.W_g.dtype == torch.float8_e4m3fn and L.W_d.dtype == torch.float8_e4m3fn
    out = L.run(X, S, W)
    check_step(L, out, S, W, ref, caches, DENSE_LAYER, X, TOL_BF16, label="fp8")


def test_layer_kinds_api_and_bad_inputs(tiny_cfg, tiny_weights, gen):
    assert {"tail", "embed", "dense", "kda"} <= set(available())
    assert sites("dense", head_dim=64) == [f"dense.{s}" for s in ("hp1", "a_in", "yin", "o", "cf1", "hp2", "a", "hg",
                                                                  "h", "cf2")]
    assert sites("dense") == [f"dense.{s}" for s in ("hp1", "a_in", "yin", "oraw", "o", "cf1", "hp2", "a", "hg", "h",
                                                     "cf2")]
    with pytest.raises(ValueError, match="layer 4 is a 'kda' launch"):
        DenseLaunch(tiny_cfg, tiny_weights, 4)
    with pytest.raises(ValueError, match="width=3"):
        DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=3)
    from glm53_flash.launches.sparse import SparseLaunch
    from glm53_flash.launches.tail import TailLaunch
    for make in (lambda **kw: DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, **kw),   # one check, every kind
                 lambda **kw: SparseLaunch(tiny_cfg, tiny_weights, 3, **kw),
                 lambda **kw: TailLaunch(tiny_cfg, torch.zeros(tiny_cfg.vocab_size, tiny_cfg.hidden_size,
                                                     dtype=torch.bfloat16),
                                         torch.ones(tiny_cfg.hidden_size, dtype=torch.bfloat16), **kw)):
        with pytest.raises(ValueError, match=r"tp_rank=2 must be in \[0, tp_size=2\)"):
            make(tp_rank=2, tp_size=2)
        with pytest.raises(ValueError, match="width=5 must be one of"):
            make(width=5)
    L = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=2)
    X = torch.randn(3, 4, tiny_cfg.hidden_size, generator=gen)
    S = torch.zeros(3, 4, 64, 64)
    W = torch.zeros(3, 3, 768)
    with pytest.raises(ValueError, match="3 rows; this launch is built for 1..2"):
        L.run(X, S, W)
    with pytest.raises(ValueError, match=r"conv_window must be torch.float32 \[2, 3, 768\]"):
        L.run(X[:2], S[:2], W[:2, :, :700])
    with pytest.raises(ValueError, match=r"X must be torch.float32"):
        L.run(X[:2].double(), S[:2], W[:2])


# ---------------------------------------------------------------------------- GPU (real shapes)
def gpu_cfg():
    """The real per-layer shapes: layers 0-2 KDA + dense, 3 DSA, 4 KDA + MoE (16 experts, top-8)."""
    from glm53_flash.config import GlmConfig
    return GlmConfig(num_hidden_layers=5, n_routed_experts=16, num_nextn_predict_layers=0)


@functools.lru_cache(maxsize=4)
def gpu_weights(layer: int, fmt: str, embed: bool):
    """(launch weights, dequantized weights for the reference, FP8 scales) of one layer on the GPU,
    cached across the GPU tests (random weights take seconds to generate at real shapes)."""
    from glm53_flash.fp8 import dequantize_fp8, quantize_fp8
    from glm53_flash.weights import RandomWeights, weight_specs
    cfg = gpu_cfg()
    base = RandomWeights(cfg, seed=0)
    specs = weight_specs(cfg)
    prefix = f"model.language_model.layers.{layer}."
    names = [n for n in specs if n.startswith(prefix)] + (["model.language_model.embed_tokens.weight"] if embed else [])
    w, deq, scales = {}, {}, {}
    for n in names:
        t = base[n]
        if fmt == "fp8" and specs[n].fp8:
            q, sc = quantize_fp8(t)
            w[n], scales[n], deq[n] = q.cuda(), sc.cuda(), dequantize_fp8(q, sc).cuda()
        else:
            w[n] = deq[n] = t.cuda()
    return w, _Partial(deq, base), scales


def gpu_layer_check(cls, layer, tp, width, fmt, fault_sites=None):
    """Real-shape launch of `cls` at one TP shard (loopback, ranks solved in 3 passes as in the CPU
    loopback test) vs the fp32 reference on the GPU: rel err <= 1e-2, bitwise repeatability, batch
    invariance over widths 1/2/4/8, faults at every site leave the state untouched."""
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = gpu_cfg()
    w, deq, scales = gpu_weights(layer, fmt, cls.kind == "embed")
    ref = ReferenceModel(cfg, deq, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(7)
    rows = width
    caches = ref.new_caches(rows, 8)
    caches.kda_state.normal_(generator=g).mul_(0.3)
    caches.conv_window.normal_(generator=g)
    X = torch.randn(rows, 4, cfg.hidden_size, device="cuda", generator=g)
    embed = cls.kind == "embed"
    tokens = torch.randint(0, cfg.vocab_size, (rows,), device="cuda", generator=g)
    x_in = tokens if embed else X
    Ls = [cls(cfg, w, layer, tp_rank=r, tp_size=tp, width=width, device="cuda", scales=scales) for r in range(tp)]
    ins = [rank_state(cfg, caches, layer, r, tp) for r in range(tp)]
    ins = [(s.cuda(), ww.cuda()) for s, ww in ins]
    if tp == 1:
        outs = [Ls[0].run(x_in, *ins[0], commit=False)]
    else:
        po, pd = {}, {}
        for L, (S, W) in zip(Ls, ins):
            L.run(x_in, S, W, commit=False)
            po[L.tp_rank] = L.own_partials()[0]
        for L, (S, W) in zip(Ls, ins):
            L.run(x_in, S, W, peer={p: (po[p], torch.zeros_like(po[p])) for p in po if p != L.tp_rank}, commit=False)
            pd[L.tp_rank] = L.own_partials()[1]
        outs = [L.run(x_in, S, W, peer={p: (po[p], pd[p]) for p in po if p != L.tp_rank}, commit=False)
                for L, (S, W) in zip(Ls, ins)]
    L = Ls[0]
    Xr, c = ref_step(ref, caches, layer, ref.embed(tokens) if embed else X)
    Sr, Wr = rank_state(cfg, c, layer, 0, tp)
    errs = {"X": rel(outs[0], Xr), "state": rel(L.S_out[:rows], Sr), "window": rel(L.W_out[:rows], Wr)}
    print(f"[gpu {cls.kind} L{layer} tp{tp} w{width} {fmt}] rel err {errs}")
    assert all(v <= 1e-2 for v in errs.values()), errs
    assert all(torch.equal(o, outs[0]) for o in outs)
    peer = None if tp == 1 else {p: (po[p], pd[p]) for p in po if p != 0}
    again = L.run(x_in, *ins[0], peer=peer, commit=False)
    assert torch.equal(again, outs[0]), "not bitwise repeatable"
    for w1 in (1, 2, 4, 8):                                  # batch invariance: row 0 alone at every width
        L1 = cls(cfg, w, layer, tp_rank=0, tp_size=tp, width=w1, device="cuda", scales=scales)
        pr = None if tp == 1 else {p: (po[p][:1], pd[p][:1]) for p in po if p != 0}
        o1 = L1.run(x_in[:1], ins[0][0][:1].clone(), ins[0][1][:1].clone(), peer=pr, commit=False)
        assert torch.equal(o1[0], outs[0][0]), f"row 0 differs at width {w1}"
        assert torch.equal(L1.S_out[0], L.S_out[0]) and torch.equal(L1.W_out[0], L.W_out[0]), w1
    if rows > 1:            # and the last row alone: its MMA column is rows - 1 in the batch, 0 alone (the MoE
        r = rows - 1        # items serve every row that chose an expert at once)
        L1 = cls(cfg, w, layer, tp_rank=0, tp_size=tp, width=1, device="cuda", scales=scales)
        pr = None if tp == 1 else {p: (po[p][r:r + 1], pd[p][r:r + 1]) for p in po if p != 0}
        o1 = L1.run(x_in[r:r + 1], ins[0][0][r:r + 1].clone(), ins[0][1][r:r + 1].clone(), peer=pr, commit=False)
        assert torch.equal(o1[0], outs[0][r]), f"row {r} alone differs from its place in the batch"
        assert torch.equal(L1.S_out[0], L.S_out[r]) and torch.equal(L1.W_out[0], L.W_out[r])
    S0, W0 = ins[0][0].clone(), ins[0][1].clone()
    for site in (fault_sites or L.sites):
        t0 = time.perf_counter()
        with pytest.raises(HandoffTimeout, match=f"'{site}'"):
            L.run(x_in, *ins[0], inject_fault=site, peer=peer)
        assert time.perf_counter() - t0 < 3.0
        assert torch.equal(ins[0][0], S0) and torch.equal(ins[0][1], W0)
    clean = L.run(x_in, *ins[0], peer=peer, commit=False)
    assert torch.equal(clean, outs[0])


class _Partial(dict):
    """A mapping that holds the layer's (dequantized) tensors and falls back to the random ones."""

    def __init__(self, have, base):
        super().__init__(have)
        self.base = base

    def __missing__(self, k):
        return self.base[k]

    def __iter__(self):
        return iter(self.base)

    def __contains__(self, k):
        return k in self.base


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("tp", [1, 8], ids=["tp1", "tp8"])
@pytest.mark.parametrize("width", [1, 8], ids=["w1", "w8"])
def test_gpu_dense(tp, width, fmt):
    gpu_layer_check(DenseLaunch, DENSE_LAYER, tp, width, fmt)


def test_stall_report_names_the_missing_producers(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    """launches/diagnose.py after a stalled launch: a box site lists every producer that never published
    (here all of them: the injected fault skips the site's publishes) and their CTAs' progress; a
    cross-rank mailbox site lists the missing source ranks and the tasks that write them."""
    from glm53_flash.launches.diagnose import box_summary, explain
    X, caches = make_step(tiny_cfg, tiny_ref, DENSE_LAYER, 1, gen)
    S, W = rank_state(tiny_cfg, caches, DENSE_LAYER)
    L = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, width=1)
    L.run(X, S, W, commit=False)
    assert "recorded no stall" in explain(L)
    with pytest.raises(HandoffTimeout):
        L.run(X, S, W, inject_fault="dense.hp2", commit=False)
    n = sum("hp2" in t.writes for t in L.schedule.tasks)
    text = explain(L)
    assert "timed out at 'dense.hp2'" in text and f"{n} of {n} producers missing" in text
    assert " NO task#" in text and " ok task#" in text and f"hp2:0/{n}" in box_summary(L, L.record().wanted)
    S2, W2 = rank_state(tiny_cfg, caches, DENSE_LAYER, 0, 2)
    L2 = DenseLaunch(tiny_cfg, tiny_weights, DENSE_LAYER, tp_rank=0, tp_size=2, width=1)
    with pytest.raises(HandoffTimeout, match="'dense.xd'"):
        L2.run(X, S2, W2, inject_fault="dense.xd", commit=False)
    text = explain(L2)
    assert "mailbox xd: source rank 0" in text and "mailbox xd: source rank 1" in text
    assert "writer task#" in text and "peer_d" in text
