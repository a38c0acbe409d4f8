"""The backward page's numbers: P from lse vs from (m, L), D, the notes' question-7 pseudo-code
run as written, and the kernels against the float64 reference.

``docs/backward.md`` quotes the output of::

    python docs/examples/backward_demo.py stats    # exp(S - lse) == exp(S - m) / L
    python docs/examples/backward_demo.py delta    # rowsum(dO * O) == rowsum(dP * P); per tile: not
    python docs/examples/backward_demo.py notes    # the notes' per-tile dS: wrong unless Bc >= N
    python docs/examples/backward_demo.py kernel   # numba_flash.backward: GQA, empty rows, atomics
    python docs/examples/backward_demo.py skip     # Q tiles a K/V tile visits: causal vs window
    python docs/examples/backward_demo.py variants # window, softcap, ALiBi, dropout, varlen

``tests/docs/test_backward_demo.py`` checks every claim printed here.
"""

from __future__ import annotations

import math
import sys

import numpy as np

import numba_flash as nf
from report import decade, err
from numba_flash import reference as ref


def problem(rng, n=12, d=4):
    q, k, v, do = (rng.standard_normal((n, d)) for _ in range(4))
    return q, k, v, do


# -- P from the saved statistics --------------------------------------------------------------
def stats_case(seed=0, n=64, d=16, spread=8.0):
    """float32 P recovered both ways against the float64 truth."""
    rng = np.random.default_rng(seed)
    q = (spread * rng.standard_normal((n, d))).astype(np.float32)
    k = rng.standard_normal((n, d)).astype(np.float32)
    s32 = (q @ k.T) / np.float32(math.sqrt(d))
    s64 = s32.astype(np.float64)
    p_true = np.exp(s64 - s64.max(1, keepdims=True))
    p_true /= p_true.sum(1, keepdims=True)
    m = s32.max(1, keepdims=True)
    L = np.exp(s32 - m).sum(1, keepdims=True)  # the notes save m and L (float32 here)
    lse = m + np.log(L)  # numba_flash saves this one number
    p_mL = np.exp(s32 - m) / L
    p_lse = np.exp(s32 - lse)
    return {"n": n, "err_mL": float(np.abs(p_mL - p_true).max()),
            "err_lse": float(np.abs(p_lse - p_true).max()),
            "between": float(np.abs(p_mL - p_lse).max()),
            "max_p": float(p_true.max()), "max_lse": float(np.abs(lse).max()),
            "spread": spread}


def stats():
    print("float32 scores S (64 x 64, q scaled by `spread`), P against the float64 truth:")
    print(f"{'spread':>6s} {'max |lse|':>9s} {'exp(S - m) / L':>15s} {'exp(S - lse)':>13s} "
          f"{'|lse| * 2^-24':>13s} {'the two differ':>14s}")
    for spread in (1.0, 8.0):
        r = stats_case(spread=spread)
        print(f"{r['spread']:6.0f} {r['max_lse']:9.2f} {decade(r['err_mL'], 15)} "
              f"{decade(r['err_lse'], 13)} {r['max_lse'] * 2.0**-24:13.1e} "
              f"{decade(r['between'], 14)}")
    print("stored per row: m and L (2 floats) vs lse (1 float); per element: exp and a divide "
          "(or multiply) vs exp only")


