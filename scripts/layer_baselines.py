"""Layer kinds for scripts/time_layers.py: one rank's random weights made on the device, the bytes each
launch must read (its floor, DESIGN.md §8), and the same layer as torch ops (the baseline).

Why a module of its own: bench_timing.py owns the measuring (read bandwidth, interleaved CUDA-graph
timing, the card); this module owns what a layer *is* for a benchmark, so the byte accounting can be
tested on the CPU against a hand count (tests/test_time_layers.py) without timing anything.

- `RankSource`: a duck-typed loaded Checkpoint of one TP rank (`weights`, `scales`, `tp_rank`,
  `tp_size`, `config`, `format`) whose tensors are generated on first access *directly at this rank's
  piece shape on the device* (torch.randn on the GPU, scaled as weights.random_tensor scales them; FP8
  as e4m3 codes with 128x128 block scales ~ 1/64 so dequantized weights keep the bf16 scale). Nothing
  GB-sized is ever made on the CPU. The launches take it as they take a Checkpoint
  (launches/layer_host.py `rank_tensors`).
- `launch_bytes(kind, ...)`: bytes one launch of `kind` must move, by component (weights of this rank
  without the routed experts, the routed experts actually chosen, state and window read + written,
  the latent rows selected, the pooled keys scored, activations in and out).
- `Baseline*`: the layer as torch ops on the same rank pieces: bf16 weights, cuBLAS GEMVs
  (`a @ W.T`), the reference's fp32 math (glm53_flash/reference/ops.py) between them, static buffers
  so it can be captured in a CUDA graph. MoE: routed experts through `torch._grouped_mm` on CUDA when
  it works, else an `index_select` gather of the chosen experts + `bmm` (named in the case label).
  TP > 1: one rank's partial sums only (like the launch in loopback with zero peers; no all-reduce).
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping

import torch

from glm53_flash import tp as tp_mod
from glm53_flash.reference import ops
from glm53_flash.weights import LM_HEAD, PREFIX, layer_specs, weight_specs

EMBED = PREFIX + "embed_tokens.weight"
FP8_SCALE = 1.0 / 64          # block scale of generated FP8 codes: dequantized ~ N(0, 1/fan_in) as bf16


# ------------------------------------------------------------------------------------ rank weights
def piece_fp8(spec, tp: int, fmt: str) -> bool:
    """Does this rank hold the tensor in FP8 (tp.py's rule: block-aligned pieces keep FP8)?"""
    return fmt == "fp8" and spec.fp8 and tp_mod.fp8_keeps_scales(spec, tp)


def piece_bytes(spec, tp: int, fmt: str) -> int:
    """Bytes of this rank's piece of `spec` (+ its FP8 scale grid)."""
    shape = tp_mod.local_shape(spec, tp)
    n = math.prod(shape)
    if piece_fp8(spec, tp, fmt):
        return n + math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128) * 4
    return n * spec.dtype.itemsize


def _gen(spec, shape, device) -> torch.Tensor:
    """fp32 random values at the init rule's scale (weights.random_tensor's rules, made on `device`)."""
    x = torch.randn(shape, device=device)
    r, f = spec.init, max(spec.fan_in, 1)
    if r in ("linear", "mirrored_heads"):
        x *= f ** -0.5
    elif r in ("residual", "hc_fn"):
        x *= 0.5 * f ** -0.5
    elif r == "norm":
        x = 1.0 + 0.1 * x
    elif r == "bias":
        x *= 0.1
    elif r in ("small", "conv", "a_log"):
        x *= 0.5
    return x


class _Lazy(Mapping):
    def __init__(self, src: "RankSource", scales: bool):
        self.src, self.is_scales = src, scales

    def __getitem__(self, name):
        w, s = self.src.get(name)
        if self.is_scales:
            if s is None:
                raise KeyError(name)
            return s
        return w

    def __contains__(self, name):
        if not self.is_scales:
            return name in self.src.specs
        return name in self.src.specs and piece_fp8(self.src.specs[name], self.src.tp_size, self.src.format)

    def __iter__(self):
        return iter(n for n in self.src.specs if n in self)

    def __len__(self):
        return sum(1 for _ in self)


