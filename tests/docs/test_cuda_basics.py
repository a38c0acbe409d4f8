"""docs/cuda-basics.md: every kernel of its examples against NumPy, and the counts it prints
(sectors, bank conflicts, occupancy) against independent arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

import cuda_basics as cb


def test_scale_add_writes_every_element_and_nothing_past_the_end():
    out = cb.demo_scale_add()
    np.testing.assert_array_equal(out, 2 * np.arange(10, dtype=np.float32) + 1)
    # more threads than elements: the guard must keep the spare ones out of a short array
    x = np.arange(5, dtype=np.float32)
    buf = np.full(8, np.nan, np.float32)
    cb.scale_add[2, 4](np.float32(3.0), x, x, buf[:5])
    np.testing.assert_array_equal(buf[:5], 4 * x)
    assert np.isnan(buf[5:]).all()


def test_whoami_coordinates():
    block_of, thread_of, warp_of, lane_of = cb.demo_threads()
    i = np.arange(200)
    np.testing.assert_array_equal(block_of, i // 64)
    np.testing.assert_array_equal(thread_of, i % 64)
    np.testing.assert_array_equal(warp_of, (i % 64) // 32)
    np.testing.assert_array_equal(lane_of, i % 32)


@pytest.mark.parametrize("shape", [(3, 21), (2, 1), (1, 8), (4, 3)])
def test_row_max_kernel(shape):
    x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)
    out = np.full(shape[0], np.nan, np.float32)
    cb.row_max[shape[0], cb.THREADS](x, out)
    np.testing.assert_array_equal(out, x.max(axis=1))  # max is exact: no tolerance


def test_naive_launch_by_hand_matches_reference():
    o, lse, o_ref, lse_ref = cb.demo_naive()
    assert not np.isnan(o).any() and not np.isnan(lse).any()
    # measured 3.5e-7 (o) and 1.1e-7 (lse) in float32
    assert np.abs(o - o_ref).max() < 2e-6 and np.abs(lse - lse_ref).max() < 1e-6


def test_sectors_and_banks():
    q_addr, k_addr, row_addr = cb.naive_load_addresses(d=64)
    assert (cb.sectors(q_addr), cb.sectors(k_addr), cb.sectors(row_addr)) == (32, 1, 4)
    # d = 4: four rows of 16 bytes share a sector
    assert cb.sectors(cb.naive_load_addresses(d=4)[0]) == 16
    assert cb.bank_conflict([t * 32 for t in range(32)]) == 32
    assert cb.bank_conflict([t * 33 for t in range(32)]) == 1
    assert cb.bank_conflict([5] * 32) == 1  # broadcast
    assert cb.bank_conflict([t * 2 for t in range(32)]) == 2  # stride 2: 2-way


def test_occupancy_reproduces_nsight_compute():
    # ncu on the H200, flash_forward float32 d=64 (commit 38a7cb7): 64 threads, 167 registers,
    # 44.03 KB static shared memory, 15.6% theoretical occupancy
    n, by, occ = cb.blocks_per_sm(64, 167, 44032)
    assert (n, by) == (5, ["shared memory"]) and round(100 * occ, 1) == 15.6
    # decode_split at 32k (issue 12): 128 threads, 191 registers -> 12.5%
    n, by, occ = cb.blocks_per_sm(128, 191, 0)
    assert occ == 0.125 and by == ["registers"]
    assert cb.blocks_per_sm(32, 16, 0)[1] == ["blocks"]
    assert cb.blocks_per_sm(1024, 32, 0) == (2, ["warps", "registers"], 1.0)


def test_warp_sum_by_shuffles():
    x, out = cb.demo_warp()
    np.testing.assert_array_equal(out, [x[0:32].sum(), x[32:64].sum(), x[64:].sum()])
