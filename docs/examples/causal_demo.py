"""The causal-tiles page's numbers: bottom-right vs the notes' top-left alignment, tiles after
the diagonal never read, rows that see no key.

``docs/causal-tiles.md`` quotes the output of::

    python docs/examples/causal_demo.py alignment   # who sees whom, Nq != Nk, both conventions
    python docs/examples/causal_demo.py kinds       # tile kinds and loaded tiles per Q tile
    python docs/examples/causal_demo.py nan-tiles   # NaN after the diagonal: never read
    python docs/examples/causal_demo.py empty-rows  # Nq > Nk: o = 0, lse = -inf

``tests/docs/test_causal_demo.py`` checks every claim printed here.
"""

from __future__ import annotations

import math
import sys

import numpy as np

import numba_flash as nf
from numba_flash import reference as ref
from report import err
from numba_flash.tools.pictures import DIAGONAL, FULL, SKIPPED, tile_kinds


# [docs:notes-causal]
def notes_causal_q_block(Qi, K, V, Bc, scale, q_start):
    """The notes' question-5 loop body (``flash_forward_q_block``, causal=True) in NumPy."""
    Br, d = Qi.shape
    N = K.shape[0]
    Oi = np.zeros((Br, d))
    li = np.zeros((Br, 1))
    mi = np.full((Br, 1), -np.inf)
    Tc = (N + Bc - 1) // Bc
    q_end = q_start + Br
    for j in range(Tc):
        k_start = j * Bc
        k_end = min(N, k_start + Bc)
        if k_start >= q_end:  # fully masked: skip
            continue
        Kj, Vj = K[k_start:k_end], V[k_start:k_end]
        Sij = Qi @ Kj.T * scale
        if k_end > q_start:  # partly masked
            q_pos = np.arange(q_start, q_end)[:, None]
            k_pos = np.arange(k_start, k_end)[None, :]
            Sij = np.where(q_pos >= k_pos, Sij, -np.inf)  # top-left: row i sees keys j <= i
        row_max = Sij.max(axis=1, keepdims=True)
        mi_new = np.maximum(mi, row_max)
        Oi = Oi * np.exp(mi - mi_new)
        li = li * np.exp(mi - mi_new)
        Pij = np.exp(Sij - mi_new)
        li = li + Pij.sum(axis=1, keepdims=True)
        Oi = Oi + Pij @ Vj
        mi = mi_new
    return Oi / li, li
# [/docs:notes-causal]


def notes_causal(q, k, v, Br, Bc):
    """The notes' causal forward for one head: their loop body over every Q tile."""
    scale = 1 / math.sqrt(q.shape[1])
    return np.concatenate([notes_causal_q_block(q[s:s + Br], k, v, Bc, scale, s)[0]
                           for s in range(0, q.shape[0], Br)])


def alignment_case(nq, nk, d=4, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nq, d))
    k = rng.standard_normal((nk, d))
    v = rng.standard_normal((nk, d))
    notes = notes_causal(q, k, v, 2, 2)
    bottom_right, _ = ref.attention(q[None, None], k[None, None], v[None, None], causal=True)
    kernel = nf.forward(q[None, None], k[None, None], v[None, None], causal=True)
    top_left = np.tril(np.ones((nq, nk), bool))  # j <= i
    p_tl = np.where(top_left, q @ k.T / math.sqrt(d), -np.inf)
    p_tl = np.exp(p_tl - p_tl.max(axis=1, keepdims=True))
    o_tl = (p_tl / p_tl.sum(axis=1, keepdims=True)) @ v
    return {"notes_vs_bottom_right": float(np.abs(notes - bottom_right[0, 0]).max()),
            "notes_vs_top_left": float(np.abs(notes - o_tl).max()),
            "kernel_vs_bottom_right": float(np.abs(kernel[0, 0] - bottom_right[0, 0]).max())}


def picture(vis):
    return ["".join("x" if e else "." for e in row) for row in vis]


def alignment():
    nq, nk = 3, 6
    br = picture(ref.causal_visible(nq, nk))
    tl = picture(np.tril(np.ones((nq, nk), bool)))
    print(f"Nq = {nq} new queries after {nk - nq} cached keys (Nk = {nk}); x = query sees key")
    print(f"{'query':>5s}  {'bottom-right (flash-attn >= 2.1)':>32s}  "
          f"{'top-left (notes: q_pos >= k_pos)':>33s}")
    for i in range(nq):
        print(f"{i:5d}  {br[i]:>32s}  {tl[i]:>33s}")
    print()
    print(f"{'Nq':>3s} {'Nk':>3s} {'notes vs bottom-right':>22s} {'notes vs top-left':>18s} "
          f"{'numba_flash vs bottom-right':>28s}")
    for nq, nk in ((6, 6), (3, 6), (6, 3)):
        r = alignment_case(nq, nk)
        print(f"{nq:3d} {nk:3d} {err(r['notes_vs_bottom_right'], 22)} "
              f"{err(r['notes_vs_top_left'], 18)} {err(r['kernel_vs_bottom_right'], 28)}")


