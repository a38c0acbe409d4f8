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
