"""numba_flash.decode with ``kv_indices`` (issue 47, token-sparse decode): each query token sees
only the key positions its list gives (DeepSeek V3.2's DSA, FA4's ``gather_kv_indices``), and-ed
with the built-in rules.  Against the float64 reference (reference.paged_decode with
``kv_indices``: gather, then dense attention), NaN-poisoned outputs (conftest), stale slots and
spare pages NaN (an unlisted slot must stay unread).  Tolerances: helpers.atol of the compute
dtype, as the dense decode: the gather changes which keys are read, not the arithmetic."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn
from test_decode_kernel import LSE_DTYPE, contiguous_cache, paged_cache

BF16 = ml_dtypes.bfloat16


def random_lists(rng, lens, g, nq, topk, fill=0.7):
    """``[B, g, Nq, topk]`` int32 lists: distinct positions of each sequence (about ``fill`` of
    the slots), the rest -1, in random order (a list need not be sorted)."""
    idx = np.full((len(lens), g, nq, topk), -1, np.int32)
    for b, n in enumerate(lens):
        for j in range(g):
            for i in range(nq):
                m = min(int(n), int(rng.binomial(topk, fill)))
                row = np.full(topk, -1, np.int32)
                row[:m] = rng.choice(int(n), m, replace=False)
                idx[b, j, i] = rng.permutation(row)
    return idx


def tol_dtype(dtype):
    """The tolerance's dtype: bfloat16 computes in float32 and rounds like a short float16."""
    return np.float16 if np.dtype(dtype) == np.dtype(BF16) else np.dtype(dtype).type


def check(o, lse, want_o, want_lse, dtype, scale=1.0):
    assert_close(o.astype(np.float64), want_o, tol_dtype(dtype),
                 scale=8.0 if np.dtype(dtype) == np.dtype(BF16) else scale, name="o")
    lse_t = LSE_DTYPE.get(np.dtype(dtype).type, np.float32)
    assert lse.dtype == lse_t
    assert_close(lse, want_lse, lse_t, name="lse")


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, BF16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("shared", [False, True])
def test_paged_random_lists_with_gqa(rng, dtype, num_splits, shared):
    """Shuffled pages (block size 8), GQA 4 : 2, a list per kv head or one for all heads, three
    query tokens; lists of 10 with about a third -1."""
    b, h, hkv, d, nq, topk = 2, 4, 2, 16, 3, 10
    lens = np.array([int(rng.integers(4, 30)), 37])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 8, np.float32)
    k, v = k.astype(dtype), v.astype(dtype)
    q = randn(rng, (b, h, nq, d), np.float32).astype(dtype)
    idx = random_lists(rng, lens, 1 if shared else hkv, nq, topk)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, kv_indices=idx,
                                num_splits=num_splits, return_lse=True)
    assert o.dtype == np.dtype(dtype) and o.shape == q.shape
    check(o, lse, *ref.paged_decode(q, k, v, lens, table, kv_indices=idx), dtype)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_every_key_listed_is_the_dense_decode(rng, block_size):
    """Dense equivalence: lists of every key in order (-1 past a shorter sequence) give the
    dense decode's result, to the last bit with one split (the same keys in the same order)."""
    b, h, hkv, d = 2, 4, 1, 32
    lens = np.array([23, 40])
    k, v, table = paged_cache(rng, b, hkv, d, lens, block_size, np.float32)
    q = randn(rng, (b, h, d), np.float32)
    idx = np.full((b, 1, 1, 40), -1, np.int32)
    for i, n in enumerate(lens):
        idx[i, 0, 0, :n] = np.arange(n)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, kv_indices=idx,
                                num_splits=1, return_lse=True)
    o_d, lse_d = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                    num_splits=1, return_lse=True)
    np.testing.assert_array_equal(o, o_d)
    np.testing.assert_array_equal(lse, lse_d)
    check(o, lse, *ref.paged_decode(q, k, v, lens, table), np.float32)


