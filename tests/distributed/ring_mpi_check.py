"""Run under ``mpiexec -n R``: ring attention on every rank against the whole-sequence oracle.

Every rank draws the same whole-sequence inputs (same seed), takes its shard, runs
:func:`ring_forward` and :func:`ring_backward`; rank 0 gathers the shards, unshards them and
compares with :func:`numba_flash.reference.attention` / ``attention_backward`` (float64) of the
whole sequence.  Prints one line per case and exits 1 if any case is off (or raised).
``--seeds N`` repeats over N seeds and prints the largest errors (how the bounds were measured).

Used by tests/distributed/test_ring_mpi.py; run by hand with
``mpiexec -n 4 python -m mpi4py tests/distributed/ring_mpi_check.py``.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import numpy as np

warnings.simplefilter("ignore")  # the simulator warning, once per rank

from mpi4py import MPI  # noqa: E402

import numba_flash  # noqa: E402
from numba_flash import reference  # noqa: E402
from numba_flash.distributed import (contiguous_shard, contiguous_unshard, ring_backward,  # noqa: E402
                                     ring_forward, zigzag_shard, zigzag_unshard)

#: error bound relative to max(1, max|reference|), per dtype.  Measured with --seeds 20 on 2 and
#: 4 ranks (the CASES below): largest float32 error 4.0e-7 (forward), 1.0e-6 (gradients, dk on
#: 2 ranks); float64 6.2e-16 (forward), 1.3e-15 (gradients).  Bounds about 4x that.
TOL = {np.float32: 4e-6, np.float64: 5e-15}

LAYOUTS = {"zigzag": (zigzag_shard, zigzag_unshard),
           "contiguous": (contiguous_shard, contiguous_unshard)}
# (layout, causal, dtype): the causal zig-zag case is the one the ring is for
CASES = [("zigzag", True, np.float32), ("zigzag", False, np.float32),
         ("contiguous", True, np.float32), ("zigzag", True, np.float64)]
SHAPE = dict(B=1, H=2, Hkv=1, N_local=4, d=8)  # GQA: two query heads share one kv head


def run_case(comm, layout, causal, dtype, seed):
    rank, world = comm.rank, comm.size
    b, h, hkv, n_local, d = (SHAPE[x] for x in ("B", "H", "Hkv", "N_local", "d"))
    n = n_local * world
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, h, n, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, n, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, n, d)).astype(dtype)
    do = rng.standard_normal((b, h, n, d)).astype(dtype)
    shard, unshard = LAYOUTS[layout]
    sq, sk, sv, sdo = (shard(x, rank, world) for x in (q, k, v, do))
    o, lse = ring_forward(sq, sk, sv, comm=comm, causal=causal, return_lse=True, layout=layout)
    dq, dk, dv = ring_backward(sdo, sq, sk, sv, o, lse, comm=comm, causal=causal, layout=layout)
    shards = comm.gather((o, lse, dq, dk, dv), root=0)
    if rank != 0:
        return None
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    refs = (o_ref, lse_ref, *reference.attention_backward(do, q, k, v, causal=causal))
    errs = {}
    for i, (name, want) in enumerate(zip(("o", "lse", "dq", "dk", "dv"), refs)):
        got = unshard([s[i] for s in shards]).astype(np.float64)
        if np.isnan(got).any():
            errs[name] = np.inf
        else:
            errs[name] = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    return errs


def check_disagreement(comm):
    """Rank 1 passes a longer shard: every rank must raise the same ValueError naming rank 1."""
    n_local = 4 if comm.rank != 1 else 6
    q = np.zeros((1, 2, n_local, 8), np.float32)
    k = np.zeros((1, 1, n_local, 8), np.float32)
    try:
        ring_forward(q, k, k, comm=comm)
    except ValueError as e:
        return "rank 1" in str(e) and "q:" in str(e), str(e)
    return False, "no error raised"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=1)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    ok = True
    with numba_flash.poisoned_outputs():  # an unwritten output element shows as NaN
        for layout, causal, dtype in CASES:
            worst = {}
            for seed in range(args.seeds):
                errs = run_case(comm, layout, causal, dtype, seed)
                if errs:
                    worst = {k: max(v, worst.get(k, 0.0)) for k, v in errs.items()}
            if comm.rank == 0:
                tol = TOL[dtype]
                bad = [k for k, v in worst.items() if not v <= tol]
                ok &= not bad
                print(f"R={comm.size} {layout:10s} causal={causal!s:5s} "
                      f"{np.dtype(dtype).name}: "
                      + " ".join(f"{k}={v:.1e}" for k, v in worst.items())
                      + f" (bound {tol:.0e}) " + ("FAIL " + ",".join(bad) if bad else "OK"),
                      flush=True)
    good, msg = check_disagreement(comm)
    all_good = comm.allreduce(int(good), op=MPI.MIN)
    if comm.rank == 0:
        print(f"R={comm.size} disagreement check: " + ("OK" if all_good else "FAIL")
              + f" ({msg})", flush=True)
    ok = comm.bcast(ok and bool(all_good), root=0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
