"""How long a launch will take in the Numba CUDA simulator, estimated before it starts.

The simulator runs every CUDA thread as a Python thread and every ``cuda.syncthreads()`` as a
barrier among them, so a launch's time grows with the work each thread does, not only with the
number of threads.  Each op tells :meth:`~numba_flash.frontend.arrays.ArrayCall.launch` that work
as a :class:`SimWork` hint:

* ``steps``: the trips of the kernel's main loop summed over all threads of the launch (for the
  tiled kernels, each thread's K/V tiles, or Q tiles for the backward's K/V-outer loop; for the
  element-wise kernels, the elements each thread handles);
* ``elems``: the per-thread elements outside the loop, summed over the threads (the head dim of
  the row or column each thread loads and writes).

The estimate is ``threads * a + elems * b + steps * c`` with ``(a, b, c)`` measured for each
kernel family on a 2-core CPU (:data:`SIM_COST`).  A launch without a hint is estimated by its
threads alone (``threads * SIM_SECONDS_PER_THREAD``, the lightest kernel's cost: a lower bound).
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import NamedTuple

import numpy as np

from ..backend import SlowSimulatorWarning

__all__ = ["SimWork", "SIM_COST", "SIM_WARN_SECONDS", "BUSY_FACTOR", "simulator_seconds",
           "warn_if_slow", "fmt_time",
           "kv_tiles_visited", "q_tiles_visited", "threads_of"]

#: how much longer than the estimate (the CPU time) a launch takes in wall time on a busy 2-core
#: machine: forwards of [1, 2, 128-256, 64] measured at a load of 16-20 on 2 cores (five
#: agents' work): CPU 0.94-1.34x the estimate, wall 1.71-2.03x
BUSY_FACTOR = 2.0

#: warn before a simulator launch estimated at this much CPU time or more: a minute of wall time
#: on a busy machine (:data:`BUSY_FACTOR`); [1, 2, 256, 64] (estimated 48 s, measured 52-64 s
#: CPU and 87-97 s wall) warns, [1, 2, 256, 64] causal (27 s; 26 s CPU, 47 s wall) does not
SIM_WARN_SECONDS = 60.0 / BUSY_FACTOR

#: seconds per simulated CUDA thread for a launch that gives no :class:`SimWork` hint: the
#: lightest kernels' cost (merge, backward preprocess) on a 2-core CPU, measured before
#: :mod:`numba_flash.simulator`'s barriers (commit a7f3a74); a lower bound.
SIM_SECONDS_PER_THREAD = 3.7e-4

#: ``family: (seconds per thread, per thread element, per loop step)``: non-negative least
#: squares on the relative error over small launches, fitted by ``bench/sim_cost.py`` on a quiet
#: 2-core CPU machine (a VM: the same launch measured up to 1.5x apart between runs) with
#: numba-cuda 0.30.4, Python 3.11 and the simulator with
#: :mod:`numba_flash.simulator`'s barriers), as the process's CPU time around each launch
#: (``time.process_time``).  Each row: the launches fitted and the range of estimate / measured
#: among them (``python bench/sim_cost.py`` prints both, and the committed constants' range).
SIM_COST = {
    # forward and forward_varlen: 13 launches, [1, 1-2, 16-128, 16-128], causal, a packed
    # batch; 0.80-1.19.  One step: one thread's K/V tile (8 x 8 tiles, 16 threads).
    "forward": (6.2e-4, 7.2e-5, 1.3e-3),
    # tensor-core forward (1 warp, 16 x 16 tiles): 9 launches, N 16-128, d 16-64; 0.84-1.12.
    # One step: one thread's 16-column k-slice of one tile pair.
    "forward_mma": (2.9e-3, 0.0, 2.6e-3),
    # backward dK/dV (8 x 8 tiles, 16 threads): 6 launches, N 16-64, d 16-64, causal, GQA;
    # 0.84-1.16.  dQ (deterministic): 4 launches; 0.91-1.14.
    "backward_dkdv": (0.0, 5.1e-5, 1.4e-3),
    "backward_dq": (0.0, 5.2e-5, 1.2e-3),
    # tensor-core backward: dK/dV 5 launches (0.87-1.06), dQ 3 launches (1.0)
    "backward_dkdv_mma": (1.7e-3, 0.0, 5.5e-3),
    "backward_dq_mma": (1.2e-3, 2.2e-5, 3.9e-3),
    # element-wise kernels, one step per element: D = rowsum(dO * O) (11 launches, 0.77-1.27),
    # the dQ cast and GQA sums (17 launches, 0.69-1.23), softmax (4, 0.96-1.06); merge_states
    # and naive_forward (one thread per row, a step per key and column) keep the first fit's
    # constants (commit d4e8373, before numba_flash.simulator's barriers), not re-measured
    # (bench/sim_cost.py does not launch them)
    "backward_preprocess": (8.0e-4, 0.0, 0.0),
    "backward_reduce": (2.2e-4, 0.0, 0.0),
    "merge": (2.2e-4, 0.0, 1.3e-5),
    "softmax": (4.7e-4, 0.0, 9.4e-6),
    "naive_forward": (1.2e-3, 2.7e-5, 4.5e-6),
    # split-KV decode: 4 launches (B 1-2, H 1-4, 16-256 keys, d 16-64); 0.66-1.17.  One step:
    # one thread's share of one block step of keys.
    "decode": (0.0, 8e-6, 1.4e-3),
}


class SimWork(NamedTuple):
    """A launch's work for the simulator estimate (see the module docstring)."""

    family: str
    steps: int
    elems: int = 0


