"""``backward_varlen`` on packed views (issue 61): the SIMT backward indexes every array through
its strides (Numba's own indexing) and reads the packed batch as ``[1, H, total, d]`` views, so
a fused projection's ``qkv[:, i]`` slices of ``[total, 3, H, d]``, a ``do`` whose rows have gaps
and an ``o`` that is a head slice are read where they lie, and ``out=`` views with the caller's
data between their rows are written in place.  Against the float64 reference
(``reference.attention_backward_varlen``; ``o`` and ``lse`` from the reference forward),
outputs NaN-poisoned (conftest), a sentinel in the gaps, inputs unchanged byte for byte; the
stand-in device's launches get the views themselves (no copy).

Tolerance: tests/kernels/test_backward_varlen.py's (the same kernels; only addresses differ).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash import standin as sd
from numba_flash.frontend import plans
from tests.helpers import assert_scaled_close

SENTINEL = 7.0
#: test_backward_varlen.GRAD_TOL
TOL = {np.dtype(np.float32): 6e-6, np.dtype(np.float16): 2.4e-2}
CU = np.array([0, 5, 5, 13], np.int32)   # three sequences, one empty
H, D = 2, 8
LENS = dict(max_seqlen_q=9, max_seqlen_k=9)


def _case(rng, dtype):
    """``(do, q, k, v, o, lse)`` as views: q, k, v slices of one ``[total, 3, H, d]``
    projection, ``do`` rows ``2 d`` apart (a wider buffer's first ``d`` columns), ``o`` heads
    ``1:`` of ``[total, H + 1, d]``; and the memories behind them."""
    total = int(CU[-1])
    qkv = rng.standard_normal((total, 3, H, D)).astype(dtype)
    q, k, v = (qkv[:, i] for i in range(3))
    do_mem = rng.standard_normal((total, H, 2 * D)).astype(dtype)
    do = do_mem[..., :D]
    o64, lse = ref.attention_varlen(*(x.astype(np.float64) for x in (q, k, v)), CU, CU,
                                    causal=True)
    o_mem = np.full((total, H + 1, D), SENTINEL, dtype)
    o = o_mem[:, 1:]
    o[...] = o64
    assert not any(x.flags.c_contiguous for x in (do, q, k, v, o))
    return (do, q, k, v, o, lse.astype(np.float32)), (qkv, do_mem, o_mem)


def _gapped(shape, dtype):
    """An ``out=`` view of ``shape`` ``[total, H, d]``: heads ``1:`` of ``[total, H + 1, d]``
    memory filled with a sentinel, and that memory."""
    mem = np.full((shape[0], shape[1] + 1, shape[2]), SENTINEL, dtype)
    return mem[:, 1:], mem


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_backward_varlen_reads_packed_views_in_place(dtype, rng):
    dtype = np.dtype(dtype)
    args, mems = _case(rng, dtype)
    before = [m.copy() for m in mems]
    outs = [_gapped(x.shape, dtype) for x in args[1:4]]
    grads = numba_flash.backward_varlen(*args, CU, CU, causal=True, **LENS,
                                        out=tuple(x for x, _ in outs))
    assert all(g is x for g, (x, _) in zip(grads, outs))
    want = ref.attention_backward_varlen(*(x.astype(np.float64) for x in args[:4]), CU, CU,
                                         causal=True)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert_scaled_close(got.astype(np.float64), w, TOL[dtype], name=name)
    for _, mem in outs:
        assert (mem[:, 0].astype(np.float64) == SENTINEL).all(), "out: a gap element written"
    for m, m0 in zip(mems, before):
        np.testing.assert_array_equal(m.view(np.uint8), m0.view(np.uint8))


def test_backward_varlen_new_gradients_from_views(rng):
    """No ``out=``: new packed C-contiguous gradients, from the same views."""
    args, _ = _case(rng, np.float32)
    grads = numba_flash.backward_varlen(*args, CU, CU, causal=True, **LENS)
    want = ref.attention_backward_varlen(*(x.astype(np.float64) for x in args[:4]), CU, CU,
                                         causal=True)
    for name, got, w in zip(("dq", "dk", "dv"), grads, want):
        assert got.flags.c_contiguous and got.shape == w.shape
        assert_scaled_close(got, w, TOL[np.dtype(np.float32)], name=name)


def test_backward_varlen_device_path_takes_views_without_a_copy(rng):
    """Stand-in device arrays: the fused projection's slices, the gapped ``do``, the head-slice
    ``o`` and gapped ``out=`` views reach the launches as they lie (no foreign device work: no
    copy), the steady call replays its plan, and the gradients land in the caller's memory."""
    args, mems = _case(rng, np.float32)
    qkv, do_mem, o_mem = (sd.adopt(m) for m in mems)
    dev = [do_mem[..., :D]] + [qkv[:, i] for i in range(3)] + [o_mem[:, 1:], sd.adopt(args[5])]
    cu = sd.adopt(CU.copy())
    out_mems = [sd.adopt(np.full((int(CU[-1]), H + 1, D), SENTINEL, np.float32))
                for _ in range(3)]
    out = tuple(m[:, 1:] for m in out_mems)
    kw = dict(causal=True, **LENS, out=out)
    # (unpoisoned: the poison of a strided out= is a fill, device work a plan does not hold)
    with sd.device(execute=True) as drv, numba_flash.poisoned_outputs(False):
        numba_flash.backward_varlen(*dev, cu, cu, **kw)
        before = plans.plan_stats()["plans"]
        with sd.count() as c:
            numba_flash.backward_varlen(*dev, cu, cu, **kw)
        assert plans.plan_stats()["plans"] == before
        sigs = [r.sig for r in drv.launches]
    assert (c.syncs, c.d2h, c.h2d, c.foreign) == (0, 0, 0, 0), c.log
    assert c.allocations == 0, c.log   # work arrays kept by the plan, no copy of any input
    assert any(t.layout == "A" for sig in sigs for t in sig if hasattr(t, "layout"))
    want = ref.attention_backward_varlen(*(x.astype(np.float64) for x in args[:4]), CU, CU,
                                         causal=True)
    for name, m, w in zip(("dq", "dk", "dv"), out_mems, want):
        assert_scaled_close(m._a[:, 1:], w, TOL[np.dtype(np.float32)], name=name)
        assert (m._a[:, 0] == SENTINEL).all(), f"{name}: a gap element written"
