"""The element-type stage: how a kernel reads an input element and writes an output element.

Every SIMT kernel (forward, backward, naive forward, softmax) computes in a *compute type*
(float32, or float64 for float64 inputs) and touches its element type in two places only: a load
(an element of ``q``, ``k``, ``v``, ``o``, ``do``, ``x`` as the compute type) and a store (the
compute type as an element of ``o``, ``dq``, ``dk``, ``dv``, ``y``).  :func:`element_ops` gives the
two device functions for an element dtype; a kernel built for a dtype calls them and is otherwise
the same source for every element type.  Adding an element type is adding it here.

==========  ===================  ==============  =============================================
element     array the kernel     compute type    load / store
            sees
==========  ===================  ==============  =============================================
float16     float16              float32         ``float32(x)`` (exact) / the array's own cast
                                                 (round to nearest even)
bfloat16    uint16 (the bits)    float32         ``bits << 16`` reinterpreted as float32
                                                 (exact) / round to nearest even (below)
float32     float32              float32         identity / identity
float64     float64              float64         identity / identity
==========  ===================  ==============  =============================================

NumPy has no bfloat16: the host type is ``ml_dtypes.bfloat16`` (:data:`BFLOAT16`); a kernel sees
a bfloat16 array as its 16-bit words (``x.view(np.uint16)``, no copy: :func:`kernel_dtype`), and
its outputs are allocated as ``uint16`` and viewed back as bfloat16.  The bfloat16 store of a
float32 ``x`` with bits ``b`` (what ``cvt.rn.bf16.f32`` and ``ml_dtypes`` do), in integer code::

    NaN  (b & 0x7FFFFFFF > 0x7F800000):  (b >> 16) | 0x0040     (quiet NaN, sign kept)
    else:                                (b + 0x7FFF + ((b >> 16) & 1)) >> 16

File: the host helpers (:data:`BFLOAT16`, :func:`kernel_dtype`), the 32-bit reinterpretations
(:func:`float32_from_bits`, :func:`float32_bits`: an ``@intrinsic`` bitcast on the GPU, a NumPy
``view`` in the simulator), the loads and stores, :func:`element_ops`, and
:func:`round_trip_kernel` (the compile tier's and the tests' probe).  Why the rounding is right,
and why integer code: docs/tiled-forward.md#compute-types.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
from numba import cuda, float32, float64, types, uint16, uint32

from ...backend import on_simulator
from .jit import device_jit, kernel_jit

#: the host (NumPy) bfloat16 dtype
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: every element dtype the SIMT stage handles
ELEMENT_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))

_SHIFT16 = uint32(16)
_ABS = uint32(0x7FFFFFFF)
_INF_BITS = uint32(0x7F800000)
_QUIET = uint32(0x0040)
_HALF_ULP = uint32(0x7FFF)
_ONE = uint32(1)


def is_bfloat16(dtype):
    """True for ``ml_dtypes.bfloat16``."""
    return np.dtype(dtype) == BFLOAT16


def kernel_dtype(dtype):
    """The dtype of the array a kernel is launched with for elements of ``dtype``: ``uint16``
    for bfloat16 (its bits), the dtype itself otherwise."""
    return np.dtype(np.uint16) if is_bfloat16(dtype) else np.dtype(dtype)


# ------------------------------------------------------------------------------------------
# 32 bits <-> float32
# ------------------------------------------------------------------------------------------
def _gpu_bitcasts():
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    try:
        from numba.cuda.core.errors import NumbaTypeError
    except ImportError:  # pragma: no cover - other numba-cuda versions
        from numba.core.errors import NumbaTypeError

    @intrinsic
    def float32_bits(typingctx, x):
        """The 32 bits of the float32 ``x`` as a uint32 (LLVM ``bitcast``)."""
        if x != types.float32:
            raise NumbaTypeError(f"float32_bits: expected a float32, got {x}")

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(x), codegen

    @intrinsic
    def float32_from_bits(typingctx, b):
        """The float32 whose bits are the uint32 ``b`` (LLVM ``bitcast``)."""
        if b != types.uint32:
            raise NumbaTypeError(f"float32_from_bits: expected a uint32 (wrap integer "
                                 f"arithmetic in uint32(...)), got {b}")

        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())

        return types.float32(b), codegen

    return float32_bits, float32_from_bits


def _sim_float32_bits(x):
    """Simulator twin of :func:`float32_bits`."""
    return np.array(x, np.float32).view(np.uint32)[()]


def _sim_float32_from_bits(b):
    """Simulator twin of :func:`float32_from_bits`."""
    return np.array(b, np.uint32).view(np.float32)[()]


if on_simulator():
    float32_bits = _sim_float32_bits
    float32_from_bits = _sim_float32_from_bits
else:
    float32_bits, float32_from_bits = _gpu_bitcasts()


# ------------------------------------------------------------------------------------------
# the loads and stores (device functions; the same source runs in both backends)
# ------------------------------------------------------------------------------------------
_device = functools.partial(device_jit, inline="always")


def _device_plain(fn):
    """A device function on the GPU; in the simulator the Python function itself (a simulated
    device call swaps the module's ``cuda`` globals on every call: measured 3.5x the time of
    the SIMT kernels, one call per loaded element; these bodies use no CUDA intrinsics)."""
    return fn if on_simulator() else _device(fn)


@_device
def load_bf16(w):
    """A bfloat16 element (its uint16 bits ``w``) as float32: ``w << 16`` (exact)."""
    return float32_from_bits(uint32(uint32(w) << _SHIFT16))


@_device
def store_bf16(x):
    """The float32 ``x`` as bfloat16 bits (uint16), rounded to nearest even; NaN stays NaN."""
    b = float32_bits(float32(x))
    if uint32(b & _ABS) > _INF_BITS:  # NaN: keep sign and payload's top, make it quiet
        return uint16(uint32(b >> _SHIFT16) | _QUIET)
    lsb = uint32(uint32(b >> _SHIFT16) & _ONE)
    return uint16(uint32(uint32(b + _HALF_ULP) + lsb) >> _SHIFT16)


@_device_plain
def load_to_f32(x):
    """A float16 or float32 element as float32 (exact)."""
    return float32(x)


@_device_plain
def load_to_f64(x):
    """A float64 element as it is."""
    return float64(x)


@_device_plain
def store_as_is(x):
    """The compute value as it is: the array's own store converts (float16: round to nearest
    even, as ``cvt.rn.f16.f32``; float32 / float64: no conversion)."""
    return x


def element_ops(dtype):
    """``(load, store)`` device functions for elements of ``dtype`` (see the module table):
    ``load(element) -> compute type`` and ``store(compute value) -> element`` (what is assigned
    into the kernel's output array).  ``dtype``: a NumPy dtype or its name."""
    dt = BFLOAT16 if isinstance(dtype, str) and dtype == "bfloat16" else np.dtype(dtype)
    if dt == BFLOAT16:
        return load_bf16, store_bf16
    if dt == np.float64:
        return load_to_f64, store_as_is
    if dt in (np.float16, np.float32):
        return load_to_f32, store_as_is
    raise TypeError(f"element_ops: expected an element dtype in "
                    f"({', '.join(d.name for d in ELEMENT_DTYPES)}), got {dt}")


# ------------------------------------------------------------------------------------------
# host twins (tests, docs)
# ------------------------------------------------------------------------------------------
def bf16_bits_host(x):
    """The bfloat16 bits (uint16 array) of float32 ``x`` by the store's integer rule, in NumPy:
    the reference the tests hold both the device stage and ``ml_dtypes`` to."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    rounded = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return np.where(nan, (b >> 16) | 0x40, rounded).astype(np.uint16)


# ------------------------------------------------------------------------------------------
# a kernel of the stage alone (tests, compile tier)
# ------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def round_trip_kernel(dtype):
    """``kernel(x, y, back)`` for 1-D arrays: ``y[i] = store(x[i])`` for a compute-type ``x``
    (float32; float64 for float64 elements) into the kernel array ``y`` of elements of
    ``dtype``, and ``back[i] = load(y[i])``.  One thread per element, any block size."""
    load, store = element_ops(dtype)

    @kernel_jit
    def element_round_trip(x, y, back):
        i = cuda.grid(1)
        if i < x.shape[0]:
            y[i] = store(x[i])
            back[i] = load(y[i])

    return element_round_trip
