"""The GPU record's format (bench/results/*.json), its renderer and the Nsight Compute parser,
on a record with every measured key (the shape a GPU run of bench/gpu_check.py writes)."""

from __future__ import annotations

import copy
import json

import pytest

import gpu_check as gc


def measured_record():
    return {
        "record_format": gc.RECORD_FORMAT, "date": "2026-11-30 12:00:00 UTC", "dry_run": False,
        "commit": "38a7cb7", "gpu": "NVIDIA H200",
        "versions": {"numba": "0.68.0", "numba-cuda": "0.30.4", "cupy": "14.2", "torch": "2.11",
                     "device": "NVIDIA H200", "driver": "13.0"},
        "ceilings": {"copy_GBps": 4165.0, "fma_TFLOPs": 30.8, "datasheet": gc.datasheet("H200")},
        "bench_forward": {"rows": [
            {"dtype": "float32", "d": 64, "causal": False, "B": 4, "H": 16, "N": 4096,
             "ms": 5.3, "TFLOP/s": 13.0, "torch TFLOP/s": 34.9},
            {"dtype": "float16", "d": 64, "causal": True, "B": 4, "H": 16, "N": 4096,
             "ms": 2.9, "TFLOP/s": 11.8, "torch TFLOP/s": 378.0}]},
        "bench_backward": {"rows": [
            {"dtype": "float16", "B": 2, "H": 8, "N": 4096, "d": 64, "causal": False,
             "ms": 3.3, "TFLOP/s": 10.4, "torch SDPA TFLOP/s": 220.0}]},
        "bench_decode": {"rows": [
            {"dtype": "float16", "cache": "paged/16", "context": 32768, "splits": 64,
             "ms": 7.51, "GB/s": 143.0, "% copy": 3.4, "peer": "torch gather + SDPA",
             "peer GB/s": 479.0}]},
    }


def test_measured_record_is_valid_and_renders():
    rec = measured_record()
    assert gc.validate_record(rec) == []
    md = gc.render_record(rec)
    assert "**NVIDIA H200**, 2026-11-30 12:00:00 UTC, commit `38a7cb7`" in md
    # fractions of the data-sheet fp32 peak (66.9), not of the (too low) measured 30.8
    assert "| float32 | 64 | no | 4x16 | 4096 | 13 | 34.9 | 0.37 | 19% fp32 |" in md
    assert "| float16 | 64 | no | 2x8 | 4096 | 10.4 | 220 | 0.047 | 1% tensor |" in md
    assert "| float16 | paged/16 | 32768 | 7.51 | 143 | 3.4 | torch gather + SDPA | 479 |" in md
    assert "| float32 FMA (SIMT), TFLOP/s | 30.8 | 66.9 |" in md


@pytest.mark.parametrize("part, key", [("bench_forward", "TFLOP/s"),
                                       ("bench_forward", "torch TFLOP/s"),
                                       ("bench_forward", "causal"),
                                       ("bench_backward", "torch SDPA TFLOP/s"),
                                       ("bench_decode", "GB/s"), ("bench_decode", "% copy"),
                                       ("bench_decode", "peer GB/s"),
                                       ("bench_decode", "context")])
def test_a_missing_key_is_a_problem(part, key):
    rec = measured_record()
    del rec[part]["rows"][0][key]
    problems = gc.validate_record(rec)
    assert problems and part in problems[0]


def test_missing_parts_and_dry_runs():
    rec = measured_record()
    del rec["commit"]
    rec["bench_decode"]["rows"] = []
    assert len(gc.validate_record(rec)) == 2
    # a dry run needs the structural keys only; without torch no peer column is required
    rec = measured_record()
    rec["dry_run"] = True
    for r in rec["bench_forward"]["rows"]:
        del r["TFLOP/s"], r["torch TFLOP/s"]
    assert gc.validate_record(rec) == []
    rec = measured_record()
    rec["versions"]["torch"] = "not installed"
    del rec["bench_forward"]["rows"][0]["torch TFLOP/s"]
    assert gc.validate_record(rec) == []


def test_write_record_names_and_latest(tmp_path):
    rec = measured_record()
    p1 = gc.write_record(rec, tmp_path)
    p2 = gc.write_record(rec, tmp_path)
    assert (p1.name, p2.name) == ("2026-11-30-h200.json", "2026-11-30-h200-2.json")
    assert json.loads((tmp_path / "latest.json").read_text()) == rec
    assert gc.gpu_slug("NVIDIA GeForce RTX 4090") == "geforce-rtx-4090"


FWD = ("cudapy::numba_flash::kernels::forward::forward_kernel::<locals>::flash_forward"
       "[abi:v1,cw51cXTLSUwv1sDUaKthqqNgqqmjgOSEQBVoFaKhgRDKsEJgOqHBWIDQ5AA_3d]"
       "(Array<float, 4, C, mutable, aligned>)")
MERGE = ("cudapy::numba_flash::kernels::merge::merge_kernel::<locals>::merge_states[abi:v2]"
         "(Array<float, 3, C, mutable, aligned>)")
HEADER = ["ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
          "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name",
          "Metric Unit", "Metric Value"]


def _csv_row(kid, name, block, grid, section, metric, unit, value):
    cells = [kid, "123", "python3.12", "127.0.0.1", name, "1", "7", block, grid, "0", "9.0",
             section, metric, unit, value]
    return ",".join(f'"{c}"' for c in cells)


