"""Kernel launches on device arrays without Numba's dispatcher: typed and packed once, then run.

Numba's dispatcher works out every argument's type and converts every argument on every launch
(about 6.6 us a launch and 3.5 us more per array on a GPU, numba-cuda #477).  A device call here
does that work once, when a :class:`PreparedLaunch` is made:

* :func:`arg_type` gives each argument the Numba type the dispatcher would (a device array as
  ``types.Array(dtype, ndim, layout)``, tuples and named tuples element by element, scalars by
  ``numba.typeof``); the kernel is compiled for exactly that signature (:class:`CudaDriver`).
* :func:`flatten` lays the arguments out as Numba's kernel ABI passes them, one kernel
  parameter per piece: an array is ``meminfo, parent, nitems, itemsize, data, shape[ndim],
  strides[ndim]`` (numba-cuda's ``_Kernel._prepare_args``), an integer or float its own width,
  a boolean one byte, a tuple its elements in order.  Each parameter gets an 8-byte slot of one
  buffer, and an array of pointers to the slots is what ``cuLaunchKernel`` reads.
* :meth:`PreparedLaunch.run` writes the arrays' data pointers into their slots (one
  ``struct.pack_into``) and calls the driver: no typing, no conversion, no allocation, no
  synchronisation.

The driver is the array library's: :class:`CudaDriver` (numba-cuda's compiler, cuda.bindings'
``cuLaunchKernel`` and ``cuMemsetD8Async``) for CuPy arrays, or the stand-in device's
(:mod:`numba_flash.standin`), which records each launch, checks it and can run it in the
simulator.
"""

from __future__ import annotations

import ctypes
import struct

import numpy as np
from numba.core import types
from numba.core.typing.typeof import Purpose, typeof

__all__ = ["arg_type", "flatten", "param_sizes", "PreparedLaunch", "CudaDriver", "Param",
           "set_max_dynamic_shared", "simulate_launch"]

#: NumPy's warning for an integer ``//`` or ``%`` by zero (the simulator's indices are NumPy
#: integers), made an error inside a simulator launch; on a GPU the result is undefined
INT_DIVIDE_BY_ZERO = r"divide by zero encountered in scalar (floor_divide|remainder)"

#: one kernel parameter's slot in the packed buffer (every Numba parameter is at most 8 bytes)
SLOT = 8

#: struct codes of the scalar parameters, by Numba type
_SCALAR_CODES = {
    types.int8: "b", types.uint8: "B", types.int16: "h", types.uint16: "H",
    types.int32: "i", types.uint32: "I", types.int64: "q", types.uint64: "Q",
    types.float16: "e", types.float32: "f", types.float64: "d", types.boolean: "B",
}


def array_type(x):
    """The Numba type of a device array ``x`` (anything with ``shape``, ``strides``, ``dtype``):
    what numba-cuda's ``DeviceNDArray._numba_type_`` gives the same memory: layout "C" or "F"
    when contiguous that way with no zero stride, else "A"."""
    from numba.np import numpy_support

    flags = x.flags
    broadcast = 0 in x.strides
    if flags.c_contiguous and not broadcast:
        layout = "C"
    elif flags.f_contiguous and not broadcast:
        layout = "F"
    else:
        layout = "A"
    return types.Array(numpy_support.from_dtype(x.dtype), x.ndim, layout)


def is_array(x):
    """A device array of the array library (CuPy or the stand-in) or anything with
    ``__cuda_array_interface__``."""
    return hasattr(x, "__cuda_array_interface__")


def arg_type(val):
    """The Numba type the dispatcher gives the launch argument ``val``."""
    if is_array(val):
        return array_type(val)
    if isinstance(val, tuple):
        return types.BaseTuple.from_types([arg_type(v) for v in val], type(val))
    return typeof(val, Purpose.argument)


class Param:
    """One flattened kernel parameter: ``code`` (its struct code), ``value`` (its constant
    value, or 0 for a data pointer written at each launch) and ``array`` (the array whose data
    pointer this slot holds, else None)."""

    __slots__ = ("code", "value", "array")

    def __init__(self, code, value, array=None):
        self.code, self.value, self.array = code, value, array

    @property
    def size(self):
        return struct.calcsize("=" + self.code)


