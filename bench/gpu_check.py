"""One-shot GPU validation and performance report, sized to fit one lent GPU session.

    python bench/gpu_check.py OUTDIR            # on a machine with an NVIDIA GPU (< 8 minutes)
    python bench/gpu_check.py OUTDIR --dry-run  # anywhere: the same script in the simulator

Parts, each run and reported even if an earlier one failed:

1. versions: device, driver, numba, numba-cuda, CuPy, torch;
2. ceilings: device-to-device copy bandwidth (GB/s, read + write) and a float32 SIMT FMA rate
   (TFLOP/s) measured with a kernel of our own;
3. tests: the ``gpu``-marked tests and the kernel tier, on the device;
4. benchmarks: bench/forward.py, bench/backward.py and bench/decode.py (trimmed with ``--quick``),
   each with its peers (torch SDPA, CuPy) in the same run, each figure also as a fraction of its
   ceiling;
5. OUTDIR/gpu_check.json (everything) and OUTDIR/gpu_check.md (the tables for
   docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
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


@cuda.jit
def fma_kernel(out, iters):
    """Each thread runs FMA_CHAINS independent multiply-add chains for ``iters`` steps."""
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
    out[t] = x0 + x1 + x2 + x3 + x4 + x5 + x6 + x7  # keeps every chain alive


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


def part_ceilings(dry):
    from common import copy_bandwidth, time_gpu, time_host

    if dry:
        out = cuda.to_device(np.zeros(64, np.float32))
        ms = time_host(lambda: fma_kernel[2, 32](out, 4), repeat=1)
        return {"copy_GBps": None, "fma_TFLOPs": None, "note": "dry run: simulator, not measured",
                "fma_kernel_ms_simulator": ms}
    dev = cuda.get_current_device()
    blocks, threads, iters = dev.MULTIPROCESSOR_COUNT * 8, 256, 4096
    out = cuda.device_array(blocks * threads, np.float32)
    ms = time_gpu(lambda: fma_kernel[blocks, threads](out, iters), repeat=10)
    flops = 2.0 * FMA_CHAINS * iters * blocks * threads
    return {"copy_GBps": copy_bandwidth(), "fma_TFLOPs": flops / ms / 1e9}


def part_tests(dry, budget_s):
    args = [sys.executable, "-m", "pytest", "-q", "-x", "tests/kernels", "-p", "no:cacheprovider"]
    if dry:
        args += ["-k", "softmax"]
    t0 = time.time()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=budget_s)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    return {"returncode": proc.returncode, "seconds": round(time.time() - t0, 1),
            "summary": tail[-1] if tail else "", "tail": tail}


def part_bench(name, dry, outdir, budget_s):
    script = ROOT / "bench" / f"{name}.py"
    if not script.exists():
        return {"error": f"{script} missing"}
    js = Path(outdir) / f"{name}.json"
    args = [sys.executable, str(script), "--quick", "--json", str(js)]
    t0 = time.time()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=budget_s)
    res = {"returncode": proc.returncode, "seconds": round(time.time() - t0, 1),
           "stdout_tail": proc.stdout.strip().splitlines()[-40:],
           "stderr_tail": proc.stderr.strip().splitlines()[-10:]}
    if js.exists():
        data = json.loads(js.read_text())
        res["rows"] = data["rows"] if isinstance(data, dict) else data  # {"rows": [...]} or [...]
    return res


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


def run_part(report, name, fn, *args):
    t0 = time.time()
    print(f"== {name}", flush=True)
    try:
        report[name] = fn(*args)
    except Exception as exc:  # noqa: BLE001  a failing part is reported, the rest still runs
        report[name] = {"error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc().splitlines()[-8:]}
    print(json.dumps(report[name], default=str)[:2000], flush=True)
    print(f"   ({time.time() - t0:.1f} s)", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir", help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--dry-run", action="store_true",
                    help="run everything in the simulator at toy sizes (for CI)")
    ap.add_argument("--skip-tests", action="store_true", help="skip part 3")
    args = ap.parse_args(argv)
    dry = args.dry_run
    if not dry and numba_flash.backend() != "cuda":
        print("no GPU backend here: use --dry-run", file=sys.stderr)
        return 2
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "dry_run": dry}
    try:
        report["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                          capture_output=True, text=True).stdout.strip()
    except Exception:  # noqa: BLE001
        report["commit"] = "?"
    run_part(report, "versions", part_versions, dry)
    run_part(report, "ceilings", part_ceilings, dry)
    if not args.skip_tests:
        run_part(report, "tests", part_tests, dry, 150 if not dry else 300)
    budgets = {"forward": 120, "backward": 90, "decode": 90} if not dry else \
        {"forward": 300, "backward": 300, "decode": 300}
    for name, budget in budgets.items():
        run_part(report, f"bench_{name}", part_bench, name, dry, outdir, budget)

    ceilings = report.get("ceilings", {})
    md = [f"# GPU check {report['date']} (commit {report['commit']})\n"]
    v = report.get("versions", {})
    md.append("| " + " | ".join(f"{k}: {val}" for k, val in v.items()
                               if not isinstance(val, dict)) + " |\n")
    md.append(f"\nCeilings: copy bandwidth {ceilings.get('copy_GBps')} GB/s, "
              f"fp32 FMA {ceilings.get('fma_TFLOPs')} TFLOP/s\n")
    t = report.get("tests", {})
    md.append(f"\nTests on the device: {t.get('summary', t.get('error', 'skipped'))}\n")
    for name in budgets:
        part = report.get(f"bench_{name}", {})
        md.append(f"\n## {name}\n\n")
        if "rows" in part:
            md.append(markdown_table(add_fractions(part["rows"], ceilings)))
        else:
            md.append(f"no table: {part.get('error') or part.get('stderr_tail')}\n")
    (outdir / "gpu_check.md").write_text("".join(md))
    (outdir / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {outdir / 'gpu_check.md'} and {outdir / 'gpu_check.json'}")
    failed = [k for k, val in report.items() if isinstance(val, dict) and
              (val.get("error") or val.get("returncode", 0) != 0)]
    if failed:
        print("parts with problems:", ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
