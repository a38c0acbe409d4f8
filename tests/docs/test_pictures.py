"""The docs' pictures are produced and non-empty; the tile classification matches the reference
loop."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.pictures import DIAGONAL, FULL, PICTURES, SKIPPED, draw_all, tile_kinds


def test_draw_all_writes_every_png(tmp_path):
    pytest.importorskip("matplotlib")
    paths = draw_all(tmp_path)
    assert len(paths) == len(PICTURES)
    for p in paths:
        data = open(p, "rb").read()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize("nq, nk, bm, bn", [(256, 256, 64, 64), (160, 320, 64, 64),
                                            (10, 7, 4, 3), (7, 10, 2, 4)])
def test_tile_kinds_agree_with_causal_mask(nq, nk, bm, bn):
    vis = ref.causal_visible(nq, nk)
    kinds = tile_kinds(nq, nk, bm, bn)
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            tile = vis[i * bm:(i + 1) * bm, j * bn:(j + 1) * bn]
            want = FULL if tile.all() else SKIPPED if not tile.any() else DIAGONAL
            assert kinds[i, j] == want, (i, j)
    assert {SKIPPED, FULL, DIAGONAL} >= set(np.unique(kinds))


def test_roofline_tiled_intensity_matches_counted_traffic():
    """The roofline's 'K/V re-read by every Q tile' intensity equals FLOPs over the bytes that
    the counted Q-outer loop of docs/loop-order.md moves (statistics aside)."""
    from notes_code import q_outer_forward

    from numba_flash.pictures import ROOFLINE, tiled_intensity

    n, d, bm = 256, 16, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    _, hbm = q_outer_forward(q, k, v, bm, bm)
    elements = sum(hbm.reads.values()) + hbm.writes["O"]
    assert np.isclose(tiled_intensity(n, bm, 4), 4 * n * n * d / (4 * elements))
    # compulsory intensity of the forward is N / itemsize
    assert ROOFLINE["kernels"][0][1] == 4096 / 4


def test_tile_ownership_picture_reads_the_kernel():
    """The barrier timeline is every commented syncthreads of the forward kernel, in order."""
    import inspect

    from numba_flash.kernels import forward
    from numba_flash.pictures import forward_barriers

    src = inspect.getsource(forward.forward_kernel)
    assert len(forward_barriers()) == src.count("cuda.syncthreads()") >= 2
