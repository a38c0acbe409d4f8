"""Ring attention over real MPI: ``mpiexec -n 2`` and ``-n 4`` run ring_mpi_check.py, which
compares forward and backward (causal and not, GQA, zig-zag and contiguous, float32 and
float64) with the float64 oracle of the whole sequence, and checks that ranks passing
different shapes all raise.  Needs mpi4py and an ``mpiexec`` (the ``mpich`` wheel of the
``test`` extra puts one in the environment's bin/); skipped with the reason otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("ring_mpi_check.py")


def _mpiexec():
    here = Path(sys.executable).parent  # the venv's bin, where the mpich wheel puts it
    return shutil.which("mpiexec", path=str(here)) or shutil.which("mpiexec")


@pytest.mark.parametrize("ranks", [2, 4])
def test_ring_under_mpiexec(ranks):
    pytest.importorskip("mpi4py", reason="mpi4py not installed (pip install -e '.[mpi]')")
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec found (the mpich wheel provides one: pip install mpich)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]))
    # -m mpi4py: an exception on one rank aborts all of them instead of a hang (no wall-clock
    # limit: about 4 s for -n 2 and 10 s for -n 4 on 2 quiet cores, more on a busy machine)
    proc = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py",
                           str(CHECK)], capture_output=True, text=True, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"R={ranks} ")]
    assert len(lines) == 5 and all(ln.split()[-1] == "OK" or "OK (" in ln for ln in lines), out
