"""The oracle's user functions (score_mod, mask_mod, score_mod_grad) against the built-in
variants they re-express, packed documents, and finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numba_flash import reference as ref


def _qkv(rng, b=1, h=2, hkv=1, nq=6, nk=9, d=4):
    return (rng.standard_normal((b, h, nq, d)), rng.standard_normal((b, hkv, nk, d)),
            rng.standard_normal((b, hkv, nk, d)))


def test_softcap_and_alibi_as_score_mods_equal_the_builtins(rng):
    q, k, v = _qkv(rng)
    q = q * 3
    slopes = ref.alibi_slopes(2)
    nq, nk = q.shape[2], k.shape[2]
    cap = 2.0

    def capped(score, b, h, q_idx, kv_idx):
        return cap * math.tanh(score / cap) - float(slopes[h]) * abs(q_idx + nk - nq - kv_idx)

    def capped_grad(score, b, h, q_idx, kv_idx):
        return 1.0 - math.tanh(score / cap) ** 2

    want = ref.attention(q, k, v, softcap=cap, alibi_slopes=slopes, causal=True)
    got = ref.attention(q, k, v, score_mod=capped, causal=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-13)
    do = rng.standard_normal(q.shape)
    gw = ref.attention_backward(do, q, k, v, softcap=cap, alibi_slopes=slopes, causal=True)
    gg = ref.attention_backward(do, q, k, v, score_mod=capped, score_mod_grad=capped_grad,
                                causal=True)
    for a, b in zip(gg, gw):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("nq, nk", [(6, 6), (4, 9)])
def test_causal_and_window_as_mask_mods_equal_the_builtins(rng, nq, nk):
    q, k, v = _qkv(rng, nq=nq, nk=nk)
    off = nk - nq  # bottom-right alignment: row i sits at key column i + off

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + off

    def window(b, h, q_idx, kv_idx):
        return q_idx + off - 2 <= kv_idx <= q_idx + off + 1

    for mod, kw in ((causal, dict(causal=True)), (window, dict(window_size=(2, 1)))):
        want = ref.attention(q, k, v, **kw)
        got = ref.attention(q, k, v, mask_mod=mod)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def test_document_mask_equals_varlen(rng):
    lens = [3, 5, 2]
    doc = np.repeat(np.arange(3), lens)
    n, h, d = doc.size, 2, 4
    q, k, v = (rng.standard_normal((1, h, n, d)) for _ in range(3))

    def same_doc(b, h, q_idx, kv_idx, doc):
        return doc[q_idx] == doc[kv_idx]

    o, lse = ref.attention(q, k, v, mask_mod=same_doc, aux_tensors=(doc,))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    packed = [x[0].transpose(1, 0, 2) for x in (q, k, v)]
    o_v, lse_v = ref.attention_varlen(*packed, cu, cu)
    np.testing.assert_allclose(o[0].transpose(1, 0, 2), o_v, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(lse[0], lse_v, rtol=1e-13)


def test_score_mod_gradients_match_finite_differences(rng):
    q, k, v = _qkv(rng, nq=4, nk=5, d=3)
    bias = rng.standard_normal((2, 4, 5))

    def mod(score, b, h, q_idx, kv_idx, bias):
        return score + 0.3 * score * score + bias[h, q_idx, kv_idx]

    def grad(score, b, h, q_idx, kv_idx, bias):
        return 1.0 + 0.6 * score

    kw = dict(score_mod=mod, aux_tensors=(bias,), causal=True)
    do = rng.standard_normal(q.shape)
    dq, dk, dv = ref.attention_backward(do, q, k, v, score_mod_grad=grad, **kw)

    def loss(q_, k_, v_):
        return float((ref.attention(q_, k_, v_, **kw)[0] * do).sum())

    eps = 1e-6
    for x, g, name in ((q, dq, "q"), (k, dk, "k"), (v, dv, "v")):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args = {"q": (q, k, v), "k": (q, k, v), "v": (q, k, v)}[name]
            plus = [xp if a is x else a for a in args]
            minus = [xm if a is x else a for a in args]
            num[idx] = (loss(*plus) - loss(*minus)) / (2 * eps)
        np.testing.assert_allclose(g, num, rtol=1e-6, atol=1e-8, err_msg=name)


def test_backward_of_a_score_mod_needs_its_derivative(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match="score_mod_grad"):
        ref.attention_backward(q, q, k, v, score_mod=lambda s, b, h, i, j: 2 * s)