def test_causal_window_softcap_alibi_and_a_listed_key_stays_hidden(rng):
    """Four query tokens at the end of each sequence, causal, a left window of 12, softcap and
    ALiBi; every list holds keys past its token's diagonal (they stay hidden)."""
    b, h, hkv, d, nq, nmax = 2, 2, 1, 16, 4, 32
    lens = np.array([30, 17])
    k, v = contiguous_cache(rng, b, hkv, nmax, d, lens, np.float32)
    q = randn(rng, (b, h, nq, d), np.float32)
    idx = random_lists(rng, lens, hkv, nq, 12, fill=0.9)
    for i, n in enumerate(lens):      # token 0 lists n - 1, past its diagonal (n - 4)
        idx[i, :, 0] = np.append(rng.choice(n - 1, 11, replace=False), n - 1)
    slopes = rng.uniform(0.1, 0.5, h).astype(np.float32)
    kw = dict(causal=True, window_size=(12, -1), softcap=5.0, alibi_slopes=slopes)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, kv_indices=idx, return_lse=True,
                                num_splits=2, **kw)
    check(o, lse, *ref.paged_decode(q, k, v, lens, kv_indices=idx, **kw), np.float32)


def test_empty_lists_give_zero_or_the_sink(rng):
    """A token whose list is all -1 (or only hidden keys) gets o = 0 and lse = -inf, or lse =
    the sink; the other tokens are unaffected."""
    b, h, d, nq = 1, 2, 16, 2
    lens = np.array([20])
    k, v, table = paged_cache(rng, b, 1, d, lens, 4, np.float32)
    q = randn(rng, (b, h, nq, d), np.float32)
    idx = np.full((b, 1, nq, 5), -1, np.int32)
    idx[0, 0, 1, :3] = [19, 2, 7]
    for sink in (None, rng.standard_normal(h).astype(np.float32)):
        o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                    kv_indices=idx, learnable_sink=sink, return_lse=True)
        want_o, want_lse = ref.paged_decode(q, k, v, lens, table, kv_indices=idx,
                                            learnable_sink=sink)
        check(o, lse, want_o, want_lse, np.float32)
        assert np.all(o[0, :, 0] == 0)
        assert np.all(lse[0, :, 0] == (-np.inf if sink is None else sink))


def test_mla_latent_cache_576_512(rng):
    """MLA's absorbed decode over a latent cache (v_cache=None, the value its first 512
    columns) with lists per token, on the SIMT kernel (the tensor-core one: below)."""
    b, h, d, d_v = 1, 4, 576, 512
    lens = np.array([21])
    k, _v, table = paged_cache(rng, b, 1, d, lens, 8, np.float32)
    k = k.astype(np.float16)
    q = randn(rng, (b, h, d), np.float16)
    idx = random_lists(rng, lens, 1, 1, 8)
    o, lse = numba_flash.decode(q, k, None, head_dim_v=d_v, cache_seqlens=lens,
                                block_table=table, kv_indices=idx, return_lse=True,
                                softmax_scale=d ** -0.5, kernel="simt")
    want_o, want_lse = ref.paged_decode(q, k, k[..., :d_v], lens, table, kv_indices=idx[:, :, 0],
                                        softmax_scale=d ** -0.5)
    check(o, lse, want_o, want_lse, np.float16)


@pytest.mark.parametrize("num_splits", [2])
def test_mla_tensor_core_gather_576_512(rng, num_splits):
    """MLA's tensor-core decode with lists: tiles of 16 list entries gathered through shuffled
    pages into shared memory, 20 heads (a full and a partial chunk of 16), two query tokens
    (causal: some listed keys hidden), entries -1, two splits (one split, the direct write:
    test_mla_decode.py's left-pad test); against the SIMT kernel's reference at
    float16's bound."""
    b, h, nq, d, d_v = 1, 20, 2, 576, 512
    lens = np.array([45])
    k, _v, table = paged_cache(rng, b, 1, d, lens, 8, np.float32)
    k = k.astype(np.float16)
    q = randn(rng, (b, h, nq, d), np.float16)
    idx = random_lists(rng, lens, 1, nq, 21)
    o, lse = numba_flash.decode(q, k, None, head_dim_v=d_v, cache_seqlens=lens,
                                block_table=table, kv_indices=idx, return_lse=True,
                                causal=True, softmax_scale=d ** -0.5, kernel="mma",
                                num_splits=num_splits)
    want_o, want_lse = ref.paged_decode(q, k, k[..., :d_v], lens, table, kv_indices=idx,
                                        causal=True, softmax_scale=d ** -0.5)
    check(o, lse, want_o, want_lse, np.float16, scale=2.0)


