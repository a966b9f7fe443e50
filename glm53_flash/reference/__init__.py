"""Pure-torch fp32 reference of GLM-5.3-Flash: the spec every kernel and launch is checked against.

`ops` holds one function per kernel family; `model.ReferenceModel` composes them into prefill,
decode steps, per-layer pieces and the MTP block; `caches.DecodeCaches` is its decode state.
"""
from .caches import DecodeCaches
from .model import PrefillOut, ReferenceModel, StepOut

__all__ = ["DecodeCaches", "PrefillOut", "ReferenceModel", "StepOut"]
