"""Check of docs/exercises/naive_causal.py: the causal kernel against the float64 reference,
including rows that see no key (Nq > Nk) and a row count that is not a multiple of the block."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref


@pytest.mark.parametrize("nq, nk", [(6, 6), (5, 9), (9, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_naive_causal(exercise, nq, nk, causal):
    check(exercise("naive_causal"), nq, nk, causal)


def check(mod, nq=9, nk=4, causal=True):
    rng = np.random.default_rng(nq * 100 + nk)
    q = rng.standard_normal((1, 2, nq, 8))
    k, v = (rng.standard_normal((1, 1, nk, 8)) for _ in range(2))
    o, lse = mod.run(q, k, v, causal)
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, err_msg="o")
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12, err_msg="lse")
