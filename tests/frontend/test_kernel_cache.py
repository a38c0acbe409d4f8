"""The on-disk kernel cache (numba_flash.kernels.core.jit): what can be checked without a GPU (the
cache attached on the CUDA target, its key stable across processes and sensitive to the closure and
the package's device code, data files named per key), and the round trip on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import cuda

import numba_flash
from numba_flash.kernels.core import jit
from numba_flash.tools import warmup

# A kernel factory in a real file (numba's cache needs a source file), as the kernel modules
# build theirs: a closure over constants and a device function.
FACTORY = '''
import json, sys
import numpy as np
import numba_flash
from numba import cuda, types
from numba_flash.kernels.core.jit import kernel_jit, cache_dir


@cuda.jit(device=True)
def plus_one(a):
    return a + 1


@cuda.jit(device=True)
def plus_two(a):
    return a + 2


def factory(n, dev):
    @kernel_jit(fastmath=True)
    def scale(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] = dev(x[i]) * n
    return scale


class Codegen:
    def magic_tuple(self):
        return ("nvptx64-nvidia-cuda", "sm_90", "")


SIG = (types.Array(types.float32, 1, "C"),)
'''

PROBE = '''
import numba_flash.kernels.core.jit as J
J.source_fingerprint = lambda: "pinned"  # tested on its own below; the tree may change meanwhile
from factory_mod import *
out = {}
k = factory(3, plus_one)
out["cache"] = type(k._cache).__name__
out["dir"] = cache_dir(k)
if out["cache"] != "KernelCache":
    print(json.dumps(out))
    sys.exit()
cases = {"3,+1": (3, plus_one), "4,+1": (4, plus_one), "3,+2": (3, plus_two)}
keys = {name: repr(factory(*a)._cache._index_key(SIG, Codegen())) for name, a in cases.items()}
out["keys"] = keys
if sys.argv[1] == "save":
    k._cache._cache_file.save(k._cache._index_key(SIG, Codegen()), {"payload": sys.argv[2]})
    factory(4, plus_one)._cache._cache_file.save(
        factory(4, plus_one)._cache._index_key(SIG, Codegen()), {"payload": "other"})
out["loaded"] = k._cache._cache_file.load(k._cache._index_key(SIG, Codegen()))
print(json.dumps(out))
'''


def _probe(tmp_path, *args, **env):
    if not (tmp_path / "factory_mod.py").exists():  # rewriting it would make the index stale
        (tmp_path / "factory_mod.py").write_text(FACTORY)
        (tmp_path / "probe.py").write_text(PROBE)
    full = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM",
                                                            jit.CACHE_ENV)}
    full.update(NUMBA_ENABLE_CUDASIM="0", NUMBA_CACHE_DIR=str(tmp_path / "cache"),
                PYTHONPATH=str(tmp_path), **env)
    r = subprocess.run([sys.executable, str(tmp_path / "probe.py"), *args], env=full,
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_cache_key_stable_across_processes_and_round_trip(tmp_path):
    a = _probe(tmp_path, "save", "from process 1", PYTHONHASHSEED="1")
    b = _probe(tmp_path, "load", PYTHONHASHSEED="2")
    assert a["cache"] == b["cache"] == "KernelCache"
    assert a["dir"].startswith(str(tmp_path / "cache"))  # NUMBA_CACHE_DIR is honoured
    assert a["keys"] == b["keys"]  # same key in another process, other hash seed
    assert len(set(a["keys"].values())) == 3  # closure constant and device function both count
    assert b["loaded"] == {"payload": "from process 1"}
    data = sorted(p.name for p in (tmp_path / "cache").rglob("*.nbc"))
    assert len(data) == 2 and all("factory.locals.scale" in n for n in data)  # one file per key


def test_cache_off_by_environment(tmp_path):
    r = _probe(tmp_path, "load", NUMBA_FLASH_CACHE="0")
    assert r["cache"] == "NullCache" and r["dir"] is None


def test_source_fingerprint_follows_device_code(tmp_path, monkeypatch):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "common.py").write_text("x = 1\n")
    (tmp_path / "philox.py").write_text("y = 1\n")
    monkeypatch.setattr(jit, "_PACKAGE", str(tmp_path))
    jit.source_fingerprint.cache_clear()
    try:
        before = jit.source_fingerprint()
        (tmp_path / "kernels" / "common.py").write_text("x = 2\n")  # a device helper edited
        jit.source_fingerprint.cache_clear()
        assert jit.source_fingerprint() != before
    finally:
        monkeypatch.undo()
        jit.source_fingerprint.cache_clear()


@pytest.mark.skipif(numba_flash.backend() != "simulator", reason="simulator only")
def test_simulator_kernel_jit_is_plain_cuda_jit():
    assert not jit.caching_enabled()

    @jit.kernel_jit
    def add_one(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] += 1

    @jit.kernel_jit(lineinfo=True, launch_bounds=8)  # device-only options: dropped here
    def add_two(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] += 2

    x = np.zeros(5, np.float32)
    add_one[1, 8](x)
    add_two[1, 8](x)
    assert type(add_one).__name__ == "FakeCUDAKernel" and x.tolist() == [3.0] * 5
    with pytest.raises(TypeError, match="kernel_jit: expected a function"):
        jit.kernel_jit("void(float32[:])")


def test_warm_up_reports_each_configuration():
    class Kernel:
        def __init__(self):
            self.overloads = {}
            self.compiled = []

        def compile(self, sig):
            self.compiled.append(sig)
            self.overloads[sig] = object()

    k = Kernel()
    configs = [{"name": "a", "kernel": k, "args": ("f4",)}, {"name": "b", "kernel": k,
                                                             "args": ("f4",)}]
    seen = []
    done = warmup.warm_up(configs, lambda *row: seen.append(row))
    assert [r[:3] for r in seen] == [(1, 2, "a"), (2, 2, "b")]
    assert [d[2] for d in done] == ["compiled (no disk cache)", "in memory"]
    assert k.compiled == [("f4",)] * 2


def test_warmup_selection():
    names = [c["name"] for c in warmup.warmup_configs()]
    assert names and not any("float64" in n for n in names)
    assert not any(n.startswith(("naive_forward", "philox")) for n in names)
    assert any(n.startswith("forward") for n in names) and any("softmax" in n for n in names)
    assert [c["name"] for c in warmup.warmup_configs("softmax", everything=True)] == [
        n for n in (c["name"] for c in warmup.warmup_configs(everything=True)) if "softmax" in n]


GPU_RUN = '''
import sys
import numpy as np
from factory_mod import *
k = factory(3, plus_one)
x = np.arange(4, dtype=np.float32)
k[1, 32](x)
print(x.tolist(), sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values()))
'''


@pytest.mark.gpu
def test_second_process_loads_the_kernel_from_disk(tmp_path):
    (tmp_path / "factory_mod.py").write_text(FACTORY)
    (tmp_path / "run.py").write_text(GPU_RUN)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=str(tmp_path))
    env.pop(jit.CACHE_ENV, None)
    outs = [subprocess.run([sys.executable, str(tmp_path / "run.py")], env=env, text=True,
                           capture_output=True, cwd=tmp_path) for _ in range(2)]
    for r in outs:
        assert r.returncode == 0, r.stderr[-3000:]
    assert outs[0].stdout.split("]")[1].split() == ["0", "1"]  # compiled, saved
    assert outs[1].stdout.split("]")[1].split() == ["1", "0"]  # loaded from disk
    assert outs[1].stdout.startswith("[3.0, 6.0, 9.0, 12.0]")
