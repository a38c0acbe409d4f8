"""One GPU session's check, planned to fit a lent machine: warm the kernel cache on every core,
run the device tests with each test named, the benchmarks, the other issues' checks, Nsight
Compute and compute-sanitizer; every part on a budget, every part kept if a later one fails.

    python bench/gpu_check.py OUTDIR                     # a GPU: the plan below, <= 9 minutes
    python bench/gpu_check.py /tmp/gc --copy-to "$OUT" --record "$OUT/results"   # a lent GPU
    python bench/gpu_check.py OUTDIR --budget tests=200 --skip sanitizer   # one part's seconds
    python bench/gpu_check.py OUTDIR --dry-run           # anywhere: every part in the simulator
    python bench/gpu_check.py --plan                     # print the plan of device time, exit
    python bench/gpu_check.py --render bench/results/latest.json   # the record as Markdown

The plan (:data:`PLAN`; seconds of device time, printed at the start with their sum, which
tests/bench keeps <= 540): each part runs in processes of its own, each process in a process
group of its own, stopped when the part's budget runs out (SIGINT, then SIGKILL a few seconds
later) and reported as ``timeout`` with what it had written so far; a total limit
(``--total``, 540 s on a GPU) cuts the last parts short if earlier ones ran over.  In order:

1. ``versions``: device, driver, numba, numba-cuda, CuPy, torch, ncu, compute-sanitizer, the
   pytest plugins there;
2. ``ceilings``: after >= 1 s of FMA work (the GPU leaves its idle clock), the device-to-device
   copy bandwidth (GB/s, read + write) and a float32 SIMT FMA rate, beside the data sheet;
3. ``warmup``: every ``numba-flash warmup --all`` configuration compiled into the on-disk kernel
   cache, one process per core (bench/kernel_warmup.py), so the tests and benchmarks that follow
   load kernels instead of compiling them; the cache's kernel count before and after;
4. ``tests``: tests/kernels (not the compile tier) and every ``gpu``-marked test, ``pytest -n
   <cores> -v -rA --junitxml`` with ``CUDA_LAUNCH_BLOCKING=1`` (a CUDA error is raised by the
   launch that made it) and bench/gpu_check_pytest.py, which writes one JSON line per test as it
   finishes (``tests/events.jsonl``: a run stopped at its limit names every test that finished
   and the ones still running) and restarts an xdist worker after a CUDA error that spoils its
   context; the record keeps the counts and every test that did not pass, with its message;
5. ``bench_forward``, ``bench_backward``, ``bench_decode``, ``bench_wgmma`` (``bench_windowed``:
   budget 0, off): bench/forward.py, backward.py and decode.py beside their peers in the same
   run, each figure also a fraction of its ceiling; a benchmark stopped at its limit keeps the
   rows it had printed;
6. the other issues' checks, each its own part: ``decode_latency`` (B = 1, 1k context, µs per
   call beside torch SDPA; goal 40), ``per_call`` (forward and backward per call, beside ncu's
   kernel time), ``kvcache_32k`` (``numba_flash.torch.flash_attn_with_kvcache`` on a 32k-token
   cache in flash-attn's ``[num_blocks, page, Hkv, d]`` layout beside torch SDPA),
   ``host_overhead`` (bench/host_overhead.py --json on CuPy arrays; "not built yet" while that
   script is missing), ``first_call`` (a fresh process's first forward, kernel cache warm and
   cold); the targets are in bench/gpu_targets.py;
7. ``ncu``: Nsight Compute on one call of each of bench/gpu_targets.py's ``NCU_CASES`` (the mma
   forward at float16 d = 64 and 128, the backward's dK/dV and dQ kernels, the split-KV decode
   at float16 d = 128 over a 32k cache, MLA's latent decode), one process each, selected with
   ``--kernel-name regex:... --launch-skip 0 --launch-count N``, sections :data:`NCU_SECTIONS`
   (warp-state stall reasons, memory workload, source counters, launch, occupancy, speed of
   light; ``--ncu-section`` replaces them), ``--clock-control none``; each report exported and
   read back as CSV (``--page raw``, ``details``, ``source``) into OUTDIR/ncu/;
8. ``sanitizer``: ``compute-sanitizer --tool memcheck`` and ``--tool racecheck`` on one small
   case of each kernel family (bench/gpu_targets.py's ``SANITIZER_CASES``: forward SIMT / mma /
   wgmma, backward SIMT / mma, split-KV decode, MLA, append, merge), each finding filed under
   the case that was running; a case that ends the process is named and the rest run in a
   fresh one;
9. ``bundle``: OUTDIR/gpu_check.json (rewritten after every part), gpu_check.md (the tables),
   gpu_check.tar.gz (every log, JSON, junit XML and CSV; rewritten after every part), and
   ncu_reports.tar.gz (the .ncu-rep files, up to 15 MiB), each copied to ``--copy-to`` (the
   device tool brings back at most 8 files of 16 MiB); on a GPU the record
   ``bench/results/<date>-<gpu>.json`` (``--record DIR`` elsewhere), copied to ``latest.json``,
   with the tests' junit XML beside it; docs/performance.md renders it (``--render``).

``--dry-run`` prints the same plan and runs every part on this CPU in the simulator at tiny
shapes, with no time limits (a ``--budget`` given still applies): the ncu and compute-sanitizer
command lines are printed, and their targets run in the simulator; the tests part runs
``-k softmax``.  Its Python commands run in forked copies of this process (numba is imported
once; ``--no-fork`` starts a new interpreter for each, as on a GPU, where a forked CUDA context
would be unusable).  The record is the report itself; :func:`validate_record` states its format and
bench/results/README.md describes it.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
T_START = time.monotonic()   # the plan's total counts from here (numba's import included)
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import numba_flash  # noqa: E402
from numba import cuda, float32  # noqa: E402

import part_runner  # noqa: E402
from part_runner import PartRun, bundle, cache_census, tail_lines  # noqa: E402

BENCH = ROOT / "bench"


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
    from importlib.metadata import version

    try:
        info["numba-cuda"] = version("numba-cuda")
    except Exception as exc:  # noqa: BLE001
        info["numba-cuda"] = f"? ({exc})"
    for mod, dists in (("cupy", ("cupy-cuda13x", "cupy-cuda12x", "cupy")), ("torch", ("torch",))):
        info[mod] = "not installed"   # read from the metadata: importing torch takes seconds
        for dist in dists:
            try:
                info[mod] = version(dist)
                break
            except Exception:  # noqa: BLE001
                continue
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



def _missing(pr, tool):
    """A part whose tool is not on the machine: failed, saying which."""
    pr.failed = True
    pr.res["error"] = f"{tool} not found"


def find_tool(name):
    """An NVIDIA tool on PATH, or where the CUDA image keeps it (None if absent)."""
    exe = shutil.which(name)
    if exe:
        return exe
    import glob

    for pattern in (f"/usr/local/cuda/bin/{name}", f"/opt/nvidia/nsight-compute/*/{name}",
                    f"/usr/local/cuda/nsight-compute*/{name}"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def tool_versions():
    """ncu's and compute-sanitizer's versions, the cores, the pytest plugins the tests use."""
    import importlib.util

    info = {"cpu_count": os.cpu_count()}
    for tool in ("ncu", "compute-sanitizer"):
        exe = find_tool(tool)
        if exe is None:
            info[tool] = "not found"
            continue
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
            lines = [ln.strip() for ln in out.stdout.splitlines() if ln.strip()]
            info[tool] = f"{lines[-1] if lines else '?'} ({exe})"
        except Exception as exc:  # noqa: BLE001
            info[tool] = f"? ({type(exc).__name__}: {exc})"
    info["pytest_plugins"] = {m: importlib.util.find_spec(m) is not None
                              for m in ("xdist", "pytest_timeout")}
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



def recover_rows(part, name, lines=None):
    """A benchmark stopped at its time limit writes no JSON, but it printed each row as it was
    measured (bench/backward.py as JSON, bench/forward.py as a dict): those rows of ``lines``
    (default ``part["stdout_tail"]``), kept in ``part["rows"]`` with ``part["rows_from"] =
    "stdout"``.  Returns ``part``."""
    import ast

    rows = []
    for line in part.get("stdout_tail", []) if lines is None else lines:
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



# -- Nsight Compute: reading its CSV ------------------------------------------------------
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



# -- the record: bench/results/<date>-<gpu>.json and latest.json ----------------------------
RESULTS = ROOT / "bench" / "results"
RECORD_FORMAT = 2   # 2: the plan's parts, each with status / budget_s / seconds
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


def write_record(report, results=RESULTS, junit=None):
    """Write the report as ``results/<date>-<gpu>.json`` (``-2``, ``-3``... if taken) and copy it
    to ``results/latest.json``; the tests' ``junit`` XML, when there is one, beside it as
    ``<date>-<gpu>.junit.xml``.  Returns the path."""
    results = Path(results)
    results.mkdir(parents=True, exist_ok=True)
    stem = f"{report['date'][:10]}-{gpu_slug(report.get('gpu', 'gpu'))}"
    path, n = results / f"{stem}.json", 2
    while path.exists():
        path, n = results / f"{stem}-{n}.json", n + 1
    if junit is not None and Path(junit).exists():
        xml = path.with_name(path.stem + ".junit.xml")
        shutil.copyfile(junit, xml)
        report.setdefault("tests", {})["junit_record"] = xml.name
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
    if isinstance(tests, dict) and "counts" in tests:   # record_format 2: the test part's own
        md.append(f"\nTests on the device ({tests.get('status')}): {tests.get('summary')}\n")
        bad = tests.get("not_passed") or []
        if bad:
            md.append("\n" + _table(["outcome", "test", "message"], [
                [t.get("outcome"), f"`{t.get('nodeid')}`", str(t.get("message", ""))[:160]]
                for t in bad[:60]]))
            if len(bad) > 60:
                md.append(f"\n({len(bad) - 60} more in the record)\n")
    elif isinstance(tests, dict) and tests:
        md.append("\nTests on the device:\n\n" + "".join(
            f"* {key}: {val}\n" for key, val in tests.items() if not isinstance(val, (dict, list))))
    kernels = (rec.get("ncu") or {}).get("kernels") or []
    if kernels:
        cols = ["kernel", "block", "grid", "registers", "static smem", "theoretical occupancy",
                "achieved occupancy", "DRAM throughput", "issue slots busy", "duration"]
        if any("case" in k for k in kernels):
            cols = ["case"] + cols
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


# -- the plan ---------------------------------------------------------------------------------
#: (part, seconds of device time, what it does), in the order they run.  The seconds are each
#: part's budget on a GPU (a subprocess time limit there); their sum is the plan, <= TOTAL_S.
PLAN = (
    ("versions", 10, "device, driver, libraries, ncu, compute-sanitizer, pytest plugins"),
    ("ceilings", 15, "float32 FMA rate and copy bandwidth after a 1 s warm-up"),
    ("warmup", 75, "the kernel cache filled on every core (bench/kernel_warmup.py --all)"),
    ("tests", 125, "tests/kernels + gpu-marked tests, pytest -n <cores> -v -rA, junit XML"),
    ("bench_forward", 30, "bench/forward.py --quick, N = 4096, d = 64 and 128, beside torch"),
    ("bench_backward", 30, "bench/backward.py --quick, beside torch SDPA's backward"),
    ("bench_decode", 30, "bench/decode.py --quick --fp8 --mla, beside torch"),
    ("bench_wgmma", 20, "bench/forward.py --kernel wgmma, float16 and e4m3, N = 4096"),
    ("bench_windowed", 0, "bench/forward.py --windowed (off; --budget bench_windowed=40)"),
    ("decode_latency", 10, "decode B = 1, 1k context: us per call beside torch SDPA (goal 40)"),
    ("per_call", 12, "forward / backward per call, beside ncu's kernel time"),
    ("kvcache_32k", 15, "torch flash_attn_with_kvcache, 32k paged cache, beside torch SDPA"),
    ("host_overhead", 10, "bench/host_overhead.py --json on CuPy arrays"),
    ("first_call", 22, "a fresh process's first forward, kernel cache warm and cold"),
    ("ncu", 70, "Nsight Compute on forward, backward, decode, MLA (one launch each)"),
    ("sanitizer", 60, "compute-sanitizer memcheck + racecheck, one small case per family"),
    ("bundle", 5, "report, Markdown, .tar.gz of logs / junit / CSVs, the record"),
)
#: the plan's limit: 9 minutes of a lent session's 15 (its start, the copies and the idle
#: wait take the rest)
TOTAL_S = 540
#: old names of --budget (before the plan): the benchmark parts
BUDGET_ALIASES = {"forward": "bench_forward", "backward": "bench_backward",
                  "decode": "bench_decode", "wgmma": "bench_wgmma", "windowed": "bench_windowed"}
#: the Nsight Compute sections each case is profiled with (``--ncu-section`` replaces them):
#: warp-state stall reasons, memory workload, per-instruction source counters, launch
#: configuration, occupancy, speed of light, and the compute workload (issue slots busy)
NCU_SECTIONS = ("WarpStateStats", "MemoryWorkloadAnalysis", "SourceCounters", "LaunchStats",
                "Occupancy", "SpeedOfLight", "ComputeWorkloadAnalysis")
#: ncu's pages written as CSV from each exported report (``--import``)
NCU_PAGES = (("raw", ()), ("details", ()), ("source", ("--print-source", "sass")))
#: the sanitizer tools, each over every SANITIZER_CASES family; its share of the part's budget
SANITIZER_TOOLS = (("memcheck", ("--tool", "memcheck", "--leak-check", "no"), 0.5),
                   ("racecheck", ("--tool", "racecheck"), 1.0))


def plan_budgets():
    return {name: secs for name, secs, _ in PLAN}


def plan_total(budgets=None):
    return sum((budgets or plan_budgets()).values())


def plan_text(budgets, dry, only=None):
    """The plan as printed at the start: one line per part and the sum."""
    lines = [f"plan of device time: {len(PLAN)} parts, seconds on the GPU (each part stopped at "
             f"its budget; 0: off)"]
    for name, _, what in PLAN:
        mark = "" if only is None or name in only else "  (not in this run)"
        lines.append(f"  {name:<15} {budgets[name]:>4} s  {what}{mark}")
    total = plan_total(budgets)
    lines.append(f"  {'total':<15} {total:>4} s  = {total / 60:.1f} min of the {TOTAL_S} s "
                 f"({TOTAL_S // 60} min) a session's check may take")
    if dry:
        lines.append("dry run: every part in the simulator at tiny shapes, no time limits "
                     "(a --budget given still applies)")
    return "\n".join(lines)


def parse_budgets(items):
    """``["tests=200", "bench_windowed=40"]`` -> ``(budgets, names given)``: the plan's budgets
    with those replaced (0 turns a part off)."""
    budgets = plan_budgets()
    given = set()
    for item in items or ():
        name, sep, sec = item.partition("=")
        name = BUDGET_ALIASES.get(name, name)
        if not sep or name not in budgets:
            raise SystemExit(f"--budget: expected NAME=SECONDS with NAME one of "
                             f"{', '.join(budgets)}, got {item!r}")
        try:
            budgets[name] = int(sec)
        except ValueError:
            raise SystemExit(f"--budget: {name}'s seconds must be an integer, got {sec!r}")
        given.add(name)
    return budgets, given


def _py(*args):
    return [sys.executable, *[str(a) for a in args]]


def _dry(pr):
    return ["--dry-run"] if pr.dry else []


def _read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _read_jsonl(path):
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return rows


# -- parts 1-2: versions, ceilings (this script's --target, in a process of its own) ----------

def run_versions(pr):
    js = pr.path("parts", "versions.json")
    pr.step("versions", _py(__file__, "--target", "versions", "--json", js, *_dry(pr)))
    pr.res.update(_read_json(js) or {})


def run_ceilings(pr):
    js = pr.path("parts", "ceilings.json")
    pr.step("ceilings", _py(__file__, "--target", "ceilings", "--json", js, *_dry(pr)))
    pr.res.update(_read_json(js) or {})


# -- part 3: the kernel cache, on every core --------------------------------------------------

def run_warmup(pr, jobs):
    import kernel_warmup

    pr.res["cache_before"] = cache_census()
    js, events = pr.path("parts", "warmup.json"), pr.path("parts", "warmup_events.jsonl")
    args = ["--all", "--events", events, "--json", js]
    # the dry run: a spread of six configurations on two processes, resolved, not compiled
    args += ["--dry-run", "--limit", "6", "--jobs", "2"] if pr.dry else ["--jobs", jobs]
    st = pr.step("kernel_warmup", _py(BENCH / "kernel_warmup.py", *args))
    data = _read_json(js)
    if data is None:   # stopped at its limit: what had finished, from its events
        data = kernel_warmup.summary(_read_jsonl(events), jobs, st.get("seconds", 0.0))
        data["from"] = "events (the warm-up did not finish)"
    pr.res.update(data)
    pr.res["events"] = pr.rel(events)
    pr.res["cache_after"] = cache_census()


# -- part 4: the device tests -----------------------------------------------------------------

def gpu_test_paths():
    """tests/kernels and every test file elsewhere that marks a test ``gpu``."""
    files = []
    for p in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("tests/kernels/"):
            continue
        try:
            if "mark.gpu" in p.read_text(errors="replace"):
                files.append(rel)
        except OSError:
            continue
    return ["tests/kernels", *files]


def _has_module(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def tests_command(dry, events, junit, jobs, paths=None, test_timeout=90):
    """The tests part's pytest command.  ``paths`` None: the GPU session's selection
    (tests/kernels without the compile tier, and the gpu-marked tests; a dry run: tests/kernels
    ``-k softmax``); else those paths as they are (tests/bench's own runs)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "gpu_check_pytest",
           f"--gpu-check-events={events}", "-p", "no:cacheprovider", "-v", "-rA",
           f"--junitxml={junit}", "-o", "junit_family=xunit2", "-o", "console_output_style=count"]
    if paths is None:
        cmd.append("--gpu-check-select")
        paths = ["tests/kernels"] if dry else gpu_test_paths()
        if dry:
            cmd += ["-k", "softmax"]
    if jobs and _has_module("xdist"):
        from importlib.metadata import version

        try:
            major, minor = (int(x) for x in version("pytest-xdist").split(".")[:2])
        except Exception:  # noqa: BLE001
            major, minor = 0, 0
        dist = "worksteal" if (major, minor) >= (3, 2) else "load"
        cmd += ["-n", str(jobs), "--dist", dist, "--max-worker-restart", str(4 * jobs),
                "--gpu-check-restart-on-sticky"]
    else:
        cmd += ["-n", "0"] if _has_module("xdist") else []
    if not dry and test_timeout and _has_module("pytest_timeout"):
        cmd += [f"--timeout={test_timeout}", "--timeout-method=thread"]
    return cmd + list(paths)


