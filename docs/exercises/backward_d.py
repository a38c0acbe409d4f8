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
        for k_start in range(0, N, Bc):
            j = slice(k_start, k_start + Bc)
            Sij = Q[i] @ K[j].T * scale  # noqa: F841  (yours to use)
            # TODO: this tile's share of D for the rows of i
    return D
