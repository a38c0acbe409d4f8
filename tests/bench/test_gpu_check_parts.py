"""bench/gpu_check.py's plan and part runner, apart from a whole dry run: the plan fits a lent
session, a part stopped by its budget keeps what it wrote, the test part names every test (also
when stopped), the Nsight Compute and compute-sanitizer parts' commands and readers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest

import gpu_check as gc
import gpu_check_pytest
import part_runner

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


def test_the_plan_fits_a_lent_session(capsys):
    names = [n for n, _, _ in gc.PLAN]
    assert len(names) == len(set(names)) and names[-1] == "bundle"
    assert all(isinstance(s, int) and s >= 0 for _, s, _ in gc.PLAN)
    assert gc.plan_total() == sum(s for _, s, _ in gc.PLAN) <= gc.TOTAL_S == 540
    # the parts the issue asks for, in its order: warm-up, tests, benchmarks, ncu, sanitizer
    order = [names.index(n) for n in ("warmup", "tests", "bench_forward", "ncu", "sanitizer")]
    assert order == sorted(order)
    assert {"host_overhead", "decode_latency", "per_call", "first_call", "kvcache_32k"} <= set(
        names)
    assert gc.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert f"total            {gc.plan_total()} s" in out and all(n in out for n in names)
    budgets, given = gc.parse_budgets(["tests=200", "windowed=40"])
    assert budgets["tests"] == 200 and budgets["bench_windowed"] == 40
    assert given == {"tests", "bench_windowed"}
    with pytest.raises(SystemExit, match="--budget"):
        gc.parse_budgets(["nothing=3"])


def _alive(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:
        return False


def test_a_part_stopped_by_its_budget_keeps_its_output(tmp_path):
    """A command that prints, writes a file and then hangs (with a child of its own) is stopped
    at the part's budget: the part is ``timeout``, its log keeps what was printed, the file what
    was written, and the child is gone too."""
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        open({str(tmp_path / 'partial.json')!r}, "w").write('{{"rows": [1]}}')
        print('{{"dtype": "float16", "N": 4096, "TFLOP/s": 1.0}}', flush=True)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(tmp_path / 'child.pid')!r}, "w").write(str(child.pid))
        time.sleep(600)
        """)
    res = {}
    pr = part_runner.PartRun("fake", tmp_path, False, 6, res)
    st = pr.step("sleeper", [sys.executable, "-c", code])
    pr.finish()
    assert st["returncode"] == "timeout" and res["status"] == "timeout"
    assert res["seconds"] <= 6 + 11   # SIGINT before the budget, SIGKILL at most 10 s later
    assert any('"TFLOP/s": 1.0' in line for line in res["log_tail"])
    assert "(stopped at its limit of 6 s)" in res["log_tail"][-1]
    assert json.loads((tmp_path / "partial.json").read_text()) == {"rows": [1]}
    gc.recover_rows(res, "bench_forward", res["log_tail"])   # a benchmark's printed rows
    assert res["rows"] == [{"dtype": "float16", "N": 4096, "TFLOP/s": 1.0}]
    if (tmp_path / "child.pid").exists():   # started before the limit: killed with its group
        pid = int((tmp_path / "child.pid").read_text())
        for _ in range(50):   # a zombie until init reaps it
            if not _alive(pid):
                break
            time.sleep(0.1)
        assert not _alive(pid)
    # a step that finds no time left is not started
    assert pr.step("late", [sys.executable, "-c", "pass"])["returncode"] == "no time left"


