"""Every claim docs/tiled-forward.md prints from forward_demo.py."""

from __future__ import annotations

import numpy as np

from numba_flash.kernels import forward as kf
from forward_demo import accuracy_rows, budget_rows, notes_triton_forward, triton_case


def test_budget_every_gpu_default_fits():
    rows = budget_rows()
    assert len(rows) == 2 * len(kf.HEAD_DIMS)
    for r in rows:
        assert r["problem"] is None, r
        assert r["smem"] < r["smem_dropout"] <= kf.SMEM_LIMIT
        assert r["regs"] <= kf.MAX_TILE_REGS
    f32_64 = next(r for r in rows if r["dtype"] == "float16/32" and r["HEAD_DIM"] == 64)
    assert (f32_64["BLOCK_M"], f32_64["BLOCK_N"], f32_64["threads"]) == (64, 32, (16, 8))
    assert round(f32_64["smem"] / 1024, 1) == 40.8  # the module docstring's figure
    assert round(f32_64["smem_dropout"] / 1024, 1) == 43.0


def test_forward_matches_reference_in_every_dtype():
    _, rows = accuracy_rows()
    bound = {"float16": 2e-3, "float32": 2e-6, "float64": 1e-13}  # printed: 4.6e-4, 4e-7, 1.3e-15
    for r in rows:
        assert r["o_err"] < bound[r["dtype"]], r
        assert r["lse_err"] < (1e-13 if r["dtype"] == "float64" else 2e-6), r
        assert r["lse_dtype"] == ("float64" if r["dtype"] == "float64" else "float32")
        assert r["blocked_err"] < 1e-13


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
