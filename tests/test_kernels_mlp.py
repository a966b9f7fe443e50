"""Dense MLP task family (glm53_flash/kernels/mlp.py: gate|up tiles with the clamped SwiGLU, then down
tiles) against the fp32 reference (reference/ops.py mlp, swiglu_clamped): bf16 and FP8 weights, 1 and
4 rows, NaN-poisoned outputs (every element written), the clamp binding at a small limit, bitwise
determinism and batch invariance.

CPU: tiny shapes under TRITON_INTERPRET=1 (the dense MLP of preset "tiny": H 256, inter 512; and the
shared expert's inter 128). GPU (`gpu` marker): H 4096 with inter 12288 (dense) and 2048 (shared).
"""
import pytest
import torch

from glm53_flash.fp8 import dequantize_fp8, quantize_fp8
from glm53_flash.kernels.gemv import GemvConfig, default_config
from glm53_flash.kernels.mlp import TEST_CFG, mlp_forward
from glm53_flash.reference import ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(x, ref):
    return float((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def _weights(H, I, fmt, gen, dev="cpu"):
    """(kernel weights [wg, wu, wd], scales, fp32 reference weights) with unit-variance outputs."""
    ws = [torch.randn(I, H, generator=gen) / H ** 0.5, torch.randn(I, H, generator=gen) / H ** 0.5,
          torch.randn(H, I, generator=gen) / I ** 0.5]
    if fmt == "bf16":
        w = [t.bfloat16() for t in ws]
        return [t.to(dev) for t in w], (None,) * 3, [t.float() for t in w]
    qs = [quantize_fp8(t) for t in ws]
    return ([q.to(dev) for q, _ in qs], tuple(s.to(dev) for _, s in qs),
            [dequantize_fp8(q, s) for q, s in qs])


def _check(x, w, s, wref, limit, tol, act_dtype=torch.bfloat16, cfg=TEST_CFG):
    y, act = mlp_forward(x.to(DEV), *w, limit, s, cfg=cfg, act_dtype=act_dtype)
    assert not torch.isnan(y).any() and not torch.isnan(act.float()).any(), "an element was not written"
    xf = x.float()
    ref_act = ops.swiglu_clamped(xf @ wref[0].t(), xf @ wref[1].t(), limit)
    ref = ops.mlp(xf, *wref, limit)
    errs = dict(act=_rel(act, ref_act), y=_rel(y, ref))
    print(" ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert all(v <= tol for v in errs.values()), errs
    return y, act


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("inter", [512, 128], ids=lambda i: f"inter{i}")
@pytest.mark.parametrize("rows", [1, 4], ids=lambda r: f"rows{r}")
def test_mlp_matches_reference(rows, inter, fmt, gen, one_thread):
    # bf16 activation hand-off: ~2^-9 relative per element
    w, s, wref = _weights(256, inter, fmt, gen)
    _check(torch.randn(rows, 256, generator=gen).bfloat16(), w, s, wref, 10.0, 5e-3)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_mlp_fp32_activation_is_exact(fmt, gen, one_thread):
    # an fp32 activation buffer: the down GEMV multiplies it as bf16 hi + lo (~16 bits, kernels/gemv.py)
    w, s, wref = _weights(256, 256, fmt, gen)
    _check(torch.randn(3, 256, generator=gen).bfloat16(), w, s, wref, 10.0, 3e-5, act_dtype=torch.float32)


def test_mlp_swiglu_clamp_binds(gen, one_thread):
    # limit 0.5 against unit-variance gate/up: most of both are clamped, on both sides of up
    w, s, wref = _weights(256, 128, "bf16", gen)
    x = torch.randn(4, 256, generator=gen).bfloat16()
    g, u = x.float() @ wref[0].t(), x.float() @ wref[1].t()
    assert (g > 0.5).float().mean() > 0.2 and (u < -0.5).float().mean() > 0.2 and (u > 0.5).float().mean() > 0.2
    _check(x, w, s, wref, 0.5, 3e-5, act_dtype=torch.float32)
    # and it differs from the unclamped result, so the clamp is really applied
    y_free, _ = mlp_forward(x.to(DEV), *w, 100.0, s, cfg=TEST_CFG, act_dtype=torch.float32)
    assert _rel(y_free, ops.mlp(x.float(), *wref, 0.5)) > 0.1


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_mlp_deterministic_and_batch_invariant(fmt, gen, one_thread):
    w, s, _ = _weights(256, 256, fmt, gen)
    x = torch.randn(4, 256, generator=gen).bfloat16().to(DEV)
    y, act = mlp_forward(x, *w, 10.0, s)
    y2, act2 = mlp_forward(x, *w, 10.0, s)
    assert torch.equal(y, y2) and torch.equal(act, act2)
    for r in (0, 3):
        y1, act1 = mlp_forward(x[r:r + 1], *w, 10.0, s)
        assert torch.equal(y1[0], y[r]) and torch.equal(act1[0], act[r]), f"row {r} differs alone vs among 4"


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_mlp_tp_partials(fmt, gen, one_thread):
    # TP 2: each rank owns half the intermediate dim (gate/up rows, down columns; FP8 scale blocks with
    # them); the per-rank down partials summed in rank order give the MLP output
    H, I, tp = 256, 256, 2
    w, s, wref = _weights(H, I, fmt, gen)
    x = torch.randn(2, H, generator=gen).bfloat16()
    h, y = I // tp, None
    for t in range(tp):
        rows_ = slice(t * h, (t + 1) * h)
        cols = (slice(None), rows_)
        blk = slice(t * h // 128, (t + 1) * h // 128)                 # FP8 scale blocks of the shard
        wt = [w[0][rows_], w[1][rows_], w[2][cols].contiguous()]
        st = (None,) * 3 if fmt == "bf16" else (s[0][blk], s[1][blk], s[2][:, blk].contiguous())
        part, _ = mlp_forward(x.to(DEV), *wt, 10.0, st)
        y = part if y is None else y + part
    assert _rel(y, ops.mlp(x.float(), *wref, 10.0)) <= 5e-3


def test_mlp_rejects_bad_inputs(gen):
    w, s, _ = _weights(256, 128, "fp8", gen)
    x = torch.randn(2, 256, generator=gen).bfloat16()
    with pytest.raises(ValueError):
        mlp_forward(x, *w, 10.0, (None, None, None))              # FP8 without scales
    with pytest.raises(ValueError):
        mlp_forward(x, *w, 10.0, s, cfg=GemvConfig(block_n=64, pf_k=64))   # FP8 chunks are 128 wide
    with pytest.raises(ValueError):
        mlp_forward(torch.randn(9, 256).bfloat16(), *w, 10.0, s)   # more rows than the padded 8


# ---------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("inter", [12288, 2048], ids=["dense", "shared"])
@pytest.mark.parametrize("rows", [1, 4, 8], ids=lambda r: f"rows{r}")
def test_gpu_mlp_real_shapes(rows, inter, fmt):
    gen = torch.Generator().manual_seed(rows * 100 + inter)
    w, s, wref = _weights(4096, inter, fmt, gen, dev="cuda")
    x = torch.randn(rows, 4096, generator=gen).bfloat16()
    cfg = default_config(w[0])
    y, act = _check(x.cuda(), w, s, [t.cuda() for t in wref], 10.0, 1e-2, cfg=cfg)
    y2, _ = mlp_forward(x.cuda(), *w, 10.0, s, cfg=cfg)
    y1, _ = mlp_forward(x[-1:].cuda(), *w, 10.0, s, cfg=cfg)
    assert torch.equal(y, y2) and torch.equal(y1[0], y[-1])
