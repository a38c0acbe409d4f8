"""Kernel tier: ``numba_flash.softmax`` on masked rows (``-inf`` entries) against the float64
reference (issue 21, item 2): leading, trailing and scattered ``-inf``, a thread whose whole
strided slice is ``-inf``, a single visible entry, and a row that is ``-inf`` everywhere."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.teach.kernels.softmax import default_threads
from helpers import assert_close, randn

NEG_INF = -np.inf


def masked_rows(rng, dtype):
    """Rows of ``n = 2 * THREADS + 5`` (every thread has 2 or 3 elements), one masking pattern
    each, and the index of the row that is ``-inf`` everywhere."""
    threads = default_threads()
    n = 2 * threads + 5
    x = randn(rng, (7, n), np.float64, scale=3.0)
    j = np.arange(n)
    x[0, :3] = NEG_INF  # leading
    x[1, -4:] = NEG_INF  # trailing
    x[2, rng.random(n) < 0.5] = NEG_INF  # scattered
    x[2, 1] = 0.5  # (at least one visible entry)
    x[3, j % threads == 3] = NEG_INF  # thread 3's whole strided slice
    x[4, j != n // 2] = NEG_INF  # one visible entry: y = one-hot
    x[5, (j % threads) != 0] = NEG_INF  # only thread 0 sees anything
    x[6] = NEG_INF  # all masked
    return x.astype(dtype), 6


# the all -inf row's 0 / 0 warns inside the simulator's threads (np.errstate is per thread)
@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning",
                            "ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_softmax_masked_rows_match_reference(rng, dtype):
    x, all_masked = masked_rows(rng, dtype)
    before = x.copy()
    with np.errstate(invalid="ignore", divide="ignore"):  # the all -inf row: 0 / 0 = NaN
        y = numba_flash.softmax(x)
    np.testing.assert_array_equal(x, before)  # input not modified
    want = np.stack([ref.softmax(r) for r in x.astype(np.float64)])
    finite = [i for i in range(x.shape[0]) if i != all_masked]
    assert_close(y[finite], want[finite], dtype)
    assert (y[finite][np.isneginf(x[finite])] == 0).all()  # a masked entry is exactly 0
    np.testing.assert_array_equal(y[4], (np.arange(x.shape[1]) == x.shape[1] // 2).astype(dtype))
    # a row with no visible entry has no softmax: NaN everywhere, as the reference (and torch)
    assert np.isnan(want[all_masked]).all()
    assert np.isnan(y[all_masked]).all()


def test_softmax_issue_example():
    y = numba_flash.softmax(np.array([[NEG_INF, 1.0, 2.0, 3.0]], np.float32))
    assert_close(y, ref.softmax([NEG_INF, 1.0, 2.0, 3.0])[None], np.float32)
    np.testing.assert_allclose(y[0], [0.0, 0.09003057, 0.24472847, 0.66524096], atol=1e-6)
