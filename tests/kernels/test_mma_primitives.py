"""Tensor-core primitives (numba_flash.kernels.ptx.mma): the m16n8k16 mma, half2 packing, fragment
loads and quad reductions, in the simulator (the twin) and on a GPU (the PTX instruction).

The fragments are laid out here by the PTX ISA's own formulas ("Matrix Fragments for
mma.m16n8k16 with floating point type"), written independently of the module's tables, so a
twin that agreed with a wrongly laid-out load would still fail.

Measured (simulator, 200 random 16x16x8 problems): the twin's max error against float64 is
4.8e-7 (float32 rounding of |D| ~ 4); on the H200 the instruction matched float64 to 1.1e-5 for
a 16x8x128 product (KERNEL_NOTES).  Bounds: 2e-6 relative for one mma, 1e-5 for K = 64.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numba import cuda

import numba_flash
from numba_flash import simulator
from numba_flash.kernels.ptx import mma


def ptx_registers(a, b):
    """uint32 [32, 6] registers of 16-bit (float16 or bfloat16) A [16, 16] and B [16, 8] by
    the PTX formulas:
    groupID = lane >> 2, threadID_in_group = lane % 4;
    A: row = groupID for a_i with 0 <= i < 2 or 4 <= i < 6, else groupID + 8;
       col = tig * 2 + (i & 1) for i < 4, + 8 for i >= 4;
    B: row = tig * 2 + (i & 1) for b_i with i < 2, + 8 for i >= 2; col = groupID;
    element 2j of a register is its low half."""
    halves = np.zeros((32, 12), a.dtype)
    for lane in range(32):
        gid, tig = lane >> 2, lane % 4
        for i in range(8):
            row = gid if (0 <= i < 2 or 4 <= i < 6) else gid + 8
            col = tig * 2 + (i & 1) + (8 if i >= 4 else 0)
            halves[lane, i] = a[row, col]
        for i in range(4):
            row = tig * 2 + (i & 1) + (8 if i >= 2 else 0)
            halves[lane, 8 + i] = b[row, gid]
    return halves.view(np.uint32)


def ptx_c(c):
    """float32 [32, 4] accumulator fragments: row = groupID for c0, c1, groupID + 8 for c2, c3;
    col = tig * 2 + (i & 1)."""
    out = np.zeros((32, 4), np.float32)
    for lane in range(32):
        gid, tig = lane >> 2, lane % 4
        for i in range(4):
            out[lane, i] = c[gid + (8 if i >= 2 else 0), tig * 2 + (i & 1)]
    return out


def launch(kernel, *args):
    with simulator.fast_switching():
        kernel[1, 32](*args)


def test_layout_tables_place_every_element_once():
    seen_a = {mma.a_coords(lane, i) for lane in range(32) for i in range(8)}
    seen_b = {mma.b_coords(lane, i) for lane in range(32) for i in range(4)}
    seen_c = {mma.c_coords(lane, i) for lane in range(32) for i in range(4)}
    assert seen_a == {(r, c) for r in range(16) for c in range(16)}
    assert seen_b == {(r, c) for r in range(16) for c in range(8)}
    assert seen_c == {(r, c) for r in range(16) for c in range(8)}
    rng = np.random.default_rng(1)
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    regs, cf = mma.fragments_from_matrices(a, b, c)
    np.testing.assert_array_equal(regs, ptx_registers(a, b))
    np.testing.assert_array_equal(cf, ptx_c(c))


@pytest.mark.parametrize("trial", range(3))
def test_mma_matches_float64_product(rng, trial):
    a = rng.standard_normal((16, 16)).astype(np.float16)
    b = rng.standard_normal((16, 8)).astype(np.float16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((32, 4), np.nan, np.float32)
    launch(mma.fragment_kernel(), ptx_registers(a, b), ptx_c(c), d)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    got = np.array([[d[lane, i] for i in range(4)] for lane in range(32)])
    np.testing.assert_allclose(got, ptx_c(want).astype(np.float64), rtol=2e-6, atol=2e-6)


def test_mma_propagates_nan_and_inf():
    a = np.ones((16, 16), np.float16)
    b = np.ones((16, 8), np.float16)
    a[3, 5] = np.nan
    b[0, 6] = np.inf
    d = np.zeros((32, 4), np.float32)
    launch(mma.fragment_kernel(), ptx_registers(a, b), ptx_c(np.zeros((16, 8))), d)
    out = mma.matrix_from_c_fragments(d)
    assert np.isnan(out[3]).all()                       # NaN in row 3 of A
    assert np.isposinf(np.delete(out[:, 6], 3)).all()   # inf in column 6 of B
    assert (np.delete(np.delete(out, 3, 0), 6, 1) == 16).all()


@pytest.mark.parametrize("K", [16, 64])
def test_warp_gemm_through_shared_memory(rng, K):
    """Fragment loads (load_a_frag / load_b_frag), K / 16 chained mma and pack_half2."""
    a = rng.standard_normal((16, K)).astype(np.float16)
    b = rng.standard_normal((K, 8)).astype(np.float16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    d16 = np.zeros((16, 4), np.uint32)
    launch(mma.warp_gemm_kernel(K), a.view(np.uint16), b.view(np.uint16), c, d, d16)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    assert np.abs(d - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    # pack_half2: exactly NumPy's round-to-nearest-even float32 -> float16
    np.testing.assert_array_equal(d16.view(np.float16), d.astype(np.float16))


def test_half2_packing_rounds_and_keeps_specials():
    vals = np.array([1.0, -2.5, 65504.0, 70000.0, np.inf, -np.inf, 1e-8, 0.1], np.float32)
    for lo, hi in zip(vals[::2], vals[1::2]):
        got = np.array([mma._sim_pack_half2(lo, hi)], np.uint32).view(np.float16)
        with np.errstate(over="ignore"):
            want = np.array([lo, hi], np.float32).astype(np.float16)
        np.testing.assert_array_equal(got, want)


@cuda.jit
def _quad_kernel(x, mx, sm):
    lane = cuda.threadIdx.x
    mx[lane] = mma.quad_max(x[lane])
    sm[lane] = mma.quad_sum(x[lane])


def test_quad_reductions(rng):
    x = rng.standard_normal(32).astype(np.float32)
    x[9] = np.nan  # quad 2 (lanes 8..11): max and sum NaN
    mx = np.zeros(32, np.float32)
    sm = np.zeros(32, np.float32)
    launch(_quad_kernel, x, mx, sm)
    quads = x.reshape(8, 4)
    with np.errstate(invalid="ignore"):
        want_max = np.repeat(np.where(np.isnan(quads).any(1), np.nan, quads.max(1)), 4)
    np.testing.assert_array_equal(mx, want_max.astype(np.float32))
    np.testing.assert_allclose(sm, np.repeat(quads.astype(np.float64).sum(1), 4), rtol=1e-6)


def test_twin_refuses_a_partial_warp():
    """The mma is warp-wide: a block of 16 threads is an error, not a silent wrong result."""
    regs = np.zeros((32, 6), np.uint32)
    c = np.zeros((32, 4), np.float32)
    d = np.zeros((32, 4), np.float32)
    if numba_flash.backend() != "simulator":
        pytest.skip("simulator behaviour")
    with pytest.raises(Exception, match="full warp"):
        with simulator.fast_switching():
            mma.fragment_kernel()[1, 16](regs, c, d)


@cuda.jit
def _frag_load_kernel(tile, out_a, out_b, out_bt):
    lane = cuda.threadIdx.x
    g = lane >> 2
    t = lane & 3
    a0, a1, a2, a3 = mma.load_a_frag(tile, 0, 0, g, t)
    out_a[lane, 0] = a0
    out_a[lane, 1] = a1
    out_a[lane, 2] = a2
    out_a[lane, 3] = a3
    b0, b1 = mma.load_b_frag(tile, 0, 0, g, t)
    out_b[lane, 0] = b0
    out_b[lane, 1] = b1
    c0, c1 = mma.load_b_frag_t(tile, 0, 0, g, t)
    out_bt[lane, 0] = c0
    out_bt[lane, 1] = c1


def test_fragment_loads_match_the_ptx_layout(rng):
    """A 16 x 16 float16 matrix M packed by rows: load_a_frag gives A = M, load_b_frag gives
    B = M[:8].T (rows of the tile are columns n), load_b_frag_t gives B = M[:, :8]."""
    m = rng.standard_normal((16, 16)).astype(np.float16)
    tile = np.ascontiguousarray(m).view(np.uint32)  # [16, 8] words
    out_a = np.zeros((32, 4), np.uint32)
    out_b = np.zeros((32, 2), np.uint32)
    out_bt = np.zeros((32, 2), np.uint32)
    launch(_frag_load_kernel, tile, out_a, out_b, out_bt)
    regs = ptx_registers(m, m[:8].T.copy())
    np.testing.assert_array_equal(out_a, regs[:, :4])
    np.testing.assert_array_equal(out_b, regs[:, 4:])
    np.testing.assert_array_equal(out_bt, ptx_registers(m, m[:, :8].copy())[:, 4:])


@cuda.jit
def _finite_load_kernel(tile, out):
    lane = cuda.threadIdx.x
    c0, c1 = mma.load_b_frag_t_finite(tile, 0, 0, lane >> 2, lane & 3)
    out[lane, 0] = c0
    out[lane, 1] = c1


def test_finite_transposed_load_zeroes_inf_and_nan(rng):
    m = rng.standard_normal((16, 16)).astype(np.float16)
    m[3, 2], m[8, 5], m[0, 0] = np.inf, np.nan, -np.inf
    out = np.zeros((32, 2), np.uint32)
    launch(_finite_load_kernel, np.ascontiguousarray(m).view(np.uint32), out)
    clean = np.where(np.isfinite(m), m, np.float16(0))
    np.testing.assert_array_equal(out, ptx_registers(m, clean[:, :8].copy())[:, 4:])


# ------------------------------------------------------------------------------------------
# bfloat16: the same layout, bfloat16 halves (ml_dtypes.bfloat16 as the NumPy-side type)
# ------------------------------------------------------------------------------------------
BF16 = ml_dtypes.bfloat16


def bf16_specials():
    """float32 values that exercise bfloat16's rounding: ties (to even), just above / below
    ties, the largest finite bfloat16 and what rounds past it, subnormals, signed zeros, inf
    and NaN."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0x7F7F7FFF, 0x7F7F8000,
                     0x7F7FFFFF, 0x00008000, 0x00018000, 0x00000001, 0x80000000, 0xBF808000,
                     0xFF7F8000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF],
                    np.uint32)
    return np.concatenate([bits.view(np.float32),
                           np.random.default_rng(5).standard_normal(64).astype(np.float32) * 30])


