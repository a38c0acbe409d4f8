"""Compile tier for the wgmma stages: the probe kernels of ``numba_flash.kernels.ptx.wgmma`` built
to PTX for ``cc=(9, 0, "a")`` (``.target sm_90a``), assembled by ``ptxas -arch=sm_90a`` and read
back by nvdisasm, in a separate process where ``numba.cuda`` is the real CUDA target.

Each probe must assemble with no spill, no stack frame and at most 48 KiB of static shared
memory, with no ptxas warning (ptxas says when it serialises ``wgmma`` instructions it cannot
prove safe), and its SASS must hold ``WARPGROUP.ARRIVE`` (``wgmma.fence``), exactly the
``HGMMA.64xNx16`` instructions the configuration lists and ``WARPGROUP.DEPBAR`` (the wait).
The same PTX built for plain sm_90 must be refused: the tier is not vacuous.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from numba_flash.tools.compile_check import find_nvidia_tool, find_ptxas
from numba_flash.kernels.core.common import SMEM_LIMIT

pytestmark = pytest.mark.compile

#: run with NUMBA_ENABLE_CUDASIM=0: one JSON row per probe on stdout's last line
BUILD = r"""
import json, os, sys
from numba_flash.tools import compile_check as cc, sass
from numba_flash.tools.catalog import ptx

cache = cc.BuildCache(sys.argv[1])   # the compile tier's cache: one file for all the probes
kept = os.path.join(cache.dir, "wgmma-probes.json")
with cache.lock(kept, True):
    rows = cache.load(kept)
    if rows is not None:
        print(json.dumps(rows))
        sys.exit(0)

ptxas, nvdisasm = cc.find_ptxas(), cc.find_nvidia_tool("nvdisasm")

def assemble(ptx, arch):
    # compile_check.assemble writes -arch=sm_{cc[0]}{cc[1]}: (9, "0a") is sm_90a
    rc, text, listing = cc.assemble(ptx, (9, arch), ptxas, nvdisasm)
    ops = [i.op for i in sass.kernel_instructions(sass.parse(listing))] if listing else []
    return rc, text, ops

rows = []
for cfg in ptx.wgmma_configs():
    ccs = [cfg["cc"]] + ([(9, 0)] if not rows else [])  # the first also for plain sm_90
    ptxs = cc.ptx_for_archs(cfg, ccs)
    ptx = ptxs[cfg["cc"]]
    rc, text, ops = assemble(ptx, "0a")
    rows.append(dict(name=cfg["name"], rc=rc, text=text[-2000:], ops=ops,
                     target=next(l.split()[1] for l in ptx.splitlines()
                                 if l.startswith(".target")),
                     f64=cc.f64_lines(ptx)[:3], hgmma=cfg["hgmma"], **cc.parse_ptxas(text)))
    if len(rows) == 1:  # the negative control: the same kernel for plain sm_90
        rc90, text90, _ = assemble(ptxs[(9, 0)], "0")
        rows.append(dict(name="sm_90 control", rc=rc90, text=text90[-2000:]))
cache.store(kept, rows)
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def rows(compile_cache):
    if find_ptxas() is None or find_nvidia_tool("nvdisasm") is None:
        pytest.fail("ptxas / nvdisasm not found: the test extra installs nvidia-cuda-nvcc and "
                    "nvidia-cuda-nvdisasm")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", BUILD, str(compile_cache)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"the sm_90a build failed:\n{proc.stderr[-4000:]}")
    return {r["name"]: r for r in json.loads(proc.stdout.splitlines()[-1])}


def probe_names():
    from numba_flash.tools.catalog import ptx

    return [cfg["name"] for cfg in ptx.wgmma_configs()]


@pytest.mark.parametrize("name", probe_names())
def test_probe_assembles_for_sm90a_with_its_hgmma(rows, name):
    r = rows[name]
    assert r["rc"] == 0, r["text"]
    assert r["target"] == "sm_90a"
    assert "warning" not in r["text"].lower(), r["text"]  # e.g. wgmma serialisation
    assert not r["spill_stores"] and not r["spill_loads"] and not r["stack"], r
    assert r["smem"] <= SMEM_LIMIT and not r["f64"], r
    ops = Counter(op for op in r["ops"] if op.startswith("HGMMA"))
    want = Counter()
    for n, count in r["hgmma"]:
        want[n] += count
    assert {int(op.split(".")[1].split("x")[1]): c for op, c in ops.items()} == dict(want), ops
    assert all(op.startswith("HGMMA.64x") and ".F32" in op for op in ops), ops
    assert ("BF16" in " ".join(ops)) == ("bfloat16" in name), ops
    assert "WARPGROUP.ARRIVE" in r["ops"] and "WARPGROUP.DEPBAR.LE" in r["ops"], r["ops"]


def test_plain_sm90_refuses_the_wgmma_instructions(rows):
    r = rows["sm_90 control"]
    assert r["rc"] != 0 and "wgmma" in r["text"], r["text"]
