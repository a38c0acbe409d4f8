"""Kernel tier: window edges at or past the sequence (issue 21, item 3) in every attention op.

``window_size = (-1, 2**31 - 1)`` means no window; before the host clamp
(:func:`numba_flash.frontend.variants.clamp_window`) it wrapped ``c + right + 1`` to a negative
int32 in the kernels (a silently wrong output), and ``(2**31, 0)`` raised an OverflowError that
named no argument from some ops and ran in others.  Each op here is compared with the float64
reference under the very window it was given (the reference treats an edge past the sequence as
unbounded); tolerances are those measured for each op's own tests (cited at each constant).
Edges beyond int64, dicts and sets are errors naming ``window_size`` in every op.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.frontend.variants import clamp_window
from helpers import assert_close, assert_scaled_close, randn

#: windows with edges at or past the sequence (Nq <= 6, Nk <= 8 below), as the issue gives them
WINDOWS = [(-1, 2**31 - 1), (2**31, 0), (2**63 - 1, np.uint64(2**40)), (np.int64(2), 2**31 + 5)]
WINDOW_IDS = ["none-2**31-1", "causal-2**31", "int64max-uint64", "left2-past"]

#: the tensor-core forward's o and lse: test_mma_forward.py's O_TOL and LSE_TOL (scaled)
MMA_O_TOL, MMA_LSE_TOL = 2e-3, 2e-6
#: scaled gradient bounds of test_backward_variants.py (SIMT) and test_mma_backward.py (mma)
GRAD_TOL = {"simt": 6e-6, "mma": 2.5e-3}


def _dense(rng, dtype, nq=5, nk=8):
    q = randn(rng, (1, 2, nq, 16), dtype)
    k = randn(rng, (1, 1, nk, 16), dtype)
    v = randn(rng, (1, 1, nk, 16), dtype)
    return q, k, v


def run_forward(rng, window, kernel):
    dtype = np.float16 if kernel == "mma" else np.float32
    q, k, v = _dense(rng, dtype)
    o, lse = numba_flash.forward(q, k, v, window_size=window, return_lse=True, kernel=kernel)
    o_ref, lse_ref = ref.attention(q, k, v, window_size=window)
    if kernel == "mma":
        assert_scaled_close(o, o_ref, MMA_O_TOL, "o")
        assert_scaled_close(lse, lse_ref, MMA_LSE_TOL, "lse")
    else:
        assert_close(o, o_ref, dtype, name="o")
        assert_close(lse, lse_ref, dtype, name="lse")


def run_backward(rng, window, kernel):
    dtype = np.float16 if kernel == "mma" else np.float32
    q, k, v = _dense(rng, dtype)
    do = randn(rng, q.shape, dtype)
    o, lse = ref.attention(q, k, v, window_size=window)
    grads = numba_flash.backward(do, q, k, v, o.astype(dtype), lse.astype(np.float32),
                                 window_size=window, kernel=kernel)
    want = ref.attention_backward(do, q, k, v, window_size=window)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert_scaled_close(g, w, GRAD_TOL[kernel], name)


def _packed(rng):
    lq, lk = [2, 4], [5, 3]  # max 4 queries, 5 keys
    cu_q = np.array([0, 2, 6], np.int32)
    cu_k = np.array([0, 5, 8], np.int32)
    q = randn(rng, (sum(lq), 2, 16))
    k = randn(rng, (sum(lk), 1, 16))
    v = randn(rng, (sum(lk), 1, 16))
    return q, k, v, cu_q, cu_k, dict(max_seqlen_q=4, max_seqlen_k=5)


def run_forward_varlen(rng, window):
    q, k, v, cu_q, cu_k, mx = _packed(rng)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, **mx, window_size=window,
                                        return_lse=True)
    o_ref, lse_ref = ref.attention_varlen(q, k, v, cu_q, cu_k, window_size=window)
    assert_close(o, o_ref, np.float32, name="o")
    assert_close(lse, lse_ref, np.float32, name="lse")


def run_backward_varlen(rng, window):
    q, k, v, cu_q, cu_k, mx = _packed(rng)
    do = randn(rng, q.shape)
    o, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, window_size=window)
    grads = numba_flash.backward_varlen(do, q, k, v, o.astype(np.float32),
                                        lse.astype(np.float32), cu_q, cu_k, **mx,
                                        window_size=window)
    want = ref.attention_backward_varlen(do, q, k, v, cu_q, cu_k, window_size=window)
    for name, g, w in zip(("dq", "dk", "dv"), grads, want):
        assert_scaled_close(g, w, GRAD_TOL["simt"], name)


def run_decode(rng, window, paged=False):
    q = randn(rng, (2, 2, 2, 16))  # [B, H, Nq = 2, d]
    lens = np.array([5, 8], np.int32)
    k = randn(rng, (2, 1, 8, 16))
    v = randn(rng, (2, 1, 8, 16))
    table = None
    if paged:  # 4 blocks of 4 tokens, in a shuffled order
        k, v = (x.reshape(2, 1, 2, 4, 16).transpose(0, 2, 1, 3, 4).reshape(4, 1, 4, 16).copy()
                for x in (k, v))
        table = np.array([[2, 0], [1, 3]], np.int32)
        k, v = k[[1, 2, 0, 3]], v[[1, 2, 0, 3]]
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                window_size=window, return_lse=True)
    o_ref, lse_ref = ref.paged_decode(q, k, v, lens, table, window_size=window)
    assert_close(o, o_ref, np.float32, name="o")
    assert_close(lse, lse_ref, np.float32, name="lse")


OPS = {
    "forward": lambda rng, w: run_forward(rng, w, "simt"),
    "forward-mma": lambda rng, w: run_forward(rng, w, "mma"),
    "backward": lambda rng, w: run_backward(rng, w, "simt"),
    "backward-mma": lambda rng, w: run_backward(rng, w, "mma"),
    "forward_varlen": run_forward_varlen,
    "backward_varlen": run_backward_varlen,
    "decode": run_decode,
    "decode-paged": lambda rng, w: run_decode(rng, w, paged=True),
}


def test_clamp_window_is_exact():
    """An edge at or past the sequence (left >= Nk, right >= Nq) becomes -1 and no row's keys
    change, at the boundary and far past it; without lengths the bound is 2**30."""
    edges = list(range(-1, 9)) + [2**30, 2**31 - 1, 2**31, 2**63 - 1]
    for nq in range(1, 7):
        for nk in range(1, 9):
            for left in edges:
                for right in edges:
                    cl, cr = clamp_window(left, right, nq, nk)
                    assert (cl, cr) == (-1 if left >= nk else left, -1 if right >= nq else right)
                    np.testing.assert_array_equal(
                        ref.visible_mask(nq, nk, window_size=(cl, cr)),
                        ref.visible_mask(nq, nk, window_size=(left, right)))
    assert clamp_window(2**30 - 1, 2**30) == (2**30 - 1, -1)


@pytest.mark.parametrize("window, same", [((2**63 - 1, 2**63 - 1), (-1, -1)),
                                          ((10**20, 3), (-1, 3)), ((1, 10**30), (1, -1))])
def test_reference_treats_edges_past_the_sequence_as_unbounded(window, same):
    for nq, nk in ((5, 8), (4, 5), (2, 8), (6, 2), (1, 1)):
        np.testing.assert_array_equal(ref.visible_mask(nq, nk, window_size=window),
                                      ref.visible_mask(nq, nk, window_size=same))


@pytest.mark.parametrize("window", WINDOWS, ids=WINDOW_IDS)
@pytest.mark.parametrize("op", list(OPS))
def test_op_matches_reference_with_edges_past_the_sequence(rng, op, window):
    OPS[op](rng, window)


def _call(op, window):
    """Call ``op`` with ``window`` on inputs that are fine otherwise (validation only)."""
    rng = np.random.default_rng(0)
    if op in ("forward", "forward-mma", "backward", "backward-mma"):
        kernel = "mma" if op.endswith("mma") else "simt"
        dtype = np.float16 if kernel == "mma" else np.float32
        q, k, v = _dense(rng, dtype)
        if op.startswith("forward"):
            return numba_flash.forward(q, k, v, window_size=window, kernel=kernel)
        lse = np.zeros(q.shape[:3], np.float32)
        return numba_flash.backward(q, q, k, v, q, lse, window_size=window, kernel=kernel)
    if op.startswith("decode"):
        q, k, v = randn(rng, (2, 2, 16)), randn(rng, (2, 1, 8, 16)), randn(rng, (2, 1, 8, 16))
        return numba_flash.decode(q, k, v, cache_seqlens=np.array([5, 8]), window_size=window)
    q, k, v, cu_q, cu_k, mx = _packed(rng)
    if op == "forward_varlen":
        return numba_flash.forward_varlen(q, k, v, cu_q, cu_k, **mx, window_size=window)
    lse = np.zeros((2, q.shape[0]), np.float32)
    return numba_flash.backward_varlen(q, q, k, v, q, lse, cu_q, cu_k, **mx, window_size=window)


@pytest.mark.parametrize("window, exc, match", [
    ((10**20, 0), ValueError, r"^window_size: expected left <= 2\*\*63 - 1"),
    ((0, 2**63), ValueError, r"^window_size: expected right <= 2\*\*63 - 1"),
    ((np.uint64(2**63), 0), ValueError, r"^window_size: expected left <= 2\*\*63 - 1"),
    ({0: 1, 2: 3}, TypeError, r"^window_size: expected a pair \(left, right\) of ints"),
    ({1, 2}, TypeError, r"^window_size: expected a pair \(left, right\) of ints"),
], ids=["10**20", "2**63", "uint64-2**63", "dict", "set"])
@pytest.mark.parametrize("op", ["forward", "forward-mma", "backward", "backward-mma",
                                "forward_varlen", "backward_varlen", "decode"])
def test_op_rejects_bad_window_naming_it(op, window, exc, match):
    with pytest.raises(exc, match=match):
        _call(op, window)
