"""Warp-level intrinsics for the Numba CUDA simulator: the same kernel source runs on both.

The simulator (numba-cuda 0.30) has no ``cuda.shfl_*_sync``, ``cuda.syncwarp`` or
``cuda.activemask``.  On the device a warp is 32 threads that execute together and a shuffle
reads a register of another lane of the same warp.  Here each CUDA thread is a Python thread,
so a shuffle becomes an exchange through memory: every lane of the warp writes its value into
the warp's slot array, waits at a barrier of the warp's lanes and reads the slot it wants.  The
slot arrays alternate from one exchange to the next (a lane's n-th exchange writes array n mod
2), so one barrier an exchange suffices: a lane that writes array n mod 2 again, at exchange n +
2, has passed exchange n + 1's barrier, which every lane reached after reading exchange n's.

:func:`install` adds ``shfl_sync``, ``shfl_up_sync``, ``shfl_down_sync``, ``shfl_xor_sync``,
``syncwarp`` and ``activemask`` to the simulator's fake ``cuda`` module, so kernels call them as
they would on the GPU.  :func:`exchange` gives a simulator twin of a warp-wide primitive (the
tensor-core ``mma`` emulation, for example) every lane's value at once; ``exchange(value, 128)``
does the same over a *warpgroup* (four consecutive warps whose first warp's rank is a multiple
of 4: linear thread ids ``128 w .. 128 w + 127``), for the ``wgmma`` twins
(:mod:`numba_flash.kernels.ptx.wgmma`), and :func:`group_shared` gives such a group one dict its
threads share (under :func:`group_lock`).

Contract (the same as a full-mask ``*_sync`` on the device): every lane of the warp calls the
primitive, the same number of times, from converged code.  A warp is 32 consecutive linear
thread ids (``x`` fastest); the last warp of a block whose size is not a multiple of 32 has
fewer lanes, and its barrier counts only those.  The ``mask`` argument is accepted and not
checked.  A lane that returns from the kernel while others of its warp wait for it at a
primitive (a divergent call) makes them raise :class:`DivergentWarpError` at once: there is no
wall-clock limit to wait out, whatever the machine's speed.
"""

from __future__ import annotations

import threading

from .kernels.core.common import FULL_MASK

WARP = 32

_state_lock = threading.Lock()


class DivergentWarpError(RuntimeError):
    """A lane of a warp (or warpgroup) returned while another waits for it at a warp-wide
    primitive: on the device a full-mask ``*_sync`` from divergent code is undefined."""


class _LaneBarrier:
    """A barrier of one warp's lanes with no wall-clock limit: it opens when every lane waits,
    fails when a lane raised (:meth:`abort`) or when a lane of the warp has returned from the
    kernel (:meth:`lane_returned`: it can never arrive, the call was divergent)."""

    def __init__(self, lanes, returned=0):
        self.cond = threading.Condition(threading.Lock())
        self.lanes, self.count, self.generation = lanes, 0, 0
        self.returned, self.aborted = returned, False

    def wait(self):
        with self.cond:
            generation = self.generation
            self.count += 1
            if self.count == self.lanes:
                self.count, self.generation = 0, generation + 1
                self.cond.notify_all()
                return
            while generation == self.generation and not (self.aborted or self.returned):
                self.cond.wait()
            if generation != self.generation:
                return
            if self.aborted:
                raise threading.BrokenBarrierError
            raise DivergentWarpError(
                "a lane of this warp returned from the kernel while another waits at a "
                "warp-wide primitive (shuffle, syncwarp or an mma twin): call it from "
                "converged code")

    def abort(self):
        with self.cond:
            self.aborted = True
            self.cond.notify_all()

    def lane_returned(self):
        with self.cond:
            self.returned += 1
            self.cond.notify_all()


class _WarpState:
    def __init__(self, lanes, returned=0):
        self.lanes = lanes
        self.slots = ([None] * lanes, [None] * lanes)   # alternate exchanges' (see exchange)
        self.calls = [0] * lanes   # each lane's exchanges so far: which slot array it writes
        self.barrier = _LaneBarrier(lanes, returned)
        self.shared = {}  # what a twin keeps for the whole group (group_shared)
        self.lock = threading.Lock()


def _group_keys(thread_id):
    """The keys of the calling thread's warp and warpgroup in the block's state dict."""
    return thread_id // WARP, (128, thread_id // 128)  # as _warp_state's keys


def lane_returned(thread):
    """Record that ``thread`` returned from the kernel: its warp's and warpgroup's lanes that
    wait for it, now or later, fail with :class:`DivergentWarpError` instead of hanging
    (called by :mod:`numba_flash.simulator` as each simulated thread ends)."""
    manager = thread._manager
    with _state_lock:
        returned = getattr(manager, "_numba_flash_returned", None)
        if returned is None:
            returned = manager._numba_flash_returned = set()
        returned.add(thread.thread_id)
        states = getattr(manager, "_numba_flash_warps", {})
        waiting = [states[k] for k in _group_keys(thread.thread_id) if k in states]
    for st in waiting:
        st.barrier.lane_returned()


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
            done = getattr(manager, "_numba_flash_returned", ())
            first = group * size
            st = states[key] = _WarpState(min(size, nthreads - first),
                                          sum(first <= t < first + size for t in done))
    return st


def exchange(value, size=WARP):
    """Every lane's ``value``, as a list indexed by lane id (all lanes of the warp must call);
    ``size=128``: over the calling thread's warpgroup, indexed by the thread's rank in it."""
    t = threading.current_thread()
    st = _warp_state(t, size)
    lane = t.thread_id % size
    n = st.calls[lane]
    st.calls[lane] = n + 1
    slots = st.slots[n & 1]   # exchange n + 2 writes it again, after exchange n + 1's barrier
    slots[lane] = value
    st.barrier.wait()  # every lane has written its slot
    return list(slots)


def exchange_once(value, compute, size=WARP):
    """:func:`exchange` of every lane's ``value``, then ``compute(values)`` evaluated once for
    the warp (by the first lane past the barrier, under the group's lock) and returned to every
    lane: a warp-wide result (a tensor-core twin's whole product) is not computed 32 times.
    Every lane of the group must call it, in the same order as its other exchanges."""
    t = threading.current_thread()
    st = _warp_state(t, size)
    key = ("once", st.calls[t.thread_id % size])   # this exchange's number, the same in every lane
    values = exchange(value, size)
    with st.lock:
        entry = st.shared.get(key)
        if entry is None:
            entry = st.shared[key] = [compute(values), 0]
        entry[1] += 1
        if entry[1] == size:   # the last lane to read it
            del st.shared[key]
    return entry[0]


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
