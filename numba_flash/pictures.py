"""Pictures for the docs, drawn with matplotlib (optional extra: ``pip install numba_flash[pictures]``).

``python -m numba_flash.pictures --out docs/img`` (or :func:`draw_all`) writes:

* ``causal_tiles.png``: which (Q tile, K/V tile) pairs a causal forward skips, computes without a
  mask, or masks (tiles crossing the diagonal), for Nq == Nk and for Nq != Nk with the
  bottom-right alignment of :func:`numba_flash.reference.causal_visible`;
* ``paged_block_table.png``: a paged decode batch: each sequence's logical token blocks and the
  physical cache blocks its block-table row points to;
* ``split_kv.png``: FlashDecoding: one query's keys split into partitions, each giving
  ``(o_p, lse_p)``, merged with the log-sum-exp rule of :func:`numba_flash.reference.merge_states`.

The tile classification comes from :func:`tile_kinds`, the same rule as
:func:`numba_flash.reference.blocked_attention`'s loop (tested in tests/docs).
"""

from __future__ import annotations

import argparse
import os

import numpy as np

SKIPPED, FULL, DIAGONAL = 0, 1, 2
_COLORS = {SKIPPED: "#e8e8e8", FULL: "#4c78a8", DIAGONAL: "#f58518"}
_LABELS = {SKIPPED: "skipped (above the diagonal)", FULL: "full tile, no mask",
           DIAGONAL: "crosses the diagonal: masked"}


