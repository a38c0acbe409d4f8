"""The tiled forward for teaching: a Q tile per block, one thread per score (tutorial step 3).

Math
----
Block ``x`` of head ``(b, h)`` owns the query rows ``x * BLOCK_M ..`` (kv head ``h_kv = h // (H //
Hkv)``, GQA).  It walks the keys ``BLOCK_N`` at a time.  For tile ``j``, with ``S = scale * Q_i
K_j^T`` and ``-inf`` where a row does not see a key, each row keeps::

    m_new = max(m_i, rowmax(S)),  alpha = exp(m_i - m_new),  P = exp(S - m_new)
    l_i   = alpha * l_i + rowsum(P)
    acc   = alpha * acc + P @ V_j
    m_i   = m_new

and at the end ``o = acc / l_i``, ``lse = m_i + log(l_i)``: ``reference.blocked_attention`` with
one Q tile per block.  Causal masking is aligned bottom-right (row ``i`` sees keys ``j <= i + Nk -
Nq``); a row that sees no key writes ``o = 0``, ``lse = -inf``.

Grid / block
------------
grid = (ceil(Nq / BLOCK_M), B * H), block = (BLOCK_N, BLOCK_M).  Thread ``(tx, ty)`` computes the
score of row ``ty`` and key ``tx`` of each tile, and owns the output columns ``tx, tx + BLOCK_N,
..`` of row ``ty``.  Every thread of a row keeps its own copy of the row's ``m_i`` and ``l_i``
(the same values).  No thread returns early: each takes its share of every copy and reaches every
barrier.

Memory
------
Shared, in the compute type: ``q_tile [BLOCK_M, HEAD_DIM]`` (loaded once), ``k_tile`` and
``v_tile [BLOCK_N, HEAD_DIM]`` (one K/V tile at a time), ``s_tile`` and ``p_tile [BLOCK_M,
BLOCK_N]``.  Every global load and store is one element (float16 and bfloat16 converted to
float32 by :mod:`numba_flash.kernels.core.elements`).  Per thread: ``acc`` (``TD`` registers).
What the production kernel (``kernels/forward/simt.py``) adds is listed in docs/tiled-forward.md.
"""

from __future__ import annotations

import functools
import math

from numba import cuda

from ...backend import on_simulator
from ...kernels.core.common import SMEM_LIMIT, acc_dtype, compute_type
from ...kernels.core.elements import element_ops

#: in the simulator (one Python thread per CUDA thread): 4 x 4 threads, so that ragged tiles,
#: spare rows and several tiles all occur on small shapes
SIM_BLOCKS = (4, 4)
#: on a GPU, the first ``(BLOCK_M, BLOCK_N)`` whose five tiles fit in 48 KiB (BLOCK_N = 32: one
#: warp is one row of S)
GPU_BLOCKS = ((16, 32), (8, 32), (8, 16), (4, 16), (4, 8))


def shared_bytes(head_dim, block_m, block_n, dtype):
    """Static shared memory of one block: the Q, K, V tiles and the S, P tiles."""
    w = acc_dtype(dtype).itemsize
    return w * (block_m * head_dim + 2 * block_n * head_dim + 2 * block_m * block_n)


def default_blocks(head_dim, dtype):
    """``(BLOCK_M, BLOCK_N)``: :data:`SIM_BLOCKS` in the simulator, else from :data:`GPU_BLOCKS`."""
    if on_simulator():
        return SIM_BLOCKS
    return next(mn for mn in GPU_BLOCKS if shared_bytes(head_dim, *mn, dtype) <= SMEM_LIMIT)


