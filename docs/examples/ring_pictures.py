"""The two pictures of docs/ring-attention.md, drawn with matplotlib (the ``pictures`` extra)::

    python docs/examples/ring_pictures.py --out docs/img

* ``ring.png``: four ranks on a ring; in step ``s`` rank ``r`` computes with the K/V shard of
  rank ``r - s`` while passing it on to rank ``r + 1``; beside it the schedule table.
* ``ring_zigzag.png``: the causal (query chunk, key chunk) grid of a sequence cut into 8 chunks,
  each query chunk coloured by the rank that owns it, contiguous vs zig-zag; the bars show the
  work per rank (visible query-key pairs).

The chunk ownership and the per-rank work come from numba_flash.distributed (``rank_chunks``,
``shard_positions``): tests/distributed/test_ring_docs.py checks the numbers drawn here.
"""

from __future__ import annotations

import argparse
import math
import os

import numpy as np

from numba_flash.distributed import rank_chunks, shard_positions

RANK_COLORS = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6",
               "#9d755d"]


def causal_work(world, tokens_per_chunk=4, layout="zigzag"):
    """Visible (query, key) pairs per rank under a causal mask, one entry per rank, for a
    sequence of ``2 * world`` chunks of ``tokens_per_chunk`` tokens (either layout)."""
    n = 2 * world * tokens_per_chunk
    vis = np.tril(np.ones((n, n), bool))
    return [int(vis[shard_positions(r, world, n, layout)].sum()) for r in range(world)]


def schedule(world):
    """``table[r][s]``: the rank whose K/V shard rank ``r`` holds in step ``s``."""
    return [[(r - s) % world for s in range(world)] for r in range(world)]


def draw_ring(path, world=4):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle, FancyArrowPatch

    fig, (ax, axt) = plt.subplots(1, 2, figsize=(11, 4.8), gridspec_kw={"width_ratios": [1, 1.1]})
    ax.set_aspect("equal")
    ax.axis("off")
    radius = 1.0
    pos = [(radius * math.sin(2 * math.pi * r / world), radius * math.cos(2 * math.pi * r / world))
           for r in range(world)]
    for r, (x, y) in enumerate(pos):
        ax.add_patch(Circle((x, y), 0.36, color=RANK_COLORS[r], alpha=0.9, zorder=2))
        a, b = rank_chunks(r, world)
        ax.text(x, y + 0.06, f"rank {r}", ha="center", va="center", fontsize=12, color="white",
                weight="bold", zorder=3)
        ax.text(x, y - 0.1, f"chunks {a}, {b}", ha="center", va="center", fontsize=9,
                color="white", zorder=3)
        nx, ny = pos[(r + 1) % world]
        ax.add_patch(FancyArrowPatch((x, y), (nx, ny), connectionstyle="arc3,rad=-0.25",
                                     arrowstyle="-|>", mutation_scale=22, lw=2, color="#444",
                                     shrinkA=36, shrinkB=36, zorder=1))
    ax.text(0, 0, "K/V shards\nmove to\nrank r + 1\nevery step", ha="center", va="center",
            fontsize=10, color="#444")
    ax.set_xlim(-1.55, 1.55)
    ax.set_ylim(-1.5, 1.5)
    ax.set_title(f"{world} ranks on a ring (zig-zag shards of {2 * world} chunks)", fontsize=11)

    table = schedule(world)
    axt.axis("off")
    cell_text = [[f"K/V of {table[r][s]}" for s in range(world)] for r in range(world)]
    colours = [[RANK_COLORS[table[r][s]] + "55" for s in range(world)] for r in range(world)]
    tab = axt.table(cellText=cell_text, cellColours=colours,
                    rowLabels=[f"rank {r}" for r in range(world)],
                    colLabels=[f"step {s}" for s in range(world)], loc="center", cellLoc="center")
    tab.auto_set_font_size(False)
    tab.set_fontsize(10)
    tab.scale(1, 2.6)
    axt.set_title("step s: rank r computes with the K/V shard of rank r - s\n"
                  "(and sends it on while computing: it travels during the step)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw_zigzag(path, world=4):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    chunks = 2 * world
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.6), gridspec_kw={"width_ratios": [1, 1, 0.9]})
    for ax, layout in zip(axes[:2], ("contiguous", "zigzag")):
        owner = {}
        for r in range(world):
            per = rank_chunks(r, world, layout)
            if layout == "contiguous":  # chunk r of R = chunks 2r, 2r+1 of 2R
                per = (2 * r, 2 * r + 1)
            for i in per:
                owner[i] = r
        for i in range(chunks):  # query chunk i = row i (top to bottom)
            for j in range(chunks):
                y = chunks - 1 - i
                if j > i:
                    ax.add_patch(Rectangle((j, y), 1, 1, fc="#f2f2f2", ec="white"))
                elif j == i:  # the diagonal chunk: a causal (triangular) block
                    ax.add_patch(Rectangle((j, y), 1, 1, fc="#f2f2f2", ec="white"))
                    ax.fill([j, j, j + 1], [y + 1, y, y], color=RANK_COLORS[owner[i]],
                            alpha=0.9, ec="white")
                else:
                    ax.add_patch(Rectangle((j, y), 1, 1, fc=RANK_COLORS[owner[i]], alpha=0.9,
                                           ec="white"))
        ax.set_xlim(0, chunks)
        ax.set_ylim(0, chunks)
        ax.set_aspect("equal")
        ax.set_xticks(np.arange(chunks) + 0.5, [str(j) for j in range(chunks)])
        ax.set_yticks(np.arange(chunks) + 0.5, [str(chunks - 1 - i) for i in range(chunks)])
        ax.set_xlabel("key chunk")
        ax.set_ylabel("query chunk")
        ax.tick_params(length=0)
        held = "; ".join(
            f"r{r}: " + ",".join(str(c) for c in sorted(k for k, v in owner.items() if v == r))
            for r in range(world))
        ax.set_title(f"{layout}\n{held}", fontsize=10)

    axb = axes[2]
    width = 0.38
    for off, layout, hatch in ((-width / 2, "contiguous", "//"), (width / 2, "zigzag", "")):
        work = causal_work(world, 4, layout)
        axb.bar(np.arange(world) + off, work, width, color=RANK_COLORS[:world], hatch=hatch,
                ec="black", label=layout)
    axb.set_xticks(range(world), [f"rank {r}" for r in range(world)])
    axb.set_ylabel("visible (query, key) pairs")
    axb.set_title("causal work per rank\n(hatched: contiguous, plain: zig-zag)", fontsize=10)
    fig.suptitle(f"causal attention over {world} ranks: each query chunk coloured by the rank "
                 "that owns it (triangle: the causal diagonal chunk)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


PICTURES = {"ring.png": draw_ring, "ring_zigzag.png": draw_zigzag}


def draw_all(out):
    os.makedirs(out, exist_ok=True)
    paths = []
    for name, fn in PICTURES.items():
        path = os.path.join(out, name)
        fn(path)
        paths.append(path)
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img")
    for p in draw_all(parser.parse_args().out):
        print(p)
