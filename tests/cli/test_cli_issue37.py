"""Issue 37, item 7: a closed pipe ends the command line quietly with status 0 (warmup, demo,
compile-check); ``demo --help`` lists every op and dtype; compile-check shows a progress bar on a
terminal only and, without the test extra's toolchain, ends in one line naming the wheel and the
install command, even with a ptxas on PATH; every install hint of the package and the README's
install lines run from a fresh clone."""

from __future__ import annotations

import io
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


def _has_wheel_ptxas():
    """Whether the test extra's nvidia-cuda-nvcc wheel is installed (what compile-check runs)."""
    import glob

    try:
        import nvidia
    except ImportError:
        return False
    return any(glob.glob(os.path.join(r, "cu*", "bin", "ptxas")) for r in nvidia.__path__)


@pytest.mark.parametrize("args", [
    ("warmup", "--list"),
    ("demo", "--ops", "softmax"),  # rich's console answered a closed pipe with SystemExit(1)
    pytest.param(("compile-check", "-k", "no configuration has this name", "-j", "1"),
                 marks=pytest.mark.skipif("not _has_wheel_ptxas()",
                                          reason="needs the test extra's ptxas")),
], ids=["warmup", "demo", "compile-check"])
def test_a_closed_pipe_ends_quietly_with_status_0(tmp_path, args):
    """``numba-flash warmup --list | head -1``: the reader is gone before the first write."""
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(PACKAGE_ROOT))
    p = subprocess.Popen([sys.executable, "-m", "numba_flash", *args], cwd=tmp_path,
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # as head does after its line
    err = p.stderr.read().decode()
    assert p.wait() == 0, err
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
    assert str(fake) in err[0] and "pip install -e '.[test]'" in err[0], err
    assert started == []


def _only_a_system_tool(monkeypatch, tmp_path, *names):
    """Each tool in ``names`` on PATH (a script that does nothing) and in no NVIDIA wheel."""
    import glob

    for name in names:
        fake = tmp_path / name
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    real = glob.glob
    monkeypatch.setattr(glob, "glob", lambda p, *a, **k: [] if p.endswith(names)
                        else real(p, *a, **k))


def test_compile_check_sass_without_the_nvdisasm_wheel_names_it(monkeypatch, capsys, tmp_path):
    """--sass needs nvdisasm too: checked with ptxas, before the compile tier starts."""
    _only_a_system_tool(monkeypatch, tmp_path, "nvdisasm")
    started = []
    monkeypatch.setattr(cli_main.subprocess, "call", lambda *a, **kw: started.append(a) or 0)
    assert main(["compile-check", "--sass", "-k", "softmax"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("numba-flash: error: compile-check needs"), err
    assert "nvdisasm of the nvidia-cuda-nvdisasm wheel" in err[0], err
    assert str(tmp_path / "nvdisasm") in err[0] and "pip install -e '.[test]'" in err[0], err
    assert started == []


@pytest.mark.parametrize("argv, tool, wheel", [
    (["-k", "no configuration has this name"], "ptxas", "nvidia-cuda-nvcc"),
    (["--sass", "-k", "no configuration has this name"], "nvdisasm", "nvidia-cuda-nvdisasm"),
])
def test_compile_check_module_takes_no_system_tool(monkeypatch, capsys, tmp_path, argv, tool,
                                                   wheel):
    """``python -m numba_flash.tools.compile_check`` (what the subcommand runs) uses the wheel's
    tools only: a ptxas on PATH is another toolchain.  One line naming the wheel, status 2, no
    table."""
    from numba_flash.tools import compile_check as cc

    _only_a_system_tool(monkeypatch, tmp_path, tool)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    assert cc.main(argv) == 2
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert out == ""
    assert len(err) == 1 and err[0].startswith("numba-flash compile-check: error: "), err
    assert f"{tool} of the {wheel} wheel" in err[0] and str(tmp_path / tool) in err[0], err
    assert "pip install -e '.[test]'" in err[0], err


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _plain_terminal(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    for var in ("TTY_INTERACTIVE", "TTY_COMPATIBLE", "NO_COLOR"):
        monkeypatch.delenv(var, raising=False)


def test_compile_check_progress_bar_draws_on_a_terminal_only(monkeypatch):
    from numba_flash.tools.compile_check import progress_bar

    _plain_terminal(monkeypatch)
    tty, log = _Terminal(), io.StringIO()
    for stream in (tty, log):
        with progress_bar(2, stream) as step:
            step(1, "stages arith [float32]")
            step(2, "softmax THREADS=256 float32")
    text = tty.getvalue()
    assert "configuration 1 of 2" in text and "stages arith [float32]" in text, text
    assert "configuration 2 of 2" in text and "softmax THREADS=256 float32" in text, text
    assert log.getvalue() == ""  # a log, a pipe, the suite's capture: nothing


def test_compile_check_shows_progress_on_stderr_and_keeps_its_table(monkeypatch, capsys):
    """main with a tiny selection (the builds faked: no compile): on a terminal stderr shows
    "configuration i of n" and the name; stdout, the table, is the same with or without it."""
    from numba_flash.tools import compile_check as cc

    _plain_terminal(monkeypatch)
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "0")
    monkeypatch.setattr(cc, "wheel_tool", lambda name: f"/wheel/bin/{name}")
    names = [c["name"] for c in cc.all_configs("stages")]
    assert names

    def fake_build(cfg, ccs, ptxas, nvdisasm=None):
        assert ptxas == "/wheel/bin/ptxas"
        return [{"name": cfg["name"], "cc": cc.arch_name(c), "registers": 40, "smem": 0,
                 "spill_stores": 0, "spill_loads": 0, "f64": [], "problems": []} for c in ccs]

    monkeypatch.setattr(cc, "build", fake_build)
    outs = []
    for stream in (_Terminal(), io.StringIO()):
        monkeypatch.setattr(sys, "stderr", stream)
        assert cc.main(["-k", "stages", "-j", "1"]) == 0
        outs.append((capsys.readouterr().out, stream.getvalue()))
    (tty_out, tty_err), (log_out, log_err) = outs
    assert tty_out == log_out and tty_out.count(" ok") == 2 * len(names), tty_out
    assert log_err == ""
    n = len(names)
    for i, name in enumerate(names, 1):
        assert f"configuration {i:>{len(str(n))}} of {n}" in tty_err and name in tty_err, tty_err


def test_install_hints_are_one_helper_and_name_the_clone(monkeypatch):
    """numba_flash is not on PyPI: no hint says ``numba_flash[extra]``; each extra it names is
    one of setup.cfg's, from the clone, by the one helper the command line uses too."""
    from numba_flash import install_hints

    assert cli_main.pip_extra is install_hints.pip_extra
    cfg = (ROOT / "setup.cfg").read_text()
    extras = set(re.findall(r"^(\w+) =", cfg.split("[options.extras_require]")[1], re.M))
    for path in (PACKAGE_ROOT / "numba_flash").rglob("*.py"):
        text = path.read_text()
        assert "numba_flash[" not in text, path
        for extra in re.findall(r"pip install (?:-e )?'\.\[(\w+)\]'", text):
            assert extra in extras | {"extra"}, (path, extra)  # "extra": a placeholder
    assert install_hints.pip_extra("test") == "pip install -e '.[test]' (in the numba_flash clone)"


def test_numba_flash_torch_without_torch_names_the_readme_lines(monkeypatch):
    import importlib

    from numba_flash.install_hints import TORCH_CPU

    for name in [m for m in sys.modules if m == "numba_flash.torch"
                 or m.startswith("numba_flash.torch.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(ImportError) as e:
        importlib.import_module("numba_flash.torch")
    msg = str(e.value)
    assert "\n" not in msg and "numba_flash[" not in msg, msg
    assert TORCH_CPU in msg and "pip install '.[torch]' (in the numba_flash clone)" in msg, msg
    readme = _install_commands((ROOT / "README.md").read_text())
    assert shlex.split(TORCH_CPU)[2:] in readme and [".[torch]"] in readme


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
