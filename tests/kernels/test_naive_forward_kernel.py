"""Kernel tier: the one-thread-per-row forward (``numba_flash.ops.naive_forward``) against the
float64 reference.  Outputs are NaN-poisoned before launch (conftest), so an unwritten element
fails."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.kernels.common import HEAD_DIMS, padded_head_dim
from numba_flash.ops.naive_forward import naive_forward
from helpers import assert_close, randn

# Max errors measured over 200 random cases per dtype (shapes and causal as below, unit-normal
# inputs, /tmp script, seed 1):
#   o:   float16 9.6e-4 absolute, |o| up to ~2.5: the final rounding to float16 (half an ulp is
#        2**-11 * |o|), so the float16 bound is scaled by max(1, max|o|);
#        float32 4.2e-7, float64 1.3e-15
#   lse: float16 inputs 5.9e-7 (lse is float32), float32 6.1e-7, float64 1.3e-15
# The bounds are helpers.ATOL (2e-3 relative to max(1, |o|), 2e-5, 1e-12): >= 4x those figures.
LSE_DTYPE = {np.float16: np.float32, np.float32: np.float32, np.float64: np.float64}

SHAPES = [  # (B, H, Hkv, Nq, Nk, d)
    (1, 1, 1, 1, 1, 1),
    (1, 2, 2, 5, 7, 3),
    (2, 4, 2, 6, 6, 8),    # GQA, 2 query heads per kv head
    (1, 3, 1, 9, 4, 5),    # MQA; Nq > Nk: causal rows with no visible key
    (1, 1, 1, 3, 11, 17),  # HEAD_DIM 32 with d = 17: the loops run over d, not HEAD_DIM
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_naive_forward_matches_reference(rng, dtype, causal, shape):
    b, h, hkv, nq, nk, d = shape
    q = randn(rng, (b, h, nq, d), dtype)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d), dtype)
    o, lse = naive_forward(q, k, v, causal=causal)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == LSE_DTYPE[dtype] and lse.shape == (b, h, nq)
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    o_scale = max(1.0, np.abs(o_ref).max()) if dtype == np.float16 else 1.0
    assert_close(o, o_ref, dtype, scale=o_scale, name="o")
    assert_close(lse, lse_ref, LSE_DTYPE[dtype], name="lse")


def test_rows_without_keys_give_zero_and_minus_inf(rng):
    q = randn(rng, (1, 1, 6, 4), np.float32)
    k = randn(rng, (1, 1, 2, 4), np.float32)
    o, lse = naive_forward(q, k, k, causal=True)
    # rows 0..3 see no key (j <= i + 2 - 6 < 0), rows 4, 5 see 1 and 2 keys
    assert np.all(o[0, 0, :4] == 0) and np.all(lse[0, 0, :4] == -np.inf)
    assert np.all(np.isfinite(lse[0, 0, 4:]))


def test_large_logits_and_custom_scale(rng):
    q = randn(rng, (1, 2, 5, 8), np.float32, scale=30.0)
    k = randn(rng, (1, 2, 7, 8), np.float32, scale=30.0)
    v = randn(rng, (1, 2, 7, 8), np.float32)
    o, lse = naive_forward(q, k, v, softmax_scale=0.9)
    o_ref, lse_ref = ref.attention(q, k, v, softmax_scale=0.9)
    # scores ~1e3 here, so float32 rounding of s (~1e-4) moves the near one-hot P: measured over
    # 50 cases max |o error| 3.7e-5 and max |lse error| / max |lse| 2.0e-7; bounds 4x those.
    assert_close(o, o_ref, np.float32, scale=1.5e-4 / 2e-5, name="o")
    assert np.abs(lse - lse_ref).max() <= 8e-7 * np.abs(lse_ref).max()


def test_inputs_not_modified_and_non_contiguous(rng):
    base = randn(rng, (1, 2, 8, 6), np.float32)
    q = base[:, :, ::2]
    k = randn(rng, (1, 2, 5, 6), np.float32)
    before = (base.copy(), k.copy())
    o, _ = naive_forward(q, k, k)
    assert_close(o, ref.attention(q, k, k)[0], np.float32)
    np.testing.assert_array_equal(base, before[0])
    np.testing.assert_array_equal(k, before[1])


def test_padded_head_dim():
    assert [padded_head_dim(d) for d in (1, 16, 17, 64, 65, 256)] == [16, 16, 32, 64, 128, 256]
    assert HEAD_DIMS[-1] == 256


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(q=np.zeros((1, 2, 3), np.float32)), ValueError, "q: expected a 4-D array"),
    (dict(k=np.zeros((1, 3, 4, 4), np.float32), v=np.zeros((1, 3, 4, 4), np.float32)),
     ValueError, "k: expected a number of kv heads"),
    (dict(v=np.zeros((1, 2, 5, 4), np.float32)), ValueError, "v: expected the shape of k"),
    (dict(v=np.zeros((1, 2, 4, 4), np.float64)), TypeError, "v: expected dtype float32"),
    (dict(causal=1), TypeError, "causal: expected a bool"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale: expected a finite number > 0"),
])
def test_rejects_bad_arguments(kwargs, exc, msg):
    args = dict(q=np.zeros((1, 2, 4, 4), np.float32), k=np.zeros((1, 2, 4, 4), np.float32),
                v=np.zeros((1, 2, 4, 4), np.float32))
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=msg):
        naive_forward(q, k, v, **args)
