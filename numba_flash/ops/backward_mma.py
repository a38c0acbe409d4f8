"""``backward_mma``: attention gradients on tensor cores (float16 / bfloat16, ``mma.sync``).

``numba_flash.backward(..., kernel="mma")`` calls it.  The launch sequence: the SIMT preprocess
(``D = rowsum(dO * O)``, ``dq_accum = 0``), the tensor-core dK/dV kernel (with atomic dQ, or the
deterministic tensor-core dQ kernel after it), then the SIMT reduce kernel sums each GQA group's
dK/dV in a fixed order and casts dQ, dK, dV to the input dtype (see
:mod:`numba_flash.kernels.backward.mma`).  A user's variant (``score_mod`` with its
``score_mod_grad``, ``mask_mod``, ``block_mask``, ``aux_tensors``) is compiled into the
tensor-core kernels (``USER``).
"""

from __future__ import annotations

import numpy as np

from ..frontend import ArrayCall
from ..frontend.validate import is_c_contiguous
from ..frontend.sim_time import SimWork, tiled_work
from ..kernels.backward.simt import fold_grid, preprocess_kernel, reduce_kernel
from ..kernels.backward.config import elem_threads, row_lanes
from ..kernels.backward.mma import (
    MMA_DTYPES, backward_mma_config, dkdv_mma_kernel, dkdv_passes, dq_mma_kernel, dq_passes,
)
from ..kernels.core.common import cdiv
from ..kernels.forward.mma import vector_copies
from ..philox import dropout_params
from ..frontend.kernel_args import BackwardShape, backward_user_build, check_backward_args
from ..frontend.kernel_args import kernel_variant


def backward_mma(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, dropout_p=0.0,
                 seed=0, deterministic=False, window_size=(-1, -1), softcap=0.0,
                 alibi_slopes=None, score_mod=None, mask_mod=None, score_mod_grad=None,
                 block_mask=None, aux_tensors=()):
    """Gradients ``(dq, dk, dv)`` on tensor cores; the contract of :func:`numba_flash.backward`.

    float16 or bfloat16 (``ml_dtypes.bfloat16``) ``q``, ``o``, ``do`` ``[B, H, Nq, d]`` and ``k``
    ``[B, Hkv, Nk, d]``, ``v`` ``[B, Hkv, Nk, d_v]`` (GQA; ``o``, ``do`` ``[.., d_v]``: a value head
    dim of its own, any ``d_v`` the forward takes; views whose last dim is contiguous are read where
    they lie, the kernels' ``STRIDED`` build), float32 ``lse [B, H, Nq]`` from the forward, and the
    forward's ``causal``, ``softmax_scale``, ``window_size``, ``softcap``, ``alibi_slopes``,
    ``dropout_p`` and ``seed``.  Each gradient comes in its input's shape and dtype; ``dk``, ``dv``
    are summed over each GQA group.  dQ is summed over K/V tiles with float32 atomic adds, or, with
    ``deterministic=True``, by a second kernel without atomics (bitwise reproducible).
    ``score_mod``, ``mask_mod``, ``score_mod_grad``, ``block_mask``, ``aux_tensors``: a user's
    variant, as in :func:`numba_flash.backward`.
    """
    a = check_backward_args(do, q, k, v, o, lse, causal, softmax_scale, deterministic, dropout_p,
                            seed, window_size, softcap, alibi_slopes, score_mod, mask_mod,
                            score_mod_grad, block_mask, aux_tensors, check_dtype=check_mma_dtype)
    return launch_backward_mma(do, q, k, v, o, lse, shape=a.shape, scale=a.scale,
                               deterministic=a.deterministic, dropout_p=dropout_p, seed=seed,
                               left=a.left, right=a.right, softcap=a.softcap, alibi=a.alibi,
                               variant=a.variant)


def check_mma_dtype(dtype):
    """A TypeError unless ``dtype`` is one the tensor-core backward takes (``MMA_DTYPES``)."""
    if np.dtype(dtype).name not in MMA_DTYPES:
        raise TypeError(f"q: expected dtype float16 or bfloat16 for the tensor-core backward, "
                        f"got {dtype}")


