"""docs/examples/gpu_banner.py: every page that quotes the H200 session of 2026-11-30 carries its
banner, each kernel change the banner lists came after the session's commit, and each change it
says the latest record measured is in that record's commit (where git can tell)."""

from __future__ import annotations

import re
import subprocess

import pytest

import gpu_banner
import snippets

#: the 2026-11-30 banner, plain or naming the record that measured the later kernels
BANNER = re.compile(r"^<!-- run: python docs/examples/gpu_banner\.py h200-2026-11-30"
                    r"( --record latest)? -->$", re.M)


def _git(*args):
    return subprocess.run(["git", *args], cwd=gpu_banner.ROOT, capture_output=True, text=True)


def _have(commit):
    return _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


@pytest.mark.parametrize("session", sorted(gpu_banner.SESSIONS))
def test_changes_listed_came_after_the_session(session):
    s = gpu_banner.SESSIONS[session]
    if not _have(s["commit"]):
        pytest.skip("the session's commit is not in this clone's history")
    for _, commit, what in gpu_banner.changes_since(s["date"]):
        after = _git("merge-base", "--is-ancestor", s["commit"], commit).returncode == 0
        assert after, f"{what} ({commit}) is not a later commit than {s['commit']}"


def test_changes_said_measured_are_in_the_records_commit():
    rec = gpu_banner.load_record()
    if rec is None or not _have(rec["commit"]):
        pytest.skip("no record, or its commit is not in this clone's history")
    for _, commit, what in gpu_banner.measured_by(rec, gpu_banner.KERNEL_CHANGES):
        inside = _git("merge-base", "--is-ancestor", commit, rec["commit"]).returncode == 0
        assert inside, f"{what} ({commit}) is not in the record's commit {rec['commit']}"


def test_latest_banner_names_the_record(capsys):
    rec = gpu_banner.load_record()
    if rec is None:
        pytest.skip("no bench/results/latest.json")
    gpu_banner.main(["latest"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"{rec['gpu']}, measured {rec['date']} at commit {rec['commit']}" in out
    assert "numba-cuda " + rec["versions"]["numba-cuda"] in out


def test_session_banner_with_the_record_says_what_it_measured(capsys):
    rec = gpu_banner.load_record()
    if rec is None:
        pytest.skip("no bench/results/latest.json")
    gpu_banner.main(["h200-2026-11-30", "--record", "latest"])
    out = " ".join(capsys.readouterr().out.split())
    assert "not today's" in out and rec["commit"] in out
    gpu_banner.main(["h200-2026-11-30"])
    assert "not measured on a GPU" in capsys.readouterr().out.replace("\n", " ")


def test_pages_quoting_the_session_carry_its_banner():
    for page in snippets.default_pages():
        text = page.read_text()
        if "38a7cb7" in text and page.name not in ("index.md",):
            assert BANNER.search(text), (f"{page.name} quotes the 2026-11-30 session without "
                                         "its banner")
