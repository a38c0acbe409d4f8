"""A user's score_mod / mask_mod / block mask on packed batches: forward_varlen and
backward_varlen (simulator, SIMT kernels), against the per-sequence batched ops with the same
functions and the float64 reference evaluated per sequence (``b`` the sequence index,
positions within the sequence)."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.flex import create_block_mask
from numba_flash.flex.examples import prefix_lm_mask
from numba_flash.frontend import ArrayCall


def _cu(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def _packed(rng, dtype, lens_q, lens_k, h=2, hkv=1, d=8):
    tq, tk = sum(lens_q), sum(lens_k)
    return tuple(rng.standard_normal(s).astype(dtype)
                 for s in ((tq, h, d), (tk, hkv, d), (tk, hkv, d)))


def _seq(x, cu, b):
    """Sequence ``b`` of a packed ``[total, H, d]`` array as a batch ``[1, H, n, d]``."""
    return x[cu[b]:cu[b + 1]].transpose(1, 0, 2)[None]


def _at(fn, b):
    """``fn`` with its batch index fixed to ``b``: a reference call on one sequence (batch index
    0 there) means sequence ``b`` of the packed batch."""
    if fn is None:
        return None
    if fn.__code__.co_varnames[0] == "score":
        return lambda score, _b, *rest: fn(score, b, *rest)
    return lambda _b, *rest: fn(b, *rest)


def _ref_varlen(q, k, v, cu_q, cu_k, score_mod=None, mask_mod=None, aux=(), **kw):
    """The float64 oracle of a packed batch with a user's variant: :func:`ref.attention` per
    sequence, with ``b`` the sequence index (reference.attention_varlen takes no functions)."""
    o = np.zeros(q.shape)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for b in range(len(cu_q) - 1):
        if cu_q[b + 1] == cu_q[b]:
            continue
        ob, lb = ref.attention(_seq(q, cu_q, b), _seq(k, cu_k, b), _seq(v, cu_k, b),
                               score_mod=_at(score_mod, b), mask_mod=_at(mask_mod, b),
                               aux_tensors=aux, **kw)
        o[cu_q[b]:cu_q[b + 1]] = ob[0].transpose(1, 0, 2)
        lse[:, cu_q[b]:cu_q[b + 1]] = lb[0]
    return o, lse


def _per_sequence_forward(q, k, v, cu_q, cu_k, aux, **kw):
    """The batched ``forward`` of each sequence alone (batch index 0, row ``b`` of each aux
    array), packed back: what forward_varlen must equal."""
    o = np.full(q.shape, np.nan, q.dtype)
    lse = np.full((q.shape[1], q.shape[0]), np.nan)
    for b in range(len(cu_q) - 1):
        ob, lb = numba_flash.forward(_seq(q, cu_q, b), _seq(k, cu_k, b), _seq(v, cu_k, b),
                                     aux_tensors=tuple(a[b:b + 1] for a in aux),
                                     return_lse=True, **kw)
        o[cu_q[b]:cu_q[b + 1]] = ob[0].transpose(1, 0, 2)
        lse[:, cu_q[b]:cu_q[b + 1]] = lb[0]
    return o, lse


def _rel(score, b, h, q_idx, kv_idx, bias):
    """A relative position bias per sequence and head (``bias [B, H, 64]``)."""
    return score + bias[b, h, q_idx - kv_idx + 32]


def test_score_mod_relative_bias_equals_per_sequence_forward_and_reference(rng):
    lens_q, lens_k = [9, 20], [13, 20]  # sequence 0: Nq < Nk (bottom-right causal)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q, k, v = _packed(rng, np.float32, lens_q, lens_k)
    bias = rng.standard_normal((2, 2, 64)).astype(np.float32)
    kw = dict(score_mod=_rel, causal=True)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=20, max_seqlen_k=20,
                                        aux_tensors=(bias,), return_lse=True, **kw)
    o_s, lse_s = _per_sequence_forward(q, k, v, cu_q, cu_k, (bias,), **kw)
    np.testing.assert_array_equal(o, o_s)  # the same kernel arithmetic, bit for bit
    np.testing.assert_array_equal(lse, lse_s)
    o_r, lse_r = _ref_varlen(q, k, v, cu_q, cu_k, aux=(bias,), **kw)
    # float32 SIMT vs float64: o within 3.6e-7, lse within 2.3e-7 (measured)
    np.testing.assert_allclose(o, o_r, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, lse_r, atol=2e-6, rtol=0)


def test_mask_mod_prefix_lm_with_a_block_mask_float64(rng):
    lens = [11, 0, 18]  # an empty sequence in the middle
    cu = _cu(lens)
    q, k, v = _packed(rng, np.float64, lens, lens, h=2, hkv=2)
    prefix = np.array([4, 0, 9], np.int32)
    bm = create_block_mask(prefix_lm_mask, 3, None, 18, 18, aux_tensors=(prefix,),
                           BLOCK_SIZE=16)  # B sequences, the longest one's lengths
    o, lse = numba_flash.forward_varlen(q, k, v, cu, cu, max_seqlen_q=18, max_seqlen_k=18,
                                        mask_mod=prefix_lm_mask, block_mask=bm,
                                        aux_tensors=(prefix,), return_lse=True)
    o_r, lse_r = _ref_varlen(q, k, v, cu, cu, mask_mod=prefix_lm_mask, aux=(prefix,))
    # float64 SIMT vs float64 reference: o and lse within 8.9e-16 (measured)
    np.testing.assert_allclose(o, o_r, atol=1e-13, rtol=0)
    np.testing.assert_allclose(lse, lse_r, atol=1e-13, rtol=0)
    # and it is not the plain causal or bidirectional result: the prefix matters
    o_c = ref.attention_varlen(q, k, v, cu, cu, causal=True)[0]
    assert np.abs(o_c - o_r).max() > 0.1 and np.abs(ref.attention_varlen(q, k, v, cu, cu)[0]
                                                    - o_r).max() > 0.1


def _same_doc(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def test_document_mask_of_one_packed_sequence_equals_varlen_of_the_documents(rng):
    """The issue's test: three documents packed in one sequence (doc ids + block mask, causal)
    in the batched forward and in forward_varlen of that one sequence, against forward_varlen
    of the documents as three sequences."""
    docs = [10, 14, 16]
    n = sum(docs)
    q, k, v = _packed(rng, np.float16, [n], [n])
    doc = np.repeat(np.arange(3, dtype=np.int32), docs)[None]
    bm = create_block_mask(_same_doc, 1, None, n, n, aux_tensors=(doc,), BLOCK_SIZE=16)
    kw = dict(mask_mod=_same_doc, block_mask=bm, aux_tensors=(doc,), causal=True)
    one = _cu([n])
    o1, lse1 = numba_flash.forward_varlen(q, k, v, one, one, max_seqlen_q=n, max_seqlen_k=n,
                                          return_lse=True, **kw)
    ob, lseb = numba_flash.forward(_seq(q, one, 0), _seq(k, one, 0), _seq(v, one, 0),
                                   return_lse=True, **kw)
    np.testing.assert_array_equal(o1, ob[0].transpose(1, 0, 2))
    np.testing.assert_array_equal(lse1, lseb[0])
    cu = _cu(docs)
    o3, lse3 = numba_flash.forward_varlen(q, k, v, cu, cu, max_seqlen_q=16, max_seqlen_k=16,
                                          causal=True, return_lse=True)
    # float16: the two runs' o measured equal here (the documents' results do not depend on
    # where the tiles fall, up to float32 rounding before the float16 store: one float16 ulp
    # at 1 is 9.8e-4), lse within 2.4e-7; o within 9.0e-4 of the reference (float16 rounding)
    np.testing.assert_allclose(o1.astype(np.float64), o3.astype(np.float64), atol=2e-3, rtol=0)
    np.testing.assert_allclose(lse1, lse3, atol=2e-5, rtol=0)
    o_r = ref.attention_varlen(q, k, v, cu, cu, causal=True)[0]
    np.testing.assert_allclose(o1.astype(np.float64), o_r, atol=2e-3, rtol=0)


@pytest.fixture
def tile_log(monkeypatch):
    from numba_flash.kernels.core import common
    log = []
    monkeypatch.setattr(common, "TILE_LOG", log)
    return log


def test_block_mask_on_varlen_skips_empty_tiles_per_sequence(rng, tile_log):
    """Documents inside each of two sequences, a block mask per sequence (B = 2, created for
    max_seqlen = 32 > the longest 28): forward_varlen equals forward_varlen of the documents,
    and the kernel computes exactly the (Q tile, K/V tile) pairs of each sequence that its
    block mask does not call EMPTY."""
    # [docs:varlen-documents]
    lens = [28, 20]
    docs = [[16, 12], [20]]  # the documents inside each sequence
    cu = _cu(lens)
    q, k, v = _packed(rng, np.float32, lens, lens, h=1, hkv=1)
    doc = np.full((2, 32), 9, np.int32)  # padded to max_seqlen: the mask reads it there too
    for b, ds in enumerate(docs):  # doc[b, i]: the document of token i of sequence b
        doc[b, :lens[b]] = np.repeat(np.arange(len(ds)), ds)
    bm = create_block_mask(_same_doc, 2, None, 32, 32, aux_tensors=(doc,), BLOCK_SIZE=16)
    kw = dict(max_seqlen_q=32, max_seqlen_k=32, mask_mod=_same_doc, aux_tensors=(doc,))
    o = numba_flash.forward_varlen(q, k, v, cu, cu, block_mask=bm, **kw)
    # [/docs:varlen-documents]
    # the sequences' masks differ (B is read): 0 skips two of its four blocks, 1 none
    assert (bm.kind[0] == 0).sum() == 2 and (bm.kind[1] != 0).all()
    np.testing.assert_array_equal(doc[1, 20:], 9)  # the aux array is not modified
    cu_docs = _cu(sum(docs, []))
    o_d = numba_flash.forward_varlen(q, k, v, cu_docs, cu_docs, max_seqlen_q=20,
                                     max_seqlen_k=20)
    # float32: measured equal here (the document edges fall on tile edges), and within
    # 2.5e-7 of the reference; other tiles would differ by float32 rounding
    np.testing.assert_allclose(o, o_d, atol=2e-6, rtol=0)

    from numba_flash.kernels.forward.config import default_tiles
    bm_, bn_, _ = default_tiles(8, np.float32)
    assert 16 % bm_ == 0 and 16 % bn_ == 0  # a kernel tile lies in one block: its verdict
    expect = {(b, 0, qs, ks // bn_) for b in range(2) for qs in range(0, lens[b], bm_)
              for ks in range(0, lens[b], bn_) if bm.kind[b, 0, qs // 16, ks // 16] != 0}
    visited = {(b, h, qs, kt) for b, h, qs, kt in tile_log}
    assert visited == expect and len(tile_log) == len(expect)
    every = sum(-(-n // bm_) * -(-n // bn_) for n in lens)
    assert len(expect) < every
    tile_log.clear()
    o2 = numba_flash.forward_varlen(q, k, v, cu, cu, **kw)  # mask_mod per element
    assert len(tile_log) == every
    np.testing.assert_array_equal(o2, o)


def _quad(score, b, h, q_idx, kv_idx, bias, doc):
    return score + 0.1 * score * score + bias[b, h, q_idx - kv_idx + 32]


def _quad_grad(score, b, h, q_idx, kv_idx, bias, doc):
    return 1.0 + 0.2 * score


def _docs(b, h, q_idx, kv_idx, bias, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


@pytest.mark.parametrize("dtype,deterministic,blocked",
                         [(np.float32, False, False), (np.float64, True, True)])
def test_backward_varlen_with_score_mod_grad_matches_finite_differences(rng, dtype,
                                                                        deterministic,
                                                                        blocked):
    """Gradients of a quadratic score_mod with a per-sequence relative bias, a per-sequence
    document mask and causal (float64: deterministic dQ and a block mask of B = 2 sequences)
    against central differences of the float64 reference, sequence by sequence."""
    lens = [7, 9]
    cu = _cu(lens)
    q, k, v = _packed(rng, dtype, lens, lens, h=2, hkv=1, d=4)
    do = rng.standard_normal(q.shape).astype(dtype)
    bias = rng.standard_normal((2, 2, 64)).astype(np.float32)
    doc = np.array([[0, 0, 0, 1, 1, 1, 1, 9, 9], [0, 0, 0, 0, 0, 1, 1, 1, 1]], np.int32)
    fns = dict(score_mod=_quad, mask_mod=_docs)
    kw = dict(max_seqlen_q=9, max_seqlen_k=9, aux_tensors=(bias, doc), causal=True, **fns)
    if blocked:
        kw["block_mask"] = create_block_mask(_docs, 2, None, 9, 9, aux_tensors=(bias, doc),
                                             BLOCK_SIZE=16)
    o, lse = numba_flash.forward_varlen(q, k, v, cu, cu, return_lse=True, **kw)
    dq, dk, dv = numba_flash.backward_varlen(do, q, k, v, o, lse, cu, cu,
                                             score_mod_grad=_quad_grad,
                                             deterministic=deterministic, **kw)

    def loss(q_, k_, v_):
        o_ = _ref_varlen(q_, k_, v_, cu, cu, aux=(bias, doc), causal=True, **fns)[0]
        return float((o_ * do).sum())

    x64 = [np.asarray(x, np.float64) for x in (q, k, v)]
    eps = 1e-5
    for i, (name, got) in enumerate(zip("qkv", (dq, dk, dv))):
        fd = np.zeros(x64[i].shape)
        for idx in np.ndindex(fd.shape):
            hi = [x.copy() for x in x64]
            lo = [x.copy() for x in x64]
            hi[i][idx] += eps
            lo[i][idx] -= eps
            fd[idx] = (loss(*hi) - loss(*lo)) / (2 * eps)
        # float32 kernel: within 6.9e-7 of the largest gradient (measured); float64 kernel vs
        # central differences: 2.1e-10 (the differences' own error: eps^2 and rounding terms)
        tol = 1e-5 if dtype == np.float32 else 2e-9
        np.testing.assert_allclose(got, fd, atol=tol * max(1.0, np.abs(fd).max()), rtol=0,
                                   err_msg=f"d{name}")
    assert np.abs(dq).max() > 0.1 and np.abs(dk).max() > 0.1  # not a vacuous zero gradient


def test_bad_variants_on_packed_batches_raise_before_any_launch(rng, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("launched")

    monkeypatch.setattr(ArrayCall, "launch", no_launch)
    lens = [6, 10]
    cu = _cu(lens)
    q, k, v = _packed(rng, np.float32, lens, lens)
    do = o = q
    lse = np.zeros((2, 16), np.float32)
    bias = np.zeros((2, 2, 64), np.float32)
    lens_kw = dict(max_seqlen_q=12, max_seqlen_k=12)

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    for shape, why in (((3, 1, 10, 10), "3 sequences for 2"),
                       ((2, 1, 8, 10), "Nq below the longest (10)"),
                       ((2, 1, 10, 16), "Nk past max_seqlen_k (12)")):
        bm = create_block_mask(causal, *shape, BLOCK_SIZE=16)
        with pytest.raises(ValueError, match=r"block_mask: expected a mask for .*packed batch"):
            numba_flash.forward_varlen(q, k, v, cu, cu, block_mask=bm, **lens_kw)
        with pytest.raises(ValueError, match=r"block_mask: expected a mask for .*packed batch"):
            numba_flash.backward_varlen(do, q, k, v, o, lse, cu, cu, block_mask=bm, **lens_kw)
    with pytest.raises(ValueError, match="score_mod_grad: the backward of score_mod _rel"):
        numba_flash.backward_varlen(do, q, k, v, o, lse, cu, cu, score_mod=_rel,
                                    aux_tensors=(bias,), **lens_kw)
    with pytest.raises(TypeError, match="score_mod: expected a function of 5"):
        numba_flash.forward_varlen(q, k, v, cu, cu, score_mod=_rel, **lens_kw)


def test_paged_prefill_with_a_variant_equals_the_packed_keys(rng):
    """The paged prefill (``block_table=``) with a score_mod, a mask_mod and a block mask of two
    sequences: bit for bit the call on the same keys packed (only the K/V row address differs),
    and the per-sequence float64 reference."""
    from tests.kernels.test_forward_paged import paged_cache

    lens = [13, 7]
    cu = _cu(lens)
    q, k, v = _packed(rng, np.float32, lens, lens, h=2, hkv=1)
    bias = rng.standard_normal((2, 2, 64)).astype(np.float32)
    doc = np.zeros((2, 16), np.int32)
    doc[0, 6:] = 1  # two documents in sequence 0

    def rel(score, b, h, q_idx, kv_idx, bias, doc):
        return score + bias[b, h, q_idx - kv_idx + 32]

    def same_doc(b, h, q_idx, kv_idx, bias, doc):
        return doc[b, q_idx] == doc[b, kv_idx]

    bm = create_block_mask(same_doc, 2, None, 16, 16, aux_tensors=(bias, doc), BLOCK_SIZE=16)
    kw = dict(max_seqlen_q=16, max_seqlen_k=16, causal=True, score_mod=rel, block_mask=bm,
              aux_tensors=(bias, doc), return_lse=True)
    kc, vc, table = paged_cache(rng, k, v, cu, 4)[:3]
    o_p, lse_p = numba_flash.forward_varlen(q, kc, vc, cu, cu, block_table=table, **kw)
    o, lse = numba_flash.forward_varlen(q, k, v, cu, cu, **kw)
    np.testing.assert_array_equal(o_p, o)
    np.testing.assert_array_equal(lse_p, lse)
    o_r, lse_r = _ref_varlen(q, k, v, cu, cu, score_mod=rel, mask_mod=same_doc,
                             aux=(bias, doc), causal=True)
    # float32: measured at most 2.4e-7 (o) and 3.6e-7 (lse) over 3 seeds
    np.testing.assert_allclose(o, o_r, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, lse_r, atol=2e-6, rtol=0)
