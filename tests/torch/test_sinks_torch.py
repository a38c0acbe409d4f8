"""Attention sinks through ``numba_flash.torch`` (issue 35): FlashAttention-4's
``learnable_sink`` on :func:`flash_attn_func` (the custom ops and the user-variant path),
:func:`flash_attn_varlen_func` and :func:`flash_attn_with_kvcache`, with autograd for the sink:
out, lse and every gradient (``dsink`` included) against torch's float64 autograd of the
gpt-oss formulation (a sink column appended to the masked scores, softmax, column dropped).
float32 inputs in the simulator, at the float32 bounds of test_sinks.py (4e-6 scaled)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash.torch as nft  # noqa: E402
from numba_flash import reference  # noqa: E402
from torch_helpers import randn  # noqa: E402

TOL = 4e-6


def gpt_oss(q, k, v, sink, causal=False, window_size=(-1, -1), score_mod=None):
    """``(out [B, Nq, H, d], lse [B, H, Nq])`` in float64 with autograd, flash-attn's layout."""
    qh, kh, vh = (x.double().transpose(1, 2) for x in (q, k, v))
    b, h, nq, d = qh.shape
    g = h // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    s = qh @ kh.transpose(-1, -2) / np.sqrt(d)
    if score_mod is not None:
        s = score_mod(s)
    vis = torch.tensor(reference.visible_mask(nq, kh.shape[2], causal=causal,
                                              window_size=window_size))
    s = s.masked_fill(~vis, -float("inf"))
    full = torch.cat([s, sink.double()[None, :, None, None].expand(b, h, nq, 1)], dim=-1)
    out = torch.softmax(full, dim=-1)[..., :-1] @ vh
    return out.transpose(1, 2), torch.logsumexp(full, dim=-1)


def _close(got, want, name):
    err = (got.double() - want.double()).abs().max().item()
    scale = max(1.0, want.double().abs().max().item())
    assert err <= TOL * scale, f"{name}: {err:.2e} > {TOL * scale:.2e}"


def _leaves(gen, b, nq, nk, h, hkv, d):
    q = randn(gen, b, nq, h, d, requires_grad=True)
    k = randn(gen, b, nk, hkv, d, requires_grad=True)
    v = randn(gen, b, nk, hkv, d, requires_grad=True)
    sink = (torch.randn(h, generator=gen) + 2.0).requires_grad_(True)
    return q, k, v, sink


def _grads(out, leaves, dout):
    return torch.autograd.grad(out, leaves, dout)


def _close_grads(gen, out, want, leaves):
    """Every leaf's gradient through ``out`` against its float64 one through ``want``, for one
    random upstream gradient."""
    dout = randn(gen, *out.shape)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), _grads(out, leaves, dout),
                          _grads(want, leaves, dout.double())):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        _close(g, w, name)


@pytest.mark.parametrize("causal, window", [(True, (-1, -1)), (False, (4, 2))])
def test_flash_attn_func_with_a_learnable_sink(gen, causal, window):
    q, k, v, sink = _leaves(gen, 2, 7, 9, 4, 2, 16)
    out, lse, _ = nft.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                      learnable_sink=sink, return_attn_probs=True)
    want, want_lse = gpt_oss(q, k, v, sink, causal, window)
    _close(out, want, "out")
    _close(lse, want_lse, "lse")
    _close_grads(gen, out, want, (q, k, v, sink))


def test_a_sink_without_grad_and_inputs_that_want_none(gen):
    """A sink that does not require grad gets none; q alone requiring grad still works."""
    q, k, v, sink = _leaves(gen, 1, 5, 5, 2, 1, 8)
    sink = sink.detach()
    out = nft.flash_attn_func(q, k.detach(), v.detach(), causal=True, learnable_sink=sink)
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    want, _ = gpt_oss(q, k, v, sink, causal=True)
    (dq_want,) = torch.autograd.grad(want.sum(), (q,))
    _close(dq, dq_want, "dq")


def test_varlen_with_a_learnable_sink(gen):
    cu_q = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 9, 14], dtype=torch.int32)
    h, hkv, d = 2, 1, 8
    q = randn(gen, 11, h, d, requires_grad=True)
    k, v = (randn(gen, 14, hkv, d, requires_grad=True) for _ in range(2))
    sink = (torch.randn(h, generator=gen) + 2.0).requires_grad_(True)
    out = nft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 6, causal=True,
                                     learnable_sink=sink)
    outs = []
    for i in range(3):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        if qs.start == qs.stop:
            continue
        outs.append(gpt_oss(q[None, qs], k[None, ks], v[None, ks], sink, causal=True)[0][0])
    want = torch.cat(outs)
    _close(out, want, "out")
    _close_grads(gen, out, want, (q, k, v, sink))


