"""Check of docs/exercises/merge_splits.py against reference.attention over the whole row:
large scores, empty splits with NaN (unwritten) o, and a row with no key at all."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref


@pytest.mark.parametrize("shift", [0.0, 2000.0])
def test_merge_splits(exercise, shift):
    check(exercise("merge_splits"), shift)


def check(mod, shift=2000.0):
    rng = np.random.default_rng(3)
    n, d, splits = 12, 4, [(0, 5), (5, 8), (8, 12), (12, 16)]  # the last split is past the end
    q = rng.standard_normal((3, d))
    k = rng.standard_normal((n, d)) + shift * q[0] / np.dot(q[0], q[0])  # row 0: scores ~ shift
    v = rng.standard_normal((n, d))
    visible = np.ones((3, n), bool)
    visible[2] = False                                     # row 2 sees no key
    visible[1, 5:8] = False                                # row 1: split 1 is empty for it
    s = q @ k.T
    o_parts = np.full((len(splits), 3, d), np.nan)
    lse_parts = np.full((len(splits), 3), -np.inf)
    for p, (a, b) in enumerate(splits):
        for r in range(3):
            keys = [j for j in range(a, min(b, n)) if visible[r, j]]
            if keys:  # a split that sees no key writes lse = -inf only
                w = np.exp(s[r, keys] - s[r, keys].max())
                o_parts[p, r] = (w / w.sum()) @ v[keys]
                lse_parts[p, r] = s[r, keys].max() + np.log(w.sum())
    with np.errstate(all="ignore"):
        o, lse = mod.merge(o_parts, lse_parts)
    for r in range(2):
        keys = visible[r]
        want_o, want_lse = ref.attention(q[None, None, r:r + 1], k[None, None, keys],
                                         v[None, None, keys], softmax_scale=1.0)
        np.testing.assert_allclose(o[r], want_o[0, 0, 0], atol=1e-10, err_msg=f"o of row {r}")
        np.testing.assert_allclose(lse[r], want_lse[0, 0, 0], rtol=1e-12,
                                   err_msg=f"lse of row {r}")
    assert lse[2] == -np.inf and (o[2] == 0).all(), "a row with no key: lse = -inf, o = 0"