def launch_backward_mma(do, q, k, v, o, lse, *, shape, scale, deterministic, dropout_p, seed,
                        left, right, softcap, alibi, variant=None, outs=None):
    """The launches of :func:`backward_mma` on arguments already checked (``shape``: a
    :class:`~numba_flash.frontend.kernel_args.BackwardShape` or a tuple ``(B, H, Hkv, Nq, Nk,
    d)``, ``left``/``right`` the kernels' window bounds, ``alibi`` float32 ``[B, H]`` or None;
    ``variant``: a user's variant from :func:`~numba_flash.flex.launch.prepare_variant`, or
    None; ``outs``: the caller's ``(dq, dk, dv)``, checked, or None): :func:`numba_flash.backward`
    validates once and calls this."""
    shape = BackwardShape._make(shape)
    b, h, hkv = shape.b, shape.h, shape.hkv
    nq, nk, d = shape.nq, shape.nk, shape.d
    d_v = v.shape[3]   # v, o, do, dv: d, or a value head dim of its own (OWN_V)
    dtype = do.dtype
    check_mma_dtype(dtype)
    name = np.dtype(dtype).name
    dropout = dropout_params(dropout_p, seed)   # (seed_lo, seed_hi, threshold, keep_scale)
    use_dropout = float(dropout_p) > 0.0
    flags = dict(DROPOUT=use_dropout, SOFTCAP=softcap > 0.0, ALIBI=alibi is not None,
                 USER=backward_user_build(variant))
    if d_v != d:   # V and dO tiles of their own width (OWN_V)
        flags["head_dim_v"] = d_v

    call = ArrayCall({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    # views whose last dim is contiguous (flash-attn's [B, N, H, d] memory) are read where they
    # lie: the tensor-core kernels' STRIDED build, the SIMT preprocess and reduce kernels' own
    # strided indexing, which also writes a strided out= in place
    do_in, q_in, k_in, v_in, o_in = (call.input(x, strided=True) for x in (do, q, k, v, o))
    lse_in = call.input(lse)
    f32 = np.float32
    outs = (None, None, None) if outs is None else outs
    dq, dk, dv = (call.output(x, shape, dtype, strided=True)
                  for x, shape in zip(outs, (q_in.shape, k_in.shape, v_in.shape)))
    dq_accum = call.empty(q_in.shape, f32)        # zeroed by the preprocess kernel
    dk_heads = call.empty((b, h, nk, d), f32)     # each query head's share of dK, dV
    dv_heads = call.empty((b, h, nk, d_v), f32)
    delta = call.empty((b, h, nq), f32)
    u16 = [x.view(np.uint16) for x in (q_in, k_in, v_in, do_in)]
    shape_cfg = backward_mma_config(d, "dq", **flags)   # the compiled widths
    head_dim, head_dim_v = shape_cfg.HEAD_DIM, shape_cfg.HEAD_DIM_V or None
    flags["VEC"] = vector_copies(d, head_dim, *u16, d_v=d_v)
    flags["STRIDED"] = not all(is_c_contiguous(x) for x in u16)
    # flat views: the kernels index lse, D and dq_accum by one 64-bit base per tile
    lse_flat, delta_flat = lse_in.reshape(-1), delta.reshape(-1)
    dq_flat, dk_flat, dv_flat = (x.reshape(-1) for x in (dq_accum, dk_heads, dv_heads))
    # the front end's Variant in float32; no sink: P comes from lse, which holds the sink
    va = kernel_variant(call, f32, scale, left, right, softcap, alibi,
                        dropout=dropout if use_dropout else None, variant=variant)

    # 1. D = rowsum(dO * O), dq_accum = 0 (the SIMT preprocess kernel)
    t = elem_threads()
    rows = cdiv(nq, t // row_lanes())
    call.launch(preprocess_kernel(t, row_lanes(), dtype), fold_grid(rows, b, h), (t,),
                o_in, do_in, delta, dq_accum, rows,
                work=SimWork("backward_preprocess", b * h * nq * d))

    # 2. dK, dV (+ atomic dQ): one block per (K/V tile, b, query head); past 320 columns of
    # the two widths (d = 256: four) passes of at most 128 columns each (dkdv_passes)
    for dkdv_pass in dkdv_passes(head_dim, deterministic, head_dim_v):
        cfg = backward_mma_config(d, "dkdv", name, **flags, **dkdv_pass)
        tiles_k = cdiv(nk, cfg.BLOCK)
        call.launch(dkdv_mma_kernel(cfg), fold_grid(tiles_k, b, h), (cfg.THREADS,), *u16,
                    lse_flat, delta_flat, dq_flat, dk_flat, dv_flat, va, tiles_k,
                    work=tiled_work("backward_dkdv_mma", [(nq, nk)] * b, h, cfg.STEP,
                                    cfg.BLOCK, left, right, cfg.THREADS, cfg.HEAD_DIM,
                                    kv_outer=True, mma=True))

    # 3. deterministic dQ: one block per (Q tile, b, head), no atomics (d = 256: two halves)
    if deterministic:
        for dq_pass in dq_passes(head_dim):
            cfg = backward_mma_config(d, "dq", name, **flags, **dq_pass)
            tiles_q = cdiv(nq, cfg.BLOCK)
            call.launch(dq_mma_kernel(cfg), fold_grid(tiles_q, b, h), (cfg.THREADS,), *u16,
                        lse_flat, delta_flat, dq_flat, va, tiles_q,
                        work=tiled_work("backward_dq_mma", [(nq, nk)] * b, h, cfg.BLOCK,
                                        cfg.STEP, left, right, cfg.THREADS, cfg.HEAD_DIM,
                                        mma=True))

    # 4. sum each GQA group's dK, dV in a fixed order; cast everything to the input dtype
    for src, dst, heads, n, cols in ((dq_accum, dq, h, nq, d), (dk_heads, dk, hkv, nk, d),
                                     (dv_heads, dv, hkv, nk, d_v)):
        tiles = cdiv(n * cols, t)
        call.launch(reduce_kernel(t, np.dtype(f32), dtype), fold_grid(tiles, b, heads), (t,),
                    src, dst, tiles, work=SimWork("backward_reduce", b * h * n * cols))
    return call.result(dq), call.result(dk), call.result(dv)
