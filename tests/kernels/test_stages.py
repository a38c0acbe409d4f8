"""Tile stages (numba_flash.kernels.ptx.stages): ldmatrix, cp.async tile copies and the double
buffer, ex2 / fmax / fma, in the simulator (the twins) and on a GPU (the PTX instructions).

The expected ldmatrix registers are built here from the PTX ISA's own statement ("lane 8m + r
gives the address of row r of matrix m; lane 4r + w receives halves 2w, 2w+1 of row r of
matrix m; .trans: of column r"), with plain loops independent of the twin's code, so a twin
that agreed with a wrong lane mapping would still fail; the ldmatrix + mma GEMM then checks that
the mapping composes with the mma fragments.

Measured (simulator, K 64, N 32, standard normal inputs): the GEMM's max error against float64
is 1.9e-6 relative (float32 accumulation); bound 1e-5.  ex2's twin is float64 exp2 rounded
once to float32; the device's ex2.approx is within 2 ulp of it (PTX ISA).
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import simulator
from numba_flash.kernels.ptx import stages


def launch(kernel, threads, *args):
    with simulator.fast_switching():
        kernel[1, threads](*args)


def ptx_ldmatrix(tile, rows, trans):
    """uint32 [32, 4]: register m of every lane by the PTX ISA's rule; ``tile`` uint16
    [64, 8], lane l points at row ``rows[l]``."""
    out = np.zeros((32, 4), np.uint32)
    for lane in range(32):
        r, w = lane // 4, lane % 4
        for m in range(4):
            mat = tile[rows[8 * m:8 * m + 8]]          # the 8 rows lanes 8m .. 8m+7 point at
            if trans:
                lo, hi = mat[2 * w, r], mat[2 * w + 1, r]
            else:
                lo, hi = mat[r, 2 * w], mat[r, 2 * w + 1]
            out[lane, m] = int(lo) | (int(hi) << 16)
    return out


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_follows_the_ptx_lane_rule(rng, trans):
    tile = rng.integers(0, 2**16, (64, 8), dtype=np.uint16)
    rows = rng.permutation(64)[:32].astype(np.int32)   # any row for any lane
    regs = np.zeros((32, 4), np.uint32)
    launch(stages.ldmatrix_kernel(trans), 32, tile.view(np.uint32).reshape(-1), rows, regs)
    np.testing.assert_array_equal(regs, ptx_ldmatrix(tile, rows, trans))


def test_ldmatrix_rows_cover_a_16x16_block_once():
    for kind in ("a", "b", "bt"):
        got = sorted(stages.ldmatrix_rows(lane, kind) for lane in range(32))
        assert got == sorted((r, c) for r in range(16) for c in (0, 8)), kind
    with pytest.raises(ValueError, match="kind"):
        stages.ldmatrix_rows(0, "c")


@pytest.mark.parametrize("m_tiles, a_src, dtype", [(1, "smem", "float16"),
                                                   (2, "regs", "float16"),
                                                   (2, "smem", "bfloat16")])
def test_warp_gemm_stage_end_to_end(rng, m_tiles, a_src, dtype):
    """The warp-GEMM stage (kernels/mainloop/warp_gemm.py) as the attention kernels use it: S = A
    B^T with A from shared memory or registers, then P V with P = S rounded to the element type (A
    from the accumulator) and B from a row-major V by ldmatrix.trans, 1 or 2 row tiles."""
    from numba_flash.kernels.core.elements import BFLOAT16
    from numba_flash.kernels.mainloop.warp_gemm import warp_gemm_kernel
    K, N, M = 64, 32, 16 * m_tiles
    dt = np.float16 if dtype == "float16" else BFLOAT16
    a = rng.standard_normal((M, K)).astype(dt)
    bt = rng.standard_normal((N, K)).astype(dt)
    v = rng.standard_normal((N, 16)).astype(dt)
    s = np.full((M, N), np.nan, np.float32)
    o = np.full((M, 16), np.nan, np.float32)
    launch(warp_gemm_kernel(m_tiles, K, N, dtype, a_src), 32, a.view(np.uint16),
           bt.view(np.uint16), v.view(np.uint16), s, o)
    s_ref = a.astype(np.float64) @ bt.astype(np.float64).T
    p = s.astype(dt).astype(np.float64)          # P rounded to the element type, as the stage
    o_ref = p @ v.astype(np.float64)
    assert np.abs(s - s_ref).max() <= 1e-5 * np.abs(s_ref).max()   # float32 accumulation
    assert np.abs(o - o_ref).max() <= 1e-5 * np.abs(o_ref).max()


@pytest.mark.parametrize("vec, d, n_rows", [
    (True, 64, 70),    # full tiles, then a partial one (6 of 32 rows) and the double buffer
    (True, 64, 96),    # three full tiles
    (False, 50, 40),   # d < HEAD_DIM: 16-bit loads, zero columns; second tile partial
])
def test_tile_copy_double_buffer_and_partial_tiles(rng, vec, d, n_rows):
    ROWS, HEAD_DIM, TILES = 32, 64, 3
    src = rng.standard_normal((n_rows, d)).astype(np.float16)
    src[5, 3] = np.nan            # tile 0
    src[min(n_rows, 64) - 1, d - 1] = -np.inf  # the last row of tile 1
    out = np.zeros((TILES, ROWS, HEAD_DIM), np.uint16)
    flags = np.full(TILES, -1, np.int32)
    launch(stages.tile_copy_kernel(ROWS, HEAD_DIM, 128, vec, TILES), 128,
           src.view(np.uint16).reshape(-1), out, np.int32(d), np.int32(n_rows), flags)
    want = np.zeros((TILES * ROWS, HEAD_DIM), np.float16)
    want[:n_rows, :d] = np.where(np.isfinite(src), src, 0)
    np.testing.assert_array_equal(out.view(np.float16).reshape(-1, HEAD_DIM), want)
    bad = ~np.isfinite(np.concatenate([src.astype(np.float32),
                                       np.zeros((TILES * ROWS - n_rows, d), np.float32)]))
    np.testing.assert_array_equal(flags, bad.reshape(TILES, ROWS, d).any((1, 2)).astype(int))


def test_arithmetic_twins():
    x = np.array([0.0, 1.0, -1.5, 10.0, -126.5, -150.0, 200.0, -np.inf, np.inf, np.nan, 1e-40,
                  3.25], np.float32)
    y = np.array([1.0, np.nan, 2.0, -3.0, np.nan, 0.5, 1.0, 0.0, -1.0, 2.0, 1.0, -3.25],
                 np.float32)
    out = np.full((x.size, 3), np.nan, np.float32)
    launch(stages.arith_kernel(), 32, x, y, out)
    with np.errstate(over="ignore", invalid="ignore"):
        e = np.exp2(np.where(np.abs(x) < np.finfo(np.float32).tiny, 0, x).astype(np.float64))
        want_ex2 = e.astype(np.float32)
        want_ex2[(want_ex2 != 0) & (np.abs(want_ex2) < np.finfo(np.float32).tiny)] = 0  # ftz
        want_fma = (x.astype(np.float64) * y + x).astype(np.float32)
    np.testing.assert_allclose(out[:, 0], want_ex2, rtol=3e-7)      # 2 ulp on the device
    assert out[7, 0] == 0 and out[5, 0] == 0 and out[10, 0] == 1    # -inf, underflow, ftz in
    np.testing.assert_array_equal(out[:, 1], np.fmax(x, y))         # NaN loses to a number
    np.testing.assert_array_equal(out[:, 2], want_fma)


def test_red_add_lands_every_add_at_its_flat_element(rng):
    """red_add (dQ's atomic): 96 threads add into 6 elements of a 2-D float32 array at flat
    offsets, 16 threads per element; every add lands (exact: the values are small integers)."""
    dst = np.zeros((2, 3), np.float32)
    elems = np.repeat(np.arange(6, dtype=np.int32), 16)[rng.permutation(96)]
    vals = rng.integers(-8, 9, 96).astype(np.float32)
    launch(stages.red_add_kernel(), 96, dst, elems, vals)
    np.testing.assert_array_equal(dst.reshape(-1), np.bincount(elems, vals, minlength=6))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_load16_reads_16_bytes_in_the_compute_type(rng, dtype):
    """load16 at flat offsets of a 2-D array: the 16 bytes from there, widened (float16 ->
    float32) exactly; the twin refuses a misaligned or out-of-range offset, as the device
    cannot read them."""
    n = 16 // np.dtype(dtype).itemsize
    src = rng.standard_normal((6, 4 * n)).astype(dtype)
    elems = (rng.permutation(src.size // n)[:5] * n).astype(np.int32)
    acc = np.float64 if dtype == np.float64 else np.float32
    out = np.full((5, n), np.nan, acc)
    launch(stages.load16_kernel(n), 5, src, elems, out)
    want = np.stack([src.reshape(-1)[e:e + n] for e in elems]).astype(acc)
    np.testing.assert_array_equal(out, want)
    for bad in (1, src.size - n + n):   # not a multiple of n; past the end
        with pytest.raises(ValueError, match="load16: expected a multiple"):
            stages.load16(src, bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lds16_reads_16_bytes_at_a_byte_offset(dtype):
    """lds16's twin: the 16 bytes from a byte offset of a float32 / float64 shared array (4 or
    2 values), and a misaligned offset refused (the device's ld.shared.v4 needs 16-byte
    alignment)."""
    smem = np.arange(32, dtype=dtype)
    n = 16 // np.dtype(dtype).itemsize
    for byte in (0, 16, 96):
        assert stages.lds16(smem, byte) == tuple(smem[byte // (16 // n):][:n])
    with pytest.raises(ValueError, match="lds16: expected a 16-byte aligned"):
        stages.lds16(smem, 8)


def test_tile_scan_bf16_uses_bfloat16_exponent_bits(rng):
    """DTYPE bfloat16: inf / NaN bfloat16 (exponent 0x7F80) read as 0 and flagged; a finite
    bfloat16 whose bits would be a float16 inf / NaN (0x7C00 set: 2**121 here) is kept."""
    import ml_dtypes

    ROWS, HEAD_DIM, TILES, n_rows = 32, 64, 3, 70
    src = rng.standard_normal((n_rows, HEAD_DIM)).astype(ml_dtypes.bfloat16)
    bits = src.view(np.uint16)
    bits[2, 7] = 0x7C00      # 2**121 as bfloat16: finite (a float16 inf)
    bits[40, 1] = 0xFC01     # -2**121 * (1 + 2**-7): finite (a float16 NaN)
    bits[3, 3] = 0x7F80      # +inf   (tile 0)
    bits[69, 63] = 0xFFC1    # NaN    (tile 2)
    out = np.zeros((TILES, ROWS, HEAD_DIM), np.uint16)
    flags = np.full(TILES, -1, np.int32)
    launch(stages.tile_copy_kernel(ROWS, HEAD_DIM, 128, True, TILES, "bfloat16"), 128,
           bits.reshape(-1), out, np.int32(HEAD_DIM), np.int32(n_rows), flags)
    want = np.zeros((TILES * ROWS, HEAD_DIM), np.uint16)
    want[:n_rows] = bits
    want[3, 3] = 0
    want[69, 63] = 0
    np.testing.assert_array_equal(out.reshape(-1, HEAD_DIM), want)
    np.testing.assert_array_equal(flags, [1, 0, 1])
    with pytest.raises(ValueError, match="DTYPE: expected one of"):
        stages.make_zero_nonfinite_word("float32")
