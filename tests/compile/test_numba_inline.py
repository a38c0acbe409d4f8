"""numba_flash.numba_inline: the inliner without numba-cuda's copies builds the same PTX.

A kernel whose stages are ``inline="always"`` device functions (the SIMT backward's row-mass
kernel: tiles, scores, a mask, the online row sums) is built to PTX in two fresh processes where
``numba.cuda`` is the real CUDA target: one with the patch installed (the package's default),
one with ``NUMBA_FLASH_INLINE_COPY=1`` (numba-cuda's own inliner).  The PTX must be the same
text, the order of numba's environment declarations aside (it varies between any two runs).
When the patch came in, the compile tier's whole table was compared the same way (198 builds,
identical rows) and the PTX of seven of its largest configurations (SIMT, mma.sync and wgmma
forwards, decode with a user's variant, MLA decode, the tensor-core dQ).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.compile

NAME = "backward row_mass M32 N32 D64 float32"

#: run with NUMBA_ENABLE_CUDASIM=0: prints {"installed": bool, "ptx": sha256 of the PTX}
BUILD = r"""
import hashlib, json, sys
from numba_flash import numba_inline
from numba_flash.tools import compile_check as cc

cfg = next(c for c in cc.all_configs(suite=True) if c["name"] == sys.argv[1])
ptx = cc.ptx_for_archs(cfg, [(9, 0)])[(9, 0)]
# numba's module-scope environment declarations come in an order that varies from run to run
# (with or without the patch): compared as a set, the rest line by line
lines = ptx.splitlines()
env = sorted(x for x in lines if x.startswith(".common .global"))
ptx = "\n".join(env + [x for x in lines if not x.startswith(".common .global")])
print(json.dumps({"installed": numba_inline.installed(), "lines": len(ptx.splitlines()),
                  "ptx": hashlib.sha256(ptx.encode()).hexdigest()}))
"""


def _build(copy):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0", NUMBA_FLASH_CACHE="0",
               NUMBA_FLASH_INLINE_COPY="1" if copy else "0")
    proc = subprocess.run([sys.executable, "-c", BUILD, NAME], env=env, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_inliner_without_copies_builds_the_same_ptx():
    fast, copying = _build(copy=False), _build(copy=True)
    assert fast["installed"] and not copying["installed"]
    assert fast["lines"] > 500   # a real kernel, its stages inlined
    assert fast["ptx"] == copying["ptx"]

