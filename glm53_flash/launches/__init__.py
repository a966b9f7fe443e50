"""Persistent launches, one module per launch kind; `base` is the shared driver.

`available()` lists the kinds implemented; `sites(kind)` their wait-site names in schedule order
(the CLI's `sites --launch KIND`, fault injection); `build_launch(kind, checkpoint)` builds a launch
from a loaded checkpoint (one TP rank) for the runner. The layer kinds (embed, dense, kda) are bound
to one layer's weights: `build_launch(kind, checkpoint, layer=i)` (default: the first layer of that
kind in the config's plan).
"""
from __future__ import annotations

_KINDS = ("tail", "embed", "dense", "kda")
_LAYER_KINDS = ("embed", "dense", "kda")


def available() -> list[str]:
    """Launch kinds implemented as persistent kernels."""
    return list(_KINDS)


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"launch kind {kind!r} is not implemented; implemented: {list(_KINDS)}")


def _layer_class(kind: str):
    if kind == "embed":
        from .embed import EmbedLaunch
        return EmbedLaunch
    if kind == "dense":
        from .dense import DenseLaunch
        return DenseLaunch
    from .kda import KdaLaunch
    return KdaLaunch


def sites(kind: str, tp: int = 1, **options) -> list[str]:
    """Wait-site names of launch `kind` in schedule order (site i is fault_site / error-record site i).

    tp and options select the variant; the defaults are the ones the runner builds. Tail: norm_mode.
    Layer kinds: head_dim (default 128, the real model; 64 on the tiny preset) or block_v_split (True
    when the KDA value blocks are narrower than a head, which adds the `oraw` site)."""
    _check_kind(kind)
    if kind in _LAYER_KINDS:
        from .layer_host import default_block_v
        split = options.pop("block_v_split", None)
        head_dim = options.pop("head_dim", 128)
        if options:
            raise ValueError(f"sites({kind!r}): unknown options {sorted(options)}")
        if split is None:
            split = default_block_v(head_dim) < head_dim
        return _layer_class(kind).site_names(tp, block_v_split=split)
    from .tail import TailLaunch
    return TailLaunch.site_names(tp, **options)


def build_launch(kind: str, checkpoint, device=None, width: int = 1, layer: int | None = None, **options):
    """A launch of `kind` for the checkpoint's TP rank (weights taken from `checkpoint.weights`)."""
    _check_kind(kind)
    if kind in _LAYER_KINDS:
        cfg = checkpoint.config
        if layer is None:
            layer = next(p.index for p in cfg.layers if p.launch == kind)
        return _layer_class(kind)(cfg, checkpoint, layer, tp_rank=checkpoint.tp_rank, tp_size=checkpoint.tp_size,
                                  width=width, device=device, **options)
    from ..weights import LM_HEAD, PREFIX
    from .tail import TailLaunch
    w = checkpoint.weights
    scales = checkpoint.scales.get(LM_HEAD) if checkpoint.format == "fp8" else None
    return TailLaunch(checkpoint.config, w[LM_HEAD], w[PREFIX + "norm.weight"], scales, tp_rank=checkpoint.tp_rank,
                      tp_size=checkpoint.tp_size, width=width, device=device, **options)
