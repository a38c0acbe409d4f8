"""The exercises of docs/exercises/ can be done, and their checks bite: each check passes on the
solution, fails on the exercise as handed out, and fails on a recorded plausible wrong answer
(:data:`WRONG`: the solution with one mistake a student could make, as text replacements).  The
checks themselves stay out of the default suite (docs/exercises/conftest.py skips them without
--exercises); here each runs once, with its default case."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXERCISES = Path(__file__).resolve().parents[2] / "docs" / "exercises"

#: exercise -> (the mistake, [(text of the solution, replacement)])
WRONG = {
    "online_softmax": ("no guard for a block of -inf scores before any finite one (NaN)", [
        ("        if m_new == -np.inf:\n"
         "            continue  # nothing seen yet: exp(-inf - (-inf)) would be NaN\n", "")]),
    "naive_window": ("a window of W + 1 keys", [
        ("lo = max(0, diag - WINDOW + 1)", "lo = max(0, diag - WINDOW)")]),
    "naive_traffic": ("K and V counted once per kv head, as if a GQA group shared the reads", [
        ("read = b * h * (nq * d + 2 * keys * d) * itemsize",
         "read = b * (h * nq * d + hkv * 2 * keys * d) * itemsize")]),
    "row_window_tiles": ("the tile range from the block's last row alone", [
        ("kv_lo = bounds(first, nq, nk)[0]", "kv_lo = bounds(last, nq, nk)[0]")]),
    "predict_failures": ("a missing barrier always shows, even with one tile", [
        ('"no_end_barrier_one_tile": "right"', '"no_end_barrier_one_tile": "wrong"')]),
    "tiled_causal": ("top-left alignment (the notes' q_pos >= k_pos)", [
        ("hi = min(hi, max(0, row + nk - nq + 1))", "hi = min(hi, row + 1)"),
        ("kv_end = min(nk, max(0, last + nk - nq + 1))", "kv_end = min(nk, last + 1)")]),
    "k_tile_banks": ("a pad of one 16-byte chunk, as the production kernel's 16-byte reads need", [
        ("return head_dim + 1", "return head_dim + 4")]),
    "backward_d": ("P normalised per tile, like the forward's running state", [
        ("            Pij = np.exp(Sij - lse[i, None])\n",
         "            Pij = np.exp(Sij - Sij.max(axis=1, keepdims=True))\n"
         "            Pij /= Pij.sum(axis=1, keepdims=True)\n")]),
    "backward_causal": ("every tile masked, none skipped", [
        ("            if causal and k_start > q_last:\n"
         "                break  # this tile and every later one lie above the diagonal\n", "")]),
    "merge_splits": ("an empty split weighted 0, but its unwritten o still read (0 * NaN)", [
        ("    o = np.where(live[:, :, None], o_parts, 0.0)      # never read an empty split's o\n",
         "    o = o_parts\n")]),
    "paged_lookup": ("entries past num_blocks refused, negative ones not", [
        ("    if page < 0 or page >= n_blocks:", "    if page >= n_blocks:")]),
    "dropout_backward": ("the keep mask in dP without its 1 / (1 - p)", [
        ("            dPij = (dO[i] @ V[j].T) * Z\n",
         "            dPij = (dO[i] @ V[j].T) * (Z > 0)\n")]),
    "sink_window": ("the sinks visible to queries before them (the future)", [
        ("    return kv_idx <= q_idx and (kv_idx < params[0] or kv_idx > q_idx - params[1])",
         "    return kv_idx < params[0] or q_idx - params[1] < kv_idx <= q_idx")]),
    "p_tile_banks": ("a pad of one 16-byte chunk (4 words)", [
        ("    while stride % 32 not in (8, 24):", "    while stride % 32 not in (4, 28):")]),
    "swizzle_tile": ("the tensor-core tiles' 128-byte swizzle, XOR with r % 8 (4-way)", [
        ("    return r * 32 + (c ^ r)", "    return r * 32 + (c ^ (r % 8))")]),
}
NAMES = sorted(WRONG)


def _load(path, name, source=None):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    if source is None:
        spec.loader.exec_module(module)
    else:
        module.__file__ = str(path)
        exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def wrong_answer(name):
    """The solution of ``name`` with the recorded mistake of :data:`WRONG` put in."""
    path = EXERCISES / "solutions" / f"{name}.py"
    source = path.read_text()
    for old, new in WRONG[name][1]:
        assert source.count(old) == 1, f"{name}: the recorded mistake no longer applies: {old!r}"
        source = source.replace(old, new)
    return _load(path, f"wrong_{name}", source)


@pytest.mark.parametrize("name", NAMES)
def test_check_passes_the_solution_and_rejects_the_hand_out_and_a_wrong_answer(name):
    check = _load(EXERCISES / f"test_{name}.py", f"check_{name}").check
    check(_load(EXERCISES / "solutions" / f"{name}.py", f"solution_{name}"))
    with pytest.raises(AssertionError):
        check(_load(EXERCISES / f"{name}.py", f"exercise_{name}"))
    with pytest.raises(AssertionError):
        check(wrong_answer(name))


def test_every_exercise_has_a_check_a_solution_a_wrong_answer_and_a_page():
    docs = EXERCISES.parent
    pages = "\n".join(p.read_text() for p in docs.glob("*.md"))
    found = sorted(p.stem for p in EXERCISES.glob("*.py")
                   if p.stem != "conftest" and not p.stem.startswith("test_"))
    assert found == NAMES
    assert len(NAMES) >= 10
    for name in NAMES:
        assert (EXERCISES / f"test_{name}.py").is_file()
        assert (EXERCISES / "solutions" / f"{name}.py").is_file()
        assert f"docs/exercises/{name}.py" in pages, f"no page sets the exercise {name}"
