"""Pure-torch fp32 reference ops of GLM-5.3-Flash: one function per kernel family.

These functions are the spec each Triton family in `glm53_flash/kernels/` is checked against, under
the same names. They take plain tensors (weights already fp32, in HF layout) and return fp32; they
never mutate their inputs. The math follows HF transformers' `glm5_next` (the model of record) with
every bf16 cast of HF left out: where HF rounds to bf16 in the middle of an op, we stay in fp32 (noted
at each such place). research/model.md §3-§4 restates the formulas with sources.

Determinism: every top-k here breaks ties toward the lower index (stable descending sort), and every
sum runs in a fixed order, so the reference gives the same bits on every run.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

L2NORM_EPS = 1e-6            # fla / HF l2norm of KDA q and k: x / sqrt(sum(x^2) + eps)
INDEX_LAYERNORM_EPS = 1e-6   # HF indexer k_norm = nn.LayerNorm(head_dim, eps=1e-6)
ROUTER_DENOM_EPS = 1e-20     # HF router: weights / (sum + 1e-20)


# ---------------------------------------------------------------------------- norms
def rms_norm(x: Tensor, w: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim; `w=None` gives the unweighted norm mHC uses on the flat streams."""
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def layer_norm(x: Tensor, w: Tensor, b: Tensor, eps: float = INDEX_LAYERNORM_EPS) -> Tensor:
    """LayerNorm with bias (the indexer's k_norm)."""
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)


def gated_rms_norm(o: Tensor, gate: Tensor, w: Tensor, eps: float) -> Tensor:
    """KDA output norm: per-head RMSNorm(o) * w * sigmoid(gate). o, gate [..., head_dim]."""
    return rms_norm(o, w, eps) * torch.sigmoid(gate.float())


def l2norm(x: Tensor, eps: float = L2NORM_EPS) -> Tensor:
    """fla's l2norm: eps inside the sqrt (not F.normalize's max(norm, eps))."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------- mHC
def sinkhorn(comb: Tensor, iters: int, eps: float) -> Tensor:
    """Sinkhorn-Knopp on [..., m, m] positive matrices, as HF orders it: one column normalisation,
    then `iters - 1` rounds of (rows, columns). Ends on columns, so sum_j comb[j, i] = 1 (to eps)."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def hc_coeffs(X: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """mHC coefficients of streams X [..., m, H] -> pre [..., m], post [..., m], comb [..., m, m].

    Unweighted RMS over the flat m*H row (eps = rms_norm_eps, as HF), the (m*(m+2))-row GEMV with
    `fn` [24, m*H], then sigmoid / 2*sigmoid / row-softmax and Sinkhorn."""
    m = X.shape[-2]
    flat = rms_norm(X.reshape(*X.shape[:-2], -1), None, cfg.rms_norm_eps)       # [..., m*H]
    mix = flat @ fn.t()                                                          # [..., m*(m+2)]
    pre_w, post_w, comb_w = mix.split([m, m, m * m], dim=-1)
    pre_b, post_b, comb_b = base.split([m, m, m * m])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + cfg.hc_eps
    post = 2.0 * torch.sigmoid(post_w * scale[1] + post_b)
    logits = comb_w.reshape(*comb_w.shape[:-1], m, m) * scale[2] + comb_b.view(m, m)
    comb = torch.softmax(logits, dim=-1) + cfg.hc_eps
    return pre, post, sinkhorn(comb, cfg.hc_sinkhorn_iters, cfg.hc_eps)


def hc_pre(X: Tensor, fn: Tensor, base: Tensor, scale: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """Collapse the streams X [..., m, H] to the sub-layer input row.

    Returns x_in [..., H] = sum_j pre[j] * X[j] (before the sub-layer's weighted RMSNorm),
    post [..., m] and comb [..., m, m] for `hc_post`."""
    pre, post, comb = hc_coeffs(X, fn, base, scale, cfg)
    x_in = (pre.unsqueeze(-1) * X).sum(-2)
    return x_in, post, comb


def hc_post(X: Tensor, y: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """X'[i] = post[i] * y + sum_j comb[j, i] * X[j]. X [..., m, H], y [..., H].
    (HF casts post/comb to the activation dtype, bf16 in a bf16 model; we stay fp32.)"""
    return post.unsqueeze(-1) * y.unsqueeze(-2) + comb.transpose(-1, -2) @ X


def hc_expand(x: Tensor, m: int) -> Tensor:
    """Embedding row [..., H] -> m identical streams [..., m, H]."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], m, x.shape[-1]).contiguous()


def tail_logits(X: Tensor, norm_w: Tensor, lm_head: Tensor, eps: float) -> Tensor:
    """X [rows, m, H] -> logits [rows, V]: unweighted mean of the streams, RMSNorm, lm_head."""
    return tail_hidden(X, norm_w, eps) @ lm_head.t()


def tail_hidden(X: Tensor, norm_w: Tensor, eps: float) -> Tensor:
    """The final post-norm row [rows, H] (lm_head input; what the MTP block consumes)."""
    return rms_norm(X.mean(-2), norm_w, eps)


# ---------------------------------------------------------------------------- KDA
def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float) -> Tensor:
    """Per-channel log-decay g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)).

    f [..., nh*d] = f_b(f_a(x)); A_log [nh]; dt_bias [nh*d]. Returns g [..., nh, d] (all < 0)."""
    nh = A_log.numel()
    z = (f.float() + dt_bias).reshape(*f.shape[:-1], nh, -1)
    return lower_bound * torch.sigmoid(torch.exp(A_log).unsqueeze(-1) * z)


