"""One-shot GPU validation and performance report, sized to fit one lent GPU session.

    python bench/gpu_check.py OUTDIR            # on a machine with an NVIDIA GPU (~6 minutes)
    python bench/gpu_check.py OUTDIR --ncu      # also an Nsight Compute summary per kernel
    python bench/gpu_check.py OUTDIR --budget forward=80 --budget windowed=0   # a part's limit
    python bench/gpu_check.py OUTDIR --dry-run  # anywhere: the same script in the simulator
    python bench/gpu_check.py --render bench/results/latest.json   # the record as Markdown

Parts, each run and reported even if an earlier one failed:

1. versions: device, driver, numba, numba-cuda, CuPy, torch;
2. ceilings: the GPU is first warmed up (>= 1 s of FMA work, so it leaves its idle clock), then
   device-to-device copy bandwidth (GB/s, read + write) and a float32 SIMT FMA rate (TFLOP/s,
   a kernel of our own) are measured, each printed beside the data-sheet peak of the device;
3. tests: the ``gpu``-marked tests and the kernel tier, on the device;
4. benchmarks: bench/forward.py, bench/backward.py and bench/decode.py (trimmed with ``--quick``),
   each with its peers (torch SDPA, CuPy) in the same run, each figure also as a fraction of its
   ceiling (float16 runs the tensor-core kernels there: ``kernel="auto"``); then the windowed
   forward rows (``bench/forward.py --windowed``, float16, 40 s at most);
5. with ``--ncu``: ``ncu`` on one launch of each kernel at benchmark size (registers, shared
   memory, occupancy, DRAM throughput, issue slots busy), the target being this script's
   ``--ncu-target`` mode;
6. OUTDIR/gpu_check.json (everything; rewritten after each part, so a lease that ends mid-run
   keeps the parts done) and OUTDIR/gpu_check.md (the tables); on a GPU also the
   record ``bench/results/<date>-<gpu>.json``, copied to ``bench/results/latest.json``, which
   docs/performance.md renders (``--render``) with its date, GPU and commit. Commit both files.

The record is the gpu_check.json report itself: ``bench_forward.rows[*]`` with ``dtype``, ``d``,
``causal``, ``N``, ``TFLOP/s``, ``torch TFLOP/s``; ``bench_backward.rows[*]`` the same (the
peer as ``torch TFLOP/s`` or ``torch SDPA TFLOP/s``); ``bench_decode.rows[*]`` with ``dtype``,
``cache``, ``context``, ``GB/s``, ``% copy``, ``peer GB/s`` (not the ``e4m3`` cache's rows of
``decode.py --fp8``: torch has no fp8 cache peer); ``ceilings`` and ``versions``.
:func:`validate_record` states the format; tests/bench checks it on a dry run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import numba_flash  # noqa: E402
from numba import cuda, float32  # noqa: E402

FMA_CHAINS = 8
FMA_ROUNDS = 4  # the 8 chains are stepped 4 times per loop iteration: 32 FMAs per loop branch


@cuda.jit
def fma_kernel(out, iters):
    """Each thread runs FMA_CHAINS independent multiply-add chains, FMA_ROUNDS steps of each per
    iteration, for ``iters`` iterations: 2 * 8 * 4 * iters FLOPs per thread."""
    t = cuda.grid(1)
    a = float32(0.999) + float32(t % 7) * float32(1e-7)
    x0 = float32(t)
    x1 = x0 + float32(1.0)
    x2 = x0 + float32(2.0)
    x3 = x0 + float32(3.0)
    x4 = x0 + float32(4.0)
    x5 = x0 + float32(5.0)
    x6 = x0 + float32(6.0)
    x7 = x0 + float32(7.0)
    b = float32(0.5)
    for _ in range(iters):
        x0 = x0 * a + b
        x1 = x1 * a + b
        x2 = x2 * a + b
        x3 = x3 * a + b
        x4 = x4 * a + b
        x5 = x5 * a + b
        x6 = x6 * a + b
        x7 = x7 * a + b
        x0 = x0 * a + b
        x1 = x1 * a + b
        x2 = x2 * a + b
        x3 = x3 * a + b
        x4 = x4 * a + b
        x5 = x5 * a + b
        x6 = x6 * a + b
        x7 = x7 * a + b
        x0 = x0 * a + b
        x1 = x1 * a + b
        x2 = x2 * a + b
        x3 = x3 * a + b
        x4 = x4 * a + b
        x5 = x5 * a + b
        x6 = x6 * a + b
        x7 = x7 * a + b
        x0 = x0 * a + b
        x1 = x1 * a + b
        x2 = x2 * a + b
        x3 = x3 * a + b
        x4 = x4 * a + b
        x5 = x5 * a + b
        x6 = x6 * a + b
        x7 = x7 * a + b
    out[t] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7  # keeps every chain alive


#: data-sheet peaks (dense, no sparsity) by a substring of the device name; fp32/fp64 are the
#: non-tensor (SIMT) rates.  TFLOP/s and GB/s.
DATASHEET = {
    "H200": {"fp32_TFLOPs": 66.9, "fp64_TFLOPs": 33.5, "fp16_tensor_TFLOPs": 989.5,
             "hbm_GBps": 4800.0},
    "H100": {"fp32_TFLOPs": 66.9, "fp64_TFLOPs": 33.5, "fp16_tensor_TFLOPs": 989.5,
             "hbm_GBps": 3350.0, "note": "H100 SXM5; the PCIe card is lower"},
    "A100": {"fp32_TFLOPs": 19.5, "fp64_TFLOPs": 9.7, "fp16_tensor_TFLOPs": 312.0,
             "hbm_GBps": 2039.0, "note": "A100 SXM4 80GB"},
}
#: float32 FMA lanes per SM by compute capability (the SIMT peak is SMs x lanes x 2 x clock)
FP32_LANES_PER_SM = {(7, 0): 64, (7, 5): 64, (8, 0): 64, (8, 6): 128, (8, 7): 128, (8, 9): 128,
                     (9, 0): 128, (10, 0): 128, (12, 0): 128}


def datasheet(name):
    """The data-sheet peaks of a device, by name (``{}`` if unknown)."""
    for key, peaks in DATASHEET.items():
        if key.lower() in str(name).lower():
            return dict(peaks, source=f"data sheet ({key})")
    return {}


def sm_clocks():
    """``nvidia-smi``'s current and maximum SM clock in MHz (``{}`` if unavailable)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20).stdout.strip().splitlines()[0]
        cur, mx = (float(x) for x in out.split(","))
        return {"sm_MHz": cur, "max_sm_MHz": mx}
    except Exception:  # noqa: BLE001
        return {}


