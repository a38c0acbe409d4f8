"""Two adjustments to the Numba CUDA simulator, applied only when it is the backend.

The simulator runs every CUDA thread of a block as a Python thread.

1. **Thread switch interval.**  Its block manager polls the threads to release a
   ``syncthreads``; with Python's default 5 ms switch interval every barrier costs milliseconds.
   :func:`fast_switching` shortens the interval for the duration of a launch (~5x faster).

2. **Shared-array allocation race.**  ``cuda.shared.array`` in the simulator
   (``FakeCUDAShared.array``, numba-cuda 0.30) looks up the caller's source line in a dict and,
   when absent, creates the array and stores it: a check-then-set without a lock.  If the
   interpreter switches threads between the check and the set, two threads of one block create
   two different arrays for the same line, and a thread then writes into memory the others never
   read (seen here as a rare wrong decode result, more often with a short switch interval).
   :func:`install` replaces the method with the same logic under a lock.
"""

from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np

_installed = False
_ORIGINAL_SHARED_ARRAY = None  # the simulator's own method, kept for the test that shows the race


@contextlib.contextmanager
def fast_switching(interval=1e-4):
    """Shorten Python's thread switch interval within the block (restored afterwards)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def install():
    """Make the simulator's shared-array allocation thread-safe (idempotent)."""
    global _installed, _ORIGINAL_SHARED_ARRAY
    if _installed:
        return
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support
    from numba.core import types

    lock = threading.Lock()
    original = _ORIGINAL_SHARED_ARRAY = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if alignment is not None or shape == 0:  # errors and dynamic shared memory: unchanged
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)  # one allocation per source line
        with lock:
            res = self._allocations.get(caller)
            if res is None:
                res = np.empty(shape, dtype)
                self._allocations[caller] = res
        return res

    kernelapi.FakeCUDAShared.array = array
    from . import simulator_warp

    simulator_warp.install()  # warp shuffles, syncwarp, activemask (see numba_flash.simulator_warp)
    _installed = True
