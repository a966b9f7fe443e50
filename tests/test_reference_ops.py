"""Reference ops against independent formulations: recurrent vs chunked KDA, conv step vs conv1d,
absorbed vs expanded MLA, indexer selection vs a brute-force python sort, MoE vs a per-expert loop,
Sinkhorn's double stochasticity, the SwiGLU clamp, ties toward the lower index."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from glm53_flash.reference import ops

pytestmark = pytest.mark.usefixtures("one_thread")


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


# ------------------------------------------------------------------------------------ KDA
@pytest.mark.parametrize("T,chunk", [(1, 16), (37, 16), (64, 32)], ids=["T1", "T37-c16", "T64-c32"])
def test_kda_chunked_matches_recurrent(gen, T, chunk):
    nh, dk, dv = 3, 16, 24
    q, k = torch.randn(T, nh, dk, generator=gen), torch.randn(T, nh, dk, generator=gen)
    v = torch.randn(T, nh, dv, generator=gen)
    g = -5.0 * torch.sigmoid(torch.randn(T, nh, dk, generator=gen))       # the model's gate range
    beta = torch.sigmoid(torch.randn(T, nh, generator=gen))
    S0 = 0.3 * torch.randn(nh, dv, dk, generator=gen)
    o_c, S_c = ops.kda_chunked(q, k, v, g, beta, S0, chunk=chunk)
    S, outs = S0, []
    for t in range(T):
        o, S = ops.kda_recurrent_step(S, q[t], k[t], v[t], g[t], beta[t])
        outs.append(o)
    o_r = torch.stack(outs)
    err_o, err_s = (o_c - o_r).abs().max().item(), (S_c - S).abs().max().item()
    print(f"kda chunked vs recurrent T={T}: max|do|={err_o:.2e} max|dS|={err_s:.2e}")
    assert err_o <= 1e-5 * max(1.0, o_r.abs().max().item())
    assert err_s <= 1e-5 * max(1.0, S.abs().max().item())


def test_kda_recurrent_step_formula(gen):
    """One step against the textbook k-first formula: M = diag(e^g) M; M += k (beta (v - M^T k))^T."""
    nh, d = 2, 8
    q, k, v, g = (torch.randn(nh, d, generator=gen) for _ in range(4))
    beta = torch.rand(nh, generator=gen)
    S = torch.randn(nh, d, d, generator=gen)                              # v-first [nh, dv, dk]
    o, S1 = ops.kda_recurrent_step(S, q, k, v, g, beta)
    for h in range(nh):
        qn, kn = q[h] / q[h].norm(), k[h] / k[h].norm()
        M = torch.diag(g[h].exp()) @ S[h].t()                             # [dk, dv]
        M = M + torch.outer(kn, beta[h] * (v[h] - M.t() @ kn))
        torch.testing.assert_close(S1[h], M.t(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o[h], M.t() @ (qn * d ** -0.5), rtol=1e-5, atol=1e-5)


def test_kda_conv_step_matches_conv1d(gen):
    T, C, K = 9, 12, 4
    x = torch.randn(T, C, generator=gen)
    w = torch.randn(C, K, generator=gen)
    y_full, win_full = ops.kda_conv(x, w)
    win, ys = torch.zeros(K - 1, C), []
    for t in range(T):
        y, win = ops.kda_conv_step(win, x[t], w)
        ys.append(y)
    torch.testing.assert_close(torch.stack(ys), y_full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(win, win_full)
    # explicit tap order: w[:, K-1] multiplies the newest input
    t = 5
    want = F.silu(sum(w[:, j] * x[t - (K - 1) + j] for j in range(K)))
    torch.testing.assert_close(y_full[t], want, rtol=1e-6, atol=1e-6)


def test_kda_gate_range(gen):
    f = 3 * torch.randn(5, 4 * 8, generator=gen)
    g = ops.kda_gate(f, torch.randn(4, generator=gen), torch.randn(32, generator=gen), -5.0)
    assert g.shape == (5, 4, 8)
    assert (g < 0).all() and (g > -5).all()


# ------------------------------------------------------------------------------------ mHC
def test_sinkhorn_doubly_stochastic(gen):
    """20 steps (the model's count) on softmax matrices of logits with std 1: columns sum to 1 (the
    last normalisation), rows to within 2e-3. Peaky matrices (std 3) converge slower: rows are off
    by a few % after 20 steps, but still improve with more steps (that is the model, not a bug)."""
    logits = torch.randn(200, 4, 4, generator=gen)
    comb = ops.sinkhorn(torch.softmax(logits, -1) + 1e-6, 20, 1e-6)
    col_err = (comb.sum(-2) - 1).abs().max().item()
    row_err = (comb.sum(-1) - 1).abs().max().item()
    print(f"sinkhorn: max|colsum-1|={col_err:.2e} max|rowsum-1|={row_err:.2e}")
    assert (comb > 0).all()
    assert col_err < 1e-5
    assert row_err < 2e-3
    peaky = torch.softmax(3 * torch.randn(200, 4, 4, generator=gen), -1) + 1e-6
    errs = [(ops.sinkhorn(peaky, n, 1e-6).sum(-1) - 1).abs().max().item() for n in (20, 200)]
    assert errs[1] < errs[0] / 5


def test_hc_pre_post_formula(gen):
    """hc_pre / hc_post against an explicit per-stream loop."""
    from glm53_flash.config import preset
    cfg = preset("tiny")
    m, H = 4, 8
    X = torch.randn(3, m, H, generator=gen)
    fn, base, scale = torch.randn(24, m * H, generator=gen), torch.randn(24, generator=gen), torch.rand(3, generator=gen)
    x_in, post, comb = ops.hc_pre(X, fn, base, scale, cfg)
    y = torch.randn(3, H, generator=gen)
    Xn = ops.hc_post(X, y, post, comb)
    for r in range(3):
        flat = X[r].reshape(-1)
        mix = fn @ (flat / torch.sqrt((flat ** 2).mean() + cfg.rms_norm_eps))
        pre = torch.sigmoid(mix[:4] * scale[0] + base[:4]) + cfg.hc_eps
        torch.testing.assert_close(x_in[r], sum(pre[j] * X[r, j] for j in range(m)), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(post[r], 2 * torch.sigmoid(mix[4:8] * scale[1] + base[4:8]))
        for i in range(m):
            want = post[r, i] * y[r] + sum(comb[r, j, i] * X[r, j] for j in range(m))
            torch.testing.assert_close(Xn[r, i], want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ MLA
def test_mla_absorbed_matches_expanded(gen):
    nh, dn, C, S = 4, 16, 24, 30
    q = torch.randn(nh, dn, generator=gen)
    kv_b = torch.randn(nh * 2 * dn, C, generator=gen) / C ** 0.5
    lat = torch.randn(S, C, generator=gen)
    sel = torch.tensor([0, 3, 4, 5, 17, 28, 29])
    mask = torch.zeros(1, S, dtype=torch.bool)
    mask[0, sel] = True
    o_abs = ops.mla_absorbed(q, kv_b, lat[sel], dn ** -0.5)
    o_exp = ops.mla_expanded(q[None], kv_b, lat, mask, dn ** -0.5)[0]
    print(f"mla absorbed vs expanded: rel {rel_err(o_abs, o_exp):.2e}")
    torch.testing.assert_close(o_abs, o_exp, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ indexer
def brute_select(scores: list[float], pos: int, k_pools: int, kp: int) -> list[int]:
    P = (pos + 1) // kp
    order = sorted(range(P), key=lambda p: (-scores[p], p))      # ties toward the lower pool
    pools = sorted(order[:k_pools])
    return [p * kp + j for p in pools for j in range(kp)] + list(range(P * kp, pos + 1))


def test_indexer_select_matches_brute_force(gen):
    kp, k_pools = 4, 4
    for pos in range(0, 70):
        P = (pos + 1) // kp
        s = torch.randint(0, 4, (P,), generator=gen).float()   # few levels: many exact ties
        got = ops.indexer_select(s, pos, k_pools, kp).tolist()
        assert got == brute_select(s.tolist(), pos, k_pools, kp), pos


def test_indexer_mask_matches_per_query_select(gen):
    kp, k_pools, T = 4, 3, 45
    P = T // kp
    scores = torch.randint(0, 5, (T, P), generator=gen).float()
    mask = ops.indexer_mask(scores, k_pools, kp)
    for t in range(T):
        want = brute_select(scores[t].tolist(), t, k_pools, kp)
        assert mask[t].nonzero().flatten().tolist() == want, t


def test_indexer_pool_and_scores_formula(gen):
    kp, d, n, P = 4, 8, 6, 5
    keys, gates = torch.randn(P, kp, d, generator=gen), torch.randn(P, kp, d, generator=gen)
    ape = torch.randn(kp, d, generator=gen)
    pk = ops.indexer_pool(keys, gates, ape)
    for p in range(P):
        for c in range(d):
            wts = torch.softmax(gates[p, :, c] + ape[:, c], 0)
            assert abs(pk[p, c] - (wts * keys[p, :, c]).sum()) < 1e-5
    iq, hw = torch.randn(n, d, generator=gen), torch.randn(n, generator=gen)
    sc = ops.indexer_scores(iq, hw, pk)
    for p in range(P):
        want = sum(hw[h] * n ** -0.5 * max(0.0, float(iq[h] @ pk[p]) * d ** -0.5) for h in range(n))
        assert abs(sc[p] - want) < 1e-5


def test_topk_lower_index_ties():
    s = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]])
    assert ops.topk_lower_index(s, 4).tolist() == [[1, 2, 4, 5]]
    with pytest.raises(ValueError, match="k=7"):
        ops.topk_lower_index(s, 7)


# ------------------------------------------------------------------------------------ FFN
def test_swiglu_clamp(gen):
    gate, up = 4 * torch.randn(100, generator=gen), 4 * torch.randn(100, generator=gen)
    assert (gate > 1).any() and (up.abs() > 1).any()              # the clamp binds on this input
    y = ops.swiglu_clamped(gate, up, 1.0)
    want = F.silu(torch.minimum(gate, torch.tensor(1.0))) * up.clamp(-1, 1)
    torch.testing.assert_close(y, want)
    assert not torch.allclose(y, ops.swiglu_clamped(gate, up, 100.0))


class _Cfg:
    num_experts_per_tok, norm_topk_prob, routed_scaling_factor, swiglu_limit = 3, True, 2.5, 1.5


def test_moe_matches_per_expert_loop(gen):
    cfg, E, H, I, rows = _Cfg(), 7, 16, 12, 9
    x = torch.randn(rows, H, generator=gen)
    gate_w, bias = torch.randn(E, H, generator=gen) / 4, 0.3 * torch.randn(E, generator=gen)
    experts = {e: (torch.randn(I, H, generator=gen) / 4, torch.randn(I, H, generator=gen) / 4,
                   torch.randn(H, I, generator=gen) / 4) for e in range(E)}
    shared = (torch.randn(I, H, generator=gen) / 4, torch.randn(I, H, generator=gen) / 4,
              torch.randn(H, I, generator=gen) / 4)
    fetched = []
    y = ops.moe(x, gate_w, bias, lambda e: fetched.append(e) or experts[e], shared, cfg)
    assert len(fetched) == len(set(fetched))                       # each routed expert fetched once

    def ffn(v, g, u, d):
        return d @ (F.silu((g @ v).clamp(max=cfg.swiglu_limit)) * (u @ v).clamp(-cfg.swiglu_limit, cfg.swiglu_limit))
    for r in range(rows):
        s = [torch.sigmoid(gate_w[e] @ x[r]).item() for e in range(E)]
        chosen = sorted(range(E), key=lambda e: (-(s[e] + bias[e].item()), e))[:3]
        tot = sum(s[e] for e in chosen)
        want = sum(s[e] / tot * 2.5 * ffn(x[r], *experts[e]) for e in chosen) + ffn(x[r], *shared)
        torch.testing.assert_close(y[r], want, rtol=1e-5, atol=1e-5)


def test_moe_route_ties_toward_lower_expert():
    cfg = _Cfg()
    x = torch.zeros(1, 4)                      # all sigmoid scores 0.5: the bias alone decides
    bias = torch.tensor([0.0, 0.1, 0.1, 0.0, 0.1, 0.1])
    w, idx = ops.moe_route(x, torch.randn(6, 4), bias, cfg)
    assert idx.tolist() == [[1, 2, 4]]
    torch.testing.assert_close(w, torch.full((1, 3), 2.5 / 3))
