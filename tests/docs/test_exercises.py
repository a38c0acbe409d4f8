"""The exercises of docs/exercises/ can be done: each check passes on the hidden solution and
fails on the exercise as handed out (so a check cannot pass by accident).  The checks themselves
stay out of the default suite (docs/exercises/conftest.py skips them without --exercises)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXERCISES = Path(__file__).resolve().parents[2] / "docs" / "exercises"
NAMES = ["naive_causal", "row_skip_tiles", "p_tile_banks", "backward_causal", "merge_splits"]


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", NAMES)
def test_exercise_check_fails_as_handed_out_and_passes_on_the_solution(name):
    check = _load(EXERCISES / f"test_{name}.py", f"check_{name}").check
    check(_load(EXERCISES / "solutions" / f"{name}.py", f"solution_{name}"))
    with pytest.raises(AssertionError):
        check(_load(EXERCISES / f"{name}.py", f"exercise_{name}"))


def test_every_exercise_has_a_check_a_solution_and_a_page():
    docs = EXERCISES.parent
    pages = "\n".join(p.read_text() for p in docs.glob("*.md"))
    found = sorted(p.stem for p in EXERCISES.glob("*.py")
                   if p.stem != "conftest" and not p.stem.startswith("test_"))
    assert found == sorted(NAMES)
    for name in NAMES:
        assert (EXERCISES / f"test_{name}.py").is_file()
        assert (EXERCISES / "solutions" / f"{name}.py").is_file()
        assert f"docs/exercises/{name}.py" in pages, f"no page sets the exercise {name}"
