"""A pytest plugin for bench/gpu_check.py's test part: every test named as it finishes, whatever
stops the run.

Loaded with ``-p gpu_check_pytest`` (bench/ on ``PYTHONPATH``); each feature is off unless its
option is given:

* ``--gpu-check-events FILE``: one JSON line per event, written and flushed as it happens by the
  process that reports (the xdist controller, or pytest itself without xdist): ``collected``
  (how many tests), ``start`` (a test began, with its worker), ``report`` (one per phase: setup,
  call, teardown; outcome, duration, worker, the first lines of a failure's text) and
  ``finish``.  A run killed at its time limit leaves every test that had finished named, and
  the tests that were running (a ``start`` without a final ``report``).
  :func:`summarize_events` turns the file into per-test outcomes.
* ``--gpu-check-select``: the tests a GPU session runs: every test under ``tests/kernels``
  except the compile tier's (``compile`` marker), and every ``gpu``-marked test elsewhere.
* ``--gpu-check-restart-on-sticky``: under xdist, a worker whose test failed with a CUDA error
  that leaves the context unusable (a misaligned or illegal address, an illegal instruction, a
  launch failure: :data:`STICKY`) exits after that test, so the tests after it run in a fresh
  worker instead of failing with the same error.  xdist reports the test a second time, as
  "worker crashed"; the events keep both reports.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

#: CUDA errors after which the context cannot run anything else (numba-cuda's CudaAPIError and
#: CuPy's driver errors name them CUDA_ERROR_*, the runtime cudaError*, torch "CUDA error: ...")
STICKY = re.compile(
    r"CUDA_ERROR_(MISALIGNED_ADDRESS|ILLEGAL_ADDRESS|ILLEGAL_INSTRUCTION|LAUNCH_FAILED|"
    r"HARDWARE_STACK_ERROR|INVALID_ADDRESS_SPACE|INVALID_PC|ASSERT|LAUNCH_TIMEOUT)"
    r"|cudaError(MisalignedAddress|IllegalAddress|IllegalInstruction|LaunchFailure|"
    r"HardwareStackError|Assert)"
    r"|CUDA error: (misaligned address|an illegal memory access|an illegal instruction|"
    r"unspecified launch failure)")
#: exit status of a worker that stopped after a sticky CUDA error
STICKY_EXIT = 86
#: lines of a failure's text kept in its event
LONGREPR_LINES = 40


def pytest_addoption(parser):
    group = parser.getgroup("gpu_check", "bench/gpu_check.py's test part")
    group.addoption("--gpu-check-events", metavar="FILE", default=None,
                    help="write one JSON line per test event to FILE as it happens")
    group.addoption("--gpu-check-select", action="store_true", default=False,
                    help="keep tests/kernels (not the compile tier) and gpu-marked tests")
    group.addoption("--gpu-check-restart-on-sticky", action="store_true", default=False,
                    help="an xdist worker exits after a test that hit a sticky CUDA error")


def _is_worker(config):
    return hasattr(config, "workerinput")


class _Events:
    def __init__(self, path):
        self.f = open(path, "a", buffering=1, encoding="utf-8")   # line-buffered: one write a line
        self.t0 = time.time()

    def write(self, **event):
        event["t"] = round(time.time() - self.t0, 3)
        self.f.write(json.dumps(event, default=str) + "\n")
        self.f.flush()


_STATE = {"events": None, "sticky": None}


def pytest_configure(config):
    path = config.getoption("--gpu-check-events")
    if path and not _is_worker(config):
        _STATE["events"] = _Events(path)
        _STATE["events"].write(event="begin", pid=os.getpid(), argv=sys.argv[1:])


def selected(nodeid, keywords):
    """True for a test the GPU session runs (``--gpu-check-select``)."""
    path = nodeid.split("::")[0].replace("\\", "/")
    in_kernels = path.startswith("tests/kernels/") or "/tests/kernels/" in path
    return ("gpu" in keywords) or (in_kernels and "compile" not in keywords)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if not config.getoption("--gpu-check-select"):
        return
    keep, drop = [], []
    for item in items:
        (keep if selected(item.nodeid, item.keywords) else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_collection_finish(session):
    ev = _STATE["events"]
    if ev is not None:   # without xdist: this process collected
        ev.write(event="collected", n=len(session.items))


def pytest_xdist_node_collection_finished(node, ids):
    ev = _STATE["events"]
    if ev is not None:
        ev.write(event="collected", n=len(ids), worker=getattr(node.gateway, "id", None))


def pytest_runtest_logstart(nodeid, location):
    ev = _STATE["events"]
    if ev is not None:
        ev.write(event="start", nodeid=nodeid)


def _worker_of(report):
    node = getattr(report, "node", None)   # xdist sets it on the controller's copy
    gw = getattr(getattr(node, "gateway", None), "id", None)
    return gw or getattr(report, "worker_id", None)


def pytest_runtest_logreport(report):
    text = ""
    if report.failed:
        text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    if report.failed and STICKY.search(text) and _STATE["sticky"] is None:
        _STATE["sticky"] = report.nodeid
    ev = _STATE["events"]
    if ev is None:
        return
    event = {"event": "report", "nodeid": report.nodeid, "when": report.when,
             "outcome": report.outcome, "duration": round(report.duration, 4),
             "worker": _worker_of(report)}
    if hasattr(report, "wasxfail"):
        event["xfail"] = True
    if report.failed:
        lines = text.splitlines()
        event["longrepr"] = "\n".join(lines[-LONGREPR_LINES:])
        if STICKY.search(text):
            event["sticky_cuda_error"] = STICKY.search(text).group(0)
    elif report.skipped and isinstance(report.longrepr, tuple):
        event["reason"] = str(report.longrepr[-1])[:300]
    ev.write(**event)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    config = item.config
    if (_STATE["sticky"] is not None and _is_worker(config)
            and config.getoption("--gpu-check-restart-on-sticky")):
        # every report of this test has gone to the controller (execnet writes synchronously);
        # the controller reports the worker as crashed on this test and starts another
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STICKY_EXIT)


def pytest_sessionfinish(session, exitstatus):
    ev = _STATE["events"]
    if ev is not None:
        ev.write(event="finish", exitstatus=int(exitstatus))


# -- reading the events (bench/gpu_check.py) ------------------------------------------------

def read_events(path):
    """The events of ``path`` (a line cut short by a kill is skipped)."""
    events = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    events.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return events


def _first_line(text):
    """A failure's message: pytest's first ``E`` line (the exception and its message), else the
    last line that is not indented (an xdist crash, a plain traceback's exception line)."""
    lines = (text or "").splitlines()
    for line in lines:
        if line.startswith("E ") and line[1:].strip():
            return line[1:].strip()[:300]
    for line in reversed(lines):
        if line.strip() and not line.startswith((" ", "\t")):
            return line.strip()[:300]
    return ""


def summarize_events(events):
    """Per-test outcomes from the events: ``{"collected", "counts", "tests": {nodeid: {...}},
    "finished"}``.  Outcomes follow pytest's: ``passed``, ``failed`` (the call failed),
    ``error`` (setup or teardown failed), ``skipped``, ``xfailed``, ``xpassed``, ``crashed``
    (its xdist worker died: a segfault, or pytest-timeout's thread method), and
    ``running when stopped`` for a test that had started when the run ended."""
    tests = {}
    collected = None
    finished = None
    for ev in events:
        kind = ev.get("event")
        if kind == "collected":
            collected = max(collected or 0, ev.get("n") or 0)
        elif kind == "finish":
            finished = ev.get("exitstatus")
        elif kind == "start":
            t = tests.setdefault(ev["nodeid"], {"outcome": "running when stopped"})
            t.setdefault("worker", ev.get("worker"))
        elif kind == "report":
            t = tests.setdefault(ev["nodeid"], {"outcome": "running when stopped"})
            _apply(t, ev)
    counts = {}
    for t in tests.values():
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return {"collected": collected, "counts": counts, "tests": tests,
            "finished": finished is not None, "exitstatus": finished}


def _apply(t, ev):
    when, outcome = ev.get("when"), ev.get("outcome")
    if ev.get("worker"):
        t["worker"] = ev["worker"]
    t["duration"] = round(t.get("duration", 0.0) + (ev.get("duration") or 0.0), 4)
    if ev.get("sticky_cuda_error"):
        t["sticky_cuda_error"] = ev["sticky_cuda_error"]
    if outcome == "failed":
        message = _first_line(ev.get("longrepr"))
        crashed = "crashed while running" in (ev.get("longrepr") or "")
        if crashed:
            t["worker_crashed"] = True
        if t.get("outcome") in ("failed", "error") and crashed:
            return   # the test's own failure stays; xdist's crash report is a second one
        t["outcome"] = "crashed" if crashed else "failed" if when == "call" else "error"
        t["message"] = message
        t["when"] = when
        return
    if t.get("outcome") in ("failed", "error", "crashed"):
        return
    if outcome == "skipped":
        t["outcome"] = "xfailed" if ev.get("xfail") else "skipped"
        if ev.get("reason"):
            t["message"] = ev["reason"]
    elif when == "call":
        t["outcome"] = "xpassed" if ev.get("xfail") else "passed"
    elif when == "teardown" and t["outcome"] == "running when stopped":
        t["outcome"] = "passed"   # a test with no call phase reported (not expected)
