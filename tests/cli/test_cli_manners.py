"""Issue 21, item 7: a missing extra is named in one line, before any work starts; the demo's
unknown --ops uses the documented error form; --help is plain text; dir() and the package
docstring list the public API."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import numba_flash
import numba_flash.__main__ as cli_main
from numba_flash.__main__ import main

ROOT = Path(__file__).resolve().parents[2]


def _no_subprocess(monkeypatch):
    started = []
    monkeypatch.setattr(cli_main.subprocess, "call", lambda *a, **kw: started.append(a) or 0)
    return started


def test_compile_check_without_the_compiler_wheels_names_the_extra(monkeypatch, capsys):
    import cuda.pathfinder

    def not_found(name):
        raise cuda.pathfinder.DynamicLibNotFoundError(f"Failure finding lib{name}.so")

    monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", not_found)
    started = _no_subprocess(monkeypatch)
    assert main(["compile-check", "-k", "softmax"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("numba-flash: error: compile-check needs"), err
    assert "libnvrtc" in err[0] and "pip install -e '.[test]'" in err[0]
    assert started == []  # detected before starting the compile tier


def test_pictures_without_matplotlib_names_the_extra(monkeypatch, capsys, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert main(["pictures", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("numba-flash: error: pictures needs matplotlib")
    assert "pip install '.[pictures]'" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_demo_unknown_ops_uses_the_documented_error_form(capsys):
    assert main(["demo", "--ops", "softmax,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["numba-flash: error: --ops: unknown operation(s) nope; choose from "
                   + ", ".join(__import__("numba_flash.demo").demo.CASES) + " (or all)"]


def test_help_is_plain_text():
    r = subprocess.run([sys.executable, "-m", "numba_flash", "--help"], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "``" not in r.stdout and ":func:" not in r.stdout
    assert "python -m numba_flash" in r.stdout


def test_dir_lists_the_public_api_before_first_use():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    r = subprocess.run([sys.executable, "-c", "import numba_flash; print(' '.join(dir("
                        "numba_flash)))"], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    names = set(r.stdout.split())
    assert set(numba_flash.__all__) <= names, set(numba_flash.__all__) - names


def test_package_docstring_lists_every_public_name():
    listed = set(re.findall(r"^\* :\w+:`(\w+)`", numba_flash.__doc__, re.M))
    assert listed == set(numba_flash.__all__), (set(numba_flash.__all__) ^ listed)
    assert "backward_varlen" in listed


def test_warning_classes_are_importable_as_documented():
    from numba_flash import SimulatorWarning, SlowSimulatorWarning
    from numba_flash.backend import SlowSimulatorWarning as from_module

    assert SlowSimulatorWarning is from_module and issubclass(SlowSimulatorWarning,
                                                              SimulatorWarning)
    assert numba_flash.backend() in ("cuda", "simulator")  # still the function


@pytest.mark.parametrize("missing", ["nvrtc", "nvvm"])
def test_missing_tools_are_listed_by_name(monkeypatch, missing):
    import cuda.pathfinder

    real = cuda.pathfinder.load_nvidia_dynamic_lib

    def load(name):
        if name == missing:
            raise cuda.pathfinder.DynamicLibNotFoundError(name)
        return real(name)

    monkeypatch.setattr(cuda.pathfinder, "load_nvidia_dynamic_lib", load)
    assert [m.split()[0] for m in cli_main._missing_compile_tools()] == [f"lib{missing}"]
