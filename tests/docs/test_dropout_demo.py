"""Every claim docs/dropout.md prints from dropout_demo.py."""

from __future__ import annotations

import numba_flash as nf
from dropout_demo import keep_by_hand, notes_case, rate_rows, reproduce_case


def test_by_hand_equals_dropout_mask():
    seed, p = 2**40 + 12345, 0.25
    mask = nf.dropout_mask(seed, 2, 3, 5, 10, p)
    for b in range(2):
        for h in range(3):
            for i in range(5):
                for j in range(10):
                    assert keep_by_hand(seed, b, h, i, j, p)[0] == mask[b, h, i, j]


def test_keep_rate_binomial():
    for r in rate_rows():
        assert r["pvalue"] > 1e-3, r  # a wrong threshold (p instead of 1 - p) gives ~0
        assert abs(r["rate"] - (1 - r["p"])) < 0.01
        assert all(abs(w - (1 - r["p"])) < 0.01 for w in r["words"])


def test_kernel_output_reproduced_from_the_mask():
    r = reproduce_case()
    assert r["o_err"] < 2e-6 and r["lse_err"] < 2e-6  # measured 3.5e-7, 2.9e-7
    assert max(r["grad_err"]) < 3e-6  # measured 6.8e-7
    assert r["lse_same_as_plain"] and r["tiles_diff"] < 1e-6
    assert r["other_seed_diff"] > 0.1
    assert abs(r["kept"] - 0.7) < 0.05


def test_notes_order_is_biased_and_divides_zero_by_zero():
    r = notes_case(samples=20000)
    assert r["ref_bias"] < 4 * r["stderr"]  # unbiased: within the sampling error
    assert r["notes_bias"] > 10 * r["stderr"]  # biased
    assert r["nan_rows"] > 0
    assert abs(r["nan_rows"] / r["rows"] - r["all_dropped"]) < 0.005
