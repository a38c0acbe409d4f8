"""Fill the on-disk kernel cache in parallel: ``numba-flash warmup``'s configurations compiled
across processes, so the device tests and benchmarks that follow load kernels instead of
compiling them.

    python bench/kernel_warmup.py [--jobs N] [--all] [-k TEXT] [--events FILE] [--json FILE]
    python bench/kernel_warmup.py --dry-run --limit 8     # the simulator: resolve, compile nothing

``numba-flash warmup`` (:mod:`numba_flash.tools.warmup`) compiles its configurations one after
another in one process (about 2 s each on an H200: 250 of them, 342 with ``--all``, take
minutes).  Here a pool of ``--jobs`` processes (default: every core) takes them one at a time,
the heaviest-looking first (warpgroup, backward, MLA, wide head dims: :func:`weight`), each
through :func:`numba_flash.tools.warmup.warm_up` and the kernels' disk cache
(:mod:`numba_flash.kernels.core.jit`, safe across processes).  The cache is where every later
process looks: ``NUMBA_CACHE_DIR`` when set, else next to the package's sources.

Each finished configuration is one JSON line of ``--events`` (flushed, so a run stopped at its
time limit keeps what it did) and one printed line; ``--json`` gets the summary at the end.  A
worker that dies (a crash in a compile) takes its configuration with it: the pool is started
again for the rest, at most twice.  In the simulator (``--dry-run``, or no GPU) nothing is
compiled: each worker looks its configurations up by name (the same listing and hand-out as on
a GPU) and reports ``simulator``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_WORKER = {}


def weight(name):
    """A guess at a configuration's compile time, to hand the heavy ones out first."""
    w = 1.0
    for token, extra in (("wgmma", 6), ("backward", 2), ("dkdv", 1), ("mla", 3), ("fp8", 1),
                         ("e4m3", 1), ("D256", 2), ("D128", 1), ("dropout", 1), ("mods", 1),
                         ("varlen", 0.5), ("sparse", 1)):
        if token in name:
            w += extra
    return w


def _configs(select, everything):
    """``{name: configuration}``, listed once per process (a forked worker inherits it)."""
    key = (select, everything)
    if _WORKER.get("key") != key:
        sys.path.insert(0, str(ROOT))
        from numba_flash.tools import warmup

        _WORKER["configs"] = {cfg["name"]: cfg
                              for cfg in warmup.warmup_configs(select, everything)}
        _WORKER["key"] = key
    return _WORKER["configs"]


def list_names(select=None, everything=False):
    return list(_configs(select, everything))


def _init(select, everything, dry):
    sys.path.insert(0, str(ROOT))
    import numba_flash

    _WORKER["dry"] = dry or numba_flash.backend() != "cuda"
    _configs(select, everything)


def _compile(name):
    """One configuration in a worker: ``(name, seconds, source, pid, error)``."""
    from numba_flash.tools import warmup

    cfg = _WORKER["configs"].get(name)
    if cfg is None:
        return name, 0.0, "missing", os.getpid(), "no configuration of that name in the worker"
    if _WORKER["dry"]:
        ok = hasattr(cfg["kernel"], "py_func") and len(tuple(cfg["args"])) > 0
        return name, 0.0, "simulator", os.getpid(), None if ok else "no kernel or signature"
    t0 = time.perf_counter()
    try:
        (_, seconds, source), = warmup.warm_up([cfg], report=lambda *a: None)
        return name, seconds, source, os.getpid(), None
    except Exception as exc:  # noqa: BLE001  one configuration's failure is reported, not fatal
        return (name, time.perf_counter() - t0, "error", os.getpid(),
                f"{type(exc).__name__}: {str(exc)[:500]}")