def _pytest_summary_lines(log):
    """pytest's last line and the ``short test summary info`` lines that are not PASSED."""
    lines = tail_lines(log, 4000, max_bytes=2_000_000)
    last = next((ln.strip("= ").strip() for ln in reversed(lines)
                 if re.match(r"^=+ .*\d+(\.\d+)?s( \(.*\))? =+$", ln)), "")
    short, inside = [], False
    for ln in lines:
        if "short test summary info" in ln:
            inside, short = True, []
            continue
        if inside and ln.startswith("="):
            inside = False
        elif inside and ln.strip() and not ln.startswith("PASSED"):
            short.append(ln.rstrip())
    return last, short


def write_junit(summary, path):
    """A junit XML file from the events' per-test outcomes (when pytest wrote none)."""
    from xml.sax.saxutils import quoteattr

    tests = summary["tests"]
    bad = {o: sum(1 for t in tests.values() if t["outcome"] == o)
           for o in ("failed", "error", "skipped", "crashed", "running when stopped")}
    out = ['<?xml version="1.0" encoding="utf-8"?>', "<testsuites>",
           f'<testsuite name="gpu_check (from events)" tests="{len(tests)}" '
           f'failures="{bad["failed"] + bad["crashed"]}" '
           f'errors="{bad["error"] + bad["running when stopped"]}" '
           f'skipped="{bad["skipped"]}">']
    for nodeid, t in tests.items():
        path_part, _, name = nodeid.rpartition("::")
        classname = path_part.replace("/", ".").removesuffix(".py").replace(".py::", ".")
        out.append(f"<testcase classname={quoteattr(classname)} name={quoteattr(name)} "
                   f'time="{t.get("duration", 0.0)}">')
        msg = quoteattr(t.get("message", t["outcome"]))
        if t["outcome"] in ("failed", "crashed"):
            out.append(f"<failure message={msg}/>")
        elif t["outcome"] in ("error", "running when stopped"):
            out.append(f"<error message={msg}/>")
        elif t["outcome"] in ("skipped", "xfailed"):
            out.append(f"<skipped message={msg}/>")
        out.append("</testcase>")
    out += ["</testsuite>", "</testsuites>"]
    Path(path).write_text("\n".join(out) + "\n")


