"""docs/row-forward.md: the first tiled kernel reads each K/V tile once per block (the tiled
forward's model, byte for byte) and writes each output once; the demo's blocks run."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash.teach.kernels.row_forward import SIM_BLOCK_M, SIM_BLOCK_N
from numba_flash.teach.ops.row_forward import row_forward
from helpers import randn
from io_count import count_global_bytes, tiled_forward_bytes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 8, 8, 4), (2, 4, 2, 5, 13, 3), (1, 2, 1, 9, 4, 2)])
def test_row_forward_traffic_matches_tiled_model(rng, shape, causal):
    b, h, hkv, nq, nk, d = shape
    q = randn(rng, (b, h, nq, d), np.float32)
    k = randn(rng, (b, hkv, nk, d), np.float32)
    v = randn(rng, (b, hkv, nk, d), np.float32)
    _, (rec,) = count_global_bytes(lambda: row_forward(q, k, v, causal=causal))
    model = tiled_forward_bytes(b, h, nq, nk, d, SIM_BLOCK_M, SIM_BLOCK_N, 4, 4, causal)
    assert (rec.read, rec.written) == (model["read"], model["written"])
    assert rec.arrays["o"]["written"] == rec.arrays["o"]["distinct_written"] == q.nbytes


@pytest.mark.parametrize("what", ["errors", "traffic"])
def test_demo_runs(what):
    """The page's recorded output of the demo (test_snippets runs the command and checks that
    it prints exactly this, so the demo is not run a second time here)."""
    import snippets

    out = snippets.recorded_output("row-forward.md",
                                   f"python docs/examples/row_forward_demo.py {what}")
    assert "row_forward" in out
