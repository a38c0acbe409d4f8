"""Pictures for the docs, drawn with matplotlib (``pip install '.[pictures]'`` in the clone).

``python -m numba_flash.tools.pictures --out docs/img`` (or :func:`draw_all`) writes:

* ``causal_tiles.png``: which (Q tile, K/V tile) pairs a causal forward skips, computes without a
  mask, or masks (tiles crossing the diagonal), for Nq == Nk and for Nq != Nk with the
  bottom-right alignment of :func:`numba_flash.reference.causal_visible`;
* ``paged_block_table.png``: a paged decode batch: each sequence's logical token blocks, its
  block-table row, and the physical slots with the token each holds (stale slots hatched);
* ``split_kv.png``: FlashDecoding: one query's keys split into partitions (one of them past the
  context, so empty), each giving ``(o_p, lse_p)``, merged with the log-sum-exp rule of
  :func:`numba_flash.reference.merge_states`;
* ``backward_loops.png``: the backward's loop layout: K/V tiles outer (one block each, dK and dV
  on chip), Q tiles inner, dQ accumulated in HBM;
* ``tile_ownership.png``: the tiled forward's thread layout (which thread owns which S and acc
  elements) and its barriers, read from ``numba_flash.kernels.forward.simt``;
* ``roofline.png``: measured kernels against the H200's copy bandwidth and compute peaks (data in
  :data:`ROOFLINE`);
* for docs/cuda-basics.md: ``grid_block_thread.png`` (a grid of blocks of threads over an array,
  :func:`thread_index`), ``warps_lanes.png`` (a block's threads as warps and lanes),
  ``memory_hierarchy.png`` (HBM, L2, shared memory, registers and where the tiled forward keeps
  each array of a tile), ``tree_reduction.png`` (the shared-memory tree of ``row_max``,
  :func:`tree_levels`) and ``smem_banks.png`` (a column of a ``[32][32]`` and a ``[32][33]``
  float32 tile over the 32 banks, :func:`bank_of`);
* ``loop_order.png``: the FlashAttention-1 (K/V outer) and -2 (Q outer) forward loop orders and
  what each reads and writes in HBM per step, for docs/loop-order.md;
* for docs/memory-access.md, drawn from requests recorded in the simulator
  (:mod:`numba_flash.tools.memory_profile`): ``memory_coalescing.png`` (a warp's float32 row
  load and column load over 128-byte lines and 32-byte sectors, :func:`_sector_panel`) and
  ``memory_banks.png`` (a tile's column read without and with an XOR swizzle, ``ldmatrix`` on
  plain and swizzled 128-byte rows, on the 32 banks: :func:`bank_cells`).

The tile classification comes from :func:`tile_kinds`, the same rule as
:func:`numba_flash.reference.blocked_attention`'s loop (tested in tests/docs).
"""

from __future__ import annotations

import argparse
import os
from typing import NamedTuple

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


def _save(fig, path, dpi=110, rect=None):
    """Lay ``fig`` out (``rect``: the part of the figure its axes may fill, leaving room for a
    suptitle or a legend), write it to ``path`` and close it."""
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)


def _finish(fig, ax, path, xlim, ylim, title, fontsize=10, dpi=110):
    """The end of a one-panel diagram: its ranges, no axes (a drawing, not a plot), its title;
    then :func:`_save`."""
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis("off")
    ax.set_title(title, fontsize=fontsize)
    _save(fig, path, dpi)


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
    _save(fig, path, rect=(0, 0.07, 1, 0.95))


