"""Every claim docs/optimised-forward.md (and docs/tiled-forward.md: the notes' Triton kernel)
prints from forward_demo.py."""

from __future__ import annotations

import numpy as np

from numba_flash.kernels.forward import config as fconfig
import snippets
from forward_demo import budget_rows, notes_triton_forward, triton_case


def test_budget_every_gpu_default_fits():
    rows = budget_rows()
    assert len(rows) == 2 * len(fconfig.HEAD_DIMS)
    for r in rows:
        assert r["problem"] is None, r
        assert r["smem"] < r["smem_dropout"] <= fconfig.SMEM_LIMIT
        assert r["regs"] <= fconfig.MAX_TILE_REGS
    f32_64 = next(r for r in rows if r["dtype"] == "float16/32" and r["HEAD_DIM"] == 64)
    assert (f32_64["BLOCK_M"], f32_64["BLOCK_N"], f32_64["threads"]) == (64, 32, (16, 8))
    assert round(f32_64["smem"] / 1024, 1) == 42.5  # the module docstring's figure
    assert round(f32_64["smem_dropout"] / 1024, 1) == 44.8


def test_forward_matches_reference_in_every_dtype():
    """The page's table as recorded: test_snippets checks that it is what ``forward_demo.py
    accuracy`` prints now (a fresh run, under another machine's arithmetic), so the claims are
    read from it instead of running the six forward launches a second time."""
    text = snippets.recorded_output("optimised-forward.md",
                                    "python docs/examples/forward_demo.py accuracy")
    rows = [snippets.printed_fields(line) for line in text.splitlines()[2:]]
    assert sorted(r[:2] for r in rows) == [[dt, c] for dt in ("float16", "float32", "float64")
                                           for c in ("False", "True")]
    bound = {"float16": 2e-3, "float32": 2e-6, "float64": 1e-13}  # printed: 4.6e-4, 2.9e-7, <1e-14
    for dtype, _, o_err, lse_err, lse_dtype, blocked in rows:
        assert snippets.printed_value(o_err) < bound[dtype], (dtype, o_err)
        assert snippets.printed_value(lse_err) < (1e-13 if dtype == "float64" else 2e-6)
        assert lse_dtype == ("float64" if dtype == "float64" else "float32")
        assert snippets.printed_value(blocked) < 1e-13


def test_notes_triton_right_only_when_n_is_a_multiple_of_the_tile():
    assert triton_case(16)["o_err"] < 1e-13
    for n in (10, 13):
        r = triton_case(n)
        assert r["pad"] > 0 and r["o_err"] > 0.05 and r["lse_err"] > 0.05
        assert r["l_excess"] < 1e-12  # l is inflated by exactly pad * exp(0 - m)
        assert r["lse_err_fixed"] < 1e-12  # ... and nothing else is wrong


def test_notes_triton_returns_l_and_m_not_lse():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    _, l, m = notes_triton_forward(q, k, v, 0.5, 8, 8)
    s = 0.5 * q @ k.T
    np.testing.assert_allclose(m, s.max(1))
    np.testing.assert_allclose(l, np.exp(s - s.max(1, keepdims=True)).sum(1))
