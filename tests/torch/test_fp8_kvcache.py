"""numba_flash.torch.flash_attn_with_kvcache over a torch.float8_e4m3fn cache (FA3's k_descale /
v_descale): the same bits as numba_flash.decode on the NumPy view of the same bytes, the
appended tokens rounded into the caller's cache in place, and the fp8 arguments checked."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
from numba_flash.frontend.fp8 import E4M3 as NP_E4M3  # noqa: E402
from numba_flash.torch import flash_attn_with_kvcache  # noqa: E402

E4M3 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(E4M3 is None, reason="this torch has no float8_e4m3fn")


def _case(gen, b=2, n=20, hkv=2, h=4, d=16, blocks=12, page=4):
    q = torch.randn(b, 1, h, d, generator=gen, dtype=torch.float32).to(torch.float16)
    k_cache = torch.randn(blocks, page, hkv, d, generator=gen).to(E4M3)   # paged, flash-attn
    v_cache = torch.randn(blocks, page, hkv, d, generator=gen).to(E4M3)
    table = torch.randperm(blocks, generator=gen).to(torch.int32)[:b * 5].reshape(b, 5)
    lens = torch.tensor([7, 13], dtype=torch.int32)
    kd = torch.rand(b, hkv, generator=gen) + 0.5
    vd = torch.rand(b, hkv, generator=gen) + 0.5
    return q, k_cache, v_cache, table, lens, kd, vd


def _np(t):
    return t.view(torch.uint8).numpy().view(NP_E4M3)


def test_paged_fp8_cache_matches_the_numpy_call(gen):
    q, k_cache, v_cache, table, lens, kd, vd = _case(gen)
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                       block_table=table, k_descale=kd, v_descale=vd,
                                       return_softmax_lse=True)
    want_o, want_lse = numba_flash.decode(
        q.numpy().transpose(0, 2, 1, 3), _np(k_cache).transpose(0, 2, 1, 3),
        _np(v_cache).transpose(0, 2, 1, 3), cache_seqlens=lens.numpy(), block_table=table.numpy(),
        k_descale=kd.numpy(), v_descale=vd.numpy(), return_lse=True)
    assert out.dtype == torch.float16 and out.shape == q.shape
    assert np.array_equal(out.numpy(), want_o.transpose(0, 2, 1, 3))
    assert np.array_equal(lse.numpy(), want_lse)


def test_new_tokens_are_rounded_into_the_callers_cache(gen):
    q, k_cache, v_cache, table, lens, kd, vd = _case(gen)
    k = torch.randn(2, 1, 2, 16, generator=gen).to(torch.float16)
    v = torch.randn(2, 1, 2, 16, generator=gen).to(torch.float16)
    before = k_cache.clone()
    flash_attn_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, block_table=table,
                            k_descale=kd, v_descale=vd)
    for i in range(2):
        t = int(lens[i])
        blk, slot = int(table[i, t // 4]), t % 4
        want = (k[i, 0].float() / kd[i][:, None]).clamp(-448, 448).to(E4M3)
        assert torch.equal(k_cache[blk, slot].view(torch.uint8), want.view(torch.uint8))
        k_cache[blk, slot] = before[blk, slot]
    assert torch.equal(k_cache.view(torch.uint8), before.view(torch.uint8))   # nothing else


def test_fp8_arguments_are_checked(gen):
    q, k_cache, v_cache, table, lens, kd, vd = _case(gen)
    call = dict(cache_seqlens=lens, block_table=table)
    with pytest.raises(ValueError, match="q_descale: expected None"):
        flash_attn_with_kvcache(q, k_cache, v_cache, q_descale=kd, **call)
    with pytest.raises(TypeError, match="v_cache: expected dtype float8_e4m3fn"):
        flash_attn_with_kvcache(q, k_cache, v_cache.to(torch.float16), **call)
    with pytest.raises(ValueError, match=r"k_descale: expected shape \(2, 2\)"):
        flash_attn_with_kvcache(q, k_cache, v_cache, k_descale=kd[:, :1], **call)


def test_latent_fp8_cache_matches_the_numpy_call(gen):
    """MLA's absorbed decode over an e4m3 latent cache (v_cache=None, head_dim_v; k_descale
    scales keys and values): the NumPy call's bits."""
    q, k_cache, _, table, lens, kd, _ = _case(gen, hkv=1, h=4, d=48)
    out, lse = flash_attn_with_kvcache(q, k_cache, None, cache_seqlens=lens, block_table=table,
                                       k_descale=kd[:, :1], head_dim_v=32,
                                       return_softmax_lse=True)
    want_o, want_lse = numba_flash.decode(
        q.numpy().transpose(0, 2, 1, 3), _np(k_cache).transpose(0, 2, 1, 3), None,
        head_dim_v=32, cache_seqlens=lens.numpy(), block_table=table.numpy(),
        k_descale=kd[:, :1].numpy(), return_lse=True)
    assert out.shape == q.shape[:3] + (32,)
    assert np.array_equal(out.numpy(), want_o.transpose(0, 2, 1, 3))
    assert np.array_equal(lse.numpy(), want_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_fp8_cache_matches_the_cpu_call(gen):
    """A CUDA float8_e4m3fn cache (its bytes as CuPy uint8 with kv_cache_dtype="fp8_e4m3", the
    CPU path's route), a token appended in place: the CPU call's bits and bytes."""
    pytest.importorskip("cupy")
    q, k_cache, v_cache, table, lens, kd, vd = _case(gen)
    k = torch.randn(2, 1, 2, 16, generator=gen).to(torch.float16)
    caches = [c.clone() for c in (k_cache, v_cache)]
    want = flash_attn_with_kvcache(q, *caches, k=k, v=k, cache_seqlens=lens, block_table=table,
                                   k_descale=kd, v_descale=vd)
    on_gpu = [c.cuda() for c in (k_cache, v_cache)]
    got = flash_attn_with_kvcache(q.cuda(), *on_gpu, k=k.cuda(), v=k.cuda(),
                                  cache_seqlens=lens.cuda(), block_table=table.cuda(),
                                  k_descale=kd.cuda(), v_descale=vd.cuda())
    assert torch.equal(got.cpu(), want)
    for c, w in zip(on_gpu, caches):
        assert torch.equal(c.cpu().view(torch.uint8), w.view(torch.uint8))
