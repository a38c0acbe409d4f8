"""Exercise (docs/online-softmax.md): the online softmax a block at a time.

The kernels do not see one score at a time: they see a tile of ``BLOCK_N`` scores.  Write
``stats_blocks(x, block)``: one pass over ``x`` in blocks of ``block`` elements (the last one may
be shorter) that returns ``(m, l)`` with ``m = max(x)`` and ``l = sum(exp(x - m))``.  Treat each
block as a whole (its max, its exponentials, its sum: NumPy on the block, no loop over its
elements), then combine it with the running ``(m, l)``.  ``x`` may hold ``-inf`` (masked
scores), whole blocks of them, and values in the thousands; all ``-inf`` gives ``(-inf, 0)``.

Check: ``python -m pytest -n 0 docs/exercises/test_online_softmax.py --exercises``.
"""

from __future__ import annotations

import numpy as np


def stats_blocks(x, block):
    """``(m, l)`` of ``x`` (1-D float64), one block of ``block`` elements at a time."""
    m, l = -np.inf, 0.0
    for start in range(0, len(x), block):
        xb = x[start:start + block]  # noqa: F841  (yours to use)
        # TODO: combine this block with (m, l)
    return m, l
