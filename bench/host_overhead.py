"""The host's share of a call: microseconds, Python function calls, synchronisations and
allocations per steady-state call of each public op.

    python bench/host_overhead.py                 # the stand-in device (any machine)
    python bench/host_overhead.py --device cupy   # CuPy arrays on a GPU
    python bench/host_overhead.py --json          # one JSON object a line per op
    python bench/host_overhead.py --ops forward decode_run --calls 2000

Each op is called on device arrays of a fixed signature: a few warm-up calls (the first one
builds its launch plan, :mod:`numba_flash.frontend.plans`), then ``--calls`` timed calls, each
timed alone (``us`` is their median), then the same number under ``cProfile`` (``calls``: Python
function calls per call, builtins included: the machine-independent figure; on the stand-in a
call to one of its functions counts once, as a call into CuPy would, its insides not), then one
call
counted by the stand-in device (``syncs``: waits for the GPU, device-to-host copies included;
``allocations``; on CuPy these two are not counted: ``null``).

On the stand-in device (:mod:`numba_flash.standin`) nothing runs on a GPU: each launch is
recorded, so ``us`` is the host path alone plus the stand-in's own bookkeeping (a few calls a
launch and an allocation, counted in ``calls`` too).  On CuPy, ``us`` is what the host spends
before the call returns, the kernels still running (no synchronisation).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import numba_flash  # noqa: E402


def _cases(xp, rng):
    """``{name: zero-argument call}`` of every op, on ``xp`` arrays."""
    f16, f32 = np.float16, np.float32

    def dev(shape, dtype=f16, scale=1.0):
        return xp.asarray((rng.standard_normal(shape) * scale).astype(dtype))

    b, h, hkv, n, d = 1, 16, 4, 1024, 64
    q, k, v = dev((b, h, n, d)), dev((b, hkv, n, d)), dev((b, hkv, n, d))
    q32, k32, v32 = (dev(x.shape, f32) for x in (q, k, v))
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True, kernel="mma")
    do = dev(o.shape)
    # decode: one token per sequence over a paged cache (pages of 64, 16 pages each)
    bd, pages, page = 4, 16, 64
    qd = dev((bd, h, 128))
    kc, vc = dev((bd * pages, hkv, page, 128)), dev((bd * pages, hkv, page, 128))
    table = xp.asarray(rng.permutation(bd * pages).reshape(bd, pages).astype(np.int32))
    lens = xp.asarray(np.full(bd, 1000, np.int32))
    kcc, vcc = dev((bd, hkv, 1024, 128)), dev((bd, hkv, 1024, 128))
    out_d = xp.empty((bd, h, 128), f16)
    plan = numba_flash.decode_plan(qd, kc, vc, cache_seqlens=lens, block_table=table)
    # varlen: two sequences packed
    cu = xp.asarray(np.array([0, 300, 1024], np.int32))
    qp, kp, vp = dev((n, h, d)), dev((n, hkv, d)), dev((n, hkv, d))
    parts_o, parts_l = dev((2, bd, h, 128), f32), dev((2, bd, h), f32)
    kn, vn = dev((bd, hkv, 1, 128)), dev((bd, hkv, 1, 128))
    cos, sin = dev((4096, 32)), dev((4096, 32))
    return {
        "forward": lambda: numba_flash.forward(q, k, v, causal=True, kernel="mma"),
        "forward_simt_f32": lambda: numba_flash.forward(q32, k32, v32, causal=True),
        "forward_varlen": lambda: numba_flash.forward_varlen(
            qp, kp, vp, cu, cu, max_seqlen_q=724, max_seqlen_k=724, causal=True),
        "backward": lambda: numba_flash.backward(do, q, k, v, o, lse, causal=True, kernel="mma"),
        "decode": lambda: numba_flash.decode(qd, kc, vc, cache_seqlens=lens,
                                             block_table=table),
        "decode_contiguous": lambda: numba_flash.decode(qd, kcc, vcc, cache_seqlens=lens),
        "decode_run": lambda: plan.run(qd, kc, vc, lens, table, out=out_d),
        "decode_append_rotary": lambda: numba_flash.decode(
            qd, kcc, vcc, cache_seqlens=lens, k_new=kn, v_new=vn, rotary_cos=cos,
            rotary_sin=sin, causal=True),
        "append_kv": lambda: numba_flash.append_kv(kcc, vcc, kn, vn, cache_seqlens=lens),
        "apply_rotary": lambda: numba_flash.apply_rotary(kn, cos, sin, seqlen_offsets=lens),
        "merge_states": lambda: numba_flash.merge_states(parts_o, parts_l),
    }


def library_calls(stats, standin):
    """Python function calls (builtins included) the calls made, less the stand-in device's own
    work: a call *to* one of its functions counts once (as a call to CuPy's would), the calls
    made *inside* it do not (its bookkeeping is no part of the library's cost, and its memory
    registry's occasional pruning would make the figure vary)."""
    total = stats.total_calls
    if not standin:
        return total
    inside = 0
    for func, (_cc, _nc, _tt, _ct, callers) in stats.stats.items():
        for caller, counts in callers.items():
            if caller[0].endswith("standin.py"):
                inside += counts[1] if isinstance(counts, tuple) else counts
    return total - inside


def measure(fn, calls, standin):
    """``{"us", "calls", "syncs", "allocations"}`` of steady calls of ``fn``."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    total = library_calls(pstats.Stats(prof), standin is not None)
    row = {"us": round(statistics.median(times) * 1e6, 2), "calls": round(total / calls, 1),
           "syncs": None, "allocations": None}
    if standin is not None:
        with standin.count() as c:
            fn()
        row["syncs"], row["allocations"] = c.syncs + c.d2h, c.allocations
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("standin", "cupy"), default="standin")
    ap.add_argument("--calls", type=int, default=1000, help="timed calls per op (>= 1000)")
    ap.add_argument("--ops", nargs="*", help="only these ops")
    ap.add_argument("--json", action="store_true", help="one JSON object a line per op")
    args = ap.parse_args(argv)
    if args.device == "cupy":
        import cupy as xp

        standin = None
    else:
        import numba_flash.standin as xp

        standin = xp
    rng = np.random.default_rng(0)
    cases = _cases(xp, rng)
    rows = []
    for name, fn in cases.items():
        if args.ops and name not in args.ops:
            continue
        if standin is not None:
            with standin.device():
                row = measure(fn, args.calls, standin)
        else:
            row = measure(fn, args.calls, None)
        row = {"op": name, "device": args.device, **row}
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print(f"{'op':24} {'us':>9} {'calls':>7} {'syncs':>6} {'allocs':>7}")
        for r in rows:
            print(f"{r['op']:24} {r['us']:9.1f} {r['calls']:7.1f} {str(r['syncs']):>6} "
                  f"{str(r['allocations']):>7}")
    return rows


if __name__ == "__main__":
    main()
