"""The command line's manners: --version, no backend warning for --help/--version, one-line
errors instead of tracebacks, the warmup command, pdb's quit in the stepping example."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import numba_flash
from numba_flash.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
no_gpu = pytest.mark.skipif(numba_flash.backend() == "cuda", reason="needs a machine without a GPU")


def cli(*args, env=None, script=None):
    full = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    full.update(env or {})
    cmd = [sys.executable, *(script or ["-m", "numba_flash"]), *args]
    return subprocess.run(cmd, env=full, capture_output=True, text=True, cwd=ROOT)


@no_gpu
@pytest.mark.parametrize("args", [["--version"], ["--help"], ["demo", "--help"]])
def test_version_and_help_print_no_simulator_warning(args):
    r = cli(*args)
    assert r.returncode == 0, r.stderr
    assert "SimulatorWarning" not in r.stderr and r.stderr == ""
    if args == ["--version"]:
        assert r.stdout.strip() == f"numba-flash {numba_flash.__version__}"


@no_gpu
def test_other_commands_still_warn_once():
    r = cli("warmup", "--list", "-k", "softmax THREADS=256 float32")
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("SimulatorWarning") == 1
    assert r.stdout.strip() == "softmax THREADS=256 float32"


def test_negative_seed_is_a_one_line_error():
    r = cli("demo", "--seed", "-5", env={"NUMBA_ENABLE_CUDASIM": "1"})
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "numba-flash demo: error: argument --seed: expected an integer >= 0, got -5")


def test_unexpected_errors_end_in_one_line(monkeypatch, capsys):
    from numba_flash import demo

    def boom(*args, **kwargs):
        raise RuntimeError("no luck")

    monkeypatch.setattr(demo, "run", boom)
    assert main(["demo", "--ops", "softmax"]) == 1
    assert capsys.readouterr().err == "numba-flash: error: RuntimeError: no luck\n"


@pytest.mark.skipif(numba_flash.backend() != "simulator", reason="simulator only")
def test_warmup_in_the_simulator_has_nothing_to_compile(capsys):
    assert main(["warmup"]) == 0
    assert "nothing to compile" in capsys.readouterr().out


@no_gpu
def test_warmup_on_the_cuda_target_without_a_gpu_says_so():
    r = cli("warmup", env={"NUMBA_ENABLE_CUDASIM": "0"})
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(
        "numba-flash: error: warmup compiles for this machine's GPU and there is none")


@pytest.mark.gpu
def test_warmup_on_a_gpu_compiles_then_loads(tmp_path):
    env = {"NUMBA_CACHE_DIR": str(tmp_path)}
    first = cli("warmup", "-k", "softmax", env=env)
    second = cli("warmup", "-k", "softmax", env=env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    from numba_flash.tools import warmup

    n = len(list(warmup.warmup_configs("softmax")))   # float16, float32 and bfloat16 today
    assert "compiled" in first.stdout and f"[1/{n}] softmax" in first.stdout
    assert f"0 compiled, {n} already cached, 0 without a disk cache" in second.stdout


@pytest.mark.skipif(numba_flash.backend() != "simulator", reason="stepping needs the simulator")
def test_quitting_pdb_in_the_stepping_example_exits_cleanly():
    r = cli("--kernel", "softmax", "--commands", "p m_i; q",
            script=[str(ROOT / "examples" / "step_through_kernel.py")])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "BdbQuit" not in r.stderr
    assert "quit: pdb stopped the kernel" in r.stdout
