"""The first attention forward: one thread per query row, no shared memory (tutorial step 1).

Math
----
For query row ``i`` of head ``(b, h)`` (kv head ``h_kv = h // (H // Hkv)``, GQA), with
``s_j = scale * q_i . k_j`` over the visible keys ``j``, one pass of the online softmax keeps the
running max ``m_i``, running sum ``l_i`` and the unnormalised output ``acc``::

    m_new = max(m_i, s_j),  alpha = exp(m_i - m_new),  p = exp(s_j - m_new)
    l_i   = alpha * l_i + p
    acc   = alpha * acc + p * v_j
    m_i   = m_new

and at the end ``o_i = acc / l_i``, ``lse_i = m_i + log(l_i)``.  Causal masking is aligned
bottom-right: row ``i`` sees keys ``j <= i + Nk - Nq``, so it simply stops its key loop early; a row
that sees no key writes ``o = 0``, ``lse = -inf``.

This is the tiled kernel with every tile one row high and one key wide: nothing is shared between
threads, so every thread reads all the K/V rows it needs straight from global memory.  Its global
traffic is ``Theta(Nq * Nk * d)`` per head (see ``docs/io-complexity.md``): the tiled forward
exists to divide that by the number of query rows that share a K/V tile.

Grid / block
------------
grid = (ceil(Nq / BLOCK_M), B * H), block = (BLOCK_M,).  ``blockIdx.y`` is the flattened
``(b, h)``; thread ``t`` of block ``x`` owns query row ``x * BLOCK_M + t``.

Memory
------
No shared memory.  Per thread: ``q_row[HEAD_DIM]`` and ``acc[HEAD_DIM]`` local arrays of the
compute type (``HEAD_DIM`` is the head dim padded to a compile-time size; the loops run over the
true ``d``), plus the scalars ``m_i``, ``l_i``.

float16 and bfloat16 inputs are computed in float32, float64 inputs in float64, each element
read and written through the element-type stage (:mod:`numba_flash.kernels.core.elements`).  ``lse``
is stored in the compute type.
"""

from __future__ import annotations

import functools
import math

from numba import cuda

from ...backend import on_simulator
from ...kernels.core.common import compute_type
from ...kernels.core.elements import element_ops
from ...kernels.mainloop.visibility import key_bounds


#: query rows (= threads) per block: few in the simulator (one Python thread each).
SIM_BLOCK_M = 4
GPU_BLOCK_M = 128


def default_block_m():
    return SIM_BLOCK_M if on_simulator() else GPU_BLOCK_M


@functools.lru_cache(maxsize=None)
def naive_forward_kernel(HEAD_DIM, CAUSAL, dtype):
    """Build (once per ``(HEAD_DIM, CAUSAL, dtype)``) ``kernel(q, k, v, o, lse, scale)``."""
    acc_t = compute_type(dtype)
    load, store = element_ops(dtype)  # the element-type stage (kernels/core/elements.py)
    NEG_INF = -math.inf

    # [docs:naive-kernel]
    @cuda.jit
    def naive_forward(q, k, v, o, lse, scale):
        # [docs:naive-grid]
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x  # query row of this thread
        bh = cuda.blockIdx.y                                          # flattened (batch, head)
        n_heads = q.shape[1]
        b = bh // n_heads
        h = bh % n_heads
        h_kv = h // (n_heads // k.shape[1])  # GQA: a group of query heads shares one kv head
        # [/docs:naive-grid]
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]
        if row >= nq:
            return  # the last block's spare threads

        # [docs:naive-body]
        q_row = cuda.local.array(HEAD_DIM, acc_t)
        acc = cuda.local.array(HEAD_DIM, acc_t)
        for c in range(d):
            q_row[c] = load(q[b, h, row, c])
            acc[c] = acc_t(0.0)
        m_i = acc_t(NEG_INF)
        l_i = acc_t(0.0)

        # the keys this row sees, [lo, hi) (the rule of visibility.py: causal is the window
        # (-1, 0), aligned bottom-right: row sees keys j <= row + nk - nq)
        lo, hi = key_bounds(row, nk - nq, nk, -1, 0 if CAUSAL else -1)
        for j in range(lo, hi):
            s = acc_t(0.0)
            for c in range(d):
                s += q_row[c] * load(k[b, h_kv, j, c])
            s *= scale
            # -- online softmax: rescale what was summed against the old max
            m_new = max(m_i, s)
            alpha = math.exp(m_i - m_new)
            p = math.exp(s - m_new)
            l_i = alpha * l_i + p
            for c in range(d):
                acc[c] = alpha * acc[c] + p * load(v[b, h_kv, j, c])
            m_i = m_new

        # -- epilogue: normalise once; a row that saw no key writes o = 0, lse = -inf
        if l_i > acc_t(0.0):
            inv_l = acc_t(1.0) / l_i
            for c in range(d):
                o[b, h, row, c] = store(acc[c] * inv_l)
            lse[b, h, row] = m_i + math.log(l_i)
        else:
            for c in range(d):
                o[b, h, row, c] = store(acc_t(0.0))
            lse[b, h, row] = acc_t(NEG_INF)
        # [/docs:naive-body]
    # [/docs:naive-kernel]

    return naive_forward
