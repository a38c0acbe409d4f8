"""The element-type stage (numba_flash.kernels.core.elements): loads exact, stores round to nearest
even, for every class of bfloat16 bit pattern, checked against ml_dtypes and the integer rule."""

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

from numba_flash.kernels.core import elements
from numba_flash.kernels.core.elements import (
    BFLOAT16, bf16_bits_host, element_ops, round_trip_kernel,
)


def run_round_trip(dtype, x):
    """(y, back) of the round-trip kernel for compute-type values ``x`` (1-D)."""
    kdt = elements.kernel_dtype(dtype)
    comp = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    x = np.ascontiguousarray(x, comp)
    y = cuda.to_device(np.zeros(x.shape, kdt))
    back = cuda.to_device(np.full(x.shape, np.nan, comp))
    threads = 32
    with np.errstate(over="ignore", invalid="ignore"):
        round_trip_kernel(np.dtype(dtype))[(x.size + threads - 1) // threads, threads](
            cuda.to_device(x), y, back)
    return y.copy_to_host(), back.copy_to_host()


def f32(bits):
    return np.array(bits, np.uint32).view(np.float32)


#: float32 inputs by class, as bit patterns: what each must become in bfloat16 (bits)
CASES = {
    # exact: the low 16 bits are 0
    "zero": ([0x00000000, 0x80000000], [0x0000, 0x8000]),
    "normals exact": ([0x3F800000, 0xBF800000, 0x7F7F0000, 0x00800000],
                      [0x3F80, 0xBF80, 0x7F7F, 0x0080]),
    "subnormals exact": ([0x00010000, 0x007F0000, 0x80010000], [0x0001, 0x007F, 0x8001]),
    "inf": ([0x7F800000, 0xFF800000], [0x7F80, 0xFF80]),
    # below half an ulp: down; above: up
    "round down": ([0x3F807FFF, 0xBF807FFF, 0x00007FFF], [0x3F80, 0xBF80, 0x0000]),
    "round up": ([0x3F808001, 0xBF808001, 0x00008001], [0x3F81, 0xBF81, 0x0001]),
    # exactly half an ulp: to the even neighbour
    "tie to even (down)": ([0x3F808000, 0xBF808000, 0x00008000], [0x3F80, 0xBF80, 0x0000]),
    "tie to even (up)": ([0x3F818000, 0xBF818000, 0x00018000], [0x3F82, 0xBF82, 0x0002]),
    # subnormal rounding up into the smallest normal
    "subnormal to normal": ([0x007FC000], [0x0080]),
    # the largest finite bfloat16 and past it: overflow to inf
    "overflow": ([0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF], [0x7F7F, 0x7F80, 0x7F80,
                                                                  0xFF80]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bf16_store_every_class(case):
    bits, want = CASES[case]
    x = f32(bits)
    y, back = run_round_trip(BFLOAT16, x)
    want = np.array(want, np.uint16)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(bf16_bits_host(x), want)  # the host twin of the rule
    np.testing.assert_array_equal(x.astype(ml_dtypes.bfloat16).view(np.uint16), want)
    # the load is exact: back is the bfloat16 value, which is float32 bits << 16
    np.testing.assert_array_equal(back.view(np.uint32), want.astype(np.uint32) << 16)


def test_bf16_nan_stays_nan_quiet_and_signed():
    x = f32([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7F80FFFF])
    y, back = run_round_trip(BFLOAT16, x)
    assert np.isnan(y.view(ml_dtypes.bfloat16).astype(np.float32)).all()
    assert np.isnan(back).all()
    np.testing.assert_array_equal(y >> 15, [0, 1, 0, 1, 0, 0])  # sign kept
    np.testing.assert_array_equal(y & 0x0040, 0x0040)  # quiet
    np.testing.assert_array_equal(y, bf16_bits_host(x))


def test_bf16_load_every_bit_pattern():
    """Every one of the 65536 bfloat16 patterns loads exactly (host twin of the device load:
    the stage's own load, called as the simulator calls it)."""
    load, _store = element_ops(BFLOAT16)
    w = np.arange(0, 65536, 257, dtype=np.uint16)  # 256 patterns spread over all classes
    got = np.array([load(np.uint16(v)) for v in w], np.float32)
    want = w.view(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_bf16_store_matches_ml_dtypes_on_random_floats(rng):
    """Random float32 bits (every exponent, NaNs included) against ml_dtypes' rounding."""
    x = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32).view(np.float32)
    host = bf16_bits_host(x)
    with np.errstate(over="ignore", invalid="ignore"):
        ml = x.astype(ml_dtypes.bfloat16).view(np.uint16)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(host[finite], ml[finite])
    assert np.isnan(host[~finite].view(ml_dtypes.bfloat16).astype(np.float32)).all()
    y, _back = run_round_trip(BFLOAT16, x[:256])
    np.testing.assert_array_equal(y, host[:256])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_other_elements_round_trip(dtype, rng):
    x = rng.standard_normal(64) * 100
    y, back = run_round_trip(dtype, x)
    comp = np.float64 if dtype == np.float64 else np.float32
    want = np.asarray(x, comp).astype(dtype)  # float16: numpy's round to nearest even
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(back, want.astype(comp))


def test_element_ops_rejects_other_dtypes():
    with pytest.raises(TypeError, match="element dtype"):
        element_ops(np.int32)


def test_kernel_dtype():
    assert elements.kernel_dtype(BFLOAT16) == np.uint16
    assert elements.kernel_dtype(np.float16) == np.float16
