"""docs/cuda-basics.md: every Python block of the page run alone, as a reader would paste it;
every kernel of its examples against NumPy, and the counts it prints (sectors, bank conflicts,
occupancy) against independent arithmetic."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest

import cuda_basics as cb
import snippets

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cuda-basics.md"
#: a Python block and the directive line above it (if any)
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```python\n(.*?)^```$", re.S | re.M)


def page_blocks(text):
    """``[(directive or "", code)]`` for every Python block of a page."""
    return [(m.group(1) or "", m.group(2)) for m in BLOCK.finditer(text)]


def run_alone(blocks, tmp_path, preload=True):
    """Run each block as ``python blockN.py`` in an empty folder, with the simulator switch left
    to the block (``NUMBA_ENABLE_CUDASIM`` unset, as on a reader's machine); return
    ``[(code, returncode, stderr)]``.  Each block is its own process, forked from one that has
    imported numba_flash when ``preload`` (docs/snippets.py's Runner: a block whose first numba
    import is not ``import numba_flash`` runs in a fresh interpreter, so a block importing
    numba.cuda first still fails as it would for the reader)."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONWARNINGS"] = "ignore"
    runner = snippets.runner(env, preload)
    done = []
    for n, code in enumerate(blocks):
        (tmp_path / f"block{n}.py").write_text(code)
        rc, _, err = runner.run(["python", f"block{n}.py"], cwd=tmp_path)
        done.append((code, rc, err))
    return done


def test_every_python_block_of_the_page_runs_alone(tmp_path):
    blocks = page_blocks(PAGE.read_text())
    # the one excerpt: the inside of the naive kernel factory (the page says so); it runs
    # through the launch block that follows it
    excerpts = [c for d, c in blocks if "include: numba_flash/teach/kernels/naive_forward.py" in d]
    runnable = [c for d, c in blocks if "include: numba_flash/" not in d]
    assert len(excerpts) == 1 and len(runnable) == len(blocks) - 1 >= 7
    for code, rc, err in run_alone(runnable, tmp_path):
        assert rc == 0, f"this block of {PAGE.name} fails alone:\n{code}\n{err[-1500:]}"


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
    # the decode kernel as ncu saw it on the H200 (2026-11-30): 128 threads, 191 registers
    n, by, occ = cb.blocks_per_sm(128, 191, 0)
    assert occ == 0.125 and by == ["registers"]
    assert cb.blocks_per_sm(32, 16, 0)[1] == ["blocks"]
    assert cb.blocks_per_sm(1024, 32, 0) == (2, ["warps", "registers"], 1.0)


def test_warp_sum_by_shuffles():
    x, out = cb.demo_warp()
    np.testing.assert_array_equal(out, [x[0:32].sum(), x[32:64].sum(), x[64:].sum()])


def test_occupancy_rows_follow_the_resource_table():
    cases = {name: rest for name, *rest in cb.occupancy_cases()}
    threads, regs, smem = cases["tiled forward fp32 d=64 (ptxas)"]
    # the 128-thread layout; registers and shared memory from ptxas, as docs/resources.md has them
    assert threads == 128 and 0 < regs <= 255 and smem <= 48 * 1024
    assert (regs, smem) == cb.resources("forward M64 N32 D64 T16x8 float32")
    with pytest.raises(LookupError):
        cb.resources("no such configuration")


def test_grid_sum_last_block_adds_the_partials():
    x, partial, ticket, out = cb.demo_atomics()
    blocks = -(-x.shape[0] // cb.SUM_THREADS)
    np.testing.assert_array_equal(
        partial, [x[b * cb.SUM_THREADS:(b + 1) * cb.SUM_THREADS].sum() for b in range(blocks)])
    assert out[0] == x.sum() and ticket[0] == 0
    # the counter was reset: a second launch (other data, one block) is right too
    y = np.arange(3, dtype=np.float32)
    out2 = np.full(1, np.nan, np.float32)
    cb.grid_sum[1, cb.SUM_THREADS](y, np.full(1, np.nan, np.float32), ticket, out2)
    assert out2[0] == 3.0 and ticket[0] == 0
