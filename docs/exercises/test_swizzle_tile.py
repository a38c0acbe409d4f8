"""Check of docs/exercises/swizzle_tile.py: the predicted conflict of the row-major column read,
and the chosen layout run in the simulator's recording mode (numba_flash.tools.memory_profile):
the transpose is right, each row stays in its 32 words, and no shared request of the kernel
takes more than one wavefront."""

from __future__ import annotations

import numpy as np


def test_swizzle_tile(exercise):
    check(exercise("swizzle_tile"))


def check(mod):
    from numba_flash.tools import memory_profile as mp

    assert mod.WAYS_ROW_MAJOR == 32, (
        f"WAYS_ROW_MAJOR: you predicted {mod.WAYS_ROW_MAJOR}; lane c reads word 32 c + r, and "
        f"every such word is in bank r")
    words = sorted(mod.tile_offset(r, c) for r in range(32) for c in range(32))
    assert words == list(range(1024)), "tile_offset must use each of the 1024 words once"
    for r in range(32):
        for c in range(32):
            w = mod.tile_offset(r, c)
            assert w // 32 == r, f"tile_offset({r}, {c}) = {w}: row {r} must stay in its words"
    x = np.arange(1024, dtype=np.float32).reshape(32, 32)
    y = np.zeros_like(x)
    kernel = mp.transpose_kernel(mod.tile_offset)
    _, prof = mp.record(lambda: kernel[1, mp.TRANSPOSE_BLOCK](x, y))
    np.testing.assert_array_equal(y, x.T)
    for s in prof.launch().find(space="shared"):
        what = "row write" if s.op == "st" else "column read"
        assert s.ways == 1, (f"the tile's {what} is {s.ways}-way: {s.wavefronts // s.requests} "
                             f"wavefronts a request, where 1 would do")
