"""The simulator's recording mode and the memory profile (issue 63): the hardware's counting
rules on hand-made requests, the known answers of the teaching kernels recorded in the
simulator (a row read 4 sectors a request for float32, a column read 32; a shared tile's column
32-way, padded or swizzled none; ldmatrix on 128-byte rows 8-way, padded or swizzled none; a
wgmma operand of a swizzled tile none), recording off by default and leaving results unchanged,
and the command line.  Tiny launches only (the whole file: a few seconds)."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash.kernels.ptx import record
from numba_flash.tools import memory_profile as mp

pytestmark = pytest.mark.skipif(numba_flash.backend() != "simulator",
                                reason="the recording mode is the simulator's")


# -- the rules, on hand-made requests -----------------------------------------------------------
def test_global_rows_and_columns():
    base = 1 << 20   # 128-byte aligned
    row = mp.global_counts([(base + 4 * i, 4) for i in range(32)])
    assert (row.sectors, row.lines, row.ideal, row.distinct) == (4, 1, 4, 128)
    col = mp.global_counts([(base + 128 * i, 4) for i in range(32)])
    assert (col.sectors, col.lines, col.ideal) == (32, 32, 4)
    shifted = mp.global_counts([(base + 16 + 4 * i, 4) for i in range(32)])   # not aligned
    assert (shifted.sectors, shifted.lines) == (5, 2)
    wide = mp.global_counts([(base + 16 * i, 16) for i in range(32)])         # 16-byte loads
    assert (wide.sectors, wide.lines, wide.bytes) == (16, 4, 512)
    same = mp.global_counts([(base, 4)] * 32)                                  # a broadcast
    assert (same.sectors, same.distinct, same.bytes) == (1, 4, 128)


def test_shared_banks_phases_and_broadcast():
    col = mp.shared_counts([(lane, 128 * lane, 4) for lane in range(32)])    # [32][32] column
    assert (col.wavefronts, col.ideal, col.ways, col.conflicts) == (32, 1, 32, 31)
    pad = mp.shared_counts([(lane, 132 * lane, 4) for lane in range(32)])    # [32][33] column
    assert (pad.wavefronts, pad.ways) == (1, 1)
    assert mp.shared_counts([(lane, 0, 4) for lane in range(32)]).ways == 1  # broadcast
    two = mp.shared_counts([(lane, 8 * lane, 4) for lane in range(32)])      # stride 2 words
    assert two.ways == 2
    # 16 bytes a lane: four phases of eight lanes, each 128 bytes
    v4 = mp.shared_counts([(lane, 16 * lane, 16) for lane in range(32)])
    assert (v4.wavefronts, v4.ideal, v4.ways, v4.phases) == (4, 4, 1, (1, 1, 1, 1))
    assert mp.lanes_per_phase(4) == 32 and mp.lanes_per_phase(8) == 16
    assert mp.lanes_per_phase(16) == 8 and mp.lanes_per_phase(2) == 32


@pytest.mark.parametrize("layout, ways", [("row-major", 8), ("padded", 1), ("swizzled", 1)])
def test_ldmatrix_layouts_by_rule(layout, ways):
    lanes = [(lane, a, 16) for lane, a in enumerate(mp.ldmatrix_lanes(layout))]
    c = mp.shared_counts(lanes)
    assert (c.ways, c.wavefronts, c.ideal) == (ways, 4 * ways, 4)


def test_core_matrix_phases():
    """A wgmma operand's request: chunks in phases of eight (one core matrix each)."""
    rows = [(128 * r, 16) for r in range(8)]                  # 8 rows 128 bytes apart
    assert mp.chunk_counts(rows, [list(range(8))]).ways == 8
    swz = [(128 * r + 16 * (r % 8), 16) for r in range(8)]   # the 128-byte swizzle
    assert mp.chunk_counts(swz, [list(range(8))]).ways == 1


# -- the teaching kernels, recorded ---------------------------------------------------------------
def _site(prof, space, op, array=None):
    (s,) = prof.launch().find(space=space, op=op, array=array)
    return s


def test_row_read_4_sectors_column_read_32():
    x = np.arange(1024, dtype=np.float32).reshape(32, 32)
    out, prof = mp.demo("rows")
    np.testing.assert_array_equal(out, x.sum(axis=0))
    s = _site(prof, "global", "ld", "x")
    assert (s.requests, s.sectors / s.requests, s.lines / s.requests, s.width) == (32, 4, 1, 4)
    out, prof = mp.demo("columns")
    np.testing.assert_array_equal(out, x.sum(axis=1))
    s = _site(prof, "global", "ld", "x")
    assert (s.requests, s.sectors / s.requests, s.lines / s.requests) == (32, 32, 32)
    assert s.ideal / s.requests == 4


@pytest.mark.parametrize("name, ways", [("transpose", 32), ("transpose_padded", 1),
                                        ("transpose_swizzled", 1)])
def test_shared_tile_column(name, ways):
    x = np.arange(1024, dtype=np.float32).reshape(32, 32)
    y, prof = mp.demo(name)
    np.testing.assert_array_equal(y, x.T)
    load, store = _site(prof, "shared", "ld"), _site(prof, "shared", "st")
    assert (load.requests, load.ways, load.wavefronts) == (32, ways, 32 * ways)
    assert store.ways == 1
    for op in ("ld", "st"):   # the global side is coalesced either way
        g = _site(prof, "global", op)
        assert g.sectors == 4 * g.requests
    lp = prof.launch()
    assert lp.total("shared", "wavefronts") - lp.total("shared", "ideal") == 32 * (ways - 1)


