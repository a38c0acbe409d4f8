"""Compile tier: every kernel configuration of the suite's selection, built to PTX (the
``mma.sync`` kernels for sm_80 and sm_90, the others for sm_90: ``compile_check.suite_target``)
and assembled by ptxas (``compile_suite.py`` runs the build, the ``table`` fixture of
conftest.py shares it).  Fails on float64 instructions in float16/float32 kernels, on register
spills, on a stack frame and on static shared memory over 48 KiB.  The SASS tier
(test_sass_tier.py) counts the same builds.  The resource table is printed (run ``pytest
tests/compile -s`` or ``NUMBA_ENABLE_CUDASIM=0 python -m numba_flash.tools.compile_check --sass``).
"""

from __future__ import annotations

import pytest
from compile_suite import BUILDS, NAMES, SASS_ARCH

from numba_flash.tools.compile_check import known_spill

pytestmark = pytest.mark.compile


def test_every_catalog_source_lists_configurations():
    from numba_flash.tools import catalog

    for source in catalog.SOURCES:
        assert list(source()), source.__qualname__


@pytest.mark.parametrize("name, cc", BUILDS)
def test_configuration_compiles_clean(table, name, cc):
    row = table[(name, cc)]
    assert row["ptxas_rc"] == 0, row["ptxas_err"]
    assert not row["problems"], "; ".join(row["problems"])


def test_checker_catches_float64(table):
    """The f64 scan is not vacuous: the float64 softmax kernel does use f64 instructions."""
    row = table[(next(n for n in NAMES if n.startswith("softmax") and "float64" in n), "sm_90")]
    assert row["f64"]


def test_known_stack_frames_are_still_real(table):
    """compile_check.KNOWN_STACK only shrinks: every entry still covers a configuration that has
    a stack frame (drop an entry once its kernel is fixed)."""
    from numba_flash.tools.compile_check import KNOWN_STACK, known_stack
    covered = {known_stack(name) for (name, _), row in table.items() if row["stack"]}
    stale = sorted(set(KNOWN_STACK) - covered)
    assert not stale, f"no stack frame any more: drop {stale} from compile_check.KNOWN_STACK"


def test_known_spills_are_still_real_and_within_their_budget(table):
    """compile_check.KNOWN_SPILL only shrinks (every entry that covers a configuration of the
    suite's builds still covers a spilling one), and a spill it lets pass holds at most its
    entry's local-memory instructions in the counted sm_90 loop."""
    from numba_flash.tools.compile_check import KNOWN_SPILL, loop_local_ops
    spilling = {name: row for (name, cc), row in table.items()
                if row["spill_stores"] or row["spill_loads"]}
    built = {known_spill(name) for name, _ in table} - {None}
    stale = sorted(built - {known_spill(name) for name in spilling})
    assert not stale, f"no spill any more: drop {stale} from compile_check.KNOWN_SPILL"
    for (name, cc), row in table.items():
        if cc == SASS_ARCH[name] and name in spilling and known_spill(name):
            budget = KNOWN_SPILL[known_spill(name)][0]
            assert (loop_local_ops(row) or 0) <= budget, (name, row["sass"]["counts"])
