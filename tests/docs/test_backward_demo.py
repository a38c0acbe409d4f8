"""Every claim docs/backward.md prints from backward_demo.py."""

from __future__ import annotations

import snippets
from backward_demo import delta_case, notes_case, stats_case


def recorded(what):
    """The page's recorded output of ``backward_demo.py what``: test_snippets checks that it is
    what the command prints now, so these claims are read from it, not run a second time."""
    return snippets.recorded_output("backward.md", f"python docs/examples/backward_demo.py {what}")


def test_p_from_lse_is_p_from_m_and_l():
    for spread in (1.0, 8.0):
        r = stats_case(spread=spread)
        # both within a few float32 ulps of |lse| of the truth
        assert r["err_mL"] < 1e-6 and r["err_lse"] < 2 * r["max_lse"] * 2.0**-24 + 1e-7
    assert stats_case(spread=8.0)["err_lse"] > stats_case(spread=8.0)["err_mL"]


def test_delta_identity_and_partial_tile_sums():
    r = delta_case()
    assert r["identity"] < 1e-13
    assert min(r["tile_err"]) > 0.1  # no single tile's sum is D
    d0, parts = r["row0"]
    assert abs(sum(parts) - d0) < 1e-13


def test_notes_backward_wrong_unless_one_tile_spans_the_row():
    assert max(notes_case(12)) < 1e-13
    for bc in (6, 4, 2):
        dq, dk, dv = notes_case(bc)
        assert dq > 0.1 and dk > 0.1  # dS uses a partial row sum
        assert dv < 1e-13  # dV does not involve dS


def test_kernels_gqa_empty_rows_determinism():
    text = recorded("kernel")
    rows = {ln.split()[0]: [float(x) for x in ln.split()[-3:]] for ln in text.splitlines()
            if ln.split()[:1] in (["atomic"], ["deterministic"])}
    assert set(rows) == {"atomic", "deterministic"}
    assert max(rows["atomic"] + rows["deterministic"]) < 2e-6  # float32, printed 5.7e-7
    assert "deterministic=True twice: bitwise identical: True" in text
    assert "their dq all zero: True; every gradient finite: True" in text
    assert "see no key: lse = [-inf]," in text
    assert "dk, dv come back as (1, 2, 9, 8)" in text


def test_window_skips_tiles():
    from backward_demo import skip_case

    r = skip_case()
    n_tiles = len(r["full"])
    assert r["full"] == [n_tiles] * n_tiles
    assert r["causal"] == list(range(n_tiles, 0, -1))
    # a window of 9 keys (8, 0) over tiles of 16: at most 2 Q tiles per K/V tile, O(N w)
    assert max(r["window"]) <= 2 and sum(r["window"]) < sum(r["causal"]) / 2


def test_variants_and_varlen_match_reference():
    lines = recorded("variants").splitlines()
    errs = [float(x) for ln in lines[2:-1] for x in ln.split()[-3:]]
    assert len(errs) == 15 and max(errs) < 6e-6  # float32 bound of test_backward_variants.py
    assert lines[-1].endswith("empty sequence's keys get dk = dv = 0: True")
