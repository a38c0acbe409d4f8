"""Every claim docs/flash-decoding.md and docs/paged-attention.md print from decode_demo.py."""

from __future__ import annotations

import numpy as np

import numba_flash as nf
from numba_flash import reference as ref
from numba_flash.kernels.decode import config as kdecode
import snippets
from decode_demo import decode_blocks, forward_style_blocks, paged_case, to_contiguous


def test_starvation_grid_sizes():
    assert forward_style_blocks(1, 32, 1, 64) == 32
    blocks, splits, size = decode_blocks([32768], 32, 8)
    assert splits == -(-32768 // size) and splits * 8 >= kdecode.SM_COUNT  # fills the GPU
    assert size >= kdecode.GPU_MIN_SPLIT_TOKENS
    assert blocks == splits * 8  # one block per (split, kv head): 4 query heads per block
    blocks, splits, _ = decode_blocks([2048] * 64, 32, 8)
    assert splits == 8 and blocks == 8 * 64 * 8  # 256-key splits: a batch fills it anyway


def test_batch_invariance_is_bitwise_and_a_batch_dependent_policy_is_not():
    """Read from the page's recorded output of ``decode_demo.py invariance`` (bits_report:
    ``a.tobytes() == b.tobytes()`` and the largest difference); test_snippets checks that it is
    what the command prints now, so its decodes are not run a second time here."""
    text = snippets.recorded_output("flash-decoding.md",
                                    "python docs/examples/decode_demo.py invariance")
    lines = [ln.split() for ln in text.splitlines() if "bitwise equal:" in ln]
    assert [ln[:2] for ln in lines] == [["float32", "num_splits=None,"],
                                        ["float16", "num_splits=None,"],
                                        ["float32", "num_splits=3,"], ["float32", "2"]]
    same = [ln[ln.index("equal:") + 1] for ln in lines]
    assert same == ["True;", "True;", "True;", "False;"]  # the last: the bits do move ...
    assert float(lines[-1][-1]) < 1e-6  # ... by rounding only (printed 1.19e-07)


def test_decode_is_the_last_rows_of_causal_attention():
    """Read from the page's recorded output of ``decode_demo.py last-row`` (checked against a
    fresh run by test_snippets): decode in each dtype against the float64 oracle's last rows."""
    text = snippets.recorded_output("flash-decoding.md",
                                    "python docs/examples/decode_demo.py last-row")
    rows = [snippets.printed_fields(ln) for ln in text.splitlines() if "|decode - oracle|" in ln]
    assert [r[:2] for r in rows] == [[dt, f"Nq={n}:"] for dt in ("float64", "float32", "float16")
                                     for n in (1, 3)]
    # printed: float64 < 1e-14, float32 9.5e-8, float16 2.3e-4
    tol = {"float64": 1e-14, "float32": 1e-6, "float16": 2e-3}
    for r in rows:
        assert snippets.printed_below(r[-1], tol[r[0]]), r


def test_paged_nan_stale_slots_and_bad_tables():
    q, k, v, seqlens, table = paged_case(np.random.default_rng(7))
    assert np.isnan(k).any() and (table == -1).any()
    o = nf.decode(q, k, v, cache_seqlens=seqlens, block_table=table)
    want, _ = ref.paged_decode(q, k, v, seqlens, table)
    assert np.isfinite(o).all() and np.abs(o - want).max() < 1e-6  # measured 2.0e-7
    oc = nf.decode(q, to_contiguous(k, table, seqlens), to_contiguous(v, table, seqlens),
                   cache_seqlens=seqlens)
    assert o.tobytes() == oc.tobytes()
    bad = table.copy()
    bad[0, 1] = k.shape[0]  # num_blocks: must not be dereferenced
    ob, lb = nf.decode(q, k, v, cache_seqlens=seqlens, block_table=bad, validate=False,
                       return_lse=True)
    assert np.isnan(ob[0]).all() and np.isnan(lb[0]).all()
    assert ob[1:].tobytes() == o[1:].tobytes()
