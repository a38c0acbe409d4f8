"""The compile tier's selection and its one build (shared by tests/compile's modules).

``table()`` runs ``python -m numba_flash.tools.compile_check --sass --suite --json`` once per test
process, in a process where ``numba.cuda`` is the real CUDA target (the simulator cannot
compile), with no wall-clock limit: a slow or busy machine makes the tier slower, never red.
Its builds are kept in a :class:`numba_flash.tools.compile_check.BuildCache` under pytest's cache
directory (``.pytest_cache/d/compile-tier``, keyed by the package's sources and the
toolchain's versions): a second run on the same checkout rebuilds nothing, and the xdist
workers that need the table at once build disjoint configurations (a build in progress is
locked; the others take another one first), each with the cores the workers leave it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from numba_flash.tools.compile_check import (
    all_configs, arch_name, find_ptxas, goal_config, wgmma_goal_config,
)

#: the suite's selection (compile_check.in_suite); `numba-flash compile-check` builds them all
SUITE = list(all_configs(suite=True))
NAMES = [cfg["name"] for cfg in SUITE]
#: (name, arch) of every build: sm_80 and sm_90, or the configuration's own target (sm_90a; in
#: the suite, sm_90 for every kernel but the mma.sync ones: compile_check.suite_target)
BUILDS = [(cfg["name"], arch) for cfg in SUITE
          for arch in ([arch_name(cfg["cc"])] if "cc" in cfg else ["sm_80", "sm_90"])]
#: the architecture whose SASS each configuration's row counts
SASS_ARCH = {cfg["name"]: arch_name(cfg["cc"]) if "cc" in cfg else "sm_90" for cfg in SUITE}
#: the configurations the static goals hold, by their fields (compile_check.goal_config)
GOALS = {cfg["name"]: cfg for cfg in SUITE if goal_config(cfg.get("config"))}
#: the warpgroup forward's goal builds (sm_90a)
WGMMA_GOALS = {cfg["name"]: cfg for cfg in SUITE if wgmma_goal_config(cfg.get("config"))}


def build_jobs():
    """Build processes for this test process: the machine's cores shared by the xdist workers
    (each may be building at once)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers)


def build_table(cache_dir, out):
    """``{(name, arch): row}`` of the suite's selection, built (or read from ``cache_dir``)."""
    if find_ptxas() is None:
        pytest.fail("ptxas not found: the test extra installs nvidia-cuda-nvcc")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-m", "numba_flash.tools.compile_check", "--sass",
                           "--suite", "--json", str(out), "--cache", str(cache_dir),
                           "--jobs", str(build_jobs())],
                          env=env, capture_output=True, text=True)
    print(proc.stdout)
    if not out.exists():
        pytest.fail(f"compile_check produced no table:\n{proc.stderr[-4000:]}")
    rows = json.loads(out.read_text())
    return {(r["name"], r["cc"]): r for r in rows}
