"""Kernel tier: ``numba_flash.decode`` (split-KV + combine) against the float64 reference.

Shapes are tiny: in the simulator every CUDA thread is a Python thread.  The simulator tiles are
BLOCK_M = 4 rows, BLOCK_N = 4 tokens, 16 tokens per split (``num_splits=None``), so lengths up to
~40 already exercise several tiles, several splits, partial tiles and row chunks.
"""

from __future__ import annotations


import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn

# Measured max abs errors over 30 random cases per dtype (B <= 3, L <= 40, d <= 16, Nq <= 2,
# block sizes 1/3/8/16, splits 1/2/5/None, causal or not; unit-normal inputs): float16 o 4.2e-4
# (the final float16 rounding), lse 5.8e-7; float32 o 3.4e-7, lse 3.4e-7; float64 o 6.7e-16,
# lse 8.9e-16.  helpers.atol (2e-3 / 2e-5 / 1e-12) is >= 4x those; lse is float32 for float16
# inputs and is held to the float32 bound.
LSE_DTYPE = {np.float16: np.float32, np.float32: np.float32, np.float64: np.float64}



def paged_cache(rng, b, hkv, d, lens, block_size, dtype, extra_blocks=3, poison=True):
    """A paged cache with a random permuted block table; stale slots and spare blocks are NaN."""
    need = [-(-int(n) // block_size) for n in lens]
    max_blocks = max(need) + 1
    num_blocks = sum(need) + extra_blocks
    k = randn(rng, (num_blocks, hkv, block_size, d), dtype)
    v = randn(rng, (num_blocks, hkv, block_size, d), dtype)
    perm = rng.permutation(num_blocks)
    table = np.full((b, max_blocks), -1, np.int32)
    used = 0
    for i, n_blk in enumerate(need):
        table[i, :n_blk] = perm[used:used + n_blk]
        used += n_blk
    if poison:
        owned = np.zeros((num_blocks, block_size), bool)
        for i, n in enumerate(lens):
            t = np.arange(int(n))
            owned[table[i, t // block_size], t % block_size] = True
        k[np.broadcast_to(~owned[:, None, :], k.shape[:3])] = np.nan
        v[np.broadcast_to(~owned[:, None, :], v.shape[:3])] = np.nan
    return k, v, table


def contiguous_cache(rng, b, hkv, nmax, d, lens, dtype, poison=True):
    k = randn(rng, (b, hkv, nmax, d), dtype)
    v = randn(rng, (b, hkv, nmax, d), dtype)
    if poison:
        for i, n in enumerate(lens):
            k[i, :, int(n):] = np.nan
            v[i, :, int(n):] = np.nan
    return k, v


def some_cache(rng, paged, b, hkv, d, lens, dtype, block_size, nmax):
    """``(k, v, table)``: :func:`paged_cache` of ``block_size``-slot blocks, or (``paged``
    False) :func:`contiguous_cache` of ``nmax`` slots with ``table = None``."""
    if paged:
        return paged_cache(rng, b, hkv, d, lens, block_size, dtype)
    return (*contiguous_cache(rng, b, hkv, nmax, d, lens, dtype), None)


def check(o, lse, want_o, want_lse, dtype):
    assert_close(o, want_o, dtype, name="o")
    assert lse.dtype == LSE_DTYPE[np.dtype(dtype).type]
    assert_close(lse, want_lse, LSE_DTYPE[np.dtype(dtype).type], name="lse")


@pytest.mark.parametrize("block_size", [1, 3, 8, 16])
@pytest.mark.parametrize("num_splits", [1, 2, 5, None, 40])
def test_paged_matches_reference(rng, block_size, num_splits):
    b, h, hkv, d = 2, 4, 2, 8
    lens = np.array([int(rng.integers(1, 30)), 33])
    k, v, table = paged_cache(rng, b, hkv, d, lens, block_size, np.float32)
    q = randn(rng, (b, h, d), np.float32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                num_splits=num_splits, return_lse=True)
    assert o.shape == q.shape and o.dtype == np.float32 and lse.shape == (b, h)
    check(o, lse, *ref.paged_decode(q, k, v, lens, table), np.float32)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("hkv", [1, 2, 4])  # MQA, GQA (group 2), MHA
def test_dtypes_and_gqa(rng, dtype, hkv):
    b, h, d = 2, 4, 5  # d = 5 pads to 8: padded lanes must not leak
    lens = np.array([1, 21])  # a length-1 sequence beside a long one
    k, v, table = paged_cache(rng, b, hkv, d, lens, 3, dtype)
    q = randn(rng, (b, h, d), dtype)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, return_lse=True)
    assert o.dtype == dtype
    check(o, lse, *ref.paged_decode(q, k, v, lens, table), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_contiguous_matches_reference(rng, num_splits):
    b, h, hkv, d, nmax = 3, 2, 1, 8, 24
    lens = np.array([24, 1, 17])
    k, v = contiguous_cache(rng, b, hkv, nmax, d, lens, np.float32)
    q = randn(rng, (b, h, d), np.float32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits,
                                return_lse=True)
    check(o, lse, *ref.paged_decode(q, k, v, lens), np.float32)


def test_equals_gathered_attention(rng):
    """Paged decode == plain attention on the gathered cache, and == the last row of causal
    attention over the whole sequence (the token being decoded is the cache's last key)."""
    b, h, hkv, d = 2, 4, 2, 8
    lens = np.array([9, 19])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 4, np.float64)
    q = randn(rng, (b, h, d), np.float64)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, return_lse=True)
    for i, n in enumerate(lens):
        kb = ref.gather_paged(k, table, n, i)[None]
        vb = ref.gather_paged(v, table, n, i)[None]
        want_o, want_lse = ref.attention(q[i:i + 1, :, None], kb, vb)
        assert_close(o[i], want_o[0, :, 0], np.float64)
        assert_close(lse[i], want_lse[0, :, 0], np.float64)
        # the decoded token's query as the last row of a causal prefill over n tokens
        q_full = randn(rng, (1, h, int(n), d), np.float64)
        q_full[0, :, -1] = q[i]
        full_o, full_lse = ref.attention(q_full, kb, vb, causal=True)
        assert_close(o[i], full_o[0, :, -1], np.float64)
        assert_close(lse[i], full_lse[0, :, -1], np.float64)


def test_decode_equals_last_rows_of_the_forward_kernel(rng):
    """Kernel against kernel: decoding the last Nq tokens against the whole cache gives the last
    Nq rows of the causal forward kernel over the sequence (both checked against float64)."""
    h, hkv, n, d, nq = 4, 2, 21, 8, 3
    q = randn(rng, (1, h, n, d), np.float64)
    k = randn(rng, (1, hkv, n, d), np.float64)
    v = randn(rng, (1, hkv, n, d), np.float64)
    o_fwd, lse_fwd = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    o_dec, lse_dec = numba_flash.decode(q[:, :, -nq:], k, v, cache_seqlens=np.array([n]),
                                        causal=True, return_lse=True)
    assert_close(o_dec, o_fwd[:, :, -nq:], np.float64)
    assert_close(lse_dec, lse_fwd[:, :, -nq:], np.float64)
    o1 = numba_flash.decode(q[:, :, -1], k, v, cache_seqlens=np.array([n]))
    assert_close(o1, o_fwd[:, :, -1], np.float64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("paged", [False, True])
def test_multi_token_queries(rng, causal, paged):
    """Nq > 1 (chunked prefill / speculative decoding), bottom-right causal; Nq > L for the
    short sequence, whose first rows see no key (o = 0, lse = -inf)."""
    b, h, hkv, nq, d = 2, 4, 2, 3, 8
    lens = np.array([2, 26])
    k, v, table = some_cache(rng, paged, b, hkv, d, lens, np.float32, 5, 26)
    q = randn(rng, (b, h, nq, d), np.float32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, causal=causal,
                                num_splits=None, return_lse=True)
    assert o.shape == q.shape and lse.shape == (b, h, nq)
    check(o, lse, *ref.paged_decode(q, k, v, lens, table, causal=causal), np.float32)


def test_causal_single_token_is_noncausal(rng):
    b, h, d = 2, 2, 8
    lens = np.array([7, 12])
    k, v = contiguous_cache(rng, b, 1, 12, d, lens, np.float32)
    q = randn(rng, (b, h, d), np.float32)
    np.testing.assert_array_equal(
        numba_flash.decode(q, k, v, cache_seqlens=lens, causal=True),
        numba_flash.decode(q, k, v, cache_seqlens=lens))


@pytest.mark.parametrize("num_splits", [None, 3])
def test_batch_invariance_bitwise(rng, num_splits):
    """One sequence's result is bitwise the same alone and beside longer / shorter ones."""
    h, hkv, d, bs = 4, 2, 8, 4
    lens = np.array([13, 40, 1])
    k, v, table = paged_cache(rng, 3, hkv, d, lens, bs, np.float32)
    q = randn(rng, (3, h, d), np.float32)
    o_all, lse_all = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                        num_splits=num_splits, return_lse=True)
    for i in (0, 2):
        o_one, lse_one = numba_flash.decode(q[i:i + 1], k, v, cache_seqlens=lens[i:i + 1],
                                            block_table=table[i:i + 1], num_splits=num_splits,
                                            return_lse=True)
        np.testing.assert_array_equal(o_one[0], o_all[i])
        np.testing.assert_array_equal(lse_one[0], lse_all[i])


def test_nan_in_stale_slots_and_foreign_blocks_is_ignored(rng):
    """NaN everywhere a sequence does not own: the result is finite and matches the reference
    (which gathers only owned slots); and +-inf garbage there changes nothing either."""
    b, h, hkv, d, bs = 2, 2, 1, 8, 3
    lens = np.array([4, 11])
    k, v, table = paged_cache(rng, b, hkv, d, lens, bs, np.float32, extra_blocks=4)
    q = randn(rng, (b, h, d), np.float32)
    o1 = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, num_splits=2)
    assert np.isfinite(o1).all()
    assert_close(o1, ref.paged_decode(q, k, v, lens, table)[0], np.float32)
    k2, v2 = k.copy(), v.copy()
    k2[np.isnan(k2)] = np.inf
    v2[np.isnan(v2)] = -np.inf
    o2 = numba_flash.decode(q, k2, v2, cache_seqlens=lens, block_table=table, num_splits=2)
    np.testing.assert_array_equal(o1, o2)


def test_inputs_not_modified_and_scale(rng):
    b, h, d = 1, 2, 8
    lens = np.array([10])
    k, v, table = paged_cache(rng, b, 1, d, lens, 4, np.float32, poison=False)
    q = randn(rng, (b, h, 2, d), np.float32)
    before = [x.copy() for x in (q, k, v, table, lens)]
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                softmax_scale=0.3, return_lse=True)
    for x, y in zip((q, k, v, table, lens), before):
        np.testing.assert_array_equal(x, y)
    check(o, lse, *ref.paged_decode(q, k, v, lens, table, causal=True, softmax_scale=0.3),
          np.float32)


