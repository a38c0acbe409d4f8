"""fp8 (e4m3) in registers: four e4m3 bytes of one 32-bit word to four float32, and back.

The first stage of the fp8 work (issue 46): an fp8 KV cache is read 16 bytes at a time (four
words) and dequantised in registers, so the one primitive a decode kernel needs is the widening
of a word.  e4m3 (``ml_dtypes.float8_e4m3fn``, ``torch.float8_e4m3fn``): 1 sign, 4 exponent bits
(bias 7), 3 mantissa bits, largest finite 448, no infinity, ``S.1111.111`` is NaN.  Every e4m3
value is a float16 value (subnormals included), so the widening is exact.

* :func:`e4m3x4_to_float32` ``(word)`` -> 4 float32: byte ``i`` of the little-endian ``uint32``
  ``word`` (element ``i`` of the array in memory order) is value ``i``.  On the GPU: two
  ``cvt.rn.f16x2.e4m3x2`` (sm_89+: the upper byte of a 16-bit half goes to the upper float16)
  and four ``cvt.f32.f16``; in the simulator a twin that reads the bytes through ml_dtypes.
* :func:`e4m3x4_to_f16x2` ``(word)`` -> 2 uint32: the same values as two float16 pairs (the
  two ``cvt`` alone): how an e4m3 tile is widened into a float16 one in shared memory.
* :func:`float32_to_e4m3` ``(x)`` -> the e4m3 bits of ``x`` (a uint32 below 256), rounded to
  nearest even and saturated to +-448 (``cvt.rn.satfinite.e4m3x2.f32``; NaN stays NaN): how
  an append writes new tokens into an e4m3 cache.
* :func:`byte_perm` ``(a, b, sel)`` -> uint32: ``prmt.b32``, four bytes picked from the eight of
  ``a`` (bytes 0-3) and ``b`` (4-7), nibble ``i`` of ``sel`` choosing byte ``i``: the byte
  transposes of fp8 tiles (the warpgroup forward's ``V^T``) in one instruction a word;
* :func:`e4m3_to_float64` ``(bits)``: the host's reading of e4m3 bit patterns (tests, reference);
  :func:`float_to_e4m3_bits`: the host's saturating rounding (the twin's, the tests').
* :func:`e4m3_probe_kernel`: one word per thread, both ways (the tests and the compile tier's
  probe, built for sm_90 only: no sm_80 instruction converts fp8).

File: the host helpers, the GPU intrinsics, their twins, the probe kernel.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, types

from ...backend import on_simulator
from ..core.jit import kernel_jit

#: the PTX behind :func:`e4m3x4_to_float32` (``cvt.rn.f16x2.e4m3x2 d, a``: ``a`` a ``.b16``
#: holding two e4m3, its upper byte converted into ``d``'s upper float16); sm_89 and later
CVT_E4M3X2_PTX = "cvt.rn.f16x2.e4m3x2"
#: ... and behind :func:`float32_to_e4m3` (``cvt.rn.satfinite.e4m3x2.f32 d, a, b``: ``a`` to the
#: upper byte of the ``.b16`` ``d``, ``b`` to the lower)
CVT_F32_E4M3X2_PTX = "cvt.rn.satfinite.e4m3x2.f32"
#: the compute capability the probe is built for (fp8 conversions: sm_89+; the tier builds 90)
CC = (9, 0)
#: largest finite e4m3 value (``S.1111.110`` = 1.75 * 2**8)
E4M3_MAX = 448.0


def e4m3_to_float64(bits):
    """e4m3 bit patterns (integers 0..255, any shape) as float64 (NaN for ``0x7F``, ``0xFF``)."""
    import ml_dtypes

    return np.asarray(bits, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def float_to_e4m3_bits(x):
    """e4m3 bit patterns (uint8) of the values ``x``: round to nearest even, saturate to +-448
    (``satfinite``: no value becomes NaN by overflow), NaN to ``0x7F``."""
    import ml_dtypes

    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        clipped = np.where(np.isnan(x), np.float32(np.nan), np.clip(x, -E4M3_MAX, E4M3_MAX))
    return clipped.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


#: the PTX of :func:`e4m3x4_to_float32`: the word's halves, each widened to two float16, each
#: float16 to float32 (``$4`` the word, ``$0..$3`` the values)
_WIDEN_ASM = ("{ .reg .b16 lo, hi, a, b, c, d; .reg .b32 h01, h23;\n mov.b32 {lo, hi}, $4;\n"
              f" {CVT_E4M3X2_PTX} h01, lo;\n {CVT_E4M3X2_PTX} h23, hi;\n"
              " mov.b32 {a, b}, h01;\n mov.b32 {c, d}, h23;\n"
              " cvt.f32.f16 $0, a;\n cvt.f32.f16 $1, b;\n cvt.f32.f16 $2, c;\n"
              " cvt.f32.f16 $3, d; }")
#: ... of :func:`e4m3x4_to_f16x2`: the two ``cvt`` alone, their float16 pairs the outputs
_WIDEN_F16_ASM = ("{ .reg .b16 lo, hi;\n mov.b32 {lo, hi}, $2;\n"
                  f" {CVT_E4M3X2_PTX} $0, lo;\n {CVT_E4M3X2_PTX} $1, hi; }}")
#: ... of :func:`float32_to_e4m3`: ``$1`` into the low byte (0 into the high), widened to 32 bits
_ROUND_ASM = ("{ .reg .b16 pair; .reg .f32 zero; mov.f32 zero, 0f00000000;\n"
              f" {CVT_F32_E4M3X2_PTX} pair, zero, $1;\n cvt.u32.u16 $0, pair; }}")


def _gpu_primitives():
    """The two conversions as ``@intrinsic`` functions (one inline-PTX block each), built
    with :func:`~numba_flash.kernels.ptx.stages.gpu_helpers`' pieces."""
    from .stages import gpu_helpers

    h = gpu_helpers()
    ir, intrinsic, type_error, i32, f32 = h.ir, h.intrinsic, h.NumbaTypeError, h.i32, h.f32
    four_f32 = ir.LiteralStructType([f32] * 4)

    def widen(context, builder, sig, args):
        res = builder.call(ir.InlineAsm(ir.FunctionType(four_f32, [i32]), _WIDEN_ASM,
                                        "=f,=f,=f,=f,r"), list(args))
        return context.make_tuple(builder, sig.return_type,
                                  [builder.extract_value(res, i) for i in range(4)])

    def widen_f16(context, builder, sig, args):
        res = builder.call(ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 2), [i32]),
                                        _WIDEN_F16_ASM, "=r,=r,r"), list(args))
        return context.make_tuple(builder, sig.return_type,
                                  [builder.extract_value(res, i) for i in range(2)])

    def round_(context, builder, sig, args):
        return builder.call(ir.InlineAsm(ir.FunctionType(i32, [f32]), _ROUND_ASM, "=r,f"),
                            list(args))

    def prmt(context, builder, sig, args):
        return builder.call(ir.InlineAsm(ir.FunctionType(i32, [i32] * 3),
                                         "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r"), list(args))

    @intrinsic
    def byte_perm(typingctx, a, b, sel):
        """``prmt.b32``: byte ``i`` of the result is byte ``(sel >> 4 i) & 7`` of ``b:a``."""
        if (a, b, sel) != (types.uint32,) * 3:
            raise type_error(f"byte_perm: expected three uint32, got {(a, b, sel)}")
        return types.uint32(a, b, sel), prmt

    @intrinsic
    def e4m3x4_to_float32(typingctx, word):
        """The four e4m3 bytes of ``word`` (uint32, byte 0 first) as four float32."""
        if word != types.uint32:
            raise type_error(f"e4m3x4_to_float32: expected a uint32 word (four e4m3 bytes), "
                             f"got {word}")
        return types.UniTuple(types.float32, 4)(word), widen

    @intrinsic
    def e4m3x4_to_f16x2(typingctx, word):
        """The four e4m3 bytes of ``word`` as two float16 pairs (uint32: bytes 0, 1 then 2, 3,
        the lower value in the lower half): a 16-bit tile's words, two ``cvt`` a word."""
        if word != types.uint32:
            raise type_error(f"e4m3x4_to_f16x2: expected a uint32 word (four e4m3 bytes), "
                             f"got {word}")
        return types.UniTuple(types.uint32, 2)(word), widen_f16

    @intrinsic
    def float32_to_e4m3(typingctx, x):
        """The e4m3 bits of the float32 ``x`` (saturating, round to nearest even), a uint32."""
        if x != types.float32:
            raise type_error(f"float32_to_e4m3: expected a float32, got {x}")
        return types.uint32(x), round_

    return e4m3x4_to_float32, e4m3x4_to_f16x2, float32_to_e4m3, byte_perm


