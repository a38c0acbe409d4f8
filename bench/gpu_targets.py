"""What bench/gpu_check.py runs in processes of their own on the device: the Nsight Compute and
compute-sanitizer targets and the small timed checks other issues asked for.

    python bench/gpu_targets.py ncu --case forward_f16_d64      # one NCU_CASES launch
    python bench/gpu_targets.py sanitizer --cases forward_mma,decode
    python bench/gpu_targets.py decode_latency|per_call|first_call|kvcache_32k --json FILE
    python bench/gpu_targets.py ... --dry-run                   # the simulator, tiny shapes

Each target prints one line per case as it goes (``case start: NAME`` / ``case done: NAME ...``,
flushed: a process stopped at its time limit, or ended by a CUDA error, still says which cases
ran) and, with ``--json``, writes its rows after every case.  On a GPU the inputs are CuPy arrays
when CuPy is installed (a call then never waits for a host copy), else NumPy arrays that the
ops copy; in the simulator (``--dry-run`` or no GPU) NumPy arrays at the ``dry`` sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

T_START = time.perf_counter()   # the first_call target: time from here to the first result

import numpy as np  # noqa: E402

import numba_flash  # noqa: E402

T_IMPORT = time.perf_counter() - T_START

# -- inputs --------------------------------------------------------------------------------


def on_gpu(dry=False):
    return not dry and numba_flash.backend() == "cuda"


class Arrays:
    """Where a target's inputs live: CuPy on a GPU when installed, else NumPy."""

    def __init__(self, dry):
        self.gpu = on_gpu(dry)
        self.cp = None
        if self.gpu:
            try:
                import cupy

                self.cp = cupy
            except ImportError:
                pass

    def put(self, x):
        if self.cp is None or not isinstance(x, np.ndarray):
            return x
        try:
            return self.cp.asarray(x)
        except Exception:  # noqa: BLE001  a dtype CuPy lacks (bfloat16): the op copies it
            return x

    def normal(self, rng, shape, dtype, scale=1.0):
        """Random normal values of ``dtype``, drawn on the device when CuPy is there (a 32k
        cache is half a billion values: the host would take seconds)."""
        dt = _dtype(dtype)
        if self.cp is not None and dt != _bf16():
            x = self.cp.random.standard_normal(shape, dtype=self.cp.float32)
            return (scale * x).astype(dt)
        return self.put(_normal(rng, shape, dtype, scale))

    def sync(self):
        if self.gpu:
            from numba import cuda

            cuda.synchronize()
            if self.cp is not None:
                self.cp.cuda.runtime.deviceSynchronize()

    @property
    def name(self):
        return "cupy" if self.cp is not None else "numpy"


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _dtype(name):
    return _bf16() if name == "bfloat16" else np.dtype(name)


def _normal(rng, shape, dtype, scale=1.0):
    return (scale * rng.standard_normal(shape, dtype=np.float32)).astype(_dtype(dtype))


