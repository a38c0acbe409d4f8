#!/usr/bin/env python
"""Keep the docs' code and numbers cut from files the tests run.

Two directives in ``docs/*.md``, each an HTML comment on its own line followed by the fenced block
this script generates:

``<!-- include: numba_flash/reference.py#online-softmax-stats -->``
    The lines between ``# [docs:online-softmax-stats]`` and ``# [/docs:online-softmax-stats]`` in
    that file (path relative to the repository root), dedented, marker lines of nested regions
    dropped.  Without ``#region`` the whole file.  The fence language follows the extension.

``<!-- run: python docs/examples/notes_code.py online-softmax -->``
    The standard output of that command (split like a shell would), run from the repository root
    with this Python, the root's absolute path removed.  This is how the numbers quoted in a page
    come from running tested code; the output must be deterministic, and the same on every
    machine: print rounding noise as a bound (``< 1e-15``), not its digits.  Each command runs
    in its own process, forked from one interpreter that has already imported NumPy and
    numba_flash (:class:`Runner`: the same process a fresh ``python`` would be, without ~65
    times the imports).

Machine independence is checked, not hoped for.  ``--write`` runs each command twice, in this
machine's own numeric environment and in a *foreign* one (:func:`foreign_env`: one BLAS thread, an
older BLAS kernel, NumPy's SIMD dispatch off, so other summation orders and other ``exp``/``log``
code paths), and reports a block whose two outputs differ.  ``--check`` (and the test suite)
compares the committed blocks with the foreign run, so a page written on one machine is checked
under another machine's arithmetic.

Besides regenerating blocks, ``--check`` fails on: a stale block, a missing file or region, an
unbalanced region marker, a relative markdown link or image whose file does not exist, a
``#anchor`` that matches no heading of its page, and a repository path written in inline code
(``numba_flash/...``, ``tests/...``, ``docs/...``, ``examples/...``, ``bench/...``) that does not
exist, unless it is listed in ``PENDING`` (files other people are writing now).

Usage::

    python docs/snippets.py --check     # exit 1 and list the problems; changes nothing
    python docs/snippets.py --write     # regenerate every block in place, then check links
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import json
import os
import platform
import re
import select
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: paths that docs may name before they exist (kernels being written now); each is reported as a
#: note once it exists, so the entry can be dropped.
PENDING: set[str] = set()

DIRECTIVE = re.compile(r"^<!--\s*(include|run):\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^(```+|~~~+)")
OPEN = re.compile(r"^\s*(?:#|//|<!--)\s*\[docs:([\w.-]+)\]")
CLOSE = re.compile(r"^\s*(?:#|//|<!--)\s*\[/docs:([\w.-]+)\]")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(?:numba_flash|tests|docs|examples|bench)/[\w./-]*\w$")
LANG = {".py": "python", ".md": "markdown", ".toml": "toml", ".cfg": "ini", ".sh": "bash"}


@dataclass
class Report:
    problems: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    changed: list = field(default_factory=list)


# -- regions --------------------------------------------------------------------------------
def regions(path):
    """``{name: [lines]}`` for every marked region of a file; raises ValueError if unbalanced."""
    text = Path(path).read_text().splitlines()
    found, open_at = {}, {}
    for n, line in enumerate(text):
        if m := OPEN.match(line):
            name = m.group(1)
            if name in open_at or name in found:
                raise ValueError(f"{path}:{n + 1}: region {name!r} opened twice")
            open_at[name] = n
        elif m := CLOSE.match(line):
            name = m.group(1)
            if name not in open_at:
                raise ValueError(f"{path}:{n + 1}: region {name!r} closed but never opened")
            start = open_at.pop(name)
            body = [ln for ln in text[start + 1:n] if not (OPEN.match(ln) or CLOSE.match(ln))]
            found[name] = body
    if open_at:
        name, n = next(iter(open_at.items()))
        raise ValueError(f"{path}:{n + 1}: region {name!r} never closed")
    return found


def include_text(spec, root=ROOT):
    """The fenced block for ``path#region`` (or a whole ``path``)."""
    path, _, region = spec.partition("#")
    full = root / path
    if not full.is_file():
        raise ValueError(f"include: no file {path}")
    if region:
        regs = regions(full)
        if region not in regs:
            raise ValueError(f"include: no region [docs:{region}] in {path}")
        lines = regs[region]
    else:
        lines = [ln for ln in full.read_text().splitlines()
                 if not (OPEN.match(ln) or CLOSE.match(ln))]
    body = textwrap.dedent("\n".join(lines)).strip("\n")
    return f"```{LANG.get(full.suffix, '')}\n{body}\n```"


