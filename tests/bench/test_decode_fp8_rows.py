"""bench/decode.py --fp8 in a dry run (the simulator, toy sizes): the e4m3 rows run beside the
float16 and float32 ones, reading 1 byte an element, so the first GPU that is lent can time
the fp8 cache with `python bench/decode.py --fp8 --quick`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_bench_fp8_rows(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--dry-run",
                           "--quick", "--fp8", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    fp8 = [r for r in rows if r.get("dtype") == "e4m3"]
    half = [r for r in rows if r.get("dtype") == "float16" and "GB/s" in r]
    assert len(fp8) == len(half) == 4   # paged and contiguous, two contexts
    assert all(r["GB/s"] > 0 and not any(k.startswith("torch") for k in r) for r in fp8)
