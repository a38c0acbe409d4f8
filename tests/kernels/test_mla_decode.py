"""MLA's absorbed decode on tensor cores (numba_flash/kernels/decode/mla.py): what
``decode(q, latent, None, head_dim_v=...)`` runs for float16 / bfloat16 latent caches whose head
dims are multiples of 64.  Against the float64 reference on the cache and its first ``d_v``
columns, outputs NaN-poisoned (conftest), at the decode tests' bounds (helpers.atol).

DeepSeek's 576 / 512 runs in test_value_head_dim.py; here smaller head dims (128 / 64: the same
code, fewer k-steps) keep the simulator quick: several query tokens (causal), GQA groups past 16
heads (two blocks of heads, the second half empty), a left pad, non-finite values where no row
looks and where one does, bad table entries, and the kernel choice.
"""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16, float8_e4m3fn

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn
from test_decode_kernel import contiguous_cache, paged_cache


def dequantised_rows(k8, kd, table, lens):
    """The float64 latent rows each sequence sees: its keys gathered through its table row
    (contiguous: its own rows) times its descale, zeros past its length."""
    n = int(max(lens))
    out = np.zeros((len(lens), k8.shape[1], n, k8.shape[3]))
    for i, m in enumerate(lens):
        rows = ref.gather_paged(k8, table, m, i) if table is not None else k8[i, :, :m]
        out[i, :, :m] = rows.astype(np.float64) * kd[i][:, None, None]
    return out


def latent_decode(q, cache, d_v, lens, table, **kw):
    return numba_flash.decode(q, cache, None, head_dim_v=d_v, cache_seqlens=lens,
                              block_table=table, return_lse=True, kernel="mma", **kw)


@pytest.mark.parametrize("dtype, b, h, hkv, nq, num_splits", [
    (np.float16, 1, 18, 1, 2, 2),      # two blocks of heads (16 + 2), two causal tokens
    (bfloat16, 2, 4, 2, 1, 3)])        # GQA, three splits
