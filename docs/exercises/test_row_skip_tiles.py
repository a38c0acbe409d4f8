"""Check of docs/exercises/row_skip_tiles.py: right outputs, and the bytes read from k and v equal
the tiled forward's model (each K/V tile once per block that needs it), counted in the simulator
by docs/examples/io_count.py's CountingArray."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from numba_flash import reference as ref


@pytest.mark.parametrize("nq, nk", [(12, 12), (5, 14), (13, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_row_skip_tiles(exercise, nq, nk, causal):
    check(exercise("row_skip_tiles"), nq, nk, causal)


def check(mod, nq=12, nk=12, causal=True):
    from io_count import CountingArray, tiled_forward_bytes

    rng = np.random.default_rng(nq * 100 + nk)
    q = rng.standard_normal((1, 1, nq, 4))
    k, v = (rng.standard_normal((1, 1, nk, 4)) for _ in range(2))
    stats, lock = {}, threading.Lock()

    def wrap(name, a):
        stats[name] = {"read": 0, "written": 0, "touched_read": np.zeros(a.shape, bool),
                       "touched_written": np.zeros(a.shape, bool)}
        return CountingArray(a, stats[name], lock)

    o, lse = mod.run(q, k, v, causal, wrap)
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, err_msg="o")
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12, err_msg="lse")
    model = tiled_forward_bytes(1, 1, nq, nk, 4, mod.BLOCK_M, mod.BLOCK_N, 8, 8, causal)
    kv_read = stats["k"]["read"] + stats["v"]["read"]
    assert kv_read == model["read"] - q.nbytes, (
        f"k and v: {kv_read} bytes read, the tiles the blocks need are {model['read'] - q.nbytes}")
