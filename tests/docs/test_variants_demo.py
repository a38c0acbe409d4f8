"""Every claim docs/variants.md prints from variants_demo.py."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref
import snippets
from variants_demo import (FULL, MASKED, SKIPPED, cost_rows, exact_kinds, packed_mask, tile_kinds,
                           tiles_rows)


@pytest.mark.parametrize("nq, nk, block_m, block_n, causal, window", [
    (32, 32, 4, 4, True, (-1, -1)), (32, 32, 4, 4, False, (11, 0)), (32, 32, 4, 4, False, (4, 4)),
    (20, 36, 4, 4, True, (-1, -1)), (29, 13, 8, 8, True, (6, -1)), (13, 30, 8, 4, False, (-1, 2)),
    (17, 17, 8, 8, False, (0, 0)), (40, 40, 8, 8, False, (8, 0)), (9, 25, 8, 8, False, (3, 12)),
])
def test_kernel_tile_kinds_are_exact(nq, nk, block_m, block_n, causal, window):
    """The kernel's per-Q-tile ranges skip exactly the tiles with no visible key and leave
    unmasked exactly the whole tiles every row sees (ragged last tiles are masked)."""
    vis = ref.visible_mask(nq, nk, causal=causal, window_size=window)
    kinds = tile_kinds(nq, nk, block_m, block_n, causal, window)
    np.testing.assert_array_equal(kinds, exact_kinds(vis, block_m, block_n))


def test_tiles_printed():
    rows = {r["title"]: r for r in tiles_rows()}
    assert [rows[t]["loaded"] for t in rows] == [36, 26, 22, 35]
    for r in rows.values():
        np.testing.assert_array_equal(r["kinds"], r["exact"])
        assert {FULL, MASKED, SKIPPED} >= set(np.unique(r["kinds"]))


def test_window_cost_grows_with_the_window_not_n():
    rows = cost_rows()
    for w in (128, 512):
        per = [r["per_q_tile"] for r in rows if r["window"] == w]
        assert max(per) <= (w + 64) / 32 + 2  # at most the band's width in tiles, plus edges
        assert max(per) - min(per) < 0.25 * max(per)  # ~constant over a 16x range of N
    causal = [r["causal_loaded"] for r in rows if r["window"] == 128]
    assert causal[-1] > 100 * rows[2]["loaded"] / 3  # causal grows like N^2, windowed like N


def test_packed_mask_is_block_diagonal():
    vis = packed_mask([3, 4, 2], [3, 4, 2], causal=True)
    assert vis[:3, 3:].sum() == 0 and vis[3:7, :3].sum() == 0 and vis[7:, :7].sum() == 0
    np.testing.assert_array_equal(vis[3:7, 3:7], np.tril(np.ones((4, 4), bool)))


def test_accuracy_printed():
    """The page's table as recorded (test_snippets checks that it is what ``variants_demo.py
    accuracy`` prints now, so its seven launches are not run a second time here)."""
    text = snippets.recorded_output("variants.md", "python docs/examples/variants_demo.py accuracy")
    rows = [snippets.printed_fields(line) for line in text.splitlines()[2:]]
    assert [r[0] for r in rows] == ["forward"] * 5 + ["forward_varlen"] * 2
    for r in rows:
        o_err, lse_err = map(snippets.printed_value, r[-2:])
        assert o_err < 2e-6 and lse_err < 2e-6, r  # printed: <= 3.2e-7


def test_picture_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from variants_demo import draw

    path = draw(tmp_path / "variants.png")
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
