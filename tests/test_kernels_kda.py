"""KDA decode task family (glm53_flash/kernels/kda.py) against the fp32 reference (reference/ops.py
kda_conv_step, kda_gate, kda_recurrent_step, gated_rms_norm): raw and normed head outputs, the new
state and the new conv window, with NaN-poisoned outputs (every word written), untouched inputs (the
all-or-nothing contract), bitwise determinism and batch invariance, for column blocks (the norm
joined in a second stage) and whole heads (the norm fused), with f / gate given or formed in the task
from the rank-128 rows (kda_lowrank). Last, the register budget of both families (kda and mhc),
compiled offline for sm_90 with Triton's bundled ptxas: no GPU needed.

CPU: tiny shapes (4 heads x 64) under TRITON_INTERPRET=1. GPU (`gpu` marker): 64 heads x 128.
"""
import pytest
import torch

from glm53_flash.config import preset
from glm53_flash.kernels import kda
from glm53_flash.reference import ops
from glm53_flash.weights import PREFIX, RandomWeights

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ROUND = 2.0 ** -7      # GPU rounds fp32 -> bf16 to nearest; the interpreter may truncate


def _same_bits(x, y):
    """Two kernel variants computing the same math: the same bits under the interpreter; compiled, the
    variants are different kernels (fma contraction and layouts may differ), so only near-equality."""
    if DEV == "cpu":
        return torch.equal(x, y)
    return torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-6)


