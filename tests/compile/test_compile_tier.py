"""Compile tier: every kernel configuration the package can launch, built to PTX for sm_80 and
sm_90 and assembled by ptxas, in a separate process where ``numba.cuda`` is the real CUDA target
(the simulator cannot compile).  Fails on float64 instructions in float16/float32 kernels, on
register spills and on static shared memory over 48 KiB.  The resource table is printed (run
``pytest tests/compile -s`` or ``NUMBA_ENABLE_CUDASIM=0 python -m numba_flash.compile_check``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from numba_flash.compile_check import all_configs, find_ptxas

pytestmark = pytest.mark.compile

NAMES = [cfg["name"] for cfg in all_configs()]


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    if find_ptxas() is None:
        pytest.fail("ptxas not found: the test extra installs nvidia-cuda-nvcc")
    out = tmp_path_factory.mktemp("ptx") / "rows.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-m", "numba_flash.compile_check", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout)
    if not out.exists():
        pytest.fail(f"compile_check produced no table:\n{proc.stderr[-4000:]}")
    rows = json.loads(out.read_text())
    return {(r["name"], r["cc"]): r for r in rows}


def test_every_kernel_module_lists_configurations():
    from numba_flash.kernels import KERNEL_MODULES
    import importlib
    for mod in KERNEL_MODULES:
        assert list(importlib.import_module(f"numba_flash.kernels.{mod}").compile_configs()), mod


@pytest.mark.parametrize("cc", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", NAMES)
def test_configuration_compiles_clean(table, name, cc):
    row = table[(name, cc)]
    assert row["ptxas_rc"] == 0, row["ptxas_err"]
    assert not row["problems"], "; ".join(row["problems"])


def test_checker_catches_float64(table):
    """The f64 scan is not vacuous: the float64 softmax kernel does use f64 instructions."""
    row = table[(next(n for n in NAMES if n.startswith("softmax") and "float64" in n), "sm_90")]
    assert row["f64"]
