"""The `embed` launch: token gather + 4-stream expansion fused with layer 0 (KDA + dense MLP).

The gather is fused into the hc_pre partial tasks (launches/kda_layer.py stage 0): a task copies its
column tile of the step's embedding rows into the 4 streams (scratch x0, fp32) and reduces the same
tile for hc_pre while it is hot, so the gather costs no stage and no hop. The streams the layer reads
later (gate row, hc_post) are x0. Everything else is the dense launch.
"""
from __future__ import annotations

import torch

from .layer_host import KdaLayerLaunch


class EmbedLaunch(KdaLayerLaunch):
    """EmbedLaunch(cfg, checkpoint, layer=0, ...).run(tokens [rows] int, kda_state, conv_window) -> X'."""

    kind = "embed"
    embed = True

    def __init__(self, cfg, source, layer: int = 0, **kw):
        super().__init__(cfg, source, layer, **kw)

    def set_tokens(self, tokens: torch.Tensor) -> None:
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"embed: tokens must be a 1-D int32/int64 tensor, got "
                             f"{getattr(tokens, 'shape', type(tokens).__name__)}")
        n, V = tokens.shape[0], self.cfg.vocab_size
        if not 1 <= n <= self.width:
            raise ValueError(f"embed: {n} tokens; this launch is built for 1..{self.width}")
        t = tokens.to("cpu", torch.int64)
        if bool(((t < 0) | (t >= V)).any()):
            raise ValueError(f"embed: token ids {t.tolist()} outside [0, {V})")
        self.tokens[:n] = tokens.to(self.device, torch.int32)

    def set_step(self, tokens, kda_state, conv_window) -> None:
        self.set_tokens(tokens)
        self.set_input(None, kda_state, conv_window)
        if kda_state.shape[0] != tokens.shape[0]:
            raise ValueError(f"embed: {tokens.shape[0]} tokens but {kda_state.shape[0]} state rows")
