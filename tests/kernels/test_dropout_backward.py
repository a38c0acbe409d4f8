"""Kernel tier: ``numba_flash.backward`` with dropout against ``reference.attention_backward``.

The reference gets the exact keep-mask ``numba_flash.dropout_mask(seed, B, H, Nq, Nk, p)``; ``o``
and ``lse`` come from ``reference.attention`` with that mask (``o`` is the dropped output, cast
to the input dtype; ``lse`` is unaffected by dropout, float32 / float64), so these tests do not
depend on the forward kernel.  A Philox call costs ~1 ms in the simulator: shapes are tiny.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import randn, assert_scaled_close

#: gradient error bound, relative to max(1, max |reference gradient|) (as in
#: test_backward_kernel.py).  Measured with dropout over random cases (B=1, H<=4, GQA, Nq, Nk
#: 1..24, d 1..39, causal on/off, p in {0.1, 0.3, 0.5, 0.8}, deterministic on/off), worst of
#: (dq, dk, dv): float32 over 60 cases 7.3e-7, float64 over 50 cases 3.0e-15, float16 over 40
#: cases 1.9e-3 (dk; Z = 1/(1-p) up to 5 amplifies the float16 rounding of o and dO V^T).
#: Bounds are ~4-5x those.
GRAD_TOL = {np.float16: 8e-3, np.float32: 4e-6, np.float64: 1.2e-14}


def assert_grad_close(got, want, dtype, name):
    assert_scaled_close(got, want, GRAD_TOL[np.dtype(dtype).type], name)


def make_inputs(rng, b, h, hkv, nq, nk, d, dtype, p, seed, causal=False):
    """``(do, q, k, v, o, lse)`` with ``o`` the dropped reference output, and the keep-mask."""
    q = randn(rng, (b, h, nq, d), dtype)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d), dtype)
    do = randn(rng, (b, h, nq, d), dtype)
    mask = numba_flash.dropout_mask(seed, b, h, nq, nk, p)
    o, lse = ref.attention(q, k, v, causal=causal, dropout_mask=mask, dropout_p=p)
    lse_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    return (do, q, k, v, o.astype(dtype), lse.astype(lse_dtype)), mask


def check_against_reference(args, mask, p, dtype, grads, causal=False):
    do, q, k, v, _, _ = args
    want = ref.attention_backward(do, q, k, v, causal=causal, dropout_mask=mask, dropout_p=p)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_grad_close(g, w, dtype, name)
    return want


# (B, H, Hkv, Nq, Nk, d, causal, dtype, p, deterministic): aligned tiles; ragged tiles, odd head
# dim; MQA with Nk > Nq; Nq > Nk causal (rows that see no key) with GQA; head dim 33 (padded to
# 64) in float64; float16 once.  Seeds above 2**32 exercise the key's high word.
CASES = [
    (1, 2, 2, 16, 16, 16, False, np.float32, 0.5, False),
    (1, 2, 2, 13, 11, 5, True, np.float32, 0.3, True),
    (2, 2, 1, 9, 19, 7, True, np.float64, 0.2, False),
    (1, 4, 2, 20, 9, 12, True, np.float32, 0.5, False),
    (1, 4, 2, 20, 9, 12, True, np.float32, 0.5, True),
    (1, 2, 1, 11, 23, 33, False, np.float64, 0.8, True),
    (1, 2, 1, 12, 10, 8, False, np.float16, 0.3, False),
]


def _case_id(c):
    b, h, hkv, nq, nk, d, causal, dtype, p, det = c
    return (f"B{b}H{h}Hkv{hkv}Nq{nq}Nk{nk}d{d}{'causal' if causal else ''}-"
            f"{np.dtype(dtype).name}-p{p}{'-det' if det else ''}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_dropout_backward_matches_reference(rng, case):
    *shape, causal, dtype, p, deterministic = case
    seed = int(rng.integers(0, 2**63)) * 2 + 1  # odd, and almost surely >= 2**32
    args, mask = make_inputs(rng, *shape, dtype, p, seed, causal=causal)
    assert 0 < mask.mean() < 1  # something is dropped, something kept
    grads = numba_flash.backward(*args, causal=causal, deterministic=deterministic,
                                 dropout_p=p, seed=seed)
    check_against_reference(args, mask, p, dtype, grads, causal=causal)


def test_dropout_backward_uses_the_seed(rng):
    """Another seed's mask gives other gradients: the kernels do read the seed (and the check
    above could fail)."""
    p, seed = 0.5, 7
    args, mask = make_inputs(rng, 1, 2, 1, 8, 12, 8, np.float32, p, seed)
    grads = numba_flash.backward(*args, dropout_p=p, seed=seed)
    other = numba_flash.dropout_mask(seed + 1, 1, 2, 8, 12, p)
    want_other = ref.attention_backward(*args[:4], dropout_mask=other, dropout_p=p)
    check_against_reference(args, mask, p, np.float32, grads)
    assert np.abs(grads[2] - want_other[2]).max() > 1e-2  # dv with the wrong mask: far off


def test_dropout_deterministic_repeatable_and_matches_atomic(rng):
    """deterministic=True with dropout: bitwise identical run to run; dk, dv equal the atomic
    path's bit for bit (same kernel), dq within tolerance."""
    p, seed = 0.4, 2**40 + 3
    args, mask = make_inputs(rng, 1, 2, 1, 11, 13, 6, np.float32, p, seed, causal=True)
    first = numba_flash.backward(*args, causal=True, deterministic=True, dropout_p=p, seed=seed)
    second = numba_flash.backward(*args, causal=True, deterministic=True, dropout_p=p, seed=seed)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    atomic = numba_flash.backward(*args, causal=True, dropout_p=p, seed=seed)
    want = check_against_reference(args, mask, p, np.float32, first, causal=True)
    bound = 2 * GRAD_TOL[np.float32] * max(1.0, np.abs(want[0]).max())
    assert np.abs(first[0].astype(np.float64) - atomic[0]).max() <= bound
    np.testing.assert_array_equal(first[1], atomic[1])
    np.testing.assert_array_equal(first[2], atomic[2])


