"""Kernel tier: ``numba_flash.append_kv`` (the cache writer) against ``reference.append_kv``.

Appending is a copy, so the caches must match the reference bitwise (every slot: the new
tokens where they belong, every other slot unchanged).  Shapes are tiny (the simulator).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import randn
from test_decode_kernel import contiguous_cache, paged_cache


def _paged_with_room(rng, b, hkv, d, lens, nnew, bs, dtype):
    """A paged cache whose table has blocks for ``lens + nnew`` tokens (stale slots NaN)."""
    k, v, table = paged_cache(rng, b, hkv, d, np.asarray(lens) + nnew, bs, dtype)
    return k, v, table


def _append_and_check(k, v, kn, vn, lens, table=None, cbi=None):
    want_k, want_v, want_lens = ref.append_kv(k, v, kn, vn, lens, table, cbi)
    assert not np.array_equal(want_k, k, equal_nan=True)  # the oracle did write something
    before = [x.copy() for x in (kn, vn, lens)] + ([table.copy()] if table is not None else [])
    new_lens = numba_flash.append_kv(k, v, kn, vn, lens, block_table=table, cache_batch_idx=cbi)
    np.testing.assert_array_equal(new_lens, want_lens)
    assert new_lens is not lens and new_lens.dtype == np.int32
    # NaN-safe bitwise comparison (stale slots stay NaN)
    np.testing.assert_array_equal(k.view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(v.view(np.uint8), want_v.view(np.uint8))
    after = [kn, vn, lens] + ([table] if table is not None else [])
    for x, y in zip(before, after):  # inputs other than the caches are unchanged
        np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("block_size", [1, 3, 8, 16])
def test_paged_append_matches_reference(rng, dtype, block_size):
    b, hkv, d, nnew = 3, 2, 5, 3
    lens = np.array([0, 7, 16], np.int32)  # empty, mid-block, on a block boundary
    k, v, table = _paged_with_room(rng, b, hkv, d, lens, nnew, block_size, dtype)
    kn, vn = randn(rng, (b, hkv, nnew, d), dtype), randn(rng, (b, hkv, nnew, d), dtype)
    _append_and_check(k, v, kn, vn, lens, table)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_contiguous_append_matches_reference(rng, dtype):
    b, hkv, nmax, d, nnew = 3, 1, 12, 8, 2
    lens = np.array([0, 5, 10], np.int32)
    k, v = contiguous_cache(rng, b, hkv, nmax, d, lens, dtype)
    kn, vn = randn(rng, (b, hkv, nnew, d), dtype), randn(rng, (b, hkv, nnew, d), dtype)
    _append_and_check(k, v, kn, vn, lens)


def test_cache_batch_idx_picks_the_rows(rng):
    b, bc, hkv, nmax, d, nnew = 2, 4, 2, 8, 4, 3
    lens = np.array([4, 1], np.int32)
    k, v = contiguous_cache(rng, bc, hkv, nmax, d, [nmax] * bc, np.float32)
    kn, vn = randn(rng, (b, hkv, nnew, d)), randn(rng, (b, hkv, nnew, d))
    _append_and_check(k, v, kn, vn, lens, cbi=np.array([3, 1], np.int32))


def test_non_contiguous_numpy_cache_is_written_in_place(rng):
    b, hkv, nmax, d = 2, 2, 6, 4
    base = randn(rng, (b, nmax, hkv, d))
    k = base.transpose(0, 2, 1, 3)  # a [B, Hkv, Nmax, d] view of a [B, Nmax, Hkv, d] array
    v = randn(rng, (b, hkv, nmax, d))
    lens = np.array([2, 3], np.int64)
    kn, vn = randn(rng, (b, hkv, 1, d)), randn(rng, (b, hkv, 1, d))
    want_k, want_v, _ = ref.append_kv(k, v, kn, vn, lens)
    new_lens = numba_flash.append_kv(k, v, kn, vn, lens)
    assert new_lens.dtype == np.int64 and list(new_lens) == [3, 4]
    np.testing.assert_array_equal(base.transpose(0, 2, 1, 3), want_k)
    np.testing.assert_array_equal(v, want_v)


def _bad_setup(rng):
    b, hkv, d, bs = 2, 1, 4, 4
    lens = np.array([3, 6], np.int32)
    k, v, table = paged_cache(rng, 6, hkv, d, [4] * 6, bs, np.float32, extra_blocks=0,
                              poison=False)
    table = np.array([[0, 1, -1], [2, 3, 5]], np.int32)   # sequence 0: room for 8 tokens
    kn, vn = randn(rng, (b, hkv, 3, d)), randn(rng, (b, hkv, 3, d))
    return k, v, kn, vn, lens, table


@pytest.mark.parametrize("case, exc, msg", [
    ("no_room", ValueError, r"block_table: no room: sequence 0 holds 10 tokens and 3 new ones "
                            r"need 4 blocks of 4 tokens, but block_table has 3 per sequence"),
    ("bad_entry", ValueError, r"block_table: expected entries in \[0, 6\) .* got 6 at \[1, 2\]"),
    ("hole", ValueError, r"block_table: expected entries .* got -1 at \[0, 2\]"),
    ("negative", ValueError, "cache_seqlens: expected every entry >= 0, got -2 at index 1"),
    ("dtype", TypeError, "k_new: expected dtype float32"),
    ("shape", ValueError, r"k_new: expected shape \[B, Hkv, Nnew, d\] = \[2, 1, Nnew, 4\]"),
    ("v_shape", ValueError, "v_new: expected shape"),
    ("lens_dtype", TypeError, "cache_seqlens: expected dtype in"),
    ("table_rows", ValueError, "block_table: expected 2 rows"),
    ("cbi_paged", ValueError, "cache_batch_idx: expected None with a paged cache"),
    ("read_only", ValueError, "k_cache: expected a writable array"),
])
def test_bad_input_raises_and_writes_nothing(rng, case, exc, msg):
    k, v, kn, vn, lens, table = _bad_setup(rng)
    kw = {}
    if case == "no_room":
        lens = np.array([10, 3], np.int32)
    elif case == "bad_entry":
        table[1, 2] = 6
    elif case == "hole":
        lens = np.array([6, 3], np.int32)  # tokens 6..8 go to block 1 and to entry [0, 2] = -1
    elif case == "negative":
        lens = np.array([3, -2], np.int32)
    elif case == "dtype":
        kn = kn.astype(np.float64)
    elif case == "shape":
        kn = vn = randn(rng, (2, 2, 3, 4))
    elif case == "v_shape":
        vn = randn(rng, (2, 1, 2, 4))
    elif case == "lens_dtype":
        lens = lens.astype(np.float32)
    elif case == "table_rows":
        table = table[:1]
    elif case == "cbi_paged":
        kw["cache_batch_idx"] = np.array([0, 1])
    elif case == "read_only":
        k.flags.writeable = False
    k0, v0 = k.copy(), v.copy()
    with pytest.raises(exc, match=msg):
        numba_flash.append_kv(k, v, kn, vn, lens, block_table=table, **kw)
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)


@pytest.mark.parametrize("case, msg", [
    ("too_small", "k_cache: too small: sequence 1 holds 5 tokens and 2 new ones do not fit in "
                  "Nmax = 6"),
    ("cbi_range", r"cache_batch_idx: expected entries in \[0, 3\) .* got 3 at index 1"),
    ("cbi_dup", "cache_batch_idx: expected distinct entries when appending .* got 2 twice"),
    ("cbi_shape", r"cache_batch_idx: expected shape \(2,\)"),
    ("batch", "k_cache: expected batch size 2 .* without cache_batch_idx, got 3"),
])
def test_bad_contiguous_input_writes_nothing(rng, case, msg):
    k, v = contiguous_cache(rng, 3, 1, 6, 4, [6] * 3, np.float32, poison=False)
    lens = np.array([1, 5 if case == "too_small" else 2], np.int32)
    kn, vn = randn(rng, (2, 1, 2, 4)), randn(rng, (2, 1, 2, 4))
    cbi = {"cbi_range": [0, 3], "cbi_dup": [2, 2], "cbi_shape": [0, 1, 2]}.get(case, [0, 1])
    cbi = None if case == "batch" else np.array(cbi, np.int32)
    k0 = k.copy()
    with pytest.raises(ValueError, match=msg):
        numba_flash.append_kv(k, v, kn, vn, lens, cache_batch_idx=cbi)
    np.testing.assert_array_equal(k, k0)


def test_unvalidated_bad_writes_are_skipped(rng):
    """validate=False (as device arrays): a token past the capacity or behind a bad table entry
    is skipped, the good ones land; nothing outside the cache is written (the simulator raises
    IndexError for a write past an array's end; a negative row would wrap silently, so the
    whole cache is compared)."""
    k, v, kn, vn, lens, table = _bad_setup(rng)
    table[1, 2] = -1          # sequence 1's third new token (position 8) has no block
    lens = np.array([7, 6], np.int32)  # sequence 0: positions 7 (ok), 8 and 9 (past 2 blocks)
    want_k, want_v = k.copy(), v.copy()
    want_k[1, :, 3], want_v[1, :, 3] = kn[0, :, 0], vn[0, :, 0]      # token 0 of seq 0: pos 7
    for i, pos in enumerate((6, 7)):                                  # seq 1: positions 6, 7
        want_k[3, :, pos - 4], want_v[3, :, pos - 4] = kn[1, :, i], vn[1, :, i]
    new_lens = numba_flash.append_kv(k, v, kn, vn, lens, block_table=table, validate=False)
    np.testing.assert_array_equal(new_lens, [10, 9])
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(v, want_v)
    # contiguous: a length past Nmax, a negative one and a bad cache_batch_idx write nothing
    kc, vc = contiguous_cache(rng, 3, 1, 4, 4, [4] * 3, np.float32, poison=False)
    kc0 = kc.copy()
    kn3, vn3 = randn(rng, (3, 1, 2, 4)), randn(rng, (3, 1, 2, 4))
    numba_flash.append_kv(kc, vc, kn3, vn3, np.array([4, -1, 0], np.int32),
                          cache_batch_idx=np.array([0, 1, 7], np.int32), validate=False)
    np.testing.assert_array_equal(kc, kc0)


@pytest.mark.gpu
def test_cupy_append_in_place(rng):
    cp = pytest.importorskip("cupy")
    b, hkv, d, bs, nnew = 3, 2, 64, 16, 5
    lens = np.array([0, 17, 40], np.int32)
    k, v, table = _paged_with_room(rng, b, hkv, d, lens, nnew, bs, np.float16)
    kn, vn = randn(rng, (b, hkv, nnew, d), np.float16), randn(rng, (b, hkv, nnew, d), np.float16)
    want_k, want_v, want_lens = ref.append_kv(k, v, kn, vn, lens, table)
    dk, dv = cp.asarray(k), cp.asarray(v)
    new = numba_flash.append_kv(dk, dv, cp.asarray(kn), cp.asarray(vn), cp.asarray(lens),
                                block_table=cp.asarray(table))
    assert isinstance(new, cp.ndarray)
    np.testing.assert_array_equal(new.get(), want_lens)
    np.testing.assert_array_equal(dk.get().view(np.uint16), want_k.view(np.uint16))
    np.testing.assert_array_equal(dv.get().view(np.uint16), want_v.view(np.uint16))
