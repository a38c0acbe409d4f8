"""Messages that read naturally: rank ranges, uint64 values shown as passed, and the test helpers
compare infinities without a RuntimeWarning."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import numba_flash
from helpers import assert_close, assert_scaled_close
from numba_flash.frontend.validate import check_array, int_values


@pytest.mark.parametrize("ndim, text", [(4, "a 4-D array"), ((3, 4), "a 3-D or 4-D array"),
                                        (range(2, 10), "a 2-D to 9-D array"),
                                        (tuple(range(1, 9)), "a 1-D to 8-D array"),
                                        ((2, 5), "a 2-D or 5-D array")])
def test_rank_message(ndim, text):
    with pytest.raises(ValueError, match=f"^x: expected {text}, got shape "):
        check_array("x", np.zeros((1,) * 10, np.float32), ndim)


def test_merge_states_rank_message_reads_naturally():
    with pytest.raises(ValueError, match=r"^o_parts: expected a 2-D to 9-D array\b.* got shape "
                                         r"\(3,\) \(1-D\)$"):
        numba_flash.merge_states(np.zeros(3, np.float32), np.zeros(3, np.float32))


def test_int_values_shows_uint64_values_as_passed():
    big = np.array([5, 2**64 - 1], np.uint64)
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected entries below 2\*\*63, got "
                                         r"18446744073709551615 at index 1$"):
        int_values("cache_seqlens", big)
    out = int_values("cache_seqlens", np.array([1, 2**63 - 1], np.uint64))
    assert out.dtype == np.int64 and out.tolist() == [1, 2**63 - 1]
    assert int_values("x", np.array([-3], np.int8)).tolist() == [-3]


def test_helpers_compare_infinities_silently():
    got = np.array([np.inf, -np.inf, 1.0], np.float32)
    want = np.array([np.inf, -np.inf, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning (inf - inf) would raise here
        assert_close(got, want, np.float32)
        with pytest.raises(AssertionError, match="max abs error"):
            assert_close(got[::-1].copy(), want, np.float32)  # inf where 1 is wanted
        with pytest.raises(AssertionError, match="max abs error"):
            assert_close(np.array([-np.inf], np.float32), np.array([np.inf]), np.float32)
        with pytest.raises(AssertionError, match="max abs error"):
            assert_scaled_close(np.array([np.inf, 1.0]), np.array([np.inf, 1.0]), 1e-3)


def test_decode_uint64_seqlens_error_shows_the_value_passed():
    q = np.zeros((1, 2, 16), np.float32)
    k = np.zeros((1, 1, 8, 16), np.float32)
    with pytest.raises(ValueError, match=r"^cache_seqlens: .* got 18446744073709551615 at index 0"):
        numba_flash.decode(q, k, k, cache_seqlens=np.array([2**64 - 1], np.uint64))
