"""Helpers of the numba_flash.torch tests: seeded torch inputs, the plain torch attention math
they compare against and flash-attn's tolerance rule."""

from __future__ import annotations

import torch


def randn(gen, *shape, dtype=torch.float32, requires_grad=False):
    x = torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)
    return x.requires_grad_(requires_grad)


def attention_ref(q, k, v, *, causal=False, softmax_scale=None, window_size=(-1, -1),
                  softcap=0.0, alibi_slopes=None, keep=None, dropout_p=0.0):
    """Plain torch attention in flash-attn's layout and rules, in the inputs' dtype:
    ``(out [B, Nq, H, d], lse [B, H, Nq])``.  ``keep`` a bool ``[B, H, Nq, Nk]`` dropout mask."""
    b, nq, h, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(h // hkv, 2)
    v = v.repeat_interleave(h // hkv, 2)
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    col = torch.arange(nq)[:, None] + nk - nq  # query i's key column (bottom-right alignment)
    j = torch.arange(nk)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(s.dtype).expand(b, h)
        s = s - slopes[:, :, None, None] * (col - j).abs().to(s.dtype)
    left, right = window_size
    if causal:
        right = 0 if right < 0 else min(right, 0)
    vis = torch.ones(nq, nk, dtype=torch.bool)
    if left >= 0:
        vis &= j >= col - left
    if right >= 0:
        vis &= j <= col + right
    s = s.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(s.float() if s.dtype == torch.float16 else s, -1)
    p = torch.softmax(s, -1).masked_fill(~vis.any(-1)[:, None], 0.0)  # no key seen: 0
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return torch.einsum("bhij,bjhd->bihd", p, v), lse


def check_rule(out, ref, same_dtype, floor, what="out"):
    """flash-attn's rule: max|out - ref| <= 2 max|same_dtype - ref| + floor, where ``ref`` is
    the float64 math and ``same_dtype`` the same math in the input dtype."""
    err = (out.double() - ref.double()).abs().max().item()
    err_torch = (same_dtype.double() - ref.double()).abs().max().item()
    assert err <= 2 * err_torch + floor, (what, err, err_torch, floor)
    return err, err_torch
