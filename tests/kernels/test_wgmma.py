"""Warpgroup tensor-core stages (numba_flash.kernels.ptx.wgmma): the m64nNk16 fragment layout, the
matrix descriptor, the swizzled shared-memory layouts and the twin, against NumPy and against
the PTX ISA's own worked examples; then one-warpgroup GEMMs end to end in the simulator (the
twin) or on an sm_90a GPU (the instruction).

The ISA's layouts are written here independently of the module: the accumulator figure by a few
hand-read cells and CUTLASS's ``CLayout_64xN`` (a CuTe layout evaluated by :func:`cute`), the
canonical shared-memory layouts by the ISA's "Exact layout" examples (tf32 and bf16), the
swizzle by the 8 x 8 chunk permutation of its 128-byte figure.

Measured (simulator, these shapes): the twin's max error against float64 is 2.6e-6 for a
64 x 64 x 64 float16 GEMM (float32 rounding of |D| ~ 30).  Bound: 2e-6 of max |D| per 64 of K
(the hardware accumulates in float32 in an unspecified order: unmeasured, no GPU lent).
"""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest
from numba import cuda, types

import numba_flash
from numba_flash import simulator
from numba_flash.kernels.ptx import mma, wgmma
from numba_flash.kernels.ptx.wgmma import TileLayout

on_sim = pytest.mark.skipif(numba_flash.backend() == "cuda",
                            reason="the twin's checks (a GPU does not raise)")


def cute(shape, stride, coord):
    """CuTe: the offset of 2-D ``coord`` in layout ``shape:stride`` (nested tuples), each mode's
    index split colexicographically over its sub-shape."""
    def offset(sh, st, i):
        if isinstance(sh, int):
            return i * st
        total = 0
        for s, d in zip(sh, st):
            size = int(np.prod(s)) if not isinstance(s, int) else s
            total += offset(s, d, i % size)
            i //= size
        return total
    return sum(offset(sh, st, c) for sh, st, c in zip(shape, stride, coord))


# -- the accumulator and A fragments ---------------------------------------------------------
def test_accumulator_layout_cells_of_the_isa_figure():
    """Hand-read from the ISA's "WGMMA .m64nNk16 register fragment layout for accumulator
    matrix D": T0 holds (0,0) (0,1) (8,0) (8,1) (0,8) ..., T1 (0,2), T4 (1,0), warp 1 rows 16..,
    the last thread the last cell."""
    c = wgmma.acc_coords
    assert [c(0, i) for i in range(6)] == [(0, 0), (0, 1), (8, 0), (8, 1), (0, 8), (0, 9)]
    assert c(1, 0) == (0, 2) and c(3, 1) == (0, 7) and c(4, 0) == (1, 0) and c(31, 3) == (15, 7)
    assert c(32, 0) == (16, 0) and c(64, 2) == (40, 0) and c(96, 5) == (48, 9)
    assert c(127, 31) == (63, 63) and c(127, 127) == (63, 255)


