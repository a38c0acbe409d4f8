"""``tiled_forward_teach``: the teaching tiled forward (``docs/tiled-forward.md``): a Q tile per
block, K/V tiles through shared memory, one thread per score, scalar loads.

Not the fast path (that is :func:`numba_flash.forward`); it exists to be read, stepped through
and changed in the exercises.
"""

from __future__ import annotations

from ..kernels.tiled_forward import default_blocks, tiled_forward_teach_kernel
from .row_forward import teaching_forward


def tiled_forward_teach(q, k, v, *, causal=False, softmax_scale=None):
    """Attention forward ``(o, lse)`` for ``q [B, H, Nq, d]``, ``k, v [B, Hkv, Nk, d]``.

    Same contract as :func:`numba_flash.reference.attention` (GQA, bottom-right causal masking,
    ``softmax_scale=None`` meaning ``1/sqrt(d)``).  ``o`` has ``q``'s dtype; ``lse [B, H, Nq]`` is
    float32 for float16/bfloat16/float32 inputs and float64 for float64.
    """
    def build(head_dim, dtype, causal):
        block_m, block_n = default_blocks(head_dim, dtype)
        kernel = tiled_forward_teach_kernel(head_dim, block_m, block_n, causal, dtype)
        return kernel, block_m, (block_n, block_m)

    return teaching_forward("tiled_forward_teach", q, k, v, causal, softmax_scale, build)
