"""numba_flash.forward with ``kv_indices`` (issue 47, token-sparse prefill): the gathering decode
kernel over k/v as a contiguous cache, against reference.sparse_attention in float64 on fresh
inputs, NaN-poisoned outputs (conftest); keys no list names are NaN, so a read of an unlisted
key fails.  Tolerances: helpers.atol of the compute dtype (the decode kernel's arithmetic)."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn
from test_decode_sparse import check


def lists(rng, b, g, nq, nk, topk, fill=0.8):
    """Distinct random key positions per list (about ``fill`` of them), the rest -1."""
    idx = np.full((b, g, nq, topk), -1, np.int32)
    for i in np.ndindex(b, g, nq):
        m = int(rng.binomial(topk, fill))
        idx[i][:m] = rng.choice(nk, m, replace=False)
    return idx


def unlisted_nan(k, v, idx, h_kv):
    """k and v with every key no list of its sequence names set to NaN."""
    k, v = k.copy(), v.copy()
    for b in range(k.shape[0]):
        named = set(int(j) for j in idx[b].ravel() if j >= 0)
        dead = [j for j in range(k.shape[2]) if j not in named]
        k[b, :, dead] = np.nan
        v[b, :, dead] = np.nan
    return k, v


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shared", [False, True])
def test_random_lists_ragged_gqa(rng, dtype, causal, shared):
    b, h, hkv, nq, nk, d, topk = 2, 4, 2, 7, 19, 16, 6
    q = randn(rng, (b, h, nq, d), dtype)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d), dtype)
    idx = lists(rng, b, 1 if shared else hkv, nq, nk, topk)
    k, v = unlisted_nan(k, v, idx, hkv)
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, causal=causal, return_lse=True)
    assert o.shape == q.shape and o.dtype == np.dtype(dtype)
    check(o, lse, *ref.sparse_attention(q, k, v, idx, causal=causal), dtype)


def test_window_softcap_alibi_sink_and_own_value_dim(rng):
    b, h, hkv, nq, nk, d, d_v, topk = 1, 2, 1, 6, 21, 32, 16, 9
    q = randn(rng, (b, h, nq, d), np.float32)
    k = randn(rng, (b, hkv, nk, d), np.float32)
    v = randn(rng, (b, hkv, nk, d_v), np.float32)
    idx = lists(rng, b, hkv, nq, nk, topk)
    sink = rng.standard_normal(h).astype(np.float32)
    slopes = rng.uniform(0.1, 0.4, h).astype(np.float32)
    kw = dict(window_size=(8, 2), softcap=4.0, alibi_slopes=slopes, learnable_sink=sink)
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, return_lse=True, **kw)
    assert o.shape == (b, h, nq, d_v)
    check(o, lse, *ref.sparse_attention(q, k, v, idx, **kw), np.float32)


def test_every_key_listed_is_the_dense_forward(rng):
    b, h, nq, nk, d = 2, 2, 5, 12, 16
    q = randn(rng, (b, h, nq, d), np.float32)
    k = randn(rng, (b, 1, nk, d), np.float32)
    v = randn(rng, (b, 1, nk, d), np.float32)
    idx = np.broadcast_to(np.arange(nk, dtype=np.int32), (b, 1, nq, nk)).copy()
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, causal=True, return_lse=True)
    want_o, want_lse = ref.attention(q, k, v, causal=True)
    check(o, lse, want_o, want_lse, np.float32)
    o_dense = numba_flash.forward(q, k, v, causal=True)
    assert_close(o, o_dense.astype(np.float64), np.float32, name="o vs the dense kernel")


def test_dense_only_options_and_bad_lists_are_named(rng):
    q = randn(rng, (1, 2, 3, 16), np.float32)
    k = randn(rng, (1, 1, 8, 16), np.float32)
    idx = np.zeros((1, 1, 3, 2), np.int32)
    idx[..., 1] = -1
    for kw, name in [(dict(dropout_p=0.1), "dropout_p"), (dict(block_m=16), "block_m"),
                     (dict(kernel="wgmma"), "kernel"),
                     (dict(mask_mod=lambda b, h, qi, ki: True), "mask_mod")]:
        with pytest.raises(ValueError, match=f"^{name}: expected .* with kv_indices"):
            numba_flash.forward(q, k, k, kv_indices=idx, **kw)
    with pytest.raises(ValueError, match=r"kv_indices: expected entries in \[-1"):
        numba_flash.forward(q, k, k, kv_indices=idx + 8)
    with pytest.raises(TypeError, match="kv_indices: expected an integer array"):
        numba_flash.forward(q, k, k, kv_indices=idx.astype(np.float64))
    with pytest.raises(TypeError, match="q: expected dtype"):
        numba_flash.forward(q.astype(np.int32), k, k, kv_indices=idx)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_from_the_sparse_forward(rng, causal, deterministic):
    """numba_flash.backward(kv_indices=): the gradients of the token-sparse forward (the
    gathering kernel; deterministic: the dense kernels with the lists as their mask), with
    GQA, a sink and rows whose list is empty, against reference.sparse_attention_backward."""
    b, h, hkv, nq, nk, d, topk = 2, 4, 2, 5, 14, 16, 6
    q = randn(rng, (b, h, nq, d), np.float64)
    k = randn(rng, (b, hkv, nk, d), np.float64)
    v = randn(rng, (b, hkv, nk, d), np.float64)
    do = randn(rng, (b, h, nq, d), np.float64)
    idx = lists(rng, b, hkv, nq, nk, topk)
    idx[0, 1, 2] = -1                 # heads 2, 3 of token 2: no key
    sink = rng.standard_normal(h).astype(np.float32)
    kw = dict(causal=causal, learnable_sink=sink)
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, return_lse=True, **kw)
    got = numba_flash.backward(do, q, k, v, o, lse, kv_indices=idx, deterministic=deterministic,
                               **kw)
    want = ref.sparse_attention_backward(do, q, k, v, idx, **kw)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert g.shape == np.shape(w)
        assert_close(g, w, np.float64 if name != "dsink" else np.float32, name=name)
    with pytest.raises(ValueError, match="mask_mod: expected None with kv_indices"):
        numba_flash.backward(do, q, k, v, o, lse, kv_indices=idx,
                             mask_mod=lambda b, h, i, j: True)
    with pytest.raises(ValueError, match="kv_indices: expected each key at most once"):
        numba_flash.backward(do, q, k, v, o, lse, kv_indices=np.zeros_like(idx))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gathered_backward_variants_and_chunks(rng, dtype):
    """The gathering backward with a window, softcap, ALiBi, a value head dim of its own, a
    GQA group of 12 (two chunks of 8 rows, the second partial) and lists of 11 (more entries
    than the simulator block's 8 threads); float16/float32 at the dtype's bound."""
    b, h, hkv, nq, nk, d, d_v, topk = 1, 12, 1, 4, 17, 16, 8, 11
    q = randn(rng, (b, h, nq, d), dtype)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d_v), dtype)
    do = randn(rng, (b, h, nq, d_v), dtype)
    idx = lists(rng, b, hkv, nq, nk, topk)
    slopes = rng.uniform(0.1, 0.4, h).astype(np.float32)
    kw = dict(window_size=(9, 1), softcap=3.0, alibi_slopes=slopes)
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, return_lse=True, **kw)
    got = numba_flash.backward(do, q, k, v, o, lse, kv_indices=idx, **kw)
    want = ref.sparse_attention_backward(do, q, k, v, idx, **kw)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert g.dtype == np.dtype(dtype) and g.shape == w.shape
        assert_close(g, w, dtype, scale=4.0, name=name)


def test_gathered_backward_unvalidated_bad_entry_is_nan_dq(rng):
    """validate=False lists (device-style): an entry past Nk is never dereferenced, its token's
    dq rows are NaN; the other token's rows and every dk, dv stay exact."""
    b, h, nq, nk, d = 1, 2, 2, 6, 16
    q, k, v, do = (randn(rng, s, np.float64) for s in ((b, h, nq, d), (b, 1, nk, d),
                                                       (b, 1, nk, d), (b, h, nq, d)))
    good = np.array([[[[0, 3, -1], [1, 5, 2]]]], np.int32)
    o, lse = numba_flash.forward(q, k, v, kv_indices=good, return_lse=True)
    bad = good.copy()
    bad[0, 0, 0, 2] = 99
    dq, dk, dv = _unvalidated_backward(do, q, k, v, o, lse, bad)
    want = ref.sparse_attention_backward(do, q, k, v, good)
    assert np.isnan(dq[0, :, 0]).all()
    assert_close(dq[:, :, 1], want[0][:, :, 1], np.float64, name="dq")
    assert_close(dk, want[1], np.float64, name="dk")
    assert_close(dv, want[2], np.float64, name="dv")


def _unvalidated_backward(do, q, k, v, o, lse, lists):
    """The backward of ``lists`` without the host's value checks (as a device call makes it)."""
    from numba_flash.frontend import sparse

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sparse, "validate_kv_indices", lambda *a, **kw: None)
        return numba_flash.backward(do, q, k, v, o, lse, kv_indices=lists)


