"""Issue 37, item 2: ``softmax_scale`` is checked against the compute type (a ValueError naming
it, before any launch), and a score that overflows within range is a non-finite score: its row
gets NaN ``o`` and ``lse`` (SIMT kernels and decode), never a clamped value."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref

Q = np.ones((1, 1, 2, 4), np.float32)


def _ops(dtype):
    q = Q.astype(dtype)
    cu = np.array([0, 2], np.int32)
    return {
        "forward": lambda s: numba_flash.forward(q, q, q, softmax_scale=s),
        "backward": lambda s: numba_flash.backward(q, q, q, q, q, np.zeros((1, 1, 2), np.float64
                                                                          if dtype == np.float64
                                                                          else np.float32),
                                                   softmax_scale=s),
        "forward_varlen": lambda s: numba_flash.forward_varlen(
            q[0].transpose(1, 0, 2).copy(), *(q[0].transpose(1, 0, 2).copy(),) * 2, cu, cu,
            max_seqlen_q=2, max_seqlen_k=2, softmax_scale=s),
        "decode": lambda s: numba_flash.decode(q[:, :, 0], q, q,
                                               cache_seqlens=np.array([2], np.int32),
                                               softmax_scale=s),
    }


BAD = [(np.float32, 1e39), (np.float32, 1e300), (np.float32, 2.4e38), (np.float32, 1e-39),
       (np.float16, 1e39), (ml_dtypes.bfloat16, 1e-40), (np.float64, 1e-310),
       (np.float64, 1.3e308), (np.float64, 10**400)]  # the last: an int beyond float64


@pytest.mark.parametrize("op", ["forward", "backward", "forward_varlen", "decode"])
@pytest.mark.parametrize("dtype, scale", BAD,
                         ids=[f"{np.dtype(d).name}-{s:.3g}" if isinstance(s, float)
                              else "int 10**400" for d, s in BAD])
def test_a_scale_the_compute_type_cannot_use_is_a_value_error(op, dtype, scale):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning on the way
        with pytest.raises(ValueError, match=r"^softmax_scale: expected a (number in|finite)") as e:
            _ops(dtype)[op](scale)
    assert repr(scale) in str(e.value)


@pytest.mark.filterwarnings("ignore:overflow encountered")  # the simulator's NumPy scalars
def test_the_largest_scale_is_accepted():
    o = _ops(np.float32)["forward"](2.3e38)
    assert np.isnan(o).all()  # every score 4 * 2.3e38 overflows: NaN rows, not a clamp


def _overflow_case():
    """Keys e0, e1, e2; row 0 sees scores 2 s, -2 s, 0 (one overflows each way with s = 2e38),
    row 1 sees 0.5 s, 0.25 s, 0 (finite: the softmax is one-hot on key 0)."""
    k = np.eye(3, 4, dtype=np.float32)[None, None]
    v = np.arange(12, dtype=np.float32).reshape(1, 1, 3, 4)
    q = np.array([[2, -2, 0, 0], [0.5, 0.25, 0, 0]], np.float32)[None, None]
    return q, k, v


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NumPy scalars overflow
def test_an_overflowing_score_makes_its_row_nan_in_the_forward_and_decode():
    q, k, v = _overflow_case()
    s = 2e38
    o_ref, lse_ref = ref.attention(q, k, v, softmax_scale=s)  # float64: nothing overflows
    o, lse = numba_flash.forward(q, k, v, softmax_scale=s, return_lse=True, kernel="simt")
    od, lsed = numba_flash.decode(q[0, 0][:, None, :],
                                  np.concatenate([k, k]), np.concatenate([v, v]),
                                  cache_seqlens=np.array([3, 3], np.int32), softmax_scale=s,
                                  return_lse=True)
    for got_o, got_lse in ((o[0, 0], lse[0, 0]), (od[:, 0], lsed[:, 0])):
        assert np.isnan(got_o[0]).all() and np.isnan(got_lse[0])        # overflow: NaN row
        np.testing.assert_array_equal(got_o[1], o_ref[0, 0, 1])          # one-hot on key 0
        np.testing.assert_allclose(got_lse[1], lse_ref[0, 0, 1], rtol=1e-6)
