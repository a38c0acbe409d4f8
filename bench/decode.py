"""Decode bandwidth: ``numba_flash.decode`` (split-KV + combine) against the device copy bandwidth.

Decode is memory bound: each K/V element of the cache is read once, so the figure of merit is
``bytes of K/V read / time`` against :func:`common.copy_bandwidth` (read + write bytes of a
device-to-device copy).  Target: >= 85% of copy bandwidth at contexts >= 32k.

GPU:       B = 8, H = 32, Hkv = 8, d = 128, context 1k .. 128k, float16 and float32 caches,
           paged (block_size 16, a random permuted block table) and contiguous, beside a baseline
           run in the same process: torch SDPA on the contiguous cache when torch with CUDA is
           installed, else a CuPy matmul-softmax-matmul (paged: gather first, the gather timed).
           Inputs rotate over enough cache copies to exceed L2.
Simulator: one small configuration, timed on the host (this times the simulator, not a GPU).

    python bench/decode.py [--quick] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np

import common  # noqa: E402  (puts the repository on sys.path, picks the backend)
import numba_flash
from numba import cuda
from numba_flash.kernels.decode import GPU_SPLIT_TOKENS

B, H, HKV, D = 8, 32, 8, 128
CONTEXTS = (1024, 4096, 16384, 32768, 65536, 131072)
QUICK_CONTEXTS = (4096, 32768)
BLOCK_SIZE = 16
L2_BYTES = 256 << 20  # rotate over cache copies totalling at least this much


def kv_bytes(b, hkv, ctx, d, dtype):
    return 2 * b * hkv * ctx * d * np.dtype(dtype).itemsize


def make_inputs(xp, rng, ctx, dtype, paged):
    """q, k_cache, v_cache, cache_seqlens, block_table on the device (CuPy, else Numba arrays)."""
    q = rng.standard_normal((B, H, D)).astype(dtype)
    lens = np.full(B, ctx, np.int32)
    if paged:
        n_blk = ctx // BLOCK_SIZE
        shape = (B * n_blk, HKV, BLOCK_SIZE, D)
        table = rng.permutation(B * n_blk).astype(np.int32).reshape(B, n_blk)
    else:
        shape = (B, HKV, ctx, D)
        table = None
    if xp is not None:  # draw the (up to 8 GiB) caches on the device
        k = xp.random.standard_normal(shape, dtype=xp.float32).astype(dtype)
        v = xp.random.standard_normal(shape, dtype=xp.float32).astype(dtype)
        up = xp.asarray
    else:
        k = cuda.to_device(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
        v = cuda.to_device(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
        up = cuda.to_device
    return [up(q), k, v, up(lens), None if table is None else up(table)]


def baseline(q, k, v, lens, table, dtype):
    """A same-run peer: torch SDPA (contiguous; paged gathers first) or CuPy matmul decode."""
    names = common.peers()
    if "torch" in names:
        import torch

        tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
        tt = None if table is None else torch.as_tensor(table, device="cuda").long()

        def run():
            kk, vv = tk, tv
            if tt is not None:  # gather [B, Hkv, ctx, d] from the paged cache
                kk = tk[tt].permute(0, 2, 1, 3, 4).reshape(B, HKV, -1, D)
                vv = tv[tt].permute(0, 2, 1, 3, 4).reshape(B, HKV, -1, D)
            return torch.nn.functional.scaled_dot_product_attention(
                tq[:, :, None], kk, vv, enable_gqa=True)
        return "torch SDPA", run
    if "cupy" in names:
        import cupy as cp

        g = H // HKV
        scale = 1.0 / math.sqrt(D)

        def run():
            kk, vv = k, v
            if table is not None:
                kk = k[table].transpose(0, 2, 1, 3, 4).reshape(B, HKV, -1, D)
                vv = v[table].transpose(0, 2, 1, 3, 4).reshape(B, HKV, -1, D)
            qg = q.reshape(B, HKV, g, D)
            s = cp.matmul(qg, kk.transpose(0, 1, 3, 2)).astype(cp.float32) * scale
            s = cp.exp(s - s.max(axis=-1, keepdims=True))
            p = (s / s.sum(axis=-1, keepdims=True)).astype(vv.dtype)
            return cp.matmul(p, vv)
        return "CuPy matmul", run
    return None, None


def bench_gpu(contexts):
    try:
        import cupy as xp
    except ImportError:
        xp = None
    rng = np.random.default_rng(0)
    copy_gbs = common.copy_bandwidth()
    print(f"device copy bandwidth: {copy_gbs:.0f} GB/s (read + write)")
    rows = []
    for dtype in (np.float16, np.float32):
        for paged in (True, False):
            for ctx in contexts:
                nbytes = kv_bytes(B, HKV, ctx, D, dtype)
                copies = max(1, min(8, -(-L2_BYTES // nbytes)))
                sets = [make_inputs(xp, rng, ctx, dtype, paged) for _ in range(copies)]
                state = {"i": 0}

                def run():
                    q, k, v, lens, table = sets[state["i"] % copies]
                    state["i"] += 1
                    return numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table)
                ms = common.time_gpu(run)
                gbs = nbytes / ms / 1e6
                row = {"dtype": np.dtype(dtype).name, "cache": f"paged/{BLOCK_SIZE}" if paged
                       else "contiguous", "context": ctx, "splits": -(-ctx // GPU_SPLIT_TOKENS),
                       "ms": ms, "GB/s": gbs, "% copy": 100 * gbs / copy_gbs}
                if xp is not None:
                    name, peer = baseline(*sets[0], dtype)
                    if peer is not None:
                        pms = common.time_gpu(peer, repeat=10)
                        row["peer"] = name
                        row["peer GB/s"] = nbytes / pms / 1e6
                rows.append(row)
                print(row, flush=True)
                del sets
    return rows, copy_gbs


def bench_simulator():
    rng = np.random.default_rng(0)
    b, h, hkv, d, ctx, bs = 1, 4, 2, 16, 64, 4
    n_blk = ctx // bs
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    k = rng.standard_normal((b * n_blk, hkv, bs, d)).astype(np.float32)
    v = rng.standard_normal((b * n_blk, hkv, bs, d)).astype(np.float32)
    table = rng.permutation(b * n_blk).astype(np.int32).reshape(b, n_blk)
    lens = np.full(b, ctx, np.int32)
    ms = common.time_host(lambda: numba_flash.decode(q, k, v, cache_seqlens=lens,
                                                     block_table=table))
    nbytes = kv_bytes(b, hkv, ctx, d, np.float32)
    return [{"dtype": "float32", "cache": f"paged/{bs}", "B": b, "H": h, "Hkv": hkv, "d": d,
             "context": ctx, "ms": ms, "GB/s": nbytes / ms / 1e6}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"contexts {QUICK_CONTEXTS} only")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    args = ap.parse_args(argv)
    if common.on_gpu():
        rows, copy_gbs = bench_gpu(QUICK_CONTEXTS if args.quick else CONTEXTS)
        print(f"\nnumba_flash.decode, B={B} H={H} Hkv={HKV} d={D}; copy bandwidth "
              f"{copy_gbs:.0f} GB/s; GB/s = K/V bytes read / time\n")
        common.print_table(rows, ["dtype", "cache", "context", "splits", "ms", "GB/s", "% copy",
                                  "peer", "peer GB/s"])
        out = {"backend": "cuda", "copy_GBps": copy_gbs, "rows": rows}
    else:
        rows = bench_simulator()
        print("Timed the Numba CUDA SIMULATOR (no GPU): host wall-clock of Python threads, not a "
              "GPU figure.\n")
        common.print_table(rows, ["dtype", "cache", "B", "H", "Hkv", "d", "context", "ms", "GB/s"])
        out = {"backend": "simulator", "rows": rows}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
