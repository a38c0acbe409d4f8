"""Three adjustments to the Numba CUDA simulator, applied only when it is the backend.

The simulator runs every CUDA thread of a block as a Python thread.

1. **Thread switch interval.**  Python's default 5 ms switch interval makes every barrier cost
   milliseconds.  :func:`fast_switching` shortens the interval for the duration of a launch.

2. **Shared-array allocation race.**  ``cuda.shared.array`` in the simulator
   (``FakeCUDAShared.array``, numba-cuda 0.30) looks up the caller's source line in a dict and,
   when absent, creates the array and stores it: a check-then-set without a lock.  If the
   interpreter switches threads between the check and the set, two threads of one block create
   two different arrays for the same line, and a thread then writes into memory the others never
   read (seen here as a rare wrong decode result, more often with a short switch interval).
   :func:`install` replaces the method with the same logic under a lock.  In the recording
   mode (:mod:`numba_flash.kernels.ptx.record`, off unless ``record.RECORDER`` is set) it hands
   the allocation to the recorder, which returns it as a recording array.

3. **Barriers without polling.**  The simulator's block manager (``BlockManager.run``,
   numba-cuda 0.30) releases a ``syncthreads`` by polling: the launching thread loops over the
   block's threads, asking each whether it is alive and whether it waits, for as long as the
   block runs, and that loop takes its turn at the interpreter lock like any simulated thread
   (measured in numba-cuda 0.30: half the CPU time of a small forward launch).  :func:`install`
   replaces it with the same rule kept by counting under one condition variable: a barrier
   opens when every thread of the block that has not returned waits at it (a thread that
   returns early no longer counts, as in the simulator and on the GPU), and the launching
   thread sleeps until the block ends or a thread raises; the first exception is raised as
   before, and the threads still waiting at a barrier, or at a warp's, are released with an
   error.  Measured on one 2-core machine: a [1, 1, 64, 16] float32 forward 2.4 -> 1.1 s, the
   tensor-core [1, 2, 64, 64] float16 forward 20 -> 7 s, the same results bit for bit.
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


class _BlockBarrier:
    """One simulated block's barrier state: threads not yet returned, threads waiting at the
    current barrier, how many barriers have opened, and the first thread that raised."""

    def __init__(self, threads):
        self.cond = threading.Condition(threading.Lock())
        self.live = threads
        self.waiting = 0
        self.generation = 0
        self.failed = None

    def open_if_all_wait(self):
        """Open the barrier when every live thread waits at it (call under ``cond``)."""
        if self.waiting and self.waiting == self.live:
            self.waiting = 0
            self.generation += 1
            self.cond.notify_all()


def _install_barriers():
    from numba.cuda.simulator import kernel

    from . import simulator_warp

    thread_run = kernel.BlockThread.run  # records the thread's exception, as before

    def syncthreads(self):
        blk = self._manager._numba_flash_barrier
        with blk.cond:
            if blk.failed is not None:
                raise RuntimeError("abort flag set on syncthreads call")
            generation = blk.generation
            blk.waiting += 1
            blk.open_if_all_wait()
            while generation == blk.generation and blk.failed is None:
                blk.cond.wait()
            if blk.failed is not None:
                raise RuntimeError("abort flag set on syncthreads clear")

    def run_thread(self):
        try:
            thread_run(self)
        finally:
            blk = self._manager._numba_flash_barrier
            with blk.cond:
                blk.live -= 1
                if self.exception is not None and blk.failed is None:
                    blk.failed = self
                    # a copy: another lane may be adding its warp to the dict meanwhile
                    for warp in list(getattr(self._manager, "_numba_flash_warps", {}).values()):
                        warp.barrier.abort()  # lanes waiting at a shuffle fail, not hang
                blk.open_if_all_wait()  # the waiting threads may now be all that is left
                blk.cond.notify_all()
            # after the first error is recorded: its warp's lanes no longer wait for this one
            simulator_warp.lane_returned(self)

    def run_block(self, grid_point, *args):
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            def target():
                self._f(*args)

            threads.append(kernel.BlockThread(target, self, grid_point, block_point,
                                              self._debug))
        blk = self._numba_flash_barrier = _BlockBarrier(len(threads))
        for t in threads:
            t.start()
        with blk.cond:  # sleep until the block ends or a thread raises
            while blk.live and blk.failed is None:
                blk.cond.wait()
            failed = blk.failed
        if failed is not None:  # the others are not joined (as the simulator does)
            raise failed.exception[0].with_traceback(failed.exception[1])
        for t in threads:
            t.join()

    kernel.BlockThread.syncthreads = syncthreads
    kernel.BlockThread.run = run_thread
    kernel.BlockManager.run = run_block


def install():
    """Make the simulator's shared-array allocation thread-safe and its barriers event-driven
    (idempotent)."""
    global _installed, _ORIGINAL_SHARED_ARRAY
    if _installed:
        return
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support
    from numba.core import types

    from .kernels.ptx import record

    lock = threading.Lock()
    original = _ORIGINAL_SHARED_ARRAY = kernelapi.FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        frame = sys._getframe(1)
        if alignment is not None or shape == 0:  # errors and dynamic shared memory: unchanged
            res = original(self, shape, dtype, alignment)
        else:
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            caller = (frame.f_code.co_filename, frame.f_lineno)  # one allocation per line
            with lock:
                res = self._allocations.get(caller)
                if res is None:
                    res = np.empty(shape, dtype)
                    self._allocations[caller] = res
        if record.RECORDER is not None:  # the recording mode (issue 63): a recording array
            return record.RECORDER.shared_array(res, frame.f_code.co_filename, frame.f_lineno)
        return res

    kernelapi.FakeCUDAShared.array = array
    _install_barriers()
    from . import simulator_warp

    simulator_warp.install()  # warp shuffles, syncwarp, activemask (see numba_flash.simulator_warp)
    from .kernels.ptx import address

    address.install()   # every launch's arrays aligned to their elements, as a GPU needs
    _installed = True


def device_view(ary):
    """The simulator's device array over ``ary``'s own memory (no copy): what ``cuda.to_device``
    gives, but at the host array's address (``cuda.to_device`` copies into a fresh buffer)."""
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

    return FakeCUDAArray(ary)
