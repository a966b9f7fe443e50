"""Persistent launches, one module per launch kind; `base` is the shared driver.

`available()` lists the kinds implemented; `sites(kind)` their wait-site names in schedule order
(the CLI's `sites --launch KIND`, fault injection); `build_launch(kind, checkpoint)` builds a launch
from a loaded checkpoint (one TP rank) for the runner. Layer kinds are bound to one layer's weights:
`build_launch(kind, checkpoint, layer=i)` (default: the first layer of that kind in the config's plan;
nextn: the MTP block). sparse and nextn also take max_len= (the cache length their selection tasks
are built for).
"""
from __future__ import annotations

_KDA_KINDS = ("embed", "dense", "kda")       # launches/layer_host.py family: KDA mixer + MLP / MoE
_DSA_KINDS = ("sparse", "nextn")             # launches/sparse_layer.py family: DSA mixer + MoE
_KINDS = ("tail",) + _KDA_KINDS + _DSA_KINDS


def available() -> list[str]:
    """Launch kinds implemented as persistent kernels."""
    return list(_KINDS)


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"launch kind {kind!r} is not implemented; implemented: {list(_KINDS)}")


def _launch_class(kind: str):
    if kind == "embed":
        from .embed import EmbedLaunch
        return EmbedLaunch
    if kind == "dense":
        from .dense import DenseLaunch
        return DenseLaunch
    if kind == "kda":
        from .kda import KdaLaunch
        return KdaLaunch
    if kind == "sparse":
        from .sparse import SparseLaunch
        return SparseLaunch
    if kind == "nextn":
        from .nextn import NextnLaunch
        return NextnLaunch
    from .tail import TailLaunch
    return TailLaunch


def sites(kind: str, tp: int = 1, **options) -> list[str]:
    """Wait-site names of launch `kind` in schedule order (site i is fault_site / error-record site i).

    tp and options select the variant. Tail: norm_mode. KDA layer kinds: head_dim (default 128, the real
    model; 64 on the tiny preset) or block_v_split (True when the KDA value blocks are narrower than a head,
    which adds the `oraw` site). Layer kinds (KDA and DSA): oproj_split and down_groups, the K slices of
    o_proj (> 1 adds `xo` at TP 1) and of the down GEMV / MoE expert groups (> 1 adds `dp`); a launch
    chooses them from its shapes (1 by default here; the real model's TP1 launches split both). NextN: width
    (default 1; wider launches keep their norm tasks, which adds `ein` and `a_in`). A built launch's own list
    is `launch.sites`."""
    _check_kind(kind)
    cls = _launch_class(kind)
    splits = {k: options.pop(k) for k in ("oproj_split", "down_groups") if k in options}
    if kind in _KDA_KINDS:
        from .layer_host import default_block_v
        split = options.pop("block_v_split", None)
        head_dim = options.pop("head_dim", 128)
        if options:
            raise ValueError(f"sites({kind!r}): unknown options {sorted(options)}")
        if split is None:
            split = default_block_v(head_dim) < head_dim
        return cls.site_names(tp, block_v_split=split, **splits)
    if kind in _DSA_KINDS:
        if kind == "nextn" and "width" in options:               # the norm folds are chosen by width
            splits["width"] = options.pop("width")
        if options:
            raise ValueError(f"sites({kind!r}): unknown options {sorted(options)}")
        return cls.site_names(tp, **splits)
    if splits:
        raise ValueError(f"sites({kind!r}): unknown options {sorted(splits)}")
    return cls.site_names(tp, **options)


def build_launch(kind: str, checkpoint, device=None, width: int = 1, layer: int | None = None, **options):
    """A launch of `kind` for the checkpoint's TP rank (weights taken from `checkpoint.weights`)."""
    _check_kind(kind)
    cls = _launch_class(kind)
    cfg = checkpoint.config
    common = dict(tp_rank=checkpoint.tp_rank, tp_size=checkpoint.tp_size, width=width, device=device, **options)
    if kind in _KDA_KINDS or kind == "sparse":
        if layer is None:
            layer = next(p.index for p in cfg.layers if p.launch == kind)
        return cls(cfg, checkpoint, layer, **common)
    if kind == "nextn":
        return cls(cfg, checkpoint, layer, **common)
    from ..weights import LM_HEAD, PREFIX
    w = checkpoint.weights
    scales = checkpoint.scales.get(LM_HEAD) if checkpoint.format == "fp8" else None
    return cls(cfg, w[LM_HEAD], w[PREFIX + "norm.weight"], scales, **common)
