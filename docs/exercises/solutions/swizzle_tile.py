"""Solution of docs/exercises/swizzle_tile.py (docs/memory-access.md).

1. Row-major, lane ``c`` of the column read takes word ``32 c + r``: bank ``r`` for every lane,
   32 different words in one bank, so 32 wavefronts (32-way).
2. ``32 r + (c ^ r)``: XOR with ``r`` permutes the 32 columns of row ``r`` (an XOR by a fixed
   number is its own inverse), so each row keeps its 32 words.  A row write (fixed ``r``, lanes
   ``c``) meets banks ``c ^ r``: all 32.  A column read (lanes ``c`` read ``(c, r)``) meets
   banks ``r ^ c``: all 32 again.  The tensor-core tiles use the same idea on 16-byte chunks
   (the 128-byte swizzle, ``chunk ^ (row % 8)``).
"""

WAYS_ROW_MAJOR = 32


def tile_offset(r, c):
    """The word of the 32 x 32 tile that holds element ``(r, c)``."""
    return r * 32 + (c ^ r)