def _sim_e4m3x4_to_float32(word):
    """Simulator twin of :func:`e4m3x4_to_float32`: the word's little-endian bytes read as
    e4m3 (exact in float32, as in float16)."""
    vals = e4m3_to_float64(np.array([word], dtype=np.uint32).view(np.uint8)).astype(np.float32)
    return vals[0], vals[1], vals[2], vals[3]


def _sim_e4m3x4_to_f16x2(word):
    """Simulator twin of :func:`e4m3x4_to_f16x2`: the bytes read as e4m3, as float16 words."""
    vals = e4m3_to_float64(np.array([word], dtype=np.uint32).view(np.uint8)).astype(np.float16)
    pairs = vals.view(np.uint32)
    return pairs[0], pairs[1]


def _sim_float32_to_e4m3(x):
    """Simulator twin of :func:`float32_to_e4m3` (:func:`float_to_e4m3_bits`)."""
    return np.uint32(float_to_e4m3_bits(np.float32(x))[()])


def _sim_byte_perm(a, b, sel):
    """Simulator twin of :func:`byte_perm` (the sign-replicating mode, bit 3 of a nibble, is
    not used here: ValueError)."""
    src = (int(b) << 32) | int(a)
    out = 0
    for i in range(4):
        nib = (int(sel) >> (4 * i)) & 0xF
        if nib & 8:
            raise ValueError(f"byte_perm: sign-replicating selector nibble {nib:#x} not modelled")
        out |= ((src >> (8 * nib)) & 0xFF) << (8 * i)
    return np.uint32(out)