def test_bf16_pack_twin_rounds_as_ml_dtypes():
    """pack_bf16x2's twin: low half = bfloat16(lo), high = bfloat16(hi), round to nearest even
    (ml_dtypes' float32 -> bfloat16 is RNE); NaN stays NaN, past the largest finite -> inf."""
    vals = bf16_specials()
    with np.errstate(invalid="ignore"):
        want = vals.astype(BF16)
    for lo, hi, wlo, whi in zip(vals[::2], vals[1::2], want[::2], want[1::2]):
        got = np.array([mma._sim_pack_bf16x2(lo, hi)], np.uint32).view(BF16)
        for g, w in zip(got, (wlo, whi)):
            if np.isnan(w):
                assert np.isnan(g)
            else:
                assert g.view(np.uint16) == np.array(w, BF16).view(np.uint16), (lo, hi, got)
    assert mma._sim_pack_bf16x2(np.float32(1.0), np.float32(-2.0)) == 0xC0003F80  # lo, hi order


def test_bf16_halves_decode_exactly():
    with np.errstate(invalid="ignore"):
        x = bf16_specials().astype(BF16)
    words = x.view(np.uint32)
    got = mma.halves_to_float64(words, "bfloat16")
    np.testing.assert_array_equal(got, x.astype(np.float64))
    assert np.isnan(got[np.isnan(x.astype(np.float64))]).all()


