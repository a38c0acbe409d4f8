"""``forward_mma``: the attention forward on tensor cores (float16 or bfloat16,
``mma.sync.m16n8k16``).

``numba_flash.forward(..., kernel="mma")`` calls it; it takes the same arguments as the SIMT
forward except the tile choice.  See :mod:`numba_flash.kernels.forward_mma` for the kernel.
"""

from __future__ import annotations

import numpy as np

from ..frontend import ArrayCall
from ..frontend.sim_time import tiled_work
from ..kernels.forward_mma import (MMA_DTYPES, default_tiles, forward_grid, forward_mma_kernel,
                                   vector_copies)
from .forward import check_forward_args, check_forward_variant, user_arrays, user_build


def forward_mma(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, dropout_p=0.0,
                seed=0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, score_mod=None,
                mask_mod=None, block_mask=None, aux_tensors=()):
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
    ``aux_tensors``: a user's variant, as in :func:`numba_flash.forward`.
    """
    args = check_forward_args(q, k, v, causal, softmax_scale, return_lse, dropout_p, seed,
                              window_size, softcap, alibi_slopes)
    variant = check_forward_variant(args, score_mod, mask_mod, block_mask, aux_tensors)
    return launch_forward_mma(q, k, v, args, variant)


def launch_forward_mma(q, k, v, args, variant=None):
    """Run the tensor-core forward on ``q``, ``k``, ``v`` with ``args`` already validated by
    :func:`~numba_flash.ops.forward.check_forward_args` (``forward(kernel="mma")`` calls this,
    so each argument is checked, and CuPy ALiBi slopes read, once per call); ``variant``: the
    user's variant from :func:`~numba_flash.flex.launch.prepare_variant`, or None."""
    if args.dtype.name not in MMA_DTYPES:
        raise TypeError(f"q: expected dtype float16 or bfloat16 for the tensor-core forward, "
                        f"got {args.dtype}")
    b, h, nq, d = args.b, args.h, args.nq, args.d
    left, right, softcap, alibi = args.left, args.right, args.softcap, args.alibi
    seed_lo, seed_hi, threshold, keep_scale = args.dropout
    use_dropout = args.dropout_p > 0.0
    num_warps, block_n, head_dim = default_tiles(d)
    grid = forward_grid(nq, b, h, 16 * num_warps)

    call = ArrayCall({"q": q, "k": k, "v": v}, op="forward_mma")
    dq, dk, dv = call.input(q), call.input(k), call.input(v)
    kernel = forward_mma_kernel(num_warps, block_n, head_dim, use_dropout, softcap > 0.0,
                                alibi is not None, vector_copies(d, head_dim, dq, dk, dv),
                                args.dtype.name, user_build(variant))
    o = call.empty((b, h, nq, d), args.dtype)  # bfloat16: uint16 words, viewed back
    lse = call.empty((b, h, nq), np.float32)
    alibi_d = call.input(alibi) if alibi is not None else call.zeros((1, 1), np.float32)
    mods = (np.float32(softcap), np.float32(1.0 / softcap if softcap > 0.0 else 0.0))
    dropout = (seed_lo, seed_hi, threshold, np.float32(keep_scale)) if use_dropout else ()
    user = user_arrays(call, variant)  # (kinds,) + aux, or ()
    call.launch(kernel, grid, (32 * num_warps,),
                dq.view(np.uint16), dk.view(np.uint16), dv.view(np.uint16), o, lse,
                np.float32(args.scale), (np.int32(left), np.int32(right)), mods, alibi_d, dropout,
                user,
                work=tiled_work("forward_mma", [(nq, args.nk)] * b, h, 16 * num_warps, block_n,
                                left, right, 32 * num_warps, head_dim, mma=True))
    if args.return_lse:
        return call.result(o), call.result(lse)
    return call.result(o)
