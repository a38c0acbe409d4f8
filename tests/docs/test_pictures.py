"""The docs' pictures are produced and non-empty; the tile classification matches the reference
loop."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.tools.pictures import DIAGONAL, FULL, PICTURES, SKIPPED, draw_all, tile_kinds


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

    from numba_flash.tools.pictures import ROOFLINE, tiled_intensity

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

    from numba_flash.kernels.forward import simt as forward
    from numba_flash.tools.pictures import forward_barriers

    src = inspect.getsource(forward.forward_kernel)
    assert len(forward_barriers()) == src.count("cuda.syncthreads()") >= 2


def test_every_picture_is_committed_and_embedded_in_a_page():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    pages = "\n".join(p.read_text() for p in docs.glob("*.md"))
    for name in PICTURES:
        assert (docs / "img" / name).is_file(), name
        assert f"](img/{name})" in pages, f"{name} is embedded in no page"


def test_grid_picture_mapping_is_the_kernels():
    """thread_index is scale_add's i = blockIdx.x * blockDim.x + threadIdx.x, spare threads
    included: the last block has threads * blocks - n of them."""
    from numba_flash.tools.pictures import thread_index

    cells = thread_index(20, 8)
    assert len(cells) == 24 and [i for _, _, i in cells] == list(range(24))
    assert all(i == b * 8 + t for b, t, i in cells)
    assert sum(i >= 20 for _, _, i in cells) == 4


def test_tree_picture_levels_are_row_max():
    from numba_flash.tools.pictures import tree_levels

    rng = np.random.default_rng(0)
    x = list(rng.integers(0, 100, 16))
    levels = tree_levels(x)
    assert [len(lv) for lv in levels] == [16, 8, 4, 2, 1] and levels[-1] == [max(x)]


def test_bank_picture_agrees_with_the_bank_conflict_counter():
    from cuda_basics import bank_conflict

    from numba_flash.tools.pictures import bank_of

    for width, ways in ((32, 32), (33, 1)):
        column = [r * width for r in range(32)]  # word indices of tile[lane][0]
        assert bank_conflict(column) == ways
        banks = [bank_of(r, 0, width) for r in range(32)]
        assert max(banks.count(b) for b in banks) == ways


def test_memory_picture_names_the_forwards_tiles():
    import inspect

    from numba_flash.kernels.forward import simt as forward
    from numba_flash.tools.pictures import MEMORY_LEVELS

    src = inspect.getsource(forward)
    for name in ("q_tile", "k_tile", "v_tile", "p_tile", "m_i", "l_i", "acc"):
        assert name in src and any(name in holds for *_, holds in MEMORY_LEVELS), name