def foreign_env():
    """Environment variables that make NumPy compute like another machine's: one BLAS/OpenMP
    thread (other blocking and summation order in ``@`` and reductions), OpenBLAS's Nehalem
    kernels on x86-64 (SSE, not this CPU's AVX2/AVX-512 GEMM), and every SIMD target NumPy
    dispatches to on this CPU switched off (``NPY_DISABLE_CPU_FEATURES``: the baseline ``exp``,
    ``log``, ``sum`` loops).  Variables the caller set are kept."""
    env = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if platform.machine().lower() in ("x86_64", "amd64"):
        env["OPENBLAS_CORETYPE"] = "Nehalem"
    try:
        from numpy._core import _multiarray_umath as umath
    except ImportError:  # NumPy 1.x
        from numpy.core import _multiarray_umath as umath
    found = [f for f in getattr(umath, "__cpu_dispatch__", [])
             if umath.__cpu_features__.get(f)]
    if found:
        env["NPY_DISABLE_CPU_FEATURES"] = " ".join(found)
    return {k: v for k, v in env.items() if k not in os.environ}


def _env(root, foreign):
    """The environment a page's command runs in (the caller's, plus the root on ``PYTHONPATH``,
    no warnings, 100 columns, and :func:`foreign_env` when ``foreign``)."""
    return dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONWARNINGS="ignore", COLUMNS="100", **(foreign_env() if foreign else {}))


class Runner:
    """Runs ``python script.py args`` commands as a fresh ``python`` would, without paying for
    NumPy, Numba and numba_flash's imports (~2 s) once per command (the pages have ~65).

    A server interpreter started with the runner's environment ``env`` (:func:`_serve`: so NumPy
    is loaded under :func:`foreign_env` when asked) imports ``numpy`` and, on a machine with no
    CUDA device, ``numba_flash`` (what every script's own ``import numba_flash`` would do first);
    then each command is a child ``fork()``-ed from it: its own process with nothing any other
    command did, with ``sys.argv``, ``sys.path[0]``, ``__main__``, working directory and exit
    status as ``python script.py`` gives them, standard output and error to files, standard input
    ``/dev/null``.  A command whose first ``numba``/``numba_flash`` import would not have been
    ``import numba_flash`` into the simulator (:func:`_guard_first_import`: ``numba.cuda`` first,
    or ``NUMBA_ENABLE_CUDASIM=0``) is run again in a fresh interpreter, as are other commands
    (``python -m ...``, ``python -c ...``; every command where there is no ``os.fork``).  With a
    CUDA device the server imports only NumPy (the driver must not be initialised before a
    fork)."""

    def __init__(self, env, preload=True):
        self.env, self.preload, self.proc = dict(env), preload, None

    def _start(self):
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve",
             "numba_flash" if self.preload else "-"], env=self.env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            start_new_session=True)  # its own process group: killed whole if it dies

    def close(self):
        if self.proc is not None:
            self.proc.stdin.close()  # the server's loop ends at end of input
            self.proc.wait()
            self.proc = None

    def run(self, argv, cwd, timeout=None):
        """``(returncode, stdout, stderr)`` of ``argv`` (``["python", script, ...]``) run in
        ``cwd``; with a ``timeout`` (seconds; none by default: the suite has no wall-clock
        limits) raises :class:`subprocess.TimeoutExpired` after it."""
        if hasattr(os, "fork") and len(argv) >= 2 and not argv[1].startswith("-"):
            rc, out, err = self._forked(argv, cwd, timeout)
            if rc != FRESH:
                return rc, out, err
        proc = subprocess.run([sys.executable, *argv[1:]], cwd=cwd, env=self.env,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout)
        return proc.returncode, proc.stdout, proc.stderr

    def _forked(self, argv, cwd, timeout):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "out"), Path(tmp, "err")
            self.proc.stdin.write(json.dumps({"argv": argv[1:], "cwd": str(cwd),
                                              "out": str(out), "err": str(err)}) + "\n")
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else ""
            if not line:  # timed out, or the server died: kill it (and a running command)
                os.killpg(self.proc.pid, signal.SIGKILL)
                died = self.proc.wait()
                self.proc = None
                if ready:  # end of output: the server is gone, run the command afresh
                    return FRESH, "", f"the snippet server exited ({died})"
                raise subprocess.TimeoutExpired(argv, timeout)
            return json.loads(line)["rc"], out.read_text(), err.read_text()


