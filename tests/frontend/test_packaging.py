"""Packaging and CI: ruff configured in pyproject.toml and run by .ci/run before the tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_configured_and_run_before_the_tests():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]
    assert conf["line-length"] == 100 and "F" in conf["lint"]["select"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "ruff check . && python -m pytest" in ci
    assert "ruff format" not in ci  # lint only: formatting is not enforced


# the files of the launch path, the command line and packaging (the rest is linted by .ci/run)
OWN = ["numba_flash/frontend", "numba_flash/kernels/core/jit.py", "numba_flash/backend.py",
       "numba_flash/__main__.py", "numba_flash/__init__.py", "numba_flash/demo.py",
       "numba_flash/ops/dropout.py", "numba_flash/teach/ops/softmax.py",
       "numba_flash/teach/ops/naive_forward.py", "examples", "tests/frontend", "tests/cli",
       "tests/helpers.py", "tests/conftest.py"]


def test_launch_path_and_cli_pass_ruff():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).exists():
        pytest.skip("ruff not installed (pip install -e '.[test]')")
    r = subprocess.run([ruff, "check", *OWN], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:]