if on_simulator():
    e4m3x4_to_float32 = _sim_e4m3x4_to_float32
    e4m3x4_to_f16x2 = _sim_e4m3x4_to_f16x2
    float32_to_e4m3 = _sim_float32_to_e4m3
    byte_perm = _sim_byte_perm
else:
    e4m3x4_to_float32, e4m3x4_to_f16x2, float32_to_e4m3, byte_perm = _gpu_primitives()


@functools.lru_cache(maxsize=None)
def e4m3_probe_kernel():
    """``probe(words, out, x, bits, pairs)``: thread ``i`` widens ``words[i]`` (uint32) into
    ``out[i, 0:4]`` (float32) and ``pairs[i, 0:2]`` (float16 pairs) and rounds ``x[i]``
    (float32) into ``bits[i]`` (uint8); threads past the arrays write nothing."""

    @kernel_jit
    def e4m3_probe(words, out, x, bits, pairs):
        i = cuda.grid(1)
        if i < words.shape[0]:
            v0, v1, v2, v3 = e4m3x4_to_float32(words[i])
            out[i, 0] = v0
            out[i, 1] = v1
            out[i, 2] = v2
            out[i, 3] = v3
            lo, hi = e4m3x4_to_f16x2(words[i])
            pairs[i, 0] = lo
            pairs[i, 1] = hi
        if i < x.shape[0]:
            bits[i] = float32_to_e4m3(x[i])

    return e4m3_probe
