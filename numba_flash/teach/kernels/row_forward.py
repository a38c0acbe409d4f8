"""The first tiled forward: one thread per query row, K/V tiles in shared memory (tutorial step 2).

Math
----
For query row ``i`` of head ``(b, h)`` (kv head ``h_kv = h // (H // Hkv)``, GQA) the keys are
taken ``BLOCK_N`` at a time.  For tile ``j`` with scores ``s = scale * q_i . K_j^T`` over the keys
of the tile that row ``i`` sees, the online softmax keeps the running max ``m_i``, the running
sum ``l_i`` and the unnormalised output ``acc`` (all in the compute type)::

    m_new = max(m_i, max(s)),  alpha = exp(m_i - m_new)
    p     = exp(s - m_new)                      (BLOCK_N values)
    l_i   = alpha * l_i + sum(p)
    acc   = alpha * acc + p @ V_j
    m_i   = m_new

and at the end ``o_i = acc / l_i``, ``lse_i = m_i + log(l_i)``: the naive kernel's recurrence with
one rescale per tile instead of one per key.  Causal masking is aligned bottom-right (row ``i``
sees keys ``j <= i + Nk - Nq``); a row that sees no key writes ``o = 0``, ``lse = -inf``.

Grid / block
------------
grid = (ceil(Nq / BLOCK_M), B * H), block = (BLOCK_M,).  ``blockIdx.y`` is the flattened
``(b, h)``; thread ``t`` of block ``x`` owns query row ``x * BLOCK_M + t``.  The block's threads
load each K/V tile together (element ``e`` of the tile by thread ``e % BLOCK_M``: consecutive
threads read consecutive addresses) and then every thread reads all of it: each K/V element comes
from global memory once per block instead of once per row (the naive kernel), a ``BLOCK_M``-fold
cut.  A thread past the last row (``row >= Nq``) does not return: it still loads its share of
every tile and reaches every barrier.

Memory
------
Shared: ``K_j`` and ``V_j``, ``[BLOCK_N, HEAD_DIM]`` each in the compute type (float16 and
bfloat16 converted to float32 once, as they are loaded, by
:mod:`numba_flash.kernels.core.elements`): ``2 * BLOCK_N * HEAD_DIM * 4`` bytes in float32, 32 KiB
at most (:func:`gpu_blocks` picks ``BLOCK_N`` for that).  Per thread: ``q_i``, ``acc``
(``HEAD_DIM``) and ``s`` (``BLOCK_N``) local arrays; they are indexed in runtime loops, so ptxas
puts them in local memory (a stack frame): the register-tile kernel (``kernels/forward/simt.py``) is
the next step.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ...backend import on_simulator
from ...kernels.core.common import HEAD_DIMS, acc_dtype, compute_type
from ...kernels.core.elements import BFLOAT16, element_ops
from ...kernels.mainloop.visibility import key_bounds

#: rows per block on a GPU, and the shared-memory budget for the two K/V tiles
GPU_BLOCK_M = 64
SMEM_BUDGET = 32 * 1024
#: in the simulator (one Python thread per CUDA thread): few rows, and a K/V tile that is not a
#: multiple of BLOCK_M, so the strided tile load and a partial last tile are exercised
SIM_BLOCK_M = 4
SIM_BLOCK_N = 6


def gpu_blocks(head_dim, dtype):
    """``(BLOCK_M, BLOCK_N)`` on a GPU: the largest ``BLOCK_N`` in (32, 16, 8) whose two K/V tiles
    fit in :data:`SMEM_BUDGET`."""
    size = acc_dtype(dtype).itemsize
    block_n = next(n for n in (32, 16, 8) if 2 * n * head_dim * size <= SMEM_BUDGET)
    return GPU_BLOCK_M, block_n


def default_blocks(head_dim, dtype):
    return (SIM_BLOCK_M, SIM_BLOCK_N) if on_simulator() else gpu_blocks(head_dim, dtype)


@functools.lru_cache(maxsize=None)
def row_forward_kernel(HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, dtype):
    """Build (once per configuration) ``kernel(q, k, v, o, lse, scale)``."""
    acc_t = compute_type(dtype)
    load, store = element_ops(dtype)  # element -> compute type and back (kernels/core/elements.py)
    NEG_INF = -math.inf

    # [docs:row-kernel]
    @cuda.jit
    def row_forward(q, k, v, o, lse, scale):
        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x * BLOCK_M + tid         # the query row of this thread
        n_heads = q.shape[1]
        b = cuda.blockIdx.y // n_heads
        h = cuda.blockIdx.y % n_heads
        h_kv = h // (n_heads // k.shape[1])           # GQA
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]

        K_j = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t)
        V_j = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t)
        q_i = cuda.local.array(HEAD_DIM, acc_t)
        acc = cuda.local.array(HEAD_DIM, acc_t)
        s = cuda.local.array(BLOCK_N, acc_t)

        # [docs:row-prologue]
        # the keys this row sees, [lo, hi); a spare thread (row >= nq) sees none but stays
        lo, hi = 0, 0
        if row < nq:
            lo, hi = key_bounds(row, nk - nq, nk, -1, 0 if CAUSAL else -1)
            for c in range(d):
                q_i[c] = load(q[b, h, row, c])
        for c in range(d):
            acc[c] = acc_t(0.0)
        m_i = acc_t(NEG_INF)
        l_i = acc_t(0.0)
        # the keys the block's last row sees: the same tile count for every thread
        last = min(nq, cuda.blockIdx.x * BLOCK_M + BLOCK_M) - 1
        n_tiles = (key_bounds(last, nk - nq, nk, -1, 0 if CAUSAL else -1)[1]
                   + BLOCK_N - 1) // BLOCK_N
        # [/docs:row-prologue]

        for t in range(n_tiles):
            # [docs:row-load]
            k0 = t * BLOCK_N
            n_rows = min(BLOCK_N, nk - k0)            # keys in this tile
            for e in range(tid, n_rows * d, BLOCK_M):  # thread tid: elements tid, tid + BLOCK_M..
                r = e // d
                c = e % d
                K_j[r, c] = load(k[b, h_kv, k0 + r, c])
                V_j[r, c] = load(v[b, h_kv, k0 + r, c])
            cuda.syncthreads()  # every thread reads rows of K_j, V_j that other threads wrote
            # [/docs:row-load]

            # [docs:row-update]
            j_lo = max(lo, k0) - k0                   # this row's keys in the tile: [j_lo, j_hi)
            j_hi = min(hi, k0 + BLOCK_N) - k0
            if j_lo < j_hi:
                # -- scores s = scale * q_i . K_j^T and their max
                m_tile = acc_t(NEG_INF)
                for j in range(j_lo, j_hi):
                    x = acc_t(0.0)
                    for c in range(d):
                        x += q_i[c] * K_j[j, c]       # all threads read K_j[j, c]: a broadcast
                    s[j] = x * scale
                    m_tile = max(m_tile, s[j])
                # -- update m_i and l_i, rescale acc: once per tile
                m_new = max(m_i, m_tile)
                alpha = math.exp(m_i - m_new)         # exp(-inf) = 0 on the first tile
                l_i *= alpha
                for c in range(d):
                    acc[c] *= alpha
                # -- acc += p @ V_j
                for j in range(j_lo, j_hi):
                    p = math.exp(s[j] - m_new)
                    l_i += p
                    for c in range(d):
                        acc[c] += p * V_j[j, c]
                m_i = m_new
            cuda.syncthreads()  # the next tile's load overwrites K_j, V_j: wait until all read
            # [/docs:row-update]

        # [docs:row-epilogue]
        if row < nq:
            if l_i > acc_t(0.0):
                inv_l = acc_t(1.0) / l_i
                for c in range(d):
                    o[b, h, row, c] = store(acc[c] * inv_l)
                lse[b, h, row] = m_i + math.log(l_i)
            else:                                     # a row that saw no key
                for c in range(d):
                    o[b, h, row, c] = store(acc_t(0.0))
                lse[b, h, row] = acc_t(NEG_INF)
        # [/docs:row-epilogue]
    # [/docs:row-kernel]

    return row_forward


#: the compile tier's selection ``(dtype, HEAD_DIM, CAUSAL)``: every head dim once in float32, the
#: causal loop, float16 where it is used most, float64 where its tiles are largest, bfloat16's
#: stage.  (All 30 float16/32/64 configurations build clean but for the stack frame by design:
#: docs/row-forward.md, docs/optimised-forward.md#the-first-tiled-kernel-on-a-gpu-a-stack-frame;
#: the selection keeps the tier's time down.)
COMPILE_SELECTION = (
    [(np.float32, hd, False) for hd in HEAD_DIMS] + [(np.float32, 64, True)]
    + [(np.float16, hd, c) for hd in (64, 128) for c in (False, True)]
    + [(np.float64, 64, False), (np.float64, 256, True), (BFLOAT16, 64, True)]
)
