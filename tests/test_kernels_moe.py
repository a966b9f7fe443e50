"""MoE task family (glm53_flash/kernels/moe.py: router partials + select, expert slots, down tiles joining
k experts then the shared expert) against the fp32 reference (reference/ops.py moe_route, moe,
swiglu_clamped): expert ids equal, routing weights, activations and the FFN output within tolerance,
for bf16 and FP8 packed expert banks, 1 and 4 rows, the tiny config (8 experts, top-2) and a mid one
(16 experts, top-8, H 512); NaN / -1 poisoned outputs (every element written); router ties go to the
lower expert index (also across expert tiles and K parts); the SwiGLU clamp binding; bitwise
determinism and batch invariance; moe_down_group's merged routed loop bitwise equal to one loop per expert.
Last, the register budget of both FFN families (mlp and moe), compiled offline for sm_90 with Triton's bundled
ptxas: no GPU needed.

CPU: TRITON_INTERPRET=1, tiny shapes. GPU (`gpu` marker): 288 experts, top-8, H 4096, inter 2048.
"""
import pytest
import torch
import triton
import triton.language as tl

from glm53_flash.config import preset
from glm53_flash.fp8 import dequantize_fp8, quantize_fp8
from glm53_flash.kernels.gemv import default_config
from glm53_flash.kernels.moe import (moe_down_group, moe_forward, pack_experts, router_prefetch, router_slice_partial,
                                     router_topk)
from glm53_flash.reference import ops

DEV = "cuda" if torch.cuda.is_available() else "cpu"
KEYS = ("part", "ids", "rw", "act_s", "act_e", "y")


