"""docs/tiled-forward.md: the teaching tiled kernel reads each K/V tile once per block that needs
it and Q once (the tiled forward's model, byte for byte), writes each output once, and the bank
figures the page prints are those of its score loop."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash.teach.kernels.tiled_forward import SIM_BLOCKS
from numba_flash.teach.ops.tiled_forward import tiled_forward_teach
from helpers import randn
from io_count import count_global_bytes, tiled_forward_bytes


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 1, 8, 8, 4), (2, 4, 2, 5, 13, 3), (1, 2, 1, 9, 4, 2)])
def test_traffic_matches_tiled_model(rng, shape, causal):
    b, h, hkv, nq, nk, d = shape
    q = randn(rng, (b, h, nq, d), np.float32)
    k = randn(rng, (b, hkv, nk, d), np.float32)
    v = randn(rng, (b, hkv, nk, d), np.float32)
    _, (rec,) = count_global_bytes(lambda: tiled_forward_teach(q, k, v, causal=causal))
    model = tiled_forward_bytes(b, h, nq, nk, d, *SIM_BLOCKS, 4, 4, causal)
    assert (rec.read, rec.written) == (model["read"], model["written"])
    assert rec.arrays["o"]["written"] == rec.arrays["o"]["distinct_written"] == q.nbytes


def test_bank_figures():
    """The page's table: the unpadded k_tile read is 16-way at HEAD_DIM = 16 and 256 and 32-way
    at 32..128; the q_tile read is a broadcast where a warp is one row (BLOCK_N = 32)."""
    from tiled_teach_demo import gpu_blocks, ways

    for hd, want in ((16, 16), (32, 32), (64, 32), (128, 32), (256, 16)):
        bn = gpu_blocks(hd, np.float32)[1]
        assert ways([(t % bn) * hd for t in range(32)]) == want
        assert ways([hd * (t // bn) for t in range(32)]) == (1 if bn == 32 else 2)  # q_tile


def test_the_page_leaves_the_causal_lines_to_the_exercise():
    """docs/tiled-forward.md teaches the kernel but not its causal lines: writing them is
    docs/exercises/tiled_causal.py, whose answer must not be on the page."""
    from pathlib import Path

    import snippets

    page = (Path(snippets.DOCS) / "tiled-forward.md").read_text()
    kernel = (Path(snippets.ROOT) / "numba_flash/teach/kernels/tiled_forward.py").read_text()
    causal = kernel.split("# [/docs:teach-bounds]", 1)[1].split("# [docs:teach-load-q]", 1)[0]
    lines = [ln.strip() for ln in causal.splitlines() if ln.strip()]
    assert lines and lines[0].startswith("if CAUSAL")
    for line in lines:
        assert line not in page, f"the exercise's answer is on the page: {line}"
