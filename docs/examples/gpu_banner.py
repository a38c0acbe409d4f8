"""The banner of every page with GPU figures: when, on which GPU and at which commit they were
measured, and which kernel changes came after, so no page shows old figures as today's.

``python docs/examples/gpu_banner.py latest``
    the record ``bench/results/latest.json``: its GPU, date, commit and versions, and the listed
    kernel changes that came after it
``python docs/examples/gpu_banner.py h200-2026-11-30``
    the one session before the record format (its figures transcribed by hand), with the kernel
    changes made after it
``python docs/examples/gpu_banner.py h200-2026-11-30 --record latest``
    the same, and which of those changes the latest record has measured since

One place holds these facts (:data:`SESSIONS`, :data:`KERNEL_CHANGES`); ``tests/docs/
test_gpu_banner.py`` checks the commits against the repository's history.
"""

from __future__ import annotations

import argparse
import json
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

#: changes to the measured kernels, in order: (date, commit, what changed); a change made after
#: the latest record's commit goes here too, so that record's banner names it
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
    return [c for c in KERNEL_CHANGES if c[0] >= date[:10]]


def measured_by(record, changes):
    """The ``changes`` a GPU record measured: those dated before the record's day (one made on
    the record's day counts as not measured; the test checks each against git)."""
    return [c for c in changes if c[0] < record["date"][:10]]


def load_record(path=RECORD):
    """The record at ``path``, or None when there is none."""
    return json.loads(Path(path).read_text()) if Path(path).exists() else None


def record_versions(rec):
    """``numba X, numba-cuda Y, CuPy Z, torch W`` from a record's ``versions``."""
    v = rec.get("versions") or {}
    names = [("numba", "numba"), ("numba-cuda", "numba-cuda"), ("cupy", "CuPy"), ("torch", "torch")]
    return ", ".join(f"{shown} {v[key]}" for key, shown in names if v.get(key)) or None


def _list(changes):
    return "; ".join(f"{what} ({d}, {c})" for d, c, what in changes)


def banner(gpu, date, commit, source, versions=None, later_record=None,
           lead="GPU figures on this page"):
    """The banner's lines.  ``later_record``: a GPU record made after this session, which
    measured (some of) the kernel changes listed."""
    text = (f"{lead}: {gpu}, measured {date} at commit {commit}"
            + (f" ({versions})" if versions else "") + f"; {source}.")
    later = changes_since(date)
    if later and later_record is None:
        text += (" Kernel changes since then, not measured on a GPU: " + _list(later)
                 + ". The figures describe the kernels of that commit, not today's.")
    elif later:
        done = measured_by(later_record, later)
        text += (" Kernel changes since then: " + _list(later) + ". The figures describe the "
                 "kernels of that commit, not today's.")
        rc = later_record["commit"]
        where = f"on {later_record['date'][:10]} at commit {rc} (bench/results/latest.json)"
        if len(done) == len(later):
            text += (f" The kernels of commit {rc}, which has all of these changes, were "
                     f"measured on {later_record['date'][:10]} (bench/results/latest.json).")
        elif done:
            text += (f" Measured {where}: {_list(done)}; not measured on a GPU: "
                     + _list([c for c in later if c not in done]) + ".")
        else:
            text += " None of these changes has been measured on a GPU."
    return textwrap.wrap(text, 96)


def latest_banner(rec):
    """The banner of the latest record: its GPU, date, commit and versions, and the listed kernel
    changes made after it (or that none is listed)."""
    text = (f"Latest GPU record (bench/results/latest.json): {rec.get('gpu')}, measured "
            f"{rec.get('date')} at commit {rec.get('commit')}")
    versions = record_versions(rec)
    text += (f" ({versions})." if versions else ".")
    after = [c for c in changes_since(rec["date"]) if c not in measured_by(rec, [c])]
    if after:
        text += (" Kernel changes since then, not measured on a GPU: " + _list(after) + ".")
    else:
        text += (" No kernel change since that commit is listed here (`git log "
                 f"{rec.get('commit')}..HEAD -- numba_flash` shows any).")
    return textwrap.wrap(text, 96)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("which", choices=["latest", *sorted(SESSIONS)])
    ap.add_argument("--record", choices=["latest"],
                    help="with a session: say which later changes that record measured")
    args = ap.parse_args(argv)
    if args.which == "latest":
        rec = load_record()
        if rec is None:
            print("GPU figures: no GPU record yet (bench/results/latest.json does not exist).")
            return
        lines = latest_banner(rec)
    else:
        s = SESSIONS[args.which]
        rec = load_record() if args.record else None
        if rec is not None:
            lines = banner(s["gpu"], s["date"], s["commit"], s["source"], s["versions"],
                           later_record=rec, lead="Older GPU figures on this page")
        else:
            lines = banner(s["gpu"], s["date"], s["commit"], s["source"], s["versions"])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