@pytest.mark.parametrize("N", wgmma.WGMMA_N)
def test_accumulator_layout_is_cutlass_clayout_and_a_bijection(N):
    """Every 64 x N cell once; equal to CUTLASS's CLayout_64xN ((4,8,4),(2,2,N/8)) :
    ((128,1,16),(64,8,512)) over column-major (m + 64 n) offsets."""
    cells = [wgmma.acc_coords(t, i) for t in range(128) for i in range(N // 2)]
    assert sorted(cells) == [(r, c) for r in range(64) for c in range(N)]
    shape, stride = ((4, 8, 4), (2, 2, N // 8)), ((128, 1, 16), (64, 8, 512))
    for t in range(128):
        for i in range(N // 2):
            r, col = wgmma.acc_coords(t, i)
            assert cute(shape, stride, (t, i)) == r + 64 * col


def test_a_and_accumulator_layouts_are_mma_sync_ones_per_warp():
    """Warp w of the warpgroup holds rows 16 w .. 16 w + 15 laid out as mma.m16n8k16's C (each
    8-column block) and A: what lets P go from S's registers to the next wgmma, and lets the
    mma.sync quad reductions serve the wgmma softmax."""
    for w, lane in itertools.product(range(4), range(32)):
        for j, i in itertools.product(range(8), range(4)):
            r, c = mma.c_coords(lane, i)
            assert wgmma.acc_coords(32 * w + lane, 4 * j + i) == (16 * w + r, 8 * j + c)
        for i in range(8):
            r, c = mma.a_coords(lane, i)
            assert wgmma.a_coords(32 * w + lane, i) == (16 * w + r, c)
    d = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    np.testing.assert_array_equal(wgmma.matrix_from_acc(wgmma.acc_fragments(d)), d)


def _py(fn):
    return getattr(fn, "py_func", fn)


@pytest.mark.parametrize("N", [16, 64, 192])
def test_fragment_view_is_the_accumulator_cell_for_cell(N):
    """make_fragment_view: d_i of a thread is view cell (r, c) with r the row bit of
    acc_coords (row g or g + 8 of its warp) and c its column pair: the mma.sync view of one
    16-row tile (warp_gemm.ACC_ROWS / ACC_COLS), so the forward's softmax stages read it."""
    from numba_flash.kernels.mainloop.warp_gemm import ACC_COLS, ACC_ROWS

    to_tuple, from_tuple = (_py(f) for f in wgmma.make_fragment_view(N))
    for t in (0, 5, 37, 127):
        w, g, tt = t >> 5, (t & 31) >> 2, t & 3
        v = np.zeros((2, N // 4), np.float32)
        for r in range(2):
            for c in range(N // 4):   # the view's (row, col) as the mma.sync layouts give them
                v[r, c] = 1000 * (16 * w + g + ACC_ROWS.offset(r)) + 2 * tt + ACC_COLS.offset(c)
        d = to_tuple(v)
        assert len(d) == N // 2
        for i in range(N // 2):
            row, col = wgmma.acc_coords(t, i)
            assert d[i] == 1000 * row + col, (t, i)
        back = np.zeros_like(v)
        from_tuple(d, back)
        np.testing.assert_array_equal(back, v)


def test_a_pack_is_the_a_fragment_of_each_k_block(rng):
    """make_a_pack: pa[4 j + q] packs k-block j's A registers from the view (a_coords' cells
    shifted 16 j columns), rounded to float16; a_words is the same words as a tuple."""
    K_STEPS = 3
    a_pack, a_words = (_py(f) for f in wgmma.make_a_pack(K_STEPS, "float16"))
    s = rng.standard_normal((64, 16 * K_STEPS)).astype(np.float32)
    for t in (0, 9, 100):
        w, g, tt = t >> 5, (t & 31) >> 2, t & 3
        v = np.zeros((2, 4 * K_STEPS), np.float32)   # the thread's view of S (its 2 rows)
        for r in range(2):
            for c in range(4 * K_STEPS):
                v[r, c] = s[16 * w + g + 8 * r, 8 * (c >> 1) + 2 * tt + (c & 1)]
        pa = np.zeros(4 * K_STEPS, np.uint32)
        a_pack(v, pa)
        halves = pa.view(np.uint16).view(np.float16)
        for j in range(K_STEPS):
            for i in range(8):
                row, col = wgmma.a_coords(t, i)
                assert halves[8 * j + i] == np.float16(s[row, 16 * j + col]), (t, j, i)
        assert tuple(int(x) for x in a_words(pa)) == tuple(int(x) for x in pa)


def test_descriptor_plus_a_step_is_the_descriptor_of_the_k_block():
    """desc_at(desc_lo(addr, hi), start >> 4, hi) (one 32-bit add, the high word a constant:
    desc_pack) equals encode_descriptor of the k-block's own start, for every k-block of the
    forward's tiles."""
    for lay, major in ((TileLayout(128, 64), "K"), (TileLayout(192, 128), "MN"),
                       (TileLayout(64, 128), "K")):
        hi = lay.desc_hi(major)
        for addr in (0x400, 0x12C00, 0x37C00):
            lo = _py(wgmma.desc_lo)(addr, hi)
            for kk in range((lay.COLS if major == "K" else lay.ROWS) // 16):
                d = lay.descriptor(major, kk)
                got = _py(wgmma.desc_at)(lo, np.uint32(d.start >> 4), hi)
                assert int(got) == wgmma.encode_descriptor(addr + d.start, d.lbo, d.sbo,
                                                           d.swizzle)
    assert int(_py(wgmma.desc_pack)(np.uint32(0x10240), np.uint32(0x40000040))) == \
        0x4000004000010240


def test_static_fold_carries_a_value_through_unrolled_steps():
    from numba_flash.kernels.core.jit import static_fold

    def step(i, ctx, x):
        return x * ctx + i

    assert _py(static_fold(5, step))(10, 0) == 1234   # ((((0 + 0) 10 + 1) 10 + 2) 10 + 3) 10 + 4
    assert _py(static_fold(0, step))(10, 7) == 7


# -- descriptors -----------------------------------------------------------------------------
def test_descriptor_bits_by_hand():
    """start 0x2400, LBO 16 (encoded 1: unused by swizzled K-major), SBO 1024, 128-byte swizzle
    (mode 1 in bits 62-63): the upper word 0x40000040 is what ptxas loads for the probe GEMM."""
    desc = wgmma.encode_descriptor(0x2400, 16, 1024, 128)
    assert desc == (0x240 | 1 << 16 | 64 << 32 | 1 << 62) == 0x4000004000010240
    assert wgmma.decode_descriptor(desc) == wgmma.Descriptor(0x2400, 16, 1024, 128, 0)
    assert wgmma.encode_descriptor(0x3FFF0, 0x3FFF0, 0x10, 32, 5) >> 62 == 3
    assert wgmma.decode_descriptor(wgmma.encode_descriptor(16, 2048, 128, 64, 3)) == \
        wgmma.Descriptor(16, 2048, 128, 64, 3)
    hi = TileLayout(64, 64, 128).desc_hi("K")
    make_desc = getattr(wgmma.make_desc, "py_func", wgmma.make_desc)
    assert int(make_desc(0x2400, hi)) == desc  # the device function's arithmetic


@pytest.mark.parametrize("bad", [dict(start=8), dict(lbo=2**18), dict(sbo=-16),
                                 dict(swizzle=16), dict(base_offset=8)])
def test_descriptor_fields_out_of_range_are_refused(bad):
    args = dict(start=0, lbo=16, sbo=1024, swizzle=128, base_offset=0) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        wgmma.encode_descriptor(**args)


def test_swizzle_permutes_16_byte_chunks_as_the_isa_figures():
    """128 B: chunk c of row r (rows 128 B apart) is stored at chunk c ^ r; 64 B (rows 64 B
    apart): c ^ (r >> 1) for pairs of rows; 32 B: c ^ (r >> 2); none: unchanged."""
    for r, c in itertools.product(range(8), range(8)):
        assert wgmma.swizzle_address(r * 128 + 16 * c, 128) == r * 128 + 16 * (c ^ r)
        assert wgmma.swizzle_address(r * 128 + 16 * c + 6, 128) == r * 128 + 16 * (c ^ r) + 6
        assert wgmma.swizzle_address(r * 128 + 16 * c, 0) == r * 128 + 16 * c
    for r, c in itertools.product(range(8), range(4)):
        assert wgmma.swizzle_address(r * 64 + 16 * c, 64) == r * 64 + 16 * (c ^ (r >> 1))
    for r, c in itertools.product(range(8), range(2)):
        assert wgmma.swizzle_address(r * 32 + 16 * c, 32) == r * 32 + 16 * (c ^ (r >> 2))
    assert wgmma.swizzle_address(1024 + 128 + 16, 128) == 1024 + 128  # periodic in 1024 B


#: the ISA's worked examples ("Canonical Layouts"): (major, swizzle, element bytes, exact layout
#: in elements, LBO and SBO in elements); the tf32 32 B one as printed (K runs on past a row)
ISA_EXAMPLES = [
    ("K", 0, 4, (((8, 2), (4, 4)), ((4, 32), (1, 64))), 64, 32),
    ("K", 32, 4, (((8, 2), (4, 4)), ((8, 64), (1, 4))), None, 64),
    ("MN", 0, 2, (((8, 1, 2), (8, 2)), ((1, 8, 64), (8, 128))), 128, 64),
    ("MN", 32, 2, (((8, 2, 2), (8, 2)), ((1, 8, 128), (16, 256))), 128, 256),
    ("MN", 64, 2, (((8, 4, 2), (8, 2)), ((1, 8, 256), (32, 512))), 256, 512),
]


@pytest.mark.parametrize("major, swizzle, eb, exact, lbo, sbo", ISA_EXAMPLES)
def test_canonical_layouts_match_the_isa_examples(major, swizzle, eb, exact, lbo, sbo):
    shape, stride = exact
    mn, k = (int(np.prod(s)) for s in shape)
    off = wgmma.canonical_offsets(major, swizzle, (lbo or 1) * eb, sbo * eb, mn, k, eb)
    want = np.array([[cute(shape, stride, (i, j)) for j in range(k)] for i in range(mn)])
    np.testing.assert_array_equal(off, want * eb)


@pytest.mark.parametrize("swizzle", wgmma.SWIZZLES)
@pytest.mark.parametrize("major", wgmma.MAJORS)
@pytest.mark.parametrize("N", wgmma.WGMMA_N)
def test_descriptor_reads_back_every_k_block_of_a_tile(rng, N, major, swizzle):
    """A tile packed by the layout (the copy helper's offsets), read through the descriptor of
    each k-block the way the instruction does (decode, canonical layout, swizzle): exactly the
    operand's N x 16 block, at a 1024-aligned arena address."""
    W = swizzle or 16
    span = max(N, W // 2)  # a MN-major tile holds whole W-byte blocks of columns
    K = max(32, W // 2)
    lay = TileLayout(N, K, swizzle) if major == "K" else TileLayout(K, span, swizzle)
    m = rng.integers(0, 2**16, (lay.ROWS, lay.COLS), dtype=np.uint16)
    words = lay.pack(m)
    offs = lay.offsets()
    assert sorted(offs.ravel()) == list(range(0, lay.BYTES, 2))  # every byte once
    base = 0x2400
    for kk in range(K // 16):
        d = lay.descriptor(major, kk, mn=N)
        desc = wgmma.encode_descriptor(base + d.start, d.lbo, d.sbo, d.swizzle)
        got = words[(wgmma.operand_addresses(desc, major, N) - base) // 2]
        want = m[:N, 16 * kk:16 * kk + 16] if major == "K" else m[16 * kk:16 * kk + 16, :N].T
        np.testing.assert_array_equal(got, want)


def test_descriptor_of_an_operand_inside_a_tile():
    """The second 64 rows of a 128-row K-major tile (two warpgroups' Q), the second 64 columns
    of a 128-wide MN-major one (V's columns 64..127)."""
    rng = np.random.default_rng(3)
    for major, lay in (("K", TileLayout(128, 64, 128)), ("MN", TileLayout(32, 128, 128))):
        m = rng.integers(0, 2**16, (lay.ROWS, lay.COLS), dtype=np.uint16)
        words = lay.pack(m)
        d = lay.descriptor(major, 1, mn0=64, mn=64)
        desc = wgmma.encode_descriptor(1024 + d.start, d.lbo, d.sbo, d.swizzle)
        got = words[(wgmma.operand_addresses(desc, major, 64) - 1024) // 2]
        want = m[64:, 16:32] if major == "K" else m[16:32, 64:].T
        np.testing.assert_array_equal(got, want)


def test_layout_and_descriptor_refuse_what_does_not_fit():
    with pytest.raises(ValueError, match="COLS"):
        TileLayout(64, 32, 128).check()  # 64 bytes a row: not a whole 128-byte block
    with pytest.raises(ValueError, match="ROWS"):
        TileLayout(60, 64, 0).check()
    with pytest.raises(ValueError, match="SWIZZLE"):
        TileLayout(64, 64, 16).check()
    with pytest.raises(ValueError, match="k-block"):
        TileLayout(64, 64, 128).descriptor("K", 4)
    with pytest.raises(ValueError, match="mn0"):
        TileLayout(64, 64, 128).descriptor("MN", 0, mn0=8)
    with pytest.raises(ValueError, match="major"):
        TileLayout(64, 64, 128).descriptor("M", 0)
    desc = wgmma.encode_descriptor(1024 + 3 * 128, 16, 1024, 128)  # row 3 of an atom
    with pytest.raises(ValueError, match="first 128-byte row"):
        wgmma.operand_addresses(desc, "K", 64)
    with pytest.raises(ValueError, match="base offset"):
        wgmma.operand_addresses(wgmma.encode_descriptor(0, 16, 1024, 128, 2), "K", 64)
    with pytest.raises(ValueError, match="N"):
        wgmma.make_wgmma(24)
    with pytest.raises(ValueError, match="dtype"):
        wgmma.make_wgmma(64, "float32")
    with pytest.raises(ValueError, match="TRANS_A"):
        wgmma.make_wgmma(64, "float16", "regs", 1)


# -- the tile copy ---------------------------------------------------------------------------
def copy_kernel(lay, vec):
    """One warpgroup copies ``src`` (rows, columns and row stride given) into a ``lay`` tile at
    the aligned start of the arena (the pad past ``smem[0]`` included); ``out`` gets the tile's
    bytes as 16-bit words."""
    copy = wgmma.make_tile_copy(lay, 128, vec)
    words = (lay.BYTES + wgmma.ARENA_ALIGN) // 4

    @cuda.jit
    def k(src, stride, rows, cols, out):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(words, types.uint32)
        pad = wgmma.align_pad(smem)
        copy(smem, pad, src, 0, stride, rows, cols, tid)
        wgmma.tiles_ready()
        for i in range(tid, lay.BYTES // 4, 128):
            w = smem[(pad >> 2) + i]
            out[2 * i] = w & 0xFFFF
            out[2 * i + 1] = w >> 16

    return k


@pytest.mark.parametrize("lay, vec, rows, cols", [(TileLayout(24, 64, 128), True, 17, 64),
                                                  (TileLayout(16, 32, 64), False, 16, 27),
                                                  (TileLayout(8, 24, 0), False, 5, 24)])
def test_tile_copy_writes_the_layout_with_zeros_past_the_edges(rng, lay, vec, rows, cols):
    """cp.async (a boundary tile: rows past ``rows`` zero-filled) and the 16-bit path (columns
    past ``cols`` zero too, an odd row stride) write what ``TileLayout.pack`` says."""
    stride = cols if vec else cols + 3
    src = rng.integers(1, 2**16, (rows + 1, stride), dtype=np.uint16)
    want = np.zeros((lay.ROWS, lay.COLS), np.uint16)
    want[:rows, :cols] = src[:rows, :cols]
    out = np.full(lay.BYTES // 2, 0xDEAD, np.uint16)
    launch(copy_kernel(lay, vec), src, stride, rows, cols, out)
    np.testing.assert_array_equal(out, lay.pack(want))


# -- end to end on one warpgroup -------------------------------------------------------------
def bits(x, dtype):
    """Random-normal ``x`` as 16-bit ``dtype`` (values, bits)."""
    v = x.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    return v.astype(np.float64), v.view(np.uint16)


def launch(kernel, *args, threads=128):
    with simulator.fast_switching():
        kernel[1, threads](*args)


def within(got, want, K):
    """The bound of the module docstring: 2e-6 of max |want| per 64 of K."""
    tol = 2e-6 * max(1.0, np.abs(want).max()) * max(1, K // 64)
    err = np.abs(got.astype(np.float64) - want).max()
    assert err <= tol, (err, tol)


#: (N, K, dtype, swizzle, A source, B major, warpgroups): every N, both types, SS and RS, both
#: majors of B, every swizzle; two warpgroups sharing B (FA3's two consumers), SS and RS
GEMMS = [(64, 64, "float16", 128, "smem", "K", 1), (128, 64, "bfloat16", 128, "regs", "MN", 1),
         (256, 16, "float16", 32, "smem", "K", 1), (32, 32, "bfloat16", 64, "smem", "MN", 1),
         (16, 32, "float16", 0, "regs", "K", 1), (8, 32, "bfloat16", 0, "smem", "MN", 1),
         (64, 64, "bfloat16", 128, "smem", "MN", 2), (8, 32, "float16", 64, "regs", "K", 2)]


@pytest.mark.parametrize("N, K, dtype, swizzle, a_src, major, wgs", GEMMS)
def test_gemm_matches_float64(rng, N, K, dtype, swizzle, a_src, major, wgs):
    M = 64 * wgs
    a, a16 = bits(rng.standard_normal((M, K)), dtype)
    b, b16 = bits(rng.standard_normal((K, N)), dtype)
    c = rng.standard_normal((M, N)).astype(np.float32)
    d = np.full((M, N), np.nan, np.float32)
    b_arg = np.ascontiguousarray(b16.T) if major == "K" else b16
    launch(wgmma.wgmma_gemm_kernel(N, K, dtype, swizzle, a_src, major, wgs), a16, b_arg, c, d,
           threads=128 * wgs)
    within(d, a @ b + c, K)


@pytest.mark.parametrize("N1, K, N2, dtype", [(64, 64, 64, "float16"),
                                              (32, 128, 128, "bfloat16")])
def test_chain_ss_then_rs_matches_float64(rng, N1, K, N2, dtype):
    """S = Q K^T by SS, then O = P V with P = dtype(S) from S's registers (RS) and V MN-major."""
    q, q16 = bits(rng.standard_normal((64, K)), dtype)
    k, k16 = bits(rng.standard_normal((N1, K)) / np.sqrt(K), dtype)
    v, v16 = bits(rng.standard_normal((N1, N2)), dtype)
    s = np.full((64, N1), np.nan, np.float32)
    o = np.full((64, N2), np.nan, np.float32)
    launch(wgmma.wgmma_chain_kernel(N1, K, N2, dtype), q16, k16, v16, s, o)
    within(s, q @ k.T, K)
    p, _ = bits(s, dtype)  # the kernel rounds its own float32 S: so does the reference
    within(o, p @ v, N1)


# -- the twin refuses what the hardware leaves undefined ------------------------------------
def misuse_kernel(case):
    """One warpgroup, ``A`` and ``B`` 64 x 16 / 16 x 8 float16 from a 2 KiB tile pair, with
    one rule broken: ``"no-fence"``, ``"no-wait"``, ``"overwrite"`` (B's tile rewritten under the
    pending mma) or ``"desc"`` (warp 3 passes another descriptor)."""
    mma8 = wgmma.make_wgmma(8)
    zeros = wgmma.make_acc_zeros(8)
    lay_a, lay_b = TileLayout(64, 16, 0), TileLayout(8, 16, 0)
    a_hi, b_hi = lay_a.desc_hi("K"), lay_b.desc_hi("K")

    @cuda.jit
    def k(out):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(1024, types.uint32)
        for i in range(tid, 1024, 128):
            smem[i] = 0x3C003C00  # float16 1.0 pairs
        cuda.syncthreads()  # the tiles are written before the warpgroup reads them
        base = wgmma.smem_address(smem)
        acc = zeros()
        if case != "no-fence":
            wgmma.wgmma_fence()
        db = wgmma.make_desc(base + 2048 + (16 if case == "desc" and tid >= 96 else 0), b_hi)
        acc = mma8(smem, wgmma.make_desc(base, a_hi), db, acc, 0)
        wgmma.wgmma_commit_group()
        if case == "overwrite":
            smem[512 + tid % 32] = 0
        if case != "no-wait":
            wgmma.wgmma_wait_group(0)
        acc = wgmma.fence_operand(acc)
        out[tid] = acc[0]

    return k


@on_sim
@pytest.mark.parametrize("case, match", [("no-fence", "wgmma_fence"),
                                         ("no-wait", "before a wgmma_wait_group"),
                                         ("overwrite", "changed before"),
                                         ("desc", "differ across the warpgroup")])
def test_twin_refuses_a_broken_rule(case, match):
    out = np.full(128, np.nan, np.float32)
    with pytest.raises(RuntimeError, match=match):
        launch(misuse_kernel(case), out)


@on_sim
def test_twin_kernel_without_a_broken_rule_runs():
    out = np.full(128, np.nan, np.float32)
    launch(misuse_kernel("ok"), out)
    np.testing.assert_array_equal(out, 16.0)  # 16 products of 1 * 1
