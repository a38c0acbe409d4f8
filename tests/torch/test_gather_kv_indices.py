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
    dout = randn(rng, (b, nq, h, d))
    _check(_forward_backward(q, k, v, lists, causal, dout), q, k, v, lists, causal, dout)


def _forward_backward(q, k, v, lists, causal, dout):
    """``(out, lse, dq, dk, dv)`` of flash_attn_func(gather_kv_indices=lists) and autograd."""
    out, lse, _ = nft.flash_attn_func(q, k, v, causal=causal, gather_kv_indices=lists,
                                      return_attn_probs=True)
    return (out, lse, *torch.autograd.grad(out, (q, k, v), dout))


def _check(results, q, k, v, lists, causal, dout):
    """:func:`_forward_backward`'s ``results`` against :func:`masked_reference` within TOL."""
    want_out, want_lse = masked_reference(q, k, v, lists, causal)
    want = torch.autograd.grad(want_out, (q, k, v), dout.double())
    for name, got, w in zip(("out", "lse", "dq", "dk", "dv"), results,
                            (want_out, want_lse, *want)):
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


def test_varlen_out_and_gradients(rng):
    """flash_attn_varlen_func(gather_kv_indices=) with FA4's packed (total_q, topk) lists:
    each sequence against the dense form of that sequence alone."""
    len_q, len_k, h, d, topk = [2, 4], [5, 9], 2, 16, 4
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(len_q)]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum(len_k)]), dtype=torch.int32)
    q = randn(rng, (sum(len_q), h, d)).requires_grad_()
    k = randn(rng, (sum(len_k), 1, d)).requires_grad_()
    v = randn(rng, (sum(len_k), 1, d)).requires_grad_()
    lists = torch.cat([_lists(rng, 1, nq, nk, topk)[0] for nq, nk in zip(len_q, len_k)])
    out = nft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 9, causal=True,
                                     gather_kv_indices=lists)
    dout = randn(rng, tuple(out.shape))
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(2):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        qb, kb, vb = (x[s][None].detach().requires_grad_() for x, s in
                      ((q, rows), (k, keys), (v, keys)))
        want_out, _ = masked_reference(qb, kb, vb, lists[rows][None], True)
        want = torch.autograd.grad(want_out, (qb, kb, vb), dout[rows][None].double())
        for name, got, w in [("out", out[rows], want_out[0]),
                             *zip(("dq", "dk", "dv"), (grads[0][rows], grads[1][keys],
                                                       grads[2][keys]), (x[0] for x in want))]:
            err = (got.double() - w.detach()).abs().max().item()
            assert err <= TOL * max(1.0, w.abs().max().item()), (name, b, err)


def test_device_path_reads_and_writes_in_place(rng):
    """The device path (CUDA tensors' code, on the stand-in device: tests/torch/
    test_device_path_torch.py): q, k, v and dout read where they lie in flash-attn's [B, N, H,
    d] memory, out, dq, dk, dv written in place through their strides.  A steady call makes no
    torch copy (torch allocates out and lse, then dq, dk, dv) and no copy on the device (its
    one stand-in allocation: the forward's cache_seqlens, int32 [B]; the backward's sums are
    its launch plan's, zeroed by memsets), syncs nothing; values as the reference's."""
    import numba_flash.standin as sd
    from test_device_path_torch import device_path

    b, nq, nk, h, hkv, d, topk = 1, 4, 9, 4, 2, 16, 3
    q, k, v = (randn(rng, s).requires_grad_()
               for s in ((b, nq, h, d), (b, nk, hkv, d), (b, nk, hkv, d)))
    lists = _lists(rng, b, nq, nk, topk).int()     # FA4's int32 lists: read as they are
    dout = randn(rng, (b, nq, h, d))
    with device_path() as (mode, _driver):
        _check(_forward_backward(q, k, v, lists, True, dout), q, k, v, lists, True, dout)
        state = {}

        def forward():
            state["out"] = nft.flash_attn_func(q, k, v, causal=True, gather_kv_indices=lists)

        for call, allocs, device_allocs in ((forward, 2, [np.dtype(np.int32)]),
                                            (lambda: state["out"].backward(dout), 3, [])):
            for _ in range(2):   # the first calls build the launch plans
                forward()
                call()
            forward()
            mode.reset()
            with sd.count() as c:
                call()
            assert (c.syncs, c.d2h, c.h2d) == (0, 0, 0), c.log
            assert [x for kind, x in c.log if kind == "allocations"] == device_allocs, c.log
            assert (mode.allocations, mode.copies) == (allocs, 0), mode.log
