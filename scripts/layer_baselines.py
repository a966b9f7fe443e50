"""The layer kinds as torch ops, the baseline of scripts/time_layers.py: the same layer on the same rank
pieces (rank_source.py), bf16 weights, cuBLAS GEMVs (`a @ W.T`), the reference's fp32 math
(glm53_flash/reference/ops.py) between them, static buffers so it can be captured in a CUDA graph.
MoE: routed experts through `torch._grouped_mm` on CUDA when it works, else an `index_select` gather of
the chosen experts + `bmm` (named in the case label). TP > 1: one rank's partial sums only (like the
launch in loopback with zero peers; no all-reduce).

Why modules of their own: bench_timing.py owns the measuring (read bandwidth, interleaved CUDA-graph
timing, the card); rank_source.py the weights; layer_bytes.py what a launch must read.
"""
from __future__ import annotations

import torch

from glm53_flash.reference import ops
from glm53_flash.weights import LM_HEAD, PREFIX
from layer_bytes import layer_of
from rank_source import EMBED, RankSource


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
