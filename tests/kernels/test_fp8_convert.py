"""fp8 (e4m3) to float32 in registers (kernels/ptx/fp8.py): every one of the 256 bit patterns, in
every byte position of a word, widened by the probe kernel (the twin in the simulator) and
compared with ml_dtypes' reading of the same bytes in memory order."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from numba_flash.kernels.ptx import fp8


def _widen(words):
    out = np.full((words.size, 4), np.nan, np.float32)   # poisoned: an unwritten value fails
    d_out = cuda.to_device(out)
    fp8.e4m3_probe_kernel()[(words.size + 31) // 32, 32](cuda.to_device(words), d_out)
    return d_out.copy_to_host()


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
