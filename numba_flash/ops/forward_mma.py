"""``forward_mma``: the attention forward on tensor cores (float16 or bfloat16,
``mma.sync.m16n8k16``).

``numba_flash.forward(..., kernel="mma")`` calls it; it takes the same arguments as the SIMT
forward except the tile choice.  See :mod:`numba_flash.kernels.forward.mma` for the kernel.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..frontend import ArrayCall
from ..frontend.validate import is_c_contiguous
from ..kernels.forward.mma import (
    MMA_DTYPES, forward_grid, forward_mma_config, forward_mma_kernel, vector_copies,
)
from ..frontend.kernel_args import (
    check_forward_args, check_forward_variant, launch_tensor_core, user_build,
)


def forward_mma(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, dropout_p=0.0,
                seed=0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, score_mod=None,
                mask_mod=None, block_mask=None, aux_tensors=(), learnable_sink=None):
    """Attention forward on tensor cores: ``o``, or ``(o, lse)`` with ``return_lse=True``.

    ``q`` float16 or bfloat16 (``ml_dtypes.bfloat16``) ``[B, H, Nq, d]``, ``k`` and ``v`` of
    the same dtype ``[B, Hkv, Nk, d]`` (``H`` a multiple
    of ``Hkv``: GQA / MQA), ``d`` in 1..256.  The contract of :func:`numba_flash.forward` and
    :func:`numba_flash.reference.attention`: ``S = softmax_scale * Q K^T`` (default
    ``1/sqrt(d)``), bottom-right ``causal`` masking, ``window_size = (left, right)``,
    ``softcap``, ``alibi_slopes`` (float32 ``[H]`` or ``[B, H]``), dropout drawn from ``seed``
    exactly as :func:`numba_flash.dropout_mask`; a row that sees no key gets ``o = 0``,
    ``lse = -inf``; NaN / inf inputs follow the reference's rules.

    ``Q K^T`` and ``P V`` run in the input type with float32 accumulation (``P`` is rounded to
    that type before ``P V``, as in flash-attn); the softmax runs in float32.  ``o`` has the
    input dtype, ``lse`` is float32 ``[B, H, Nq]``.  bfloat16 needs compute capability >= 8.0
    (``mma...bf16`` and ``cvt.rn.bf16x2.f32`` are sm_80 instructions).  NumPy in, NumPy out;
    CuPy in, CuPy out (GPU backend).  ``score_mod``, ``mask_mod``, ``block_mask``,
    ``aux_tensors``: a user's variant, ``learnable_sink`` a sink per head, as in
    :func:`numba_flash.forward`.
    """
    args = check_forward_args(q, k, v, causal, softmax_scale, return_lse, dropout_p, seed,
                              window_size, softcap, alibi_slopes, learnable_sink)
    variant = check_forward_variant(args, score_mod, mask_mod, block_mask, aux_tensors)
    return launch_forward_mma(q, k, v, args, variant)


def launch_forward_mma(q, k, v, args, variant=None):
    """Run the tensor-core forward on ``q``, ``k``, ``v`` with ``args`` already validated by
    :func:`~numba_flash.frontend.kernel_args.check_forward_args` (``forward(kernel="mma")`` calls
    this, so each argument is checked, and CuPy ALiBi slopes read, once per call); ``variant``: the
    user's variant from :func:`~numba_flash.flex.launch.prepare_variant`, or None."""
    if args.dtype.name not in MMA_DTYPES:
        raise TypeError(f"q: expected dtype float16 or bfloat16 for the tensor-core forward, "
                        f"got {args.dtype}")
    b, h, nq, d = args.b, args.h, args.nq, args.d
    d_v = args.d_v or d
    call = ArrayCall({"q": q, "k": k, "v": v}, op="forward_mma")
    # views whose last dim is contiguous are read (and out= written) through their strides
    dq, dk, dv = (call.input(x, strided=True) for x in (q, k, v))
    o = call.output(args.out, (b, h, nq, d_v), args.dtype, strided=True)  # bf16: words
    # a value head dim of its own: K / Q tiles and V tiles each of their own width (OWN_V)
    cfg = forward_mma_config(d, args.dtype.name, head_dim_v=d_v if d_v != d else None,
                             DROPOUT=args.dropout_p > 0.0, SOFTCAP=args.softcap > 0.0,
                             ALIBI=args.alibi is not None, USER=user_build(variant))
    cfg = dataclasses.replace(cfg, VEC=vector_copies(d, cfg.HEAD_DIM, dq, dk, dv, d_v=d_v),
                              STRIDED=not all(is_c_contiguous(x) for x in (dq, dk, dv, o)))
    return launch_tensor_core(call, args, variant, forward_mma_kernel(cfg),
                              forward_grid(nq, b, h, cfg.BLOCK_M), cfg,
                              [x.view(np.uint16) for x in (dq, dk, dv)], d_v, o=o)
