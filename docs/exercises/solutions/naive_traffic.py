"""Exercise (docs/naive-forward.md): predict the first kernel's global-memory traffic.

Before you read docs/io-complexity.md, say how many bytes ``numba_flash.naive_forward`` reads
from and writes to global memory, as a formula.  One thread owns one query row: it reads its q
row once, then the K and V rows of every key it sees, straight from global memory, and writes its
o row and its lse.  ``naive_bytes`` gets the shapes (``h`` query heads, ``hkv`` kv heads), the
input's bytes per element and the lse's (float32 for float16/float32 inputs), and ``causal``
(bottom-right: row ``i`` sees keys ``j <= i + nk - nq``).

Check: ``python -m pytest -n 0 docs/exercises/test_naive_traffic.py --exercises`` (it runs the
kernel in the simulator and counts every element it reads and writes).
"""

from __future__ import annotations


def naive_bytes(b, h, hkv, nq, nk, d, itemsize, lse_itemsize, causal):
    """``{"read": bytes, "written": bytes}`` of one ``naive_forward`` launch."""
    if causal:
        keys = sum(min(nk, max(0, i + nk - nq + 1)) for i in range(nq))
    else:
        keys = nq * nk
    # every query head's rows read their keys: kv heads shared by a GQA group are read again
    read = b * h * (nq * d + 2 * keys * d) * itemsize
    written = b * h * nq * (d * itemsize + lse_itemsize)
    return {"read": read, "written": written}
