"""``apply_rotary`` and ``merge_states`` on strided views (issue 61): the rotary kernel indexes
``x`` through its strides (Numba's own indexing), so flash-attn's ``[B, N, H, d]`` memory
(passed as its ``transpose(0, 2, 1, 3)`` view) and a fused QKV projection's slice are read where
they lie; ``merge_states`` reads ``o_parts`` (and ``lse_parts``) views whose row axes fold into
at most three through their strides.  Against the float64 reference, outputs NaN-poisoned
(conftest), inputs unchanged byte for byte; the stand-in device's launch gets the views
themselves (no copy: no foreign device work, one allocation an output).

Tolerances: tests/kernels/test_rotary.py's and tests/kernels/test_merge_kernel.py's (the same
arithmetic; only the addresses differ).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash import standin as sd
from numba_flash.frontend import plans
from numba_flash.kernels.core.elements import BFLOAT16
from tests.helpers import assert_scaled_close

#: test_rotary.TOL (bfloat16: 8x float16's, 3 fewer bits)
ROT_TOL = {np.dtype(np.float16): 1e-3, np.dtype(np.float32): 5e-7, BFLOAT16: 8e-3}


def _tables(rng, max_position, half, dtype):
    angle = rng.uniform(0, 2 * np.pi, (max_position, half))
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def _rotary_views(rng, layout, b, n, h, d, dtype):
    """``x`` ``[B, H, N, d]`` as a view of flash-attn's ``[B, N, H, d]`` memory ("bnhd") or of a
    fused projection ``[B, N, 3, H, d]`` (its k slice, "fused"); and the memory."""
    if layout == "bnhd":
        mem = rng.standard_normal((b, n, h, d)).astype(dtype)
        return mem.transpose(0, 2, 1, 3), mem
    mem = rng.standard_normal((b, n, 3, h, d)).astype(dtype)
    return mem[:, :, 1].transpose(0, 2, 1, 3), mem


@pytest.mark.parametrize("layout,dtype,interleaved", [
    ("bnhd", np.float32, False), ("fused", np.float16, True), ("bnhd", BFLOAT16, False)])
def test_rotary_reads_views_in_place(layout, dtype, interleaved, rng):
    b, n, h, d, rot = 2, 5, 3, 8, 6
    dtype = np.dtype(dtype)
    x, mem = _rotary_views(rng, layout, b, n, h, d, dtype)
    assert not x.flags.c_contiguous
    before = mem.copy()
    cos, sin = _tables(rng, 12, rot // 2, dtype)
    offsets = np.array([0, 7], np.int32)   # the last sequence ends at position 11 = max - 1
    got = numba_flash.apply_rotary(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    want = ref.apply_rotary(*(a.astype(np.float64) for a in (x, cos, sin)),
                            interleaved=interleaved, seqlen_offsets=offsets)
    assert got.shape == x.shape and got.dtype == dtype
    assert_scaled_close(got.astype(np.float64), want, ROT_TOL[dtype], name="rotary")
    np.testing.assert_array_equal(got[..., rot:].view(np.uint8), x[..., rot:].view(np.uint8))
    np.testing.assert_array_equal(mem.view(np.uint8), before.view(np.uint8))
    assert np.abs(want - x.astype(np.float64)).max() > 0.1   # something turned


def test_rotary_device_path_takes_the_view_without_a_copy(rng):
    """Stand-in device arrays: ``x`` a transposed view of ``[B, N, H, d]`` memory goes to the
    launch as it lies (no copy: no foreign device work; one allocation, the result), the steady
    call replays its plan, and the result is the reference's."""
    b, n, h, d = 1, 4, 2, 8
    mem = rng.standard_normal((b, n, h, d)).astype(np.float32)
    cos, sin = _tables(rng, 8, 2, np.float32)
    x = sd.adopt(mem).transpose(0, 2, 1, 3)
    dc, ds, off = sd.adopt(cos), sd.adopt(sin), sd.adopt(np.array([3], np.int32))
    with sd.device(execute=True) as drv:
        numba_flash.apply_rotary(x, dc, ds, seqlen_offsets=off)
        before = plans.plan_stats()["plans"]
        with sd.count() as c:
            got = numba_flash.apply_rotary(x, dc, ds, seqlen_offsets=off)
        assert plans.plan_stats()["plans"] == before
        sig = drv.launches[-1].sig
    assert (c.syncs, c.d2h, c.h2d, c.foreign, c.launches) == (0, 0, 0, 0, 1), c.log
    assert c.allocations <= 1, c.log   # the result (no copy of x)
    assert sig[0].layout == "A"        # x's own strides reach the kernel
    want = ref.apply_rotary(mem.transpose(0, 2, 1, 3).astype(np.float64), cos, sin,
                            seqlen_offsets=np.array([3]))
    assert_scaled_close(got.get().astype(np.float64), want, ROT_TOL[np.dtype(np.float32)])
