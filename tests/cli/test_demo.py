"""The main job, ``python -m numba_flash demo``: every row OK on the available backend."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from numba_flash import demo
from numba_flash.__main__ import main


def test_demo_all_rows_ok(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    for name in ("softmax", "forward", "forward causal", "backward causal", "dropout fwd+bwd",
                 "decode contiguous", "paged decode split-KV"):
        assert name in out
    assert "FAIL" not in out and out.count("OK") >= len(demo.CASES)


def test_demo_fails_loudly_on_a_wrong_result(monkeypatch, capsys):
    """A row whose kernel output is wrong is a FAIL and the exit code is 1."""
    def broken(rng, s, dtype):
        row = demo.case_softmax(rng, s, dtype)
        got, want = row.errors[0]
        row.errors[0] = (np.asarray(got) + 0.01, want)
        return row

    monkeypatch.setitem(demo.CASES, "softmax", broken)
    assert main(["demo", "--ops", "softmax"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_demo_rejects_unknown_ops(capsys):
    assert main(["demo", "--ops", "softmax,nope"]) == 2
    assert "unknown operation" in capsys.readouterr().err


def test_module_help_runs():
    r = subprocess.run([sys.executable, "-m", "numba_flash", "demo", "--help"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "--ops" in r.stdout and "--size" in r.stdout


@pytest.mark.parametrize("cmd", [["info"]])
def test_info(cmd, capsys):
    assert main(cmd) == 0
    assert "backend" in capsys.readouterr().out


def test_compile_check_subcommand_passes_its_options():
    r = subprocess.run([sys.executable, "-m", "numba_flash", "compile-check", "-k", "softmax",
                        "--cc", "90"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "softmax THREADS=256 float32" in r.stdout and "sm_90" in r.stdout
    assert "sm_80" not in r.stdout
