"""Exercise (docs/naive-forward.md): make the first kernel causal.

This is the naive forward of ``numba_flash/kernels/naive_forward.py`` with the causal mask taken
out: every row walks every key.  Give ``make_kernel`` its ``CAUSAL`` constant back: with
``CAUSAL=True`` query row ``row`` must see only the keys ``j <= row + nk - nq`` (bottom-right
alignment), and a row that sees no key must write ``o = 0`` and ``lse = -inf``.  Do it by
shortening the key loop, not by adding ``-inf`` scores.

Check: ``python -m pytest -n 0 docs/exercises/test_naive_causal.py --exercises``.
"""

from __future__ import annotations

import functools
import math

import numpy as np

import numba_flash  # noqa: F401  (first: selects the simulator when there is no GPU)
from numba import cuda, float32, float64

HEAD_DIM = 16  # the exercise's compile-time head dim (d <= 16)


@functools.lru_cache(maxsize=None)
def make_kernel(CAUSAL, dtype):
    acc_t = float64 if np.dtype(dtype) == np.float64 else float32
    NEG_INF = -math.inf

    @cuda.jit
    def naive_forward(q, k, v, o, lse, scale):
        row = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        n_heads = q.shape[1]
        b = cuda.blockIdx.y // n_heads
        h = cuda.blockIdx.y % n_heads
        h_kv = h // (n_heads // k.shape[1])
        nq, nk, d = q.shape[2], k.shape[2], q.shape[3]
        if row >= nq:
            return
        q_row = cuda.local.array(HEAD_DIM, acc_t)
        acc = cuda.local.array(HEAD_DIM, acc_t)
        for c in range(d):
            q_row[c] = acc_t(q[b, h, row, c])
            acc[c] = acc_t(0.0)
        m_i = acc_t(NEG_INF)
        l_i = acc_t(0.0)
        for j in range(nk):  # TODO: with CAUSAL, only the keys this row sees
            s = acc_t(0.0)
            for c in range(d):
                s += q_row[c] * acc_t(k[b, h_kv, j, c])
            s *= scale
            m_new = max(m_i, s)
            alpha = math.exp(m_i - m_new)
            p = math.exp(s - m_new)
            l_i = alpha * l_i + p
            for c in range(d):
                acc[c] = alpha * acc[c] + p * acc_t(v[b, h_kv, j, c])
            m_i = m_new
        if l_i > acc_t(0.0):
            for c in range(d):
                o[b, h, row, c] = acc[c] / l_i
            lse[b, h, row] = m_i + math.log(l_i)
        else:
            for c in range(d):
                o[b, h, row, c] = acc_t(0.0)
            lse[b, h, row] = acc_t(NEG_INF)

    return naive_forward


def run(q, k, v, causal, block_m=4):
    """Launch the kernel on NumPy arrays; return ``(o, lse)`` (NaN where nothing was written)."""
    b, h, nq, d = q.shape
    o = np.full(q.shape, np.nan, q.dtype)
    lse = np.full((b, h, nq), np.nan, q.dtype)
    kernel = make_kernel(causal, q.dtype)
    kernel[(-(-nq // block_m), b * h), block_m](q, k, v, o, lse, q.dtype.type(1 / math.sqrt(d)))
    return o, lse
