"""The varlen ops on the device path (issue 60), on the stand-in device (numba_flash.standin):
``forward_varlen`` (packed K/V and the paged prefill) and ``backward_varlen`` with device
``cu_seqlens`` that are never read on the host (no ``validate``): the first call builds its
launch plan and equals the float64 reference when its launches run in the simulator from their
packed parameters; a second call on fresh inputs replays the plan (no new plan, the same
launches) and equals the reference too; a steady call with ``out=`` synchronises, copies back,
allocates and works outside its launches not at all, and leaves its inputs unchanged.  Then
what keeps a call off the fast path: ``validate=True`` (the lengths read on the host, bad ones
refused as for NumPy) and a non-int32 ``cu_seqlens`` (converted on the device).

Tolerances: tests/kernels/test_forward_varlen.py's (o float32 2e-6 absolute, lse 8e-7
relative) and tests/kernels/test_backward_varlen.py's (float32 gradients 6e-6, relative to
max(1, max |grad|)): the same kernels, fed the same values through the device path.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
import numba_flash.standin as sd
from numba_flash import reference as ref
from numba_flash.frontend import plans
from helpers import assert_scaled_close, paged_cache, randn

O_TOL, LSE_TOL, GRAD_TOL = 2e-6, 8e-7, 6e-6

# ragged around the simulator's 8-wide tiles: a sequence with no keys, one with no queries,
# one over two Q tiles; max_seqlen above the longest (the launch is sized by it, unread)
LENS_Q = [5, 2, 0, 9]
LENS_K = [7, 0, 3, 6]
H, HKV, D = 2, 1, 8
LENS = dict(max_seqlen_q=11, max_seqlen_k=8)
CU_Q = np.concatenate([[0], np.cumsum(LENS_Q)]).astype(np.int32)
CU_K = np.concatenate([[0], np.cumsum(LENS_K)]).astype(np.int32)


@pytest.fixture(autouse=True)
def _fresh_plans():
    plans.clear_plans()
    yield
    plans.clear_plans()


def packed(rng):
    q = randn(rng, (int(CU_Q[-1]), H, D))
    k = randn(rng, (int(CU_K[-1]), HKV, D))
    v = randn(rng, (int(CU_K[-1]), HKV, D))
    return q, k, v


def compare_forward(o, lse, want_o, want_lse):
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "NaN (an unwritten element?)"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    err = np.abs(o.astype(np.float64) - want_o).max()
    assert err <= O_TOL, f"o: max abs error {err:.3e}"
    fin = np.isfinite(want_lse)
    rel = (np.abs(lse[fin] - want_lse[fin]) / np.maximum(1.0, np.abs(want_lse[fin]))).max()
    assert rel <= LSE_TOL, f"lse: max relative error {rel:.3e}"


def steady(call, arrays):
    """Run ``call()`` once counted by the stand-in; assert it waited, copied back, allocated
    and worked outside its launches not at all and left ``arrays`` as they were."""
    before = [x.get() for x in arrays]
    with sd.count() as c:
        result = call()
    assert (c.syncs, c.d2h, c.allocations, c.foreign) == (0, 0, 0, 0), c.log
    for x, was in zip(arrays, before):
        np.testing.assert_array_equal(x.get(), was)
    return result


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_forward_varlen(rng, paged):
    kw = dict(causal=True, return_lse=True, **LENS)
    launched = []
    for call in range(2):   # the first call builds the plan, the second replays it
        q, k, v = packed(rng)
        want = ref.attention_varlen(q, k, v, CU_Q, CU_K, causal=True)
        if paged:
            kc, vc, table = paged_cache(rng, k, v, CU_K, 3, spare_cols=1, spare_blocks=2)
            args = [sd.asarray(x) for x in (q, kc, vc, CU_Q, CU_K)]
            kw["block_table"] = sd.asarray(table)
        else:
            args = [sd.asarray(x) for x in (q, k, v, CU_Q, CU_K)]
        stats = plans.plan_stats()
        with sd.device(execute=True) as driver, sd.count() as c:
            o, lse = numba_flash.forward_varlen(*args, **kw)
        assert (c.syncs, c.d2h, c.foreign) == (0, 0, 0), c.log   # cu_seqlens never read
        assert plans.plan_stats() == {"plans": 1, "unplanned": {}}, (call, stats)
        launched.append([(r.name, r.grid, r.block, r.sig) for r in driver.launches])
        compare_forward(o.get(), lse.get(), *want)
    assert launched[0] == launched[1] and launched[0][0][0] == "flash_forward"

    # out=: o written in place and returned; lse not asked for: nothing allocated
    kw["return_lse"] = False
    out = sd.empty(q.shape, np.float32)
    numba_flash.forward_varlen(*args, **kw, out=out)            # builds the out= plan
    with sd.device(execute=True):
        got = steady(lambda: numba_flash.forward_varlen(*args, **kw, out=out),
                     args + [kw.get("block_table", args[0])])
    assert got is out and plans.plan_stats()["plans"] == 2
    err = np.abs(out.get().astype(np.float64) - want[0]).max()
    assert err <= O_TOL, f"o: max abs error {err:.3e}"


def backward_case(rng):
    q, k, v = packed(rng)
    q *= 2.0
    do = randn(rng, q.shape)
    o, lse = ref.attention_varlen(q, k, v, CU_Q, CU_K, causal=True)
    host = (do, q, k, v, o.astype(np.float32), lse.astype(np.float32), CU_Q, CU_K)
    want = ref.attention_backward_varlen(do, q, k, v, CU_Q, CU_K, causal=True)
    return [sd.asarray(x) for x in host], want


def check_grads(grads, want):
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert g.dtype == np.float32 and g.shape == w.shape, name
        assert_scaled_close(g.get(), w, GRAD_TOL, name)


def test_backward_varlen(rng):
    kw = dict(causal=True, **LENS)
    launched = []
    for call in range(2):
        args, want = backward_case(rng)
        with sd.device(execute=True) as driver, sd.count() as c:
            grads = numba_flash.backward_varlen(*args, **kw)
        assert (c.syncs, c.d2h, c.foreign) == (0, 0, 0), c.log
        assert plans.plan_stats() == {"plans": 1, "unplanned": {}}, call
        if call:   # a replay allocates its results alone: the packed arrays are read and
            assert c.allocations == 3   # written in place, the work arrays kept by the plan
        launched.append([(r.name, r.grid, r.sig) for r in driver.launches])
        check_grads(grads, want)
    assert launched[0] == launched[1]

    out = tuple(sd.empty(x.shape, np.float32) for x in args[1:4])
    numba_flash.backward_varlen(*args, **kw, out=out)             # builds the out= plan
    with sd.device(execute=True):
        got = steady(lambda: numba_flash.backward_varlen(*args, **kw, out=out), args)
    assert all(g is x for g, x in zip(got, out)) and plans.plan_stats()["plans"] == 2
    check_grads(out, want)


def test_backward_varlen_out_numpy(rng):
    """``out=`` on the NumPy path: the gradients copied into the caller's arrays."""
    args, want = backward_case(rng)
    host = [x.get() for x in args]
    out = tuple(np.empty(x.shape, np.float32) for x in host[1:4])
    got = numba_flash.backward_varlen(*host, causal=True, **LENS, out=out)
    assert all(g is x for g, x in zip(got, out))
    for name, g, w in zip(("dq", "dk", "dv"), out, want):
        assert_scaled_close(g, w, GRAD_TOL, name)


