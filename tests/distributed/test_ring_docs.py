"""What docs/ring-attention.md shows: the pictures draw, the cost model's formulas and numbers,
and the runnable example (under mpiexec, when there is one)."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs" / "examples"))

import ring_cost  # noqa: E402
import ring_pictures  # noqa: E402


def test_pictures_draw(tmp_path):
    pytest.importorskip("matplotlib")
    paths = ring_pictures.draw_all(str(tmp_path))
    assert [Path(p).name for p in paths] == ["ring.png", "ring_zigzag.png"]
    assert all(Path(p).stat().st_size > 10_000 for p in paths)


def test_picture_numbers():
    assert ring_pictures.causal_work(4, 4, "zigzag") == [132] * 4
    assert ring_pictures.causal_work(4, 4, "contiguous") == [36, 100, 164, 228]
    assert sum(ring_pictures.causal_work(4, 4, "zigzag")) == 32 * 33 // 2  # all of tril(32)
    assert ring_pictures.schedule(4)[0] == [0, 3, 2, 1]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("h,hkv,itemsize", [(1, 1, 4), (8, 1, 2), (32, 8, 2)])
def test_threshold_balances_compute_and_transfer(causal, h, hkv, itemsize):
    flops_rate, bw = 453e12, 50e9
    n = ring_cost.hiding_length(flops_rate, bw, h, hkv, itemsize, causal)
    b, d = 3, 64  # cancel out
    t_compute = ring_cost.step_flops(b, h, n, d, causal) / flops_rate
    t_transfer = ring_cost.step_bytes(b, hkv, n, d, itemsize) / bw
    assert math.isclose(t_compute, t_transfer, rel_tol=1e-12)


def test_quoted_numbers():
    # the page's table: torch fp16 at 453 TFLOP/s over NVLink (450 GB/s), MHA, no mask
    assert round(ring_cost.hiding_length(453e12, 450e9, 1, 1, 2, False)) == 1007
    assert round(ring_cost.hiding_length(13e12, 450e9, 1, 1, 4, False)) == 58
    assert round(ring_cost.hiding_length(13e12, 50e9, 1, 1, 4, True)) == 1040
    assert ring_cost.step_bytes(1, 8, 8192, 128, 2) == 32 * 2**20
    assert "| 9,060 | 18,120 |" in ring_cost.table()


def test_demo_output_quoted_on_the_page():
    """The page quotes ``ring_demo.py --ranks 4`` (an mpiexec run); tests/docs/test_snippets.py
    reruns that command and fails if the quoted text is stale, so checking the quoted numbers
    here checks the run without a second mpiexec."""
    page = (ROOT / "docs" / "ring-attention.md").read_text()
    block = page.split("<!-- run: python docs/examples/ring_demo.py --ranks 4 -->", 1)[1]
    block = block.split("```text\n", 1)[1].split("```", 1)[0]
    errs = {m[0]: float(m[1]) for m in re.findall(r"4 ranks, N = 32: (\w+) max error (\S+)",
                                                  block)}
    assert set(errs) == {"o", "dq", "dk", "dv"}, block
    assert max(errs.values()) < 1e-5, block  # float32 against the float64 oracle