def _bad_case(**over):
    rng = np.random.default_rng(0)
    args = dict(q=randn(rng, (2, 4, 8)), k=randn(rng, (6, 2, 4, 8)), v=randn(rng, (6, 2, 4, 8)),
                cache_seqlens=np.array([5, 8]), block_table=np.array([[0, 1, -1], [2, 3, -1]]))
    args.update(over)
    return args


@pytest.mark.parametrize("over, exc, msg", [
    (dict(block_table=np.array([[0, 6, -1], [2, 3, -1]])), ValueError,
     r"block_table: .*\[0, 6\).* got 6 at \[0, 1\]"),
    (dict(block_table=np.array([[0, -1, 5], [2, 3, -1]])), ValueError,
     r"block_table: .* got -1 at \[0, 1\]"),
    (dict(cache_seqlens=np.array([5, 13])), ValueError, "cache_seqlens: entry 1 = 13 needs 4"),
    (dict(cache_seqlens=np.array([-1, 8])), ValueError,
     "cache_seqlens: expected every entry >= 0, got -1 at index 0"),
    (dict(cache_seqlens=np.array([5.0, 8.0])), TypeError, "cache_seqlens: expected dtype"),
    (dict(cache_seqlens=np.array([5, 8, 1])), ValueError, r"cache_seqlens: expected shape \(2,\)"),
    (dict(block_table=np.array([[0.0, 1.0]])), TypeError, "block_table: expected dtype"),
    (dict(block_table=np.array([[0, 1, 2]])), ValueError, "block_table: expected 2 rows"),
    (dict(k=randn(np.random.default_rng(0), (6, 2, 4, 8), np.float64)), TypeError,
     "k_cache: expected dtype float32"),
    (dict(v=randn(np.random.default_rng(0), (6, 2, 3, 8))), ValueError,
     r"v_cache: expected shape \(6, 2, 4, 'd_v'\)"),
    (dict(k=randn(np.random.default_rng(0), (6, 3, 4, 8)),
          v=randn(np.random.default_rng(0), (6, 3, 4, 8))),
     ValueError, "k_cache: expected a number of kv heads that divides"),
    (dict(q=randn(np.random.default_rng(0), (2, 4, 6))), ValueError,
     "k_cache: expected head dim 6"),
])
def test_rejects_bad_input(over, exc, msg):
    a = _bad_case(**over)
    with pytest.raises(exc, match=msg):
        numba_flash.decode(a["q"], a["k"], a["v"], cache_seqlens=a["cache_seqlens"],
                           block_table=a["block_table"])