def build(op, dims, arrays, seed=0):
    """A zero-argument callable that runs ``op`` once on inputs of ``dims`` (made here, on the
    device when ``arrays`` puts them there)."""
    rng = np.random.default_rng(seed)
    if arrays.cp is not None:
        arrays.cp.random.seed(seed)
    put = arrays.put
    dt = dims.get("dtype", "float16")
    if op in ("forward", "backward"):
        b, h, n, d = dims["b"], dims["h"], dims["n"], dims["d"]
        q, k, v = (arrays.normal(rng, (b, h, n, d), dt) for _ in range(3))
        kw = dict(causal=dims.get("causal", False), kernel=dims.get("kernel", "auto"))
        if op == "forward":
            return lambda: numba_flash.forward(q, k, v, **kw)
        o, lse = numba_flash.forward(q, k, v, return_lse=True, **kw)
        do = arrays.normal(rng, (b, h, n, d), dt)
        return lambda: numba_flash.backward(do, q, k, v, o, lse, **kw)
    if op == "decode":
        b, h, hkv, d, bs, ctx = (dims[x] for x in ("b", "h", "hkv", "d", "block", "ctx"))
        n_blk = -(-ctx // bs)
        q = arrays.normal(rng, (b, h, d), dt)
        k, v = (arrays.normal(rng, (b * n_blk, hkv, bs, d), dt) for _ in range(2))
        table = put(rng.permutation(b * n_blk).astype(np.int32).reshape(b, n_blk))
        lens = put(np.full(b, ctx, np.int32))
        return lambda: numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table)
    if op == "mla":
        b, h, d, d_v, bs, ctx = (dims[x] for x in ("b", "h", "d", "d_v", "block", "ctx"))
        n_blk = -(-ctx // bs)
        cache = arrays.normal(rng, (b * n_blk, 1, bs, d), dt, 0.3)
        q = arrays.normal(rng, (b, h, d), dt, 0.3)
        table = put(rng.permutation(b * n_blk).astype(np.int32).reshape(b, n_blk))
        lens = put(np.full(b, ctx, np.int32))
        return lambda: numba_flash.decode(q, cache, None, head_dim_v=d_v, cache_seqlens=lens,
                                          block_table=table)
    if op == "append":
        b, hkv, d, bs, ctx, new = (dims[x] for x in ("b", "hkv", "d", "block", "ctx", "new"))
        n_blk = -(-(ctx + new) // bs)
        k, v = (arrays.normal(rng, (b * n_blk, hkv, bs, d), dt) for _ in range(2))
        kn, vn = (arrays.normal(rng, (b, hkv, new, d), dt) for _ in range(2))
        table = put(rng.permutation(b * n_blk).astype(np.int32).reshape(b, n_blk))
        lens = put(np.full(b, ctx, np.int32))
        return lambda: numba_flash.append_kv(k, v, kn, vn, lens, block_table=table)
    if op == "merge":
        p, b, h, n, d = (dims[x] for x in ("p", "b", "h", "n", "d"))
        o = arrays.normal(rng, (p, b, h, n, d), dt)
        lse = put(rng.standard_normal((p, b, h, n)).astype(np.float32))
        return lambda: numba_flash.merge_states(o, lse)
    raise ValueError(f"unknown op {op!r}")


# -- Nsight Compute: one call of each case, at benchmark size ------------------------------

#: name -> (op, GPU dims, dry dims, kernel-name regex, most matching launches in one call).
#: ncu runs one case per process (bench/gpu_check.py): ``--kernel-name regex:REGEX
#: --launch-skip 0 --launch-count COUNT`` over one call of the op.
NCU_CASES = {
    "forward_f16_d64": ("forward", dict(dtype="float16", b=4, h=16, n=4096, d=64, kernel="mma"),
                        dict(dtype="float16", b=1, h=1, n=16, d=16, kernel="mma"),
                        "flash_forward_mma", 1),
    "forward_f16_d128": ("forward", dict(dtype="float16", b=4, h=16, n=4096, d=128,
                                         kernel="mma"),
                         dict(dtype="float16", b=1, h=1, n=16, d=32, kernel="mma"),
                         "flash_forward_mma", 1),
    "backward_f16_d64": ("backward", dict(dtype="float16", b=2, h=8, n=4096, d=64, kernel="mma"),
                         dict(dtype="float16", b=1, h=1, n=16, d=16, kernel="mma"),
                         "backward_dkdv_mma|backward_dq_mma", 2),
    "decode_f16_d128": ("decode", dict(dtype="float16", b=8, h=32, hkv=8, d=128, block=16,
                                       ctx=32768),
                        dict(dtype="float16", b=1, h=2, hkv=1, d=16, block=4, ctx=16),
                        "decode_split", 1),
    "mla_bf16": ("mla", dict(dtype="bfloat16", b=16, h=128, d=576, d_v=512, block=64, ctx=4096),
                 dict(dtype="bfloat16", b=1, h=16, d=128, d_v=64, block=16, ctx=16),
                 "mla_decode|merge_states", 2),
}


def target_ncu(cases, dry, out):
    arrays = Arrays(dry)
    done = []
    for name in cases:
        op, gpu, small, _, _ = NCU_CASES[name]
        dims = small if not arrays.gpu else gpu
        print(f"case start: {name} {dims}", flush=True)
        call = build(op, dims, arrays)
        call()
        arrays.sync()
        done.append(name)
        print(f"case done: {name}", flush=True)
    return {"cases": done, "arrays": arrays.name}


# -- compute-sanitizer: one small case of each kernel family --------------------------------

#: name -> (op, dims on a GPU, dims in the simulator); small: a few blocks, ragged tiles
def _attention(op, dtype, kernel, n=(80, 12), d=(64, 16), causal=True):
    """An attention family's case: ``(op, its dims on a GPU, in the simulator)``."""
    mask = dict(causal=True) if causal else {}
    return (op, dict(dtype=dtype, b=1, h=2, n=n[0], d=d[0], kernel=kernel, **mask),
            dict(dtype=dtype, b=1, h=1, n=n[1], d=d[1], kernel=kernel, **mask))


SANITIZER_CASES = {
    "forward_simt": _attention("forward", "float32", "simt"),
    "forward_mma": _attention("forward", "float16", "mma", n=(80, 20)),
    "forward_wgmma": _attention("forward", "float16", "wgmma", n=(130, 20), d=(64, 64),
                                causal=False),
    "backward_simt": _attention("backward", "float32", "simt"),
    "backward_mma": _attention("backward", "float16", "mma", n=(80, 20)),
    "decode_split_kv": ("decode", dict(dtype="float16", b=2, h=4, hkv=2, d=128, block=16,
                                       ctx=100),
                        dict(dtype="float16", b=1, h=2, hkv=1, d=16, block=4, ctx=10)),
    "mla": ("mla", dict(dtype="bfloat16", b=2, h=16, d=128, d_v=64, block=16, ctx=40),
            dict(dtype="bfloat16", b=1, h=16, d=128, d_v=64, block=16, ctx=10)),
    "append": ("append", dict(dtype="float16", b=2, hkv=2, d=64, block=16, ctx=21, new=3),
               dict(dtype="float16", b=1, hkv=1, d=16, block=4, ctx=5, new=2)),
    "merge": ("merge", dict(dtype="float32", p=3, b=1, h=2, n=5, d=64),
              dict(dtype="float32", p=2, b=1, h=1, n=3, d=16)),
}


def _needs_sm90(name):
    return "wgmma" in name


def target_sanitizer(cases, dry, out):
    """Each case once, in order; a case that raises is reported and the next one runs (a CUDA
    error that spoils the context spoils the rest too: bench/gpu_check.py then starts a fresh
    process for the cases left)."""
    arrays = Arrays(dry)
    res = {"cases": {}, "arrays": arrays.name}
    cc = None
    if arrays.gpu:
        from numba import cuda

        cc = tuple(cuda.get_current_device().compute_capability)
    for name in cases:
        op, gpu, small = SANITIZER_CASES[name]
        if arrays.gpu and _needs_sm90(name) and cc != (9, 0):
            res["cases"][name] = f"skipped: needs sm_90 (this GPU is {cc})"
            print(f"case done: {name} skipped", flush=True)
            continue
        print(f"case start: {name}", flush=True)
        try:
            build(op, gpu if arrays.gpu else small, arrays)()
            arrays.sync()
            res["cases"][name] = "ran"
            print(f"case done: {name} ok", flush=True)
        except Exception as exc:  # noqa: BLE001  report it, run the next family
            res["cases"][name] = f"error: {type(exc).__name__}: {str(exc)[:300]}"
            print(f"case done: {name} error {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        _write(out, res)
    return res


# -- timing helpers ------------------------------------------------------------------------


def event_ms(fn, arrays, repeat, warmup=2):
    """Median ms of ``fn()`` between CUDA events (a GPU: bench/common.py's ``time_gpu``), or
    wall-clock ms of one call (the simulator: the figure says nothing, the call checks the
    path)."""
    if arrays.gpu:
        from common import time_gpu

        arrays.sync()
        return time_gpu(fn, repeat=repeat, warmup=warmup)
    from common import time_host

    return time_host(fn, repeat=1, warmup=0)


def host_ms(fn, arrays, calls):
    """Wall-clock ms per call of ``calls`` back-to-back calls, synchronised once at the end:
    what a caller's thread spends per call when the GPU keeps up."""
    if arrays.gpu:
        fn()
        arrays.sync()
    else:
        calls = 1
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    arrays.sync()
    return (time.perf_counter() - t0) * 1e3 / calls


# -- the other issues' checks --------------------------------------------------------------

#: issue 12's latency goal for a B = 1, 1k-context decode (the README's 30 us; this check's 40)
DECODE_LATENCY_GOAL_US = 40.0


def target_decode_latency(dry, out):
    """B = 1, 1k context, float16, paged/16 and contiguous: microseconds per call (CUDA events
    around the Python call, and wall clock over back-to-back calls) beside torch SDPA on the same
    cache in the same process (bench/decode.py's inputs and peers)."""
    import decode as bench_decode

    arrays = Arrays(dry)
    cfg = bench_decode.GPU if arrays.gpu else bench_decode.DRY
    ctx = bench_decode.LATENCY_CONTEXT["gpu" if arrays.gpu else "dry"]
    repeat, calls = 200, 200
    rng = np.random.default_rng(1)
    rows = []
    for paged in (True, False):
        q, k, v, lens, table = bench_decode.make_inputs(cfg, arrays.cp, rng, 1, ctx, np.float16,
                                                        paged)
        fn = lambda: numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table)  # noqa
        row = {"dtype": "float16", "cache": f"paged/{cfg['BLOCK_SIZE']}" if paged
               else "contiguous", "B": 1, "context": ctx,
               "us per call": event_ms(fn, arrays, repeat) * 1e3,
               "host us per call": host_ms(fn, arrays, calls) * 1e3}
        if arrays.gpu:
            for peer, pfn in bench_decode.torch_peers(cfg, q, k, v, table).items():
                row[f"{peer} us"] = event_ms(pfn, arrays, repeat) * 1e3
        row["goal us"] = DECODE_LATENCY_GOAL_US
        row["goal met"] = bool(arrays.gpu and row["us per call"] <= DECODE_LATENCY_GOAL_US)
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(out, {"rows": rows})
    return {"rows": rows, "arrays": arrays.name}


#: per_call's cases: the forward and backward cases of NCU_CASES (ncu's kernel time beside them)
PER_CALL_CASES = ("forward_f16_d64", "forward_f16_d128", "backward_f16_d64")


def target_per_call(dry, out):
    """The forward and backward NCU_CASES timed per call: CUDA events around the Python call (the
    GPU time of all its launches plus the gaps the host leaves) and wall clock per call; the
    report puts Nsight Compute's kernel durations beside them."""
    arrays = Arrays(dry)
    repeat, calls = 20, 20
    rows = []
    for name in PER_CALL_CASES:
        op, gpu, small, _, _ = NCU_CASES[name]
        fn = build(op, gpu if arrays.gpu else small, arrays)
        row = {"case": name, "ms per call": event_ms(fn, arrays, repeat, warmup=1),
               "host ms per call": host_ms(fn, arrays, calls)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(out, {"rows": rows})
    return {"rows": rows, "arrays": arrays.name}


#: first_call's forward: float16 (the tensor-core kernel), one head of 1k tokens
FIRST_CALL = dict(gpu=dict(dtype="float16", b=1, h=8, n=1024, d=64),
                  dry=dict(dtype="float32", b=1, h=1, n=16, d=16))


def target_first_call(dry, out):
    """This process's first forward: seconds from the interpreter's start of this script to
    ``import numba_flash`` done, to the first result (compile or cache load included), and a
    second call.  bench/gpu_check.py runs it in fresh processes with the kernel cache warm and
    cold (an empty ``NUMBA_CACHE_DIR``)."""
    arrays = Arrays(dry)
    dims = FIRST_CALL["gpu" if arrays.gpu else "dry"]
    fn = build("forward", dims, arrays)
    t0 = time.perf_counter()
    fn()
    arrays.sync()
    first = time.perf_counter() - t0
    to_first = time.perf_counter() - T_START
    t1 = time.perf_counter()
    fn()
    arrays.sync()
    res = {"import_s": round(T_IMPORT, 3), "first_call_s": round(first, 4),
           "second_call_s": round(time.perf_counter() - t1, 5),
           "to_first_result_s": round(to_first, 3),
           "dims": dims, "cache_dir": os.environ.get("NUMBA_CACHE_DIR", "(default)"),
           "arrays": arrays.name}
    print(json.dumps(res), flush=True)
    return res


#: kvcache_32k: flash-attn's paged layout [num_blocks, page, Hkv, d] (page 256, flash-attn's
#: own rule), float16, H = 32 over Hkv = 8, d = 128
KVCACHE = dict(gpu=dict(batches=(1, 8), ctx=32768, page=256, h=32, hkv=8, d=128),
               dry=dict(batches=(1,), ctx=32, page=16, h=2, hkv=1, d=16))


def target_kvcache_32k(dry, out):
    """One decode step through ``numba_flash.torch.flash_attn_with_kvcache`` on a 32k-token
    paged cache in flash-attn's layout, beside torch SDPA on the same keys gathered once into a
    contiguous cache (``enable_gqa``), same process: microseconds per call and GB/s of K/V."""
    import torch

    from numba_flash.torch import flash_attn_with_kvcache

    gpu = on_gpu(dry) and torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    cfg = KVCACHE["gpu" if gpu else "dry"]
    ctx, page, h, hkv, d = (cfg[x] for x in ("ctx", "page", "h", "hkv", "d"))
    dtype = torch.float16 if gpu else torch.float32
    repeat = 50 if gpu else 1
    torch.manual_seed(0)   # drawn where they live: a 32k cache of B = 8 is 1 GB
    rows = []

    def timed(fn):
        if not gpu:   # the simulator: one call checks the path
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            return (time.perf_counter() - t0) * 1e3 / repeat
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)

    for b in cfg["batches"]:
        n_blk = ctx // page
        k_cache = torch.randn((b * n_blk, page, hkv, d), device=dev, dtype=dtype)
        v_cache = torch.randn((b * n_blk, page, hkv, d), device=dev, dtype=dtype)
        q = torch.randn((b, 1, h, d), device=dev, dtype=dtype)
        table = torch.randperm(b * n_blk, device=dev).to(torch.int32).reshape(b, n_blk)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        ms = timed(lambda: flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens,
                                                   block_table=table))
        nbytes = 2 * b * ctx * hkv * d * (2 if dtype == torch.float16 else 4)
        row = {"dtype": str(dtype).replace("torch.", ""), "layout": f"[blocks, {page}, Hkv, d]",
               "B": b, "context": ctx, "H": h, "Hkv": hkv, "d": d, "us per call": ms * 1e3,
               "GB/s": nbytes / ms / 1e6}
        idx = table.long()
        ck = k_cache[idx].reshape(b, ctx, hkv, d).transpose(1, 2).contiguous()
        cv = v_cache[idx].reshape(b, ctx, hkv, d).transpose(1, 2).contiguous()
        tq = q.transpose(1, 2)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        pms = timed(lambda: sdpa(tq, ck, cv, enable_gqa=True))
        row["torch SDPA contiguous us"] = pms * 1e3
        row["torch SDPA contiguous GB/s"] = nbytes / pms / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(out, {"rows": rows})
    return {"rows": rows, "device": dev}


# -- command line --------------------------------------------------------------------------


def _write(out, data):
    if out:
        Path(out).write_text(json.dumps(data, indent=1, default=str))


TARGETS = ("ncu", "sanitizer", "decode_latency", "per_call", "first_call", "kvcache_32k")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", choices=TARGETS)
    ap.add_argument("--case", action="append", default=[],
                    help="ncu: a case of NCU_CASES (repeatable; 'all': every one)")
    ap.add_argument("--cases", default="all", help="sanitizer: comma-separated SANITIZER_CASES")
    ap.add_argument("--dry-run", action="store_true", help="the simulator at tiny shapes")
    ap.add_argument("--json", help="write the result here (after every case)")
    args = ap.parse_args(argv)
    dry = args.dry_run
    try:
        if args.target == "ncu":
            cases = [c for name in (args.case or ["all"])
                     for c in (NCU_CASES if name == "all" else [name])]
            res = target_ncu(cases, dry, args.json)
        elif args.target == "sanitizer":
            cases = list(SANITIZER_CASES) if args.cases == "all" else args.cases.split(",")
            res = target_sanitizer(cases, dry, args.json)
        else:
            res = globals()[f"target_{args.target}"](dry, args.json)
    except Exception:
        traceback.print_exc()
        raise
    _write(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
