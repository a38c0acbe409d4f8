"""``numba_flash.forward``: the FlashAttention forward (tiled, online softmax, causal, GQA)."""

from __future__ import annotations

import numpy as np

from ..backend import on_simulator
from ..frontend import ArrayCall
from ..frontend.validate import check_bool, check_qkv, check_scale, check_tile
from ..kernels.common import acc_dtype, cdiv
from ..kernels.forward import choose_tiles, explicit_tiles, forward_kernel, launch_config
from ..philox import dropout_params


def forward(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, block_m=None,
            block_n=None, dropout_p=0.0, seed=0):
    """Attention forward: ``o``, or ``(o, lse)`` with ``return_lse=True``.

    ``q`` is ``[B, H, Nq, d]``, ``k`` and ``v`` are ``[B, Hkv, Nk, d]`` with ``H`` a multiple of
    ``Hkv`` (query head ``h`` reads kv head ``h // (H // Hkv)``: GQA / MQA), ``d`` in 1..256.
    Same contract as :func:`numba_flash.reference.attention`: ``S = softmax_scale * Q K^T``
    (default ``1/sqrt(d)``), causal masking aligned bottom-right (query ``i`` sees key ``j`` iff
    ``j <= i + Nk - Nq``; a row that sees no key gets ``o = 0``, ``lse = -inf``).

    ``o`` has the input dtype; ``lse [B, H, Nq]`` (natural log) is float32, or float64 for
    float64 inputs.  float16 computes in float32, float64 in float64.  ``block_m`` / ``block_n``
    pick other compiled tile shapes (see :func:`numba_flash.kernels.forward.explicit_tiles`);
    ``None`` takes the backend's default.  NumPy in, NumPy out; CuPy in, CuPy out (GPU backend).

    ``dropout_p`` in ``[0, 1)`` drops each attention probability with that probability and
    scales the kept ones by ``1 / (1 - dropout_p)``: ``o = (P * keep / (1 - p)) V``, while ``lse``
    is that of the undropped ``P``.  The keep-mask is drawn in the kernel from ``seed`` (an
    integer in ``[0, 2**64)``) and is exactly ``numba_flash.dropout_mask(seed, B, H, Nq, Nk,
    dropout_p)`` (``h`` the query head), whatever the tiles; the same seed gives the same
    output.  ``dropout_p = 0`` runs the plain kernel (no random numbers drawn).
    """
    b, h, _hkv, nq, _nk, d, dtype = check_qkv(q, k, v)
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    scale = check_scale(softmax_scale, d)
    seed_lo, seed_hi, threshold, keep_scale = dropout_params(dropout_p, seed)
    use_dropout = float(dropout_p) > 0.0  # dropout_p = 0: the plain kernel, nothing drawn
    allowed = explicit_tiles(d, dtype)
    block_m = check_tile("block_m", block_m, {bm for bm, _ in allowed})
    block_n = check_tile("block_n", block_n, {bn for _, bn in allowed})
    BLOCK_M, BLOCK_N, HEAD_DIM = choose_tiles(d, dtype, block_m, block_n)
    block, threads_m, threads_n = launch_config(BLOCK_M, BLOCK_N, HEAD_DIM, on_simulator())
    kernel = forward_kernel(BLOCK_M, BLOCK_N, HEAD_DIM, causal, np.dtype(dtype), threads_m,
                            threads_n, use_dropout)
    # the kernel's dropout tuple: () adds no kernel parameter; scalars in kernel types
    acc_t = acc_dtype(dtype)  # lse and scalars in the compute type: no float64 in f32 kernels
    dropout = ((seed_lo, seed_hi, threshold, acc_t.type(keep_scale)) if use_dropout else ())

    call = ArrayCall({"q": q, "k": k, "v": v})
    dq, dk, dv = call.input(q), call.input(k), call.input(v)
    o = call.empty((b, h, nq, d), dtype)
    lse = call.empty((b, h, nq), acc_t)
    scale_arg = acc_t.type(scale)
    call.launch(kernel, (cdiv(nq, BLOCK_M), b * h), block, dq, dk, dv, o, lse, scale_arg,
                dropout)
    if return_lse:
        return call.result(o), call.result(lse)
    return call.result(o)
