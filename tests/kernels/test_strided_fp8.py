"""The e4m3 forwards on strided views (issue 61): the ``mma.sync`` and warpgroup builds'
``STRIDED`` variants read ``q``, ``k`` (byte pairs through their strides), ``v`` (its ``[B, Hkv,
N, d / 4]`` word view, read through its strides by the transposing fills) and write ``out=``
through their strides: flash-attn's ``[B, N, H, d]`` memory as its ``transpose(0, 2, 1, 3)``
view, and a call whose q, k, v lie in three different layouts (so a base or a row stride taken
from the wrong operand fails). Against the float64 reference on the dequantised inputs at
tests/kernels/test_forward_fp8.py's measured bound, outputs NaN-poisoned (conftest), a sentinel
between ``out``'s rows, inputs unchanged; the stand-in device hands the views to the launch
without a copy.
"""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import float8_e4m3fn

import numba_flash
from numba_flash import standin as sd
from numba_flash.frontend import plans
from numba_flash import reference as ref
from tests.kernels.test_forward_fp8 import O_BOUND, check, dequantised

E4M3 = float8_e4m3fn
SENTINEL = 7.0


def _views(rng, layout, b, h, hkv, nq, nk, d):
    def randn(shape):
        return rng.standard_normal(shape).astype(E4M3)

    if layout == "bnhd":   # flash-attn's memory
        return (randn((b, nq, h, d)).transpose(0, 2, 1, 3),
                randn((b, nk, hkv, d)).transpose(0, 2, 1, 3),
                randn((b, nk, hkv, d)).transpose(0, 2, 1, 3))
    # "mixed": q transposed, k a batch slice at an offset, v rows with gaps
    return (randn((b, nq, h, d)).transpose(0, 2, 1, 3), randn((b + 1, hkv, nk, d))[1:],
            randn((b, hkv, nk, 2 * d))[..., d:])


@pytest.mark.parametrize("layout,kernel", [("bnhd", "mma"), ("mixed", "mma"),
                                           ("mixed", "wgmma")])   # (wgmma: d = 64, its least)
def test_fp8_forward_reads_views_through_strides(rng, layout, kernel):
    b, h, hkv, nq, nk, d = 1, 2, 1, 20, 41, 32 if kernel == "mma" else 64
    q, k, v = _views(rng, layout, b, h, hkv, nq, nk, d)
    scales = [rng.uniform(0.5, 2.0, (b, hkv)).astype(np.float32) for _ in range(3)]
    before = [x.copy() for x in (q, k, v)]
    mem = np.full((b, nq, h + 1, d), SENTINEL, np.float16)
    out = mem[:, :, 1:].transpose(0, 2, 1, 3)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True, q_descale=scales[0],
                                 k_descale=scales[1], v_descale=scales[2], out_dtype="float16",
                                 out=out, kernel=kernel)
    assert o is out
    check(o, lse, q, k, v, scales, causal=True)
    assert (mem[:, :, 0] == SENTINEL).all(), "out: a gap element written"
    for x, x0 in zip((q, k, v), before):
        np.testing.assert_array_equal(x.view(np.uint8), x0.view(np.uint8))


def test_fp8_device_path_takes_views_without_a_copy(rng):
    """Stand-in device arrays in flash-attn's layout: the steady call replays its plan, no
    copy, no device work outside the launch and no allocation but lse's, and the result is
    the reference's."""
    b, h, n, d = 1, 2, 16, 32
    mems = [rng.standard_normal((b, n, h, d)).astype(E4M3) for _ in range(3)]
    scales = [np.ones((b, h), np.float32) for _ in range(3)]   # (descales of 1)
    # (CuPy's form of e4m3: its uint8 bytes with qkv_dtype="fp8_e4m3")
    q, k, v = (sd.adopt(m.view(np.uint8)).transpose(0, 2, 1, 3) for m in mems)
    out_mem = sd.adopt(np.zeros((b, n, h, d), np.float16))
    out = out_mem.transpose(0, 2, 1, 3)
    # (no descales: device descales are stacked by device work of their own, not a copy)
    kw = dict(causal=True, out_dtype="float16", out=out, qkv_dtype="fp8_e4m3")
    with sd.device(execute=True), numba_flash.poisoned_outputs(False):
        numba_flash.forward(q, k, v, **kw)   # builds the plan
        before = plans.plan_stats()["plans"]
        with sd.count() as c:
            numba_flash.forward(q, k, v, **kw)
        assert plans.plan_stats()["plans"] == before
    assert (c.syncs, c.d2h, c.h2d, c.foreign, c.launches) == (0, 0, 0, 0, 1), c.log
    assert c.allocations <= 1, c.log     # lse
    want, _ = ref.attention(*dequantised(*(m.transpose(0, 2, 1, 3) for m in mems), scales),
                            causal=True)
    err = np.abs(out_mem._a.transpose(0, 2, 1, 3).astype(np.float64) - want).max()
    assert err <= O_BOUND * np.abs(mems[2].astype(np.float64)).max(), err