#: a child's exit status asking :class:`Runner` to run its command in a fresh interpreter
FRESH = 86


def _guard_first_import(sim):
    """In a child of a server that imported ``numba_flash``: let the command go on only if its
    own first import of ``numba`` or ``numba_flash`` would have given it this same process, that
    is, it imports ``numba_flash`` first (``numba.cuda`` first would have chosen no simulator,
    or raised numba_flash's BackendError) with ``NUMBA_ENABLE_CUDASIM`` not ``0``; otherwise exit
    :data:`FRESH` before the import.  ``NUMBA_ENABLE_CUDASIM`` goes back to ``sim`` (what the
    process was started with) until then, and is ``1`` after it, as numba_flash's import leaves
    it."""
    import builtins

    original = builtins.__import__

    def first_import(name, globals=None, locals=None, fromlist=(), level=0):  # noqa: A002
        top = name.split(".")[0]
        if level == 0 and top in ("numba", "numba_flash"):
            builtins.__import__ = original  # decided: every later import is the plain one
            env = os.environ.get("NUMBA_ENABLE_CUDASIM")
            if top != "numba_flash" or (env or "").strip() == "0":
                sys.stdout.flush()
                os._exit(FRESH)
            if not (env or "").strip():
                os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        return original(name, globals, locals, fromlist, level)

    if sim is None:
        os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = sim
    builtins.__import__ = first_import