def tile_kinds(nq, nk, block_m, block_n):
    """``[ceil(nq/block_m), ceil(nk/block_n)]`` array of SKIPPED / FULL / DIAGONAL (causal)."""
    offset = nk - nq  # query i sees key j iff j <= i + offset
    tm, tn = -(-nq // block_m), -(-nk // block_n)
    kinds = np.empty((tm, tn), int)
    for i in range(tm):
        q_start, q_end = i * block_m, min(nq, (i + 1) * block_m)
        for j in range(tn):
            k_start, k_end = j * block_n, min(nk, (j + 1) * block_n)
            if k_start > q_end - 1 + offset:
                kinds[i, j] = SKIPPED
            elif k_end - 1 <= q_start + offset:
                kinds[i, j] = FULL
            else:
                kinds[i, j] = DIAGONAL
    return kinds


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tile_panel(ax, nq, nk, block_m, block_n):
    from matplotlib.patches import Patch, Rectangle

    kinds = tile_kinds(nq, nk, block_m, block_n)
    for i in range(kinds.shape[0]):
        for j in range(kinds.shape[1]):
            x0, y0 = j * block_n, i * block_m
            w, h = min(nk, x0 + block_n) - x0, min(nq, y0 + block_m) - y0
            ax.add_patch(Rectangle((x0, y0), w, h, facecolor=_COLORS[kinds[i, j]],
                                   edgecolor="white", linewidth=2))
    # the diagonal j = i + (nk - nq): the last key each query row sees
    i = np.array([0, nq])
    ax.plot(i + nk - nq, i, color="black", linewidth=1.5, label="last visible key j = i + Nk - Nq")
    for i in range(kinds.shape[0]):
        ax.text(1.02 * nk, i * block_m + min(block_m, nq - i * block_m) / 2,
                f"block ({i}, bh)", ha="left", va="center", fontsize=9)
    ax.set_xlim(0, nk)
    ax.set_ylim(nq, 0)
    ax.set_aspect("equal")
    ax.set_xlabel("key position j  (K/V tiles of BLOCK_N)")
    ax.set_ylabel("query position i")
    ax.set_title(f"Nq={nq}, Nk={nk}, BLOCK_M={block_m}, BLOCK_N={block_n}", fontsize=10)
    return [Patch(facecolor=_COLORS[k], label=_LABELS[k]) for k in (FULL, DIAGONAL, SKIPPED)]


def draw_causal_tiles(path):
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5.2), gridspec_kw={"width_ratios": [1, 1.3]})
    handles = _tile_panel(axes[0], 256, 256, 64, 64)
    _tile_panel(axes[1], 160, 320, 64, 64)
    line = axes[0].get_lines()[0]
    fig.legend(handles + [line], [h.get_label() for h in handles] + [line.get_label()],
               loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle("Causal forward: each row of tiles is one thread block (grid x), walking its "
                 "K/V tiles left to right", fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_paged_block_table(path):
    from matplotlib.patches import FancyArrowPatch, Rectangle

    plt = _plt()
    block_size = 4
    seqlens = [10, 5, 7]
    block_table = [[6, 2, 9], [4, 7, -1], [0, 5, -1]]  # -1: unused entry
    colors = ["#4c78a8", "#f58518", "#54a24b"]
    n_phys = 10
    fig, ax = plt.subplots(figsize=(12, 5.5))
    phys_x, slot_w = 8.0, 0.55
    # physical blocks: a column of n_phys rows of block_size slots
    owner = {}
    for b, row in enumerate(block_table):
        for lb, pb in enumerate(row):
            if pb >= 0:
                owner[pb] = (b, lb)
    for pb in range(n_phys):
        y = n_phys - 1 - pb
        for s in range(block_size):
            used = pb in owner and owner[pb][1] * block_size + s < seqlens[owner[pb][0]]
            color = colors[owner[pb][0]] if used else "#e8e8e8"
            ax.add_patch(Rectangle((phys_x + s * slot_w, y * 0.55), slot_w * 0.92, 0.45,
                                   facecolor=color, edgecolor="black", linewidth=0.5))
        ax.text(phys_x - 0.15, y * 0.55 + 0.22, f"phys {pb}", ha="right", va="center", fontsize=8)
    ax.text(phys_x + 2 * slot_w * 0.95, n_phys * 0.55 + 0.15,
            "k_cache / v_cache [num_blocks, Hkv, block_size, d]", ha="center", fontsize=9)
    # logical tokens per sequence, grouped in logical blocks
    for b, (n, row) in enumerate(zip(seqlens, block_table)):
        y0 = 4.3 - b * 1.8
        ax.text(0.0, y0 + 0.65, f"sequence {b}: cache_seqlens[{b}] = {n}, "
                f"block_table[{b}] = {row}", fontsize=9)
        for t in range(n):
            lb, s = divmod(t, block_size)
            x = t * 0.55 + lb * 0.25
            ax.add_patch(Rectangle((x, y0), 0.5, 0.45, facecolor=colors[b], edgecolor="black",
                                   linewidth=0.5))
            ax.text(x + 0.25, y0 + 0.22, str(t), ha="center", va="center", fontsize=7,
                    color="white")
        for lb in range(-(-n // block_size)):
            pb = row[lb]
            x = (lb * block_size + min(block_size, n - lb * block_size) / 2) * 0.55 + lb * 0.25
            ax.text(x, y0 - 0.25, f"logical {lb} -> phys {pb}", ha="center", va="center",
                    fontsize=7, color=colors[b])
            ax.add_patch(FancyArrowPatch((x, y0 - 0.4), (phys_x - 1.0, (n_phys - 1 - pb) * 0.55 + 0.22),
                                         arrowstyle="-|>", mutation_scale=10, color=colors[b],
                                         linewidth=0.8, alpha=0.6, connectionstyle="arc3,rad=0.05"))
    ax.text(0.0, -0.9, "token t of sequence b lives in physical block block_table[b, t // "
            f"block_size] at slot t % block_size (block_size = {block_size}); grey slots are "
            "free", fontsize=9)
    ax.set_xlim(-0.3, phys_x + block_size * slot_w + 0.3)
    ax.set_ylim(-1.2, n_phys * 0.55 + 0.5)
    ax.axis("off")
    ax.set_title("Paged KV cache: logical tokens to physical blocks through the block table",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_split_kv(path):
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    plt = _plt()
    nk, n_splits = 24, 4
    per = nk // n_splits
    colors = ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]
    fig, ax = plt.subplots(figsize=(12, 4.8))
    ax.add_patch(Rectangle((0, 3.6), 0.5, 0.45, facecolor="#222222"))
    ax.text(0.7, 3.82, "q: one query row (decode)", va="center", fontsize=9)
    for t in range(nk):
        p = t // per
        ax.add_patch(Rectangle((t * 0.45 + p * 0.3, 2.6), 0.4, 0.45, facecolor=colors[p],
                               edgecolor="black", linewidth=0.5))
    ax.text(0, 3.2, f"keys/values 0..{nk - 1}, split into {n_splits} partitions "
            "(one thread block each, in parallel)", fontsize=9)
    for p in range(n_splits):
        cx = (p * per + per / 2) * 0.45 + p * 0.3
        ax.add_patch(FancyBboxPatch((cx - 1.0, 1.2), 2.0, 0.7, boxstyle="round,pad=0.05",
                                    facecolor="white", edgecolor=colors[p]))
        ax.text(cx, 1.55, f"o_{p} = softmax(s_{p}) V_{p}\nlse_{p} = log sum exp(s_{p})",
                ha="center", va="center", fontsize=8)
        ax.add_patch(FancyArrowPatch((cx, 2.55), (cx, 1.95), arrowstyle="-|>",
                                     mutation_scale=10, color=colors[p]))
        ax.add_patch(FancyArrowPatch((cx, 1.15), (6.0, 0.45), arrowstyle="-|>",
                                     mutation_scale=10, color=colors[p]))
    ax.add_patch(FancyBboxPatch((3.3, -0.35), 5.4, 0.75, boxstyle="round,pad=0.05",
                                facecolor="#f4f4f4", edgecolor="black"))
    ax.text(6.0, 0.02, "merge: lse = log sum_p exp(lse_p)\no = sum_p exp(lse_p - lse) o_p",
            ha="center", va="center", fontsize=9)
    ax.set_xlim(-0.3, nk * 0.45 + n_splits * 0.3 + 0.2)
    ax.set_ylim(-0.6, 4.2)
    ax.axis("off")
    ax.set_title("Split-KV decode (FlashDecoding): partial states per partition, then one merge",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PICTURES = {
    "causal_tiles.png": draw_causal_tiles,
    "paged_block_table.png": draw_paged_block_table,
    "split_kv.png": draw_split_kv,
}


def draw_all(outdir):
    """Draw every picture into ``outdir``; return the paths written."""
    os.makedirs(outdir, exist_ok=True)
    paths = []
    for name, draw in PICTURES.items():
        path = os.path.join(outdir, name)
        draw(path)
        paths.append(path)
    return paths


def main(argv=None):
    ap = argparse.ArgumentParser(description="Draw the docs' pictures (needs matplotlib).")
    ap.add_argument("--out", default="docs/img", help="output folder (default docs/img)")
    args = ap.parse_args(argv)
    for path in draw_all(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