def summarize_tests(pr, events, junit):
    """The tests part's entry from its events, log and junit XML."""
    import gpu_check_pytest

    summ = gpu_check_pytest.summarize_events(gpu_check_pytest.read_events(events))
    tests = summ["tests"]
    pr.res.update(collected=summ["collected"], counts=summ["counts"],
                  finished=summ["finished"], events=pr.rel(events))
    last, short = _pytest_summary_lines(pr.log)
    pr.res["summary"] = last or ("stopped before pytest's summary: " + ", ".join(
        f"{n} {o}" for o, n in sorted(summ["counts"].items())) + " (from the events)")
    pr.res["short_summary"] = short[:200]
    pr.res["not_passed"] = [
        {"nodeid": nodeid, **{k: t[k] for k in ("outcome", "message", "worker",
                                                 "sticky_cuda_error", "worker_crashed")
                              if k in t}}
        for nodeid, t in tests.items()
        if t["outcome"] not in ("passed", "skipped", "xfailed")]
    pr.res["skipped"] = sum(1 for t in tests.values() if t["outcome"] == "skipped")
    pr.res["slowest"] = [[nodeid, t.get("duration", 0.0)] for nodeid, t in sorted(
        tests.items(), key=lambda kv: -kv[1].get("duration", 0.0))[:15]]
    if not Path(junit).exists() and tests:
        write_junit(summ, junit)
        pr.res["junit_from"] = "events (pytest wrote none: it was stopped)"
    pr.res["junit"] = pr.rel(junit) if Path(junit).exists() else None


