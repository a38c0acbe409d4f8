"""Check of docs/exercises/naive_window.py: the windowed kernel against the float64 reference
(rows with no key, a window wider than the row's history, Nq > Nk), and the bytes read from k and
v: exactly the keys each row sees, counted element by element in the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref


@pytest.mark.parametrize("nq, nk, window", [(9, 9, 3), (5, 11, 4), (9, 4, 2), (6, 6, 0)])
def test_naive_window(exercise, nq, nk, window):
    check(exercise("naive_window"), nq, nk, window)


def check(mod, nq=9, nk=12, window=3):
    from io_count import counting_wrap

    rng = np.random.default_rng(nq * 100 + nk)
    q = rng.standard_normal((1, 2, nq, 8))
    k, v = (rng.standard_normal((1, 1, nk, 8)) for _ in range(2))
    wrap, stats = counting_wrap()
    o, lse = mod.run(q, k, v, window, wrap)
    win = (window - 1, 0) if window else (-1, -1)
    o_ref, lse_ref = ref.attention(q, k, v, causal=True, window_size=win)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, err_msg="o")
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12, err_msg="lse")
    seen = int(ref.visible_mask(nq, nk, causal=True, window_size=win).sum())
    want = 2 * seen * 8 * 8          # 2 heads, d = 8 elements of 8 bytes, per visible key
    got = stats["k"]["read"]
    assert got == want, f"k: {got} bytes read, the keys the rows see are {want} bytes"
