"""GEMV task family (glm53_flash/kernels/gemv.py): accuracy vs an fp64 reference, every output written,
batch invariance (a row's bits do not depend on the other rows or their number), determinism, split-K,
and the device-function API driven the way a persistent launch drives it.

CPU: runs the kernels under TRITON_INTERPRET=1 (set by the root conftest.py) at small shapes. GPU (`gpu` marker): the real
24896 x 4096 shape, compiled, plus the register/spill budget of the default config.
"""
import pytest
import torch
import triton
import triton.language as tl

from glm53_flash.fp8 import dequantize_fp8, quantize_fp8
from glm53_flash.kernels.gemv import GemvConfig, default_config, gemv, gemv_finish, gemv_prefetch, gemv_store

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = GemvConfig(block_n=32, block_k=128, pf_k=128, num_stages=2)   # interpreter-friendly tiles
TOL = {torch.bfloat16: 1e-6, torch.float32: 5e-5}   # bf16 x: exact products; fp32 x: hi+lo ~16 bits


def _weights(n, k, fmt, gen):
    w = (torch.randn(n, k, generator=gen) / k ** 0.5)
    if fmt == "bf16":
        w = w.bfloat16()
        return w.to(DEV), None, w.double()
    q, s = quantize_fp8(w)
    return q.to(DEV), s.to(DEV), dequantize_fp8(q, s).double()


def _rel(y, ref):
    return float((y.double().cpu() - ref).norm() / ref.norm())


