"""Attention backward throughput: numba_flash.backward beside torch SDPA's backward.

    python bench/backward.py [--quick] [--json FILE]

On a GPU: TFLOP/s by flash-attn's convention (2.5x the forward's 4 B H Nq Nk d, halved for
causal; :func:`bench.common.attention_flops` with ``backward=True``) for N = 1024..8192,
d = 64/128, causal off/on, float16/float32, with B * N = 8192 tokens and 8 heads.  The time is one
``numba_flash.backward`` call on device arrays (preprocess, dK/dV/dQ kernel, cast) after warm-up,
median of CUDA-event timings; ``o`` and ``lse`` come from a float32 NumPy forward on the host
(so the benchmark does not depend on the forward kernel).  When torch with CUDA is importable,
``torch.autograd.grad`` through ``scaled_dot_product_attention`` (whichever backend torch picks)
is timed in the same run on the same shapes and dtype (float32 rows beside torch SDPA float32,
which keeps float32 accuracy).  The full run also times ``deterministic=True``.  ``--quick`` runs
float16 at N = 1024 and 4096 and float32 at N = 4096 (d = 64 and 128, causal off and on).  The
host inputs of one (N, d, causal) are drawn once and cast to each dtype.  The full run adds a
sliding-window series (float32, d = 64, causal window of 256 keys, N = 2048..16384 at 16384
tokens): TFLOP/s counts the visible pairs only, so a flat rate means time grows with N * window.

In the simulator it runs one small configuration and says that it timed the simulator.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

from common import attention_flops, on_gpu, peers, print_table, time_gpu, time_host

import numba_flash  # noqa: E402  (common.py put the repository on sys.path)
from numba import cuda  # noqa: E402
from numba_flash import reference as ref  # noqa: E402
from numba_flash.frontend.kernel_choice import check_backward_kernel as check_kernel  # noqa: E402

TOKENS = 8192
HEADS = 8


def make_inputs(b, h, n, d, dtype, causal, rng):
    """Host arrays; o and lse from a float32 NumPy forward (BLAS), one head at a time."""
    q, k, v, do = (rng.standard_normal((b, h, n, d)).astype(dtype) for _ in range(4))
    o = np.empty((b, h, n, d), dtype)
    lse = np.empty((b, h, n), np.float32)
    mask = ref.causal_visible(n, n) if causal else None
    for bb in range(b):
        for hh in range(h):
            s = (q[bb, hh].astype(np.float32) @ k[bb, hh].astype(np.float32).T) / np.sqrt(d)
            if causal:
                s = np.where(mask, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            l = p.sum(axis=1, keepdims=True)
            o[bb, hh] = (p / l) @ v[bb, hh].astype(np.float32)
            lse[bb, hh] = (m + np.log(l))[:, 0]
    return do, q, k, v, o, lse


def torch_backward_ms(host, causal):
    import torch
    import torch.nn.functional as F

    do, q, k, v = (torch.from_numpy(x).cuda() for x in host[:4])
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ms = time_gpu(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True),
                  repeat=10, warmup=2)
    torch.cuda.synchronize()
    return ms


def run_gpu(quick):
    rng = np.random.default_rng(0)
    has_torch = "torch" in peers()
    rows = []
    if quick:
        ns = {np.float16: (1024, 4096), np.float32: (4096,)}
    else:
        ns = {np.float16: (1024, 2048, 4096, 8192), np.float32: (1024, 2048, 4096, 8192)}
    for d in (64, 128):
        for causal in (False, True):
            for n in sorted({n for v in ns.values() for n in v}):
                b, h = max(1, TOKENS // n), HEADS
                host32 = make_inputs(b, h, n, d, np.float32, causal, rng)
                for dtype in (np.float16, np.float32):
                    if n not in ns[dtype]:
                        continue
                    host = [x.astype(dtype) for x in host32[:5]] + [host32[5]]
                    dev = [cuda.to_device(x) for x in host]
                    flops = attention_flops(b, h, n, n, d, causal=causal, backward=True)
                    ms = time_gpu(lambda: numba_flash.backward(*dev, causal=causal),
                                  repeat=5 if n >= 4096 else 10, warmup=1)
                    row = {"dtype": np.dtype(dtype).name, "B": b, "H": h, "N": n, "d": d,
                           "causal": causal, "kernel": check_kernel("auto", dtype), "ms": ms,
                           "TFLOP/s": flops / ms / 1e9}
                    if not quick:
                        ms_det = time_gpu(lambda: numba_flash.backward(
                            *dev, causal=causal, deterministic=True), repeat=3, warmup=1)
                        row["deterministic TFLOP/s"] = flops / ms_det / 1e9
                    if has_torch:
                        try:
                            t_ms = torch_backward_ms(host, causal)
                            row["torch SDPA ms"] = t_ms
                            row["torch SDPA TFLOP/s"] = flops / t_ms / 1e9
                            row["torch TFLOP/s"] = row["torch SDPA TFLOP/s"]  # forward's key
                        except Exception as exc:  # noqa: BLE001  report, keep benchmarking
                            row["torch SDPA ms"] = f"error: {type(exc).__name__}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


WINDOW = 256  # keys per row in the sliding-window rows: window_size = (WINDOW - 1, 0)


def window_inputs(b, h, n, d, dtype, rng):
    """Host ``(do, q, k, v, o, lse)`` for causal window ``(WINDOW - 1, 0)``: ``lse`` from the
    banded scores only (``n * WINDOW`` dot products per head, so long ``n`` stays cheap on the
    host); ``o`` is random (its values only set ``D = rowsum(dO * O)``, not the work)."""
    q, k, v, do, o = (rng.standard_normal((b, h, n, d)).astype(dtype) for _ in range(5))
    lse = np.empty((b, h, n), np.float32)
    for bb in range(b):
        for hh in range(h):
            kp = np.concatenate([np.zeros((WINDOW - 1, d), np.float32),
                                 k[bb, hh].astype(np.float32)])
            band = np.lib.stride_tricks.sliding_window_view(kp, (WINDOW, d))[:, 0]
            s = np.einsum("nd,nwd->nw", q[bb, hh].astype(np.float32), band) / np.sqrt(d)
            s[np.arange(WINDOW)[None, :] < (WINDOW - 1 - np.arange(n))[:, None]] = -np.inf
            m = s.max(axis=1, keepdims=True)
            lse[bb, hh] = (m + np.log(np.exp(s - m).sum(axis=1, keepdims=True)))[:, 0]
    return do, q, k, v, o, lse


def run_window_gpu():
    """float32, d = 64, causal sliding window of WINDOW keys, fixed B * N = 16384 tokens: the time
    per token stays flat as N grows (tiles outside the band are never loaded), where full causal
    attention's grows with N."""
    rng = np.random.default_rng(1)
    rows = []
    d, dtype, h = 64, np.float32, HEADS
    for n in (2048, 4096, 8192, 16384):
        b = max(1, 16384 // n)
        dev = [cuda.to_device(x) for x in window_inputs(b, h, n, d, dtype, rng)]
        ms = time_gpu(lambda: numba_flash.backward(*dev, causal=True,
                                                   window_size=(WINDOW - 1, 0)),
                      repeat=5, warmup=1)
        pairs = WINDOW * n - WINDOW * (WINDOW - 1) // 2  # visible (query, key) pairs per head
        flops = 2.5 * 4 * b * h * pairs * d
        row = {"dtype": "float32", "B": b, "H": h, "N": n, "d": d, "causal": True,
               "window": WINDOW, "kernel": check_kernel("auto", dtype), "ms": ms,
               "TFLOP/s": flops / ms / 1e9}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def run_simulator():
    rng = np.random.default_rng(0)
    b, h, n, d, dtype, causal = 1, 2, 32, 16, np.float32, False
    host = make_inputs(b, h, n, d, dtype, causal, rng)
    ms = time_host(lambda: numba_flash.backward(*host, causal=causal), repeat=1, warmup=0)
    flops = attention_flops(b, h, n, n, d, causal=causal, backward=True)
    print("Timed the Numba CUDA SIMULATOR (no GPU here): these figures say nothing about GPU "
          "performance.")
    return [{"dtype": "float32", "B": b, "H": h, "N": n, "d": d, "causal": causal, "ms": ms,
             "TFLOP/s": flops / ms / 1e9, "backend": "simulator"}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a short sweep (float16, N 1024/4096)")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    args = ap.parse_args(argv)
    if on_gpu():
        rows = run_gpu(args.quick) + ([] if args.quick else run_window_gpu())
    else:
        rows = run_simulator()
    columns = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    print_table(rows, columns)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1, default=lambda x: None if isinstance(x, float)
                      and math.isnan(x) else str(x))


if __name__ == "__main__":
    main()
