"""Exercise (docs/tiled-forward.md): make the teaching tiled kernel causal.

This is ``numba_flash/teach/kernels/tiled_forward.py`` for float32/float64 inputs, without its
causal lines: every row sees every key, and every block walks every K/V tile.  Give
``make_kernel`` its ``CAUSAL`` constant back.  With ``CAUSAL=True`` row ``i`` sees the keys
``j <= i + nk - nq`` (bottom-right alignment); a row that sees no key writes ``o = 0``,
``lse = -inf``.  A block must not load a K/V tile that no row of it sees.

Check: ``python -m pytest -n 0 docs/exercises/test_tiled_causal.py --exercises`` (it compares
with the reference and counts the bytes read from k and v in the simulator).
"""

from __future__ import annotations

import functools
import math

import numpy as np

import numba_flash  # noqa: F401  (first: selects the simulator when there is no GPU)
from numba import cuda, float32, float64

HEAD_DIM = 16
BLOCK_M = 4   # query rows per block (threadIdx.y)
BLOCK_N = 4   # keys per K/V tile (threadIdx.x)
TD = HEAD_DIM // BLOCK_N  # output columns per thread


@functools.lru_cache(maxsize=None)
def make_kernel(CAUSAL, dtype):
    acc_t = float64 if np.dtype(dtype) == np.float64 else float32
    NEG_INF = -math.inf

    @cuda.jit
    def tiled_forward(q, k, v, o, lse, scale):
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * BLOCK_N + tx
        n_heads = q.shape[1]
        b = cuda.blockIdx.y // n_heads
        h = cuda.blockIdx.y % n_heads
        h_kv = h // (n_heads // k.shape[1])
        nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
        q_start = cuda.blockIdx.x * BLOCK_M
        row = q_start + ty
        q_tile = cuda.shared.array((BLOCK_M, HEAD_DIM), acc_t)
        k_tile = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t)
        v_tile = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t)
        s_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        p_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        acc = cuda.local.array(TD, acc_t)
        # the keys this row sees, [0, hi), and the keys the block's last row sees, [0, kv_end)
        last = min(nq, q_start + BLOCK_M) - 1  # noqa: F841  (yours to use)
        hi = nk if row < nq else 0
        kv_end = nk
        # TODO: with CAUSAL, shorten hi and kv_end
        for e in range(tid, BLOCK_M * d, BLOCK_M * BLOCK_N):
            x = acc_t(0.0)
            if q_start + e // d < nq:
                x = acc_t(q[b, h, q_start + e // d, e % d])
            q_tile[e // d, e % d] = x
        m_i = acc_t(NEG_INF)
        l_i = acc_t(0.0)
        for t in range(TD):
            acc[t] = acc_t(0.0)
        cuda.syncthreads()  # q_tile is complete before any thread reads a row of it
        for kt in range((kv_end + BLOCK_N - 1) // BLOCK_N):
            k0 = kt * BLOCK_N
            n_keys = min(BLOCK_N, nk - k0)
            for e in range(tid, n_keys * d, BLOCK_M * BLOCK_N):
                k_tile[e // d, e % d] = acc_t(k[b, h_kv, k0 + e // d, e % d])
                v_tile[e // d, e % d] = acc_t(v[b, h_kv, k0 + e // d, e % d])
            cuda.syncthreads()  # k_tile and v_tile are complete before any thread reads them
            x = acc_t(NEG_INF)
            if k0 + tx < hi:
                x = acc_t(0.0)
                for c in range(d):
                    x += q_tile[ty, c] * k_tile[tx, c]
                x *= scale
            s_tile[ty, tx] = x
            cuda.syncthreads()  # the row's scores are all written before any thread reads them
            m_new = m_i
            for j in range(BLOCK_N):
                m_new = max(m_new, s_tile[ty, j])
            m_use = m_new if m_new != NEG_INF else acc_t(0.0)
            alpha = acc_t(math.exp(m_i - m_use))
            p_tile[ty, tx] = math.exp(x - m_use)
            m_i = m_new
            cuda.syncthreads()  # the row's P is all written before any thread reads it
            row_sum = acc_t(0.0)
            for j in range(BLOCK_N):
                row_sum += p_tile[ty, j]
            l_i = alpha * l_i + row_sum
            for t in range(TD):
                c = tx + t * BLOCK_N
                if c < d:
                    a = alpha * acc[t]
                    for j in range(min(BLOCK_N, hi - k0)):
                        a += p_tile[ty, j] * v_tile[j, c]
                    acc[t] = a
            cuda.syncthreads()  # all reads of k/v/p_tile are done before the next tile's copy
        if row < nq:
            inv_l = acc_t(1.0) / l_i if l_i > acc_t(0.0) else acc_t(0.0)
            for t in range(TD):
                if tx + t * BLOCK_N < d:
                    o[b, h, row, tx + t * BLOCK_N] = acc[t] * inv_l
            if tx == 0:
                lse[b, h, row] = m_i + math.log(l_i) if l_i > acc_t(0.0) else acc_t(NEG_INF)

    return tiled_forward


def run(q, k, v, causal, wrap=lambda name, a: a):
    """Launch on NumPy arrays; ``wrap(name, array)`` may replace each array argument (the check
    passes counting proxies).  Returns ``(o, lse)`` (NaN where nothing was written)."""
    b, h, nq, d = q.shape
    o = np.full(q.shape, np.nan, q.dtype)
    lse = np.full((b, h, nq), np.nan, q.dtype)
    args = [wrap(n, a) for n, a in zip("q k v o lse".split(), (q, k, v, o, lse))]
    make_kernel(causal, q.dtype)[(-(-nq // BLOCK_M), b * h), (BLOCK_N, BLOCK_M)](
        *args, q.dtype.type(1 / math.sqrt(d)))
    return o, lse
