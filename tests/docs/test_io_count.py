"""The global-memory counter against the models, byte for byte."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import numba_flash
from numba_flash.ops.naive_forward import naive_forward
from helpers import randn
from io_count import (count_global_bytes, naive_forward_bytes, softmax_kernel_bytes,
                      standard_attention_bytes, tiled_forward_bytes)


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


@pytest.mark.skipif(importlib.util.find_spec("numba_flash.ops.forward") is None,
                    reason="the tiled forward has not landed yet")
def test_tiled_forward_reuses_kv_tiles(rng):
    """When numba_flash.forward lands: Q read once, O written once, K/V read once per Q tile."""
    nq = nk = 32
    d = 16
    q = randn(rng, (1, 1, nq, d), np.float32)
    k = randn(rng, (1, 1, nk, d), np.float32)
    _, launches = count_global_bytes(lambda: numba_flash.forward(q, k, k))
    rec = next(r for r in launches if {"q", "k", "v"} <= set(r.arrays))
    assert rec.arrays["q"]["read"] == q.nbytes
    passes = rec.arrays["k"]["read"] / k.nbytes  # = number of Q tiles
    assert passes == int(passes) and 1 <= passes < nq
