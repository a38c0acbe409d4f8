"""bench/decode.py runs end to end on its dry path (the simulator at toy sizes), so that it runs
unchanged the first time a GPU is lent: every bandwidth row (float16/float32, paged/contiguous)
and the latency rows come out, with the K/V byte count the GB/s figure uses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_bench_dry_run(tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "decode.py"), "--dry-run",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["dry_run"] is True
    bw = [r for r in data["rows"] if "GB/s" in r]
    lat = [r for r in data["rows"] if "us per call" in r]
    assert {(r["dtype"], r["cache"].split("/")[0]) for r in bw} == {
        (dt, c) for dt in ("float16", "float32") for c in ("paged", "contiguous")}
    assert all(r["GB/s"] > 0 and r["ms"] > 0 for r in bw)
    assert {r["cache"].split("/")[0] for r in lat} == {"paged", "contiguous"}
    assert all(r["B"] == 1 for r in lat)
    assert "| dtype | cache | context |" in proc.stdout


def test_kv_bytes_counts_every_live_element_once():
    sys.path.insert(0, str(ROOT / "bench"))
    import decode as bench

    assert bench.kv_bytes(8, 8, 32768, 128, "float16") == 2 * 8 * 8 * 32768 * 128 * 2
