"""The global-memory counter against the models, byte for byte."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash.teach.ops.naive_forward import naive_forward
from helpers import randn
from io_count import (count_global_bytes, decode_kv_bytes, naive_forward_bytes,
                      softmax_kernel_bytes, standard_attention_bytes, tiled_forward_bytes)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_softmax_kernel_reads_x_twice_writes_y_once(rng, dtype):
    x = randn(rng, (3, 21), dtype)
    y, (rec,) = count_global_bytes(lambda: numba_flash.softmax(x))
    assert rec.kernel == "softmax_rows" and rec.grid == (3,)
    item = np.dtype(dtype).itemsize
    model = softmax_kernel_bytes(3, 21, item)
    assert rec.arrays["x"]["read"] == model["read"] and rec.arrays["x"]["written"] == 0
    assert rec.arrays["y"]["written"] == model["written"] and rec.arrays["y"]["read"] == 0
    assert rec.arrays["x"]["distinct_read"] == 3 * 21 * item  # every element, no more
    assert not np.isnan(y).any()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 8, 8, 4), (2, 4, 2, 5, 9, 3), (1, 2, 1, 9, 4, 2)])
def test_naive_forward_traffic_matches_model(rng, shape, causal):
    b, h, hkv, nq, nk, d = shape
    q = randn(rng, (b, h, nq, d), np.float32)
    k = randn(rng, (b, hkv, nk, d), np.float32)
    v = randn(rng, (b, hkv, nk, d), np.float32)
    _, (rec,) = count_global_bytes(lambda: naive_forward(q, k, v, causal=causal))
    model = naive_forward_bytes(b, h, nq, nk, d, 4, 4, causal)
    assert (rec.read, rec.written) == (model["read"], model["written"])
    assert rec.arrays["o"]["distinct_written"] == q.nbytes  # every output element written ...
    assert rec.arrays["o"]["written"] == q.nbytes  # ... exactly once


def test_counter_sees_a_kernel_that_reads_more():
    """Not vacuous: the count grows with Nk for fixed output size (no reuse in the naive kernel)."""
    rng = np.random.default_rng(0)
    q = randn(rng, (1, 1, 4, 4), np.float32)
    reads = []
    for nk in (4, 8):
        k = randn(rng, (1, 1, nk, 4), np.float32)
        _, (rec,) = count_global_bytes(lambda: naive_forward(q, k, k))
        reads.append(rec.arrays["k"]["read"])
    assert reads[1] == 2 * reads[0]


def test_models_asymptotics():
    # tiled K/V traffic is the naive traffic divided by BLOCK_M (one K/V pass per Q tile, not
    # per row); standard attention's N^2 terms dominate its Nd terms
    n, d = 1024, 64
    naive = naive_forward_bytes(1, 1, n, n, d, 2, 4)
    tiled = tiled_forward_bytes(1, 1, n, n, d, 128, 64, 2, 4)
    kv_naive = naive["read"] - n * d * 2
    kv_tiled = tiled["read"] - n * d * 2
    assert kv_naive == 128 * kv_tiled
    std = standard_attention_bytes(n, n, d, 2)
    assert std["read"] + std["written"] == (4 * n * n + 4 * n * d) * 2
    causal = tiled_forward_bytes(1, 1, n, n, d, 128, 64, 2, 4, causal=True)
    assert causal["read"] < 0.6 * tiled["read"]


@pytest.mark.parametrize("nq, nk, d, bm, bn, causal, dtype", [
    (32, 32, 16, 8, 8, False, np.float32), (32, 32, 16, 16, 8, True, np.float32),
    (20, 37, 12, 8, 16, True, np.float16), (9, 40, 5, 16, 8, True, np.float64),
])
def test_tiled_forward_traffic_matches_model(rng, nq, nk, d, bm, bn, causal, dtype):
    """numba_flash.forward: Q read once, K/V once per Q tile (fewer past the diagonal), O and lse
    written once, byte for byte the model's count (GQA: each query head reads its kv head)."""
    b, h, hkv = 2, 4, 2
    q = randn(rng, (b, h, nq, d), dtype)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d), dtype)
    _, launches = count_global_bytes(
        lambda: numba_flash.forward(q, k, v, causal=causal, block_m=bm, block_n=bn))
    rec = next(r for r in launches if {"q", "k", "v"} <= set(r.arrays))
    a = rec.arrays
    item = np.dtype(dtype).itemsize
    model = tiled_forward_bytes(b, h, nq, nk, d, bm, bn, item, 8 if item == 8 else 4, causal)
    assert a["q"]["read"] == q.nbytes
    assert a["q"]["read"] + a["k"]["read"] + a["v"]["read"] == model["read"]
    assert a["o"]["written"] + a["lse"]["written"] == model["written"]
    assert a["k"]["read"] < h // hkv * k.nbytes * nq  # fewer than one K pass per query row


@pytest.mark.parametrize("h, hkv, chunks", [(4, 4, 1), (8, 2, 1), (8, 1, 2)])
def test_decode_reads_kv_once_per_gqa_group(rng, h, hkv, chunks):
    from numba_flash.kernels.decode.config import SIM_BLOCK_M
    assert -(-(h // hkv) // SIM_BLOCK_M) == chunks
    seqlens = np.array([5, 37, 20], np.int32)
    d, bs = 8, 4
    live = -(-seqlens // bs)
    kc = randn(rng, (int(live.sum()), hkv, bs, d), np.float32)
    table = np.full((3, 10), -1, np.int32)
    perm = rng.permutation(int(live.sum())).astype(np.int32)  # scrambled physical blocks
    start = np.concatenate([[0], np.cumsum(live)])
    for b in range(3):
        table[b, : live[b]] = perm[start[b]: start[b + 1]]
    q = randn(rng, (3, h, d), np.float32)
    _, launches = count_global_bytes(
        lambda: numba_flash.decode(q, kc, kc, cache_seqlens=seqlens, block_table=table))
    a = launches[0].arrays
    want = decode_kv_bytes(seqlens, h, hkv, 1, d, 4, SIM_BLOCK_M)
    assert a["k_cache"]["read"] + a["v_cache"]["read"] == want
    assert want == 2 * hkv * 62 * d * 4 * chunks
    assert a["k_cache"]["distinct_read"] == hkv * 62 * d * 4  # live slots only, none stale
