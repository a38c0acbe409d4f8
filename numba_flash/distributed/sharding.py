"""Cutting a sequence into per-rank shards and gluing the shards back.

Context parallelism gives each of ``R`` ranks a shard of the sequence axis (axis 2 of
``[B, H, N, d]``).  Two layouts:

* **contiguous**: rank ``r`` holds chunk ``r`` of ``R`` equal chunks (tokens
  ``r * N / R ... (r + 1) * N / R - 1``).  Fine without a causal mask; with one, rank ``R - 1``
  does ``2R - 1`` times the work of rank 0.
* **zig-zag**: the sequence is cut into ``2R`` equal chunks and rank ``r`` holds chunks ``r``
  and ``2R - 1 - r`` (one early, one late), so under a causal mask every rank sees the same
  number of (query, key) pairs.

The helpers work on NumPy and CuPy arrays and always return new (contiguous) arrays; their
inputs are never modified.
"""

from __future__ import annotations

import numbers

import numpy as np

from ..frontend.validate import array_module

__all__ = ["LAYOUTS", "rank_chunks", "shard_positions", "zigzag_shard", "zigzag_unshard",
           "contiguous_shard", "contiguous_unshard"]

LAYOUTS = ("zigzag", "contiguous")


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def _check_int(name, x, lo, hi=None):
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    x = int(x)
    if x < lo or (hi is not None and x >= hi):
        bound = f"in [{lo}, {hi})" if hi is not None else f">= {lo}"
        raise ValueError(f"{name}: expected an int {bound}, got {x}")
    return x


def _check_axis(x, axis):
    ndim = getattr(x, "ndim", None)
    if ndim is None:
        raise TypeError(f"x: expected a NumPy or CuPy array, got {type(x).__name__}")
    axis = _check_int("axis", axis, -ndim, ndim)
    return axis % ndim


def rank_chunks(rank, world, layout="zigzag"):
    """The global chunk indices rank ``rank`` holds, in the order they sit in its shard.

    ``zigzag``: ``(rank, 2 * world - 1 - rank)`` of ``2 * world`` chunks; ``contiguous``:
    ``(rank,)`` of ``world`` chunks.  Both tuples are increasing, which the ring relies on.
    """
    world = _check_int("world", world, 1)
    rank = _check_int("rank", rank, 0, world)
    if check_layout(layout) == "zigzag":
        return (rank, 2 * world - 1 - rank)
    return (rank,)


def n_chunks(world, layout):
    return 2 * world if layout == "zigzag" else world


def shard_positions(rank, world, n, layout="zigzag"):
    """Global token positions (an int64 NumPy vector) of the rows of rank ``rank``'s shard."""
    world = _check_int("world", world, 1)
    n = _check_int("n", n, 0)
    chunks = n_chunks(world, check_layout(layout))
    if n % chunks:
        raise ValueError(f"n: expected a multiple of {chunks} ({layout} over {world} ranks), "
                         f"got {n}")
    c = n // chunks
    return np.concatenate([np.arange(i * c, (i + 1) * c, dtype=np.int64)
                           for i in rank_chunks(rank, world, layout)])


def _shard(x, rank, world, axis, layout):
    world = _check_int("world", world, 1)
    rank = _check_int("rank", rank, 0, world)
    axis = _check_axis(x, axis)
    n = x.shape[axis]
    chunks = n_chunks(world, layout)
    if n % chunks:
        raise ValueError(f"x: expected a length on axis {axis} that is a multiple of {chunks} "
                         f"({layout} over {world} ranks), got {n} (shape {tuple(x.shape)})")
    xp = array_module(x)
    c = n // chunks
    parts = [xp.take(x, xp.arange(i * c, (i + 1) * c), axis=axis)
             for i in rank_chunks(rank, world, layout)]
    return xp.ascontiguousarray(xp.concatenate(parts, axis=axis))


def _unshard(shards, axis, layout):
    shards = list(shards)
    if not shards:
        raise ValueError("shards: expected one shard per rank, got an empty sequence")
    first = shards[0]
    axis = _check_axis(first, axis)
    for r, s in enumerate(shards):
        if getattr(s, "shape", None) != first.shape:
            raise ValueError(f"shards[{r}]: expected the shape of shards[0] "
                             f"{tuple(first.shape)}, got {getattr(s, 'shape', type(s).__name__)}")
    world = len(shards)
    per_rank = len(rank_chunks(0, world, layout))
    n_local = first.shape[axis]
    if n_local % per_rank:
        raise ValueError(f"shards: expected a shard length on axis {axis} that is a multiple of "
                         f"{per_rank} ({layout}), got {n_local}")
    c = n_local // per_rank
    xp = array_module(first)
    pieces = [None] * n_chunks(world, layout)
    for r, s in enumerate(shards):
        for j, i in enumerate(rank_chunks(r, world, layout)):
            pieces[i] = xp.take(s, xp.arange(j * c, (j + 1) * c), axis=axis)
    return xp.ascontiguousarray(xp.concatenate(pieces, axis=axis))


def zigzag_shard(x, rank, world, axis=2):
    """Rank ``rank``'s zig-zag shard of ``x``: chunks ``rank``, ``2*world-1-rank`` of ``2*world``.

    ``x.shape[axis]`` must be a multiple of ``2 * world`` (ValueError otherwise).  Returns a new
    array of length ``x.shape[axis] / world`` on ``axis``.
    """
    return _shard(x, rank, world, axis, "zigzag")


def zigzag_unshard(shards, axis=2):
    """Inverse of :func:`zigzag_shard`: ``shards[r]`` is rank ``r``'s shard; returns the whole."""
    return _unshard(shards, axis, "zigzag")


def contiguous_shard(x, rank, world, axis=2):
    """Rank ``rank``'s contiguous shard: chunk ``rank`` of ``world`` equal chunks of ``axis``."""
    return _shard(x, rank, world, axis, "contiguous")


def contiguous_unshard(shards, axis=2):
    """Inverse of :func:`contiguous_shard` (a concatenation in rank order)."""
    return _unshard(shards, axis, "contiguous")
