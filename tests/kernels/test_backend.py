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
                          capture_output=True, text=True)


def test_backend_matches_what_numba_cuda_runs():
    """backend() says what numba.cuda really is in this process: the simulator's jit returns a
    FakeCUDAKernel, the CUDA target's a CUDADispatcher."""
    from numba import cuda
    from numba.cuda.core import config

    kernel = cuda.jit(lambda x: None)
    simulated = type(kernel).__name__ == "FakeCUDAKernel"
    assert simulated == bool(config.ENABLE_CUDASIM)
    assert numba_flash.backend() == ("simulator" if simulated else "cuda")


def test_numpy_without_row_stack_fails_at_import_on_the_cuda_target():
    """numba-cuda 0.30 needs np.row_stack (gone in NumPy 2.5): a clear error at import, naming
    both versions and the fix, instead of an AttributeError at every launch."""
    import numpy
    from importlib.metadata import version

    r = run_py("""
        import numpy
        del numpy.row_stack          # what NumPy 2.5 looks like
        import numba_flash
    """, NUMBA_ENABLE_CUDASIM="0")
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("numba_flash.backend.BackendError: numpy ")
    assert f"numpy {numpy.__version__}" in last and f"numba-cuda {version('numba-cuda')}" in last
    assert "pip install 'numpy<2.5'" in last


def test_numpy_without_row_stack_is_fine_in_the_simulator():
    r = run_py("""
        import numpy as np
        del np.row_stack
        import numba_flash
        print(numba_flash.softmax(np.zeros((1, 4), np.float32)).tolist())
    """, NUMBA_ENABLE_CUDASIM="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[[0.25, 0.25, 0.25, 0.25]]"


def test_install_pins_numpy_below_2_5_and_scipy_is_test_only():
    import configparser
    from pathlib import Path

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    install = cfg["options"]["install_requires"]
    assert "numpy>=1.24,<2.5" in install.split()
    assert "scipy" not in install and "scipy" in cfg["options.extras_require"]["test"]


def test_package_works_without_scipy():
    """scipy is a test/docs dependency only: with it unimportable the package imports and runs."""
    r = run_py("""
        import sys
        sys.modules["scipy"] = None  # any "import scipy" now raises ImportError
        import numpy as np
        import numba_flash
        from numba_flash import demo, reference, philox  # noqa: F401
        from numba_flash.tools import pictures  # noqa: F401
        from numba_flash import ops
        import numba_flash.ops.forward, numba_flash.ops.backward, numba_flash.ops.decode
        import numba_flash.teach.ops.softmax, numba_flash.ops.dropout, numba_flash.__main__
        print(numba_flash.softmax(np.zeros((1, 2), np.float32)).tolist())
    """, NUMBA_ENABLE_CUDASIM="1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[[0.5, 0.5]]"


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
def test_simulator_warning_is_one_line_without_a_source_echo():
    r = run_py("import numba_flash")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr  # no "  from .backend import ..." echoed under it
    assert lines[0].startswith("numba_flash:0: SimulatorWarning: no usable CUDA GPU found; "
                               "kernels run in the Numba CUDA simulator")


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
