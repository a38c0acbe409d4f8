"""Merging partial attention states with the log-sum-exp rule (FlashDecoding stage 2).

Math
----
Part ``p`` of a row holds a normalised output ``o_p`` over its own key set and that set's
log-sum-exp ``lse_p``.  Over the union of the (disjoint) key sets::

    m   = max_p lse_p
    w_p = exp(lse_p - m)                  (the part's share of the softmax mass, up to 1/W)
    W   = sum_p w_p,   lse = m + log W,   o = (sum_p w_p o_p) / W

A part with ``lse_p = -inf`` saw no key: it is skipped (so a garbage ``o_p`` cannot leak in), and
a row whose parts are all ``-inf`` gets ``o = 0, lse = -inf``.  Skipping, rather than adding
``w_p = 0``, also keeps the result bitwise independent of how many empty parts a launch has,
which the split-KV decode needs for batch invariance.

Grid / block
------------
grid = ``(rows,)``, block = ``(THREADS,)``.  Every thread of block ``row`` computes the row's
``m`` and ``W`` (the ``P`` lse values are the same few words for all threads: broadcast loads),
then thread ``t`` merges the head-dim elements ``t, t + THREADS, ...`` (consecutive threads on
consecutive elements: coalesced); thread 0 writes ``lse``.

Shared memory
-------------
None.

Parts are read in their dtype and merged in float32 (float64 for float64 parts); ``o`` is written
in the output dtype (the decode writes float32 partials and a float16 output for float16 caches).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ..backend import on_simulator
from .common import acc_dtype, compute_type, numba_array_type

SIM_THREADS = 4
GPU_THREADS = 128


def default_threads():
    return SIM_THREADS if on_simulator() else GPU_THREADS


@functools.lru_cache(maxsize=None)
def merge_kernel(THREADS, part_dtype, out_dtype):
    """Build (once per configuration) ``kernel(o_parts, lse_parts, o, lse)``.

    ``o_parts`` ``[P, rows, d]`` in ``part_dtype``; ``lse_parts`` ``[P, rows]`` and ``lse``
    ``[rows]`` in the compute type of ``part_dtype``; ``o`` ``[rows, d]`` in ``out_dtype``.
    """
    acc_t = compute_type(part_dtype)
    NEG_INF = -math.inf

    @cuda.jit
    def merge_states(o_parts, lse_parts, o, lse):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n_parts = o_parts.shape[0]
        d = o_parts.shape[2]

        # [docs:merge-skip-empty]
        # -- m = max_p lse_p and W = sum_p exp(lse_p - m), skipping empty parts
        m = acc_t(NEG_INF)
        for p in range(n_parts):
            m = max(m, acc_t(lse_parts[p, row]))
        total = acc_t(0.0)
        if m != NEG_INF:
            for p in range(n_parts):
                lse_p = acc_t(lse_parts[p, row])
                if lse_p != NEG_INF:
                    total += math.exp(lse_p - m)
        # [/docs:merge-skip-empty]

        # -- o = sum_p w_p o_p / W for this thread's head-dim elements
        for c in range(tid, d, THREADS):
            out = acc_t(0.0)
            if total > acc_t(0.0):
                for p in range(n_parts):
                    lse_p = acc_t(lse_parts[p, row])
                    if lse_p != NEG_INF:
                        out += math.exp(lse_p - m) * acc_t(o_parts[p, row, c])
                out = out / total
            o[row, c] = out
        if tid == 0:
            lse_row = acc_t(NEG_INF)
            if total > acc_t(0.0):
                lse_row = m + math.log(total)
            lse[row] = lse_row

    return merge_states


#: (part dtype, output dtype) pairs the package launches: merge_states keeps the parts' dtype;
#: the decode merges float32 partials into float16 for float16 caches.
PAIRS = (
    (np.dtype(np.float16), np.dtype(np.float16)),
    (np.dtype(np.float32), np.dtype(np.float16)),
    (np.dtype(np.float32), np.dtype(np.float32)),
    (np.dtype(np.float64), np.dtype(np.float64)),
)


def compile_configs():
    """Every merge configuration the package can launch on a GPU, for the compile tier."""
    for part_dtype, out_dtype in PAIRS:
        acc_np = acc_dtype(part_dtype)
        yield {
            "name": f"merge THREADS={GPU_THREADS} {part_dtype.name}->{out_dtype.name}",
            "kernel": merge_kernel(GPU_THREADS, part_dtype, out_dtype),
            "args": (numba_array_type(part_dtype, 3), numba_array_type(acc_np, 2),
                     numba_array_type(out_dtype, 2), numba_array_type(acc_np, 1)),
            "float64_ok": part_dtype == np.float64,
        }
