"""Attention in NumPy: the code and the runs quoted by ``docs/attention-numpy.md``.

Plain NumPy, no kernel: the shapes, the formula, softmax's max trick, the log-sum-exp, causal
masking and GQA as a mask and an index map.  Each ``[docs:...]`` region is a block of the page
and runs on its own (it starts with its own imports).  ``tests/docs/test_attention_numpy.py``
runs every block of the page alone and compares :func:`attention` with
``numba_flash.reference.attention``::

    python docs/examples/attention_numpy.py one-head    # the formula on one head
    python docs/examples/attention_numpy.py softmax     # overflow, and the max trick
    python docs/examples/attention_numpy.py causal      # the causal mask, Nq = Nk and Nq != Nk
    python docs/examples/attention_numpy.py gqa         # which kv head each query head reads
    python docs/examples/attention_numpy.py attention   # all of it, against the reference
"""

# The regions repeat their imports (each must run alone), hence imports below code (E402) and
# redefinitions (F811).
# ruff: noqa: E402, F811

from __future__ import annotations

import sys
import warnings

from report import err


# [docs:one-head]
import numpy as np


def attention_one_head(q, k, v):
    """q [Nq, d], k and v [Nk, d] -> o [Nq, d] = softmax(q k^T / sqrt(d)) v."""
    d = q.shape[1]
    s = q @ k.T / np.sqrt(d)                     # [Nq, Nk]: s[i, j] = q_i . k_j / sqrt(d)
    e = np.exp(s)
    p = e / e.sum(axis=1, keepdims=True)         # softmax of each row: p[i] sums to 1
    return p @ v                                 # [Nq, d]: o_i = sum_j p[i, j] v_j
# [/docs:one-head]


def demo_one_head():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, 4)) for n in (3, 5, 5))
    o = attention_one_head(q, k, v)
    s = q @ k.T / np.sqrt(4)
    p = np.exp(s) / np.exp(s).sum(axis=1, keepdims=True)
    print(f"q {q.shape}, k {k.shape}, v {v.shape} -> s {s.shape}, p {p.shape}, o {o.shape}")
    print(f"  p rows sum to 1:  max |p.sum(1) - 1| = {err(np.abs(p.sum(1) - 1).max())}")
    o0 = p[0] @ v
    print(f"  o_0 = sum_j p[0, j] v_j:  max |o[0] - p[0] @ v| = {err(np.abs(o[0] - o0).max())}")
    print(f"  p[0] = {np.round(p[0], 3).tolist()}  (every key gets some weight)")
    return q, k, v, o


# [docs:softmax]
import numpy as np


def softmax_naive(s):
    e = np.exp(s)                                # overflows to inf once s > 709 (float64)
    return e / e.sum(axis=-1, keepdims=True)


def softmax_stable(s):
    m = s.max(axis=-1, keepdims=True)            # the row's max
    e = np.exp(s - m)                            # every exponent <= 0: no overflow; the max -> 1
    return e / e.sum(axis=-1, keepdims=True)


def log_sum_exp(s):
    m = s.max(axis=-1, keepdims=True)
    return (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]
# [/docs:softmax]


def demo_softmax():
    s = np.array([1000.0, 999.0, 998.0])
    with warnings.catch_warnings(), np.errstate(over="ignore", invalid="ignore"):
        warnings.simplefilter("ignore")
        naive = softmax_naive(s)
        naive32 = softmax_naive(np.array([100.0, 99.0], np.float32))
    stable = softmax_stable(s)
    shifted = softmax_stable(s - 1000.0)
    lse = log_sum_exp(s)
    print(f"s = {s.tolist()}")
    print(f"  softmax_naive(s)          = {naive.tolist()}   (exp(1000) = inf, inf / inf = nan)")
    print(f"  softmax_naive, float32 [100, 99] = {naive32.tolist()}   (float32 exp overflows"
          " past 88.7)")
    print(f"  softmax_stable(s)         = {np.round(stable, 4).tolist()}")
    print(f"  the same as softmax(s - 1000): max difference {err(np.abs(stable - shifted).max())}")
    print(f"  log_sum_exp(s) = {lse:.4f} = 1000 + log(1 + e^-1 + e^-2)")
    p = np.exp(s - lse)
    # lse ~ 1000 is rounded to ~1e-13 absolute, and exp(s - lse) inherits it: noise below 1e-12
    print(f"  exp(s - lse) is the softmax: max difference"
          f" {err(np.abs(p - stable).max(), noise=1e-12)}")
    return s, naive, stable, lse


# [docs:causal]
import numpy as np