def run_tests(pr, jobs, paths=None, test_timeout=90):
    events, junit = pr.path("tests", "events.jsonl"), pr.path("tests", "junit.xml")
    for p in (events, junit):
        if p.exists():
            p.unlink()
    cmd = tests_command(pr.dry, events, junit, 2 if pr.dry and paths is None else jobs,
                       paths, test_timeout)
    env = {"PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT),
                                          os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "CUDA_LAUNCH_BLOCKING": "1"}
    pr.res["command"] = shlex.join(cmd)
    before = cache_census()
    st = pr.step("pytest", cmd, env=env, fork=False)
    pr.res["returncode"] = st["returncode"]
    summarize_tests(pr, events, junit)
    after = cache_census()
    pr.res["kernels_compiled_during_tests"] = after["kernels"] - before["kernels"]


# -- part 5: the benchmarks -------------------------------------------------------------------

def bench_command(name, dry, js, budget):
    """bench/<script>.py's command for the part ``bench_<name>``."""
    script = BENCH / f"{'forward' if name in ('windowed', 'wgmma') else name}.py"
    args = [script, "--quick", "--json", js]
    cut = (lambda reserve: ["--max-seconds", str(max(10, budget - reserve))]) if budget else None
    if name == "forward" and not dry:  # the goal shapes: N = 4096, d = 64 and 128 (issue 13)
        args += ["--n", "4096", "--d", "64,128"] + (cut(12) if cut else [])
    if name == "decode":  # issue 46: the e4m3 cache's rows beside float16's (no torch peer),
        args += ["--fp8", "--mla"]   # and MLA's latent decode, bfloat16 and e4m3
    if name == "wgmma":  # issue 33: the warpgroup forward beside torch SDPA (sm_90a), float16
        args += ["--kernel", "wgmma", "--dtype", "float16,e4m3"]   # issue 46: e4m3 too
        if not dry:
            args += ["--n", "4096", "--d", "64,128"] + (cut(10) if cut else [])
    if name == "windowed":  # issue 14: time grows with the window, not with N (float16)
        args = [script, "--windowed", "--dtype", "float16", "--json", js]
        args += [] if dry or not cut else cut(10)
    return _py(*args)


def run_bench(pr, name):
    js = pr.path("parts", f"bench_{name}.json")
    if js.exists():
        js.unlink()
    offset = pr.log.stat().st_size if pr.log.exists() else 0
    st = pr.step(name, bench_command(name, pr.dry, js, pr.budget))
    pr.res["returncode"] = st["returncode"]
    with open(pr.log, "rb") as f:
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    pr.res["stdout_tail"] = lines[-40:]
    data = _read_json(js)
    if data is not None:
        rows = data["rows"] if isinstance(data, dict) else data  # {"rows": [...]} or [...]
        pr.res["rows"] = normalize_rows(f"bench_{name}", rows)
    else:   # stopped at its limit: the rows it had printed
        recover_rows(pr.res, f"bench_{name}", lines)


# -- part 6: the other issues' checks ---------------------------------------------------------

def run_target(pr, target):
    """One of bench/gpu_targets.py's timed checks; its JSON (written after every case) read."""
    js = pr.path("parts", f"{target}.json")
    if js.exists():
        js.unlink()
    pr.step(target, _py(BENCH / "gpu_targets.py", target, "--json", js, *_dry(pr)))
    pr.res.update(_read_json(js) or {})


