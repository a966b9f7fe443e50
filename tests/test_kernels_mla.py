"""Absorbed NoPE MLA task family (glm53_flash/kernels/mla.py) against the fp32 reference
(reference/ops.py mla_absorbed, indexer_select): absorbed queries, split attention over the indexer's
selection and the split-softmax join + value projection, for several splits (tokens per task, heads
per task, token tile), both attend forms (online, two-pass), latent dtypes and bf16 / FP8 kv_b;
NaN-poisoned outputs and partials (every word written), bitwise determinism, batch invariance (row r
alone == row r among 4); the indexer kernels' selection fed to the attention; the host-side split
chooser. Last, the
register budget of both DSA families (mla and indexer) at real shapes, compiled offline for sm_90 with
Triton's bundled ptxas (no GPU needed).

CPU: tiny shapes (4 heads, latent 64, nope/v 32, selections of <= 19 tokens) under TRITON_INTERPRET=1.
GPU (`gpu` marker): 64 heads, latent 512, nope/v 256, positions 640, 8191, 65535 (2051 tokens).
"""
import pytest
import torch

import dataclasses

from glm53_flash.config import preset
from glm53_flash.fp8 import dequantize_fp8, quantize_fp8
from glm53_flash.kernels import mla
from glm53_flash.reference import ops
from glm53_flash.weights import PREFIX, RandomWeights

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(x, ref):
    return float((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def _same(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _inputs(cfg, positions, gen, lat_dtype=torch.float32, nh=None):
    """Fresh random q, latent caches and a reference indexer selection per row (from random scores)."""
    nh = nh or cfg.num_attention_heads
    rows, KP, C = len(positions), cfg.index_kpool, cfg.kv_lora_rank
    max_len = max(positions) + 1
    idx = torch.full((rows, cfg.index_width), -1, dtype=torch.int32)
    for r, pos in enumerate(positions):
        P = (pos + 1) // KP
        sel = ops.indexer_select(torch.randn(P, generator=gen), pos, cfg.index_topk_pools, KP)
        idx[r, :sel.numel()] = sel.int()
    return dict(q=torch.randn(rows, nh, cfg.qk_nope_head_dim, generator=gen),
                latent=torch.randn(rows, max_len, C, generator=gen).to(lat_dtype), idx=idx,
                positions=torch.tensor(positions, dtype=torch.int32))


def _kv_b(cfg, nh=None):
    W = RandomWeights(cfg, seed=0)
    w = W[f"{PREFIX}layers.{cfg.dsa_layers[0]}.self_attn.kv_b_proj.weight"]      # bf16 [nh (dn + dv), C]
    return w[:(nh or cfg.num_attention_heads) * (cfg.qk_nope_head_dim + cfg.v_head_dim)].contiguous()


def _run(cfg, x, kv_b, split, chunk_c=None):
    d = {k: v.to(DEV) for k, v in x.items()}
    scale = None
    if isinstance(kv_b, tuple):                                             # FP8: (q, block scales)
        kv_b, scale = kv_b[0], kv_b[1].to(DEV)
    out = mla.mla_decode(d["q"], kv_b.to(DEV), d["latent"], d["idx"], d["positions"], cfg, split, chunk_c=chunk_c,
                         kv_b_scale=scale)
    return {k: v.cpu() for k, v in out.items()}


def _reference(cfg, x, kv_b):
    if isinstance(kv_b, tuple):
        kv_b = dequantize_fp8(*kv_b)
    dn = cfg.qk_nope_head_dim
    W = kv_b.float().view(x["q"].shape[1], -1, kv_b.shape[1])
    outs, qlat = [], []
    for r in range(x["q"].shape[0]):
        sel = x["idx"][r][x["idx"][r] >= 0].long()
        outs.append(ops.mla_absorbed(x["q"][r], kv_b.float(), x["latent"][r][sel].float(), cfg.qk_head_dim ** -0.5))
        qlat.append(torch.einsum("hd,hdc->hc", x["q"][r], W[:, :dn]))
    return torch.stack(outs), torch.stack(qlat)


def _check(cfg, x, kv_b, split, tol, chunk_c=None):
    before = {k: v.clone() for k, v in x.items()}
    o = _run(cfg, x, kv_b, split, chunk_c)
    for name, t in o.items():
        assert not torch.isnan(t).any(), f"{name}: an element was not written"
    for name, t in x.items():
        assert torch.equal(t, before[name]), f"input {name} was modified"
    ref, qlat = _reference(cfg, x, kv_b)
    e_out, e_q = _rel(o["out"], ref), _rel(o["qlat"], qlat)
    print(f"{split} chunk_c {chunk_c}: out rel err {e_out:.1e}, q~ rel err {e_q:.1e}")
    assert e_out <= tol and e_q <= tol
    return o


SPLITS = [mla.AttentionSplit(4, 8, 8, 3), mla.AttentionSplit(2, 16, 16, 2), mla.AttentionSplit(1, 32, 32, 1)]


@pytest.mark.parametrize("chunk_c", [None, 16], ids=lambda c: "online" if c is None else f"tile{c}")
@pytest.mark.parametrize("split", SPLITS, ids=lambda s: f"hb{s.heads_per_task}-t{s.tokens_per_task}x{s.n_splits}")
@pytest.mark.parametrize("positions", [[130], [10, 40, 130, 77]], ids=lambda p: f"rows{len(p)}")
def test_mla_matches_reference(positions, split, chunk_c, gen, one_thread):
    cfg = preset("tiny")
    _check(cfg, _inputs(cfg, positions, gen), _kv_b(cfg), split, 1e-3, chunk_c)


def test_attend_clamps_token_ids(gen, one_thread):
    # the launch's attend task runs once before its wait (ffn.WARM_CODE) on whatever idx holds: an id past the
    # row's position must read the position's row, never past the cache (here: far past the tensor's end)
    cfg = preset("tiny")
    x = _inputs(cfg, [130, 61], gen)
    bad = x["idx"].clone()
    for r, pos in enumerate(x["positions"].tolist()):
        live = (bad[r] >= 0).nonzero().flatten()[::3]
        bad[r, live] = pos + 1 + (1 << 28)
    clamped = torch.minimum(bad, x["positions"][:, None])
    o_bad = _run(cfg, dict(x, idx=bad), _kv_b(cfg), SPLITS[1], 16)
    o_ref = _run(cfg, dict(x, idx=clamped), _kv_b(cfg), SPLITS[1], 16)
    assert all(torch.equal(o_bad[k], o_ref[k]) for k in o_ref)


@pytest.mark.parametrize("chunk_c", [None, 32], ids=lambda c: "online" if c is None else f"tile{c}")
def test_mla_bf16_latents(chunk_c, gen, one_thread):
    cfg = preset("tiny")
    _check(cfg, _inputs(cfg, [40, 130], gen, torch.bfloat16), _kv_b(cfg), SPLITS[0], 1e-3, chunk_c)


@pytest.mark.parametrize("chunk_c", [None, 16], ids=lambda c: "online" if c is None else f"tile{c}")
def test_mla_deterministic_and_batch_invariant(chunk_c, gen, one_thread):
    cfg = preset("tiny")
    x, kv_b, split = _inputs(cfg, [10, 40, 130, 77], gen), _kv_b(cfg), SPLITS[0]
    first, again = _run(cfg, x, kv_b, split, chunk_c), _run(cfg, x, kv_b, split, chunk_c)
    for k in first:
        assert _same(first[k], again[k]), k
    for r in (0, 3):
        alone = _run(cfg, {k: v[r:r + 1] for k, v in x.items()}, kv_b, split, chunk_c)
        for k in ("out", "qlat", "pm", "pl", "pacc"):
            assert _same(alone[k][0], first[k][r]), f"{k}: row {r} differs alone vs among 4"


@pytest.mark.parametrize("chunk_c", [None, 32], ids=lambda c: "online" if c is None else f"tile{c}")
def test_mla_fp8_weights(chunk_c, gen, one_thread):
    # FP8 e4m3 kv_b with 128 x 128 block scales; head parts of 128 rows (whole scale blocks, as at the
    # real shape), so the tiny config is widened to nope = v = latent = 128 with 2 heads
    cfg = dataclasses.replace(preset("tiny"), qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=128)
    w = torch.randn(2 * 256, 128, generator=gen) * 0.05
    _check(cfg, _inputs(cfg, [40, 130], gen, nh=2), quantize_fp8(w), mla.AttentionSplit(2, 8, 8, 3), 1e-3, chunk_c)


def test_indexer_then_mla(gen, one_thread):
    # the hand-off: the indexer kernels' selection (int32, -1 padded) feeds the attention tasks
    from glm53_flash.kernels import indexer
    cfg = preset("tiny")
    positions = [40, 130]
    x = _inputs(cfg, positions, gen)
    NH, D = cfg.index_n_heads, cfg.index_head_dim
    iq, w = torch.randn(2, NH, D, generator=gen), torch.randn(2, NH, generator=gen)
    pk = torch.randn(2, 40, D, generator=gen)
    pos = x["positions"].to(DEV)
    s = indexer.score_pools(iq.to(DEV), w.to(DEV), pk.to(DEV), pos, cfg.index_kpool, chunk=16, block_p=16)
    x["idx"] = indexer.select(s, pos, cfg, chunk=8, block=8).cpu()
    for r, p in enumerate(positions):
        P = (p + 1) // cfg.index_kpool
        ref_sel = ops.indexer_select(ops.indexer_scores(iq[r], w[r], pk[r, :P]), p, cfg.index_topk_pools,
                                     cfg.index_kpool)
        assert torch.equal(x["idx"][r, :ref_sel.numel()].long(), ref_sel)
    _check(cfg, x, _kv_b(cfg), SPLITS[0], 1e-3, 16)


def test_choose_attention_split():
    cfg = preset("glm53-flash")
    W = cfg.index_width
    for nh, grid, sms in ((64, 132, 132), (8, 132, 132), (16, 264, 132), (64, 1056, 132), (32, 8, 132)):
        s = mla.choose_attention_split(W, nh, grid, sms)
        assert nh % s.heads_per_task == 0 and s.heads_per_task <= 16
        assert s.tokens_per_task == s.block_t and s.block_t in (32, 64, 128)      # one tile a task
        assert s.tokens_per_task * s.n_splits >= W > s.tokens_per_task * (s.n_splits - 1)
        fits = s.tasks_per_row(nh) <= grid
        assert fits or s.block_t == 128                                          # else the largest tile
        if fits and s.block_t > 32:                                              # the smallest tile that fits
            assert nh // s.heads_per_task * -(-W // (s.block_t // 2)) > grid
        print(f"nh {nh} grid {grid}: {s}, {s.tasks_per_row(nh)} tasks a row")
    assert mla.choose_attention_split(W, 8, 132, 132) == mla.AttentionSplit(8, 32, 32, 65)       # TP8
    assert mla.choose_attention_split(W, 64, 132, 132) == mla.AttentionSplit(16, 64, 64, 33)     # TP1
    with pytest.raises(ValueError):
        mla.choose_attention_split(0, 64, 132, 132)
    with pytest.raises(ValueError):
        _run(preset("tiny"), _inputs(preset("tiny"), [40], torch.Generator()), _kv_b(preset("tiny")),
             mla.AttentionSplit(4, 8, 8, 1))                                 # covers 8 of 19 index slots
    with pytest.raises(ValueError, match="one tile"):
        _run(preset("tiny"), _inputs(preset("tiny"), [40], torch.Generator()), _kv_b(preset("tiny")),
             mla.AttentionSplit(4, 8, 16, 2), chunk_c=16)                    # two tiles a task: online form only


def test_join_chunk():
    assert mla.att_chunk(32, 512) == 64 and mla.att_chunk(64, 512) == 32 and mla.att_chunk(8, 64) == 64
    assert mla.join_chunk(65, 512) == (128, 8) and mla.join_chunk(33, 512) == (64, 8)
    assert mla.join_chunk(1, 64) == (2, 2) and mla.join_chunk(3, 64) == (4, 4) and mla.join_chunk(65, 64) == (128, 64)


# ---------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 8], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("nh", [64, 8], ids=lambda n: f"heads{n}")
def test_gpu_mla_real_shapes(nh, rows):
    cfg = preset("glm53-flash")
    gen = torch.Generator().manual_seed(rows * 100 + nh)
    positions = ([640, 8191, 65535] * 3)[:rows]
    x, kv_b = _inputs(cfg, positions, gen, torch.bfloat16, nh=nh), _kv_b(cfg, nh)
    split = mla.choose_attention_split(cfg.index_width, nh, 132, 132)
    for chunk_c in (None, 32):
        first = _check(cfg, x, kv_b, split, 1e-3, chunk_c)
        for k, v in _run(cfg, x, kv_b, split, chunk_c).items():
            assert _same(v, first[k]), k
        alone = _run(cfg, {k: v[-1:] for k, v in x.items()}, kv_b, split, chunk_c)
        for k in ("out", "qlat"):
            assert _same(alone[k][0], first[k][-1]), k


@pytest.mark.gpu
def test_gpu_mla_fp8_real_shapes():
    cfg = preset("glm53-flash")
    gen = torch.Generator().manual_seed(8)
    x = _inputs(cfg, [640, 8191, 65535, 3000], gen, torch.bfloat16, nh=8)
    kv_b = quantize_fp8(_kv_b(cfg, 8))
    split = mla.choose_attention_split(cfg.index_width, 8, 132, 132)
    first = _check(cfg, x, kv_b, split, 1e-3, 32)
    alone = _run(cfg, {k: v[-1:] for k, v in x.items()}, kv_b, split, 32)
    assert _same(alone["out"][0], first["out"][-1])


# ---------------------------------------------------------------------------- registers, without a GPU
_DIVISIBLE = ()   # int args a launch passes as multiples of 16


_F, _B, _I = "*fp32", "*bf16", "*i32"
_ATTEND = dict(qlat=_F, idx=_I, latent=_B, positions=_I, pm=_F, pl=_F, pacc=_F, stride_lat="i32",
               width="i32", n_splits="i32", tpt="i32", scale="fp32", TOPK="i32", NH="constexpr", C="constexpr",
               KP="constexpr", HB="constexpr", BLOCK_T="constexpr", CK="constexpr")
_MLA_C = dict(NH=64, DN=256, DV=256, C=512)
_OUT = dict(kv_b=_B, s_kv=_B, pm=_F, pl=_F, pacc=_F, ctx=_F, out=_F, rows="i32", n_splits="i32", NH="constexpr",
            DN="constexpr", DV="constexpr", C="constexpr", ROWS_PAD="constexpr", BLOCK_N="constexpr",
            BLOCK_K="constexpr", PF_K="constexpr", NS_PAD="constexpr", SB="constexpr")
# (variant, register budget); measured with triton 3.6's ptxas: printed by the test
BUDGETS = [
    (["mla", "mla_absorb_kernel", dict(q=_F, kv_b=_B, s_kv=_B, qlat=_F, rows="i32", NH="constexpr", DN="constexpr",
                                       DV="constexpr", C="constexpr", ROWS_PAD="constexpr", BLOCK_C="constexpr",
                                       CK="constexpr"), dict(_MLA_C, ROWS_PAD=8, BLOCK_C=64, CK=64), 4], 128),
    # online form: measured 251 (4 warps), 210 (8 warps); (BLOCK_T 64, 8 warps) spills 824 B - not listed
    (["mla", "mla_attend_kernel", _ATTEND, dict(NH=64, C=512, KP=4, HB=16, BLOCK_T=32, CK=512), 8], 224),
    # one-tile form (what the launches build: TP8 (HB 8, BLOCK_T 32), TP1 (HB 16, BLOCK_T 64))
    (["mla", "mla_attend_kernel", _ATTEND, dict(NH=64, C=512, KP=4, HB=8, BLOCK_T=32, CK=64), 4], 128),
    (["mla", "mla_attend_kernel", _ATTEND, dict(NH=64, C=512, KP=4, HB=16, BLOCK_T=64, CK=32), 4], 168),
    (["mla", "mla_out_kernel", _OUT, dict(_MLA_C, ROWS_PAD=8, BLOCK_N=64, BLOCK_K=128, PF_K=128, NS_PAD=128, SB=8),
      4], 128),
    (["mla", "mla_out_kernel", _OUT, dict(_MLA_C, ROWS_PAD=8, BLOCK_N=64, BLOCK_K=128, PF_K=128, NS_PAD=64, SB=8),
      4], 144),                                  # 122 measured with [SB, C] split tiles
    (["mla", "mla_absorb_kernel", dict(q=_F, kv_b="*fp8e4nv", s_kv=_F, qlat=_F, rows="i32", NH="constexpr",
                                       DN="constexpr", DV="constexpr", C="constexpr", ROWS_PAD="constexpr",
                                       BLOCK_C="constexpr", CK="constexpr"),
      dict(_MLA_C, ROWS_PAD=8, BLOCK_C=64, CK=64), 4], 128),
    (["mla", "mla_out_kernel", dict(_OUT, kv_b="*fp8e4nv", s_kv=_F),
      dict(_MLA_C, ROWS_PAD=8, BLOCK_N=64, BLOCK_K=128, PF_K=128, NS_PAD=128, SB=8), 4], 144),   # 139 measured
    (["indexer", "idx_pool_kernel", dict(kraw=_B, graw=_B, ln_w=_B, ln_b=_B, ape=_B, tail=_F, pool_keys=_B,
                                         positions=_I, stride_pk="i32", eps="fp32", D="constexpr", KP="constexpr"),
      dict(D=128, KP=4), 4], 64),
    (["indexer", "idx_score_kernel", dict(iq=_B, w=_B, pool_keys=_B, scores=_F, positions=_I, stride_pk="i32",
                                          stride_s="i32", chunk="i32", NH="constexpr", D="constexpr", KP="constexpr",
                                          BLOCK_P="constexpr"), dict(NH=32, D=128, KP=4, BLOCK_P=64), 4], 136),
    (["indexer", "topk_hist_kernel", dict(scores=_F, hist=_I, state=_I, positions=_I, stride_s="i32", j="i32", chunk="i32",
                                          TOPK="i32", KP="constexpr", T_MAX="constexpr", BITS="constexpr",
                                          BLOCK="constexpr"), dict(KP=4, T_MAX=16, BITS=8, BLOCK=1024), 4], 128),
    (["indexer", "topk_write_kernel", dict(scores=_F, hist=_I, state=_I, out=_I, positions=_I, stride_s="i32", chunk="i32",
                                           TOPK="i32", WIDTH="i32", live="i32", KP="constexpr", T_MAX="constexpr",
                                           BITS="constexpr", BLOCK="constexpr"),
      dict(KP=4, T_MAX=16, BITS=8, BLOCK=1024), 4], 144),
]


def test_offline_sm90_registers():
    """Compile the real-shape task kernels of the DSA families for sm_90 with Triton's bundled ptxas:
    no spills, registers within budget (a persistent launch inherits the max over its families)."""
    from glm53_flash.sm90_regs import kernel_registers, ptxas_available
    if not ptxas_available():
        pytest.skip("Triton's bundled ptxas is missing")
    stats = kernel_registers([[f"glm53_flash.kernels.{v[0]}", *v[1:], list(_DIVISIBLE)] for v, _ in BUDGETS])
    for s, (_, budget) in zip(stats, BUDGETS):
        print(f"{s['kernel']} {s['consts']} warps{s['warps']}: {s['regs']} regs, {s['spill']} B spilled")
    for s, (_, budget) in zip(stats, BUDGETS):
        assert s["spill"] == 0 and s["regs"] <= budget, (s, budget)
