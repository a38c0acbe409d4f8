"""``forward(..., kernel="wgmma")``: the attention forward on Hopper's warpgroup tensor-core
instruction (float16 or bfloat16, ``wgmma.mma_async``, sm_90a).

It takes what the ``mma.sync`` forward takes (:func:`numba_flash.ops.forward_mma.forward_mma`),
for head dims up to 128 with ``v`` as wide as ``q``; it runs in the simulator everywhere and on a
GPU of compute capability 9.0.  ``kernel="auto"`` does not choose it: its speed on a GPU is
unmeasured.  See :mod:`numba_flash.kernels.forward.wgmma` for the kernel.
"""

from __future__ import annotations

import numpy as np

from ..frontend import ArrayCall
from ..kernels.forward.wgmma import (
    MMA_DTYPES, WGMMA_HEAD_DIMS, forward_grid, forward_wgmma_kernel, forward_wgmma_config,
)
from ..kernels.forward.config import wgmma_head_dim
from ..kernels.forward.mma import vector_copies
from ..frontend.kernel_args import launch_tensor_core, user_build
from ..frontend.validate import is_c_contiguous


def launch_forward_wgmma(q, k, v, args, variant=None):
    """Run the warpgroup forward on ``q``, ``k``, ``v`` with ``args`` validated by
    :func:`~numba_flash.frontend.kernel_args.check_forward_args` (``forward(kernel="wgmma")`` calls
    this); ``variant``: the user's variant or None.  Head dims past 128 and a value head dim of
    its own are a ``ValueError`` (use ``kernel="mma"``)."""
    if args.dtype.name not in MMA_DTYPES:
        raise TypeError(f"q: expected dtype float16 or bfloat16 for the warpgroup forward, "
                        f"got {args.dtype}")
    b, h, nq, d = args.b, args.h, args.nq, args.d
    if d > WGMMA_HEAD_DIMS[-1]:
        raise ValueError(f"q: kernel='wgmma' takes head dims up to {WGMMA_HEAD_DIMS[-1]}, got "
                         f"{d}; use kernel='mma'")
    if args.d_v and args.d_v != d:
        raise ValueError(f"v: kernel='wgmma' takes v with q's head dim {d}, got {args.d_v}; "
                         "use kernel='mma' for a value head dim of its own")
    call = ArrayCall({"q": q, "k": k, "v": v}, op="forward_wgmma")
    # views whose last dim is contiguous are read (and out= written) through their strides
    dq, dk, dv = (call.input(x, strided=True) for x in (q, k, v))
    o = call.output(args.out, (b, h, nq, d), args.dtype, strided=True)  # bf16: words
    cfg = forward_wgmma_config(d, args.dtype.name, DROPOUT=args.dropout_p > 0.0,
                               SOFTCAP=args.softcap > 0.0, ALIBI=args.alibi is not None,
                               USER=user_build(variant),
                               VEC=vector_copies(d, wgmma_head_dim(d), dq, dk, dv),
                               STRIDED=not all(is_c_contiguous(x) for x in (dq, dk, dv, o)))
    return launch_tensor_core(call, args, variant, forward_wgmma_kernel(cfg),
                              forward_grid(nq, b, h, cfg.BLOCK_M), cfg,
                              [x.view(np.uint16) for x in (dq, dk, dv)], d,
                              shared=cfg.SMEM_BYTES, o=o)
