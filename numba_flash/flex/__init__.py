"""Your own attention variant in Python: ``score_mod``, ``mask_mod`` and block masks.

Checking and compiling a user's functions (:mod:`.functions`), block masks (:mod:`.block_mask`,
FlexAttention's ``create_block_mask``), what an op does with them before a launch
(:mod:`.launch`) and example functions (:mod:`.examples`).  ``numba_flash.forward`` (both kernel
families, every dtype), ``numba_flash.backward``, ``numba_flash.forward_varlen`` (the paged
prefill too) and ``numba_flash.backward_varlen`` take them, and ``numba_flash.decode`` (no block
mask there).  The backwards also take ``aux_grad``, a function that adds the gradients of the
aux tensors with :func:`atomic_add` (:mod:`.atomics`, :mod:`numba_flash.frontend.aux_grad`).  The
page: docs/own-variant.md.
"""

from .atomics import atomic_add
from .block_mask import DEFAULT_BLOCK_SIZE, EMPTY, FULL, PARTIAL, BlockMask, create_block_mask
from .functions import check_mod, device_function, fingerprint, host_function

__all__ = ["atomic_add", "BlockMask", "create_block_mask", "EMPTY", "PARTIAL", "FULL",
           "DEFAULT_BLOCK_SIZE", "check_mod", "device_function", "fingerprint", "host_function"]
