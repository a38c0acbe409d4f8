"""The first tiled kernel (``numba_flash.teach.ops.row_forward``) run for docs/row-forward.md.

``python docs/examples/row_forward_demo.py errors``   its error against the float64 reference
``python docs/examples/row_forward_demo.py traffic``  global bytes read, measured in the simulator,
                                                      against the naive kernel's
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import numba_flash  # noqa: F401  (chooses the backend before numba.cuda is imported)
from numba_flash import reference as ref
from numba_flash.teach.kernels.row_forward import SIM_BLOCK_M, SIM_BLOCK_N
from numba_flash.teach.ops.naive_forward import naive_forward
from numba_flash.teach.ops.row_forward import row_forward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from io_count import count_global_bytes, naive_forward_bytes, tiled_forward_bytes  # noqa: E402


def bound(x):
    """An error as a bound (its digits are rounding noise that differs between machines)."""
    for b in (1e-15, 1e-14, 1e-13, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2):
        if x < b:
            return f"< {b:.0e}"
    return f"{x:.1e}"


def errors(op=row_forward, blocks=(SIM_BLOCK_M, SIM_BLOCK_N), d=8):
    """``op`` (a teaching forward; the first tiled kernel by default) against the reference."""
    rng = np.random.default_rng(0)
    print(f"{op.__name__} against reference.attention, B=1 H=2 Hkv=1 Nq=9 Nk=13 d={d}, simulator "
          f"blocks of {blocks[0]} rows x {blocks[1]} keys:")
    for dtype in (np.float16, np.float32, np.float64):
        for causal in (False, True):
            q = rng.standard_normal((1, 2, 9, d)).astype(dtype)
            k = rng.standard_normal((1, 1, 13, d)).astype(dtype)
            v = rng.standard_normal((1, 1, 13, d)).astype(dtype)
            o, lse = op(q, k, v, causal=causal)
            o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
            print(f"  {np.dtype(dtype).name:8s} causal={causal!s:5s}  o {o.dtype.name:8s} "
                  f"max |o - ref| {bound(np.abs(o - o_ref).max()):7s}  lse {lse.dtype.name:8s} "
                  f"max |lse - ref| {bound(np.abs(lse - lse_ref).max())}")


def traffic():
    rng = np.random.default_rng(0)
    d = 8
    print(f"global bytes read (float32, B = H = 1, d = {d}), counted element by element in the "
          f"simulator;\nrow_forward's blocks: {SIM_BLOCK_M} rows x {SIM_BLOCK_N} keys")
    print(f"  {'N':>3s} {'causal':6s} {'naive':>8s} {'row_forward':>11s} {'model':>8s} "
          f"{'naive / row':>11s}")
    for n, causal in ((8, False), (16, False), (24, False), (24, True)):
        q = rng.standard_normal((1, 1, n, d)).astype(np.float32)
        _, (naive,) = count_global_bytes(lambda: naive_forward(q, q, q, causal=causal))
        _, (row,) = count_global_bytes(lambda: row_forward(q, q, q, causal=causal))
        assert naive.read == naive_forward_bytes(1, 1, n, n, d, 4, 4, causal)["read"]
        model = tiled_forward_bytes(1, 1, n, n, d, SIM_BLOCK_M, SIM_BLOCK_N, 4, 4, causal)["read"]
        print(f"  {n:3d} {causal!s:6s} {naive.read:8d} {row.read:11d} {model:8d} "
              f"{naive.read / row.read:11.2f}")


if __name__ == "__main__":
    {"errors": errors, "traffic": traffic}[sys.argv[1]]()
