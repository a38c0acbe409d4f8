"""Check of docs/exercises/sink_window.py: numba_flash.forward with the exercise's functions
against the float64 reference with the rule written out as a dense mask and temperature (not the
exercise's functions), for sinks and windows that overlap and that do not."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash as nf
from numba_flash import reference as ref


@pytest.mark.parametrize("sinks, window", [(2, 3), (4, 2)])
def test_sink_window(exercise, sinks, window):
    check(exercise("sink_window"), sinks, window)


def check(mod, sinks=3, window=2):
    rng = np.random.default_rng(sinks * 10 + window)
    n, h = 10, 2
    q = rng.standard_normal((1, h, n, 8)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, n, 8)).astype(np.float32) for _ in range(2))
    temp = np.array([0.5, 2.0], np.float32)
    params = np.array([sinks, window], np.int32)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    seen = (j <= i) & ((j < sinks) | (j > i - window))
    want = ref.attention(q, k, v, mask_mod=lambda b, hh, qi, kj: seen[qi, kj],
                         score_mod=lambda s, b, hh, qi, kj: s / float(temp[hh]))
    got = nf.forward(q, k, v, return_lse=True, mask_mod=mod.mask_mod, score_mod=mod.score_mod,
                     aux_tensors=(temp, params))
    # float32 kernel against the float64 reference: measured over 48 cases (12 seeds, 4
    # sink/window pairs) 6.4e-7 on o, 6.7e-7 on lse; bound 4e-6, about 6x
    for name, g, w in zip(("o", "lse"), got, want):
        np.testing.assert_allclose(g, w, atol=4e-6, err_msg=name)
