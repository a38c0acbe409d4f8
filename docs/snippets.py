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
    machine: print rounding noise as a bound (``< 1e-15``), not its digits.

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
import difflib
import os
import platform
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

#: paths that docs may name before they exist (kernels being written now); each is reported as a
#: note once it exists, so the entry can be dropped.
PENDING: set[str] = {
    "bench/results/latest.json",  # written and committed by the first GPU session's gpu_check.py
}

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


def run_text(command, root=ROOT, foreign=False):
    """The fenced block holding the standard output of ``python ...`` run from ``root`` (under
    :func:`foreign_env` when ``foreign``)."""
    argv = shlex.split(command)
    if not argv or argv[0] != "python":
        raise ValueError(f"run: only 'python ...' commands are allowed, got {command!r}")
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore", COLUMNS="100", **(foreign_env() if foreign else {}))
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise ValueError(f"run: {command!r} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    out = proc.stdout.replace(str(root) + os.sep, "")  # no machine-specific absolute paths
    return f"```text\n{out.rstrip()}\n```"


# -- pages ----------------------------------------------------------------------------------
def render(text, root=ROOT, mode="check"):
    """Return ``(new_text, problems)``: every directive's block regenerated.  ``mode`` "check"
    runs commands in the foreign environment; "write" runs them natively and again foreign, and
    reports a block whose outputs differ (it depends on the machine)."""
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
                block = run_text(arg, root, foreign=(mode == "check"))
                if mode == "write" and (other := run_text(arg, root, foreign=True)) != block:
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
    for page in pages:
        text = page.read_text()
        new, problems = render(text, root, mode="write" if write else "check")
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
    sys.exit(main())
