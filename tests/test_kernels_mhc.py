"""mHC task family (glm53_flash/kernels/mhc.py) against the fp32 reference (reference/ops.py hc_coeffs,
hc_pre, rms_norm, hc_post): column-tile partials (GEMV sums and Gram matrix), the joined coefficients
and gate row, hc_post alone and fused with the next hc_pre's partials. Every output word written
(NaN-poisoned buffers), bitwise determinism, batch invariance (row r alone gives the same bits as row
r among 4), odd tilings. Register budgets of these kernels: tests/test_kernels_kda.py (offline sm_90).

CPU: tiny shapes under TRITON_INTERPRET=1 (root conftest.py). GPU (`gpu` marker): H = 4096.
"""
import pytest
import torch

from glm53_flash.config import preset
from glm53_flash.kernels import mhc
from glm53_flash.reference import ops
from glm53_flash.weights import PREFIX, RandomWeights

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BF16_ROUND = 2.0 ** -7      # GPU rounds fp32 -> bf16 to nearest; the interpreter may truncate


def _same_bits(x, y):
    """Two kernels computing the same math: the same bits under the interpreter; compiled, different
    kernels may contract multiply-adds differently, so only near-equality."""
    if DEV == "cpu":
        return torch.equal(x, y)
    return torch.allclose(x, y, rtol=1e-5, atol=1e-6)