def part_versions(dry):
    info = {"python": platform.python_version(), "backend": numba_flash.backend(),
            "numba_flash": numba_flash.__version__}
    import numba

    info["numba"] = numba.__version__
    try:
        from importlib.metadata import version

        info["numba-cuda"] = version("numba-cuda")
    except Exception as exc:  # noqa: BLE001
        info["numba-cuda"] = f"? ({exc})"
    for mod in ("cupy", "torch"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            info[mod] = "not installed"
    if not dry:
        dev = cuda.get_current_device()
        from common import device_name

        info["device"] = device_name()
        info["compute_capability"] = "%d.%d" % dev.compute_capability
        info["sm_count"] = dev.MULTIPROCESSOR_COUNT
        try:
            info["driver"] = ".".join(map(str, cuda.cudadrv.driver.driver.get_version()))
        except Exception:  # noqa: BLE001
            pass
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                  "--format=csv,noheader"], capture_output=True, text=True,
                                 timeout=30)
            info["nvidia-smi"] = out.stdout.strip()
        except Exception:  # noqa: BLE001
            pass
    else:
        info["device"] = "simulator (dry run)"
    return info


def warm_up(launch, seconds=1.0):
    """Run ``launch()`` (synchronised) until ``seconds`` of wall time have passed; the GPU leaves
    its idle clock (an H200 idles at 345 MHz) before anything is measured."""
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        launch()
        cuda.synchronize()
        n += 1
    return {"seconds": round(time.perf_counter() - t0, 2), "launches": n}


def part_ceilings(dry):
    from common import copy_bandwidth, time_gpu, time_host

    if dry:
        out = cuda.to_device(np.zeros(64, np.float32))
        ms = time_host(lambda: fma_kernel[2, 32](out, 4), repeat=1)
        return {"copy_GBps": None, "fma_TFLOPs": None, "note": "dry run: simulator, not measured",
                "fma_kernel_ms_simulator": ms, "datasheet": datasheet("H200 (dry run)")}
    dev = cuda.get_current_device()
    from common import device_name

    name = device_name()
    blocks, threads, iters = dev.MULTIPROCESSOR_COUNT * 8, 256, 16384
    out = cuda.device_array(blocks * threads, np.float32)
    launch = lambda: fma_kernel[blocks, threads](out, iters)  # noqa: E731
    launch()  # compile
    cuda.synchronize()
    res = {"clocks_before_warm_up": sm_clocks()}
    res["warm_up"] = warm_up(launch, 1.0)
    res["clocks_after_warm_up"] = sm_clocks()
    ms = time_gpu(launch, repeat=20, warmup=2)
    flops = 2.0 * FMA_CHAINS * FMA_ROUNDS * iters * blocks * threads
    res["fma_TFLOPs"] = flops / ms / 1e9
    res["fma_kernel_ms"] = ms
    res["copy_GBps"] = copy_bandwidth(repeat=20)
    cc = tuple(dev.compute_capability)
    lanes = FP32_LANES_PER_SM.get(cc)
    clock_khz = getattr(dev, "CLOCK_RATE", None)
    if lanes and clock_khz:
        res["fp32_TFLOPs_from_clock"] = dev.MULTIPROCESSOR_COUNT * lanes * 2 * clock_khz / 1e9
        res["fp32_peak_formula"] = (f"{dev.MULTIPROCESSOR_COUNT} SMs x {lanes} lanes x 2 x "
                                    f"{clock_khz / 1e6:.2f} GHz")
    res["datasheet"] = datasheet(name)
    peak = res["datasheet"].get("fp32_TFLOPs") or res.get("fp32_TFLOPs_from_clock")
    if peak:
        res["fma_fraction_of_peak"] = res["fma_TFLOPs"] / peak
    hbm = res["datasheet"].get("hbm_GBps")
    if hbm:
        res["copy_fraction_of_datasheet"] = res["copy_GBps"] / hbm
    print(f"   fp32 FMA {res['fma_TFLOPs']:.1f} TFLOP/s measured vs {peak} data sheet; copy "
          f"{res['copy_GBps']:.0f} GB/s measured vs {hbm} data sheet", flush=True)
    return res


