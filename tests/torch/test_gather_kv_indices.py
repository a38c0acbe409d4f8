"""FlashAttention-4's ``gather_kv_indices`` on ``numba_flash.torch.flash_attn_func`` (issue 47):
token-sparse attention with autograd.  out, lse and dq, dk, dv against torch's float64 autograd
of a dense softmax whose scores are masked to each query's listed keys (and the causal rule);
float32 CPU tensors in the simulator, at the float32 bound of test_sinks_torch.py (4e-6)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash.torch as nft  # noqa: E402
from numba_flash import reference  # noqa: E402

TOL = 4e-6


def masked_reference(q, k, v, lists, causal):
    """``(out [B, Nq, H, d], lse [B, H, Nq])`` in float64 with autograd: every head of query
    ``i`` sees the keys ``lists[b, i]`` names (and the causal rule allows)."""
    qh, kh, vh = (x.double().transpose(1, 2) for x in (q, k, v))
    b, h, nq, d = qh.shape
    g = h // kh.shape[1]
    kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    nk = kh.shape[2]
    listed = torch.zeros(b, nq, nk + 1, dtype=torch.bool)
    listed.scatter_(2, torch.where(lists >= 0, lists, nk).long(), True)
    vis = listed[:, None, :, :nk] & torch.tensor(reference.visible_mask(nq, nk, causal=causal))
    s = (qh @ kh.transpose(-1, -2) / np.sqrt(d)).masked_fill(~vis, -float("inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.where(vis, torch.exp(s - lse[..., None].clamp(min=-1e300)), torch.zeros(()))
    return (p @ vh).transpose(1, 2), lse


def randn(rng, shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


def _lists(rng, b, nq, nk, topk):
    out = np.full((b, nq, topk), -1, np.int64)
    for i in np.ndindex(b, nq):
        m = int(rng.integers(1, topk + 1))
        out[i][:m] = rng.choice(nk, m, replace=False)
    return torch.from_numpy(out)


@pytest.mark.parametrize("causal", [False, True])
def test_out_lse_and_gradients(rng, causal):
    b, nq, nk, h, hkv, d, topk = 2, 5, 11, 4, 2, 16, 6
    q, k, v = (randn(rng, s).requires_grad_()
               for s in ((b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, d)))
    lists = _lists(rng, b, nq, nk, topk)
    out, lse, _ = nft.flash_attn_func(q, k, v, causal=causal, gather_kv_indices=lists,
                                      return_attn_probs=True)
    want_out, want_lse = masked_reference(q, k, v, lists, causal)
    dout = randn(rng, tuple(out.shape))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(want_out, (q, k, v), dout.double())
    for name, got, w in [("out", out, want_out), ("lse", lse, want_lse),
                         *zip(("dq", "dk", "dv"), grads, want)]:
        w = w.detach()
        both_inf = torch.isinf(w) & (got.double() == w)
        err = torch.where(both_inf, 0.0, (got.double() - w).abs()).max().item()
        assert err <= TOL * max(1.0, w[torch.isfinite(w)].abs().max().item()), (name, err)


def test_bad_lists_are_named(rng):
    q = randn(rng, (1, 3, 2, 16))
    k = randn(rng, (1, 8, 1, 16))
    good = torch.zeros((1, 3, 2), dtype=torch.int32)
    good[..., 1] = -1
    with pytest.raises(TypeError, match="gather_kv_indices: expected dtype in"):
        nft.flash_attn_func(q, k, k, gather_kv_indices=good.float())
    with pytest.raises(ValueError, match=r"gather_kv_indices: expected shape \(1, 3, topk\)"):
        nft.flash_attn_func(q, k, k, gather_kv_indices=good[:, :2])
    with pytest.raises(ValueError, match="gather_kv_indices: expected no dropout_p"):
        nft.flash_attn_func(q, k, k, dropout_p=0.1, gather_kv_indices=good)
    with pytest.raises(ValueError, match=r"kv_indices: expected entries in \[-1"):
        nft.flash_attn_func(q, k, k, gather_kv_indices=good + 8)
