"""Kernel tier: ``numba_flash.merge_states`` (the combine kernel) against the float64 reference."""

from __future__ import annotations


import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn

# Measured max abs errors over 100 random cases per dtype (P <= 6, rows <= 3, d <= 19, lse
# spread 10): float16 o 9.7e-4 (half an ulp of float16 at |o| in [2, 4)), lse 9.9e-7; float32
# o 3.1e-7, lse 1.5e-6 (|lse| ~ 30); float64 o 2.2e-16, lse 0.  Bounds: helpers.atol
# (2e-3 / 2e-5 / 1e-12), scaled by max|o| for float16 outputs (the rounding is relative).
LSE_DTYPE = {np.float16: np.float32, np.float32: np.float32, np.float64: np.float64}



def parts(rng, shape, dtype):
    o = randn(rng, shape, dtype)
    lse = (rng.standard_normal(shape[:-1]) * 10).astype(LSE_DTYPE[np.dtype(dtype).type])
    return o, lse


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 5), (2, 3, 8), (4, 2, 3, 6), (6, 1, 1, 1, 17)])
def test_merge_matches_reference(rng, dtype, shape):
    o_parts, lse_parts = parts(rng, shape, dtype)
    o, lse = numba_flash.merge_states(o_parts, lse_parts)
    assert o.shape == shape[1:] and o.dtype == dtype
    assert lse.shape == shape[1:-1] and lse.dtype == LSE_DTYPE[np.dtype(dtype).type]
    want_o, want_lse = ref.merge_states(o_parts, lse_parts)
    o_scale = max(1.0, np.abs(want_o).max()) if dtype == np.float16 else 1.0
    assert_close(o, want_o, dtype, scale=o_scale, name="o")
    assert_close(lse, want_lse, lse.dtype.type, name="lse")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_empty_parts(rng, dtype):
    """-inf parts contribute nothing (even with NaN in their o); all -inf gives o = 0,
    lse = -inf."""
    o_parts, lse_parts = parts(rng, (4, 3, 2, 8), dtype)
    lse_parts[1] = -np.inf          # part 1 empty everywhere
    o_parts[1] = np.nan             # ... with garbage output
    lse_parts[:, 2, 1] = -np.inf    # row (2, 1): every part empty
    lse_parts[[0, 2], 0, 0] = -np.inf
    o, lse = numba_flash.merge_states(o_parts, lse_parts)
    want_o, want_lse = ref.merge_states(np.where(np.isnan(o_parts), 0, o_parts), lse_parts)
    assert_close(o, want_o, dtype)
    assert_close(lse, want_lse, dtype)
    assert lse[2, 1] == -np.inf and (o[2, 1] == 0).all()
    # a part that is alone (every other one empty) passes through exactly
    np.testing.assert_array_equal(o[0, 0], o_parts[3, 0, 0])
    assert lse[0, 0] == lse_parts[3, 0, 0]


def test_merge_of_split_attention_is_full_attention(rng):
    """Attention over disjoint key halves, merged, equals attention over all keys."""
    q = randn(rng, (1, 2, 3, 8), np.float64)
    k = randn(rng, (1, 2, 10, 8), np.float64)
    v = randn(rng, (1, 2, 10, 8), np.float64)
    o_a, l_a = ref.attention(q, k[:, :, :4], v[:, :, :4])
    o_b, l_b = ref.attention(q, k[:, :, 4:], v[:, :, 4:])
    o, lse = numba_flash.merge_states(np.stack([o_a, o_b]), np.stack([l_a, l_b]))
    want_o, want_lse = ref.attention(q, k, v)
    assert_close(o, want_o, np.float64)
    assert_close(lse, want_lse, np.float64)


def test_merge_rejects_bad_input(rng):
    o, l = parts(rng, (2, 3, 4), np.float32)
    with pytest.raises(ValueError, match=r"lse_parts: expected shape \(2, 3\)"):
        numba_flash.merge_states(o, l[:, :2])
    with pytest.raises(TypeError, match="lse_parts: expected dtype float32"):
        numba_flash.merge_states(o, l.astype(np.float64))
    with pytest.raises(TypeError, match="o_parts: expected dtype in"):
        numba_flash.merge_states(o.astype(np.int32), l)
    with pytest.raises(ValueError, match=r"o_parts: expected a 2-D to 9-D array \[P, ..., d\], "
                                         r"got shape \(4,\)"):
        numba_flash.merge_states(o[0, 0], l)
