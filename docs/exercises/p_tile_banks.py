"""Exercise (docs/tiled-forward.md): derive the ``p_tile`` row pad of the tiled forward.

The tiled forward (``numba_flash/kernels/forward/simt.py``) at float32 ``HEAD_DIM = 64`` runs blocks
of ``THREADS_N x THREADS_M = 8 x 16`` threads (``threadIdx.x = tx`` fastest) and each thread stores
its scores one word at a time with ``p_tile[ty + i * THREADS_M, tx + j * THREADS_N] = s[i, j]``;
``p_tile`` is a float32 ``[BLOCK_M, P_STRIDE]`` array.  One warp is 32 consecutive threads:
``tx = 0..7`` for four consecutive ``ty``.  Before the 16-byte rebuild (issue 22) the row length
was ``BLOCK_N + 1``, the pad that suits a transposed tile; it is what this file hands you.

Work out which bank (word ``w`` is in bank ``w % 32``) each lane's store hits and choose a row
length ``p_stride(block_n) >= block_n`` for which one warp's store touches 32 different banks.
Then check that your rows start on 16-byte boundaries: ``P V`` reads ``p_tile`` 16 bytes at a
time (4 keys of one row, ``ld.shared.v4``, aligned addresses only; the 8 lanes served together
read the same 16 bytes, a broadcast).

Check: ``python -m pytest -n 0 docs/exercises/test_p_tile_banks.py --exercises``.  (Then compare
with the kernel's ``P_PAD``.)
"""

THREADS_N = 8
THREADS_M = 16


def p_stride(block_n):
    """The padded row length (in 4-byte words) of ``p_tile`` for tiles of ``block_n`` keys."""
    return block_n + 1  # TODO: a length for which a warp's store is conflict-free
