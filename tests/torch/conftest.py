"""Fixtures of the numba_flash.torch tests (each test module skips itself without torch)."""

from __future__ import annotations

import pytest


@pytest.fixture
def gen(rng):
    """A torch generator seeded from the test's numpy ``rng`` (so a failure reproduces)."""
    import torch

    return torch.Generator().manual_seed(int(rng.integers(2**62)))
