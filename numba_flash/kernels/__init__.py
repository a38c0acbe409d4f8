"""One module per kernel family.

Each module holds a cached kernel factory (tile sizes and head dim as compile-time constants) and
``compile_configs()``: the configurations the package can launch on a GPU, which the compile tier
(:mod:`numba_flash.compile_check`) builds to PTX and assembles with ptxas.  Modules are found by
name: every module here except the shared helpers ``common`` (types, head dims), ``jit`` (the
kernel decorator and its disk cache) and ``visibility`` (the masking rule the kernels call) is a
kernel family.  ``tiled_forward_teach`` (the teaching tiled kernel of docs/tiled-forward.md) is
not in the compile tier yet: it has no ``compile_configs()`` and no rows in docs/resources.md.
"""

import pkgutil as _pkgutil

_NOT_FAMILIES = ("common", "jit", "visibility", "tiled_forward_teach")
KERNEL_MODULES = sorted(
    m.name for m in _pkgutil.iter_modules(__path__) if m.name not in _NOT_FAMILIES
)
