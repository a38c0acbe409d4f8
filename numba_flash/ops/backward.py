"""``numba_flash.backward``: attention gradients recomputed from the forward's ``lse``.

:func:`launch_backward` is the launch sequence that ``backward`` and
:func:`numba_flash.backward_varlen` share (the same kernels; varlen passes the packed arrays as
one batch and the ``cu_seqlens``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..frontend import ArrayCall
from ..frontend.sim_time import SimWork, tiled_work
from ..frontend.validate import array_module, check_backward_arrays, check_bool, check_scale
from ..frontend.variants import check_sink, check_variants
from ..kernels.backward.config import backward_simt_config
from ..kernels.backward.simt import (
    default_tiles, dkdv_kernel, dq_kernel, elem_threads, fold_grid, preprocess_kernel,
    reduce_kernel, row_lanes, row_mass_kernel,
)
from ..kernels.core.common import acc_dtype, cdiv
from ..flex.launch import prepare_variant
from ..philox import dropout_params
from .aux_grad import aux_gradients, prepare_aux_grad
from .forward import kernel_variant
from .kernel_choice import check_backward_kernel, import_mma


class BackwardArgs(NamedTuple):
    """The dense backward's arguments, checked once (:func:`check_backward_args`)."""

    b: int
    h: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: np.dtype
    causal: bool
    deterministic: bool
    scale: float
    #: the kernels' window bounds (:func:`numba_flash.frontend.variants.check_variants`)
    left: int
    right: int
    softcap: float
    #: float32 ``[B, H]`` of the inputs' kind, or None
    alibi: object
    #: a user's variant (:func:`numba_flash.flex.launch.prepare_variant`), or None
    variant: object
    #: the value head dim (``v``, ``o``, ``do``, ``dv``): ``d`` unless ``v`` has its own
    d_v: int = 0

    @property
    def shape(self):
        """``(B, H, Hkv, Nq, Nk, d)``."""
        return self.b, self.h, self.hkv, self.nq, self.nk, self.d


def check_backward_args(do, q, k, v, o, lse, causal, softmax_scale, deterministic, dropout_p,
                        seed, window_size, softcap, alibi_slopes, score_mod, mask_mod,
                        score_mod_grad, block_mask, aux_tensors, check_dtype=None):
    """Check every argument :func:`backward` and
    :func:`~numba_flash.ops.backward_mma.backward_mma` share (raising before any launch), in
    one order: the arrays, then ``check_dtype(dtype)`` when given, the flags, the scale,
    ``dropout_p`` and ``seed``, the built-in variants, the user's variant; return them as a
    :class:`BackwardArgs`."""
    b, h, hkv, nq, nk, d, d_v, dtype = check_backward_arrays(do, q, k, v, o, lse,
                                                             value_dim=True)
    if check_dtype is not None:
        check_dtype(dtype)
    causal = check_bool("causal", causal)
    deterministic = check_bool("deterministic", deterministic)
    scale = check_scale(softmax_scale, d, dtype)
    dropout_params(dropout_p, seed)  # checks dropout_p and seed
    _window, left, right, softcap, alibi = check_variants(causal, window_size, softcap,
                                                         alibi_slopes, b, h, nq=nq, nk=nk)
    # the one check of the user's arguments: None = no variant (and none of them given)
    variant = prepare_variant(score_mod, mask_mod, aux_tensors, block_mask,
                              score_mod_grad=score_mod_grad, needs_grad=True,
                              compute_dtype=acc_dtype(dtype), shape=(b, h, nq, nk))
    return BackwardArgs(b, h, hkv, nq, nk, d, dtype, causal, deterministic, scale, left, right,
                        softcap, alibi, variant, d_v)


