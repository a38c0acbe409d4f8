"""Check of docs/exercises/predict_failures.py: each prediction against what the simulator does
with the first tiled kernel broken in that way (the kernel below is the row kernel's loop with
switches for the two barriers and for an early return of spare threads)."""

from __future__ import annotations

import functools
import math

import numpy as np

import numba_flash  # noqa: F401  (first: selects the simulator when there is no GPU)
from numba import cuda, float64
from numba_flash import reference as ref

BLOCK_M, BLOCK_N, HEAD_DIM = 4, 6, 4


@functools.lru_cache(maxsize=None)
def make_kernel(LOAD_BARRIER, END_BARRIER, SPARE_RETURNS):
    @cuda.jit
    def row_forward(q, k, v, o, scale):
        tid = cuda.threadIdx.x
        row = cuda.blockIdx.x * BLOCK_M + tid
        nq, nk, d = q.shape[0], k.shape[0], q.shape[1]
        if SPARE_RETURNS and row >= nq:
            return
        K_j = cuda.shared.array((BLOCK_N, HEAD_DIM), float64)
        V_j = cuda.shared.array((BLOCK_N, HEAD_DIM), float64)
        acc = cuda.local.array(HEAD_DIM, float64)
        for c in range(d):
            acc[c] = 0.0
        m_i, l_i = -math.inf, 0.0
        for t in range((nk + BLOCK_N - 1) // BLOCK_N):
            k0 = t * BLOCK_N
            n_rows = min(BLOCK_N, nk - k0)
            for e in range(tid, n_rows * d, BLOCK_M):
                K_j[e // d, e % d] = k[k0 + e // d, e % d]
                V_j[e // d, e % d] = v[k0 + e // d, e % d]
            if LOAD_BARRIER:
                cuda.syncthreads()
            if row < nq:
                for j in range(n_rows):
                    s = 0.0
                    for c in range(d):
                        s += q[row, c] * K_j[j, c]
                    s *= scale
                    m_new = max(m_i, s)
                    alpha, p = math.exp(m_i - m_new), math.exp(s - m_new)
                    l_i = alpha * l_i + p
                    for c in range(d):
                        acc[c] = alpha * acc[c] + p * V_j[j, c]
                    m_i = m_new
            if END_BARRIER:
                cuda.syncthreads()
        if row < nq:
            for c in range(d):
                o[row, c] = acc[c] / l_i

    return row_forward


def wrong_rows(nq, nk, load_barrier=True, end_barrier=True, spare_returns=False):
    """The query rows whose output differs from the reference (run in the simulator)."""
    rng = np.random.default_rng(nq * 100 + nk)
    q, k, v = (rng.standard_normal((n, HEAD_DIM)) for n in (nq, nk, nk))
    o = np.full(q.shape, np.nan)
    make_kernel(load_barrier, end_barrier, spare_returns)[-(-nq // BLOCK_M), BLOCK_M](
        q, k, v, o, 0.5)
    want = ref.attention(q[None, None], k[None, None], v[None, None], softmax_scale=0.5)[0][0, 0]
    return [int(r) for r in np.flatnonzero(~np.isclose(o, want, atol=1e-12).all(axis=1))]


def test_predict_failures(exercise):
    check(exercise("predict_failures"))


def check(mod):
    guess = mod.PREDICTION
    assert None not in guess.values(), "fill in every prediction first"
    runs = {
        "no_load_barrier": wrong_rows(8, 18, load_barrier=False),
        "no_end_barrier_one_tile": wrong_rows(8, 6, end_barrier=False),
        "no_end_barrier": wrong_rows(8, 18, end_barrier=False),
    }
    for name, bad in runs.items():
        seen = "wrong" if bad else "right"
        assert guess[name] == seen, f"{name}: you predicted {guess[name]!r}; it came out {seen}"
    bad = wrong_rows(10, 18, spare_returns=True)
    assert list(guess["early_return_rows"]) == bad, (
        f"early_return_rows: you predicted {guess['early_return_rows']}; rows {bad} came out wrong")