def test_generation_loop_lists_the_new_tokens(rng):
    """append + decode: each step appends a token (k_new) and lists it with a random part of
    the older keys; the lists are checked against the lengths after the append."""
    b, h, hkv, d, nmax = 2, 2, 1, 16, 12
    lens = np.array([3, 6])
    k, v = contiguous_cache(rng, b, hkv, nmax, d, lens, np.float32)
    k[np.isnan(k)] = 0.0
    v[np.isnan(v)] = 0.0
    for _step in range(3):
        q = randn(rng, (b, h, d), np.float32)
        kn = randn(rng, (b, hkv, 1, d), np.float32)
        vn = randn(rng, (b, hkv, 1, d), np.float32)
        idx = random_lists(rng, lens, 1, 1, 4)
        idx[:, 0, 0, 0] = lens        # the token being appended
        want_k, want_v, new_lens = ref.append_kv(k, v, kn, vn, lens)
        want = ref.paged_decode(q, want_k, want_v, new_lens, kv_indices=idx[:, :, 0])
        o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, k_new=kn, v_new=vn,
                                    kv_indices=idx, return_lse=True)
        check(o, lse, *want, np.float32)
        lens = new_lens


def test_bad_lists_are_named_before_any_launch(rng):
    b, h, d = 1, 2, 16
    lens = np.array([5])
    k, v = contiguous_cache(rng, b, 1, 8, d, lens, np.float32, poison=False)
    q = randn(rng, (b, h, d), np.float32)
    kn = randn(rng, (b, 1, 1, d), np.float32)
    k0 = k.copy()
    call = dict(cache_seqlens=lens)
    good = np.array([[[[0, 3, -1]]]], np.int32)
    with pytest.raises(TypeError, match="kv_indices: expected an integer array"):
        numba_flash.decode(q, k, v, kv_indices=good.astype(np.float32), **call)
    with pytest.raises(ValueError, match="kv_indices: expected a 4-D array"):
        numba_flash.decode(q, k, v, kv_indices=good[:, :, :, :, None], **call)
    with pytest.raises(ValueError, match=r"kv_indices: expected shape .* = \[1, 1, 1, topk\]"):
        numba_flash.decode(q, k, v, kv_indices=np.zeros((1, 1, 2, 3), np.int32), **call)
    with pytest.raises(ValueError, match=r"kv_indices: expected entries in \[-1, cache_seqlens"):
        numba_flash.decode(q, k, v, kv_indices=good + 5, **call)      # 5 >= L = 5
    with pytest.raises(ValueError, match=r"kv_indices: expected entries in .* got -2"):
        numba_flash.decode(q, k, v, kv_indices=good - 2, **call)
    with pytest.raises(ValueError, match="kv_indices: expected each key at most once"):
        numba_flash.decode(q, k, v, kv_indices=np.array([[[[1, 4, 1]]]], np.int32), **call)
    with pytest.raises(ValueError, match=r"kv_indices: expected entries in .* got 6"):
        numba_flash.decode(q, k, v, k_new=kn, v_new=kn, kv_indices=good + 3, **call)  # L' = 6
    np.testing.assert_array_equal(k, k0)        # nothing was appended


def test_unvalidated_bad_entry_is_a_nan_row_never_read(rng):
    """validate=False: an entry past the cache makes its token's rows NaN (its page is never
    looked up); the other token of the call is exact."""
    b, h, d, nq = 1, 2, 16, 2
    lens = np.array([9])
    k, v, table = paged_cache(rng, b, 1, d, lens, 4, np.float32)
    q = randn(rng, (b, h, nq, d), np.float32)
    idx = np.array([[[[0, 5, 2**40], [1, 8, -1]]]], np.int64)   # past int32 too
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, kv_indices=idx,
                                validate=False, return_lse=True)
    assert np.isnan(o[0, :, 0]).all() and np.isnan(lse[0, :, 0]).all()
    want_o, want_lse = ref.paged_decode(q[:, :, 1:], k, v, lens, table, kv_indices=idx[:, :, 1:])
    check(o[:, :, 1:], lse[:, :, 1:], want_o, want_lse, np.float32)


