"""Token-sparse attention (``kv_indices``) on flash-attn's ``[B, N, H, d]`` memory: the forward's
SIMT decode reads ``q`` and writes ``out=`` through their strides and reads ``k``, ``v`` as
tokens-first caches; the gathering backward indexes ``do``, ``q``, ``k``, ``v``, ``o`` and
writes ``dq`` through their strides, and casts its ``dk`` / ``dv`` sums into ``out=`` views
where they lie.  A fused projection's ``k`` / ``v`` slices (rows with gaps between them) are
read where they lie too: the decode hands the rows of their memory to its kernels (the SIMT
kernel's and the tensor-core one's) with the slices' own row strides.

Against the float64 reference (``reference.sparse_attention`` and its backward), outputs
NaN-poisoned (conftest), a sentinel head between the rows of every ``out=``, the inputs
unchanged, and the arrays launched checked to be views of the caller's memory (no copy).
Tolerances: tests/kernels/test_forward_sparse.py's (the same kernels, only addresses differ).
"""

from __future__ import annotations

import numpy as np

import numba_flash
import numba_flash.ops.decode as op
from numba_flash import reference as ref
from helpers import assert_close, randn
from test_cache_layouts import _launched_caches, launched  # noqa: F401 (a fixture)
from test_decode_sparse import check
from test_forward_sparse import lists
from test_strided_backward import SENTINEL, _gapped
from test_strided_decode import _at


def _bnhd(rng, b, n, h, d, dtype):
    """A ``[B, H, N, d]`` view of ``[B, N, H, d]`` memory."""
    return randn(rng, (b, n, h, d), dtype).transpose(0, 2, 1, 3)


def _backward_into(mems, do, q, k, v, o, lse, idx, dtype, heads):
    """``numba_flash.backward(kv_indices=idx, causal=True)`` into the ``out=`` views of the
    ``[B, N, heads, d]`` arrays ``mems`` at the head ranges ``heads`` (one per gradient): the
    reference's gradients within the sparse tests' bound, the views themselves returned, the
    inputs unchanged."""
    outs = tuple(m[:, :, lo:hi].transpose(0, 2, 1, 3) for m, (lo, hi) in zip(mems, heads))
    before = [x.copy() for x in (do, q, k, v, o)]
    got = numba_flash.backward(do, q, k, v, o, lse, kv_indices=idx, causal=True, out=outs)
    assert all(g is x for g, x in zip(got, outs))
    want = ref.sparse_attention_backward(do, q, k, v, idx, causal=True)
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert_close(g, w, dtype, scale=4.0, name=name)
    for x, x0 in zip((do, q, k, v, o), before):
        np.testing.assert_array_equal(x, x0)


def test_flash_attn_layout_views_forward_and_backward(rng, launched):  # noqa: F811
    """q, k, v, do as [B, N, H, d] views (GQA, a list per kv head, causal), out= and the
    gradients' out= views with a sentinel head between their rows; the backward reads the
    forward's strided out= as its o."""
    b, h, hkv, nq, nk, d, topk, dtype = 2, 4, 2, 5, 11, 16, 4, np.float32
    q, do = (_bnhd(rng, b, nq, h, d, dtype) for _ in range(2))
    k, v = (_bnhd(rng, b, nk, hkv, d, dtype) for _ in range(2))
    idx = lists(rng, b, hkv, nq, nk, topk)
    out, out_mem = _gapped(b, h, nq, d, dtype)
    lse_out = np.empty((b, h, nq), np.float32)
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, causal=True, return_lse=True,
                                 out=out, lse_out=lse_out)
    assert o is out and lse is lse_out
    check(o, lse, *ref.sparse_attention(q, k, v, idx, causal=True), dtype)
    assert (out_mem[:, :, 0] == SENTINEL).all(), "out: a gap element written"
    _launched_caches(launched, q, k, v, out_mem)   # each read or written where it lies
    launched.clear()
    mems = [np.full((b, n, g + 1, d), SENTINEL, dtype) for n, g in ((nq, h), (nk, hkv),
                                                                    (nk, hkv))]
    _backward_into(mems, do, q, k, v, o, lse, idx, dtype, [(1, h + 1), (1, hkv + 1)] * 2)
    for m in mems:
        assert (m[:, :, 0] == SENTINEL).all(), "a gradient's gap element written"
    _launched_caches(launched, do, q, k, v, out_mem, *mems)


def test_fused_qkv_slices(rng, launched):  # noqa: F811
    """q, k, v slices of one fused [B, N, H + 2 Hkv + 1, d] projection (float16, GQA, one list
    for every head) and dq, dk, dv written as slices of one fused gradient: the forward and
    the backward read (and write) every slice where it lies (the sentinel head after them
    untouched)."""
    b, h, hkv, n, d, topk, dtype = 1, 4, 2, 6, 16, 4, np.float16
    heads = [(0, h), (h, h + hkv), (h + hkv, h + 2 * hkv)]
    mem = randn(rng, (b, n, h + 2 * hkv + 1, d), dtype)
    q, k, v = (mem[:, :, lo:hi].transpose(0, 2, 1, 3) for lo, hi in heads)
    do = _bnhd(rng, b, n, h, d, dtype)
    idx = lists(rng, b, 1, n, n, topk)
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, causal=True, return_lse=True)
    check(o, lse, *ref.sparse_attention(q, k, v, idx, causal=True), dtype)
    _launched_caches(launched, q)
    assert _at(launched, k) and _at(launched, v), "a fused slice reached the decode as a copy"
    launched.clear()
    grad = np.full(mem.shape, SENTINEL, dtype)
    _backward_into([grad] * 3, do, q, k, v, o, lse, idx, dtype, heads)
    assert (grad[:, :, -1] == SENTINEL).all(), "the gap head written"
    _launched_caches(launched, do, q, k, v, *(grad[:, :, lo:hi] for lo, hi in heads))


def test_fused_qkv_slices_tensor_cores(rng, launched, monkeypatch):  # noqa: F811
    """The tensor-core decode (``kernel="auto"``: 8 query heads a kv head, d = 64) over a
    fused [B, N, H + 3, d] projection's slices (float16, MQA, causal, the head after v NaN:
    a read of it shows): k, v gathered into shared memory from their rows where they lie, no
    copy, the buffer unchanged."""
    b, h, n, d, topk, dtype = 1, 8, 5, 64, 4, np.float16
    mem = randn(rng, (b, n, h + 3, d), dtype)
    mem[:, :, -1] = np.nan
    q, k, v = (mem[:, :, lo:hi].transpose(0, 2, 1, 3) for lo, hi in [(0, h), (h, h + 1),
                                                                       (h + 1, h + 2)])
    idx = lists(rng, b, 1, n, n, topk)
    before = mem.copy()
    cfgs = []
    build = op.mla_decode_kernel
    monkeypatch.setattr(op, "mla_decode_kernel", lambda cfg: cfgs.append(cfg) or build(cfg))
    o, lse = numba_flash.forward(q, k, v, kv_indices=idx, causal=True, return_lse=True)
    check(o, lse, *ref.sparse_attention(q, k, v, idx, causal=True), dtype)
    np.testing.assert_array_equal(mem, before)
    assert len(cfgs) == 1 and cfgs[0].GATHER, "not the tensor-core decode"
    assert _at(launched, k) and _at(launched, v), "a fused slice reached the decode as a copy"
