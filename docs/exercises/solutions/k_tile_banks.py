"""Solution of docs/exercises/k_tile_banks.py (docs/tiled-forward.md).

1. Unpadded, lane ``tx`` reads word ``tx * 64 + c``; ``64 % 32 == 0``, so all 32 words sit in
   bank ``c % 32``: a 32-way conflict (the warp's one read becomes 32 in a row).  At ``BLOCK_N =
   16`` the two rows of the warp read the same 16 words: 16-way.
2. With an odd row length ``stride``, lane ``tx`` is in bank ``(tx * stride + c) % 32``, and
   ``tx * stride`` takes 32 different values modulo 32 for ``tx = 0..31`` (an odd number is
   invertible modulo 32): no conflict.  ``head_dim + 1`` is the smallest odd length, the
   ``[32][33]`` padding of docs/cuda-basics.md.  (The production kernel pads ``k_tile`` by one
   16-byte chunk, ``HEAD_DIM + 4`` words, for its 16-byte reads: docs/optimised-forward.md.)
"""

WAYS_UNPADDED = 32


def k_stride(head_dim):
    """The row length (in 4-byte words) of ``k_tile`` for a compile-time ``head_dim``."""
    return head_dim + 1