def kda_conv_step(window: Tensor, x: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """One step of the causal depthwise conv + SiLU.

    window [..., K-1, C]: the K-1 previous inputs, oldest first; x [..., C] the new input;
    w [C, K] (w[:, K-1] multiplies the newest input). Returns (y [..., C], new window)."""
    full = torch.cat([window, x.unsqueeze(-2)], dim=-2)           # [..., K, C]
    y = F.silu((full * w.t()).sum(-2))
    return y, full[..., 1:, :].clone()


def kda_conv(x: Tensor, w: Tensor, window: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv + SiLU over a sequence x [T, C] (prefill form, via F.conv1d).

    `window` [K-1, C] holds the inputs before x (zeros when None, as at sequence start).
    Returns (y [T, C], window after the last input [K-1, C])."""
    T, C = x.shape
    K = w.shape[1]
    if window is None:
        window = x.new_zeros(K - 1, C)
    full = torch.cat([window, x], dim=0)                          # [K-1+T, C]
    y = F.conv1d(full.t().unsqueeze(0), w.unsqueeze(1), groups=C)[0].t()   # [T, C]
    return F.silu(y), full[-(K - 1):].clone()


def kda_recurrent_step(S: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       l2norm_qk: bool = True) -> tuple[Tensor, Tensor]:
    """One token of the KDA delta rule, state stored v-first (as fla / SGLang).

    S [..., nh, dv, dk]; q, k [..., nh, dk]; v [..., nh, dv]; g [..., nh, dk] log-decay; beta [..., nh].
    q, k are l2-normalised here (fla's use_qk_l2norm_in_kernel) and q is scaled by dk^-0.5.
      S <- S * exp(g)              (decay per key channel = per column of the v-first state)
      S <- S + beta (v - S k) k^T  (delta rule)
      o  = S q
    Returns (o [..., nh, dv], new S)."""
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    S = S * torch.exp(g).unsqueeze(-2)
    kv = (S * k.unsqueeze(-2)).sum(-1)                            # [..., nh, dv] = S k
    delta = beta.unsqueeze(-1) * (v - kv)
    S = S + delta.unsqueeze(-1) * k.unsqueeze(-2)
    o = (S * q.unsqueeze(-2)).sum(-1)
    return o, S


def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, S0: Tensor | None = None,
                chunk: int = 32, l2norm_qk: bool = True) -> tuple[Tensor, Tensor]:
    """KDA over a sequence in chunks (prefill form), written independently of the recurrent step.

    q, k [T, nh, dk]; v [T, nh, dv]; g [T, nh, dk]; beta [T, nh]; S0 [nh, dv, dk] (v-first) or None.
    Returns (o [T, nh, dv], S_T [nh, dv, dk]).

    Within a chunk, with G_t = cumsum g (per channel) and the state in k-first form M = S^T [dk, dv],
    the delta-rule updates u_t = beta_t (v_t - (D_t M_{t-1})^T k_t) satisfy the unit lower-triangular
    system (I + A) U = diag(beta) (V - (K * e^G) M0) with A_ts = beta_t sum_c k_tc k_sc e^(G_tc - G_sc)
    (s < t), solved by a triangular solve. Then
      O   = (Q * e^G) M0 + Mask_incl(Q K^T decayed) U
      M_C = e^(G_C) * M0 + (K * e^(G_C - G))^T U.
    Decay ratios are formed as exp of differences (t >= s only), so nothing overflows."""
    if l2norm_qk:
        q, k = l2norm(q.float()), l2norm(k.float())
    T, nh, dk = k.shape
    dv = v.shape[-1]
    q = q * dk ** -0.5
    # head-major: [nh, T, d]
    q, k, v, g = (x.float().transpose(0, 1) for x in (q, k, v, g))
    beta = beta.float().t()                                       # [nh, T]
    M = q.new_zeros(nh, dk, dv) if S0 is None else S0.float().transpose(-1, -2).clone()
    out = []
    for s0 in range(0, T, chunk):
        qc, kc, vc, gc, bc = (x[:, s0:s0 + chunk] for x in (q, k, v, g, beta))
        C = kc.shape[1]
        G = gc.cumsum(1)                                          # [nh, C, dk]
        diff = G.unsqueeze(2) - G.unsqueeze(1)                    # [nh, t, s, dk] = G_t - G_s
        causal = torch.ones(C, C, dtype=torch.bool, device=kc.device).tril()        # s <= t
        diff = diff.masked_fill(~causal[None, :, :, None], float("-inf"))
        decay = torch.exp(diff)                                   # 0 above the diagonal
        kk = torch.einsum("htc,hsc,htsc->hts", kc, kc, decay)     # k_t . D(t,s) k_s
        A = (bc.unsqueeze(-1) * kk).tril(-1)                      # strictly lower
        eye = torch.eye(C, device=kc.device).expand(nh, C, C)
        rhs = bc.unsqueeze(-1) * (vc - (kc * torch.exp(G)) @ M)   # [nh, C, dv]
        U = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        qk = torch.einsum("htc,hsc,htsc->hts", qc, kc, decay)     # inclusive (s <= t)
        out.append((qc * torch.exp(G)) @ M + qk @ U)
        GC = G[:, -1:]                                            # [nh, 1, dk]
        M = torch.exp(GC).transpose(-1, -2) * M + (kc * torch.exp(GC - G)).transpose(-1, -2) @ U
    o = torch.cat(out, dim=1).transpose(0, 1)                     # [T, nh, dv]
    return o.contiguous(), M.transpose(-1, -2).contiguous()


# ---------------------------------------------------------------------------- DSA: MLA
def mla_absorbed(q: Tensor, kv_b: Tensor, latents: Tensor, scale: float) -> Tensor:
    """Absorbed NoPE MLA for one query row over its selected latents (decode form).

    q [nh, dn]; kv_b [nh*(dn+dv), C] (per head: dn key rows then dv value rows); latents [n, C].
    q~_h = W_UK,h^T q_h; p = softmax_t(q~_h . c_t * scale); o_h = W_UV,h (sum_t p_t c_t).
    Returns o [nh, dv]."""
    nh, dn = q.shape
    W = kv_b.view(nh, -1, kv_b.shape[-1])                         # [nh, dn+dv, C]
    W_uk, W_uv = W[:, :dn], W[:, dn:]
    q_lat = torch.einsum("hd,hdc->hc", q, W_uk)                   # [nh, C]
    p = torch.softmax((q_lat @ latents.t()) * scale, dim=-1)      # [nh, n]
    ctx = p @ latents                                             # [nh, C]
    return torch.einsum("hc,hdc->hd", ctx, W_uv)


def mla_expanded(q: Tensor, kv_b: Tensor, latents: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Expanded (non-absorbed) NoPE MLA for a block of queries (prefill form, as HF computes it).

    q [T, nh, dn]; latents [S, C]; mask [T, S] bool (True = attend). Per-head keys and values are
    materialised from the latents. Returns o [T, nh, dv]."""
    nh, dn = q.shape[1], q.shape[2]
    kv = (latents @ kv_b.t()).view(latents.shape[0], nh, -1)      # [S, nh, dn+dv]
    keys, values = kv[..., :dn], kv[..., dn:]
    s = torch.einsum("thd,shd->hts", q, keys) * scale
    s = s.masked_fill(~mask.unsqueeze(0), float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hts,shd->thd", p, values)


# ---------------------------------------------------------------------------- DSA: indexer
def indexer_pool(keys: Tensor, gates: Tensor, ape: Tensor) -> Tensor:
    """Pooled index key of complete pools: per channel, softmax over the kpool members of
    (gate + ape), weighted sum of the LayerNorm'd keys.

    keys, gates [..., kpool, d]; ape [kpool, d]. Returns [..., d].
    (HF casts the probabilities to the key dtype, bf16 in a bf16 model; we stay fp32.)"""
    p = torch.softmax(gates.float() + ape, dim=-2)
    return (p * keys).sum(-2)


def indexer_scores(iq: Tensor, weights: Tensor, pool_keys: Tensor) -> Tensor:
    """Pool scores sum_h w_h * n^-0.5 * ReLU(iq_h . pk_p * d^-0.5).

    iq [..., n, d] index queries; weights [..., n] the raw weights_proj output; pool_keys [P, d].
    Returns [..., P]."""
    n, d = iq.shape[-2], iq.shape[-1]
    s = F.relu((iq @ pool_keys.t()) * d ** -0.5)                  # [..., n, P]
    return ((weights * n ** -0.5).unsqueeze(-2) @ s).squeeze(-2)


def topk_lower_index(scores: Tensor, k: int) -> Tensor:
    """Indices [..., k] of the k largest scores, ties toward the lower index (stable sort),
    ordered by descending score."""
    if not 0 <= k <= scores.shape[-1]:
        raise ValueError(f"topk_lower_index: k={k} outside [0, {scores.shape[-1]}]")
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def indexer_select(scores: Tensor, pos: int, topk_pools: int, kpool: int) -> Tensor:
    """Token indices a query at `pos` attends to (ascending): the top `topk_pools` complete pools
    (all of them while there are no more), expanded to tokens, then the incomplete tail
    [kpool * P, pos]. scores [P] for the P = (pos + 1) // kpool complete pools."""
    P, dev = (pos + 1) // kpool, scores.device
    if scores.shape[-1] != P:
        raise ValueError(f"indexer_select: {scores.shape[-1]} scores for pos={pos}, expected {P} pools")
    if P <= topk_pools:
        pools = torch.arange(P, device=dev)
    else:
        pools = topk_lower_index(scores, topk_pools).sort().values
    toks = (pools.unsqueeze(-1) * kpool + torch.arange(kpool, device=dev)).reshape(-1)
    return torch.cat([toks, torch.arange(P * kpool, pos + 1, device=dev)])


def indexer_mask(scores: Tensor, topk_pools: int, kpool: int) -> Tensor:
    """Selection of every query of a prompt at once (prefill form): scores [T, P_all] over the
    P_all = T // kpool complete pools of the prompt -> mask [T, T] (True = query t attends to token s). Query t sees the pools
    that end at or before t; pools it cannot see never win (they sort last), and the tail is added."""
    T, P_all = scores.shape
    if P_all * kpool > T:
        raise ValueError(f"indexer_mask: {P_all} pools of {kpool} do not fit {T} tokens")
    t = torch.arange(T, device=scores.device)
    pool_end = torch.arange(P_all, device=scores.device) * kpool + kpool - 1
    visible = pool_end.unsqueeze(0) <= t.unsqueeze(1)             # [T, P_all]
    ranked = torch.sort(scores.masked_fill(~visible, float("-inf")), dim=-1, descending=True,
                        stable=True).indices[:, :topk_pools]      # visible pools first
    chosen = torch.zeros(T, P_all, dtype=torch.bool, device=scores.device)
    chosen.scatter_(1, ranked, True)
    chosen &= visible
    mask = torch.zeros(T, T, dtype=torch.bool, device=scores.device)
    mask[:, :P_all * kpool] = chosen.repeat_interleave(kpool, dim=1)   # pool -> its tokens
    s = t.unsqueeze(0)                                            # key positions, [1, T]
    tail_start = ((t + 1) // kpool * kpool).unsqueeze(1)          # first token of the open pool
    return mask | ((s >= tail_start) & (s <= t.unsqueeze(1)))


# ---------------------------------------------------------------------------- FFN
def swiglu_clamped(gate: Tensor, up: Tensor, limit: float) -> Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def mlp(x: Tensor, gate_w: Tensor, up_w: Tensor, down_w: Tensor, limit: float) -> Tensor:
    """Clamped SwiGLU MLP (dense layers, shared and routed experts). x [rows, H]."""
    return swiglu_clamped(x @ gate_w.t(), x @ up_w.t(), limit) @ down_w.t()


def moe_route(x: Tensor, gate_w: Tensor, bias: Tensor, cfg, idx: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Sigmoid router with correction bias: top-k on (sigmoid(x W^T) + bias), ties toward the lower
    expert; weights = chosen sigmoid scores, renormalised (norm_topk_prob), times the scaling.
    x [rows, H]; gate_w [E, H]; bias [E]. Returns (weights [rows, k], idx [rows, k]). `idx`, if given,
    replaces the choice (tests: a kernel's pick on a near-tie, weighted by this router's scores)."""
    s = torch.sigmoid(x.float() @ gate_w.t())                     # [rows, E]
    if idx is None:
        idx = topk_lower_index(s + bias, cfg.num_experts_per_tok)
    w = s.gather(-1, idx)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + ROUTER_DENOM_EPS)
    return w * cfg.routed_scaling_factor, idx


ExpertFn = Callable[[int], tuple[Tensor, Tensor, Tensor]]


def moe(x: Tensor, gate_w: Tensor, bias: Tensor, expert: ExpertFn, shared: tuple[Tensor, Tensor, Tensor],
        cfg) -> Tensor:
    """MoE FFN: sum_k w_k Expert_{idx_k}(x) + SharedExpert(x). x [rows, H].

    `expert(e)` returns (gate [I, H], up [I, H], down [H, I]) of routed expert e; it is called once
    per distinct routed expert, so only those are materialised. Sums run in rank order (k = 0..K-1),
    then the shared expert."""
    w, idx = moe_route(x, gate_w, bias, cfg)
    per_rank = x.new_zeros(x.shape[0], idx.shape[1], x.shape[1])  # [rows, k, H]
    for e in sorted(set(idx.flatten().tolist())):
        rows, ranks = torch.nonzero(idx == e, as_tuple=True)
        g, u, d = expert(e)
        per_rank[rows, ranks] = mlp(x[rows], g, u, d, cfg.swiglu_limit) * w[rows, ranks].unsqueeze(-1)
    y = per_rank[:, 0]
    for r in range(1, idx.shape[1]):
        y = y + per_rank[:, r]
    return y + mlp(x, *shared, cfg.swiglu_limit)
