"""The tiled-forward page's numbers: the GPU tile budget, the kernel against the float64
reference, and the notes' Triton kernel (question 8) run as written.

``docs/optimised-forward.md`` quotes the output of (``triton``: ``docs/tiled-forward.md``)::

    python docs/examples/forward_demo.py budget     # tiles, micro-tiles, registers, shared memory
    python docs/examples/forward_demo.py accuracy   # numba_flash.forward vs reference, 3 dtypes
    python docs/examples/forward_demo.py triton     # the notes' kernel: padded keys get probability

``tests/docs/test_forward_demo.py`` checks every claim printed here.
"""

from __future__ import annotations

import math
import sys

import numpy as np

import numba_flash as nf
from numba_flash import reference as ref
from report import err
from numba_flash.kernels.forward import config as fconfig


# -- the GPU tile budget ---------------------------------------------------------------------
def budget_rows():
    """One row per (compute word, head dim): the GPU default tiles and what they cost."""
    rows = []
    for dtype in (np.float32, np.float64):
        word = fconfig._word(dtype)
        for hd in fconfig.HEAD_DIMS:
            bm, bn, _ = fconfig.gpu_tiles(hd, dtype)
            tm_, tn_ = fconfig.thread_layout(bm, bn, hd)
            regs = word // 4
            rows.append({
                "dtype": "float16/32" if dtype == np.float32 else "float64",
                "HEAD_DIM": hd, "BLOCK_M": bm, "BLOCK_N": bn, "threads": (tm_, tn_),
                "S": (bm // tm_, bn // tn_), "acc": (bm // tm_, hd // tn_),
                "regs": max(bm // tm_ * bn // tn_, bm // tm_ * hd // tn_) * regs,
                "smem": fconfig.shared_bytes(bm, bn, hd, dtype),
                "smem_dropout": fconfig.shared_bytes(bm, bn, hd, dtype, dropout=True),
                "problem": fconfig.tile_problem(bm, bn, hd, dtype, dropout=True),
            })
    return rows


def budget():
    print(f"{'compute':>10s} {'HEAD_DIM':>8s} {'BLOCK_M':>7s} {'BLOCK_N':>7s} {'threads':>7s} "
          f"{'S/thread':>8s} {'acc/thread':>10s} {'regs':>4s} {'smem KiB':>8s} {'+dropout':>8s}")
    for r in budget_rows():
        print(f"{r['dtype']:>10s} {r['HEAD_DIM']:8d} {r['BLOCK_M']:7d} {r['BLOCK_N']:7d} "
              f"{'%dx%d' % r['threads']:>7s} {'%dx%d' % r['S']:>8s} {'%dx%d' % r['acc']:>10s} "
              f"{r['regs']:4d} {r['smem'] / 1024:8.1f} {r['smem_dropout'] / 1024:8.1f}")
    print(f"limit: {fconfig.SMEM_LIMIT // 1024} KiB of static shared memory per block, "
          f"{fconfig.MAX_TILE_REGS} registers per micro-tile")


# -- accuracy --------------------------------------------------------------------------------
def accuracy_rows(seed=0):
    """``numba_flash.forward`` (simulator, 8 x 8 tiles) against ``reference.attention``."""
    rng = np.random.default_rng(seed)
    rows = []
    shape = (2, 4, 2, 19, 27, 12)  # B, H, Hkv (GQA), Nq, Nk, d: ragged tiles, d not a power of 2
    b, h, hkv, nq, nk, d = shape
    q0 = rng.standard_normal((b, h, nq, d))
    k0 = rng.standard_normal((b, hkv, nk, d))
    v0 = rng.standard_normal((b, hkv, nk, d))
    for dtype in (np.float16, np.float32, np.float64):
        q, k, v = (x.astype(dtype) for x in (q0, k0, v0))
        for causal in (False, True):
            o, lse = nf.forward(q, k, v, causal=causal, return_lse=True)
            ro, rlse = ref.attention(q, k, v, causal=causal)
            bo, blse = ref.blocked_attention(q, k, v, 8, 8, causal=causal)
            rows.append({"dtype": np.dtype(dtype).name, "causal": causal,
                         "o_err": float(np.abs(o - ro).max()),
                         "lse_err": float(np.abs(lse - rlse).max()),
                         "lse_dtype": lse.dtype.name,
                         "blocked_err": float(np.abs(bo - ro).max())})
    return shape, rows


def accuracy():
    shape, rows = accuracy_rows()
    print("B, H, Hkv, Nq, Nk, d =", shape, "; simulator tiles BLOCK_M = BLOCK_N = 8")
    print(f"{'input':>8s} {'causal':>6s} {'max |o - ref|':>14s} {'max |lse - ref|':>16s} "
          f"{'lse dtype':>9s} {'blocked_attention':>18s}")
    for r in rows:
        print(f"{r['dtype']:>8s} {str(r['causal']):>6s} {err(r['o_err'], 14)} "
              f"{err(r['lse_err'], 16)} {r['lse_dtype']:>9s} {err(r['blocked_err'], 18)}")


# -- the notes' Triton kernel ------------------------------------------------------------------
# [docs:notes-triton]
def notes_triton_forward(Q, K, V, scale, BLOCK_Q, BLOCK_KV):
    """The notes' question-8 Triton kernel, one program after another, in NumPy.

    ``tl.load(..., mask=rows < N, other=0.0)`` becomes a zero-padded tile; everything else is
    line for line (``O``, ``l``, ``m`` are the kernel's names).
    """
    N, D = Q.shape

    def load(X, start, rows):  # tl.load with mask=(start + offs) < N, other=0.0
        tile = np.zeros((rows, D))
        n = max(0, min(rows, N - start))
        tile[:n] = X[start:start + n]
        return tile

    O_out, L_out, M_out = np.zeros((N, D)), np.zeros(N), np.zeros(N)
    for pid in range((N + BLOCK_Q - 1) // BLOCK_Q):
        q_start = pid * BLOCK_Q
        Qb = load(Q, q_start, BLOCK_Q)
        O = np.zeros((BLOCK_Q, D))
        l = np.zeros((BLOCK_Q, 1))
        m = np.full((BLOCK_Q, 1), -np.inf)
        Tc = (N + BLOCK_KV - 1) // BLOCK_KV
        for j in range(Tc):
            k_start = j * BLOCK_KV
            Kb = load(K, k_start, BLOCK_KV)
            Vb = load(V, k_start, BLOCK_KV)
            S = Qb @ Kb.T * scale  # padded keys (zero rows of Kb) score exactly 0
            m_new = np.maximum(m, S.max(axis=1, keepdims=True))
            O = O * np.exp(m - m_new)
            l = l * np.exp(m - m_new)
            P = np.exp(S - m_new)
            l = l + P.sum(axis=1, keepdims=True)
            O = O + P @ Vb
            m = m_new
        O = O / l
        rows = min(BLOCK_Q, N - q_start)  # the stores' mask
        O_out[q_start:q_start + rows] = O[:rows]
        L_out[q_start:q_start + rows] = l[:rows, 0]  # l (the sum), not lse
        M_out[q_start:q_start + rows] = m[:rows, 0]
    return O_out, L_out, M_out
# [/docs:notes-triton]


def triton_case(n, block=8, d=4, seed=3):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    scale = 1 / math.sqrt(d)
    o, l, m = notes_triton_forward(q, k, v, scale, block, block)
    ro, rlse = ref.attention(q[None, None], k[None, None], v[None, None])
    ro, rlse = ro[0, 0], rlse[0, 0]
    s = scale * q @ k.T
    l_true = np.exp(s - s.max(axis=1, keepdims=True)).sum(axis=1)
    pad = -n % block  # padded keys in the last K/V tile
    return {"n": n, "block": block, "pad": pad, "o_err": float(np.abs(o - ro).max()),
            "l_excess": float(np.abs(l - l_true - pad * np.exp(-m)).max()),
            "lse_err": float(np.abs(m + np.log(l) - rlse).max()),
            "lse_err_fixed": float(np.abs(m + np.log(l - pad * np.exp(-m)) - rlse).max())}


def triton():
    print("the notes' Triton kernel vs reference.attention, BLOCK_Q = BLOCK_KV = 8, d = 4")
    print(f"{'N':>3s} {'padded keys':>11s} {'max |O - ref|':>14s} "
          f"{'max |(m + log l) - lse|':>24s} {'l - l_true - pad e^-m':>22s}")
    for n in (16, 10, 13):
        r = triton_case(n)
        print(f"{r['n']:3d} {r['pad']:11d} {err(r['o_err'], 14)} {err(r['lse_err'], 24)} "
              f"{err(r['l_excess'], 22)}")


if __name__ == "__main__":
    {"budget": budget, "accuracy": accuracy, "triton": triton}[sys.argv[1]]()
