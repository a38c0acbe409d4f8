"""bench/host_overhead.py on the stand-in device: issue 60's figures of a steady call, the
machine-independent ones (Python function calls, synchronisations, allocations), checked
against the issue's bounds.  Microseconds are reported by the benchmark, never asserted."""

from __future__ import annotations

import json

import pytest

import host_overhead

#: issue 60's bounds on Python calls per steady call (forward 622 and decode 1043 before)
BOUNDS = {"forward": 60, "forward_simt_f32": 60, "decode_run": 40, "decode": 80,
          "decode_contiguous": 80, "backward": 150}
#: results a call allocates (outputs; no out= in the benchmark but decode_run's)
ALLOCATIONS = {"forward": 1, "forward_simt_f32": 1, "forward_varlen": 1, "decode_run": 0,
               "decode": 1,
               "decode_contiguous": 1, "backward": 3, "decode_append_rotary": 1,
               "append_kv": 1, "apply_rotary": 1, "merge_states": 2}


@pytest.fixture(scope="module")
def rows():
    got = host_overhead.main(["--calls", "20", "--json", "--ops", *ALLOCATIONS])
    return {r["op"]: r for r in got}


def test_every_op_is_measured(rows):
    assert sorted(rows) == sorted(ALLOCATIONS)


@pytest.mark.parametrize("op", sorted(ALLOCATIONS))
def test_a_steady_call_never_syncs_and_allocates_its_results_only(rows, op):
    assert rows[op]["syncs"] == 0
    assert rows[op]["allocations"] == ALLOCATIONS[op]


@pytest.mark.parametrize("op", sorted(BOUNDS))
def test_python_calls_within_the_issue_bounds(rows, op):
    assert rows[op]["calls"] <= BOUNDS[op], rows[op]


def test_json_lines(capsys):
    host_overhead.main(["--calls", "2", "--json", "--ops", "decode_run"])
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    row = json.loads(line)
    assert set(row) == {"op", "device", "us", "calls", "syncs", "allocations"}
    assert row["device"] == "standin"