class RankSource:
    """One TP rank's random weights, generated on `device` at piece shapes on first access (cached until
    `release()`, so a baseline can be built from the very tensors the launch was given)."""

    def __init__(self, cfg, tp_rank: int, tp_size: int, fmt: str, device, seed: int = 0):
        self.config, self.tp_rank, self.tp_size, self.format = cfg, tp_rank, tp_size, fmt
        self.device, self.seed = torch.device(device), seed
        self.specs = weight_specs(cfg)
        self.weights, self.scales = _Lazy(self, False), _Lazy(self, True)
        self._cache: dict[str, tuple] = {}

    def get(self, name: str):
        if name not in self._cache:
            spec = self.specs[name]
            shape = tp_mod.local_shape(spec, self.tp_size)
            x = _gen(spec, shape, self.device)
            if piece_fp8(spec, self.tp_size, self.format):
                grid = (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
                s = FP8_SCALE * (1 + 0.05 * torch.rand(grid, device=self.device))
                full = s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
                w = (x / full).clamp(-448, 448).to(torch.float8_e4m3fn)
                self._cache[name] = (w, s)
            else:
                self._cache[name] = (x.to(spec.dtype).contiguous(), None)
        return self._cache[name]

    def bf16(self, name: str) -> torch.Tensor:
        """The piece as bf16 (FP8 dequantized) for the torch baseline."""
        w, s = self.get(name)
        if s is None:
            return w.to(torch.bfloat16) if w.dtype != torch.float32 else w
        full = s.repeat_interleave(128, 0)[: w.shape[0]].repeat_interleave(128, 1)[:, : w.shape[1]]
        return (w.float() * full).to(torch.bfloat16)

    def release(self) -> None:
        self._cache.clear()


# ------------------------------------------------------------------------------------ byte accounting
def layer_of(cfg, kind: str) -> int:
    if kind == "nextn":
        return cfg.num_hidden_layers
    return next(p.index for p in cfg.layers if p.launch == kind)


def resident_bytes(cfg, kind: str, tp: int, fmt: str) -> int:
    """Bytes of one copy of this rank's tensors of the launch (all experts: what memory must hold)."""
    if kind == "tail":
        return piece_bytes(weight_specs(cfg)[LM_HEAD], tp, fmt)
    n = sum(piece_bytes(s, tp, fmt) for s in layer_specs(cfg, layer_of(cfg, kind)))
    if kind in ("embed", "nextn"):
        n += piece_bytes(weight_specs(cfg)[EMBED], tp, fmt)
    if kind == "nextn":
        n += piece_bytes(weight_specs(cfg)[LM_HEAD], tp, fmt)
    return n


def selected_tokens(cfg, pos: int) -> int:
    """Latent rows a query at `pos` attends to (reference ops.indexer_select)."""
    P = (pos + 1) // cfg.index_kpool
    if P <= cfg.index_topk_pools:
        return pos + 1
    return cfg.index_topk_pools * cfg.index_kpool + (pos + 1 - P * cfg.index_kpool)


def launch_bytes(kind: str, cfg, tp: int, rows: int, fmt: str, pos: int = 0, n_routed: int | None = None,
                 logits: bool = True) -> dict[str, int]:
    """Bytes one launch of `kind` (one rank) must move, by component (ordered).

    weights: every tensor of the layer this rank holds except routed experts (+ FP8 scales);
    routed experts: `n_routed` distinct experts (default rows x top-k, capped by E) at this rank's piece;
    kda state [rows, nh/tp, 128, 128] fp32 and conv window [rows, K-1, 3D/tp] fp32, each read + written;
    DSA caches: latent rows selected (bf16), pooled keys scored (bf16, only in the sparse regime, where
    the indexer must score them), the open pool's ring rows (fp32), and this token's writes;
    activations: X [rows, 4, H] fp32 read + X' written (embed: the embedding rows; nextn: hidden in,
    z and n out, + the draft logits' lm_head shard when `logits`)."""
    specs = weight_specs(cfg)
    H = cfg.hidden_size
    out: dict[str, int] = {}
    if kind == "tail":
        out["lm_head"] = piece_bytes(specs[LM_HEAD], tp, fmt)
        out["norm"] = H * 2
        out["X in"] = rows * cfg.hc_mult * H * 4
        return out
    L = layer_of(cfg, kind)
    lay = layer_specs(cfg, L)
    exp = [s for s in lay if ".mlp.experts." in s.name]
    shared = [s for s in lay if ".mlp.shared_experts." in s.name]
    rest = [s for s in lay if s not in exp and s not in shared]
    out["weights"] = sum(piece_bytes(s, tp, fmt) for s in rest)
    if shared:
        out["shared expert"] = sum(piece_bytes(s, tp, fmt) for s in shared)
    if exp:
        per = sum(piece_bytes(s, tp, fmt) for s in exp) // cfg.n_routed_experts
        n = n_routed if n_routed is not None else min(rows * cfg.num_experts_per_tok, cfg.n_routed_experts)
        out[f"routed experts ({n})"] = n * per
    if kind in ("embed", "dense", "kda"):
        nh, d = cfg.linear_num_heads // tp, cfg.linear_head_dim
        out["kda state r+w"] = 2 * rows * nh * d * d * 4
        out["conv window r+w"] = 2 * rows * (cfg.linear_conv_kernel_dim - 1) * 3 * nh * d * 4
    if kind in ("sparse", "nextn"):
        C, DI, KP = cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_kpool
        P = (pos + 1) // KP
        out["latent rows selected"] = rows * selected_tokens(cfg, pos) * C * 2
        out["pool keys scored"] = rows * P * DI * 2 if P > cfg.index_topk_pools else 0
        out["ring rows"] = rows * KP * 2 * DI * 4
        out["cache writes"] = rows * (C * 2 + 2 * DI * 4 + (DI * 2 if (pos + 1) % KP == 0 else 0))
    if kind == "embed":
        out["embed rows"] = rows * H * 2
        out["X' out"] = rows * cfg.hc_mult * H * 4
    elif kind == "nextn":
        out["embed rows"] = rows * H * 2
        out["hidden in, z + n out"] = 3 * rows * H * 4
        if logits:
            out["draft lm_head"] = piece_bytes(specs[LM_HEAD], tp, fmt)
    else:
        out["X in + X' out"] = 2 * rows * cfg.hc_mult * H * 4
    return out


# ------------------------------------------------------------------------------------ torch baselines
def _lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """bf16 GEMV through cuBLAS (x [rows, K] bf16, w [N, K] bf16) -> [rows, N] bf16."""
    return x @ w.t()


class MoeBaseline:
    """Sigmoid router + top-k + routed experts + shared expert as torch ops. mode: 'grouped'
    (torch._grouped_mm over the packed banks, CUDA) or 'gather' (index_select the chosen experts, bmm)."""

    def __init__(self, src: RankSource, p: str, cfg, mode: str):
        m = p + "mlp."
        E = cfg.n_routed_experts
        self.cfg, self.mode, self.E, self.K = cfg, mode, E, cfg.num_experts_per_tok
        self.W_r = src.get(m + "gate.weight")[0].float()
        self.bias = src.get(m + "gate.e_score_correction_bias")[0].float()
        self.sh = (torch.cat([src.bf16(m + f"shared_experts.{n}_proj.weight") for n in ("gate", "up")]),
                   src.bf16(m + "shared_experts.down_proj.weight"))
        d0 = src.bf16(f"{m}experts.0.down_proj.weight")
        H, I = d0.shape
        gu = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=d0.device)    # filled in place: no
        dn = torch.empty(E, H, I, dtype=torch.bfloat16, device=d0.device)        # transient lists
        for e in range(E):
            gu[e, :I] = src.bf16(f"{m}experts.{e}.gate_proj.weight")
            gu[e, I:] = src.bf16(f"{m}experts.{e}.up_proj.weight")
            dn[e] = src.bf16(f"{m}experts.{e}.down_proj.weight")
        self.I = I
        self.gu, self.dn = gu, dn
        self.gu_t, self.dn_t = gu.transpose(1, 2), dn.transpose(1, 2)   # [E, K, N], K contiguous (column-major B)
        self.idx = None
        self.checked = False

    def _experts(self, a, flat, mode):
        """Routed experts' outputs [rows*K, H] bf16, in (row, rank) order."""
        K, I, cfg = self.K, self.I, self.cfg
        xr = a.repeat_interleave(K, 0)                                          # [rows*K, H]
        if mode == "grouped":
            order = torch.argsort(flat, stable=True)
            counts = torch.zeros(self.E, dtype=torch.int32, device=a.device).scatter_add_(
                0, flat, torch.ones_like(flat, dtype=torch.int32))
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = torch._grouped_mm(xr[order], self.gu_t, offs=offs)             # [rows*K, 2I]
            act = ops.swiglu_clamped(h[:, :I].float(), h[:, I:].float(), cfg.swiglu_limit).bfloat16()
            ys = torch._grouped_mm(act, self.dn_t, offs=offs)                   # [rows*K, H]
            yk = torch.empty_like(ys)
            yk[order] = ys
            return yk
        h = torch.bmm(self.gu.index_select(0, flat), xr.unsqueeze(-1)).squeeze(-1)
        act = ops.swiglu_clamped(h[:, :I].float(), h[:, I:].float(), cfg.swiglu_limit).bfloat16()
        return torch.bmm(self.dn.index_select(0, flat), act.unsqueeze(-1)).squeeze(-1)

    def __call__(self, a: torch.Tensor) -> torch.Tensor:
        cfg, K = self.cfg, self.K
        s = torch.sigmoid(a.float() @ self.W_r.t())                            # [rows, E]
        idx = torch.topk(s + self.bias, K, dim=-1).indices
        w = s.gather(-1, idx)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * cfg.routed_scaling_factor
        self.idx = idx
        rows = a.shape[0]
        flat = idx.reshape(-1)
        if self.mode == "grouped" and not self.checked:     # first (eager) call: grouped must work and agree
            self.checked = True
            try:
                yk = self._experts(a, flat, "grouped")
                ref = self._experts(a, flat, "gather").float()
                bad = float((yk.float() - ref).norm() / ref.norm().clamp_min(1e-30)) > 2e-2
            except (RuntimeError, AttributeError, TypeError, NotImplementedError):
                bad = True
            if bad:
                self.mode = "gather"
        yk = self._experts(a, flat, self.mode)
        y = (yk.view(rows, K, -1).float() * w.unsqueeze(-1)).sum(1)
        hs = _lin(a, self.sh[0])
        Is = self.sh[1].shape[1]
        acts = ops.swiglu_clamped(hs[:, :Is].float(), hs[:, Is:].float(), cfg.swiglu_limit).bfloat16()
        return y + _lin(acts, self.sh[1]).float()


