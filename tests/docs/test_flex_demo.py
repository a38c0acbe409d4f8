"""Every claim docs/own-variant.md prints from flex_demo.py and flex_step.py (the simulator)."""

from __future__ import annotations

import numpy as np
import pytest

import flex_demo
import flex_step
import snippets
from numba_flash.flex import EMPTY, FULL, PARTIAL, create_block_mask

# float16 tensor-core forward vs the float64 reference (and vs forward_varlen) at the demo's
# shapes: o within 9.8e-4 (one float16 ulp at 1.0: two float16 outputs a rounding apart), lse
# within 4.8e-7 (measured over every row below, 2026-12-01)
O_BOUND, LSE_BOUND = 2e-3, 1e-6


def _rows_within_bounds(rows):
    for name, what, eo, el in rows:
        if "reference(score_mod) vs reference" in what or "reference_varlen" in what:
            assert eo < 1e-14 and el < 1e-14, (name, what, eo, el)  # float64 vs float64
        else:
            assert eo < O_BOUND and el < LSE_BOUND, (name, what, eo, el)


def test_scores():
    rows = flex_demo.scores_rows()
    assert len(rows) == 5
    _rows_within_bounds(rows)
    # the score_mod and the built-in run the same float32 steps: o the same to the bit here
    assert rows[-1][2] == 0.0


def _recorded_rows(what):
    """``(text, rows)``: the page's recorded output of ``flex_demo.py what`` (test_snippets
    checks that it is what the command prints now, so its launches are not run again here) and
    its print_rows rows as ``(line, o, lse)``, o and lse as printed."""
    text = snippets.recorded_output("own-variant.md", f"python docs/examples/flex_demo.py {what}")
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.split()[:2] == ["variant", "compared"])
    rows = []
    for ln in lines[start + 1:]:
        fields = snippets.printed_fields(ln)
        if len(fields) < 4 or " vs " not in ln:
            break
        rows.append((ln, *fields[-2:]))
    return text, rows


def _printed_rows_within_bounds(rows):
    for line, eo, el in rows:
        if "reference(score_mod) vs reference" in line or "reference_varlen" in line:
            bound = (1e-14, 1e-14)  # float64 vs float64
        else:
            bound = (O_BOUND, LSE_BOUND)
        assert snippets.printed_below(eo, bound[0]) and snippets.printed_below(el, bound[1]), line


def test_documents_against_varlen():
    text, rows = _recorded_rows("documents")
    assert len(rows) == 4
    _printed_rows_within_bounds(rows)
    # the block mask changes which tiles run, not a single output bit
    assert text.splitlines()[-1] == ("with and without the block mask, o is bit for bit the "
                                     "same: True")
    n = sum(flex_demo.DOC_LENS)  # the demo's block mask, built on the host (no launch)
    bm = create_block_mask(flex_demo.same_document, 1, None, n, n,
                           aux_tensors=(flex_demo.documents_of(flex_demo.DOC_LENS),), BLOCK_SIZE=16)
    np.testing.assert_array_equal(bm.kind[0, 0], [[PARTIAL, PARTIAL, EMPTY],
                                                  [PARTIAL, FULL, EMPTY],
                                                  [EMPTY, EMPTY, FULL]])
    assert str(bm).splitlines()[1:] == ["xx.", "x#.", "..#"]
    assert str(bm) in text  # the printed mask is this one


def test_prefix_lm():
    _, rows = _recorded_rows("prefix")
    assert len(rows) == 1
    _printed_rows_within_bounds(rows)


