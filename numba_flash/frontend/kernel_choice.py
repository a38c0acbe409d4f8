"""``kernel=``: which kernel family runs a call, SIMT (FMA, every dtype) or tensor cores ("mma",
float16 and bfloat16).  The one home of that choice for :func:`numba_flash.forward` and
:func:`numba_flash.backward`.

``"auto"`` takes tensor cores for float16 and bfloat16 on the CUDA backend with compute
capability >= 8.0 (bfloat16's ``mma.sync`` and ``cvt.rn.bf16x2`` are sm_80 instructions), and
the SIMT kernels otherwise: float32, float64, the simulator, or an older GPU (bfloat16 there
runs on the SIMT kernels, which need no sm_80 instruction).  Which dtypes an mma op takes is its
module's ``MMA_DTYPES`` (float16 alone for a module without one), so a dtype reaches the tensor
cores only once that op has it.  ``kernel="mma"`` on a GPU older than sm_80 is a ``ValueError``
naming its compute capability (before any compile), never a ptxas failure.

``kernel="wgmma"`` (the forward only) asks for Hopper's warpgroup forward
(:mod:`numba_flash.ops.forward_wgmma`): float16 / bfloat16, the simulator or compute capability
9.0 (a ``ValueError`` naming the GPU's elsewhere); ``"auto"`` does not take it.

The tensor-core ops (:mod:`numba_flash.ops.forward_mma`, :mod:`numba_flash.ops.backward_mma`)
are imported only when a call would use them; one that is installed but fails to import is an
:class:`ImportError` naming the failure, never a quiet fall-back to SIMT (only a module that is
not installed at all makes ``"auto"`` take SIMT).
"""

from __future__ import annotations

import importlib

import numpy as np

from ..backend import on_simulator

__all__ = ["KERNELS", "check_forward_kernel", "check_backward_kernel", "mma_available",
           "mma_dtypes", "import_mma", "cuda_cc"]

#: the values of ``kernel=`` (``"wgmma"``: the forward only, compute capability 9.0)
KERNELS = ("auto", "simt", "mma", "wgmma")

_WHAT = {"forward_mma": "the tensor-core forward", "backward_mma": "the tensor-core backward",
         "forward_wgmma": "the warpgroup (wgmma) forward"}


def _module_name(name):
    return f"numba_flash.ops.{name}"


def import_mma(name):
    """The tensor-core op module ``numba_flash.ops.<name>``.

    Raises ``NotImplementedError`` (naming ``kernel``) when this installation does not have it,
    and ``ImportError`` naming the module and the import's own error when it is there but fails
    to import (a syntax error, a missing name, a broken dependency).
    """
    full = _module_name(name)
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as exc:
        if exc.name != full:  # the module is there; something it imports is missing
            raise _broken(name, exc) from exc
        raise NotImplementedError(
            f"kernel: 'mma' needs {full} ({_WHAT[name]}), which this installation does not "
            "have; use kernel='simt'") from exc
    except ImportError as exc:
        raise _broken(name, exc) from exc


def _broken(name, exc):
    full = _module_name(name)
    return ImportError(
        f"{full} ({_WHAT[name]}) is installed but failed to import: {type(exc).__name__}: {exc}. "
        "Fix or reinstall numba_flash, or pass kernel='simt' to run the SIMT kernels")


def mma_available(name):
    """True when ``numba_flash.ops.<name>`` imports, False when it is not installed; raises the
    :class:`ImportError` of :func:`import_mma` when it is installed but broken."""
    try:
        import_mma(name)
    except NotImplementedError:
        return False
    return True


def cuda_cc():
    """Compute capability of the current CUDA device, or None (simulator, no device)."""
    if on_simulator():
        return None
    try:
        from numba import cuda

        return tuple(cuda.get_current_device().compute_capability)
    except Exception:  # no usable device: the launch will say so
        return None


def mma_dtypes(name):
    """The dtype names ``numba_flash.ops.<name>`` takes on the tensor cores (its
    ``MMA_DTYPES``; ``("float16",)`` for a module without it; ``()`` when not installed)."""
    try:
        mod = import_mma(name)
    except NotImplementedError:
        return ()
    return tuple(getattr(mod, "MMA_DTYPES", ("float16",)))


