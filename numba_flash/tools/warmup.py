"""``numba-flash warmup``: compile the catalog's configurations ahead, through the kernels' disk
cache (:func:`numba_flash.kernels.core.jit.kernel_jit`), so a first call does not wait for them.
"""

from __future__ import annotations

import time

from . import catalog

__all__ = ["warmup_configs", "warm_up"]


def warmup_configs(select=None, everything=False):
    """The compile-tier configurations to compile ahead: by default every configuration of the
    public ops for float16, bfloat16 and float32; ``everything`` adds float64 and the teaching
    kernels (:data:`~numba_flash.tools.catalog.TEACHING`); ``select`` keeps names containing that
    text."""
    for source in catalog.SOURCES:
        if not everything and source in catalog.TEACHING:
            continue
        for cfg in source():
            if not everything and "float64" in cfg["name"]:
                continue
            if select and select not in cfg["name"]:
                continue
            yield cfg


def _disk_cached(kernel):
    """True for a kernel with numba's disk cache attached (``kernel_jit`` or ``cache=True``)."""
    cache = getattr(kernel, "_cache", None)
    return cache is not None and type(cache).__name__ != "NullCache"


def _cache_hits(kernel):
    stats = getattr(kernel, "stats", None)
    return sum(stats.cache_hits.values()) if stats is not None else 0


def warm_up(configs, report=print):
    """Compile each configuration for this process's GPU, through the disk cache.

    ``report(i, n, name, seconds, source)`` is called after each one, ``source`` being
    ``"compiled"``, ``"cache"`` (loaded from disk), ``"in memory"`` or ``"compiled (no disk
    cache)"`` for a kernel still decorated with plain ``cuda.jit``.  Returns the list of
    ``(name, seconds, source)``.
    """
    configs = list(configs)
    done = []
    for i, cfg in enumerate(configs, 1):
        kernel, sig = cfg["kernel"], tuple(cfg["args"])
        in_memory = sig in getattr(kernel, "overloads", {})
        hits = _cache_hits(kernel)
        t0 = time.perf_counter()
        kernel.compile(sig)
        seconds = time.perf_counter() - t0
        if in_memory:
            source = "in memory"
        elif _cache_hits(kernel) > hits:
            source = "cache"
        else:
            source = "compiled" if _disk_cached(kernel) else "compiled (no disk cache)"
        done.append((cfg["name"], seconds, source))
        report(i, len(configs), cfg["name"], seconds, source)
    return done
