"""Gradients of a user's aux tensors, for :func:`numba_flash.backward` and
:func:`numba_flash.backward_varlen` (``aux_grad=``): the checks before any launch
(:func:`prepare_aux_grad`) and the launch of :mod:`numba_flash.kernels.backward.aux_grad`
(:func:`aux_gradients`).

The user's function::

    def aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, *aux) -> None

is called for every (query, key) pair the query sees, with ``grad_score`` the gradient of the
loss w.r.t. ``score_mod``'s output there (FlexAttention's convention; the backward's ``dS``) and
``score`` the score ``score_mod`` received (after scale, softcap, ALiBi); ``b``, ``h``,
``q_idx``, ``kv_idx`` and ``aux`` as ``score_mod`` gets them.  It adds ``grad_score * d
score_mod / d aux`` into ``grads`` (a tuple of one zero-initialised array per aux tensor, its
shape, float32 / float64 for float64 inputs) with :func:`numba_flash.flex.atomic_add`.  The
backward returns each ``grads`` array in its aux tensor's dtype (a float one; an integer or
bool aux tensor's gradient stays in the compute type) after ``dq, dk, dv``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import ArrayCall
from .sim_time import SimWork
from ..kernels.backward.aux_grad import aux_grad_grid, aux_grad_kernel, default_shape
from ..kernels.core.common import acc_dtype, cdiv

__all__ = ["AuxGrad", "prepare_aux_grad", "check_aux_grad", "aux_gradients"]


class AuxGrad(NamedTuple):
    """A checked ``aux_grad`` with the variant it belongs to."""

    fn: object        # the CUDA device function
    variant: object   # numba_flash.flex.launch.UserVariant (its score_mod, mask_mod, aux)


def prepare_aux_grad(aux_grad, variant, dtype, dropout_p):
    """Check ``aux_grad`` before any launch (:func:`check_aux_grad`); ``None`` without one."""
    if aux_grad is None:
        return None
    from ..flex.functions import device_function

    check_aux_grad(aux_grad, () if variant is None else variant.aux, dtype, dropout_p)
    return AuxGrad(device_function(aux_grad), variant)


def check_aux_grad(aux_grad, aux, dtype, dropout_p):
    """A ``ValueError`` without aux arrays ``aux`` or with dropout; a ``TypeError`` naming
    ``aux_grad`` unless it takes the 7 fixed arguments and one per aux array, Numba compiles it
    for the types the kernel calls it with (the compute type of ``dtype``) and it returns
    nothing."""
    from numba import from_dtype, types

    from ..flex.functions import check_host_types, check_mod
    from ..flex.launch import aux_numba_types

    if not aux:
        raise ValueError("aux_grad: given without aux_tensors (it adds the gradients of the aux "
                         "tensors a score_mod reads)")
    if float(dropout_p) > 0.0:
        raise ValueError(f"aux_grad: not supported with dropout (dropout_p = {dropout_p}); pass "
                         f"dropout_p=0 to train aux tensors")
    check_mod("aux_grad", aux_grad, len(aux))
    acc = from_dtype(acc_dtype(dtype))
    grads_t = types.Tuple(tuple(types.Array(acc, a.ndim, "A") for a in aux))
    check_host_types("aux_grad", aux_grad,
                     (acc, acc) + (types.int32,) * 4 + (grads_t,) + aux_numba_types(aux), "none")


def _result(call, g, aux):
    """A gradient array back to the caller's kind, in the aux tensor's dtype if it is a float."""
    out = call.result(g)
    dt = np.dtype(aux.dtype)
    return out.astype(dt) if dt.kind == "f" and dt != out.dtype else out


def aux_gradients(prepared, do, q, k, v, o, lse, *, cu_seqlens=None, max_nq, max_nk, dtype,
                  scale, left, right, softcap, alibi):
    """Launch the aux-gradient kernel on validated arrays; returns one gradient per aux tensor.

    Dense: ``q``, ``o``, ``do`` ``[B, H, Nq, d]``, ``k``, ``v`` ``[B, Hkv, Nk, d]``, ``lse``
    ``[B, H, Nq]``.  Varlen: the same as one batch ``[1, H, total, d]`` (and ``lse [1, H,
    total]``) with ``cu_seqlens = (cu_q, cu_k)``, the validated int32 arrays.  ``alibi``: the
    validated float32 ``[n_seq, H]`` slopes or None; the rest as :func:`numba_flash.backward`
    validated them.
    """
    variant = prepared.variant
    b, h, _rows, d = q.shape
    n_seq = b if cu_seqlens is None else len(cu_seqlens[0]) - 1
    acc_t = acc_dtype(dtype)
    call = ArrayCall({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    dq_, dk_, dv_ = (call.input(x) for x in (q, k, v))
    do_, o_, lse_ = (call.input(x) for x in (do, o, lse))
    if cu_seqlens is None:  # dense: never read, but the kernel takes int32 arrays there
        cu_q = cu_k = call.zeros((1,), np.int32)
    else:
        cu_q, cu_k = (call.input(c) for c in cu_seqlens)  # validated int32 arrays
    slopes = call.zeros((n_seq, h), np.float32) if alibi is None else call.input(alibi)
    grads = tuple(call.zeros(a.shape, acc_t) for a in variant.aux)
    aux = tuple(call.input(a) for a in variant.aux)
    rows, lanes = default_shape()
    tiles = cdiv(max(int(max_nq), 1), rows)
    kernel = aux_grad_kernel(rows, lanes, np.dtype(dtype),
                             (variant.score_mod, variant.mask_mod, prepared.fn))
    grid = aux_grad_grid(tiles, n_seq, h)
    threads = rows * lanes
    pairs = n_seq * h * max(int(max_nq), 1) * max(int(max_nk), 1)
    call.launch(kernel, grid, (threads,), dq_, dk_, dv_, o_, do_, lse_, cu_q, cu_k, slopes,
                acc_t.type(scale), acc_t.type(softcap),
                acc_t.type(1.0 / softcap if softcap > 0 else 0.0), np.int32(left),
                np.int32(right), np.int32(cu_seqlens is not None), np.int32(tiles), grads, aux,
                work=SimWork("naive_forward", pairs * 2 * d, grid[0] * threads * d))
    return tuple(_result(call, g, a) for g, a in zip(grads, variant.aux))
