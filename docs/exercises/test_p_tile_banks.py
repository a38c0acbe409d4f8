"""Check of docs/exercises/p_tile_banks.py: one warp's p_tile store, bank by bank, for the tiled
forward's tile widths.  (A conflict-free length is 8 or 24 modulo 32, so its rows are 16-byte
aligned as P V's ld.shared.v4 reads need: no separate check.)"""

from __future__ import annotations

import pytest


def ways(words, banks=32):
    """The most different 4-byte words one bank serves for one warp-wide access."""
    per_bank = {}
    for w in words:
        per_bank.setdefault(w % banks, set()).add(w)
    return max(len(s) for s in per_bank.values())


@pytest.mark.parametrize("block_n", [16, 32, 64])
def test_p_tile_banks(exercise, block_n):
    check(exercise("p_tile_banks"), block_n)


def check(mod, block_n=64):
    stride = mod.p_stride(block_n)
    assert stride >= block_n, f"p_stride({block_n}) = {stride}: a row must hold {block_n} keys"
    assert stride - block_n <= 32, "more padding than a bank cycle is never needed"
    tn, tm = mod.THREADS_N, mod.THREADS_M
    for warp in range(tn * tm // 32):
        lanes = [(t % tn, t // tn) for t in range(32 * warp, 32 * warp + 32)]  # (tx, ty)
        for i, j in ((0, 0), (1, 1)):
            store = [(ty + i * tm) * stride + tx + j * tn for tx, ty in lanes]
            assert ways(store) == 1, (f"p_stride({block_n}) = {stride}: the store of warp "
                                      f"{warp} is {ways(store)}-way")