def user_build(variant):
    """The backward kernels' ``USER`` (both families): ``(score_mod, mask_mod,
    score_mod_grad, BLOCKS)`` device code of a user's variant, or None without one."""
    if variant is None:
        return None
    return (variant.score_mod, variant.mask_mod, variant.score_mod_grad, variant.block)


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
    with np.errstate(invalid="ignore"):
        w = xp.exp(xp.asarray(sink).astype(f64)[None, :, None] - lse)
    total = -(w * d_row).sum(axis=(0, 2))
    return total if accumulate else total.astype(xp.float32)


def launch_backward(call, do_in, q_in, k_in, v_in, o_in, lse_in, *, n_seq, max_nq, max_nk,
                    cu_q, cu_k, varlen, dtype, scale, left, right, softcap, alibi,
                    deterministic, dropout_p, seed, lens=None, user_variant=None, sink=None):
    """Run preprocess, dK/dV (+ atomic dQ), deterministic dQ and the reductions on 4-D device
    arrays ``[Ba, H, N, d]`` (``Ba = B``, or 1 for a packed batch); return device ``(dq, dk, dv)``
    of the inputs' shapes and dtype.

    ``n_seq`` sequences (``B``, or the ``cu_seqlens`` entries - 1), the longest ``max_nq`` /
    ``max_nk`` (``lens``: each sequence's ``(nq, nk)``, for the simulator's time estimate;
    default ``n_seq`` times the longest); ``alibi`` a validated ``[n_seq, H]`` float32 array or
    None; the rest as the kernels take them (:mod:`numba_flash.kernels.backward.simt`);
    ``user_variant``: a user's variant (:func:`numba_flash.flex.launch.prepare_variant`) or
    None; ``sink``: the learnable sink logits (float32 ``[H]`` device array) or None.

    float32 runs :func:`~numba_flash.kernels.backward.simt.row_mass_kernel` first: every later
    kernel reads its ``dO`` with each row divided by that row's ``c_i = sum_j exp(S_ij -
    lse_i)`` where ``lse_i`` is the rounded log-sum-exp of exactly these keys (the module
    docstring of :mod:`numba_flash.kernels.backward.simt`, "The stored lse").
    """
    ba, h, nq_rows, d = q_in.shape
    hkv, nk_rows = k_in.shape[1], k_in.shape[2]
    acc_t = acc_dtype(dtype)  # float32 accumulation for float16/float32, float64 for float64
    seed_lo, seed_hi, threshold, keep_scale = dropout_params(dropout_p, seed)
    dropout = float(dropout_p) > 0.0  # compile-time: p = 0 runs the plain kernels, bit for bit

    d_v = v_in.shape[3]  # dv, do, o: the value head dim (d, or v's own)
    dk = call.empty(k_in.shape, dtype)
    dv = call.empty(v_in.shape, dtype)
    dq = call.empty(q_in.shape, dtype)
    # float32 / float64 accumulate straight into dq; float16 / bfloat16 through a float32 buffer
    dq_accum = dq if dtype == acc_t else call.empty(q_in.shape, acc_t)
    # each query head's dK/dV share: straight into dk/dv when there is no group to sum and no
    # cast; otherwise a compute-type buffer with H heads that reduce_kernel sums per group
    direct = dtype == acc_t and h == hkv
    dk_out = dk if direct else call.empty((ba, h, nk_rows, d), acc_t)
    dv_out = dv if direct else call.empty((ba, h, nk_rows, d_v), acc_t)
    delta = call.empty(lse_in.shape, acc_t)
    if cu_q is None:  # dense: never read, but the kernels take an int32 array there
        cu_q = cu_k = call.zeros((1,), np.int32)
    # the variant (kernels/core/variant.py): ALiBi slopes always (zeros when off), () for no dropout
    # and no user variant (no kernel parameter); the sink, read by row_mass_kernel alone
    va = kernel_variant(call, acc_t, scale, left, right, softcap, alibi, (n_seq, h),
                        (seed_lo, seed_hi, threshold, keep_scale) if dropout else None,
                        user_variant, sink)
    user = user_build(user_variant)

    def launch(kernel, grid, block, *args, work=None):
        if grid[0] > 0:  # an empty problem (varlen: every sequence empty) launches nothing
            call.launch(kernel, grid, block, *args, work=work)

    lens = [(max_nq, max_nk)] * n_seq if lens is None else list(lens)
    tiles = default_tiles(max(d, d_v), dtype)
    block_m, block_n, head_dim, threads = tiles
    cfg = backward_simt_config(tiles, dtype, dropout, user)

    # 0. float32: dO with row i divided by c_i = sum_j exp(S_ij - lse_i) where lse_i is the
    # rounded log-sum-exp of these very keys (kernels/backward/simt.py, "The stored lse"); the same
    # as dividing row i of P (and D_i with it), never the inputs' own dO
    if dtype == np.float32:
        do_p = call.empty(do_in.shape, acc_t)
        tiles_q = cdiv(max_nq, block_m)
        launch(row_mass_kernel(cfg._replace(DROPOUT=False)),
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


def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, deterministic=False,
             dropout_p=0.0, seed=0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
             kernel="auto", score_mod=None, mask_mod=None, score_mod_grad=None,
             block_mask=None, aux_tensors=(), aux_grad=None, learnable_sink=None):
    """Gradients ``(dq, dk, dv)`` of attention for the upstream gradient ``do`` (with a
    ``learnable_sink``, ``(dq, dk, dv, dsink)``; with ``aux_grad``, the aux tensors' gradients
    after them).

    ``q``, ``o``, ``do`` are ``[B, H, Nq, d]``; ``k``, ``v`` are ``[B, Hkv, Nk, d]`` (GQA: ``H`` a
    multiple of ``Hkv``); ``lse`` ``[B, H, Nq]`` is the forward's log-sum-exp, float32 (float64
    for float64 inputs).  Pass the forward's own arguments: ``causal`` masks bottom-right (query
    ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``); ``window_size = (left, right)`` keeps keys
    ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (-1: unbounded side; causal sets
    ``right = 0``); ``softcap > 0`` caps scores as ``softcap * tanh(s / softcap)``;
    ``alibi_slopes`` (float32 ``[H]`` or ``[B, H]``) subtracts ``slope * |i + Nk - Nq - j|``;
    ``softmax_scale`` defaults to ``1/sqrt(d)``.  Each gradient comes in its input's shape and
    dtype; ``dk`` and ``dv`` are summed over each GQA group.

    ``P`` is recomputed from ``lse`` (see :mod:`numba_flash.kernels.backward.simt`).  dQ is summed
    over K/V blocks with atomic adds by default; ``deterministic=True`` computes it in a second
    kernel without atomics, so two runs give bitwise identical gradients (a little slower).

    Dropout: pass the forward's ``dropout_p`` (a real in ``[0, 1)``) and ``seed`` (an integer in
    ``[0, 2**64)``), and its dropped ``o``; the kernels redraw the forward's keep-mask
    (:func:`numba_flash.dropout_mask`) from the seed and differentiate through
    ``keep / (1 - dropout_p)``.  ``dropout_p = 0`` runs exactly the kernels without dropout.

    ``kernel``: "simt" (the FMA kernels here, every dtype), "mma" (tensor cores: the dtypes of
    :mod:`numba_flash.ops.backward_mma`'s ``MMA_DTYPES``: float16 and bfloat16) or
    "auto" (mma for those dtypes on a GPU of compute capability >= 8.0 where available, simt
    otherwise).  bfloat16 (``ml_dtypes.bfloat16``) computes in float32 and returns bfloat16.

    Non-finite inputs: a row whose ``lse`` is NaN (a NaN in its ``q`` or a visible key) gets NaN
    gradients; a row that sees no key (``lse = -inf``) gets ``dq = 0`` and adds nothing to
    ``dk``/``dv``; keys a row does not see never affect it.

    A user's variant (the forward's ``score_mod``, ``mask_mod``, ``block_mask``, ``aux_tensors``,
    see :func:`numba_flash.forward`) needs ``score_mod_grad(score, b, h, q_idx, kv_idx, *aux)``,
    d score_mod / d score, with a ``score_mod`` (``dS`` is multiplied by it, at the score
    ``score_mod`` received).  Both kernel families take it (``kernel`` chooses as without one);
    with a ``block_mask`` the tiles it calls EMPTY are never loaded in either backward loop
    (the dK/dV kernel's Q tiles of a K/V tile, the dQ kernel's K/V tiles of a Q tile), and FULL
    ones skip the per-element ``mask_mod``.

    Gradients of the aux tensors (a learned bias table, learnable ALiBi slopes):
    ``aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, *aux)`` adds ``grad_score * d
    score_mod / d aux`` into ``grads`` (one zero-initialised array per aux tensor, its shape, the
    compute type) with :func:`numba_flash.flex.atomic_add`; ``grad_score`` is the gradient of
    the loss w.r.t. ``score_mod``'s output, ``score`` the score ``score_mod`` received.  The
    call then returns ``(dq, dk, dv, *aux_grads)`` (each in its aux tensor's float dtype); one
    more kernel (:mod:`numba_flash.ops.aux_grad`), no dropout.  The adds are atomic, so
    ``deterministic=True`` does not make the aux gradients bitwise reproducible.

    ``learnable_sink``: the forward's sink logits (float32 ``[H]``, :func:`numba_flash.forward`);
    ``lse`` holds the sink, so ``P`` and the kernels are unchanged, and ``dsink_h = -sum_{b,i}
    exp(sink_h - lse_bhi) D_bhi`` (``D = rowsum(dO * O)``) is summed on the host in float64
    (float32 ``[H]``, the sink's kind).

    NumPy in, NumPy out; CuPy in, CuPy out (GPU backend).
    """
    a = check_backward_args(do, q, k, v, o, lse, causal, softmax_scale, deterministic, dropout_p,
                            seed, window_size, softcap, alibi_slopes, score_mod, mask_mod,
                            score_mod_grad, block_mask, aux_tensors)
    aux = prepare_aux_grad(aux_grad, a.variant, a.dtype, dropout_p)
    sink = check_sink(learnable_sink, a.h)
    if a.d_v != a.d and aux is not None:
        raise ValueError(f"aux_grad: expected None with a value head dim of its own ({a.d_v}, "
                         f"not {a.d}): the aux gradients take d_v == d only so far")
    kernel = check_backward_kernel(kernel, a.dtype)
    if kernel == "mma":  # validated above, once: straight to the launches
        grads = import_mma("backward_mma").launch_backward_mma(
            do, q, k, v, o, lse, shape=a.shape, scale=a.scale, deterministic=a.deterministic,
            dropout_p=dropout_p, seed=seed, left=a.left, right=a.right, softcap=a.softcap,
            alibi=a.alibi, variant=a.variant)
    else:
        call = ArrayCall({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
        ins = [call.input(x) for x in (do, q, k, v, o, lse)]
        dq, dk, dv = launch_backward(
            call, *ins, n_seq=a.b, max_nq=a.nq, max_nk=a.nk, cu_q=None, cu_k=None, varlen=False,
            dtype=a.dtype, scale=a.scale, left=a.left, right=a.right, softcap=a.softcap,
            alibi=a.alibi, deterministic=a.deterministic, dropout_p=dropout_p, seed=seed,
            user_variant=a.variant, sink=None if sink is None else call.input(sink))
        grads = (call.result(dq), call.result(dk), call.result(dv))
    if sink is not None:
        grads = tuple(grads) + (sink_gradient(do, o, lse, sink),)
    if aux is None:
        return grads
    return tuple(grads) + aux_gradients(aux, do, q, k, v, o, lse, max_nq=a.nq, max_nk=a.nk,
                                        dtype=a.dtype, scale=a.scale, left=a.left,
                                        right=a.right, softcap=a.softcap, alibi=a.alibi)
