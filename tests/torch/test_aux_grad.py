"""Gradients of learnable aux tensors (``aux_grad`` + ``numba_flash.flex.atomic_add``) on the
NumPy API (``numba_flash.backward`` / ``backward_varlen``) against torch float64 autograd of the
same attention: a relative-position bias table ``[H, 2N - 1]``, a learned per-head table (a
bias ``[H, Nq, Nk]`` and a per-head temperature, whose gradient needs ``score``), and learnable
ALiBi slopes; and the checks before any launch (arity, return value, dropout, an index outside
the array in the simulator)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
from numba_flash.flex import atomic_add  # noqa: E402

N = 8  # tokens: the relative bias table has 2N - 1 entries per head


def rel_bias(score, b, h, q_idx, kv_idx, table):
    return score + table[h, q_idx - kv_idx + N - 1]


def rel_bias_grad(score, b, h, q_idx, kv_idx, table):
    return 1.0


def rel_bias_aux(grad_score, score, b, h, q_idx, kv_idx, grads, table):
    atomic_add(grads[0], (h, q_idx - kv_idx + N - 1), grad_score)


# [docs:aux-grad-head-table]
def head_table(score, b, h, q_idx, kv_idx, bias, temp):
    return score * temp[h] + bias[h, q_idx, kv_idx]


def head_table_grad(score, b, h, q_idx, kv_idx, bias, temp):
    return temp[h]


def head_table_aux(grad_score, score, b, h, q_idx, kv_idx, grads, bias, temp):
    atomic_add(grads[0], (h, q_idx, kv_idx), grad_score)
    atomic_add(grads[1], h, grad_score * score)  # d (score temp) / d temp = score
# [/docs:aux-grad-head-table]


def alibi(score, b, h, q_idx, kv_idx, slopes):
    return score - slopes[h] * abs(q_idx - kv_idx)


def alibi_grad(score, b, h, q_idx, kv_idx, slopes):
    return 1.0


def alibi_aux(grad_score, score, b, h, q_idx, kv_idx, grads, slopes):
    atomic_add(grads[0], h, -grad_score * abs(q_idx - kv_idx))


def torch_scores(s, name, aux, qi, kj):
    """The same score_mod on a ``[B, H, Nq, Nk]`` torch score tensor (differentiable in
    ``aux``); ``qi``, ``kj`` the query / key positions (within the sequence)."""
    h = torch.arange(s.shape[1])[:, None, None]
    if name == "rel":
        return s + aux[0][h, qi - kj + N - 1]
    if name == "head":
        return s * aux[1][h] + aux[0][h, qi, kj]
    return s - aux[0][h] * (qi - kj).abs()


def torch_attention(q, k, v, name, aux, *, causal=False, softcap=0.0):
    """float64 attention ``[B, H, N, d]`` with GQA, bottom-right causal, softcap before the
    score_mod (numba_flash's order)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    nq, nk = s.shape[-2:]
    qi, kj = torch.arange(nq)[:, None], torch.arange(nk)[None]
    s = torch_scores(s, name, aux, qi, kj)
    if causal:
        s = s.masked_fill(kj > qi + nk - nq, float("-inf"))
    return torch.softmax(s, -1) @ v


CASES = {"rel": (rel_bias, rel_bias_grad, rel_bias_aux),
         "head": (head_table, head_table_grad, head_table_aux),
         "alibi": (alibi, alibi_grad, alibi_aux)}


def _aux(rng, name, h):
    if name == "rel":
        return (rng.standard_normal((h, 2 * N - 1)),)
    if name == "head":
        return rng.standard_normal((h, N, N)), 1.0 + 0.3 * rng.standard_normal(h)
    return (0.2 + 0.3 * rng.random(h),)


def _check(got, want, tol, names):
    for g, w, name in zip(got, want, names):
        w = w.detach().numpy()
        err = np.abs(np.asarray(g, np.float64) - w).max() / np.abs(w).max()
        assert err <= tol, (name, err)


#: max |got - want| / max |want| against float64 autograd, measured 2026-12-01 over 5 seeds on
#: these shapes (every gradient, aux ones included): float32 1.4e-7 .. 4.4e-7 (the float32
#: rounding of the scores and of the atomic sums of up to 2N terms), float64 4.7e-16 .. 1.6e-15.
#: Bounds with about 4x headroom.
TOL = {np.float32: 2e-6, np.float64: 1e-14}


@pytest.mark.parametrize("name, dtype, causal, softcap, hkv", [
    ("rel", np.float32, True, 0.0, 1), ("head", np.float64, False, 2.0, 2),
    ("alibi", np.float32, True, 0.0, 2)])
def test_backward_aux_grads_match_torch_autograd(rng, name, dtype, causal, softcap, hkv):
    score_mod, score_mod_grad, aux_grad = CASES[name]
    b, h, d = 1, 2, 8
    q, do = (rng.standard_normal((b, h, N, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, hkv, N, d)) for _ in range(2))
    aux = tuple(a.astype(dtype) for a in _aux(rng, name, h))
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    kw = dict(causal=causal, softcap=softcap, score_mod=score_mod, aux_tensors=aux)
    # [docs:aux-grad-call]
    o, lse = numba_flash.forward(q, k, v, return_lse=True, **kw)
    got = numba_flash.backward(do, q, k, v, o, lse, score_mod_grad=score_mod_grad,
                               aux_grad=aux_grad, deterministic=True, **kw)
    dq, dk, dv, *aux_grads = got   # one gradient per aux tensor, its shape and dtype
    # [/docs:aux-grad-call]
    assert len(got) == 3 + len(aux)
    for g, a in zip(got[3:], aux):
        assert g.shape == a.shape and g.dtype == a.dtype
    qt, kt, vt = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    at = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in aux]
    out = torch_attention(qt, kt, vt, name, at, causal=causal, softcap=softcap)
    out.backward(torch.tensor(do, dtype=torch.float64))
    _check(got, [qt.grad, kt.grad, vt.grad, *(a.grad for a in at)], TOL[dtype],
           ["dq", "dk", "dv"] + [f"aux{i}" for i in range(len(aux))])