def run_host_overhead(pr):
    """bench/host_overhead.py (another issue's; called when it exists): ``--json`` prints one
    JSON object a line per op; on a GPU ``--device cupy`` (CuPy arrays), in a dry run its own
    default (the stand-in device)."""
    script = BENCH / "host_overhead.py"
    if not script.exists():
        pr.res.update(status="not built yet", note="bench/host_overhead.py does not exist yet "
                      "(another issue writes it); this slot runs it with --json when it does")
        return
    out = pr.path("parts", "host_overhead.jsonl")
    args = [script, "--json"]
    if not pr.dry and "cupy" in script.read_text(errors="replace"):
        args += ["--device", "cupy"]
    pr.step("host_overhead", _py(*args), stdout=out)
    rows = [r for r in _read_jsonl(out) if isinstance(r, dict)]
    pr.res["rows"] = rows
    pr.res["output"] = pr.rel(out)


def run_first_call(pr):
    """The first forward of a fresh process, with the kernel cache warm (the cache the warm-up
    filled) and cold (an empty NUMBA_CACHE_DIR); ``process_s``: the whole process."""
    cold = pr.outdir / "first_call_cold_cache"
    shutil.rmtree(cold, ignore_errors=True)
    cold.mkdir(parents=True)
    for mode, env in (("warm", {}), ("cold", {"NUMBA_CACHE_DIR": str(cold)})):
        js = pr.path("parts", f"first_call_{mode}.json")
        st = pr.step(mode, _py(BENCH / "gpu_targets.py", "first_call", "--json", js, *_dry(pr)),
                     env=env)
        pr.res[mode] = dict(_read_json(js) or {}, process_s=st.get("seconds"))
    shutil.rmtree(cold, ignore_errors=True)


# -- part 7: Nsight Compute -------------------------------------------------------------------

def ncu_profile_command(exe, case, rep, sections=NCU_SECTIONS, dry=False):
    """ncu on one call of NCU_CASES[case]: its kernels by name, exported to ``rep``."""
    import gpu_targets

    _, _, _, regex, count = gpu_targets.NCU_CASES[case]
    cmd = [exe, "--target-processes", "all", "--clock-control", "none",
           "--kernel-name", f"regex:{regex}", "--launch-skip", "0", "--launch-count", str(count)]
    for sec in sections:
        cmd += ["--section", sec]
    cmd += ["--export", rep, "--force-overwrite"]
    return cmd + _py(BENCH / "gpu_targets.py", "ncu", "--case", case) + (
        ["--dry-run"] if dry else [])


def ncu_import_commands(exe, rep):
    """``(page, command)``: the exported report read back as CSV, one page each."""
    return [(page, [exe, "--import", rep, "--csv", "--page", page, *extra])
            for page, extra in NCU_PAGES]


def _duration_ms(text):
    """ncu's ``Duration`` (``"1,286,112 ns"``, ``"1.29 ms"``, ``"328 usecond"``) in ms."""
    m = re.match(r"\s*([\d.,]+)\s*([a-z]*)", str(text or ""))
    if not m:
        return None
    value = float(m.group(1).replace(",", ""))
    unit = m.group(2)
    scale = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0,
             "msecond": 1.0, "s": 1e3, "second": 1e3}.get(unit)
    return None if scale is None else value * scale


def run_ncu(pr, sections):
    import gpu_targets

    cases = list(gpu_targets.NCU_CASES)
    exe = find_tool("ncu")
    shown = exe or "ncu"
    pr.res.update(sections=list(sections), cases=cases, kernels=[], csv={}, commands={})
    for case in cases:
        rep = pr.rel(pr.path("ncu", case))
        pr.res["commands"][case] = [shlex.join(ncu_profile_command(shown, case, rep, sections))]
        pr.res["commands"][case] += [shlex.join(c) for _, c in
                                     ncu_import_commands(shown, rep + ".ncu-rep")]
    if pr.dry:   # the command lines, and the target's every case in the simulator
        for case, cmds in pr.res["commands"].items():
            for c in cmds:
                print(f"   would run: {c}", flush=True)
        js = pr.path("parts", "ncu_target.json")
        pr.step("target", _py(BENCH / "gpu_targets.py", "ncu", "--case", "all", "--dry-run",
                              "--json", js))
        pr.res["target"] = _read_json(js)
        pr.res["note"] = "dry run: ncu not run; its commands printed, its target run"
        return
    if exe is None:
        return _missing(pr, "ncu (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute)")
    for i, case in enumerate(cases):
        left = pr.remaining()
        share = None if left is None else max(20.0, 1.5 * left / (len(cases) - i))
        rep = pr.path("ncu", case)
        rep_file = rep.with_name(rep.name + ".ncu-rep")
        if rep_file.exists():
            rep_file.unlink()
        pr.step(f"profile {case}", ncu_profile_command(exe, case, rep, sections), limit=share)
        if not rep_file.exists():
            continue
        pr.res["csv"][case] = []
        for page, cmd in ncu_import_commands(exe, rep_file):
            out = pr.path("ncu", f"{case}_{page}.csv")
            st = pr.step(f"{case} {page}", cmd, stdout=out, limit=30, check=False)
            if st["returncode"] == 0:
                pr.res["csv"][case].append(pr.rel(out))
        details = pr.outdir / "ncu" / f"{case}_details.csv"
        if details.exists():
            for k in parse_ncu_csv(details.read_text(errors="replace")):
                k["case"] = case
                pr.res["kernels"].append(k)


# -- part 8: compute-sanitizer ----------------------------------------------------------------

def parse_sanitizer(text):
    """Per case, from one process's output: ``{case: {"status", "findings", "errors"}}`` (the
    sanitizer's lines filed under the case that was running) and the summary lines."""
    cases, current, summary = {}, None, []
    for line in text.splitlines():
        m = re.match(r"case start: (\S+)", line)
        if m:
            current = m.group(1)
            cases[current] = {"status": "started", "findings": [], "errors": 0}
            continue
        m = re.match(r"case done: (\S+)\s*(.*)", line)
        if m:
            c = cases.setdefault(m.group(1), {"findings": [], "errors": 0})
            c["status"] = m.group(2).strip() or "ok"
            current = None
            continue
        if line.startswith("========="):
            body = line[9:]
            if "SUMMARY" in body:
                summary.append(line.strip())
            elif current is not None and body.strip() and "COMPUTE-SANITIZER" not in body:
                c = cases[current]
                if not body.startswith("  "):   # "=========     at ...": a finding's detail
                    c["errors"] += 1
                if len(c["findings"]) < 40:
                    c["findings"].append(line.rstrip())
    return cases, summary


