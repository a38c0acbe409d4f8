"""Check of docs/exercises/row_window_tiles.py: right outputs, and the bytes read from k and v
equal to the tiles the blocks need (each K/V tile once per block in which some row sees a key of
it), counted element by element in the simulator (docs/examples/io_count.py)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref


@pytest.mark.parametrize("nq, nk, window", [(12, 12, 4), (5, 14, 2), (13, 7, 3), (8, 8, 0)])
def test_row_window_tiles(exercise, nq, nk, window):
    check(exercise("row_window_tiles"), nq, nk, window)


def tile_bytes(nq, nk, d, block_m, block_n, window, itemsize):
    """k and v bytes of the tiles each block needs: from the tile of its first row's first key
    to the tile of its last row's last key."""
    vis = ref.visible_mask(nq, nk, causal=True,
                           window_size=(window - 1, 0) if window else (-1, -1))
    total = 0
    for first in range(0, nq, block_m):
        keys = np.flatnonzero(vis[first:first + block_m].any(axis=0))
        if keys.size:
            for t in range(keys[0] // block_n, keys[-1] // block_n + 1):
                total += 2 * (min(nk, t * block_n + block_n) - t * block_n) * d * itemsize
    return total


def check(mod, nq=13, nk=14, window=3):
    from io_count import counting_wrap

    rng = np.random.default_rng(nq * 100 + nk)
    q = rng.standard_normal((1, 1, nq, 4))
    k, v = (rng.standard_normal((1, 1, nk, 4)) for _ in range(2))
    wrap, stats = counting_wrap()
    o, lse = mod.run(q, k, v, window, wrap)
    win = (window - 1, 0) if window else (-1, -1)
    o_ref, lse_ref = ref.attention(q, k, v, causal=True, window_size=win)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, err_msg="o")
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12, err_msg="lse")
    want = tile_bytes(nq, nk, 4, mod.BLOCK_M, mod.BLOCK_N, window, 8)
    got = stats["k"]["read"] + stats["v"]["read"]
    assert got == want, f"k and v: {got} bytes read, the tiles the blocks need are {want} bytes"