def _varlen_reference(q, k, v, cu_q, cu_k, idx, **kw):
    """Each sequence's reference.sparse_attention, packed back: ``(o, lse [H, total_q])``."""
    o = np.zeros(q.shape[:2] + v.shape[-1:])
    lse = np.zeros((q.shape[1], q.shape[0]))
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        ob, lb = ref.sparse_attention(q[rows].transpose(1, 0, 2)[None],
                                      k[keys].transpose(1, 0, 2)[None],
                                      v[keys].transpose(1, 0, 2)[None],
                                      idx[rows].transpose(1, 0, 2)[None], **kw)
        o[rows], lse[:, rows] = ob[0].transpose(1, 0, 2), lb[0]
    return o, lse


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_packed_lists(rng, causal):
    """forward_varlen(kv_indices=): ragged sequences (one with no query row), GQA, lists per kv
    head, causal aligned per sequence; the unlisted keys of every sequence NaN."""
    h, hkv, d, topk = 4, 2, 16, 5
    len_q, len_k = np.array([3, 0, 6, 2]), np.array([7, 4, 9, 2])
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(len_k)]).astype(np.int32)
    q = randn(rng, (cu_q[-1], h, d), np.float32)
    k = randn(rng, (cu_k[-1], hkv, d), np.float32)
    v = randn(rng, (cu_k[-1], hkv, d), np.float32)
    idx = np.full((cu_q[-1], hkv, topk), -1, np.int32)
    named = np.zeros(cu_k[-1], bool)
    for b in range(len(len_q)):
        for r in range(cu_q[b], cu_q[b + 1]):
            for g in range(hkv):
                m = int(rng.integers(0, min(topk, len_k[b]) + 1))
                idx[r, g, :m] = rng.choice(len_k[b], m, replace=False)
                named[cu_k[b] + idx[r, g, :m]] = True
    k[~named], v[~named] = np.nan, np.nan
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=6, max_seqlen_k=9,
                                        kv_indices=idx, causal=causal, return_lse=True)
    want_o, want_lse = _varlen_reference(q, k, v, cu_q, cu_k, idx, causal=causal)
    assert o.shape == q.shape and lse.shape == (h, cu_q[-1])
    check(o, lse, want_o, want_lse, np.float32)
    with pytest.raises(ValueError, match=r"kv_indices: expected entries in \[-1"):
        numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=6, max_seqlen_k=9,
                                   kv_indices=idx + 9)


