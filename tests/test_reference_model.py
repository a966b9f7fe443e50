"""The reference model against itself in independent forms: decode step by step == whole-prompt
prefill (chunked KDA vs recurrent, expanded vs absorbed MLA, selection from cached pools vs from the
prompt), batched rows == single rows, MTP decode == MTP prefill, plus input validation, the SwiGLU
clamp, non-degenerate greedy output, and sane activations at the real shapes."""
from __future__ import annotations

import time

import pytest
import torch

from glm53_flash.config import preset
from glm53_flash.reference import ReferenceModel, ops
from glm53_flash.weights import PREFIX, RandomWeights

pytestmark = pytest.mark.usefixtures("one_thread")

T_LONG = 64


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def model(tiny_cfg, tiny_weights):
    return ReferenceModel(tiny_cfg, tiny_weights)


@pytest.fixture(scope="module")
def prompt(tiny_cfg):
    return torch.randint(0, tiny_cfg.vocab_size, (T_LONG,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def runs(model, prompt):
    """The prompt through prefill (with caches) and through T decode steps, with DSA traces."""
    c_pre, tr_pre = model.new_caches(1, 80), {}
    pre = model.prefill(prompt, c_pre, trace=tr_pre)
    c_dec, tr_dec, logits, hidden = model.new_caches(1, 80), [], [], []
    for t in range(T_LONG):
        tr = {}
        out = model.decode_step(c_dec, prompt[t:t + 1], torch.tensor([t]), trace=tr)
        logits.append(out.logits)
        hidden.append(out.hidden)
        tr_dec.append(tr)
    return dict(pre=pre, c_pre=c_pre, tr_pre=tr_pre, c_dec=c_dec, tr_dec=tr_dec,
                logits=torch.cat(logits), hidden=torch.cat(hidden))


# ----------------------------------------------------------------------------- decode == prefill
def test_decode_matches_prefill(runs, tiny_cfg):
    pre = runs["pre"]
    scale = pre.logits.abs().max().item()
    d_logit, d_hidden = max_diff(runs["logits"], pre.logits), max_diff(runs["hidden"], pre.hidden)
    print(f"\ndecode vs prefill over {T_LONG} tokens: max|dlogit|={d_logit:.2e} (logit scale {scale:.2f}), "
          f"max|dhidden|={d_hidden:.2e}")
    assert d_logit <= 1e-4 * max(1.0, scale)
    assert d_hidden <= 1e-4
    # the caches prefill leaves behind equal those of T decode steps
    for name, t in runs["c_pre"].tensors().items():
        d = max_diff(t.float(), runs["c_dec"].tensors()[name].float())
        assert d <= 1e-4 * max(1.0, t.abs().max().item()), (name, d)


def test_selection_sparse_and_same_in_both_forms(runs, tiny_cfg):
    """The sparse regime is reached (pos + 1 >= 20 on tiny) and decode selects, at every position and
    DSA layer, exactly the tokens prefill's mask selects."""
    sparse = 0
    for li in tiny_cfg.dsa_layers:
        mask = runs["tr_pre"][li]["mask"]
        for t in range(T_LONG):
            toks = runs["tr_dec"][t][li][0]
            assert toks.tolist() == mask[t].nonzero().flatten().tolist(), (li, t)
            sparse += len(toks) < t + 1
            assert len(toks) <= tiny_cfg.index_width
    assert sparse >= len(tiny_cfg.dsa_layers) * (T_LONG - 20)
    assert len(runs["tr_dec"][T_LONG - 1][tiny_cfg.dsa_layers[0]][0]) == tiny_cfg.index_topk  # 64 % 4 == 0: no tail


def test_prefill_then_decode(model, prompt, runs):
    """Prefill 37 tokens into a slot, decode the rest: same logits as the whole-prompt prefill."""
    c = model.new_caches(2, 80)
    head = model.prefill(prompt[:37], c, slot=1)
    logits = [model.decode_step(c, prompt[t:t + 1], torch.tensor([t]), torch.tensor([1])).logits
              for t in range(37, T_LONG)]
    ref = runs["pre"].logits
    d = max(max_diff(head.logits, ref[:37]), max_diff(torch.cat(logits), ref[37:]))
    print(f"\nprefill(37) + decode vs prefill(64): max|dlogit|={d:.2e}")
    assert d <= 1e-4 * max(1.0, ref.abs().max().item())
    assert c.lengths.tolist() == [0, T_LONG]


# ----------------------------------------------------------------------------- batched rows
def test_batched_rows_match_single_rows(model, tiny_cfg):
    g = torch.Generator().manual_seed(11)
    lens = [21, 26, 23, 30]
    prompts = [torch.randint(0, tiny_cfg.vocab_size, (n,), generator=g) for n in lens]
    steps = torch.randint(0, tiny_cfg.vocab_size, (3, 4), generator=g)   # 3 decode tokens per prompt

    singles = []                                  # each prompt alone in a 1-slot cache
    for i, p in enumerate(prompts):
        c = model.new_caches(1, 40)
        model.prefill(p, c)
        singles.append([model.decode_step(c, steps[s, i:i + 1], torch.tensor([lens[i] + s])).logits[0]
                        for s in range(3)])

    c = model.new_caches(4, 40)                   # prompt i in slot order[i]
    order = [2, 0, 3, 1]
    for i, p in enumerate(prompts):
        model.prefill(p, c, slot=order[i])
    worst = 0.0
    for s in range(3):
        rows = [0, 1, 2, 3] if s != 1 else [3, 1]        # w=4, then w=2, then w=4
        slots = torch.tensor([order[i] for i in rows])
        pos = torch.tensor([lens[i] + s for i in rows])
        out = model.decode_step(c, steps[s, rows], pos, slots)
        for r, i in enumerate(rows):
            worst = max(worst, max_diff(out.logits[r], singles[i][s]))
        if s == 1:                                        # rows 0 and 2 did not step: catch them up
            rows = [0, 2]
            out = model.decode_step(c, steps[s, rows], torch.tensor([lens[i] + s for i in rows]),
                                    torch.tensor([order[i] for i in rows]))
            for r, i in enumerate(rows):
                worst = max(worst, max_diff(out.logits[r], singles[i][s]))
    print(f"\nbatched vs single rows: max|dlogit|={worst:.2e}")
    assert worst <= 1e-5 * 10


# ----------------------------------------------------------------------------- MTP
def test_mtp_decode_matches_prefill(model, prompt, runs, tiny_cfg):
    """Rows i = (h_i, t_{i+1}): the block run as one prompt == row by row from its own caches."""
    T = 40                                         # past pos + 1 >= 20: sparse selection in the block
    h, nxt = runs["pre"].hidden[:T], prompt[1:T + 1]
    c_pre, c_dec = model.new_caches(1, 48), model.new_caches(1, 48)
    pre = model.nextn_prefill(h, nxt, c_pre)
    dec = [model.nextn_step(c_dec, h[i:i + 1], nxt[i:i + 1], torch.tensor([i])) for i in range(T)]
    d_logit = max_diff(torch.cat([o.logits for o in dec]), pre.logits)
    d_hidden = max_diff(torch.cat([o.hidden for o in dec]), pre.hidden)
    print(f"\nMTP decode vs prefill over {T} rows: max|dlogit|={d_logit:.2e} max|dhidden|={d_hidden:.2e}")
    assert d_logit <= 1e-4 * max(1.0, pre.logits.abs().max().item())
    assert d_hidden <= 1e-4
    assert c_dec.mtp_lengths.tolist() == [T] and c_dec.lengths.tolist() == [0]
    mtp = c_dec.n_dsa
    for name in ("latent", "pool_keys", "tail_rows"):
        assert max_diff(getattr(c_pre, name)[:, mtp], getattr(c_dec, name)[:, mtp]) <= 1e-4
        assert getattr(c_dec, name)[:, :mtp].abs().max() == 0        # trunk layers untouched


def test_mtp_first_row_formula(model, runs, prompt, tiny_cfg):
    """Row 0 written out by hand: attention over one token is that token's value."""
    get, eps = model.get, tiny_cfg.rms_norm_eps
    p = f"{PREFIX}layers.{tiny_cfg.num_hidden_layers}."
    a = p + "self_attn."
    h, t1 = runs["pre"].hidden[:1], prompt[1:2]
    e = model._embed_rows(t1)
    x = torch.cat([ops.rms_norm(e, get(p + "enorm.weight"), eps), ops.rms_norm(h, get(p + "hnorm.weight"), eps)],
                  -1) @ get(p + "eh_proj.weight").t()
    u = ops.rms_norm(x, get(p + "input_layernorm.weight"), eps)
    c = ops.rms_norm(u @ get(a + "kv_a_proj_with_mqa.weight").t(), get(a + "kv_a_layernorm.weight"), eps)
    nh, dn = tiny_cfg.num_attention_heads, tiny_cfg.qk_nope_head_dim
    v = (c @ get(a + "kv_b_proj.weight").t()).view(nh, 2 * dn)[:, dn:]          # value of token 0 per head
    y = x + v.reshape(1, -1) @ get(a + "o_proj.weight").t()
    f = ops.rms_norm(y, get(p + "post_attention_layernorm.weight"), eps)
    sh = [get(f"{p}mlp.shared_experts.{n}_proj.weight") for n in ("gate", "up", "down")]
    w, idx = ops.moe_route(f, get(p + "mlp.gate.weight"), get(p + "mlp.gate.e_score_correction_bias"), tiny_cfg)
    z = y + ops.mlp(f, *sh, tiny_cfg.swiglu_limit)
    for k in range(idx.shape[1]):
        ex = [get(f"{p}mlp.experts.{int(idx[0, k])}.{n}_proj.weight") for n in ("gate", "up", "down")]
        z = z + w[0, k] * ops.mlp(f, *ex, tiny_cfg.swiglu_limit)
    n = ops.rms_norm(z, get(p + "shared_head.norm.weight"), eps)
    out = model.nextn_prefill(h, t1)
    torch.testing.assert_close(out.hidden, n, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, n @ get("lm_head.weight").t(), rtol=1e-5, atol=1e-4)


# ----------------------------------------------------------------------------- validation
def test_bad_inputs_raise_and_leave_caches_untouched(model, tiny_cfg):
    V, H = tiny_cfg.vocab_size, tiny_cfg.hidden_size
    c = model.new_caches(3, 12)
    g = torch.Generator().manual_seed(3)
    model.prefill(torch.randint(0, V, (5,), generator=g), c, slot=0)
    model.prefill(torch.randint(0, V, (12,), generator=g), c, slot=2)          # slot 2 is full
    model.nextn_prefill(torch.randn(4, H, generator=g), torch.randint(0, V, (4,), generator=g), c, slot=0)
    before = c.clone()
    t = torch.tensor
    X = torch.randn(1, 4, H)
    bad = [
        ("tokens", lambda: model.decode_step(c, t([V]), t([5]))),
        ("tokens", lambda: model.decode_step(c, t([3, -1]), t([5, 0]), t([0, 1]))),
        ("tokens", lambda: model.decode_step(c, t([1.0]), t([5]))),
        ("tokens", lambda: model.decode_step(c, t([[1]]), t([5]))),
        ("positions", lambda: model.decode_step(c, t([1]), t([4]))),
        ("positions", lambda: model.decode_step(c, t([1, 2]), t([5]), t([0, 1]))),
        ("positions", lambda: model.decode_step(c, t([1, 2]), t([5, 1]), t([0, 1]))),    # row 1 is bad
        ("positions", lambda: model.decode_step(c, t([1]), t([12]), t([2]))),             # >= max_len
        ("slots", lambda: model.decode_step(c, t([1, 2]), t([5, 5]), t([0, 0]))),
        ("slots", lambda: model.decode_step(c, t([1]), t([0]), t([3]))),
        ("slots", lambda: model.decode_step(c, t([1, 2, 3, 4]), t([5, 0, 12, 0]))),
        ("caches", lambda: model.decode_step("nope", t([1]), t([5]))),
        ("X", lambda: model.layer_step(c, 0, torch.randn(1, 3, H), t([5]))),
        ("layer_idx", lambda: model.layer_step(c, tiny_cfg.num_hidden_layers, X, t([5]))),
        ("positions", lambda: model.layer_step(c, 3, X, t([6]))),
        ("slot", lambda: model.prefill(t([1, 2]), c, slot=0)),                            # not empty
        ("slot", lambda: model.prefill(t([1, 2]), c, slot=5)),
        ("tokens", lambda: model.prefill(torch.randint(0, V, (13,)), c, slot=1)),         # > max_len
        ("tokens", lambda: model.prefill(t([0, V + 3]), c, slot=1)),
        ("hidden", lambda: model.nextn_step(c, torch.randn(1, H + 1), t([1]), t([4]))),
        ("hidden", lambda: model.nextn_step(c, torch.ones(1, H, dtype=torch.int64), t([1]), t([4]))),
        ("positions", lambda: model.nextn_step(c, torch.randn(1, H), t([1]), t([5]))),
        ("next_tokens", lambda: model.nextn_step(c, torch.randn(1, H), t([V]), t([4]))),
        ("slot", lambda: model.nextn_prefill(torch.randn(2, H), t([1, 2]), c, slot=0)),
    ]
    for what, call in bad:
        with pytest.raises(ValueError, match=what):
            call()
        for name, ten in c.tensors().items():
            assert torch.equal(ten, before.tensors()[name]), (what, name)
    # and a good call still works afterwards
    model.decode_step(c, t([1]), t([5]))
    assert c.lengths.tolist() == [6, 0, 12]


# ----------------------------------------------------------------------------- clamp, greedy
def test_swiglu_limit_binds(tiny_cfg, tiny_weights, prompt, runs, monkeypatch):
    seen = {"gate": 0.0, "up": 0.0}
    inner = ops.swiglu_clamped

    def spy(gate, up, limit):
        seen["gate"] = max(seen["gate"], gate.max().item())
        seen["up"] = max(seen["up"], up.abs().max().item())
        return inner(gate, up, limit)

    monkeypatch.setattr(ops, "swiglu_clamped", spy)
    low = ReferenceModel(tiny_cfg.replace(swiglu_limit=0.5), tiny_weights).prefill(prompt[:16])
    d = max_diff(low.logits, runs["pre"].logits[:16])
    print(f"\nswiglu_limit 0.5: pre-clamp max gate {seen['gate']:.2f}, max |up| {seen['up']:.2f}; "
          f"logits move by {d:.2f}")
    assert seen["gate"] > 0.5 and seen["up"] > 0.5
    assert d > 1e-2


def test_greedy_tokens_do_not_collapse(model, runs, tiny_cfg):
    """All 8 layers + tail: the prefill argmax over a random prompt and a greedy continuation are
    not one constant token."""
    pre_tokens = runs["pre"].logits.argmax(-1)
    c = model.new_caches(1, 40)
    out = model.prefill(torch.tensor([5, 17, 300, 42]), c)
    tok, gen = out.logits[-1].argmax().view(1), []
    for pos in range(4, 28):
        gen.append(int(tok))
        tok = model.decode_step(c, tok, torch.tensor([pos])).logits[0].argmax().view(1)
    print(f"\nprefill argmax distinct: {len(set(pre_tokens.tolist()))}/{T_LONG}; greedy: {gen}")
    assert len(set(pre_tokens.tolist())) >= T_LONG // 4
    assert len(set(gen)) >= 4


# ----------------------------------------------------------------------------- real shapes
def test_real_shape_activations_are_sane():
    """One layer of each kind at the real shapes (RandomWeights, only routed experts materialised):
    finite, std within 0.05..50, rows not constant across tokens. 3 tokens through layer 0 (KDA + dense),
    then layer 3 (DSA + MoE) and layer 4 (KDA + MoE)."""
    cfg = preset("glm53-flash")
    t0 = time.time()
    m = ReferenceModel(cfg, RandomWeights(cfg, seed=0))
    g = torch.Generator().manual_seed(5)
    X = ops.hc_expand(torch.randn(3, cfg.hidden_size, generator=g), cfg.hc_mult)   # embedding-like rows
    report = []
    for li, rows in ((0, 3), (3, 3), (4, 3)):
        plan = cfg.layers[li]
        X_in = X[:rows]
        X = m.layer_prefill(li, X_in)
        inc = X - X_in
        for what, t in (("X", X), ("increment", inc)):
            std = t.std().item()
            report.append(f"L{li} {plan.mixer}+{plan.ffn} {what}: std {std:.3f}")
            assert torch.isfinite(t).all(), (li, what)
            assert 0.05 <= std <= 50, (li, what, std)
        per_token = X.reshape(rows, -1)
        assert (per_token - per_token[0]).abs().max() > 1e-3 * per_token.abs().max(), li
        m.drop_cached_weights()                                   # free this layer's fp32 weights
    print("\n" + "\n".join(report) + f"\n({time.time() - t0:.1f} s)")
