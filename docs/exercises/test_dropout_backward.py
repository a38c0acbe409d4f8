"""Check of docs/exercises/dropout_backward.py: the keep bits of a few tiles against
numba_flash.dropout_mask (tile edges not on multiples of 4, a head and batch other than 0), and
the gradients against reference.attention_backward with that mask."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash as nf
from numba_flash import reference as ref

SEED, P, B, H = 2**40 + 12345, 0.3, 2, 3


@pytest.mark.parametrize("n, br, bc", [(11, 4, 3), (9, 5, 6)])
def test_dropout_backward(exercise, n, br, bc):
    check(exercise("dropout_backward"), n, br, bc)


def check(mod, n=11, br=4, bc=3):
    b, h = 1, 2
    mask = nf.dropout_mask(SEED, B, H, n, n, P)
    for rows, cols in ((range(0, 4), range(0, 3)), (range(5, n), range(3, n - 1))):
        got = mod.keep_tile(SEED, b, h, np.arange(rows.start, rows.stop),
                            np.arange(cols.start, cols.stop), P)
        want = mask[b, h, rows.start:rows.stop, cols.start:cols.stop]
        assert np.array_equal(got, want), f"keep_tile rows {rows}, keys {cols}: wrong bits"
    rng = np.random.default_rng(n)
    q, k, v, do = (rng.standard_normal((n, 4)) for _ in range(4))
    q4, k4, v4, do4 = (x[None, None] for x in (q, k, v, do))
    m4 = mask[b:b + 1, h:h + 1]
    o, lse = ref.attention(q4, k4, v4, dropout_mask=m4, dropout_p=P)
    got = mod.tiled_backward(q, k, v, o[0, 0], do, lse[0, 0], br, bc, SEED, P, b=b, h=h)
    want = ref.attention_backward(do4, q4, k4, v4, dropout_mask=m4, dropout_p=P)
    for name, g, w in zip(("dQ", "dK", "dV"), got, want):
        np.testing.assert_allclose(g, w[0, 0], atol=1e-12, err_msg=name)