def _rel(x, ref):
    return float((x.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm())


def _cfg(name, **kw):
    cfg = preset("tiny")
    if name == "mid":
        cfg = cfg.replace(hidden_size=512, n_routed_experts=16, num_experts_per_tok=8)
    return cfg.replace(**kw) if kw else cfg


def _problem(cfg, fmt, gen):
    """Random router, correction bias, packed expert banks and shared expert (kernel form and fp32
    reference form), unit-variance gate/up outputs."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts

    def mk():
        return [torch.randn(I, H, generator=gen) / H ** 0.5, torch.randn(I, H, generator=gen) / H ** 0.5,
                torch.randn(H, I, generator=gen) / I ** 0.5]

    ex, sh = [mk() for _ in range(E)], mk()
    if fmt == "bf16":
        exk, shk = [[t.bfloat16() for t in e] for e in ex], [t.bfloat16() for t in sh]
        exr, shr = [[t.float() for t in e] for e in exk], [t.float() for t in shk]
    else:
        exk, shk = [[quantize_fp8(t) for t in e] for e in ex], [quantize_fp8(t) for t in sh]
        exr, shr = [[dequantize_fp8(*t) for t in e] for e in exk], [dequantize_fp8(*t) for t in shk]
    gu, dn = pack_experts(exk)
    to = (lambda t: tuple(u.to(DEV) for u in t) if isinstance(t, tuple) else t.to(DEV))
    return dict(wr=torch.randn(E, H, generator=gen) / H ** 0.5, bias=torch.randn(E, generator=gen) * 0.1,
                gu=to(gu), dn=to(dn), shared=[to(t) for t in shk], exr=exr, shr=shr)


def _run(cfg, x, p, **kw):
    return moe_forward(x.to(DEV), p["wr"].to(DEV), p["bias"].to(DEV), p["gu"], p["dn"], p["shared"], cfg, **kw)


def _check(cfg, x, p, tol, **kw):
    out = _run(cfg, x, p, **kw)
    for k in KEYS:
        assert not torch.isnan(out[k].float()).any(), f"{k}: an element was not written"
    assert (out["ids"] >= 0).all(), "ids: a record was not written"
    xf = x.float()
    w, idx = ops.moe_route(xf, p["wr"], p["bias"], cfg)
    assert torch.equal(out["ids"].long().cpu(), idx), (out["ids"], idx)
    lim = cfg.swiglu_limit
    act_e = torch.stack([torch.stack([ops.swiglu_clamped(xf[r] @ p["exr"][e][0].t(), xf[r] @ p["exr"][e][1].t(), lim)
                                      for e in idx[r].tolist()]) for r in range(x.shape[0])])
    ref = ops.moe(xf, p["wr"], p["bias"], lambda e: p["exr"][e], p["shr"], cfg)
    errs = dict(logit=_rel(out["part"].sum(0), xf @ p["wr"].t()), rw=_rel(out["rw"], w),
                act_s=_rel(out["act_s"], ops.swiglu_clamped(xf @ p["shr"][0].t(), xf @ p["shr"][1].t(), lim)),
                act_e=_rel(out["act_e"], act_e), y=_rel(out["y"], ref))
    print(" ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert errs["logit"] <= 1e-5 and errs["rw"] <= 1e-5, errs
    assert all(v <= tol for v in errs.values()), errs
    return out


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", [1, 4], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("name", ["tiny", "mid"])
def test_moe_matches_reference(name, rows, fmt, gen, one_thread):
    # bf16 activation hand-off: ~2^-9 relative per element; the router in two K parts
    cfg = _cfg(name)
    p = _problem(cfg, fmt, gen)
    _check(cfg, torch.randn(rows, cfg.hidden_size, generator=gen).bfloat16(), p, 5e-3, n_parts=2)


def test_moe_fp32_row_and_one_router_part(gen, one_thread):
    # the gate row handed over as fp32; fp32 activations (only fp32 / hi+lo rounding remains)
    cfg = _cfg("tiny")
    p = _problem(cfg, "bf16", gen)
    _check(cfg, torch.randn(3, cfg.hidden_size, generator=gen), p, 3e-5, n_parts=1, act_dtype=torch.float32)


def test_moe_swiglu_clamp_binds(gen, one_thread):
    # limit 0.5 against unit-variance gate/up: the clamp binds for most elements, and the reference
    # with and without it differs, so matching it to 3e-5 needs the clamp applied in the tasks
    cfg = _cfg("tiny", swiglu_limit=0.5)
    p = _problem(cfg, "bf16", gen)
    x = torch.randn(4, cfg.hidden_size, generator=gen).bfloat16()
    g = x.float() @ p["shr"][0].t()
    assert (g > 0.5).float().mean() > 0.2
    _check(cfg, x, p, 3e-5, act_dtype=torch.float32)
    free = ops.moe(x.float(), p["wr"], p["bias"], lambda e: p["exr"][e], p["shr"], _cfg("tiny", swiglu_limit=100.0))
    assert _rel(free, ops.moe(x.float(), p["wr"], p["bias"], lambda e: p["exr"][e], p["shr"], cfg)) > 0.1


@triton.jit
def _topk_kernel(logit, bias, ids_out, w_out, E, K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
    e = tl.arange(0, E_PAD)
    kk = tl.arange(0, K_PAD)
    ids, w = router_topk(tl.load(logit + e, mask=e < E, other=0.0), tl.load(bias + e, mask=e < E, other=0.0), E,
                         1.0, K, E_PAD, K_PAD, False)
    tl.store(ids_out + kk, ids)
    tl.store(w_out + kk, w)


@pytest.mark.parametrize("K", [1, 7, 8])
def test_topk_pairs_pick_as_sequential_maxima(K, gen, one_thread):
    """_topk_loop takes two keys per reduction (_top2): the ids are the reference's stable descending order of
    sigmoid(logit) + bias (ties to the lower index, -inf last), for odd and even K, entries past K stay 0, and the
    weights are the chosen experts' sigmoid scores. The choices are the kernel's own sigmoid: a tie the test makes
    with equal logits is a tie in both."""
    E, K_PAD = 288, 8
    for trial in range(3):
        lg = torch.randn(E, generator=gen)
        lg[torch.randperm(E, generator=gen)[:40]] = 1.5                  # exact ties among many
        b = torch.zeros(E)
        b[torch.randperm(E, generator=gen)[:5]] = float("-inf") if trial == 2 else 0.0
        ids, w = torch.full((K_PAD,), -7, dtype=torch.int32), torch.full((K_PAD,), float("nan"))
        _topk_kernel[(1,)](lg, b, ids, w, E, K=K, E_PAD=512, K_PAD=K_PAD)
        choice = torch.sigmoid(lg) + b
        want = torch.sort(choice, descending=True, stable=True).indices[:K]
        assert ids[:K].tolist() == want.tolist()
        assert ids[K:].tolist() == [0] * (K_PAD - K)
        assert torch.allclose(w[:K], torch.sigmoid(lg)[want], rtol=1e-6, atol=0)     # tl.sigmoid vs torch: ulps


@pytest.mark.parametrize("name", ["tiny", "mid"])
def test_router_ties_go_to_lower_index(name, gen, one_thread):
    # experts with identical router rows and biases tie exactly; put them in different expert tiles
    # (block_e 4) and the logits in two K parts: the lower indices must win, in ascending order
    cfg = _cfg(name)
    E, K, H = cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size
    p = _problem(cfg, "bf16", gen)
    x = torch.randn(2, H, generator=gen).bfloat16()
    tied = [E - 1, 1, 6, 3, 4, 10, 12, 9, 14, 7][:K + 1] if name == "mid" else [5, 2, 6]
    row = x[0].float() / x[0].float().norm() * 3.0            # a large logit for row 0
    p["wr"][tied] = row
    p["bias"][tied] = 0.25
    out = _run(cfg, x, p, n_parts=2, block_e=4)
    want = sorted(tied)[:K]
    assert out["ids"][0].tolist() == want, (out["ids"][0].tolist(), want)
    w, idx = ops.moe_route(x.float(), p["wr"], p["bias"], cfg)
    assert torch.equal(out["ids"].long().cpu(), idx)
    assert torch.equal(out["rw"][0].cpu(), torch.full((K,), cfg.routed_scaling_factor / K))   # equal shares


def test_moe_deterministic_and_batch_invariant(gen, one_thread):
    cfg = _cfg("tiny")
    p = _problem(cfg, "fp8", gen)
    x = torch.randn(4, cfg.hidden_size, generator=gen).bfloat16()
    first, again = _run(cfg, x, p, n_parts=2), _run(cfg, x, p, n_parts=2)
    for k in KEYS:
        assert torch.equal(first[k], again[k]), k
    for r in (0, 3):
        alone = _run(cfg, x[r:r + 1], p, n_parts=2)
        for k in KEYS:
            a, b = (alone[k][:, 0], first[k][:, r]) if k == "part" else (alone[k][0], first[k][r])
            assert torch.equal(a, b), f"{k}: row {r} differs alone vs among 4"


def test_moe_select_in_task_same_bits(gen, one_thread):
    # slots and down tiles that run the top-k themselves from the logit partials (no select hop; they
    # are handed a poisoned record) give the same bits as the record path
    cfg = _cfg("mid")
    p = _problem(cfg, "bf16", gen)
    x = torch.randn(1, cfg.hidden_size, generator=gen).bfloat16()
    rec, own = _run(cfg, x, p, n_parts=2), _run(cfg, x, p, n_parts=2, select_in_task=True)
    for k in KEYS:
        assert torch.equal(rec[k], own[k]), k


def test_moe_tp_partials(gen, one_thread):
    # TP 2: each rank owns half of every expert's (and the shared expert's) intermediate dim, the router
    # is replicated (same record on both ranks), and the per-rank down partials summed in rank order
    # give the MoE output
    cfg, tp = _cfg("tiny"), 2
    p = _problem(cfg, "bf16", gen)
    I = cfg.moe_intermediate_size
    h = I // tp
    x = torch.randn(3, cfg.hidden_size, generator=gen).bfloat16()
    E = cfg.n_routed_experts
    gu, dn = p["gu"].cpu(), p["dn"].cpu()
    outs = []
    for t in range(tp):
        cols = slice(t * h, (t + 1) * h)
        ex = [(gu[e, :I][cols], gu[e, I:][cols], dn[e][:, cols].contiguous()) for e in range(E)]
        wg, wu, wd = (u.cpu() for u in p["shared"])
        rank = dict(p, shared=[wg[cols].to(DEV), wu[cols].to(DEV), wd[:, cols].contiguous().to(DEV)])
        rank["gu"], rank["dn"] = (u.to(DEV) for u in pack_experts(ex))
        outs.append(_run(cfg, x, rank, n_parts=2))
    assert torch.equal(outs[0]["ids"], outs[1]["ids"]) and torch.equal(outs[0]["rw"], outs[1]["rw"])
    y = outs[0]["y"]
    for o in outs[1:]:
        y = y + o["y"]
    ref = ops.moe(x.float(), p["wr"], p["bias"], lambda e: p["exr"][e], p["shr"], cfg)
    assert _rel(y, ref) <= 5e-3, _rel(y, ref)


def test_moe_rejects_bad_inputs(gen):
    cfg = _cfg("tiny")
    p = _problem(cfg, "bf16", gen)
    x = torch.randn(2, cfg.hidden_size, generator=gen).bfloat16()
    with pytest.raises(ValueError):
        moe_forward(x, p["wr"].bfloat16(), p["bias"], p["gu"], p["dn"], p["shared"], cfg)  # router must be fp32
    with pytest.raises(ValueError):
        moe_forward(x, p["wr"], p["bias"], p["gu"], p["dn"], p["shared"], _cfg("mid"))    # wrong E / H
    g = [quantize_fp8(torch.randn(64, 256)) for _ in range(3)]
    with pytest.raises(ValueError):
        pack_experts([(g[0], g[1], g[2])])                         # FP8 gate|up blocks would straddle


# ---------------------------------------------------------------------------- GPU, real shapes
def _gpu_problem(cfg, fmt, gen):
    """Real-shape banks made on the GPU (288 experts: 14 GB in bf16): random bf16, or random e4m3 codes
    with random block scales (the vendor format, without quantising 288 experts on the CPU)."""
    H, I, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts

    def bank(*shape, fan_in):
        w = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        if fmt == "bf16":
            return w.div_(fan_in ** 0.5), None
        s = (torch.rand(*shape[:-2], shape[-2] // 128, shape[-1] // 128, device="cuda", generator=gen) + 0.5)
        return w.mul_(64).to(torch.float8_e4m3fn), s.div_(64 * fan_in ** 0.5).contiguous()

    def deq(w, s):
        return w.float() if s is None else w.float() * s.repeat_interleave(128, -2).repeat_interleave(128, -1)

    gu, dn = bank(E, 2 * I, H, fan_in=H), bank(E, H, I, fan_in=I)
    sh = [bank(I, H, fan_in=H), bank(I, H, fan_in=H), bank(H, I, fan_in=I)]
    shk = [t if s is None else (t, s) for t, s in sh]
    ex = (lambda e: (deq(gu[0][e, :I], None if gu[1] is None else gu[1][e, :I // 128]),
                     deq(gu[0][e, I:], None if gu[1] is None else gu[1][e, I // 128:]),
                     deq(dn[0][e], None if dn[1] is None else dn[1][e])))
    return dict(wr=torch.randn(E, H, device="cuda", generator=gen) / H ** 0.5,
                bias=torch.randn(E, device="cuda", generator=gen) * 0.1,
                gu=gu[0] if gu[1] is None else gu, dn=dn[0] if dn[1] is None else dn, shared=shk,
                ex=ex, shr=[deq(*t) for t in sh])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_moe_real_shapes(fmt):
    cfg = preset("glm53-flash")
    gen = torch.Generator(device="cuda").manual_seed(3)
    p = _gpu_problem(cfg, fmt, gen)
    gcfg = default_config(p["shared"][0] if fmt == "bf16" else p["shared"][0][0])
    for rows in (1, 4, 8):
        x = torch.randn(rows, cfg.hidden_size, device="cuda", generator=gen).bfloat16()
        kw = dict(cfg=gcfg, n_parts=4, block_e=32)
        out = moe_forward(x, p["wr"], p["bias"], p["gu"], p["dn"], p["shared"], cfg, **kw)
        for k in KEYS:
            assert not torch.isnan(out[k].float()).any(), k
        w, idx = ops.moe_route(x.float(), p["wr"], p["bias"], cfg)
        assert torch.equal(out["ids"].long(), idx)
        ref = ops.moe(x.float(), p["wr"], p["bias"], p["ex"], p["shr"], cfg)
        err = _rel(out["y"], ref)
        print(f"{fmt} rows{rows}: y rel err {err:.1e}, rw {_rel(out['rw'], w):.1e}")
        assert err <= 1e-2 and _rel(out["rw"], w) <= 1e-5
        again = moe_forward(x, p["wr"], p["bias"], p["gu"], p["dn"], p["shared"], cfg, **kw)
        alone = moe_forward(x[-1:], p["wr"], p["bias"], p["gu"], p["dn"], p["shared"], cfg, **kw)
        for k in KEYS:
            assert torch.equal(out[k], again[k]), k
        assert torch.equal(alone["y"][0], out["y"][-1]) and torch.equal(alone["ids"][0], out["ids"][-1])


# ---------------------------------------------------------------------------- registers, without a GPU
_DIVISIBLE = ("stride_x", "stride_a", "stride_y", "I", "H", "I_s", "split_len")   # int args a launch passes as multiples of 16


_F, _B, _Q, _C = "*fp32", "*bf16", "*fp8e4nv", "constexpr"
_GEMV = dict(ROWS_PAD=_C, BLOCK_K=_C, PF_K=_C, NUM_STAGES=_C)


def _gemv_consts(pf_k=128, stages=3):
    return dict(ROWS_PAD=8, BLOCK_K=128, PF_K=pf_k, NUM_STAGES=stages)


def _gateup(w, pf_k=128, stages=3):
    sig = dict(x=_B, stride_x="i32", wg=w, wu=w, sg=_F, su=_F, act=_B, stride_a="i32", rows="i32", I="i32",
               H="i32", limit="fp32", ROWS_PAD=_C, BLOCK_I=_C, BLOCK_K=_C, PF_K=_C, NUM_STAGES=_C)
    return ["mlp", "mlp_gateup_kernel", sig, dict(BLOCK_I=64, **_gemv_consts(pf_k, stages)), 4]


def _down(w):
    sig = dict(act=_B, stride_a="i32", wd=w, sd=_F, y=_F, stride_y="i32", rows="i32", I="i32", H="i32",
               ROWS_PAD=_C, BLOCK_N=_C, BLOCK_K=_C, PF_K=_C, NUM_STAGES=_C)
    return ["mlp", "mlp_down_kernel", sig, dict(BLOCK_N=64, **_gemv_consts()), 4]


_SEL_ARGS = dict(part=_F, n_parts="i32", rows="i32", bias=_F, scaling="fp32")
_SEL_CONSTS = dict(SELECT=_C, E_PAD=_C, K_PAD=_C, RENORM=_C)


def _sel(select):
    return dict(SELECT=select, E_PAD=512, K_PAD=8, RENORM=True)


def _expert(w, select=False):
    sig = dict(x=_B, stride_x="i32", ids_rec="*i32", w_gu=w, s_gu=_F, act_e=_B, E="i32", I="i32", H="i32",
               limit="fp32", **_SEL_ARGS, K=_C, ROWS_PAD=_C, BLOCK_I=_C, BLOCK_K=_C, PF_K=_C, NUM_STAGES=_C,
               **_SEL_CONSTS)
    return ["moe", "expert_gateup_kernel", sig, dict(K=8, BLOCK_I=64, **_gemv_consts(), **_sel(select)), 4]


def _moe_down(w, stages=3, select=False):
    sig = dict(act_s=_B, ids_rec="*i32", rw_rec=_F, act_e=_B, wd_s=w, sd_s=_F, w_d=w, s_d=_F, y=_F, E="i32",
               H="i32", I="i32", I_s="i32", **_SEL_ARGS, K=_C, ROWS_PAD=_C, BLOCK_N=_C, BLOCK_K=_C, PF_K=_C,
               NUM_STAGES=_C, **_SEL_CONSTS)
    return ["moe", "moe_down_kernel", sig, dict(K=8, BLOCK_N=64, **_gemv_consts(stages=stages), **_sel(select)), 4]


_ROUTER = ["moe", "router_partial_kernel",
           dict(x=_B, stride_x="i32", wr=_F, part=_F, rows="i32", E="i32", H="i32", split_len="i32", ROWS_PAD=_C,
                BLOCK_E=_C, CK=_C, NUM_STAGES=_C), dict(ROWS_PAD=8, BLOCK_E=32, CK=32, NUM_STAGES=3), 4]
_SELECT = ["moe", "router_select_kernel",
           dict(part=_F, n_parts="i32", rows="i32", bias=_F, ids_out="*i32", w_out=_F, E="i32", scaling="fp32",
                K=_C, E_PAD=_C, K_PAD=_C, RENORM=_C), dict(K=8, E_PAD=512, K_PAD=8, RENORM=True), 4]

# (variant, register budget at 4 warps, 64-wide tiles, BLOCK_K 128); measured with triton 3.6's ptxas:
@triton.jit
def _router_slice_kernel(wr, x, part, rows, k0, k1, E: tl.constexpr, H: tl.constexpr, BLOCK_E: tl.constexpr,
                         CK: tl.constexpr):
    e0 = tl.program_id(0) * BLOCK_E
    w0 = router_prefetch(wr, e0, k0, k1, E, H, BLOCK_E, CK)
    w1 = router_prefetch(wr, e0, k0 + CK, k1, E, H, BLOCK_E, CK)
    router_slice_partial(part, w0, w1, x, H, rows, e0, k0, k1, E, 1, 8, BLOCK_E, CK)


@pytest.mark.parametrize("rows", [1, 3, 8], ids=lambda r: f"rows{r}")
def test_router_slice_partial(rows, gen, one_thread):
    """The launches' router partial in its slice form (kernels/moe.py router_slice_partial; launches/ffn_tasks.py
    router_task): two CK-wide register tiles cover the K range [k0, k1) (here 48 of 64 columns, the second tile
    half masked), 40 experts over two 32-expert tiles (the second mostly past E): the fp32 logits of each row
    within fp32 rounding of x @ W^T, rows past `rows` and columns past E untouched (NaN-poisoned), and each row's
    bits the same whatever the row count (it is computed alone in every case)."""
    E, H, k0, k1, CK, BE = 40, 256, 64, 112, 32, 32
    wr = torch.randn(E, H, generator=gen) / H ** 0.5
    x = torch.randn(8, H, generator=gen).bfloat16()
    outs = {}
    for n in (rows, 1):
        part = torch.full((8, E), float("nan"))
        _router_slice_kernel[(triton.cdiv(E, BE),)](wr, x, part, n, k0, k1, E=E, H=H, BLOCK_E=BE, CK=CK)
        outs[n] = part
    part = outs[rows]
    want = x[:rows, k0:k1].double() @ wr[:, k0:k1].double().T
    assert not torch.isnan(part[:rows]).any() and torch.isnan(part[rows:]).all()
    assert torch.allclose(part[:rows].double(), want, rtol=0, atol=1e-5)
    assert torch.equal(part[:1], outs[1][:1])


_COMPILE_SLICE = r"""
import json, sys, triton
sys.path.insert(0, "tests")
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from test_kernels_moe import _router_slice_kernel as k
sig = {n: "i32" for n in k.arg_names}
sig.update(wr="*fp32", x="*bf16", part="*fp32", E="constexpr", H="constexpr", BLOCK_E="constexpr", CK="constexpr")
attrs = {(k.arg_names.index(n),): [["tt.divisibility", 16]] for n in ("wr", "x", "part")}   # as the launches'
ck = triton.compile(ASTSource(fn=k, signature=sig, constexprs={"E": 288, "H": 4096, "BLOCK_E": 32, "CK": 128},
                              attrs=attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
print(json.dumps({"ptx": ck.asm["ptx"]}))
"""


def test_sm90_router_slice_loads_first():
    """The slice form at the launches' shape (32 experts x 2 tiles of 128 columns): every row's x is loaded (16
    cache-global loads: 8 rows x 2 tiles) before the first CTA barrier, so 8 rows cost one round trip, and x meets w
    in w's layout (no MMA; a [1, CK] load gets another layout, and the barrier of its conversion after every load
    serialised the rows in the first build)."""
    from test_sync import sm90_ptx
    from glm53_flash.sm90_regs import ptxas_available
    if not ptxas_available():
        pytest.skip("Triton's bundled ptxas is missing")
    lines = sm90_ptx(_COMPILE_SLICE).splitlines()
    loads = [i for i, ln in enumerate(lines) if "ld.global.cg" in ln]
    bars = [i for i, ln in enumerate(lines) if "bar.sync" in ln]
    assert len(loads) == 16
    assert not bars or max(loads) < min(bars)
    assert not any("mma" in ln for ln in lines)


# gate|up bf16 146 (PF_K 64 + 2 stages: 80), FP8 134; down 72 / 72; expert gate|up 144 / 128;
# MoE down 146 (2 stages: 114) / 120; router partial 64; router select 88 (its 16 planes in flight: 64 registers)
BUDGETS = [
    (_gateup(_B), 160), (_gateup(_B, pf_k=64, stages=2), 96), (_gateup(_Q), 160), (_down(_B), 96), (_down(_Q), 96),
    (_expert(_B), 160), (_expert(_Q), 160), (_moe_down(_B), 160), (_moe_down(_B, stages=2), 128),
    (_moe_down(_Q), 160), (_ROUTER, 80), (_SELECT, 96), (_expert(_B, select=True), 160),
    (_moe_down(_B, select=True), 176),     # its router_select's 16 planes in flight beside the down prefetch: 162
]


def test_offline_sm90_registers():
    """Compile the real-shape FFN task kernels (mlp and moe) for sm_90 with Triton's bundled ptxas, no GPU
    needed: no spills, registers within budget (a persistent launch inherits the max)."""
    from glm53_flash.sm90_regs import kernel_registers, ptxas_available
    if not ptxas_available():
        pytest.skip("Triton's bundled ptxas is missing")
    stats = kernel_registers([[f"glm53_flash.kernels.{v[0]}", *v[1:], list(_DIVISIBLE)] for v, _ in BUDGETS])
    for s, (_, budget) in zip(stats, BUDGETS):
        print(f"{s['kernel']} {s['consts']} warps{s['warps']}: {s['regs']} regs, {s['spill']} B spilled")
        assert s["spill"] == 0 and s["regs"] <= budget, (s, budget)


# ---------------------------------------------------------------------------- the merged down loop


@triton.jit
def _down_group_kernel(wd_s, sd_s, act_s, ids, rw, act_e, w_d, s_d, y, j0, j1, E, H, I_s, I: tl.constexpr,
                       K: tl.constexpr, BLOCK_N: tl.constexpr, MERGED: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    acc = moe_down_group(wd_s, sd_s, act_s, ids, rw, act_e, w_d, s_d, n0, j0, j1, E, H, I, I_s, 8, BLOCK_N, 128, 3,
                         K, MERGED)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(y + offs_n, tl.sum(tl.where(tl.arange(0, 8)[None, :] == 0, acc, 0.0), axis=1), mask=offs_n < H)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("j0, j1, same_i", [(0, 3, 0), (3, 6, 0), (6, 9, 0), (0, 2, 0), (7, 9, 0), (6, 9, 1), (7, 9, 1)],
                         ids=lambda v: str(v))
def test_merged_down_loop_same_bits(fmt, j0, j1, same_i, gen, one_thread):
    """moe_down_group with the routed experts of a group in one pipelined loop (MERGED, the launches' form) gives the
    same bits as one gemv_stream per expert, for full groups, the group holding the shared expert (j1 = K + 1) and
    short ones (fewer routed slots than the loop's three accumulators); bf16 (with a partial last K step) and FP8.
    same_i: the shared expert as wide as a routed one (the model's shapes), so it joins the merged loop as the slot
    after the group's routed ones (its weight 1.0); otherwise it keeps its own gemv_stream after the loop."""
    E, H, I, K, BN = 6, 128, (256 if fmt == "fp8" else 192), 8, 64     # bf16: a masked last K step
    I_s = I if same_i else 128
    w = torch.randn(E, H, I, generator=gen) * 0.05
    ws = torch.randn(H, I_s, generator=gen) * 0.05
    if fmt == "fp8":
        q, sc = zip(*(quantize_fp8(w[e]) for e in range(E)))
        w_d, s_d = torch.stack(q).contiguous(), torch.stack(sc).contiguous()
        wd_s, sd_s = quantize_fp8(ws)
    else:
        w_d, wd_s = w.to(torch.bfloat16), ws.to(torch.bfloat16)
        s_d, sd_s = torch.zeros(1), torch.zeros(1)
    act_e = torch.randn(K, I, generator=gen).to(torch.bfloat16)
    act_s = torch.randn(I_s, generator=gen).to(torch.bfloat16)
    ids = torch.randint(0, E, (K,), generator=gen, dtype=torch.int32)
    rw = torch.rand(K, generator=gen)
    out = []
    for merged in (0, 3):
        y = torch.full((H,), float("nan"))
        _down_group_kernel[(H // BN,)](wd_s, sd_s, act_s, ids, rw, act_e, w_d, s_d, y, j0, j1, E, H, I_s, I=I, K=K,
                                       BLOCK_N=BN, MERGED=merged)
        out.append(y)
    assert not out[1].isnan().any()
    assert torch.equal(out[0].view(torch.int32), out[1].view(torch.int32))
