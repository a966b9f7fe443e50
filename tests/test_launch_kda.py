"""The `kda` launch (KDA mixer + MoE: router, expert slots, shared expert, down) against the
reference's `layer_step` on the tiny preset (8 experts, top-2), interpreter, stage by stage: X', the
KDA state and conv window, the in-launch routing record against the reference router on the launch's
own gate row, NaN-poisoned scratch, fault injection at every wait site, simulated TP2, FP8 experts from
a checkpoint; GPU checks at real shapes (16 experts) under the `gpu` marker.
Shared helpers: tests/test_launch_dense.py."""
import pytest
import torch

from glm53_flash.launches import build_launch, sites
from glm53_flash.launches.kda import KdaLaunch
from glm53_flash.launches.layer_host import DEFAULT_MAXNREG, new_xchg, run_tp
from glm53_flash.reference import ops
from glm53_flash.reference.model import ReferenceModel
from sync import HandoffTimeout
from sync.asm import SPIN_LINE_LOAD
from test_launch_dense import (TOL_BF16, check_step, check_tp2, fault_every_site, gpu_layer_check, make_step,
                               poison_scratch, rank_state, rel, tiny_ref)  # noqa: F401 (fixture)

KDA_LAYER = 4


def check_routing(L, rows):
    """The launch's routing record equals the reference router run on the launch's own gate row."""
    a = L.layout.view(L.scratch, "a_rows")[:rows].float()
    ids = L.layout.view(L.scratch, "ids_rec")[:rows]
    rw = L.layout.view(L.scratch, "rw_rec")[:rows]
    w_ref, idx_ref = ops.moe_route(a, L.W_r.cpu(), L.bias_r.cpu(), L.cfg)
    assert ids.long().tolist() == idx_ref.tolist()
    assert torch.allclose(rw, w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("width, rows", [(1, 1), (4, 3)], ids=["w1", "w4-rows3"])
def test_kda_vs_reference(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, width, rows):
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, rows, gen)
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
    L = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=width)
    poison_scratch(L)
    out = L.run(X, S, W)
    check_routing(L, rows)
    check_step(L, out, S, W, tiny_ref, caches, KDA_LAYER, X, TOL_BF16, label="bf16")
    assert bool(torch.isnan(L.X_out[rows:]).all()) and bool(torch.isnan(L.S_out[rows:]).all())


def test_kda_batch_and_grid_invariance(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    # routing included: a row's bits do not depend on the width, the other rows or the grid
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 2, gen)
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
    a = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=2).run(X, S2 := S.clone(), W2 := W.clone())
    S1, W1 = S[1:2].clone(), W[1:2].clone()
    c = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=1, grid=3).run(X[1:2].clone(), S1, W1)
    assert torch.equal(c[0], a[1]) and torch.equal(S1[0], S2[1]) and torch.equal(W1[0], W2[1])


def test_kda_experts_read_once_for_rows_sharing_them(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    """The experts stage's items are (distinct expert, tile, K slice): rows 0 and 2 given the same input pick the
    same experts, so each of those items serves both rows (MMA columns 0 and 2). Both rows' bits are the same,
    equal to row 2 run alone, the other rows' equal to theirs alone, every expert plane entry of the rows written
    (NaN-poisoned scratch), and the launch matches the reference."""
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 3, gen)
    k = tiny_cfg.kda_layers.index(KDA_LAYER)
    X[2] = X[0]
    caches.kda_state[2, k] = caches.kda_state[0, k]
    caches.conv_window[2, k] = caches.conv_window[0, k]
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
    L = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=4)
    poison_scratch(L)
    out = L.run(X, S2 := S.clone(), W2 := W.clone())
    ids = L.layout.view(L.scratch, "ids_rec")[:3]
    assert torch.equal(ids[0], ids[2]) and len(set(ids.flatten().tolist())) < ids.numel()
    assert torch.equal(out[0], out[2]) and torch.equal(S2[0], S2[2])
    for r in (1, 2):
        S1, W1 = S[r:r + 1].clone(), W[r:r + 1].clone()
        alone = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=1).run(X[r:r + 1].clone(), S1, W1)
        assert torch.equal(alone[0], out[r]) and torch.equal(S1[0], S2[r]), f"row {r} differs from its run alone"
    check_step(L, out, S2, W2, tiny_ref, caches, KDA_LAYER, X, TOL_BF16, label="shared-experts")