@pytest.mark.parametrize("deterministic", [False, True])
def test_dropout_p_zero_is_the_plain_backward(rng, deterministic):
    """dropout_p = 0 (any seed) is bitwise the call without dropout: the same plain kernels."""
    args, _ = make_inputs(rng, 1, 2, 1, 10, 9, 8, np.float32, 0.0, 0, causal=True)
    plain = numba_flash.backward(*args, causal=True, deterministic=deterministic)
    zero = numba_flash.backward(*args, causal=True, deterministic=deterministic,
                                dropout_p=0.0, seed=12345)
    for a, b in zip(plain, zero):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def _zeros():
    z = np.zeros
    return (z((1, 2, 4, 8), np.float32), z((1, 2, 4, 8), np.float32), z((1, 1, 5, 8), np.float32),
            z((1, 1, 5, 8), np.float32), z((1, 2, 4, 8), np.float32), z((1, 2, 4), np.float32))


@pytest.mark.parametrize("kwargs, exc, msg", [
    ({"dropout_p": 1.0}, ValueError, r"dropout_p: expected a real number in \[0, 1\)"),
    ({"dropout_p": -0.1}, ValueError, "dropout_p: expected"),
    ({"dropout_p": float("nan")}, ValueError, "dropout_p: expected"),
    ({"dropout_p": "0.1"}, TypeError, "dropout_p: expected a real number"),
    ({"dropout_p": True}, TypeError, "dropout_p: expected a real number"),
    ({"dropout_p": 0.1, "seed": -1}, ValueError, r"seed: expected an integer in \[0, 2\*\*64\)"),
    ({"dropout_p": 0.1, "seed": 2**64}, ValueError, "seed: expected an integer"),
    ({"dropout_p": 0.1, "seed": 1.5}, TypeError, "seed: expected an integer"),
    ({"dropout_p": 0.1, "seed": True}, TypeError, "seed: expected an integer"),
    ({"seed": -1}, ValueError, "seed: expected an integer"),  # checked even when p = 0
])
def test_dropout_backward_rejects_bad_p_and_seed(kwargs, exc, msg, monkeypatch):
    """Bad ``dropout_p`` / ``seed`` raise before any launch, naming the argument."""
    from numba_flash.frontend import arrays

    def no_launch(*a, **k):
        raise AssertionError("launched a kernel before validation finished")

    monkeypatch.setattr(arrays.ArrayCall, "launch", no_launch)
    with pytest.raises(exc, match=msg):
        numba_flash.backward(*_zeros(), **kwargs)
