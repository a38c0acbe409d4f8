"""docs/examples/gpu_banner.py: every page that quotes the H200 session carries its banner, and
each kernel change the banner lists came after the session's commit (where git can tell)."""

from __future__ import annotations

import subprocess

import pytest

import gpu_banner
import snippets

BANNER = "<!-- run: python docs/examples/gpu_banner.py h200-2026-11-30 -->"


def _git(*args):
    return subprocess.run(["git", *args], cwd=gpu_banner.ROOT, capture_output=True, text=True)


@pytest.mark.parametrize("session", sorted(gpu_banner.SESSIONS))
def test_changes_listed_came_after_the_session(session):
    s = gpu_banner.SESSIONS[session]
    if _git("cat-file", "-e", f"{s['commit']}^{{commit}}").returncode:
        pytest.skip("the session's commit is not in this clone's history")
    for _, commit, what in gpu_banner.changes_since(s["date"]):
        after = _git("merge-base", "--is-ancestor", s["commit"], commit).returncode == 0
        assert after, f"{what} ({commit}) is not a later commit than {s['commit']}"


def test_pages_quoting_the_session_carry_its_banner():
    for page in snippets.default_pages():
        text = page.read_text()
        if "38a7cb7" in text and page.name not in ("index.md",):
            assert BANNER in text, f"{page.name} quotes the 2026-11-30 session without its banner"