def test_expert_slots_follow_the_width():
    """expert_slots at the real shapes (TP8, 288 experts, top-8): one slot an item at 1 row, as the per-choice
    slots were; 8 rows take one wave of the nominal grid, every slot at most ceil(64 experts' items / slots)."""
    from glm53_flash.config import preset
    from glm53_flash.schedule import NOMINAL_GRID
    cfg = preset("glm53-flash")
    for width in (1, 2, 8):
        L = KdaLaunch.__new__(KdaLaunch)
        L.width, L.KE, L.E, L.block_n, L.e_bn = width, cfg.num_experts_per_tok, cfg.n_routed_experts, 64, 64
        L.I_E, L.ks_e = cfg.moe_intermediate_size // 8, 8
        items = (L.I_E // 64) * 8
        slots, per = L.expert_slots()
        most = min(width * L.KE, L.E) * items
        assert slots <= most and slots * per >= most and (per - 1) * slots < most
        assert slots == (L.KE * items if width == 1 else max(L.KE * items, NOMINAL_GRID))


def test_kda_trace_every_task_same_bits(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    """A traced launch (TRACE build) gives the same bits and a (start, end) row for every task and CTA;
    the report names every stage and walks a critical path that ends at the last task."""
    from glm53_flash.launches.trace import critical_path, read, report
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 2, gen)
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
    L = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=2)
    plain = L.run(X, S.clone(), W.clone(), commit=False)
    with pytest.raises(RuntimeError, match="not tracing"):
        read(L)
    L.enable_trace()
    traced = L.run(X, S.clone(), W.clone(), commit=False)
    assert torch.equal(plain, traced)
    tb = L.trace_buf
    assert bool((tb[:, :4] >= 0).all()) and bool((tb[:, 0] <= tb[:, 1]).all()) and bool((tb[:, 4:7] >= -1).all())
    times, ctas = read(L)
    assert sorted(t.task for t in times) == list(range(len(L.schedule.tasks))) and len(ctas) == L.grid
    text = report(L)
    assert all(n in text for n in L.schedule.stage_names) and "critical path" in text
    path = critical_path(L, times)
    assert path[-1][0].end == max(t.end for t in times) and path[0][1] == "first"
    L.enable_trace(False)
    assert torch.equal(L.run(X, S.clone(), W.clone(), commit=False), plain)


def test_kda_fault_every_site_then_clean(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 1, gen)
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
    L = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=1)
    want = [f"kda.{s}" for s in ("hp1", "a_in", "yin", "o", "cf1", "hp2", "a", "rl", "hg", "sel", "xe", "h", "cf2")]
    assert sites("kda", head_dim=64) == want
    fault_every_site(L, X, S, W, want, clean_after=("kda.hp1", "kda.rl", "kda.xe"))


def test_kda_oproj_k_slices(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, monkeypatch):
    """o_proj in K slices joined by the o_sum tasks' rank sum (layer_host.py _oproj_split; 4 at the real TP1
    shapes), pinned at 2 on the tiny shapes with the MoE FFN: the reference, the unsplit launch up to rounding,
    the xo site faulted (state untouched) and a clean launch after."""
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 2, gen)
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
    base = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=2).run(X, S.clone(), W.clone(), commit=False)
    monkeypatch.setattr(KdaLaunch, "oproj_split", 2)
    L = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=2)
    assert L.ks_o == 2 and list(L.sites) == KdaLaunch.site_names(1, down_groups=L.kg, oproj_split=2)
    poison_scratch(L)
    S0, W0 = S.clone(), W.clone()
    with pytest.raises(HandoffTimeout, match="wait site 'kda.xo'"):
        L.run(X, S, W, inject_fault="kda.xo")
    assert torch.equal(S, S0) and torch.equal(W, W0)
    out = L.run(X, S, W)
    assert rel(out, base) < 1e-5
    check_step(L, out, S, W, tiny_ref, caches, KDA_LAYER, X, TOL_BF16, label="oproj-k-slices")


