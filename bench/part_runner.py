"""The part runner of bench/gpu_check.py: each part of the plan a budget in seconds, each of its
commands a process group killed when the budget runs out, every line it prints kept in a log.

* :func:`run_logged` runs one command with its output streamed into a log file (so a command
  stopped at its limit leaves everything it printed), in a process group of its own: at the
  limit the group gets SIGINT (pytest then writes its junit XML and ``-rA`` summary, a Python
  script its traceback), a few seconds later SIGKILL; whatever the group left running after
  its leader exited is killed too (xdist workers, a spawned pool, ncu's target).
* :class:`PartRun` is one part as it runs: its budget (``None``: no limit, a dry run's default),
  the report entry it fills in as it goes (``status``, ``seconds``, ``steps``, what it read), and
  :meth:`PartRun.step` for its commands, each limited by what is left of the part's budget.
* :func:`cache_census` counts the compiled kernels in the on-disk cache; :func:`bundle` packs an
  output folder into one ``.tar.gz`` (the device tool brings back at most 8 files).
"""

from __future__ import annotations

import os
import resource
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the process group running now (the orchestrator's SIGTERM handler kills it)
CURRENT = {"proc": None}


def _group_kwargs():
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}


def _killpg(pid, sig):
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def kill_current():
    """Kill the running command's process group (the orchestrator's SIGTERM handler)."""
    proc = CURRENT["proc"]
    if proc is not None:
        _killpg(proc.pid, signal.SIGKILL)


def tail_lines(path, n=30, max_bytes=200_000):
    """The last ``n`` lines of a text file (``[]`` if none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read().decode(errors="replace")
    except OSError:
        return []
    return data.splitlines()[-n:]


def grace_for(timeout):
    """Seconds between SIGINT and SIGKILL for a command of ``timeout`` seconds."""
    return min(6.0, max(1.0, 0.08 * timeout))


class _Forked:
    """A forked child running a Python command of this interpreter, seen as a ``Popen``."""

    def __init__(self, cmd, cwd, env, out_fd, err_fd):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:   # the child: never returns
            _forked_child(cmd, cwd, env, out_fd, err_fd)
        self.pid = pid
        self.returncode = None

    def wait(self, timeout=None):
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            pid, status = os.waitpid(self.pid, 0 if end is None else os.WNOHANG)
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if end is not None and time.monotonic() >= end:
                raise subprocess.TimeoutExpired(self.pid, timeout)
            time.sleep(0.05)
        return self.returncode


def _forked_child(cmd, cwd, env, out_fd, err_fd):
    code = 1
    try:
        os.setpgid(0, 0)
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        sys.stdout = open(1, "w", buffering=1, closefd=False, errors="replace")
        sys.stderr = open(2, "w", buffering=1, closefd=False, errors="replace")
        os.chdir(cwd)
        os.environ.update(env)
        import runpy

        args = [str(c) for c in cmd[1:]]
        try:
            if args[0] == "-m":
                sys.argv = [args[1], *args[2:]]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = args
                sys.path.insert(0, str(Path(args[0]).resolve().parent))
                runpy.run_path(args[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001  the child reports and exits, whatever it was
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def run_logged(cmd, log, timeout=None, env=None, stdout=None, cwd=ROOT, fork=False):
    """Run ``cmd`` (a list) with its output appended to ``log`` as it comes (``stdout``: a file
    for standard output alone, standard error still to ``log``), stopped after ``timeout``
    seconds (None: no limit).  Returns ``{"command", "returncode", "seconds", "cpu_s", "log"}``
    (``cpu_s``: the CPU time of the processes it waited for); ``returncode`` is ``"timeout"``
    when it was stopped.

    ``fork``: a command ``[sys.executable, script.py | -m module, ...]`` runs in a forked copy of
    this process instead of a new interpreter (``runpy``; its own process group, output and
    limit all the same): a dry run's shortcut past re-importing numba for every part.  Only
    where this process holds no CUDA context (the simulator): a forked CUDA context is
    unusable."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    t0 = time.monotonic()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "ab") as lf:
        lf.write(f"\n$ {shlex.join(str(c) for c in cmd)}\n".encode())
        lf.flush()
        out = open(stdout, "wb") if stdout else lf
        try:
            if fork and str(cmd[0]) == sys.executable:
                proc = _Forked(cmd, cwd, env or {}, out.fileno(), lf.fileno())
            else:
                proc = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=full_env,
                                        stdout=out, stderr=lf, stdin=subprocess.DEVNULL,
                                        **_group_kwargs())
        except OSError as exc:
            if stdout:
                out.close()
            lf.write(f"could not start: {exc}\n".encode())
            return {"command": shlex.join(str(c) for c in cmd), "returncode": "not started",
                    "error": str(exc), "seconds": 0.0, "log": str(log)}
        CURRENT["proc"] = proc
        rc = None
        try:
            if timeout is None:
                rc = proc.wait()
            else:
                grace = grace_for(timeout)
                try:
                    rc = proc.wait(max(0.1, timeout - grace))
                except subprocess.TimeoutExpired:
                    _killpg(proc.pid, signal.SIGINT)
                    try:
                        proc.wait(grace)
                    except subprocess.TimeoutExpired:
                        pass
                    rc = "timeout"
        finally:
            _killpg(proc.pid, signal.SIGKILL)   # the leader if still there, and what it left
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            CURRENT["proc"] = None
            if stdout:
                out.close()
        seconds = round(time.monotonic() - t0, 1)
        if rc == "timeout":
            lf.write(f"\n(stopped at its limit of {timeout:.0f} s)\n".encode())
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"command": shlex.join(str(c) for c in cmd), "returncode": rc, "seconds": seconds,
            "cpu_s": round(cpu, 1), "log": str(log)}