def causal_mask(nq, nk):
    """[nq, nk] bool: query i sees key j iff j <= i + nk - nq (aligned bottom-right: the last
    query sees every key, as when nq new tokens follow nk - nq cached ones)."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    return j <= i + (nk - nq)
# [/docs:causal]


def demo_causal():
    for nq, nk in ((4, 4), (2, 5), (5, 3)):
        mask = causal_mask(nq, nk)
        print(f"causal_mask({nq}, {nk}):  (1 = the query row sees the key column)")
        for i, row in enumerate(mask.astype(int)):
            note = "  <- sees no key: o = 0, lse = -inf" if not row.any() else ""
            print(f"  row {i}: {' '.join(map(str, row))}{note}")
    return causal_mask


# [docs:gqa]
import numpy as np


def kv_head(h, H, Hkv):
    """The kv head that query head h reads (GQA: H // Hkv query heads share each kv head;
    Hkv = H is plain multi-head attention, Hkv = 1 multi-query attention)."""
    return h // (H // Hkv)
# [/docs:gqa]


def demo_gqa():
    H, Hkv = 8, 2
    heads = [kv_head(h, H, Hkv) for h in range(H)]
    print(f"H = {H} query heads, Hkv = {Hkv} kv heads: query head h reads kv head {heads}")
    k = np.random.default_rng(0).standard_normal((1, Hkv, 3, 4))
    same = np.array_equal(k[:, heads], np.repeat(k, H // Hkv, axis=1))
    print(f"  k[:, kv_head(h)] for every h == np.repeat(k, H // Hkv, axis=1): {same}")
    return heads


# [docs:attention]
import numpy as np


def attention(q, k, v, causal=False, scale=None):
    """q [B, H, Nq, d], k and v [B, Hkv, Nk, d] (H a multiple of Hkv, Nk >= 1)
    -> (o [B, H, Nq, d], lse [B, H, Nq]), in float64."""
    B, H, nq, d = q.shape
    Hkv, nk = k.shape[1], k.shape[2]
    if H % Hkv:
        raise ValueError(f"H = {H} query heads is not a multiple of Hkv = {Hkv} kv heads")
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    h_kv = np.arange(H) // (H // Hkv)              # GQA: an index map, not copied data
    k, v = k[:, h_kv], v[:, h_kv]                  # [B, H, Nk, d]
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)  # [B, H, Nq, Nk]
    if causal:
        i = np.arange(nq)[:, None]
        j = np.arange(nk)[None, :]
        s = np.where(j <= i + (nk - nq), s, -np.inf)  # a hidden key: score -inf, weight 0
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)           # a row that sees no key: no -inf - -inf
    e = np.exp(s - m)
    l = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(l > 0, e / l, 0.0)            # such a row: p = 0, so o = 0
        lse = np.where(l > 0, m + np.log(l), -np.inf)[..., 0]
    return np.einsum("bhij,bhjd->bhid", p, v), lse
# [/docs:attention]


def demo_attention():
    import numba_flash

    rng = np.random.default_rng(0)
    rows = []
    for B, H, Hkv, nq, nk, d, causal in ((2, 4, 2, 5, 7, 8, True), (1, 3, 1, 6, 4, 16, True),
                                         (1, 2, 2, 3, 9, 4, False)):
        q = rng.standard_normal((B, H, nq, d))
        k, v = (rng.standard_normal((B, Hkv, nk, d)) for _ in range(2))
        o, lse = attention(q, k, v, causal=causal)
        o_ref, lse_ref = numba_flash.reference.attention(q, k, v, causal=causal)
        fin = np.isfinite(lse_ref)
        rows.append(((B, H, Hkv, nq, nk, d, causal), np.abs(o - o_ref).max(),
                     np.abs(lse[fin] - lse_ref[fin]).max(),
                     bool(np.array_equal(np.isfinite(lse), fin)), int((~fin).sum())))
    print("attention() against numba_flash.reference.attention (float64):")
    print("  (B, H, Hkv, Nq, Nk, d, causal)   max |o - ref|  max |lse - ref|  empty rows")
    for shape, eo, el, same_empty, empty in rows:
        print(f"  {str(shape):32s} {err(eo, 12)}  {err(el, 15)}  {empty:10d}"
              f"{'' if same_empty else '  (lse -inf in different rows!)'}")
    return rows


DEMOS = {"one-head": demo_one_head, "softmax": demo_softmax, "causal": demo_causal,
         "gqa": demo_gqa, "attention": demo_attention}

if __name__ == "__main__":
    DEMOS[sys.argv[1]]()
