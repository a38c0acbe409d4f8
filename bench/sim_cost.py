"""Measure the simulator's cost per kernel family and fit :data:`numba_flash.frontend.sim_time.
SIM_COST` (the estimate behind ``SlowSimulatorWarning``).

Each family's launches are timed as the process's CPU time (``time.process_time``) around the
launch, on small shapes, and ``seconds ~ threads * a + elems * b + steps * c`` is fitted by
non-negative least squares on the relative error (``scipy.optimize.nnls``).  Run it on a quiet
machine: the fitted constants are that machine's.  The printed table is what
``numba_flash/frontend/sim_time.py`` holds, with each family's launch count and the range of
``estimate / measured`` over its launches::

    NUMBA_ENABLE_CUDASIM=1 python bench/sim_cost.py            # every family (~4 min)
    NUMBA_ENABLE_CUDASIM=1 python bench/sim_cost.py forward    # families containing "forward"
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings

import numpy as np

import numba_flash
import numba_flash.frontend.arrays as arrays
from numba_flash import SlowSimulatorWarning
from numba_flash.frontend.sim_time import SIM_COST, threads_of


def _record(records):
    real = arrays.ArrayCall.launch

    def timed(self, kernel, grid, block, *args, work=None, **kw):
        t0 = time.process_time()
        real(self, kernel, grid, block, *args, work=work, **kw)
        if work is not None:
            records[work.family].append((threads_of(grid, block), int(work.elems),
                                         int(work.steps), time.process_time() - t0))

    arrays.ArrayCall.launch = timed


def _workloads():
    """The shapes each family is measured on (small: the whole run takes minutes)."""
    rng = np.random.default_rng(0)

    def r(*shape, dtype=np.float32):
        return rng.standard_normal(shape).astype(dtype)

    for h, n, d, causal in ((1, 16, 16, False), (1, 64, 16, False), (2, 32, 32, True),
                            (1, 128, 16, True), (1, 32, 64, False), (1, 16, 128, False)):
        yield "forward", lambda h=h, n=n, d=d, c=causal: numba_flash.forward(
            r(1, h, n, d), r(1, h, n, d), r(1, h, n, d), causal=c)
    lens = np.array([0, 20, 52], np.int32)
    yield "forward (varlen)", lambda: numba_flash.forward_varlen(
        r(52, 2, 16), r(52, 2, 16), r(52, 2, 16), cu_seqlens_q=lens, cu_seqlens_k=lens,
        max_seqlen_q=32, max_seqlen_k=32)
    for n, d in ((16, 16), (64, 16), (32, 64), (128, 32)):
        yield "forward_mma", lambda n=n, d=d: numba_flash.forward(
            r(1, 1, n, d, dtype=np.float16), r(1, 1, n, d, dtype=np.float16),
            r(1, 1, n, d, dtype=np.float16), kernel="mma")
    for hq, hk, n, d, causal, det in ((1, 1, 16, 16, False, True), (1, 1, 32, 16, True, False),
                                      (2, 1, 32, 32, True, True), (1, 1, 64, 16, False, False),
                                      (1, 1, 32, 64, True, True), (1, 1, 48, 32, False, True)):
        def bwd(hq=hq, hk=hk, n=n, d=d, c=causal, det=det):
            q, k, v, do = r(1, hq, n, d), r(1, hk, n, d), r(1, hk, n, d), r(1, hq, n, d)
            o, lse = numba_flash.forward(q, k, v, causal=c, return_lse=True)
            numba_flash.backward(do, q, k, v, o, lse, causal=c, deterministic=det)
        yield "backward", bwd
    for n, d, det in ((16, 16, True), (32, 32, False), (64, 16, True), (32, 64, True),
                      (48, 16, False)):
        def bwd_mma(n=n, d=d, det=det):
            q, k, v, do = (r(1, 1, n, d, dtype=np.float16) for _ in range(4))
            o, lse = numba_flash.forward(q, k, v, return_lse=True, kernel="mma")
            numba_flash.backward(do, q, k, v, o, lse, kernel="mma", deterministic=det)
        yield "backward_mma", bwd_mma
    for b, h, n, d in ((1, 1, 16, 16), (2, 2, 64, 32), (1, 4, 256, 64), (2, 1, 128, 16)):
        def dec(b=b, h=h, n=n, d=d):
            numba_flash.decode(r(b, h, 1, d), r(b, h, n, d), r(b, h, n, d),
                               cache_seqlens=np.full(b, n, np.int32), num_splits=2)
        yield "decode", dec
    for rows, n in ((4, 16), (16, 64), (8, 300), (64, 32)):
        yield "softmax", lambda rows=rows, n=n: numba_flash.softmax(r(rows, n))


def fit(rows):
    """``(a, b, c)`` minimising the relative error of ``threads a + elems b + steps c``, and
    the range of ``estimate / measured`` over the rows."""
    from scipy.optimize import nnls

    a = np.array([[t, e, s] for t, e, s, _ in rows], np.float64)
    y = np.array([sec for *_, sec in rows], np.float64)
    cols = a.any(axis=0)  # a column that is zero everywhere stays zero
    x = np.zeros(3)
    x[cols] = nnls(a[:, cols] / y[:, None], np.ones(len(y)))[0]
    ratio = a @ x / y
    return x, ratio.min(), ratio.max()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("select", nargs="?", default="", help="only workloads containing this text")
    args = ap.parse_args(argv)
    if numba_flash.backend() != "simulator":
        raise SystemExit("run with NUMBA_ENABLE_CUDASIM=1: this measures the simulator")
    records = collections.defaultdict(list)
    _record(records)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowSimulatorWarning)
        for name, run in _workloads():
            if args.select in name:
                run()
    print(f"{'family':22s} {'launches':>8s}  {'per thread':>10s} {'per elem':>10s} "
          f"{'per step':>10s}  est/measured   (committed: est/measured)")
    for family, rows in sorted(records.items()):
        (a, b, c), lo, hi = fit(rows)
        old = SIM_COST.get(family)
        if old is not None:
            ratios = [(t * old[0] + e * old[1] + s * old[2]) / sec for t, e, s, sec in rows]
            was = f"{min(ratios):.2f}-{max(ratios):.2f}"
        else:
            was = "-"
        print(f"{family:22s} {len(rows):8d}  {a:10.2g} {b:10.2g} {c:10.2g}  "
              f"{lo:.2f}-{hi:.2f}      ({was})")


if __name__ == "__main__":
    main()
