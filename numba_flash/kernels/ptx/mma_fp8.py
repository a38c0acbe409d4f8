"""Warp-level fp8 tensor-core primitives: ``mma.sync.m16n8k32`` with e4m3 operands (sm_89+).

One ``mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32`` computes ``D = A B + C`` for ``A``
16 x 32, ``B`` 32 x 8 (e4m3 bytes) and ``C``, ``D`` 16 x 8 float32.  Each 32-bit register holds
four bytes, byte ``i`` (little-endian) being element ``i`` of the register (PTX ISA, "Matrix
Fragments for mma.m16n8k32"; CUTLASS's ``SM80_16x8x32`` layouts).  With ``g = lane >> 2`` and
``t = lane % 4``:

=========  ============================  ============================================
operand    registers of lane ``(g, t)``  elements (row, column), byte ``i`` = 0..3
=========  ============================  ============================================
A 16x32    ``a0 a1 a2 a3``               ``a0``: (g, 4t + i);       ``a1``: (g + 8, 4t + i);
                                         ``a2``: (g, 16 + 4t + i);  ``a3``: (g + 8, 16 + 4t + i)
B 32x8     ``b0 b1``                     ``b0``: (4t + i, g);       ``b1``: (16 + 4t + i, g)
C, D 16x8  four float32                  as ``m16n8k16``: (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
=========  ============================  ============================================

A lane's four bytes of one register are four consecutive ``k``: a row-major ``A`` tile and a
``B`` stored as ``N`` rows of ``K`` bytes (K-major: ``K`` for ``Q K^T``, ``V^T`` for ``P V``)
are read by the 16-bit kernels' ``ldmatrix`` addresses unchanged, a k-step being 32 bytes in
both.  The accumulator's ``C`` layout is *not* the ``A`` layout of ``P``: a lane holds keys
``2t, 2t + 1`` of each 8-key fragment, where ``A`` wants ``4t .. 4t + 3``.  Rather than
exchanging bytes between lanes, :func:`pack_e4m3x4` packs the lane's own four values, and the
kernel permutes the keys of ``V^T`` to match (:func:`p_key_of_k`).

* :func:`mma_m16n8k32_e4m3` (``a0..a3, b0, b1, c0..c3``) -> ``(d0, d1, d2, d3)``: an
  ``@intrinsic`` with the PTX on the GPU; in the simulator a twin that exchanges the warp's
  registers, reads the bytes as e4m3 (exact in float64) and rounds the sum to float32;
* :func:`pack_e4m3x4` ``(x0, x1, x2, x3)`` -> uint32: byte ``i`` the e4m3 of ``x_i`` (round to
  nearest even, saturated to +-448: two ``cvt.rn.satfinite.e4m3x2.f32``);
* host functions: :func:`a_coords`, :func:`b_coords` (the table), :func:`p_key_of_k`;
  :func:`warp_gemm_e4m3_kernel`, the one-warp probe the tests and the compile tier build.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from ...backend import on_simulator
from ..core.jit import kernel_jit
from .fp8 import e4m3_to_float64, float_to_e4m3_bits

WARP = 32

#: the PTX instruction behind :func:`mma_m16n8k32_e4m3` (sm_89 and later)
MMA_E4M3_PTX = "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"
#: the conversion behind :func:`pack_e4m3x4` (``d, a, b``: ``a`` to the upper byte of ``d``)
CVT_E4M3X2_PTX = "cvt.rn.satfinite.e4m3x2.f32"


# ------------------------------------------------------------------------------------------
# the fragment layout as host functions (the docs, the tests, the simulator twin)
# ------------------------------------------------------------------------------------------
def a_coords(lane, i):
    """(row, col) in the 16 x 32 ``A`` of byte ``i`` (0..15: register ``i // 4``, byte ``i % 4``)
    held by ``lane``."""
    g, t = lane >> 2, lane % 4
    reg, byte = divmod(i, 4)
    return g + 8 * (reg & 1), 16 * (reg >> 1) + 4 * t + byte


def b_coords(lane, i):
    """(row, col) in the 32 x 8 ``B`` of byte ``i`` (0..7) held by ``lane``."""
    g, t = lane >> 2, lane % 4
    reg, byte = divmod(i, 4)
    return 16 * reg + 4 * t + byte, g


def p_key_of_k(k):
    """The key of a 32-key ``P V`` step whose probability a lane packs as ``k`` of ``A``: the
    lane holding ``k = 16 h + 4 t + i`` (``i`` = 0..3) packs, of its accumulator, keys ``16 h
    + 2 t + (i & 1) + 8 (i >> 1)`` (its two columns of two 8-key fragments)."""
    h, rest = divmod(k, 16)
    t, i = divmod(rest, 4)
    return 16 * h + 2 * t + (i & 1) + 8 * (i >> 1)


def _tables():
    a_lane = np.zeros((16, 32), np.intp)
    a_byte = np.zeros((16, 32), np.intp)
    b_lane = np.zeros((32, 8), np.intp)
    b_byte = np.zeros((32, 8), np.intp)
    for lane in range(WARP):
        for i in range(16):
            a_lane[a_coords(lane, i)], a_byte[a_coords(lane, i)] = lane, i
        for i in range(8):
            b_lane[b_coords(lane, i)], b_byte[b_coords(lane, i)] = lane, 16 + i
    return a_lane, a_byte, b_lane, b_byte


_A_LANE, _A_BYTE, _B_LANE, _B_BYTE = _tables()


# ------------------------------------------------------------------------------------------
# GPU implementations: inline PTX
# ------------------------------------------------------------------------------------------
def _gpu_primitives():
    from .stages import gpu_helpers

    h = gpu_helpers()
    ir, intrinsic, type_error, i32, f32 = h.ir, h.intrinsic, h.NumbaTypeError, h.i32, h.f32

    @intrinsic
    def mma_m16n8k32_e4m3(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """``(d0, d1, d2, d3) = A B + C`` on the tensor cores (the module docstring's layout);
        ``a*``, ``b*`` uint32 (four e4m3 bytes each), ``c*`` float32."""
        regs = (a0, a1, a2, a3, b0, b1)
        accs = (c0, c1, c2, c3)
        if any(r != types.uint32 for r in regs):
            raise type_error(f"mma_m16n8k32_e4m3: expected the six A/B registers as uint32 (four "
                             f"e4m3 bytes each), got {regs}")
        if any(c != types.float32 for c in accs):
            raise type_error(f"mma_m16n8k32_e4m3: expected the four C values as float32, got "
                             f"{accs}")
        sig = types.UniTuple(types.float32, 4)(*regs, *accs)

        def codegen(context, builder, sig, args):
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(
                fnty, MMA_E4M3_PTX + " {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
                "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            res = builder.call(asm, list(args))
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, i) for i in range(4)])

        return sig, codegen

    # two conversions of two floats each (the upper byte of each .b16 is its first operand),
    # then the halves joined: byte i of the word is x_i
    pack_asm = ("{ .reg .b16 lo, hi;\n"
                f" {CVT_E4M3X2_PTX} lo, $2, $1;\n {CVT_E4M3X2_PTX} hi, $4, $3;\n"
                " mov.b32 $0, {lo, hi}; }")

    @intrinsic
    def pack_e4m3x4(typingctx, x0, x1, x2, x3):
        """One uint32 whose byte ``i`` is the e4m3 of ``x_i`` (nearest even, saturated)."""
        if any(x != types.float32 for x in (x0, x1, x2, x3)):
            raise type_error(f"pack_e4m3x4: expected four float32, got {(x0, x1, x2, x3)}")
        sig = types.uint32(x0, x1, x2, x3)

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(i32, [f32] * 4), pack_asm, "=r,f,f,f,f")
            return builder.call(asm, list(args))

        return sig, codegen

    return mma_m16n8k32_e4m3, pack_e4m3x4


# ------------------------------------------------------------------------------------------
# simulator twins: the same layout, through memory
# ------------------------------------------------------------------------------------------
def _sim_mma_m16n8k32_e4m3(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """Simulator twin of :func:`mma_m16n8k32_e4m3`: every lane publishes its six registers,
    ``A`` and ``B`` are rebuilt by the table and multiplied once for the warp, and each lane
    adds its accumulator to its four ``D`` elements (the e4m3 products are exact in float64; the
    sum rounded to float32 once)."""
    from ... import simulator_warp

    def product(regs):   # the warp's A B [16, 8], computed by one lane
        if len(regs) != WARP:
            raise RuntimeError(f"mma_m16n8k32_e4m3: needs a full warp of 32 lanes, got "
                               f"{len(regs)}")
        vals = e4m3_to_float64(np.array(regs, dtype=np.uint32).view(np.uint8))   # [32, 24]
        with np.errstate(invalid="ignore", over="ignore"):
            return vals[_A_LANE, _A_BYTE] @ vals[_B_LANE, _B_BYTE]   # [16, 32] [32, 8]

    p = simulator_warp.exchange_once((int(a0), int(a1), int(a2), int(a3), int(b0), int(b1)),
                                     product)
    lane = simulator_warp.lane_id()
    g, t = lane >> 2, lane % 4
    with np.errstate(invalid="ignore", over="ignore"):
        d = p[[g, g + 8]][:, [2 * t, 2 * t + 1]]
        d = d + np.array([[c0, c1], [c2, c3]], np.float64)
    d = d.astype(np.float32)
    return d[0, 0], d[0, 1], d[1, 0], d[1, 1]


def _sim_pack_e4m3x4(x0, x1, x2, x3):
    """Simulator twin of :func:`pack_e4m3x4` (:func:`~numba_flash.kernels.ptx.fp8.
    float_to_e4m3_bits`)."""
    return np.uint32(float_to_e4m3_bits(np.array([x0, x1, x2, x3], np.float32)).view(
        np.uint32)[0])


if on_simulator():
    mma_m16n8k32_e4m3 = _sim_mma_m16n8k32_e4m3
    pack_e4m3x4 = _sim_pack_e4m3x4
else:
    mma_m16n8k32_e4m3, pack_e4m3x4 = _gpu_primitives()


# ------------------------------------------------------------------------------------------
# a one-warp GEMM: the primitive end to end (tests, compile tier)
# ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def warp_gemm_e4m3_kernel(K):
    """``kernel(a, b, c, d)``: ``d = a @ b + c`` for e4m3 bytes ``a`` uint32 ``[16, K / 4]``
    (row-major words: four consecutive ``k`` a word) and ``bt`` uint32 ``[8, K / 4]`` (``B``
    transposed: a row of ``K`` bytes per column ``n``), float32 ``c``, ``d [16, 8]``, on one
    warp; ``K`` a multiple of 32.  Each lane reads its registers straight from the arrays by
    the layout table, then ``K / 32`` mma steps accumulate."""
    assert K % 32 == 0

    @kernel_jit
    def warp_gemm_e4m3(a, bt, c, d):
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        c0 = c[g, 2 * t]
        c1 = c[g, 2 * t + 1]
        c2 = c[g + 8, 2 * t]
        c3 = c[g + 8, 2 * t + 1]
        for kc in range(K // 32):
            w = 8 * kc + t           # the word of bytes 32 kc + 4 t .. + 3
            c0, c1, c2, c3 = mma_m16n8k32_e4m3(a[g, w], a[g + 8, w], a[g, w + 4], a[g + 8, w + 4],
                                               bt[g, w], bt[g, w + 4], c0, c1, c2, c3)
        d[g, 2 * t] = c0
        d[g, 2 * t + 1] = c1
        d[g + 8, 2 * t] = c2
        d[g + 8, 2 * t + 1] = c3

    return warp_gemm_e4m3
