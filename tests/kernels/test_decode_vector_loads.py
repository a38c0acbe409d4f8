"""Kernel tier: decode's 16-byte path (issue 22 item 1).  When the head dim fills the compiled
tile (``d == HEAD_DIM``) every lane reads its chunk of a q / K / V row with one 16-byte load
(:func:`numba_flash.kernels.ptx.stages.load16`); the simulator takes that path when a lane's chunk
is 16 bytes: float16 d = 32, float32 d = 16, float64 d = 8 (4 lanes per key group).

Each test counts the 16-byte loads the kernel issues (a wrapper around the twin) so that it
fails if the path is not taken, and checks the result against the float64 reference with the
NaN rules of tests/kernels/test_decode_variants.py.  Tolerances: helpers.atol (float16 2e-3,
float32 2e-5, float64 1e-12); measured max errors on these cases, 4 seeds: float16 o 4.9e-4,
float32 o 2.4e-7, float64 o 4.4e-16, lse within the float32 / float64 bound at 1e-6 / 1e-15.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.kernels.decode import config as dconfig
from numba_flash.kernels.decode import split_kv as kdecode
from helpers import assert_close, randn
from test_decode_kernel import contiguous_cache, paged_cache
from test_decode_variants import check

VEC_D = {np.float16: 32, np.float32: 16, np.float64: 8}  # 16-byte chunks of 4 lanes


@pytest.fixture
def load16_calls(monkeypatch):
    """Count the kernel's 16-byte loads (the twin still does the reading)."""
    calls = []
    twin = kdecode.load16

    def counted(src, elem):
        calls.append(int(elem))
        return twin(src, elem)

    monkeypatch.setattr(kdecode, "load16", counted)
    return calls


def test_launch_shape_reads_16_bytes_per_lane():
    """The GPU layout: a lane's chunk is 16 bytes, a float16 d = 128 row is 16 lanes (two keys
    per warp instruction), float32 32 lanes of 4, float64 32 lanes of 2 chunks of 2."""
    assert dconfig.lane_layout(np.float16, 128, simulator=False) == (16, 8)
    assert dconfig.lane_layout(np.float32, 128, simulator=False) == (32, 4)
    assert dconfig.lane_layout(np.float64, 128, simulator=False) == (32, 2)
    assert dconfig.lane_layout(np.float16, 16, simulator=False) == (2, 8)
    assert dconfig.gpu_rows_max(np.float16, 128) == 4   # a GQA-4 group in one block


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("paged", [False, True])
def test_vector_path_matches_reference(rng, load16_calls, dtype, paged):
    """GQA group 2 x Nq 2 (4 rows), two sequences, several splits, block size 3 (slots carry
    across table entries inside a step), stale slots NaN."""
    b, h, hkv, nq, d = 2, 4, 2, 2, VEC_D[dtype]
    lens = np.array([5, 21])
    if paged:
        k, v, table = paged_cache(rng, b, hkv, d, lens, 3, dtype)
    else:
        k, v = contiguous_cache(rng, b, hkv, 21, d, lens, dtype)
        table = None
    q = randn(rng, (b, h, nq, d), dtype)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                num_splits=3, return_lse=True)
    check(o, lse, *ref.paged_decode(q, k, v, lens, table, causal=True), dtype)
    # every lane of group 0 reads its q chunk of each live row, and K and V of its keys
    assert len(load16_calls) > 0 and all(e % (16 // np.dtype(dtype).itemsize) == 0
                                         for e in load16_calls)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # inf q x 0 in the twins
def test_vector_path_variants_and_nonfinite(rng, load16_calls):
    """Window + softcap + ALiBi (splits at the band's edge take the per-row rule), a NaN key,
    an inf value and an inf query, float16 paged: torch's NaN semantics on the 16-byte path."""
    b, h, hkv, nq, d = 1, 4, 1, 2, 32
    lens = np.array([26])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 4, np.float16)
    q = randn(rng, (b, h, nq, d), np.float16)
    t_k, t_v = 3, 20            # table positions of a NaN key and an inf value
    k[table[0, t_k // 4], 0, t_k % 4, 1] = np.nan
    v[table[0, t_v // 4], 0, t_v % 4, 5] = np.inf
    q[0, 2, 1, 0] = np.inf
    slopes = ref.alibi_slopes(h).astype(np.float32)
    for window in ((-1, -1), (6, 0)):   # with the window no row sees key 3
        kw = dict(window_size=window, softcap=4.0, alibi_slopes=slopes)
        o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                    num_splits=2, return_lse=True, **kw)
        want_o, want_lse = ref.paged_decode(q, k, v, lens, table, **kw)
        # an inf value makes o[.., 5] non-finite (documented: not necessarily NaN)
        np.testing.assert_array_equal(np.isfinite(o), np.isfinite(want_o))
        fin = np.isfinite(want_o)
        if fin.any():                   # without the window the NaN key reaches every row
            assert_close(o[fin], want_o[fin], np.float16)
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
        fin = np.isfinite(want_lse)
        if fin.any():
            assert_close(lse[fin], want_lse[fin], np.float32)
    assert np.isnan(o[0, 2, 1]).all() and np.isfinite(o[0, 0, :, :5]).all()  # windowed call
    assert load16_calls


def test_vector_path_bad_table_entry_gives_nan(rng, load16_calls):
    """Without host validation a bad table entry of a live key makes the sequence NaN, reads
    only inside the cache (every 16-byte load lands inside it), and leaves the other sequence
    exact."""
    b, h, hkv, d = 2, 2, 1, 32
    lens = np.array([9, 14])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 4, np.float16)
    q = randn(rng, (b, h, d), np.float16)
    bad = table.copy()
    bad[0, 1] = k.shape[0] + 5
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=bad, validate=False,
                                num_splits=2, return_lse=True)
    assert np.isnan(o[0]).all() and np.isnan(lse[0]).all()
    want_o, want_lse = ref.paged_decode(q[1:], k, v, lens[1:], table[1:])
    check(o[1:], lse[1:], want_o, want_lse, np.float16)
    rows = k.shape[0] * hkv * 4
    assert all(0 <= e < rows * d for e in load16_calls)
