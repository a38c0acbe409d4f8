"""The wgmma m64nNk16 accumulator layout and the 128-byte swizzle, as text tables.

    python docs/examples/wgmma_layout.py            # which thread holds which accumulator cell
    python docs/examples/wgmma_layout.py swizzle    # where each 16-byte chunk of 8 rows lands

Both come from the functions the simulator twin and the tests use
(``numba_flash.kernels.ptx.wgmma.acc_coords``, ``swizzle_address``; the PTX ISA's "Matrix Fragments
for wgmma.mma_async.m64nNk16" and "Shared Memory Matrix Layout"), beside the mma.sync table.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")  # no GPU needed: host functions only

from numba_flash.kernels.ptx.mma import c_coords  # noqa: E402
from numba_flash.kernels.ptx.wgmma import acc_coords, swizzle_address  # noqa: E402


def accumulators(threads=(0, 1, 4, 31, 32, 127)):
    lines = ["thread (w, g, t)  d0..d7 of m64nNk16 (row, col)                         "
             "mma.m16n8k16 c0..c3 of lane r % 32"]
    for r in threads:
        w, g, t = r >> 5, (r & 31) >> 2, r & 3
        d = " ".join(f"{acc_coords(r, i)}".replace(" ", "") for i in range(8))
        c = " ".join(f"{c_coords(r & 31, i)}".replace(" ", "") for i in range(4))
        lines.append(f"{r:6d} ({w}, {g}, {t})  {d:60s}  {c}")
    lines.append("d_(4j+q): the cell of d_q moved 8 j columns right (j up to N/8 - 1)")
    return "\n".join(lines)


def swizzle():
    lines = ["128-byte swizzle: chunk c (16 bytes) of row r is stored at chunk"]
    lines.append("row  " + " ".join(f"c{c}" for c in range(8)))
    for r in range(8):
        lines.append(f"{r:3d}  " + " ".join(
            f"{(swizzle_address(128 * r + 16 * c, 128) - 128 * r) // 16:2d}" for c in range(8)))
    return "\n".join(lines)


if __name__ == "__main__":
    print(swizzle() if sys.argv[1:] == ["swizzle"] else accumulators())
