"""Solution of the exercise docs/exercises/merge_splits.py (docs/flash-decoding.md): the
log-sum-exp merge of ``reference.merge_states``, with the largest ``lse`` subtracted before any
``exp`` and the empty splits' unwritten ``o`` never touched."""

from __future__ import annotations

import numpy as np


def merge(o_parts, lse_parts):
    """``o_parts [S, rows, d]``, ``lse_parts [S, rows]`` -> ``(o [rows, d], lse [rows])``."""
    m = lse_parts.max(axis=0)                         # -inf for a row with no key at all
    live = np.isfinite(lse_parts)                     # splits that saw a key of the row
    safe_m = np.where(np.isfinite(m), m, 0.0)
    w = np.where(live, np.exp(np.where(live, lse_parts, 0.0) - safe_m), 0.0)
    total = w.sum(axis=0)
    o = np.where(live[:, :, None], o_parts, 0.0)      # never read an empty split's o
    o = (w[:, :, None] * o).sum(axis=0)
    o = np.where(total[:, None] > 0, o / np.where(total > 0, total, 1.0)[:, None], 0.0)
    lse = np.where(total > 0, safe_m + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return o, lse