def _no_cuda_device():
    """True when no CUDA driver reports a device, asked in a forked child: initialising the
    driver in the server would break CUDA in every child forked after it."""
    pid = os.fork()
    if pid == 0:  # the child: exit 1 when a device answers
        import ctypes

        found = False
        for name in ("libcuda.so.1", "libcuda.so"):
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            count = ctypes.c_int(0)
            found = lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 \
                and count.value > 0
            break
        os._exit(1 if found else 0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def _serve(preload):
    """The server of :class:`Runner`: one JSON request per input line, one ``{"rc": ...}`` reply
    per line of output; returns at end of input.  A forked child returns from here too, into the
    interpreter's normal exit (``atexit``, thread joins, buffered output flushed, an exception's
    traceback and exit status 1, ``SystemExit``'s status)."""
    import builtins
    import importlib.machinery
    import io
    import types

    import numpy  # noqa: F401  (loaded now, under this server's environment)

    sim = os.environ.get("NUMBA_ENABLE_CUDASIM")  # as the command's process starts with it
    preloaded = preload and ((sim or "").strip() not in ("", "0")
                             or (sim is None and _no_cuda_device()))
    if preloaded:
        import numba_flash  # noqa: F401  (the simulator: no driver in this process)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()  # nothing buffered for the child to inherit
        pid = os.fork()
        if pid == 0:  # the child: become `python script args`
            for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                    (1, req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                    (2, req["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                opened = os.open(path, flags, 0o644)
                os.dup2(opened, fd)
                os.close(opened)  # no descriptor a fresh process would not have
            sys.stdin = open(0, closefd=False)  # noqa: SIM115  (reads /dev/null now)
            os.chdir(req["cwd"])
            script = os.path.abspath(req["argv"][0])  # __file__ is absolute, argv[0] as given
            sys.argv = list(req["argv"])
            sys.path[0] = os.path.dirname(script)
            with io.open_code(script) as f:
                code = compile(f.read(), script, "exec")
            main = types.ModuleType("__main__")
            main.__dict__.update(
                __file__=script, __cached__=None, __builtins__=builtins, __annotations__={},
                __loader__=importlib.machinery.SourceFileLoader("__main__", script))
            sys.modules["__main__"] = main
            if preloaded:
                _guard_first_import(sim)
            exec(code, main.__dict__)  # noqa: S102  (the command's script, as python runs it)
            return
        rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(json.dumps({"rc": rc}), flush=True)


_RUNNERS: dict = {}


def runner(env, preload=True):
    """This process's :class:`Runner` for the environment ``env`` (one server per environment,
    closed at exit); ``preload``: whether its server imports numba_flash."""
    key = (tuple(sorted(env.items())), preload)
    if key not in _RUNNERS:
        _RUNNERS[key] = Runner(env, preload)
    return _RUNNERS[key]


@atexit.register
def _close_runners():
    for r in _RUNNERS.values():
        r.close()


def run_text(command, root=ROOT, foreign=False):
    """The fenced block holding the standard output of ``python ...`` run from ``root`` (under
    :func:`foreign_env` when ``foreign``), by :func:`runner`."""
    argv = shlex.split(command)
    if not argv or argv[0] != "python":
        raise ValueError(f"run: only 'python ...' commands are allowed, got {command!r}")
    preload = (Path(root) / "numba_flash" / "__init__.py").is_file()  # the package they share
    rc, stdout, stderr = runner(_env(root, foreign), preload).run(argv, cwd=root)
    if rc != 0:
        raise ValueError(f"run: {command!r} exited {rc}:\n{stderr[-2000:]}")
    out = stdout.replace(str(root) + os.sep, "")  # no machine-specific absolute paths
    return f"```text\n{out.rstrip()}\n```"


def recorded_output(page, command, root=ROOT):
    """The output of ``<!-- run: command -->`` as ``page`` (a name in docs/) records it, without
    its fence.  The docs' tests read a claim's numbers here: test_snippets checks that the block
    is what the command prints now (under :func:`foreign_env`), so they need not run it again."""
    text = (Path(root) / "docs" / page).read_text()
    head = f"<!-- run: {command} -->\n"
    if head not in text:
        raise ValueError(f"{page} has no <!-- run: {command} --> block")
    block = text.split(head, 1)[1]
    if not block.startswith("```text\n"):
        raise ValueError(f"{page}: no ```text block under <!-- run: {command} -->")
    return block[len("```text\n"):].split("\n```", 1)[0]


def printed_fields(line):
    """The whitespace-separated fields of a printed table row, a bound ``< 1e-14`` one field."""
    return re.findall(r"<\s*\S+|\S+", line)


def printed_value(token):
    """A number as the demos print it: ``4.6e-04`` is 4.6e-04, a bound ``< 1e-14`` is 1e-14 (an
    upper bound of the value); ``True``/``False`` are booleans."""
    token = token.strip()
    if token in ("True", "False"):
        return token == "True"
    return float(token[1:]) if token.startswith("<") else float(token)


def printed_below(token, tol):
    """Whether a printed number, or the value behind a printed bound ``< b`` (``b <= tol``), is
    below ``tol``."""
    value = printed_value(token)
    return value <= tol if token.strip().startswith("<") else value < tol


# -- pages ----------------------------------------------------------------------------------
def render(text, root=ROOT, mode="check", runs=None):
    """Return ``(new_text, problems)``: every directive's block regenerated.  ``mode`` "check"
    runs commands in the foreign environment; "write" runs them natively and again foreign, and
    reports a block whose outputs differ (it depends on the machine).  ``runs``: a dict of the
    outputs already run in this pass, by (command, root, foreign): a command quoted on several
    pages runs once."""
    def run_once(arg, foreign):
        if runs is None:
            return run_text(arg, root, foreign=foreign)
        key = (arg, str(root), foreign)
        if key not in runs:
            runs[key] = run_text(arg, root, foreign=foreign)
        return runs[key]

    lines = text.split("\n")
    out, problems, i, fence = [], [], 0, None
    while i < len(lines):
        line = lines[i]
        out.append(line)
        i += 1
        if f := FENCE.match(line):  # a directive quoted inside a code block is only text
            if fence is None:
                fence = f.group(1)
            elif line.startswith(fence):
                fence = None
            continue
        m = DIRECTIVE.match(line) if fence is None else None
        if not m:
            continue
        kind, arg = m.groups()
        # the old block: a fence opening on the very next line, up to its closing fence
        old_end = i
        if i < len(lines) and (f := FENCE.match(lines[i])):
            j = i + 1
            while j < len(lines) and not lines[j].startswith(f.group(1)):
                j += 1
            old_end = min(j + 1, len(lines))
        try:
            if kind == "include":
                block = include_text(arg, root)
            else:
                block = run_once(arg, foreign=(mode == "check"))
                if mode == "write" and (other := run_once(arg, foreign=True)) != block:
                    problems.append(f"run: {arg!r} prints different output on another machine's "
                                    f"arithmetic (foreign_env()):\n" + "\n".join(
                                        difflib.unified_diff(block.split("\n"),
                                                             other.split("\n"), "native",
                                                             "foreign", lineterm="", n=0)))
        except (ValueError, subprocess.TimeoutExpired) as exc:
            problems.append(str(exc))
            block = "\n".join(lines[i:old_end])  # keep the old block
        if block:
            out.extend(block.split("\n"))
        i = old_end
    return "\n".join(out), problems


def slug(heading):
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def prose_lines(text):
    """Lines outside fenced code blocks, with their line numbers."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        if f := FENCE.match(line):
            if fence is None:
                fence = f.group(1)
                continue
            if line.startswith(fence):
                fence = None
                continue
        if fence is None:
            yield n, line


def anchors(text):
    seen, out = {}, set()
    for _, line in prose_lines(text):
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            base = slug(m.group(1))
            k = seen.get(base, 0)
            out.add(base if k == 0 else f"{base}-{k}")
            seen[base] = k + 1
    return out


def check_links(page, text, root=ROOT, pending=PENDING):
    problems, notes = [], []
    rel = page.relative_to(root)
    for n, line in prose_lines(text):
        for m in LINK.finditer(line):
            target = m.group(1)
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.append(f"{rel}:{n}: link to missing file {target}")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                problems.append(f"{rel}:{n}: no heading for anchor #{anchor} in "
                                f"{dest.relative_to(root)}")
        for m in INLINE_CODE.finditer(line):
            token = m.group(1).strip()
            candidate = token.split("::")[0].split("#")[0]
            if not REPO_PATH.match(candidate):
                continue
            if (root / candidate).exists():
                if candidate in pending:
                    notes.append(f"{rel}:{n}: {candidate} now exists: drop it from PENDING")
            elif candidate not in pending:
                problems.append(f"{rel}:{n}: inline path {candidate} does not exist")
    return problems, notes


def process(pages, write=False, root=ROOT, pending=PENDING):
    """Regenerate (``write``) or compare every page; check links; return a :class:`Report`."""
    rep = Report()
    runs = {}   # a command quoted on several pages (or twice on one) runs once per pass
    for page in pages:
        text = page.read_text()
        new, problems = render(text, root, mode="write" if write else "check", runs=runs)
        rel = page.relative_to(root)
        rep.problems += [f"{rel}: {p}" for p in problems]
        if new != text:
            if write:
                page.write_text(new)
                rep.changed.append(str(rel))
            else:
                rep.problems.append(f"{rel}: stale generated block(s): run "
                                    "python docs/snippets.py --write")
        p, notes = check_links(page, new if write else text, root, pending)
        rep.problems += p
        rep.notes += notes
    return rep


def default_pages(root=ROOT):
    return sorted((root / "docs").glob("*.md"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="report problems, change nothing")
    mode.add_argument("--write", action="store_true", help="regenerate blocks in place")
    ap.add_argument("pages", nargs="*", type=Path, help="pages (default: docs/*.md)")
    args = ap.parse_args(argv)
    pages = [p.resolve() for p in args.pages] or default_pages()
    rep = process(pages, write=args.write)
    for c in rep.changed:
        print(f"rewrote {c}")
    for note in rep.notes:
        print(f"note: {note}")
    for p in rep.problems:
        print(f"PROBLEM: {p}")
    print(f"{len(pages)} page(s), {len(rep.problems)} problem(s)")
    return 1 if rep.problems else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:  # Runner's server (its children return here too)
        sys.exit(_serve(sys.argv[2] == "numba_flash"))
    sys.exit(main())
