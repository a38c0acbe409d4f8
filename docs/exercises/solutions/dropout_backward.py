"""Exercise (docs/dropout.md): the tiled backward with dropout, the mask redrawn per tile.

``tiled_backward`` is the tiled NumPy backward of docs/backward.md for query head ``h`` of batch
``b`` (``Nq == Nk == N``, not causal).  The forward dropped probabilities with the seed ``seed``
and rate ``dropout_p`` (docs/dropout.md, "The exact contract"); ``O`` is the forward's output,
dropout included.  Add dropout to the backward without storing the mask:

1. ``keep_tile``: the keep bits of rows ``rows`` and keys ``cols`` (global indices), drawn from
   Philox (``numba_flash.philox.philox4x32_10``) exactly as the forward drew them;
2. in the loop: the chain rule through ``Z = keep / (1 - dropout_p)``.

Check: ``python -m pytest -n 0 docs/exercises/test_dropout_backward.py --exercises``.
"""

from __future__ import annotations

import math

import numpy as np

from numba_flash.philox import philox4x32_10


def keep_tile(seed, b, h, rows, cols, dropout_p):
    """Bool ``[len(rows), len(cols)]``: True where element ``(b, h, i, j)`` is kept."""
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], np.uint64)
    i, j = np.meshgrid(rows, cols, indexing="ij")
    counter = np.stack([j // 4, i, np.full_like(i, h), np.full_like(i, b)], axis=-1)
    draws = np.take_along_axis(philox4x32_10(counter.astype(np.uint64), key),
                               (j % 4)[..., None], axis=-1)[..., 0]
    return draws >= min(round(dropout_p * 2**32), 2**32 - 1)


def tiled_backward(Q, K, V, O, dO, lse, Br, Bc, seed, dropout_p, b=0, h=0):
    """``(dQ, dK, dV)`` for one head."""
    N, d = Q.shape
    scale = 1 / math.sqrt(d)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for q_start in range(0, N, Br):
        i = slice(q_start, q_start + Br)
        D_i = (dO[i] * O[i]).sum(axis=1, keepdims=True)  # O is the dropped output
        rows = np.arange(q_start, min(N, q_start + Br))
        for k_start in range(0, N, Bc):
            j = slice(k_start, k_start + Bc)
            cols = np.arange(k_start, min(N, k_start + Bc))
            Z = keep_tile(seed, b, h, rows, cols, dropout_p) / (1 - dropout_p)
            Pij = np.exp(Q[i] @ K[j].T * scale - lse[i, None])
            dV[j] += (Pij * Z).T @ dO[i]
            dPij = (dO[i] @ V[j].T) * Z
            dSij = Pij * (dPij - D_i)
            dQ[i] += dSij @ K[j] * scale
            dK[j] += dSij.T @ Q[i] * scale
    return dQ, dK, dV
