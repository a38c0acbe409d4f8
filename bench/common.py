"""Shared measuring tools for the benchmarks in bench/ (not part of the package).

* :func:`time_gpu` - median milliseconds of a callable with CUDA events after warm-up.
* :func:`time_host` - median wall-clock milliseconds (the simulator: it times Python threads).
* :func:`attention_flops` - flash-attn's convention: 4*B*H*Nq*Nk*d forward, halved for causal.
* :func:`copy_bandwidth` - measured device-to-device copy bandwidth in GB/s (read + write).
* :func:`peers` - which baselines (torch SDPA, CuPy) can run here.
* :func:`print_table` - a plain Markdown table, so output pastes into docs/performance.md.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numba_flash  # noqa: E402  (chooses the backend before numba.cuda is imported)
from numba import cuda  # noqa: E402


def on_gpu():
    return numba_flash.backend() == "cuda"


def device_name():
    """The current CUDA device's name (numba-cuda returns bytes in some versions, str in others)."""
    name = cuda.get_current_device().name
    return name.decode() if isinstance(name, bytes) else str(name)


def time_host(fn, repeat=3, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_gpu(fn, repeat=20, warmup=3):
    """Median ms of ``fn()`` between CUDA events on the default stream, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = cuda.event(), cuda.event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(cuda.event_elapsed_time(start, end))
    return statistics.median(times)


def attention_flops(b, h, nq, nk, d, causal=False, backward=False):
    """FLOPs of attention by flash-attn's convention (2 matmuls of 2*Nq*Nk*d each)."""
    f = 4.0 * b * h * nq * nk * d
    if causal:
        f /= 2
    if backward:
        f *= 2.5
    return f


def copy_bandwidth(nbytes=1 << 30, repeat=10):
    """Device-to-device copy bandwidth in GB/s, counting read + write bytes (CuPy if present)."""
    try:
        import cupy as cp
    except ImportError:
        import numpy as np

        a = cuda.device_array(nbytes // 4, np.float32)
        b = cuda.device_array(nbytes // 4, np.float32)
        ms = time_gpu(lambda: b.copy_to_device(a), repeat=repeat)
        return 2 * nbytes / ms / 1e6
    a = cp.empty(nbytes // 4, cp.float32)
    b = cp.empty_like(a)
    ms = time_gpu(lambda: b.__setitem__(Ellipsis, a), repeat=repeat)
    return 2 * nbytes / ms / 1e6


def peers():
    """Names of the baselines importable here: 'torch' (CUDA build with a GPU) and 'cupy'."""
    out = []
    try:
        import torch

        if torch.cuda.is_available():
            out.append("torch")
    except ImportError:
        pass
    try:
        import cupy  # noqa: F401

        if on_gpu():
            out.append("cupy")
    except ImportError:
        pass
    return out


def print_table(rows, columns):
    """Print ``rows`` (dicts) as a Markdown table with the given column order."""
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("---" for _ in columns) + "|")
    for r in rows:
        cells = []
        for c in columns:
            v = r.get(c, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")