def run(names, jobs, select, everything, dry, events=None, say=print):
    """Compile ``names`` on ``jobs`` processes; returns the list of result dicts."""
    import multiprocessing

    order = sorted(names, key=lambda n: -weight(n))
    done = {}
    ev = open(events, "a", buffering=1, encoding="utf-8") if events else None
    t0 = time.time()
    # a GPU run spawns its workers: this process has initialised CUDA (import numba_flash),
    # which a forked child cannot use; the simulator forks (the listing comes along)
    import numba_flash

    sim = dry or numba_flash.backend() != "cuda"
    ctx = multiprocessing.get_context("fork" if sim else "spawn")
    restarts = 0
    while True:
        todo = [n for n in order if n not in done]
        if not todo:
            break
        try:
            with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init,
                                     initargs=(select, everything, sim)) as pool:
                futures = {pool.submit(_compile, n): n for n in todo}
                for fut in as_completed(futures):
                    name, seconds, source, pid, error = fut.result()
                    row = {"name": name, "seconds": round(seconds, 3), "source": source,
                           "pid": pid, "t": round(time.time() - t0, 2)}
                    if error:
                        row["error"] = error
                    done[name] = row
                    if ev:
                        ev.write(json.dumps(row) + "\n")
                    say(f"[{len(done):>4}/{len(order)}] {name:<52} {seconds:7.2f} s  {source}"
                        + (f"  {error}" if error else ""))
        except BrokenProcessPool as exc:
            restarts += 1
            lost = [n for n in todo if n not in done]
            say(f"warmup: a worker died ({exc}); {len(lost)} configurations left")
            if restarts > 2:
                for n in lost:
                    done[n] = {"name": n, "seconds": 0.0, "source": "error",
                               "error": "not compiled: the worker pool broke three times"}
                break
            # the configuration(s) in flight when it died: the first not done, in hand-out order
            victim = lost[0]
            done[victim] = {"name": victim, "seconds": 0.0, "source": "error",
                            "error": f"a worker died compiling it, or one beside it: {exc}"}
    if ev:
        ev.close()
    return [done[n] for n in order if n in done]


def summary(rows, jobs, seconds):
    by = {}
    for r in rows:
        by[r["source"]] = by.get(r["source"], 0) + 1
    slowest = sorted(rows, key=lambda r: -r.get("seconds", 0))[:12]
    return {"configurations": len(rows), "jobs": jobs, "seconds": round(seconds, 1),
            "by_source": by, "compile_seconds_total": round(sum(r.get("seconds", 0)
                                                                for r in rows), 1),
            "errors": [r for r in rows if r.get("error")],
            "slowest": [[r["name"], r.get("seconds", 0)] for r in slowest]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="worker processes (default: every core)")
    ap.add_argument("--all", action="store_true",
                    help="also float64 and the teaching kernels (the kernel tests launch them)")
    ap.add_argument("-k", default=None, metavar="TEXT",
                    help="only configurations whose name contains TEXT")
    ap.add_argument("--limit", type=int, default=None,
                    help="only the first LIMIT configurations (of each kind, heaviest first)")
    ap.add_argument("--dry-run", action="store_true", help="resolve, compile nothing")
    ap.add_argument("--events", help="one JSON line per configuration, as each finishes")
    ap.add_argument("--json", help="the summary as JSON")
    args = ap.parse_args(argv)
    t0 = time.time()
    names = list_names(args.k, args.all)
    if args.limit is not None:   # a spread: every kind of configuration before a second of one
        seen, picked = set(), []
        for n in sorted(names, key=lambda n: -weight(n)):
            kind = " ".join(n.split()[:2])
            if kind not in seen:
                seen.add(kind)
                picked.append(n)
        names = picked[:args.limit]
    jobs = max(1, min(args.jobs, len(names) or 1))
    print(f"warmup: {len(names)} configurations on {jobs} processes"
          + (" (dry run: nothing compiled)" if args.dry_run else ""), flush=True)
    rows = run(names, jobs, args.k, args.all, args.dry_run, args.events,
               say=lambda s: print(s, flush=True))
    res = summary(rows, jobs, time.time() - t0)
    print(f"warmup: {res['by_source']} in {res['seconds']} s "
          f"({res['compile_seconds_total']} s of compiling)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
