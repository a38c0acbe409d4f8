"""Exercise (docs/flash-decoding.md): merge the split-KV partial states.

Each split ``s`` of one query row's keys leaves ``(o_s, lse_s)``: its output normalised over its
own keys and the log-sum-exp of its scores.  A split that holds no key of the row (past the
sequence's end, or wholly masked) writes only ``lse_s = -inf`` and never writes its ``o_s``: in
the check those rows are NaN, as unwritten memory may be.  ``merge`` below is the formula as
first written down; make it right for scores of any size (``lse`` in the thousands) and for
empty splits, and return ``lse = -inf``, ``o = 0`` for a row whose every split is empty.

Check: ``python -m pytest -n 0 docs/exercises/test_merge_splits.py --exercises``.
"""

from __future__ import annotations

import numpy as np


def merge(o_parts, lse_parts):
    """``o_parts [S, rows, d]``, ``lse_parts [S, rows]`` -> ``(o [rows, d], lse [rows])``."""
    w = np.exp(lse_parts)                  # TODO: overflows; 0 * NaN for an empty split
    lse = np.log(w.sum(axis=0))
    o = (w[:, :, None] * o_parts).sum(axis=0) / w.sum(axis=0)[:, None]
    return o, lse