class DenseFfnBaseline:
    def __init__(self, src: RankSource, p: str, cfg):
        m = p + "mlp."
        self.cfg = cfg
        self.gu = torch.cat([src.bf16(m + "gate_proj.weight"), src.bf16(m + "up_proj.weight")])
        self.dn = src.bf16(m + "down_proj.weight")
        self.idx = None

    def __call__(self, a):
        I = self.dn.shape[1]
        h = _lin(a, self.gu)
        act = ops.swiglu_clamped(h[:, :I].float(), h[:, I:].float(), self.cfg.swiglu_limit).bfloat16()
        return _lin(act, self.dn).float()


def _hc(src, p):
    return [tuple(src.get(p + f"hc_{s}_{n}")[0].float() for n in ("fn", "base", "scale")) for s in ("attn", "ffn")]


class KdaLayerBaseline:
    """embed / dense / kda: mHC -> KDA mixer -> mHC -> FFN (dense or MoE), torch ops, one rank.
    __call__(X or tokens, S, win) -> X' [rows, 4, H] fp32; the new state / window go to S_out / W_out."""

    def __init__(self, src: RankSource, cfg, kind: str, rows: int, moe_mode: str):
        L = layer_of(cfg, kind)
        p = f"{PREFIX}layers.{L}."
        a = p + "self_attn."
        tp = src.tp_size
        self.cfg, self.kind = cfg, kind
        self.nh, self.d = cfg.linear_num_heads // tp, cfg.linear_head_dim
        self.D = self.nh * self.d
        self.hc = _hc(src, p)
        self.ln = [src.bf16(p + "input_layernorm.weight"), src.bf16(p + "post_attention_layernorm.weight")]
        self.W_in = torch.cat([src.bf16(a + f"{n}_proj.weight") for n in ("q", "k", "v", "b", "f_a", "g_a")])
        self.conv_w = torch.cat([src.get(a + f"{n}_conv1d.weight")[0].float().squeeze(1) for n in "qkv"])
        self.A_log, self.dt_bias = src.get(a + "A_log")[0].float(), src.get(a + "dt_bias")[0].float()
        self.f_b, self.g_b = src.bf16(a + "f_b_proj.weight"), src.bf16(a + "g_b_proj.weight")
        self.onorm, self.W_o = src.bf16(a + "o_norm.weight"), src.bf16(a + "o_proj.weight")
        self.embed = src.bf16(EMBED) if kind == "embed" else None
        self.ffn = MoeBaseline(src, p, cfg, moe_mode) if kind == "kda" else DenseFfnBaseline(src, p, cfg)
        dev = self.W_in.device
        self.S_out = torch.empty(rows, self.nh, self.d, self.d, device=dev)
        self.W_out = torch.empty(rows, cfg.linear_conv_kernel_dim - 1, 3 * self.D, device=dev)

    def mixer(self, a, S, win):
        cfg, nh, d, D = self.cfg, self.nh, self.d, self.D
        rows = a.shape[0]
        y = _lin(a, self.W_in)                                                  # [rows, N_IN] bf16
        qkv, b, fa, ga = y.split([3 * D, nh, d, d], dim=-1)
        x, win2 = ops.kda_conv_step(win, qkv.float(), self.conv_w)
        q, k, v = (t.reshape(rows, nh, d) for t in x.split(D, dim=-1))
        g = ops.kda_gate(_lin(fa, self.f_b), self.A_log, self.dt_bias, cfg.linear_lower_bound)
        gate = _lin(ga, self.g_b).view(rows, nh, d)
        o, S2 = ops.kda_recurrent_step(S, q, k, v, g, torch.sigmoid(b.float()))
        self.S_out[:rows].copy_(S2)
        self.W_out[:rows].copy_(win2)
        o = ops.gated_rms_norm(o, gate, self.onorm, cfg.rms_norm_eps)
        return _lin(o.reshape(rows, -1).bfloat16(), self.W_o).float()

    def __call__(self, X, S, win):
        cfg = self.cfg
        if self.embed is not None:                                              # X: token ids
            X = ops.hc_expand(self.embed[X].float(), cfg.hc_mult)
        x_in, post, comb = ops.hc_pre(X, *self.hc[0], cfg)
        y = self.mixer(ops.rms_norm(x_in, self.ln[0], cfg.rms_norm_eps).bfloat16(), S, win)
        X = ops.hc_post(X, y, post, comb)
        x_in, post, comb = ops.hc_pre(X, *self.hc[1], cfg)
        y = self.ffn(ops.rms_norm(x_in, self.ln[1], cfg.rms_norm_eps).bfloat16())
        return ops.hc_post(X, y, post, comb)


