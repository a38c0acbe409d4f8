"""Decode bandwidth and latency: ``numba_flash.decode`` against the device copy bandwidth and
torch in the same run.

Decode is memory bound: each live K/V element of the cache is read once, so the figure of merit
is ``bytes of K/V read / time`` (GB/s) against :func:`common.copy_bandwidth` (read + write bytes
of a device-to-device copy, measured in the same run).  Goals (issue 12, H200): float16 and
float32 paged (block size 16) at 32k and 128k contexts at >= 80% of copy bandwidth and at least
as fast as torch SDPA on the contiguous cache; a B = 1, 1k-context call in <= 30 us.

GPU (CuPy inputs, so a call never waits for the host):
  bandwidth rows  B = 8, H = 32, Hkv = 8, d = 128, contexts 1k .. 128k (``--quick``: 4k, 32k),
                  float16 and float32, paged (block size 16, a random permuted block table) and
                  contiguous; each row beside torch SDPA (``enable_gqa``) on the contiguous cache
                  and, for paged rows, torch gather (``k_cache[table]``) + SDPA, timed the same
                  way.  Inputs rotate over enough cache copies to exceed L2.
  latency rows    B = 1, 1k context, float16, paged and contiguous: microseconds per call
                  (CUDA events around the Python call: launch and host overhead included).
  ``--fp8``       also e4m3 caches (uint8 bytes, ``kv_cache_dtype="fp8_e4m3"``) beside a float16
                  q: the bytes read per second against the float16 rows (no peer: torch SDPA
                  takes no fp8 cache).
  ``--mla``       also MLA's absorbed decode (DeepSeek's shapes: H = 128 query heads over one
                  576-wide latent cache, the value its first 512 columns, paged by 64,
                  bfloat16 q): a bfloat16 and an e4m3 latent cache (the tensor-core decode,
                  ``kernel="auto"``), GB/s of latent bytes read and TFLOP/s (``2 B H L (576 +
                  512)``; no peer here).
Simulator (``--dry-run``, or no GPU): the same rows at toy sizes, timed on the host, to check
that the script runs (this times the simulator, not a GPU).

    python bench/decode.py [--quick] [--dry-run] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import common  # noqa: E402  (puts the repository on sys.path, picks the backend)
import numba_flash
from numba import cuda
from numba_flash.kernels.decode import config as kdecode

GPU = dict(B=8, H=32, HKV=8, D=128, BLOCK_SIZE=16,
           contexts=(1024, 4096, 16384, 32768, 65536, 131072), quick=(4096, 32768))
DRY = dict(B=1, H=4, HKV=2, D=16, BLOCK_SIZE=4, contexts=(16, 64), quick=(16, 64))
LATENCY_CONTEXT = {"gpu": 1024, "dry": 16}
L2_BYTES = 256 << 20  # rotate over cache copies totalling at least this much


def kv_bytes(b, hkv, ctx, d, dtype):
    """K + V bytes a decode reads: every live element once."""
    return 2 * b * hkv * ctx * d * np.dtype(dtype).itemsize


def e4m3_bytes(xp, shape, rng):
    """uint8 e4m3 bytes of values of magnitude 2**-4 .. 2 with random signs (no NaN pattern),
    drawn on the device when ``xp`` is CuPy."""
    if xp is not None:
        mag = xp.random.randint(0x20, 0x40, shape, dtype=xp.int32)
        sign = xp.random.randint(0, 2, shape, dtype=xp.int32) << 7
        return (mag | sign).astype(xp.uint8)
    return (rng.integers(0x20, 0x40, shape) | (rng.integers(0, 2, shape) << 7)).astype(np.uint8)


def make_inputs(cfg, xp, rng, b, ctx, dtype, paged):
    """``[q, k_cache, v_cache, cache_seqlens, block_table]`` on the device (CuPy when present,
    else Numba device arrays; NumPy in the simulator); ``dtype="e4m3"``: uint8 e4m3 caches
    beside a float16 ``q``."""
    h, hkv, d, bs = cfg["H"], cfg["HKV"], cfg["D"], cfg["BLOCK_SIZE"]
    fp8 = isinstance(dtype, str) and dtype == "e4m3"
    q = rng.standard_normal((b, h, d)).astype(np.float16 if fp8 else dtype)
    lens = np.full(b, ctx, np.int32)
    if paged:
        n_blk = -(-ctx // bs)
        shape = (b * n_blk, hkv, bs, d)
        table = rng.permutation(b * n_blk).astype(np.int32).reshape(b, n_blk)
    else:
        shape, table = (b, hkv, ctx, d), None
    if xp is not None:
        up = xp.asarray
    else:
        up = (lambda x: x) if not common.on_gpu() else cuda.to_device
    if fp8:
        k, v = up(e4m3_bytes(xp, shape, rng)), up(e4m3_bytes(xp, shape, rng))
    elif xp is not None:  # draw the (up to 8.6 GiB) caches on the device
        k = xp.random.standard_normal(shape, dtype=xp.float32).astype(dtype)
        v = xp.random.standard_normal(shape, dtype=xp.float32).astype(dtype)
    else:
        k = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        v = rng.standard_normal(shape, dtype=np.float32).astype(dtype)
        k, v = up(k), up(v)
    return [up(q), k, v, up(lens), None if table is None else up(table)]


def torch_peers(cfg, q, k, v, table):
    """``{name: callable}``: torch SDPA on a contiguous cache (the paged cache's tokens gathered
    once, outside the timing) and, for a paged cache, torch gather + SDPA (gather timed)."""
    if "torch" not in common.peers():
        return {}
    import torch

    b, hkv, d = q.shape[0], cfg["HKV"], cfg["D"]
    tq, tk, tv = (torch.as_tensor(x, device="cuda") for x in (q, k, v))
    tq = tq[:, :, None]
    out = {}
    if table is None:
        out["torch SDPA contiguous"] = lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, enable_gqa=True)
        return out
    tt = torch.as_tensor(table, device="cuda").long()

    def gather(x):  # [num_blocks, Hkv, bs, d] -> [B, Hkv, ctx, d]
        return x[tt].permute(0, 2, 1, 3, 4).reshape(b, hkv, -1, d)

    ck, cv = gather(tk).contiguous(), gather(tv).contiguous()
    out["torch SDPA contiguous"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        tq, ck, cv, enable_gqa=True)
    out["torch gather + SDPA"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        tq, gather(tk), gather(tv), enable_gqa=True)
    return out


def bandwidth_rows(cfg, contexts, xp, copy_gbs, timer, repeat, fp8=False):
    rng = np.random.default_rng(0)
    b, hkv, d = cfg["B"], cfg["HKV"], cfg["D"]
    rows = []
    for dtype in (np.float16, np.float32) + (("e4m3",) if fp8 else ()):
        e4m3 = isinstance(dtype, str)
        extra = {"kv_cache_dtype": "fp8_e4m3"} if e4m3 else {}
        elem = np.uint8 if e4m3 else dtype
        for paged in (True, False):
            for ctx in contexts:
                nbytes = kv_bytes(b, hkv, ctx, d, elem)
                copies = max(1, min(8, -(-L2_BYTES // nbytes))) if common.on_gpu() else 1
                sets = [make_inputs(cfg, xp, rng, b, ctx, dtype, paged) for _ in range(copies)]
                state = {"i": 0}

                def run():
                    q, k, v, lens, table = sets[state["i"] % copies]
                    state["i"] += 1
                    return numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                              **extra)

                ms = timer(run, repeat)
                gbs = nbytes / ms / 1e6
                splits, size = kdecode.gpu_splits(ctx, hkv, dtype=elem, HEAD_DIM=d,
                                                  n_rows=cfg["H"] // hkv)
                row = {"dtype": dtype if e4m3 else np.dtype(dtype).name,
                       "cache": f"paged/{cfg['BLOCK_SIZE']}" if paged else "contiguous",
                       "context": ctx, "GPU splits": splits, "ms": ms, "GB/s": gbs}
                if copy_gbs:
                    row["% copy"] = 100 * gbs / copy_gbs
                q, k, v, _, table = sets[0]
                for name, fn in ({} if e4m3 else torch_peers(cfg, q, k, v, table)).items():
                    pms = timer(fn, repeat)
                    row[f"{name} GB/s"] = nbytes / pms / 1e6
                    if name == "torch SDPA contiguous":
                        row["vs SDPA"] = pms / ms
                rows.append(row)
                print(row, flush=True)
                sets.clear()  # free the caches before the next size
    return rows


#: MLA's rows (``--mla``): DeepSeek V3's 128 heads over one latent cache of 576 (512 + 64)
MLA_GPU = dict(B=16, H=128, D=576, D_V=512, BLOCK_SIZE=64, contexts=(4096, 32768),
               quick=(4096,))
MLA_DRY = dict(B=1, H=16, D=128, D_V=64, BLOCK_SIZE=16, contexts=(16, 64), quick=(16,))


def mla_rows(cfg, contexts, xp, timer, repeat):
    """MLA's absorbed decode, ``decode(q, latent, None, head_dim_v=D_V)`` over a paged latent
    cache: bfloat16 and e4m3 (uint8 with ``kv_cache_dtype``, ``k_descale`` 0.5) beside a
    bfloat16 ``q``; GB/s of the latent bytes a call reads once (each block of 16 heads reads
    them again, mostly from L2) and TFLOP/s of its two products."""
    import ml_dtypes

    rng = np.random.default_rng(2)
    b, h, d, d_v, bs = cfg["B"], cfg["H"], cfg["D"], cfg["D_V"], cfg["BLOCK_SIZE"]
    up = xp.asarray if xp is not None else (
        (lambda x: x) if not common.on_gpu() else cuda.to_device)
    rows = []
    for dtype in ("bfloat16", "e4m3"):
        e4m3 = dtype == "e4m3"
        for ctx in contexts:
            n_blk = -(-ctx // bs)
            shape = (b * n_blk, 1, bs, d)
            cache = up(e4m3_bytes(xp, shape, rng) if e4m3 else
                       (0.3 * rng.standard_normal(shape, dtype=np.float32)).astype(
                           ml_dtypes.bfloat16))
            q = up((0.3 * rng.standard_normal((b, h, d), dtype=np.float32)).astype(
                ml_dtypes.bfloat16))
            lens = up(np.full(b, ctx, np.int32))
            table = up(rng.permutation(b * n_blk).astype(np.int32).reshape(b, n_blk))
            extra = dict(kv_cache_dtype="fp8_e4m3", k_descale=up(np.full((b, 1), 0.5,
                                                                          np.float32))) \
                if e4m3 else {}
            ms = timer(lambda: numba_flash.decode(q, cache, None, head_dim_v=d_v,
                                                  cache_seqlens=lens, block_table=table,
                                                  **extra), repeat)
            nbytes = b * ctx * d * (1 if e4m3 else 2)
            row = {"dtype": dtype, "cache": f"MLA latent, paged/{bs}", "heads": h,
                   "head dims": f"{d}/{d_v}", "context": ctx,
                   "ms": ms, "GB/s": nbytes / ms / 1e6,
                   "TFLOP/s": 2 * b * h * ctx * (d + d_v) / ms / 1e9}
            rows.append(row)
            print(row, flush=True)
    return rows


def latency_rows(cfg, ctx, xp, timer, repeat):
    rng = np.random.default_rng(1)
    rows = []
    for paged in (True, False):
        q, k, v, lens, table = make_inputs(cfg, xp, rng, 1, ctx, np.float16, paged)
        ms = timer(lambda: numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table),
                   repeat)
        row = {"dtype": "float16", "cache": f"paged/{cfg['BLOCK_SIZE']}" if paged
               else "contiguous", "B": 1, "context": ctx, "us per call": ms * 1e3}
        for name, fn in torch_peers(cfg, q, k, v, table).items():
            row[f"{name} us"] = timer(fn, repeat) * 1e3
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="contexts 4k and 32k only")
    ap.add_argument("--dry-run", action="store_true",
                    help="toy sizes (the default without a GPU): checks the script, times nothing")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--fp8", action="store_true", help="also e4m3 caches (beside a float16 q)")
    ap.add_argument("--mla", action="store_true",
                    help="also MLA's latent decode, bfloat16 and e4m3 caches")
    args = ap.parse_args(argv)
    dry = args.dry_run or not common.on_gpu()
    cfg = DRY if dry else GPU
    contexts = cfg["quick"] if args.quick else cfg["contexts"]
    xp = None
    if common.on_gpu():
        try:
            import cupy as xp
        except ImportError:
            xp = None
    if common.on_gpu():
        copy_gbs = common.copy_bandwidth()
        print(f"{common.device_name()}: copy bandwidth {copy_gbs:.0f} GB/s (read + write)")

        def timer(fn, repeat):
            return common.time_gpu(fn, repeat=repeat)
        repeat = 3 if dry else 20
    else:
        copy_gbs = None

        def timer(fn, repeat):
            return common.time_host(fn, repeat=repeat, warmup=0)
        repeat = 1
    rows = bandwidth_rows(cfg, contexts, xp, copy_gbs, timer, repeat, fp8=args.fp8)
    lat = latency_rows(cfg, LATENCY_CONTEXT["dry" if dry else "gpu"], xp, timer, repeat)
    mla = []
    if args.mla:
        mcfg = MLA_DRY if dry else MLA_GPU
        mla = mla_rows(mcfg, mcfg["quick"] if args.quick else mcfg["contexts"], xp, timer,
                       repeat)
    where = "GPU" if common.on_gpu() else "Numba CUDA SIMULATOR (host wall-clock, not a GPU figure)"
    print(f"\nnumba_flash.decode on the {where}: B={cfg['B']} H={cfg['H']} Hkv={cfg['HKV']} "
          f"d={cfg['D']}; GB/s = K/V bytes read / time"
          + (f"; copy bandwidth {copy_gbs:.0f} GB/s" if copy_gbs else "") + "\n")
    cols = ["dtype", "cache", "context", "GPU splits", "ms", "GB/s", "% copy", "vs SDPA",
            "torch SDPA contiguous GB/s", "torch gather + SDPA GB/s"]
    common.print_table(rows, [c for c in cols if any(c in r for r in rows)])
    print()
    cols = ["dtype", "cache", "B", "context", "us per call", "torch SDPA contiguous us",
            "torch gather + SDPA us"]
    common.print_table(lat, [c for c in cols if any(c in r for r in lat)])
    if mla:
        print()
        common.print_table(mla, ["dtype", "cache", "heads", "head dims", "context", "ms",
                                 "GB/s", "TFLOP/s"])
    out = {"backend": numba_flash.backend(), "dry_run": dry, "copy_GBps": copy_gbs,
           "config": {k: v for k, v in cfg.items() if k not in ("contexts", "quick")},
           "rows": rows + lat + mla}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return out


if __name__ == "__main__":
    main()