@pytest.mark.parametrize("trial", range(2))
def test_bf16_mma_matches_float64_product(rng, trial):
    """The bfloat16 twin on fragments laid out by the PTX formulas: float64 products of the
    bfloat16 values (exact), float32 result; measured over 50 problems: 5.6e-8 of max |D|
    (float32 rounding); bound 2e-6."""
    a = (rng.standard_normal((16, 16)) * 4).astype(BF16)
    b = (rng.standard_normal((16, 8)) * 4).astype(BF16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((32, 4), np.nan, np.float32)
    launch(mma.fragment_kernel("bfloat16"), ptx_registers(a, b), ptx_c(c), d)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    got = mma.matrix_from_c_fragments(d).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())
    # read as float16, the same registers give a different product: the type is honoured
    d16 = np.full((32, 4), np.nan, np.float32)
    launch(mma.fragment_kernel("float16"), ptx_registers(a, b), ptx_c(c), d16)
    assert not np.allclose(mma.matrix_from_c_fragments(d16), want, equal_nan=True)


def test_bf16_mma_propagates_nan_and_inf():
    a = np.ones((16, 16), BF16)
    b = np.ones((16, 8), BF16)
    a[3, 5] = np.nan
    b[0, 6] = np.inf
    d = np.zeros((32, 4), np.float32)
    launch(mma.fragment_kernel("bfloat16"), ptx_registers(a, b), ptx_c(np.zeros((16, 8))), d)
    out = mma.matrix_from_c_fragments(d)
    assert np.isnan(out[3]).all()
    assert np.isposinf(np.delete(out[:, 6], 3)).all()
    assert (np.delete(np.delete(out, 3, 0), 6, 1) == 16).all()


