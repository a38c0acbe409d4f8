"""One module per kernel family.

Each module holds a cached kernel factory (tile sizes and head dim as compile-time constants) and
``compile_configs()``: the configurations the package can launch on a GPU, which the compile tier
(:mod:`numba_flash.compile_check`) builds to PTX and assembles with ptxas.  Modules are found by
name: every module here except the shared helpers of :data:`HELPERS` is a kernel family.
"""

import pkgutil as _pkgutil

#: modules that hold no kernel of their own: ``common`` (types, head dims), ``jit`` (the kernel
#: decorator and its disk cache), ``visibility`` (the masking rule), ``tiles`` (the kernel
#: configurations and tile choices), ``variant`` (the variant-argument convention) and the
#: mainloop stages ``online_softmax``, ``tile_scores``, ``tile_walk`` (their kernels are the
#: families')
HELPERS = ("common", "jit", "visibility", "tiles", "variant", "online_softmax", "tile_scores",
           "tile_walk")

KERNEL_MODULES = sorted(m.name for m in _pkgutil.iter_modules(__path__) if m.name not in HELPERS)
