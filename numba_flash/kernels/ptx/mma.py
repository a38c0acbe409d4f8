"""Warp-level tensor-core primitives: ``mma.sync.m16n8k16`` (float16 or bfloat16 in, float32 out).

One ``mma.sync.aligned.m16n8k16`` computes ``D = A B + C`` for ``A`` 16 x 16, ``B`` 16 x 8 (16-bit
elements) and ``C``, ``D`` 16 x 8 float32.  Each of the 32 lanes holds a *fragment*, registers at
fixed (row, column) places (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type").
With ``g = lane >> 2`` (groupID) and ``t = lane % 4`` (threadID_in_group), and each 32-bit register
holding two 16-bit elements (element ``2i`` in the low half, ``2i + 1`` high):

=========  ==========================================  ======================================
operand    registers of lane ``(g, t)``                elements (row, column)
=========  ==========================================  ======================================
A 16x16    ``a0`` (a0, a1)   ``a1`` (a2, a3)           ``a0``: (g, 2t), (g, 2t+1);
           ``a2`` (a4, a5)   ``a3`` (a6, a7)           ``a1``: (g+8, 2t), (g+8, 2t+1);
                                                       ``a2``: (g, 2t+8), (g, 2t+9);
                                                       ``a3``: (g+8, 2t+8), (g+8, 2t+9)
B 16x8     ``b0`` (b0, b1)   ``b1`` (b2, b3)           ``b0``: (2t, g), (2t+1, g);
                                                       ``b1``: (2t+8, g), (2t+9, g)
C, D 16x8  four float32 ``c0 c1 c2 c3``                (g, 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1)
=========  ==========================================  ======================================

Every operand register is a ``uint32`` (Numba types ``uint32 + uint32`` as ``uint64``: register
arithmetic is wrapped in ``uint32(...)``).  The kernels call these names; the backend picks the
implementation at import (an ``@intrinsic`` emitting the PTX through ``ir.InlineAsm`` on the GPU, a
twin exchanging the warp's registers through :func:`numba_flash.simulator_warp.exchange` in the
simulator, computing in float64 and rounding to float32):

* :func:`mma_m16n8k16`, :func:`mma_m16n8k16_bf16`; :func:`pack_half2`, :func:`pack_bf16x2` (two
  float32 to one register, round to nearest even); :func:`mma_ops` ``(dtype)`` -> ``(mma,
  pack2)``, :func:`make_a_frag_from_c` ``(dtype)`` likewise for :func:`a_frag_from_c`;
* plain device functions (one source in both backends): :func:`half2_bits`,
  :func:`a_frag_from_c` (an ``A`` fragment from two accumulator fragments), :func:`load_a_frag`,
  :func:`load_b_frag`, :func:`load_b_frag_t` (``B`` from an untransposed tile), the ``_finite``
  loads, :func:`quad_max`, :func:`quad_sum` (over the 4 lanes of a quad).

File: the layout as host functions (:func:`a_coords`, ...: the docs picture, the tests, the
twin), the GPU intrinsics, the twins, the plain device functions, and the one-warp GEMM
:func:`warp_gemm_kernel` (the compile tier's and the tests' probe).  How the layout shapes the
kernels, the twins and their tests: docs/tensor-cores.md#what-a-tensor-core-computes.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types, uint32

from ...backend import on_simulator
from ..core.common import FULL_MASK
from ..core.jit import device_jit, kernel_jit

WARP = 32

#: the PTX instructions behind :func:`mma_m16n8k16` and :func:`mma_m16n8k16_bf16`
MMA_PTX = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
MMA_BF16_PTX = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#: ... and behind :func:`pack_half2` / :func:`pack_bf16x2` (``cvt.rn.X.f32 d, a, b``: ``a`` to
#: the upper half, ``b`` to the lower)
PACK_PTX = "cvt.rn.f16x2.f32"
PACK_BF16_PTX = "cvt.rn.bf16x2.f32"

#: the element types of the tensor-core operands
MMA_DTYPES = ("float16", "bfloat16")


# ------------------------------------------------------------------------------------------
# the fragment layout as host functions (the docs picture, the tests, the simulator twin)
# ------------------------------------------------------------------------------------------
def a_coords(lane, i):
    """(row, col) in the 16 x 16 ``A`` of half ``i`` (0..7, ``a_i``) held by ``lane``."""
    g, t = lane >> 2, lane % 4
    row = g if (i < 2 or 4 <= i < 6) else g + 8
    col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def b_coords(lane, i):
    """(row, col) in the 16 x 8 ``B`` of half ``i`` (0..3, ``b_i``) held by ``lane``."""
    g, t = lane >> 2, lane % 4
    return 2 * t + (i & 1) + (8 if i >= 2 else 0), g


def c_coords(lane, i):
    """(row, col) in the 16 x 8 ``C`` / ``D`` of float ``i`` (0..3, ``c_i``) held by ``lane``."""
    g, t = lane >> 2, lane % 4
    return g + (8 if i >= 2 else 0), 2 * t + (i & 1)


def _tables():
    a_lane = np.zeros((16, 16), np.intp)
    a_half = np.zeros((16, 16), np.intp)
    b_lane = np.zeros((16, 8), np.intp)
    b_half = np.zeros((16, 8), np.intp)
    for lane in range(WARP):
        for i in range(8):
            r, c = a_coords(lane, i)
            a_lane[r, c], a_half[r, c] = lane, i          # halves 0..7 of registers a0..a3
        for i in range(4):
            r, c = b_coords(lane, i)
            b_lane[r, c], b_half[r, c] = lane, 8 + i      # halves 8..11: registers b0, b1
    return a_lane, a_half, b_lane, b_half


_A_LANE, _A_HALF, _B_LANE, _B_HALF = _tables()


def fragments_from_matrices(a, b, c):
    """Per-lane registers ``(regs uint32 [32, 6], c float32 [32, 4])`` of float16 ``a [16, 16]``,
    ``b [16, 8]`` and float32 ``c [16, 8]``, laid out as the table of the module docstring."""
    halves = np.zeros((WARP, 12), np.float16)
    for lane in range(WARP):
        for i in range(8):
            halves[lane, i] = a[a_coords(lane, i)]
        for i in range(4):
            halves[lane, 8 + i] = b[b_coords(lane, i)]
    cf = np.array([[c[c_coords(lane, i)] for i in range(4)] for lane in range(WARP)], np.float32)
    return halves.view(np.uint32), cf


def matrix_from_c_fragments(d):
    """The 16 x 8 matrix whose lane fragments are ``d [32, 4]`` (the ``C`` / ``D`` layout)."""
    out = np.zeros((16, 8), np.asarray(d).dtype)
    for lane in range(WARP):
        for i in range(4):
            out[c_coords(lane, i)] = d[lane][i]
    return out


# ------------------------------------------------------------------------------------------
# GPU implementations: inline PTX
# ------------------------------------------------------------------------------------------
def _gpu_primitives():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    try:
        from numba.cuda.core.errors import NumbaTypeError
    except ImportError:  # pragma: no cover - other numba-cuda versions
        from numba.core.errors import NumbaTypeError

    # [docs:mma-intrinsic]
    def make_mma(ptx, name, elem):
        @intrinsic
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            """``(d0, d1, d2, d3) = A B + C`` on the tensor cores; the fragment layout of the
            module docstring.  ``a*``, ``b*`` uint32 (two 16-bit elements each), ``c*``
            float32."""
            regs = (a0, a1, a2, a3, b0, b1)
            accs = (c0, c1, c2, c3)
            if any(r != types.uint32 for r in regs):
                raise NumbaTypeError(f"{name}: expected the six A/B registers as uint32 (two "
                                     f"{elem} each; wrap integer arithmetic in uint32(...)), "
                                     f"got {regs}")
            if any(c != types.float32 for c in accs):
                raise NumbaTypeError(f"{name}: expected the four C values as float32, got "
                                     f"{accs}")
            sig = types.UniTuple(types.float32, 4)(*regs, *accs)

            def codegen(context, builder, sig, args):
                f32 = ir.FloatType()
                i32 = ir.IntType(32)
                fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
                asm = ir.InlineAsm(
                    fnty,
                    ptx + " {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                    "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                )
                res = builder.call(asm, list(args))
                outs = [builder.extract_value(res, i) for i in range(4)]
                return context.make_tuple(builder, sig.return_type, outs)

            return sig, codegen

        return mma
    # [/docs:mma-intrinsic]

    def make_pack(ptx, name, elem):
        @intrinsic
        def pack(typingctx, lo, hi):
            """One uint32 holding ``elem(lo)`` in the low and ``elem(hi)`` in the high 16
            bits (round to nearest even)."""
            if lo != types.float32 or hi != types.float32:
                raise NumbaTypeError(f"{name}: expected two float32, got {lo}, {hi}")
            sig = types.uint32(lo, hi)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                f32 = ir.FloatType()
                fnty = ir.FunctionType(i32, [f32, f32])
                # cvt.rn.{f16x2,bf16x2}.f32 d, a, b: a goes to the upper half, b to the lower
                asm = ir.InlineAsm(fnty, ptx + " $0, $2, $1;", "=r,f,f")
                return builder.call(asm, list(args))

            return sig, codegen

        return pack

    return (make_mma(MMA_PTX, "mma_m16n8k16", "float16"),
            make_pack(PACK_PTX, "pack_half2", "float16"),
            make_mma(MMA_BF16_PTX, "mma_m16n8k16_bf16", "bfloat16"),
            make_pack(PACK_BF16_PTX, "pack_bf16x2", "bfloat16"))


# ------------------------------------------------------------------------------------------
# simulator twins: the same layout, through memory
# ------------------------------------------------------------------------------------------
def halves_to_float64(words, dtype):
    """The 16-bit elements of uint32 registers ``words`` (low half first) as float64, read as
    ``dtype`` (``"float16"`` or ``"bfloat16"``: a bfloat16 is the upper half of a float32, so
    the widening is exact either way)."""
    h = np.ascontiguousarray(words, dtype=np.uint32).view(np.uint16)
    if dtype == "float16":
        return h.view(np.float16).astype(np.float64)
    return (h.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def float32_to_bf16_bits(x):
    """float32 values -> uint16 bfloat16 bit patterns, round to nearest even (``cvt.rn``):
    NaN stays NaN (quietened), a value past the largest bfloat16 rounds to inf."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    sh = np.uint64(16)
    rounded = (bits + np.uint64(0x7FFF) + ((bits >> sh) & np.uint64(1))) >> sh
    nan = ((bits >> sh) | np.uint64(0x0040)) & np.uint64(0xFFFF)
    return np.where(np.isnan(x), nan, rounded).astype(np.uint16)