def flatten(ty, val, out):
    """Append the kernel parameters of argument ``val`` of Numba type ``ty`` to ``out`` (a list
    of :class:`Param`), in Numba's ABI order."""
    if isinstance(ty, types.Array):
        shape, strides = val.shape, val.strides
        out += [Param("Q", 0), Param("Q", 0), Param("q", int(np.prod(shape, dtype=np.int64))),
                Param("q", int(val.dtype.itemsize)), Param("Q", 0, val)]
        out += [Param("q", int(s)) for s in shape]
        out += [Param("q", int(s)) for s in strides]
    elif isinstance(ty, types.BaseTuple):
        if len(ty) != len(val):
            raise ValueError(f"a tuple argument of type {ty} got {len(val)} values")
        for t, v in zip(ty, val):
            flatten(t, v, out)
    elif ty in _SCALAR_CODES:
        code = _SCALAR_CODES[ty]
        if ty == types.boolean:
            value = int(bool(val))
        elif isinstance(ty, types.Integer):
            value = int(val)
        else:
            value = float(val)
        out.append(Param(code, value))
    else:
        raise NotImplementedError(f"kernel argument of type {ty} ({type(val).__name__})")
    return out


def param_sizes(sig, args):
    """The byte size of each kernel parameter of a launch with signature ``sig``: the list the
    ``.entry`` parameters of the compiled PTX have (count, sizes, order)."""
    params = []
    for ty, val in zip(sig, args):
        flatten(ty, val, params)
    return [p.size for p in params]


class PreparedLaunch:
    """One kernel launch with its parameters packed: ``function`` (the driver's handle of the
    compiled build), ``grid``, ``block``, ``shared`` bytes, the stream, and the parameters.

    ``arrays`` are the arrays of the array parameters, in slot order.  :meth:`run_direct`
    launches on them; a launch plan (:mod:`numba_flash.frontend.plans`) sets ``relocs``,
    ``(slot, buffer, offset)`` for each, and :meth:`run` launches with each data pointer
    ``base[buffer] + offset`` of the replay's buffer addresses ``base``.  A replay holds its
    plan's lock from the writing of the pointers to the launch (the driver copies the
    parameters at the launch, so the buffer is free again as soon as it returns)."""

    __slots__ = ("driver", "function", "grid", "block", "shared", "stream", "name", "sig",
                 "values", "slots", "arrays", "packer", "buffer", "params", "sizes",
                 "kernel", "relocs", "params_addr", "stream_handle")

    def __init__(self, driver, kernel, sig, args, grid, block, shared, stream):
        params = []
        for ty, val in zip(sig, args):
            flatten(ty, val, params)
        self.driver, self.kernel, self.sig = driver, kernel, tuple(sig)
        self.name = getattr(getattr(kernel, "py_func", None), "__name__", "kernel")
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.block = tuple(int(b) for b in block) + (1,) * (3 - len(block))
        self.shared, self.stream = int(shared), stream
        self.sizes = [p.size for p in params]
        self.values = [p.value for p in params]
        self.slots = [i for i, p in enumerate(params) if p.array is not None]
        self.arrays = [p.array for p in params if p.array is not None]
        self.relocs = None
        # every parameter in an 8-byte slot: "=" packs without alignment, "x" pads each slot
        fmt = "=" + "".join(p.code + "x" * (SLOT - p.size) for p in params)
        self.packer = struct.Struct(fmt)
        self.buffer = ctypes.create_string_buffer(max(1, self.packer.size))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * max(1, len(params)))(
            *[base + SLOT * i for i in range(len(params))])
        self.params_addr = ctypes.addressof(self.params)
        self.function = driver.function(kernel, self.sig, self.shared)
        self.stream_handle = driver.stream(stream)

    def run_direct(self):
        """Launch on the arrays it was prepared with."""
        values = self.values
        for slot, x in zip(self.slots, self.arrays):
            values[slot] = data_pointer(x)
        self.packer.pack_into(self.buffer, 0, *values)
        self.driver.launch(self)

    def run(self, base):
        """Launch with each array parameter at ``base[buffer] + offset`` (``relocs``)."""
        values = self.values
        for slot, buf, off in self.relocs:
            values[slot] = base[buf] + off
        self.packer.pack_into(self.buffer, 0, *values)
        self.driver.launch(self)

    def packed(self):
        """The parameter bytes as the driver reads them (for checks and the stand-in)."""
        return bytes(self.buffer)[: self.packer.size]


