"""Gradients of a user's aux tensors: ``aux_grad`` called once per (b, h, row, key) a row sees.

A ``score_mod`` that reads an aux tensor (a relative-position bias table, learnable ALiBi
slopes) makes the loss depend on that tensor through the scores.  With ``x = score_mod(s, b, h,
i, j, *aux)`` the score the softmax uses (``s`` the score ``score_mod`` received: after scale,
softcap and ALiBi), the gradient of the loss ``L`` w.r.t. ``x`` is the backward's ``dS``::

    P_ij  = exp(x_ij - lse_i)                 (recomputed from the forward's lse)
    dP_ij = dO_i . v_j                        (the gradient w.r.t. P)
    D_i   = dO_i . O_i                        (= sum_j P_ij dP_ij)
    dS_ij = P_ij (dP_ij - D_i) = dL / dx_ij   (FlexAttention's grad_score)

and ``dL / d aux = sum_ij dS_ij d x_ij / d aux``.  The user writes the inner factor as a device
function ``aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, *aux)`` that adds
``grad_score * d x / d aux`` into ``grads`` (one array per aux tensor, its shape, the compute
type) with :func:`numba_flash.flex.atomic_add`; this kernel calls it with ``grad_score = dS_ij``
and ``score = s_ij`` for every key ``j`` that row ``i`` sees (the visibility rule of
:mod:`numba_flash.kernels.mainloop.visibility` and-ed with the user's ``mask_mod``), never for a key
it does not see, a padding row or a row that sees no key (``lse = -inf``).  Dropout is not taken
(the caller refuses ``aux_grad`` with ``dropout_p > 0``).

Layouts (those of :mod:`numba_flash.kernels.backward.simt`): ``q``, ``o``, ``do`` ``[Ba, H, rows,
d]``, ``k``, ``v`` ``[Ba, Hkv, key rows, d]`` (query head ``h`` reads kv head ``h // (H // Hkv)``),
``lse`` ``[Ba, H, rows]`` in the compute type; dense: ``Ba = B`` and sequence ``b`` is batch
entry ``b``; varlen (``varlen = 1``): ``Ba = 1`` and sequence ``b`` is rows ``cu_q[b] :
cu_q[b + 1]`` (keys ``cu_k[b] : cu_k[b + 1]``), with ``q_idx`` / ``kv_idx`` positions within
the sequence.  ``alibi`` float32 ``[n_seq, H]`` (zeros: no ALiBi).

Parallelism: ``LANES`` threads per query row (a warp on the GPU), ``ROWS`` rows a block, block
``x`` of the 1-D grid is row tile ``x % tiles`` of ``(b, h) = divmod(x // tiles, H)``.  Lane
``l`` takes the row's keys ``lo + l, lo + l + LANES, ...``: each (row, key) is independent
(two dot products over the head dim from global memory, the score, ``P``, ``dS``, the user's
call), so there is no shared memory and no barrier; the user's atomic adds sum the
contributions.  ``D_i`` is computed by every lane of the row (``d`` products: as many as one
key's).  The kernel does the backward's ``O(Nq Nk d)`` work once more: aux gradients cost
about one more backward pass (a fused kernel would call ``aux_grad`` from the backward's ``dS``
tile; the backward kernels are not changed for it).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, int32, types

from ...backend import on_simulator
from ..core.common import GRID_X_MAX, acc_dtype, compute_type, numba_array_type
from ..core.elements import element_ops
from ..core.jit import device_jit, kernel_jit
from ..mainloop.visibility import key_bounds, make_score

#: ``(ROWS, LANES)``: query rows per block and threads per row.  GPU: a warp per row, 4 rows
#: (128 threads).  Simulator (each CUDA thread a Python thread, each block a round of thread
#: starts): 4 lanes per row and 8 rows, so a block of 32 threads covers 8 rows with 8x fewer
#: threads than a warp each (measured on a loaded 2-core CPU, a [2, 2, 32, 8]
#: float64 backward with a learnable-slopes aux_grad: 6.5 s -> 2.9 s, most of it the backward).
GPU_SHAPE = (4, 32)
SIM_SHAPE = (8, 4)


def default_shape():
    """``(ROWS, LANES)`` on the current backend."""
    return SIM_SHAPE if on_simulator() else GPU_SHAPE


def aux_grad_grid(tiles, n_seq, heads):
    """The 1-D grid ``(tiles * n_seq * heads,)`` (everything in ``gridDim.x``: ``y`` and ``z``
    stop at 65535)."""
    n = int(tiles) * int(n_seq) * int(heads)
    if n <= GRID_X_MAX:
        return (n,)
    raise ValueError(f"aux_grad: {tiles} row tiles x {n_seq} sequences x {heads} heads = {n} "
                     f"blocks exceed CUDA's grid limit {GRID_X_MAX}")


@functools.lru_cache(maxsize=None)
def aux_grad_kernel(ROWS, LANES, dtype, USER):
    """Build ``kernel(q, k, v, o, do, lse, cu_q, cu_k, alibi, scale, softcap, inv_softcap, left,
    right, varlen, tiles, grads, aux)`` for elements of ``dtype``, ``ROWS`` rows per block and
    ``LANES`` threads per row (``ROWS * LANES`` threads; lane ``l`` takes keys ``lo + l, lo + l
    + LANES, ...``).  ``USER``: ``(score_mod, mask_mod, aux_grad)`` device functions
    (``score_mod`` / ``mask_mod`` may be None).  ``scale``, ``softcap``, ``inv_softcap``
    (0: no softcap) are compute-type scalars; ``left`` / ``right`` the window (-1: unbounded),
    ``varlen`` 0 or 1, ``tiles`` the row tiles of the longest sequence (int32); ``grads`` and
    ``aux`` tuples of arrays."""
    load, _store = element_ops(dtype)
    acc_t = compute_type(dtype)
    score_alibi = make_score(False, True, acc_t)  # the forward's score (a slope of 0: exact)
    score_capped = make_score(True, True, acc_t)
    user_score, user_mask, user_aux_grad = USER
    U_SCORE = user_score is not None
    U_MASK = user_mask is not None
    ZERO = acc_t(0.0)
    NEG_INF = acc_t(-math.inf)

    @device_jit(own_module=True, inline="always")
    def dot(x, bx, hx, rx, y, by, hy, ry, d):
        """``x[bx, hx, rx, :] . y[by, hy, ry, :]`` in the compute type, one FMA per column in
        order (the score contract of
        :func:`~numba_flash.kernels.mainloop.visibility.make_score`)."""
        acc = ZERO
        for c in range(d):
            acc += load(x[bx, hx, rx, c]) * load(y[by, hy, ry, c])
        return acc

    @kernel_jit(cache=False)  # a user's functions stay off the on-disk kernel cache
    def aux_grad(q, k, v, o, do, lse, cu_q, cu_k, alibi, scale, softcap, inv_softcap, left,
                 right, varlen, tiles, grads, aux):
        heads = q.shape[1]
        group = heads // k.shape[1]
        bx = cuda.blockIdx.x
        tile = bx % tiles
        bh = bx // tiles
        b = int32(bh // heads)
        h = int32(bh % heads)
        hk = h // group
        lane = cuda.threadIdx.x % LANES
        row = int32(tile * ROWS + cuda.threadIdx.x // LANES)
        if varlen:
            bb = 0
            q0 = cu_q[b]
            nq = cu_q[b + 1] - q0
            k0 = cu_k[b]
            nk = cu_k[b + 1] - k0
        else:
            bb = b
            q0 = 0
            nq = q.shape[2]
            k0 = 0
            nk = k.shape[2]
        if row >= nq:
            return
        qr = q0 + row
        lse_i = acc_t(lse[bb, h, qr])
        if lse_i == NEG_INF:  # the row sees no key: P = 0 everywhere, nothing to add
            return
        d = q.shape[3]
        delta = dot(do, bb, h, qr, o, bb, h, qr, d)  # D_i = dO_i . O_i
        offset = nk - nq  # bottom-right alignment
        lo, hi = key_bounds(row, offset, nk, left, right)
        slope = acc_t(alibi[b, h])
        for j in range(lo + lane, hi, LANES):
            key = int32(j)
            if U_MASK:
                if not user_mask(b, h, row, key, *aux):
                    continue
            qk = dot(q, bb, h, qr, k, bb, hk, k0 + key, d)
            if softcap > ZERO:  # runtime: the forward's SOFTCAP build
                s, _dcap = score_capped(qk, scale, row, key, offset, softcap, inv_softcap,
                                        slope)
            else:
                s, _dcap = score_alibi(qk, scale, row, key, offset, softcap, inv_softcap,
                                       slope)
            x = s
            if U_SCORE:  # the score the softmax used (acc_t, whatever the user's code returns)
                x = acc_t(user_score(s, b, h, row, key, *aux))
            p = math.exp(x - lse_i)
            dp = dot(do, bb, h, qr, v, bb, hk, k0 + key, d)
            # dS = P (dP - D): the gradient w.r.t. score_mod's output; score: its input
            user_aux_grad(p * (dp - delta), s, b, h, row, key, grads, *aux)

    return aux_grad


def kernel_arg_types(dtype, grad_types, aux_types):
    """The Numba argument types of :func:`aux_grad_kernel` for elements of ``dtype``."""
    acc = numba_array_type(acc_dtype(dtype), 3)
    x = numba_array_type(dtype, 4)
    i32 = numba_array_type(np.int32, 1)
    ct = compute_type(dtype)
    return (x, x, x, x, x, acc, i32, i32, numba_array_type(np.float32, 2), ct, ct, ct,
            types.int32, types.int32, types.int32, types.int32,
            types.Tuple(tuple(grad_types)), types.Tuple(tuple(aux_types)))
