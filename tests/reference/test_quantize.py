"""The host quantiser (numba_flash/quantize.py): FA3's descales from the values, the Hadamard
rotation that leaves attention unchanged, and its checks."""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import float8_e4m3fn

import numba_flash
from numba_flash import reference as ref
from numba_flash.quantize import hadamard


def inputs(rng, b=2, h=4, hkv=2, nq=5, nk=7, d=16):
    return (rng.standard_normal((b, h, nq, d)), rng.standard_normal((b, hkv, nk, d)),
            rng.standard_normal((b, hkv, nk, d)))


def test_descales_map_each_groups_amax_to_448(rng):
    q, k, v = inputs(rng)
    q[1, 2:] *= 10.0                                  # the second group of sequence 1
    q8, k8, v8, qd, kd, vd = numba_flash.quantize_e4m3(q, k, v)
    assert q8.dtype == k8.dtype == v8.dtype == np.dtype(float8_e4m3fn)
    assert qd.shape == kd.shape == vd.shape == (2, 2) and qd.dtype == np.float32
    for x, x8, xd in ((q, q8, qd), (k, k8, kd), (v, v8, vd)):
        g = x.shape[1] // 2
        amax = np.abs(x.reshape(2, 2, -1)).max(axis=-1)
        np.testing.assert_allclose(xd, amax / 448.0, rtol=1e-6)
        assert np.abs(x8.astype(np.float64)).reshape(2, 2, -1).max(axis=-1).min() == 448.0
        back = ref.dequantize(x8, xd)
        # e4m3 keeps 3 mantissa bits: a relative step of at most 2**-4 above 2**-6 * descale
        err = np.abs(back - x) / np.maximum(np.abs(x), 2.0 ** -6 * np.repeat(xd, g, 1)
                                            [:, :, None, None])
        assert err.max() <= 2.0 ** -4 + 1e-6


def test_rotation_is_orthonormal_and_leaves_attention_unchanged(rng):
    h = hadamard(16)
    np.testing.assert_allclose(h @ h.T, np.eye(16), atol=1e-12)
    q, k, v = inputs(rng)
    o, lse = ref.attention(q, k, v, causal=True)
    o_rot, lse_rot = ref.attention(q @ h, k @ h, v, causal=True)
    np.testing.assert_allclose(o_rot, o, atol=1e-12)
    np.testing.assert_allclose(lse_rot, lse, atol=1e-12)


def test_rotated_inputs_run_the_fp8_forward(rng):
    """quantize_e4m3(rotate=True) then the fp8 forward: the float64 attention of the float
    inputs, within the input rounding (e4m3's 2**-4 on q, k, v) plus the kernel's bound."""
    q, k, v = inputs(rng, b=1, h=2, hkv=1, nq=8, nk=40, d=32)
    q8, k8, v8, qd, kd, vd = numba_flash.quantize_e4m3(q, k, v, rotate=True)
    o = numba_flash.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
    want, _ = ref.attention(q, k, v)
    assert np.abs(o.astype(np.float64) - want).max() <= 0.1 * np.abs(v).max()


def test_bad_quantiser_inputs_are_named(rng):
    q, k, v = inputs(rng, d=24)
    with pytest.raises(ValueError, match="^rotate: expected a head dim that is a power of two"):
        numba_flash.quantize_e4m3(q, k, v, rotate=True)
    with pytest.raises(TypeError, match="^rotate: "):
        numba_flash.quantize_e4m3(q, k, v, rotate="yes")
    with pytest.raises(TypeError, match="^q: "):
        numba_flash.quantize_e4m3(q.astype(np.int32), k, v)
