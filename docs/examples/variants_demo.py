"""The variants page's numbers and picture: the visible band of causal, sliding-window and
variable-length attention, how the forward classifies its tiles from it, what a window costs,
and the kernel against the float64 reference for every variant.

``docs/variants.md`` quotes the output of::

    python docs/examples/variants_demo.py band       # who sees whom: causal, windows, varlen
    python docs/examples/variants_demo.py tiles      # tile kinds per (Q tile, K/V tile)
    python docs/examples/variants_demo.py cost       # K/V tiles loaded: grow with the window
    python docs/examples/variants_demo.py accuracy   # forward / forward_varlen vs the reference
    python docs/examples/variants_demo.py draw docs/img/variants.png   # the picture (matplotlib)

``tests/docs/test_variants_demo.py`` checks every claim printed here.
"""

from __future__ import annotations

import sys

import numpy as np

import numba_flash as nf
from numba_flash import reference as ref
from numba_flash.kernels.mainloop.visibility import (
    tile_full_range_py, tile_key_range_py, tile_needs_mask_py, window_bounds,
)

SKIPPED, FULL, MASKED = ".", "F", "M"

#: the band examples: (title, causal, window_size)
BANDS = [("causal", True, (-1, -1)),
         ("sliding window (3, 0)", False, (3, 0)),
         ("window (2, 2)", False, (2, 2)),
         ("causal, Nq < Nk", True, (-1, -1))]


