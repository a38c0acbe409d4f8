"""Warp-level intrinsics for the Numba CUDA simulator: the same kernel source runs on both.

The simulator (numba-cuda 0.30) has no ``cuda.shfl_*_sync``, ``cuda.syncwarp`` or
``cuda.activemask``.  On the device a warp is 32 threads that execute together and a shuffle
reads a register of another lane of the same warp.  Here each CUDA thread is a Python thread,
so a shuffle becomes an exchange through memory: every lane of the warp writes its value into
the warp's slot array, waits at a barrier of the warp's lanes, reads the slot it wants, and
waits again so that no lane overwrites a slot before every lane has read it.

:func:`install` adds ``shfl_sync``, ``shfl_up_sync``, ``shfl_down_sync``, ``shfl_xor_sync``,
``syncwarp`` and ``activemask`` to the simulator's fake ``cuda`` module, so kernels call them as
they would on the GPU.  :func:`exchange` gives a simulator twin of a warp-wide primitive (the
tensor-core ``mma`` emulation, for example) every lane's value at once; ``exchange(value, 128)``
does the same over a *warpgroup* (four consecutive warps whose first warp's rank is a multiple
of 4: linear thread ids ``128 w .. 128 w + 127``), for the ``wgmma`` twins
(:mod:`numba_flash.kernels.wgmma`), and :func:`group_shared` gives such a group one dict its
threads share (under :func:`group_lock`).

Contract (the same as a full-mask ``*_sync`` on the device): every lane of the warp calls the
primitive, the same number of times, from converged code.  A warp is 32 consecutive linear
thread ids (``x`` fastest); the last warp of a block whose size is not a multiple of 32 has
fewer lanes, and its barrier counts only those.  The ``mask`` argument is accepted and not
checked.
"""

from __future__ import annotations

import threading

from .kernels.common import FULL_MASK

WARP = 32
_TIMEOUT = 120.0  # seconds: a lane that never arrives (divergent call) fails instead of hanging

_state_lock = threading.Lock()


class _WarpState:
    def __init__(self, lanes):
        self.lanes = lanes
        self.slots = [None] * lanes
        self.barrier = threading.Barrier(lanes, timeout=_TIMEOUT)
        self.shared = {}  # what a twin keeps for the whole group (group_shared)
        self.lock = threading.Lock()


def _warp_state(thread, size=WARP):
    """The exchange state of the calling thread's group of ``size`` consecutive threads (a warp,
    or a warpgroup for ``size=128``), made once per block launch."""
    manager = thread._manager
    group = thread.thread_id // size
    key = group if size == WARP else (size, group)
    with _state_lock:
        states = getattr(manager, "_numba_flash_warps", None)
        if states is None:
            states = manager._numba_flash_warps = {}
        st = states.get(key)
        if st is None:
            bx, by, bz = manager._block_dim
            nthreads = bx * by * bz
            st = states[key] = _WarpState(min(size, nthreads - group * size))
    return st


def exchange(value, size=WARP):
    """Every lane's ``value``, as a list indexed by lane id (all lanes of the warp must call);
    ``size=128``: over the calling thread's warpgroup, indexed by the thread's rank in it."""
    t = threading.current_thread()
    st = _warp_state(t, size)
    lane = t.thread_id % size
    st.slots[lane] = value
    st.barrier.wait()  # every lane has written its slot
    values = list(st.slots)
    st.barrier.wait()  # every lane has read: the slots may be reused
    return values


def lane_id(size=WARP):
    """The calling thread's lane (linear thread id mod 32), or with ``size=128`` its rank in its
    warpgroup."""
    return threading.current_thread().thread_id % size


def group_shared(size=WARP):
    """A dict shared by the threads of the calling thread's group of ``size`` (one per block
    launch); hold :func:`group_lock` while reading and writing it."""
    return _warp_state(threading.current_thread(), size).shared


def group_lock(size=WARP):
    """The lock of :func:`group_shared`."""
    return _warp_state(threading.current_thread(), size).lock


def _pick(values, src, own):
    return values[src] if 0 <= src < len(values) else own


def shfl_sync(self, mask, value, src_lane):
    values = exchange(value)
    return _pick(values, int(src_lane) % WARP, value)


def shfl_up_sync(self, mask, value, delta):
    values = exchange(value)
    return _pick(values, lane_id() - int(delta), value)


def shfl_down_sync(self, mask, value, delta):
    values = exchange(value)
    return _pick(values, lane_id() + int(delta), value)


def shfl_xor_sync(self, mask, value, lane_mask):
    values = exchange(value)
    return _pick(values, lane_id() ^ int(lane_mask), value)


def syncwarp(self, mask=FULL_MASK):
    exchange(None)


def activemask(self):
    st = _warp_state(threading.current_thread())
    return (1 << st.lanes) - 1 if st.lanes < WARP else FULL_MASK


_installed = False


def install():
    """Add the warp intrinsics to the simulator's fake ``cuda`` module (idempotent)."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernelapi

    for fn in (shfl_sync, shfl_up_sync, shfl_down_sync, shfl_xor_sync, syncwarp, activemask):
        setattr(kernelapi.FakeCUDAModule, fn.__name__, fn)
    _installed = True
