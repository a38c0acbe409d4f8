"""Kernel tier: the redesigned decode (issue 12) with the variants of issue 14 and the limits
and non-finite semantics of issue 15, against the float64 reference.

Simulator launch shape (kernels/decode/config.py): 8 threads, key groups of 4 lanes (2 per block),
2 keys per group step, at most 4 query rows per block, so these tiny shapes already cover several
key groups and splits, row chunks (GQA groups of 8), shuffles and the fused combine.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.kernels.decode import config as kdecode
from numba_flash.kernels.decode import merge as kmerge
from helpers import assert_close, randn
from test_decode_kernel import LSE_DTYPE, contiguous_cache, paged_cache

ROOT = Path(__file__).resolve().parents[2]

# Measured max abs errors over the CASES below, 6 seeds, paged and contiguous, 1-4 splits
# (2026-11-30): float32 o 2.7e-7, lse 3.7e-7; float16 o 5.4e-4 (the final float16 rounding), lse
# 3.4e-7.  helpers.atol (2e-5 for float32, 2e-3 for float16; lse held to float32) is >= 3.7x.


def same_nan(a, b):
    """NaN in exactly the same places."""
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


def check(o, lse, want_o, want_lse, dtype):
    same_nan(o, want_o)
    same_nan(lse, want_lse)
    fin = ~np.isnan(want_o)
    if fin.any():
        assert_close(o[fin], want_o[fin], dtype, name="o")
    fin = np.isfinite(want_lse)
    np.testing.assert_array_equal(lse[~fin], want_lse[~fin])  # -inf rows stay -inf
    if fin.any():
        assert_close(lse[fin], want_lse[fin], LSE_DTYPE[np.dtype(dtype).type], name="lse")


CASES = [  # (window_size, causal, softcap, alibi)
    ((3, -1), False, 0.0, False),     # sliding window, left only
    ((2, 0), False, 0.0, False),      # Mistral-style (W - 1, 0)
    ((-1, -1), True, 5.0, False),     # causal + softcap
    ((-1, -1), False, 0.0, True),     # ALiBi
    ((4, 1), True, 2.0, True),        # everything at once (causal folds right to 0)
]


@pytest.mark.parametrize("window, causal, softcap, alibi", CASES)
@pytest.mark.parametrize("paged", [False, True])
def test_variants_match_reference(rng, window, causal, softcap, alibi, paged):
    b, h, hkv, nq, d = 2, 4, 2, 2, 8
    lens = np.array([3, 30])  # the first sequence is shorter than some windows' reach
    if paged:
        k, v, table = paged_cache(rng, b, hkv, d, lens, 4, np.float32)
    else:
        k, v = contiguous_cache(rng, b, hkv, 30, d, lens, np.float32)
        table = None
    q = randn(rng, (b, h, nq, d), np.float32)
    slopes = ref.alibi_slopes(h).astype(np.float32) if alibi else None
    kw = dict(causal=causal, window_size=window, softcap=softcap, alibi_slopes=slopes)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, num_splits=3,
                                return_lse=True, **kw)
    check(o, lse, *ref.paged_decode(q, k, v, lens, table, **kw), np.float32)


def test_window_with_default_splits_and_batch_alibi(rng):
    """[B, H] slopes, a window shorter than a split, float16, the default split policy."""
    b, h, hkv, d = 3, 4, 1, 16
    lens = np.array([40, 7, 25])
    k, v = contiguous_cache(rng, b, hkv, 40, d, lens, np.float16)
    q = randn(rng, (b, h, d), np.float16)
    slopes = rng.uniform(0.05, 0.5, (b, h)).astype(np.float32)
    kw = dict(window_size=(5, -1), alibi_slopes=slopes)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, return_lse=True, **kw)
    check(o, lse, *ref.paged_decode(q, k, v, lens, **kw), np.float16)


@pytest.mark.parametrize("h, hkv, nq", [(8, 1, 1), (8, 2, 3), (6, 2, 1)])
def test_gqa_groups_and_row_chunks(rng, h, hkv, nq):
    """Groups of 8 rows (two chunks of 4 in the simulator), 12 rows (3 chunks), 3 rows (one
    chunk with a padded row): every query head of a group served by its kv head."""
    b, d = 2, 8
    lens = np.array([17, 9])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 8, np.float32)
    q = randn(rng, (b, h, nq, d), np.float32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                return_lse=True)
    check(o, lse, *ref.paged_decode(q, k, v, lens, table, causal=True), np.float32)


# -- non-finite semantics (issue 15) ---------------------------------------------------------
def test_nonfinite_keys_values_and_queries(rng):
    b, h, hkv, d = 1, 4, 1, 8
    lens = np.array([20])
    k, v = contiguous_cache(rng, b, hkv, 24, d, lens, np.float32)
    q = randn(rng, (b, h, 2, d), np.float32)
    k[0, 0, 3, 1] = np.nan         # a key every row sees without a window
    v[0, 0, 7, 5] = np.inf         # column 5 of every row that sees key 7
    q[0, 2, 1, 0] = np.inf         # one query row
    for window in ((-1, -1), (6, -1)):  # with the window no row sees keys 3 or 7
        kw = dict(window_size=window, causal=True)
        o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=2, return_lse=True,
                                    **kw)
        want_o, want_lse = ref.paged_decode(q, k, v, lens, **kw)
        np.testing.assert_array_equal(np.isfinite(o), np.isfinite(want_o))
        same_nan(lse, want_lse)
        fin = np.isfinite(want_o)
        if fin.any():
            assert_close(o[fin], want_o[fin], np.float32)
    assert np.isfinite(o[0, 0]).all() and np.isnan(o[0, 2, 1]).all()  # the windowed call


def test_row_that_sees_no_key(rng):
    """Nq > L (the first rows see no key): o = 0 and lse = -inf, not NaN."""
    k, v = contiguous_cache(rng, 1, 1, 8, 8, [2], np.float32)
    q = randn(rng, (1, 2, 4, 8), np.float32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=np.array([2]), causal=True,
                                num_splits=2, return_lse=True)
    assert (o[:, :, :2] == 0).all() and (lse[:, :, :2] == -np.inf).all()
    check(o, lse, *ref.paged_decode(q, k, v, [2], causal=True), np.float32)


# -- no host validation: the kernel checks what it dereferences -------------------------------
def _count_module():
    spec = importlib.util.spec_from_file_location("io_count", ROOT / "docs/examples/io_count.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("io_count", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("bad_entry", [-1, "num_blocks"])
def test_bad_table_entry_gives_nan_and_is_never_read(rng, bad_entry):
    b, h, hkv, d, bs = 3, 2, 1, 8, 4
    lens = np.array([10, 13, 5])
    k, v, table = paged_cache(rng, b, hkv, d, lens, bs, np.float32, poison=False)
    q = randn(rng, (b, h, d), np.float32)
    good = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table)
    bad = table.copy()
    bad[1, 2] = k.shape[0] if bad_entry == "num_blocks" else -1
    with pytest.raises(ValueError, match=r"block_table: .* at \[1, 2\]"):
        numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=bad)  # validate=True
    count = _count_module().count_global_bytes
    (o, lse), launches = count(lambda: numba_flash.decode(
        q, k, v, cache_seqlens=lens, block_table=bad, validate=False, return_lse=True))
    assert np.isnan(o[1]).all() and np.isnan(lse[1]).all()
    np.testing.assert_array_equal(o[[0, 2]], good[[0, 2]])
    # every live key except the 4 of the bad block was read, once: nothing else (no block -1)
    reads = launches[0].arrays["k_cache"]["read"]
    assert reads == (lens.sum() - bs) * hkv * d * 4


def test_bad_lengths_without_validation(rng):
    """A length past the capacity or negative gives NaN; 0 gives o = 0, lse = -inf; no read
    outside the cache (the simulator would raise IndexError)."""
    k, v = contiguous_cache(rng, 4, 1, 6, 8, [6] * 4, np.float32, poison=False)
    q = randn(rng, (4, 2, 8), np.float32)
    lens = np.array([6, 7, -3, 0])
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, validate=False, return_lse=True)
    assert_close(o[0], ref.paged_decode(q[:1], k[:1], v[:1], [6])[0][0], np.float32)
    assert np.isnan(o[1:3]).all() and np.isnan(lse[1:3]).all()
    assert (o[3] == 0).all() and (lse[3] == -np.inf).all()


def test_uint64_lengths_error_shows_the_value_passed():
    rng = np.random.default_rng(0)
    k = randn(rng, (2, 1, 6, 8))
    with pytest.raises(ValueError, match="got 18446744073709551615 at index 1"):
        numba_flash.decode(randn(rng, (2, 2, 8)), k, k,
                           cache_seqlens=np.array([3, 2**64 - 1], np.uint64))


def test_validate_argument_is_checked():
    rng = np.random.default_rng(0)
    k = randn(rng, (1, 1, 4, 8))
    with pytest.raises(TypeError, match="validate: expected a bool"):
        numba_flash.decode(randn(rng, (1, 1, 8)), k, k, cache_seqlens=np.array([4]),
                           validate="yes")


# -- sizes and grids ---------------------------------------------------------------------------
def test_huge_num_splits_is_clamped_to_the_key_tiles(rng):
    b, h, d = 2, 2, 8
    lens = np.array([11, 30])
    k, v = contiguous_cache(rng, b, 1, 30, d, lens, np.float32)
    q = randn(rng, (b, h, d), np.float32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=10**9, return_lse=True)
    check(o, lse, *ref.paged_decode(q, k, v, lens), np.float32)
    # the grid never has more splits than STEP-key tiles of the capacity
    step = kdecode.block_step(kdecode.SIM_THREADS, kdecode.SIM_LANES, kdecode.SIM_KEYS_PER_STEP)
    target, smin = kdecode.split_policy(10**9, 1, step)
    assert kdecode.split_grid(target, smin, 30) == -(-30 // step)
    assert kdecode.split_grid(*kdecode.split_policy(10**9, 8, 16), 2**40) == kdecode.GRID_YZ_MAX


def test_grid_keeps_large_batches_in_x():
    assert kdecode.decode_grid(70000, 1, 1, 4) == (70000, 4)       # B * Hkv past 65535
    assert kdecode.decode_grid(9000, 8, 2, 65535) == (144000, 65535)
    with pytest.raises(ValueError, match="num_splits: expected 1..65535"):
        kdecode.decode_grid(1, 1, 1, 65536)
    with pytest.raises(ValueError, match="x limit"):
        kdecode.decode_grid(2**20, 2**10, 4, 1)
    assert kmerge.merge_grid(70000) == (70000,)


def test_batch_of_many_sequences_runs(rng):
    """A batch wider than a few blocks in x, each sequence one block: the fused combine's
    counters and the direct (one-split) path side by side."""
    b = 40
    lens = rng.integers(1, 9, b)
    k, v = contiguous_cache(rng, b, 1, 8, 4, lens, np.float32)
    q = randn(rng, (b, 1, 4), np.float32)
    for ns in (1, 2):
        o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=ns, return_lse=True)
        check(o, lse, *ref.paged_decode(q, k, v, lens), np.float32)


def test_split_count_invariance(rng):
    """Different split counts agree to rounding (not bitwise: the merge order changes)."""
    lens = np.array([37])
    k, v = contiguous_cache(rng, 1, 1, 37, 8, lens, np.float32)
    q = randn(rng, (1, 2, 8), np.float32)
    outs = [numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=s) for s in (1, 2, 7)]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], atol=1e-6)  # measured 1.2e-7


# -- merge_states: non-finite parts ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_nonfinite_parts(rng, dtype):
    acc = LSE_DTYPE[dtype]
    o_parts = randn(rng, (3, 4, 5), dtype)
    lse_parts = rng.standard_normal((3, 4)).astype(acc)
    lse_parts[1, 0] = np.nan        # row 0: NaN
    lse_parts[2, 1] = np.inf        # row 1: lse +inf, o NaN
    o_parts[0, 2, 3] = np.nan       # row 2: NaN in a non-empty part reaches o[2, 3] only
    lse_parts[:, 3] = [-np.inf, 0.5, -np.inf]
    o_parts[[0, 2], 3] = np.nan     # row 3: empty parts' garbage never read
    o, lse = numba_flash.merge_states(o_parts, lse_parts)
    want_o, want_lse = ref.merge_states(o_parts, lse_parts)
    assert np.isnan(lse[0]) and np.isnan(o[0]).all()
    assert lse[1] == np.inf and np.isnan(o[1]).all()
    assert np.isnan(o[2, 3]) and np.isfinite(np.delete(o[2], 3)).all()
    np.testing.assert_array_equal(o[3], o_parts[1, 3])
    same_nan(o, want_o)
    np.testing.assert_array_equal(lse[:2], want_lse[:2])
    fin = ~np.isnan(want_o)
    assert_close(o[fin], want_o[fin], dtype)


# -- GPU only: no host round trip, CUDA graph capture -----------------------------------------
@pytest.mark.gpu
def test_cupy_decode_captures_in_a_cuda_graph(rng):
    """With CuPy inputs the call only enqueues work: it records into a CUDA graph and a replay
    recomputes with new query values (a host synchronisation would fail the capture)."""
    cp = pytest.importorskip("cupy")
    b, h, hkv, d, bs = 4, 8, 2, 128, 16
    lens = np.array([100, 1, 513, 2048], np.int32)
    k, v, table = paged_cache(rng, b, hkv, d, lens, bs, np.float16)
    q = randn(rng, (b, h, d), np.float16)
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    dl, dt = cp.asarray(lens), cp.asarray(table)
    want = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        numba_flash.decode(dq, dk, dv, cache_seqlens=dl, block_table=dt)  # warm the pools
        stream.synchronize()
        stream.begin_capture()
        out = numba_flash.decode(dq, dk, dv, cache_seqlens=dl, block_table=dt)
        graph = stream.end_capture()
        q2 = randn(rng, q.shape, np.float16)
        dq[...] = cp.asarray(q2)
        graph.launch(stream)
        stream.synchronize()
    want2 = numba_flash.decode(q2, k, v, cache_seqlens=lens, block_table=table)
    np.testing.assert_array_equal(out.get(), want2)
    assert not np.array_equal(want, want2)


@pytest.mark.gpu
def test_large_batch_grid_on_device(rng):
    """B * Hkv = 70000 (past gridDim.y's 65535) on the device."""
    b, hkv, d = 35000, 2, 16
    lens = np.full(b, 3, np.int32)
    k, v = contiguous_cache(rng, b, hkv, 4, d, lens, np.float32, poison=False)
    q = randn(rng, (b, 2 * hkv, d), np.float32)
    o = numba_flash.decode(q, k, v, cache_seqlens=lens)
    assert_close(o[-5:], ref.paged_decode(q[-5:], k[-5:], v[-5:], lens[-5:])[0], np.float32)
