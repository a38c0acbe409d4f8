"""The simulator's shared-array allocation is made thread-safe (numba_flash.simulator).

``FakeCUDAShared.array`` looks up the calling source line and creates the array if it is
missing, without a lock.  To make the race deterministic the tests slow ``numpy.empty`` down, so
that every thread passes the lookup before any of them stores its array."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from numba import cuda  # a module global: the simulator swaps it for its fake module

import numba_flash
from numba_flash import simulator

pytestmark = pytest.mark.skipif(numba_flash.backend() != "simulator", reason="simulator only")


def distinct_arrays_from_threads(array_method, monkeypatch, n=8):
    """How many different arrays ``n`` threads get from one source line of one block."""
    from numba.cuda.simulator import kernelapi

    fast_empty = np.empty

    def slow_empty(*args, **kwargs):
        time.sleep(0.005)  # widen the window between the lookup and the store
        return fast_empty(*args, **kwargs)

    monkeypatch.setattr(np, "empty", slow_empty)
    shared = kernelapi.FakeCUDAShared(0)
    results = [None] * n
    barrier = threading.Barrier(n)

    def thread(i):
        barrier.wait()
        results[i] = array_method(shared, 4, np.int32)  # the same line for every thread

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len({id(r) for r in results})


def test_fixed_allocation_gives_one_array_per_line(monkeypatch):
    from numba.cuda.simulator import kernelapi

    assert kernelapi.FakeCUDAShared.array is not simulator._ORIGINAL_SHARED_ARRAY
    assert distinct_arrays_from_threads(kernelapi.FakeCUDAShared.array, monkeypatch) == 1


def test_original_allocation_races(monkeypatch):
    """The race the fix removes (so the test above can fail)."""
    assert distinct_arrays_from_threads(simulator._ORIGINAL_SHARED_ARRAY, monkeypatch) > 1


# -- barriers without polling (numba_flash.simulator, item 3) ---------------------------------
def _launch(kernel, grid, block, *args):
    with simulator.fast_switching():
        kernel[grid, block](*args)


def test_barrier_orders_shared_writes_and_early_returns_do_not_count():
    """Each thread writes its slot, waits, reads its neighbour's: a barrier that opened early
    would leave NaN.  Threads >= 12 return before the second barrier, which must still open."""
    @cuda.jit
    def rotate(out):
        sh = cuda.shared.array(16, np.float64)
        t = cuda.threadIdx.x
        sh[t] = t * 1.5
        cuda.syncthreads()
        v = sh[(t + 1) % 16]
        if t >= 12:
            out[t] = v
            return
        cuda.syncthreads()  # only the 12 threads left take part
        out[t] = v + 100.0

    out = np.full(16, np.nan)
    _launch(rotate, 1, 16, out)
    want = np.array([((t + 1) % 16) * 1.5 + (100.0 if t < 12 else 0.0) for t in range(16)])
    np.testing.assert_array_equal(out, want)


def test_exception_in_one_thread_is_raised_while_others_wait():
    """A thread that raises before a barrier the others wait at: the launch raises its error
    (not a hang, not the others' abort errors)."""
    @cuda.jit
    def fails(out):
        t = cuda.threadIdx.x
        if t == 3:
            raise ValueError("thread 3 fails")
        cuda.syncthreads()
        out[t] = 1.0

    with pytest.raises(ValueError, match="thread 3 fails"):  # returns: the waiters are released
        _launch(fails, 1, 8, np.zeros(8))


def test_device_jit_is_plain_python_unless_it_reads_cuda():
    """``device_jit`` in the simulator: a function that never names ``cuda`` stays the Python
    function (no simulated call, which swaps module globals under locks); one that reads
    ``cuda`` from another module stays a simulated device function; ``own_module`` opts out."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    from numba_flash.kernels.core.jit import device_jit

    def plain(x):
        return x + 1

    def reads_cuda(x):
        return x + cuda.threadIdx.x

    assert device_jit(plain) is plain
    assert isinstance(device_jit(reads_cuda), FakeCUDAKernel)
    assert device_jit(own_module=True)(reads_cuda) is reads_cuda
