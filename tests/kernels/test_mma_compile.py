"""Compile tier for the tensor-core kernels: the checker flags a configuration marked ``mma``
whose PTX has no ``mma.sync`` (so every tensor-core configuration in the compile tier is proven
to run on the tensor cores), and the primitives' own kernel passes it.  Runs in a subprocess
where ``numba.cuda`` is the real CUDA target (the simulator cannot compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from numba_flash.compile_check import find_ptxas

pytestmark = pytest.mark.compile

SCRIPT = r"""
import json, sys
from numba import cuda, types
from numba_flash.compile_check import build, find_ptxas
from numba_flash.kernels import mma

@cuda.jit
def simt_only(x):
    x[0] = x[0] * types.float32(2.0)

fake = {"name": "not tensor cores", "kernel": simt_only,
        "args": (types.Array(types.float32, 1, "C"),), "float64_ok": False, "mma": True}
real = next(c for c in mma.compile_configs() if c["name"] == "mma fragment")
rows = [build(cfg, [(8, 0)], find_ptxas())[0] for cfg in (fake, real)]
json.dump(rows, sys.stdout)
"""


def test_checker_requires_mma_sync_in_tensor_core_kernels():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: the test extra installs nvidia-cuda-nvcc")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fake, real = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any("mma.sync" in p for p in fake["problems"]), fake["problems"]
    assert real["problems"] == [] and not real["mma_missing"], real["problems"]
