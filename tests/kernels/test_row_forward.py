"""Kernel tier: the one-thread-per-row forward with K/V tiles in shared memory
(``numba_flash.teach.ops.row_forward``) against the float64 reference.  Outputs are NaN-poisoned
before launch (conftest), so an unwritten element fails.  In the simulator the blocks are 4 rows by
6 keys (``SIM_BLOCK_M``, ``SIM_BLOCK_N``): the tile load's stride loop, a partial last tile and a
block with spare threads all occur in the shapes below."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.teach.kernels.row_forward import SMEM_BUDGET, gpu_blocks
from numba_flash.kernels.core.common import HEAD_DIMS
from numba_flash.teach.ops.row_forward import row_forward
from helpers import check_forward_against_reference

# Max errors measured over 40 random cases per dtype (the shapes below, causal and not,
# unit-normal inputs, /tmp script, seed 1), o relative to max(1, max|o|):
#   o:   float16 3.8e-4, float32 4.2e-7, float64 7.4e-16
#   lse: float16 inputs 3.8e-7 (lse is float32), float32 3.2e-7, float64 8.9e-16
# The bounds are helpers.ATOL (2e-3, 2e-5, 1e-12), >= 5x those figures.

SHAPES = [  # (B, H, Hkv, Nq, Nk, d)
    (1, 1, 1, 1, 1, 1),
    (1, 2, 2, 5, 7, 3),     # two K/V tiles (6 + 1 keys); a block with 3 spare threads
    (2, 4, 2, 6, 13, 8),    # GQA, three K/V tiles
    (1, 3, 1, 9, 4, 5),     # MQA; Nq > Nk: causal rows with no visible key
    (1, 1, 1, 3, 11, 17),   # HEAD_DIM 32 with d = 17: the loops run over d, not HEAD_DIM
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_row_forward_matches_reference(rng, dtype, causal, shape):
    check_forward_against_reference(row_forward, rng, dtype, causal, shape)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES[1:4])
def test_row_forward_bfloat16(rng, causal, shape):
    """bfloat16 in and out (uint16 words in the kernel, kernels/core/elements.py), float32 inside.
    Measured over 40 random cases (the shapes above): max |o error| / max(1, max|o|) 3.5e-3 (the
    final rounding: half a bfloat16 ulp is 2**-9 of |o|), lse 3.5e-7; bounds 1.6e-2 and 2e-5."""
    bf16 = ml_dtypes.bfloat16
    b, h, hkv, nq, nk, d = shape
    q = rng.standard_normal((b, h, nq, d)).astype(bf16)
    k = rng.standard_normal((b, hkv, nk, d)).astype(bf16)
    v = rng.standard_normal((b, hkv, nk, d)).astype(bf16)
    o, lse = row_forward(q, k, v, causal=causal)
    assert o.dtype == bf16 and lse.dtype == np.float32
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    err = np.abs(o.astype(np.float64) - o_ref).max() / max(1.0, np.abs(o_ref).max())
    assert err <= 1.6e-2, err
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    fin = np.isfinite(lse_ref)
    assert np.abs(lse[fin] - lse_ref[fin]).max(initial=0) <= 2e-5


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_gpu_tiles_fit_the_shared_memory_budget(dtype, head_dim):
    block_m, block_n = gpu_blocks(head_dim, dtype)
    item = 8 if dtype == np.float64 else 4
    assert 2 * block_n * head_dim * item <= SMEM_BUDGET <= 48 * 1024
    assert block_n >= 8 and block_m == 64
