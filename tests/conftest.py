"""Shared pytest fixtures: the tiny config, its deterministic random weights, seeded generators,
and a single-threaded torch for small-op CPU tests (on 2 busy cores, torch's thread pool makes
many tiny ops several times slower)."""
from __future__ import annotations

import pytest
import torch

from glm53_flash.config import preset
from glm53_flash.weights import RandomWeights


@pytest.fixture(scope="session")
def tiny_cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def tiny_weights(tiny_cfg):
    """RandomWeights(tiny, seed=0), cached: the same values as a checkpoint written with seed 0."""
    return RandomWeights(tiny_cfg, seed=0, cache=True)


@pytest.fixture
def gen(request):
    """A torch.Generator seeded from the test's name: fresh, reproducible inputs per test."""
    import zlib
    return torch.Generator().manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one torch thread; restores the previous setting."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