def test_bf16_warp_gemm_and_pack(rng):
    """warp_gemm in bfloat16 (mma_ops' pair): d against float64 (measured over 20 problems:
    7.7e-8 of max |D|; bound 1e-5), d16 exactly ml_dtypes' bfloat16 rounding of d."""
    K = 32
    a = rng.standard_normal((16, K)).astype(BF16)
    b = rng.standard_normal((K, 8)).astype(BF16)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    d16 = np.zeros((16, 4), np.uint32)
    launch(mma.warp_gemm_kernel(K, "bfloat16"), a.view(np.uint16), b.view(np.uint16), c, d, d16)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    assert np.abs(d - want).max() <= 1e-5 * max(1.0, np.abs(want).max())
    np.testing.assert_array_equal(d16.view(np.uint16), d.astype(BF16).view(np.uint16))


def test_mma_ops_selects_by_dtype():
    assert mma.mma_ops("float16") == (mma.mma_m16n8k16, mma.pack_half2)
    assert mma.mma_ops(np.float16) == (mma.mma_m16n8k16, mma.pack_half2)
    assert mma.mma_ops(BF16) == (mma.mma_m16n8k16_bf16, mma.pack_bf16x2)
    assert mma.mma_ops("bfloat16") == (mma.mma_m16n8k16_bf16, mma.pack_bf16x2)
    assert mma.make_a_frag_from_c("float16") is mma.a_frag_from_c
    assert mma.make_a_frag_from_c("bfloat16") is not mma.a_frag_from_c
    for bad in (np.float32, "float64", "int8"):
        with pytest.raises(ValueError, match="dtype: expected one of"):
            mma.mma_ops(bad)