def test_varlen_lists_over_a_paged_cache(rng):
    """forward_varlen(kv_indices=, block_table=): the paged prefill's keys through shuffled
    pages (stale slots NaN), against the same lists over the keys gathered into packed rows."""
    from test_decode_kernel import paged_cache

    h, d, topk = 2, 16, 4
    len_q, len_k = np.array([2, 3]), np.array([6, 11])
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(len_k)]).astype(np.int32)
    k_cache, v_cache, table = paged_cache(rng, 2, 1, d, len_k, 4, np.float32)
    q = randn(rng, (cu_q[-1], h, d), np.float32)
    idx = np.full((cu_q[-1], 1, topk), -1, np.int32)
    for b in range(2):
        for r in range(cu_q[b], cu_q[b + 1]):
            idx[r, 0, :3] = rng.choice(len_k[b], 3, replace=False)
    o, lse = numba_flash.forward_varlen(q, k_cache, v_cache, cu_q, cu_k, max_seqlen_q=3,
                                        max_seqlen_k=11, block_table=table, kv_indices=idx,
                                        causal=True, return_lse=True)
    packed = [np.concatenate([ref.gather_paged(c, table, n, b).transpose(1, 0, 2)
                              for b, n in enumerate(len_k)]) for c in (k_cache, v_cache)]
    check(o, lse, *_varlen_reference(q, *packed, cu_q, cu_k, idx, causal=True), np.float32)