# [docs:mma-twin]
def _sim_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, dtype):
    """Simulator twin of the ``mma``: every lane publishes its six registers, ``A`` and ``B``
    are rebuilt by the PTX table and multiplied once for the warp (float64), and each lane adds
    its own accumulator to its four ``D`` elements (then float32)."""
    from ... import simulator_warp

    def product(regs):   # the warp's A B [16, 8], computed by one lane
        if len(regs) != WARP:
            raise RuntimeError(f"mma_m16n8k16: needs a full warp of 32 lanes, got {len(regs)}")
        halves = halves_to_float64(np.array(regs, dtype=np.uint32), dtype)  # [32, 12]
        with np.errstate(invalid="ignore", over="ignore"):
            return halves[_A_LANE, _A_HALF] @ halves[_B_LANE, _B_HALF]   # [16, 16] [16, 8]

    p = simulator_warp.exchange_once((int(a0), int(a1), int(a2), int(a3), int(b0), int(b1)),
                                     product)
    lane = simulator_warp.lane_id()
    g, t = lane >> 2, lane % 4
    with np.errstate(invalid="ignore", over="ignore"):
        d = p[[g, g + 8]][:, [2 * t, 2 * t + 1]]  # [2, 2]: rows g, g+8; columns 2t, 2t+1
        d = d + np.array([[c0, c1], [c2, c3]], np.float64)
    d = d.astype(np.float32)
    return d[0, 0], d[0, 1], d[1, 0], d[1, 1]


