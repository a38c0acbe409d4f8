"""The simulator's time estimate (issue 21, item 5): from the work each thread does (each launch's
work hint, its family's model), growing with the work, and a SlowSimulatorWarning before a long
launch (checked without running it).  No test here times anything: how close the estimate comes
to the measured time is ``bench/sim_cost.py``'s measurement."""

from __future__ import annotations

import contextlib
import warnings

import numpy as np
import pytest

import numba_flash
import numba_flash.frontend.arrays as arrays
from numba_flash import SlowSimulatorWarning
from numba_flash.frontend.sim_time import SIM_COST

on_sim = pytest.mark.skipif(numba_flash.backend() != "simulator", reason="simulator only")


def _estimate(grid, block, work):
    """The launch path's estimate, on the code before (no work hint) and after."""
    if work is None:
        return arrays.simulator_seconds(grid, block)
    return arrays.simulator_seconds(grid, block, work)


@pytest.fixture
def hinted_launches(monkeypatch):
    """Run every launch and record (kernel, its work hint, the estimate)."""
    records = []
    real = arrays.ArrayCall.launch

    def recorded(self, kernel, grid, block, *args, **kw):
        real(self, kernel, grid, block, *args, **kw)
        work = kw.get("work")
        records.append((kernel.py_func.__name__, work, _estimate(grid, block, work)))

    monkeypatch.setattr(arrays.ArrayCall, "launch", recorded)
    return records


# How close the estimate comes to the measured time is a measurement of this machine, not a
# test: ``bench/sim_cost.py`` times each family and prints estimate / measured for the committed
# constants (0.66-1.27 on the quiet 2-core machine they were fitted on).  A timed assertion here
# failed beside a CPU-bound process (CPU time 3.4x under the estimate, 2026-12-04), so the suite
# checks what does not depend on the machine: each launch carries its family's work hint, and
# the estimate is that family's model of it.


@on_sim
@pytest.mark.parametrize("n", [16, 64])
def test_forward_launch_is_estimated_from_its_work(hinted_launches, n):
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(np.float32) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowSimulatorWarning)
        numba_flash.forward(q, k, v)
    (name, work, estimate), = hinted_launches
    assert name == "flash_forward" and work is not None and work.family == "forward"
    assert work.steps > 0 and work.elems > 0
    assert estimate > int(work.steps) * SIM_COST["forward"][2] > 0


@on_sim
def test_backward_launches_are_estimated_from_their_work(hinted_launches):
    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((1, 1, 32, 16)).astype(np.float32) for _ in range(4))
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    hinted_launches.clear()
    numba_flash.backward(do, q, k, v, o, lse, causal=True)
    (name, work, estimate), = [r for r in hinted_launches if r[0] == "backward_dkdv"]
    assert work is not None and work.family == "backward_dkdv" and work.steps > 0
    assert estimate >= int(work.steps) * SIM_COST["backward_dkdv"][2] > 0


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
