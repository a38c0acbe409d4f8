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

from numba_flash.tools.compile_check import find_ptxas

pytestmark = pytest.mark.compile

SCRIPT = r"""
import json, sys
from numba import cuda, types
from numba_flash.tools.compile_check import build, find_ptxas
from numba_flash.tools.catalog import ptx as catalog_ptx

@cuda.jit
def simt_only(x):
    x[0] = x[0] * types.float32(2.0)

fake = {"name": "not tensor cores", "kernel": simt_only,
        "args": (types.Array(types.float32, 1, "C"),), "float64_ok": False, "mma": True}
real = next(c for c in catalog_ptx.mma_configs() if c["name"] == "mma fragment")
rows = [build(cfg, [(8, 0)], find_ptxas())[0] for cfg in (fake, real)]
json.dump(rows, sys.stdout)
"""


def test_checker_requires_mma_sync_in_tensor_core_kernels():
    if find_ptxas() is None:
        pytest.fail("ptxas not found: the test extra installs nvidia-cuda-nvcc")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fake, real = json.loads(proc.stdout.strip().splitlines()[-1])
    assert any("mma.sync" in p for p in fake["problems"]), fake["problems"]
    assert real["problems"] == [] and not real["mma_missing"], real["problems"]


BF16_SCRIPT = r"""
import json, sys
from numba_flash.tools.compile_check import build, find_ptxas, ptx_for_archs
from numba_flash.tools.catalog import ptx as catalog_ptx

out = []
for name in ("mma fragment bfloat16", "mma warp_gemm K64 bfloat16"):
    cfg = next(c for c in catalog_ptx.mma_configs() if c["name"] == name)
    ptx = ptx_for_archs(cfg, [(8, 0)])[(8, 0)]
    row = build(cfg, [(8, 0), (9, 0)], find_ptxas())
    out.append({"name": name, "ptx": ptx, "problems": [r["problems"] for r in row],
                "rc": [r["ptxas_rc"] for r in row]})
json.dump(out, sys.stdout)
"""


def test_bfloat16_intrinsics_assemble():
    """The bfloat16 mma and pack (``mma.sync ... .bf16.bf16``, ``cvt.rn.bf16x2.f32``) in the
    PTX of their kernels, assembled by ptxas for sm_80 and sm_90 with no problem."""
    if find_ptxas() is None:
        pytest.fail("ptxas not found: the test extra installs nvidia-cuda-nvcc")
    from numba_flash.kernels.ptx.mma import MMA_BF16_PTX, PACK_BF16_PTX

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", BF16_SCRIPT], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    frag, gemm = json.loads(proc.stdout.strip().splitlines()[-1])
    for row in (frag, gemm):
        assert row["rc"] == [0, 0] and row["problems"] == [[], []], row["problems"]
        assert MMA_BF16_PTX in row["ptx"] and ".f16.f16" not in row["ptx"], row["name"]
    assert PACK_BF16_PTX in gemm["ptx"] and "cvt.rn.f16x2" not in gemm["ptx"]