def _sim_mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """Twin of :func:`mma_m16n8k16` (float16 operands)."""
    return _sim_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, "float16")
# [/docs:mma-twin]


def _sim_mma_m16n8k16_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """Twin of :func:`mma_m16n8k16_bf16` (bfloat16 operands)."""
    return _sim_mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, "bfloat16")


def _sim_pack_half2(lo, hi):
    """Simulator twin of :func:`pack_half2` (NumPy's float32 -> float16 rounds to nearest even)."""
    with np.errstate(over="ignore"):
        pair = np.array([lo, hi], np.float32).astype(np.float16)
    return np.uint32(pair.view(np.uint32)[0])


def _sim_pack_bf16x2(lo, hi):
    """Simulator twin of :func:`pack_bf16x2`: bfloat16(lo) | bfloat16(hi) << 16, round to
    nearest even (:func:`float32_to_bf16_bits`)."""
    return np.uint32(float32_to_bf16_bits(np.array([lo, hi], np.float32)).view(np.uint32)[0])


if on_simulator():
    mma_m16n8k16 = _sim_mma_m16n8k16
    pack_half2 = _sim_pack_half2
    mma_m16n8k16_bf16 = _sim_mma_m16n8k16_bf16
    pack_bf16x2 = _sim_pack_bf16x2
