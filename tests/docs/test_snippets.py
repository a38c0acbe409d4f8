"""docs/snippets.py: the pages are up to date with the code they quote, and the checker itself
catches each kind of drift (on a throwaway tree, so these tests can fail)."""

from __future__ import annotations

import textwrap

import pytest

import snippets


def test_docs_are_current_and_links_resolve():
    rep = snippets.process(snippets.default_pages(), write=False)
    assert not rep.problems, "\n".join(rep.problems + ["fix: python docs/snippets.py --write"])


def test_every_page_is_reachable_from_the_index():
    index = (snippets.DOCS / "index.md").read_text()
    for page in snippets.default_pages():
        if page.name != "index.md":
            assert f"]({page.name})" in index, page.name


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "numba_flash").mkdir()
    (tmp_path / "numba_flash" / "mod.py").write_text(textwrap.dedent("""\
        def f(x):
            # [docs:body]
            y = x + 1
            return y
            # [/docs:body]
        """))
    return tmp_path


def page(tree, text):
    p = tree / "docs" / "p.md"
    p.write_text(textwrap.dedent(text))
    return p


def run(tree, p, write=False):
    return snippets.process([p], write=write, root=tree, pending=set())


def test_write_then_check_roundtrip(tree):
    p = page(tree, """\
        # Title
        <!-- include: numba_flash/mod.py#body -->
        """)
    assert any("stale" in x for x in run(tree, p).problems)
    assert not run(tree, p, write=True).problems
    assert "```python\ny = x + 1\nreturn y\n```" in p.read_text()
    assert not run(tree, p).problems


def test_code_change_makes_page_stale(tree):
    p = page(tree, "<!-- include: numba_flash/mod.py#body -->\n")
    run(tree, p, write=True)
    mod = tree / "numba_flash" / "mod.py"
    mod.write_text(mod.read_text().replace("x + 1", "x + 2"))
    assert any("stale" in x for x in run(tree, p).problems)


@pytest.mark.parametrize("line, problem", [
    ("<!-- include: numba_flash/nope.py#body -->", "no file numba_flash/nope.py"),
    ("<!-- include: numba_flash/mod.py#nope -->", "no region [docs:nope]"),
    ("see [there](missing.md)", "link to missing file missing.md"),
    ("see [there](p.md#no-such-heading)", "no heading for anchor #no-such-heading"),
    ("see `numba_flash/ghost.py`", "inline path numba_flash/ghost.py does not exist"),
    ("<!-- run: ls -->", "only 'python ...' commands"),
])
def test_each_kind_of_problem_is_reported(tree, line, problem):
    p = page(tree, f"# Heading\n\n{line}\n")
    assert any(problem in x for x in run(tree, p).problems), run(tree, p).problems


def test_anchor_and_pending_path_are_accepted(tree):
    p = page(tree, "# A heading: `with` code\n\n"
                   "[up](#a-heading-with-code) `numba_flash/later.py`\n")
    rep = snippets.process([p], root=tree, pending={"numba_flash/later.py"})
    assert not rep.problems


def test_unbalanced_marker(tree):
    (tree / "numba_flash" / "bad.py").write_text("# [docs:x]\npass\n")
    p = page(tree, "<!-- include: numba_flash/bad.py#x -->\n")
    assert any("never closed" in x for x in run(tree, p).problems)


def test_run_directive_output(tree):
    (tree / "numba_flash" / "hello.py").write_text("print('hello', 6 * 7)\n")
    p = page(tree, "<!-- run: python numba_flash/hello.py -->\n")
    run(tree, p, write=True)
    assert "```text\nhello 42\n```" in p.read_text()


def test_directive_inside_a_code_block_is_left_alone(tree):
    text = "```text\n<!-- include: numba_flash/mod.py#body -->\n```\n"
    p = page(tree, text)
    assert not run(tree, p, write=True).problems
    assert p.read_text() == text


