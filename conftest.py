"""Project-wide pytest set-up (loaded before tests/conftest.py).

Without CUDA the Triton kernels run under the interpreter: TRITON_INTERPRET must be set before any
module that defines an @triton.jit function is imported, so it is set here, first. GPU tests carry the
`gpu` marker and skip without CUDA; REQUIRE_CUDA=1 (set on the GPU machine) turns that skip into a
failure so nothing silently skips there.
"""
import os

import pytest

try:
    import torch
    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # torch missing is a set-up error reported by the tests themselves
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    require = os.environ.get("REQUIRE_CUDA") == "1"
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if gpu_items and require:
        raise pytest.UsageError(f"REQUIRE_CUDA=1 but CUDA is not available ({len(gpu_items)} gpu tests)")
    for item in gpu_items:
        item.add_marker(pytest.mark.skip(reason="needs CUDA"))
