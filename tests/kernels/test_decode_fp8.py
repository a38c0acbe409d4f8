"""numba_flash.decode over an e4m3 KV cache (issue 46, the cache part): the kernel widens the
cache's bytes exactly and folds FA3's descales into q's scale (K) and o (V), so it is held to
the same bounds as a decode of the dequantised cache in q's dtype: helpers.atol of q's dtype,
against the float64 reference of the dequantised cache (reference.dequantize).  Stale slots and
spare pages are e4m3 NaN (0x7F): an unread slot must stay unread."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn
from test_decode_kernel import LSE_DTYPE, contiguous_cache, paged_cache

E4M3 = ml_dtypes.float8_e4m3fn


def fp8_caches(k, v):
    """The caches as e4m3 (NaN stays NaN), and descales != 1 per (sequence, kv head)."""
    return k.astype(E4M3), v.astype(E4M3)


def descales(rng, b, hkv):
    return (rng.uniform(0.25, 2.0, (b, hkv)).astype(np.float32),
            rng.uniform(0.25, 2.0, (b, hkv)).astype(np.float32))


def reference(q, k8, v8, kd, vd, lens, table=None, **kw):
    """The float64 decode of the dequantised cache: each sequence's keys (gathered through the
    table when paged) times its own descales, as a contiguous cache."""
    if table is not None:   # a page serves one sequence: dequantise per sequence after the gather
        nmax = int(max(lens))
        k8 = np.stack([_pad(ref.gather_paged(k8, table, n, i), nmax) for i, n in enumerate(lens)])
        v8 = np.stack([_pad(ref.gather_paged(v8, table, n, i), nmax) for i, n in enumerate(lens)])
    return ref.paged_decode(q, ref.dequantize(k8, kd), ref.dequantize(v8, vd), lens, **kw)


def _pad(x, n):
    """``[Hkv, L, d]`` (any dtype) to ``[Hkv, n, d]`` float64, zeros past ``L``."""
    out = np.zeros(x.shape[:1] + (n,) + x.shape[2:])
    out[:, :x.shape[1]] = x.astype(np.float64)
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
def test_paged_e4m3_cache_with_gqa(rng, dtype, num_splits):
    b, h, hkv, d = 2, 4, 2, 16
    lens = np.array([int(rng.integers(1, 30)), 37])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 8, np.float32)   # shuffled pages, NaN slots
    k8, v8 = fp8_caches(k, v)
    kd, vd = descales(rng, b, hkv)
    q = randn(rng, (b, h, d), np.float32).astype(dtype)
    o, lse = numba_flash.decode(q, k8, v8, cache_seqlens=lens, block_table=table,
                                num_splits=num_splits, return_lse=True, k_descale=kd,
                                v_descale=vd)
    assert o.dtype == np.dtype(dtype) and o.shape == q.shape
    want_o, want_lse = reference(q.astype(np.float64), k8, v8, kd, vd, lens, table)
    tol = np.float16 if dtype != np.float32 else np.float32
    assert_close(o.astype(np.float64), want_o, tol, scale=4.0 if dtype != np.float32 else 1.0,
                 name="o")
    assert lse.dtype == np.float32
    assert_close(lse, want_lse, np.float32, name="lse")


def test_contiguous_causal_two_tokens_and_sink(rng):
    b, h, hkv, d, nmax = 2, 2, 1, 32, 40
    lens = np.array([40, 9])
    k, v = contiguous_cache(rng, b, hkv, nmax, d, lens, np.float32)
    k8, v8 = fp8_caches(k, v)
    kd, vd = descales(rng, b, hkv)
    q = randn(rng, (b, h, 2, d), np.float16)
    sink = rng.standard_normal(h).astype(np.float32)
    o, lse = numba_flash.decode(q, k8, v8, cache_seqlens=lens, causal=True, return_lse=True,
                                k_descale=kd, v_descale=vd, learnable_sink=sink)
    want_o, want_lse = reference(q, k8, v8, kd, vd, lens, causal=True, learnable_sink=sink)
    assert_close(o, want_o, np.float16, name="o")
    assert_close(lse, want_lse, LSE_DTYPE[np.float32], name="lse")


def test_descales_default_to_one(rng):
    b, h, d = 1, 2, 16
    lens = np.array([20])
    k, v, table = paged_cache(rng, b, 1, d, lens, 4, np.float32)
    k8, v8 = fp8_caches(k, v)
    q = randn(rng, (b, h, d), np.float32)
    o = numba_flash.decode(q, k8, v8, cache_seqlens=lens, block_table=table)
    ones = np.ones((b, 1), np.float32)
    assert_close(o, reference(q, k8, v8, ones, ones, lens, table)[0], np.float32)


def test_bad_fp8_arguments_are_named(rng):
    b, h, d = 1, 2, 16
    lens = np.array([5])
    k, v = contiguous_cache(rng, b, 1, 8, d, lens, np.float32, poison=False)
    k8, v8 = fp8_caches(k, v)
    q = randn(rng, (b, h, d), np.float16)
    kd = np.ones((b, 1), np.float32)
    k_bytes = k8.view(np.uint8).copy()
    call = dict(cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"k_descale: expected shape \(1, 1\)"):
        numba_flash.decode(q, k8, v8, k_descale=np.ones((1, 2), np.float32), **call)
    with pytest.raises(TypeError, match="v_descale: expected dtype float32"):
        numba_flash.decode(q, k8, v8, v_descale=np.ones((1, 1)), **call)
    with pytest.raises(ValueError, match="k_descale: expected None without e4m3"):
        numba_flash.decode(q, k.astype(np.float16), v.astype(np.float16), k_descale=kd, **call)
    with pytest.raises(TypeError, match="k_cache: expected dtype in"):
        numba_flash.decode(q, k.astype(ml_dtypes.float8_e5m2), v8, **call)
    with pytest.raises(TypeError, match="v_cache: expected float8_e4m3fn"):
        numba_flash.decode(q, k8, v.astype(np.float16), **call)
    with pytest.raises(TypeError, match="q: expected dtype in"):
        numba_flash.decode(q.astype(np.float64), k8, v8, **call)
    with pytest.raises(ValueError, match="k_cache: expected a head dim that is a multiple of 4, "
                                         "at least 16"):
        numba_flash.decode(q[..., :12], k8[..., :12], v8[..., :12], **call)
    with pytest.raises(ValueError, match="v_cache: expected a value head dim that is a multiple"):
        numba_flash.decode(q, k8, v8[..., :6], **call)
    with pytest.raises(ValueError, match="head_dim_v: expected a value head dim that is a "
                                         "multiple of 4"):
        numba_flash.decode(q, k8, None, head_dim_v=10, **call)
    with pytest.raises(ValueError, match="v_descale: expected None with v_cache=None"):
        numba_flash.decode(q, k8, None, head_dim_v=8, v_descale=kd, **call)
    with pytest.raises(ValueError, match=r"kernel: 'mma' \(the tensor-core decode\) takes "
                                         r"float16 or bfloat16 caches, or an e4m3 latent cache "
                                         r"\(got e4m3 K and V caches\)"):
        numba_flash.decode(q, k8, v8, kernel="mma", **call)
    with pytest.raises(ValueError, match=r"kernel: 'mma' .* multiples of 64"):
        numba_flash.decode(q, k8, None, head_dim_v=8, kernel="mma", **call)

    class DeviceDescale:   # a device array's interface, beside NumPy inputs
        __cuda_array_interface__ = {"shape": (1, 1), "typestr": "<f4", "data": (0, False),
                                    "version": 3}

    with pytest.raises(TypeError, match="^k_descale: expected a NumPy array with NumPy inputs"):
        numba_flash.decode(q, k8, v8, k_descale=DeviceDescale(), **call)
    with pytest.raises(TypeError, match=r"k_new: expected dtype float16 \(the dtype of q\)"):
        numba_flash.decode(q, k8, v8, k_new=k[:, :, :1].astype(np.float32),
                           v_new=v[:, :, :1].astype(np.float32), **call)
    with pytest.raises(TypeError, match="k_new: expected dtype in"):
        numba_flash.append_kv(k8, v8, k[:, :, :1].astype(np.float64), v[:, :, :1], lens)
    with pytest.raises(TypeError, match=r"v_new: expected dtype float32 \(the dtype of k_new\)"):
        numba_flash.append_kv(k8, v8, k[:, :, :1], v[:, :, :1].astype(np.float64), lens)
    assert np.array_equal(k8.view(np.uint8), k_bytes)   # inputs untouched


@pytest.mark.parametrize("dtype, d, d_v, hkv, nq, num_splits, paged", [
    (np.float16, 48, 32, 2, 1, 2, True),          # GQA 2:1, shuffled pages, two splits
    (np.float32, 80, 64, 1, 2, None, False),      # two causal tokens, contiguous
    (ml_dtypes.bfloat16, 576, 512, 1, 1, 1, True)])   # DeepSeek's latent: 512 + 64
def test_mla_latent_e4m3_cache(rng, dtype, d, d_v, hkv, nq, num_splits, paged):
    """MLA's absorbed decode over an e4m3 latent cache (v_cache=None) on the SIMT kernel (the
    tensor-core one: test_mla_decode.py): K is the row, V its first d_v columns, both scaled by
    k_descale; head dims that are no power of two take the 32-bit word loads (4 e4m3 a word,
    zero past d)."""
    b, h = 2, 2 * hkv
    lens = np.array([int(rng.integers(1, 30)), 37])
    if paged:
        k, _, table = paged_cache(rng, b, hkv, d, lens, 8, np.float32)   # NaN slots and pages
    else:
        k, _ = contiguous_cache(rng, b, hkv, 40, d, lens, np.float32)
        table = None
    k8 = k.astype(E4M3)
    kd, _ = descales(rng, b, hkv)
    q = randn(rng, (b, h, nq, d), np.float32, scale=d ** -0.25 * 2).astype(dtype)
    o, lse = numba_flash.decode(q, k8, None, head_dim_v=d_v, cache_seqlens=lens,
                                block_table=table, causal=nq > 1, num_splits=num_splits,
                                return_lse=True, k_descale=kd, kernel="simt")
    assert o.shape == (b, h, nq, d_v) and o.dtype == np.dtype(dtype)
    if paged:   # a page serves one sequence: dequantise each after its gather
        kk = np.stack([_pad(ref.gather_paged(k8, table, n, i), 37) for i, n in enumerate(lens)])
        kk = kk * kd[:, :, None, None]
    else:
        kk = ref.dequantize(k8, kd)
    want_o, want_lse = ref.paged_decode(q.astype(np.float64), kk, kk[..., :d_v], lens,
                                        causal=nq > 1)
    tol = np.float16 if dtype != np.float32 else np.float32
    assert_close(o.astype(np.float64), want_o, tol, scale=4.0 if dtype != np.float32 else 1.0,
                 name="o")
    assert_close(lse, want_lse, np.float32, name="lse")


def test_own_value_width_and_head_dims_not_powers_of_two(rng):
    """A v_cache of its own width (d = 96, d_v = 40: word loads, neither a power of two), two
    causal tokens, a sink: against the float64 decode of the dequantised caches."""
    b, h, hkv, d, d_v = 2, 4, 2, 96, 40
    lens = np.array([17, 33])
    k, _ = contiguous_cache(rng, b, hkv, 40, d, lens, np.float32)
    _, v = contiguous_cache(rng, b, hkv, 40, d_v, lens, np.float32)
    k8, v8 = fp8_caches(k, v)
    kd, vd = descales(rng, b, hkv)
    sink = rng.standard_normal(h).astype(np.float32)
    q = randn(rng, (b, h, 2, d), np.float32)
    o, lse = numba_flash.decode(q, k8, v8, cache_seqlens=lens, causal=True, return_lse=True,
                                k_descale=kd, v_descale=vd, learnable_sink=sink, num_splits=2)
    want_o, want_lse = reference(q, k8, v8, kd, vd, lens, causal=True, learnable_sink=sink)
    assert o.shape == (b, h, 2, d_v)
    assert_close(o, want_o, np.float32, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")


def check_e4m3_append(k8, v8, before_k, before_v, want_k, want_v, lens, table, page):
    """After an append of ``want_k`` / ``want_v`` (e4m3 ``[B, Hkv, Nnew, d]``) into paged
    e4m3 caches at ``lens``: each new token's slot holds its bytes, every other byte is as in
    ``before_k`` / ``before_v``."""
    written = np.zeros(k8.shape[:3], bool)
    for i in range(want_k.shape[0]):
        for j in range(want_k.shape[2]):
            t = lens[i] + j
            blk, slot = table[i, t // page], t % page
            written[blk, :, slot] = True
            assert np.array_equal(k8[blk, :, slot].view(np.uint8), want_k[i, :, j].view(np.uint8))
            assert np.array_equal(v8[blk, :, slot].view(np.uint8), want_v[i, :, j].view(np.uint8))
    assert np.array_equal(k8.view(np.uint8)[~written], before_k.view(np.uint8)[~written])
    assert np.array_equal(v8.view(np.uint8)[~written], before_v.view(np.uint8)[~written])


def _quantised(x, descale):
    """The host's e4m3 of ``x / descale[b, kvh]`` (float32 division, then the saturating
    round to nearest even of kernels/ptx/fp8.py), as e4m3 values."""
    from numba_flash.kernels.ptx.fp8 import float_to_e4m3_bits

    scaled = x.astype(np.float32) / descale[:, :, None, None]
    return float_to_e4m3_bits(scaled.astype(np.float32)).view(E4M3)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
def test_append_rounds_new_tokens_into_e4m3(rng, dtype):
    """append_kv into a paged e4m3 cache: the new slots hold exactly the e4m3 of x / descale
    (values past 448 * descale saturate), every other byte is untouched."""
    b, hkv, d, nnew = 2, 2, 16, 3
    lens = np.array([5, 12])
    k, v, table = paged_cache(rng, b, hkv, d, lens + nnew, 4, np.float32, poison=False)
    k8, v8 = fp8_caches(k, v)
    kd, vd = descales(rng, b, hkv)
    k_new = (randn(rng, (b, hkv, nnew, d), np.float32) * 500).astype(dtype)   # some saturate
    v_new = randn(rng, (b, hkv, nnew, d), np.float32).astype(dtype)
    before_k, before_v = k8.copy(), v8.copy()
    new_lens = numba_flash.append_kv(k8, v8, k_new, v_new, lens, table, k_descale=kd,
                                     v_descale=vd)
    assert new_lens.tolist() == (lens + nnew).tolist()
    check_e4m3_append(k8, v8, before_k, before_v, _quantised(k_new, kd),
                      _quantised(v_new, vd), lens, table, 4)
    assert (np.abs(k8.astype(np.float32)) == 448).any()   # the x 500 keys saturated, not NaN


def test_generation_loop_appends_and_decodes(rng):
    """Four steps of decode(k_new=, v_new=) on a contiguous e4m3 cache: each step's o is the
    float64 decode of the dequantised cache, the new token included as it was rounded."""
    b, h, hkv, d, nmax = 2, 4, 2, 16, 24
    lens = np.array([6, 11])
    k, v = contiguous_cache(rng, b, hkv, nmax, d, lens, np.float32)
    k8, v8 = fp8_caches(k, v)
    kd, vd = descales(rng, b, hkv)
    for _ in range(4):
        q = randn(rng, (b, h, d), np.float16)
        k_new = randn(rng, (b, hkv, 1, d), np.float16)
        v_new = randn(rng, (b, hkv, 1, d), np.float16)
        o = numba_flash.decode(q, k8, v8, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                               k_descale=kd, v_descale=vd)
        for i in range(b):
            assert np.array_equal(k8[i, :, lens[i]].view(np.uint8),
                                  _quantised(k_new, kd)[i, :, 0].view(np.uint8))
        lens = lens + 1
        assert_close(o, reference(q, k8, v8, kd, vd, lens)[0], np.float16, name="o")


def test_uint8_caches_with_kv_cache_dtype_fp8_e4m3(rng):
    """vLLM's kv_cache_dtype="fp8_e4m3": uint8 caches (how a device array carries e4m3) read as
    e4m3, the same bits as the float8_e4m3fn call; "auto" keeps uint8 out."""
    b, h, hkv, d = 2, 4, 2, 16
    lens = np.array([9, 21])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 4, np.float32)
    k8, v8 = fp8_caches(k, v)
    kd, vd = descales(rng, b, hkv)
    q = randn(rng, (b, h, d), np.float16)
    call = dict(cache_seqlens=lens, block_table=table, k_descale=kd, v_descale=vd)
    want = numba_flash.decode(q, k8, v8, **call)
    got = numba_flash.decode(q, k8.view(np.uint8), v8.view(np.uint8), kv_cache_dtype="fp8_e4m3",
                             **call)
    assert np.array_equal(got, want)
    with pytest.raises(TypeError, match="k_cache: expected dtype in"):
        numba_flash.decode(q, k8.view(np.uint8), v8.view(np.uint8), **call)
    with pytest.raises(ValueError, match="kv_cache_dtype: expected one of"):
        numba_flash.decode(q, k8, v8, kv_cache_dtype="fp8", **call)
    with pytest.raises(TypeError, match="k_cache: expected uint8"):
        numba_flash.decode(q, k.astype(np.float16), v.astype(np.float16),
                           kv_cache_dtype="fp8_e4m3", cache_seqlens=lens, block_table=table)


def test_append_into_uint8_caches_with_kv_cache_dtype(rng):
    b, hkv, d = 1, 1, 16
    lens = np.array([3])
    k, v = contiguous_cache(rng, b, hkv, 8, d, lens, np.float32, poison=False)
    k8, v8 = fp8_caches(k, v)
    ku, vu = k8.view(np.uint8).copy(), v8.view(np.uint8).copy()
    k_new = randn(rng, (b, hkv, 2, d), np.float16)
    numba_flash.append_kv(k8, v8, k_new, k_new, lens)
    numba_flash.append_kv(ku, vu, k_new, k_new, lens, kv_cache_dtype="fp8_e4m3")
    assert np.array_equal(ku, k8.view(np.uint8)) and np.array_equal(vu, v8.view(np.uint8))


def test_a_gpu_below_sm89_is_named_before_any_launch(rng, monkeypatch):
    """decode and append_kv with e4m3 caches on a (pretended) sm_80: a ValueError naming
    k_cache from the host checks, before a kernel is built; float16 caches never ask."""
    from numba_flash.frontend import fp8 as host_fp8

    monkeypatch.setattr(host_fp8, "on_simulator", lambda: False)
    monkeypatch.setattr(host_fp8, "cuda_cc", lambda: (8, 0))
    b, d = 1, 16
    lens = np.array([4])
    k, v = contiguous_cache(rng, b, 1, 8, d, lens, np.float32, poison=False)
    k8, v8 = fp8_caches(k, v)
    q = randn(rng, (b, 2, d), np.float16)
    match = "k_cache: an e4m3 cache needs a GPU of compute capability >= 8.9"
    with pytest.raises(ValueError, match=match):
        numba_flash.decode(q, k8, v8, cache_seqlens=lens)
    with pytest.raises(ValueError, match=match):
        numba_flash.append_kv(k8, v8, k[:, :, :1].astype(np.float16),
                              v[:, :, :1].astype(np.float16), lens)
    assert np.array_equal(k8.astype(np.float32), k.astype(E4M3).astype(np.float32))  # unwritten


def test_latent_word_loads_with_token_lists(rng):
    """The SIMT kernel's word loads over an e4m3 latent cache (d = 80) through token lists
    (-1 entries, GQA of 4 heads a list): against reference.sparse_attention of the dequantised
    cache."""
    b, h, d, d_v, nq, topk = 1, 4, 80, 64, 2, 9
    lens = np.array([30])
    k, _, table = paged_cache(rng, b, 1, d, lens, 8, np.float32)
    k8 = k.astype(E4M3)
    kd = np.array([[1.25]], np.float32)
    q = randn(rng, (b, h, nq, d), np.float32)
    lists = np.stack([rng.permutation(30)[:topk] for _ in range(nq)]).astype(np.int32)
    lists[1, :2] = -1
    o = numba_flash.decode(q, k8, None, head_dim_v=d_v, cache_seqlens=lens, block_table=table,
                           causal=True, k_descale=kd, kv_indices=lists[None, None])
    rows = _pad(ref.gather_paged(k8, table, 30, 0), 30)[None] * 1.25
    want, _ = ref.sparse_attention(q, rows, rows[..., :d_v], lists[None, None], causal=True)
    assert_close(o, want, np.float32, name="o")
