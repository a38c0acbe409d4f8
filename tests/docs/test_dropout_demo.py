"""Every claim docs/dropout.md prints from dropout_demo.py."""

from __future__ import annotations

import re

import numba_flash as nf
import snippets
from dropout_demo import keep_by_hand, rate_rows


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


def recorded(what):
    """The page's recorded output of ``dropout_demo.py what`` (test_snippets checks that it is
    what the command prints now, so the claims are read from it, not run a second time)."""
    return snippets.recorded_output("dropout.md", f"python docs/examples/dropout_demo.py {what}")


def test_kernel_output_reproduced_from_the_mask():
    text = recorded("reproduce")

    def values(label):  # the numbers (and booleans) printed after label on its line
        line = next(ln for ln in text.splitlines() if label in ln)
        return [snippets.printed_value(x) for x in
                re.findall(r"\d+\.\d+(?:e[+-]\d+)?|True|False", line.split(label, 1)[1])]

    o_err, lse_err = values("forward:")
    assert o_err < 2e-6 and lse_err < 2e-6  # printed 2.3e-7, 2.4e-7
    assert len(values("backward:")) == 3 and max(values("backward:")) < 3e-6  # printed 4.4e-7
    assert values("lse with dropout is bitwise the lse without:") == [True]
    assert values("tiles 16 x 8 instead of 8 x 8:")[0] < 1e-6
    assert values("seed 100 instead of 99:")[0] > 0.1
    assert abs(values("kept fraction of the visible probabilities:")[0] - 0.7) < 0.05


def test_notes_order_is_biased_and_divides_zero_by_zero():
    text = recorded("notes")
    row = next(snippets.printed_fields(ln) for ln in text.splitlines()
               if ln.split()[:1] == ["20000"])
    ref_bias, notes_bias, stderr = map(float, row[1:4])
    nan_rows, rows = int(row[4]), int(row[6])
    assert ref_bias < 4 * stderr  # unbiased: within the sampling error
    assert notes_bias > 10 * stderr  # biased
    assert nan_rows > 0
    assert abs(nan_rows / rows - 0.5 ** 6) < 0.005  # a row loses all Nk = 6 keys: p^Nk
