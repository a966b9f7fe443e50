"""Persistent launches, one module per launch kind; `base` is the shared driver.

`available()` lists the kinds implemented; `sites(kind)` their wait-site names in schedule order
(the CLI's `sites --launch KIND`, fault injection); `build_launch(kind, checkpoint)` builds a launch
from a loaded checkpoint (one TP rank) for the runner.
"""
from __future__ import annotations

_KINDS = ("tail",)


def available() -> list[str]:
    """Launch kinds implemented as persistent kernels."""
    return list(_KINDS)


def _check_kind(kind: str) -> None:
    if kind not in _KINDS:
        raise ValueError(f"launch kind {kind!r} is not implemented; implemented: {list(_KINDS)}")


def sites(kind: str, tp: int = 1, **options) -> list[str]:
    """Wait-site names of launch `kind` in schedule order (site i is fault_site / error-record site i).

    tp and options (e.g. tail's norm_mode) select the variant; the defaults are the ones the runner builds."""
    _check_kind(kind)
    from .tail import TailLaunch
    return TailLaunch.site_names(tp, **options)


def build_launch(kind: str, checkpoint, device=None, width: int = 1, **options):
    """A launch of `kind` for the checkpoint's TP rank (weights taken from `checkpoint.weights`)."""
    _check_kind(kind)
    from ..weights import LM_HEAD, PREFIX
    from .tail import TailLaunch
    w = checkpoint.weights
    scales = checkpoint.scales.get(LM_HEAD) if checkpoint.format == "fp8" else None
    return TailLaunch(checkpoint.config, w[LM_HEAD], w[PREFIX + "norm.weight"], scales, tp_rank=checkpoint.tp_rank,
                      tp_size=checkpoint.tp_size, width=width, device=device, **options)