def test_the_packed_forms_take_a_learnable_sink(gen):
    """flash_attn_qkvpacked_func / kvpacked / their varlen twins take ``learnable_sink`` as
    flash_attn_func does (the sweep's repeat: it was an unexpected keyword): out and the sink's
    gradient against the gpt-oss formulation."""
    q, k, v, sink = _leaves(gen, 1, 6, 6, 2, 2, 8)
    want, _ = gpt_oss(q, k, v, sink, causal=True)
    qkv = torch.stack((q, k, v), dim=2).detach().requires_grad_(True)
    kv = torch.stack((k, v), dim=2)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    outs = {"qkvpacked": nft.flash_attn_qkvpacked_func(qkv, causal=True, learnable_sink=sink),
            "kvpacked": nft.flash_attn_kvpacked_func(q, kv, causal=True, learnable_sink=sink),
            "varlen qkvpacked": nft.flash_attn_varlen_qkvpacked_func(
                qkv[0], cu, 6, causal=True, learnable_sink=sink)[None],
            "varlen kvpacked": nft.flash_attn_varlen_kvpacked_func(
                q[0], kv[0], cu, cu, 6, 6, causal=True, learnable_sink=sink)[None]}
    (dsink_want,) = torch.autograd.grad(want.sum(), (sink,))
    for name, out in outs.items():
        _close(out, want, name)
        (dsink,) = torch.autograd.grad(out.sum(), (sink,))
        _close(dsink, dsink_want, f"{name} dsink")


def test_a_users_score_mod_with_a_learnable_sink(gen):
    """FlashAttention-4's variant path (VariantFunc) carries the sink and its gradient."""
    q, k, v, sink = _leaves(gen, 1, 6, 6, 2, 2, 8)

    def bias(score, b, h, q_idx, kv_idx):
        return score + 0.125 * (q_idx - kv_idx)

    def bias_grad(score, b, h, q_idx, kv_idx):
        return 1.0

    out = nft.flash_attn_func(q, k, v, causal=True, score_mod=bias, score_mod_grad=bias_grad,
                              learnable_sink=sink)
    idx = torch.arange(6, dtype=torch.float64)
    want, _ = gpt_oss(q, k, v, sink, causal=True,
                      score_mod=lambda s: s + 0.125 * (idx[:, None] - idx[None, :]))
    _close(out, want, "out")
    _close_grads(gen, out, want, (q, k, v, sink))


def test_kvcache_decode_with_a_learnable_sink(gen):
    b, h, hkv, d, nmax = 2, 4, 2, 8, 12
    q = randn(gen, b, 1, h, d)
    kc, vc = randn(gen, b, nmax, hkv, d), randn(gen, b, nmax, hkv, d)
    lens = torch.tensor([12, 5], dtype=torch.int32)
    sink = torch.randn(h, generator=gen) + 2.0
    out, lse = nft.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=3,
                                           return_softmax_lse=True, learnable_sink=sink)
    for i, n in enumerate(lens.tolist()):
        want, want_lse = gpt_oss(q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n], sink)
        _close(out[i:i + 1], want, "out")
        _close(lse[i:i + 1], want_lse, "lse")


@pytest.mark.parametrize("sink, err, words", [
    (torch.zeros(2, dtype=torch.float64), TypeError, "dtype float32"),
    (torch.zeros(3), ValueError, "shape (2,)"),
    (np.zeros(2, np.float32), TypeError, "torch.Tensor"),
])
def test_a_bad_sink_tensor_is_named(gen, sink, err, words):
    q = randn(gen, 1, 4, 2, 8)
    with pytest.raises(err) as info:
        nft.flash_attn_func(q, q, q, learnable_sink=sink)
    assert "learnable_sink" in str(info.value) and words in str(info.value)


def test_a_minus_inf_sink_gets_a_zero_gradient(gen):
    """Issue 59's repro through autograd (flash_attn_func and the user-variant path): a row that
    sees no key beside a -inf sink gave dsink = NaN; it is 0."""
    q = randn(gen, 1, 2, 2, 4, requires_grad=True)
    k = randn(gen, 1, 1, 2, 4, requires_grad=True)
    sink = torch.tensor([-float("inf"), 0.5], requires_grad=True)
    outs = {"custom op": nft.flash_attn_func(q, k, k, causal=True, learnable_sink=sink),
            "variant": nft.flash_attn_func(q, k, k, causal=True, learnable_sink=sink,
                                           score_mod=lambda s, b, h, i, j: s,
                                           score_mod_grad=lambda s, b, h, i, j: 1.0)}
    for name, out in outs.items():
        (dsink,) = torch.autograd.grad(out.sum(), (sink,))
        assert dsink[0].item() == 0.0 and torch.isfinite(dsink).all(), (name, dsink)
