"""ModelRunner (glm53_flash/model_runner.py) on the tiny preset under the interpreter, eager: batched decode
over slots against the reference, batch invariance (a row alone vs in a batch: the same bits), every bad
input refused with the caches untouched, a fault mid-step rolled back and the next step clean, the
fallback path wider than the widest build, release and a new prefill."""
import pytest
import torch

from glm53_flash.model_runner import ModelRunner
from sync import HandoffTimeout


def rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def snapshot(r):
    return {k: v.clone() for k, v in r.caches.tensors().items()}


def same_caches(r, snap) -> bool:
    return all(torch.equal(v, snap[k]) for k, v in r.caches.tensors().items())


@pytest.fixture
def runner(one_thread):
    r = ModelRunner.from_preset("tiny", device="cpu", max_slots=4, max_len=64, widths=(1, 2), progress=False,
                                log=lambda *_: None)
    r.prefill(0, [3, 17, 42])
    r.prefill(2, [5, 6])
    return r


def ids(*v, dtype=torch.int64):
    return torch.tensor(v, dtype=dtype)


def test_decode_matches_reference_and_rows_are_batch_invariant(runner):
    r = runner
    snap = r.caches.clone()
    pos = ids(r.length(0), r.length(2))
    toks = ids(7, 9)
    out = r.decode(toks, pos, ids(0, 2, dtype=torch.int32))
    assert out.shape == (2, r.cfg.vocab_size) and out.dtype == torch.float32 and torch.isfinite(out).all()
    want = r.ref.decode_step(snap.clone(), toks, pos, ids(0, 2)).logits
    assert rel(out, want) < 2e-2, rel(out, want)
    assert r.length(0) == int(pos[0]) + 1 and r.length(2) == int(pos[1]) + 1
    # the same rows one at a time (width 1 builds) from the caches before the step: the same bits
    after = r.caches
    r.caches = snap.clone()
    a = r.decode(toks[:1], pos[:1], ids(0, dtype=torch.int32))
    b = r.decode(toks[1:], pos[1:], ids(2, dtype=torch.int32))
    assert torch.equal(a[0], out[0]) and torch.equal(b[0], out[1])
    assert all(torch.equal(x, y) for x, y in zip(r.caches.tensors().values(), after.tensors().values()))
    r.caches = after


def test_bad_inputs_leave_caches_untouched(runner):
    r = runner
    snap = snapshot(r)
    s2 = ids(0, 2, dtype=torch.int32)
    cases = [
        ((ids(7, 9), ids(3, 2), ids(0, 2)), "slots: dtype int64, expected int32"),
        ((ids(7, 9, dtype=torch.int32), ids(3, 2), s2), "input_ids: dtype int32, expected int64"),
        ((ids(7, r.cfg.vocab_size), ids(3, 2), s2), "outside \\[0, vocab_size"),
        ((ids(7, -1), ids(3, 2), s2), "outside \\[0, vocab_size"),
        ((ids(7, 9), ids(3, -1), s2), "negative"),
        ((ids(7, 9), ids(3, 64), s2), ">= max_len"),
        ((ids(7, 9), ids(4, 2), s2), "next position is 3"),
        ((ids(7, 9), ids(3, 2), ids(0, 1, dtype=torch.int32)), "slot 1 is not active"),
        ((ids(7, 9), ids(3, 2), ids(0, 7, dtype=torch.int32)), "outside \\[0, max_slots"),
        ((ids(7, 9), ids(3, 3), ids(0, 0, dtype=torch.int32)), "appears twice"),
        ((ids(), ids(), ids(dtype=torch.int32)), "empty batch"),
        ((ids(7, 9), ids(3), s2), "positions: shape"),
        ((ids(7, 9).reshape(2, 1), ids(3, 2), s2), "input_ids: shape"),
        (([7, 9], ids(3, 2), s2), "a torch.Tensor"),
    ]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            r.decode(*args)
        assert same_caches(r, snap), msg
    with pytest.raises(ValueError, match="no wait site"):
        r.decode(ids(7, 9), ids(3, 2), s2, inject_fault="kda:kda.nope")
    with pytest.raises(ValueError, match="is active"):
        r.prefill(0, [1, 2])
    with pytest.raises(ValueError, match="outside \\[0, vocab_size"):
        r.prefill(1, [1, r.cfg.vocab_size])
    assert same_caches(r, snap)


def test_fault_mid_step_rolls_back_and_the_next_step_is_clean(runner):
    r = runner
    args = (ids(7, 9), ids(3, 2), ids(0, 2, dtype=torch.int32))
    snap = snapshot(r)
    clean = r.caches.clone()
    for spec in ("kda:kda.xe", "tail:0"):     # kda: its first launch follows the first sparse one, whose rows roll back
        with pytest.raises(HandoffTimeout) as ei:
            r.decode(*args, inject_fault=spec)
        assert "every slot's caches are as before the step" in "".join(getattr(ei.value, "__notes__", []))
        assert same_caches(r, snap), spec
    out = r.decode(*args)
    r2_caches, r.caches = r.caches, clean
    want = r.decode(*args)                                   # the same step, never faulted
    assert torch.equal(out, want)
    assert all(torch.equal(x, y) for x, y in zip(r.caches.tensors().values(), r2_caches.tensors().values()))


