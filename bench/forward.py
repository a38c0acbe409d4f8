"""Benchmark ``numba_flash.forward`` (TFLOP/s) beside torch SDPA and a naive CuPy attention.

On a GPU: for N in 512..16384 (Nq = Nk = N), d in {64, 128}, causal off and on, float32 and
float16, with B * N = 16384 tokens and H = 16 heads, report the median time (CUDA events) and
TFLOP/s by flash-attn's convention (``4 B H N^2 d``, halved for causal;
:func:`bench.common.attention_flops`), next to ``torch.nn.functional.scaled_dot_product_attention``
and a naive CuPy attention (``matmul + softmax + matmul``, skipped where its N x N scores do not
fit the memory budget) when they are installed.  Each row also gives ``max|o - ref|`` against
torch SDPA (or CuPy) as a spot check of the result.

``--dtype e4m3`` times FA3's fp8 forward (CuPy uint8 inputs with ``qkv_dtype="fp8_e4m3"``,
``o`` float16; ``--kernel wgmma`` for the Hopper build, else ``mma.sync``) beside the peers on
float16 copies of the same values, TFLOP/s by the same convention.

``--kernel simt|mma|wgmma|auto`` picks the kernel (``numba_flash.forward(kernel=...)``;
``auto``, the default, runs float16 on tensor cores on compute capability >= 8.0; ``wgmma`` the
warpgroup forward, compute capability 9.0); each row names the kernel that ran.

``--windowed`` runs the sliding-window rows instead: causal local attention ``window_size = (W
- 1, 0)`` for W in {128, 512, 2048} and N in {2048, 8192, 32768} (d = 64), beside causal full
attention at the same N.  K/V tiles outside the band are never loaded, so the time per query
token (``us/token``: ms over B * H * N) grows with the window and stays flat in N, while causal
full attention's grows linearly with N.  FLOPs count the visible (query, key) pairs exactly
(:func:`window_flops`).  No peer runs these rows (torch SDPA has no sliding window short of an
N x N mask).

In the simulator it runs one small configuration and says so: those milliseconds time Python
threads, not a GPU.

    python bench/forward.py [--quick] [--max-seconds S] [--n 1024,4096] [--d 64]
                            [--dtype float32] [--causal both|on|off] [--kernel auto]
                            [--windowed] [--json PATH]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time

import numpy as np

from common import (attention_flops, device_name, on_gpu, peers, print_table, time_gpu,
                    time_host)

import numba_flash  # noqa: E402  (common imported it first: the backend is chosen)

TOKENS = 16384          # B * N per configuration
HEADS = 16
NAIVE_BYTES = 24 << 30  # skip the naive CuPy attention when its scores would exceed this


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N in {1024, 4096}, d = 64 only")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop starting new configurations after this many seconds")
    ap.add_argument("--n", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--d", default=None, help="comma-separated head dims")
    ap.add_argument("--dtype", default="float32,float16", help="comma-separated dtypes")
    ap.add_argument("--causal", choices=("both", "on", "off"), default="both")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per measurement")
    ap.add_argument("--kernel", choices=("auto", "simt", "mma", "wgmma"), default="auto",
                    help="numba_flash.forward(kernel=...) (wgmma: float16 / bfloat16 on "
                         "compute capability 9.0)")
    ap.add_argument("--windowed", action="store_true",
                    help="sliding-window rows: time grows with the window, not with N")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    return ap.parse_args(argv)


def sweep(args):
    ns = [512, 1024, 2048, 4096, 8192, 16384]
    ds = [64, 128]
    if args.quick:
        ns, ds = [1024, 4096], [64]
    if args.n:
        ns = [int(x) for x in args.n.split(",")]
    if args.d:
        ds = [int(x) for x in args.d.split(",")]
    causals = {"both": [False, True], "on": [True], "off": [False]}[args.causal]
    dtypes = [bench_dtype(x) for x in args.dtype.split(",")]
    for dtype in dtypes:
        for d in ds:
            for causal in causals:
                for n in ns:
                    yield dtype, d, causal, n


def bench_dtype(name):
    """A ``--dtype`` entry as a NumPy dtype: ``e4m3`` is ``ml_dtypes.float8_e4m3fn`` (FA3's fp8
    inputs, on the device as uint8 bytes with ``qkv_dtype="fp8_e4m3"``)."""
    if name == "e4m3":
        import ml_dtypes

        return np.dtype(ml_dtypes.float8_e4m3fn)
    return np.dtype(name)


def fp8_inputs(rng_host, shape):
    """``(bytes, float16)``: e4m3 values of a standard normal as CuPy uint8 (ours) and the same
    values in float16 for the peers (every e4m3 value is a float16 one)."""
    import cupy as cp
    import ml_dtypes

    x = rng_host.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.float8_e4m3fn)
    return cp.asarray(x.view(np.uint8)), cp.asarray(x.astype(np.float16))


WINDOWS = (128, 512, 2048)
WINDOW_NS = (2048, 8192, 32768)


def window_flops(b, h, n, d, w):
    """4 * B * H * d * (visible (query, key) pairs) for Nq = Nk = n and window (w - 1, 0); w =
    None: causal full attention (the same count as flash-attn's halved convention plus the
    diagonal)."""
    i = np.arange(n, dtype=np.int64)
    pairs = int(np.minimum(i + 1, w).sum()) if w is not None else n * (n + 1) // 2
    return 4 * b * h * d * pairs


def windowed_sweep(args):
    dtypes = [np.dtype(x) for x in args.dtype.split(",")]
    ns = [int(x) for x in args.n.split(",")] if args.n else list(WINDOW_NS)
    for dtype in dtypes:
        for w in (*WINDOWS, None):  # None: causal full attention, the contrast
            for n in ns:
                yield dtype, 64, w, n


def kernel_ran(args, dtype):
    """Which kernel ``numba_flash.forward(kernel=args.kernel)`` runs for this dtype."""
    from numba_flash.frontend.kernel_choice import check_forward_kernel as check_kernel

    return check_kernel(args.kernel, dtype, False)


# -- peers ----------------------------------------------------------------------------------------
def torch_sdpa(q, k, v, causal, scale):
    import torch
    import torch.nn.functional as F

    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))

    def run():
        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal, scale=scale)

    return run


def cupy_naive(q, k, v, causal, scale):
    import cupy as cp

    n = q.shape[2]
    mask = cp.triu(cp.ones((n, n), dtype=bool), k=1) if causal else None  # Nq = Nk here

    def run():
        s = cp.matmul(q, k.swapaxes(-1, -2)).astype(cp.float32) * cp.float32(scale)
        if mask is not None:
            s = cp.where(mask, cp.float32(-cp.inf), s)
        s -= s.max(axis=-1, keepdims=True)
        p = cp.exp(s)
        p /= p.sum(axis=-1, keepdims=True)
        return cp.matmul(p.astype(q.dtype), v)

    return run


def max_diff(a, b):
    import cupy as cp

    return float(cp.abs(cp.asarray(a).astype(cp.float32) - cp.asarray(b).astype(cp.float32)).max())


# -- GPU ------------------------------------------------------------------------------------------
def run_gpu(args):
    import cupy as cp

    have = peers()
    rows = []
    t_start = time.perf_counter()
    for dtype, d, causal, n in sweep(args):
        if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
            print(f"(stopped after {args.max_seconds:g} s: --max-seconds)")
            break
        b = max(1, TOKENS // n)
        rng = cp.random.default_rng(0)
        scale = 1.0 / math.sqrt(d)
        flops = attention_flops(b, HEADS, n, n, d, causal=causal)
        if dtype.itemsize == 1:   # e4m3: ours on the bytes, the peers on float16 of the values
            host = np.random.default_rng(0)
            (q8, q), (k8, k), (v8, v) = (fp8_inputs(host, (b, HEADS, n, d)) for _ in range(3))
            fp8_kernel = args.kernel if args.kernel in ("mma", "wgmma") else "auto"   # (no simt)
            ours = functools.partial(numba_flash.forward, q8, k8, v8, causal=causal,
                                     kernel=fp8_kernel, qkv_dtype="fp8_e4m3",
                                     out_dtype="float16")
            ran = "wgmma e4m3" if args.kernel == "wgmma" else "mma e4m3"
        else:
            q, k, v = (rng.standard_normal((b, HEADS, n, d), dtype=cp.float32).astype(dtype)
                       for _ in range(3))
            ours = functools.partial(numba_flash.forward, q, k, v, causal=causal,
                                     kernel=args.kernel)
            ran = kernel_ran(args, dtype)
        o = ours()
        ms = time_gpu(ours, repeat=args.repeat)
        row = {"dtype": dtype.name, "d": d, "causal": causal, "B": b, "H": HEADS, "N": n,
               "kernel": ran, "ms": ms, "TFLOP/s": flops / ms / 1e9}
        ref_out = None
        if "torch" in have:
            fn = torch_sdpa(q, k, v, causal, scale)
            ref_out = fn()
            row["torch TFLOP/s"] = flops / time_gpu(fn, repeat=args.repeat) / 1e9
        if "cupy" in have:
            itemsize = 4  # the naive scores are float32
            if 3 * b * HEADS * n * n * itemsize <= NAIVE_BYTES:
                fn = cupy_naive(q, k, v, causal, scale)
                if ref_out is None:
                    ref_out = fn()
                row["cupy TFLOP/s"] = flops / time_gpu(fn, repeat=args.repeat) / 1e9
                cp.get_default_memory_pool().free_all_blocks()
            else:
                row["cupy TFLOP/s"] = "-"
        if ref_out is not None:
            row["max|o-ref|"] = max_diff(o, ref_out)
        rows.append(row)
        print(f"  {row}", flush=True)
        del q, k, v, o, ref_out
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def run_gpu_windowed(args):
    import cupy as cp

    rows = []
    t_start = time.perf_counter()
    for dtype, d, w, n in windowed_sweep(args):
        if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
            print(f"(stopped after {args.max_seconds:g} s: --max-seconds)")
            break
        b = max(1, TOKENS // n)
        rng = cp.random.default_rng(0)
        q, k, v = (rng.standard_normal((b, HEADS, n, d), dtype=cp.float32).astype(dtype)
                   for _ in range(3))
        window = (w - 1, 0) if w is not None else (-1, -1)
        ours = functools.partial(numba_flash.forward, q, k, v, causal=True, window_size=window,
                                 kernel=args.kernel)
        ours()
        ms = time_gpu(ours, repeat=args.repeat)
        row = {"dtype": dtype.name, "d": d, "window": w if w is not None else "causal",
               "B": b, "H": HEADS, "N": n, "kernel": kernel_ran(args, dtype), "ms": ms,
               "us/token": ms * 1e3 / (b * HEADS * n),
               "TFLOP/s": window_flops(b, HEADS, n, d, w) / ms / 1e9}
        rows.append(row)
        print(f"  {row}", flush=True)
        del q, k, v
        cp.get_default_memory_pool().free_all_blocks()
    return rows


# -- simulator ------------------------------------------------------------------------------------
def run_simulator(args):
    b, h, n, d = 1, 1, 32, 16
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((b, h, n, d)).astype(np.float32) for _ in range(3))
    rows = []
    if args.windowed:
        for w in (4, 16, None):
            window = (w - 1, 0) if w is not None else (-1, -1)
            run = lambda: numba_flash.forward(q, k, v, causal=True, window_size=window)  # noqa: E731
            ms = time_host(run, repeat=1)
            want = numba_flash.reference.attention(q, k, v, causal=True, window_size=window)[0]
            rows.append({"dtype": "float32", "d": d, "window": w if w is not None else "causal",
                         "B": b, "H": h, "N": n, "ms (simulator)": ms,
                         "max|o-ref|": float(np.abs(run() - want).max())})
        print("No GPU: timed the Numba CUDA simulator (Python threads), one small configuration.")
        print("These milliseconds say nothing about GPU performance.\n")
        return rows
    for causal in (False, True):
        ms = time_host(lambda: numba_flash.forward(q, k, v, causal=causal), repeat=1)
        o = numba_flash.forward(q, k, v, causal=causal)
        err = float(np.abs(o - numba_flash.reference.attention(q, k, v, causal=causal)[0]).max())
        rows.append({"dtype": "float32", "d": d, "causal": causal, "B": b, "H": h, "N": n,
                     "ms (simulator)": ms, "max|o-ref|": err})
    print("No GPU: timed the Numba CUDA simulator (Python threads), one small configuration.")
    print("These milliseconds say nothing about GPU performance.\n")
    return rows


def main(argv=None):
    args = parse_args(argv)
    if on_gpu():
        try:
            import cupy  # noqa: F401
        except ImportError:
            raise SystemExit("bench/forward.py on a GPU needs CuPy for its inputs: pip install "
                             "cupy-cuda12x (or cupy-cuda13x)")
        print(f"GPU: {device_name()}; peers: {peers() or 'none'}")
        if args.windowed:
            rows = run_gpu_windowed(args)
            cols = ["dtype", "d", "window", "B", "H", "N", "kernel", "ms", "us/token", "TFLOP/s"]
        else:
            rows = run_gpu(args)
            cols = ["dtype", "d", "causal", "B", "H", "N", "kernel", "ms", "TFLOP/s",
                    "torch TFLOP/s", "cupy TFLOP/s", "max|o-ref|"]
    else:
        rows = run_simulator(args)
        cols = ["dtype", "d", "window" if args.windowed else "causal", "B", "H", "N",
                "ms (simulator)", "max|o-ref|"]
    print()
    print_table(rows, cols)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"backend": numba_flash.backend(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
