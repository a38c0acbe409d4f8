"""Attention sinks (issue 35, gpt-oss's learnable sink, flash-attn 4's ``learnable_sink``): one
logit per query head that joins every row's softmax denominator as a key with no value.

The reference against torch's float64 autograd of the gpt-oss formulation (a sink column
appended to the masked scores, softmax, the column dropped), then the forward's kernels (SIMT
in every dtype, tensor cores in float16 and bfloat16) and the backward (both families: ``P``
comes from ``lse``, which holds the sink; ``dsink`` is summed on the host) against the
reference, on random inputs with NaN-poisoned outputs, at the tolerances of the kernels' own
tests (tests/helpers.py, test_mma_forward.py, test_mma_backward.py): the sink is added once per
row in the epilogue, so it brings no error of its own beyond one ``exp`` and one division.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference
from tests.helpers import LSE_DTYPE, assert_close, assert_scaled_close, randn

torch = pytest.importorskip("torch")


def gpt_oss(q, k, v, sink, causal, window_size):
    """The gpt-oss formulation in torch float64 (the ground truth of the reference)."""
    tq, tk, tv, ts = (torch.tensor(np.asarray(x, np.float64), requires_grad=True)
                      for x in (q, k, v, sink))
    b, h, nq, d = q.shape
    g = h // k.shape[1]
    kk, vv = tk.repeat_interleave(g, 1), tv.repeat_interleave(g, 1)
    s = tq @ kk.transpose(-1, -2) / np.sqrt(d)
    vis = torch.tensor(reference.visible_mask(nq, k.shape[2], causal=causal,
                                              window_size=window_size))
    s = s.masked_fill(~vis, -float("inf"))
    full = torch.cat([s, ts[None, :, None, None].expand(b, h, nq, 1)], dim=-1)
    o = torch.softmax(full, dim=-1)[..., :-1] @ vv
    return (tq, tk, tv, ts), o, torch.logsumexp(full, dim=-1)


@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)),
                                            (False, (3, 1))])
def test_reference_is_the_gpt_oss_formulation(rng, causal, window):
    """o, lse and every gradient (dsink included) equal torch's float64 autograd; nq > nk with
    causal leaves rows that see no key: o = 0, lse = sink."""
    q, do = rng.standard_normal((2, 4, 7, 8)), rng.standard_normal((2, 4, 7, 8))
    k, v = rng.standard_normal((2, 2, 5, 8)), rng.standard_normal((2, 2, 5, 8))
    sink = rng.standard_normal(4)
    leaves, o_t, lse_t = gpt_oss(q, k, v, sink, causal, window)
    o_t.backward(torch.tensor(do))
    o, lse = reference.attention(q, k, v, causal=causal, window_size=window,
                                 learnable_sink=sink)
    grads = reference.attention_backward(do, q, k, v, causal=causal, window_size=window,
                                         learnable_sink=sink)
    np.testing.assert_allclose(o, o_t.detach().numpy(), atol=1e-14)
    np.testing.assert_allclose(lse, lse_t.detach().numpy(), atol=1e-14)
    for got, leaf in zip(grads, leaves):
        np.testing.assert_allclose(got, leaf.grad.numpy(), atol=1e-13)
    if causal:   # rows 0, 1 see no key (7 queries, 5 keys, bottom-right)
        assert (o[:, :, :2] == 0).all()
        np.testing.assert_array_equal(lse[:, :, :2], np.broadcast_to(sink[None, :, None],
                                                                     (2, 4, 2)))


def _sinks(rng, h):
    # logits around the scores' lse (about log Nk): the sink takes a real share of each row
    return (rng.standard_normal(h) + 2.0).astype(np.float32)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("causal", [False, True])
def test_simt_forward_with_a_sink(rng, dtype, causal):
    b, h, hkv, nq, nk, d = 1, 4, 2, 13, 9, 16
    q, k, v = (randn(rng, s, dtype) for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))
    sink = _sinks(rng, h)
    sink[1] = -np.inf     # a head without a sink: plain attention
    o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True, kernel="simt",
                                 learnable_sink=sink)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, learnable_sink=sink)
    o_scale = max(1.0, np.abs(o_ref).max()) if dtype == np.float16 else 1.0
    assert_close(o, o_ref, dtype, scale=o_scale, name="o")
    assert_close(lse, lse_ref, LSE_DTYPE[dtype], name="lse")
    if causal:   # rows 0..3 see no key: o = 0, lse = the sink (-inf for head 1)
        assert (np.asarray(o, np.float64)[:, :, :4] == 0).all()
        np.testing.assert_array_equal(lse[0, :, 0], sink)


def test_simt_forward_sink_with_softcap_alibi_and_window(rng):
    q, k, v = (randn(rng, s) for s in ((2, 2, 11, 16), (2, 1, 14, 16), (2, 1, 14, 16)))
    sink = _sinks(rng, 2)
    kw = dict(window_size=(5, 2), softcap=3.0,
              alibi_slopes=np.array([0.5, 0.25], np.float32))
    o, lse = numba_flash.forward(q, k, v, return_lse=True, kernel="simt", learnable_sink=sink,
                                 **kw)
    o_ref, lse_ref = reference.attention(q, k, v, learnable_sink=sink, **kw)
    assert_close(o, o_ref, np.float32, name="o")
    assert_close(lse, lse_ref, np.float32, name="lse")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_forward_with_a_sink(rng, dtype):
    from ml_dtypes import bfloat16
    from numba_flash.ops.forward_mma import forward_mma
    np_dtype = np.float16 if dtype == "float16" else bfloat16
    q, k, v = (rng.standard_normal(s).astype(np_dtype)
               for s in ((1, 2, 19, 16), (1, 1, 23, 16), (1, 1, 23, 16)))
    sink = _sinks(rng, 2)
    o, lse = forward_mma(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    o_ref, lse_ref = reference.attention(q, k, v, causal=True, learnable_sink=sink)
    # test_mma_forward.py's bounds (float16's, 2e-3 / 2e-6); bfloat16 keeps 3 fewer bits
    assert_scaled_close(np.asarray(o, np.float64), o_ref, 2e-3 if dtype == "float16" else 1.6e-2,
                        name="o")
    assert_scaled_close(lse, lse_ref, 2e-6, name="lse")


@pytest.mark.parametrize("kernel, dtype, tol", [("simt", np.float32, 4e-6),
                                                ("mma", np.float16, 2.5e-3)])
def test_backward_with_a_sink(rng, kernel, dtype, tol):
    """(dq, dk, dv, dsink) against the reference, from the kernels' own forward (the bounds of
    test_backward_kernel.py / test_mma_backward.py)."""
    b, h, hkv, nq, nk, d = 1, 2, 1, 17, 21, 16
    q, k, v, do = (randn(rng, s, dtype) for s in ((b, h, nq, d), (b, hkv, nk, d),
                                                  (b, hkv, nk, d), (b, h, nq, d)))
    sink = _sinks(rng, h)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True, kernel=kernel,
                                 learnable_sink=sink)
    got = numba_flash.backward(do, q, k, v, o, lse, causal=True, kernel=kernel,
                               learnable_sink=sink)
    want = reference.attention_backward(do, q, k, v, causal=True, learnable_sink=sink)
    assert len(got) == 4 and got[3].dtype == np.float32 and got[3].shape == (h,)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert_scaled_close(np.asarray(g, np.float64), w, tol, name=name)


@pytest.mark.parametrize("sink, err, words", [
    (np.zeros(2, np.float64), TypeError, "dtype float32"),
    (np.zeros(3, np.float32), ValueError, "shape (2,)"),
    (np.zeros((1, 2), np.float32), ValueError, "shape (2,)"),
    (np.array([0.0, np.nan], np.float32), ValueError, "NaN"),
    (np.array([np.inf, 0.0], np.float32), ValueError, "+inf"),
    ([0.0, 1.0], TypeError, "learnable_sink"),
])
def test_a_bad_sink_is_named_before_any_launch(rng, sink, err, words):
    q, k, v = (randn(rng, (1, 2, 4, 8)) for _ in range(3))
    for call in (lambda: numba_flash.forward(q, k, v, learnable_sink=sink),
                 lambda: numba_flash.backward(q, q, k, v, q, np.zeros((1, 2, 4), np.float32),
                                              learnable_sink=sink)):
        with pytest.raises(err) as info:
            call()
        assert "learnable_sink" in str(info.value) and words in str(info.value)


@pytest.mark.parametrize("kernel, dtype, tol", [("simt", np.float32, 2e-5),
                                                ("mma", np.float16, 2e-3)])
def test_a_sink_with_dropout_and_a_users_score_mod(rng, kernel, dtype, tol):
    """The sink joins the denominator of the undropped P (dropout then drops keys only), and a
    user's score_mod changes the scores, never the sink."""
    b, h, nq, nk, d = 1, 2, 9, 12, 16
    q, k, v = (randn(rng, s, dtype) for s in ((b, h, nq, d), (b, 1, nk, d), (b, 1, nk, d)))
    sink = _sinks(rng, h)
    mask = numba_flash.dropout_mask(7, b, h, nq, nk, 0.25)
    o = numba_flash.forward(q, k, v, kernel=kernel, dropout_p=0.25, seed=7,
                            learnable_sink=sink)
    o_ref, _ = reference.attention(q, k, v, dropout_mask=mask, dropout_p=0.25,
                                   learnable_sink=sink)
    assert_scaled_close(np.asarray(o, np.float64), o_ref, tol, name="o dropout")

    def bias(score, b_, h_, qi, ki):
        return score + 0.1 * (qi - ki)

    o, lse = numba_flash.forward(q, k, v, kernel=kernel, score_mod=bias, return_lse=True,
                                 learnable_sink=sink)
    o_ref, lse_ref = reference.attention(q, k, v, score_mod=bias, learnable_sink=sink)
    assert_scaled_close(np.asarray(o, np.float64), o_ref, tol, name="o score_mod")
    assert_scaled_close(lse, lse_ref, 2e-6, name="lse score_mod")


