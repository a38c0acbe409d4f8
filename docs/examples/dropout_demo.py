"""The dropout page's numbers: the counter layout by hand, the keep rate, the memory a stored
mask would take, a kernel's output rebuilt from ``dropout_mask``, and the notes' variant.

``docs/dropout.md`` quotes the output of::

    python docs/examples/dropout_demo.py counter     # one mask element drawn by hand
    python docs/examples/dropout_demo.py rate        # keep rate and a binomial test
    python docs/examples/dropout_demo.py memory      # a stored mask vs a seed
    python docs/examples/dropout_demo.py reproduce   # forward/backward == reference + dropout_mask
    python docs/examples/dropout_demo.py notes       # l from the dropped P: biased, 0/0 rows

``tests/docs/test_dropout_demo.py`` checks every claim printed here.
"""

from __future__ import annotations

import math
import sys

import numpy as np
from scipy import stats as sps

import numba_flash as nf
from numba_flash import reference as ref
from numba_flash.philox import dropout_params, philox4x32_10


# -- one element by hand ----------------------------------------------------------------------
# [docs:dropout-by-hand]
def keep_by_hand(seed, b, h, i, j, dropout_p):
    """Element (b, h, i, j) of the keep-mask, straight from the contract."""
    key = (seed & 0xFFFFFFFF, seed >> 32)
    counter = (j // 4, i, h, b)
    draw = int(philox4x32_10(np.array(counter), np.array(key))[j % 4])
    threshold = min(round(dropout_p * 2**32), 2**32 - 1)
    return draw >= threshold, draw, threshold
# [/docs:dropout-by-hand]


def counter():
    seed, p = 2**40 + 12345, 0.25
    lo, hi, thr, scale = dropout_params(p, seed)
    print(f"seed = 2**40 + 12345 -> key = (seed_lo, seed_hi) = ({int(lo)}, {int(hi)}); "
          f"dropout_p = {p}: threshold = {int(thr)}, scale 1/(1-p) = {scale:.4f}")
    mask = nf.dropout_mask(seed, 2, 3, 5, 10, p)
    print(f"{'(b, h, i, j)':>14s} {'counter':>16s} {'word':>4s} {'draw':>10s} {'keep':>5s} "
          f"{'dropout_mask':>12s}")
    for b, h, i, j in ((0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 0, 5), (1, 2, 4, 9), (1, 1, 3, 7)):
        keep, draw, _ = keep_by_hand(seed, b, h, i, j, p)
        print(f"{str((b, h, i, j)):>14s} {str((j // 4, i, h, b)):>16s} {j % 4:4d} {draw:10d} "
              f"{str(keep):>5s} {str(bool(mask[b, h, i, j])):>12s}")


# -- keep rate ----------------------------------------------------------------------------------
def rate_rows(shape=(2, 4, 128, 128), seed=7):
    rows = []
    for p in (0.1, 0.5, 0.9):
        keep = nf.dropout_mask(seed, *shape, p)
        n, kept = keep.size, int(keep.sum())
        test = sps.binomtest(kept, n, 1 - p)
        words = [float(keep[..., w::4].mean()) for w in range(4)]  # the 4 words of a Philox call
        rows.append({"p": p, "n": n, "kept": kept, "rate": kept / n,
                     "z": (kept - n * (1 - p)) / math.sqrt(n * p * (1 - p)),
                     "pvalue": test.pvalue, "words": words})
    return rows


def rate():
    print("nf.dropout_mask(seed=7, B=2, H=4, Nq=128, Nk=128, p): 131072 draws each")
    print(f"{'p':>4s} {'kept':>7s} {'rate':>7s} {'1 - p':>6s} {'z':>6s} {'binomial p-value':>16s} "
          f" keep rate of words 0..3")
    for r in rate_rows():
        print(f"{r['p']:4.1f} {r['kept']:7d} {r['rate']:7.4f} {1 - r['p']:6.2f} {r['z']:6.2f} "
              f"{r['pvalue']:16.2f}  " + " ".join(f"{w:.4f}" for w in r["words"]))


# -- memory -------------------------------------------------------------------------------------
def memory():
    b, h = 8, 32
    print(f"a stored mask for B = {b}, H = {h} (per attention layer) vs what numba_flash keeps")
    print(f"{'N':>6s} {'1 bit/elem':>11s} {'bool (1 B)':>11s} {'float16 (bernoulli_)':>21s} "
          f"{'seed':>5s}")
    for n in (2048, 8192, 32768):
        e = b * h * n * n
        print(f"{n:6d} {e / 8 / 2**30:9.2f} GiB {e / 2**30:7.1f} GiB {2 * e / 2**30:17.1f} GiB "
              f"{8:3d} B")


# -- the kernels reproduced ---------------------------------------------------------------------
def reproduce_case(seed=99, p=0.3, dtype=np.float32):
    rng = np.random.default_rng(5)
    b, h, hkv, nq, nk, d = 2, 4, 2, 13, 20, 8
    q = rng.standard_normal((b, h, nq, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, nk, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, nk, d)).astype(dtype)
    do = rng.standard_normal((b, h, nq, d)).astype(dtype)
    # [docs:dropout-reproduce]
    o, lse = nf.forward(q, k, v, causal=True, dropout_p=p, seed=seed, return_lse=True)
    keep = nf.dropout_mask(seed, b, h, nq, nk, p)  # the same bits, drawn on the host
    o_ref, lse_ref = ref.attention(q, k, v, causal=True, dropout_mask=keep, dropout_p=p)
    grads = nf.backward(do, q, k, v, o, lse, causal=True, dropout_p=p, seed=seed)
    grads_ref = ref.attention_backward(do, q, k, v, causal=True, dropout_mask=keep, dropout_p=p)
    # [/docs:dropout-reproduce]
    o16 = nf.forward(q, k, v, causal=True, dropout_p=p, seed=seed, block_m=16, block_n=8)
    _, lse_plain = nf.forward(q, k, v, causal=True, return_lse=True)
    o_other_seed = nf.forward(q, k, v, causal=True, dropout_p=p, seed=seed + 1)
    return {"shape": (b, h, hkv, nq, nk, d), "p": p,
            "o_err": float(np.abs(o - o_ref).max()), "lse_err": float(np.abs(lse - lse_ref).max()),
            "grad_err": [float(np.abs(g - w).max()) for g, w in zip(grads, grads_ref)],
            "tiles_diff": float(np.abs(o16 - o).max()),
            "lse_same_as_plain": lse.tobytes() == lse_plain.tobytes(),
            "other_seed_diff": float(np.abs(o_other_seed - o).max()),
            "kept": float(keep[ref.causal_visible(nq, nk)[None, None].repeat(b, 0)
                               .repeat(h, 1)].mean())}


def reproduce():
    r = reproduce_case()
    print(f"float32, causal, B, H, Hkv, Nq, Nk, d = {r['shape']}, dropout_p = {r['p']}, seed = 99")
    print(f"  kept fraction of the visible probabilities: {r['kept']:.3f}")
    print(f"  forward:  max |o - ref| = {r['o_err']:.1e}, max |lse - ref| = {r['lse_err']:.1e}")
    print("  backward: max |dq - ref|, |dk - ref|, |dv - ref| = "
          + ", ".join(f"{e:.1e}" for e in r["grad_err"]))
    print(f"  lse with dropout is bitwise the lse without: {r['lse_same_as_plain']}")
    print(f"  tiles 16 x 8 instead of 8 x 8: max |o difference| = {r['tiles_diff']:.1e}")
    print(f"  seed 100 instead of 99: max |o difference| = {r['other_seed_diff']:.2f}")


# -- the notes' variant -------------------------------------------------------------------------
def notes_case(samples=20000, p=0.5, nq=4, nk=6, d=3, seed=11):
    """Average ``samples`` dropout outputs of one small head (masks: batch index = sample) for
    the reference (l from the undropped P) and the notes' order (l from the dropped P)."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((n, d)) for n in (nq, nk, nk))
    s = q @ k.T / math.sqrt(d)
    P = np.exp(s - s.max(1, keepdims=True))  # exp(S - m): the unnormalised probabilities
    o_exact = (P / P.sum(1, keepdims=True)) @ v  # no dropout
    z = nf.dropout_mask(seed, samples, 1, nq, nk, p)[:, 0] / (1 - p)  # [samples, nq, nk]
    o_ref = (P / P.sum(1, keepdims=True) * z) @ v  # the standard: P from the undropped l
    l_notes = (P * z).sum(2, keepdims=True)  # the notes: l summed after the mask
    with np.errstate(invalid="ignore", divide="ignore"):
        o_notes = (P * z) @ v / l_notes
    nan_rows = int(np.isnan(o_notes).any(2).sum())
    return {"samples": samples, "p": p, "nq": nq, "nk": nk,
            "ref_bias": float(np.abs(o_ref.mean(0) - o_exact).max()),
            "notes_bias": float(np.abs(np.nanmean(o_notes, 0) - o_exact).max()),
            "stderr": float((o_ref.std(0) / math.sqrt(samples)).max()),
            "nan_rows": nan_rows, "rows": samples * nq, "all_dropped": p ** nk}


def notes():
    print("mean over dropout masks vs the output without dropout "
          "(one head, Nq = 4, Nk = 6, p = 0.5)")
    print(f"{'masks':>6s} {'reference: max |mean - exact|':>30s} "
          f"{'notes: max |mean - exact|':>26s} "
          f"{'std. error':>10s} {'notes 0/0 rows':>15s}")
    for n in (2000, 20000):
        r = notes_case(samples=n)
        print(f"{n:6d} {r['ref_bias']:30.4f} {r['notes_bias']:26.4f} {r['stderr']:10.4f} "
              f"{r['nan_rows']:6d} of {r['rows']:6d}")
    print(f"a row loses every key with probability p^Nk = {0.5 ** 6:.4f}: the notes divide 0 by 0")


if __name__ == "__main__":
    {"counter": counter, "rate": rate, "memory": memory, "reproduce": reproduce,
     "notes": notes}[sys.argv[1]]()