def test_tokens_heads_and_splits(rng, dtype, b, h, hkv, nq, num_splits):
    """Page size 16 with pages crossed, stale slots NaN, causal, merged splits."""
    from helpers import assert_scaled_close
    d, d_v = 128, 64
    lens = np.array([37, 5][:b])
    k, _, table = paged_cache(rng, b, hkv, d, lens, 16, np.float16)
    k = k.astype(dtype)
    q = randn(rng, (b, h, nq, d), np.float16, scale=0.3).astype(dtype)
    o, lse = latent_decode(q, k, d_v, lens, table, causal=True, num_splits=num_splits)
    want_o, want_lse = ref.paged_decode(q, k, k[..., :d_v], lens, table, causal=True)
    assert o.shape == (b, h, nq, d_v) and o.dtype == dtype
    if dtype == np.float16:
        assert_close(o, want_o, np.float16, name="o")
    else:   # test_mma_forward.py's bfloat16 bound
        assert_scaled_close(np.asarray(o, np.float64), want_o, 1.6e-2, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")


def test_left_pad_window_and_non_finite_keys(rng):
    """cache_leftpad (keys before it are not the sequence's: NaN there never leaks), a window,
    a NaN in a key that the second token sees but the first does not (causal): only the second
    token's rows are NaN; against the reference on the keys [pad, L)."""
    b, h, d, d_v = 1, 4, 64, 64
    lens, pad = np.array([40]), np.array([6])
    k, _ = contiguous_cache(rng, b, 1, 48, d, lens, np.float16)
    k[0, 0, :6] = np.nan                        # before the pad: never read
    k[0, 0, 39, 3] = np.nan                     # the last key: only token 1 sees it
    q = randn(rng, (b, h, 2, d), np.float16, scale=0.3)
    o, lse = latent_decode(q, k, d_v, lens, None, causal=True, window_size=(20, 0),
                           cache_leftpad=pad, num_splits=1)
    want_o, want_lse = ref.paged_decode(q, k[:, :, 6:], k[:, :, 6:, :d_v],
                                        lens - pad, None, causal=True, window_size=(20, 0))
    assert np.isnan(want_o[:, :, 1]).all() and np.isfinite(want_o[:, :, 0]).all()
    assert np.isnan(o[:, :, 1]).all() and np.isnan(lse[:, :, 1]).all()
    assert_close(o[:, :, 0], want_o[:, :, 0], np.float16, name="o")
    assert_close(lse[:, :, 0], want_lse[:, :, 0], np.float32, name="lse")


def test_bad_entries_and_lengths_are_nan_and_read_nothing(rng):
    """validate=False: a table entry past the cache that only the second of two causal tokens
    reads makes the whole sequence NaN (both tokens, as the SIMT decode), a length past the
    capacity too; a sequence of length 0 gets o = 0 and lse = its sink; the fourth is right
    (the kernel checks every entry and length before it reads)."""
    b, h, d, d_v = 4, 4, 64, 64
    lens = np.array([17, 30, 0, 20])
    k, _, table = paged_cache(rng, b, 1, d, lens, 16, np.float16)
    bad = table.copy()
    bad[0, 1] = 10_000                          # key 16: token 1 sees it, token 0 does not
    bad_lens = lens.copy()
    bad_lens[1] = 10_000
    q = randn(rng, (b, h, 2, d), np.float16, scale=0.3)
    sink = np.array([0.5, 1.0, -1.0, 2.0], np.float32)
    for splits in (1, 2):
        o, lse = latent_decode(q, k, d_v, bad_lens, bad, causal=True, validate=False,
                               num_splits=splits, learnable_sink=sink if splits == 2 else None)
        assert np.isnan(o[:2]).all() and np.isnan(lse[:2]).all(), splits
        np.testing.assert_array_equal(o[2], 0)
        np.testing.assert_array_equal(lse[2], np.broadcast_to(
            sink[:, None] if splits == 2 else -np.inf, (h, 2)))
        want_o, want_lse = ref.paged_decode(q[3:], k, k[..., :d_v], lens[3:], table[3:],
                                            causal=True,
                                            learnable_sink=sink if splits == 2 else None)
        assert_close(o[3:], want_o, np.float16, name="o")
        assert_close(lse[3:], want_lse, np.float32, name="lse")


@pytest.mark.parametrize("kw, words", [
    (dict(kernel="mma", dtype=np.float32), "float16 or bfloat16"),
    (dict(kernel="mma", d=72), "multiples of 64"),
    (dict(kernel="mma", softcap=5.0), "no softcap"),
    (dict(kernel="warp"), "one of ('auto', 'simt', 'mma')"),
])
def test_kernel_choice_is_named(rng, kw, words):
    d = kw.pop("d", 64)
    dtype = kw.pop("dtype", np.float16)
    k = np.zeros((1, 1, 8, d), dtype)
    q = np.zeros((1, 2, d), dtype)
    with pytest.raises(ValueError, match="^kernel: ") as info:
        numba_flash.decode(q, k, None, head_dim_v=64, cache_seqlens=np.array([3]), **kw)
    assert words in str(info.value)
    e4m3 = np.zeros((1, 1, 8, 64), float8_e4m3fn)
    with pytest.raises(ValueError, match="^kernel: 'mma'.*e4m3"):
        numba_flash.decode(np.zeros((1, 2, 64), np.float16), e4m3, e4m3,
                           cache_seqlens=np.array([3]), kernel="mma")


@pytest.mark.parametrize("dtype, h, hkv, nq, num_splits, d, d_v", [
    (np.float16, 18, 1, 2, 2, 128, 64),     # two blocks of heads, two causal tokens, one warp
    (np.float16, 4, 1, 1, 2, 192, 128),     # four warps, 12 chunks a row over 8 threads
    (bfloat16, 4, 2, 1, 3, 256, 128)])      # GQA, three splits, four warps
def test_e4m3_latent_cache_on_tensor_cores(rng, dtype, h, hkv, nq, num_splits, d, d_v):
    """An e4m3 latent cache (k_descale != 1): each tile's bytes copied into a stage, widened
    into the 16-bit tile the GEMMs read; shuffled pages of 16 with NaN slots and spare pages
    (never read), causal, merged splits; against the float64 decode of the dequantised cache,
    and the SIMT kernel's answer within the same bounds."""
    from helpers import assert_scaled_close
    b = 2
    lens = np.array([37, 5])
    k, _, table = paged_cache(rng, b, hkv, d, lens, 16, np.float32)
    k8 = k.astype(float8_e4m3fn)
    kd = rng.uniform(0.25, 2.0, (b, hkv)).astype(np.float32)
    q = randn(rng, (b, h, nq, d), np.float32, scale=0.3).astype(dtype)
    o, lse = latent_decode(q, k8, d_v, lens, table, causal=True, num_splits=num_splits,
                           k_descale=kd)
    assert o.shape == (b, h, nq, d_v) and o.dtype == dtype
    rows = dequantised_rows(k8, kd, table, lens)
    want_o, want_lse = ref.paged_decode(q.astype(np.float64), rows, rows[..., :d_v], lens,
                                        causal=True)
    if dtype == np.float16:
        assert_close(o, want_o, np.float16, name="o")
    else:   # P rounded to bfloat16, as the 16-bit build
        assert_scaled_close(np.asarray(o, np.float64), want_o, 1.6e-2, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    call = dict(head_dim_v=d_v, cache_seqlens=lens, block_table=table, causal=True,
                num_splits=num_splits, k_descale=kd)
    auto = numba_flash.decode(q, k8, None, **call)
    assert np.array_equal(np.asarray(auto).view(np.uint16), np.asarray(o).view(np.uint16))
    simt = numba_flash.decode(q, k8, None, kernel="simt", **call)   # the other kernel's answer
    assert_close(np.asarray(simt, np.float64), want_o, np.float16, name="o (simt)",
                 scale=1.0 if dtype == np.float16 else 4.0)   # (bfloat16 o: test_decode_fp8's)


def test_e4m3_latent_cache_with_token_lists_on_tensor_cores(rng):
    """DeepSeek V3.2's sparse MLA over an e4m3 latent cache: each query token's listed keys
    (-1 entries, one past its causal edge) gathered as bytes through their pages and widened;
    against reference.sparse_attention of the dequantised cache."""
    b, h, d, d_v, nq, topk = 1, 8, 64, 64, 2, 20
    lens = np.array([45])
    k, _, table = paged_cache(rng, b, 1, d, lens, 16, np.float32)
    k8 = k.astype(float8_e4m3fn)
    kd = np.array([[0.75]], np.float32)
    q = randn(rng, (b, h, nq, d), np.float32, scale=0.3).astype(np.float16)
    lists = np.stack([rng.permutation(45)[:topk] for _ in range(nq)]).astype(np.int32)
    lists[0, :3] = -1
    lists[0, 3] = 44                            # past token 0's causal edge (column 43)
    lists = lists[None, None]
    o = numba_flash.decode(q, k8, None, head_dim_v=d_v, cache_seqlens=lens, block_table=table,
                           causal=True, k_descale=kd, kv_indices=lists, kernel="mma")
    rows = dequantised_rows(k8, kd, table, lens)
    want, _ = ref.sparse_attention(q, rows, rows[..., :d_v], lists, causal=True)
    assert_close(o, want, np.float16, name="o")


@pytest.mark.parametrize("e4m3", [False, True])
def test_latent_generation_loop_appends_and_decodes(rng, e4m3):
    """MLA's generation loop: append_kv(latent, None, row, None) writes each new token's whole
    latent row (e4m3: the saturating rounding of x / k_descale, tests/kernels/test_decode_fp8's
    rule), then the tensor-core decode reads it; three steps against the float64 decode of the
    cache as written, every other slot untouched."""
    from test_decode_fp8 import _quantised
    b, h, d, d_v = 2, 4, 128, 64
    lens = np.array([5, 14])
    k, _, table = paged_cache(rng, b, 1, d, lens + 3, 8, np.float32, poison=False)
    cache = k.astype(float8_e4m3fn if e4m3 else np.float16)
    kd = np.array([[0.5], [1.5]], np.float32) if e4m3 else None
    for _ in range(3):
        row = randn(rng, (b, 1, 1, d), np.float16)
        before = cache.copy()
        new_lens = numba_flash.append_kv(cache, None, row, None, lens, table, k_descale=kd)
        assert new_lens.tolist() == (lens + 1).tolist()
        want_row = _quantised(row, kd) if e4m3 else row
        written = np.zeros(cache.shape[:3], bool)
        for i in range(b):
            blk, slot = table[i, lens[i] // 8], lens[i] % 8
            written[blk, :, slot] = True
            assert np.array_equal(cache[blk, :, slot].view(np.uint8),
                                  want_row[i, :, 0].view(np.uint8))
        assert np.array_equal(cache.view(np.uint8)[~written], before.view(np.uint8)[~written])
        lens = new_lens
        q = randn(rng, (b, h, d), np.float16, scale=0.3)
        o = numba_flash.decode(q, cache, None, head_dim_v=d_v, cache_seqlens=lens,
                               block_table=table, k_descale=kd)
        rows = dequantised_rows(cache, kd if e4m3 else np.ones((b, 1), np.float32), table, lens)
        want, _ = ref.paged_decode(q, rows, rows[..., :d_v], lens)
        assert_close(o, want, np.float16, name="o")
    with pytest.raises(ValueError, match="^v_new: expected None with v_cache=None"):
        numba_flash.append_kv(cache, None, row, row, lens, table)
