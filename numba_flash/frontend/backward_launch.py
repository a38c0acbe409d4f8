"""The SIMT backward's launches (preprocess, dK/dV, dQ, the float32 row mass, the GQA sums) and
the sink's gradient, shared by :func:`numba_flash.backward` and
:func:`numba_flash.backward_varlen`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..kernels.backward.config import backward_simt_config
from ..kernels.backward.simt import (
    dkdv_kernel, dq_kernel, fold_grid, preprocess_kernel, reduce_kernel, row_mass_kernel,
)
from ..kernels.backward.config import default_tiles, elem_threads, row_lanes
from ..kernels.core.common import acc_dtype, cdiv
from ..philox import dropout_params
from .kernel_args import backward_user_build, device_constant, kernel_variant
from .sim_time import SimWork, tiled_work
from .validate import array_module


def sink_gradient(do, o, lse, sink, accumulate=False):
    """``dsink [H]`` (float32, the sink's kind; float64 with ``accumulate``, a partial sum to add
    to): ``-sum_{b,i} exp(sink_h - lse_bhi) D_bhi`` with ``D = rowsum(dO * O)``, in float64 over
    ``[B, H, N, d]`` (or packed ``[T, H, d]`` with ``lse [H, T]``) arrays."""
    xp = array_module(sink)
    f64 = xp.float64
    d_row = (xp.asarray(do).astype(f64) * xp.asarray(o).astype(f64)).sum(axis=-1)
    lse = xp.asarray(lse).astype(f64)
    if d_row.ndim == 2:        # packed: D [T, H] against lse [H, T]
        d_row = d_row.T[None]
        lse = lse[None]
    sink = xp.asarray(sink).astype(f64)[None, :, None]
    with np.errstate(invalid="ignore"):
        # a -inf sink is no sink: its weight is 0 (exp(-inf - lse) is NaN where lse = -inf, a
        # row that sees no key)
        w = xp.where(sink == -xp.inf, 0.0, xp.exp(sink - lse))
    total = 0.0 - (w * d_row).sum(axis=(0, 2))  # 0.0 - x: a sink with no weight gets +0
    return total if accumulate else total.astype(xp.float32)


def launch_backward(call, do_in, q_in, k_in, v_in, o_in, lse_in, *, n_seq, max_nq, max_nk,
                    cu_q, cu_k, varlen, dtype, scale, left, right, softcap, alibi,
                    deterministic, dropout_p, seed, lens=None, user_variant=None, sink=None,
                    outs=None):
    """Run preprocess, dK/dV (+ atomic dQ), deterministic dQ and the reductions on 4-D device
    arrays ``[Ba, H, N, d]`` (``Ba = B``, or 1 for a packed batch); return device ``(dq, dk, dv)``
    of the inputs' shapes and dtype.

    ``n_seq`` sequences (``B``, or the ``cu_seqlens`` entries - 1), the longest ``max_nq`` /
    ``max_nk`` (``lens``: each sequence's ``(nq, nk)``, for the simulator's time estimate;
    default ``n_seq`` times the longest); ``alibi`` a validated ``[n_seq, H]`` float32 array or
    None; the rest as the kernels take them (:mod:`numba_flash.kernels.backward.simt`);
    ``user_variant``: a user's variant (:func:`numba_flash.flex.launch.prepare_variant`) or
    None; ``sink``: the learnable sink logits (float32 ``[H]`` device array) or None;
    ``outs``: the caller's ``(dq, dk, dv)`` to write into (checked, these shapes), or None.

    float32 runs :func:`~numba_flash.kernels.backward.simt.row_mass_kernel` first: every later
    kernel reads its ``dO`` with each row divided by that row's ``c_i = sum_j exp(S_ij -
    lse_i)`` where ``lse_i`` is the rounded log-sum-exp of exactly these keys (why:
    docs/backward.md#what-the-forward-keeps-one-number-per-row).
    """
    ba, h, nq_rows, d = q_in.shape
    hkv, nk_rows = k_in.shape[1], k_in.shape[2]
    acc_t = acc_dtype(dtype)  # float32 accumulation for float16/float32, float64 for float64
    seed_lo, seed_hi, threshold, keep_scale = dropout_params(dropout_p, seed)
    dropout = float(dropout_p) > 0.0  # compile-time: p = 0 runs the plain kernels, bit for bit

    d_v = v_in.shape[3]  # dv, do, o: the value head dim (d, or v's own)
    outs = (None, None, None) if outs is None else outs
    # the SIMT kernels write through strides (Numba's indexing): a strided out= in place
    dk = call.output(outs[1], k_in.shape, dtype, strided=True)
    dv = call.output(outs[2], v_in.shape, dtype, strided=True)
    dq = call.output(outs[0], q_in.shape, dtype, strided=True)
    # float32 / float64 accumulate straight into dq; float16 / bfloat16 through a float32 buffer
    dq_accum = dq if dtype == acc_t else call.empty(q_in.shape, acc_t)
    # each query head's dK/dV share: straight into dk/dv when there is no group to sum and no
    # cast; otherwise a compute-type buffer with H heads that reduce_kernel sums per group
    direct = dtype == acc_t and h == hkv
    dk_out = dk if direct else call.empty((ba, h, nk_rows, d), acc_t)
    dv_out = dv if direct else call.empty((ba, h, nk_rows, d_v), acc_t)
    delta = call.empty(lse_in.shape, acc_t)
    if cu_q is None:  # dense: never read, but the kernels take an int32 array there
        cu_q = cu_k = device_constant(call, "no_cu_seqlens", np.zeros((1,), np.int32))
    # the variant (kernels/core/variant.py): ALiBi slopes always (zeros when off), () for no dropout
    # and no user variant (no kernel parameter); the sink, read by row_mass_kernel alone
    va = kernel_variant(call, acc_t, scale, left, right, softcap, alibi, (n_seq, h),
                        (seed_lo, seed_hi, threshold, keep_scale) if dropout else None,
                        user_variant, sink)
    user = backward_user_build(user_variant)

    def launch(kernel, grid, block, *args, work=None):
        if grid[0] > 0:  # an empty problem (varlen: every sequence empty) launches nothing
            call.launch(kernel, grid, block, *args, work=work)

    lens = [(max_nq, max_nk)] * n_seq if lens is None else list(lens)
    tiles = default_tiles(max(d, d_v), dtype)
    block_m, block_n, head_dim, threads = tiles
    cfg = backward_simt_config(tiles, dtype, dropout, user)

    # 0. float32: dO with row i divided by c_i = sum_j exp(S_ij - lse_i) where lse_i is the
    # rounded log-sum-exp of these very keys (docs/backward.md, what the forward keeps); the same
    # as dividing row i of P (and D_i with it), never the inputs' own dO
    if dtype == np.float32:
        do_p = call.empty(do_in.shape, acc_t)
        tiles_q = cdiv(max_nq, block_m)
        launch(row_mass_kernel(dataclasses.replace(cfg, DROPOUT=False)),
               fold_grid(tiles_q, n_seq, h), (threads,),
               q_in, k_in, do_in, lse_in, do_p, cu_q, cu_k, va, int(varlen), tiles_q,
               work=tiled_work("backward_dq", lens, h, block_m, block_n, left, right, threads,
                               head_dim))
        do_in = do_p

    # 1. D = rowsum(dO * O); dq_accum = 0 (row by row: no sequence boundaries needed)
    t = elem_threads()
    lanes = row_lanes()
    rows = cdiv(nq_rows, t // lanes)
    launch(preprocess_kernel(t, lanes, dtype), fold_grid(rows, ba, h), (t,),
           o_in, do_in, delta, dq_accum, rows,
           work=SimWork("backward_preprocess", ba * h * nq_rows * d))

    # 2. dK, dV (and dQ by atomics unless deterministic): one block per (K/V tile, b, head)
    tiles_k = cdiv(max_nk, block_n)
    launch(dkdv_kernel(cfg),
           fold_grid(tiles_k, n_seq, h), (threads,),
           q_in, k_in, v_in, do_in, lse_in, delta, dq_accum, dk_out, dv_out, cu_q, cu_k, va,
           int(varlen), tiles_k, 0 if deterministic else 1,
           work=tiled_work("backward_dkdv", lens, h, block_m, block_n, left, right, threads,
                           head_dim, kv_outer=True))

    # 3. deterministic dQ: one block per (Q tile, b, head), no atomics
    if deterministic:
        tiles_q = cdiv(max_nq, block_m)
        launch(dq_kernel(cfg),
               fold_grid(tiles_q, n_seq, h), (threads,),
               q_in, k_in, v_in, do_in, lse_in, delta, dq_accum, cu_q, cu_k, va, int(varlen),
               tiles_q,
               work=tiled_work("backward_dq", lens, h, block_m, block_n, left, right, threads,
                               head_dim))

    # 4. float16 / bfloat16: cast the float32 dQ accumulator (round to nearest even); GQA (or a
    # 16-bit dtype): sum each group's dK, dV
    if dq_accum is not dq:
        tiles = cdiv(nq_rows * d, t)
        launch(reduce_kernel(t, acc_t, dtype), fold_grid(tiles, ba, h), (t,), dq_accum, dq,
               tiles, work=SimWork("backward_reduce", ba * h * nq_rows * d))
    if not direct:
        for src, dst, width in ((dk_out, dk, d), (dv_out, dv, d_v)):
            tiles = cdiv(nk_rows * width, t)
            launch(reduce_kernel(t, acc_t, dtype), fold_grid(tiles, ba, hkv), (t,), src, dst,
                   tiles, work=SimWork("backward_reduce", ba * h * nk_rows * width))
    return dq, dk, dv