class PartRun:
    """One part of the plan as it runs.  ``res`` is its report entry, filled in as it goes (so
    the report written after a failure or a kill still has what the part had found)."""

    def __init__(self, name, outdir, dry, budget, res, fork=False):
        self.name = name
        self.fork = fork   # run_logged's fork: Python commands in forked copies (a dry run)
        self.outdir = Path(outdir)
        self.dry = dry
        self.budget = budget
        self.t0 = time.monotonic()
        self.res = res
        self.res.update(status="running", budget_s=budget)
        self.res.setdefault("steps", [])
        self.timed_out = False
        self.failed = False

    @property
    def log(self):
        return self.outdir / "logs" / f"{self.name}.log"

    def path(self, *parts):
        """A path under the output folder (its folder made)."""
        p = self.outdir.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def rel(self, path):
        try:
            return str(Path(path).relative_to(self.outdir))
        except ValueError:
            return str(path)

    def remaining(self):
        if self.budget is None:
            return None
        return self.budget - (time.monotonic() - self.t0)

    def step(self, label, cmd, env=None, stdout=None, limit=None, check=True, fork=True):
        """Run one command of this part, limited by what is left of the budget (and ``limit``).
        Returns the step's entry (also appended to ``res["steps"]``); a step that finds less than
        a second left is not started (``returncode`` ``"no time left"``)."""
        left = self.remaining()
        timeout = left if limit is None else (limit if left is None else min(limit, left))
        if timeout is not None and timeout < 1:
            entry = {"label": label, "command": shlex.join(str(c) for c in cmd),
                     "returncode": "no time left", "seconds": 0.0}
            self.timed_out = True
            self.res["steps"].append(entry)
            return entry
        print(f"   {label}: {shlex.join(str(c) for c in cmd)}"
              + (f"  (limit {timeout:.0f} s)" if timeout is not None else ""), flush=True)
        entry = run_logged(cmd, self.log, timeout, env=env, stdout=stdout,
                           fork=fork and self.fork)
        entry = {"label": label, **entry, "log": self.rel(entry["log"])}
        if timeout is not None:
            entry["limit_s"] = round(timeout, 1)
        if entry["returncode"] == "timeout":
            self.timed_out = True
        elif check and entry["returncode"] != 0:
            self.failed = True
        self.res["steps"].append(entry)
        return entry

    def finish(self, error=None):
        self.res["seconds"] = round(time.monotonic() - self.t0, 1)
        self.res["cpu_s"] = round(sum(st.get("cpu_s", 0.0) for st in self.res["steps"]), 1)
        self.res["log"] = self.rel(self.log) if self.log.exists() else None
        if self.res.get("status") not in ("running", None):
            pass   # the part set its own status (skipped, not built yet)
        elif error is not None:
            self.res["status"] = "error"
        elif self.timed_out:
            self.res["status"] = "timeout"
        elif self.failed:
            self.res["status"] = "failed"
        else:
            self.res["status"] = "ok"
        if error is not None:
            self.res["error"] = error
        if self.log.exists():
            self.res["log_tail"] = tail_lines(self.log, 25)
        return self.res


# -- the on-disk kernel cache ----------------------------------------------------------------

def cache_dirs():
    """Where compiled kernels are kept: ``NUMBA_CACHE_DIR`` when set, else the ``__pycache__``
    folders beside the package's sources (numba's in-tree locator)."""
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env:
        return [Path(env)]
    return [p for p in (ROOT / "numba_flash").rglob("__pycache__") if p.is_dir()]


def cache_census():
    """``{"kernels": n, "bytes": b, "where": ...}``: the compiled kernels (``.nbc`` files) in
    the on-disk cache."""
    n = size = 0
    for d in cache_dirs():
        if not d.exists():
            continue
        for f in d.rglob("*.nbc"):
            n += 1
            try:
                size += f.stat().st_size
            except OSError:
                pass
    return {"kernels": n, "bytes": size,
            "where": os.environ.get("NUMBA_CACHE_DIR") or "numba_flash/**/__pycache__"}


# -- bringing the results back ---------------------------------------------------------------

def bundle(outdir, name, include=None, exclude=(), max_bytes=None):
    """Pack the files of ``outdir`` (``include(path)`` true, none of the suffixes ``exclude``) into
    ``outdir/name``; with ``max_bytes``, the largest files are left out until the rest fits (the
    device tool brings back files of at most 16 MiB).  Returns ``{"path", "files", "bytes",
    "left_out"}``."""
    outdir = Path(outdir)
    target = outdir / name
    files = sorted(p for p in outdir.rglob("*") if p.is_file() and p.name != name
                   and not p.name.endswith(".tar.gz") and not p.name.endswith(".tmp")
                   and not any(p.name.endswith(s) for s in exclude)
                   and (include is None or include(p)))
    sizes = {p: p.stat().st_size for p in files}
    left_out = []
    if max_bytes is not None:
        while files and sum(sizes[p] for p in files) > max_bytes * 0.9:  # gzip rarely grows
            big = max(files, key=lambda p: sizes[p])
            files.remove(big)
            left_out.append(str(big.relative_to(outdir)))
    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for p in files:
            tar.add(p, arcname=str(p.relative_to(outdir)))
    os.replace(tmp, target)
    return {"path": name, "files": len(files), "bytes": target.stat().st_size,
            "left_out": left_out}