def _rel(x, ref):
    return float((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def _weights(cfg):
    W = RandomWeights(cfg, seed=0)
    p = f"{PREFIX}layers.0.self_attn."
    conv_w = torch.cat([W[p + f"{n}_conv1d.weight"].squeeze(1) for n in "qkv"]).float().contiguous()  # [3D, KC]
    return conv_w, W[p + "A_log"].float(), W[p + "dt_bias"].float(), W[p + "o_norm.weight"]


def _inputs(cfg, rows, gen, act=torch.float32):
    """Fresh random activations and carried state for `rows` rows (never zeros)."""
    nh, d, KC = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    D = nh * d
    return dict(qkv=torch.randn(rows, 3 * D, generator=gen).to(act), b=torch.randn(rows, nh, generator=gen).to(act),
                f=torch.randn(rows, D, generator=gen).to(act), gate=torch.randn(rows, D, generator=gen).to(act),
                window=torch.randn(rows, KC - 1, 3 * D, generator=gen),
                S=torch.randn(rows, nh, d, d, generator=gen) * 0.1)


def _reference(cfg, x, conv_w, A_log, dt_bias, nw, lowrank=None):
    rows, nh, d = x["b"].shape[0], cfg.linear_num_heads, cfg.linear_head_dim
    qkv, f, gate = x["qkv"].float(), x["f"].float(), x["gate"].float()
    if lowrank is not None:                       # f, gate are the f_a / g_a rows
        f, gate = f @ lowrank[0].float().t(), gate @ lowrank[1].float().t()
    y, win = ops.kda_conv_step(x["window"], qkv, conv_w)
    q, k, v = (t.reshape(rows, nh, d) for t in y.split(nh * d, dim=-1))
    g = ops.kda_gate(f, A_log, dt_bias, cfg.linear_lower_bound)
    o, S = ops.kda_recurrent_step(x["S"], q, k, v, g, torch.sigmoid(x["b"].float()))
    on = ops.gated_rms_norm(o, gate.view(rows, nh, d), nw.float(), cfg.rms_norm_eps)
    return dict(o=o, on32=on, S=S, window=win)


def _run(cfg, x, w, lowrank=None, **kw):
    xd = {k: v.to(DEV) for k, v in x.items()}
    lr = None if lowrank is None else tuple(t.to(DEV) for t in lowrank)
    return kda.kda_step(xd["qkv"], xd["b"], xd["f"], xd["gate"], xd["window"], xd["S"], *(t.to(DEV) for t in w),
                        cfg, lowrank=lr, **kw)


def _check(cfg, x, w, tol, lowrank=None, **kw):
    before = {k: v.clone() for k, v in x.items()}
    out = _run(cfg, x, w, lowrank=lowrank, **kw)
    for name, t in out.items():
        assert not torch.isnan(t.float()).any(), f"{name}: an element was not written"
    for name, t in x.items():
        assert torch.equal(t, before[name]), f"input {name} was modified"
    ref = _reference(cfg, x, *w, lowrank=lowrank)
    errs = {k: _rel(out[k], ref[k]) for k in ref}
    # the partial sums of squares join to the full one
    errs["ssq"] = _rel(out["ssq"].sum(-1), ref["o"].pow(2).sum(-1))
    print(" ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert all(v <= tol for v in errs.values()), errs
    assert torch.equal(out["window"].cpu(), ref["window"])          # a shift: exact
    if DEV == "cuda":
        assert torch.equal(out["on"], out["on32"].bfloat16())
    else:
        assert ((out["on"].float() - out["on32"]).abs() <= BF16_ROUND * out["on32"].abs()).all()
    return out


@pytest.mark.parametrize("block_v", [32, 64], ids=lambda b: f"bv{b}")
@pytest.mark.parametrize("rows", [1, 4], ids=lambda r: f"rows{r}")
def test_kda_matches_reference(rows, block_v, gen, one_thread):
    cfg = preset("tiny")
    _check(cfg, _inputs(cfg, rows, gen), _weights(cfg), 1e-5, block_v=block_v)


def test_kda_bf16_activations(gen, one_thread):
    # the inproj / f_b / g_b outputs handed over as bf16; 16-wide blocks (4 per head)
    cfg = preset("tiny")
    _check(cfg, _inputs(cfg, 2, gen, act=torch.bfloat16), _weights(cfg), 1e-5, block_v=16)


@pytest.mark.parametrize("block_v", [32, 64], ids=lambda b: f"bv{b}")
def test_kda_lowrank_in_task(block_v, gen, one_thread):
    # f = f_b(f_a x) and the output gate g_b(g_a x) formed inside the tasks from the rank-R rows
    cfg = preset("tiny")
    W = RandomWeights(cfg, seed=0)
    p = f"{PREFIX}layers.0.self_attn."
    fb, gb = W[p + "f_b_proj.weight"], W[p + "g_b_proj.weight"]                          # [D, R] bf16
    x = _inputs(cfg, 3, gen)
    x["f"], x["gate"] = (torch.randn(3, fb.shape[1], generator=gen) for _ in range(2))     # f_a / g_a rows
    _check(cfg, x, _weights(cfg), 1e-5, lowrank=(fb, gb), block_v=block_v)


def test_kda_deterministic_and_batch_invariant(gen, one_thread):
    cfg = preset("tiny")
    x, w = _inputs(cfg, 4, gen), _weights(cfg)
    first = _run(cfg, x, w, block_v=32)
    again = _run(cfg, x, w, block_v=32)
    for k in first:
        assert torch.equal(first[k], again[k]), k
    for r in (0, 3):
        alone = _run(cfg, {k: v[r:r + 1].contiguous() for k, v in x.items()}, w, block_v=32)
        for k in first:
            assert torch.equal(alone[k][0], first[k][r]), f"{k}: row {r} differs alone vs among 4"


def test_kda_variants_same_bits(gen, one_thread):
    # the norm fused into a whole-head task == joined in a second stage; state loaded early == late
    cfg = preset("tiny")
    x, w = _inputs(cfg, 2, gen), _weights(cfg)
    fused = _run(cfg, x, w, block_v=64, fuse_norm=True)
    joined = _run(cfg, x, w, block_v=64, fuse_norm=False)
    for k in fused:
        assert _same_bits(fused[k], joined[k]), k
    early = _run(cfg, x, w, block_v=32, prefetch=True)
    late = _run(cfg, x, w, block_v=32, prefetch=False)
    for k in early:
        assert _same_bits(early[k], late[k]), k


def test_kda_rejects_bad_blocks(gen):
    cfg = preset("tiny")
    x, w = _inputs(cfg, 1, gen), _weights(cfg)
    with pytest.raises(ValueError):
        _run(cfg, x, w, block_v=48)
    with pytest.raises(ValueError):
        _run(cfg, x, w, block_v=32, fuse_norm=True)


# ---------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [16, 32, 128], ids=lambda b: f"bv{b}")
@pytest.mark.parametrize("rows", [1, 4, 8], ids=lambda r: f"rows{r}")
def test_gpu_kda_real_shapes(rows, block_v):
    cfg = preset("glm53-flash")
    gen = torch.Generator().manual_seed(rows * 1000 + block_v)
    x, w = _inputs(cfg, rows, gen, act=torch.bfloat16), _weights(cfg)
    _check(cfg, x, w, 1e-2, block_v=block_v)
    first = _run(cfg, x, w, block_v=block_v)
    alone = _run(cfg, {k: v[-1:].contiguous() for k, v in x.items()}, w, block_v=block_v)
    for k in first:
        assert torch.equal(first[k], _run(cfg, x, w, block_v=block_v)[k]), k
        assert torch.equal(alone[k][0], first[k][-1]), k


@pytest.mark.gpu
def test_gpu_kda_lowrank_real_shapes():
    cfg = preset("glm53-flash")
    gen = torch.Generator().manual_seed(5)
    W = RandomWeights(cfg, seed=0)
    p = f"{PREFIX}layers.0.self_attn."
    x = _inputs(cfg, 4, gen, act=torch.bfloat16)
    x["f"], x["gate"] = (torch.randn(4, cfg.linear_head_dim, generator=gen).bfloat16() for _ in range(2))
    _check(cfg, x, _weights(cfg), 1e-2, lowrank=(W[p + "f_b_proj.weight"], W[p + "g_b_proj.weight"]), block_v=16)


# ---------------------------------------------------------------------------- registers, without a GPU
_DIVISIBLE = ("stride_qkv", "stride_fg", "D", "K", "H", "chunk")   # int args a launch passes as multiples of 16


_F, _B = "*fp32", "*bf16"
_KDA_SIG = dict(qkv=_B, stride_qkv="i32", b=_B, stride_b="i32", f=_B, gate=_B, stride_fg="i32", fb=_B, gb=_B,
                win_in=_F, win_out=_F, S_in=_F, S_out=_F, conv_w=_F, A_log=_F, dt_bias=_F, norm_w=_B, o=_F, ssq=_F,
                on=_B, on32=_F, D="i32", lower_bound="fp32", eps="fp32", DK="constexpr", DV="constexpr",
                BV="constexpr", KC="constexpr", R="constexpr", FUSE_NORM="constexpr", PREFETCH="constexpr",
                LOWRANK="constexpr")


def _kda_variant(bv, prefetch, lowrank=False, warps=4):
    return ["kda", "kda_block_kernel", _KDA_SIG,
            dict(DK=128, DV=128, BV=bv, KC=4, R=128, FUSE_NORM=bv == 128, PREFETCH=prefetch, LOWRANK=lowrank), warps]


# (variant, register budget at 4 warps); measured with triton 3.6's ptxas: 72, 128, 80, 56, 72, 26, 117, 116, 32, 48
BUDGETS = [
    (_kda_variant(16, True), 96), (_kda_variant(32, True), 128), (_kda_variant(32, False), 96),
    (_kda_variant(16, False), 64), (_kda_variant(16, True, lowrank=True), 96),
    (["kda", "kda_norm_kernel", dict(o=_F, ssq=_F, gate=_B, stride_fg="i32", gb=_B, norm_w=_B, on=_B, on32=_F,
                                     D="i32", eps="fp32", DK="constexpr", DV="constexpr", BV="constexpr",
                                     R="constexpr", LOWRANK="constexpr"),
      dict(DK=128, DV=128, BV=32, R=128, LOWRANK=False), 4], 32),
    (["mhc", "hc_partial_kernel", dict(X=_F, fn=_F, part=_F, rows="i32", chunk="i32", H="i32", ROWS_PAD="constexpr",
                                       BLOCK_C="constexpr"), dict(ROWS_PAD=8, BLOCK_C=32), 4], 128),
    (["mhc", "hc_post_partial_kernel", dict(X=_F, Y=_B, coef=_F, fn=_F, out=_F, part=_F, rows="i32", chunk="i32",
                                            H="i32", ROWS_PAD="constexpr", BLOCK_C="constexpr"),
      dict(ROWS_PAD=8, BLOCK_C=32), 4], 128),
    (["mhc", "hc_finish_kernel", dict(X=_F, part=_F, base=_F, scale=_F, norm_w=_B, out=_B, out32=_F, coef=_F,
                                      n_parts="i32", H="i32", eps="fp32", hc_eps="fp32", ROWS_PAD="constexpr",
                                      ITERS="constexpr", BLOCK_H="constexpr"),
      dict(ROWS_PAD=8, ITERS=20, BLOCK_H=512), 4], 64),
    (["mhc", "hc_post_kernel", dict(X=_F, Y=_B, coef=_F, out=_F, H="i32", BLOCK_H="constexpr"),
      dict(BLOCK_H=512), 4], 64),
]


def test_offline_sm90_registers():
    """Compile the real-shape task kernels of both families (kda and mhc) for sm_90 with Triton's bundled
    ptxas, no GPU needed: no spills, registers within budget (a persistent launch inherits the max)."""
    from glm53_flash.sm90_regs import kernel_registers, ptxas_available
    if not ptxas_available():
        pytest.skip("Triton's bundled ptxas is missing")
    stats = kernel_registers([[f"glm53_flash.kernels.{v[0]}", *v[1:], list(_DIVISIBLE)] for v, _ in BUDGETS])
    for s, (_, budget) in zip(stats, BUDGETS):
        print(f"{s['kernel']} {s['consts']} warps{s['warps']}: {s['regs']} regs, {s['spill']} B spilled")
        assert s["spill"] == 0 and s["regs"] <= budget, (s, budget)
