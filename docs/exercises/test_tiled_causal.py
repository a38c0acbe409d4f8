"""Check of docs/exercises/tiled_causal.py: the kernel against the float64 reference, causal and
not, for Nq = Nk, Nq < Nk and Nq > Nk, with GQA; and the bytes read from k and v equal to the
tiles the blocks need (io_count.tiled_forward_bytes: a tile after the block's last visible key
is never loaded), counted element by element in the simulator."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref


@pytest.mark.parametrize("nq, nk", [(8, 8), (5, 11), (10, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_causal(exercise, nq, nk, causal):
    check(exercise("tiled_causal"), nq, nk, causal)


def check(mod, nq=6, nk=11, causal=True):
    from io_count import counting_wrap, tiled_forward_bytes

    rng = np.random.default_rng(nq * 100 + nk)
    q = rng.standard_normal((1, 2, nq, 5))
    k, v = (rng.standard_normal((1, 1, nk, 5)) for _ in range(2))
    wrap, stats = counting_wrap()
    o, lse = mod.run(q, k, v, causal, wrap)
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    np.testing.assert_allclose(o, o_ref, atol=1e-12, err_msg="o")
    np.testing.assert_allclose(lse, lse_ref, atol=1e-12, err_msg="lse")
    model = tiled_forward_bytes(1, 2, nq, nk, 5, mod.BLOCK_M, mod.BLOCK_N, 8, 8, causal)
    got = stats["k"]["read"] + stats["v"]["read"]
    want = model["read"] - q.nbytes
    assert got == want, f"k and v: {got} bytes read, the tiles the blocks need are {want} bytes"
