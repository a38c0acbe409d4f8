"""reference.dequantize: fp8 values times FA3's per-(batch, kv head) descale factors, and the fp8
attention it gives equal to FA3's formula written out (scores scaled after Q K^T, the output
after P V)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numba_flash import reference


def test_fp8_attention_is_fa3s_formula():
    rng = np.random.default_rng(7)
    b, h, hkv, n, d = 2, 4, 2, 5, 8
    f8 = ml_dtypes.float8_e4m3fn
    q = rng.standard_normal((b, h, n, d)).astype(f8)
    k = rng.standard_normal((b, hkv, n, d)).astype(f8)
    v = rng.standard_normal((b, hkv, n, d)).astype(f8)
    qd, kd, vd = (rng.uniform(0.1, 4.0, (b, hkv)).astype(np.float32) for _ in range(3))
    o, lse = reference.attention(reference.dequantize(q, qd), reference.dequantize(k, kd),
                                 reference.dequantize(v, vd), causal=True)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for bi in range(b):
        for hi in range(h):
            g = hi // (h // hkv)
            s = q64[bi, hi] @ k64[bi, g].T * (float(qd[bi, g]) * float(kd[bi, g]) / np.sqrt(d))
            s[np.triu_indices(n, 1)] = -np.inf
            p = np.exp(s - s.max(1, keepdims=True))
            want_lse = np.log(p.sum(1)) + s.max(1)
            want_o = (p / p.sum(1, keepdims=True)) @ v64[bi, g] * float(vd[bi, g])
            np.testing.assert_allclose(o[bi, hi], want_o, rtol=1e-12, atol=1e-12)
            np.testing.assert_allclose(lse[bi, hi], want_lse, rtol=1e-12)


def test_descale_shape_is_checked():
    with pytest.raises(ValueError, match=r"descale: expected \[B, Hkv\]"):
        reference.dequantize(np.zeros((2, 4, 3, 8)), np.ones((2, 3)))
