"""A faster ``inline="always"`` for numba-cuda: the inliner without its two defensive copies.

Every ``device_jit`` stage of this package is inlined into its kernel at Numba's IR level
(``inline="always"``).  numba-cuda's ``InlineWorker.inline_function`` builds a fresh IR of the
callee for each call site (its untyped passes) and hands it to ``inline_ir``, which deep-copies
it twice: once to have a copy to mutate, once to return an unmutated one (which
``InlineInlinables``, the only caller of ``inline_function``, throws away).  Neither copy is
needed when the IR is fresh, and ``copy.deepcopy`` of Numba IR is slow (each block's copy
copies the function's whole scope): it was 45% of a tensor-core forward's build
(``forward_mma W4 M128 N64 D64``: 23.0 s, 12.7 s without the copies, the same PTX and SASS).
This is numba-cuda's open issue NVIDIA/numba-cuda#688 (fix proposed in #689).

:func:`install` replaces ``inline_function`` with one that runs ``inline_ir`` on the fresh IR
without copying it; ``inline_ir`` itself, and every other caller of it (overload inlining,
which passes a cached IR), keep numba-cuda's copies.  It installs only when numba-cuda's
module is the one this was written against (one ``copy.deepcopy`` in it, in ``inline_ir``'s
copy), and never in the simulator, which has no inliner.  The module global it swaps for
one call is read only by that call: numba compiles under its global compiler lock.
``NUMBA_FLASH_INLINE_COPY=1`` keeps numba-cuda's behaviour (tests/compile/test_numba_inline.py
builds a kernel both ways and compares the PTX).
"""

from __future__ import annotations

import inspect
import os
import types

__all__ = ["install", "installed"]

#: environment variable: "1" keeps numba-cuda's copying inliner
COPY_ENV = "NUMBA_FLASH_INLINE_COPY"

_NO_COPY = types.SimpleNamespace(deepcopy=lambda obj, memo=None: obj)
_INSTALLED = False


def _fits(icc):
    """Whether numba-cuda's inliner is the one this patch was written against."""
    try:
        source = inspect.getsource(icc)
        worker = icc.InlineWorker
    except (OSError, TypeError, AttributeError):
        return False
    return (source.count("copy.deepcopy(") == 1 and hasattr(worker, "inline_ir")
            and hasattr(worker, "run_untyped_passes") and icc.copy.__name__ == "copy")


def install():
    """Make ``inline="always"`` skip the copies of a fresh callee IR (see the module
    docstring); True when installed (now or before)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if os.environ.get(COPY_ENV, "0").strip() == "1":
        return False
    from .backend import on_simulator

    if on_simulator():
        return False
    from numba.cuda.core import inline_closurecall as icc

    if not _fits(icc):
        return False
    copy_module = icc.copy

    def inline_function(self, caller_ir, block, i, function, arg_typs=None):
        callee_ir = self.run_untyped_passes(function)   # fresh: no one else holds it
        icc.copy = _NO_COPY    # inline_ir's only copy.deepcopy: take the fresh blocks as they are
        try:
            return self.inline_ir(caller_ir, block, i, callee_ir,
                                  function.__code__.co_freevars, arg_typs=arg_typs)
        finally:
            icc.copy = copy_module

    inline_function.__doc__ = icc.InlineWorker.inline_function.__doc__
    icc.InlineWorker.inline_function = inline_function
    _INSTALLED = True
    return True


def installed():
    """Whether :func:`install` has replaced numba-cuda's ``inline_function`` in this process."""
    return _INSTALLED