def test_kda_router_wide_chunks(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, monkeypatch):
    """router_ck 64 (the router tiles' least width), with 2 router K ranges: two register tiles of at least 64
    columns a range; the routing record equals the reference router on the launch's own gate row, and the layer
    matches the reference (NaN-poisoned scratch)."""
    import glm53_flash.launches.kda as kda_mod
    monkeypatch.setattr(KdaLaunch, "router_ck", 64)
    monkeypatch.setattr(kda_mod, "ROUTER_PARTS", 2)
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 2, gen)
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
    L = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=2)
    assert L.r_split % 64 == 0 and L.r_split > 64 and L.nrpart == -(-L.H // L.r_split)
    assert L.router_ck >= 64 and 2 * L.router_ck >= L.r_split
    poison_scratch(L)
    out = L.run(X, S, W)
    check_routing(L, 2)
    check_step(L, out, S, W, tiny_ref, caches, KDA_LAYER, X, TOL_BF16, label="router-ck64")


def test_kda_route_many_experts(gen, one_thread):
    """160 experts, top 8 (the tiny preset otherwise: E_PAD 256, several warps' worth of keys in the route's
    picks): the record equals the reference router on the launch's own gate row and the layer matches the
    reference (NaN-poisoned scratch)."""
    from glm53_flash.config import preset
    from glm53_flash.weights import RandomWeights
    cfg = preset("tiny").replace(n_routed_experts=160, num_experts_per_tok=8)
    weights = RandomWeights(cfg, seed=3)
    ref = ReferenceModel(cfg, weights)
    X, caches = make_step(cfg, ref, KDA_LAYER, 2, gen)
    S, W = rank_state(cfg, caches, KDA_LAYER)
    L = KdaLaunch(cfg, weights, KDA_LAYER, width=2)
    poison_scratch(L)
    out = L.run(X, S, W)
    check_routing(L, 2)
    check_step(L, out, S, W, ref, caches, KDA_LAYER, X, TOL_BF16, label="e160")


def test_kda_tp2_simulated(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 2, gen)
    xchg = new_xchg(tiny_cfg, 2, 2, "cpu")
    Ls = [KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, tp_rank=r, tp_size=2, width=2, xchg=xchg) for r in range(2)]
    assert Ls[0].I_E == tiny_cfg.moe_intermediate_size // 2
    check_tp2(Ls, X, tiny_ref, caches, KDA_LAYER, "tp2")


def test_kda_tp2_moe_down_row_groups_same_bits(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, monkeypatch):
    """moe_down splits its rows over tasks (launches/kda.py _moe_down_tasks, layer_host.rows_per_task): a task a
    row of a width-4 launch running 3 rows (the last task's row is past the rows) gives the same bits as one task
    taking every row, on every rank, and every row is walked (the reference check)."""
    from glm53_flash.launches import layer_host
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 3, gen)
    fresh = [(X, *rank_state(tiny_cfg, caches, KDA_LAYER, r, 2)) for r in range(2)]
    outs, states = {}, {}
    for nominal in (1024, 1):
        ins = states[nominal] = [(x, s.clone(), w.clone()) for x, s, w in fresh]     # a run commits its state
        monkeypatch.setattr(layer_host, "NOMINAL_GRID", nominal)
        xchg = new_xchg(tiny_cfg, 2, 4, "cpu")
        Ls = [KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, tp_rank=r, tp_size=2, width=4, xchg=xchg) for r in range(2)]
        groups = sorted({t.args[4] for t in Ls[0].schedule.tasks if t.family == "moe_down"})
        assert groups == ([(0 << 8) | 1, (1 << 8) | 1, (2 << 8) | 1, (3 << 8) | 1] if nominal == 1024 else [0]), groups
        outs[nominal] = run_tp(Ls, ins)
    for r in range(2):
        assert torch.equal(outs[1024][r], outs[1][r])
        assert torch.equal(states[1024][r][1], states[1][r][1]) and torch.equal(states[1024][r][2], states[1][r][2])
        check_step(Ls[r], outs[1][r], states[1][r][1], states[1][r][2], tiny_ref, caches, KDA_LAYER, X, TOL_BF16,
                   tp=2, rank=r, label="moe_down row groups")


