"""KDA (Kimi delta attention) sub-layer of the reference, prefill and decode forms.

Both forms share the projections; they differ in the conv (F.conv1d over the prompt vs one window
step) and the recurrence (chunked triangular solve vs one delta-rule step), so the decode==prefill
test checks one against the other. `get(name)` returns an fp32 weight by its HF checkpoint name.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from . import ops

Tensor = torch.Tensor
Getter = Callable[[str], Tensor]


def _conv_weight(get: Getter, p: str) -> Tensor:
    """The three depthwise convs side by side: [3*D, K] over channels q|k|v."""
    return torch.cat([get(p + f"{n}_conv1d.weight").squeeze(1) for n in "qkv"], dim=0)


def _project(get: Getter, p: str, cfg, a: Tensor):
    """a [rows, H] (input_layernorm output) -> raw q|k|v [rows, 3D], g [rows, nh, d], beta [rows, nh],
    output gate [rows, nh, d]."""
    qkv = torch.cat([a @ get(p + f"{n}_proj.weight").t() for n in "qkv"], dim=-1)
    f = (a @ get(p + "f_a_proj.weight").t()) @ get(p + "f_b_proj.weight").t()
    g = ops.kda_gate(f, get(p + "A_log"), get(p + "dt_bias"), cfg.linear_lower_bound)
    beta = torch.sigmoid(a @ get(p + "b_proj.weight").t())
    gate = (a @ get(p + "g_a_proj.weight").t()) @ get(p + "g_b_proj.weight").t()
    return qkv, g, beta, gate.view(*gate.shape[:-1], cfg.linear_num_heads, cfg.linear_head_dim)


def _split_heads(x: Tensor, cfg) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [rows, 3D] -> q, k, v [rows, nh, d]."""
    shape = (*x.shape[:-1], cfg.linear_num_heads, cfg.linear_head_dim)
    q, k, v = x.split(cfg.kda_dim, dim=-1)
    return q.reshape(shape), k.reshape(shape), v.reshape(shape)


def _output(get: Getter, p: str, cfg, o: Tensor, gate: Tensor) -> Tensor:
    """o [rows, nh, dv] -> gated per-head RMSNorm -> o_proj -> [rows, H].
    (HF returns the KDA core output in the activation dtype, bf16 in a bf16 model; we stay fp32.)"""
    o = ops.gated_rms_norm(o, gate, get(p + "o_norm.weight"), cfg.rms_norm_eps)
    return o.reshape(o.shape[0], -1) @ get(p + "o_proj.weight").t()


def kda_prefill(get: Getter, p: str, cfg, a: Tensor, chunk: int = 32) -> tuple[Tensor, Tensor, Tensor]:
    """Whole prompt a [T, H] from an empty state. Returns (y [T, H], state [nh, dv, dk],
    conv window [K-1, 3D])."""
    qkv, g, beta, gate = _project(get, p, cfg, a)
    x, window = ops.kda_conv(qkv, _conv_weight(get, p))
    q, k, v = _split_heads(x, cfg)
    o, S = ops.kda_chunked(q, k, v, g, beta, chunk=chunk)
    return _output(get, p, cfg, o, gate), S, window


def kda_decode(get: Getter, p: str, cfg, a: Tensor, S: Tensor, window: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row: a [w, H], S [w, nh, dv, dk], window [w, K-1, 3D].
    Returns (y [w, H], new S, new window)."""
    qkv, g, beta, gate = _project(get, p, cfg, a)
    x, window = ops.kda_conv_step(window, qkv, _conv_weight(get, p))
    q, k, v = _split_heads(x, cfg)
    o, S = ops.kda_recurrent_step(S, q, k, v, g, beta)
    return _output(get, p, cfg, o, gate), S, window