def _rel(x, ref):
    return float((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def _hc_weights(cfg, seed=0, site="attn"):
    W = RandomWeights(cfg, seed=seed)
    p = f"{PREFIX}layers.0."
    return (W[p + f"hc_{site}_fn"].float(), W[p + f"hc_{site}_base"].float(), W[p + f"hc_{site}_scale"].float(),
            W[p + "input_layernorm.weight"])


def _to(dev, *ts):
    return [t.to(dev) for t in ts]


def _check_slots(part, X, fn):
    """The joined slots against fp64: GEMV sums and Gram matrix of every row."""
    rows = X.shape[0]
    part = part[:, :rows].double().cpu()
    flat = X.reshape(rows, -1).double()
    Xd = X.double()
    errs = {"mix": _rel(part[..., :24].sum(0), flat @ fn.double().t()),
            "gram": _rel(part[..., 24:40].sum(0), (Xd @ Xd.transpose(-1, -2)).reshape(rows, 16))}
    assert not torch.isnan(part).any(), "a slot word was not written"
    return errs


def _check_gate(cfg, X, fn, base, scale, nw, a, a32, coef, errs, tol):
    rows = X.shape[0]
    for name, t in (("a", a), ("a32", a32), ("coef", coef)):
        assert not torch.isnan(t.float()).any(), f"{name}: an element was not written"
    pre, post, comb = ops.hc_coeffs(X, fn, base, scale, cfg)
    x_in = (pre.unsqueeze(-1) * X).sum(-2)
    ref_a = ops.rms_norm(x_in, nw.float(), cfg.rms_norm_eps)
    errs.update({"pre": _rel(coef[:, :4], pre), "post": _rel(coef[:, 4:8], post),
                 "comb": _rel(coef[:, 8:], comb.reshape(rows, 16)), "a32": _rel(a32, ref_a)})
    print(" ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert all(v <= tol for v in errs.values()), errs
    # the bf16 hand-off is the fp32 row rounded (to nearest on the GPU, within one bf16 step here)
    if DEV == "cuda":
        assert torch.equal(a, a32.bfloat16())
    else:
        assert ((a.float() - a32).abs() <= BF16_ROUND * a32.abs()).all()


def _check_pre(cfg, X, fn, base, scale, nw, tol, **kw):
    a, a32, coef, part = mhc.hc_pre(*_to(DEV, X, fn, base, scale, nw), cfg, **kw)
    _check_gate(cfg, X, fn, base, scale, nw, a, a32, coef, _check_slots(part, X, fn), tol)
    return a, a32, coef, part


@pytest.mark.parametrize("rows", [1, 4], ids=lambda r: f"rows{r}")
def test_hc_pre_matches_reference(rows, gen, one_thread):
    cfg = preset("tiny")
    fn, base, scale, nw = _hc_weights(cfg)
    X = torch.randn(rows, 4, cfg.hidden_size, generator=gen)
    _check_pre(cfg, X, fn, base, scale, nw, 1e-5)


def test_hc_pre_odd_chunks_and_shape(gen, one_thread):
    # H = 320: not a multiple of BLOCK_H; chunk 96: a half-masked BLOCK_C step in every task, short last task;
    # fresh random fn/base large enough that softmax and Sinkhorn move far from uniform
    cfg = preset("tiny")
    H, rows = 320, 3
    fn = torch.randn(24, 4 * H, generator=gen) / (4 * H) ** 0.5 * 4
    base = torch.randn(24, generator=gen)
    scale = 1 + 0.1 * torch.randn(3, generator=gen)
    nw = (1 + 0.1 * torch.randn(H, generator=gen)).bfloat16()
    X = torch.randn(rows, 4, H, generator=gen) * 3
    _check_pre(cfg, X, fn, base, scale, nw, 1e-5, chunk=96, block_c=64, block_h=128)


def test_hc_pre_deterministic_and_batch_invariant(gen, one_thread):
    cfg = preset("tiny")
    fn, base, scale, nw = _to(DEV, *_hc_weights(cfg, site="ffn"))
    X = torch.randn(4, 4, cfg.hidden_size, generator=gen).to(DEV)
    first = mhc.hc_pre(X, fn, base, scale, nw, cfg)
    again = mhc.hc_pre(X, fn, base, scale, nw, cfg)
    for x, y in zip(first[:3], again[:3]):
        assert torch.equal(x, y)
    assert torch.equal(first[3][:, :4], again[3][:, :4])   # slots of pad rows are never written
    for r in range(4):
        alone = mhc.hc_pre(X[r:r + 1].contiguous(), fn, base, scale, nw, cfg)
        for x, y in zip(alone[:3], first[:3]):
            assert torch.equal(x[0], y[r]), f"row {r} differs alone vs among 4"
        assert torch.equal(alone[3][:, 0], first[3][:, r])


@pytest.mark.parametrize("rows", [1, 4], ids=lambda r: f"rows{r}")
def test_hc_post_matches_reference(rows, gen, one_thread):
    cfg = preset("tiny")
    fn, base, scale, _ = _hc_weights(cfg)
    H = cfg.hidden_size
    X = torch.randn(rows, 4, H, generator=gen)
    y = torch.randn(rows, H, generator=gen)
    pre, post, comb = ops.hc_coeffs(X, fn, base, scale, cfg)
    coef = torch.cat([pre, post, comb.reshape(rows, 16)], -1)
    ref = ops.hc_post(X, y, post, comb)
    out = mhc.hc_post(*_to(DEV, X, y, coef))
    assert not torch.isnan(out).any(), "an element was not written"
    err = _rel(out, ref)
    print(f"hc_post rows{rows}: rel err {err:.1e}")
    assert err <= 1e-6
    # bf16 sub-layer output (the o_proj / down hand-off), another tile width
    out_bf = mhc.hc_post(*_to(DEV, X, y.bfloat16(), coef), block_h=64)
    assert _rel(out_bf, ops.hc_post(X, y.bfloat16().float(), post, comb)) <= 1e-6
    # determinism and batch invariance
    assert torch.equal(out, mhc.hc_post(*_to(DEV, X, y, coef)))
    if rows > 1:
        alone = mhc.hc_post(*_to(DEV, X[-1:].contiguous(), y[-1:].contiguous(), coef[-1:].contiguous()))
        assert torch.equal(alone[0], out[-1])


@pytest.mark.parametrize("rows", [1, 4], ids=lambda r: f"rows{r}")
def test_hc_post_fused_with_next_partials(rows, gen, one_thread):
    # attn hc_post fused with the ffn hc_pre's partials; then the ffn gate row from those slots
    cfg = preset("tiny")
    fn, base, scale, _ = _hc_weights(cfg)
    fn2, base2, scale2, nw2 = _hc_weights(cfg, site="ffn")
    H = cfg.hidden_size
    X = torch.randn(rows, 4, H, generator=gen)
    y = torch.randn(rows, H, generator=gen).bfloat16()
    pre, post, comb = ops.hc_coeffs(X, fn, base, scale, cfg)
    coef = torch.cat([pre, post, comb.reshape(rows, 16)], -1)
    Xd = X.to(DEV)
    out, part = mhc.hc_post_fused(Xd, *_to(DEV, y, coef, fn2), chunk=96, block_c=32)
    assert not torch.isnan(out).any(), "an element was not written"
    assert torch.equal(Xd.cpu(), X), "X was modified (X' goes to its own buffer)"
    assert _same_bits(out, mhc.hc_post(*_to(DEV, X, y, coef)))             # as the plain tile
    Xn = ops.hc_post(X, y.float(), post, comb)
    errs = _check_slots(part, Xn, fn2)
    errs["X'"] = _rel(out, Xn)
    a, a32, coef2 = mhc.hc_finish(out, part, *_to(DEV, base2, scale2, nw2), cfg)
    _check_gate(cfg, Xn, fn2, base2, scale2, nw2, a, a32, coef2, errs, 1e-5)
    # determinism and batch invariance of the fused task
    again = mhc.hc_post_fused(*_to(DEV, X, y, coef, fn2), chunk=96, block_c=32)
    assert torch.equal(again[0], out) and torch.equal(again[1][:, :rows], part[:, :rows])
    alone = mhc.hc_post_fused(*_to(DEV, X[-1:].contiguous(), y[-1:].contiguous(), coef[-1:].contiguous(), fn2),
                              chunk=96, block_c=32)
    assert torch.equal(alone[0][0], out[-1]) and torch.equal(alone[1][:, 0], part[:, rows - 1])


# ---------------------------------------------------------------------------- GPU, real shapes
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 8], ids=lambda r: f"rows{r}")
def test_gpu_hc_real_shapes(rows):
    cfg = preset("glm53-flash")
    gen = torch.Generator().manual_seed(rows)
    fn, base, scale, nw = _hc_weights(cfg)
    X = torch.randn(rows, 4, cfg.hidden_size, generator=gen)
    a, a32, coef, _ = _check_pre(cfg, X, fn, base, scale, nw, 1e-2, chunk=128, block_c=32, block_h=512)
    y = torch.randn(rows, cfg.hidden_size, generator=gen)
    _, post, comb = ops.hc_coeffs(X, fn, base, scale, cfg)
    out = mhc.hc_post(*_to(DEV, X, y), coef, block_h=512)
    assert _rel(out, ops.hc_post(X, y, post, comb)) <= 1e-2
    fn2, base2, scale2, nw2 = _hc_weights(cfg, site="ffn")
    out2, part2 = mhc.hc_post_fused(*_to(DEV, X, y), coef, fn2.to(DEV), chunk=128, block_c=32)
    assert _same_bits(out2, out)
    Xn = out.cpu()
    a2, a2_32, coef2 = mhc.hc_finish(out2, part2, *_to(DEV, base2, scale2, nw2), cfg, block_h=512)
    _check_gate(cfg, Xn, fn2, base2, scale2, nw2, a2, a2_32, coef2, _check_slots(part2, Xn, fn2), 1e-2)