def test_fallback_wider_than_the_builds_release_and_prefill(runner):
    r = runner
    r.prefill(1, [8])
    snap = r.caches.clone()
    s3 = ids(0, 1, 2, dtype=torch.int32)
    pos = ids(3, 1, 2)
    out = r.decode(ids(7, 8, 9), pos, s3)                    # 3 rows > widths (1, 2): the reference's step
    want = r.ref.decode_step(snap, ids(7, 8, 9), pos, ids(0, 1, 2)).logits
    assert torch.equal(out, want)
    r.release(1)
    assert r.length(1) == 0 and not r.caches.kda_state[1].any()
    with pytest.raises(ValueError, match="not active"):
        r.decode(ids(4), ids(2), ids(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="not active"):
        r.release(1)
    r.prefill(1, [4, 4])
    assert r.length(1) == 2


def test_step_programs_match_the_eager_path(one_thread):
    """graph_programs=True (the step programs the CUDA graphs capture, run uncaptured on the CPU): the same
    logits and caches, bit for bit, as the plain eager path, for a 2-row step on the width-2 builds and a
    1-row step; a fault (eager path) between them changes nothing."""
    rs = [ModelRunner.from_preset("tiny", device="cpu", max_slots=2, max_len=32, widths=(1, 2), progress=False,
                                  log=lambda *_: None, graph_programs=g) for g in (False, True)]
    assert not rs[0].programs and sorted(rs[1].programs) == [1, 2]
    outs = []
    for r in rs:
        r.prefill(0, [3, 17])
        r.prefill(1, [5])
        o = [r.decode(ids(7, 9), ids(2, 1), ids(1, 0, dtype=torch.int32)[[1, 0]])]
        with pytest.raises(HandoffTimeout):
            r.decode(ids(4), ids(3), ids(0, dtype=torch.int32), inject_fault="tail:0")
        o.append(r.decode(ids(4), ids(3), ids(0, dtype=torch.int32)))
        outs.append((o, snapshot(r)))
    (a, ca), (b, cb) = outs
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(ca[k], cb[k]) for k in ca)
    # a fault inside a program step (its first kda launch skips a publish): the gathered records name it and the
    # step rolls back (the DSA rows it wrote put back, nothing committed)
    r = rs[1]
    prog = r.programs[1]
    k = next(i for i, L in enumerate(prog.launches) if L.kind == "kda")
    snap = snapshot(r)
    dev_args = (ids(4), ids(r.length(0)), ids(0))
    with pytest.raises(HandoffTimeout, match="kda.xe"):
        prog.step(*dev_args, fault=(k, prog.launches[k].fault_id("kda.xe")))
    assert same_caches(r, snap)


def test_widths_share_one_copy_of_the_weights(one_thread):
    """Every layer's builds for the widths point at the same weight tensors (share_weights), which are the
    weights the build would have loaded itself (bitwise), and the tails share the lm_head; a build of
    another layer is refused."""
    from glm53_flash.launches.kda import KdaLaunch
    from glm53_flash.weights import RandomWeights
    r = ModelRunner.from_preset("tiny", device="cpu", max_slots=2, max_len=32, widths=(1, 2), progress=False,
                                log=lambda *_: None)
    for li, L1 in r.builds[1]["layers"].items():
        L2 = r.builds[2]["layers"][li]
        assert L1.weight_names and L1.weight_names == L2.weight_names
        assert all(getattr(L1, n) is getattr(L2, n) for n in L1.weight_names)
    assert r.builds[1]["tail"].W.data_ptr() == r.builds[2]["tail"].W.data_ptr()
    li, lj = [p.index for p in r.cfg.layers if p.launch == "kda"][:2]
    own = KdaLaunch(r.cfg, RandomWeights(r.cfg, seed=0, cache=True), li, width=2, device="cpu")
    shared = r.builds[2]["layers"][li]
    assert all(torch.equal(getattr(own, n), getattr(shared, n)) for n in own.weight_names)
    with pytest.raises(ValueError, match="same kind, layer"):
        own.share_weights(r.builds[1]["layers"][lj])


