"""The tensor-core decode with a value cache of its own (numba_flash/kernels/decode/mla.py,
``OWN_V``): GQA decode on ``mma.sync`` (``decode(..., kernel="mma")``) and the token-sparse
forward's tensor-core gather (``forward(..., kv_indices=, kernel="mma" or "auto")``: tiles of
16 listed K and V rows copied by ``cp.async`` into shared memory, each through its page).

Against the float64 reference, outputs NaN-poisoned (conftest), at the decode tests' bounds
(helpers.atol; bfloat16 at test_decode_sparse.py's scaled bound).  Head dims 64 / 128 keep the
simulator quick (the code is the same at 128 / 128, the compile tier's build).
"""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16

import numba_flash
from numba_flash import reference as ref
from helpers import randn
from test_decode_kernel import paged_cache
from test_decode_sparse import check, random_lists


@pytest.mark.parametrize("dtype, h, hkv, nq, num_splits, sink", [
    (np.float16, 20, 1, 2, 1, False),    # two chunks of heads (16 + 4), two causal tokens
    (bfloat16, 4, 2, 1, 3, True),        # GQA 2 : 1, three merged splits and a sink
])
def test_gqa_decode_on_tensor_cores(rng, dtype, h, hkv, nq, num_splits, sink):
    """A dense paged decode (shuffled pages of 8, stale slots NaN) with K and V caches of their
    own and d_v != d: the same results as the reference at the kernels' bound."""
    b, d, d_v = 2, 64, 128
    lens = np.array([45, 6])
    k, _, table = paged_cache(rng, b, hkv, d, lens, 8, np.float32)
    v = randn(rng, k.shape[:3] + (d_v,), np.float32)
    v[np.isnan(k[..., 0])] = np.nan              # the same stale slots
    k, v = k.astype(dtype), v.astype(dtype)
    q = randn(rng, (b, h, nq, d), np.float32).astype(dtype)
    learnable_sink = rng.standard_normal(h).astype(np.float32) if sink else None
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                num_splits=num_splits, learnable_sink=learnable_sink,
                                return_lse=True, kernel="mma")
    want_o, want_lse = ref.paged_decode(q, k, v, lens, table, causal=True,
                                        learnable_sink=learnable_sink)
    assert o.shape == (b, h, nq, d_v) and o.dtype == dtype
    check(o, lse, want_o, want_lse, dtype)


def test_append_then_decode_on_tensor_cores(rng):
    """k_new / v_new appended into the caller's contiguous caches, then the tensor-core decode:
    the caches written back (the append op's documented write), the result the reference's."""
    b, h, hkv, d, nmax = 2, 8, 1, 64, 24
    lens = np.array([5, 11])
    k = randn(rng, (b, hkv, nmax, d), np.float16)
    v = randn(rng, (b, hkv, nmax, d), np.float16)
    kn = randn(rng, (b, hkv, 3, d), np.float16)
    vn = randn(rng, (b, hkv, 3, d), np.float16)
    q = randn(rng, (b, h, 3, d), np.float16)
    want_k, want_v, new_lens = ref.append_kv(k, v, kn, vn, lens)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, k_new=kn, v_new=vn, causal=True,
                                return_lse=True, kernel="mma")
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    want_o, want_lse = ref.paged_decode(q, want_k, want_v, new_lens, causal=True)
    check(o, lse, want_o, want_lse, np.float16)


def sparse_inputs(rng, dtype, b=1, h=16, hkv=2, nq=3, nk=48, d=64, d_v=128, topk=37):
    q = randn(rng, (b, h, nq, d), np.float32).astype(dtype)
    k = randn(rng, (b, hkv, nk, d), np.float32).astype(dtype)
    v = randn(rng, (b, hkv, nk, d_v), np.float32).astype(dtype)
    idx = random_lists(rng, np.full(b, nk), hkv, nq, topk)
    return q, k, v, idx


@pytest.mark.parametrize("dtype, variant", [(np.float16, dict(causal=True)),
                                            (np.float16, dict(window_size=(12, 3))),
                                            (bfloat16, dict(causal=True, sink=True))])
def test_sparse_forward_gathers_on_tensor_cores(rng, dtype, variant):
    """forward(kv_indices=, kernel="mma"): GQA 16 : 2 (a list per kv head), d_v != d, lists of
    37 with -1 entries (two tiles of 32), the causal or window mask hiding some listed keys,
    a sink; against reference.sparse_attention."""
    q, k, v, idx = sparse_inputs(rng, dtype)
    kw = dict(variant)
    if kw.pop("sink", False):
        kw["learnable_sink"] = rng.standard_normal(q.shape[1]).astype(np.float32)
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, return_lse=True, kernel="mma", **kw)
    want_o, want_lse = ref.sparse_attention(q, k, v, idx, **kw)
    assert o.shape == q.shape[:3] + (v.shape[3],) and o.dtype == dtype
    check(o, lse, want_o, want_lse, dtype)


