"""fp8 (e4m3) in registers (kernels/ptx/fp8.py): every one of the 256 bit patterns, in every byte
position of a word, widened by the probe kernel (the twin in the simulator) and compared with
ml_dtypes' reading of the same bytes in memory order; float32 to e4m3 (saturating, round to
nearest even) on hand-derived cases and on every e4m3 value and the midpoints between them."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from numba_flash.kernels.ptx import fp8


def _probe(words, x):
    """``(out, bits, pairs)`` of the probe kernel: ``words`` widened (to float32, and to
    float16 pairs), ``x`` rounded to e4m3."""
    out = cuda.to_device(np.full((words.size, 4), np.nan, np.float32))   # poisoned
    bits = cuda.to_device(np.full(x.size, 0xAA, np.uint8))   # 0xAA: -0.0703125, never expected
    pairs = cuda.to_device(np.full((words.size, 2), 0x7E007E00, np.uint32))   # float16 NaNs
    n = max(words.size, x.size)
    fp8.e4m3_probe_kernel()[(n + 31) // 32, 32](cuda.to_device(words), out,
                                               cuda.to_device(x.astype(np.float32)), bits, pairs)
    return out.copy_to_host(), bits.copy_to_host(), pairs.copy_to_host()


def _widen(words):
    return _probe(words, np.zeros(0, np.float32))[0]


@pytest.mark.parametrize("shift", [0, 2])
def test_every_bit_pattern_to_float16_pairs(shift):
    """e4m3x4_to_f16x2: byte i of a word is float16 i of its two pairs (lower value in the
    lower half), bit for bit the float16 of the value (NaN: a NaN)."""
    data = np.roll(np.arange(256, dtype=np.uint8), shift)
    pairs = _probe(data.view(np.uint32), np.zeros(0, np.float32))[2]
    got = pairs.reshape(-1).view(np.float16)
    want = data.view(ml_dtypes.float8_e4m3fn).astype(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan) and nan.sum() == 2
    assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


def _round(x):
    return _probe(np.zeros(0, np.uint32), np.asarray(x, np.float32))[1]


@pytest.mark.parametrize("shift", [0, 1, 2, 3])
def test_every_bit_pattern_in_every_byte_position(shift):
    """256 bytes rotated by ``shift``: each pattern lands in byte ``(i + shift) % 4`` of some
    word; ``0x7F`` and ``0xFF`` (e4m3fn's NaN) widen to NaN, everything else exactly."""
    data = np.roll(np.arange(256, dtype=np.uint8), shift)
    got = _widen(data.view(np.uint32))
    want = data.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(-1, 4)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan], want[~nan])
    assert nan.sum() == 2 and np.abs(want[~nan]).max() == fp8.E4M3_MAX


def test_host_reading_matches_ml_dtypes():
    bits = np.arange(256, dtype=np.uint8)
    want = bits.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    got = fp8.e4m3_to_float64(bits)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(got[~np.isnan(want)], want[~np.isnan(want)])


def test_known_values_from_the_format():
    """e4m3fn by hand (sign, 4 exponent bits of bias 7, 3 mantissa bits): 1.0, -1.0, the largest
    finite 448 (``0.1111.110``), the smallest subnormal 2**-9, -0, and NaN (``S.1111.111``)."""
    words = np.array([0x38, 0xB8, 0x7E, 0x01, 0x80, 0x7F, 0x00, 0x3C], np.uint8).view(np.uint32)
    got = _widen(words).ravel()
    assert got[:5].tolist() == [1.0, -1.0, 448.0, 2.0**-9, 0.0] and np.signbit(got[4])
    assert np.isnan(got[5]) and got[6] == 0.0 and got[7] == 1.5


def test_rounding_to_e4m3_saturates_and_ties_to_even():
    """1 -> 0x38; 448 and anything past it (500, 1e9, inf) -> 0x7E, the largest finite, not NaN
    (satfinite); -448.. -> 0xFE; 2**-9 (smallest subnormal) -> 0x01; 2**-11 -> 0; 1.0625,
    halfway between 1.0 (0x38) and 1.125 (0x39), -> 0x38 (even); 1.1875 -> 0x3A (even);
    NaN -> NaN (0x7F or 0xFF)."""
    x = [1.0, 448.0, 500.0, 1e9, np.inf, -1e9, 2.0**-9, 2.0**-11, 1.0625, 1.1875, np.nan]
    got = _round(x)
    assert got[:10].tolist() == [0x38, 0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x01, 0x00, 0x38, 0x3A]
    assert got[10] & 0x7F == 0x7F


def test_rounding_round_trips_every_value_and_splits_every_gap():
    """Every finite e4m3 value rounds to itself; a point a quarter of the way to the next
    value rounds down, three quarters rounds up."""
    bits = np.array([b for b in range(256) if b & 0x7F != 0x7F], np.uint8)
    vals = fp8.e4m3_to_float64(bits)
    assert np.array_equal(_round(vals), bits)
    pos = np.sort(vals[vals > 0])
    lo, hi = pos[:-1], pos[1:]
    want_lo = _round(lo)
    assert np.array_equal(_round(lo + 0.25 * (hi - lo)), want_lo)
    assert np.array_equal(_round(lo + 0.75 * (hi - lo)), _round(hi))
