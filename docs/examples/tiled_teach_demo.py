"""The teaching tiled forward (``numba_flash.teach.ops.tiled_forward``) run for
docs/tiled-forward.md.

``python docs/examples/tiled_teach_demo.py errors``   its error against the float64 reference
``python docs/examples/tiled_teach_demo.py traffic``  global bytes read, counted in the simulator,
                                                      against the naive and first tiled kernels
``python docs/examples/tiled_teach_demo.py budget``   the GPU tiles per head dim, their threads and
                                                      shared memory
``python docs/examples/tiled_teach_demo.py banks``    the bank conflict of the score loop's k_tile
                                                      read, per head dim
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import numba_flash  # noqa: F401  (chooses the backend before numba.cuda is imported)
from numba_flash.teach.kernels import tiled_forward as teach
from numba_flash.kernels.core.common import HEAD_DIMS, SMEM_LIMIT
from numba_flash.teach.ops.naive_forward import naive_forward
from numba_flash.teach.ops.row_forward import row_forward
from numba_flash.teach.ops.tiled_forward import tiled_forward_teach

sys.path.insert(0, str(Path(__file__).resolve().parent))
from io_count import count_global_bytes, tiled_forward_bytes  # noqa: E402
import row_forward_demo  # noqa: E402

BLOCK_M, BLOCK_N = teach.SIM_BLOCKS


def errors():
    row_forward_demo.errors(tiled_forward_teach, teach.SIM_BLOCKS, d=6)


def traffic():
    rng = np.random.default_rng(0)
    d = 8
    print(f"global bytes read (float32, B = H = 1, d = {d}), counted element by element in the "
          f"simulator;\ntiles of {BLOCK_M} rows x {BLOCK_N} keys")
    print(f"  {'N':>3s} {'causal':6s} {'naive':>8s} {'row_forward':>11s} {'teach':>8s} "
          f"{'model':>8s}")
    for n, causal in ((8, False), (16, False), (24, False), (24, True)):
        q = rng.standard_normal((1, 1, n, d)).astype(np.float32)
        counted = [count_global_bytes(lambda f=f: f(q, q, q, causal=causal))[1][0].read
                   for f in (naive_forward, row_forward, tiled_forward_teach)]
        model = tiled_forward_bytes(1, 1, n, n, d, BLOCK_M, BLOCK_N, 4, 4, causal)["read"]
        print(f"  {n:3d} {causal!s:6s} {counted[0]:8d} {counted[1]:11d} {counted[2]:8d} "
              f"{model:8d}")


def gpu_blocks(head_dim, dtype):
    """The GPU's ``(BLOCK_M, BLOCK_N)``: :func:`teach.default_blocks` as on a GPU."""
    return next(mn for mn in teach.GPU_BLOCKS
                if teach.shared_bytes(head_dim, *mn, dtype) <= SMEM_LIMIT)


def budget():
    print("GPU tiles: the first (BLOCK_M, BLOCK_N) of GPU_BLOCKS whose five tiles fit in 48 KiB")
    print(f"  {'compute':>10s} {'HEAD_DIM':>8s} {'BLOCK_M':>7s} {'BLOCK_N':>7s} {'threads':>7s} "
          f"{'smem KiB':>8s} {'acc/thread':>10s}")
    for dtype, name in ((np.float32, "float16/32"), (np.float64, "float64")):
        for hd in HEAD_DIMS:
            bm, bn = gpu_blocks(hd, dtype)
            kib = teach.shared_bytes(hd, bm, bn, dtype) / 1024
            print(f"  {name:>10s} {hd:8d} {bm:7d} {bn:7d} {bm * bn:7d} {kib:8.1f} "
                  f"{-(-hd // bn):10d}")


def ways(words, banks=32):
    """The most different 4-byte words one bank serves for one warp-wide access."""
    per_bank = {}
    for w in words:
        per_bank.setdefault(w % banks, set()).add(w)
    return max(len(s) for s in per_bank.values())


def banks():
    print("one warp's read of k_tile[tx, c] in the score loop (float32, GPU tiles):")
    print(f"  {'HEAD_DIM':>8s} {'BLOCK_N':>7s} {'keys a warp reads':>17s} {'ways':>5s}")
    for hd in HEAD_DIMS:
        bn = gpu_blocks(hd, np.float32)[1]
        words = [(t % bn) * hd for t in range(32)]  # lane t is tx = t % BLOCK_N, column c = 0
        print(f"  {hd:8d} {bn:7d} {len(set(words)):17d} {ways(words):5d}")


if __name__ == "__main__":
    {"errors": errors, "traffic": traffic, "budget": budget, "banks": banks}[sys.argv[1]]()
