"""Kernel tier: the teaching tiled forward (``numba_flash.ops.tiled_forward_teach``) against the
float64 reference.  Outputs are NaN-poisoned before launch (conftest), so an unwritten element
fails.  In the simulator the tiles are 4 rows by 4 keys (``SIM_BLOCKS``): several K/V tiles, a
ragged last tile, a block with spare rows and head dims that are not a multiple of ``BLOCK_N``
all occur in the shapes below."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.kernels.common import HEAD_DIMS, SMEM_LIMIT
from numba_flash.kernels.tiled_forward_teach import GPU_BLOCKS, default_blocks, shared_bytes
from numba_flash.ops.tiled_forward_teach import tiled_forward_teach
from helpers import assert_close, randn

# Max errors measured over 80 random cases per dtype (the shapes below, causal and not,
# unit-normal inputs, /tmp script, seed 1), o relative to max(1, max|o|):
#   o:   float16 4.1e-4, float32 3.6e-7, float64 9.0e-16, bfloat16 3.5e-3
#   lse: float16 inputs 4.7e-7 (lse is float32), float32 5.3e-7, float64 8.9e-16, bfloat16 3.0e-7
# The bounds are helpers.ATOL (2e-3, 2e-5, 1e-12), >= 4x those figures; bfloat16 below.
LSE_DTYPE = {np.float16: np.float32, np.float32: np.float32, np.float64: np.float64}

SHAPES = [  # (B, H, Hkv, Nq, Nk, d)
    (1, 1, 1, 1, 1, 1),
    (1, 2, 2, 5, 7, 3),     # two K/V tiles (4 + 3 keys); a Q tile with 3 spare rows
    (2, 4, 2, 6, 13, 8),    # GQA, four K/V tiles, the last with one key
    (1, 3, 1, 9, 4, 5),     # MQA; Nq > Nk: causal rows with no visible key
    (1, 1, 1, 3, 11, 17),   # HEAD_DIM 32 with d = 17: a thread's columns 1, 5, .., 29 (>= d: idle)
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(rng, dtype, causal, shape):
    b, h, hkv, nq, nk, d = shape
    q = randn(rng, (b, h, nq, d), dtype)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d), dtype)
    o, lse = tiled_forward_teach(q, k, v, causal=causal)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == LSE_DTYPE[dtype] and lse.shape == (b, h, nq)
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    o_scale = max(1.0, np.abs(o_ref).max()) if dtype == np.float16 else 1.0
    assert_close(o, o_ref, dtype, scale=o_scale, name="o")
    assert_close(lse, lse_ref, LSE_DTYPE[dtype], name="lse")


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16(rng, causal):
    """bfloat16 in and out, float32 inside (measured above: o 3.5e-3, the final rounding to
    bfloat16; lse 3.0e-7); bounds 1.6e-2 and 2e-5."""
    bf16 = ml_dtypes.bfloat16
    q = rng.standard_normal((2, 4, 6, 8)).astype(bf16)
    k = rng.standard_normal((2, 2, 13, 8)).astype(bf16)
    v = rng.standard_normal((2, 2, 13, 8)).astype(bf16)
    o, lse = tiled_forward_teach(q, k, v, causal=causal)
    assert o.dtype == bf16 and lse.dtype == np.float32
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    err = np.abs(o.astype(np.float64) - o_ref).max() / max(1.0, np.abs(o_ref).max())
    assert err <= 1.6e-2, err
    assert_close(lse, lse_ref, np.float32, name="lse")


def test_rows_without_keys_give_zero_and_minus_inf(rng):
    q = randn(rng, (1, 1, 6, 4), np.float32)
    k = randn(rng, (1, 1, 2, 4), np.float32)
    o, lse = tiled_forward_teach(q, k, k, causal=True)
    # rows 0..3 see no key (j <= i + 2 - 6 < 0), rows 4, 5 see 1 and 2 keys
    assert np.all(o[0, 0, :4] == 0) and np.all(lse[0, 0, :4] == -np.inf)
    assert np.all(np.isfinite(lse[0, 0, 4:]))


def test_large_logits_one_rescale_per_tile(rng):
    """Scores ~1e3 whose max moves from tile to tile: alpha = exp(m_old - m_new) underflows to 0
    for earlier tiles, which must then drop out, not turn into inf or NaN."""
    q = randn(rng, (1, 1, 4, 8), np.float32, scale=30.0)
    k = randn(rng, (1, 1, 19, 8), np.float32, scale=30.0)
    v = randn(rng, (1, 1, 19, 8), np.float32)
    o, lse = tiled_forward_teach(q, k, v, softmax_scale=0.9)
    o_ref, lse_ref = ref.attention(q, k, v, softmax_scale=0.9)
    # float32 rounding of scores ~1e3 (~1e-4) moves the near one-hot P; as in the naive kernel's
    # test (measured there: 3.7e-5 on o, 2.0e-7 relative on lse over 50 cases), bounds 4x those
    assert_close(o, o_ref, np.float32, scale=1.5e-4 / 2e-5, name="o")
    assert np.abs(lse - lse_ref).max() <= 8e-7 * np.abs(lse_ref).max()


def test_inputs_not_modified_and_non_contiguous(rng):
    base = randn(rng, (1, 2, 8, 6), np.float32)
    q = base[:, :, ::2]
    k = randn(rng, (1, 2, 5, 6), np.float32)
    before = (base.copy(), k.copy())
    o, _ = tiled_forward_teach(q, k, k)
    assert_close(o, ref.attention(q, k, k)[0], np.float32)
    np.testing.assert_array_equal(base, before[0])
    np.testing.assert_array_equal(k, before[1])


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gpu_tiles_fit_static_shared_memory(dtype, head_dim, monkeypatch):
    monkeypatch.setattr("numba_flash.kernels.tiled_forward_teach.on_simulator", lambda: False)
    block_m, block_n = default_blocks(head_dim, dtype)
    assert (block_m, block_n) in GPU_BLOCKS
    assert shared_bytes(head_dim, block_m, block_n, dtype) <= SMEM_LIMIT
    assert block_m * block_n <= 1024


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(q=np.zeros((1, 2, 3), np.float32)), ValueError, "q: expected a 4-D array"),
    (dict(v=np.zeros((1, 2, 4, 4), np.float64)), TypeError, "v: expected dtype float32"),
    (dict(causal=1), TypeError, "causal: expected a bool"),
])
def test_rejects_bad_arguments(kwargs, exc, msg):
    args = dict(q=np.zeros((1, 2, 4, 4), np.float32), k=np.zeros((1, 2, 4, 4), np.float32),
                v=np.zeros((1, 2, 4, 4), np.float32))
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=msg):
        tiled_forward_teach(q, k, v, **args)
