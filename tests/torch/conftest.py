"""Fixtures of the numba_flash.torch tests (skipped as a whole without torch)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def gen(rng):
    """A torch generator seeded from the test's numpy ``rng`` (so a failure reproduces)."""
    return torch.Generator().manual_seed(int(rng.integers(2**62)))
