"""fp8 (e4m3) in registers: four e4m3 bytes of one 32-bit word to four float32.

The first stage of the fp8 work (issue 46): an fp8 KV cache is read 16 bytes at a time (four
words) and dequantised in registers, so the one primitive a decode kernel needs is the widening
of a word.  e4m3 (``ml_dtypes.float8_e4m3fn``, ``torch.float8_e4m3fn``): 1 sign, 4 exponent bits
(bias 7), 3 mantissa bits, largest finite 448, no infinity, ``S.1111.111`` is NaN.  Every e4m3
value is a float16 value (subnormals included), so the widening is exact.

* :func:`e4m3x4_to_float32` ``(word)`` -> 4 float32: byte ``i`` of the little-endian ``uint32``
  ``word`` (element ``i`` of the array in memory order) is value ``i``.  On the GPU: two
  ``cvt.rn.f16x2.e4m3x2`` (sm_89+: the upper byte of a 16-bit half goes to the upper float16)
  and four ``cvt.f32.f16``; in the simulator a twin that reads the bytes through ml_dtypes.
* :func:`e4m3_to_float64` ``(bits)``: the host's reading of e4m3 bit patterns (tests, reference).
* :func:`e4m3_probe_kernel`: one word per thread (the tests and the compile tier's probe,
  built for sm_90 only: no sm_80 instruction converts fp8).

File: the host reading, the GPU intrinsic, its twin, the probe kernel.
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
#: the compute capability the probe is built for (fp8 conversions: sm_89+; the tier builds 90)
CC = (9, 0)
#: largest finite e4m3 value (``S.1111.110`` = 1.75 * 2**8)
E4M3_MAX = 448.0


def e4m3_to_float64(bits):
    """e4m3 bit patterns (integers 0..255, any shape) as float64 (NaN for ``0x7F``, ``0xFF``)."""
    import ml_dtypes

    return np.asarray(bits, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _gpu_primitive():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    try:
        from numba.cuda.core.errors import NumbaTypeError
    except ImportError:  # pragma: no cover - other numba-cuda versions
        from numba.core.errors import NumbaTypeError

    @intrinsic
    def e4m3x4_to_float32(typingctx, word):
        """The four e4m3 bytes of ``word`` (uint32, byte 0 first) as four float32."""
        if word != types.uint32:
            raise NumbaTypeError(f"e4m3x4_to_float32: expected a uint32 word (four e4m3 "
                                 f"bytes), got {word}")
        sig = types.UniTuple(types.float32, 4)(word)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [ir.IntType(32)])
            asm = ir.InlineAsm(
                fnty,
                "{ .reg .b16 lo, hi, a, b, c, d; .reg .b32 h01, h23;\n"
                " mov.b32 {lo, hi}, $4;\n"
                f" {CVT_E4M3X2_PTX} h01, lo;\n"
                f" {CVT_E4M3X2_PTX} h23, hi;\n"
                " mov.b32 {a, b}, h01;\n"
                " mov.b32 {c, d}, h23;\n"
                " cvt.f32.f16 $0, a;\n cvt.f32.f16 $1, b;\n"
                " cvt.f32.f16 $2, c;\n cvt.f32.f16 $3, d; }",
                "=f,=f,=f,=f,r",
            )
            res = builder.call(asm, list(args))
            outs = [builder.extract_value(res, i) for i in range(4)]
            return context.make_tuple(builder, sig.return_type, outs)

        return sig, codegen

    return e4m3x4_to_float32


def _sim_e4m3x4_to_float32(word):
    """Simulator twin of :func:`e4m3x4_to_float32`: the word's little-endian bytes read as
    e4m3 (exact in float32, as in float16)."""
    vals = e4m3_to_float64(np.array([word], dtype=np.uint32).view(np.uint8)).astype(np.float32)
    return vals[0], vals[1], vals[2], vals[3]


if on_simulator():
    e4m3x4_to_float32 = _sim_e4m3x4_to_float32
else:
    e4m3x4_to_float32 = _gpu_primitive()


@functools.lru_cache(maxsize=None)
def e4m3_probe_kernel():
    """``probe(words, out)``: thread ``i`` widens ``words[i]`` (uint32) into ``out[i, 0:4]``
    (float32); threads past ``words.size`` write nothing."""

    @kernel_jit
    def e4m3_probe(words, out):
        i = cuda.grid(1)
        if i < words.shape[0]:
            v0, v1, v2, v3 = e4m3x4_to_float32(words[i])
            out[i, 0] = v0
            out[i, 1] = v1
            out[i, 2] = v2
            out[i, 3] = v3

    return e4m3_probe
