"""The mainloop's walk over tiles, shared by the tensor-core kernels (forward, dK/dV, dQ).

Contract: :func:`make_tile_walk` builds ``walk(t, ahead, t_hi, wctx, sctx)``, which runs each
tile the kernel visits once, in order, from ``t`` to ``t_hi`` (exclusive), through one of two
per-tile steps: the kernel's unmasked step where the tile's verdict says every row sees every
key of it, else its masked step.  ``ahead`` is the tile the step's copy prefetches (the
prologue loaded the ones before it); ``stage`` cycles ``0 .. STAGES - 1`` with the tiles.

A dense walk (no block mask: every tile from ``t`` to ``t_hi`` in turn) derives ``ahead`` (``t
+ AHEAD``) from ``t`` instead of carrying it: one register fewer in kernels at ptxas's 255 (the
d = 64 forward's tile bounds stopped being reloaded from local memory each tile).  Deriving the
stage too (``t % STAGES``) was tried: ptxas then spilled more, not less.

Layout of the loop: one loop, each tile's verdict choosing the step.  (A run of unmasked
tiles as a loop of its own, FA2's layout, made ptxas 13 spill in the d = 128 forward and the
dK/dV kernels at 255 registers, where the one loop does not.)  The SASS
tier counts the unmasked step's path through it (:func:`numba_flash.tools.sass.count_iteration`: a
masked step skips work an unmasked tile does).
"""

from __future__ import annotations

import functools
from collections import namedtuple

from numba import int32

from ..core.common import log_tile
from ..core.jit import device_jit
from .visibility import make_next_tile, make_tile_verdict

__all__ = ["KvWalk", "make_tile_walk", "make_kv_walk"]

#: the context of a walk over K/V tiles (:func:`make_kv_walk`): the user's arrays, the block's
#: batch, head and query rows ``[q_start, q_end)``, ``nk`` keys, the last tile ``t_hi`` and the
#: unmasked ones ``[f_lo, f_hi)``, the thread
KvWalk = namedtuple("KvWalk", "user b h q_start q_end nk t_hi f_lo f_hi tid")


@functools.lru_cache(maxsize=None)
def make_tile_walk(step_full, step_masked, visit, next_tile, STAGES, AHEAD=0):
    """``walk(t, ahead, t_hi, wctx, sctx)`` (see the module docstring) from the kernel's device
    functions:

    * ``visit(t, wctx) -> (unmasked, umask)``: the verdict on tile ``t``
      (:func:`~numba_flash.kernels.mainloop.visibility.make_tile_verdict`; the simulator's tile log
      goes here too);
    * ``next_tile(t, wctx)``: the tile after ``t`` (``t_hi`` past the last; a block mask skips
      its EMPTY tiles);
    * ``step_full`` / ``step_masked(t, ahead, stage, t_hi, sctx, umask)``: one tile.

    ``wctx`` and ``sctx`` are the kernel's tuples for the first two and for the steps.
    ``AHEAD`` > 0: a dense walk (``next_tile(t) == t + 1``), the step's prefetch tile ``t +
    AHEAD`` (see the module docstring)."""

    @device_jit(own_module=True, inline=True)
    def advance(t, ahead, stage, wctx):
        if AHEAD:   # dense: the next tile, and the loop's own test stops it at t_hi
            return int32(t + 1), ahead, int32(stage + 1 if stage + 1 < STAGES else 0)
        return (int32(next_tile(t, wctx)), int32(next_tile(ahead, wctx)),
                int32(stage + 1 if stage + 1 < STAGES else 0))

    @device_jit(own_module=True, inline=True)
    def walk(t, ahead, t_hi, wctx, sctx):
        # 32-bit tile indices: one register each (Python ints are 64-bit in Numba), and the
        # tile comparisons one instruction
        t, ahead, t_hi, stage = int32(t), int32(ahead), int32(t_hi), int32(0)
        while t < t_hi:
            if AHEAD:   # dense: the prefetch tile follows from t
                ahead = int32(t + AHEAD)
            unmasked, umask = visit(t, wctx)
            if unmasked:   # every row sees every key of the tile: no mask
                step_full(t, ahead, stage, t_hi, sctx, False)
            else:
                step_masked(t, ahead, stage, t_hi, sctx, umask)
            t, ahead, stage = advance(t, ahead, stage, wctx)

    return walk


@functools.lru_cache(maxsize=None)
def make_kv_walk(step_full, step_masked, BLOCKS, MASK_MOD, BLOCK_N, STAGES, AHEAD, LOG=False):
    """``(walk, next_kv)`` for a kernel whose block owns a Q tile and walks its K/V tiles of
    ``BLOCK_N`` keys (the forward, the deterministic dQ): :func:`make_tile_walk` with the
    verdict of :func:`~numba_flash.kernels.mainloop.visibility.make_tile_verdict` and, with a block
    mask (``BLOCKS``), its EMPTY tiles skipped.  ``wctx``: a :data:`KvWalk` (``[f_lo, f_hi)``: the
    tiles every row sees whole); ``next_kv(kt, wctx)`` is
    the tile after ``kt`` (``next_kv(t_lo - 1, wctx)`` the first); ``AHEAD``: how many tiles
    ahead the step prefetches; ``LOG``: the simulator's tile log
    (:data:`~numba_flash.kernels.core.common.TILE_LOG`)."""
    verdict = make_tile_verdict(BLOCKS, MASK_MOD, BLOCK_N)
    next_tile = make_next_tile(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None

    @device_jit(own_module=True, inline=True)
    def next_kv(kt, w):
        if kt >= w.t_hi:
            return w.t_hi
        if BLOCKS is None:
            return kt + 1
        return next_tile(w.user[0], w.b, w.h, w.q_start, w.q_end, kt + 1, w.t_hi, w.nk)

    @device_jit(own_module=True, inline=True)
    def visit(kt, w):
        if LOG and w.tid == 0:
            log_tile(w.b, w.h, w.q_start, kt)
        return verdict(w.user, w.b, w.h, w.q_start, w.q_end, kt, w.nk,
                       w.f_lo <= kt and kt < w.f_hi)

    dense = BLOCKS is None
    return (make_tile_walk(step_full, step_masked, visit, next_kv, STAGES, AHEAD if dense else 0),
            next_kv)