def test_e4m3_cache_with_lists_each_lane_on_its_own(rng):
    """An e4m3 cache (FlashMLA's sparse decode reads fp8) at d = 16: one lane a key group, so a
    warp's key groups outnumber its lanes and each lane resolves its own keys (gather_keys, not
    share_keys); against the dequantised cache's sparse reference."""
    b, h, hkv, d = 2, 4, 2, 16
    lens = np.array([13, 30])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 8, np.float32)
    k8, v8 = k.astype(ml_dtypes.float8_e4m3fn), v.astype(ml_dtypes.float8_e4m3fn)
    kd = rng.uniform(0.5, 2.0, (b, hkv)).astype(np.float32)
    vd = rng.uniform(0.5, 2.0, (b, hkv)).astype(np.float32)
    q = randn(rng, (b, h, d), np.float16)
    idx = random_lists(rng, lens, hkv, 1, 9)
    o, lse = numba_flash.decode(q, k8, v8, cache_seqlens=lens, block_table=table, kv_indices=idx,
                                k_descale=kd, v_descale=vd, return_lse=True)
    want = ref.paged_decode(q, _dequantised(k8, kd, table, lens),
                            _dequantised(v8, vd, table, lens), lens, table,
                            kv_indices=idx[:, :, 0])
    check(o, lse, *want, np.float16)


def _dequantised(cache, descale, table, lens):
    """A paged e4m3 cache times each sequence's descale (every page serves one sequence)."""
    out = cache.astype(np.float64)
    for b, n in enumerate(lens):
        for page in table[b, :-(-int(n) // cache.shape[2])]:
            out[page] *= descale[b][:, None, None]
    return out


def test_batch_invariant(rng):
    """A sequence's token-sparse decode is bitwise the same alone and beside others (its splits
    come from its list's length, never from the batch)."""
    b, h, d = 3, 2, 16
    lens = np.array([40, 9, 25])
    k, v, table = paged_cache(rng, b, 1, d, lens, 8, np.float32)
    q = randn(rng, (b, h, d), np.float32)
    idx = random_lists(rng, lens, 1, 1, 20)
    o_all, lse_all = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                        kv_indices=idx, return_lse=True)
    o_one, lse_one = numba_flash.decode(q[:1], k, v, cache_seqlens=lens[:1],
                                        block_table=table[:1], kv_indices=idx[:1],
                                        return_lse=True)
    np.testing.assert_array_equal(o_all[:1], o_one)
    np.testing.assert_array_equal(lse_all[:1], lse_one)


def test_mla_tensor_core_gather_bfloat16_and_a_bad_entry(rng):
    """MLA's tensor-core gather in bfloat16, and validate=False: token 1's list holds a key past
    the sequence (never read: its rows NaN), token 0's rows exact."""
    b, h, nq, d, d_v = 1, 16, 2, 576, 512
    lens = np.array([30])
    k, _v, table = paged_cache(rng, b, 1, d, lens, 8, np.float32)
    k = k.astype(BF16)
    q = randn(rng, (b, h, nq, d), np.float32).astype(BF16)
    idx = random_lists(rng, lens, 1, nq, 10)
    idx[0, 0, 1, 0] = 31                       # past L = 30
    o, lse = numba_flash.decode(q, k, None, head_dim_v=d_v, cache_seqlens=lens,
                                block_table=table, kv_indices=idx, return_lse=True,
                                softmax_scale=d ** -0.5, kernel="mma", validate=False)
    assert np.isnan(o[0, :, 1].astype(np.float32)).all() and np.isnan(lse[0, :, 1]).all()
    want_o, want_lse = ref.paged_decode(q[:, :, :1], k, k[..., :d_v], lens, table,
                                        kv_indices=idx[:, :, :1], softmax_scale=d ** -0.5)
    check(o[:, :, :1], lse[:, :, :1], want_o, want_lse, BF16)
