"""The backward on strided views (issue 61): the SIMT kernels index every array through its
strides (Numba's own indexing), so ``do``, ``q``, ``k``, ``v``, ``o`` in flash-attn's ``[B, N,
H, d]`` memory (their ``transpose(0, 2, 1, 3)`` views) are read where they lie and ``out=``
views with the caller's data between their rows are written in place; the tensor-core backward
copies such inputs and writes a new array that the call copies into ``out=``.  Against the
float64 reference (the forward's ``o`` and ``lse`` from the same views), outputs NaN-poisoned
(conftest), a sentinel in the gaps, inputs unchanged.

Tolerance: tests/kernels/test_backward_kernel.py's (the same kernels; only addresses differ).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference
from tests.helpers import assert_scaled_close

SENTINEL = 7.0
#: max |grad - ref| / max(1, max |ref|): the backward tests' bounds per dtype
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 4e-3}


def _bnhd(rng, b, n, h, d, dtype):
    return rng.standard_normal((b, n, h, d)).astype(dtype).transpose(0, 2, 1, 3)


def _gapped(b, h, n, d, dtype):
    """An ``out=`` view ``[B, H, N, d]`` of ``[B, N, H + 1, d]`` memory (head 0 the caller's)."""
    mem = np.full((b, n, h + 1, d), SENTINEL, dtype)
    return mem[:, :, 1:].transpose(0, 2, 1, 3), mem


@pytest.mark.parametrize("kernel,dtype", [("simt", np.float32), ("simt", np.float16),
                                          ("mma", np.float16)])
def test_backward_on_flash_attn_layout_views(kernel, dtype, rng):
    b, h, hkv, nq, nk, d = 1, 4, 2, 18, 23, 16
    dtype = np.dtype(dtype)
    q = _bnhd(rng, b, nq, h, d, dtype)
    k, v = (_bnhd(rng, b, nk, hkv, d, dtype) for _ in range(2))
    do = _bnhd(rng, b, nq, h, d, dtype)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    o = np.ascontiguousarray(o.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)   # [B, N, H, d]
    check_backward_into_gapped_outs(do, q, k, v, o, lse, TOL[dtype], kernel=kernel)


def check_backward_into_gapped_outs(do, q, k, v, o, lse, tol, **kw):
    """``numba_flash.backward`` (causal; ``kw`` its options) into ``out=`` views with a
    sentinel head between their rows: each gradient the reference's within ``tol``, returned
    as the ``out=`` arrays themselves, the gaps and the inputs untouched."""
    before = [x.copy() for x in (do, q, k, v, o)]
    outs = [_gapped(*x.shape, x.dtype) for x in (q, k, v)]
    dq, dk, dv = numba_flash.backward(do, q, k, v, o, lse, causal=True,
                                      out=tuple(x for x, _ in outs), **kw)
    assert all(g is x for g, (x, _) in zip((dq, dk, dv), outs))
    want = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)),
                                        causal=True)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert_scaled_close(got.astype(np.float64), w, tol, name=name)
    for _, mem in outs:
        assert (mem[:, :, 0].astype(np.float64) == SENTINEL).all(), "a gap element written"
    for x, x0 in zip((do, q, k, v, o), before):
        np.testing.assert_array_equal(x.view(np.uint8), x0.view(np.uint8))


def test_overlapping_gradient_out_is_refused():
    q = np.zeros((1, 2, 4, 16), np.float32)
    lse = np.zeros((1, 2, 4), np.float32)
    bad = np.broadcast_to(np.zeros((1, 1, 4, 16), np.float32), (1, 2, 4, 16))
    with pytest.raises(ValueError, match=r"out\[0\] \(dq\): expected a view whose last dim"):
        numba_flash.backward(q, q, q, q, q, lse, out=(bad, q.copy(), q.copy()))
