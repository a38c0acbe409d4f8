"""The tensor-core backward in bfloat16 (``ml_dtypes.bfloat16`` in, bfloat16 out) against the
float64 reference, the forward's ``o`` and ``lse`` from the bfloat16 tensor-core forward.

Measured (simulator, 2026-12-01): the two cases below (the first then without GQA) and a
causal GQA d = 16 case, on 4 seeds, max |dx - dx_ref| /
max(1, max |dx_ref|) per gradient = 1.9e-3 to 5.1e-3; five other cases (no mask d = 32, d = 200
in the four half-column passes, dropout alone, softcap + ALiBi alone) 1.4e-3 to 4.9e-3, float16
on the same draws 2.5e-4 to 5.3e-4 (bfloat16's 8-bit mantissa: about 8x).  Bound 2e-2, about 4x
the worst, as test_mma_backward's float16 bound is.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference
from numba_flash.ops.backward_mma import backward_mma
from numba_flash.ops.forward_mma import forward_mma
from tests.helpers import assert_scaled_close

BF16 = ml_dtypes.bfloat16
GRAD_TOL = 2e-2


def inputs(rng, b, h, hkv, nq, nk, d):
    shapes = ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, h, nq, d))
    return [rng.standard_normal(s).astype(BF16) for s in shapes]


@pytest.mark.parametrize("shape, kw", [
    ((1, 2, 1, 18, 23, 32), dict(window_size=(4, 6), deterministic=True)),   # GQA
    ((1, 2, 2, 20, 30, 16), dict(causal=True, softcap=4.0, dropout_p=0.2, seed=3)),
])
def test_bfloat16_backward_matches_float64(rng, shape, kw):
    q, k, v, do = inputs(rng, *shape)
    kw = dict(kw)
    det = kw.pop("deterministic", False)
    alibi = reference.alibi_slopes(shape[1]) if "softcap" in kw else None
    o, lse = forward_mma(q, k, v, return_lse=True, alibi_slopes=alibi, **kw)
    assert o.dtype == BF16 and lse.dtype == np.float32
    copies = [x.copy() for x in (do, q, k, v, o, lse)]
    grads = numba_flash.backward(do, q, k, v, o, lse, kernel="mma", deterministic=det,
                                 alibi_slopes=alibi, **kw)
    for x, c in zip((do, q, k, v, o, lse), copies):
        np.testing.assert_array_equal(x.view(np.uint8), c.view(np.uint8))  # inputs untouched
    mask = None
    if kw.get("dropout_p"):
        mask = numba_flash.dropout_mask(kw["seed"], shape[0], shape[1], shape[3], shape[4],
                                        kw["dropout_p"])
    rkw = {n: x for n, x in kw.items() if n != "seed"}
    refs = reference.attention_backward(do, q, k, v, dropout_mask=mask, alibi_slopes=alibi,
                                        **rkw)
    for name, got, want, like in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert got.dtype == BF16 and got.shape == like.shape, name
        assert_scaled_close(got.astype(np.float64), want, GRAD_TOL, name=name)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NumPy on NaN * 0
def test_bfloat16_non_finite_do_stays_on_visible_keys(rng):
    """bfloat16's exponent bits (0x7F80) in the non-finite dO rule: a NaN dO[i, c] makes dV[:, c]
    NaN only for the keys row i sees, everything else finite, as in the reference."""
    q, k, v, do = inputs(rng, 1, 1, 1, 20, 18, 16)
    do[0, 0, 9, 3] = np.nan
    kw = dict(window_size=(3, 2))
    o, lse = forward_mma(q, k, v, return_lse=True, **kw)
    grads = backward_mma(do, q, k, v, o, lse, **kw)
    want = reference.attention_backward(do, q, k, v, **kw)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        np.testing.assert_array_equal(np.isfinite(got.astype(np.float64)), np.isfinite(w),
                                      err_msg=name)
    vis = reference.visible_mask(20, 18, **kw)
    assert np.isnan(grads[2].astype(np.float64)[0, 0, vis[9], 3]).all()
