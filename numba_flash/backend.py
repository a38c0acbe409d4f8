"""Which backend runs the kernels: a CUDA GPU or the Numba CUDA simulator.

The choice has to be made before ``numba.cuda`` is first imported, because numba-cuda reads
``NUMBA_ENABLE_CUDASIM`` once, at import time, and then swaps the whole ``numba.cuda`` module for
the simulator.  So this module asks the CUDA driver directly (through ``ctypes``, without numba)
whether there is a usable GPU:

* ``NUMBA_ENABLE_CUDASIM=1`` set by the user: simulator, as asked.
* ``NUMBA_ENABLE_CUDASIM=0`` set by the user: the real CUDA target, as asked (also the mode the
  compile tier uses to build PTX on a machine with no GPU).
* unset, and the driver reports at least one device: the GPU.
* unset, and no driver or no device: turn the simulator on and say so once with a warning.

If ``numba.cuda`` was imported before ``numba_flash`` on a machine without a GPU and without the
simulator, no kernel could ever launch in this process; we raise :class:`BackendError` naming the
fix instead of failing later with a driver error.

On the CUDA target we also check the NumPy / numba-cuda pair: numba-cuda 0.30.x registers an
overload for ``np.row_stack``, which NumPy 2.5 removed, so with that pair every kernel launch (and
the compile tier) fails deep inside numba with ``AttributeError: module 'numpy' has no attribute
'row_stack'``.  :func:`check_numpy_pair` raises :class:`BackendError` at import instead, naming
both versions and the fix.  The simulator does not load that code and is unaffected.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

__all__ = ["backend", "BackendError", "SimulatorWarning", "SlowSimulatorWarning"]


class BackendError(RuntimeError):
    """No backend can run kernels in this process."""


class SimulatorWarning(UserWarning):
    """Kernels will run in the Numba CUDA simulator (no GPU found)."""


class SlowSimulatorWarning(SimulatorWarning):
    """A simulator launch is estimated at 30 s of CPU time or more, a minute of wall time on a
    busy machine (Ctrl-C stops it)."""


def _quiet_command_line() -> bool:
    """``numba-flash --help`` / ``--version`` (or ``python -m numba_flash ...``): print no
    backend warning, those commands launch nothing."""
    argv = sys.argv or [""]
    if argv[0] != "-m" and os.path.basename(argv[0]) not in ("numba-flash", "__main__.py"):
        return False
    return any(a in ("-h", "--help", "--version") for a in argv[1:])


def _warn_simulator() -> None:
    """Warn once that kernels run in the simulator, as ``numba_flash:0: SimulatorWarning: ...``
    (warn_explicit at line 0: no source line echoed under the message; filters still apply)."""
    if _quiet_command_line():
        return
    warnings.warn_explicit(
        "no usable CUDA GPU found; kernels run in the Numba CUDA simulator (slow, one Python "
        "thread per CUDA thread: use small shapes). Set NUMBA_ENABLE_CUDASIM=1 to choose it "
        "without this warning.",
        SimulatorWarning, filename="numba_flash", lineno=0, module="numba_flash",
        registry=_WARNING_REGISTRY,
    )


_WARNING_REGISTRY: dict = {}


def _driver_device_count() -> int:
    """Number of CUDA devices the driver reports; 0 if there is no driver or it fails."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll", "libcuda.dylib"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return int(count.value)
        except AttributeError:
            return 0
    return 0


def _choose() -> str:
    env = os.environ.get("NUMBA_ENABLE_CUDASIM")
    cuda_imported = "numba.cuda" in sys.modules
    if cuda_imported:
        from numba.cuda.core import config

        if config.ENABLE_CUDASIM:
            return "simulator"
        if _driver_device_count() > 0 or env == "0":
            return "cuda"
        raise BackendError(
            "numba.cuda was imported before numba_flash on a machine with no usable CUDA GPU and "
            "without the simulator, so no kernel can run in this process. Fix: import numba_flash "
            "before numba.cuda, or set NUMBA_ENABLE_CUDASIM=1 in the environment before starting "
            "Python."
        )
    if env is not None and env.strip() not in ("", "0"):
        return "simulator"
    if env is not None and env.strip() == "0":
        return "cuda"
    if _driver_device_count() > 0:
        return "cuda"
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    _warn_simulator()
    return "simulator"


def _numba_cuda_version() -> str:
    try:
        from importlib.metadata import version

        return version("numba-cuda")
    except Exception:  # pragma: no cover - not installed from a distribution
        return "unknown"


def _numba_cuda_uses_row_stack() -> bool:
    """True when the installed numba-cuda's CUDA target refers to ``np.row_stack`` (read from its
    source, without importing it: importing it is what fails)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("numba_cuda")
    except (ImportError, ValueError):
        return False
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "numba", "cuda", "np", "arrayobj.py")
        try:
            with open(path, encoding="utf-8") as f:
                return "np.row_stack" in f.read()
        except OSError:
            continue
    return False


def check_numpy_pair(np_module=None) -> None:
    """Raise :class:`BackendError` if NumPy lacks ``row_stack`` while numba-cuda needs it."""
    if np_module is None:
        import numpy as np_module
    if hasattr(np_module, "row_stack") or not _numba_cuda_uses_row_stack():
        return
    raise BackendError(
        f"numpy {np_module.__version__} does not work with numba-cuda {_numba_cuda_version()} on "
        "the CUDA target: numba-cuda uses numpy.row_stack, which NumPy 2.5 removed, so every "
        "kernel launch would fail. Fix: pip install 'numpy<2.5' (numba_flash pins it; a "
        "numba-cuda release that supports NumPy 2.5 also fixes it), or set "
        "NUMBA_ENABLE_CUDASIM=1 to run in the simulator."
    )


_BACKEND = _choose()
if _BACKEND == "cuda":
    check_numpy_pair()


def backend() -> str:
    """``"cuda"`` when kernels run on a GPU, ``"simulator"`` when they run in the simulator."""
    return _BACKEND


def on_simulator() -> bool:
    """True when kernels run in the Numba CUDA simulator."""
    return _BACKEND == "simulator"