def test_forked_commands_run_and_stop_like_processes(tmp_path):
    """A dry run's forked commands (no new interpreter): output, exit status, the limit."""
    script = tmp_path / "script.py"
    script.write_text("import sys, time\nprint('argv', sys.argv[1:], flush=True)\n"
                      "if sys.argv[1] == 'sleep':\n    time.sleep(600)\nsys.exit(3)\n")
    driver = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(BENCH)!r})
        import part_runner
        log = {str(tmp_path / 'log')!r}
        a = part_runner.run_logged([sys.executable, {str(script)!r}, 'exit'], log, fork=True)
        b = part_runner.run_logged([sys.executable, {str(script)!r}, 'sleep'], log, 3, fork=True)
        print(json.dumps([a["returncode"], b["returncode"]]))
        """)
    out = subprocess.run([sys.executable, "-c", driver], capture_output=True, text=True,
                         timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [3, "timeout"], out.stderr
    log = (tmp_path / "log").read_text()
    assert "argv ['exit']" in log and "argv ['sleep']" in log and "KeyboardInterrupt" in log


FAKE_TESTS = '''
import os

PIDS = os.environ["FAKE_PIDS"]


def test_a_passes():
    open(os.path.join(PIDS, "a"), "w").write(str(os.getpid()))


def test_b_fails():
    assert 1 == 2, "b is wrong"


def test_c_spoils_the_context():
    raise RuntimeError("[716] Call to cuMemcpyDtoH results in CUDA_ERROR_MISALIGNED_ADDRESS")


def test_d_runs_after_it():
    open(os.path.join(PIDS, "d"), "w").write(str(os.getpid()))
'''


def test_the_test_part_names_every_test(tmp_path):
    """The test part on tests of its own (pytest-xdist, one worker): every test named with its
    outcome and message, pytest's junit XML and -rA summary kept, and the test after a CUDA
    error that spoils the context run in a fresh worker."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "test_fake.py").write_text(FAKE_TESTS)
    pids = tmp_path / "pids"
    pids.mkdir()
    work = tmp_path / "work"
    env = dict(os.environ, FAKE_PIDS=str(pids))
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), str(work), "--dry-run",
                           "--only", "tests", "--test-paths", str(fake), "--jobs", "1"],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    t = json.loads((work / "gpu_check.json").read_text())["tests"]
    assert proc.returncode == 1 and t["status"] == "failed", proc.stdout[-3000:]
    assert t["collected"] == 4 and t["finished"] is True
    assert t["counts"] == {"passed": 2, "failed": 2}, t["counts"]
    bad = {item["nodeid"].split("::")[-1]: item for item in t["not_passed"]}
    assert set(bad) == {"test_b_fails", "test_c_spoils_the_context"}
    assert "b is wrong" in bad["test_b_fails"]["message"]
    assert bad["test_c_spoils_the_context"]["sticky_cuda_error"] == \
        "CUDA_ERROR_MISALIGNED_ADDRESS"
    assert bad["test_c_spoils_the_context"]["worker_crashed"] is True
    # the worker that ran c stopped after it: d ran in another process than a
    assert (pids / "a").read_text() != (pids / "d").read_text()
    assert t["junit"] == "tests/junit.xml" and "junit_from" not in t
    junit = (work / "tests" / "junit.xml").read_text()
    assert "test_b_fails" in junit and "test_d_runs_after_it" in junit
    assert any(line.startswith("FAILED") and "test_b_fails" in line
               for line in t["short_summary"])
    assert "failed" in t["summary"] and "tests: " in proc.stdout
    with tarfile.open(work / "gpu_check.tar.gz") as tar:
        assert {"tests/events.jsonl", "tests/junit.xml", "logs/tests.log"} <= set(
            tar.getnames())


