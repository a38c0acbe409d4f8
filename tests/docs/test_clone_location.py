"""The docs do not depend on where the repository is cloned, or on what its folder is called.

A copy of the checkout (its tracked files, and the untracked ones git does not ignore) in a
folder named ``numba_flash`` (the default name of a clone of this repository, and the package's
own name), and there every docs command whose committed output names a file (a pdb transcript:
``> docs/examples/flex_step.py(41)my_bias()``) is run again by that copy's ``docs/snippets.py
--check``: it must print the committed bytes.  A path made relative to the wrong folder (the
first ``numba_flash/`` of ``/tmp/x/numba_flash/docs/...``) fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import snippets

ROOT = Path(__file__).resolve().parents[2]
#: a file path in a generated block, as pdb and tracebacks print them
NAMES_A_FILE = re.compile(r"(?:docs|numba_flash|numba|examples|tests)/[\w/]+\.py\b")
#: a run directive and the fenced block it generates
RUN_BLOCK = re.compile(r"^<!-- run: [^\n]* -->\n```\w*\n.*?^```\n", re.M | re.S)


def copy_checkout(dest):
    """The checkout's files (tracked, and untracked but not ignored) copied under ``dest``."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                                 "--exclude-standard"], cwd=ROOT, capture_output=True,
                                check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: everything but caches
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
            ".git", ".venv", "__pycache__", ".pytest_cache", "*.egg-info", "build", "dist"))
        return
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():   # a deleted file stays listed until the deletion is staged
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def blocks_that_name_files():
    """The run directives whose generated output (not the command) names a file."""
    return [m.group(0) for page in snippets.default_pages()
            for m in RUN_BLOCK.finditer(page.read_text())
            if NAMES_A_FILE.search(m.group(0).split("\n", 1)[1])]


def test_the_path_printing_blocks_are_found():
    """Not vacuous: the pdb transcripts of docs/own-variant.md are among the blocks run."""
    assert sum("flex_step.py" in b for b in blocks_that_name_files()) >= 2


def test_docs_that_print_paths_are_the_same_from_a_folder_named_numba_flash(tmp_path):
    clone = tmp_path / "elsewhere" / "numba_flash"
    copy_checkout(clone)
    page = clone / "docs" / "clone-location-check.md"
    page.write_text("# Blocks that print paths, run from another folder\n\n"
                    + "\n".join(blocks_that_name_files()))
    env = dict(os.environ, PYTHONPATH=str(clone), NUMBA_ENABLE_CUDASIM="1")
    r = subprocess.run([sys.executable, "docs/snippets.py", "--check", str(page)], cwd=clone,
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
