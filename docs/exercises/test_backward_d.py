"""Check of docs/exercises/backward_d.py: D against rowsum(dO * O) of the float64 reference,
with several K/V tiles per row (a per-tile quantity cannot pass), causal and not."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref


@pytest.mark.parametrize("n, br, bc", [(12, 4, 3), (10, 3, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_d(exercise, n, br, bc, causal):
    check(exercise("backward_d"), n, br, bc, causal)


def check(mod, n=11, br=4, bc=3, causal=True):
    rng = np.random.default_rng(n * 10 + bc)
    q, k, v, do = (rng.standard_normal((n, 5)) * 1.5 for _ in range(4))
    o, lse = ref.attention(q[None, None], k[None, None], v[None, None], causal=causal)
    got = mod.delta(q, k, v, do, lse[0, 0], br, bc, causal=causal)
    want = (do * o[0, 0]).sum(axis=1)
    np.testing.assert_allclose(got, want, atol=1e-12, err_msg="D")