else:
    mma_m16n8k16, pack_half2, mma_m16n8k16_bf16, pack_bf16x2 = _gpu_primitives()


def dtype_name(dtype):
    """``"float16"`` or ``"bfloat16"`` for a tensor-core element type given as a name, a NumPy
    dtype (``ml_dtypes.bfloat16`` included) or a Numba type; ValueError otherwise."""
    if isinstance(dtype, str):
        name = dtype
    elif isinstance(dtype, types.Type):
        name = str(dtype)
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = repr(dtype)
    if name not in MMA_DTYPES:
        raise ValueError(f"dtype: expected one of {MMA_DTYPES} for the tensor cores, got {name}")
    return name


def mma_ops(dtype):
    """``(mma, pack2)`` of the element type ``dtype`` (``float16`` or ``bfloat16``, see
    :func:`dtype_name`): :func:`mma_m16n8k16` and :func:`pack_half2`, or
    :func:`mma_m16n8k16_bf16` and :func:`pack_bf16x2`.  Called in a kernel factory, so the
    kernel's element type is a compile-time choice."""
    if dtype_name(dtype) == "float16":
        return mma_m16n8k16, pack_half2
    return mma_m16n8k16_bf16, pack_bf16x2


# ------------------------------------------------------------------------------------------
# plain device functions (the same source runs in both backends)
# ------------------------------------------------------------------------------------------
_device = functools.partial(device_jit, inline=True)

_SHIFT16 = uint32(16)
_LOW16 = uint32(0xFFFF)
_EXP16 = uint32(0x7C00)  # float16 exponent bits: all set = inf or NaN


@_device
def half2_bits(lo, hi):
    """One register from two float16 bit patterns (integers < 2**16): ``lo | hi << 16``."""
    return uint32(uint32(lo) | uint32(uint32(hi) << _SHIFT16))


@_device
def a_frag_from_c(c, f0, f1):
    """Registers ``a0..a3`` of a 16 x 16 ``A`` block from two of this lane's float32 accumulator
    fragments: ``c[f0, :]`` holds its columns 0..7, ``c[f1, :]`` its columns 8..15.  By the
    table, ``C``'s (g, 2t), (g, 2t+1) are ``a0``'s halves and (g+8, 2t), (g+8, 2t+1) ``a1``'s (and
    ``a2``, ``a3`` the same for ``f1``), so ``P`` or ``dS`` goes from the accumulators of one
    ``mma`` into the next without touching memory (rounded to float16 by :func:`pack_half2`)."""
    return (pack_half2(c[f0, 0], c[f0, 1]), pack_half2(c[f0, 2], c[f0, 3]),
            pack_half2(c[f1, 0], c[f1, 1]), pack_half2(c[f1, 2], c[f1, 3]))


@functools.lru_cache(maxsize=None)
def make_a_frag_from_c(dtype):
    """:func:`a_frag_from_c` for the element type ``dtype`` (``float16``: that function;
    ``bfloat16``: the same with :func:`pack_bf16x2`)."""
    _mma, pack2 = mma_ops(dtype)
    if pack2 is pack_half2:
        return a_frag_from_c

    @_device
    def a_frag_from_c_bf16(c, f0, f1):
        """:func:`a_frag_from_c` with the halves rounded to bfloat16."""
        return (pack2(c[f0, 0], c[f0, 1]), pack2(c[f0, 2], c[f0, 3]),
                pack2(c[f1, 0], c[f1, 1]), pack2(c[f1, 2], c[f1, 3]))

    return a_frag_from_c_bf16