def test_auto_takes_tensor_cores_for_full_tiles(rng):
    """kernel="auto": 8 heads of one kv head run the tensor-core gather (bitwise the "mma" call),
    2 heads a kv head the SIMT kernel (bitwise the "simt" call); both at the reference."""
    q, k, v, idx = sparse_inputs(rng, np.float16, h=8, hkv=1, nq=2, d_v=64)
    auto = numba_flash.forward(q, k, v, kv_indices=idx, causal=True)
    np.testing.assert_array_equal(auto, numba_flash.forward(q, k, v, kv_indices=idx,
                                                            causal=True, kernel="mma"))
    want, _ = ref.sparse_attention(q, k, v, idx, causal=True)
    check(auto, np.zeros(1, np.float32), want, np.zeros(1), np.float16)
    q, k, v, idx = sparse_inputs(rng, np.float16, h=4, hkv=2, nq=2, d_v=64)
    auto = numba_flash.forward(q, k, v, kv_indices=idx, causal=True)
    np.testing.assert_array_equal(auto, numba_flash.forward(q, k, v, kv_indices=idx,
                                                            causal=True, kernel="simt"))


def test_dense_lists_and_empty_lists(rng):
    """Every key listed: the dense forward's result (both at float16's bound of the float64
    dense reference); a token whose list is all -1: o = 0, lse = -inf."""
    b, h, nq, nk, d = 1, 16, 3, 24, 64
    q = randn(rng, (b, h, nq, d), np.float16)
    k = randn(rng, (b, 1, nk, d), np.float16)
    v = randn(rng, (b, 1, nk, d), np.float16)
    idx = np.tile(rng.permutation(nk).astype(np.int32), (b, 1, nq, 1))
    idx[0, 0, 1] = -1
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, return_lse=True, kernel="mma")
    want_o, want_lse = ref.attention(q, k, v)
    check(o[:, :, ::2], lse[:, :, ::2], want_o[:, :, ::2], want_lse[:, :, ::2], np.float16)
    assert np.all(o[:, :, 1] == 0) and np.all(lse[:, :, 1] == -np.inf)


def test_varlen_lists_on_tensor_cores(rng):
    """forward_varlen(kv_indices=) with 8 heads a kv head: the packed k / v read in place as
    one-key pages by the tensor-core gather; ragged sequences (one empty of queries)."""
    h, hkv, d = 8, 1, 64
    len_q, len_k = np.array([3, 0, 2]), np.array([10, 4, 17])
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(len_k)]).astype(np.int32)
    q = randn(rng, (int(cu_q[-1]), h, d), np.float16)
    k = randn(rng, (int(cu_k[-1]), hkv, d), np.float16)
    v = randn(rng, (int(cu_k[-1]), hkv, d), np.float16)
    idx = np.full((int(cu_q[-1]), hkv, 6), -1, np.int32)
    for s in range(3):
        for r in range(cu_q[s], cu_q[s + 1]):
            m = min(6, int(len_k[s]))
            idx[r, 0, :m] = rng.choice(int(len_k[s]), m, replace=False)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=17,
                                        causal=True, kv_indices=idx, return_lse=True)
    for s in (0, 2):
        rows = slice(cu_q[s], cu_q[s + 1])
        keys = slice(cu_k[s], cu_k[s + 1])
        want_o, want_lse = ref.sparse_attention(
            q[rows].transpose(1, 0, 2)[None], k[keys].transpose(1, 0, 2)[None],
            v[keys].transpose(1, 0, 2)[None], idx[rows].transpose(1, 0, 2)[None], causal=True)
        check(o[rows].transpose(1, 0, 2)[None], lse[:, rows][None], want_o, want_lse,
              np.float16)


def test_unvalidated_bad_entry_is_never_read(rng):
    """decode(validate=False) on the tensor-core gather: an entry past the cache makes only its
    token's rows NaN (never read); the other token's rows are the reference's."""
    b, h, nq, d, nmax = 1, 16, 2, 64, 16
    lens = np.array([12])
    k = randn(rng, (b, 1, nmax, d), np.float16)
    v = randn(rng, (b, 1, nmax, d), np.float16)
    q = randn(rng, (b, h, nq, d), np.float16)
    idx = random_lists(rng, lens, 1, nq, 5)
    idx[0, 0, 1, 2] = 10 ** 6
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, kv_indices=idx, return_lse=True,
                                kernel="mma", validate=False)
    assert np.all(np.isnan(o[:, :, 1].astype(np.float64))) and np.all(np.isnan(lse[:, :, 1]))
    want_o, want_lse = ref.paged_decode(q[:, :, :1], k, v, lens, kv_indices=idx[:, :, :1])
    check(o[:, :, :1], lse[:, :, :1], want_o, want_lse, np.float16)


@pytest.mark.parametrize("kw, words", [
    (dict(dtype=np.float32), "float16 or bfloat16"),
    (dict(d=48), "multiples of 64"),
    (dict(softcap=5.0), "no softcap"),
])
def test_mma_refusals_are_named(rng, kw, words):
    """kernel="mma" where the tensor-core gather cannot run: a ValueError naming kernel and why;
    kernel="warp" is not a kernel of the token-sparse forward."""
    d = kw.pop("d", 64)
    dtype = kw.pop("dtype", np.float16)
    q, k, v, idx = sparse_inputs(rng, dtype, d=d, d_v=d)
    with pytest.raises(ValueError, match="^kernel: 'mma'") as info:
        numba_flash.forward(q, k, v, kv_indices=idx, kernel="mma", **kw)
    assert words in str(info.value)
    with pytest.raises(ValueError, match="^kernel: expected one of"):
        numba_flash.forward(q, k, v, kv_indices=idx, kernel="warp")