def test_a_stopped_test_run_still_names_its_tests(tmp_path):
    """The events of a pytest run killed mid-test (no ``finish``, no junit XML): the finished
    tests keep their outcomes, the running one is named, and a junit XML is made from them."""
    ev = [{"event": "begin"}, {"event": "collected", "n": 5},
          {"event": "start", "nodeid": "t.py::a"},
          {"event": "report", "nodeid": "t.py::a", "when": "setup", "outcome": "passed"},
          {"event": "report", "nodeid": "t.py::a", "when": "call", "outcome": "passed",
           "duration": 0.5, "worker": "gw0"},
          {"event": "start", "nodeid": "t.py::b"},
          {"event": "report", "nodeid": "t.py::b", "when": "setup", "outcome": "failed",
           "longrepr": "Traceback\n    x = f()\nValueError: no fixture"},
          {"event": "start", "nodeid": "t.py::c[1]"},
          {"event": "report", "nodeid": "t.py::c[1]", "when": "setup", "outcome": "skipped",
           "reason": "needs a CUDA GPU"},
          {"event": "start", "nodeid": "t.py::d"},
          {"event": "report", "nodeid": "t.py::d", "when": "setup", "outcome": "passed"}]
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in ev) + '\n{"event": "rep')   # cut short
    summ = gpu_check_pytest.summarize_events(gpu_check_pytest.read_events(path))
    assert summ["collected"] == 5 and summ["finished"] is False
    out = {k: v["outcome"] for k, v in summ["tests"].items()}
    assert out == {"t.py::a": "passed", "t.py::b": "error", "t.py::c[1]": "skipped",
                   "t.py::d": "running when stopped"}
    assert summ["tests"]["t.py::b"]["message"] == "ValueError: no fixture"
    gc.write_junit(summ, tmp_path / "junit.xml")
    import xml.etree.ElementTree as ET

    suite = ET.parse(tmp_path / "junit.xml").getroot()[0]
    assert suite.get("tests") == "4" and suite.get("errors") == "2"
    assert [c.get("name") for c in suite] == ["a", "b", "c[1]", "d"]


def test_gpu_test_selection():
    assert gpu_check_pytest.selected("tests/kernels/test_x.py::t", {"t"})
    assert not gpu_check_pytest.selected("tests/kernels/test_x.py::t", {"compile"})
    assert gpu_check_pytest.selected("tests/torch/test_cuda.py::t", {"gpu"})
    assert not gpu_check_pytest.selected("tests/torch/test_cuda.py::t", {"t"})
    paths = gc.gpu_test_paths()
    assert paths[0] == "tests/kernels" and "tests/torch/test_cuda.py" in paths
    assert not any(p.startswith("tests/kernels/") for p in paths)


def test_ncu_commands_and_kernel_time():
    import gpu_targets

    cmd = gc.ncu_profile_command("ncu", "backward_f16_d64", "ncu/backward_f16_d64")
    i = cmd.index("--kernel-name")
    assert cmd[i + 1] == "regex:backward_dkdv_mma|backward_dq_mma"
    assert cmd[cmd.index("--launch-skip") + 1] == "0"
    assert cmd[cmd.index("--launch-count") + 1] == "2"
    assert cmd[cmd.index("--clock-control") + 1] == "none"   # leave the card's clocks alone
    sections = [cmd[j + 1] for j, c in enumerate(cmd) if c == "--section"]
    assert {"WarpStateStats", "MemoryWorkloadAnalysis", "SourceCounters", "LaunchStats",
            "Occupancy", "SpeedOfLight"} <= set(sections)
    assert cmd[-4:] == [str(BENCH / "gpu_targets.py"), "ncu", "--case", "backward_f16_d64"]
    pages = [c[c.index("--page") + 1] for _, c in gc.ncu_import_commands("ncu", "r.ncu-rep")]
    assert pages == ["raw", "details", "source"]
    assert set(gpu_targets.PER_CALL_CASES) <= set(gpu_targets.NCU_CASES)
    assert gc._duration_ms("1,286,112 ns") == pytest.approx(1.286112)
    assert gc._duration_ms("328.5 usecond") == pytest.approx(0.3285)
    assert gc._duration_ms("2.5 ms") == 2.5 and gc._duration_ms("?") is None
    report = {"per_call": {"rows": [{"case": "backward_f16_d64", "ms per call": 4.0}]},
              "ncu": {"kernels": [
                  {"case": "backward_f16_d64", "kernel": "backward_dkdv_mma",
                   "duration": "2,000,000 ns"},
                  {"case": "backward_f16_d64", "kernel": "backward_dq_mma", "duration": "1 ms"},
                  {"case": "forward_f16_d64", "kernel": "flash_forward_mma",
                   "duration": "1 ms"}]}}
    gc.join_per_call(report)
    row = report["per_call"]["rows"][0]
    assert row["ncu kernel ms"] == pytest.approx(3.0)
    assert row["kernel share of the call"] == pytest.approx(0.75)
    assert row["ncu kernels"] == ["backward_dkdv_mma", "backward_dq_mma"]