def test_ldmatrix_recorded_on_padded_and_swizzled_tiles():
    regs = {}
    for layout, ways in (("row-major", 8), ("padded", 1), ("swizzled", 1)):
        regs[layout], prof = mp.demo(f"ldmatrix_{layout}")
        s = _site(prof, "shared", "ldsm")
        assert (s.requests, s.width, s.ways, s.wavefronts) == (1, 16, ways, 4 * ways)
        assert [a - s.example[0][1] for _, a, _ in s.example] == [
            a - mp.ldmatrix_lanes(layout)[0] for a in mp.ldmatrix_lanes(layout)]
    np.testing.assert_array_equal(regs["row-major"], regs["swizzled"])   # the same fragment
    np.testing.assert_array_equal(regs["row-major"], regs["padded"])


def test_wgmma_operands_of_a_swizzled_tile():
    from numba_flash.kernels.ptx import wgmma

    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(np.float16)
    b = rng.standard_normal((8, 64)).astype(np.float16)
    c = np.zeros((64, 8), np.float32)
    d = np.full((64, 8), np.nan, np.float32)
    k = wgmma.wgmma_gemm_kernel(8, 64, "float16", 128, "smem", "K", 1)
    _, prof = mp.record(lambda: k[1, 128](a.view(np.uint16), b.view(np.uint16), c, d))
    np.testing.assert_allclose(d, a.astype(np.float32) @ b.astype(np.float32).T, atol=1e-2)
    s = _site(prof, "shared", "wgmma")
    # 4 k-steps, each A (64 x 16: 16 core matrices) and B (8 x 16: 2), no conflict
    assert (s.requests, s.ways, s.wavefronts, s.bytes) == (8, 1, 4 * 18, 4 * (2048 + 256))
    assert all(c.ways == 1 for c in prof.launch().find(space="shared", op="ldgsts"))


# -- recording is off by default and changes nothing ----------------------------------------------
def test_recording_is_off_by_default_and_restored():
    from numba.cuda.simulator import kernel as sim_kernel

    assert record.RECORDER is None
    call = sim_kernel.FakeCUDAKernel.__call__
    with mp.recording() as rec:
        assert record.RECORDER is rec and sim_kernel.FakeCUDAKernel.__call__ is not call
        with pytest.raises(RuntimeError, match="already running"):
            record.Recorder().start()
    assert record.RECORDER is None and sim_kernel.FakeCUDAKernel.__call__ is call


def test_recorded_forward_equals_the_plain_one_and_groups_lanes_by_warp():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, 16, 64)).astype(np.float16) for _ in range(3))
    plain = numba_flash.forward(q, k, v, kernel="mma")
    got, prof = mp.record(lambda: numba_flash.forward(q, k, v, kernel="mma"))
    np.testing.assert_array_equal(got, plain)
    lp = prof.launch("flash_forward_mma")
    assert lp.find(space="shared", op="ldsm") and lp.total("shared", "conflicts") == 0
    for s in lp.find(space="global", op="ldgsts"):
        assert s.lanes <= 32 * s.requests and s.sectors / s.requests == s.ideal / s.requests
    lines = prof.by_line()
    assert any(path == "numba_flash/kernels/ptx/stages.py" and op == "ldgsts"
               for path, _, _, op in lines)   # make_tile_copy's copy_column


def test_gpu_tiles_are_put_back():
    from numba_flash.kernels.decode import config as dconfig
    from numba_flash.kernels.forward import config as fconfig

    before = (fconfig.FORWARD_MMA_SIM_TILES, dconfig.SIM_THREADS, dconfig.SIM_LANES)
    with mp.gpu_tiles(128):
        assert fconfig.FORWARD_MMA_SIM_TILES == fconfig.FORWARD_MMA_TILES[128]
        assert (dconfig.SIM_THREADS, dconfig.SIM_LANES) == (dconfig.GPU_THREADS, 16)
    assert (fconfig.FORWARD_MMA_SIM_TILES, dconfig.SIM_THREADS, dconfig.SIM_LANES) == before


# -- the command ----------------------------------------------------------------------------------
def test_profile_command_prints_the_table(capsys):
    from numba_flash.__main__ import main

    assert main(["profile", "demo:transpose"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("transpose: grid (1, 1, 1), block (32, 4, 1)")
    row = next(ln.split() for ln in out if "tile" in ln and "load" in ln)
    assert row[-3:] == ["32", "1", "32"]   # wavefronts, ideal, ways
    assert "992 from bank conflicts" in out[-1]
    assert main(["profile", "demo:rows", "--lines", "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "| numba_flash/tools/memory_profile.py:" in md
    assert main(["profile", "demo:transpose", "--ncu"]) == 0
    ncu = capsys.readouterr().out
    assert ("| `l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum` | 992 | unmeasured |"
            in ncu)
    assert main(["profile", "demo:nope"]) == 1
    assert "unknown 'nope'" in capsys.readouterr().err
