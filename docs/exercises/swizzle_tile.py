"""Exercise (docs/memory-access.md): a transpose tile with no room for padding, made
conflict-free.

``transpose_kernel(tile_offset)`` in ``numba_flash/tools/memory_profile.py`` transposes a 32 x 32
float32 matrix through a shared tile of exactly 32 x 32 words (4 KiB: no spare column).  Warp
``ty`` (lanes ``c = 0..31``) writes row ``r`` of the tile (element ``(r, c)``) and, after the
barrier, reads column ``r`` (element ``(c, r)``).  ``tile_offset(r, c)`` is the word where element
``(r, c)`` lives; word ``w`` is in bank ``w % 32``.

1. ``WAYS_ROW_MAJOR``: predict the wavefronts (the conflict's ways) of one warp's column read
   with the row-major layout ``32 r + c``.
2. ``tile_offset``: a layout that keeps each row in its own 32 words (``tile_offset(r, c) // 32
   == r``, every word used once) and makes both the row write and the column read
   conflict-free.

Check: ``python -m pytest -n 0 docs/exercises/test_swizzle_tile.py --exercises``.  It runs the
kernel in the simulator's recording mode and counts every request's banks.
"""

WAYS_ROW_MAJOR = None  # your prediction: an integer


def tile_offset(r, c):
    """The word of the 32 x 32 tile that holds element ``(r, c)``."""
    return r * 32 + c  # TODO: a layout with no bank conflict for rows and columns
