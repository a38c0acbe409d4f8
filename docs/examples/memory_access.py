"""The memory profile from Python (docs/memory-access.md): record a call, read its sites.

``python docs/examples/memory_access.py teach``  the teaching tiled forward (docs/tiled-forward.md)
                                                 at d = 64, a warp a row of 32 keys: its shared
                                                 sites, the score loop's k_tile read 32-way
"""

from __future__ import annotations

import sys

import numpy as np

import numba_flash  # noqa: F401  (chooses the backend before numba.cuda is imported)
from numba_flash.teach.kernels import tiled_forward as teach
from numba_flash.teach.ops.tiled_forward import tiled_forward_teach
from numba_flash.tools.memory_profile import record


def teach_sites(d=64, nq=2, nk=32, blocks=(2, 32)):
    """Record the teaching forward with tiles of ``blocks`` (BLOCK_M rows, BLOCK_N keys: one
    warp is one row of 32 keys, as on the GPU; one block here) and print its shared sites."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, nq, d)).astype(np.float32)
    k, v = (rng.standard_normal((1, 1, nk, d)).astype(np.float32) for _ in range(2))
    saved, teach.SIM_BLOCKS = teach.SIM_BLOCKS, blocks   # the simulator's tile choice
    try:
        # [docs:record-api]
        (o, lse), prof = record(lambda: tiled_forward_teach(q, k, v))
        launch = prof.launch("tiled_forward_teach")
        for s in launch.find(space="shared"):
            print(f"{s.label():26s} {s.array:7s} {s.op:3s} {s.requests:5d} requests "
                  f"{s.wavefronts / s.requests:5.1f} wavefronts each, {s.ways:2d}-way")
        # [/docs:record-api]
    finally:
        teach.SIM_BLOCKS = saved
    ref = numba_flash.reference.attention(q, k, v)[0]
    print(f"o agrees with the reference (within 1e-5): {np.abs(o - ref).max() < 1e-5}")


if __name__ == "__main__":
    {"teach": teach_sites}[sys.argv[1] if len(sys.argv) > 1 else "teach"]()
