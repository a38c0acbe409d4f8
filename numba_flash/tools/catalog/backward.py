"""The backward kernels' compile-tier configurations: the SIMT backward, mma.sync, the
token-sparse backward and the user-function gradients."""

from __future__ import annotations

import numpy as np

from numba import types
from numba_flash.kernels.backward.config import backward_mma_config
from numba_flash.kernels.core.common import HEAD_DIMS, acc_dtype, compute_type, numba_array_type
from numba_flash.kernels.core.elements import BFLOAT16
from numba_flash.kernels.core.variant import variant_type
from numba_flash.kernels.backward import aux_grad
from numba_flash.kernels.backward.config import backward_simt_config
from numba_flash.kernels.backward import mma
from numba_flash.kernels.backward import config as bconfig
from numba_flash.kernels.backward import simt
from numba_flash.kernels.backward import sparse


def _example_user(dtype):
    """The compile tier's user functions: :mod:`numba_flash.flex.examples`' relative-position
    bias (score_mod, and its aux_grad into the bias table's gradient)."""
    from numba_flash.flex.examples import relative_bias, relative_bias_aux_grad
    from numba_flash.flex.functions import device_function

    return (device_function(relative_bias), None, device_function(relative_bias_aux_grad))


def aux_grad_configs():
    """float32 and float16 (the float32 kernel with 16-bit loads) with the examples'
    relative-position bias table and its aux_grad, for the compile tier."""
    for dt in (np.dtype(np.float32), np.dtype(np.float16)):
        acc = acc_dtype(dt)
        yield {
            "name": f"aux_grad ROWS={aux_grad.GPU_SHAPE[0]} relative_bias {dt.name}",
            "kernel": aux_grad.aux_grad_kernel(*aux_grad.GPU_SHAPE, dt, _example_user(dt)),
            "args": aux_grad.kernel_arg_types(dt, (numba_array_type(acc, 2),),
                                     (numba_array_type(np.float32, 2),)),
            "float64_ok": False,
        }


def simt_configs():
    """Every backward configuration the package can launch on a GPU, for the compile tier: the
    plain kernels at the default tiles of every padded head dim and dtype, and the ``DROPOUT``
    kernels for :data:`DROPOUT_CONFIGS` only (float16/float32 at HEAD_DIM 64 and 128, float64
    and bfloat16 at 64; the rest share their code and differ only in tile constants); bfloat16's
    dK/dV and dQ kernels at :data:`BF16_HEAD_DIMS` only; float32's :func:`row_mass_kernel` at
    :data:`ROW_MASS_HEAD_DIMS`.  Window, softcap, ALiBi, GQA and varlen
    are runtime arguments of the same kernels."""
    dropout_set = {(hd, np.dtype(dt)) for hd, dt in simt.DROPOUT_CONFIGS}
    i64 = types.int64
    cu_t = numba_array_type(np.int32, 1)
    for dtype in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BFLOAT16):
        acc = acc_dtype(dtype)
        a4, a3 = numba_array_type(dtype, 4), numba_array_type(acc, 3)
        acc4 = numba_array_type(acc, 4)
        acc_nb = compute_type(dtype)
        f64_ok = dtype == np.float64
        yield {"name": f"backward preprocess {dtype.name}",
               "kernel": simt.preprocess_kernel(bconfig.GPU_ELEM_THREADS, bconfig.GPU_ROW_LANES,
                                                dtype),
               "args": (a4, a4, a3, acc4, i64), "float64_ok": f64_ok}
        yield {"name": f"backward reduce {acc.name}->{dtype.name}",
               "kernel": simt.reduce_kernel(bconfig.GPU_ELEM_THREADS, acc, dtype),
               "args": (acc4, a4, i64), "float64_ok": f64_ok}
        lse3 = numba_array_type(acc, 3)
        for hd in HEAD_DIMS:
            if dtype == BFLOAT16 and hd not in simt.BF16_HEAD_DIMS:
                continue
            tiles = bconfig.default_tiles(hd, dtype, simulator=False)
            bm, bn, _, threads = tiles
            if dtype == np.float32 and hd in simt.ROW_MASS_HEAD_DIMS:
                yield {"name": f"backward row_mass M{bm} N{bn} D{hd} {dtype.name}",
                       "kernel": simt.row_mass_kernel(backward_simt_config(tiles, dtype)),
                       "args": (a4, a4, a4, lse3, acc4, cu_t, cu_t, variant_type(acc_nb, False),
                                i64, i64),
                       "float64_ok": f64_ok}
            for dropout in (False, True) if (hd, dtype) in dropout_set else (False,):
                tag = f"M{bm} N{bn} D{hd} {dtype.name}{' dropout' if dropout else ''}"
                va_t = variant_type(acc_nb, dropout)
                yield {"name": f"backward dkdv {tag}",
                       "kernel": simt.dkdv_kernel(backward_simt_config(tiles, dtype, dropout)),
                       "args": (a4, a4, a4, a4, lse3, a3, acc4, acc4, acc4, cu_t, cu_t, va_t,
                                i64, i64, i64),
                       "launch_bounds": (threads, bconfig.min_blocks("dkdv", hd, dtype, dropout)),
                       "float64_ok": f64_ok}
                yield {"name": f"backward dq {tag}",
                       "kernel": simt.dq_kernel(backward_simt_config(tiles, dtype, dropout)),
                       "args": (a4, a4, a4, a4, lse3, a3, acc4, cu_t, cu_t, va_t, i64, i64),
                       "launch_bounds": (threads, bconfig.min_blocks("dq", hd, dtype, dropout)),
                       "float64_ok": f64_ok}


