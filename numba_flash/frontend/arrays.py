"""Moving arrays to where the kernels run, allocating outputs, and giving results back.

One :class:`ArrayCall` serves one public call:

* NumPy inputs are copied to the device once (``cuda.to_device``; a non-contiguous view is made
  contiguous first) and results copied back (``copy_to_host``).  The same two calls run in the
  simulator, where "the device" is host memory and each is a plain copy, so both backends walk
  one code path.  Inputs are never written.
* CuPy arrays (or any ``__cuda_array_interface__`` object) on the GPU backend are used in place,
  zero copy, on the current CuPy stream; results come back as CuPy arrays on the same device
  (Numba device arrays for other producers).  In the simulator they are a ``TypeError``.

For tests, :func:`poisoned_outputs` fills every output with NaN (or a sentinel for integer
arrays) before launch, so that an element a kernel forgot to write fails the comparison.
"""

from __future__ import annotations

import contextlib

import numpy as np
from numba import cuda

from .. import simulator
from ..backend import on_simulator
from .validate import is_device_array

_POISON = False


@contextlib.contextmanager
def poisoned_outputs(enabled=True):
    """Within this block, outputs are filled with NaN (ints: -2**31 + 1) instead of left empty."""
    global _POISON
    old, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = old


def _poison_value(dtype):
    return np.nan if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min + 1


class ArrayCall:
    """Array handling for one public call; ``inputs`` are the user's arrays, by name."""

    def __init__(self, inputs):
        arrays = list(inputs.values())
        self.on_device = any(is_device_array(x) for x in arrays)
        if self.on_device and on_simulator():
            name = next(n for n, x in inputs.items() if is_device_array(x))
            raise TypeError(
                f"{name}: GPU arrays (CuPy / __cuda_array_interface__) need the CUDA backend, "
                "but kernels run in the simulator here; pass numpy.ndarray instead"
            )
        self._cupy = None
        self.stream = 0
        if self.on_device:
            first = next(x for x in arrays if is_device_array(x))
            if type(first).__module__.split(".")[0] == "cupy":
                import cupy

                self._cupy = cupy
                ptr = cupy.cuda.get_current_stream().ptr
                # CuPy's current stream; 0 is the legacy default stream, numba's stream 0 too
                self.stream = cuda.external_stream(ptr) if ptr else 0

    # -- inputs ------------------------------------------------------------------------------
    def input(self, x):
        """The array as the kernel takes it: C-contiguous, on the backend's memory."""
        if not self.on_device:
            return cuda.to_device(np.ascontiguousarray(x), stream=self.stream)
        if self._cupy is not None:
            return cuda.as_cuda_array(self._cupy.ascontiguousarray(x))
        dx = cuda.as_cuda_array(x)
        if not dx.is_c_contiguous():
            out = cuda.device_array(dx.shape, dx.dtype, stream=self.stream)
            out.copy_to_device(dx, stream=self.stream)  # strided copy on device
            dx = out
        return dx

    # -- outputs -----------------------------------------------------------------------------
    def empty(self, shape, dtype):
        """An output array (NaN-poisoned inside :func:`poisoned_outputs`)."""
        dtype = np.dtype(dtype)
        if not self.on_device:
            host = np.empty(shape, dtype)
            if _POISON:
                host.fill(_poison_value(dtype))
            return cuda.to_device(host, stream=self.stream)
        if self._cupy is not None:
            arr = self._cupy.empty(shape, dtype)
            if _POISON:
                arr.fill(_poison_value(dtype))
            return cuda.as_cuda_array(arr)
        arr = cuda.device_array(shape, dtype, stream=self.stream)
        if _POISON:
            arr.copy_to_device(np.full(shape, _poison_value(dtype), dtype), stream=self.stream)
        return arr

    def zeros(self, shape, dtype):
        """A zero-filled work buffer (for atomics)."""
        if not self.on_device:
            return cuda.to_device(np.zeros(shape, dtype), stream=self.stream)
        if self._cupy is not None:
            return cuda.as_cuda_array(self._cupy.zeros(shape, dtype))
        return cuda.to_device(np.zeros(shape, dtype), stream=self.stream)

    def result(self, x):
        """Give a kernel output back in the kind the caller passed in."""
        if not self.on_device:
            return x.copy_to_host(stream=self.stream)
        if self._cupy is not None:
            return self._cupy.asarray(x)
        return x

    def launch(self, kernel, grid, block, *args):
        """Launch ``kernel[grid, block, stream](*args)``."""
        if not on_simulator():
            kernel[grid, block, self.stream](*args)
            return
        with simulator.fast_switching():  # see numba_flash.simulator
            kernel[grid, block, self.stream](*args)
