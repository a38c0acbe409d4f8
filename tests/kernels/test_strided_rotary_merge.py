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
from numba_flash.ops.decode import _strided_rows
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


# -- merge_states ---------------------------------------------------------------------------------
#: test_merge_kernel's bounds (helpers.ATOL), float16's scaled by max |o|
MERGE_TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3}


def _merge_views(rng, p, b, h, n, d, dtype):
    """``o_parts`` ``[P, B, H, N, d]`` viewing ``[P, B, N, H, d]`` memory (flash-attn's outputs
    stacked; rows fold into three axes), ``lse_parts`` ``[P, B, H, N]`` viewing ``[B, H, P, N]``
    memory (its last dim contiguous: read in place too); and both memories."""
    o_mem = rng.standard_normal((p, b, n, h, d)).astype(dtype)
    l_mem = (rng.standard_normal((b, h, p, n)) * 4).astype(np.float32)
    return o_mem.transpose(0, 1, 3, 2, 4), l_mem.transpose(2, 0, 1, 3), o_mem, l_mem


def _check_merge(o_parts, lse_parts, dtype, sink=None):
    dtype = np.dtype(dtype)
    o, lse = numba_flash.merge_states(o_parts, lse_parts, learnable_sink=sink)
    assert o.shape == o_parts.shape[1:] and o.dtype == dtype
    want_o, want_lse = ref.merge_states(o_parts.astype(np.float64), lse_parts.astype(np.float64),
                                        learnable_sink=sink)
    assert_scaled_close(o.astype(np.float64), want_o, MERGE_TOL[dtype], name="o")
    live = np.isfinite(want_lse)   # (a row whose parts are all empty: lse -inf exactly)
    assert_scaled_close(lse[live], want_lse[live], 2e-6, name="lse")
    np.testing.assert_array_equal(lse[~live], want_lse[~live])


@pytest.mark.parametrize("dtype,sink", [(np.float32, False), (np.float16, True)])
def test_merge_reads_strided_parts_in_place(dtype, sink, rng):
    p, b, h, n, d = 3, 2, 3, 4, 8
    o_parts, lse_parts, o_mem, l_mem = _merge_views(rng, p, b, h, n, d, dtype)
    lse_parts[1, 0, 1] = -np.inf          # a part empty in some rows
    lse_parts[:, 1, 2, 3] = -np.inf       # a row with every part empty
    assert not o_parts.flags.c_contiguous and not lse_parts.flags.c_contiguous
    before = o_mem.copy(), l_mem.copy()
    s = np.linspace(-1, 1, h).astype(np.float32)[:, None] if sink else None
    assert _strided_rows(o_parts, lse_parts) == (b, h, n)   # the strided build, three axes
    _check_merge(o_parts, lse_parts, dtype, s)
    np.testing.assert_array_equal(o_mem.view(np.uint8), before[0].view(np.uint8))
    np.testing.assert_array_equal(l_mem.view(np.uint8), before[1].view(np.uint8))


def test_merge_rows_that_do_not_fold_are_copied(rng):
    """Four row axes no pair of which merges: copied to C order (the flat build), same values."""
    mem = rng.standard_normal((2, 2, 2, 2, 3, 8)).astype(np.float32)
    o_parts = mem.transpose(0, 4, 1, 3, 2, 5)      # [P, 3, 2, 2, 2, d]
    lse_parts = rng.standard_normal((2, 3, 2, 2, 2)).astype(np.float32)
    assert _strided_rows(o_parts, lse_parts) is None
    _check_merge(o_parts, lse_parts, np.float32)


def test_merge_device_path_takes_the_views_without_a_copy(rng):
    """Stand-in device arrays: strided ``o_parts`` and ``lse_parts`` reach the launch as they
    lie (layout "A", no foreign device work; two allocations, ``o`` and ``lse``), and the steady
    call replays its plan."""
    p, b, h, n, d = 2, 1, 2, 3, 8
    o_parts, lse_parts, o_mem, l_mem = _merge_views(rng, p, b, h, n, d, np.float32)
    do = sd.adopt(o_mem).transpose(0, 1, 3, 2, 4)
    dl = sd.adopt(l_mem).transpose(2, 0, 1, 3)
    with sd.device(execute=True) as drv:
        numba_flash.merge_states(do, dl)
        before = plans.plan_stats()["plans"]
        with sd.count() as c:
            o, lse = numba_flash.merge_states(do, dl)
        assert plans.plan_stats()["plans"] == before
        sig = drv.launches[-1].sig
    assert (c.syncs, c.d2h, c.h2d, c.foreign, c.launches) == (0, 0, 0, 0, 1), c.log
    assert c.allocations <= 2, c.log
    assert (sig[0].layout, sig[0].ndim, sig[1].layout) == ("A", 5, "A")
    want_o, want_lse = ref.merge_states(o_parts.astype(np.float64), lse_parts.astype(np.float64))
    assert_scaled_close(o.get().astype(np.float64), want_o, 2e-5, name="o")
    assert_scaled_close(lse.get(), want_lse, 2e-6, name="lse")