def mma_configs():
    """A representative set for the compile tier, from the tile choices of
    :data:`~numba_flash.kernels.backward.config.BACKWARD_MMA_TILES`: the dK/dV kernel (with atomic
    dQ) at every head dim (256: two of its four passes, the dV half and the dK half with dQ), the
    deterministic dQ kernel at 64, 128 and 256 (one half), every flag (dropout, softcap,
    ALiBi) at 128 in both, the 16-bit-load build (``VEC`` off) and bfloat16 at 64, a user's
    variant at 64, a value head dim of its own, (192, 128) (``OWN_V``; both kernels), and the
    strided builds at 64 and 128 (both kernels).
    Causal and windows are run-time arguments."""
    every = dict(DROPOUT=True, SOFTCAP=True, ALIBI=True)

    def dkdv(hd, dtype="float16", **flags):
        return backward_mma_config(hd, "dkdv", dtype, simulator=False, **flags)

    def dq(hd, dtype="float16", **flags):
        return backward_mma_config(hd, "dq", dtype, simulator=False, **flags)

    plan = [dkdv(hd) for hd in HEAD_DIMS if 2 * hd <= mma.ONE_PASS_COLUMNS]
    plan += [dkdv(256, **mma.dkdv_passes(256, False)[0]),
             dkdv(256, **mma.dkdv_passes(256, False)[2])]
    plan += [dkdv(128, **every), dkdv(64, VEC=False), dkdv(64, "bfloat16"),
             dkdv(64, USER=_user_build())]
    plan += [dq(64), dq(128), dq(128, **every), dq(256, **mma.dq_passes(256)[0]),
             dq(64, "bfloat16")]
    # (d, d_v) = (192, 128), MLA prefill (OWN_V: K and Q tiles 192 wide, V and dO 128): the
    # dK/dV kernel (one pass, atomic dQ) and the deterministic dQ
    plan += [dkdv(192, head_dim_v=128, **mma.dkdv_passes(192, False, 128)[0]),
             dq(192, head_dim_v=128)]
    # read through strides (flash-attn's [B, N, H, d] memory): the goal head dims, both kernels
    plan += [f(hd, STRIDED=True) for hd in (64, 128) for f in (dkdv, dq)]
    for cfg in plan:
        yield mma.compile_config(cfg)


def _user_build():
    """A user's variant (:mod:`numba_flash.flex.examples`: a relative-position bias score_mod
    with its score_mod_grad and a document mask_mod with a block mask) as device functions (every
    function gets every aux array)."""
    from numba_flash.flex.examples import document_mask, relative_bias, relative_bias_grad
    from numba_flash.flex.functions import device_function

    def biased(score, b, h, q_idx, kv_idx, bias, doc):
        return relative_bias(score, b, h, q_idx, kv_idx, bias)

    def biased_grad(score, b, h, q_idx, kv_idx, bias, doc):
        return relative_bias_grad(score, b, h, q_idx, kv_idx, bias)

    def documents(b, h, q_idx, kv_idx, bias, doc):
        return document_mask(b, h, q_idx, kv_idx, doc)

    return (device_function(biased), device_function(documents), device_function(biased_grad),
            (128, 128))


def sparse_configs():
    """The token-sparse backward (:mod:`numba_flash.kernels.backward.sparse`) at ``HEAD_DIM =
    128``: float16 plain and with softcap and ALiBi, float32 plain (the head dim and the flags
    are the only constants; float64 and bfloat16 are the same source)."""
    for dtype, flags in ((np.dtype(np.float16), {}),
                         (np.dtype(np.float16), {"softcap": True, "alibi": True}),
                         (np.dtype(np.float32), {})):
        cfg = bconfig.sparse_backward_config(128, dtype, simulator=False, **flags)
        acc = acc_dtype(dtype)
        a4 = numba_array_type(dtype, 4)
        acc4 = numba_array_type(acc, 4)
        tag = "".join(f" {f}" for f in flags)
        yield {"name": f"backward sparse T{cfg.THREADS} R{cfg.ROWS} D{cfg.HEAD_DIM} "
                       f"{dtype.name}{tag}",
               "config": cfg,
               "kernel": sparse.sparse_backward_kernel(cfg),
               "args": (a4, a4, a4, a4, a4, numba_array_type(acc, 3),
                        numba_array_type(np.int32, 4), a4, acc4, acc4,
                        variant_type(compute_type(dtype), False)),
               "float64_ok": False}
