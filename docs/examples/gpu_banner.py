"""The banner of every page with GPU figures: when, on which GPU and at which commit they were
measured, and which kernel changes came after, so no page shows old figures as today's.

``python docs/examples/gpu_banner.py h200-2026-11-30``   the one session before the record format
                                                       (its figures transcribed by hand)
``python docs/examples/gpu_banner.py latest``            the record bench/results/latest.json

One place holds these facts (:data:`SESSIONS`, :data:`KERNEL_CHANGES`); ``tests/docs/
test_gpu_banner.py`` checks the commits against the repository's history.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "bench" / "results" / "latest.json"

#: sessions whose figures a page quotes without a committed record
SESSIONS = {
    "h200-2026-11-30": {
        "gpu": "NVIDIA H200", "date": "2026-11-30", "commit": "38a7cb7",
        "versions": "numba 0.68.0, numba-cuda 0.30.4, CuPy 14.2, torch 2.11",
        "source": "transcribed by hand from the session's report (its JSON record was not "
                  "committed: the record format came after)",
    },
}

#: changes to the measured kernels, in order: (date, commit, what changed)
KERNEL_CHANGES = [
    ("2026-11-30", "4ae8547", "SIMT forward: 128 threads per block, warp-shuffle row max and sum"),
    ("2026-11-30", "66f3d32", "float16 forward on a new tensor-core kernel (mma.sync)"),
    ("2026-11-30", "b8c350d", "float16 backward on a new tensor-core kernel"),
    ("2026-12-01", "9f8a62e", "SIMT forward and backward: 16-byte shared loads, cp.async copies, "
                              "ex2 (issue 22)"),
]


def changes_since(date):
    """The :data:`KERNEL_CHANGES` dated on or after ``date`` (the test checks that each is a
    later commit than the session's)."""
    return [c for c in KERNEL_CHANGES if c[0] >= date]


def banner(gpu, date, commit, source, versions=None):
    """The banner's lines."""
    text = (f"GPU figures on this page: {gpu}, measured {date} at commit {commit}"
            + (f" ({versions})" if versions else "") + f"; {source}.")
    later = changes_since(date)
    if later:
        text += (" Kernel changes since then, not measured on a GPU: "
                 + "; ".join(f"{what} ({d}, {c})" for d, c, what in later)
                 + ". The figures describe the kernels of that commit, not today's.")
    return textwrap.wrap(text, 96)


def main(which):
    if which == "latest":
        if not RECORD.exists():
            print("GPU figures: no GPU record yet (bench/results/latest.json does not exist).")
            return
        rec = json.loads(RECORD.read_text())
        lines = banner(rec.get("gpu"), rec.get("date"), rec.get("commit"),
                       "from bench/results/latest.json")
    else:
        s = SESSIONS[which]
        lines = banner(s["gpu"], s["date"], s["commit"], s["source"], s["versions"])
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1])
