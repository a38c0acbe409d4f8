"""examples/step_through_kernel.py, run non-interactively: it stops in the chosen thread at the
chosen line, and the values it prints are that thread's running statistics."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from numba_flash import reference as ref
from numba_flash.teach.kernels.softmax import SIM_THREADS

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "step_through_kernel.py"
_spec = importlib.util.spec_from_file_location("step_through_kernel", SCRIPT)
stk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(stk)


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def floats_after(prompt_lines):
    return [float(re.sub(r"np\.float\d+\((.*)\)", r"\1", s)) for s in prompt_lines]


def test_softmax_pdb_commands_print_the_threads_running_stats():
    out = run("--kernel", "softmax", "--block", "1", "--thread", "3",
              "--commands", "p float(m_i); p float(l_i); p tid; p row")
    values = re.findall(r"^\(Pdb\) (.+)$", out, re.M)
    m_i, l_i, tid, row = floats_after(values[:4])
    assert (tid, row) == (3, 1)
    x = stk.make_inputs("softmax")["x"]
    threads = SIM_THREADS  # the script runs in the simulator
    m_want, l_want = ref.online_softmax_stats(x[1, 3::threads])
    assert m_i == np.float32(m_want)
    assert abs(l_i - l_want) <= 1e-6 * l_want
    assert "kernel finished" in out


def test_naive_forward_non_interactive_stop_after_three_keys():
    out = run("--kernel", "naive_forward", "--block", "1", "--thread", "2",
              "--at", "m_i = m_new", "--hit", "3", "--non-interactive")
    got = dict(re.findall(r"^(\w+) = (?:np\.float\d+\()?([-\d.e+inf]+)\)?$", out, re.M))
    assert int(got["row"]) == 6 and int(got["j"]) == 2 and int(got["h"]) == 0
    inp = stk.make_inputs("naive_forward")
    q, k = inp["q"].astype(np.float64), inp["k"].astype(np.float64)
    s = 0.5 * k[0, 0, :3] @ q[0, 0, 6]  # scale = 1/sqrt(4); keys 0..2 seen so far
    assert abs(float(got["m_new"]) - s.max()) < 1e-6
    assert abs(float(got["m_i"]) - s[:2].max()) < 1e-6  # not yet updated at this line
    assert abs(float(got["l_i"]) - np.exp(s - s.max()).sum()) < 1e-6


def test_unknown_thread_never_stops():
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--kernel", "softmax", "--block", "9",
                           "--non-interactive"], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 1 and "never stopped" in proc.stdout