# -- D ----------------------------------------------------------------------------------------
def delta_case(seed=1, n=12, d=4, bc=4):
    rng = np.random.default_rng(seed)
    q, k, v, do = problem(rng, n, d)
    s = q @ k.T / math.sqrt(d)
    p = np.exp(s - s.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    o = p @ v
    dp = do @ v.T
    d_row = (dp * p).sum(1)
    d_fast = (do * o).sum(1)
    tiles = [(dp[:, j:j + bc] * p[:, j:j + bc]).sum(1) for j in range(0, n, bc)]
    return {"n": n, "d": d, "bc": bc, "identity": float(np.abs(d_row - d_fast).max()),
            "tile_err": [float(np.abs(t - d_row).max()) for t in tiles],
            "row0": (d_row[0], [t[0] for t in tiles])}


def delta():
    r = delta_case()
    print(f"N = {r['n']}, d = {r['d']}: max |rowsum(dP * P) - rowsum(dO * O)| = "
          f"{err(r['identity'])}")
    print(f"per K/V tile of Bc = {r['bc']} columns, (dP * P).sum(dim=1) over the tile only:")
    d0, parts = r["row0"]
    print(f"  row 0: D = {d0:+.4f}; tile sums " + ", ".join(f"{x:+.4f}" for x in parts)
          + f" (they add up to {sum(parts):+.4f})")
    for j, e in enumerate(r["tile_err"]):
        print(f"  tile {j}: max |tile sum - D| over rows = {e:.3f}")


# -- the notes' pseudo-code --------------------------------------------------------------------
# [docs:notes-backward]
def notes_backward(Q, K, V, dO, Br, Bc):
    """The notes' question-7 pseudo-code for one (Q_i, K_j, V_j) pair, inside the loops the notes
    prescribe (Q tiles outer, K/V tiles inner), with P recovered from the saved m and L."""
    N, d = Q.shape
    scale = 1 / math.sqrt(d)
    S = Q @ K.T * scale  # the forward's statistics (what question 6 saves)
    m_saved = S.max(axis=1, keepdims=True)
    L_saved = np.exp(S - m_saved).sum(axis=1, keepdims=True)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for q_start in range(0, N, Br):
        i = slice(q_start, q_start + Br)
        for k_start in range(0, N, Bc):
            j = slice(k_start, k_start + Bc)
            Sij = Q[i] @ K[j].T * scale
            Pij = np.exp(Sij - m_saved[i]) / L_saved[i]
            dV[j] += Pij.T @ dO[i]
            dPij = dO[i] @ V[j].T
            dSij = Pij * (dPij - (dPij * Pij).sum(axis=1, keepdims=True))  # a partial row sum
            dQ[i] += dSij @ K[j] * scale
            dK[j] += dSij.T @ Q[i] * scale
    return dQ, dK, dV
# [/docs:notes-backward]


# [docs:fixed-backward]
def tiled_backward(Q, K, V, O, dO, lse, Br, Bc):
    """The notes' loops with the two fixes: P from the one saved number per row (``lse``), and
    the row sum ``D = rowsum(dO * O)`` computed once per Q tile before the K/V loop (it is the
    sum over *all* keys of ``dP * P``, which no single tile holds)."""
    N, d = Q.shape
    scale = 1 / math.sqrt(d)
    dQ, dK, dV = np.zeros_like(Q), np.zeros_like(K), np.zeros_like(V)
    for q_start in range(0, N, Br):
        i = slice(q_start, q_start + Br)
        D_i = (dO[i] * O[i]).sum(axis=1, keepdims=True)  # = rowsum(dP * P) over every key
        for k_start in range(0, N, Bc):
            j = slice(k_start, k_start + Bc)
            Sij = Q[i] @ K[j].T * scale
            Pij = np.exp(Sij - lse[i, None])
            dV[j] += Pij.T @ dO[i]
            dPij = dO[i] @ V[j].T
            dSij = Pij * (dPij - D_i)
            dQ[i] += dSij @ K[j] * scale
            dK[j] += dSij.T @ Q[i] * scale
    return dQ, dK, dV
# [/docs:fixed-backward]


def fixed_case(bc, seed=2, n=12, d=4, br=4):
    rng = np.random.default_rng(seed)
    q, k, v, do = problem(rng, n, d)
    o, lse = ref.attention(q[None, None], k[None, None], v[None, None])
    got = tiled_backward(q, k, v, o[0, 0], do, lse[0, 0], br, bc)
    want = ref.attention_backward(do[None, None], q[None, None], k[None, None], v[None, None])
    return [float(np.abs(g - w[0, 0]).max() / np.abs(w).max()) for g, w in zip(got, want)]


def fixed():
    print("tiled_backward (the notes' loops, lse and D fixed) vs reference.attention_backward,")
    print("N = 12, d = 4, Br = 4 (the same inputs as above)")
    print(f"{'Bc':>3s} {'K/V tiles':>9s} {'dQ rel. err':>11s} {'dK rel. err':>11s} "
          f"{'dV rel. err':>11s}")
    for bc in (12, 6, 4, 2):
        e = fixed_case(bc)
        print(f"{bc:3d} {12 // bc:9d} " + " ".join(err(x, 11) for x in e))


def notes_case(bc, seed=2, n=12, d=4, br=4):
    rng = np.random.default_rng(seed)
    q, k, v, do = problem(rng, n, d)
    got = notes_backward(q, k, v, do, br, bc)
    want = ref.attention_backward(do[None, None], q[None, None], k[None, None], v[None, None])
    return [float(np.abs(g - w[0, 0]).max() / np.abs(w).max()) for g, w in zip(got, want)]


def notes():
    print("the notes' pseudo-code vs reference.attention_backward, N = 12, d = 4, Br = 4")
    print(f"{'Bc':>3s} {'K/V tiles':>9s} {'dQ rel. err':>11s} {'dK rel. err':>11s} "
          f"{'dV rel. err':>11s}")
    for bc in (12, 6, 4, 2):
        e = notes_case(bc)
        print(f"{bc:3d} {12 // bc:9d} " + " ".join(err(x, 11) for x in e))


# -- the kernels ------------------------------------------------------------------------------
def kernel_case(seed=3, dtype=np.float32):
    rng = np.random.default_rng(seed)
    b, h, hkv, nq, nk, d = 1, 4, 2, 12, 9, 8  # GQA; Nq > Nk: rows 0..2 see no key (causal)
    q = rng.standard_normal((b, h, nq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, nk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, nk, d)).astype(dtype)
    do = rng.standard_normal((b, h, nq, d)).astype(dtype)
    o, lse = nf.forward(q, k, v, causal=True, return_lse=True)
    want = ref.attention_backward(do, q, k, v, causal=True)
    atomic = nf.backward(do, q, k, v, o, lse, causal=True)
    det1 = nf.backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    det2 = nf.backward(do, q, k, v, o, lse, causal=True, deterministic=True)
    return {
        "shape": (b, h, hkv, nq, nk, d),
        "err_atomic": [float(np.abs(g - w).max()) for g, w in zip(atomic, want)],
        "err_det": [float(np.abs(g - w).max()) for g, w in zip(det1, want)],
        "det_bitwise": all(x.tobytes() == y.tobytes() for x, y in zip(det1, det2)),
        "empty_lse": lse[0, :, :3].ravel().tolist(),
        "empty_dq_zero": bool((atomic[0][:, :, :3] == 0).all() and (det1[0][:, :, :3] == 0).all()),
        "dk_shape": atomic[1].shape,
        "finite": all(np.isfinite(g).all() for g in atomic + det1),
    }


def kernel():
    r = kernel_case()
    b, h, hkv, nq, nk, d = r["shape"]
    print(f"numba_flash.backward, float32, causal, B={b} H={h} Hkv={hkv} Nq={nq} Nk={nk} d={d}")
    print(f"  {'':>14s} {'max |dq - ref|':>14s} {'max |dk - ref|':>14s} {'max |dv - ref|':>14s}")
    print(f"  {'atomic dQ':>14s} " + " ".join(f"{e:14.1e}" for e in r["err_atomic"]))
    print(f"  {'deterministic':>14s} " + " ".join(f"{e:14.1e}" for e in r["err_det"]))
    print(f"  dk, dv come back as {r['dk_shape']} (summed over each group of {h // hkv} "
          "query heads)")
    print(f"  rows 0..2 see no key: lse = {sorted(set(r['empty_lse']))}, their dq all zero: "
          f"{r['empty_dq_zero']}; every gradient finite: {r['finite']}")
    print(f"  deterministic=True twice: bitwise identical: {r['det_bitwise']}")


# -- window, softcap, ALiBi, packed batches -----------------------------------------------------
def skip_case(n=128, block=16, window=(8, 0)):
    """Q tiles each K/V tile's block visits (tile_query_range), causal vs a causal window."""
    from numba_flash.kernels.mainloop.visibility import tile_query_range_py

    out = {}
    for name, (left, right) in (("full", (-1, -1)), ("causal", (-1, 0)), ("window", window)):
        visits = []
        for k_start in range(0, n, block):
            lo, hi = tile_query_range_py(k_start, min(k_start + block, n), 0, n, left, right)
            visits.append(0 if hi <= lo else -(-hi // block) - lo // block)
        out[name] = visits
    return out


def skip():
    n, block, window = 128, 16, (8, 0)
    r = skip_case(n, block, window)
    print(f"N = {n}, tiles of {block}: Q tiles visited by the dK/dV block of each K/V tile")
    for name, label in (("full", "no mask"), ("causal", "causal"),
                        ("window", f"window {window}")):
        v = r[name]
        print(f"  {label:>14s}: {' '.join(f'{x:2d}' for x in v)}   total {sum(v):2d} of "
              f"{len(v) ** 2} pairs")


def variants_case(seed=4):
    rng = np.random.default_rng(seed)
    b, h, hkv, n, d = 1, 2, 1, 16, 8
    q = 2 * rng.standard_normal((b, h, n, d)).astype(np.float32)
    k, v = (rng.standard_normal((b, hkv, n, d)).astype(np.float32) for _ in range(2))
    do = rng.standard_normal((b, h, n, d)).astype(np.float32)
    cases = {
        "window (4, 0)": dict(window_size=(4, 0)),
        "softcap 2": dict(softcap=2.0),
        "ALiBi": dict(alibi_slopes=ref.alibi_slopes(h)),
        "all + dropout": dict(causal=True, window_size=(6, -1), softcap=3.0,
                              alibi_slopes=ref.alibi_slopes(h), dropout_p=0.2),
    }
    out = {}
    for name, kw in cases.items():
        kw = dict(kw)
        p = kw.pop("dropout_p", 0.0)
        mask = nf.dropout_mask(7, b, h, n, n, p) if p else None
        o, lse = ref.attention(q, k, v, dropout_mask=mask, dropout_p=p, **kw)
        got = nf.backward(do, q, k, v, o.astype(np.float32), lse.astype(np.float32),
                          dropout_p=p, seed=7, **kw)
        want = ref.attention_backward(do, q, k, v, dropout_mask=mask, dropout_p=p, **kw)
        out[name] = [float(np.abs(g - w).max() / max(1.0, np.abs(w).max()))
                     for g, w in zip(got, want)]
    # a packed batch of 3 sequences, the middle one without queries
    lq, lk = [5, 0, 11], [7, 3, 9]
    cu_q = np.array([0, 5, 5, 16], np.int32)
    cu_k = np.array([0, 7, 10, 19], np.int32)
    qp = 2 * rng.standard_normal((16, h, d)).astype(np.float32)
    kp, vp = (rng.standard_normal((19, hkv, d)).astype(np.float32) for _ in range(2))
    dop = rng.standard_normal((16, h, d)).astype(np.float32)
    op, lsep = ref.attention_varlen(qp, kp, vp, cu_q, cu_k, causal=True)
    got = nf.backward_varlen(dop, qp, kp, vp, op.astype(np.float32), lsep.astype(np.float32),
                             cu_q, cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk), causal=True)
    want = ref.attention_backward_varlen(dop, qp, kp, vp, cu_q, cu_k, causal=True)
    out["varlen causal"] = [float(np.abs(g - w).max() / max(1.0, np.abs(w).max()))
                            for g, w in zip(got, want)]
    out["empty sequence's keys: dk = dv = 0"] = bool(not got[1][7:10].any()
                                                     and not got[2][7:10].any())
    return out


def variants():
    r = variants_case()
    print("numba_flash.backward, float32, B=1 H=2 Hkv=1 N=16 d=8, error / max(1, |ref|):")
    print(f"  {'':>16s} {'dq':>8s} {'dk':>8s} {'dv':>8s}")
    for name, errs in r.items():
        if isinstance(errs, list):
            print(f"  {name:>16s} " + " ".join(f"{e:8.1e}" for e in errs))
    print(f"  varlen lengths q [5, 0, 11], k [7, 3, 9]; empty sequence's keys get dk = dv = 0: "
          f"{r['empty sequence' + chr(39) + 's keys: dk = dv = 0']}")


if __name__ == "__main__":
    {"stats": stats, "delta": delta, "notes": notes, "kernel": kernel, "skip": skip,
     "variants": variants, "fixed": fixed}[sys.argv[1]]()