def kinds():
    sym = {SKIPPED: ".", FULL: "F", DIAGONAL: "D"}
    for nq, nk in ((32, 32), (16, 40)):
        kk = tile_kinds(nq, nk, 8, 8)
        print(f"Nq = {nq}, Nk = {nk}, BLOCK_M = BLOCK_N = 8 (F full, D masked, . skipped)")
        for t, row in enumerate(kk):
            loaded = int((row != SKIPPED).sum())
            print(f"  Q tile {t}: {''.join(sym[x] for x in row)}   loads {loaded} of {len(row)}")
        print(f"  tiles loaded: {int((kk != SKIPPED).sum())} of {kk.size}")


def nan_tile_rows(nq=32, nk=32, d=8, block=8, seed=1):
    """For each Q tile t: K/V keys after the last key tile t can see set to NaN; the rows of
    tile t from numba_flash.forward (causal) against the reference on the clean inputs."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, nq, d)).astype(np.float32)
    k = rng.standard_normal((1, 1, nk, d)).astype(np.float32)
    v = rng.standard_normal((1, 1, nk, d)).astype(np.float32)
    want, _ = ref.attention(q, k, v, causal=True)
    rows = []
    for t in range(nq // block):
        q_end = (t + 1) * block
        last_key = q_end - 1 + nk - nq  # the last key any row of this tile sees
        first_bad = (last_key // block + 1) * block  # first key of the first skipped tile
        kn, vn = k.copy(), v.copy()
        kn[..., first_bad:, :] = np.nan
        vn[..., first_bad:, :] = np.nan
        o = nf.forward(q, kn, vn, causal=True, block_m=block, block_n=block)
        # load every tile and mask instead of skipping: 0 * NaN = NaN in P V
        s = np.einsum("id,jd->ij", q[0, 0, t * block:q_end], kn[0, 0]) / math.sqrt(d)
        s = np.where(ref.causal_visible(nq, nk)[t * block:q_end], s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        masked_all = (p / p.sum(axis=1, keepdims=True)) @ vn[0, 0]
        rows.append({"tile": t, "nan_keys": nk - first_bad,
                     "finite": bool(np.isfinite(o[0, 0, t * block:q_end]).all()),
                     "err": float(np.abs(o[0, 0, t * block:q_end]
                                         - want[0, 0, t * block:q_end]).max()),
                     "mask_all_finite": bool(np.isfinite(masked_all).all())})
    return rows


def nan_tiles():
    print("Nq = Nk = 32, d = 8, BLOCK_M = BLOCK_N = 8, float32, causal; keys after the tile's")
    print("last visible K/V tile are NaN; rows of that Q tile from numba_flash.forward:")
    print(f"{'Q tile':>6s} {'NaN keys':>8s} {'finite':>6s} {'max |o - ref(clean)|':>21s} "
          f"{'load all + mask: finite':>24s}")
    for r in nan_tile_rows():
        print(f"{r['tile']:6d} {r['nan_keys']:8d} {str(r['finite']):>6s} {r['err']:21.1e} "
              f"{str(r['mask_all_finite']):>24s}")


def empty_rows_case(seed=2):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, 1, 6, 4)).astype(np.float32)
    k = rng.standard_normal((1, 1, 3, 4)).astype(np.float32)
    v = rng.standard_normal((1, 1, 3, 4)).astype(np.float32)
    o, lse = nf.forward(q, k, v, causal=True, return_lse=True)
    ro, rlse = ref.attention(q, k, v, causal=True)
    return o[0, 0], lse[0, 0], float(np.abs(o - ro).max())


def empty_rows():
    o, lse, err = empty_rows_case()
    print("Nq = 6, Nk = 3, causal: query i sees keys j <= i - 3")
    print(f"{'query':>5s} {'keys seen':>9s} {'lse':>8s}  o")
    for i in range(6):
        seen = max(0, min(3, i - 3 + 1))
        print(f"{i:5d} {seen:9d} {lse[i]:8.3f}  {' '.join(f'{x:7.3f}' for x in o[i])}")
    print(f"max |o - reference| = {err:.1e}")


if __name__ == "__main__":
    {"alignment": alignment, "kinds": kinds, "nan-tiles": nan_tiles,
     "empty-rows": empty_rows}[sys.argv[1]]()