def test_kda_act_fold(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, monkeypatch):
    """act_fold (launches/kda.py act_fold_width): at widths up to 2 moe_down joins its expert group's routed
    activations itself and there is no act stage for them. Pinned on (grouped, 3 groups) and off at the same
    width: bitwise the same output, state and window (the join is the same code in the same order); the
    reference; every wait site faulted, then a clean launch."""
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 2, gen)
    monkeypatch.setattr(KdaLaunch, "down_groups", tiny_cfg.num_experts_per_tok + 1)
    outs = {}
    for width in (0, 2):
        monkeypatch.setattr(KdaLaunch, "act_fold_width", width)
        L = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=2)
        assert L.act_fold == (width == 2) and ("act" in L.schedule.stage_names) == (width == 0)
        S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
        poison_scratch(L)
        outs[width] = (L.run(X, S, W), S, W)
        check_step(L, outs[width][0], S, W, tiny_ref, caches, KDA_LAYER, X, TOL_BF16, label=f"fold-width{width}")
    for a, b in zip(outs[0], outs[2]):
        assert torch.equal(a, b)
    fault_every_site(L, X, *rank_state(tiny_cfg, caches, KDA_LAYER), list(L.sites), clean_after=("kda.xe",))


def test_kda_grouped_moe_down(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, monkeypatch):
    """moe_down in expert groups (the real shapes' choice, schedule.py choose_groups: 3 at TP1 and TP8) joined
    by down_join: the reference at TP1 (2 of 4 rows) and in simulated TP2, its wait site `dp` faulted and
    clean again, and the same result as the ungrouped launch up to rounding (the sum order differs)."""
    X, caches = make_step(tiny_cfg, tiny_ref, KDA_LAYER, 2, gen)
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER)
    ungrouped = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=4).run(X, S.clone(), W.clone(), commit=False)
    monkeypatch.setattr(KdaLaunch, "down_groups", tiny_cfg.num_experts_per_tok + 1)
    L = KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, width=4)
    assert L.kg == 3 and "down_join" in L.schedule.stage_names
    assert list(L.sites)[-3:] == ["kda.h", "kda.dp", "kda.cf2"]
    assert list(L.sites) == KdaLaunch.site_names(1, down_groups=3)
    poison_scratch(L)
    out = L.run(X, S.clone(), W.clone(), commit=False)
    assert rel(out, ungrouped) < 1e-5
    check_step(L, L.run(X, S, W), S, W, tiny_ref, caches, KDA_LAYER, X, TOL_BF16, label="grouped")
    fault_every_site(L, X, *rank_state(tiny_cfg, caches, KDA_LAYER), KdaLaunch.site_names(1, down_groups=3),
                     clean_after=("kda.dp",))
    xchg = new_xchg(tiny_cfg, 2, 2, "cpu")
    Ls = [KdaLaunch(tiny_cfg, tiny_weights, KDA_LAYER, tp_rank=r, tp_size=2, width=2, xchg=xchg) for r in range(2)]
    assert [s.split(".")[1] for s in Ls[0].sites][-4:] == ["h", "dp", "cf2", "xd"]
    check_tp2(Ls, X, tiny_ref, caches, KDA_LAYER, "tp2-grouped")


def test_kda_fp8_checkpoint(tiny_cfg, tmp_path, gen, one_thread):
    from glm53_flash.checkpoint import load_checkpoint, make_random_checkpoint
    make_random_checkpoint(tiny_cfg, tmp_path / "ck", seed=5, weights="fp8")
    ck = load_checkpoint(tmp_path / "ck", progress=False)
    ref = ReferenceModel(tiny_cfg, ck.dequantized())
    X, caches = make_step(tiny_cfg, ref, KDA_LAYER + 1, 2, gen)
    S, W = rank_state(tiny_cfg, caches, KDA_LAYER + 1)
    L = build_launch("kda", ck, width=2, layer=KDA_LAYER + 1)
    assert L.w_gu.dtype == torch.float8_e4m3fn and L.W_g.dtype == torch.float8_e4m3fn
    out = L.run(X, S, W)
    check_routing(L, 2)
    check_step(L, out, S, W, ref, caches, KDA_LAYER + 1, X, TOL_BF16, label="fp8")


def test_kda_rejects_other_layers(tiny_cfg, tiny_weights):
    with pytest.raises(ValueError, match="layer 1 is a 'dense' launch"):
        KdaLaunch(tiny_cfg, tiny_weights, 1)
    with pytest.raises(ValueError, match="layer 3 is a 'sparse' launch"):
        KdaLaunch(tiny_cfg, tiny_weights, 3)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("tp", [1, 8], ids=["tp1", "tp8"])
