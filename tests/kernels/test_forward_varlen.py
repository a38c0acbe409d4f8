"""Kernel tier: ``numba_flash.forward_varlen`` (packed variable-length batches) against the float64
reference :func:`numba_flash.reference.attention_varlen`, with ragged lengths (an empty
sequence, one shorter than a tile, one over several tiles), every variant, GQA, dropout with the
documented per-sequence mask, and its argument checks.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.ops import forward_varlen as varlen_op
from helpers import randn

# Tolerances: the varlen kernel is the batched kernel's arithmetic with other indexing, so these
# are the bounds measured for the batched variants (tests/kernels/test_forward_variants.py: o
# float16 8.5e-4, float32 4.7e-7, float64 1.1e-15; relative lse float16 2.0e-7, float32 1.7e-7,
# float64 6.3e-16).  The cases below measured at most: o float16 4.0e-4, float32 3.3e-7,
# float64 6.7e-16.
O_TOL = {np.float16: 4e-3, np.float32: 2e-6, np.float64: 5e-15}
LSE_TOL = {np.float16: 8e-7, np.float32: 8e-7, np.float64: 2.5e-15}


def packed(rng, lens_q, lens_k, h, hkv, d, dtype):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = randn(rng, (int(cu_q[-1]), h, d), dtype)
    k = randn(rng, (int(cu_k[-1]), hkv, d), dtype)
    v = randn(rng, (int(cu_k[-1]), hkv, d), dtype)
    return q, k, v, cu_q, cu_k


def compare(o, lse, want_o, want_lse, dtype):
    dtype = np.dtype(dtype).type
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "NaN (an unwritten element?)"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    err = np.abs(o.astype(np.float64) - want_o).max()
    assert err <= O_TOL[dtype], f"o: max abs error {err:.3e} > {O_TOL[dtype]:.1e}"
    fin = np.isfinite(want_lse)
    if fin.any():
        rel = (np.abs(lse[fin] - want_lse[fin]) / np.maximum(1.0, np.abs(want_lse[fin]))).max()
        assert rel <= LSE_TOL[dtype], f"lse: max relative error {rel:.3e}"


def run(q, k, v, cu_q, cu_k, **kw):
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=int(lq.max()),
                                        max_seqlen_k=int(lk.max()), return_lse=True, **kw)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    want_o, want_lse = ref.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    return o, lse, want_o, want_lse


# ragged: an empty sequence (both sides), a sequence shorter than a tile, several tiles,
# Nq > Nk (rows that see no key under causal) and Nq < Nk
LENS_Q = [5, 0, 19, 1, 12]
LENS_K = [7, 3, 11, 1, 20]


@pytest.mark.parametrize("kw", [
    dict(),
    dict(causal=True),
    dict(window_size=(3, 2), softcap=1.5),
    dict(causal=True, window_size=(4, -1), alibi_slopes=ref.alibi_slopes(4)),
    dict(alibi_slopes=np.linspace(0.1, 1, 20, dtype=np.float32).reshape(5, 4), softcap=2.0,
         softmax_scale=0.3),
], ids=["plain", "causal", "window-softcap", "causal-window-alibi", "alibi-BxH-softcap"])
def test_varlen_matches_reference_float32(rng, kw):
    q, k, v, cu_q, cu_k = packed(rng, LENS_Q, LENS_K, 4, 2, 6, np.float32)
    compare(*run(q, k, v, cu_q, cu_k, **kw), np.float32)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_varlen_other_dtypes(rng, dtype):
    q, k, v, cu_q, cu_k = packed(rng, [9, 3], [4, 13], 2, 1, 5, dtype)
    compare(*run(q, k, v, cu_q, cu_k, causal=True, window_size=(5, -1)), dtype)


def test_varlen_sequence_without_keys(rng):
    """A sequence with query rows and no key: o = 0, lse = -inf for its rows."""
    q, k, v, cu_q, cu_k = packed(rng, [4, 3, 5], [6, 0, 7], 2, 2, 4, np.float32)
    lq = np.diff(cu_q)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=5, max_seqlen_k=7,
                                        return_lse=True)
    assert (o[4:7] == 0).all() and np.isneginf(lse[:, 4:7]).all()
    keep_q = np.r_[0:4, 7:12]
    want_o, want_lse = ref.attention_varlen(q[keep_q], k, v, np.array([0, 4, 4, 9]),
                                            np.array([0, 6, 6, 13]))
    compare(o[keep_q], lse[:, keep_q], want_o, want_lse, np.float32)
    assert lq.sum() == q.shape[0]


def test_varlen_equals_the_batched_forward(rng):
    """Equal lengths: the packed call is the batched forward on the transposed arrays."""
    q, k, v, cu_q, cu_k = packed(rng, [7, 7], [10, 10], 2, 1, 5, np.float32)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=7, max_seqlen_k=10,
                                        causal=True, return_lse=True)

    def batch(x):
        return np.ascontiguousarray(x.reshape(2, -1, *x.shape[1:]).transpose(0, 2, 1, 3))

    ob, lseb = numba_flash.forward(batch(q), batch(k), batch(v), causal=True, return_lse=True)
    np.testing.assert_array_equal(o, ob.transpose(0, 2, 1, 3).reshape(o.shape))
    np.testing.assert_array_equal(lse, lseb.transpose(1, 0, 2).reshape(lse.shape))


def test_varlen_dropout_is_the_per_sequence_mask(rng):
    """Sequence b's mask is dropout_mask(seed, B, H, nq_b, nk_b, p)[b] (within-sequence rows and
    keys, b as the batch index)."""
    lens_q, lens_k = [6, 0, 9], [5, 2, 11]
    q, k, v, cu_q, cu_k = packed(rng, lens_q, lens_k, 2, 1, 4, np.float32)
    p, seed = 0.3, 2**40 + 9
    masks = [numba_flash.dropout_mask(seed, 3, 2, max(nq, 1), max(nk, 1), p)[b, :, :nq, :nk]
             for b, (nq, nk) in enumerate(zip(lens_q, lens_k))]
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=9, max_seqlen_k=11,
                                        causal=True, dropout_p=p, seed=seed, return_lse=True)
    want_o, want_lse = ref.attention_varlen(q, k, v, cu_q, cu_k, causal=True,
                                            dropout_masks=masks, dropout_p=p)
    plain_o = ref.attention_varlen(q, k, v, cu_q, cu_k, causal=True)[0]
    assert np.abs(plain_o - want_o).max() > 1e-2  # the mask matters here
    compare(o * (1 - p), lse, want_o * (1 - p), want_lse, np.float32)


def _args(total_q=6, total_k=8, h=2, hkv=1, d=4):
    z = np.zeros
    return (z((total_q, h, d), np.float32), z((total_k, hkv, d), np.float32),
            z((total_k, hkv, d), np.float32), np.array([0, 2, 6], np.int32),
            np.array([0, 5, 8], np.int32))


@pytest.mark.parametrize("change, exc, msg", [
    (lambda a, kw: ((a[0][None], *a[1:]), kw), ValueError, r"^q: expected a 3-D array"),
    (lambda a, kw: ((a[0], a[1].astype(np.float64), *a[2:]), kw), TypeError,
     r"^k: expected dtype float32"),
    (lambda a, kw: ((*a[:3], a[3].astype(np.float32), a[4]), kw), TypeError,
     r"^cu_seqlens_q: expected an integer array"),
    (lambda a, kw: ((*a[:3], np.array([1, 2, 6], np.int32), a[4]), kw), ValueError,
     r"^cu_seqlens_q: expected 0 first"),
    (lambda a, kw: ((*a[:3], np.array([0, 2, 5], np.int32), a[4]), kw), ValueError,
     r"^cu_seqlens_q: expected the packed length 6 last"),
    (lambda a, kw: ((*a[:3], np.array([0, 4, 2, 6], np.int32), a[4]), kw), ValueError,
     r"^cu_seqlens_q: expected non-decreasing"),
    (lambda a, kw: ((*a[:4], np.array([0, 8], np.int32)), dict(kw, max_seqlen_k=8)),
     ValueError, r"^cu_seqlens_k: expected 3 entries"),
    (lambda a, kw: (a, dict(kw, max_seqlen_q=3)), ValueError,
     r"^max_seqlen_q: expected at least the longest sequence"),
    (lambda a, kw: (a, dict(kw, max_seqlen_k=4.0)), TypeError, r"^max_seqlen_k: expected an int"),
    (lambda a, kw: (a, dict(kw, window_size=(-3, 0))), ValueError, r"^window_size: expected left"),
    (lambda a, kw: (a, dict(kw, softcap=-2)), ValueError, r"^softcap: expected a finite number"),
    (lambda a, kw: (a, dict(kw, alibi_slopes=np.ones((3, 2), np.float32))), ValueError,
     r"^alibi_slopes: expected shape \(2,\) or \(2, 2\)"),
    (lambda a, kw: (a, dict(kw, dropout_p=1.5)), ValueError, r"^dropout_p: expected"),
    (lambda a, kw: (a, dict(kw, causal="yes")), TypeError, r"^causal: expected a bool"),
])
def test_varlen_arguments_are_checked_before_launch(monkeypatch, change, exc, msg):
    def no_kernel(*args):
        raise AssertionError("a kernel was built before validation finished")

    monkeypatch.setattr(varlen_op, "forward_kernel", no_kernel)
    args, kw = change(_args(), dict(max_seqlen_q=4, max_seqlen_k=5))
    with pytest.raises(exc, match=msg):
        numba_flash.forward_varlen(*args, **kw)
