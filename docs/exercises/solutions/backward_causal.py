"""Solution of the exercise docs/exercises/backward_causal.py (docs/backward.md).

``tiled_backward`` is the corrected loop of ``docs/examples/backward_demo.py`` (P from the saved
``lse``, ``D = rowsum(dO * O)`` once per Q tile), for one head with ``Nq == Nk == N``.  Add
``causal=True``: query row ``i`` sees keys ``j <= i``.  Skip the (Q tile, K/V tile) pairs that lie
wholly above the diagonal (count the pairs you do compute in ``steps``) and mask the keys a row
does not see in the tiles that cross it (their ``P`` must be 0).  ``o`` and ``lse`` come from the
causal forward.

Check: ``python -m pytest -n 0 docs/exercises/test_backward_causal.py --exercises``.
"""

from __future__ import annotations

import math

import numpy as np


def tiled_backward(Q, K, V, O, dO, lse, Br, Bc, causal=False):
    """``(dQ, dK, dV, steps)`` for one head; ``steps`` = tile pairs computed."""
    N, d = Q.shape
    scale = 1 / math.sqrt(d)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    steps = 0
    for q_start in range(0, N, Br):
        i = slice(q_start, q_start + Br)
        D_i = (dO[i] * O[i]).sum(axis=1, keepdims=True)
        q_last = min(N, q_start + Br) - 1
        for k_start in range(0, N, Bc):
            if causal and k_start > q_last:
                break  # this tile and every later one lie above the diagonal
            j = slice(k_start, k_start + Bc)
            steps += 1
            Sij = Q[i] @ K[j].T * scale
            Pij = np.exp(Sij - lse[i, None])
            if causal and k_start + Bc - 1 > q_start:  # the tile crosses the diagonal
                rows = np.arange(q_start, q_last + 1)[:, None]
                cols = np.arange(k_start, min(N, k_start + Bc))[None, :]
                Pij = np.where(cols <= rows, Pij, 0.0)
            dV[j] += Pij.T @ dO[i]
            dPij = dO[i] @ V[j].T
            dSij = Pij * (dPij - D_i)
            dQ[i] += dSij @ K[j] * scale
            dK[j] += dSij.T @ Q[i] * scale
    return dQ, dK, dV, steps
