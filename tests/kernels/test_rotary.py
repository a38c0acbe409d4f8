"""Kernel tier: ``numba_flash.apply_rotary`` against ``reference.apply_rotary`` (float64)."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_scaled_close, randn

# Measured max error relative to max(1, max |want|) over 15 random cases per dtype (unit-normal
# x [2, 2, 3, 8], rotary_dim 2/4/8, both pairings, angles uniform in [0, 2 pi), tables in x's
# dtype): float16 3.7e-4 (the output's rounding: at most half an ulp, 2**-11 = 4.9e-4 of the
# largest value), float32 8.0e-8, float64 0.  Bounds: 1e-3 (2x the float16 rounding's worst
# case), 5e-7 (6x), 1e-15.
TOL = {np.float16: 1e-3, np.float32: 5e-7, np.float64: 1e-15}


def tables(rng, max_position, half, dtype):
    angle = rng.uniform(0, 2 * np.pi, (max_position, half))
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [4, 8])  # part of the head dim (rest passes), all of it
def test_matches_reference(rng, dtype, interleaved, rotary_dim):
    b, h, n, d = 2, 2, 3, 8
    x = randn(rng, (b, h, n, d), dtype)
    cos, sin = tables(rng, 12, rotary_dim // 2, dtype)
    offsets = np.array([0, 9], np.int32)  # the last sequence ends at position 11 = max - 1
    x0 = x.copy()
    got = numba_flash.apply_rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    want = ref.apply_rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    assert got.shape == x.shape and got.dtype == dtype
    assert_scaled_close(got, want, TOL[dtype])
    np.testing.assert_array_equal(got[..., rotary_dim:], x[..., rotary_dim:])  # bitwise
    np.testing.assert_array_equal(x, x0)
    assert np.abs(want - x).max() > 0.1  # something turned


def test_int_offset_and_styles_differ(rng):
    b, h, n, d = 1, 3, 4, 6
    x = randn(rng, (b, h, n, d))
    cos, sin = tables(rng, 9, 3, np.float32)
    got = numba_flash.apply_rotary(x, cos, sin, seqlen_offsets=5)
    assert_scaled_close(got, ref.apply_rotary(x, cos, sin, seqlen_offsets=5), TOL[np.float32])
    gj = numba_flash.apply_rotary(x, cos, sin, seqlen_offsets=5, interleaved=True)
    assert np.abs(gj - got).max() > 0.1  # the two pairings are different rotations
    # offset 0 (the default) with the angle-0 row is the identity
    cos[0], sin[0] = 1, 0
    np.testing.assert_array_equal(numba_flash.apply_rotary(x[:, :, :1], cos, sin), x[:, :, :1])


@pytest.mark.parametrize("case, exc, msg", [
    ("short", ValueError, r"cos: too short: sequence 1 needs position 12 \(seqlen_offsets\[b\] "
                          r"\+ N - 1\), but cos has 12 positions"),
    ("short_int", ValueError, "cos: too short: sequence 0 needs position 13"),
    ("too_wide", ValueError, r"cos: expected \[max_position, rotary_dim / 2\] with rotary_dim "
                             r"<= the head dim 8, got shape \(12, 5\) \(rotary_dim 10\)"),
    ("dtype", TypeError, "cos: expected dtype float32 .*got float64"),
    ("sin_shape", ValueError, r"sin: expected the shape of cos \(12, 2\), got \(12, 3\)"),
    ("negative", ValueError, "seqlen_offsets: expected entries >= 0, got -1 at index 0"),
    ("negative_int", ValueError, "seqlen_offsets: expected an int in"),
    ("offsets_shape", ValueError, r"seqlen_offsets: expected shape \(2,\)"),
    ("offsets_type", TypeError, "seqlen_offsets: expected an int or an integer array"),
    ("x_rank", ValueError, "x: expected a 4-D array"),
    ("x_dtype", TypeError, "x: expected dtype in"),
])
def test_bad_input(rng, case, exc, msg):
    x = randn(rng, (2, 2, 3, 8))
    cos, sin = tables(rng, 12, 2, np.float32)
    off = np.array([0, 10], np.int32)
    if case == "short_int":
        off = 11
    elif case == "too_wide":
        cos, sin = tables(rng, 12, 5, np.float32)
    elif case == "dtype":
        cos = cos.astype(np.float64)
    elif case == "sin_shape":
        sin = tables(rng, 12, 3, np.float32)[1]
    elif case == "negative":
        off = np.array([-1, 0])
    elif case == "negative_int":
        off = -1
    elif case == "offsets_shape":
        off = np.array([0, 1, 2])
    elif case == "offsets_type":
        off = 1.5
    elif case == "x_rank":
        x = x[0]
    elif case == "x_dtype":
        x = x.astype(np.int32)
    with pytest.raises(exc, match=msg):
        numba_flash.apply_rotary(x, cos, sin, seqlen_offsets=off)


def test_unvalidated_position_past_the_tables_is_nan(rng):
    x = randn(rng, (2, 1, 2, 6))
    cos, sin = tables(rng, 4, 2, np.float32)
    got = numba_flash.apply_rotary(x, cos, sin, seqlen_offsets=np.array([2, -3]), validate=False)
    want = ref.apply_rotary(x[:1], cos, sin, seqlen_offsets=2)
    assert_scaled_close(got[0], want[0], TOL[np.float32])      # positions 2, 3: in the tables
    assert np.isnan(got[1, :, :, :4]).all()                    # positions -3, -2: NaN
    np.testing.assert_array_equal(got[1, :, :, 4:], x[1, :, :, 4:])
    got = numba_flash.apply_rotary(x, cos, sin, seqlen_offsets=3, validate=False)
    assert np.isnan(got[:, :, 1, :4]).all() and not np.isnan(got[:, :, 0]).any()
