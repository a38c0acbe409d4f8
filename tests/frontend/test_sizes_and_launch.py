"""The launch path (numba_flash.frontend.arrays): sizes checked before allocation, numba's
low-occupancy warning hidden, a warning before a simulator launch likely to run for minutes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

import numba_flash
from numba_flash.backend import SlowSimulatorWarning
from numba_flash.frontend import arrays
from numba_flash.frontend import sim_time
from numba_flash.frontend.arrays import ArrayCall, check_memory, nbytes, simulator_seconds

on_sim = pytest.mark.skipif(numba_flash.backend() != "simulator", reason="simulator only")


# -- sizes ------------------------------------------------------------------------------------
def test_nbytes_is_exact_beyond_int64_products():
    assert nbytes((2, 3), np.float16) == 12
    assert nbytes((10**6, 10**6, 10**6, 10**6), np.float64) == 8 * 10**24  # no int64 overflow


def test_dropout_mask_too_large_names_shape_and_gib():
    """The issue's example: numpy's own message named an internal shape the user never asked for."""
    with pytest.raises(MemoryError) as err:
        numba_flash.dropout_mask(0, 1, 1, 10**6, 10**6, 0.1)
    msg = str(err.value)
    assert msg.startswith("dropout_mask: needs ")
    assert "the keep-mask [1, 1, 1000000, 1000000] bool (931.3 GiB)" in msg
    assert "GiB of host memory is available" in msg


def test_softmax_too_large_is_refused_before_any_copy():
    x = np.broadcast_to(np.float32(1), (10**6, 10**6))  # 4 TB as a contiguous copy, 4 bytes here
    with pytest.raises(MemoryError, match=r"softmax: needs \d+\.\d GiB for y \[1000000, 1000000\] "
                                          r"float32 \(3725\.3 GiB\)"):
        numba_flash.softmax(x)


def test_check_memory_against_a_given_budget(monkeypatch):
    monkeypatch.setattr(arrays, "host_memory_available", lambda: 2**30)
    monkeypatch.setattr(arrays, "device_memory_available", lambda: 2**30)
    small = {"o": ((1024, 1024), np.float32)}  # 4 MiB: never looked at
    assert check_memory("op", small) == 4 * 2**20
    fits = {"o": ((2**27,), np.float32)}  # 512 MiB <= 1 GiB
    assert check_memory("op", fits, device=False) == 2**29
    with pytest.raises(MemoryError, match=r"op: needs 2\.0 GiB for o \[268435456\] float32 "
                                          r"\(1\.0 GiB\) and work arrays \(1\.0 GiB\), but only "
                                          r"1\.0 GiB of host memory is available"):
        check_memory("op", {"o": ((2**28,), np.float32)}, device=False, work_bytes=2**30)


def test_every_allocation_of_the_launch_path_is_checked(monkeypatch):
    """Ops that allocate without ``reserve`` still get the clear error from ``empty``/``zeros``."""
    monkeypatch.setattr(arrays, "device_memory_available", lambda: 2**30)
    call = ArrayCall({"x": np.zeros((2, 2), np.float32)}, op="decode")
    with pytest.raises(MemoryError, match=r"decode: needs 7\.5 GiB for an output \[1000, 1000, "
                                          r"1000\] float64"):
        call.empty((1000, 1000, 1000), np.float64)
    with pytest.raises(MemoryError, match=r"decode: needs .* for a work buffer"):
        call.zeros((2**31,), np.float32)


def test_array_call_names_the_calling_op():
    def forward():
        return ArrayCall({"q": np.zeros(1, np.float32)})

    assert forward().op == "forward"


# -- launch warnings ----------------------------------------------------------------------------
def test_simulator_seconds_without_a_work_hint_counts_threads():
    assert simulator_seconds((64, 32), (4, 4)) == pytest.approx(64 * 32 * 16 * 3.7e-4)
    assert simulator_seconds(10, 8) == pytest.approx(80 * 3.7e-4)


@on_sim
def test_slow_simulator_launch_warns_with_the_estimate(monkeypatch):
    x = np.zeros((3, 8), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowSimulatorWarning)
        numba_flash.softmax(x)  # a tiny launch: no warning
    monkeypatch.setattr(sim_time, "SIM_WARN_SECONDS", 0.0)
    with pytest.warns(SlowSimulatorWarning) as rec:
        numba_flash.softmax(x)
    msg = str(rec[0].message)
    assert "launch of softmax_rows (grid (3,), block (8,), 24 CUDA threads)" in msg
    assert "from the work of its threads" in msg and "Ctrl-C stops it" in msg
    assert rec[0].filename == __file__  # points at the caller's line, not inside the package


def _run_py(code, **env):
    full = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True)


def test_low_occupancy_warning_hidden_in_launches():
    """numba warns "Grid size N will likely result in GPU under-utilization" on the CUDA target
    when the launch is configured; the launch path filters it (the launch itself then fails here,
    with no GPU)."""
    r = _run_py("""
        import warnings
        import numpy as np
        import numba_flash
        from numba import cuda
        from numba_flash.frontend.arrays import ArrayCall

        @cuda.jit
        def k(x):
            pass

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            k[3, 1, 0]  # control: numba warns for this grid
            try:
                ArrayCall({"x": np.zeros(1)}).launch(k, 2, 1, np.zeros(1))
            except Exception as exc:
                print("launch:", type(exc).__name__)
        print([str(x.message).split(" will")[0] for x in w])
    """, NUMBA_ENABLE_CUDASIM="0")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1] == "['Grid size 3']"  # only the control's, none from ArrayCall.launch


# -- devices ------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cupy_outputs_on_the_inputs_device():
    cp = pytest.importorskip("cupy")
    n = cp.cuda.runtime.getDeviceCount()
    dev = n - 1
    with cp.cuda.Device(dev):
        x = cp.random.standard_normal((4, 64), dtype=cp.float32)
    with cp.cuda.Device(0):  # CuPy's current device: 0, the inputs live on the last one
        y = numba_flash.softmax(x)
    assert y.device.id == dev
    want = np.exp(x.get() - x.get().max(1, keepdims=True))
    np.testing.assert_allclose(y.get(), want / want.sum(1, keepdims=True), atol=1e-6)


@pytest.mark.gpu
def test_inputs_on_two_devices_rejected():
    cp = pytest.importorskip("cupy")
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    with cp.cuda.Device(0):
        q = cp.zeros((1, 1, 8, 16), cp.float32)
    with cp.cuda.Device(1):
        k = cp.zeros((1, 1, 8, 16), cp.float32)
    with pytest.raises(ValueError, match="k: expected an array on GPU 0 .* got one on GPU 1"):
        numba_flash.forward(q, k, k)


def test_reserve_counts_input_copies_and_skips_absent_inputs():
    x = np.zeros((4, 8), np.float32)  # 128 bytes, copied to the device once
    xt = np.zeros((8, 4), np.float32).T  # non-contiguous: a contiguous copy, then the device copy
    call = ArrayCall({"x": x, "xt": xt, "block_table": None}, op="op")
    assert call.reserve({"o": ((4, 8), np.float32)}) == 128 + 128 + 2 * 128