def data_pointer(x):
    """The device address of array ``x``'s first element (CuPy and the stand-in:
    ``x.data.ptr``; others: their ``__cuda_array_interface__``)."""
    data = getattr(x, "data", None)
    ptr = getattr(data, "ptr", None)
    if ptr is not None:
        return int(ptr)
    return int(x.__cuda_array_interface__["data"][0])


class CudaDriver:
    """The GPU's driver for :class:`PreparedLaunch`: numba-cuda compiles a kernel for the exact
    signature (its on-disk cache included, :mod:`numba_flash.kernels.core.jit`), cuda.bindings
    launches and sets memory.  Used for CuPy arrays; unmeasured until a GPU runs it."""

    def __init__(self):
        from cuda.bindings import driver as cu

        self._cu = cu
        self._streams = {}

    def function(self, kernel, sig, shared):
        """The ``CUfunction`` of ``kernel`` compiled for ``sig`` on the current device (dynamic
        shared memory past 48 KiB opted into)."""
        compiled = kernel.compile(sig)
        cufunc = compiled._codelibrary.get_cufunc()
        set_max_dynamic_shared(cufunc, shared)
        return cufunc.handle

    def stream(self, ptr):
        """A ``CUstream`` of the stream handle ``ptr`` (one object per handle)."""
        s = self._streams.get(ptr)
        if s is None:
            s = self._streams[ptr] = self._cu.CUstream(ptr)
        return s

    def launch(self, prep):
        gx, gy, gz = prep.grid
        bx, by, bz = prep.block
        err, = self._cu.cuLaunchKernel(prep.function, gx, gy, gz, bx, by, bz, prep.shared,
                                       prep.stream_handle, prep.params_addr, 0)
        if err:
            raise RuntimeError(f"cuLaunchKernel({prep.name}): {err!r}")

    def memset(self, ptr, byte, nbytes, stream):
        if not nbytes:
            return
        err, = self._cu.cuMemsetD8Async(ptr, byte, nbytes, self.stream(stream))
        if err:
            raise RuntimeError(f"cuMemsetD8Async: {err!r}")


def set_max_dynamic_shared(cufunc, nbytes):
    """The driver attribute ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` of a compiled
    kernel (numba-cuda's ``CUfunction`` wrapper), which numba-cuda has no public way to set (its
    issue 94): needed to launch with more than 48 KiB of dynamic shared memory.  Per kernel and
    device; nothing to do at 48 KiB or under.  Unmeasured: no GPU has run it yet."""
    if nbytes <= 48 * 1024:   # a static array's limit: no opting in
        return
    from numba.cuda.cudadrv.driver import binding, driver

    attr = binding.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    driver.cuKernelSetAttribute(attr, int(nbytes), cufunc.handle, cufunc.device.id)


def simulate_launch(kernel, grid, block, shared, args, stream=0):
    """Run ``kernel[grid, block, stream, shared](*args)`` in the simulator: Python's thread
    switch made short (:mod:`numba_flash.simulator`), an integer division by zero an error, and
    an exception raised in a user's ``score_mod`` / ``mask_mod`` told in its terms."""
    import warnings

    from .. import simulator

    try:
        with simulator.fast_switching(), warnings.catch_warnings():  # see numba_flash.simulator
            # an integer division by zero (a NumPy integer: 0 and a warning; a Python int
            # raises) is an error wherever it happens, a user's function or a kernel
            warnings.filterwarnings("error", INT_DIVIDE_BY_ZERO, RuntimeWarning)
            kernel[grid, block, stream, shared](*args)
    except Exception as exc:  # raised in a user's score_mod / mask_mod: told in its terms
        from ..flex.errors import user_error

        mapped = user_error(exc)
        if mapped is None:
            raise
        raise mapped from None