SANITIZER_LOG = """\
========= COMPUTE-SANITIZER
case start: forward_simt
case done: forward_simt ok
case start: forward_mma
========= Invalid __global__ read of size 16 bytes
=========     at flash_forward_mma+0x1a0
=========     by thread (3,0,0) in block (0,0,0)
case done: forward_mma error CudaAPIError: [719] CUDA_ERROR_LAUNCH_FAILED
case start: decode_split_kv
"""


def test_sanitizer_findings_are_filed_under_their_case():
    found, summary = gc.parse_sanitizer(SANITIZER_LOG + "========= ERROR SUMMARY: 1 error\n")
    assert found["forward_simt"] == {"status": "ok", "findings": [], "errors": 0}
    assert found["forward_mma"]["errors"] == 1 and len(found["forward_mma"]["findings"]) == 3
    assert found["forward_mma"]["status"].startswith("error CudaAPIError")
    assert found["decode_split_kv"]["status"] == "started"
    assert summary == ["========= ERROR SUMMARY: 1 error"]
    # the process ended in decode_split_kv: named, and the cases after it run in a fresh one
    results = {}
    left = ["forward_simt", "forward_mma", "decode_split_kv", "mla", "merge"]
    assert gc.sanitizer_next(results, left, found, 1) == ["mla", "merge"]
    assert results["decode_split_kv"]["status"].startswith("the process ended in this case")
    # stopped at the limit: the running case says so, the others were not run
    results = {}
    assert gc.sanitizer_next(results, left, found, "timeout") == []
    assert results["decode_split_kv"]["status"] == "stopped at the limit"
    assert results["merge"]["status"] == "not run: no time left"


def test_bundle_leaves_out_the_largest_files_past_its_limit(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "small.log").write_text("x" * 100)
    (tmp_path / "big.ncu-rep").write_bytes(os.urandom(200_000))
    (tmp_path / "other.csv").write_bytes(os.urandom(50_000))
    res = part_runner.bundle(tmp_path, "b.tar.gz", max_bytes=120_000)
    assert res["left_out"] == ["big.ncu-rep"] and res["files"] == 2
    with tarfile.open(tmp_path / "b.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["logs/small.log", "other.csv"]
    res = part_runner.bundle(tmp_path, "c.tar.gz", exclude=(".ncu-rep",))
    assert res["files"] == 2 and res["left_out"] == []


def test_a_record_of_the_plan_renders_its_failing_tests():
    from test_gpu_record import measured_record

    rec = measured_record()
    rec["record_format"] = gc.RECORD_FORMAT
    rec["tests"] = {"status": "failed", "summary": "1 failed, 2 passed in 80.0s",
                    "counts": {"passed": 2, "failed": 1}, "not_passed": [
                        {"nodeid": "tests/kernels/test_x.py::test_y[a|b]", "outcome": "failed",
                         "message": "AssertionError: o differs"}]}
    rec["ncu"] = {"kernels": [{"case": "backward_f16_d64", "kernel": "backward_dq_mma",
                               "duration": "1 ms"}]}
    assert gc.validate_record(rec) == []
    md = gc.render_record(rec)
    assert "Tests on the device (failed): 1 failed, 2 passed in 80.0s" in md
    assert "| failed | `tests/kernels/test_x.py::test_y[a\\|b]` | AssertionError: o differs |" in md
    assert "| case | kernel |" in md and "| backward_f16_d64 | backward_dq_mma |" in md


def test_parts_past_the_total_are_skipped_and_reported(tmp_path):
    """``--total``: a part that would start after the plan's total is not started; every part
    is still in the report, with why."""
    proc = subprocess.run([sys.executable, str(BENCH / "gpu_check.py"), str(tmp_path),
                           "--dry-run", "--only", "versions,ceilings", "--total", "1"],
                          capture_output=True, text=True, cwd=ROOT)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["versions"]["status"] == "skipped", proc.stdout[-2000:]
    assert "total of 1.0 s was spent" in report["versions"]["note"]
    assert {report[n]["status"] for n, _, _ in gc.PLAN if n != "bundle"} == {"skipped"}
    assert proc.returncode == 0
