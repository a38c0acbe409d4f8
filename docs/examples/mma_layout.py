"""The m16n8k16 fragment layout: which lane holds which element of A, B and C.

    python docs/examples/mma_layout.py            # print the table of a few lanes
    python docs/examples/mma_layout.py --png FILE # draw docs/img/mma_fragments.png (matplotlib)

Both come from the layout functions the simulator twin and the tests use
(``numba_flash.kernels.ptx.mma.a_coords`` / ``b_coords`` / ``c_coords``, the PTX ISA's "Matrix
Fragments for mma.m16n8k16" formulas).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # no GPU needed: host functions only

from numba_flash.kernels.ptx.mma import a_coords, b_coords, c_coords  # noqa: E402


def table(lanes=(0, 1, 4, 5, 31)):
    lines = ["lane (g, t)  A registers a0..a3 (row, col) of their two halves       "
             "B b0, b1 (k, n)            C c0..c3 (row, col)"]
    for lane in lanes:
        g, t = lane >> 2, lane % 4
        a = " ".join(f"{a_coords(lane, 2 * r)}{a_coords(lane, 2 * r + 1)}"
                     .replace(" ", "") for r in range(4))
        b = " ".join(f"{b_coords(lane, 2 * r)}{b_coords(lane, 2 * r + 1)}"
                     .replace(" ", "") for r in range(2))
        c = " ".join(f"{c_coords(lane, i)}".replace(" ", "") for i in range(4))
        lines.append(f"{lane:4d} ({g}, {t})  {a}  {b}  {c}")
    return "\n".join(lines)


def draw(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cmap = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 3, figsize=(19, 8.2),
                             gridspec_kw={"width_ratios": [16, 8, 8], "wspace": 0.12})
    panels = [
        ("A  16 x 16 float16 (row-major: .row)", 16, 16, 8, a_coords, "a"),
        ("B  16 x 8 float16 (k x n, read per column: .col)", 16, 8, 4, b_coords, "b"),
        ("C, D  16 x 8 float32", 16, 8, 4, c_coords, "c"),
    ]
    for ax, (title, rows, cols, per_lane, coords, name) in zip(axes, panels):
        for lane in range(32):
            t = lane % 4
            for i in range(per_lane):
                r, c = coords(lane, i)
                ax.add_patch(Rectangle((c, r), 1, 1, facecolor=cmap(t), alpha=0.25 + 0.1 * (
                    (lane >> 2) % 2), edgecolor="white", lw=1.5))
                reg = i // 2 if name in "ab" else i
                label = f"T{lane}\n{name}{reg}" if name in "ab" else f"T{lane}\nc{i}"
                ax.text(c + 0.5, r + 0.5, label, ha="center", va="center", fontsize=6.3)
        ax.set_xlim(0, cols)
        ax.set_ylim(rows, 0)
        ax.set_aspect("equal")
        ax.set_xticks([x + 0.5 for x in range(cols)], [str(x) for x in range(cols)], fontsize=7)
        ax.set_yticks([y + 0.5 for y in range(rows)], [str(y) for y in range(rows)], fontsize=7)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("column" if name != "b" else "n (column)", fontsize=9)
        ax.set_ylabel("row" if name != "b" else "k (row)", fontsize=9)
        ax.tick_params(length=0)
    handles = [Rectangle((0, 0), 1, 1, facecolor=cmap(t), alpha=0.35) for t in range(4)]
    fig.legend(handles, [f"threadID_in_group t = lane % 4 = {t}" for t in range(4)],
               loc="lower center", ncol=4, fontsize=9, frameon=False)
    fig.suptitle("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32: lane T holds the marked "
                 "elements (register a_i / b_i packs two float16, low half first; "
                 "g = lane >> 2)", fontsize=11)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--png", help="draw the picture into this file")
    args = ap.parse_args(argv)
    if args.png:
        print(draw(args.png))
    else:
        print(table())


if __name__ == "__main__":
    main()