@functools.lru_cache(maxsize=None)
def tiled_forward_teach_kernel(HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, dtype):
    """Build (once per configuration) ``kernel(q, k, v, o, lse, scale)``."""
    acc_t = compute_type(dtype)
    load, store = element_ops(dtype)  # element -> compute type and back (kernels/core/elements.py)
    NEG_INF = -math.inf
    THREADS = BLOCK_M * BLOCK_N
    TD = (HEAD_DIM + BLOCK_N - 1) // BLOCK_N  # output columns per thread

    @cuda.jit
    def tiled_forward_teach(q, k, v, o, lse, scale):
        # [docs:teach-index]
        tx = cuda.threadIdx.x                 # the key of each tile this thread scores
        ty = cuda.threadIdx.y                 # the row of the Q tile this thread works on
        tid = ty * BLOCK_N + tx               # 0 .. THREADS - 1: the thread's share of a copy
        n_heads = q.shape[1]
        b = cuda.blockIdx.y // n_heads
        h = cuda.blockIdx.y % n_heads
        h_kv = h // (n_heads // k.shape[1])   # GQA: query heads share a kv head
        nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
        q_start = cuda.blockIdx.x * BLOCK_M
        row = q_start + ty                    # this thread's query row (>= nq: a spare row)
        # [/docs:teach-index]

        # [docs:teach-arrays]
        q_tile = cuda.shared.array((BLOCK_M, HEAD_DIM), acc_t)
        k_tile = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t)
        v_tile = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t)
        s_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        p_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        acc = cuda.local.array(TD, acc_t)     # columns tx, tx + BLOCK_N, .. of this row
        # [/docs:teach-arrays]

        # [docs:teach-bounds]
        # the keys this row sees, [0, hi), and the keys the block's last row sees, [0, kv_end)
        last = min(nq, q_start + BLOCK_M) - 1
        hi = nk if row < nq else 0
        kv_end = nk
        # [/docs:teach-bounds]
        if CAUSAL:                            # bottom-right: row i sees keys j <= i + nk - nq
            hi = min(hi, max(0, row + nk - nq + 1))
            kv_end = min(nk, max(0, last + nk - nq + 1))

        # [docs:teach-load-q]
        for e in range(tid, BLOCK_M * d, THREADS):  # consecutive threads, consecutive elements
            r = e // d
            c = e % d
            x = acc_t(0.0)                    # a spare row's Q is zero
            if q_start + r < nq:
                x = load(q[b, h, q_start + r, c])
            q_tile[r, c] = x
        m_i = acc_t(NEG_INF)
        l_i = acc_t(0.0)
        for t in range(TD):
            acc[t] = acc_t(0.0)
        cuda.syncthreads()  # q_tile is complete before any thread reads a row of it
        # [/docs:teach-load-q]

        for kt in range((kv_end + BLOCK_N - 1) // BLOCK_N):
            # [docs:teach-load-kv]
            k0 = kt * BLOCK_N
            n_keys = min(BLOCK_N, nk - k0)    # the last tile may be ragged
            for e in range(tid, n_keys * d, THREADS):
                r = e // d
                c = e % d
                k_tile[r, c] = load(k[b, h_kv, k0 + r, c])
                v_tile[r, c] = load(v[b, h_kv, k0 + r, c])
            cuda.syncthreads()  # k_tile and v_tile are complete before any thread reads them
            # [/docs:teach-load-kv]

            # [docs:teach-s]
            x = acc_t(NEG_INF)                # a key this row does not see: P will be 0
            if k0 + tx < hi:
                x = acc_t(0.0)
                for c in range(d):
                    x += q_tile[ty, c] * k_tile[tx, c]
                x *= scale
            s_tile[ty, tx] = x
            cuda.syncthreads()  # the row's scores are all written before any thread reads them
            # [/docs:teach-s]

            # [docs:teach-softmax]
            m_new = m_i
            for j in range(BLOCK_N):
                m_new = max(m_new, s_tile[ty, j])
            m_use = m_new if m_new != NEG_INF else acc_t(0.0)  # no key yet: exp(-inf) = 0
            alpha = acc_t(math.exp(m_i - m_use))
            p_tile[ty, tx] = math.exp(x - m_use)
            m_i = m_new
            cuda.syncthreads()  # the row's P is all written before any thread reads it
            # [/docs:teach-softmax]

            # [docs:teach-pv]
            row_sum = acc_t(0.0)
            for j in range(BLOCK_N):
                row_sum += p_tile[ty, j]
            l_i = alpha * l_i + row_sum
            j_end = min(BLOCK_N, hi - k0)     # the keys of this tile the row sees
            for t in range(TD):
                c = tx + t * BLOCK_N
                if c < d:
                    a = alpha * acc[t]
                    for j in range(j_end):
                        a += p_tile[ty, j] * v_tile[j, c]
                    acc[t] = a
            cuda.syncthreads()  # all reads of k/v/p_tile are done before the next tile's copy
            # [/docs:teach-pv]

        # [docs:teach-epilogue]
        if row < nq:
            inv_l = acc_t(0.0)                # a row that saw no key: o = 0, lse = -inf
            row_lse = acc_t(NEG_INF)
            if l_i > acc_t(0.0):
                inv_l = acc_t(1.0) / l_i
                row_lse = m_i + math.log(l_i)
            for t in range(TD):
                c = tx + t * BLOCK_N
                if c < d:
                    o[b, h, row, c] = store(acc[t] * inv_l)
            if tx == 0:
                lse[b, h, row] = row_lse
        # [/docs:teach-epilogue]

    return tiled_forward_teach


#: the configurations the compile tier builds ``(dtype, head dim, causal)``: the page's float32
#: at 64, causal and not, and float16 at 128 (the kernel is a teaching step: its one design
#: fact for the compile tier, registers without spills, is the same in all)
COMPILE_SELECTION = (("float32", 64, False), ("float32", 64, True), ("float16", 128, True))
