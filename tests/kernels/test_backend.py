"""Backend choice: simulator without a GPU, an error that names the fix when it is too late."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import numba_flash


def run_py(code, **env):
    full = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    full.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=300)


def test_backend_value():
    assert numba_flash.backend() in ("cuda", "simulator")


@pytest.mark.skipif(numba_flash.backend() == "cuda", reason="needs a machine without a GPU")
def test_import_without_gpu_turns_simulator_on_and_warns():
    r = run_py("""
        import warnings
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            import numba_flash
        print(numba_flash.backend(), sum('simulator' in str(x.message) for x in w))
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["simulator", "1"]


@pytest.mark.skipif(numba_flash.backend() == "cuda", reason="needs a machine without a GPU")
def test_numba_cuda_imported_first_without_gpu_names_the_fix():
    r = run_py("""
        from numba import cuda
        import numba_flash
    """)
    assert r.returncode != 0
    assert "BackendError" in r.stderr and "NUMBA_ENABLE_CUDASIM=1" in r.stderr


def test_explicit_simulator_env_is_respected():
    r = run_py("import numba_flash; print(numba_flash.backend())", NUMBA_ENABLE_CUDASIM="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "simulator"


@pytest.mark.skipif(numba_flash.backend() == "cuda", reason="simulator behaviour")
def test_device_arrays_rejected_in_simulator():
    class FakeDevice:
        __cuda_array_interface__ = {"shape": (2, 3), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
    with pytest.raises(TypeError, match="x: GPU arrays .* need the CUDA backend"):
        numba_flash.softmax(FakeDevice())


@pytest.mark.gpu
def test_cupy_zero_copy_softmax():
    cp = pytest.importorskip("cupy")
    x = cp.random.standard_normal((4, 100), dtype=cp.float32)
    y = numba_flash.softmax(x)
    assert isinstance(y, cp.ndarray) and y.device == x.device
    want = np.exp(x.get() - x.get().max(1, keepdims=True))
    np.testing.assert_allclose(y.get(), want / want.sum(1, keepdims=True), atol=1e-6)