def test_varlen_forward_and_backward_with_a_sink(rng):
    """Packed sequences (one without keys, one without queries, one whose first rows see no
    key under causal: lse = sink there): o, lse and (dq, dk, dv, dsink) against the
    reference's per-sequence sum."""
    cu_q = np.array([0, 5, 12, 12, 20], np.int32)
    cu_k = np.array([0, 3, 3, 15, 21], np.int32)
    h, hkv, d = 2, 1, 16
    q, do = randn(rng, (20, h, d)), randn(rng, (20, h, d))
    k, v = randn(rng, (21, hkv, d)), randn(rng, (21, hkv, d))
    sink = _sinks(rng, h)
    kw = dict(causal=True, learnable_sink=sink)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=8, max_seqlen_k=12,
                                        return_lse=True, **kw)
    o_ref, lse_ref = reference.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    assert_close(o, o_ref, np.float32, name="o")
    assert_close(lse, lse_ref, np.float32, name="lse")
    got = numba_flash.backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, max_seqlen_q=8,
                                      max_seqlen_k=12, **kw)
    want = reference.attention_backward_varlen(do, q, k, v, cu_q, cu_k, **kw)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert_scaled_close(np.asarray(g, np.float64), w, 4e-6, name=name)


# -- a -inf sink is no sink: its gradient is 0, also where a row sees no key (issue 59) ----------
def _no_key_rows(rng):
    """Two queries against one key, causal: query 0 sees no key (its lse is the sink's, or
    -inf); head 0's sink is -inf (none), head 1's finite."""
    q = rng.standard_normal((1, 2, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    return q, k, k.copy(), np.array([-np.inf, 0.5], np.float32)


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_a_minus_inf_sink_gets_a_zero_gradient(rng, kernel):
    """The fuzzer's repro: dsink was NaN for the -inf head (exp(-inf - -inf)); it is 0, the
    finite head's as the reference's, in the backward and the reference."""
    q, k, v, sink = _no_key_rows(rng)
    dtype = np.float16 if kernel == "mma" else np.float32
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True, learnable_sink=sink,
                                 kernel=kernel)
    do = np.ones_like(o)
    got = numba_flash.backward(do, q, k, v, o, lse, causal=True, learnable_sink=sink,
                               kernel=kernel)[3]
    want = reference.attention_backward(do, q, k, v, causal=True, learnable_sink=sink)[3]
    assert got[0] == 0 and want[0] == 0
    assert np.isfinite(got).all() and got[1] != 0
    np.testing.assert_allclose(got, want, atol=2e-3 if kernel == "mma" else 1e-6)


def test_a_minus_inf_sink_gets_a_zero_gradient_varlen(rng):
    """The same in a packed batch (a sequence whose first row sees no key beside one with no
    keys at all): backward_varlen and the reference's varlen backward."""
    cu_q = np.array([0, 2, 4], np.int32)
    cu_k = np.array([0, 1, 1], np.int32)
    q = rng.standard_normal((4, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 2, 4)).astype(np.float32)
    sink = np.array([-np.inf, 0.5], np.float32)
    kw = dict(causal=True, learnable_sink=sink)
    o, lse = numba_flash.forward_varlen(q, k, k, cu_q, cu_k, max_seqlen_q=2, max_seqlen_k=1,
                                        return_lse=True, **kw)
    do = np.ones_like(o)
    got = numba_flash.backward_varlen(do, q, k, k, o, lse, cu_q, cu_k, max_seqlen_q=2,
                                      max_seqlen_k=1, **kw)[3]
    want = reference.attention_backward_varlen(do, q, k, k, cu_q, cu_k, **kw)[3]
    assert got[0] == 0 and want[0] == 0 and np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-6)
