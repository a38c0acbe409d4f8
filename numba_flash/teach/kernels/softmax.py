"""Row softmax with the online normaliser: one thread block per row.

Math
----
For a row ``x`` of length ``n``::

    m = max_j x_j,   l = sum_j exp(x_j - m),   y_j = exp(x_j - m) / l

Each thread computes ``(m, l)`` for its strided slice ``x[t], x[t + THREADS], ...`` in one pass
with the online recurrence ``m_new = max(m, x); l = l * exp(m - m_new) + exp(x - m_new)``.  The
``THREADS`` partial pairs are merged by a shared-memory tree reduction with the same rule applied
to pairs::

    m = max(m_a, m_b),   l = l_a * exp(m_a - m) + l_b * exp(m_b - m)

and a final pass writes ``y_j = exp(x_j - m) / l``.  (A normalised softmax needs this second pass:
no output can be written before the whole row's ``m`` and ``l`` are known.)

Masked entries (``-inf``, e.g. from an attention mask) get ``y_j = 0``: the recurrence skips a
``-inf`` element (it adds ``exp(-inf) = 0`` and moves no maximum; computing it would give
``exp(-inf - (-inf)) = NaN`` while ``m`` is still ``-inf``), and the merge keeps two empty
halves at ``(-inf, 0)``, so leading, trailing or scattered ``-inf`` entries, or a thread whose
whole strided slice is ``-inf``, give :func:`numba_flash.reference.softmax` of the row.  A row
that is ``-inf`` everywhere has no softmax and comes out NaN everywhere, as in
:func:`numba_flash.reference.softmax` (and torch).  A NaN anywhere in a row makes the row NaN.

Grid / block
------------
grid = (rows,), block = (THREADS,).  Thread ``t`` of block ``r`` handles ``x[r, t::THREADS]``;
consecutive threads read consecutive elements, so every load is coalesced.

Shared memory
-------------
``m_sh[THREADS]`` and ``l_sh[THREADS]`` of the compute type: ``2 * THREADS * 4`` bytes in float32
(2 KiB at 256 threads), ``2 * THREADS * 8`` in float64.  No warp shuffles, so the kernel runs
unchanged in the simulator.

float16 and bfloat16 inputs are computed in float32, float64 inputs in float64, each element
read and written through the element-type stage (:mod:`numba_flash.kernels.core.elements`).
"""

from __future__ import annotations

import functools
import math

from numba import cuda

from ...kernels.core.common import backend_threads, compute_type
from ...kernels.core.elements import element_ops

#: threads per block: small in the simulator (one Python thread each), a full block on the GPU.
SIM_THREADS = 8
GPU_THREADS = 256
default_threads = functools.partial(backend_threads, SIM_THREADS, GPU_THREADS)


@functools.lru_cache(maxsize=None)
def softmax_kernel(THREADS, dtype):
    """Build (once per ``(THREADS, dtype)``) the row-softmax kernel ``kernel(x, y)``."""
    assert THREADS & (THREADS - 1) == 0, "THREADS must be a power of two for the tree reduction"
    acc_t = compute_type(dtype)
    load, store = element_ops(dtype)  # the element-type stage (kernels/core/elements.py)
    NEG_INF = -math.inf

    @cuda.jit
    def softmax_rows(x, y):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        n = x.shape[1]
        m_sh = cuda.shared.array(THREADS, acc_t)
        l_sh = cuda.shared.array(THREADS, acc_t)

        # [docs:softmax-kernel-pass1]
        # -- pass 1: online (m, l) over this thread's strided slice of the row
        m_i = acc_t(NEG_INF)
        l_i = acc_t(0.0)
        for j in range(tid, n, THREADS):
            xj = load(x[row, j])
            if xj != NEG_INF:  # a -inf adds exp(-inf) = 0 and moves no max: skip, no -inf + inf
                m_new = max(m_i, xj)
                l_i = l_i * math.exp(m_i - m_new) + math.exp(xj - m_new)
                m_i = m_new
        m_sh[tid] = m_i
        l_sh[tid] = l_i
        cuda.syncthreads()  # every (m, l) is in shared memory before the reduction reads it
        # [/docs:softmax-kernel-pass1]

        # [docs:softmax-kernel-reduction]
        # -- tree reduction of the (m, l) pairs: THREADS/2, THREADS/4, ..., 1 active threads
        stride = THREADS // 2
        while stride > 0:
            if tid < stride:
                m_a = m_sh[tid]
                m_b = m_sh[tid + stride]
                m_new = max(m_a, m_b)
                if m_new != NEG_INF:  # both halves empty: keep (-inf, 0), avoid exp(-inf + inf)
                    l_sh[tid] = (l_sh[tid] * math.exp(m_a - m_new)
                                 + l_sh[tid + stride] * math.exp(m_b - m_new))
                    m_sh[tid] = m_new
            cuda.syncthreads()  # this level's merged pairs are written before the next level reads
            stride //= 2
        # [/docs:softmax-kernel-reduction]

        # -- pass 2: normalise with the row's (m, l), which thread 0 left in slot 0
        m_row = m_sh[0]
        inv_l = acc_t(1.0) / l_sh[0]
        for j in range(tid, n, THREADS):
            y[row, j] = store(math.exp(load(x[row, j]) - m_row) * inv_l)

    return softmax_rows