@pytest.mark.parametrize("deterministic", [False, True])
def test_varlen_backward_packed_lists(rng, deterministic):
    """backward_varlen(kv_indices=): the gradients of forward_varlen's lists, per sequence
    against reference.sparse_attention_backward, ragged sequences (one with no query row),
    causal, a sink (dsink summed over the real rows only)."""
    h, hkv, d, topk = 2, 1, 16, 4
    len_q, len_k = np.array([3, 0, 4]), np.array([6, 3, 9])
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(len_k)]).astype(np.int32)
    q, do = (randn(rng, (cu_q[-1], h, d), np.float64) for _ in range(2))
    k, v = (randn(rng, (cu_k[-1], hkv, d), np.float64) for _ in range(2))
    idx = np.full((cu_q[-1], hkv, topk), -1, np.int32)
    for b in range(3):
        for r in range(cu_q[b], cu_q[b + 1]):
            idx[r, 0, :3] = rng.choice(len_k[b], 3, replace=False)
    sink = rng.standard_normal(h).astype(np.float32)
    kw = dict(max_seqlen_q=4, max_seqlen_k=9, causal=True, learnable_sink=sink)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, kv_indices=idx, return_lse=True,
                                        **kw)
    got = numba_flash.backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, kv_indices=idx,
                                      deterministic=deterministic, **kw)
    want = [np.zeros_like(q), np.zeros_like(k), np.zeros_like(v), np.zeros(h)]
    for b in range(3):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start:
            continue
        batch = [x[rows].transpose(1, 0, 2)[None] for x in (do, q)]
        kb, vb = (x[keys].transpose(1, 0, 2)[None] for x in (k, v))
        gq, gk, gv, gs = ref.sparse_attention_backward(
            batch[0], batch[1], kb, vb, idx[rows].transpose(1, 0, 2)[None], causal=True,
            learnable_sink=sink)
        want[0][rows], want[1][keys] = gq[0].transpose(1, 0, 2), gk[0].transpose(1, 0, 2)
        want[2][keys] = gv[0].transpose(1, 0, 2)
        want[3] += gs
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert_close(g, w, np.float64 if name != "dsink" else np.float32, name=name)


def test_review_holes_are_closed(rng):
    """A review's findings (2026-12-05): dropout and score_mod_grad rejected by the backward on
    both paths, float packed lists a TypeError (not truncated), an empty aux_tensors list taken,
    an unsigned entry past int32 a ValueError."""
    q, k, do = (randn(rng, s, np.float64) for s in ((1, 2, 3, 16), (1, 1, 6, 16), (1, 2, 3, 16)))
    idx = np.array([[[[0, 4, -1], [1, -1, -1], [5, 2, 3]]]], np.int32)
    o, lse = numba_flash.forward(q, k, k, kv_indices=idx, return_lse=True, aux_tensors=[])
    for det in (False, True):
        with pytest.raises(ValueError, match="^dropout_p: expected 0.0 with kv_indices"):
            numba_flash.backward(do, q, k, k, o, lse, kv_indices=idx, dropout_p=0.3,
                                 deterministic=det)
        with pytest.raises(ValueError, match="^score_mod_grad: expected None with kv_indices"):
            numba_flash.backward(do, q, k, k, o, lse, kv_indices=idx, deterministic=det,
                                 score_mod_grad=lambda s, b, h, i, j: 1.0)
    with pytest.raises(ValueError, match=r"expected entries in .* got 9223372036854775808"):
        numba_flash.forward(q, k, k, kv_indices=idx.astype(np.uint64) * np.uint64(2**63))
    cu_q, cu_k = np.array([0, 3], np.int32), np.array([0, 6], np.int32)
    qp, kp, dop = (x[0].transpose(1, 0, 2) for x in (q, k, do))
    packed = idx[0].transpose(1, 0, 2).astype(np.float32) + 0.7
    with pytest.raises(TypeError, match="kv_indices: expected an integer array"):
        numba_flash.forward_varlen(qp, kp, kp, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=6,
                                   kv_indices=packed)
    with pytest.raises(TypeError, match="kv_indices: expected an integer array"):
        numba_flash.backward_varlen(dop, qp, kp, kp, qp, lse[0], cu_q, cu_k, max_seqlen_q=3,
                                    max_seqlen_k=6, kv_indices=packed)
