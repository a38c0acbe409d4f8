"""Kernel tier: ``numba_flash.softmax`` against the float64 reference."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn


def ref_rows(x):
    return np.stack([ref.softmax(r) for r in np.asarray(x, np.float64)])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (2, 8), (4, 37), (1, 64)])
def test_softmax_matches_reference(rng, dtype, shape):
    x = randn(rng, shape, dtype, scale=3.0)
    y = numba_flash.softmax(x)
    assert y.dtype == dtype and y.shape == shape
    assert_close(y, ref_rows(x), dtype)


def test_softmax_large_logits(rng):
    x = randn(rng, (3, 20), np.float32, scale=1e3)
    y = numba_flash.softmax(x)
    assert_close(y, ref_rows(x), np.float32)


def test_softmax_non_contiguous_and_not_modified(rng):
    base = randn(rng, (6, 40), np.float32)
    x = base[::2, ::3]
    before = base.copy()
    y = numba_flash.softmax(x)
    assert_close(y, ref_rows(x), np.float32)
    np.testing.assert_array_equal(base, before)


def test_softmax_deterministic(rng):
    x = randn(rng, (2, 30), np.float32)
    np.testing.assert_array_equal(numba_flash.softmax(x), numba_flash.softmax(x))


@pytest.mark.parametrize("bad, exc, msg", [
    ([[1.0, 2.0]], TypeError, "x: expected a numpy.ndarray"),
    (np.zeros((2, 2), np.int32), TypeError, "x: expected dtype in"),
    (np.zeros(3, np.float32), ValueError, "x: expected a 2-D array"),
    (np.zeros((0, 3), np.float32), ValueError, "x: expected no empty dimension"),
])
def test_softmax_rejects_bad_input(bad, exc, msg):
    with pytest.raises(exc, match=msg):
        numba_flash.softmax(bad)
