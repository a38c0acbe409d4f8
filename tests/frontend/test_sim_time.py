"""The simulator's time estimate (issue 21, item 5): from the work each thread does, within a
factor of 3 of the measured time, and a SlowSimulatorWarning before a long launch (checked
without running it).  Times are the process's CPU time (``time.process_time``), the wall time
on an idle machine: the suite often runs beside other work."""

from __future__ import annotations

import contextlib
import time
import warnings

import numpy as np
import pytest

import numba_flash
import numba_flash.frontend.arrays as arrays
from numba_flash import SlowSimulatorWarning

on_sim = pytest.mark.skipif(numba_flash.backend() != "simulator", reason="simulator only")


def _estimate(grid, block, work):
    """The launch path's estimate, on the code before (no work hint) and after."""
    if work is None:
        return arrays.simulator_seconds(grid, block)
    return arrays.simulator_seconds(grid, block, work)


@pytest.fixture
def timed_launches(monkeypatch):
    """Run every launch and record (kernel, estimate, CPU seconds)."""
    records = []
    real = arrays.ArrayCall.launch

    def timed(self, kernel, grid, block, *args, **kw):
        t0 = time.process_time()
        real(self, kernel, grid, block, *args, **kw)
        records.append((kernel.py_func.__name__, _estimate(grid, block, kw.get("work")),
                        time.process_time() - t0))

    monkeypatch.setattr(arrays.ArrayCall, "launch", timed)
    return records


@on_sim
@pytest.mark.parametrize("n", [16, 64])
def test_forward_estimate_within_3x_of_the_measured_time(timed_launches, n):
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(np.float32) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowSimulatorWarning)
        numba_flash.forward(q, k, v)
    (name, estimate, measured), = timed_launches
    assert 1 / 3 <= estimate / measured <= 3, (name, estimate, measured)


@on_sim
def test_backward_estimates_within_3x_of_the_measured_time(timed_launches):
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((1, 1, 32, 16)).astype(np.float32) for _ in range(4))
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    timed_launches.clear()
    numba_flash.backward(do, q, k, v, o, lse, causal=True)
    (name, estimate, measured), = [r for r in timed_launches if r[0] == "backward_dkdv"]
    assert 1 / 3 <= estimate / measured <= 3, (name, estimate, measured)


class _NotRun(Exception):
    pass


@on_sim
def test_a_long_forward_warns_before_it_starts(monkeypatch):
    """[1, 2, 1024, 64] float32: minutes in the simulator; the warning comes before the launch
    (which is stopped here at its first step), with the estimate and the advice."""
    @contextlib.contextmanager
    def stop():
        raise _NotRun
        yield

    monkeypatch.setattr(arrays.simulator, "fast_switching", stop)
    q = np.zeros((1, 2, 1024, 64), np.float32)
    with pytest.warns(SlowSimulatorWarning) as rec, pytest.raises(_NotRun):
        numba_flash.forward(q, q, q)
    msg = str(rec[0].message)
    assert "launch of flash_forward" in msg and "min" in msg, msg
    assert "smaller shapes" in msg and "GPU" in msg and "Ctrl-C stops it" in msg
    assert rec[0].filename == __file__


@on_sim
def test_estimates_grow_with_the_work_not_only_the_threads(monkeypatch):
    """Causal forward visits about half the tiles; a 4x longer sequence 16x the tile pairs."""
    seen = []
    monkeypatch.setattr(arrays.ArrayCall, "launch",
                        lambda self, kernel, grid, block, *a, **kw: seen.append(
                            _estimate(grid, block, kw.get("work"))))
    for n, causal in ((256, False), (256, True), (1024, False)):
        q = np.zeros((1, 1, n, 64), np.float32)
        numba_flash.forward(q, q, q, causal=causal)
    full, causal, long = seen
    assert 0.4 < causal / full < 0.7
    assert 12 < long / full < 17
