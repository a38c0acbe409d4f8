"""bench/gpu_check.py --dry-run: the one-shot GPU script exercised end to end in the simulator,
so that it runs unchanged the first time a GPU is lent, and writes a record in the format that
docs/performance.md renders.  Its test part (``pytest tests/kernels -k softmax`` in a dry run:
tests this suite runs anyway) is checked apart, collected but not run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), str(tmp_path),
                           "--dry-run", "--ncu", "--record", str(results), "--skip-tests"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for part in ("versions", "ceilings", "bench_forward", "bench_backward", "bench_decode",
                 "ncu"):
        assert part in report and "error" not in report[part], (part, report.get(part))
    assert "tests" not in report  # --skip-tests: test_part_tests_selects_the_kernel_tier
    for name in ("forward", "backward", "decode"):
        assert report[f"bench_{name}"]["rows"], name
    # bench/decode.py as this run ran it (--quick: on a CPU the dry contexts, 16 and 64, so the
    # same run as `decode.py --dry-run --fp8 --mla`): every bandwidth row (float16/float32/e4m3,
    # paged and contiguous), the latency rows and MLA's (bfloat16, e4m3 latent caches), timed
    data = json.loads((tmp_path / "decode.json").read_text())
    if data["dry_run"]:  # no GPU here (on a GPU, --quick is the GPU sweep)
        bw = [r for r in data["rows"] if "GB/s" in r and "heads" not in r]
        lat = [r for r in data["rows"] if "us per call" in r]
        mla = [r for r in data["rows"] if "heads" in r]   # --mla: MLA's latent decode
        assert {(r["dtype"], r["cache"].split("/")[0]) for r in bw} == {
            (dt, c) for dt in ("float16", "float32", "e4m3") for c in ("paged", "contiguous")}
        assert all(r["GB/s"] > 0 and r["ms"] > 0 for r in bw + mla)
        assert {r["dtype"] for r in mla} == {"bfloat16", "e4m3"}
        assert {r["cache"].split("/")[0] for r in lat} == {"paged", "contiguous"}
        assert all(r["B"] == 1 for r in lat)
        assert "| dtype | cache | context |" in "\n".join(report["bench_decode"]["stdout_tail"])
    md = (tmp_path / "gpu_check.md").read_text()
    for heading in ("## forward", "## backward", "## decode", "## as rendered"):
        assert heading in md
    assert "(no rows)" not in md and "no table" not in md
    # the record: <date>-<gpu>.json and latest.json, identical, valid, renderable
    files = sorted(p.name for p in results.iterdir())
    assert "latest.json" in files and len(files) == 2, files
    dated = next(p for p in results.iterdir() if p.name != "latest.json")
    assert dated.name.startswith(report["date"][:10])
    assert dated.read_text() == (results / "latest.json").read_text()
    import gpu_check

    rec = json.loads((results / "latest.json").read_text())
    assert rec["dry_run"] is True and rec["record_format"] == gpu_check.RECORD_FORMAT
    assert gpu_check.validate_record(rec) == []
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--render",
                          str(results / "latest.json")], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert rec["commit"] in out.stdout and "Forward" in out.stdout and "Decode" in out.stdout


def test_part_tests_selects_the_kernel_tier(monkeypatch):
    """The dry run's test part, as the script builds it: its pytest command is run collecting
    only (the softmax kernel tests it selects are tests/kernels', run by this suite), and its
    report has the status and pytest's summary line."""
    import gpu_check

    seen = []
    run = subprocess.run

    def collect_only(args, **kw):
        seen.append(list(args))
        return run([*args, "--collect-only", "-n", "0"], **kw)  # -n 0: after setup.cfg's -n 2

    monkeypatch.setattr(gpu_check.subprocess, "run", collect_only)
    res = gpu_check.part_tests(True, 300)
    assert seen == [[sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels", "-p",
                     "no:cacheprovider", "-k", "softmax"]]
    assert res["returncode"] == 0, res["tail"]
    n = int(res["summary"].split("/")[0].split()[0])  # "34/1500 tests collected (...) in 3s"
    assert n >= 20 and "collected" in res["summary"], res["summary"]