@_device
def load_a_frag(tile, row0, word0, g, t):
    """Registers ``a0..a3`` of the 16 x 16 ``A`` block at rows ``row0 ..`` and half columns
    ``2 word0 ..`` of ``tile`` (uint32 ``[rows, words]``, word ``w`` of a row = halves ``2w``,
    ``2w + 1``): ``a0 = tile[row0+g, word0+t]``, ``a1 = tile[row0+g+8, word0+t]``,
    ``a2 = tile[row0+g, word0+4+t]``, ``a3 = tile[row0+g+8, word0+4+t]``."""
    return (tile[row0 + g, word0 + t], tile[row0 + g + 8, word0 + t],
            tile[row0 + g, word0 + 4 + t], tile[row0 + g + 8, word0 + 4 + t])


@_device
def load_b_frag(tile, n0, word0, g, t):
    """Registers ``b0, b1`` of the 16 x 8 ``B`` block whose column ``n`` is row ``n0 + n`` of
    ``tile`` (uint32 ``[n, words]``, i.e. ``B`` stored transposed: a row of ``K`` for
    ``S = Q K^T``): ``b0 = tile[n0+g, word0+t]`` (``k = 2t, 2t+1``), ``b1 = tile[n0+g,
    word0+4+t]`` (``k = 2t+8, 2t+9``)."""
    return tile[n0 + g, word0 + t], tile[n0 + g, word0 + 4 + t]


@_device
def load_b_frag_t(tile, k0, n0, g, t):
    """Registers ``b0, b1`` of the 16 x 8 ``B`` block whose row ``k`` is row ``k0 + k`` of
    ``tile`` (uint32 ``[k, words]``: ``B`` stored as is, ``n`` along the packed halves), i.e.
    ``B[k, n] = tile half (k0 + k, n0 + n)``: ``b0`` packs halves ``(k0+2t, n0+g)`` and
    ``(k0+2t+1, n0+g)``, ``b1`` rows ``k0+2t+8`` and ``k0+2t+9``.  The two halves of a register
    come from two rows, so each is cut out of its word (what ``ldmatrix.trans`` does in
    hardware): 4 loads instead of 2.  Used by the tests and :func:`warp_gemm_kernel`; the
    backward reads such operands with ``ldmatrix.trans`` (:mod:`numba_flash.kernels.ptx.stages`)."""
    col = n0 + g
    word = col >> 1
    sh = uint32((col & 1) * 16)
    h0 = uint32(tile[k0 + 2 * t, word] >> sh) & _LOW16
    h1 = uint32(tile[k0 + 2 * t + 1, word] >> sh) & _LOW16
    h2 = uint32(tile[k0 + 2 * t + 8, word] >> sh) & _LOW16
    h3 = uint32(tile[k0 + 2 * t + 9, word] >> sh) & _LOW16
    return half2_bits(h0, h1), half2_bits(h2, h3)


@_device
def finite_half(h):
    """A float16 bit pattern, or 0 (+0.0) if it is inf or NaN (all exponent bits set)."""
    return h if (h & _EXP16) != _EXP16 else uint32(0)


@_device
def load_b_frag_t_finite(tile, k0, n0, g, t):
    """:func:`load_b_frag_t` with every inf / NaN half replaced by 0 (not used by the kernels:
    the backward zeroes non-finite chunks with ``stages.make_tile_scan``).  The rule it
    implements: a non-finite ``q`` or ``k`` of a pair the row sees has
    already made that row's ``dS`` NaN (through ``S``), and one of a pair it does not see must
    not turn its ``dS = 0`` into ``0 * inf = NaN`` on the tensor core."""
    col = n0 + g
    word = col >> 1
    sh = uint32((col & 1) * 16)
    h0 = finite_half(uint32(tile[k0 + 2 * t, word] >> sh) & _LOW16)
    h1 = finite_half(uint32(tile[k0 + 2 * t + 1, word] >> sh) & _LOW16)
    h2 = finite_half(uint32(tile[k0 + 2 * t + 8, word] >> sh) & _LOW16)
    h3 = finite_half(uint32(tile[k0 + 2 * t + 9, word] >> sh) & _LOW16)
    return half2_bits(h0, h1), half2_bits(h2, h3)


@_device
def quad_max(x):
    """The max of ``x`` over the 4 lanes ``4g .. 4g+3`` (a row of a ``C`` fragment); NaN wins."""
    y = cuda.shfl_xor_sync(FULL_MASK, x, 1)
    x = y if (y > x or y != y) else x
    y = cuda.shfl_xor_sync(FULL_MASK, x, 2)
    return y if (y > x or y != y) else x


