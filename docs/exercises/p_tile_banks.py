"""Exercise (docs/tiled-forward.md): remove the bank conflict of the ``p_tile`` store.

The tiled forward (``numba_flash/kernels/forward.py``) runs blocks of ``THREADS_N x THREADS_M =
8 x 16`` threads (``threadIdx.x = tx`` fastest) and each thread stores its scores with
``p_tile[ty + i * THREADS_M, tx + j * THREADS_N] = s[i, j]``; ``p_tile`` is a float32
``[BLOCK_M, P_STRIDE]`` array whose padded row length is ``BLOCK_N + 1`` today.  One warp is 32
consecutive threads: ``tx = 0..7`` for four consecutive ``ty``.  Work out which bank (word
``w`` is in bank ``w % 32``) each lane's store hits and choose a row length ``p_stride(block_n)
>= block_n`` for which one warp's store touches 32 different banks, without making ``P V``'s reads
``p_tile[ty + i * THREADS_M, n]`` (one word per row, four rows per warp) conflict.

Check: ``python -m pytest -n 0 docs/exercises/test_p_tile_banks.py --exercises``.  (Then the
same change in the kernel is ``K_STRIDE`` split into a stride for ``k_tile`` and one for
``p_tile``.)
"""

THREADS_N = 8
THREADS_M = 16


def p_stride(block_n):
    """The padded row length (in 4-byte words) of ``p_tile`` for tiles of ``block_n`` keys."""
    return block_n + 1  # TODO: a length for which a warp's store is conflict-free
