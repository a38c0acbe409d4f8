"""Kernel tier: warp shuffles as kernels call them (on the simulator: numba_flash.simulator_warp).

Each test computes on the device (or simulator) what a shuffle returns per lane and checks it
against the definition, including a block whose last warp is partial.
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda

import numba_flash

FULL = 0xFFFFFFFF


@cuda.jit
def shuffles(x, out):
    t = cuda.threadIdx.x
    v = x[t]
    out[0, t] = cuda.shfl_xor_sync(FULL, v, 1)
    out[1, t] = cuda.shfl_xor_sync(FULL, v, 16)
    out[2, t] = cuda.shfl_sync(FULL, v, 3)
    out[3, t] = cuda.shfl_down_sync(FULL, v, 2)
    out[4, t] = cuda.shfl_up_sync(FULL, v, 5)
    # butterfly row max over groups of 8 lanes
    m = v
    for off in (4, 2, 1):
        m = max(m, cuda.shfl_xor_sync(FULL, m, off))
    out[5, t] = m
    cuda.syncwarp(FULL)


@pytest.mark.parametrize("n", [64])
def test_shuffles_match_their_definition(rng, n):
    x = rng.standard_normal(n).astype(np.float32)
    out = np.full((6, n), np.nan, np.float32)
    shuffles[1, n](x, out)
    lane = np.arange(n) % 32
    base = np.arange(n) - lane
    np.testing.assert_array_equal(out[0], x[base + (lane ^ 1)])
    np.testing.assert_array_equal(out[1], x[base + (lane ^ 16)])
    np.testing.assert_array_equal(out[2], x[base + 3])
    down = np.where(lane + 2 < 32, base + lane + 2, np.arange(n))
    np.testing.assert_array_equal(out[3], x[down])
    up = np.where(lane - 5 >= 0, base + lane - 5, np.arange(n))
    np.testing.assert_array_equal(out[4], x[up])
    np.testing.assert_array_equal(out[5], x.reshape(-1, 8).max(1).repeat(8))


@cuda.jit
def partial_warp(x, out):
    t = cuda.threadIdx.x
    out[t] = cuda.shfl_xor_sync(FULL, x[t], 2)


def test_partial_last_warp(rng):
    """40 threads: the second warp has 8 lanes; xor 2 stays inside it."""
    x = rng.standard_normal(40).astype(np.float32)
    out = np.full(40, np.nan, np.float32)
    partial_warp[1, 40](x, out)
    idx = np.arange(40)
    np.testing.assert_array_equal(out, x[(idx - idx % 32) + ((idx % 32) ^ 2)])


@cuda.jit
def divergent(x, out):
    t = cuda.threadIdx.x
    if t == 5:
        return                      # lane 5 never reaches the shuffle
    out[t] = cuda.shfl_xor_sync(FULL, x[t], 1)


@pytest.mark.skipif(numba_flash.backend() != "simulator", reason="simulator only")
def test_a_divergent_shuffle_fails_without_a_wall_clock_limit():
    """A lane that returns before a shuffle its warp's other lanes call: the simulator raises
    DivergentWarpError as soon as the lane returns (no timeout to wait out, whatever the
    machine's speed); on the device the call is undefined, so the simulator alone checks it."""
    from numba_flash.simulator_warp import DivergentWarpError

    x = np.zeros(32, np.float32)
    with pytest.raises(DivergentWarpError, match="converged code"):
        divergent[1, 32](x, np.zeros(32, np.float32))
