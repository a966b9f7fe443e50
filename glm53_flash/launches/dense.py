"""The `dense` launch: a KDA layer with the dense clamped-SwiGLU MLP (layers 1-2 of GLM-5.3-Flash).

All of it is the shared KDA layer launch (launches/kda_layer.py kernel, launches/layer_host.py host
side); this module only names the kind, so its wait sites read `dense.<region>`.
"""
from __future__ import annotations

from .layer_host import KdaLayerLaunch


class DenseLaunch(KdaLayerLaunch):
    """DenseLaunch(cfg, checkpoint, layer, tp_rank=0, tp_size=1, width=1, device=None, grid=None)
    .run(X, kda_state, conv_window, *, inject_fault=None) -> X' (see KdaLayerLaunch)."""

    kind = "dense"
