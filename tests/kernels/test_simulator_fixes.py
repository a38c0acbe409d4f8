"""The simulator's shared-array allocation is made thread-safe (numba_flash.simulator).

``FakeCUDAShared.array`` looks up the calling source line and creates the array if it is
missing, without a lock.  To make the race deterministic the tests slow ``numpy.empty`` down, so
that every thread passes the lookup before any of them stores its array."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

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