@pytest.mark.parametrize("width", [1, 8], ids=["w1", "w8"])
def test_gpu_kda(tp, width, fmt):
    gpu_layer_check(KdaLaunch, KDA_LAYER, tp, width, fmt)


# ---------------------------------------------------------------------------- offline sm_90 compile
SPIN_LOAD = SPIN_LINE_LOAD                          # the box spin's line loads (sync.asm line_loads_ptx)


def real_consts(tp=1, moe=False, embed=False, fp8=False, warps=4, maxnreg=DEFAULT_MAXNREG):
    """A real-shape build of the layer kernel (glm53_flash/build_report.py layer_spec) at the launch's ptxas cap."""
    kind = "kda" if moe else "embed" if embed else "dense"
    return dict(name=f"{kind}-tp{tp}-{'fp8' if fp8 else 'bf16'}-w{warps}", kind=kind, tp=tp, fp8=fp8, warps=warps,
                maxnreg=maxnreg)


def compile_sm90(variants):
    """sm_90 registers / spills (local-store bytes summed over the kernel and its noinline functions) / shared
    memory of each variant, and whether its spin loops survived (the spin's vector line loads in the PTX)."""
    from glm53_flash.build_report import layer_spec
    from glm53_flash.sm90_regs import kernel_registers, ptxas_available
    if not ptxas_available():
        pytest.skip("Triton's bundled ptxas is missing")
    specs = [layer_spec(v["kind"], v["tp"], v["fp8"], v["warps"], v["maxnreg"]) + [[SPIN_LOAD]] for v in variants]
    stats = kernel_registers(specs, timeout=900)
    for v, st in zip(variants, stats):
        st.update(name=v["name"], spin_ok=st["ptx_counts"][SPIN_LOAD] > 0)
        print(f"{st['name']}: {st['regs']} registers, {st['spill']} B spilled, {st['shared']} B shared")
    return stats


def test_sm90_compile_kda_tp8():
    """The whole kernel (every family, MoE included) compiles for sm_90 with its spin loops intact, and at the
    launch's cap (layer_host.maxnreg_for: 255 at two CTAs per SM) nothing spills: a spilled register's reload
    after a wait's fence is an L2 round trip on the task's path (launches/kda_layer.py "Registers")."""
    (s,) = compile_sm90([real_consts(tp=8, moe=True)])
    assert s["spin_ok"] and s["regs"] <= DEFAULT_MAXNREG and s["spill"] == 0
    # One compiled copy of the code every task shares, and of each warmed body (ffn.WARM_CODE: the dry run and the
    # real call must run the same code): a constexpr argument to a noinline function makes one copy per value, and
    # every copy is code the SM's instruction cache holds beside the others (H200: ~6 cycles an instruction cold).
    fns = s["functions"]
    for name in ("_wait_box", "_wait_box2", "_signal_at", "gate_task", "gate_row", "coef_task", "_kda_body",
                 "_kda_norm_body", "_route_record", "post_partials", "peer_task"):
        assert fns.get(name, [0])[0] == 1, (name, fns.get(name))
    assert s["code_instructions"] < 16000, s["code_instructions"]     # 20152 before the copies were removed
    # and the warmed bodies are called twice through that copy (the dry run and the real call): a call inlined into
    # its caller (a second specialisation) leaves one symbol but warms code the real call does not run
    calls = s["calls"]
    for name in ("gate_row", "_kda_body", "_kda_norm_body", "_route_record", "post_partials"):
        assert calls.get(name, 0) >= 2, (name, calls.get(name))
    assert calls.get("_wait_box", 0) >= 10 and calls.get("_signal_at", 0) >= 10      # one copy, called from the families


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").environ.get("GLM53_COMPILE_MATRIX"), reason="~6 min: GLM53_COMPILE_MATRIX=1")
def test_sm90_compile_matrix():
    """Every kind x format at TP1 / TP8, 4 and 8 warps: compiles; registers and spills printed."""
    vs = [real_consts(tp=tp, moe=moe, embed=embed, fp8=fp8, warps=w) for moe, embed in ((False, False), (False, True),
          (True, False)) for tp in (1, 8) for fp8 in (False, True) for w in (4, 8)]
    for s in compile_sm90(vs):
        assert s["spin_ok"] and s["regs"] <= 255
