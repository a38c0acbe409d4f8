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

from numba_flash.philox import philox4x32_10  # noqa: F401  (yours to use)


def keep_tile(seed, b, h, rows, cols, dropout_p):
    """Bool ``[len(rows), len(cols)]``: True where element ``(b, h, i, j)`` is kept."""
    return np.ones((len(rows), len(cols)), bool)  # TODO

def tiled_backward(Q, K, V, O, dO, lse, Br, Bc, seed, dropout_p, b=0, h=0):
    """``(dQ, dK, dV)`` for one head."""
    N, d = Q.shape
    scale = 1 / math.sqrt(d)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for q_start in range(0, N, Br):
        i = slice(q_start, q_start + Br)
        D_i = (dO[i] * O[i]).sum(axis=1, keepdims=True)  # O is the dropped output
        rows = np.arange(q_start, min(N, q_start + Br))  # noqa: F841  (yours to use)
        for k_start in range(0, N, Bc):
            j = slice(k_start, k_start + Bc)
            cols = np.arange(k_start, min(N, k_start + Bc))  # noqa: F841
            Pij = np.exp(Q[i] @ K[j].T * scale - lse[i, None])
            dV[j] += Pij.T @ dO[i]  # TODO: dropout
            dPij = dO[i] @ V[j].T  # TODO: dropout
            dSij = Pij * (dPij - D_i)
            dQ[i] += dSij @ K[j] * scale
            dK[j] += dSij.T @ Q[i] * scale
    return dQ, dK, dV