#: the warpgroup forward's tests (issue 33): never run on a GPU before the first lent session, so
#: they run apart from the -x run of the other kernels' (a failure there must not stop those)
WGMMA_TESTS = ("tests/kernels/test_forward_wgmma.py",
               "tests/kernels/test_forward_wgmma_fp8.py")   # the e4m3 warpgroup forward too


def run_within(args, budget_s):
    """``subprocess.run`` with a time limit that keeps what the process printed before it was
    stopped: ``(returncode, stdout, stderr)``, returncode ``"timeout"`` when it ran out."""
    try:
        proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=budget_s)
        return proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        def text(x):
            return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
        return "timeout", text(exc.stdout), text(exc.stderr) + f"\n(stopped after {budget_s} s)"


def _pytest(args, budget_s):
    t0 = time.time()
    rc, out, err = run_within(args, budget_s)
    tail = (out + err).strip().splitlines()[-15:]
    return {"returncode": rc, "seconds": round(time.time() - t0, 1),
            "summary": tail[-1] if tail else "", "tail": tail}


def part_tests(dry, budget_s, wgmma_budget_s=120):
    args = [sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels", "-p", "no:cacheprovider"]
    xdist = []
    if dry:
        args += ["-k", "softmax"]
    else:
        import importlib.util

        if importlib.util.find_spec("xdist") is not None:  # JIT spread over the cores
            xdist = ["-n", "8"]
        args += [f"--ignore={path}" for path in WGMMA_TESTS] + xdist
    res = _pytest(args, budget_s)
    if not dry and wgmma_budget_s:   # the warpgroup forward (cc 9.0 only) in a run of its own
        res["wgmma"] = _pytest([sys.executable, "-m", "pytest", "-q", *WGMMA_TESTS, "-p",
                                "no:cacheprovider"] + xdist, wgmma_budget_s)
    return res


def part_bench(name, dry, outdir, budget_s):
    script = ROOT / "bench" / f"{'forward' if name in ('windowed', 'wgmma') else name}.py"
    if not script.exists():
        return {"error": f"{script} missing"}
    js = Path(outdir) / f"{name}.json"
    args = [sys.executable, str(script), "--quick", "--json", str(js)]
    if name == "forward" and not dry:  # the goal shapes: N = 4096, d = 64 and 128 (issue 13)
        args += ["--n", "4096", "--d", "64,128",
                 "--max-seconds", str(max(10, budget_s - 30))]  # stop sweeping, keep the rows
    if name == "decode":  # issue 46: the e4m3 cache's rows beside float16's (no torch peer),
        args += ["--fp8", "--mla"]   # and MLA's latent decode, bfloat16 and e4m3
    if name == "wgmma":  # issue 33: the warpgroup forward beside torch SDPA (sm_90a), float16
        args += ["--kernel", "wgmma", "--dtype", "float16,e4m3"]   # issue 46: e4m3 too
        if not dry:
            args += ["--n", "4096", "--d", "64,128", "--max-seconds", str(max(10, budget_s - 20))]
    if name == "windowed":  # issue 14: time grows with the window, not with N (float16)
        args = [sys.executable, str(script), "--windowed", "--dtype", "float16", "--json",
                str(js)] + ([] if dry else ["--max-seconds", str(max(10, budget_s - 15))])
    t0 = time.time()
    rc, out, err = run_within(args, budget_s)
    res = {"returncode": rc, "seconds": round(time.time() - t0, 1),
           "stdout_tail": out.strip().splitlines()[-40:],
           "stderr_tail": err.strip().splitlines()[-10:]}
    if js.exists():
        data = json.loads(js.read_text())
        rows = data["rows"] if isinstance(data, dict) else data  # {"rows": [...]} or [...]
        res["rows"] = normalize_rows(f"bench_{name}", rows)
    else:
        recover_rows(res, f"bench_{name}")
    return res


def recover_rows(part, name):
    """A benchmark stopped at its time limit writes no JSON, but it printed each row as it was
    measured (bench/backward.py as JSON, bench/forward.py as a dict): those rows, kept in
    ``part["rows"]`` with ``part["rows_from"] = "stdout"``.  Returns ``part``."""
    import ast

    rows = []
    for line in part.get("stdout_tail", []):
        line = line.strip()
        if not (line.startswith("{") and line.endswith("}")):
            continue
        try:
            row = json.loads(line)
        except ValueError:
            try:
                row = ast.literal_eval(line)
            except (ValueError, SyntaxError):
                continue
        if isinstance(row, dict) and "dtype" in row:
            rows.append(row)
    if rows and not part.get("rows"):
        part["rows"] = normalize_rows(name, rows)
        part["rows_from"] = "stdout"
    return part


def add_fractions(rows, ceilings):
    """Add each figure as a fraction of its ceiling (TFLOP/s vs FMA rate, GB/s vs copy)."""
    fma, bw = ceilings.get("fma_TFLOPs"), ceilings.get("copy_GBps")
    for r in rows:
        for key, val in list(r.items()):
            if not isinstance(val, (int, float)) or val is None or isinstance(val, bool):
                continue
            low = key.lower()
            if "tflop" in low and fma and "frac" not in low:
                r[f"{key} / fp32 FMA peak"] = val / fma
            if ("gb/s" in low or "gbps" in low) and bw and "frac" not in low and "%" not in low:
                r[f"{key} / copy bw"] = val / bw
    return rows


def markdown_table(rows):
    if not rows:
        return "(no rows)\n"
    cols = []
    for r in rows:
        for c in r:
            if c not in cols:
                cols.append(c)
    def cell(x):
        return str(x).replace("|", "\\|")  # a '|' inside a cell would split it

    lines = ["| " + " | ".join(cell(c) for c in cols) + " |",
             "|" + "|".join("---" for _ in cols) + "|"]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if isinstance(v, float):
                v = "nan" if math.isnan(v) else f"{v:.3g}"
            cells.append(cell(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- Nsight Compute -------------------------------------------------------------------------
NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "ComputeWorkloadAnalysis")
#: ncu metric names kept in the summary (section "details" page, ncu 2023-2025)
NCU_METRICS = {
    "Registers Per Thread": "registers",
    "Static Shared Memory Per Block": "static smem",
    "Dynamic Shared Memory Per Block": "dynamic smem",
    "Block Size": "block",
    "Grid Size": "grid",
    "Waves Per SM": "waves",
    "Theoretical Occupancy": "theoretical occupancy",
    "Achieved Occupancy": "achieved occupancy",
    "Duration": "duration",
    "DRAM Throughput": "DRAM throughput",
    "Memory Throughput": "memory throughput",
    "Compute (SM) Throughput": "SM throughput",
    "Issue Slots Busy": "issue slots busy",
    "Executed Ipc Active": "IPC",
}
#: what --ncu-target launches, in this order (GPU sizes; the dry run shrinks them)
NCU_CASES = (
    ("forward float32 d=64 N=4096 B=4 H=16", "forward", np.float32, dict(b=4, h=16, n=4096, d=64)),
    ("forward float16 d=64 N=4096 B=4 H=16", "forward", np.float16, dict(b=4, h=16, n=4096, d=64)),
    ("backward float16 d=64 N=4096 B=2 H=8", "backward", np.float16, dict(b=2, h=8, n=4096, d=64)),
    ("decode float16 paged/16 32k B=8 H=32 Hkv=8 d=128", "decode", np.float16,
     dict(b=8, h=32, hkv=8, ctx=32768, d=128, block=16)),
)


def ncu_target(dry):
    """Launch each case of NCU_CASES once (inputs made on the host: no other kernel runs)."""
    rng = np.random.default_rng(0)
    put = (lambda x: x) if dry else cuda.to_device
    for label, op, dtype, kw in NCU_CASES:
        if dry:  # simulator: toy sizes
            kw = {k: (min(v, 2) if k in ("b", "h", "hkv") else v) for k, v in kw.items()}
            kw.update(n=16, ctx=32, d=16, block=4) if op == "decode" else kw.update(n=16, d=16)
            if op == "decode":
                kw["hkv"], kw["h"] = 1, 2
        print(f"ncu target: {label}", file=sys.stderr, flush=True)
        if op in ("forward", "backward"):
            q, k, v = (put(rng.standard_normal((kw["b"], kw["h"], kw["n"], kw["d"]))
                           .astype(dtype)) for _ in range(3))
            if op == "forward":
                numba_flash.forward(q, k, v)
            else:
                o, lse = numba_flash.forward(q, k, v, return_lse=True)
                numba_flash.backward(o, q, k, v, o, lse)  # o as the upstream gradient
        else:
            n_blk = kw["ctx"] // kw["block"]
            q = put(rng.standard_normal((kw["b"], kw["h"], kw["d"])).astype(dtype))
            shape = (kw["b"] * n_blk, kw["hkv"], kw["block"], kw["d"])
            kc, vc = (put(np.full(shape, 0.01, dtype)) for _ in range(2))
            table = put(rng.permutation(kw["b"] * n_blk).astype(np.int32).reshape(kw["b"], n_blk))
            lens = put(np.full(kw["b"], kw["ctx"], np.int32))
            numba_flash.decode(q, kc, vc, cache_seqlens=lens, block_table=table)
        if not dry:
            cuda.synchronize()
    return {"cases": [c[0] for c in NCU_CASES]}


def short_kernel_name(name):
    """``cudapy::numba_flash::kernels::forward::...::flash_forward[abi:..](Array<...>)`` or ncu's
    ``flash_forward[v1,cw51c...]`` -> ``flash_forward``."""
    base = name.split("(")[0]
    base = re.sub(r"\[[^\]]*\]", "", base)
    base = re.sub(r"_\d+$", "", base.split("::")[-1])
    return base or name


def parse_ncu_csv(text):
    """Per-kernel summaries from ``ncu --csv --page details`` output (other lines ignored):
    ``[{"id", "kernel", metric: "value unit", ...}]`` in launch order."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if start is None:
        return []
    rows = [ln for ln in lines[start:] if ln.startswith('"')]
    kernels = {}
    for r in csv.DictReader(io.StringIO("\n".join(rows))):
        kid = r.get("ID")
        name = short_kernel_name(r.get("Kernel Name", "?"))
        k = kernels.setdefault(kid, {"id": kid, "kernel": name, "block": r.get("Block Size"),
                                     "grid": r.get("Grid Size")})
        key = NCU_METRICS.get(r.get("Metric Name"))
        if key:
            unit = (r.get("Metric Unit") or "").strip()
            k[key] = f"{r.get('Metric Value', '').strip()} {unit}".strip()
    return sorted(kernels.values(), key=lambda k: int(k["id"]) if str(k["id"]).isdigit() else 0)


def part_ncu(dry, budget_s):
    if dry:
        return {"note": "dry run: ncu not run; the target ran in the simulator",
                **ncu_target(True)}
    exe = shutil.which("ncu")
    if exe is None:
        return {"error": "ncu not found on PATH"}
    cmd = [exe, "--target-processes", "all", "--launch-count", "16", "--csv", "--page",
           "details"]
    for sec in NCU_SECTIONS:
        cmd += ["--section", sec]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--ncu-target"]
    t0 = time.time()
    rc, out, err = run_within(cmd, budget_s)
    kernels = parse_ncu_csv(out)
    return {"returncode": rc, "seconds": round(time.time() - t0, 1),
            "command": " ".join(cmd[:-3] + ["python", "bench/gpu_check.py", "--ncu-target"]),
            "cases": [c[0] for c in NCU_CASES], "kernels": kernels,
            "stderr_tail": err.strip().splitlines()[-12:]}


# -- the record: bench/results/<date>-<gpu>.json and latest.json ----------------------------
RESULTS = ROOT / "bench" / "results"
RECORD_FORMAT = 1
REQUIRED_ROW_KEYS = {  # present in every row, dry run or not
    "bench_forward": ("dtype", "d", "causal", "N"),
    "bench_backward": ("dtype", "d", "causal", "N"),
    "bench_decode": ("dtype", "cache", "context"),
}
MEASURED_ROW_KEYS = {  # present in every row measured on a GPU ("a|b": either name)
    "bench_forward": ("TFLOP/s",),
    "bench_backward": ("TFLOP/s",),
    "bench_decode": ("GB/s", "% copy"),
}
PEER_ROW_KEYS = {  # present when the peer (torch) was installed in that run
    "bench_forward": ("torch TFLOP/s",),
    "bench_backward": ("torch TFLOP/s|torch SDPA TFLOP/s",),
    "bench_decode": ("peer GB/s",),
}


#: decode's peers as bench/decode.py names them, per cache layout: the record's ``peer`` and
#: ``peer GB/s`` are the one that reads the same cache (paged: gather + SDPA)
DECODE_PEERS = {"paged": "torch gather + SDPA", "contiguous": "torch SDPA contiguous"}


def is_latency_row(row):
    """bench/decode.py's latency rows (B = 1, microseconds per call) carry no GB/s."""
    return "us per call" in row


def normalize_rows(part, rows):
    """Keep the record's keys whatever the bench script calls them: ``peer``/``peer GB/s`` for
    decode (from ``<peer> GB/s``), ``torch TFLOP/s`` for the backward (from ``torch SDPA
    TFLOP/s``).  The script's own keys stay too."""
    for r in rows:
        if part == "bench_decode" and not is_latency_row(r) and "peer GB/s" not in r:
            layout = "contiguous" if str(r.get("cache", "")).startswith("contiguous") else "paged"
            name = DECODE_PEERS[layout]
            if f"{name} GB/s" in r:
                r["peer"], r["peer GB/s"] = name, r[f"{name} GB/s"]
        if part == "bench_backward" and "torch TFLOP/s" not in r and "torch SDPA TFLOP/s" in r:
            r["torch TFLOP/s"] = r["torch SDPA TFLOP/s"]
    return rows


def gpu_slug(name):
    """``NVIDIA H200`` -> ``h200``: the ``<gpu>`` of the record's file name."""
    s = re.sub(r"^nvidia\s+", "", str(name).strip(), flags=re.I).lower()
    return re.sub(r"[^a-z0-9]+", "-", s).strip("-") or "gpu"


def _has(row, key):
    return any(k in row for k in key.split("|"))


def validate_record(rec):
    """Problems with a record (``[]`` if none): the keys docs/performance.md renders.  A dry run
    (``rec["dry_run"]``) need not have the measured keys; a GPU run must."""
    problems = []
    for key in ("record_format", "date", "commit", "gpu", "versions", "ceilings"):
        if key not in rec:
            problems.append(f"missing top-level key {key!r}")
    measured = not rec.get("dry_run", False)
    torch = str(rec.get("versions", {}).get("torch", "not installed")) != "not installed"
    if measured and not isinstance(rec.get("ceilings", {}).get("copy_GBps"), (int, float)):
        problems.append("ceilings.copy_GBps is not a number")
    for part, keys in REQUIRED_ROW_KEYS.items():
        rows = rec.get(part, {}).get("rows")
        if not rows:
            problems.append(f"{part}.rows missing or empty")
            continue
        for i, row in enumerate(rows):
            if part == "bench_decode" and is_latency_row(row):
                need = ["dtype", "cache", "context", "us per call"]
            else:
                need = list(keys) + (list(MEASURED_ROW_KEYS[part]) if measured else [])
                peered = not (part == "bench_decode" and row.get("dtype") == "e4m3")
                need += list(PEER_ROW_KEYS[part]) if measured and torch and peered else []
            for k in need:
                if not _has(row, k):
                    problems.append(f"{part}.rows[{i}] has no {k!r}")
    return problems


def write_record(report, results=RESULTS):
    """Write the report as ``results/<date>-<gpu>.json`` (``-2``, ``-3``... if taken) and copy it
    to ``results/latest.json``; return the path."""
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    stem = f"{report['date'][:10]}-{gpu_slug(report.get('gpu', 'gpu'))}"
    path, n = results / f"{stem}.json", 2
    while path.exists():
        path, n = results / f"{stem}-{n}.json", n + 1
    text = json.dumps(report, indent=1, default=str) + "\n"
    path.write_text(text)
    (results / "latest.json").write_text(text)
    return path


def _fmt(v, digits=3):
    if isinstance(v, bool) or v is None:
        return "" if v is None else str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.0f}" if abs(v) >= 10 ** digits else f"{v:.{digits}g}"
    return str(v)


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return "\n".join(out) + "\n"


def render_record(rec):
    """The record as the Markdown tables of docs/performance.md."""
    v = rec.get("versions", {})
    c = rec.get("ceilings", {})
    ds = c.get("datasheet", {})
    md = [f"**{rec.get('gpu')}**, {rec.get('date')}, commit `{rec.get('commit')}`"
          + (" (dry run in the simulator: nothing measured)" if rec.get("dry_run") else "")
          + f"; numba {v.get('numba')}, numba-cuda {v.get('numba-cuda')}, CuPy {v.get('cupy')}, "
          f"torch {v.get('torch')}, driver {v.get('driver', '?')}.\n"]
    if rec.get("source"):
        md.append(f"\nSource: {rec['source']}\n")
    md.append("\n" + _table(["ceiling", "measured", "data sheet"], [
        ["float32 FMA (SIMT), TFLOP/s", _fmt(c.get("fma_TFLOPs")), _fmt(ds.get("fp32_TFLOPs"))],
        ["copy bandwidth (read + write), GB/s", _fmt(c.get("copy_GBps"), 4),
         _fmt(ds.get("hbm_GBps"), 4)],
        ["float16 tensor cores (dense), TFLOP/s", "", _fmt(ds.get("fp16_tensor_TFLOPs"))]]))
    fma = ds.get("fp32_TFLOPs") or c.get("fma_TFLOPs")  # the data sheet's, else the measured
    tensor = ds.get("fp16_tensor_TFLOPs")
    for part, title in (("bench_forward", "Forward"), ("bench_backward", "Backward"),
                        ("bench_wgmma", "Warpgroup (wgmma) forward")):
        rows = rec.get(part, {}).get("rows") or []
        body = []
        for r in rows:
            ours = r.get("TFLOP/s") if not rec.get("dry_run") else None  # simulator: no rate
            peer = r.get("torch TFLOP/s", r.get("torch SDPA TFLOP/s"))
            ratio = ours / peer if isinstance(ours, float) and isinstance(peer, float) else None
            # float16 / bfloat16 run on tensor cores: their roof is the tensor-core peak
            roof, which = ((tensor, "tensor") if r.get("dtype") in ("float16", "bfloat16")
                           else (fma, "fp32"))
            frac = (f"{100 * ours / roof:.0f}% {which}" if isinstance(ours, float) and roof
                    else "")
            body.append([r.get("dtype"), r.get("d"), "yes" if r.get("causal") else "no",
                         f"{r.get('B', '')}x{r.get('H', '')}", r.get("N"), _fmt(ours),
                         _fmt(peer), _fmt(ratio, 2), frac])
        if part == "bench_wgmma" and not body:
            continue
        md.append(f"\n{title} (TFLOP/s; flash-attn's FLOP count):\n\n")
        md.append(_table(["dtype", "d", "causal", "B x H", "N", "numba_flash", "torch SDPA",
                          "ratio", "of the peak (fp32 FMA or tensor)"], body)
                  if body else "(no rows)\n")
        if rec.get(part, {}).get("rows_from") == "stdout":
            md.append("\n(the part stopped at its time limit; these are the rows it had "
                      "printed)\n")
    rows = rec.get("bench_decode", {}).get("rows") or []
    sim = bool(rec.get("dry_run"))
    contiguous = f"{DECODE_PEERS['contiguous']} GB/s"
    body = [[r.get("dtype"), r.get("cache"), r.get("context"), "" if sim else _fmt(r.get("ms")),
             "" if sim else _fmt(r.get("GB/s")), _fmt(r.get("% copy"), 2), r.get("peer", ""),
             _fmt(r.get("peer GB/s")),
             "" if r.get("peer") == DECODE_PEERS["contiguous"] else _fmt(r.get(contiguous))]
            for r in rows if not is_latency_row(r)]
    md.append("\nDecode (GB/s of K/V read: only the K and V bytes count; % of the copy "
              "ceiling; the peer reads the same cache layout):\n\n")
    md.append(_table(["dtype", "cache", "context", "ms", "GB/s", "% copy", "peer", "peer GB/s",
                      "torch SDPA, contiguous copy, GB/s"], body) if body else "(no rows)\n")
    lat = [r for r in rows if is_latency_row(r)]
    if lat:
        us = [k for k in lat[0] if k.endswith(" us")]
        md.append("\nDecode latency (microseconds per call):\n\n")
        md.append(_table(["dtype", "cache", "B", "context", "numba_flash"] + us,
                         [[r.get("dtype"), r.get("cache"), r.get("B"), r.get("context"),
                           "" if sim else _fmt(r.get("us per call"))]
                          + ["" if sim else _fmt(r.get(k)) for k in us] for r in lat]))
    tests = rec.get("tests")
    if isinstance(tests, dict) and tests:
        md.append("\nTests on the device:\n\n" + "".join(
            f"* {key}: {val}\n" for key, val in tests.items() if not isinstance(val, (dict, list))))
    kernels = (rec.get("ncu") or {}).get("kernels") or []
    if kernels:
        cols = ["kernel", "block", "grid", "registers", "static smem", "theoretical occupancy",
                "achieved occupancy", "DRAM throughput", "issue slots busy", "duration"]
        md.append("\nNsight Compute, one launch per kernel at benchmark size:\n\n")
        md.append(_table(cols, [[short_kernel_name(k.get(col, "")) if col == "kernel"
                                 else k.get(col, "") for col in cols] for k in kernels]))
    return "".join(md)


def render_main(path):
    p = Path(path)
    if not p.exists():
        print(f"No GPU record yet: {path} does not exist. A session with a GPU writes it with "
              "`python bench/gpu_check.py OUTDIR` and commits it.")
        return 0
    rec = json.loads(p.read_text())
    problems = validate_record(rec)
    print(render_record(rec), end="")
    for pr in problems:
        print(f"\nrecord problem: {pr}")
    return 1 if problems else 0


def run_part(report, name, fn, *args, outdir=None):
    t0 = time.time()
    print(f"== {name}", flush=True)
    try:
        report[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001  a failing part is reported, the rest still runs
        report[name] = {"error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc().splitlines()[-8:]}
    print(json.dumps(report[name], default=str)[:2000], flush=True)
    print(f"   ({time.time() - t0:.1f} s)", flush=True)
    if outdir is not None:  # the report so far: a lease that ends mid-run keeps the parts done
        (Path(outdir) / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))


#: seconds per part on a GPU (the lease's budget; each is a subprocess timeout there); a dry run
#: (the test suite's) has no time limit. ``--budget NAME=S`` overrides one, ``NAME=0`` skips it.
GPU_BUDGETS = {"tests": 150, "wgmma_tests": 120, "forward": 110, "wgmma": 60, "backward": 90,
               "decode": 90, "windowed": 40, "ncu": 240}


def parse_budgets(items):
    """``["forward=80", "windowed=0"]`` -> GPU_BUDGETS with those entries replaced."""
    budgets = dict(GPU_BUDGETS)
    for item in items or ():
        name, sep, sec = item.partition("=")
        if not sep or name not in budgets:
            raise SystemExit(f"--budget: expected NAME=SECONDS with NAME one of "
                             f"{', '.join(budgets)}, got {item!r}")
        try:
            budgets[name] = int(sec)
        except ValueError:
            raise SystemExit(f"--budget: {name}'s seconds must be an integer, got {sec!r}")
    return budgets


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", nargs="?", help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--dry-run", action="store_true",
                    help="run everything in the simulator at toy sizes (for CI)")
    ap.add_argument("--skip-tests", action="store_true", help="skip part 3")
    ap.add_argument("--ncu", action="store_true",
                    help="part 5: Nsight Compute summary per kernel (adds about 2 minutes)")
    ap.add_argument("--record", metavar="DIR", default=None,
                    help="where the record goes (default bench/results on a GPU; a dry run "
                         "writes one only when given)")
    ap.add_argument("--render", metavar="RECORD", help="print RECORD (a results JSON) as the "
                    "Markdown tables of docs/performance.md and exit")
    ap.add_argument("--budget", action="append", metavar="NAME=S",
                    help="a GPU part's time limit in seconds (0 skips it); NAME one of "
                         + ", ".join(GPU_BUDGETS))
    ap.add_argument("--commit", help="the commit to record (default: git rev-parse HEAD; a "
                    "copy of the tree without .git, as on a lent machine, needs it)")
    ap.add_argument("--ncu-target", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        return render_main(args.render)
    dry = args.dry_run
    if args.ncu_target:
        ncu_target(dry)
        return 0
    if args.outdir is None:
        ap.error("OUTDIR is required")
    if not dry and numba_flash.backend() != "cuda":
        print("no GPU backend here: use --dry-run", file=sys.stderr)
        return 2
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    report = {"record_format": RECORD_FORMAT,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry_run": dry}
    try:
        report["commit"] = args.commit or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
            text=True).stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        report["commit"] = "?"
    gpu_budgets = parse_budgets(args.budget)
    run_part(report, "versions", part_versions, dry, outdir=outdir)
    report["gpu"] = report["versions"].get("device", "?") if isinstance(
        report.get("versions"), dict) else "?"
    run_part(report, "ceilings", part_ceilings, dry, outdir=outdir)
    if not args.skip_tests and (dry or gpu_budgets["tests"]):
        run_part(report, "tests", part_tests, dry, None if dry else gpu_budgets["tests"],
                 None if dry else gpu_budgets["wgmma_tests"], outdir=outdir)
    names = ("forward", "wgmma", "backward", "decode", "windowed")
    budgets = {name: None if dry else gpu_budgets[name] for name in names}
    for name, budget in budgets.items():
        if dry or budget:
            run_part(report, f"bench_{name}", part_bench, name, dry, outdir, budget,
                     outdir=outdir)
    if args.ncu and (dry or gpu_budgets["ncu"]):
        run_part(report, "ncu", part_ncu, dry, gpu_budgets["ncu"], outdir=outdir)

    ceilings = report.get("ceilings", {})
    md = [f"# GPU check {report['date']} (commit {report['commit']})\n"]
    v = report.get("versions", {})
    md.append("| " + " | ".join(f"{k}: {val}" for k, val in v.items()
                               if not isinstance(val, dict)) + " |\n")
    ds = ceilings.get("datasheet", {})
    md.append(f"\nCeilings: copy bandwidth {ceilings.get('copy_GBps')} GB/s measured "
              f"({ds.get('hbm_GBps')} data sheet), fp32 FMA {ceilings.get('fma_TFLOPs')} TFLOP/s "
              f"measured ({ds.get('fp32_TFLOPs')} data sheet)\n")
    t = report.get("tests", {})
    md.append(f"\nTests on the device: {t.get('summary', t.get('error', 'skipped'))}\n")
    for name in budgets:
        part = report.get(f"bench_{name}", {})
        md.append(f"\n## {name}\n\n")
        if "rows" in part:
            md.append(markdown_table(add_fractions([dict(r) for r in part["rows"]], ceilings)))
        else:
            md.append(f"no table: {part.get('error') or part.get('stderr_tail')}\n")
    md.append("\n## as rendered in docs/performance.md\n\n" + render_record(report))
    (outdir / "gpu_check.md").write_text("".join(md))
    (outdir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {outdir / 'gpu_check.md'} and {outdir / 'gpu_check.json'}")
    record_dir = args.record or (None if dry else RESULTS)
    if record_dir is not None:
        path = write_record(report, record_dir)
        print(f"wrote the record {path} and {Path(record_dir) / 'latest.json'}: commit both")
    problems = validate_record(report)
    for pr in problems:
        print(f"record problem: {pr}")
    failed = [k for k, val in report.items() if isinstance(val, dict) and
              (val.get("error") or val.get("returncode", 0) not in (0, None))]
    if failed:
        print("parts with problems:", ", ".join(failed))
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
