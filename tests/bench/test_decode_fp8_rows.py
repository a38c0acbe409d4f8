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


def test_the_record_needs_no_peer_for_e4m3_rows():
    """gpu_check's record format: an e4m3 decode row measured on a GPU with torch installed is
    complete without a peer column (torch has no fp8 cache to compare with); a float16 row is
    not."""
    import gpu_check

    rec = {"record_format": 1, "date": "d", "commit": "c", "gpu": "g", "dry_run": False,
           "versions": {"torch": "2.13.0"}, "ceilings": {"copy_GBps": 4000.0},
           "bench_forward": {"rows": [{"dtype": "float16", "d": 64, "causal": False, "N": 1,
                                       "TFLOP/s": 1.0, "torch TFLOP/s": 1.0}]},
           "bench_backward": {"rows": [{"dtype": "float16", "d": 64, "causal": False, "N": 1,
                                        "TFLOP/s": 1.0, "torch TFLOP/s": 1.0}]},
           "bench_decode": {"rows": [{"dtype": "e4m3", "cache": "paged/16", "context": 4096,
                                      "GB/s": 1.0, "% copy": 1.0}]}}
    assert gpu_check.validate_record(rec) == []
    rec["bench_decode"]["rows"][0]["dtype"] = "float16"
    assert gpu_check.validate_record(rec) == ["bench_decode.rows[0] has no 'peer GB/s'"]
