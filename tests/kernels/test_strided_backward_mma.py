"""The tensor-core backward on strided views (issue 61): its ``STRIDED`` build reads ``q``,
``k``, ``v`` and ``do`` through their own strides (each operand's base and row stride its own,
:func:`numba_flash.kernels.backward.mma.make_backward_bases`) and the SIMT preprocess / reduce
kernels read ``o`` and write a strided ``out=`` in place.  The operands here are all laid out
differently (flash-attn's transposed ``[B, N, H, d]`` q, k and v slices of one fused
projection, a ``do`` that is a batch slice at an offset, an ``o`` with gaps between its rows),
so a base or a row stride taken from the wrong operand gives wrong gradients.  Against the
float64 reference (the forward's ``o``, ``lse`` from the same inputs), outputs NaN-poisoned
(conftest), a sentinel in ``out=``'s gaps, inputs unchanged; the stand-in device hands the views
to the launches without a copy.

Tolerances: tests/kernels/test_mma_backward.py's (float16) and
test_bfloat16_mma_backward.py's (bfloat16): the same kernels, only the addresses differ.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference
from numba_flash import standin as sd
from numba_flash.frontend import plans
from tests.helpers import assert_scaled_close
from tests.kernels.test_strided_backward import SENTINEL, check_backward_into_gapped_outs

BF16 = np.dtype(ml_dtypes.bfloat16)
TOL = {np.dtype(np.float16): 2.5e-3, BF16: 2e-2}


def _views(rng, b, h, hkv, nq, nk, d, d_v, dtype):
    """``(do, q, k, v)`` in four different layouts, and their float64 values."""
    q = rng.standard_normal((b, nq, h, d)).astype(dtype).transpose(0, 2, 1, 3)
    if d_v == d:   # k, v: slices of one fused [B, Nk, 2, Hkv, d] projection
        kv = rng.standard_normal((b, nk, 2, hkv, d)).astype(dtype)
        k, v = (kv[:, :, i].transpose(0, 2, 1, 3) for i in range(2))
    else:
        k = rng.standard_normal((b, nk, hkv, d)).astype(dtype).transpose(0, 2, 1, 3)
        v = rng.standard_normal((b, hkv, nk, d_v + 8)).astype(dtype)[..., 8:]   # row gaps
    do = rng.standard_normal((b + 1, h, nq, d_v)).astype(dtype)[1:]   # a batch offset
    return do, q, k, v


@pytest.mark.parametrize("dtype,d,d_v,deterministic", [
    (np.float16, 16, 16, False),
    (np.float16, 32, 16, True),      # a value head dim of its own; the dQ kernel
    (BF16, 16, 16, True),
], ids=["f16", "f16-own_dv-deterministic", "bf16-deterministic"])
def test_mma_backward_reads_each_view_through_its_own_strides(dtype, d, d_v, deterministic,
                                                              rng):
    b, h, hkv, nq, nk = 1, 4, 2, 19, 23
    dtype = np.dtype(dtype)
    do, q, k, v = _views(rng, b, h, hkv, nq, nk, d, d_v, dtype)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    o_mem = np.full((b, h, nq, d_v + 16), SENTINEL, dtype)   # o with gaps between its rows
    o_mem[..., :d_v] = o
    o = o_mem[..., :d_v]
    check_backward_into_gapped_outs(do, q, k, v, o, lse, TOL[dtype], kernel="mma",
                                    deterministic=deterministic)


def test_mma_backward_wide_rows_through_strides(rng):
    """d = 128 (16 chunks a row): the strided copies give a row 8 threads and each thread two
    chunks of it, one address a row (stages.make_tile_copy's plan for STRIDED), in the dK/dV
    kernel's K, V, Q and dO copies and (deterministic) the dQ kernel's K / V pair; every view
    its own strides (the simulator's tiles: two whole ones and a partial one of the dK/dV
    kernel's 16 queries and of the dQ kernel's 16 keys)."""
    b, h, hkv, nq, nk, d = 1, 1, 1, 33, 33, 128
    dtype = np.dtype(np.float16)
    do, q, k, v = _views(rng, b, h, hkv, nq, nk, d, d, dtype)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    o_mem = np.full((b, h, nq, d + 16), SENTINEL, dtype)
    o_mem[..., :d] = o
    check_backward_into_gapped_outs(do, q, k, v, o_mem[..., :d], lse, TOL[dtype], kernel="mma",
                                    deterministic=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NumPy on NaN * 0
def test_mma_backward_non_finite_do_in_a_view(rng):
    """A non-finite dO element (the dK/dV kernel's fixup rereads dO from global memory, through
    dO's own row stride): dV's column of the keys its row sees is non-finite as the
    reference's, the rest finite and close."""
    b, h, hkv, nq, nk, d = 1, 2, 1, 9, 12, 16
    do, q, k, v = _views(rng, b, h, hkv, nq, nk, d, d, np.dtype(np.float16))
    do = np.ascontiguousarray(do.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)   # rows H d apart
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    do[0, 1, 8, 3] = np.inf   # the last row: a masked (partial) query tile
    _, _, dv = numba_flash.backward(do, q, k, v, o, lse, causal=True, kernel="mma")
    want = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)),
                                        causal=True)[2]
    got = dv.astype(np.float64)
    assert np.array_equal(np.isfinite(got), np.isfinite(want)) and not np.isfinite(want).all()
    fin = np.isfinite(want)
    assert_scaled_close(got[fin], want[fin], TOL[np.dtype(np.float16)], name="dv")


def test_device_path_mma_backward_without_a_copy(rng):
    """Stand-in device arrays in flash-attn's layout (do, q, k, v, o and the out= gradients
    transposed views of [B, N, H, d] memory): the steady call replays its plan with no copy and
    no allocation (the work arrays are the plan's), and the result is the reference's."""
    b, h, n, d = 1, 2, 16, 16
    dtype = np.dtype(np.float16)
    mems = [rng.standard_normal((b, n, h, d)).astype(dtype) for _ in range(4)]
    q, k, v, do = (m.transpose(0, 2, 1, 3) for m in mems)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    o_mem = np.ascontiguousarray(o.transpose(0, 2, 1, 3))
    dev = [sd.adopt(m).transpose(0, 2, 1, 3) for m in (*mems, o_mem)]
    grad_mems = [sd.adopt(np.zeros((b, n, h, d), dtype)) for _ in range(3)]
    outs = tuple(g.transpose(0, 2, 1, 3) for g in grad_mems)
    d_lse = sd.adopt(lse)
    d_q, d_k, d_v, d_do, d_o = dev
    with sd.device(execute=True), numba_flash.poisoned_outputs(False):
        def call():
            numba_flash.backward(d_do, d_q, d_k, d_v, d_o, d_lse, causal=True, kernel="mma",
                                 out=outs)
        call()
        before = plans.plan_stats()["plans"]
        call()
        with sd.count() as c:
            call()
        assert plans.plan_stats()["plans"] == before
    assert (c.syncs, c.d2h, c.h2d, c.foreign, c.allocations) == (0, 0, 0, 0, 0), c.log
    want = reference.attention_backward(*(x.astype(np.float64) for x in (do, q, k, v)),
                                        causal=True)
    for name, g, w in zip(("dq", "dk", "dv"), grad_mems, want):
        got = g._a.transpose(0, 2, 1, 3).astype(np.float64)
        assert_scaled_close(got, w, TOL[dtype], name=name)