def threads_of(grid, block):
    """CUDA threads of a launch configuration (ints or tuples)."""
    def count(dims):
        dims = dims if isinstance(dims, tuple) else (dims,)
        return math.prod(int(x) for x in dims)

    return count(grid) * count(block)


def _tile_edges(n, block):
    start = np.arange(0, max(0, int(n)), int(block), dtype=np.int64)
    return start, np.minimum(start + int(block), int(n))


def kv_tiles_visited(nq, nk, block_m, block_n, left, right):
    """(Q tile, K/V tile) pairs the forward-style loop visits for one head: for each Q tile, the
    K/V tiles that hold a key some row sees (:func:`~numba_flash.kernels.mainloop.visibility.
    tile_key_range_py`, vectorised)."""
    q_start, q_end = _tile_edges(nq, block_m)
    offset = int(nk) - int(nq)
    lo = np.zeros_like(q_start) if left < 0 else np.maximum(0, q_start + offset - left)
    hi = np.full_like(q_start, nk) if right < 0 else np.minimum(nk, q_end - 1 + offset + right + 1)
    first = lo // block_n
    last = -(-hi // block_n)
    return int(np.where(hi > lo, last - first, 0).sum())


def q_tiles_visited(nq, nk, block_m, block_n, left, right):
    """(K/V tile, Q tile) pairs the backward's K/V-outer loop visits for one head
    (:func:`~numba_flash.kernels.mainloop.visibility.tile_query_range_py`, vectorised)."""
    k_start, k_end = _tile_edges(nk, block_n)
    offset = int(nk) - int(nq)
    lo = np.zeros_like(k_start) if right < 0 else np.maximum(0, k_start - right - offset)
    hi = np.full_like(k_start, nq) if left < 0 else np.minimum(nq, k_end - 1 + left - offset + 1)
    first = lo // block_m
    last = -(-hi // block_m)
    return int(np.where(hi > lo, last - first, 0).sum())


def tiled_work(family, lens, heads, block_m, block_n, left, right, per_block, head_dim,
               kv_outer=False, mma=False):
    """:class:`SimWork` of a tiled kernel with ``per_block`` threads, over the sequences
    ``lens`` (pairs ``(nq, nk)``: ``B`` times the same pair, or a packed batch's lengths) and
    ``heads`` heads each: ``steps`` are the (outer tile, inner tile) pairs visited times the
    threads, ``elems`` the outer tiles' threads times ``head_dim``.  ``kv_outer``: the outer
    loop runs over K/V tiles (the backward's dK/dV kernel), else over Q tiles.  ``mma``: a
    tensor-core kernel, whose simulator twins emulate each ``m16n8k16`` lane by lane, so a tile
    pair costs in proportion to its ``head_dim / 16`` k-slices: each slice counts as a step."""
    steps = elems = 0
    for nq, nk in lens:
        nq, nk = int(nq), int(nk)
        if kv_outer:
            steps += q_tiles_visited(nq, nk, block_m, block_n, left, right)
            elems += -(-nk // block_n)
        else:
            steps += kv_tiles_visited(nq, nk, block_m, block_n, left, right)
            elems += -(-nq // block_m)
    slices = max(1, head_dim // 16) if mma else 1
    return SimWork(family, steps * heads * per_block * slices,
                   elems * heads * per_block * head_dim)


def simulator_seconds(grid, block, work=None):
    """Estimated wall time of a simulator launch (see the module docstring)."""
    threads = threads_of(grid, block)
    cost = SIM_COST.get(work.family) if work is not None else None
    if cost is None:
        return threads * SIM_SECONDS_PER_THREAD
    per_thread, per_elem, per_step = cost
    return threads * per_thread + int(work.elems) * per_elem + int(work.steps) * per_step


def _user_stacklevel():
    """The stacklevel of the first frame outside numba_flash (for warnings about a call)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def fmt_time(seconds):
    """An estimate as the warning and the README print it: ``48 s``, ``12 min``, ``1.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def warn_if_slow(kernel, grid, block, work=None):
    """Warn (:class:`~numba_flash.backend.SlowSimulatorWarning`) before a simulator launch
    estimated at :data:`SIM_WARN_SECONDS` or more."""
    seconds = simulator_seconds(grid, block, work)
    if seconds < SIM_WARN_SECONDS:
        return seconds
    name = getattr(getattr(kernel, "py_func", None), "__name__", None) or "kernel"
    how = (f"of CPU time, from the work of its threads; up to {BUSY_FACTOR:g}x that in wall "
           f"time on a busy machine" if work is not None and work.family in SIM_COST
           else "at least: counted from its threads alone")
    warnings.warn(
        f"this simulator launch of {name} (grid {grid}, block {block}, "
        f"{threads_of(grid, block)} CUDA threads) is estimated to take {fmt_time(seconds)} "
        f"({how}). Use smaller shapes in the simulator, or run on a GPU; Ctrl-C stops it.",
        SlowSimulatorWarning,
        stacklevel=_user_stacklevel(),
    )
    return seconds
