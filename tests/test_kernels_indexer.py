"""kpool indexer task family (glm53_flash/kernels/indexer.py) against the fp32 reference (reference/ops.py
layer_norm, indexer_pool, indexer_scores, indexer_select, topk_lower_index): the tail row and pooled key
of the pool task, pool scores (and their independence of the task split), the multi-task radix top-k
(exactly the reference's selection on the same scores, ties included; 32768 pools with many exact ties),
the score -> select chain compared as sets, tie-aware; NaN/sentinel-poisoned outputs (every word
written), bitwise determinism and batch invariance (row r alone == row r among 4).

CPU: tiny shapes (4 index heads x 64, 4 pools selected of up to 32) under TRITON_INTERPRET=1.
GPU (`gpu` marker): 32 heads x 128, positions 640, 8191, 65535 (P = 160, 2048, 16384 pools).
"""
import pytest
import torch

from glm53_flash.config import preset
from glm53_flash.kernels import indexer
from glm53_flash.reference import ops
from glm53_flash.weights import PREFIX, RandomWeights

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SENTINEL = -7                                   # indexer.select pre-fills out with it


def _rel(x, ref):
    return float((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def _same(a, b):
    """Bitwise equality of fp32 tensors, NaN poison included."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _ix_weights(cfg):
    W = RandomWeights(cfg, seed=0)
    p = f"{PREFIX}layers.{cfg.dsa_layers[0]}.self_attn.indexer."
    return (W[p + "k_norm.weight"].float(), W[p + "k_norm.bias"].float(),
            W[p + "index_kpool_compress_ape"].float())


def _pos(positions):
    return torch.tensor(positions, dtype=torch.int32, device=DEV)


def _expected(scores, positions, cfg):
    """The reference selection of every row, -1 padded to the index width."""
    out = torch.full((len(positions), cfg.index_width), -1, dtype=torch.int64)
    for r, pos in enumerate(positions):
        P = (pos + 1) // cfg.index_kpool
        sel = ops.indexer_select(scores[r, :P].cpu(), pos, cfg.index_topk_pools, cfg.index_kpool)
        out[r, :sel.numel()] = sel
    return out


def _tied_scores(rows, P, gen):
    """Scores with many exact ties (a few levels, ReLU-like zeros, some -0.0)."""
    s = (torch.randint(-30, 40, (rows, P), generator=gen).float() / 8).clamp(min=0)
    s[:, ::5] = -0.0
    return s


# ---------------------------------------------------------------------------- pool task
@pytest.mark.parametrize("positions", [[39], [11, 40, 130, 7]], ids=lambda p: f"rows{len(p)}")
def test_pool_task(positions, gen, one_thread):
    cfg = preset("tiny")
    D, KP = cfg.index_head_dim, cfg.index_kpool
    ln_w, ln_b, ape = _ix_weights(cfg)
    rows, Pmax = len(positions), 40
    kraw, graw = torch.randn(rows, D, generator=gen) * 3 + 1, torch.randn(rows, D, generator=gen)
    tail = torch.randn(rows, KP, 2 * D, generator=gen)
    pk = torch.full((rows, Pmax, D), float("nan"))
    tail_d, pk_d = tail.to(DEV), pk.to(DEV)
    indexer.pool_step(kraw.to(DEV), graw.to(DEV), ln_w.to(DEV), ln_b.to(DEV), ape.to(DEV), tail_d, pk_d,
                      _pos(positions))
    tail_d, pk_d = tail_d.cpu(), pk_d.cpu()
    for r, pos in enumerate(positions):
        row = torch.cat([ops.layer_norm(kraw[r], ln_w, ln_b), graw[r]])
        exp_tail = tail[r].clone()
        exp_tail[pos % KP] = row
        assert _rel(tail_d[r], exp_tail) <= 1e-6
        others = [j for j in range(KP) if j != pos % KP]
        assert torch.equal(tail_d[r, others], tail[r, others]), "another ring row was touched"
        done = (pos + 1) % KP == 0
        for p in range(Pmax):
            if done and p == pos // KP:
                ref = ops.indexer_pool(exp_tail[:, :D], exp_tail[:, D:], ape)
                err = _rel(pk_d[r, p], ref)
                print(f"pos {pos}: pooled key rel err {err:.1e}")
                assert err <= 1e-6
            else:
                assert torch.isnan(pk_d[r, p]).all(), f"pool {p} written at pos {pos}"


# ---------------------------------------------------------------------------- scores
def _score_inputs(cfg, positions, gen, pk_dtype=torch.float32, Pmax=40):
    rows, NH, D = len(positions), cfg.index_n_heads, cfg.index_head_dim
    return dict(iq=torch.randn(rows, NH, D, generator=gen), w=torch.randn(rows, NH, generator=gen),
                pk=torch.randn(rows, Pmax, D, generator=gen).to(pk_dtype))


def _scores(cfg, x, positions, **kw):
    return indexer.score_pools(x["iq"].to(DEV), x["w"].to(DEV), x["pk"].to(DEV), _pos(positions), cfg.index_kpool,
                               **kw).cpu()


@pytest.mark.parametrize("pk_dtype", [torch.float32, torch.bfloat16], ids=["pk32", "pk16"])
@pytest.mark.parametrize("positions", [[130], [10, 40, 130, 77]], ids=lambda p: f"rows{len(p)}")
def test_scores_match_reference(positions, pk_dtype, gen, one_thread):
    cfg = preset("tiny")
    x = _score_inputs(cfg, positions, gen, pk_dtype)
    s = _scores(cfg, x, positions, chunk=16, block_p=16)
    for r, pos in enumerate(positions):
        P = (pos + 1) // cfg.index_kpool
        ref = ops.indexer_scores(x["iq"][r], x["w"][r], x["pk"][r, :P].float())
        assert not torch.isnan(s[r, :P]).any(), "a score was not written"
        assert torch.isnan(s[r, P:]).all(), "a score past P was written"
        err = _rel(s[r, :P], ref)
        print(f"pos {pos}: scores rel err {err:.1e}")
        assert err <= (1e-6 if pk_dtype == torch.float32 else 1e-4)     # bf16 keys: iq split hi + lo
    # any split into BLOCK_P multiples gives the same bits
    assert _same(s, _scores(cfg, x, positions, chunk=32, block_p=16))


# ---------------------------------------------------------------------------- selection
@pytest.mark.parametrize("bits", [8, 11], ids=lambda b: f"bits{b}")
@pytest.mark.parametrize("chunk", [8, 64], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("positions", [[130], [10, 40, 130, 2]], ids=lambda p: f"rows{len(p)}")
def test_select_equals_reference(positions, chunk, bits, gen, one_thread):
    # same scores -> exactly the reference's selection, in its order, ties toward the lower pool
    cfg = preset("tiny")
    s = _tied_scores(len(positions), 40, gen)
    out = indexer.select(s.to(DEV), _pos(positions), cfg, chunk=chunk, bits=bits, block=8).cpu()
    assert not (out == SENTINEL).any(), "an output word was not written"
    assert torch.equal(out.long(), _expected(s, positions, cfg))


def test_write_dry_run_stores_nothing(gen, one_thread):
    # the launch's select task runs the write once before its wait with live = 0 (ffn.WARM_CODE), on whatever
    # the histograms and join states hold: garbage whose ranks point anywhere must store nothing
    cfg = preset("tiny")
    positions = [130, 61]
    rows, t_max, bits = len(positions), 8, 8
    s = _tied_scores(rows, 40, gen).to(DEV)
    g = torch.Generator().manual_seed(5)
    hist = torch.randint(0, 1 << 20, (rows, 4, t_max, 1 << bits), generator=g).int().to(DEV)      # counts far
    # past the pools (int32 sums stay in range: the interpreter rejects overflow)
    state = torch.randint(-(1 << 20), 1 << 20, (rows, 4, t_max + 2), generator=g).int().to(DEV)
    out = indexer.select(s, _pos(positions), cfg, chunk=8, bits=bits, block=8, t_max=t_max, state_in=(hist, state))
    assert (out == SENTINEL).all(), "a dry write stored a word"


def test_select_32768_pools_with_ties(gen, one_thread):
    # the real width: 512 of 32768 pools (position 131071), 8 / 4 tasks, many exact ties at the cut
    cfg = preset("glm53-flash")
    pos, P = 131071, 32768
    s = _tied_scores(1, P, gen)
    ref = ops.topk_lower_index(s[0], cfg.index_topk_pools).sort().values
    kth = s[0, ops.topk_lower_index(s[0], cfg.index_topk_pools)[-1]]
    n_tied = int((s[0] == kth).sum())
    print(f"{n_tied} pools tie with the k-th score, {int((s[0, ref] == kth).sum())} of them selected")
    assert n_tied > 100
    for bits, chunk in ((8, 4096), (11, 8192)):
        out = indexer.select(s.to(DEV), _pos([pos]), cfg, chunk=chunk, bits=bits, block=1024).cpu()[0].long()
        assert torch.equal(out, _expected(s, [pos], cfg)[0])
        pools = out[:4 * cfg.index_topk_pools:4] // 4
        assert torch.equal(pools, ref)


# ---------------------------------------------------------------------------- score -> select
def _check_tie_aware(sel, ref_scores, pos, cfg):
    """sel: a row's token indices. Valid iff its pools are a top-k of ref_scores up to a tolerance:
    no unselected pool scores above a selected one by more than tol. Returns the near-ties met."""
    KP, K = cfg.index_kpool, cfg.index_topk_pools
    P = (pos + 1) // KP
    toks = sel[sel >= 0]
    k = min(P, K)
    assert toks.numel() == k * KP + pos + 1 - P * KP
    assert torch.equal(toks[k * KP:], torch.arange(P * KP, pos + 1)), "tail"
    pools = toks[:k * KP].view(k, KP)
    assert torch.equal(pools, pools[:, :1] + torch.arange(KP)) and (pools[:, 0] % KP == 0).all()
    chosen = torch.zeros(P, dtype=torch.bool)
    chosen[pools[:, 0] // KP] = True
    if k == P:
        return 0
    tol = 1e-5 * float(ref_scores.abs().max())
    lo, hi = float(ref_scores[chosen].min()), float(ref_scores[~chosen].max())
    assert hi <= lo + tol, (hi, lo)
    return int(((ref_scores - lo).abs() <= tol).sum()) - 1


def _chain(cfg, x, positions, chunk=8):
    s = _scores(cfg, x, positions, chunk=chunk, block_p=8)
    return s, indexer.select(s.to(DEV), _pos(positions), cfg, chunk=chunk, block=8).cpu()


def test_chain_tie_aware_deterministic_batch_invariant(gen, one_thread):
    cfg = preset("tiny")
    positions = [10, 40, 130, 77]
    x = _score_inputs(cfg, positions, gen)
    s, out = _chain(cfg, x, positions)
    ties = 0
    for r, pos in enumerate(positions):
        P = (pos + 1) // cfg.index_kpool
        ties += _check_tie_aware(out[r].long(), ops.indexer_scores(x["iq"][r], x["w"][r], x["pk"][r, :P]), pos, cfg)
    print(f"near-ties at the cut: {ties}")
    s2, out2 = _chain(cfg, x, positions)
    assert _same(s, s2) and torch.equal(out, out2)
    for r in (0, 2):
        s1, o1 = _chain(cfg, {k: v[r:r + 1] for k, v in x.items()}, positions[r:r + 1])
        P = (positions[r] + 1) // cfg.index_kpool
        assert torch.equal(s1[0, :P], s[r, :P]) and torch.equal(o1[0], out[r]), f"row {r} alone differs"


def test_select_rejects_too_many_tasks():
    cfg = preset("tiny")
    with pytest.raises(ValueError):
        indexer.select(torch.zeros(1, 40, device=DEV), _pos([130]), cfg, chunk=8, t_max=2)


# ---------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("positions", [[640], [8191], [65535], [640, 8191, 65535, 3000]],
                         ids=lambda p: "pos" + "-".join(map(str, p)))
def test_gpu_indexer_real_shapes(positions):
    cfg = preset("glm53-flash")
    gen = torch.Generator().manual_seed(sum(positions))
    rows, D, KP = len(positions), cfg.index_head_dim, cfg.index_kpool
    Pmax = (max(positions) + 1) // KP + 8
    x = _score_inputs(cfg, positions, gen, torch.bfloat16, Pmax=Pmax)
    kw = dict(chunk=2048, block_p=64)
    s = _scores(cfg, x, positions, **kw)
    out = indexer.select(s.to(DEV), _pos(positions), cfg, chunk=2048, block=1024).cpu()
    assert not (out == SENTINEL).any()
    for r, pos in enumerate(positions):
        P = (pos + 1) // KP
        ref = ops.indexer_scores(x["iq"][r], x["w"][r], x["pk"][r, :P].float())
        assert _rel(s[r, :P], ref) <= 1e-4
        print(f"pos {pos}: near-ties {_check_tie_aware(out[r].long(), ref, pos, cfg)}")
        assert torch.equal(out[r].long(), _expected(s[r:r + 1], [pos], cfg)[0])   # exact on the kernel's scores
    assert _same(s, _scores(cfg, x, positions, **kw))
    assert torch.equal(out, indexer.select(s.to(DEV), _pos(positions), cfg, chunk=2048, block=1024).cpu())
    s1 = _scores(cfg, {k: v[-1:] for k, v in x.items()}, positions[-1:], **kw)
    P = (positions[-1] + 1) // KP
    assert torch.equal(s1[0, :P], s[-1, :P])
    # pool task at the real width
    ln_w, ln_b, ape = _ix_weights(cfg)
    kraw, graw = torch.randn(rows, D, generator=gen), torch.randn(rows, D, generator=gen)
    tail = torch.randn(rows, KP, 2 * D, generator=gen).to(DEV)
    pk = torch.full((rows, Pmax, D), float("nan"), device=DEV)
    done = [p - (p + 1) % KP for p in positions]                            # make every token complete a pool
    indexer.pool_step(kraw.to(DEV), graw.to(DEV), ln_w.to(DEV), ln_b.to(DEV), ape.to(DEV), tail, pk, _pos(done))
    for r, pos in enumerate(done):
        ref = ops.indexer_pool(tail[r, :, :D].cpu(), tail[r, :, D:].cpu(), ape)
        assert _rel(pk[r, pos // KP].cpu(), ref) <= 1e-5
