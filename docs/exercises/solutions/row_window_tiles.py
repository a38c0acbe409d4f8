"""Exercise (docs/row-forward.md): a sliding window in the first tiled kernel, with only the K/V
tiles the block needs.

This is the first tiled kernel of ``numba_flash/teach/kernels/row_forward.py``, causal, with a
sliding window: with ``WINDOW = W > 0`` row ``row`` sees the ``W`` keys ``c - W < j <= c`` ending at
its diagonal ``c = row + nk - nq`` (the row bounds ``lo``, ``hi`` are given).  The block loads the
tiles from tile 0 up to the last one its last row sees.  With a window the early tiles are
needed by no row of a late block: start the tile loop at the first tile some row of the block
sees (the same tile range in every thread: the loop holds the barriers).

Check: ``python -m pytest -n 0 docs/exercises/test_row_window_tiles.py --exercises`` (it counts
the bytes read from k and v, element by element, in the simulator).
"""

from __future__ import annotations

import functools
import math

import numpy as np

import numba_flash  # noqa: F401  (first: selects the simulator when there is no GPU)
from numba import cuda, float32, float64

HEAD_DIM = 16
BLOCK_M = 4   # rows (threads) per block
BLOCK_N = 3   # keys per K/V tile


@functools.lru_cache(maxsize=None)
def make_kernel(WINDOW, dtype):
    acc_t = float64 if np.dtype(dtype) == np.float64 else float32
    NEG_INF = -math.inf

    @cuda.jit(device=True)
    def bounds(row, nq, nk):
        """``(lo, hi)``: the keys ``[lo, hi)`` row ``row`` sees (none for a spare row)."""
        if row >= nq:
            return 0, 0
        diag = row + nk - nq
        lo = max(0, diag - WINDOW + 1) if WINDOW > 0 else 0
        return lo, min(nk, max(0, diag + 1))

    @cuda.jit
    def row_forward(q, k, v, o, lse, scale):
        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x * BLOCK_M + tid
        n_heads = q.shape[1]
        b = cuda.blockIdx.y // n_heads
        h = cuda.blockIdx.y % n_heads
        h_kv = h // (n_heads // k.shape[1])
        nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
        K_j = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t)
        V_j = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t)
        q_i = cuda.local.array(HEAD_DIM, acc_t)
        acc = cuda.local.array(HEAD_DIM, acc_t)
        s = cuda.local.array(BLOCK_N, acc_t)
        lo, hi = bounds(row, nq, nk)
        if row < nq:
            for c in range(d):
                q_i[c] = acc_t(q[b, h, row, c])
        for c in range(d):
            acc[c] = acc_t(0.0)
        m_i = acc_t(NEG_INF)
        l_i = acc_t(0.0)
        # the tiles some row of the block sees: from the first row's lo to the last row's hi
        first = cuda.blockIdx.x * BLOCK_M
        last = min(nq, first + BLOCK_M) - 1
        kv_lo = bounds(first, nq, nk)[0]
        kv_hi = bounds(last, nq, nk)[1]
        t_first = kv_lo // BLOCK_N
        t_end = (kv_hi + BLOCK_N - 1) // BLOCK_N
        for t in range(t_first, t_end):
            k0 = t * BLOCK_N
            n_rows = min(BLOCK_N, nk - k0)
            for e in range(tid, n_rows * d, BLOCK_M):
                K_j[e // d, e % d] = acc_t(k[b, h_kv, k0 + e // d, e % d])
                V_j[e // d, e % d] = acc_t(v[b, h_kv, k0 + e // d, e % d])
            cuda.syncthreads()  # every thread reads rows of K_j, V_j that other threads wrote
            j_lo = max(lo, k0) - k0
            j_hi = min(hi, k0 + BLOCK_N) - k0
            if j_lo < j_hi:
                m_tile = acc_t(NEG_INF)
                for j in range(j_lo, j_hi):
                    x = acc_t(0.0)
                    for c in range(d):
                        x += q_i[c] * K_j[j, c]
                    s[j] = x * scale
                    m_tile = max(m_tile, s[j])
                m_new = max(m_i, m_tile)
                alpha = math.exp(m_i - m_new)
                l_i *= alpha
                for c in range(d):
                    acc[c] *= alpha
                for j in range(j_lo, j_hi):
                    p = math.exp(s[j] - m_new)
                    l_i += p
                    for c in range(d):
                        acc[c] += p * V_j[j, c]
                m_i = m_new
            cuda.syncthreads()  # the next tile's load overwrites K_j, V_j: wait until all read
        if row < nq:
            for c in range(d):
                o[b, h, row, c] = acc[c] / l_i if l_i > acc_t(0.0) else acc_t(0.0)
            lse[b, h, row] = m_i + math.log(l_i) if l_i > acc_t(0.0) else acc_t(NEG_INF)

    return row_forward


def run(q, k, v, window, wrap=lambda name, a: a):
    """Launch on NumPy arrays; ``wrap(name, array)`` may replace each array argument (the check
    passes counting proxies).  Returns ``(o, lse)``."""
    b, h, nq, d = q.shape
    o = np.full(q.shape, np.nan, q.dtype)
    lse = np.full((b, h, nq), np.nan, q.dtype)
    args = [wrap(n, a) for n, a in zip("q k v o lse".split(), (q, k, v, o, lse))]
    make_kernel(window, q.dtype)[(-(-nq // BLOCK_M), b * h), BLOCK_M](
        *args, q.dtype.type(1 / math.sqrt(d)))
    return o, lse
