"""bench/gpu_check.py --dry-run: the one-shot GPU script exercised end to end in the simulator,
so that it runs unchanged the first time a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), str(tmp_path),
                           "--dry-run"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for part in ("versions", "ceilings", "tests", "bench_forward", "bench_backward",
                 "bench_decode"):
        assert part in report and "error" not in report[part], (part, report.get(part))
    assert report["tests"]["returncode"] == 0
    for name in ("forward", "backward", "decode"):
        assert report[f"bench_{name}"]["rows"], name
    md = (tmp_path / "gpu_check.md").read_text()
    for heading in ("## forward", "## backward", "## decode"):
        assert heading in md
    assert "(no rows)" not in md and "no table" not in md
