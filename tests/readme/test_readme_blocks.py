"""The README's Python blocks run as written (in order, one namespace, as a reader pastes them),
except those that need a GPU (CuPy)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_blocks():
    assert len(_blocks()) >= 3


def test_readme_blocks_run_on_a_cpu():
    ns = {}
    ran = 0
    for block in _blocks():
        if "import cupy" in block or "cp." in block:
            continue  # GPU only
        exec(compile(block, str(README), "exec"), ns)  # noqa: S102 - the README's own code
        ran += 1
    assert ran >= 3
    assert ns["lens"].tolist() == [8, 8]  # the generation loop appended 5 + 3 tokens
    # the last block: a user's variant, whose comment states the bound the printed error obeys
    bound = re.search(r"# float32: below (\S+) \((\S+) to (\S+) in (\d+) draws\)", _blocks()[-1])
    assert bound, "the own-variant block states its error bound"
    assert abs(ns["o"] - ns["o_ref"]).max() < float(bound.group(1))
