"""Kernel tier: the visibility rule's device functions as a kernel sees them.

:mod:`numba_flash.kernels.mainloop.visibility` compiles the same source as its ``_py`` twins
(checked against the reference in tests/reference/test_variants.py); this runs the device versions
in a probe kernel, on the simulator or the GPU, for every (row, key) of windowed problems.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

from numba_flash import reference as ref
from numba_flash.kernels.mainloop import visibility as vis


@cuda.jit
def probe(out, tiles, offset, nk, left, right):
    i = cuda.threadIdx.x
    for j in range(nk):
        out[i, j] = vis.is_visible(i, j, offset, nk, left, right)
    lo, hi = vis.tile_key_range(i, i + 1, offset, nk, left, right)
    tiles[i, 0] = lo
    tiles[i, 1] = hi
    lo, hi = vis.key_bounds(i, offset, nk, left, right)
    tiles[i, 2] = lo
    tiles[i, 3] = max(lo, hi)


@pytest.mark.parametrize("nq,nk,left,right", [(5, 7, 2, 1), (6, 3, -1, 0), (4, 4, 0, -1)])
def test_device_rule(nq, nk, left, right):
    out = np.full((nq, nk), -1, np.int32)
    tiles = np.full((nq, 4), -1, np.int32)
    probe[1, nq](out, tiles, nk - nq, nk, left, right)
    want = ref.visible_mask(nq, nk, window_size=(left, right))
    assert (out == want).all()
    for i in range(nq):
        for c in (0, 2):
            assert [tiles[i, c] <= j < tiles[i, c + 1] for j in range(nk)] == list(want[i])