NCU_CSV = "\n".join([
    "==PROF== Connected to process 123 (/usr/bin/python3.12)",
    '==PROF== Profiling "flash_forward": 0%....50%....100% - 9 passes',
    ",".join(f'"{h}"' for h in HEADER),
    _csv_row("0", FWD, "(64, 1, 1)", "(64, 64, 1)", "Launch Statistics", "Registers Per Thread",
             "register/thread", "167"),
    _csv_row("0", FWD, "(64, 1, 1)", "(64, 64, 1)", "Occupancy", "Theoretical Occupancy", "%",
             "15.62"),
    _csv_row("0", FWD, "(64, 1, 1)", "(64, 64, 1)", "Compute Workload Analysis",
             "Issue Slots Busy", "%", "56.1"),
    _csv_row("1", MERGE, "(128, 1, 1)", "(256, 1, 1)", "GPU Speed Of Light Throughput",
             "DRAM Throughput", "%", "3.02"),
    "ncu target: decode",
])


def test_parse_ncu_csv():
    kernels = gc.parse_ncu_csv(NCU_CSV)
    assert [k["kernel"] for k in kernels] == ["flash_forward", "merge_states"]
    k = kernels[0]
    assert (k["registers"], k["theoretical occupancy"], k["issue slots busy"]) == \
        ("167 register/thread", "15.62 %", "56.1 %")
    assert k["block"] == "(64, 1, 1)" and kernels[1]["DRAM throughput"] == "3.02 %"
    rec = measured_record()
    rec["ncu"] = {"kernels": kernels}
    md = gc.render_record(rec)
    assert "| flash_forward | (64, 1, 1) | (64, 64, 1) | 167 register/thread |" in md
    assert gc.parse_ncu_csv("no csv here") == []


def test_datasheet_and_render_of_missing_record(tmp_path, capsys):
    assert gc.datasheet("NVIDIA H200")["fp32_TFLOPs"] == 66.9
    assert gc.datasheet("NVIDIA L4") == {}
    assert gc.render_main(tmp_path / "latest.json") == 0
    assert "No GPU record yet" in capsys.readouterr().out
    bad = copy.deepcopy(measured_record())
    del bad["gpu"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    assert gc.render_main(tmp_path / "bad.json") == 1


@pytest.mark.parametrize("part", sorted(gc.REQUIRED_ROW_KEYS))
def test_bench_scripts_still_write_the_record_keys(part):
    """A GPU run's rows come from bench/<name>.py, which the dry run cannot time: every key the
    record needs must still be a string literal in that script (a renamed key fails here)."""
    src = (gc.ROOT / "bench" / f"{part.removeprefix('bench_')}.py").read_text()
    keys = gc.REQUIRED_ROW_KEYS[part] + gc.MEASURED_ROW_KEYS[part] + gc.PEER_ROW_KEYS[part]
    for key in keys:
        if part == "bench_decode" and key == "peer GB/s":  # derived by normalize_rows
            assert all(f'"{name}"' in src for name in gc.DECODE_PEERS.values())
            assert 'f"{name} GB/s"' in src or all(f'"{n} GB/s"' in src
                                                  for n in gc.DECODE_PEERS.values())
            continue
        assert any(f'"{k}"' in src for k in key.split("|")), (part, key)


def test_normalize_rows_keeps_the_record_keys():
    rows = [{"dtype": "float16", "cache": "paged/16", "context": 4096, "GB/s": 66.0,
             "% copy": 1.6, "torch SDPA contiguous GB/s": 2010.0,
             "torch gather + SDPA GB/s": 432.0},
            {"dtype": "float16", "cache": "contiguous", "context": 4096, "GB/s": 70.0,
             "% copy": 1.7, "torch SDPA contiguous GB/s": 2010.0},
            {"dtype": "float16", "cache": "paged/16", "B": 1, "context": 1024,
             "us per call": 40.0, "torch SDPA contiguous us": 20.0}]
    out = gc.normalize_rows("bench_decode", rows)
    assert (out[0]["peer"], out[0]["peer GB/s"]) == ("torch gather + SDPA", 432.0)
    assert (out[1]["peer"], out[1]["peer GB/s"]) == ("torch SDPA contiguous", 2010.0)
    assert "peer" not in out[2]
    rec = measured_record()
    rec["bench_decode"]["rows"] = out
    assert gc.validate_record(rec) == []
    md = gc.render_record(rec)
    assert "| float16 | paged/16 | 4096 |  | 66 | 1.6 | torch gather + SDPA | 432 | 2010 |" in md
    assert "Decode latency" in md and "| float16 | paged/16 | 1 | 1024 | 40 | 20 |" in md
    back = gc.normalize_rows("bench_backward", [{"torch SDPA TFLOP/s": 220.0}])
    assert back[0]["torch TFLOP/s"] == 220.0


def test_a_benchmark_stopped_at_its_limit_keeps_the_rows_it_printed():
    """bench/backward.py prints each row as JSON, bench/forward.py as a dict: a part stopped at
    its time limit (no JSON file) keeps those rows, marked as read from its output."""
    part = {"returncode": "timeout", "stdout_tail": [
        "GPU: NVIDIA H200; peers: ['torch']",
        '{"dtype": "float16", "d": 64, "causal": false, "N": 4096, "TFLOP/s": 43.4, '
        '"torch SDPA TFLOP/s": 343.3}',
        "  {'dtype': 'float32', 'd': 64, 'causal': True, 'N': 4096, 'TFLOP/s': 5.8, "
        "'torch SDPA TFLOP/s': 26.5}",
        "{not a row}", "| dtype | d |"]}
    gc.recover_rows(part, "bench_backward")
    assert part["rows_from"] == "stdout" and len(part["rows"]) == 2
    assert [r["torch TFLOP/s"] for r in part["rows"]] == [343.3, 26.5]   # the record's peer key
    assert gc.recover_rows({"stdout_tail": ["no rows"]}, "bench_forward").get("rows") is None
