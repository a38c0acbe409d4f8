"""Ring attention over MPI, the example of docs/ring-attention.md.

Run with any number of ranks (the mpich wheel of the ``mpi`` extra provides ``mpiexec``)::

    mpiexec -n 4 python -m mpi4py docs/examples/ring_demo.py

(``-m mpi4py``: an uncaught exception on one rank aborts them all instead of leaving the
others waiting.)

Every rank builds the same whole sequence (same seed), keeps its zig-zag shard, runs the causal
ring forward and backward, and rank 0 gathers the shards and compares with the float64 oracle
of the whole sequence.  ``python docs/examples/ring_demo.py --ranks 4`` starts that ``mpiexec``
itself (the venv's, from the mpich wheel) and prints rank 0's lines: the page quotes that run,
and ``tests/distributed/test_ring_docs.py`` checks it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np

warnings.simplefilter("ignore")  # the simulator warning, once per rank

if __name__ == "__main__" and "--ranks" in sys.argv:  # launcher: mpiexec -n R this script
    ranks = sys.argv[sys.argv.index("--ranks") + 1]
    mpiexec = (shutil.which("mpiexec", path=str(Path(sys.executable).parent))
               or shutil.which("mpiexec"))
    if mpiexec is None:
        sys.exit("no mpiexec found: pip install mpich (or '.[mpi]' in the clone)")
    proc = subprocess.run([mpiexec, "-n", ranks, sys.executable, "-m", "mpi4py", __file__],
                          capture_output=True, text=True)
    print(proc.stdout, end="")
    if proc.returncode:
        sys.exit(proc.stderr)
    sys.exit(0)

# [docs:ring-demo]
from mpi4py import MPI  # noqa: E402

from numba_flash import reference  # noqa: E402
from numba_flash.distributed import (ring_backward, ring_forward, zigzag_shard,  # noqa: E402
                                     zigzag_unshard)

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()

B, H, Hkv, N_local, d = 1, 4, 2, 8, 16  # GQA: 2 query heads per kv head
N = N_local * world  # the whole sequence; each rank holds N_local tokens
rng = np.random.default_rng(0)  # the same seed on every rank: the same whole tensors
q = rng.standard_normal((B, H, N, d)).astype(np.float32)
k = rng.standard_normal((B, Hkv, N, d)).astype(np.float32)
v = rng.standard_normal((B, Hkv, N, d)).astype(np.float32)
do = rng.standard_normal((B, H, N, d)).astype(np.float32)

# this rank's shard: chunks rank and 2*world-1-rank of 2*world
q_r, k_r, v_r, do_r = (zigzag_shard(x, rank, world) for x in (q, k, v, do))
o_r, lse_r = ring_forward(q_r, k_r, v_r, comm=comm, causal=True, return_lse=True)
dq_r, dk_r, dv_r = ring_backward(do_r, q_r, k_r, v_r, o_r, lse_r, comm=comm, causal=True)

shards = comm.gather((o_r, dq_r, dk_r, dv_r), root=0)
if rank == 0:
    o_ref, _ = reference.attention(q, k, v, causal=True)
    refs = (o_ref, *reference.attention_backward(do, q, k, v, causal=True))
    for i, (name, want) in enumerate(zip(("o", "dq", "dk", "dv"), refs)):
        got = zigzag_unshard([s[i] for s in shards])
        print(f"{world} ranks, N = {N}: {name} max error {np.abs(got - want).max():.1e}")
# [/docs:ring-demo]
