"""``naive_forward``: attention forward with one thread per query row (the tutorial's first step).

Not the fast path (that is :func:`numba_flash.forward`); it exists to be read, stepped through in
the simulator and measured (``docs/naive-forward.md``, ``docs/io-complexity.md``).
"""

from __future__ import annotations

import numpy as np

from ...frontend import ArrayCall
from ...frontend.sim_time import SimWork, kv_tiles_visited
from ...frontend.validate import check_bool, check_qkv, check_scale
from ...kernels.core.common import acc_dtype, cdiv, padded_head_dim
from ..kernels.naive_forward import default_block_m, naive_forward_kernel


def naive_forward(q, k, v, *, causal=False, softmax_scale=None):
    """Attention forward ``(o, lse)`` for ``q [B, H, Nq, d]``, ``k, v [B, Hkv, Nk, d]``.

    Same contract as :func:`numba_flash.reference.attention` (GQA, bottom-right causal masking,
    ``softmax_scale=None`` meaning ``1/sqrt(d)``).  ``o`` has ``q``'s dtype; ``lse [B, H, Nq]`` is
    float32 for float16/float32 inputs and float64 for float64.
    """
    qkv = check_qkv(q, k, v)
    b, h, nq, nk = qkv.b, qkv.h, qkv.nq, qkv.nk
    d, dtype = qkv.d, qkv.dtype
    causal = check_bool("causal", causal)
    scale = check_scale(softmax_scale, d, dtype)
    acc_t = acc_dtype(dtype)

    call = ArrayCall({"q": q, "k": k, "v": v}, op="naive_forward")
    call.reserve({"o": ((b, h, nq, d), dtype), "lse": ((b, h, nq), acc_t)})
    dq, dk, dv = call.input(q), call.input(k), call.input(v)
    o = call.empty((b, h, nq, d), dtype)
    lse = call.empty((b, h, nq), acc_t)
    block_m = default_block_m()
    kernel = naive_forward_kernel(padded_head_dim(d), causal, np.dtype(dtype))
    scale_arg = acc_t.type(scale)  # already the compute type: no float64 in f32 kernels
    # each thread is one query row; its loop visits the keys the row sees, d elements each
    keys = kv_tiles_visited(nq, nk, 1, 1, -1, 0 if causal else -1)
    call.launch(kernel, (cdiv(nq, block_m), b * h), (block_m,), dq, dk, dv, o, lse, scale_arg,
                work=SimWork("naive_forward", b * h * keys * d, b * h * nq * d))
    return call.result(o), call.result(lse)
