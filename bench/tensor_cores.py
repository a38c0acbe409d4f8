"""Benchmark the tensor-core kernels beside the SIMT kernels and torch SDPA, float16, same run.

For each row (float16, d in {64, 128}, causal off and on, N from 1024 to 16384 for the forward and
to 8192 for the backward, B * N = 16384 tokens, H = 16) it times, one after another in one
process: ``numba_flash.forward(kernel="simt")``, ``forward(kernel="mma")`` and
``torch.nn.functional.scaled_dot_product_attention`` (and the same three for the backward:
``numba_flash.backward(kernel=...)`` and torch autograd through SDPA), median of CUDA-event
timings after warm-up, TFLOP/s by flash-attn's convention (:func:`bench.common.attention_flops`).
``mma/simt`` is the tensor-core speed-up, ``mma/torch`` the fraction of torch's speed; each row
also gives ``max|o_mma - o_torch|`` (forward) or ``max|dq_mma - dq_simt|`` (backward) as a spot
check.  Goals (issue 11, H200): forward d=128 N=4096 non-causal >= 150 TFLOP/s, backward >= 60.

In the simulator it runs one tiny configuration of each and says so: those milliseconds time
Python threads, not a GPU.

    python bench/tensor_cores.py [--quick] [--forward-only | --backward-only]
                                 [--max-seconds S] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

from common import attention_flops, on_gpu, peers, print_table, time_gpu, time_host

import numba_flash  # noqa: E402  (common imported it first: the backend is chosen)

TOKENS = 16384
HEADS = 16
FORWARD_NS = (1024, 2048, 4096, 8192, 16384)
BACKWARD_NS = (1024, 2048, 4096, 8192)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="N = 4096 only")
    part = ap.add_mutually_exclusive_group()
    part.add_argument("--forward-only", action="store_true")
    part.add_argument("--backward-only", action="store_true")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="stop starting new configurations after this many seconds")
    ap.add_argument("--repeat", type=int, default=10, help="timed runs per measurement")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    return ap.parse_args(argv)


def configs(ns, quick):
    for d in (64, 128):
        for causal in (False, True):
            for n in ((4096,) if quick else ns):
                yield d, causal, n


def ratios(row):
    if row.get("simt TFLOP/s"):
        row["mma/simt"] = row["mma TFLOP/s"] / row["simt TFLOP/s"]
    if isinstance(row.get("torch TFLOP/s"), float):
        row["mma/torch"] = row["mma TFLOP/s"] / row["torch TFLOP/s"]
    return row


def run_gpu_forward(args, t_start):
    import cupy as cp

    has_torch = "torch" in peers()
    rows = []
    for d, causal, n in configs(FORWARD_NS, args.quick):
        if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
            print(f"(stopped after {args.max_seconds:g} s: --max-seconds)")
            break
        b = max(1, TOKENS // n)
        rng = cp.random.default_rng(0)
        q, k, v = (rng.standard_normal((b, HEADS, n, d), dtype=cp.float32).astype(cp.float16)
                   for _ in range(3))
        flops = attention_flops(b, HEADS, n, n, d, causal=causal)
        row = {"pass": "forward", "dtype": "float16", "d": d, "causal": causal, "B": b,
               "H": HEADS, "N": n}
        outs = {}
        for kernel in ("simt", "mma"):
            fn = lambda kernel=kernel: numba_flash.forward(q, k, v, causal=causal,  # noqa: E731
                                                           kernel=kernel)
            outs[kernel] = fn()
            row[f"{kernel} TFLOP/s"] = flops / time_gpu(fn, repeat=args.repeat) / 1e9
        if has_torch:
            import torch
            import torch.nn.functional as F

            tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
            fn = lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)  # noqa: E731
            ref = cp.asarray(fn())
            row["torch TFLOP/s"] = flops / time_gpu(fn, repeat=args.repeat) / 1e9
            row["max|o_mma-o_torch|"] = float(cp.abs(outs["mma"].astype(cp.float32)
                                                     - ref.astype(cp.float32)).max())
        rows.append(ratios(row))
        print(json.dumps(row), flush=True)
        q = k = v = outs = None  # free before the next configuration allocates
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def run_gpu_backward(args, t_start):
    import cupy as cp

    has_torch = "torch" in peers()
    rows = []
    for d, causal, n in configs(BACKWARD_NS, args.quick):
        if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
            print(f"(stopped after {args.max_seconds:g} s: --max-seconds)")
            break
        b = max(1, TOKENS // n)
        rng = cp.random.default_rng(0)
        q, k, v, do = (rng.standard_normal((b, HEADS, n, d), dtype=cp.float32)
                       .astype(cp.float16) for _ in range(4))
        o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True, kernel="mma")
        flops = attention_flops(b, HEADS, n, n, d, causal=causal, backward=True)
        row = {"pass": "backward", "dtype": "float16", "d": d, "causal": causal, "B": b,
               "H": HEADS, "N": n}
        grads = {}
        for kernel in ("simt", "mma"):
            fn = lambda kernel=kernel: numba_flash.backward(  # noqa: E731
                do, q, k, v, o, lse, causal=causal, kernel=kernel)
            grads[kernel] = fn()
            row[f"{kernel} TFLOP/s"] = flops / time_gpu(fn, repeat=max(3, args.repeat // 2),
                                                        warmup=1) / 1e9
        row["max|dq_mma-dq_simt|"] = float(cp.abs(grads["mma"][0].astype(cp.float32)
                                                  - grads["simt"][0].astype(cp.float32)).max())
        if has_torch:
            import torch
            import torch.nn.functional as F

            tq, tk, tv = (torch.as_tensor(x, device="cuda").requires_grad_(True)
                          for x in (q, k, v))
            tdo = torch.as_tensor(do, device="cuda")
            out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
            fn = lambda: torch.autograd.grad(out, (tq, tk, tv), tdo,  # noqa: E731
                                             retain_graph=True)
            row["torch TFLOP/s"] = flops / time_gpu(fn, repeat=max(3, args.repeat // 2),
                                                    warmup=1) / 1e9
        rows.append(ratios(row))
        print(json.dumps(row), flush=True)
        q = k = v = do = o = lse = grads = None  # free before the next configuration
        cp.get_default_memory_pool().free_all_blocks()
    return rows


def run_simulator(args):
    """One tiny configuration per pass, to show the script runs (not a GPU measurement)."""
    rng = np.random.default_rng(0)
    b, h, n, d = 1, 1, 16, 16
    q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(np.float16) for _ in range(4))
    rows = []
    if not args.backward_only:
        row = {"pass": "forward", "dtype": "float16", "d": d, "causal": False, "B": b, "H": h,
               "N": n, "backend": "simulator"}
        for kernel in ("simt", "mma"):
            ms = time_host(lambda kernel=kernel: numba_flash.forward(q, k, v, kernel=kernel),
                           repeat=1, warmup=0)
            row[f"{kernel} TFLOP/s"] = attention_flops(b, h, n, n, d) / ms / 1e9
        rows.append(ratios(row))
    if not args.forward_only:
        from numba_flash.ops.forward_mma import forward_mma

        o, lse = forward_mma(q, k, v, return_lse=True)
        row = {"pass": "backward", "dtype": "float16", "d": d, "causal": False, "B": b, "H": h,
               "N": n, "backend": "simulator"}
        for kernel in ("simt", "mma"):
            ms = time_host(lambda kernel=kernel: numba_flash.backward(do, q, k, v, o, lse,
                                                                      kernel=kernel),
                           repeat=1, warmup=0)
            row[f"{kernel} TFLOP/s"] = attention_flops(b, h, n, n, d, backward=True) / ms / 1e9
        rows.append(ratios(row))
    print("Timed the Numba CUDA SIMULATOR (no GPU here): these figures say nothing about GPU "
          "performance.")
    return rows


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    if on_gpu():
        rows = []
        if not args.backward_only:
            rows += run_gpu_forward(args, t_start)
        if not args.forward_only:
            rows += run_gpu_backward(args, t_start)
    else:
        rows = run_simulator(args)
    columns = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    print_table(rows, columns)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=lambda x: None if isinstance(x, float)
                      and math.isnan(x) else str(x))
    return rows


if __name__ == "__main__":
    main()
