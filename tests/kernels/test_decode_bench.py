"""bench/decode.py's K/V byte count (the GB/s figure's numerator).  Its dry run end to end (every
bandwidth row, float16/float32, paged/contiguous, and the latency rows) is checked on the run
``bench/gpu_check.py --dry-run`` makes: tests/bench/test_gpu_check_dry_run.py."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kv_bytes_counts_every_live_element_once():
    sys.path.insert(0, str(ROOT / "bench"))
    import decode as bench

    assert bench.kv_bytes(8, 8, 32768, 128, "float16") == 2 * 8 * 8 * 32768 * 128 * 2
