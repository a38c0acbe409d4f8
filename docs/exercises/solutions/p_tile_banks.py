"""Solution of the exercise docs/exercises/p_tile_banks.py (docs/tiled-forward.md).

Lane ``(tx, ty)`` stores word ``ty * stride + tx + const``: bank ``(ty * stride + tx) % 32``.
With ``stride = block_n + 1`` and ``block_n`` a multiple of 32 the four rows start in banks 0, 1,
2, 3 and their eight lanes overlap: bank 3 is hit by ``(tx, ty) = (3, 0), (2, 1), (1, 2), (0,
3)``, a 4-way conflict.  A row length that is 8 (or 24) modulo 32 starts the four rows 8 banks
apart (0, 8, 16, 24): 32 banks, one word each.  Such a length is a multiple of 8 words, so every
row starts 16-byte aligned, as the 16-byte reads of ``P V`` need.  The kernel's ``P_PAD = 8``
(``BLOCK_N`` = 16, 32, 64 give 24, 40, 72 words) is this answer.
"""

THREADS_N = 8
THREADS_M = 16


def p_stride(block_n):
    """The smallest row length >= block_n that is 8 or 24 modulo 32."""
    stride = block_n
    while stride % 32 not in (8, 24):
        stride += 1
    return stride