def test_foreign_env_changes_the_arithmetic():
    env = snippets.foreign_env()
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        assert env.get(name, "1") == "1"
    from numpy._core import _multiarray_umath as umath
    found = [f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f)]
    if found and "NPY_DISABLE_CPU_FEATURES" not in snippets.os.environ:
        assert env["NPY_DISABLE_CPU_FEATURES"].split() == found


def test_machine_dependent_output_is_reported_on_write(tree):
    """--write runs a command natively and under foreign_env(): a block that prints something
    of the machine's arithmetic (here the BLAS thread setting itself) is a problem, and --check
    compares the committed block with the foreign run."""
    (tree / "numba_flash" / "noisy.py").write_text(
        "import os\nprint('threads', os.environ.get('OMP_NUM_THREADS', 'native'))\n")
    p = page(tree, "<!-- run: python numba_flash/noisy.py -->\n")
    rep = run(tree, p, write=True)
    if "OMP_NUM_THREADS" in snippets.os.environ:
        pytest.skip("OMP_NUM_THREADS is set here: foreign_env() keeps it")
    assert any("different output on another machine" in x for x in rep.problems), rep.problems
    assert "threads native" in p.read_text()  # the native output is what --write writes
    assert any("stale" in x for x in run(tree, p).problems)  # and --check sees the foreign one


def test_docs_examples_print_noise_as_a_bound():
    import report
    assert report.err(4.4e-16) == "< 1e-14" and report.err(0.0) == "< 1e-14"
    assert report.err(4.9e-1, 8) == " 4.9e-01"
    assert report.decade(6.3e-8) == report.decade(6.2e-8) == "< 1e-07"


PROBE = """\
import os, sys
print(sys.argv, __name__, __file__, sorted(globals()), os.getcwd(), sys.path[0], flush=True)
print(repr(sys.stdin.read()), sorted(os.listdir("/proc/self/fd")))
{imports}
print(os.environ.get("NUMBA_ENABLE_CUDASIM"), file=sys.stderr)
raise SystemExit(int(sys.argv[1]))
"""


def test_runner_runs_a_script_as_a_fresh_python_does(tmp_path):
    """Runner forks each command from one interpreter that imported numba_flash (so ~65 commands
    pay its imports once): argv, __main__'s globals, cwd, sys.path[0], descriptors, stdin, output,
    exit status and numba_flash's backend choice are those of a fresh ``python script.py``; a
    script importing numba.cuda before numba_flash is run in a fresh interpreter."""
    env = snippets._env(snippets.ROOT, foreign=True)  # the pages' check's server
    runner = snippets.runner(env)
    (tmp_path / "probe.py").write_text(PROBE.format(imports="import numba_flash"))
    argv = ["python", "probe.py", "3"]
    got = runner.run(argv, cwd=tmp_path)
    fresh = snippets.subprocess.run([snippets.sys.executable, *argv[1:]], cwd=tmp_path, env=env,
                                    stdin=snippets.subprocess.DEVNULL, capture_output=True,
                                    text=True)
    assert got[:2] == (fresh.returncode, fresh.stdout), (got, fresh)
    assert got[2].splitlines()[-1:] == fresh.stderr.splitlines()[-1:], (got[2], fresh.stderr)
    assert got[0] == 3 and " __main__ " in got[1] and "['probe.py', '3']" in got[1]
    # numba.cuda before numba_flash: a fresh interpreter would choose the backend otherwise (or
    # raise BackendError), so the forked child stops and the command runs fresh
    (tmp_path / "first.py").write_text(PROBE.format(imports="from numba import cuda\n"
                                                            "import numba_flash"))
    sim = snippets.os.environ.get("NUMBA_ENABLE_CUDASIM", "").strip() not in ("", "0")
    if sim:  # the pytest process runs in the simulator: the server imported numba_flash
        assert runner._forked(["python", "first.py", "3"], tmp_path, 60)[0] == snippets.FRESH
        assert runner._forked(argv, tmp_path, 60)[0] == 3
    assert runner.run(["python", "first.py", "4"], cwd=tmp_path)[0] == 4