def test_rejects_bad_contiguous_and_options():
    rng = np.random.default_rng(0)
    q, k = randn(rng, (2, 2, 8)), randn(rng, (2, 1, 6, 8))
    with pytest.raises(ValueError, match="cache_seqlens: expected every entry <= Nmax = 6"):
        numba_flash.decode(q, k, k, cache_seqlens=np.array([3, 7]))
    with pytest.raises(ValueError, match="k_cache: expected batch size 3"):
        numba_flash.decode(randn(rng, (3, 2, 8)), k, k, cache_seqlens=np.array([3, 4, 5]))
    with pytest.raises(ValueError, match="num_splits: expected an int >= 1"):
        numba_flash.decode(q, k, k, cache_seqlens=np.array([3, 4]), num_splits=0)
    with pytest.raises(TypeError, match=r"num_splits: expected an int >= 1 \(at most 2\*\*31 - 1\) "
                                        r"or None, got float"):
        numba_flash.decode(q, k, k, cache_seqlens=np.array([3, 4]), num_splits=2.0)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        numba_flash.decode(q, k, k, cache_seqlens=np.array([3, 4]), causal=1)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_empty_cache_is_accepted(rng, paged, num_splits):
    """``cache_seqlens = 0`` (an empty cache before the first token; flash-attn accepts it) is
    valid under validation: its rows get o = 0, lse = -inf, the other sequences are unaffected
    (they match the reference).  Before: ValueError "expected every entry >= 1"."""
    b, h, hkv, d = 3, 4, 2, 8
    lens = np.array([0, 13, 0])
    k, v, table = some_cache(rng, paged, b, hkv, d, lens, np.float32, 4, 16)
    q = randn(rng, (b, h, 2, d), np.float32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                num_splits=num_splits, return_lse=True)
    assert (o[[0, 2]] == 0).all() and (lse[[0, 2]] == -np.inf).all()
    check(o, lse, *ref.paged_decode(q, k, v, lens, table, causal=True), np.float32)
