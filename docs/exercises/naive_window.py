"""Exercise (docs/naive-forward.md): a sliding window in the first kernel.

This is the naive forward of ``numba_flash/teach/kernels/naive_forward.py``, causal, written without
``key_bounds``.  Give ``make_kernel`` a ``WINDOW`` constant: with ``WINDOW = W > 0`` query row
``row`` sees only the ``W`` keys that end at its diagonal ``c = row + nk - nq``, that is the keys
``c - W < j <= c`` that exist (flash-attn's ``window_size=(W - 1, 0)``).  ``WINDOW = 0`` keeps
plain causal attention.  A row that sees no key writes ``o = 0`` and ``lse = -inf``.  Change
where the key loop starts and stops: a key the row does not see must not be read at all.

Check: ``python -m pytest -n 0 docs/exercises/test_naive_window.py --exercises`` (it counts the
bytes read from k and v, element by element, in the simulator).
"""

from __future__ import annotations

import functools
import math

import numpy as np

import numba_flash  # noqa: F401  (first: selects the simulator when there is no GPU)
from numba import cuda, float32, float64

HEAD_DIM = 16  # the exercise's compile-time head dim (d <= 16)


@functools.lru_cache(maxsize=None)
def make_kernel(WINDOW, dtype):
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
        diag = row + nk - nq                    # the last key this row sees (causal)
        for j in range(min(nk, diag + 1)):      # TODO: with WINDOW > 0, only the last WINDOW
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


def run(q, k, v, window, wrap=lambda name, a: a, block_m=4):
    """Launch on NumPy arrays; ``wrap(name, array)`` may replace each array argument (the check
    passes counting proxies).  Returns ``(o, lse)`` (NaN where nothing was written)."""
    b, h, nq, d = q.shape
    o = np.full(q.shape, np.nan, q.dtype)
    lse = np.full((b, h, nq), np.nan, q.dtype)
    args = [wrap(n, a) for n, a in zip("q k v o lse".split(), (q, k, v, o, lse))]
    make_kernel(window, q.dtype)[(-(-nq // block_m), b * h), block_m](
        *args, q.dtype.type(1 / math.sqrt(d)))
    return o, lse
