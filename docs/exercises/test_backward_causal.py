"""Check of docs/exercises/backward_causal.py: gradients against reference.attention_backward,
and only the tile pairs a causal forward visits are computed."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.tools.pictures import SKIPPED, tile_kinds


@pytest.mark.parametrize("n, br, bc", [(12, 4, 4), (13, 4, 3), (10, 5, 2)])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_causal(exercise, n, br, bc, causal):
    check(exercise("backward_causal"), n, br, bc, causal)


def check(mod, n=12, br=4, bc=4, causal=True):
    rng = np.random.default_rng(n * 10 + bc)
    q, k, v, do = (rng.standard_normal((n, 4)) for _ in range(4))
    o, lse = ref.attention(q[None, None], k[None, None], v[None, None], causal=causal)
    *got, steps = mod.tiled_backward(q, k, v, o[0, 0], do, lse[0, 0], br, bc, causal=causal)
    want = ref.attention_backward(do[None, None], q[None, None], k[None, None], v[None, None],
                                  causal=causal)
    for name, g, w in zip(("dQ", "dK", "dV"), got, want):
        np.testing.assert_allclose(g, w[0, 0], atol=1e-12, err_msg=name)
    visited = int((tile_kinds(n, n, br, bc) != SKIPPED).sum()) if causal else \
        -(-n // br) * -(-n // bc)
    assert steps == visited, f"{steps} tile pairs computed, the causal forward visits {visited}"