def test_tiles_visited_are_the_non_empty_blocks():
    qb, kb = flex_demo.kernel_tile()
    assert (qb, kb) == (32, 16)  # the page's prose: the simulator's tensor-core forward tile
    runs = {r["lengths"]: r for r in map(flex_demo.visited_tiles, flex_demo.LAYOUTS)}
    for r in runs.values():
        assert (r["bm"].Q_BLOCK, r["bm"].KV_BLOCK) == (qb, kb)  # one block per kernel tile
        assert r["visited"] == r["non_empty"] == len(r["tiles"]), r  # each tile computed once
        assert r["o_err"] < O_BOUND
        kind = r["bm"].kind[0, 0]
        assert {(qs // qb, kt) for _, _, qs, kt in r["tiles"]} == set(zip(*np.nonzero(kind)))
    assert [runs[lens]["visited"] for lens in flex_demo.LAYOUTS] == [8, 4, 4, 6]
    # one document: every tile, all FULL; documents on tile edges: each Q tile's own keys only
    assert (runs[(64,)]["bm"].kind == FULL).all()
    assert runs[(8,) * 8]["visited"] == runs[(16,) * 4]["visited"] == 64 // kb
    # documents shorter than a tile: their tiles are PARTIAL (masked per element)
    for lens in ((16,) * 4, (8,) * 8):
        kind = runs[lens]["bm"].kind
        assert set(kind[kind != EMPTY].tolist()) == {PARTIAL}
    # the documents crossing tile edges cost more tiles than those on the edges
    assert runs[(5, 19, 12, 28)]["visited"] > runs[(16,) * 4]["visited"]


def test_cost_grows_with_the_documents_not_n_squared():
    rows = flex_demo.scaling_rows()
    for r in rows:  # documents of 256 tokens in 128-blocks: 2 x 2 blocks each, all FULL
        assert r["non_empty"] == (r["n"] // 256) * 4
        assert r["all"] == (r["n"] // 128) ** 2
    assert rows[-1]["non_empty"] / rows[0]["non_empty"] == rows[-1]["n"] / rows[0]["n"]


def test_step_into_score_mod():
    cmds = "p q_idx, kv_idx, float(score); n; p float(s); up; p row, key, float(s)"
    stopper, o_err = flex_step.run_stopped(cmds, {"q_idx": 3, "kv_idx": 1})
    out = stopper.out.getvalue()
    blk, tid = stopper.stopped_in
    assert blk == 0 and tid == 12  # lane (g, t) = (3, 0) holds row 3 and keys 0, 1 of n = 0
    lines = [ln for ln in out.splitlines() if ln.startswith("(Pdb) (")]
    q_idx, kv_idx, score = eval(lines[0][6:])
    assert (q_idx, kv_idx) == (3, 1)
    _, _, _, bias = flex_step.inputs()
    s_after = float(out.split("-> return s\n(Pdb) ")[1].split()[0])
    assert s_after == pytest.approx(score + float(bias[0, 3 - 1 + flex_step.N - 1]), abs=1e-6)
    assert eval(lines[1][6:]) == (3, 1, score)  # the score stage's frame: row, key, its score
    assert "flash_forward_mma" not in out and "tile_scores.py(" in out and "score_fn()" in out
    calls = stopper.calls  # 16 x 16 scores, 8 per lane: the stop did not end the counting
    assert sum(calls.values()) == 256 and len(calls) == 32 and set(calls.values()) == {8}
    assert o_err < O_BOUND


def test_breakpoint_inside_a_score_mod_stops_in_pdb():
    """breakpoint() written inside the score_mod stops in pdb in the simulator, in the thread that
    computes (q_idx, kv_idx) = (3, 1), called by the score stage (the page's claims); the host
    check no longer refuses it (it compiles to nothing there)."""
    text, o_err = flex_step.try_breakpoint("p q_idx, kv_idx, float(score); up; "
                                           "p row, key, float(s)")
    assert o_err is not None, text                # not refused before launch
    lines = [ln for ln in text.splitlines() if ln.startswith("(Pdb) (")]
    assert len(lines) == 2, text
    q_idx, kv_idx, score = eval(lines[0][6:])
    assert (q_idx, kv_idx) == (3, 1)
    assert eval(lines[1][6:]) == (3, 1, score)  # the score stage's frame: row, key, its score
    assert text.startswith("> docs/examples/flex_step.py(") and "score_fn()" in text
    assert o_err < O_BOUND
