"""bench/tensor_cores.py runs end to end (in the simulator: one tiny row per pass, both kernels)
and writes its rows as JSON; on a GPU it is the benchmark itself, not a test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numba_flash

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tensor_core_bench_runs(tmp_path):
    if numba_flash.backend() != "simulator":
        import pytest

        pytest.skip("on a GPU this is the full benchmark")
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tensor_cores.py"),
                           "--json", str(out)], capture_output=True, text=True,
                          env=dict(os.environ, NUMBA_ENABLE_CUDASIM="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["pass"] for r in rows] == ["forward", "backward"]
    for r in rows:
        assert r["mma TFLOP/s"] > 0 and r["simt TFLOP/s"] > 0 and r["backend"] == "simulator"
    assert "SIMULATOR" in proc.stdout
