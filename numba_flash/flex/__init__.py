"""Your own attention variant in Python: ``score_mod``, ``mask_mod`` and block masks.

The pieces that do not depend on a kernel: checking and compiling a user's functions
(:mod:`.functions`) and block masks (:mod:`.block_mask`, FlexAttention's ``create_block_mask``).
The attention ops do not take these functions yet; see docs/variants.md for the built-in
variants they take today.
"""

from .block_mask import DEFAULT_BLOCK_SIZE, EMPTY, FULL, PARTIAL, BlockMask, create_block_mask
from .functions import check_mod, device_function, fingerprint, host_function

__all__ = ["BlockMask", "create_block_mask", "EMPTY", "PARTIAL", "FULL", "DEFAULT_BLOCK_SIZE",
           "check_mod", "device_function", "fingerprint", "host_function"]