@_device
def quad_sum(x):
    """The sum of ``x`` over the 4 lanes ``4g .. 4g+3`` (a row of a ``C`` fragment)."""
    x += cuda.shfl_xor_sync(FULL_MASK, x, 1)
    return x + cuda.shfl_xor_sync(FULL_MASK, x, 2)


# ------------------------------------------------------------------------------------------
# a one-warp GEMM: the primitives end to end (tests, compile tier, docs)
# ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def warp_gemm_kernel(K, DTYPE="float16"):
    """``kernel(a, b, c, d, d16)``: ``d = a @ b + c`` for uint16 bits ``a [16, K]``,
    ``b [K, 8]`` and float32 ``c``, ``d [16, 8]``, on one warp (``block = 32``); ``K`` a multiple
    of 16.  ``a`` goes through shared memory as packed rows, ``b`` transposed (a row per column
    ``n``), then ``K / 16`` mma steps accumulate in registers.  ``d`` gets the float32
    accumulator and ``d16`` (uint32 ``[16, 4]``) its rounding to ``DTYPE``, packed by
    :func:`pack_half2` (word ``w`` of row ``r`` = columns ``2w``, ``2w + 1``).  ``DTYPE``
    (``"float16"`` or ``"bfloat16"``): the element type of ``a``, ``b`` and ``d16``, through
    :func:`mma_ops`."""
    assert K % 16 == 0
    mma, pack2 = mma_ops(DTYPE)
    WORDS = K // 2
    STRIDE = WORDS + 4  # + 4 words: the 8 rows g of one fragment load fall in distinct banks

    @kernel_jit
    def warp_gemm(a, b, c, d, d16):
        lane = cuda.threadIdx.x & 31
        g = lane >> 2
        t = lane & 3
        a_tile = cuda.shared.array((16, STRIDE), types.uint32)
        bt_tile = cuda.shared.array((8, STRIDE), types.uint32)
        for idx in range(lane, 16 * WORDS, WARP):
            r = idx // WORDS
            w = idx % WORDS
            a_tile[r, w] = half2_bits(a[r, 2 * w], a[r, 2 * w + 1])
        for idx in range(lane, 8 * WORDS, WARP):
            n = idx // WORDS
            w = idx % WORDS
            bt_tile[n, w] = half2_bits(b[2 * w, n], b[2 * w + 1, n])
        cuda.syncthreads()  # the tiles are complete before any lane reads another's words
        c0 = c[g, 2 * t]
        c1 = c[g, 2 * t + 1]
        c2 = c[g + 8, 2 * t]
        c3 = c[g + 8, 2 * t + 1]
        for kc in range(K // 16):
            a0, a1, a2, a3 = load_a_frag(a_tile, 0, 8 * kc, g, t)
            b0, b1 = load_b_frag(bt_tile, 0, 8 * kc, g, t)
            c0, c1, c2, c3 = mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
        d[g, 2 * t] = c0
        d[g, 2 * t + 1] = c1
        d[g + 8, 2 * t] = c2
        d[g + 8, 2 * t + 1] = c3
        lo = pack2(c0, c1)  # row g, columns 2t, 2t+1 as one register of two halves
        hi = pack2(c2, c3)
        d16[g, t] = lo
        d16[g + 8, t] = hi

    return warp_gemm


@functools.lru_cache(maxsize=None)
def fragment_kernel(DTYPE="float16"):
    """``kernel(regs, c, d)``: each lane runs one ``mma`` (of ``DTYPE`` operands) on its own
    registers ``regs[lane]`` (uint32 x 6) and ``c[lane]`` (float32 x 4) and writes ``d[lane]``:
    the primitive alone, for a test that lays fragments out by the PTX table itself."""
    mma, _pack2 = mma_ops(DTYPE)

    @kernel_jit
    def fragment_mma(regs, c, d):
        lane = cuda.threadIdx.x & 31
        d0, d1, d2, d3 = mma(regs[lane, 0], regs[lane, 1], regs[lane, 2],
                                      regs[lane, 3], regs[lane, 4], regs[lane, 5],
                                      c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3])
        d[lane, 0] = d0
        d[lane, 1] = d1
        d[lane, 2] = d2
        d[lane, 3] = d3

    return fragment_mma
