"""One module per kernel family.

Each module holds a cached kernel factory (tile sizes and head dim as compile-time constants) and
``compile_configs()``: the configurations the package can launch on a GPU, which the compile tier
(:mod:`numba_flash.compile_check`) builds to PTX and assembles with ptxas.  Modules are found by
name: every module here except the shared helpers ``common`` (types, head dims), ``jit`` (the
kernel decorator and its disk cache) and ``visibility`` (the masking rule the kernels call) is a
kernel family.  ``wgmma`` (Hopper's warpgroup stages) is left out until the compile tier builds a
configuration for its own ``"cc"`` (sm_90a: ptxas refuses its instructions for sm_80 / sm_90);
its probes are built by ``tests/compile/test_wgmma_compile.py``.
"""

import pkgutil as _pkgutil

KERNEL_MODULES = sorted(
    m.name for m in _pkgutil.iter_modules(__path__)
    if m.name not in ("common", "jit", "visibility", "wgmma")
)