def sanitizer_next(results, left, found, returncode):
    """After one sanitizer process over the cases ``left``: file what it found into ``results``
    and return the cases still to run in a fresh process (``[]``: none).  A case that started
    and never finished ended the process (a CUDA error that spoils the context, a crash): it is
    named, and the cases after it run again; a process stopped at its limit ends the tool."""
    results.update({c: dict(v) for c, v in found.items()})
    unfinished = [c for c in left if found.get(c, {}).get("status") in (None, "started")]
    if returncode in ("timeout", "no time left"):
        for c in unfinished:
            results.setdefault(c, {"findings": [], "errors": 0})["status"] = (
                "stopped at the limit" if c in found else "not run: no time left")
        return []
    if not unfinished:
        return []
    culprit = next((c for c in unfinished if c in found), None)
    if culprit is None:   # the process ended before its first case
        for c in unfinished:
            results[c] = {"status": f"not run: the process exited {returncode}",
                          "findings": [], "errors": 0}
        return []
    results[culprit]["status"] = (f"the process ended in this case (exit {returncode}); the "
                                  f"cases after it ran in a fresh one")
    return [c for c in unfinished if c != culprit]


def sanitizer_command(exe, tool_args, cases, js, dry=False):
    return ([exe, *tool_args, "--print-limit", "50", "--target-processes", "all"]
            + _py(BENCH / "gpu_targets.py", "sanitizer", "--cases", ",".join(cases),
                  "--json", js) + (["--dry-run"] if dry else []))


def run_sanitizer(pr):
    import gpu_targets

    cases = list(gpu_targets.SANITIZER_CASES)
    exe = find_tool("compute-sanitizer")
    shown = exe or "compute-sanitizer"
    pr.res.update(cases=cases, tools={}, commands={})
    for tool, args, _ in SANITIZER_TOOLS:
        pr.res["commands"][tool] = shlex.join(sanitizer_command(
            shown, args, cases, pr.rel(pr.path("parts", f"sanitizer_{tool}.json"))))
    if pr.dry:
        for c in pr.res["commands"].values():
            print(f"   would run: {c}", flush=True)
        offset = pr.log.stat().st_size if pr.log.exists() else 0
        js = pr.path("parts", "sanitizer_target.json")
        pr.step("target", _py(BENCH / "gpu_targets.py", "sanitizer", "--cases", ",".join(cases),
                              "--json", js, "--dry-run"))
        found, _ = parse_sanitizer(_log_since(pr.log, offset))
        pr.res["target"] = {c: v.get("status") for c, v in found.items()}
        pr.res["note"] = "dry run: compute-sanitizer not run; its commands printed, its target run"
        return
    if exe is None:
        return _missing(pr, "compute-sanitizer")
    for tool, args, share in SANITIZER_TOOLS:
        results, summaries, left, tries = {}, [], list(cases), 0
        while left and tries < 4:
            tries += 1
            remaining = pr.remaining()
            limit = None if remaining is None else max(5.0, remaining * share)
            js = pr.path("parts", f"sanitizer_{tool}_{tries}.json")
            offset = pr.log.stat().st_size if pr.log.exists() else 0
            st = pr.step(f"{tool} ({len(left)} cases)",
                         sanitizer_command(exe, args, left, js), limit=limit, check=False)
            found, summary = parse_sanitizer(_log_since(pr.log, offset))
            summaries += summary
            left = sanitizer_next(results, left, found, st["returncode"])
        pr.res["tools"][tool] = {"cases": results, "summary": summaries,
                                 "errors": sum(v.get("errors", 0) for v in results.values())}
        if pr.res["tools"][tool]["errors"]:
            pr.failed = True