def test_validate_reads_cu_seqlens(rng):
    """``validate=True``: device cu_seqlens read and checked as NumPy ones are (the call then
    runs unplanned); without it a bad one is not looked at (recorded, not run here)."""
    q, k, v = (sd.asarray(x) for x in packed(rng))
    bad = sd.asarray(np.array([0, 5, 7, 4, 16], np.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q: expected non-decreasing values, got 7 "
                                         "then 4 at index 2"):
        numba_flash.forward_varlen(q, k, v, bad, sd.asarray(CU_K), validate=True, **LENS)
    with pytest.raises(ValueError, match=r"max_seqlen_k: expected at least the longest"):
        numba_flash.forward_varlen(q, k, v, sd.asarray(CU_Q), sd.asarray(CU_K), validate=True,
                                   max_seqlen_q=11, max_seqlen_k=3)
    with sd.device(), sd.count() as c:
        numba_flash.forward_varlen(q, k, v, sd.asarray(CU_Q), sd.asarray(CU_K), validate=True,
                                   **LENS)
    assert c.syncs > 0 and plans.plan_stats() == {
        "plans": 0, "unplanned": {"cu_seqlens_q is read on the host": 1}}
    with sd.device(), sd.count() as c:
        numba_flash.forward_varlen(q, k, v, bad, sd.asarray(CU_K), **LENS)
    assert c.syncs == 0 and c.launches == 1


def test_int64_cu_seqlens_converted(rng):
    """A non-int32 device cu_seqlens: converted on the device, the call unplanned."""
    q, k, v = (sd.asarray(x) for x in packed(rng))
    cu_q, cu_k = sd.asarray(CU_Q.astype(np.int64)), sd.asarray(CU_K.astype(np.int64))
    with sd.device(), sd.count() as c:
        numba_flash.forward_varlen(q, k, v, cu_q, cu_k, **LENS)
    assert c.syncs == 0 and c.foreign == 2 and plans.plan_stats()["plans"] == 0


def test_out_refused_where_not_taken(rng):
    q, k, v = packed(rng)
    out = np.empty(q.shape, np.float32)
    with pytest.raises(ValueError, match="out: expected None with e4m3 inputs or kv_indices"):
        numba_flash.forward_varlen(q, k, v, CU_Q, CU_K, **LENS, out=out,
                                   kv_indices=np.full((q.shape[0], HKV, 2), -1, np.int32))
    with pytest.raises(ValueError, match=r"out: expected shape \(16, 2, 8\), got \(16, 2, 4\)"):
        numba_flash.forward_varlen(q, k, v, CU_Q, CU_K, **LENS, out=out[..., :4].copy())
    with pytest.raises(ValueError, match="out: expected None with kv_indices"):
        numba_flash.backward_varlen(q, q, k, v, q, np.zeros((H, q.shape[0]), np.float32),
                                    CU_Q, CU_K, **LENS, out=(q, k, v),
                                    kv_indices=np.full((q.shape[0], HKV, 2), -1, np.int32))


def test_one_cu_seqlens_for_both(rng):
    """Self-attention's one array as both ``cu_seqlens``: planned too (the plan relocates it
    once), and its replay on another such array equals the reference."""
    lens = dict(max_seqlen_q=9, max_seqlen_k=9)
    for call in range(2):
        q, k, v = (randn(rng, (int(CU_Q[-1]), n, D)) for n in (H, HKV, HKV))
        cu = sd.asarray(CU_Q)
        args = [sd.asarray(x) for x in (q, k, v)] + [cu, cu]
        with sd.device(execute=call == 1), sd.count() as c:
            o = numba_flash.forward_varlen(*args, causal=True, **lens)
        assert plans.plan_stats() == {"plans": 1, "unplanned": {}}
    assert (c.syncs, c.allocations, c.foreign) == (0, 1, 0), c.log
    want = ref.attention_varlen(q, k, v, CU_Q, CU_Q, causal=True)[0]
    err = np.abs(o.get().astype(np.float64) - want).max()
    assert err <= O_TOL, f"o: max abs error {err:.3e}"
