"""The paged prefill (``forward_varlen(..., block_table=...)``) on caches in their own memory
order (issue 61): flash-attn's / vLLM's tokens-first ``[num_blocks, block_size, Hkv, d]``
memory passed as its ``transpose(0, 2, 1, 3)`` view is read where it lies, through the row
strides ``(block, head, slot)`` the kernel takes at launch (frontend/cache_args.cache_memory, as
decode); a cache whose rows have gaps (no memory order) is copied, as before.  Each case: the
paged call bit for bit equal to ``forward_varlen`` on the packed K/V and within the varlen
tolerances of the float64 reference, outputs NaN-poisoned (conftest), stale cache slots NaN (a
slot read by mistake shows), the caches and table unchanged; the stand-in device's launch gets
the caches' memory with no copy.  Its q and ``out=`` are read and written through their
strides too (issue 61's packed views, as the non-paged varlen call): a fused projection's q
slice or a head slice at an offset (the rest of their memory NaN: a stray read shows), ``out=``
a view of a wider buffer whose elements between the rows keep a sentinel, bit for bit the
paged call on C-contiguous q and out; the stand-in device's launch gets them with no copy.

Tolerances: tests/kernels/test_forward_paged.py's (the same kernel; only row addresses differ).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash import standin as sd
from numba_flash.frontend import plans
from tests.helpers import assert_scaled_close, paged_cache, randn

BF16 = np.dtype(ml_dtypes.bfloat16)
O_TOL = {np.dtype(np.float32): 2e-6, BF16: 1e-2}
LENS_Q, LENS_K = [3, 0, 9], [6, 2, 11]   # a sequence without queries; several K/V tiles
H, HKV, D, BS = 4, 2, 8, 3                # GQA 4:2 (tokens-first differs from heads-first)
KW = dict(max_seqlen_q=9, max_seqlen_k=11, causal=True, return_lse=True)
SENTINEL = 7.0


def _case(rng, dtype):
    cu_q = np.concatenate([[0], np.cumsum(LENS_Q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(LENS_K)]).astype(np.int32)
    q = randn(rng, (int(cu_q[-1]), H, D), dtype)
    k, v = (randn(rng, (int(cu_k[-1]), HKV, D), dtype) for _ in range(2))
    kc, vc, table = paged_cache(rng, k, v, cu_k, BS)   # heads-first, stale slots NaN
    return q, k, v, cu_q, cu_k, kc, vc, table


def _tokens_first(x):
    """A heads-first cache's values in flash-attn's memory ``[n, block_size, Hkv, d]``, passed
    as its ``[n, Hkv, block_size, d]`` view; and that memory."""
    mem = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    return mem.transpose(0, 2, 1, 3), mem


def _check(q, k, v, cu_q, cu_k, kc, vc, table, dtype):
    mems = [kc.base if kc.base is not None else kc, vc.base if vc.base is not None else vc]
    before = [m.copy() for m in mems] + [table.copy()]
    o, lse = numba_flash.forward_varlen(q, kc, vc, cu_q, cu_k, block_table=table, **KW)
    for was, now in zip(before, mems + [table]):
        np.testing.assert_array_equal(was.view(np.uint8), now.view(np.uint8))
    o_packed, lse_packed = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, **KW)
    np.testing.assert_array_equal(o.view(np.uint8), o_packed.view(np.uint8))
    np.testing.assert_array_equal(lse, lse_packed)
    want, _ = ref.attention_varlen(*(x.astype(np.float64) for x in (q, k, v)), cu_q, cu_k,
                                   causal=True)
    assert_scaled_close(o.astype(np.float64), want, O_TOL[np.dtype(dtype)], name="o")


@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_tokens_first_paged_cache_read_in_place(dtype, rng):
    q, k, v, cu_q, cu_k, kc, vc, table = _case(rng, dtype)
    (kt, _), (vt, _) = _tokens_first(kc), _tokens_first(vc)
    assert not kt.flags.c_contiguous
    _check(q, k, v, cu_q, cu_k, kt, vt, table, dtype)


def test_cache_with_gapped_rows_is_copied(rng):
    """Rows ``2 d`` apart (a wider buffer's first ``d`` columns): no memory order, copied to
    heads-first (the same values)."""
    q, k, v, cu_q, cu_k, kc, vc, table = _case(rng, np.float32)
    wide_k, wide_v = (np.full(x.shape[:3] + (2 * D,), 5.0, np.float32) for x in (kc, vc))
    wide_k[..., :D], wide_v[..., :D] = kc, vc
    _check(q, k, v, cu_q, cu_k, wide_k[..., :D], wide_v[..., :D], table, np.float32)


def test_device_path_reads_a_tokens_first_cache_without_a_copy(rng):
    """Stand-in device arrays: a tokens-first paged cache reaches the launch as its memory (no
    copy: no foreign device work; allocations o and lse alone), the steady call replays its
    plan, and the result is the host call's."""
    q, k, v, cu_q, cu_k, kc, vc, table = _case(rng, np.float32)
    (_, k_mem), (_, v_mem) = _tokens_first(kc), _tokens_first(vc)
    kd, vd = (sd.adopt(m).transpose(0, 2, 1, 3) for m in (k_mem, v_mem))
    args = [sd.adopt(np.ascontiguousarray(x)) for x in (q, cu_q, cu_k, table)]
    kw = dict(KW, block_table=args[3])
    with sd.device(execute=True):
        numba_flash.forward_varlen(args[0], kd, vd, args[1], args[2], **kw)
        before = plans.plan_stats()["plans"]
        with sd.count() as c:
            o, lse = numba_flash.forward_varlen(args[0], kd, vd, args[1], args[2], **kw)
        assert plans.plan_stats()["plans"] == before
    assert (c.syncs, c.d2h, c.h2d, c.foreign, c.launches) == (0, 0, 0, 0, 1), c.log
    assert c.allocations <= 2, c.log     # o and lse (no copy of either cache)
    want, want_lse = numba_flash.forward_varlen(q, kc, vc, cu_q, cu_k, block_table=table, **KW)
    np.testing.assert_array_equal(o.get(), want)
    np.testing.assert_array_equal(lse.get(), want_lse)


def _q_view(q, layout):
    """``q``'s values in a view of wider memory, the rest NaN, and that memory: ``fused``, a
    fused projection's q slice ``qkv[:, 0]`` of ``[total, 3, H, d]``; ``offset``, heads ``1 ..
    H`` of ``[total, H + 2, d]`` (a head slice at an offset)."""
    if layout == "fused":
        mem = np.full((q.shape[0], 3, H, D), np.nan, q.dtype)
        view = mem[:, 0]
    else:
        mem = np.full((q.shape[0], H + 2, D), np.nan, q.dtype)
        view = mem[:, 1:H + 1]
    view[...] = q
    assert not view.flags.c_contiguous
    return view, mem


def _out_view(total, dtype):
    """An ``out=`` view ``buf[:, :, :d]`` of a ``[total, H, d + 4]`` buffer of sentinels, and
    the buffer."""
    mem = np.full((total, H, D + 4), SENTINEL, dtype)
    return mem[:, :, :D], mem


@pytest.mark.parametrize("layout, dtype", [("fused", np.float32), ("offset", BF16)])
def test_q_and_out_views_read_and_written_in_place(layout, dtype, rng):
    """The paged prefill on a q view and an ``out=`` view (tokens-first caches of shuffled
    pages): ``out`` itself comes back, bit for bit the C-contiguous call's o and lse, within the
    reference's tolerance; the elements between out's rows keep their sentinel, q's memory and
    the caches are unchanged.  float32 the cp.async build, bfloat16 the element one."""
    q_c, k, v, cu_q, cu_k, kc, vc, table = _case(rng, dtype)
    q, q_mem = _q_view(q_c, layout)
    out, out_mem = _out_view(q.shape[0], dtype)
    (kt, k_mem), (vt, v_mem) = _tokens_first(kc), _tokens_first(vc)
    before = [x.copy() for x in (q_mem, k_mem, v_mem)]
    o, lse = numba_flash.forward_varlen(q, kt, vt, cu_q, cu_k, block_table=table, out=out, **KW)
    assert o is out
    for was, now in zip(before, (q_mem, k_mem, v_mem)):
        np.testing.assert_array_equal(was.view(np.uint8), now.view(np.uint8))
    assert (out_mem[..., D:].astype(np.float64) == SENTINEL).all(), "out: a gap element written"
    o_c, lse_c = numba_flash.forward_varlen(q_c, kc, vc, cu_q, cu_k, block_table=table, **KW)
    np.testing.assert_array_equal(np.ascontiguousarray(o).view(np.uint8), o_c.view(np.uint8))
    np.testing.assert_array_equal(lse, lse_c)
    want, _ = ref.attention_varlen(*(x.astype(np.float64) for x in (q_c, k, v)), cu_q, cu_k,
                                   causal=True)
    assert_scaled_close(o.astype(np.float64), want, O_TOL[np.dtype(dtype)], name="o")


def test_device_path_takes_q_and_out_views_without_a_copy(rng):
    """Stand-in device arrays: a fused projection's q slice and an ``out=`` view of a wider
    buffer reach the launch as they lie (no copy, no device work outside the launch, one
    allocation: lse), the steady call replays its plan; out's memory holds the host call's o
    (out= pre-filled with NaN before the counted call: a strided out= is not poisoned on a
    device) with its gaps untouched."""
    q_c, _k, _v, cu_q, cu_k, kc, vc, table = _case(rng, np.float32)
    q, q_mem = _q_view(q_c, "fused")
    out, out_mem = _out_view(q.shape[0], np.float32)
    (_, k_mem), (_, v_mem) = _tokens_first(kc), _tokens_first(vc)
    kd, vd = (sd.adopt(m).transpose(0, 2, 1, 3) for m in (k_mem, v_mem))
    qd = sd.adopt(q_mem)[:, 0]
    od = sd.adopt(out_mem)[:, :, :D]
    args = [sd.adopt(np.ascontiguousarray(x)) for x in (cu_q, cu_k, table)]
    kw = dict(KW, block_table=args[2], out=od)
    with sd.device(execute=True):
        numba_flash.forward_varlen(qd, kd, vd, args[0], args[1], **kw)
        before = plans.plan_stats()["plans"]
        out[...] = np.nan
        with sd.count() as c:
            o, lse = numba_flash.forward_varlen(qd, kd, vd, args[0], args[1], **kw)
        assert plans.plan_stats()["plans"] == before
    assert o is od
    assert (c.syncs, c.d2h, c.h2d, c.foreign, c.launches) == (0, 0, 0, 0, 1), c.log
    assert c.allocations <= 1, c.log     # lse (no copy of q, nor of out)
    want, want_lse = numba_flash.forward_varlen(q_c, kc, vc, cu_q, cu_k, block_table=table, **KW)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(lse.get(), want_lse)
    assert (out_mem[..., D:] == SENTINEL).all(), "out: a gap element written"
