"""The e4m3 tensor-core primitives (numba_flash/kernels/ptx/mma_fp8.py): the m16n8k32 fragment
table is a bijection onto A and B, the P-packing permutation is one, and the one-warp GEMM
(the simulator twin in the simulator, the PTX on a GPU) matches NumPy on e4m3 values."""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import float8_e4m3fn

from numba_flash.kernels.ptx import mma_fp8


def test_fragment_table_covers_a_and_b_once():
    a = {mma_fp8.a_coords(lane, i) for lane in range(32) for i in range(16)}
    b = {mma_fp8.b_coords(lane, i) for lane in range(32) for i in range(8)}
    assert a == {(r, c) for r in range(16) for c in range(32)}
    assert b == {(k, n) for k in range(32) for n in range(8)}
    # lane (g, t) packs its accumulator columns 8 f + 2 t (+1) as k = 4 t .. 4 t + 3 (+16)
    keys = [mma_fp8.p_key_of_k(k) for k in range(32)]
    assert sorted(keys) == list(range(32))
    for lane in range(32):
        t = lane % 4
        assert {keys[k] for k in range(4 * t, 4 * t + 4)} == {2 * t, 2 * t + 1, 2 * t + 8,
                                                              2 * t + 9}


@pytest.mark.parametrize("K", [32, 96])
def test_warp_gemm_matches_numpy(rng, K):
    a = (rng.standard_normal((16, K)) * 4).astype(float8_e4m3fn)
    b = (rng.standard_normal((K, 8)) * 4).astype(float8_e4m3fn)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    a_words = np.ascontiguousarray(a).view(np.uint8).view(np.uint32)
    bt_words = np.ascontiguousarray(b.T).view(np.uint8).view(np.uint32)
    mma_fp8.warp_gemm_e4m3_kernel(K)[1, 32](a_words, bt_words, c, d)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, want, rtol=2e-6, atol=1e-5)


def test_pack_rounds_and_saturates():
    bits = mma_fp8._sim_pack_e4m3x4(np.float32(1.0), np.float32(-0.3), np.float32(1e6),
                                    np.float32(2.0 ** -12))
    vals = np.array([bits], np.uint32).view(np.uint8).view(float8_e4m3fn).astype(np.float64)
    assert list(vals) == [1.0, float(np.float32(-0.3).astype(float8_e4m3fn)), 448.0, 0.0]
