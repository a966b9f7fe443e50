"""The `embed` launch (token gather + 4-stream expansion fused into the hc_pre partial tasks, then
layer 0 as the dense launch) against the reference's embed + `layer_step(0)` on the tiny preset:
X', the KDA state and conv window, NaN-poisoned scratch, pad rows, bad token ids refused, fault
injection (first and last sites) with the caller's state untouched; GPU checks under `gpu`.
Shared helpers: tests/test_launch_dense.py."""
import pytest
import torch

from glm53_flash.launches import sites
from glm53_flash.launches.embed import EmbedLaunch
from sync import HandoffTimeout
from test_launch_dense import (TOL_BF16, check_step, gpu_layer_check, make_step, poison_scratch,  # noqa: F401
                               rank_state, tiny_ref)


@pytest.mark.parametrize("width, rows", [(1, 1), (4, 3)], ids=["w1", "w4-rows3"])
def test_embed_vs_reference(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread, width, rows):
    _, caches = make_step(tiny_cfg, tiny_ref, 0, rows, gen)
    tokens = torch.randint(0, tiny_cfg.vocab_size, (rows,), generator=gen)
    S, W = rank_state(tiny_cfg, caches, 0)
    L = EmbedLaunch(tiny_cfg, tiny_weights, width=width)
    poison_scratch(L)
    out = L.run(tokens, S, W)
    x0 = L.layout.view(L.scratch, "x0")[:rows]
    assert torch.equal(x0, tiny_ref.embed(tokens))                     # the gathered, expanded streams
    check_step(L, out, S, W, tiny_ref, caches, 0, tiny_ref.embed(tokens), TOL_BF16, label="bf16")
    assert bool(torch.isnan(L.X_out[rows:]).all()) and bool(torch.isnan(L.S_out[rows:]).all())


def test_embed_faults_and_bad_tokens(tiny_cfg, tiny_weights, tiny_ref, gen, one_thread):
    _, caches = make_step(tiny_cfg, tiny_ref, 0, 1, gen)
    tokens = torch.tensor([7])
    S, W = rank_state(tiny_cfg, caches, 0)
    L = EmbedLaunch(tiny_cfg, tiny_weights, width=1)
    assert list(L.sites) == sites("embed", head_dim=64)
    S0, W0 = S.clone(), W.clone()
    for site in (L.sites.names[0], L.sites.names[-1]):
        with pytest.raises(HandoffTimeout, match=f"wait site '{site}'"):
            L.run(tokens, S, W, inject_fault=site)
        assert torch.equal(S, S0) and torch.equal(W, W0)
    out = L.run(tokens, S, W)
    check_step(L, out, S, W, tiny_ref, caches, 0, tiny_ref.embed(tokens), TOL_BF16, label="after-faults")
    with pytest.raises(ValueError, match=r"token ids \[1024\] outside \[0, 1024\)"):
        L.run(torch.tensor([1024]), S, W)
    with pytest.raises(ValueError, match="2 tokens; this launch is built for 1..1"):
        L.run(torch.tensor([1, 2]), S, W)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("tp", [1, 8], ids=["tp1", "tp8"])
@pytest.mark.parametrize("width", [1, 8], ids=["w1", "w8"])
def test_gpu_embed(tp, width, fmt):
    gpu_layer_check(EmbedLaunch, 0, tp, width, fmt)
