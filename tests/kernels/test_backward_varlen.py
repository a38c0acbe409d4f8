"""Kernel tier: ``numba_flash.backward_varlen`` on packed ragged batches against
``reference.attention_backward_varlen``; argument errors.

``o`` and ``lse`` come from the reference, sequence by sequence (a sequence with no keys gets
``o = 0``, ``lse = -inf``, what the forward returns for rows that see nothing), so these tests do
not depend on the forward kernel.  Dropout: sequence ``b`` uses element ``(b, h, i, j)`` of
``numba_flash.dropout_mask`` (indices within the sequence).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import randn, assert_scaled_close

#: as in test_backward_variants.py (the same kernels; measured there).
GRAD_TOL = {np.float16: 2.4e-2, np.float32: 6e-6, np.float64: 1.8e-14}


def masks_for(seed, p, lq, lk, h):
    """Per-sequence keep masks ``[H, nq_b, nk_b]``: ``dropout_mask(seed, B, H, ...)[b]``."""
    full = numba_flash.dropout_mask(seed, len(lq), h, max(1, max(lq)), max(1, max(lk)), p)
    return [full[b, :, :nq, :nk] for b, (nq, nk) in enumerate(zip(lq, lk))]


def make_case(rng, lq, lk, h, hkv, d, dtype, *, p=0.0, seed=0, **variant):
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    q = randn(rng, (cu_q[-1], h, d), dtype, scale=2.0)
    k = randn(rng, (cu_k[-1], hkv, d), dtype)
    v = randn(rng, (cu_k[-1], hkv, d), dtype)
    do = randn(rng, (cu_q[-1], h, d), dtype)
    masks = masks_for(seed, p, lq, lk, h) if p else None
    o = np.zeros(q.shape)
    lse = np.full((h, q.shape[0]), -np.inf)
    group = h // hkv
    for b in range(len(lq)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q1 == q0 or k1 == k0:
            continue  # no rows, or rows that see no key: o = 0, lse = -inf
        alibi = variant.get("alibi_slopes")
        kw = dict(variant, alibi_slopes=None if alibi is None else
                  (alibi[b] if np.ndim(alibi) == 2 else alibi))
        ob, lb = ref.attention(q[q0:q1].transpose(1, 0, 2)[None],
                               k[k0:k1].transpose(1, 0, 2)[None],
                               v[k0:k1].transpose(1, 0, 2)[None],
                               dropout_mask=None if masks is None else masks[b][None],
                               dropout_p=p, **kw)
        o[q0:q1] = ob[0].transpose(1, 0, 2)
        lse[:, q0:q1] = lb[0]
    assert h % group == 0
    lse_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    args = (do, q, k, v, o.astype(dtype), lse.astype(lse_dtype), cu_q, cu_k)
    return args, masks, dict(max_seqlen_q=max(lq), max_seqlen_k=max(lk))


def check(args, masks, dtype, grads, p=0.0, **variant):
    do, q, k, v, _, _, cu_q, cu_k = args
    want = ref.attention_backward_varlen(do, q, k, v, cu_q, cu_k, dropout_masks=masks,
                                         dropout_p=p, **variant)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_scaled_close(g, w, GRAD_TOL[np.dtype(dtype).type], name)
    return want


# (id, dtype, lq, lk, H, Hkv, d, variant, p, deterministic); sequence lengths are ragged around
# the simulator's 8-wide tiles, with an empty query sequence (its keys get dk = dv = 0)
CASES = [
    ("causal-gqa", np.float32, [5, 0, 12, 1], [7, 3, 9, 4], 2, 1, 8, dict(causal=True), 0.0,
     False),
    ("window-softcap-alibi-f16-det", np.float16, [9, 3, 0, 6], [9, 5, 2, 11], 2, 1, 8,
     dict(window_size=(3, 1), softcap=2.0,
          alibi_slopes=np.array([[0.5, 0.25], [1.0, 0.1], [0.3, 0.2], [0.7, 0.05]],
                                np.float32)), 0.0, True),
    ("dropout-window-gqa", np.float32, [6, 10, 0], [8, 7, 3], 2, 1, 12,
     dict(causal=True, window_size=(4, -1)), 0.3, False),
    ("dropout-window-gqa-det", np.float32, [6, 10, 0], [8, 7, 3], 2, 1, 12,
     dict(causal=True, window_size=(4, -1)), 0.3, True),
    ("f64", np.float64, [4, 11], [13, 2], 2, 2, 7, dict(alibi_slopes=ref.alibi_slopes(2)), 0.0,
     False),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_varlen_matches_reference(rng, case):
    _, dtype, lq, lk, h, hkv, d, variant, p, det = case
    seed = 12345
    args, masks, maxes = make_case(rng, lq, lk, h, hkv, d, dtype, p=p, seed=seed, **variant)
    grads = numba_flash.backward_varlen(*args, **maxes, dropout_p=p, seed=seed,
                                        deterministic=det, **variant)
    check(args, masks, dtype, grads, p=p, **variant)
    if lq.count(0):  # keys of an empty query sequence: nothing flows back to them
        _, _, _, _, _, _, cu_q, cu_k = args
        b = lq.index(0)
        assert not grads[1][cu_k[b]:cu_k[b + 1]].any()
        assert not grads[2][cu_k[b]:cu_k[b + 1]].any()


def test_backward_varlen_sequence_without_keys(rng):
    """A sequence with queries but no keys: its rows see nothing (lse = -inf), dq = 0."""
    lq, lk = [4, 5, 3], [6, 0, 5]
    args, _, maxes = make_case(rng, lq, lk, 2, 2, 8, np.float32)
    for det in (False, True):
        grads = numba_flash.backward_varlen(*args, **maxes, deterministic=det)
        np.testing.assert_array_equal(grads[0][4:9], 0.0)
        check(args, None, np.float32, grads)


def test_backward_varlen_equals_dense_per_sequence(rng):
    """One sequence packed is the dense backward, bit for bit (same kernels, same order)."""
    args, _, maxes = make_case(rng, [11], [13], 1, 1, 8, np.float32, causal=True)
    do, q, k, v, o, lse, cu_q, cu_k = args
    packed = numba_flash.backward_varlen(*args, **maxes, causal=True, deterministic=True)
    dense = numba_flash.backward(*(x.transpose(1, 0, 2)[None] for x in (do, q, k, v, o)),
                                 lse[None], causal=True, deterministic=True)
    for a, b in zip(packed, dense):
        np.testing.assert_array_equal(a, b[0].transpose(1, 0, 2))


def _good():
    z = np.zeros
    cu = np.array([0, 2, 5], np.int32)
    cuk = np.array([0, 3, 4], np.int32)
    return dict(do=z((5, 2, 8), np.float32), q=z((5, 2, 8), np.float32),
                k=z((4, 1, 8), np.float32), v=z((4, 1, 8), np.float32),
                o=z((5, 2, 8), np.float32), lse=z((2, 5), np.float32), cu_seqlens_q=cu,
                cu_seqlens_k=cuk, max_seqlen_q=3, max_seqlen_k=3)


@pytest.mark.parametrize("change, exc, msg", [
    ({"q": np.zeros((1, 5, 2, 8), np.float32)}, ValueError, "q: expected a 3-D array"),
    ({"k": np.zeros((4, 3, 8), np.float32), "v": np.zeros((4, 3, 8), np.float32)}, ValueError,
     "k: expected a number of kv heads"),
    ({"o": np.zeros((5, 2, 8), np.float16)}, TypeError, "o: expected dtype float32"),
    ({"do": np.zeros((4, 2, 8), np.float32)}, ValueError, "do: expected the shape of q"),
    ({"lse": np.zeros((5, 2), np.float32)}, ValueError, r"lse: expected shape \(2, 5\)"),
    ({"cu_seqlens_q": np.array([0, 2, 4], np.int32)}, ValueError,
     "cu_seqlens_q: expected the packed length 5 last"),
    ({"cu_seqlens_q": np.array([0, 2.0, 5])}, TypeError, "cu_seqlens_q: expected an integer"),
    ({"cu_seqlens_k": np.array([0, 4], np.int32), "max_seqlen_k": 4}, ValueError,
     "cu_seqlens_k: expected 3 entries"),
    ({"cu_seqlens_k": np.array([0, 3, 2, 4], np.int32)}, ValueError,
     "cu_seqlens_k: expected non-decreasing"),
    ({"max_seqlen_q": 2}, ValueError, "max_seqlen_q: expected at least the longest"),
    ({"max_seqlen_k": 3.0}, TypeError, "max_seqlen_k: expected an int"),
    ({"window_size": (0, -3)}, ValueError, "window_size"),
    ({"softcap": -0.5}, ValueError, "softcap"),
    ({"alibi_slopes": np.zeros((3, 2), np.float32)}, ValueError, "alibi_slopes: expected shape"),
    ({"dropout_p": 1.0}, ValueError, "dropout_p"),
])
def test_backward_varlen_argument_errors(change, exc, msg):
    kw = _good()
    kw.update(change)
    pos = [kw.pop(n) for n in ("do", "q", "k", "v", "o", "lse", "cu_seqlens_q",
                               "cu_seqlens_k")]
    with pytest.raises(exc, match=msg):
        numba_flash.backward_varlen(*pos, **kw)


def test_backward_varlen_after_forward_varlen_with_dropout(rng):
    """Kernel to kernel: forward_varlen's dropped o and lse into backward_varlen, against the
    reference with dropout_mask(seed, B, H, ...)[b] per sequence: both kernels draw the same
    varlen keep-mask (batch index b, indices within the sequence)."""
    lq, lk, h, d, p, seed = [5, 0, 9], [7, 4, 6], 2, 8, 0.25, 2**40 + 3
    args, masks, maxes = make_case(rng, lq, lk, h, 1, d, np.float32, p=p, seed=seed,
                                   causal=True)
    do, q, k, v, _, _, cu_q, cu_k = args
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, **maxes, causal=True, dropout_p=p,
                                        seed=seed, return_lse=True)
    grads = numba_flash.backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, **maxes, causal=True,
                                        dropout_p=p, seed=seed)
    check(args, masks, np.float32, grads, p=p, causal=True)
