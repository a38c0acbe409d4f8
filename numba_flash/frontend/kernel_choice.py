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
not installed at all makes ``"auto"`` take SIMT).  Which op module serves which ``kernel=`` of
which op is one table, :data:`FAMILIES`; a call imports its module once (:class:`KernelChoice`).
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import numpy as np

from ..backend import on_simulator

__all__ = ["KERNELS", "FAMILIES", "KernelFamily", "KernelChoice", "check_forward_kernel",
           "check_backward_kernel", "choose_forward_kernel", "choose_backward_kernel",
           "mma_available", "mma_dtypes", "import_mma", "cuda_cc"]

#: the values of ``kernel=`` (``"wgmma"``: the forward only, compute capability 9.0)
KERNELS = ("auto", "simt", "mma", "wgmma")

#: the dtypes ``kernel="mma"`` / ``"wgmma"`` take at all (an op's ``MMA_DTYPES`` may be fewer)
TENSOR_CORE_DTYPES = ("float16", "bfloat16")


class KernelFamily(NamedTuple):
    """A tensor-core kernel family: the ``op`` (``"forward"`` / ``"backward"``) and ``kernel=``
    value it serves, its op module ``numba_flash.ops.<module>`` and the function there that
    launches it on validated arguments, what messages call it, and the dtypes it takes when its
    module has no ``MMA_DTYPES``."""

    op: str
    kernel: str
    module: str
    launch: str
    what: str
    dtypes: tuple = ("float16",)


#: the tensor-core families by name (the name is the op module's): the one table of which
#: module serves which ``kernel=`` of which op; SIMT is every op's own code
FAMILIES = {f.module: f for f in (
    KernelFamily("forward", "mma", "forward_mma", "launch_forward_mma",
                 "the tensor-core forward"),
    KernelFamily("backward", "mma", "backward_mma", "launch_backward_mma",
                 "the tensor-core backward"),
    KernelFamily("forward", "wgmma", "forward_wgmma", "launch_forward_wgmma",
                 "the warpgroup (wgmma) forward"),
)}


def _family(op, kernel):
    """The registry's family for ``op`` and ``kernel=`` (a tensor-core one), or None."""
    for family in FAMILIES.values():
        if (family.op, family.kernel) == (op, kernel):
            return family
    return None


def _module_name(name):
    return f"numba_flash.ops.{name}"


