"""examples/generate.py in the simulator at tiny sizes: a paged-cache generation loop (prefill
with forward_varlen + append_kv, decode steps with k_new/v_new and rotary fused) whose logits
match recomputing every sequence with forward, and which exits non-zero past its bound."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def generate():
    spec = importlib.util.spec_from_file_location("generate", ROOT / "examples/generate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _diffs(out):
    return [float(line.rsplit("= ", 1)[1]) for line in out.splitlines()
            if line.startswith("step ")]


def test_generation_matches_recomputation(generate, capsys):
    # 3 prompts of lengths 4, 1, 6 over pages of 4 tokens, 2 layers, GQA 4/2, 2 decode steps
    assert generate.main(["--steps", "2", "--prompt-lengths", "4,1,6"]) == 0
    out = capsys.readouterr().out
    diffs = _diffs(out)
    assert len(diffs) == 3 and max(diffs) <= 1e-4   # measured <= 1.1e-6 (seeds 0-3)
    assert max(diffs[1:]) > 0                        # the decode path is not the recompute's
    assert "within the bound" in out


def test_exits_non_zero_past_the_bound(generate, capsys):
    assert generate.main(["--steps", "1", "--prompt-lengths", "3,1", "--bound", "1e-9"]) == 1
    assert "OVER the bound" in capsys.readouterr().out
