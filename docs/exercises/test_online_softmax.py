"""Check of docs/exercises/online_softmax.py against reference.online_softmax_stats: a maximum
that moves late, scores in the thousands, masked (-inf) blocks first and in the middle, a last
block that is shorter, and a vector that is all -inf."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref

NINF = -np.inf
CASES = {
    "rising": np.arange(10.0),
    "thousands": np.array([1000.0, 1003.0, 999.0, 2500.0, 2499.0, -3.0, 2501.0]),
    "masked first": np.array([NINF, NINF, NINF, 1.0, NINF, 2.0, 0.5]),
    "masked middle": np.array([0.5, 3.0, NINF, NINF, NINF, NINF, 4.0, NINF, 1.0]),
    "all masked": np.full(5, NINF),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("block", [1, 2, 3])
def test_online_softmax(exercise, name, block):
    check(exercise("online_softmax"), {name: CASES[name]}, (block,))


def check(mod, cases=CASES, blocks=(1, 2, 3)):
    for name, x in cases.items():
        want = ref.online_softmax_stats(x)
        for block in blocks:
            with np.errstate(all="ignore"):
                m, l = mod.stats_blocks(x.copy(), block)
            assert m == want[0], f"{name}, block {block}: m = {m}, want {want[0]}"
            assert np.isclose(l, want[1], rtol=1e-13, atol=0), (
                f"{name}, block {block}: l = {l}, want {want[1]}")
