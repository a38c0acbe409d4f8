"""Kernel tier: ``numba_flash.backward`` against ``reference.attention_backward`` (float64).

``o`` and ``lse`` come from ``reference.attention`` (``o`` in the input dtype, ``lse`` in float32,
float64 for float64 inputs: what the forward returns), so these tests do not depend on the
forward kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import randn, assert_scaled_close

#: gradient error bound, relative to max(1, max |reference gradient|) (gradients grow with the
#: inputs, so a fixed absolute bound would be too loose for small ones, too tight for large).
#: Measured over 120 random cases (B=1, H<=4, Nq, Nk 1..24, d 1..39, causal on/off, GQA):
#: float16 8.2e-4 (inputs, o and the float16 output rounding dominate), float32 9.3e-7,
#: float64 1.9e-15.  Bounds are ~4-5x those.
GRAD_TOL = {np.float16: 4e-3, np.float32: 4e-6, np.float64: 1e-14}


def assert_grad_close(got, want, dtype, name):
    assert_scaled_close(got, want, GRAD_TOL[np.dtype(dtype).type], name)


def make_inputs(rng, b, h, hkv, nq, nk, d, dtype, causal=False, softmax_scale=None, q_scale=1.0):
    q = randn(rng, (b, h, nq, d), dtype, scale=q_scale)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d), dtype)
    do = randn(rng, (b, h, nq, d), dtype)
    o, lse = ref.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    lse_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    return do, q, k, v, o.astype(dtype), lse.astype(lse_dtype)


def check_against_reference(args, dtype, grads, causal=False, softmax_scale=None):
    do, q, k, v, _, _ = args
    want = ref.attention_backward(do, q, k, v, causal=causal, softmax_scale=softmax_scale)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_grad_close(g, w, dtype, name)
    return want


# (B, H, Hkv, Nq, Nk, d, causal): aligned tiles; ragged tiles with an odd head dim; Nk > Nq with
# MQA; Nq > Nk causal (fully masked rows) with GQA; head dim 33 (padded to 64), Nk > Nq.
CASES = [
    (1, 2, 2, 16, 16, 16, False),
    (1, 2, 2, 13, 11, 5, True),
    (2, 2, 1, 9, 19, 7, True),
    (1, 4, 2, 20, 9, 12, True),
    (1, 2, 1, 11, 23, 33, False),
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}Hkv{}Nq{}Nk{}d{}{}".format(
    *c[:6], "causal" if c[6] else ""))
def test_backward_matches_reference(rng, dtype, case):
    *shape, causal = case
    args = make_inputs(rng, *shape, dtype, causal=causal)
    grads = numba_flash.backward(*args, causal=causal)
    check_against_reference(args, dtype, grads, causal=causal)


def test_backward_fully_masked_rows_get_zero_gradient(rng):
    """Causal with Nq > Nk: the first Nq - Nk rows see no key (lse = -inf): dq = 0, never NaN."""
    nq, nk = 14, 5
    args = make_inputs(rng, 1, 2, 1, nq, nk, 8, np.float32, causal=True)
    assert np.isneginf(args[5][:, :, : nq - nk]).all()
    for deterministic in (False, True):
        dq, dk, dv = numba_flash.backward(*args, causal=True, deterministic=deterministic)
        assert not np.isnan(dq).any() and not np.isnan(dk).any() and not np.isnan(dv).any()
        np.testing.assert_array_equal(dq[:, :, : nq - nk], 0.0)
        assert np.abs(dq[:, :, nq - nk:]).max() > 0  # the visible rows do get a gradient
        check_against_reference(args, np.float32, (dq, dk, dv), causal=True)


def test_backward_softmax_scale_and_peaked_scores(rng):
    """A custom scale with large logits (P nearly one-hot): lse alone still recovers P."""
    args = make_inputs(rng, 1, 2, 1, 12, 17, 16, np.float32, causal=True, softmax_scale=0.9,
                       q_scale=4.0)
    grads = numba_flash.backward(*args, causal=True, softmax_scale=0.9)
    do, q, k, v, _, _ = args
    want = ref.attention_backward(do, q, k, v, causal=True, softmax_scale=0.9)
    # Logits reach ~40 here and lse is stored in float32, so P = exp(S - lse) carries a relative
    # error of about |lse| * 2**-24 on top of the usual float32 error.  Measured worst over 60
    # seeds: 7.2e-6 relative to max(1, |grad|); bound 3e-5.
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        err = np.abs(g.astype(np.float64) - w).max() / max(1.0, np.abs(w).max())
        assert err <= 3e-5, f"{name}: {err:.2e}"


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_backward_deterministic(rng, dtype):
    """deterministic=True: bitwise identical across runs, and close to the atomic path.

    (In the simulator blocks run one after another, so atomics are ordered too; on a GPU the
    atomic dq may differ run to run in the last bits, the deterministic one may not.)
    """
    causal = dtype == np.float32
    args = make_inputs(rng, 1, 2, 1, 19, 13, 12, dtype, causal=causal)   # GQA: two heads, one kv
    first = numba_flash.backward(*args, causal=causal, deterministic=True)
    second = numba_flash.backward(*args, causal=causal, deterministic=True)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint16 if dtype == np.float16 else np.uint32),
                                      b.view(np.uint16 if dtype == np.float16 else np.uint32))
    want = check_against_reference(args, dtype, first, causal=causal)
    atomic = numba_flash.backward(*args, causal=causal)
    for name, a, b, w in zip(("dq", "dk", "dv"), first, atomic, want):
        bound = 2 * GRAD_TOL[np.dtype(dtype).type] * max(1.0, np.abs(w).max())
        assert np.abs(a.astype(np.float64) - b).max() <= bound, name
    np.testing.assert_array_equal(first[1], atomic[1])  # dk, dv: same kernel, same order
    np.testing.assert_array_equal(first[2], atomic[2])


def test_backward_inputs_unmodified_and_non_contiguous(rng):
    """Inputs stay untouched; a [B, N, H, d] buffer viewed as [B, H, N, d] works."""
    b, h, n, d = 1, 2, 10, 8
    q_bnhd = randn(rng, (b, n, h, d), np.float32)
    q = q_bnhd.transpose(0, 2, 1, 3)  # non-contiguous view
    k = randn(rng, (b, 1, 12, d), np.float32)
    v = randn(rng, (b, 1, 12, d), np.float32)
    do = randn(rng, (b, h, n, d), np.float32)
    o, lse = ref.attention(q, k, v)
    o, lse = o.astype(np.float32), lse.astype(np.float32)
    before = [x.copy() for x in (do, q_bnhd, k, v, o, lse)]
    grads = numba_flash.backward(do, q, k, v, o, lse)
    for x, x0 in zip((do, q_bnhd, k, v, o, lse), before):
        np.testing.assert_array_equal(x, x0)
    check_against_reference((do, q, k, v, o, lse), np.float32, grads)


def _good(dtype=np.float32):
    z = np.zeros
    lse_dtype = np.float64 if dtype == np.float64 else np.float32
    return dict(do=z((1, 2, 4, 8), dtype), q=z((1, 2, 4, 8), dtype), k=z((1, 1, 5, 8), dtype),
                v=z((1, 1, 5, 8), dtype), o=z((1, 2, 4, 8), dtype), lse=z((1, 2, 4), lse_dtype))


@pytest.mark.parametrize("change, exc, msg", [
    ({"q": [[1.0]]}, TypeError, "q: expected a numpy.ndarray"),
    ({"do": np.zeros((1, 2, 3, 8), np.float32)}, ValueError, r"do: expected the shape of q"),
    ({"o": np.zeros((1, 2, 4, 8), np.float64)}, TypeError, "o: expected dtype float32"),
    ({"do": np.zeros((1, 2, 4, 8), np.float16)}, TypeError, "do: expected dtype float32"),
    ({"o": np.zeros((2, 4, 8), np.float32)}, ValueError, "o: expected a 4-D array"),
    ({"lse": np.zeros((1, 2, 4), np.float64)}, TypeError, r"lse: expected dtype in \(float32\)"),
    ({"lse": np.zeros((1, 2, 5), np.float32)}, ValueError, r"lse: expected shape \(1, 2, 4\)"),
    ({"lse": np.zeros((2, 4), np.float32)}, ValueError, "lse: expected a 3-D array"),
    ({"k": np.zeros((1, 3, 5, 8), np.float32), "v": np.zeros((1, 3, 5, 8), np.float32)},
     ValueError, "k: expected a number of kv heads"),
    ({"v": np.zeros((1, 1, 6, 8), np.float32)}, ValueError, "v: expected shape"),
    ({"causal": "yes"}, TypeError, "causal: expected a bool"),
    ({"deterministic": 1}, TypeError, "deterministic: expected a bool"),
    ({"softmax_scale": -1.0}, ValueError, "softmax_scale: expected a finite number > 0"),
])
def test_backward_rejects_bad_input(change, exc, msg):
    kw = _good()
    kw.update(change)
    args = [kw.pop(n) for n in ("do", "q", "k", "v", "o", "lse")]
    with pytest.raises(exc, match=msg):
        numba_flash.backward(*args, **kw)


def test_backward_float64_wants_float64_lse():
    kw = _good(np.float64)
    kw["lse"] = kw["lse"].astype(np.float32)
    with pytest.raises(TypeError, match=r"lse: expected dtype in \(float64\)"):
        numba_flash.backward(*(kw[n] for n in ("do", "q", "k", "v", "o", "lse")))


def test_preprocess_warp_rows_and_group_reduce(rng):
    """The two helper kernels on their own: delta = rowsum(dO * O) by LANES threads per row (d
    wider than the lanes, a row count that leaves the last block part empty) with dq_accum
    zeroed; and the GQA reduce (sum of each group's heads, cast to float16)."""
    from numba import cuda

    from numba_flash.kernels.backward import config as bconfig
    from numba_flash.kernels.backward import simt as kb

    b, h, n, d = 2, 3, 7, 19
    o, do = randn(rng, (b, h, n, d)), randn(rng, (b, h, n, d))
    delta = cuda.to_device(np.full((b, h, n), np.nan, np.float32))
    dq_accum = cuda.to_device(np.full((b, h, n, d), np.nan, np.float32))
    t, lanes = bconfig.elem_threads(), bconfig.row_lanes()
    tiles = -(-n // (t // lanes))
    kb.preprocess_kernel(t, lanes, np.dtype(np.float32))[kb.fold_grid(tiles, b, h), t](
        o, do, delta, dq_accum, tiles)
    want = (do.astype(np.float64) * o).sum(-1)
    assert np.abs(delta.copy_to_host() - want).max() < 1e-5  # float32 sums of 19 products
    np.testing.assert_array_equal(dq_accum.copy_to_host(), 0.0)

    src = randn(rng, (b, 4, n, d))  # H = 4 heads in groups of 2 -> Hkv = 2
    dst = cuda.to_device(np.full((b, 2, n, d), np.nan, np.float16))
    tiles = -(-(n * d) // t)
    kb.reduce_kernel(t, np.dtype(np.float32), np.dtype(np.float16))[
        kb.fold_grid(tiles, b, 2), t](src, dst, tiles)
    want = src.reshape(b, 2, 2, n, d).sum(2)
    np.testing.assert_array_equal(dst.copy_to_host(), want.astype(np.float16))
