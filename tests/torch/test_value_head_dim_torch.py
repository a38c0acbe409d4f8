"""A value head dim of its own through ``numba_flash.torch`` (issue 35; FA3's ``hdim_v``):
``flash_attn_func`` / ``flash_attn_varlen_func`` forward with ``v [.., headdim_v]`` against
torch's float64 attention, the gradients (the SIMT backward) against its autograd, and MLA's
absorbed decode through ``flash_attn_with_kvcache(q, latent, None, head_dim_v=)``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numba_flash.torch as nft  # noqa: E402
from test_sinks_torch import gpt_oss  # noqa: E402
from torch_helpers import randn  # noqa: E402


def test_flash_attn_func_with_a_value_head_dim(gen):
    q, k = randn(gen, 2, 7, 4, 24), randn(gen, 2, 9, 2, 24)
    v = randn(gen, 2, 9, 2, 8)
    with torch.no_grad():
        out, lse, _ = nft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    want, want_lse = gpt_oss(q, k, v, torch.full((4,), -float("inf")), causal=True)
    assert out.shape == (2, 7, 4, 8)
    assert (out.double() - want).abs().max().item() < 4e-6
    assert (lse.double() - want_lse).abs().max().item() < 4e-6


def test_varlen_with_a_value_head_dim(gen):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = randn(gen, 8, 2, 16), randn(gen, 8, 1, 16), randn(gen, 8, 1, 4)
    out = nft.flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    for s in (slice(0, 3), slice(3, 8)):
        want, _ = gpt_oss(q[None, s], k[None, s], v[None, s], torch.full((2,), -float("inf")),
                          causal=True)
        assert (out[s].double() - want[0]).abs().max().item() < 4e-6


def test_gradients_with_a_value_head_dim(gen):
    """dq, dk (headdim 16) and dv (headdim_v 8) against torch's float64 autograd."""
    q = randn(gen, 1, 5, 4, 16, requires_grad=True)
    k = randn(gen, 1, 6, 2, 16, requires_grad=True)
    v = randn(gen, 1, 6, 2, 8, requires_grad=True)
    out = nft.flash_attn_func(q, k, v, causal=True)
    want, _ = gpt_oss(q, k, v, torch.full((4,), -float("inf")), causal=True)
    dout = randn(gen, *out.shape)
    for g, w in zip(torch.autograd.grad(out, (q, k, v), dout),
                    torch.autograd.grad(want, (q, k, v), dout.double())):
        assert g.shape == w.shape and (g.double() - w).abs().max().item() < 4e-6


def test_kvcache_mla_absorbed_decode(gen):
    """One latent cache (headdim 128, the value its first 64 columns), 4 query heads, float16:
    the tensor-core decode against torch's float64 attention on the cache and its columns;
    a v_cache of its own headdim; bad latent calls named."""
    q = randn(gen, 1, 1, 4, 128, dtype=torch.float16) * 0.3
    latent = randn(gen, 1, 24, 1, 128, dtype=torch.float16)
    lens = torch.tensor([20], dtype=torch.int32)
    out = nft.flash_attn_with_kvcache(q, latent, None, cache_seqlens=lens, head_dim_v=64)
    want, _ = gpt_oss(q, latent[:, :20], latent[:, :20, :, :64], torch.full((4,), -float("inf")))
    assert out.shape == (1, 1, 4, 64) and out.dtype == torch.float16
    assert (out.double() - want).abs().max().item() < 2e-3
    v_own = latent[..., :64].contiguous()
    out2 = nft.flash_attn_with_kvcache(q, latent, v_own, cache_seqlens=lens)
    assert (out2.double() - want).abs().max().item() < 2e-3
    with pytest.raises(ValueError, match="^head_dim_v: "):
        nft.flash_attn_with_kvcache(q, latent, None, cache_seqlens=lens)
    with pytest.raises(ValueError, match="^k: expected None with v_cache=None"):
        nft.flash_attn_with_kvcache(q, latent, None, k=latent[:, :1], v=latent[:, :1],
                                    cache_seqlens=lens, head_dim_v=64)
