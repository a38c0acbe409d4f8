"""Kernel tier: the one-thread-per-row forward (``numba_flash.teach.ops.naive_forward``) against the
float64 reference.  Outputs are NaN-poisoned before launch (conftest), so an unwritten element
fails."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash.kernels.core.common import HEAD_DIMS, padded_head_dim
from numba_flash.teach.ops.naive_forward import naive_forward
from helpers import check_forward_against_reference

# Max errors measured over 200 random cases per dtype (shapes and causal as below, unit-normal
# inputs, /tmp script, seed 1):
#   o:   float16 9.6e-4 absolute, |o| up to ~2.5: the final rounding to float16 (half an ulp is
#        2**-11 * |o|), so the float16 bound is scaled by max(1, max|o|);
#        float32 4.2e-7, float64 1.3e-15
#   lse: float16 inputs 5.9e-7 (lse is float32), float32 6.1e-7, float64 1.3e-15
# The bounds are helpers.ATOL (2e-3 relative to max(1, |o|), 2e-5, 1e-12): >= 4x those figures.

SHAPES = [  # (B, H, Hkv, Nq, Nk, d)
    (1, 1, 1, 1, 1, 1),
    (1, 2, 2, 5, 7, 3),
    (2, 4, 2, 6, 6, 8),    # GQA, 2 query heads per kv head
    (1, 3, 1, 9, 4, 5),    # MQA; Nq > Nk: causal rows with no visible key
    (1, 1, 1, 3, 11, 17),  # HEAD_DIM 32 with d = 17: the loops run over d, not HEAD_DIM
]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_naive_forward_matches_reference(rng, dtype, causal, shape):
    check_forward_against_reference(naive_forward, rng, dtype, causal, shape)


def test_padded_head_dim():
    assert [padded_head_dim(d) for d in (1, 16, 17, 64, 65, 256)] == [16, 16, 32, 64, 128, 256]
    assert HEAD_DIMS[-1] == 256