def _check_name(kernel, dtype, name):
    if not isinstance(kernel, str):
        raise TypeError(f"kernel: expected one of {KERNELS} (a str), got {type(kernel).__name__}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    dt = np.dtype(dtype)
    if kernel == "wgmma":
        return _check_wgmma(dt, name)
    if kernel == "mma" and dt.name not in ("float16", "bfloat16"):
        raise ValueError(f"kernel: 'mma' (tensor cores) takes float16 or bfloat16 inputs, got "
                         f"{dt.name}; use kernel='simt' or 'auto'")
    if kernel == "mma" and dt.name == "bfloat16" and dt.name not in mma_dtypes(name):
        raise ValueError(f"kernel: 'mma' ({_WHAT[name]}) does not take bfloat16 yet, got "
                         f"{dt.name}; use kernel='simt' or 'auto'")
    cc = cuda_cc() if kernel == "mma" else None
    if cc is not None and cc < (8, 0):  # m16n8k16 (and its bf16 form, cvt.rn.*x2) are sm_80
        raise ValueError(f"kernel: 'mma' needs a GPU of compute capability >= 8.0 "
                         f"(mma.sync.m16n8k16), this one has {cc[0]}.{cc[1]}; use kernel='simt' "
                         "or 'auto' (which runs SIMT there)")


def _check_wgmma(dt, name):
    """``kernel="wgmma"``: the forward only, float16 / bfloat16, the simulator or a GPU of
    compute capability 9.0 (``wgmma`` is an sm_90a instruction: not on 8.x, nor on 10.x)."""
    if name != "forward_mma":
        raise ValueError("kernel: 'wgmma' is the forward's (numba_flash.forward); the "
                         "backward runs on kernel='mma', 'simt' or 'auto'")
    if dt.name not in ("float16", "bfloat16"):
        raise ValueError(f"kernel: 'wgmma' (tensor cores) takes float16 or bfloat16 inputs, "
                         f"got {dt.name}; use kernel='simt' or 'auto'")
    cc = cuda_cc()
    if cc is not None and cc[:2] != (9, 0):
        raise ValueError(f"kernel: 'wgmma' needs a GPU of compute capability 9.0 (Hopper: "
                         f"wgmma.mma_async is sm_90a), this one has {cc[0]}.{cc[1]}; use "
                         "kernel='mma' or 'auto'")


def _auto_mma(dtype, name):
    """"auto": tensor cores for float16 / bfloat16 on compute capability >= 8.0, if the op is
    installed and takes the dtype."""
    if np.dtype(dtype).name not in ("float16", "bfloat16"):
        return False
    cc = cuda_cc()
    return (cc is not None and cc >= (8, 0) and mma_available(name)
            and np.dtype(dtype).name in mma_dtypes(name))


def check_forward_kernel(kernel, dtype, explicit_tiles_given):
    """``"simt"`` or ``"mma"`` for the forward's ``kernel=`` (validated) and input dtype.

    ``"auto"`` takes tensor cores (see the module docstring) unless ``block_m`` / ``block_n``
    ask for SIMT tiles; with ``"mma"`` or ``"wgmma"`` explicit tiles are a ``ValueError``.
    ``"auto"`` never takes ``"wgmma"``: it keeps ``mma.sync`` until a GPU record shows the
    warpgroup forward correct and faster (docs/performance.md).
    """
    _check_name(kernel, dtype, "forward_mma")
    if kernel in ("mma", "wgmma"):
        if explicit_tiles_given:
            raise ValueError(f"block_m: the tile choice applies to kernel='simt' only, got "
                             f"block_m/block_n with kernel={kernel!r}")
        return kernel
    if kernel == "simt" or explicit_tiles_given:
        return "simt"
    return "mma" if _auto_mma(dtype, "forward_mma") else "simt"


def check_backward_kernel(kernel, dtype):
    """``"simt"`` or ``"mma"`` for the backward's ``kernel=`` (validated) and input dtype."""
    _check_name(kernel, dtype, "backward_mma")
    if kernel == "auto":
        return "mma" if _auto_mma(dtype, "backward_mma") else "simt"
    return kernel