def test_backward_varlen_aux_grads(rng):
    """Two packed sequences of 5 and 8 tokens sharing one bias table: ``b`` is the sequence,
    positions within it, and the table's gradient is the sum over both."""
    cu = np.array([0, 5, 13], np.int32)
    h, d = 2, 8
    q, k, v, do = (rng.standard_normal((13, h, d)).astype(np.float32) for _ in range(4))
    (table,) = (a.astype(np.float32) for a in _aux(rng, "rel", h))
    kw = dict(max_seqlen_q=8, max_seqlen_k=8, causal=True, score_mod=rel_bias,
              aux_tensors=(table,))
    o, lse = numba_flash.forward_varlen(q, k, v, cu, cu, return_lse=True, **kw)
    got = numba_flash.backward_varlen(do, q, k, v, o, lse, cu, cu, score_mod_grad=rel_bias_grad,
                                      aux_grad=rel_bias_aux, **kw)
    tt = torch.tensor(table, dtype=torch.float64, requires_grad=True)
    ts = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v)]
    for lo, hi in zip(cu[:-1], cu[1:]):
        seq = [t[lo:hi].transpose(0, 1)[None] for t in ts]
        out = torch_attention(*seq, "rel", [tt], causal=True)
        out.backward(torch.tensor(do[lo:hi], dtype=torch.float64).transpose(0, 1)[None])
    _check(got, [t.grad for t in ts] + [tt.grad], TOL[np.float32], ["dq", "dk", "dv", "table"])


def _small(rng, dtype=np.float32):
    q = rng.standard_normal((1, 2, N, 8)).astype(dtype)
    table = rng.standard_normal((2, 2 * N - 1)).astype(dtype)
    o, lse = numba_flash.forward(q, q, q, return_lse=True, score_mod=rel_bias,
                                 aux_tensors=(table,))
    return q, o, lse, table


def _returns(grad_score, score, b, h, q_idx, kv_idx, grads, table):
    return grad_score


def _two_aux(grad_score, score, b, h, q_idx, kv_idx, grads, table, other):
    atomic_add(grads[0], (h, 0), grad_score)


def _out_of_bounds(grad_score, score, b, h, q_idx, kv_idx, grads, table):
    atomic_add(grads[0], (h, q_idx - kv_idx), grad_score)  # negative for kv_idx > q_idx


@pytest.mark.parametrize("fn, over, exc, match", [
    (_two_aux, {}, TypeError, r"aux_grad: expected a function of 8 arguments \(grad_score, "
                              r"score, b, h, q_idx, kv_idx, grads and 1 aux tensor"),
    (_returns, {}, TypeError, r"aux_grad: expected _returns to return nothing \(None\), got "
                              r"float32"),
    (rel_bias_aux, dict(dropout_p=0.1), ValueError, r"aux_grad: not supported with dropout"),
    (rel_bias_aux, dict(aux_tensors=(), score_mod=None, score_mod_grad=None), ValueError,
     r"aux_grad: given without aux_tensors"),
])
def test_bad_aux_grad_is_an_error_before_any_launch(rng, fn, over, exc, match):
    q, o, lse, table = _small(rng)
    kw = dict(score_mod=rel_bias, score_mod_grad=rel_bias_grad, aux_tensors=(table,)) | over
    with pytest.raises(exc, match=match):
        numba_flash.backward(q, q, q, q, o, lse, aux_grad=fn, **kw)


def test_atomic_add_outside_the_array_raises_in_the_simulator(rng):
    """The simulator's twin refuses the negative index NumPy would wrap (a GPU writes outside
    the array there)."""
    if numba_flash.backend() != "simulator":
        pytest.skip("the bounds check is the simulator's")
    q, o, lse, table = _small(rng)
    with pytest.raises(IndexError, match=r"atomic_add: index \(\d, -\d+\) is outside the array "
                                         r"of shape \(2, 15\)"):
        numba_flash.backward(q, q, q, q, o, lse, score_mod=rel_bias, score_mod_grad=rel_bias_grad,
                             aux_tensors=(table,), aux_grad=_out_of_bounds)
