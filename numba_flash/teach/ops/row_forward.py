"""``row_forward``: attention forward with one thread per query row and K/V tiles in shared
memory (the tutorial's second step, ``docs/row-forward.md``).

Not the fast path (that is :func:`numba_flash.forward`); it exists to be read and stepped through.
:func:`teaching_forward` is the checked launch it shares with the next step,
:func:`numba_flash.teach.ops.tiled_forward.tiled_forward_teach`.
"""

from __future__ import annotations

import numpy as np

from ...frontend import ArrayCall
from ...frontend.validate import check_bool, check_qkv, check_scale
from ...kernels.core.common import acc_dtype, cdiv, padded_head_dim
from ..kernels.row_forward import default_blocks, row_forward_kernel


def teaching_forward(op, q, k, v, causal, softmax_scale, build):
    """Check the arguments, allocate ``(o, lse)`` and launch ``kernel(q, k, v, o, lse, scale)``
    where ``build(head_dim, dtype, causal)`` returns ``(kernel, block_m, block)``: ``block_m``
    query rows per block (grid ``(ceil(Nq / block_m), B * H)``), ``block`` the threads."""
    qkv = check_qkv(q, k, v)
    b, h, nq = qkv.b, qkv.h, qkv.nq
    d, dtype = qkv.d, qkv.dtype
    causal = check_bool("causal", causal)
    scale = check_scale(softmax_scale, d, dtype)
    acc_t = acc_dtype(dtype)

    call = ArrayCall({"q": q, "k": k, "v": v}, op=op)
    call.reserve({"o": ((b, h, nq, d), dtype), "lse": ((b, h, nq), acc_t)})
    dq, dk, dv = call.input(q), call.input(k), call.input(v)
    o = call.empty((b, h, nq, d), dtype)
    lse = call.empty((b, h, nq), acc_t)
    kernel, block_m, block = build(padded_head_dim(d), np.dtype(dtype), causal)
    # no SimWork: the simulator's cost of these kernels is not measured (its slow-launch warning
    # counts threads alone, a lower bound)
    call.launch(kernel, (cdiv(nq, block_m), b * h), block, dq, dk, dv, o, lse,
                acc_t.type(scale))
    return call.result(o), call.result(lse)


def row_forward(q, k, v, *, causal=False, softmax_scale=None):
    """Attention forward ``(o, lse)`` for ``q [B, H, Nq, d]``, ``k, v [B, Hkv, Nk, d]``.

    Same contract as :func:`numba_flash.reference.attention` (GQA, bottom-right causal masking,
    ``softmax_scale=None`` meaning ``1/sqrt(d)``).  ``o`` has ``q``'s dtype; ``lse [B, H, Nq]`` is
    float32 for float16/float32 inputs and float64 for float64.
    """
    def build(head_dim, dtype, causal):
        block_m, block_n = default_blocks(head_dim, dtype)
        return row_forward_kernel(head_dim, block_m, block_n, causal, dtype), block_m, (block_m,)

    return teaching_forward("row_forward", q, k, v, causal, softmax_scale, build)