def draw_paged_block_table(path):
    from matplotlib.patches import Rectangle

    plt = _plt()
    block_size = 4
    seqlens = [10, 5, 7]
    block_table = [[6, 2, 9], [4, 7, -1], [0, 5, -1]]  # -1: unused entry
    colors = ["#4c78a8", "#f58518", "#54a24b"]
    n_phys = 10
    stale_color = "#d9d9d9"
    fig, ax = plt.subplots(figsize=(12, 6.2))
    cw, ch = 0.62, 0.5  # one token slot

    # -- left: each sequence's tokens in logical blocks (token numbers), with its table row
    for b, (n, row) in enumerate(zip(seqlens, block_table)):
        y0 = 4.9 - b * 2.05
        ax.text(0.0, y0 + 0.75, f"sequence {b}: cache_seqlens[{b}] = {n}", fontsize=10,
                color=colors[b], fontweight="bold")
        for t in range(n):
            lb, _ = divmod(t, block_size)
            x = t * cw + lb * 0.3
            ax.add_patch(Rectangle((x, y0), cw * 0.92, ch * 0.9, facecolor=colors[b],
                                   edgecolor="black", linewidth=0.5))
            ax.text(x + cw * 0.46, y0 + ch * 0.45, str(t), ha="center", va="center", fontsize=9,
                    color="white", fontweight="bold")
        for lb in range(-(-n // block_size)):
            x = lb * (block_size * cw + 0.3) + block_size * cw / 2
            ax.text(x, y0 - 0.28, f"logical {lb}", ha="center", va="center", fontsize=8)
        # the table row, as an array of cells
        tx = 9.9
        ax.text(tx - 0.15, y0 + ch * 0.45, f"block_table[{b}] =", ha="right", va="center",
                fontsize=9)
        for lb, pb in enumerate(row):
            live = lb < -(-n // block_size)
            ax.add_patch(Rectangle((tx + lb * 0.62, y0), 0.58, ch * 0.9,
                                   facecolor=colors[b] if live else "white",
                                   edgecolor="black", linewidth=0.6))
            ax.text(tx + lb * 0.62 + 0.29, y0 + ch * 0.45, str(pb), ha="center", va="center",
                    fontsize=10, color="white" if live else "black", fontweight="bold")

    # -- right: the physical cache; each slot shows which token it holds
    px = 13.6
    holder = {}
    for b, row in enumerate(block_table):
        for lb, pb in enumerate(row):
            if pb >= 0:
                holder[pb] = (b, lb)
    ax.text(px + block_size * cw / 2, n_phys * 0.62 + 0.25,
            "k_cache / v_cache [num_blocks, Hkv, block_size, d]", ha="center", fontsize=9)
    for pb in range(n_phys):
        y = (n_phys - 1 - pb) * 0.62
        ax.text(px - 0.12, y + ch * 0.45, f"phys {pb}", ha="right", va="center", fontsize=9)
        for slot in range(block_size):
            x = px + slot * cw
            if pb in holder and holder[pb][1] * block_size + slot < seqlens[holder[pb][0]]:
                b, lb = holder[pb]
                ax.add_patch(Rectangle((x, y), cw * 0.92, ch * 0.9, facecolor=colors[b],
                                       edgecolor="black", linewidth=0.5))
                ax.text(x + cw * 0.46, y + ch * 0.45, str(lb * block_size + slot), ha="center",
                        va="center", fontsize=9, color="white", fontweight="bold")
            else:
                ax.add_patch(Rectangle((x, y), cw * 0.92, ch * 0.9, facecolor=stale_color,
                                       edgecolor="black", linewidth=0.5, hatch="///"))
        if pb in holder:
            b, lb = holder[pb]
            note = f"seq {b}, logical {lb}"
            n_live = min(block_size, seqlens[b] - lb * block_size)
            if n_live < block_size:
                note += f" ({block_size - n_live} stale)"
            ax.text(px + block_size * cw + 0.1, y + ch * 0.45, note, va="center", fontsize=8,
                    color=colors[b])
        else:
            ax.text(px + block_size * cw + 0.1, y + ch * 0.45, "not in any live table entry",
                    va="center", fontsize=8, color="#555555")
    ax.add_patch(Rectangle((0.0, -1.25), cw * 0.92, ch * 0.9, facecolor=stale_color,
                           edgecolor="black", linewidth=0.5, hatch="///"))
    ax.text(cw + 0.1, -1.03, "stale slot: holds whatever an earlier request left (or was never "
            "written); the kernel must not use it", va="center", fontsize=9)
    ax.text(0.0, -1.75, f"token t of sequence b lives in physical block block_table[b, t // "
            f"{block_size}] at slot t % {block_size}; white table cells (-1) are past the "
            "sequence's end and never read", fontsize=9)
    _finish(fig, ax, path, (-0.2, px + block_size * cw + 2.6), (-2.0, n_phys * 0.62 + 0.5),
            "Paged KV cache: logical tokens, the block table, and the physical slots that "
            "hold them (block_size = 4)", fontsize=11, dpi=100)


def draw_split_kv(path):
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    plt = _plt()
    context, per, n_splits = 15, 5, 4  # the fourth split starts past the end: it is empty
    colors = ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]
    fig, ax = plt.subplots(figsize=(12, 5.6))
    tw, gap = 0.5, 0.45
    split_x = [p * (per * tw + gap) for p in range(n_splits)]
    centers = [x + per * tw / 2 for x in split_x]
    # the query, above everything, connected to every split
    qx, qy = centers[0] + (centers[-1] - centers[0]) / 2, 5.0
    ax.add_patch(Rectangle((qx - 0.6, qy), 1.2, 0.45, facecolor="#222222"))
    ax.text(qx, qy + 0.22, "q", ha="center", va="center", color="white", fontsize=11,
            fontweight="bold")
    ax.text(qx + 0.8, qy + 0.22, "one query row (decode): every split computes q . k_j for its "
            "own keys", va="center", fontsize=9)
    for p in range(n_splits):
        ax.add_patch(FancyArrowPatch((qx, qy - 0.02), (centers[p], 4.05), arrowstyle="-|>",
                                     mutation_scale=12, color=colors[p], linewidth=1.2))
    # keys per split (token numbers); the empty split draws its slots dashed
    for p in range(n_splits):
        label = (f"split {p}" if p * per < context else
                 f"split {p}: keys {p * per}..{p * per + per - 1}, past the context")
        ax.text(centers[p], 3.65, label, ha="center", va="bottom", fontsize=9,
                color=colors[p], fontweight="bold")
        for i in range(per):
            t = p * per + i
            x = split_x[p] + i * tw
            if t < context:
                ax.add_patch(Rectangle((x, 3.1), tw * 0.9, 0.45, facecolor=colors[p],
                                       edgecolor="black", linewidth=0.5))
                ax.text(x + tw * 0.45, 3.32, str(t), ha="center", va="center", fontsize=8,
                        color="white")
            else:
                ax.add_patch(Rectangle((x, 3.1), tw * 0.9, 0.45, facecolor="white",
                                       edgecolor=colors[p], linewidth=0.8, linestyle="--"))
    # partial states
    for p in range(n_splits):
        empty = p * per >= context
        text = ("no key: writes lse_3 = -inf only\n(o_3 never written; skipped)" if empty else
                f"o_{p} = softmax(s_{p}) V_{p}\nlse_{p} = log sum exp(s_{p})")
        ax.add_patch(FancyBboxPatch((centers[p] - 1.15, 1.45), 2.3, 0.8,
                                    boxstyle="round,pad=0.05",
                                    facecolor="#f7f7f7" if empty else "white",
                                    edgecolor=colors[p], linestyle="--" if empty else "-"))
        ax.text(centers[p], 1.85, text, ha="center", va="center", fontsize=8.5)
        ax.add_patch(FancyArrowPatch((centers[p], 3.05), (centers[p], 2.32), arrowstyle="-|>",
                                     mutation_scale=10, color=colors[p]))
        ax.add_patch(FancyArrowPatch((centers[p], 1.4), (qx, 0.62), arrowstyle="-|>",
                                     mutation_scale=10, color=colors[p],
                                     linestyle="--" if empty else "-"))
    ax.add_patch(FancyBboxPatch((qx - 3.6, -0.2), 7.2, 0.8, boxstyle="round,pad=0.05",
                                facecolor="#f4f4f4", edgecolor="black"))
    ax.text(qx, 0.2, "merge (the last split block to finish, in split order): m = max_p lse_p,  "
            "w_p = exp(lse_p - m)"
            "\no = sum_p w_p o_p / sum_p w_p,   lse = m + log sum_p w_p   (empty parts skipped)",
            ha="center", va="center", fontsize=9)
    _finish(fig, ax, path, (-0.4, split_x[-1] + per * tw + 0.4), (-0.5, 5.7),
            f"Split-KV decode (FlashDecoding): {n_splits} splits of {per} keys over a "
            f"context of {context}; one thread block per split, then one merge", fontsize=11,
            dpi=100)


def draw_backward_loops(path):
    """The backward's loop layout: one thread block per K/V tile (grid), Q tiles inner."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    plt = _plt()
    tr, tc, j = 4, 4, 1  # Q tiles, K/V tiles, the block drawn in detail
    fig, ax = plt.subplots(figsize=(12, 5.8))
    x0, y0, w, h = 2.4, 0.9, 1.1, 0.9  # the S/P tile grid: rows = Q tiles, columns = K/V tiles
    top = y0 + tr * h
    for jj in range(tc):
        ax.text(x0 + jj * w + w / 2, top + 0.5, f"K_{jj}, V_{jj}", ha="center", fontsize=9)
        ax.text(x0 + jj * w + w / 2, top + 0.2, f"block {jj}", ha="center", fontsize=8,
                color="#4c78a8" if jj == j else "#777777")
    for i in range(tr):
        y = top - (i + 1) * h
        ax.text(x0 - 0.15, y + h / 2, f"Q_{i}, dO_{i},\nlse_{i}, D_{i}", ha="right",
                va="center", fontsize=8.5)
        for jj in range(tc):
            mine = jj == j
            ax.add_patch(Rectangle((x0 + jj * w, y), w * 0.95, h * 0.93,
                                   facecolor="#c6dbef" if mine else "#f0f0f0",
                                   edgecolor="#4c78a8" if mine else "#bbbbbb"))
            if mine:
                ax.text(x0 + jj * w + w / 2, y + h / 2, f"S, P, dP, dS\n(i={i}, step {i + 1})",
                        ha="center", va="center", fontsize=7.5)
    # the inner loop: down the column
    cx = x0 + j * w + w * 0.95 + 0.1
    ax.add_patch(FancyArrowPatch((cx, top - 0.1), (cx, y0 + 0.1), arrowstyle="-|>",
                                 mutation_scale=14, color="#4c78a8", linewidth=1.6))
    ax.text(cx + 0.08, y0 - 0.05, "inner loop:\nQ tiles i = 0, 1, ...", fontsize=8.5,
            color="#4c78a8", va="top")
    ax.text(x0 + tc * w / 2, top + 0.85,
            "grid: one thread block per K/V tile (x batch x query head)",
            ha="center", fontsize=10, fontweight="bold")
    # on chip: dK_j, dV_j
    ax.add_patch(FancyBboxPatch((0.3, -0.75), 5.6, 0.9, boxstyle="round,pad=0.05",
                                facecolor="#e5f5e0", edgecolor="#54a24b"))
    ax.text(3.1, -0.3, f"block {j} keeps dK_{j}, dV_{j} on chip (registers) for the whole loop:\n"
            f"dV_{j} += P^T dO_i,  dK_{j} += scale dS^T Q_i;  written to HBM once, at the end",
            ha="center", va="center", fontsize=9)
    ax.add_patch(FancyArrowPatch((x0 + j * w + w / 2, y0 - 0.02), (x0 + j * w + w / 2, 0.2),
                                 arrowstyle="-|>", mutation_scale=12, color="#54a24b"))
    # dQ in HBM, accumulated
    qx = 8.2
    ax.text(qx + 0.7, top + 0.5, "dQ (HBM, float32 accumulator)", ha="center", fontsize=9)
    for i in range(tr):
        y = top - (i + 1) * h
        ax.add_patch(Rectangle((qx, y), 1.4, h * 0.93, facecolor="#fdd0a2", edgecolor="#f58518"))
        ax.text(qx + 0.7, y + h / 2, f"dQ_{i}", ha="center", va="center", fontsize=9)
        ax.add_patch(FancyArrowPatch((x0 + j * w + w * 0.95, y + h / 2), (qx - 0.05, y + h / 2),
                                     arrowstyle="-|>", mutation_scale=10, color="#f58518",
                                     connectionstyle="arc3,rad=0.0", linewidth=1.0))
    ax.text(qx + 0.7, y0 - 0.15, "every K/V block adds\nscale dS K_j into dQ_i:\n"
            "atomic adds (or a second,\nQ-outer kernel: deterministic)", ha="center", va="top",
            fontsize=8.5, color="#a0522d")
    ax.text(10.2, top - 0.4, "per (i, j) step:\nS = scale Q_i K_j^T\nP = exp(S - lse_i)\n"
            "dP = dO_i V_j^T\ndS = P (dP - D_i)\n\nD_i = rowsum(dO_i * O_i),\n"
            "from a preprocess kernel", fontsize=8.5, va="top", family="monospace")
    _finish(fig, ax, path, (-0.2, 12.6), (-0.95, top + 1.1),
            "Backward loop layout: K/V tiles outer (the grid), Q tiles inner; dK, dV on "
            "chip, dQ accumulated in HBM", fontsize=11, dpi=100)


def forward_barriers():
    """The comments of the tiled forward's ``cuda.syncthreads()`` calls, in source order: the
    picture's barrier timeline follows the kernel's code."""
    import inspect
    import re

    from ..kernels.forward import simt as forward

    src = inspect.getsource(forward.forward_kernel)
    return re.findall(r"cuda\.syncthreads\(\)\s*#\s*(.+)", src)


def draw_tile_ownership(path, head_dim=64, tx=1, ty=2):
    """Which thread of the tiled forward owns which elements of S and acc (GPU layout of
    ``numba_flash.kernels.forward.simt`` for float32 at ``head_dim``), and its barriers per K/V
    tile."""
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

    from ..kernels.forward import simt as forward

    from ..kernels.forward.config import gpu_tiles, thread_layout

    block_m, block_n, hd = gpu_tiles(head_dim, np.float32)
    t_m, t_n = thread_layout(block_m, block_n, hd)
    plt = _plt()
    fig = plt.figure(figsize=(12, 9))
    ax = fig.add_axes([0.01, 0.36, 0.98, 0.58])
    cell = 0.1
    mine, other = "#f58518", "#e3eaf4"

    def tile(x0, rows, cols, title, chunk=1):
        for r in range(rows):
            for c in range(cols):
                own = r % t_m == ty and (c // chunk) % t_n == tx
                ax.add_patch(Rectangle((x0 + c * cell, (rows - 1 - r) * cell), cell, cell,
                                       facecolor=mine if own else other,
                                       edgecolor="white", linewidth=0.3))
        ax.text(x0 + cols * cell / 2, rows * cell + 0.15, title, ha="center", va="bottom",
                fontsize=9.5, fontweight="bold")
        for r in range(ty, rows, t_m):
            ax.text(x0 - 0.05, (rows - 1 - r) * cell + cell / 2, f"row {r}", ha="right",
                    va="center", fontsize=8, color="#a04d00")
        if chunk == 1:
            cols_text = f"its columns: {tx}, {tx + t_n}, {tx + 2 * t_n}, ... (every {t_n}th)"
        else:
            c0, c1 = tx * chunk, (tx + t_n) * chunk
            cols_text = (f"its columns: {c0}-{c0 + chunk - 1}, {c1}-{c1 + chunk - 1}, ... "
                         f"({chunk}-column chunks)")
        ax.text(x0 + cols * cell / 2, -0.12, cols_text, ha="center", va="top", fontsize=8,
                color="#a04d00")
        return x0 + cols * cell

    x_end = tile(0.7, block_m, block_n,
                 f"S = scale Q K^T\n{block_m} x {block_n} (BLOCK_M x BLOCK_N)")
    x1 = x_end + 1.1
    vw = forward.VEC_BYTES // 4  # float32 columns of one 16-byte chunk
    x_end = tile(x1, block_m, hd, f"acc (becomes O)\n{block_m} x {hd} (BLOCK_M x HEAD_DIM)",
                 chunk=vw)
    note = (f"block = {t_n} x {t_m} = {t_n * t_m} threads\n(tx = 0..{t_n - 1}, ty = 0..{t_m - 1})"
            f"\n\nThread (tx={tx}, ty={ty}), orange,\nowns rows ty, ty + {t_m}, ...\n"
            f"and in them the S columns\ntx, tx + {t_n}, ... and the acc\ncolumns in "
            f"{vw}-column (16-byte)\nchunks tx, tx + {t_n}, ...:\n"
            f"a {block_m // t_m} x {block_n // t_n} S micro-tile and a\n"
            f"{block_m // t_m} x {hd // t_n} acc micro-tile, in registers.\n\n"
            f"16-byte loads: the {t_n} threads\nof a row read one Q chunk\n(a broadcast), "
            f"{t_n} keys' chunks\n(padded rows: {t_n} bank groups)\nor 128 bytes of a V row. "
            "They are\nconsecutive lanes of one warp,\nso a row's max and sum combine\n"
            "by warp shuffles.")
    ax.text(x_end + 0.3, block_m * cell, note, fontsize=8.8, va="top")
    ax.set_xlim(0, x_end + 3.4)
    ax.set_ylim(-0.4, block_m * cell + 0.7)
    ax.set_aspect("equal")
    ax.axis("off")

    # the barrier timeline, from the kernel's own comments
    bx = fig.add_axes([0.02, 0.02, 0.96, 0.30])
    bx.axis("off")
    bx.set_xlim(0, 12)
    bx.set_ylim(0, 3.6)
    # the plain kernel's barriers (the paged build's page_sh barrier is not drawn)
    barriers = [b for b in forward_barriers() if "page_sh" not in b]
    work = ["copy the Q tile (all threads, 16 B each)",
            "copy K_j, then V_j (two cp.async groups); wait for K",
            "S micro-tile in registers, row max by shuffles, P -> p_tile; wait for V",
            "acc += P V_j"]
    steps = []
    for i, text in enumerate(barriers):
        steps.append(("work", work[i] if i < len(work) else "..."))
        steps.append(("barrier", text))
    n = len(steps)
    w = 12 / max(n, 1)
    for i, (kind, text) in enumerate(steps):
        x = i * w
        if kind == "work":
            bx.add_patch(FancyBboxPatch((x + 0.05, 1.3), w - 0.1, 1.1, boxstyle="round,pad=0.02",
                                        facecolor="#e5f5e0", edgecolor="#54a24b"))
            bx.text(x + w / 2, 1.85, _wrap(text, 20), ha="center", va="center", fontsize=8)
        else:
            bx.add_patch(Rectangle((x + w / 2 - 0.04, 1.1), 0.08, 1.5, facecolor="#d62728"))
            bx.text(x + w / 2, 0.95, _wrap("syncthreads: " + text, 24), ha="center", va="top",
                    fontsize=7.5, color="#8b0000")
    if n >= 4:
        bx.add_patch(FancyArrowPatch((n * w - 0.3, 2.7), (2 * w + 0.3, 2.7),
                                     connectionstyle="arc3,rad=0.08", arrowstyle="-|>",
                                     mutation_scale=12, color="#4c78a8"))
        bx.text((n + 2) * w / 2, 3.25, f"per K/V tile: {len(barriers) - 1} barriers, then the "
                "next tile", ha="center", fontsize=9, color="#4c78a8")
        bx.text(w, 3.25, "once", ha="center", fontsize=9, color="#4c78a8")
    fig.suptitle(f"Tiled forward, float32, HEAD_DIM = {hd} (GPU layout of "
                 "numba_flash/kernels/forward/simt.py): who owns what, and every barrier",
                 fontsize=11)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _wrap(text, width):
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


class RooflineKernel(NamedTuple):
    """One kernel's points on the roofline: ours and a peer's measured TFLOP/s."""

    name: str
    intensity: float   # FLOPs per byte of compulsory HBM traffic
    ours: float        # our TFLOP/s
    peer: str          # the peer's name
    theirs: float      # the peer's TFLOP/s


#: What the roofline picture plots: the H200's ceilings and the kernels measured on it
#: (commit 38a7cb7, bench/gpu_check.py; the figures of issues 11-13 and
#: docs/performance.md).  Arithmetic intensity counts compulsory bytes: every input read once,
#: every output written once.
ROOFLINE = {
    "gpu": "NVIDIA H200",
    "copy_GBps": 4165.0,          # measured (read + write) in the same run
    "fp32_fma_TFLOPs": 66.9,      # data sheet: 132 SMs x 128 lanes x 2 FLOP x 1.98 GHz
    "fp16_tensor_TFLOPs": 989.5,  # data sheet, dense
    "kernels": [
        RooflineKernel("forward fp32, d=64, N=4096", 4096 / 4, 13.0, "torch SDPA fp32", 34.9),
        RooflineKernel("forward fp16, d=64, N=4096", 4096 / 2, 13.3, "torch SDPA fp16", 453.0),
        RooflineKernel("backward fp16, d=64, N=4096", 1.25 * 4096 / 2, 10.4, "torch SDPA fp16",
                       220.0),
        # decode: 4 H d ctx FLOPs over 2 Hkv d ctx x 2 bytes = H / Hkv = 4 FLOP/byte;
        # TFLOP/s = GB/s x 4 / 1000 (ours 143 GB/s paged, torch 3920 GB/s contiguous)
        RooflineKernel("decode fp16 paged, 32k, GQA 4", 4.0, 143 * 4 / 1000,
                       "torch SDPA contiguous", 3920 * 4 / 1000),
    ],
}


def tiled_intensity(n, block_m, itemsize):
    """FLOPs per byte of the tiled forward when every Q tile re-reads K and V from HBM (no L2
    hits): ``4 N^2 d / (itemsize (2 N d + 2 N d N / BLOCK_M))`` = ``2 N / (itemsize (1 + N /
    BLOCK_M))``."""
    return 2 * n / (itemsize * (1 + n / block_m))


def draw_roofline(path, data=ROOFLINE):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 6.2))
    bw = data["copy_GBps"] / 1000  # TB/s: TFLOP/s = intensity x TB/s
    x = np.logspace(-0.5, 4, 200)
    for peak, label, style in ((data["fp32_fma_TFLOPs"], "float32 FMA peak (SIMT)", "-"),
                               (data["fp16_tensor_TFLOPs"], "float16 tensor-core peak", "--")):
        ax.plot(x, np.minimum(peak, bw * x), style, color="#333333", linewidth=1.3)
        ax.text(2.2e3, peak * 1.12, f"{label}: {peak:.0f} TFLOP/s", fontsize=9, ha="center")
    ax.text(1.2, bw * 1.2 * 1.9, f"copy bandwidth {data['copy_GBps']:.0f} GB/s (measured)",
            fontsize=9, rotation=33, rotation_mode="anchor")
    colors = ["#4c78a8", "#f58518", "#54a24b", "#b279a2"]
    kernels = [RooflineKernel._make(k) for k in data["kernels"]]
    for kern, c in zip(kernels, colors):
        ax.plot([kern.intensity], [kern.ours], "o", color=c, markersize=9,
                label=f"{kern.name}: ours {kern.ours:.3g}")
        ax.plot([kern.intensity], [kern.theirs], "^", color=c, markersize=9,
                markerfacecolor="white", markeredgewidth=1.8,
                label=f"{kern.name}: {kern.peer} {kern.theirs:.3g}")
    ai_tiled = tiled_intensity(4096, 64, 4)
    ax.plot([ai_tiled], [13.0], "o", color=colors[0], markerfacecolor="none", markersize=9)
    ax.annotate("", xy=(kernels[0].intensity, 13.0), xytext=(ai_tiled, 13.0),
                arrowprops=dict(arrowstyle="->", color=colors[0], linestyle=":"))
    ax.text(ai_tiled, 9.0, f"same run, counting the K/V re-read\nby every 64-row Q tile: "
            f"{ai_tiled:.0f} FLOP/B", fontsize=8, color=colors[0], ha="center", va="top")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(10 ** -0.5, 1e4)
    ax.set_ylim(0.2, 2500)
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of compulsory HBM traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper left", ncol=1, frameon=True)
    ax.set_title(f"Roofline, {data['gpu']}: filled = numba_flash, open triangles = peer in the "
                 "same run", fontsize=11)
    _save(fig, path, dpi=100)


# -- the CUDA basics ---------------------------------------------------------------------------
def thread_index(n, threads):
    """``[(block, thread, i)]`` of a 1-D launch over ``n`` elements with ``threads`` per block:
    ``i = blockIdx.x * blockDim.x + threadIdx.x`` (``i >= n``: a spare thread)."""
    blocks = -(-n // threads)
    return [(b, t, b * threads + t) for b in range(blocks) for t in range(threads)]


def tree_levels(values):
    """The levels of the shared-memory tree reduction (max) of ``row_max`` in
    docs/examples/cuda_basics.py: ``[values, after stride len/2, ..., [max]]``."""
    level = list(values)
    out = [level]
    stride = len(level) // 2
    while stride > 0:
        level = [max(level[t], level[t + stride]) for t in range(stride)]
        out.append(level)
        stride //= 2
    return out


def bank_of(row, col, width, banks=32):
    """The shared-memory bank of float32 element ``[row][col]`` of a tile ``width`` words wide."""
    return (row * width + col) % banks


def draw_grid_block_thread(path, n=20, threads=8):
    from matplotlib.patches import Rectangle

    plt = _plt()
    cells = thread_index(n, threads)
    fig, ax = plt.subplots(figsize=(12, 3.6))
    colors = ["#c6dbef", "#fdd0a2", "#c7e9c0", "#dadaeb"]
    for b, t, i in cells:
        spare = i >= n
        ax.add_patch(Rectangle((i, 1.2), 0.95, 0.9, facecolor="#eeeeee" if spare
                               else colors[b % 4], edgecolor="#888888",
                               hatch="//" if spare else None))
        ax.text(i + 0.47, 1.85, f"t{t}", ha="center", va="center", fontsize=7.5)
        ax.text(i + 0.47, 1.45, f"i={i}", ha="center", va="center", fontsize=7,
                color="#999999" if spare else "black")
        if not spare:
            ax.add_patch(Rectangle((i, 0), 0.95, 0.7, facecolor="white", edgecolor="#4c78a8"))
            ax.text(i + 0.47, 0.35, f"x[{i}]", ha="center", va="center", fontsize=7)
            ax.annotate("", (i + 0.47, 0.72), (i + 0.47, 1.18),
                        arrowprops=dict(arrowstyle="->", color="#777777", lw=0.7))
    for b in range(-(-n // threads)):
        ax.text(b * threads + threads / 2 - 0.05, 2.35, f"block {b} (blockIdx.x = {b})",
                ha="center", fontsize=9, fontweight="bold")
    if len(cells) > n:
        ax.text((n + len(cells)) / 2, 0.35, "spare threads\n(i >= n: they return)",
                fontsize=8.5, ha="center", va="center", color="#555555")
    _finish(fig, ax, path, (-0.3, len(cells) + 0.3), (-0.2, 2.7),
            f"A grid of {-(-n // threads)} blocks of {threads} threads over an array of {n}:"
            " thread t of block b handles i = b * blockDim.x + t")


def draw_warps_lanes(path, threads=96):
    from matplotlib.patches import Rectangle

    plt = _plt()
    fig, ax = plt.subplots(figsize=(12, 3.2))
    colors = ["#c6dbef", "#fdd0a2", "#c7e9c0"]
    for t in range(threads):
        warp, lane = divmod(t, 32)
        x, y = lane, 2 - warp
        ax.add_patch(Rectangle((x, y), 0.92, 0.8, facecolor=colors[warp % 3],
                               edgecolor="#888888", linewidth=0.5))
        ax.text(x + 0.46, y + 0.55, str(t), ha="center", va="center", fontsize=6)
        ax.text(x + 0.46, y + 0.2, str(lane), ha="center", va="center", fontsize=5.5,
                color="#555555")
    for warp in range(threads // 32):
        ax.text(-0.4, 2 - warp + 0.4, f"warp {warp}\n(threads {32 * warp}-{32 * warp + 31})",
                ha="right", va="center", fontsize=8.5)
    ax.text(16, 3.05, "lane = threadIdx.x % 32 (small numbers), warp = threadIdx.x // 32; "
            "the 32 lanes of a warp issue each instruction together", ha="center", fontsize=9)
    _finish(fig, ax, path, (-5.5, 32.3), (-0.2, 3.4),
            f"A block of {threads} threads is {threads // 32} warps of 32 lanes")


#: the memory levels of an H100/H200, as docs/cuda-basics.md gives them, and what the tiled
#: forward keeps in each during one K/V tile (``numba_flash.kernels.forward.simt``)
MEMORY_LEVELS = [
    ("HBM (global memory)", "tens to 141 GB, about 4.8 TB/s, all SMs",
     "q, k, v, o, lse: the whole arrays; each K/V tile read once per Q tile"),
    ("L2 cache", "50 MB, shared by all SMs",
     "recently read K/V tiles (other blocks of the same head re-read them)"),
    ("shared memory (per block)", "<= 48 KiB per block, 228 KiB per SM",
     "q_tile (loaded once), k_tile and v_tile (the current K/V tile), p_tile"),
    ("registers (per thread)", "<= 255 x 4 B per thread, 256 KiB per SM",
     "a micro-tile of S and of acc, m_i and l_i of the thread's rows"),
]


def draw_memory_hierarchy(path, levels=MEMORY_LEVELS):
    from matplotlib.patches import FancyBboxPatch

    plt = _plt()
    fig, ax = plt.subplots(figsize=(12, 5))
    colors = ["#fdd0a2", "#fdae6b", "#c6dbef", "#c7e9c0"]
    n = len(levels)
    for k, (name, size, holds) in enumerate(levels):
        y = n - 1 - k
        width = 5.2 - 0.8 * k
        ax.add_patch(FancyBboxPatch((3 - width / 2, y + 0.1), width, 0.75,
                                    boxstyle="round,pad=0.03", facecolor=colors[k],
                                    edgecolor="#666666"))
        ax.text(3, y + 0.6, name, ha="center", va="center", fontsize=10, fontweight="bold")
        ax.text(3, y + 0.3, size, ha="center", va="center", fontsize=8.5)
        ax.text(6.1, y + 0.47, holds, ha="left", va="center", fontsize=9)
        if k:
            ax.annotate("", (3, y + 0.87), (3, y + 1.08),
                        arrowprops=dict(arrowstyle="<->", color="#555555"))
    ax.text(6.1, n + 0.05, "during one K/V tile of the tiled forward:", fontsize=9.5,
            fontweight="bold")
    ax.text(0.1, -0.35, "smaller and faster towards the bottom; a load from HBM goes through L2; "
            "shared memory and registers are on the SM", fontsize=8.5, color="#555555")
    _finish(fig, ax, path, (0, 13), (-0.5, n + 0.35),
            "The memory hierarchy, and where a tile's data lives", fontsize=11)


def draw_tree_reduction(path, values=(3, 7, 1, 8, 2, 9, 4, 6)):
    from matplotlib.patches import Rectangle

    plt = _plt()
    levels = tree_levels(values)
    fig, ax = plt.subplots(figsize=(10, 4.6))
    for k, level in enumerate(levels):
        y = len(levels) - 1 - k
        for t, val in enumerate(level):
            ax.add_patch(Rectangle((t, y), 0.9, 0.6, facecolor="#c6dbef" if k else "#eeeeee",
                                   edgecolor="#4c78a8"))
            ax.text(t + 0.45, y + 0.3, str(val), ha="center", va="center", fontsize=10)
            if k:
                stride = len(level)
                for src in (t, t + stride):
                    ax.annotate("", (t + 0.45, y + 0.62), (src + 0.45, y + 0.98),
                                arrowprops=dict(arrowstyle="->", color="#777777", lw=0.8))
        label = ("partial[t] (one slot per thread)" if k == 0 else
                 f"threads t < {len(level)}: partial[t] = max(partial[t], partial[t + "
                 f"{len(level)}])")
        ax.text(8.3, y + 0.3, label, va="center", fontsize=8.5)
        if k < len(levels) - 1:
            ax.plot([-0.2, 8.1], [y - 0.2, y - 0.2], color="#d62728", linestyle="--", lw=0.9)
            ax.text(-0.3, y - 0.2, "syncthreads", ha="right", va="center", fontsize=7.5,
                    color="#d62728")
    _finish(fig, ax, path, (-1.6, 15), (-0.3, len(levels) - 0.2),
            "Tree reduction in shared memory (row_max, 8 threads): log2(8) = 3 levels, a "
            "barrier before each level reads")


def draw_smem_banks(path, rows=8):
    from matplotlib.patches import Rectangle

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    cmap = plt.get_cmap("hsv")
    for ax, width in zip(axes, (32, 33)):
        for r in range(rows):
            for c in range(width):
                bank = bank_of(r, c, width)
                hit = c == 0
                ax.add_patch(Rectangle((c, rows - 1 - r), 0.95, 0.9,
                                       facecolor=cmap(bank / 32), alpha=0.9 if hit else 0.25,
                                       edgecolor="black" if hit else "none",
                                       linewidth=1.2 if hit else 0))
                if hit or r == 0:
                    ax.text(c + 0.47, rows - 1 - r + 0.45, str(bank), ha="center",
                            va="center", fontsize=5.5)
        col_banks = [bank_of(r, 0, width) for r in range(32)]
        ways = max(col_banks.count(b) for b in set(col_banks))
        ax.set_title(f"float32 tile[32][{width}]: column 0 (outlined, first {rows} rows shown) "
                     f"lies in banks {col_banks[0]}, {col_banks[1]}, {col_banks[2]}, ...: "
                     f"{ways}-way", fontsize=9)
        ax.set_xlim(-0.2, 33.5)
        ax.set_ylim(-0.3, rows + 0.2)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.suptitle("Shared-memory banks: word w is in bank w % 32 (numbers: the bank); a warp "
                 "reading a column of a 32-wide tile hits one bank 32 times, of a 33-wide tile "
                 "32 banks once", fontsize=10)
    _save(fig, path, rect=(0, 0, 1, 0.93))


# -- loop orders ------------------------------------------------------------------------------
def draw_loop_order(path, tr=3, tc=3):
    from matplotlib.patches import Rectangle

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    orders = {
        "FlashAttention-1: K/V tiles outer, Q tiles inner":
            [(i, j) for j in range(tc) for i in range(tr)],
        "FlashAttention-2: Q tiles outer (the grid), K/V tiles inner":
            [(i, j) for i in range(tr) for j in range(tc)],
    }
    notes = [
        "per step (i, j): read Q_i, O_i, l_i, m_i from HBM,\nrescale, write O_i, l_i, m_i "
        "back;\nK_j, V_j stay on chip for the inner loop",
        "per step (i, j): read K_j, V_j; Q_i, acc, m_i, l_i\nstay on chip for the inner loop; "
        "O_i and lse_i\nwritten once, after the last j; the Q tiles\nrun in parallel, one block "
        "each",
    ]
    for ax, (title, order), note in zip(axes, orders.items(), notes):
        for step, (i, j) in enumerate(order):
            ax.add_patch(Rectangle((j, tr - 1 - i), 0.92, 0.92, facecolor="#c6dbef",
                                   edgecolor="#4c78a8"))
            ax.text(j + 0.46, tr - 1 - i + 0.46, f"step {step + 1}\nS_{i}{j}", ha="center",
                    va="center", fontsize=9)
        for (i0, j0), (i1, j1) in zip(order, order[1:]):
            ax.annotate("", (j1 + 0.46, tr - 1 - i1 + 0.46), (j0 + 0.46, tr - 1 - i0 + 0.46),
                        arrowprops=dict(arrowstyle="->", color="#f58518", lw=1.0,
                                        shrinkA=14, shrinkB=14))
        for j in range(tc):
            ax.text(j + 0.46, tr + 0.15, f"K_{j}, V_{j}", ha="center", fontsize=9)
        for i in range(tr):
            ax.text(-0.1, tr - 1 - i + 0.46, f"Q_{i}", ha="right", va="center", fontsize=9)
        ax.text(-0.5, -0.35, note, fontsize=8.5, va="top")
        ax.set_xlim(-0.7, tc + 0.3)
        ax.set_ylim(-1.6, tr + 0.5)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(title, fontsize=10)
    fig.suptitle("The forward's two loop orders over the score tiles S_ij (orange: the order of "
                 "the steps)", fontsize=11)
    _save(fig, path)


# -- memory access, drawn from recorded requests (docs/memory-access.md) ------------------------
def bank_cells(lanes, width=None):
    """Where one warp's shared request lands: ``[(phase, bank, slot, lane)]`` for every 4-byte
    word a lane touches (``lanes``: ``(lane, byte address, bytes)``); ``slot``: the word's rank
    among the different words of its bank in its phase (the wavefront that serves it)."""
    from .memory_profile import WORD, lanes_per_phase

    width = width or max(n for _, _, n in lanes)
    per = lanes_per_phase(width)
    words = {}
    for lane, a, n in lanes:
        for w in range(a // WORD, (a + n - 1) // WORD + 1):
            words.setdefault((lane // per, w % 32), {}).setdefault(w, []).append(lane)
    cells = []
    for (phase, bank), ws in sorted(words.items()):
        for slot, w in enumerate(sorted(ws)):
            cells += [(phase, bank, slot, lane) for lane in ws[w]]
    return cells


def _bank_panel(ax, lanes, title, width=None, height=None):
    """One warp's shared request on the 32 banks: a column per bank, a row per wavefront (the
    phases one above the other), each cell the lane(s) whose word it is (addresses from the
    allocation's start: its byte 0 in bank 0; ``height``: rows the panel has room for)."""
    from matplotlib.patches import Rectangle

    from ..kernels.ptx.address import SHARED_BASE

    cmap = _plt().get_cmap("hsv")
    cells = bank_cells([(ln, a - SHARED_BASE, n) for ln, a, n in lanes], width)
    phases = sorted({c[0] for c in cells})
    depth = {ph: 1 + max(c[2] for c in cells if c[0] == ph) for ph in phases}
    base, y0 = {}, 0
    for ph in phases:
        base[ph] = y0
        y0 += depth[ph] + 0.6
    for ph, bank, slot, lane in cells:
        y = base[ph] + slot
        ax.add_patch(Rectangle((bank, -y - 1), 0.92, 0.88, facecolor=cmap(lane / 32), alpha=0.75,
                               edgecolor="black", linewidth=0.4))
        ax.text(bank + 0.46, -y - 0.55, str(lane), ha="center", va="center", fontsize=5.5)
    for ph in phases:
        ax.text(-0.6, -base[ph] - depth[ph] / 2, f"phase {ph}: {depth[ph]}", ha="right",
                va="center", fontsize=7)
    for b in range(32):
        ax.text(b + 0.46, 0.4, str(b), ha="center", va="bottom", fontsize=5.5)
    ax.text(16, 1.6, "bank", ha="center", fontsize=7.5)
    ax.set_xlim(-6.5, 32.5)
    ax.set_ylim(-max(y0, height or 0) - 0.5, 2.4)
    ax.axis("off")
    ax.set_title(title, fontsize=9)


def _sector_panel(ax, lanes, title, max_lines=32, height=None):
    """One warp's global request over 128-byte lines (rows) of four 32-byte sectors: each lane's
    bytes at their offset in the line, the sectors touched shaded."""
    from matplotlib.patches import Rectangle

    from .memory_profile import LINE, SECTOR

    cmap = _plt().get_cmap("hsv")
    lines = sorted({a // LINE for _, a, _ in lanes})[:max_lines]
    row = {ln: i for i, ln in enumerate(lines)}
    touched = {(a // SECTOR) for _, a, n in lanes}
    for ln in lines:
        y = -row[ln]
        for s in range(LINE // SECTOR):
            hit = (ln * LINE // SECTOR + s) in touched
            ax.add_patch(Rectangle((s * SECTOR, y - 0.9), SECTOR, 0.8,
                                   facecolor="#fdd49e" if hit else "white", edgecolor="#888888",
                                   linewidth=0.6))
        ax.text(-3, y - 0.5, f"line {row[ln]}", ha="right", va="center", fontsize=6)
    for lane, a, n in lanes:
        if a // LINE in row:
            x, y = a % LINE, -row[a // LINE]
            ax.add_patch(Rectangle((x, y - 0.8), n, 0.6, facecolor=cmap(lane / 32),
                                   edgecolor="black", linewidth=0.3))
            if len(lines) <= 2:
                ax.text(x + n / 2, y - 0.5, str(lane), ha="center", va="center", fontsize=5)
    for s in range(LINE // SECTOR):
        ax.text(s * SECTOR + SECTOR / 2, 0.25, f"sector {s}", ha="center", fontsize=6.5)
    ax.set_xlim(-26, LINE + 2)
    ax.set_ylim(-max(len(lines), 2, height or 0) - 0.3, 0.9)
    ax.axis("off")
    ax.set_title(title, fontsize=9)


def _demo_site(name, space, op):
    """The first request of the demo ``name``'s site of ``space`` and ``op`` (recorded now)."""
    from .memory_profile import demo

    _, prof = demo(name)
    return prof.launches[0].find(space=space, op=op)[0]


def draw_memory_coalescing(path):
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.2), gridspec_kw={"width_ratios": [1, 1]})
    for ax, name in zip(axes, ("rows", "columns")):
        s = _demo_site(name, "global", "ld")
        _sector_panel(ax, s.example,
                      f"sum_{name}: x[{'r, c' if name == 'rows' else 'r, c'}] with lane = "
                      f"{'c' if name == 'rows' else 'r'}\none request: "
                      f"{s.sectors // s.requests} sectors, {s.lines // s.requests} line"
                      f"{'s' if s.lines // s.requests > 1 else ''} for 128 bytes", height=32)
    fig.suptitle("A warp's float32 load over 128-byte lines of 32-byte sectors (recorded in the "
                 "simulator; colour: the lane): a row is 4 sectors, a column 32", fontsize=10)
    _save(fig, path, rect=(0, 0, 1, 0.95))


def draw_memory_banks(path):
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(14, 11), gridspec_kw={"height_ratios": [1.7, 1]})
    cases = [("transpose", "ld", "tile[32][32] read by columns (row-major)"),
             ("transpose_swizzled", "ld", "the same read, tile[32 r + (c ^ r)] (XOR swizzle)"),
             ("ldmatrix_row-major", "ldsm", "ldmatrix .x4 on 128-byte rows (row-major)"),
             ("ldmatrix_swizzled", "ldsm", "ldmatrix .x4, the 128-byte swizzle")]
    for i, (ax, (name, op, what)) in enumerate(zip(axes.flat, cases)):
        s = _demo_site(name, "shared", op)
        waves = s.wavefronts // s.requests
        _bank_panel(ax, s.example, f"{what}:\n{waves} wavefront{'s' if waves > 1 else ''} "
                    f"({s.ways}-way)", s.width, height=32.6 if i < 2 else 34.4)
    fig.suptitle("One warp's shared-memory request on the 32 banks (recorded in the simulator; "
                 "a cell: a 4-byte word and the lane that reads it; a row: one wavefront; "
                 "phase k: wavefronts)", fontsize=10)
    _save(fig, path, rect=(0, 0, 1, 0.96))


PICTURES = {
    "causal_tiles.png": draw_causal_tiles,
    "paged_block_table.png": draw_paged_block_table,
    "split_kv.png": draw_split_kv,
    "backward_loops.png": draw_backward_loops,
    "roofline.png": draw_roofline,
    "tile_ownership.png": draw_tile_ownership,
    "grid_block_thread.png": draw_grid_block_thread,
    "warps_lanes.png": draw_warps_lanes,
    "memory_hierarchy.png": draw_memory_hierarchy,
    "tree_reduction.png": draw_tree_reduction,
    "smem_banks.png": draw_smem_banks,
    "loop_order.png": draw_loop_order,
    "memory_coalescing.png": draw_memory_coalescing,
    "memory_banks.png": draw_memory_banks,
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
