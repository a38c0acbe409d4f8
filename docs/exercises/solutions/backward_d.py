"""Exercise (docs/backward.md): the backward's D when you do not have O.

The backward needs, for every query row, ``D_i = sum_j P_ij dP_ij`` over the *whole* row, with
``dP = dO V^T`` (docs/backward.md).  The kernels get it as ``rowsum(dO * O)``, from the forward's
output.  Here you do not have ``O``: compute ``D`` tile by tile, from ``Q``, ``K``, ``V``, ``dO``
and the saved ``lse``, never holding more than one ``[Br, Bc]`` tile of scores.  With ``causal``,
row ``i`` sees keys ``j <= i`` (``Nq == Nk == N``).

Check: ``python -m pytest -n 0 docs/exercises/test_backward_d.py --exercises``.
"""

from __future__ import annotations

import math

import numpy as np


def delta(Q, K, V, dO, lse, Br, Bc, causal=False):
    """``D [N]`` for one head."""
    N, d = Q.shape
    scale = 1 / math.sqrt(d)
    D = np.zeros(N)
    for q_start in range(0, N, Br):
        i = slice(q_start, q_start + Br)
        rows = np.arange(q_start, min(N, q_start + Br))[:, None]
        for k_start in range(0, N, Bc):
            j = slice(k_start, k_start + Bc)
            Sij = Q[i] @ K[j].T * scale
            # P from the saved lse: already normalised over the whole row
            Pij = np.exp(Sij - lse[i, None])
            if causal:
                cols = np.arange(k_start, min(N, k_start + Bc))[None, :]
                Pij = np.where(cols <= rows, Pij, 0.0)
            dPij = dO[i] @ V[j].T
            D[i] += (Pij * dPij).sum(axis=1)  # this tile's share of the row's sum
    return D
