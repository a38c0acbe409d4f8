"""Shared fixtures for the three tiers.

* tests/reference: the float64 oracle alone (fast, NumPy).
* tests/kernels:   every kernel against the oracle, in the simulator on a CPU, on the device when
                   a GPU is present.  Outputs are NaN-poisoned before every launch (autouse).
* tests/compile:   every launchable configuration to PTX for sm_80/sm_90, assembled by ptxas.
"""

from __future__ import annotations

import os
import warnings
import zlib

import numpy as np
import pytest

with warnings.catch_warnings():  # the suite knows it may run in the simulator: no summary entry
    warnings.filterwarnings("ignore", message="no usable CUDA GPU found")
    import numba_flash


def pytest_collection_modifyitems(config, items):
    if numba_flash.backend() != "cuda":
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _poison_outputs():
    """Every output array a kernel is launched with starts as NaN: an unwritten element fails."""
    with numba_flash.poisoned_outputs():
        yield


@pytest.fixture
def rng(request):
    """A generator per test, seeded from the test's id (stable across runs, distinct across
    tests), so a failure reproduces.  Set NUMBA_FLASH_TEST_SEED=N to draw other inputs."""
    extra = int(os.environ.get("NUMBA_FLASH_TEST_SEED", 0))
    seed = zlib.crc32(request.node.nodeid.encode()) ^ extra
    return np.random.default_rng(seed)

