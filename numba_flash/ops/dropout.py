"""``numba_flash.dropout_mask``: the exact keep-mask the attention kernels draw from a seed.

The mask is computed on the host with the NumPy twin of the kernels' Philox4x32-10 (see
:mod:`numba_flash.philox` for the counter layout), so tests and users can rebuild, element for
element, what a forward or backward call with ``(dropout_p, seed)`` applied, and feed it to
:func:`numba_flash.reference.attention` as ``dropout_mask``.
"""

from __future__ import annotations

import numpy as np

from ..frontend.arrays import check_memory
from ..frontend.validate import check_int
from ..philox import dropout_params, keep_mask

#: host bytes of work per element of one (b, h) slab in philox.keep_mask (counters, meshgrid,
#: the Philox rounds' uint64 temporaries): an upper estimate
WORK_BYTES_PER_ELEMENT = 48

__all__ = ["dropout_mask", "dropout_params"]


def _check_dim(name, x):
    return check_int(name, x, 1, 2**32, what="a positive int <= 2**32")


def dropout_mask(seed, B, H, Nq, Nk, dropout_p):
    """The bool keep-mask ``[B, H, Nq, Nk]`` for ``(seed, dropout_p)``: True = kept.

    Element ``(b, h, i, j)`` (``h`` the query head) is kept iff word ``j % 4`` of
    ``philox4x32_10(counter=(j // 4, i, h, b), key=(seed & 0xFFFFFFFF, seed >> 32))`` is
    ``>= min(round(dropout_p * 2**32), 2**32 - 1)``: exactly the mask the kernels apply, so
    ``P(keep) = 1 - dropout_p`` (to within ``2**-33``) and ``dropout_p = 0`` keeps everything.

    ``seed`` is an integer in ``[0, 2**64)`` (Python or NumPy, not bool), ``dropout_p`` a real in
    ``[0, 1)``, ``B, H, Nq, Nk`` positive ints.  Raises ``TypeError``/``ValueError`` naming the
    argument.  Memory: the mask itself plus about ``48 * Nq * Nk`` bytes of work per (b, h);
    a request that cannot fit in the host's available memory raises ``MemoryError`` naming the
    mask's shape and the GiB, before anything is allocated.
    """
    seed_lo, seed_hi, threshold, _scale = dropout_params(dropout_p, seed)
    dims = [_check_dim(n, x) for n, x in (("B", B), ("H", H), ("Nq", Nq), ("Nk", Nk))]
    _b, _h, nq, nk = dims
    check_memory("dropout_mask", {"the keep-mask": (dims, np.bool_)}, device=False,
                 work_bytes=WORK_BYTES_PER_ELEMENT * nq * (-(-nk // 4) * 4))
    return keep_mask(seed_lo, seed_hi, threshold, *dims)
