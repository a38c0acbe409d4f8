"""Exercise (docs/backward.md): the tiled NumPy backward, causal.

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
        for k_start in range(0, N, Bc):  # TODO: causal: skip tiles above the diagonal
            j = slice(k_start, k_start + Bc)
            steps += 1
            Sij = Q[i] @ K[j].T * scale
            Pij = np.exp(Sij - lse[i, None])  # TODO: causal: P = 0 where key > query
            dV[j] += Pij.T @ dO[i]
            dPij = dO[i] @ V[j].T
            dSij = Pij * (dPij - D_i)
            dQ[i] += dSij @ K[j] * scale
            dK[j] += dSij.T @ Q[i] * scale
    return dQ, dK, dV, steps
