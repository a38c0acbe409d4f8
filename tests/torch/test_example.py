"""examples/torch_train_tiny_gpt.py runs (smallest settings) and its losses match SDPA's."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = pathlib.Path(__file__).parents[2] / "examples" / "torch_train_tiny_gpt.py"


def test_tiny_gpt_example(capsys):
    spec = importlib.util.spec_from_file_location("torch_train_tiny_gpt", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    status = example.main(["--steps", "2", "--seq-len", "8", "--batch", "1", "--tolerance",
                           "1e-5"])
    out = capsys.readouterr().out
    assert status == 0, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2 and all(float(r[1]) > 0 for r in rows)
