"""Check of docs/exercises/paged_lookup.py: decode through a shuffled table whose stale slots and
free blocks hold NaN (and one free block holds a finished request's finite keys), against
reference.paged_decode; then tables with a bad live entry (-1, num_blocks): that sequence's o and
lse NaN, the others unchanged, and no element of the cache read that its table does not name."""

from __future__ import annotations

import numpy as np

from numba_flash import reference as ref

BLOCK_SIZE, N_BLOCKS = 3, 12
SEQLENS = np.array([7, 2, 9])
TABLE = np.array([[5, 0, 9, -1], [11, -1, -1, -1], [2, 7, 4, -1]])


def test_paged_lookup(exercise):
    check(exercise("paged_lookup"))


def caches(rng):
    k, v = (rng.standard_normal((N_BLOCKS, 1, BLOCK_SIZE, 4)) for _ in range(2))
    live = np.zeros((N_BLOCKS, BLOCK_SIZE), bool)
    for b, n in enumerate(SEQLENS):
        for t in range(n):
            live[TABLE[b, t // BLOCK_SIZE], t % BLOCK_SIZE] = True
    live[1] = live[10] = True  # a finished request's keys: finite, never to be read
    for x in (k, v):
        x[:, 0][~live] = np.nan
    return k, v


def check(mod):
    from io_count import counting_wrap

    rng = np.random.default_rng(12)
    q = rng.standard_normal((3, 2, 4))
    k, v = caches(rng)
    o, lse = mod.run(q, k, v, TABLE, SEQLENS)
    o_ref, lse_ref = ref.paged_decode(q, k, v, SEQLENS, TABLE)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, err_msg="o")
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12, err_msg="lse")
    for bad in (-1, -2, N_BLOCKS, 10 ** 9):
        table = TABLE.copy()
        table[2, 1] = bad                            # a live entry of sequence 2
        wrap, stats = counting_wrap()
        o, lse = mod.run(q, k, v, table, SEQLENS, wrap)
        assert np.isnan(o[2]).all() and np.isnan(lse[2]).all(), (
            f"entry {bad} in sequence 2's live range: its o and lse must be NaN")
        np.testing.assert_allclose(o[:2], o_ref[:2], atol=1e-12, err_msg="the other sequences")
        named = np.zeros(N_BLOCKS, bool)
        named[[p for p in table.ravel() if 0 <= p < N_BLOCKS]] = True
        read = stats["k_cache"]["touched_read"].any(axis=(1, 2, 3))
        assert not (read & ~named).any(), (
            f"entry {bad}: blocks {np.flatnonzero(read & ~named)} were read, no table names them")
