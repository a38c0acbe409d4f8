"""A user's score_mod / mask_mod in the decode (FlashDecoding split-KV, simulator) over paged and
contiguous caches, against the float64 reference with the same functions
(:func:`numba_flash.reference.kvcache_decode`), the built-in variants they restate and the
batched forward of the whole sequences."""

from __future__ import annotations

import math

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.flex import create_block_mask

#: decode vs float64, worst over the cases below with 5 seeds each (measured 2026-12-01):
#: float16 o 4.8e-4, lse 4.2e-7; float32 o 3.8e-7, lse 3.9e-7; float64 o 5.6e-16, lse 8.9e-16.
#: decode vs the forward of the whole sequences: float32 3.6e-7, float64 8.9e-16
O_TOL = {np.float16: 2e-3, np.float32: 1.5e-6, np.float64: 1e-14}
LSE_TOL = {np.float16: 2e-6, np.float32: 1.5e-6, np.float64: 1e-14}


def _randn(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def _paged(rng, k, v, lens, block_size):
    """The contiguous ``[B, Hkv, Nmax, d]`` caches as paged caches with a shuffled block table
    (spare blocks and slots past a sequence's length NaN: never read)."""
    b, hkv, nmax, d = k.shape
    n_tab = -(-nmax // block_size)
    nblk = b * n_tab + 2
    kp = np.full((nblk, hkv, block_size, d), np.nan, k.dtype)
    vp = np.full_like(kp, np.nan)
    table = rng.permutation(nblk)[:b * n_tab].reshape(b, n_tab).astype(np.int32)
    for s in range(b):
        for t in range(int(lens[s])):
            kp[table[s, t // block_size], :, t % block_size] = k[s, :, t]
            vp[table[s, t // block_size], :, t % block_size] = v[s, :, t]
    return kp, vp, table


def _cache(rng, dtype, b, hkv, nmax, d, lens):
    k, v = _randn(rng, (b, hkv, nmax, d), dtype), _randn(rng, (b, hkv, nmax, d), dtype)
    for s in range(b):  # stale slots: NaN, never read
        k[s, :, int(lens[s]):] = np.nan
        v[s, :, int(lens[s]):] = np.nan
    return k, v


def _check(got, want, dtype):
    o, lse = got
    o_r, lse_r = want[:2]
    dt = np.dtype(dtype).type
    np.testing.assert_allclose(o.astype(np.float64), o_r, atol=O_TOL[dt], rtol=0)
    fin = np.isfinite(lse_r)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], lse_r[fin], atol=LSE_TOL[dt], rtol=0)


def _docs(b, h, q_idx, kv_idx, doc, heads):
    """Packed documents, in the heads that ``heads[h]`` switches on (a head switched off: rows
    with no key, o = 0, lse = -inf).  ``heads`` has H entries: a call for a padding row of the
    kernel (h = H) would be an IndexError in the simulator."""
    return heads[h] != 0 and doc[b, q_idx] == doc[b, kv_idx]


def _slopes_bias(score, b, h, q_idx, kv_idx, slopes):
    """ALiBi as a score_mod (the built-in: minus slope times the distance of the columns)."""
    return score - slopes[h] * abs(q_idx - kv_idx)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_document_mask_over_a_paged_cache(rng, dtype):
    """GQA 4/2, Nq = 3 (6 rows of a group: a padding row chunk), block size 3, 3 splits per
    sequence; documents from per-token ids, one head masked out entirely."""
    b, h, hkv, nq, d, nmax = 2, 4, 2, 3, 8, 30
    lens = np.array([23, 29])
    k, v = _cache(rng, dtype, b, hkv, nmax, d, lens)
    kp, vp, table = _paged(rng, k, v, lens, 3)
    q = _randn(rng, (b, h, nq, d), dtype)
    # [docs:decode-documents]
    doc = np.zeros((b, nmax), np.int32)  # doc[b, t]: the document of token t of sequence b
    doc[0, 9:] = 1
    doc[0, 21:] = 2              # the last query rows start a document of their own
    doc[1, 20:] = 1
    heads = np.array([1, 1, 1, 0], np.int32)
    kw = dict(mask_mod=_docs, aux_tensors=(doc, heads), causal=True)
    got = numba_flash.decode(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=3,
                             return_lse=True, **kw)
    want = ref.kvcache_decode(q, kp, vp, lens, block_table=table, **kw)
    # [/docs:decode-documents]
    _check(got, want, dtype)
    assert np.isneginf(got[1][:, 3]).all() and (got[0][:, 3] == 0).all()
    if dtype != np.float32:
        return
    # the same rows of the batched forward of the whole sequences (on the gathered K/V, with
    # the same function): the decode's q_idx / kv_idx are the forward's
    for s in range(b):
        n = int(lens[s])
        kf, vf = (ref.gather_paged(c, table, n, s)[None].astype(dtype) for c in (kp, vp))
        qf = np.concatenate([_randn(rng, (1, h, n - nq, d), dtype), q[s:s + 1]], axis=2)
        fwd = numba_flash.forward(qf, kf, vf, return_lse=True, mask_mod=_docs, causal=True,
                                  aux_tensors=(doc[s:s + 1], heads))
        np.testing.assert_allclose(got[0][s].astype(np.float64),
                                   fwd[0][0, :, -nq:].astype(np.float64),
                                   atol=2 * O_TOL[np.dtype(dtype).type], rtol=0)
        np.testing.assert_array_equal(np.isfinite(fwd[1][0, :, -nq:]), np.isfinite(got[1][s]))


def test_window_as_mask_mod_equals_the_built_in_window(rng):
    """A sliding window written as a mask_mod, over a paged cache with a left pad: equal to
    decode's window_size (and the reference of both)."""
    b, h, hkv, nq, d, nmax = 2, 2, 1, 2, 4, 36
    lens = np.array([36, 19])
    pad = np.array([5, 0], np.int32)
    k, v = _cache(rng, np.float32, b, hkv, nmax, d, lens)
    kp, vp, table = _paged(rng, k, v, lens, 4)
    q = _randn(rng, (b, h, nq, d), np.float32)

    def local(b, h, q_idx, kv_idx):
        return q_idx - 7 <= kv_idx and kv_idx <= q_idx

    kw = dict(cache_seqlens=lens, block_table=table, cache_leftpad=pad, return_lse=True)
    got = numba_flash.decode(q, kp, vp, mask_mod=local, num_splits=4, **kw)
    builtin = numba_flash.decode(q, kp, vp, window_size=(7, 0), **kw)
    want = ref.kvcache_decode(q, kp, vp, lens, block_table=table, cache_leftpad=pad,
                              window_size=(7, 0))
    _check(got, want, np.float32)
    _check(builtin, want, np.float32)
    _check(got, ref.kvcache_decode(q, kp, vp, lens, block_table=table, cache_leftpad=pad,
                                   mask_mod=local), np.float32)


def test_alibi_as_score_mod_equals_built_in_alibi_contiguous(rng):
    """ALiBi as a score_mod reading an aux table, MQA 4/1, Nq = 2, contiguous, float64: equal to
    decode's alibi_slopes; the same rows of the batched forward of the whole sequences."""
    b, h, hkv, nq, d, nmax = 2, 4, 1, 2, 8, 20
    lens = np.array([20, 20])
    k, v = _cache(rng, np.float64, b, hkv, nmax, d, lens)
    q = _randn(rng, (b, h, nq, d), np.float64)
    slopes = ref.alibi_slopes(h).astype(np.float32)
    kw = dict(cache_seqlens=lens, return_lse=True, num_splits=3, softcap=4.0)
    got = numba_flash.decode(q, k, v, score_mod=_slopes_bias, aux_tensors=(slopes,), **kw)
    builtin = numba_flash.decode(q, k, v, alibi_slopes=slopes, **kw)
    _check(got, ref.kvcache_decode(q, k, v, lens, alibi_slopes=slopes, softcap=4.0),
           np.float64)
    np.testing.assert_allclose(got[0], builtin[0], atol=1e-14, rtol=0)
    qf = np.concatenate([_randn(rng, (b, h, nmax - nq, d), np.float64), q], axis=2)
    fwd = numba_flash.forward(qf, k, v, return_lse=True, score_mod=_slopes_bias,
                              aux_tensors=(slopes,), softcap=4.0)
    np.testing.assert_allclose(got[0], fwd[0][:, :, -nq:], atol=1e-14, rtol=0)
    np.testing.assert_allclose(got[1], fwd[1][:, :, -nq:], atol=1e-14, rtol=0)


def test_relative_bias_and_mask_with_append(rng):
    """A relative-position bias (aux table) and a prefix-LM mask on a float16 paged cache with
    two appended tokens per sequence (GQA 2/1, Nq = 3: a padding row, which never calls the
    functions): the positions are those of the new lengths."""
    b, h, hkv, nq, d, nmax, nnew = 2, 2, 1, 3, 8, 24, 2
    lens = np.array([13, 20])
    k, v = _cache(rng, np.float16, b, hkv, nmax, d, lens + nnew)
    kp, vp, table = _paged(rng, k, v, lens, 5)
    k_new = _randn(rng, (b, hkv, nnew, d), np.float16)
    v_new = _randn(rng, (b, hkv, nnew, d), np.float16)
    q = _randn(rng, (b, h, nq, d), np.float16)
    bias = rng.standard_normal((h, 2 * nmax)).astype(np.float32)
    prefix = np.array([4, 17], np.int32)

    def rel(score, b, h, q_idx, kv_idx, bias, prefix):
        return score + bias[h, q_idx - kv_idx + 24]

    def prefix_lm(b, h, q_idx, kv_idx, bias, prefix):
        return kv_idx < prefix[b] or kv_idx <= q_idx - 1   # the query itself excluded

    kw = dict(score_mod=rel, mask_mod=prefix_lm, aux_tensors=(bias, prefix))
    want = ref.kvcache_decode(q, kp, vp, lens, k_new=k_new, v_new=v_new, block_table=table,
                              **kw)
    kp0 = kp.copy()
    got = numba_flash.decode(q, kp, vp, cache_seqlens=lens, block_table=table, k_new=k_new,
                             v_new=v_new, num_splits=2, return_lse=True, **kw)
    _check(got, want, np.float16)
    assert not np.array_equal(kp0, kp, equal_nan=True)  # appended in place


def test_score_mod_minus_inf_still_sees_the_value(rng):
    """A score_mod that gives a visible key -inf: p = 0, and a NaN in that key's value reaches
    the output column (as the reference and torch: the key is masked by the score, not by the
    mask); a mask_mod hiding the same key keeps the NaN out."""
    b, h, hkv, d, n = 1, 2, 1, 4, 12
    lens = np.array([n])
    k, v = _cache(rng, np.float32, b, hkv, n, d, lens)
    v[0, 0, 5, 1] = np.nan
    q = _randn(rng, (b, h, d), np.float32)

    def drop5(score, b, h, q_idx, kv_idx):
        return -math.inf if kv_idx == 5 else score

    def hide5(b, h, q_idx, kv_idx):
        return kv_idx != 5

    for kw in (dict(score_mod=drop5), dict(mask_mod=hide5)):
        got = numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=2, return_lse=True,
                                 **kw)
        want = ref.kvcache_decode(q, k, v, lens, **kw)
        assert np.isnan(want[0][..., 1]).all() == ("score_mod" in kw)
        _check(got, want, np.float32)   # NaN where the reference has NaN, close elsewhere


def test_bad_variants_raise_before_any_launch(rng):
    """Wrong arity, aux tensors of the wrong kind, a block mask, aux without a function: each
    raises before the append kernel runs (the caches are untouched)."""
    b, h, hkv, d = 1, 2, 1, 4
    lens = np.array([5])
    k, v = _cache(rng, np.float32, b, hkv, 8, d, lens + 1)
    k0 = k.copy()
    q = _randn(rng, (b, h, d), np.float32)
    kn = _randn(rng, (b, hkv, 1, d), np.float32)
    kw = dict(cache_seqlens=lens, k_new=kn, v_new=kn)
    doc = np.zeros((1, 8), np.int32)
    cases = [
        (TypeError, "score_mod: expected a function of 6", dict(
            score_mod=lambda s, b, h, i, j: s, aux_tensors=(doc,))),
        (TypeError, "mask_mod: expected a function of 4", dict(
            mask_mod=lambda b, h, i: True)),
        (TypeError, "aux_tensors: expected a tuple", dict(
            mask_mod=lambda b, h, i, j, a: True, aux_tensors=doc)),
        (TypeError, r"aux_tensors\[0\]: expected a NumPy or device array", dict(
            mask_mod=lambda b, h, i, j, a: True, aux_tensors=("doc",))),
        (TypeError, r"aux_tensors\[0\]: expected a bool, integer or float", dict(
            mask_mod=lambda b, h, i, j, a: True, aux_tensors=(np.array(["x"]),))),
        (TypeError, "mask_mod: expected <lambda> to return a bool", dict(
            mask_mod=lambda b, h, i, j: 1.5)),
        (ValueError, "aux_tensors: given without", dict(aux_tensors=(doc,))),
        (ValueError, "block_mask: expected None", dict(
            block_mask=create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 1, 6,
                                         BLOCK_SIZE=16))),
    ]
    for err, msg, extra in cases:
        with pytest.raises(err, match=msg):
            numba_flash.decode(q, k, v, **kw, **extra)
        np.testing.assert_array_equal(k, k0)