# [docs:variants-tile-kinds]
def tile_kinds(nq, nk, block_m, block_n, causal=False, window_size=(-1, -1)):
    """The forward kernel's classification of every (Q tile, K/V tile): the loop of
    ``kernels/forward/simt.py`` run on the host with the visibility module's twins."""
    left, right = window_bounds(causal, window_size)
    offset = nk - nq
    n_qt, n_kt = -(-nq // block_m), -(-nk // block_n)
    kinds = np.full((n_qt, n_kt), SKIPPED)
    for qt in range(n_qt):
        q_start, q_end = qt * block_m, min(nq, (qt + 1) * block_m)
        kv_lo, kv_hi = tile_key_range_py(q_start, q_end, offset, nk, left, right)
        full_lo, full_hi = tile_full_range_py(q_start, q_end, offset, nk, left, right)
        if kv_hi <= kv_lo:
            continue  # no row of this Q tile sees any key: nothing is loaded
        for kt in range(kv_lo // block_n, -(-kv_hi // block_n)):
            k_start = kt * block_n
            masked = tile_needs_mask_py(k_start, k_start + block_n, full_lo, full_hi)
            kinds[qt, kt] = MASKED if masked else FULL
    return kinds
# [/docs:variants-tile-kinds]


def exact_kinds(vis, block_m, block_n):
    """What each tile holds according to the reference mask: no visible key, all, some."""
    n_qt, n_kt = -(-vis.shape[0] // block_m), -(-vis.shape[1] // block_n)
    kinds = np.full((n_qt, n_kt), SKIPPED)
    for qt in range(n_qt):
        for kt in range(n_kt):
            tile = vis[qt * block_m:(qt + 1) * block_m, kt * block_n:(kt + 1) * block_n]
            full = tile.all() and tile.shape[1] == block_n
            kinds[qt, kt] = FULL if full else MASKED if tile.any() else SKIPPED
    return kinds


def packed_mask(lens_q, lens_k, causal=False, window_size=(-1, -1)):
    """Boolean ``[total_q, total_k]``: who sees whom in a packed varlen batch (block diagonal,
    each block with its own bottom-right alignment)."""
    vis = np.zeros((sum(lens_q), sum(lens_k)), bool)
    q0 = k0 = 0
    for nq, nk in zip(lens_q, lens_k):
        vis[q0:q0 + nq, k0:k0 + nk] = ref.visible_mask(nq, nk, causal=causal,
                                                       window_size=window_size)
        q0, k0 = q0 + nq, k0 + nk
    return vis


def show(mask):
    return ["".join("#" if x else "." for x in row) for row in mask]


# -- band --------------------------------------------------------------------------------------
def band():
    panels = []
    for title, causal, window in BANDS:
        nq, nk = (6, 10) if "Nq < Nk" in title else (8, 8)
        panels.append((f"{title} [{nq} x {nk}]",
                       show(ref.visible_mask(nq, nk, causal=causal, window_size=window))))
    panels.append(("varlen causal, lengths 3, 4, 2 [9 x 9]",
                   show(packed_mask([3, 4, 2], [3, 4, 2], causal=True))))
    for title, rows in panels:
        print(title)
        for r in rows:
            print("  " + r)


# -- tiles -------------------------------------------------------------------------------------
TILE_CASES = [("causal", 32, 32, True, (-1, -1)),
              ("window (11, 0)", 32, 32, False, (11, 0)),
              ("window (4, 4)", 32, 32, False, (4, 4)),
              ("causal, Nq = 20 < Nk = 36", 20, 36, True, (-1, -1))]


def tiles_rows(block=4):
    rows = []
    for title, nq, nk, causal, window in TILE_CASES:
        kinds = tile_kinds(nq, nk, block, block, causal, window)
        vis = ref.visible_mask(nq, nk, causal=causal, window_size=window)
        rows.append({"title": title, "kinds": kinds, "exact": exact_kinds(vis, block, block),
                     "loaded": int((kinds != SKIPPED).sum()), "total": kinds.size})
    return rows


def tiles():
    print("tiles of 4 x 4 (F: loaded, no mask; M: loaded, masked per key; .: never loaded)")
    for r in tiles_rows():
        print(f"{r['title']}: {r['loaded']} of {r['total']} tiles loaded")
        for line in r["kinds"]:
            print("  " + "".join(line))


# -- cost --------------------------------------------------------------------------------------
def cost_rows(block_m=64, block_n=32):
    """K/V tiles the forward loads in total for a sliding window (W - 1, 0), with the GPU float32
    tiles at head dim 64: the work per query stays ~(W + BLOCK_M) / BLOCK_N tiles for every N."""
    rows = []
    for w in (128, 512):
        for n in (1024, 4096, 16384):
            kinds = tile_kinds(n, n, block_m, block_n, False, (w - 1, 0))
            loaded = int((kinds != SKIPPED).sum())
            causal_loaded = int((tile_kinds(n, n, block_m, block_n, True) != SKIPPED).sum())
            rows.append({"window": w, "N": n, "loaded": loaded,
                         "per_q_tile": loaded / kinds.shape[0], "causal_loaded": causal_loaded})
    return rows


def cost():
    print("sliding window (W - 1, 0), Nq = Nk = N, tiles 64 x 32: K/V tiles loaded")
    print(f"{'W':>5s} {'N':>6s} {'loaded':>8s} {'per Q tile':>10s} {'causal loads':>12s}")
    for r in cost_rows():
        print(f"{r['window']:5d} {r['N']:6d} {r['loaded']:8d} {r['per_q_tile']:10.2f} "
              f"{r['causal_loaded']:12d}")


# -- accuracy ----------------------------------------------------------------------------------
VARIANTS = [("causal", dict(causal=True)),
            ("window (5, 2)", dict(window_size=(5, 2))),
            ("softcap 2", dict(softcap=2.0)),
            ("ALiBi", dict(alibi_slopes=ref.alibi_slopes(4))),
            ("all of them", dict(causal=True, window_size=(6, -1), softcap=2.0,
                                 alibi_slopes=ref.alibi_slopes(4)))]


def accuracy_rows(seed=0):
    rng = np.random.default_rng(seed)
    b, h, hkv, nq, nk, d = 1, 4, 2, 19, 23, 8
    q = rng.standard_normal((b, h, nq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, nk, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, nk, d)).astype(np.float32)
    rows = []
    for name, kw in VARIANTS:
        o, lse = nf.forward(q, k, v, return_lse=True, **kw)
        ro, rlse = ref.attention(q, k, v, **kw)
        rows.append({"call": "forward", "variant": name, "o_err": float(np.abs(o - ro).max()),
                     "lse_err": float(np.abs(lse - rlse).max())})
    lens_q, lens_k = [5, 0, 9, 3], [7, 2, 9, 12]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    qp = rng.standard_normal((int(cu_q[-1]), h, d)).astype(np.float32)
    kp = rng.standard_normal((int(cu_k[-1]), hkv, d)).astype(np.float32)
    vp = rng.standard_normal((int(cu_k[-1]), hkv, d)).astype(np.float32)
    for name, kw in VARIANTS[::4]:
        o, lse = nf.forward_varlen(qp, kp, vp, cu_q, cu_k, max_seqlen_q=9, max_seqlen_k=12,
                                   return_lse=True, **kw)
        ro, rlse = ref.attention_varlen(qp, kp, vp, cu_q, cu_k, **kw)
        rows.append({"call": "forward_varlen", "variant": name,
                     "o_err": float(np.abs(o - ro).max()),
                     "lse_err": float(np.abs(lse - rlse).max())})
    return rows


def accuracy():
    print("float32, simulator tiles 8 x 8; forward: B, H, Hkv, Nq, Nk, d = 1, 4, 2, 19, 23, 8;"
          " varlen: lengths q 5, 0, 9, 3 and k 7, 2, 9, 12")
    print(f"{'call':>15s} {'variant':>12s} {'max |o - ref|':>14s} {'max |lse - ref|':>16s}")
    for r in accuracy_rows():
        print(f"{r['call']:>15s} {r['variant']:>12s} {r['o_err']:14.1e} {r['lse_err']:16.1e}")


# -- the picture -------------------------------------------------------------------------------
def draw(path):
    """Visible keys (dark) with the 4 x 4 tile grid coloured by kind, for causal, a sliding
    window and a packed varlen batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    block = 4
    lens = [7, 12, 5]
    panels = [("causal, Nq = Nk = 24", ref.visible_mask(24, 24, causal=True),
               tile_kinds(24, 24, block, block, True)),
              ("sliding window (9, 0), Nq = Nk = 24",
               ref.visible_mask(24, 24, window_size=(9, 0)),
               tile_kinds(24, 24, block, block, False, (9, 0))),
              ("varlen causal, lengths 7, 12, 5 (packed)", packed_mask(lens, lens, causal=True),
               None)]
    colors = {FULL: "#4c78a8", MASKED: "#f58518"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 5.0))
    for ax, (title, vis, kinds) in zip(axes, panels):
        ax.imshow(vis, cmap="Greys", vmin=0, vmax=1.6, interpolation="nearest")
        if kinds is not None:
            for qt in range(kinds.shape[0]):
                for kt in range(kinds.shape[1]):
                    if kinds[qt, kt] != SKIPPED:
                        ax.add_patch(Rectangle((kt * block - 0.5, qt * block - 0.5), block,
                                               block, fill=True, alpha=0.35, linewidth=1,
                                               color=colors[kinds[qt, kt]]))
        else:  # varlen: each sequence is its own little causal problem on the diagonal
            start = 0
            for n in lens:
                ax.add_patch(Rectangle((start - 0.5, start - 0.5), n, n, fill=False,
                                       linewidth=2, edgecolor="#54a24b"))
                start += n
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("key j")
        ax.set_ylabel("query i")
    axes[0].legend(handles=[Patch(color=colors[FULL], alpha=0.5, label="tile loaded, no mask"),
                            Patch(color=colors[MASKED], alpha=0.5,
                                  label="tile loaded, masked per key"),
                            Patch(facecolor="white", edgecolor="grey",
                                  label="tile never loaded")],
                   loc="lower left", fontsize=8)
    fig.suptitle("Visible keys (dark) and the forward's 4 x 4 tiles", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "draw":
        draw(sys.argv[2])
    else:
        {"band": band, "tiles": tiles, "cost": cost, "accuracy": accuracy}[cmd]()