def _log_since(log, offset):
    try:
        with open(log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# -- part 9: the bundle, the Markdown, the record ---------------------------------------------

def join_per_call(report):
    """Put Nsight Compute's kernel time beside each per_call row (same case)."""
    rows = (report.get("per_call") or {}).get("rows") or []
    kernels = (report.get("ncu") or {}).get("kernels") or []
    for r in rows:
        ks = [k for k in kernels if k.get("case") == r.get("case")]
        ms = [_duration_ms(k.get("duration")) for k in ks]
        if ks and all(m is not None for m in ms):
            r["ncu kernels"] = [k.get("kernel") for k in ks]
            r["ncu kernel ms"] = sum(ms)
            if isinstance(r.get("ms per call"), (int, float)) and r["ms per call"]:
                r["kernel share of the call"] = sum(ms) / r["ms per call"]


def write_markdown(report, outdir):
    ceilings = report.get("ceilings", {})
    md = [f"# GPU check {report['date']} (commit {report['commit']})\n\n"]
    v = report.get("versions", {})
    md.append("| " + " | ".join(f"{k}: {val}" for k, val in v.items()
                               if not isinstance(val, (dict, list)) and k not in HOUSEKEEPING)
              + " |\n")
    md.append("\n## The plan\n\n" + _table(
        ["part", "budget s", "used s", "status", "note"],
        [[name, (report.get(name) or {}).get("budget_s", ""),
          (report.get(name) or {}).get("seconds", ""), (report.get(name) or {}).get("status", ""),
          str((report.get(name) or {}).get("error") or (report.get(name) or {}).get("note")
              or "")[:120]] for name, _, _ in PLAN]))
    ds = ceilings.get("datasheet", {})
    md.append(f"\nCeilings: copy bandwidth {ceilings.get('copy_GBps')} GB/s measured "
              f"({ds.get('hbm_GBps')} data sheet), fp32 FMA {ceilings.get('fma_TFLOPs')} TFLOP/s "
              f"measured ({ds.get('fp32_TFLOPs')} data sheet)\n")
    t = report.get("tests", {})
    md.append(f"\nTests on the device: {t.get('summary', t.get('error', t.get('status')))}\n")
    for item in t.get("not_passed", [])[:100]:
        md.append(f"* {item.get('outcome')}: `{item['nodeid']}` {item.get('message', '')}\n")
    for name in ("forward", "backward", "decode", "wgmma", "windowed"):
        part = report.get(f"bench_{name}", {})
        md.append(f"\n## {name}\n\n")
        if part.get("rows"):
            md.append(markdown_table(add_fractions([dict(r) for r in part["rows"]], ceilings)))
        elif part.get("status") == "skipped":
            md.append(f"skipped: {part.get('note')}\n")
        else:
            md.append(f"no table: {part.get('status')} "
                      f"{part.get('error') or (part.get('log_tail') or [''])[-1]}\n")
    for name in ("decode_latency", "per_call", "kvcache_32k", "host_overhead"):
        part = report.get(name, {})
        md.append(f"\n## {name}\n\n")
        md.append(markdown_table(part["rows"]) if part.get("rows")
                  else f"{part.get('status')}: {part.get('note') or part.get('error') or ''}\n")
    fc = report.get("first_call", {})
    md.append("\n## first_call\n\n" + markdown_table(
        [dict(mode=m, **{k: val for k, val in (fc.get(m) or {}).items()
                         if not isinstance(val, dict)}) for m in ("warm", "cold")]))
    for name in ("ncu", "sanitizer"):
        part = report.get(name, {})
        md.append(f"\n## {name}: {part.get('status')}\n\n")
        if name == "sanitizer":
            for tool, res in (part.get("tools") or {}).items():
                md.append(f"* {tool}: {res.get('errors')} findings; " + "; ".join(
                    f"{c} {v.get('status')}" for c, v in res.get("cases", {}).items()) + "\n")
        elif part.get("kernels"):
            md.append(markdown_table([{k: val for k, val in kk.items() if k != "id"}
                                      for kk in part["kernels"]]))
    md.append("\n## as rendered in docs/performance.md\n\n" + render_record(report))
    (Path(outdir) / "gpu_check.md").write_text("".join(md))


#: keys every part's entry has (the runner's), left out of the versions line
HOUSEKEEPING = ("status", "budget_s", "seconds", "cpu_s", "steps", "log", "log_tail", "error")


def checkpoint(report, outdir, copy_to=None, final=False):
    """Write the report, the Markdown and gpu_check.tar.gz (every file of OUTDIR but the
    .ncu-rep reports); with ``final``, also ncu_reports.tar.gz.  Copy them to ``copy_to``."""
    outdir = Path(outdir)
    (outdir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    try:
        write_markdown(report, outdir)
    except Exception as exc:  # noqa: BLE001  the Markdown is a convenience; the JSON is the record
        (outdir / "gpu_check.md").write_text(f"(the Markdown failed: {exc!r})\n")
    names = ["gpu_check.json", "gpu_check.md"]
    report.setdefault("bundle", {})
    report["bundle"]["logs"] = bundle(outdir, "gpu_check.tar.gz", exclude=(".ncu-rep",),
                                      max_bytes=15 << 20)
    names.append("gpu_check.tar.gz")
    if final and any(outdir.rglob("*.ncu-rep")):
        report["bundle"]["ncu_reports"] = bundle(outdir, "ncu_reports.tar.gz",
                                                 include=lambda p: p.name.endswith(".ncu-rep"),
                                                 max_bytes=15 << 20)
        names.append("ncu_reports.tar.gz")
    (outdir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    if copy_to:
        dest = Path(copy_to)
        dest.mkdir(parents=True, exist_ok=True)
        for n in names:
            if (outdir / n).exists() and (outdir / n).resolve() != (dest / n).resolve():
                shutil.copyfile(outdir / n, dest / n)
    return names


# -- the orchestrator -------------------------------------------------------------------------

def run_plan(report, outdir, args, dry, budgets, given, only, copy_to=None, t_start=None):
    """Run the plan's parts in order, each on its budget (a dry run: only the budgets given),
    the report and the bundle rewritten after each; the total counts from ``t_start``."""
    jobs = max(1, args.jobs or os.cpu_count() or 1)
    total = args.total if args.total is not None else (None if dry else TOTAL_S)
    t_start = time.monotonic() if t_start is None else t_start
    sections = tuple(args.ncu_section) if args.ncu_section else NCU_SECTIONS
    fns = {
        "versions": run_versions, "ceilings": run_ceilings,
        "warmup": lambda pr: run_warmup(pr, jobs),
        "tests": lambda pr: run_tests(pr, jobs, args.test_paths or None, args.test_timeout),
        "bench_forward": lambda pr: run_bench(pr, "forward"),
        "bench_backward": lambda pr: run_bench(pr, "backward"),
        "bench_decode": lambda pr: run_bench(pr, "decode"),
        "bench_wgmma": lambda pr: run_bench(pr, "wgmma"),
        "bench_windowed": lambda pr: run_bench(pr, "windowed"),
        "decode_latency": lambda pr: run_target(pr, "decode_latency"),
        "per_call": lambda pr: run_target(pr, "per_call"),
        "kvcache_32k": lambda pr: run_target(pr, "kvcache_32k"),
        "host_overhead": run_host_overhead,
        "first_call": run_first_call,
        "ncu": lambda pr: run_ncu(pr, sections),
        "sanitizer": run_sanitizer,
    }
    for name, _, _ in PLAN:
        if name == "bundle":
            continue
        entry = report.setdefault(name, {})
        if only is not None and name not in only:
            entry.update(status="skipped", budget_s=budgets[name], note="not selected")
            continue
        if budgets[name] == 0:
            entry.update(status="skipped", budget_s=0, note="budget 0 (off)")
            continue
        budget = budgets[name] if (not dry or name in given) else None
        if total is not None:
            left = total - (time.monotonic() - t_start) - budgets["bundle"]
            if left < 2:
                entry.update(status="skipped", budget_s=budget,
                             note=f"the plan's total of {total} s was spent")
                checkpoint(report, outdir, copy_to)
                continue
            budget = left if budget is None else min(budget, left)
        print(f"== {name}" + (f" (budget {budget:.0f} s)" if budget is not None else ""),
              flush=True)
        pr = PartRun(name, outdir, dry, budget, entry, fork=dry and not args.no_fork)
        REPORT_STATE["part"] = name
        error = None
        try:
            fns[name](pr)
        except Exception as exc:  # noqa: BLE001  a failing part is reported, the rest still runs
            error = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc().splitlines()[-8:]
        pr.finish(error)
        if name == "versions":
            report["gpu"] = entry.get("device", "?")
        print(f"   {entry['status']} in {entry['seconds']} s"
              + (f": {entry.get('error') or entry.get('note')}"
                 if entry.get("error") or entry.get("note") else ""), flush=True)
        checkpoint(report, outdir, copy_to)
    REPORT_STATE["part"] = None
    join_per_call(report)
    report["bundle"] = dict(report.get("bundle") or {}, status="ok", budget_s=budgets["bundle"])
    return report


REPORT_STATE = {"part": None, "report": None, "outdir": None, "copy_to": None}


def _on_term(signum, frame):
    """SIGTERM / SIGHUP (the device tool's limit): stop the running part, keep the report."""
    part_runner.kill_current()
    report, outdir = REPORT_STATE["report"], REPORT_STATE["outdir"]
    if report is not None and outdir is not None:
        name = REPORT_STATE["part"]
        if name:
            report.setdefault(name, {}).update(status="killed",
                                               note=f"the check itself got signal {signum}")
        try:
            checkpoint(report, outdir, REPORT_STATE["copy_to"])
        except Exception:  # noqa: BLE001
            pass
    sys.exit(128 + signum)


def target_main(name, dry, js):
    """``--target versions|ceilings``: one of this script's in-process parts, its JSON."""
    res = part_versions(dry) if name == "versions" else part_ceilings(dry)
    if name == "versions":
        res.update(tool_versions())
    text = json.dumps(res, indent=1, default=str)
    if js:
        Path(js).write_text(text)
    print(text)
    return 0


def problem_parts(report):
    """The parts that failed, timed out or raised (not those skipped or not built yet)."""
    return [name for name, _, _ in PLAN
            if (report.get(name) or {}).get("status") in ("failed", "timeout", "error", "killed")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", nargs="?", help="folder for everything the check writes")
    ap.add_argument("--dry-run", action="store_true",
                    help="every part in the simulator at tiny shapes, no time limits (for CI)")
    ap.add_argument("--plan", action="store_true", help="print the plan of device time and exit")
    ap.add_argument("--budget", action="append", metavar="NAME=S",
                    help="a part's budget in seconds (0 turns it off; a dry run applies only "
                         "these); NAME one of " + ", ".join(n for n, _, _ in PLAN))
    ap.add_argument("--total", type=float, default=None,
                    help=f"stop starting parts after this many seconds (a GPU: {TOTAL_S})")
    ap.add_argument("--only", help="comma-separated parts to run (the others: skipped)")
    ap.add_argument("--skip", help="comma-separated parts to leave out")
    ap.add_argument("--skip-tests", action="store_true", help="the same as --skip tests")
    ap.add_argument("--ncu", action="store_true",
                    help="(ncu is a part of the plan now; kept for old command lines)")
    ap.add_argument("--ncu-section", action="append", metavar="NAME",
                    help="an Nsight Compute section (repeatable; replaces "
                         + " ".join(NCU_SECTIONS) + ")")
    ap.add_argument("--jobs", type=int, default=None,
                    help="processes for the warm-up and pytest workers (default: every core)")
    ap.add_argument("--test-timeout", type=int, default=90,
                    help="pytest-timeout's limit per test where that plugin is installed (0: off)")
    ap.add_argument("--no-fork", action="store_true",
                    help="a dry run starts each part's Python commands in forked copies of this "
                         "process (no numba import each time); this starts new interpreters, as "
                         "on a GPU")
    ap.add_argument("--test-paths", nargs="+", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--copy-to", metavar="DIR",
                    help="after every part, copy the report, the Markdown and the bundles here "
                         "(a lent machine's $OUT: at most 8 files come back)")
    ap.add_argument("--record", metavar="DIR", default=None,
                    help="where the record goes (default bench/results on a GPU; a dry run "
                         "writes one only when given)")
    ap.add_argument("--render", metavar="RECORD", help="print RECORD (a results JSON) as the "
                    "Markdown tables of docs/performance.md and exit")
    ap.add_argument("--commit", help="the commit to record (default: git rev-parse HEAD; a "
                    "copy of the tree without .git, as on a lent machine, needs it)")
    ap.add_argument("--target", choices=("versions", "ceilings"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render:
        return render_main(args.render)
    dry = args.dry_run
    if args.target:
        return target_main(args.target, dry, args.json)
    budgets, given = parse_budgets(args.budget)
    names = [n for n, _, _ in PLAN]
    only = None
    if args.only:
        only = {BUDGET_ALIASES.get(n, n) for n in args.only.split(",") if n}
    skip = {BUDGET_ALIASES.get(n, n) for n in (args.skip or "").split(",") if n}
    if args.skip_tests:
        skip.add("tests")
    for n in (only or set()) | skip:
        if n not in names:
            ap.error(f"no part named {n!r}: the parts are {', '.join(names)}")
    if skip:
        only = set(only if only is not None else names) - skip
    print(plan_text(budgets, dry, only), flush=True)
    if args.plan:
        return 0
    if args.outdir is None:
        ap.error("OUTDIR is required")
    if not dry and numba_flash.backend() != "cuda":
        print("no GPU backend here: use --dry-run", file=sys.stderr)
        return 2
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    report = {"record_format": RECORD_FORMAT,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "dry_run": dry,
              "gpu": "?"}   # the versions part names it
    try:
        report["commit"] = args.commit or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
            text=True).stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        report["commit"] = "?"
    report["plan"] = {"parts": [[n, budgets[n], what] for n, _, what in PLAN],
                      "total_s": plan_total(budgets), "limit_s": TOTAL_S}
    REPORT_STATE.update(report=report, outdir=outdir, copy_to=args.copy_to)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_term)
    run_plan(report, outdir, args, dry, budgets, given, only, args.copy_to, t_start=T_START)
    t_bundle = time.monotonic()
    record_dir = args.record or (None if dry else RESULTS)
    checkpoint(report, outdir, args.copy_to, final=True)
    if record_dir is not None:
        path = write_record(report, record_dir, junit=outdir / "tests" / "junit.xml")
        report["bundle"]["record"] = str(path)
        print(f"wrote the record {path} and {Path(record_dir) / 'latest.json'}: commit both")
    report["bundle"]["seconds"] = round(time.monotonic() - t_bundle, 1)
    report["bundle"]["budget_s"] = budgets["bundle"]
    report["elapsed_s"] = round(time.monotonic() - T_START, 1)
    checkpoint(report, outdir, args.copy_to, final=True)
    print(f"wrote {outdir / 'gpu_check.json'}, gpu_check.md and gpu_check.tar.gz"
          + (f" (copied to {args.copy_to})" if args.copy_to else ""))
    problems = validate_record(report) if (only is None or {"bench_forward", "bench_backward",
                                                             "bench_decode"} <= only) else []
    for pr_ in problems:
        print(f"record problem: {pr_}")
    print("\n" + _table(["part", "budget s", "used s", "status"],
                        [[n, (report.get(n) or {}).get("budget_s", ""),
                          (report.get(n) or {}).get("seconds", ""),
                          (report.get(n) or {}).get("status", "")] for n in names]), end="")
    print(f"total {report['elapsed_s']} s (plan {plan_total(budgets)} s)")
    t = report.get("tests") or {}
    if t.get("counts"):
        print(f"tests: {t.get('summary')}")
        for item in t.get("not_passed", [])[:40]:
            print(f"  {item.get('outcome')}: {item['nodeid']}  {item.get('message', '')[:150]}")
    failed = problem_parts(report)
    if failed:
        print("parts with problems:", ", ".join(failed))
    return 1 if failed or problems else 0


if __name__ == "__main__":
    sys.exit(main())