class DsaBaseline:
    """sparse (mHC + DSA + MoE) or nextn (eh_proj + DSA + MoE + draft logits), torch ops, one rank.
    All rows sit at one position `pos` (host int): the indexer's regime is fixed at build."""

    def __init__(self, src: RankSource, cfg, kind: str, pos: int, moe_mode: str, logits: bool = True):
        L = layer_of(cfg, kind)
        p = f"{PREFIX}layers.{L}."
        a, ix = p + "self_attn.", p + "self_attn.indexer."
        tp = src.tp_size
        self.cfg, self.kind, self.pos = cfg, kind, pos
        self.nh = cfg.num_attention_heads // tp
        self.ln = [src.bf16(p + "input_layernorm.weight"), src.bf16(p + "post_attention_layernorm.weight")]
        names = [a + "q_a_proj.weight", a + "kv_a_proj_with_mqa.weight", ix + "wk.weight",
                 ix + "index_kpool_compress_gate", ix + "weights_proj.weight"]
        self.W_a = torch.cat([src.bf16(n) for n in names])
        self.splits = [cfg.q_lora_rank, cfg.kv_lora_rank, cfg.index_head_dim, cfg.index_head_dim, cfg.index_n_heads]
        self.qa_ln, self.kva_ln = src.bf16(a + "q_a_layernorm.weight"), src.bf16(a + "kv_a_layernorm.weight")
        self.W_qb, self.W_iqb = src.bf16(a + "q_b_proj.weight"), src.bf16(ix + "wq_b.weight")
        kv_b = src.bf16(a + "kv_b_proj.weight").view(self.nh, -1, cfg.kv_lora_rank)
        dn = cfg.qk_nope_head_dim
        self.W_uk, self.W_uv = kv_b[:, :dn].contiguous(), kv_b[:, dn:].contiguous()   # [nh, dn|dv, C]
        self.W_o = src.bf16(a + "o_proj.weight")
        self.kn = (src.get(ix + "k_norm.weight")[0].float(), src.get(ix + "k_norm.bias")[0].float())
        self.ape = src.get(ix + "index_kpool_compress_ape")[0].float()
        self.ffn = MoeBaseline(src, p, cfg, moe_mode)
        if kind == "sparse":
            self.hc = _hc(src, p)
        else:
            self.enorm, self.hnorm = src.bf16(p + "enorm.weight"), src.bf16(p + "hnorm.weight")
            self.shn, self.W_eh = src.bf16(p + "shared_head.norm.weight"), src.bf16(p + "eh_proj.weight")
            self.embed = src.bf16(EMBED)
            self.lm_head = src.bf16(LM_HEAD) if logits else None

    def mixer(self, a, lat, pk, tr):
        cfg, pos, nh = self.cfg, self.pos, self.nh
        KP, DI, NI = cfg.index_kpool, cfg.index_head_dim, cfg.index_n_heads
        rows = a.shape[0]
        qa, kva, ik, ig, hw = _lin(a, self.W_a).split(self.splits, dim=-1)
        qr = ops.rms_norm(qa, self.qa_ln, cfg.rms_norm_eps).bfloat16()
        c = ops.rms_norm(kva, self.kva_ln, cfg.rms_norm_eps)
        q = _lin(qr, self.W_qb).view(rows, nh, -1)                              # [rows, nh, dn]
        iq = _lin(qr, self.W_iqb).float().view(rows, NI, DI)
        ik = ops.layer_norm(ik, *self.kn)
        lat[:rows, pos] = c.to(lat.dtype)                                       # this token's cache writes
        tr[:rows, pos % KP] = torch.cat([ik, ig.float()], dim=-1)
        if (pos + 1) % KP == 0:
            pk[:rows, pos // KP] = ops.indexer_pool(tr[:rows, :, :DI], tr[:rows, :, DI:], self.ape).to(pk.dtype)
        P = (pos + 1) // KP
        dev = a.device
        if P > cfg.index_topk_pools:
            s = torch.relu(torch.bmm(iq, pk[:rows, :P].float().transpose(1, 2)) * DI ** -0.5)   # [rows, NI, P]
            sc = ((hw.float() * NI ** -0.5).unsqueeze(1) @ s).squeeze(1)                        # [rows, P]
            pools = torch.topk(sc, cfg.index_topk_pools, dim=-1).indices
            toks = (pools.unsqueeze(-1) * KP + torch.arange(KP, device=dev)).reshape(rows, -1)
            tail = torch.arange(P * KP, pos + 1, device=dev).expand(rows, -1)
            toks = torch.cat([toks, tail], dim=-1)
        else:
            toks = torch.arange(pos + 1, device=dev).expand(rows, -1)
        sel = lat[torch.arange(rows, device=dev).unsqueeze(-1), toks]          # [rows, n, C]
        sel = sel.to(torch.bfloat16)
        q_lat = torch.einsum("rhd,hdc->rhc", q, self.W_uk)                      # [rows, nh, C] bf16
        p_att = torch.softmax((q_lat @ sel.transpose(1, 2)).float() * cfg.qk_head_dim ** -0.5, dim=-1)
        ctx = p_att.bfloat16() @ sel                                            # [rows, nh, C]
        o = torch.einsum("rhc,hdc->rhd", ctx, self.W_uv)
        return _lin(o.reshape(rows, -1), self.W_o).float()

    def __call__(self, X, lat, pk, tr, tokens=None):
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        if self.kind == "sparse":
            x_in, post, comb = ops.hc_pre(X, *self.hc[0], cfg)
            y = self.mixer(ops.rms_norm(x_in, self.ln[0], eps).bfloat16(), lat, pk, tr)
            X = ops.hc_post(X, y, post, comb)
            x_in, post, comb = ops.hc_pre(X, *self.hc[1], cfg)
            y = self.ffn(ops.rms_norm(x_in, self.ln[1], eps).bfloat16())
            return ops.hc_post(X, y, post, comb)
        e = ops.rms_norm(self.embed[tokens], self.enorm, eps)                  # X: the trunk's hidden row
        x = _lin(torch.cat([e, ops.rms_norm(X, self.hnorm, eps)], dim=-1).bfloat16(), self.W_eh).float()
        y = x + self.mixer(ops.rms_norm(x, self.ln[0], eps).bfloat16(), lat, pk, tr)
        z = y + self.ffn(ops.rms_norm(y, self.ln[1], eps).bfloat16())
        if self.lm_head is None:
            return z
        n = ops.rms_norm(z, self.shn, eps).bfloat16()
        return z, _lin(n, self.lm_head).argmax(-1)


# ------------------------------------------------------------------------------------ printing
def print_accounting(kind, acct, bw, out: list) -> int:
    """Append the byte accounting of one launch to `out` (lines for the header card); return the total."""
    total = sum(acct["bytes"].values())
    out.append(f"   bytes of one {kind} launch ({acct.get('timing')}, {acct.get('copies')} weight copies"
          + (f", {acct['n_routed']} routed experts: {acct.get('n_routed_source')}" if acct.get("n_routed") is not None
             else "") + "):")
    for k, v in acct["bytes"].items():
        out.append(f"     {k:28s} {v / 1e6:12.3f} MB")
    out.append(f"     {'total':28s} {total / 1e6:12.3f} MB  floor {total / bw * 1e6:.2f} us")
    return total


def step_summary(cfg, per_kind: dict, kinds: tuple, out: list) -> dict:
    """One decode step = the launch plan (no nextn) with each kind's timing and floor times its count."""
    plan = [k for k in cfg.launch_plan if k != "nextn"]
    counts = {k: plan.count(k) for k in kinds}
    out.append(f"-- step: {len(plan)} launches " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    out.append(f"   {'kind':8s} {'n':>3s} {'us each':>9s} {'floor each':>10s} {'torch each':>10s} {'us sum':>9s} "
          f"{'floor sum':>9s} {'torch sum':>9s}")
    tot = {"us": 0.0, "floor_us": 0.0, "torch_us": 0.0, "bytes": 0}
    for k, n in counts.items():
        v = per_kind[k]
        t = v["torch_us"] if v["torch_us"] is not None else float("nan")
        out.append(f"   {k:8s} {n:3d} {v['us']:9.2f} {v['floor_us']:10.2f} {t:10.2f} {n * v['us']:9.1f} "
              f"{n * v['floor_us']:9.1f} {n * t:9.1f}")
        tot["us"] += n * v["us"]
        tot["floor_us"] += n * v["floor_us"]
        tot["torch_us"] += n * t
        tot["bytes"] += n * v["bytes"]
    pct = 100 * tot["floor_us"] / tot["us"] if tot["us"] == tot["us"] and tot["us"] > 0 else float("nan")
    out.append(f"   {'step':8s} {len(plan):3d} {'':9s} {'':10s} {'':10s} {tot['us']:9.1f} {tot['floor_us']:9.1f} "
          f"{tot['torch_us']:9.1f}   ({tot['bytes'] / 1e9:.3f} GB, {pct:.1f}% of floor)")
    return {"launches": len(plan), "counts": counts, "us": round(tot["us"], 2), "floor_us": round(tot["floor_us"], 2),
            "torch_us": round(tot["torch_us"], 2), "bytes": tot["bytes"], "pct_floor": round(pct, 1)}


def dry_report(title, card, bw, cases, extra, notes=(), post=()) -> None:
    print(f"== {title}")
    for k, v in card.items():
        print(f"   {k:10s} {v}")
    for line in notes:
        print(line)
    print(f"{'case':44s} {'bytes MB':>10s} {'floor us':>9s}  info")
    rows = []
    for c in cases:
        print(f"{c.name:44s} {c.bytes_read / 1e6:10.3f} {c.bytes_read / bw * 1e6:9.3f}  "
              + " ".join(f"{k}={v}" for k, v in c.info.items() if k not in ("minus",) and v is not None))
        rows.append({"case": c.name, "bytes": c.bytes_read, "floor_us": round(c.bytes_read / bw * 1e6, 4),
                     "judged": c.floor, **c.info})
    for line in post:
        print(line)
    print(json.dumps({"title": title, **card, "read_bw_tbps": bw / 1e12, "rows": rows, **extra}, default=str))


def per_kind_from_json(paths, kinds: tuple) -> dict:
    """`--kind step --from`: each kind's launch time, bytes, floor and torch time from the JSON lines of
    earlier runs (the last JSON line of each file; a later file overrides an earlier one for a kind)."""
    per: dict = {}
    for path in paths:
        with open(path) as f:
            lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
        if not lines:
            raise ValueError(f"{path}: no JSON line")
        rec = json.loads(lines[-1])
        title_kind = rec.get("title", "").split("--kind ")[-1].split()[0] if "--kind" in rec.get("title", "") else None
        bw = rec["read_bw_tbps"] * 1e12
        for r in rec["rows"]:
            k = r.get("kind") or title_kind
            if k not in kinds:
                continue
            if r.get("judged"):
                per.setdefault(k, {"torch_us": None})
                per[k].update(us=r["us"], bytes=r["bytes"], floor_us=r["bytes"] / bw * 1e6, source=path)
            elif r["case"].startswith("  torch ops"):
                per.setdefault(k, {})["torch_us"] = r["us"]
    missing = [k for k in kinds if "us" not in per.get(k, {})]
    if missing:
        raise ValueError(f"--from: no timing for {missing} in {list(paths)}")
    return per