def _poisoned(rows, n, dtype=torch.float32):
    return torch.full((rows, n), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("rows", range(1, 9), ids=lambda r: f"rows{r}")
def test_matches_reference(rows, fmt, xdt):
    gen = torch.Generator().manual_seed(1000 * rows + (fmt == "fp8") * 10 + (xdt == torch.float32))
    n, k = 200, 384                                   # 200: partial last tile (and FP8 scale block)
    w, s, wref = _weights(n, k, fmt, gen)
    x = torch.randn(rows, k, generator=gen).to(xdt)
    out = _poisoned(rows, n)
    gemv(x.to(DEV), w, s, cfg=SMALL, out=out)
    assert torch.isfinite(out).all(), "an output element was not written"
    err = _rel(out, x.double() @ wref.T)
    print(f"rows{rows}-{fmt}-{xdt}: rel err {err:.2e}")
    assert err < TOL[xdt]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_odd_shapes_split_k_and_bf16_out(fmt):
    # N = 300 and K = 448 are not multiples of the tile or of the 128 scale block
    gen = torch.Generator().manual_seed(7)
    n, k, rows = 300, 448, 3
    w, s, wref = _weights(n, k, fmt, gen)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    ref = x.double() @ wref.T
    for cfg in (SMALL, GemvConfig(block_n=32, block_k=128, pf_k=128, split_k=2),
                GemvConfig(block_n=64, block_k=256, pf_k=64 if fmt == "bf16" else 128, num_stages=2),
                GemvConfig(block_n=256, block_k=128, pf_k=128, num_stages=2),    # FP8: 2 scale rows a tile
                GemvConfig(block_n=32, block_k=256, pf_k=128, k_split=2, num_warps=2)):
        out = _poisoned(rows, n)
        gemv(x.to(DEV), w, s, cfg=cfg, out=out)
        assert torch.isfinite(out).all()
        assert _rel(out, ref) < 1e-6, cfg
    y = gemv(x.to(DEV), w, s, cfg=SMALL, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16 and _rel(y, ref) < 1e-2
    y1 = gemv(x[0].to(DEV), w, s, cfg=SMALL)            # 1-D x -> 1-D y
    assert y1.shape == (n,) and torch.equal(y1, gemv(x[:1].to(DEV), w, s, cfg=SMALL)[0])


@pytest.mark.parametrize("split", ["split_k1", "split_k2", "k_split2"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_batch_invariance_and_determinism(fmt, split):
    gen = torch.Generator().manual_seed(11 + len(split))
    n, k = 96, 512
    w, s, _ = _weights(n, k, fmt, gen)
    cfg = GemvConfig(block_n=32, block_k=128, pf_k=128, split_k=2 if split == "split_k2" else 1,
                     k_split=2 if split == "k_split2" else 1)
    x8 = torch.randn(8, k, generator=gen).to(DEV)     # fp32 activations: the hi/lo path
    y8 = gemv(x8, w, s, cfg=cfg)
    assert torch.equal(y8, gemv(x8, w, s, cfg=cfg)), "two runs differ"
    other = torch.randn(8, k, generator=gen).to(DEV)
    for r in range(8):
        assert torch.equal(gemv(x8[r:r + 1], w, s, cfg=cfg)[0], y8[r]), f"row {r} alone differs"
        mixed = other.clone()
        mixed[r] = x8[r]
        assert torch.equal(gemv(mixed[: r + 1], w, s, cfg=cfg)[r], y8[r]), f"row {r} among others differs"


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32], ids=["xbf16", "xfp32"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_even_mask_free_is_bitwise_equal(fmt, xdt):
    # whole tiles (N % BLOCK_N == 0, K - PF_K % BLOCK_K == 0): the mask-free loop gives the masked one's bits
    from glm53_flash.kernels.gemv import is_even
    gen = torch.Generator().manual_seed(23)
    n, k, rows = 64, 384, 3
    w, s, wref = _weights(n, k, fmt, gen)
    x = torch.randn(rows, k, generator=gen).to(xdt).to(DEV)
    even = GemvConfig(block_n=32, block_k=128, pf_k=128, num_stages=2)
    assert is_even(n, k, k, even) and not is_even(n + 32 - 1, k, k, even) and not is_even(n, k + 128 + 64, k + 192, even)
    y = gemv(x, w, s, cfg=even)
    assert torch.equal(y, gemv(x, w, s, cfg=GemvConfig(**{**even.__dict__, "even": False})))
    assert _rel(y, x.double().cpu() @ wref.T) < TOL[xdt]


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_k_rotate(fmt):
    # standalone-only K rotation: start 0 keeps the prefetch+finish bits; a rotated start changes the order
    # per tile but stays accurate, deterministic and batch invariant; partial tiles and K wrap masked
    gen = torch.Generator().manual_seed(31)
    n, k = 96, 512
    w, s, wref = _weights(n, k, fmt, gen)
    x8 = torch.randn(8, k, generator=gen).bfloat16().to(DEV)
    base = GemvConfig(block_n=32, block_k=128, pf_k=128, num_stages=2)
    assert torch.equal(gemv(x8, w, s, cfg=GemvConfig(**{**base.__dict__, "k_rotate": 0})), gemv(x8, w, s, cfg=base))
    rot = GemvConfig(**{**base.__dict__, "k_rotate": 3})
    y8 = gemv(x8, w, s, cfg=rot)
    assert _rel(y8, x8.double().cpu() @ wref.T) < 1e-6
    assert torch.equal(y8, gemv(x8, w, s, cfg=rot)), "two runs differ"
    other = torch.randn(8, k, generator=gen).bfloat16().to(DEV)
    for r in (0, 3, 7):
        assert torch.equal(gemv(x8[r:r + 1], w, s, cfg=rot)[0], y8[r]), f"row {r} alone differs"
        mixed = other.clone()
        mixed[r] = x8[r]
        assert torch.equal(gemv(mixed[: r + 1], w, s, cfg=rot)[r], y8[r]), f"row {r} among others differs"
    # masked: N and K not whole tiles / steps (bk256 over K = 384: the last step half past k1)
    n2, k2 = 200, 384
    w2, s2, wref2 = _weights(n2, k2, fmt, gen)
    x3 = torch.randn(3, k2, generator=gen).bfloat16()
    for cfg in (GemvConfig(block_n=32, block_k=256, pf_k=128, num_stages=2, k_rotate=1),
                GemvConfig(block_n=64, block_k=128, pf_k=128, num_stages=2, k_rotate=1, split_k=2)):
        out = _poisoned(3, n2)
        gemv(x3.to(DEV), w2, s2, cfg=cfg, out=out)
        assert torch.isfinite(out).all()
        assert _rel(out, x3.double() @ wref2.T) < 1e-6, cfg
    assert not torch.equal(y8, gemv(x8, w, s, cfg=base)), "rotation changed no bits (did it run?)"
    with pytest.raises(ValueError, match="k_rotate"):
        GemvConfig(k_rotate=1, k_split=2)


def test_default_fp8_config_rotated():
    # gemv()'s FP8 default runs the rotated loop: accurate, deterministic, batch invariant at its own tile
    gen = torch.Generator().manual_seed(37)
    n, k = 128, 512                                    # 2 tiles of 64, 4 K steps: tile 1 starts at step 1
    w, s, wref = _weights(n, k, "fp8", gen)
    cfg = default_config(w)
    assert cfg.k_rotate >= 0 and default_config(torch.empty(1, 1, dtype=torch.bfloat16)).k_rotate < 0
    x8 = torch.randn(8, k, generator=gen).bfloat16().to(DEV)
    y8 = gemv(x8, w, s)
    assert _rel(y8, x8.double().cpu() @ wref.T) < 1e-6
    assert torch.equal(y8, gemv(x8, w, s))
    for r in (0, 6):
        assert torch.equal(gemv(x8[r:r + 1], w, s)[0], y8[r])
    assert torch.equal(y8, gemv(x8, w, s, cfg=GemvConfig(**{**cfg.__dict__, "even": False})))


@triton.jit
def _walk_tiles(x_ptr, w_ptr, s_ptr, y_ptr, rows, N, K, n_tiles,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_K: tl.constexpr, KSPLIT: tl.constexpr):
    # one program walks every tile in reverse, as a persistent CTA walks its task list
    t = n_tiles - 1
    while t >= 0:
        n0 = t * BLOCK_N
        w0 = gemv_prefetch(w_ptr, n0, 0, K, N, K, BLOCK_N, PF_K, KSPLIT)
        # (a persistent launch waits for x here)
        acc = gemv_finish(w0, w_ptr, s_ptr, x_ptr, K, rows, n0, 0, K, N, K, 8, BLOCK_N, BLOCK_K, PF_K, 2, KSPLIT)
        gemv_store(y_ptr, N, acc, rows, n0, N, 8, BLOCK_N)
        t -= 1


@pytest.mark.parametrize("ks", [1, 2], ids=["ks1", "ks2"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_device_api_tile_walk_is_bitwise_equal(fmt, ks):
    gen = torch.Generator().manual_seed(5)
    n, k, rows = 160, 384, 5
    w, s, _ = _weights(n, k, fmt, gen)
    x = torch.randn(rows, k, generator=gen).bfloat16().to(DEV)
    out = _poisoned(rows, n)
    n_tiles = triton.cdiv(n, 32)
    _walk_tiles[(1,)](x, w, w if s is None else s, out, rows, n, k, n_tiles, BLOCK_N=32, BLOCK_K=128, PF_K=128,
                      KSPLIT=ks)
    assert torch.isfinite(out).all()
    assert torch.equal(out, gemv(x, w, s, cfg=GemvConfig(block_n=32, block_k=128, pf_k=128, k_split=ks)))


def test_rejects_bad_inputs():
    w = torch.randn(64, 128).bfloat16().to(DEV)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(9, 128).to(DEV), w)
    with pytest.raises(ValueError, match="w must be"):
        gemv(torch.randn(2, 64).to(DEV), w)
    q, s = quantize_fp8(torch.randn(64, 128))
    with pytest.raises(ValueError, match="scales"):
        gemv(torch.randn(2, 128).to(DEV), q.to(DEV), None)
    with pytest.raises(ValueError, match="block_k"):
        gemv(torch.randn(2, 128).to(DEV), q.to(DEV), s.to(DEV), cfg=GemvConfig(block_k=64))
    with pytest.raises(ValueError, match="pf_k"):
        gemv(torch.randn(2, 128).to(DEV), q.to(DEV), s.to(DEV), cfg=GemvConfig(pf_k=64))
    with pytest.raises(ValueError, match="power of two"):
        GemvConfig(block_k=96)
    with pytest.raises(ValueError, match="MMA step"):
        GemvConfig(pf_k=256)
    with pytest.raises(ValueError, match="k_split"):
        GemvConfig(k_split=4)


# ------------------------------------------------------------ GPU (conftest skips these without CUDA)
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_real_shape(fmt):
    n, k = 24896, 4096                                # KDA in-projection, one rank at TP1
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5
    if fmt == "bf16":
        w, s = w.bfloat16(), None
        wref = w.float()
    else:
        q, s = quantize_fp8(w.cpu())
        wref = dequantize_fp8(q, s).cuda()
        w, s = q.cuda(), s.cuda()
    x8 = torch.randn(8, k, generator=gen, device="cuda").bfloat16()
    ref = (x8.double() @ wref.double().T)
    for cfg in (default_config(w), GemvConfig(), GemvConfig(num_warps=8), GemvConfig(block_n=128),
                GemvConfig(block_n=32, k_split=2, num_warps=2)):
        out = torch.full((8, n), float("nan"), device="cuda")
        gemv(x8, w, s, cfg=cfg, out=out)
        assert torch.isfinite(out).all()
        err = float((out.double() - ref).norm() / ref.norm())
        assert err < 1e-5, (cfg, err)
        assert torch.equal(out, gemv(x8, w, s, cfg=cfg))
        if cfg.k_split == 1:                      # mask-free (EVEN) and masked loops: the same bits
            assert torch.equal(out, gemv(x8, w, s, cfg=GemvConfig(**{**cfg.__dict__, "even": False})))
        for r in (0, 5):
            assert torch.equal(gemv(x8[r:r + 1], w, s, cfg=cfg)[0], out[r])
    # bits do not depend on the tile width, the warps, the stages or the padded row count (MMA elements
    # are independent); they may depend on k_split, like on BLOCK_K
    # (rows_pad=16 compiles to wgmma, whose FP8/f16 bits differed from mma.sync's on the H200: every width
    # uses rows_pad=8)
    pad16 = 16 if fmt == "bf16" else 8
    for ks, cfgs in ((1, (GemvConfig(num_warps=8), GemvConfig(rows_pad=pad16), GemvConfig(block_n=32),
                          GemvConfig(block_n=128, num_warps=2, num_stages=2))),
                     (2, (GemvConfig(block_n=64, num_warps=4), GemvConfig(block_n=16, num_warps=2, rows_pad=pad16)))):
        base = gemv(x8, w, s, cfg=GemvConfig(k_split=ks, num_warps=2, block_n=32))
        for cfg in cfgs:
            cfg = GemvConfig(**{**cfg.__dict__, "k_split": ks})
            assert torch.equal(gemv(x8, w, s, cfg=cfg), base), cfg


@pytest.mark.gpu
def test_gpu_register_budget():
    from glm53_flash.kernels.gemv import gemv_kernel
    for wdt, xdt in ((torch.bfloat16, torch.bfloat16), (torch.float8_e4m3fn, torch.bfloat16),
                     (torch.bfloat16, torch.float32), (torch.float8_e4m3fn, torch.float32)):
        w = torch.zeros(256, 1024, device="cuda").to(wdt)
        cfg = default_config(w)
        s = torch.ones(2, 8, device="cuda")
        x = torch.zeros(4, 1024, device="cuda", dtype=xdt)
        y = torch.empty(4, 256, device="cuda")
        ck = gemv_kernel.warmup(x, w, s if wdt != torch.bfloat16 else w, y, 4, 256, 1024, 1024, 256, 1024, 1024,
                                ROWS_PAD=cfg.rows_pad, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PF_K=cfg.pf_k,
                                NUM_STAGES=cfg.num_stages, KSPLIT=cfg.k_split, ROT=cfg.k_rotate,
                                num_warps=cfg.num_warps, grid=(1,))
        ck._init_handles()
        print(f"{wdt} x{xdt} {cfg}: {ck.n_regs} regs, {ck.n_spills} spills, {ck.metadata.shared} B smem")
        assert ck.n_spills == 0 and ck.n_regs <= 200


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_gpu_k_rotate(fmt):
    # the standalone rotated-K loop at the real shape: rot 0 == the prefetch+finish bits; rotated starts
    # accurate, deterministic, batch invariant
    n, k = 24896, 4096
    gen = torch.Generator(device="cuda").manual_seed(4)
    w = torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5
    if fmt == "bf16":
        w, s, wref = w.bfloat16(), None, w.bfloat16().float()
    else:
        q, s = quantize_fp8(w.cpu())
        wref = dequantize_fp8(q, s).cuda()
        w, s = q.cuda(), s.cuda()
    x8 = torch.randn(8, k, generator=gen, device="cuda").bfloat16()
    ref = x8.double() @ wref.double().T
    base = GemvConfig(block_n=64, block_k=128, pf_k=128, num_warps=4, num_stages=4)
    assert torch.equal(gemv(x8, w, s, cfg=GemvConfig(**{**base.__dict__, "k_rotate": 0})), gemv(x8, w, s, cfg=base))
    for cfg in (default_config(w), *(GemvConfig(**{**base.__dict__, "k_rotate": r}) for r in (1, 5, 13)),
                GemvConfig(block_n=32, block_k=256, num_warps=2, num_stages=4, k_rotate=5)):
        out = torch.full((8, n), float("nan"), device="cuda")
        gemv(x8, w, s, cfg=cfg, out=out)
        assert torch.isfinite(out).all()
        assert float((out.double() - ref).norm() / ref.norm()) < 1e-5, cfg
        assert torch.equal(out, gemv(x8, w, s, cfg=cfg))
        for r in (0, 5):
            assert torch.equal(gemv(x8[r:r + 1], w, s, cfg=cfg)[0], out[r])
