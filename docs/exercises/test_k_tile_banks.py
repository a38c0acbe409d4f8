"""Check of docs/exercises/k_tile_banks.py: the predicted conflict of the unpadded read, and one
warp's read of ``k_tile[tx, c]`` bank by bank with the chosen row length."""

from __future__ import annotations

import pytest


def ways(words, banks=32):
    """The most different 4-byte words one bank serves for one warp-wide access."""
    per_bank = {}
    for w in words:
        per_bank.setdefault(w % banks, set()).add(w)
    return max(len(s) for s in per_bank.values())


def warp_read(stride, block_n, c):
    """The words warp 0 reads in step ``c`` of the dot product: lane ``t`` is ``tx = t %
    block_n``."""
    return [(t % block_n) * stride + c for t in range(32)]


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_k_tile_banks(exercise, head_dim):
    check(exercise("k_tile_banks"), [head_dim])


def check(mod, head_dims=(16, 32, 64, 128, 256)):
    unpadded = ways(warp_read(64, 32, 0))
    assert mod.WAYS_UNPADDED == unpadded, (
        f"WAYS_UNPADDED: you predicted {mod.WAYS_UNPADDED}; the read is {unpadded}-way")
    for head_dim in head_dims:
        stride = mod.k_stride(head_dim)
        assert stride >= head_dim, f"k_stride({head_dim}) = {stride}: a row must hold the row"
        for block_n in (16, 32):
            for c in range(head_dim):
                n = ways(warp_read(stride, block_n, c))
                assert n == 1, (f"k_stride({head_dim}) = {stride}: at BLOCK_N = {block_n} the "
                                f"read of column {c} is {n}-way")
