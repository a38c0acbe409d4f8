"""Exercise (docs/tiled-forward.md): the teaching kernel's bank conflict, counted and fixed.

In ``numba_flash/teach/kernels/tiled_forward.py`` thread ``(tx, ty)`` computes the score of row
``ty`` and key ``tx``: in step ``c`` of its dot product it reads ``k_tile[tx, c]``.  ``k_tile`` is
a float32 ``[BLOCK_N, HEAD_DIM]`` array, row-major, so that element is word ``tx * HEAD_DIM + c``
and sits in bank ``(tx * HEAD_DIM + c) % 32``.  One warp is 32 consecutive threads (``tx``
fastest): at ``BLOCK_N = 32`` one row ``ty`` and keys ``tx = 0..31``; at ``BLOCK_N = 16`` two rows
and keys ``0..15`` twice (two threads reading the same word are served by one read).

1. ``WAYS_UNPADDED``: predict how many different words one bank must serve for one warp's read
   of ``k_tile[tx, c]`` at ``HEAD_DIM = 64``, ``BLOCK_N = 32`` (1 means no conflict).
2. ``k_stride``: choose a row length (in words) ``>= head_dim`` for ``k_tile``, so that the read
   becomes ``k_tile[tx * stride + c]`` and no bank serves two different words, for every
   ``HEAD_DIM`` in 16..256 and ``BLOCK_N`` in 16 and 32.

Check: ``python -m pytest -n 0 docs/exercises/test_k_tile_banks.py --exercises``.
"""

WAYS_UNPADDED = None  # your prediction: an integer


def k_stride(head_dim):
    """The row length (in 4-byte words) of ``k_tile`` for a compile-time ``head_dim``."""
    return head_dim  # TODO: a row length that makes the read conflict-free
