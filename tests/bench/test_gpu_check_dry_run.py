"""bench/gpu_check.py --dry-run: the one-shot GPU check exercised end to end in the simulator, so
that it runs unchanged the first time a GPU is lent, prints its plan of device time, and writes a
report, a bundle and a record in the format docs/performance.md renders.  Its test part
(``pytest tests/kernels -k softmax`` in a dry run: tests this suite runs anyway) is checked
apart, collected but not run; tests/bench/test_gpu_check_parts.py runs the test part on a few
tests of its own."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    import gpu_check

    results, out = tmp_path / "results", tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"),
                           str(tmp_path / "work"), "--dry-run", "--record", str(results),
                           "--skip-tests", "--copy-to", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    # the plan of device time, printed first, sums to 9 minutes or less
    total = re.search(r"^  total\s+(\d+) s", proc.stdout, re.M)
    assert total and int(total.group(1)) == gpu_check.plan_total() <= 540, proc.stdout[:3000]
    report = json.loads((tmp_path / "work" / "gpu_check.json").read_text())
    # every part of the plan is in the report with a status; each ran but the tests (skipped
    # here), the windowed rows (budget 0) and host_overhead (another issue's script)
    statuses = {name: report[name]["status"] for name, _, _ in gpu_check.PLAN}
    expected = {name: "ok" for name in statuses}
    expected.update(tests="skipped", bench_windowed="skipped")
    host = statuses.pop("host_overhead")
    expected.pop("host_overhead")
    assert statuses == expected, {n: report[n].get("log_tail") for n in statuses
                                  if statuses[n] != expected[n]}
    assert host in ("ok", "not built yet"), report["host_overhead"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [p[0] for p in report["plan"]["parts"]] == [n for n, _, _ in gpu_check.PLAN]
    for name in ("forward", "backward", "decode", "wgmma"):
        assert report[f"bench_{name}"]["rows"], name
    # bench/decode.py as this run ran it (--quick: on a CPU the dry contexts, 16 and 64, so the
    # same run as `decode.py --dry-run --fp8 --mla`): every bandwidth row (float16/float32/e4m3,
    # paged and contiguous), the latency rows and MLA's (bfloat16, e4m3 latent caches), timed
    data = json.loads((tmp_path / "work" / "parts" / "bench_decode.json").read_text())
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
    # the warm-up resolved its configurations; the other issues' checks wrote their rows
    assert report["warmup"]["by_source"] == {"simulator": 6}
    assert {r["cache"] for r in report["decode_latency"]["rows"]} == {"paged/4", "contiguous"}
    assert [r["case"] for r in report["per_call"]["rows"]] == [
        "forward_f16_d64", "forward_f16_d128", "backward_f16_d64"]
    assert report["kvcache_32k"]["rows"][0]["us per call"] > 0
    assert report["first_call"]["warm"]["first_call_s"] > 0
    assert report["first_call"]["cold"]["first_call_s"] > 0
    # ncu and compute-sanitizer: their command lines printed, their targets run in the simulator
    import gpu_targets

    assert report["ncu"]["target"]["cases"] == list(gpu_targets.NCU_CASES)
    assert set(report["ncu"]["commands"]) == set(gpu_targets.NCU_CASES)
    assert re.search(r"would run: \S*ncu --target-processes all --clock-control none",
                     proc.stdout)
    assert "--section WarpStateStats" in proc.stdout and "--page raw" in proc.stdout
    assert report["sanitizer"]["target"] == {c: "ok" for c in gpu_targets.SANITIZER_CASES}
    assert re.search(r"would run: \S*compute-sanitizer --tool racecheck", proc.stdout)
    md = (tmp_path / "work" / "gpu_check.md").read_text()
    for heading in ("## The plan", "## forward", "## backward", "## decode", "## as rendered"):
        assert heading in md
    assert "(no rows)" not in md and "no table" not in md
    # what comes back from a lent machine: a few files, the bundle holding every log
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md",
                                                     "gpu_check.tar.gz"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = tar.getnames()
    assert {f"logs/{n}.log" for n in ("versions", "warmup", "bench_decode", "ncu",
                                      "sanitizer")} <= set(names)
    assert "parts/warmup_events.jsonl" in names
    # the record: <date>-<gpu>.json and latest.json, identical, valid, renderable
    files = sorted(p.name for p in results.iterdir())
    assert "latest.json" in files and len(files) == 2, files
    dated = next(p for p in results.iterdir() if p.name != "latest.json")
    assert dated.name.startswith(report["date"][:10])
    assert dated.read_text() == (results / "latest.json").read_text()
    rec = json.loads((results / "latest.json").read_text())
    assert rec["dry_run"] is True and rec["record_format"] == gpu_check.RECORD_FORMAT
    assert gpu_check.validate_record(rec) == []
    md = gpu_check.render_record(rec)
    assert rec["commit"] in md and "Forward" in md and "Decode" in md


def test_tests_command_collects_the_kernel_tier(tmp_path):
    """The dry run's test part, as the script builds it, collecting only (the softmax kernel
    tests it selects are tests/kernels', run by this suite): the plugin's options parse, its
    selection keeps tests/kernels."""
    import gpu_check

    cmd = gpu_check.tests_command(True, tmp_path / "events.jsonl", tmp_path / "junit.xml", 2)
    assert cmd[:4] == [sys.executable, "-m", "pytest", "-p"] and cmd[-1] == "tests/kernels"
    for flag in ("--gpu-check-select", "-rA", "-v", f"--junitxml={tmp_path / 'junit.xml'}",
                 "--gpu-check-restart-on-sticky"):
        assert flag in cmd
    assert cmd[cmd.index("-k") + 1] == "softmax" and cmd[cmd.index("-n") + 1] == "2"
    env = dict(__import__("os").environ, PYTHONPATH=str(ROOT / "bench"))
    i = cmd.index("-n")
    run = subprocess.run([*cmd[:i], *cmd[i + 2:], "--collect-only", "-q", "-n", "0"],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    m = re.search(r"(\d+)/\d+ tests collected", run.stdout)   # "39/1327 tests collected (...)"
    assert m and int(m.group(1)) >= 20, run.stdout[-2000:]
    events = [json.loads(ln) for ln in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "begin" and any(e["event"] == "collected" for e in events)