def test_without_reference_prefill_runs_as_decode_steps(one_thread):
    """reference=False (the real-shape mode: no fp32 reference beside the launches): prefill teacher-forces the
    prompt through decode steps of its row, close to the reference's prefill of the same weights; a batch wider
    than the widest build is refused (no fallback path); a built RankSource (device-made weights, duck-typed
    checkpoint) drives the same launches."""
    from glm53_flash.config import preset
    from glm53_flash.device_weights import RankSource
    from glm53_flash.weights import RandomWeights
    cfg = preset("tiny")
    src = RandomWeights(cfg, seed=0, cache=True)
    kw = dict(device="cpu", max_slots=2, max_len=32, widths=(1,), progress=False, log=lambda *_: None)
    with_ref = ModelRunner(cfg, src, **kw)
    no_ref = ModelRunner(cfg, src, reference=False, **kw)
    assert no_ref.ref is None
    a, b = with_ref.prefill(0, [3, 17]), no_ref.prefill(0, [3, 17])
    assert rel(b, a) < 2e-2 and no_ref.length(0) == 2
    with pytest.raises(ValueError, match="no reference model"):
        no_ref.prefill(1, [5])
        no_ref.decode(ids(1, 2), ids(2, 1), ids(0, 1, dtype=torch.int32))
    rs = ModelRunner(cfg, RankSource(cfg, 0, 1, "bf16", "cpu"), reference=False, **kw)
    assert torch.isfinite(rs.prefill(1, [4])).all() and rs.length(1) == 1


def test_tp2_loopback_group_checked_committed_and_rolled_back(one_thread):
    """tp_size=2: every rank in loopback on one device. One decode step under the MONO_CHECK hooks (every rank's
    launch: error record, canaries, tags, X' / state / window against the reference's layer step, every rank's X'
    the same bits as rank 0's), the committed caches against the reference's own step (a rank's state slice put
    back in the wrong heads fails here), then a fault in a later step leaves every cache as it was."""
    from check import MonoCheck, hook
    r = ModelRunner.from_preset("tiny", device="cpu", tp_size=2, max_slots=1, max_len=64, widths=(1,),
                                reference=True, progress=False, log=lambda *_: None)
    assert len(r.builds[1]["ranks"][0]) == 2 and [L.tp_rank for L in r.builds[1]["tails"]] == [0, 1]
    first = int(torch.argmax(r.prefill(0, [3, 17, 42])))
    ref_caches = r.caches.clone()
    ref_logits = r.ref.decode_step(ref_caches, ids(first), ids(3), ids(0)).logits.float()
    checker = MonoCheck()
    r.hooks.append(hook(checker))
    logits = r.decode(ids(first), ids(3), ids(0, dtype=torch.int32))
    assert not checker.violations, checker.violations
    assert checker.checks > 100
    assert any(m.launch == "tail" and m.output == "logits" for m in checker.metrics)
    assert rel(logits, ref_logits) <= 1e-2
    for name in ("kda_state", "conv_window", "latent", "pool_keys", "tail_rows"):
        got, want = getattr(r.caches, name).float(), getattr(ref_caches, name).float()
        assert rel(got, want) <= 1e-2, name
    assert int(r.caches.lengths[0]) == 4
    r.hooks.clear()
    snap = snapshot(r)
    nxt = int(torch.argmax(logits[0]))
    with pytest.raises(HandoffTimeout, match="kda"):
        r.decode(ids(nxt), ids(4), ids(0, dtype=torch.int32), inject_fault="kda:2")
    assert same_caches(r, snap)


def test_tp_loopback_refusals():
    with pytest.raises(ValueError, match="tp_rank"):
        ModelRunner.from_preset("tiny", device="cpu", tp_size=2, tp_rank=1, progress=False)
    with pytest.raises(ValueError, match="eagerly"):
        ModelRunner.from_preset("tiny", device="cpu", tp_size=2, graph_programs=True, progress=False)
    with pytest.raises(ValueError, match="tp_size"):
        ModelRunner.from_preset("tiny", device="cpu", tp_size=3, progress=False)


@pytest.mark.gpu
def test_gpu_step_graphs_match_eager_bitwise():
    """On the GPU: the captured step graph of every batch size B = 1 .. 8 (on the smallest width >= B of 1/2/4/8,
    two steps each, slots in two orders) gives the eager launches' logits and slot caches bit for bit (two
    runners of the same seed)."""
    kw = dict(device="cuda", max_slots=8, max_len=48, widths=(1, 2, 4, 8), progress=False, log=lambda *_: None)
    eager, graphs = (ModelRunner.from_preset("tiny", eager=e, **kw) for e in (True, False))
    assert not eager.programs and sorted(graphs.programs) == list(range(1, 9))
    for r in (eager, graphs):
        for s in range(8):
            r.prefill(s, [(3 + 5 * s + t) % r.cfg.vocab_size for t in range(2 + s % 3)])
    for B in range(1, 9):
        for step in range(2):
            sl = torch.arange(B, dtype=torch.int32).flip(0) if step else torch.arange(B, dtype=torch.int32)
            tok = torch.tensor([(11 + 7 * int(s) + step) % eager.cfg.vocab_size for s in sl], dtype=torch.int64)
            outs = []
            for r in (eager, graphs):
                pos = torch.tensor([r.length(int(s)) for s in sl], dtype=torch.int64)
                outs.append(r.decode(tok, pos, sl).cpu())
            assert bool(torch.isfinite(outs[0]).all()) and torch.equal(outs[0], outs[1]), (B, step)
    a, b = snapshot(eager), snapshot(graphs)
    assert all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)
