"""Kernel tier: the teaching tiled forward (``numba_flash.teach.ops.tiled_forward``) against the
float64 reference.  Outputs are NaN-poisoned before launch (conftest), so an unwritten element
fails.  In the simulator the tiles are 4 rows by 4 keys (``SIM_BLOCKS``): several K/V tiles, a
ragged last tile, a block with spare rows and head dims that are not a multiple of ``BLOCK_N``
all occur in the shapes below."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.kernels.core.common import HEAD_DIMS, SMEM_LIMIT
from numba_flash.teach.kernels.tiled_forward import GPU_BLOCKS, default_blocks, shared_bytes
from numba_flash.teach.ops.tiled_forward import tiled_forward_teach
from helpers import assert_close, check_forward_against_reference

# Max errors measured over 80 random cases per dtype (the shapes below, causal and not,
# unit-normal inputs, /tmp script, seed 1), o relative to max(1, max|o|):
#   o:   float16 4.1e-4, float32 3.6e-7, float64 9.0e-16, bfloat16 3.5e-3
#   lse: float16 inputs 4.7e-7 (lse is float32), float32 5.3e-7, float64 8.9e-16, bfloat16 3.0e-7
# The bounds are helpers.ATOL (2e-3, 2e-5, 1e-12), >= 4x those figures; bfloat16 below.

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
    check_forward_against_reference(tiled_forward_teach, rng, dtype, causal, shape)


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


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gpu_tiles_fit_static_shared_memory(dtype, head_dim, monkeypatch):
    monkeypatch.setattr("numba_flash.teach.kernels.tiled_forward.on_simulator", lambda: False)
    block_m, block_n = default_blocks(head_dim, dtype)
    assert (block_m, block_n) in GPU_BLOCKS
    assert shared_bytes(head_dim, block_m, block_n, dtype) <= SMEM_LIMIT
    assert block_m * block_n <= 1024