def import_mma(name):
    """The tensor-core op module ``numba_flash.ops.<name>`` (a name of :data:`FAMILIES`).

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
            f"kernel: 'mma' needs {full} ({FAMILIES[name].what}), which this installation does "
            "not have; use kernel='simt'") from exc
    except ImportError as exc:
        raise _broken(name, exc) from exc


def _broken(name, exc):
    full = _module_name(name)
    return ImportError(
        f"{full} ({FAMILIES[name].what}) is installed but failed to import: "
        f"{type(exc).__name__}: {exc}. "
        "Fix or reinstall numba_flash, or pass kernel='simt' to run the SIMT kernels")


def _installed(name):
    """The op module of family ``name``, or None when it is not installed (the
    :class:`ImportError` of :func:`import_mma` when it is installed but broken)."""
    try:
        return import_mma(name)
    except NotImplementedError:
        return None


def mma_available(name):
    """True when ``numba_flash.ops.<name>`` imports, False when it is not installed; raises the
    :class:`ImportError` of :func:`import_mma` when it is installed but broken."""
    return _installed(name) is not None


def cuda_cc():
    """Compute capability of the current CUDA device, or None (simulator, no device)."""
    if on_simulator():
        return None
    try:
        from numba import cuda

        return tuple(cuda.get_current_device().compute_capability)
    except Exception:  # no usable device: the launch will say so
        return None


def _module_dtypes(name, mod):
    """The dtype names op module ``mod`` of family ``name`` takes (``()``: not installed)."""
    if mod is None:
        return ()
    return tuple(getattr(mod, "MMA_DTYPES", FAMILIES[name].dtypes))


def mma_dtypes(name):
    """The dtype names ``numba_flash.ops.<name>`` takes on the tensor cores (its
    ``MMA_DTYPES``; ``("float16",)`` for a module without it; ``()`` when not installed)."""
    return _module_dtypes(name, _installed(name))


class KernelChoice(NamedTuple):
    """The kernel family a call runs: ``kernel`` ``"simt"``, ``"mma"`` or ``"wgmma"``;
    ``family`` the :data:`FAMILIES` record of a tensor-core one (None for SIMT); ``module`` its
    op module when the choice has imported it already (None: :meth:`launcher` imports it)."""

    kernel: str
    family: object = None
    module: object = None

    def launcher(self):
        """The tensor-core family's launch function on validated arguments (its op module
        imported once per call: the one the choice resolved, else now)."""
        mod = self.module if self.module is not None else import_mma(self.family.module)
        return getattr(mod, self.family.launch)


def _check_name(kernel, dtype, op):
    """Validate ``kernel=`` for ``op`` and ``dtype``; returns the op module where the check
    imported it (bfloat16 on ``"mma"``), else None."""
    if not isinstance(kernel, str):
        raise TypeError(f"kernel: expected one of {KERNELS} (a str), got {type(kernel).__name__}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS}, got {kernel!r}")
    dt = np.dtype(dtype)
    if kernel == "wgmma":
        return _check_wgmma(dt, op)
    mod = None
    if kernel == "mma" and dt.name not in TENSOR_CORE_DTYPES:
        raise ValueError(f"kernel: 'mma' (tensor cores) takes float16 or bfloat16 inputs, got "
                         f"{dt.name}; use kernel='simt' or 'auto'")
    if kernel == "mma" and dt.name == "bfloat16":
        name = _family(op, "mma").module
        mod = _installed(name)
        if dt.name not in _module_dtypes(name, mod):
            raise ValueError(f"kernel: 'mma' ({FAMILIES[name].what}) does not take bfloat16 "
                             f"yet, got {dt.name}; use kernel='simt' or 'auto'")
    cc = cuda_cc() if kernel == "mma" else None
    if cc is not None and cc < (8, 0):  # m16n8k16 (and its bf16 form, cvt.rn.*x2) are sm_80
        raise ValueError(f"kernel: 'mma' needs a GPU of compute capability >= 8.0 "
                         f"(mma.sync.m16n8k16), this one has {cc[0]}.{cc[1]}; use kernel='simt' "
                         "or 'auto' (which runs SIMT there)")
    return mod


def _check_wgmma(dt, op):
    """``kernel="wgmma"``: the forward only, float16 / bfloat16, the simulator or a GPU of
    compute capability 9.0 (``wgmma`` is an sm_90a instruction: not on 8.x, nor on 10.x)."""
    if _family(op, "wgmma") is None:
        raise ValueError("kernel: 'wgmma' is the forward's (numba_flash.forward); the "
                         "backward runs on kernel='mma', 'simt' or 'auto'")
    if dt.name not in TENSOR_CORE_DTYPES:
        raise ValueError(f"kernel: 'wgmma' (tensor cores) takes float16 or bfloat16 inputs, "
                         f"got {dt.name}; use kernel='simt' or 'auto'")
    check_wgmma_gpu()


def check_wgmma_gpu():
    """On a GPU, compute capability 9.0 (``wgmma`` is sm_90a), else a ``ValueError`` naming
    ``kernel``; nothing in the simulator."""
    cc = cuda_cc()
    if cc is not None and cc[:2] != (9, 0):
        raise ValueError(f"kernel: 'wgmma' needs a GPU of compute capability 9.0 (Hopper: "
                         f"wgmma.mma_async is sm_90a), this one has {cc[0]}.{cc[1]}; use "
                         "kernel='mma' or 'auto'")


def _auto(dtype, op):
    """"auto": tensor cores (``mma.sync``) for float16 / bfloat16 on compute capability >= 8.0,
    if the op's module is installed and takes the dtype (imported once), else SIMT."""
    name = np.dtype(dtype).name
    if name not in TENSOR_CORE_DTYPES:
        return KernelChoice("simt")
    cc = cuda_cc()
    if cc is None or cc < (8, 0):
        return KernelChoice("simt")
    family = _family(op, "mma")
    mod = _installed(family.module)
    if name not in _module_dtypes(family.module, mod):
        return KernelChoice("simt")
    return KernelChoice("mma", family, mod)


def choose_forward_kernel(kernel, dtype, explicit_tiles_given):
    """The forward's :class:`KernelChoice` for its ``kernel=`` (validated) and input dtype.

    ``"auto"`` takes tensor cores (see the module docstring) unless ``block_m`` / ``block_n``
    ask for SIMT tiles; with ``"mma"`` or ``"wgmma"`` explicit tiles are a ``ValueError``.
    ``"auto"`` never takes ``"wgmma"``: it keeps ``mma.sync`` until a GPU record shows the
    warpgroup forward correct and faster (docs/performance.md).
    """
    mod = _check_name(kernel, dtype, "forward")
    if kernel in ("mma", "wgmma"):
        if explicit_tiles_given:
            raise ValueError(f"block_m: the tile choice applies to kernel='simt' only, got "
                             f"block_m/block_n with kernel={kernel!r}")
        return KernelChoice(kernel, _family("forward", kernel), mod)
    if kernel == "simt" or explicit_tiles_given:
        return KernelChoice("simt")
    return _auto(dtype, "forward")


def choose_backward_kernel(kernel, dtype):
    """The backward's :class:`KernelChoice` for its ``kernel=`` (validated) and input dtype."""
    mod = _check_name(kernel, dtype, "backward")
    if kernel == "auto":
        return _auto(dtype, "backward")
    return KernelChoice(kernel, _family("backward", kernel), mod)


def check_forward_kernel(kernel, dtype, explicit_tiles_given):
    """``"simt"``, ``"mma"`` or ``"wgmma"`` for the forward's ``kernel=`` (validated) and input
    dtype (:func:`choose_forward_kernel`'s ``kernel``)."""
    return choose_forward_kernel(kernel, dtype, explicit_tiles_given).kernel


def check_backward_kernel(kernel, dtype):
    """``"simt"`` or ``"mma"`` for the backward's ``kernel=`` (validated) and input dtype."""
    return choose_backward_kernel(kernel, dtype).kernel
