"""Every claim docs/causal-tiles.md prints from causal_demo.py."""

from __future__ import annotations

import numpy as np

from numba_flash import reference as ref
from numba_flash.tools.pictures import SKIPPED, tile_kinds
from causal_demo import alignment_case, empty_rows_case, nan_tile_rows


def test_top_left_equals_bottom_right_only_when_nq_equals_nk():
    same = alignment_case(6, 6)
    assert max(same.values()) < 1e-12
    for nq, nk in ((3, 6), (6, 3)):
        r = alignment_case(nq, nk)
        assert r["notes_vs_top_left"] < 1e-12  # the transcription is the top-left rule
        assert r["notes_vs_bottom_right"] > 0.1  # ... which is not flash-attn's
        assert r["kernel_vs_bottom_right"] < 1e-6


def test_visibility_pictures():
    vis = ref.causal_visible(3, 6)
    assert vis.sum(1).tolist() == [4, 5, 6]
    assert np.tril(np.ones((3, 6), bool)).sum(1).tolist() == [1, 2, 3]


def test_tile_counts():
    assert int((tile_kinds(32, 32, 8, 8) != SKIPPED).sum()) == 10
    assert int((tile_kinds(16, 40, 8, 8) != SKIPPED).sum()) == 9


def test_tiles_after_the_diagonal_are_never_read():
    rows = nan_tile_rows()
    assert [r["nan_keys"] for r in rows] == [24, 16, 8, 0]
    for r in rows:
        assert r["finite"] and r["err"] < 1e-6  # float32, measured 2.0e-7
    assert [r["mask_all_finite"] for r in rows] == [False, False, False, True]


def test_rows_with_no_visible_key():
    o, lse, err = empty_rows_case()
    assert (o[:3] == 0).all() and np.isneginf(lse[:3]).all()
    assert np.isfinite(lse[3:]).all() and err < 1e-6


def test_kernel_tile_ranges_give_the_pictured_kinds():
    """The forward kernel's per-block ranges (visibility.py, run on the host by variants_demo)
    classify causal tiles as the page's map does: skipped, full, masked (diagonal), except that
    the kernel also masks a ragged last K/V tile (its padded keys score 0, not -inf)."""
    from numba_flash.tools.pictures import DIAGONAL, FULL
    from variants_demo import FULL as K_FULL, MASKED, SKIPPED as K_SKIPPED
    from variants_demo import tile_kinds as kernel_kinds

    names = {SKIPPED: K_SKIPPED, FULL: K_FULL, DIAGONAL: MASKED}
    for nq, nk, bm, bn in ((32, 32, 8, 8), (16, 40, 8, 8), (10, 7, 4, 3), (7, 10, 2, 4)):
        pictured = np.vectorize(names.get)(tile_kinds(nq, nk, bm, bn))
        if nk % bn:
            pictured[:, -1][pictured[:, -1] == K_FULL] = MASKED
        np.testing.assert_array_equal(kernel_kinds(nq, nk, bm, bn, causal=True), pictured)
