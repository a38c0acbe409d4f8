"""The exercises' checks: kept out of the default suite (setup.cfg's ``testpaths = tests``, and
skipped here unless asked for).

    python -m pytest -n 0 docs/exercises --exercises              # check your work
    python -m pytest -n 0 docs/exercises --exercises --solutions  # check the hidden solutions

Each ``test_NAME.py`` checks the module ``NAME.py`` next to it (the file you edit), or
``solutions/NAME.py`` with ``--solutions``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for sub in ("docs/examples", "docs"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))


def pytest_addoption(parser):
    parser.addoption("--exercises", action="store_true", help="run the exercises' checks")
    parser.addoption("--solutions", action="store_true",
                     help="check docs/exercises/solutions/ instead of the exercise files")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--exercises"):
        return
    skip = pytest.mark.skip(reason="an exercise check: run with --exercises")
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(skip)


def load(name, solutions=False):
    """The module ``NAME.py`` of the exercises (or of ``solutions/``), imported by path."""
    path = (HERE / "solutions" if solutions else HERE) / f"{name}.py"
    spec = importlib.util.spec_from_file_location(
        f"exercise_{'solution_' if solutions else ''}{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def exercise(request):
    """``exercise("name")``: the module to check."""
    return lambda name: load(name, request.config.getoption("--solutions"))
