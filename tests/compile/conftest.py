"""The compile tier's fixtures: where its builds are kept, and the suite's build table, once per
test process (see compile_suite.py)."""

from __future__ import annotations

import pytest

from compile_suite import build_table


@pytest.fixture(scope="session")
def compile_cache(request, tmp_path_factory):
    """The folder of the builds' cache: ``.pytest_cache/d/compile-tier`` (``pytest --cache-clear``
    empties it), or beside the workers' temporary folders under ``-p no:cacheprovider``."""
    cache = getattr(request.config, "cache", None)
    return (cache.mkdir("compile-tier") if cache is not None
            else tmp_path_factory.getbasetemp().parent / "compile-tier")


@pytest.fixture(scope="session")
def table(compile_cache, tmp_path_factory):
    return build_table(compile_cache, tmp_path_factory.mktemp("ptx") / "rows.json")
