"""Issue 37, item 7: a closed pipe ends the command line quietly with status 0; ``demo --help``
lists every op and dtype; compile-check without the test extra's toolchain is one line naming
it, even with a ptxas on PATH; the README's install lines run from a fresh clone."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import numba_flash
import numba_flash.__main__ as cli_main
from numba_flash import demo
from numba_flash.__main__ import main

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_ROOT = Path(numba_flash.__file__).resolve().parents[1]  # the numba_flash under test


def test_a_closed_pipe_ends_quietly_with_status_0(tmp_path, args=("warmup", "--list")):
    """``numba-flash warmup --list | head -1``: the reader is gone before the first write."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(PACKAGE_ROOT))
    p = subprocess.Popen([sys.executable, "-m", "numba_flash", *args], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # as head does after its line
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 0, err
    assert err == "", err


def test_demo_help_lists_every_op_and_dtype(capsys):
    assert cli_main.DEMO_OPS == tuple(demo.CASES)
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    ops = re.search(r"--ops OPS comma-separated subset of: (.*?) \(default: all\)", text)
    assert ops and ops.group(1).split(", ") == list(demo.CASES), text
    dtypes = re.search(r"--dtype \{(.*?)\}", text)
    assert dtypes and set(dtypes.group(1).split(",")) == set(demo.TOLERANCE), text


def test_demo_runs_bfloat16(capsys):
    assert main(["demo", "--ops", "softmax", "--dtype", "bfloat16"]) == 0
    assert "bfloat16" in capsys.readouterr().out


def test_compile_check_with_only_a_system_ptxas_names_the_test_extra(monkeypatch, capsys,
                                                                       tmp_path):
    import glob

    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    real = glob.glob
    monkeypatch.setattr(glob, "glob", lambda p, *a, **k: [] if p.endswith("ptxas")
                        else real(p, *a, **k))  # no nvidia-cuda-nvcc wheel
    started = []
    monkeypatch.setattr(cli_main.subprocess, "call", lambda *a, **kw: started.append(a) or 0)
    assert main(["compile-check", "-k", "softmax"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("numba-flash: error: compile-check needs the test "
                                               "extra's"), err
    assert str(fake) in err[0] and "pip install '.[test]'" in err[0], err
    assert started == []


def _install_commands(text):
    """The ``pip install`` commands of the bash blocks, as argument lists (comments dropped,
    ``a && b`` split)."""
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    cmds = [shlex.split(c) for b in blocks for line in b.splitlines()
            for c in line.split("#")[0].split("&&")]
    return [c[2:] for c in cmds if c[:2] == ["pip", "install"]]


def test_readme_install_lines_run_from_a_fresh_clone():
    """numba_flash is not on PyPI: every install of it is from the clone ('.' with an extra of
    setup.cfg); torch comes from its CPU index (PyPI's Linux torch is the CUDA build)."""
    cfg = (ROOT / "setup.cfg").read_text()
    extras = set(re.findall(r"^(\w+) =", cfg.split("[options.extras_require]")[1], re.M))
    readme = (ROOT / "README.md").read_text()
    commands = _install_commands(readme)
    assert len(commands) >= 4, commands
    for args in commands:
        if any(a.startswith("torch") for a in args):
            assert args == ["torch==2.13.*", "--index-url", "https://download.pytorch.org/whl/cpu"
                            ], args
            continue
        spec = [a for a in args if a != "-e"]
        m = re.fullmatch(r"\.(?:\[(\w+)\])?", spec[0]) if len(spec) == 1 else None
        assert m and m.group(1) in (None, *extras), f"{args}: not an install from the clone"
    assert "numba_flash[" not in readme
