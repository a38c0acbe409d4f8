"""The sharding helpers: round trips, which tokens each rank holds, and the causal work balance."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash.distributed import (contiguous_shard, contiguous_unshard, rank_chunks,
                                     shard_positions, zigzag_shard, zigzag_unshard)

HELPERS = {"zigzag": (zigzag_shard, zigzag_unshard),
           "contiguous": (contiguous_shard, contiguous_unshard)}


@pytest.mark.parametrize("layout", sorted(HELPERS))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("axis", [2, -1, 0])
def test_round_trip_and_positions(layout, world, axis, rng):
    shard, unshard = HELPERS[layout]
    shape = [2, 3, 4 * world, 4 * world]
    shape[axis] = 2 * world * 3  # 3 tokens per chunk
    x = rng.standard_normal(shape)
    x_before = x.copy()
    shards = [shard(x, r, world, axis=axis) for r in range(world)]
    np.testing.assert_array_equal(x, x_before)  # input untouched
    n = x.shape[axis]
    for r, s in enumerate(shards):
        assert s.flags.c_contiguous and s.shape[axis] == n // world
        pos = shard_positions(r, world, n, layout)
        np.testing.assert_array_equal(s, np.take(x, pos, axis=axis))
    np.testing.assert_array_equal(unshard(shards, axis=axis), x)
    # every token on exactly one rank
    allpos = np.concatenate([shard_positions(r, world, n, layout) for r in range(world)])
    np.testing.assert_array_equal(np.sort(allpos), np.arange(n))


def test_zigzag_chunks_are_the_documented_ones():
    # 2R = 8 chunks of 1 token over R = 4 ranks: rank r holds chunks r and 7 - r
    x = np.arange(8).reshape(1, 1, 8, 1)
    assert [zigzag_shard(x, r, 4).ravel().tolist() for r in range(4)] == [
        [0, 7], [1, 6], [2, 5], [3, 4]]
    assert rank_chunks(1, 4) == (1, 6)
    assert rank_chunks(1, 4, "contiguous") == (1,)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(world):
    """Causal (query, key) pairs per rank: equal under zig-zag, 1 : 3 : ... under contiguous."""
    n = 2 * world * 4
    visible = np.tril(np.ones((n, n), bool))
    work = {lay: [int(visible[shard_positions(r, world, n, lay)].sum()) for r in range(world)]
            for lay in HELPERS}
    assert len(set(work["zigzag"])) == 1
    assert work["contiguous"][-1] > work["contiguous"][0]


def test_errors():
    x = np.zeros((1, 1, 6, 2))
    with pytest.raises(ValueError, match=r"multiple of 4 \(zigzag over 2 ranks\), got 6"):
        zigzag_shard(x, 0, 2)
    with pytest.raises(ValueError, match=r"rank: expected an int in \[0, 3\), got 3"):
        contiguous_shard(x, 3, 3)
    with pytest.raises(ValueError, match="world"):
        contiguous_shard(x, 0, 0)
    with pytest.raises(TypeError, match="rank: expected an int, got float"):
        contiguous_shard(x, 0.0, 2)
    with pytest.raises(ValueError, match="axis"):
        contiguous_shard(x, 0, 2, axis=4)
    with pytest.raises(TypeError, match="x: expected a NumPy or CuPy array"):
        contiguous_shard([1, 2], 0, 2)
    with pytest.raises(ValueError, match="empty"):
        zigzag_unshard([])
    with pytest.raises(ValueError, match=r"shards\[1\]: expected the shape of shards\[0\]"):
        zigzag_unshard([np.zeros((1, 1, 2, 2)), np.zeros((1, 1, 4, 2))])
    with pytest.raises(ValueError, match="multiple of 2"):
        zigzag_unshard([np.zeros((1, 1, 3, 2))] * 2)
    with pytest.raises(ValueError, match="layout"):
        shard_positions(0, 2, 8, "striped")
