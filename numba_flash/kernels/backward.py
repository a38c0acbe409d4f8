"""FlashAttention backward: recompute P from ``lse``, K/V tiles outer, dQ by atomics.

Math
----
For one ``(batch, query head)`` with ``S = scale * Q K^T`` (masked entries ``-inf``), the forward
saved only ``O`` and one float per query row, ``lse_i = log sum_j exp(S_ij)``, not the running
``m_i`` and ``l_i``: since ``P_ij = exp(S_ij - m_i) / l_i = exp(S_ij - (m_i + log l_i))``, the one
number ``lse_i = m_i + log l_i`` recovers the probabilities exactly::

    P  = exp(S - lse)                     (recomputed tile by tile, never stored in HBM)
    dV = P^T dO                           dP = dO V^T
    dS = P * (dP - D),   D_i = rowsum(dP_i * P_i)
    dQ = scale * dS K                     dK = scale * dS^T Q

``dS`` is the softmax Jacobian applied to ``dP``: ``dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik)``.
The row term ``D_i`` needs a whole row of ``dP``, which no K/V tile has, but it equals a row of
``dO * O`` summed (the *preprocess* kernel, :func:`preprocess_kernel`)::

    sum_j dP_ij P_ij = sum_j P_ij sum_c dO_ic V_jc
                     = sum_c dO_ic (sum_j P_ij V_jc) = sum_c dO_ic O_ic

``d`` multiplies per row instead of ``Nk``, and it reads only ``O`` and ``dO``.  A row that sees no
key (causal with ``Nq > Nk``) has ``lse = -inf``: its ``P`` is forced to 0 (never
``exp(S + inf)``), so it adds nothing and its ``dQ`` stays 0, never NaN.

Kernels
-------
1. :func:`preprocess_kernel` ``(o, do, delta, dq_accum)``: ``delta = rowsum(dO * O)`` and zeroes
   the dQ accumulator.  grid = (ceil(Nq / THREADS), B, H), one thread per query row.
2. :func:`dkdv_kernel` ``(q, k, v, do, lse, delta, dq_accum, dk, dv, scale, causal, dq_atomic)``:
   one block per ``(K/V tile j, batch, kv head)``, grid = (ceil(Nk / BLOCK_N), B, Hkv).  ``k_tile``
   and ``v_tile`` are loaded once; the block loops over the query heads of its GQA group and over
   the Q tiles, recomputing ``P`` and ``dS`` for each ``(Q_i, K_j)``; ``dK_j`` and ``dV_j`` are
   accumulated in registers and written once at the end (the block owns that kv head's tile for
   the whole group, so no atomics).  With ``dq_atomic`` it also adds ``scale * dS K_j`` into the
   float32 (float64) ``dq_accum`` with ``cuda.atomic.add``.  Causal: the Q tiles wholly before
   the diagonal (no row sees a key of this tile) are skipped; the others are masked per element.
3. :func:`dq_kernel` ``(q, k, v, do, lse, delta, dq_out, scale, causal)``, for
   ``deterministic=True``: one block per ``(Q tile, batch, query head)``, grid =
   (ceil(Nq / BLOCK_M), B, H); it loops over the K/V tiles (causal: up to the last one its rows
   can see), recomputes ``P`` and ``dS`` and
   accumulates ``dQ_i`` in registers in a fixed order, then stores it: bitwise identical run to
   run.  (Atomic float adds land in whatever order the blocks reach them; flash-attn users ask for
   a deterministic backward, flash-attn issues #414 and #988.)  ``dK``/``dV`` then come from
   :func:`dkdv_kernel` with ``dq_atomic = 0``; they never used atomics.
4. :func:`cast_kernel` ``(src, dst)``: the float32 dQ accumulator to float16 (float32 and float64
   accumulate straight into the output).  grid = (ceil(Nq d / THREADS), B, H).

Thread mapping
--------------
Every tile product gives each thread a register micro-tile (:func:`layout`): for a ``ROWS x COLS``
tile, ``COL_T`` threads across columns, ``ROW_T = THREADS / COL_T`` down rows; a thread owns rows
``r, r + ROW_T, ...`` and columns ``c, c + COL_T, ...``.  Per step of the reduction it loads its
``TR`` row values and ``TC`` column values from shared memory and does ``TR * TC`` FMAs.
Neighbouring threads own neighbouring columns, so their shared reads hit distinct banks (rows are
padded by one element) or broadcast.  Three micro-tiles: ``S``/``dP`` (``BLOCK_M x BLOCK_N``),
``dK``/``dV`` (``BLOCK_N x HEAD_DIM``, live across the whole K/V-outer loop) and ``dQ``
(``BLOCK_M x HEAD_DIM``).  ``P`` and ``dS`` go through shared memory between them.

Shared memory (``w`` = 4 bytes in float16/float32, 8 in float64)
------------------------------------------------------------------
``k_tile``, ``v_tile [BLOCK_N, HEAD_DIM + PAD]``, ``q_tile``, ``do_tile [BLOCK_M, HEAD_DIM + PAD]``,
``p_tile``, ``ds_tile [BLOCK_M, BLOCK_N]``, ``lse`` and ``delta [BLOCK_M]``::

    w * (2 (BLOCK_M + BLOCK_N)(HEAD_DIM + PAD) + 2 BLOCK_M BLOCK_N + 2 BLOCK_M)  bytes

plus ``4 BLOCK_M BLOCK_N / 4`` for the dropout ``keep_tile`` (:func:`shared_bytes`), at most 48
KiB for every GPU configuration (:data:`GPU_TILES`; e.g. 42.4 KiB for float32 at HEAD_DIM = 128
with 8 x 32 tiles, 42.6 KiB with dropout).  Tiles hold the compute type: float16 inputs are read
as float16 and computed in float32; float64 computes in float64.

Compile-time constants
----------------------
``BLOCK_M``, ``BLOCK_N``, ``HEAD_DIM`` (padded to 16/32/64/128/256), ``THREADS``, the dtype and
``DROPOUT`` are arguments of the memoised factories; ``causal`` and ``dq_atomic`` are runtime ints.  Causal costs
one integer compare per score (next to ``2 HEAD_DIM`` FMAs) and its tile skipping is a runtime loop
bound anyway, while a compile-time flag doubled the compile tier (measured on a 2-core CPU: 126
builds, ~260 s of CPU with it; 68 builds, ~145 s without).

Dropout (the ``DROPOUT`` specialisation; the plain kernels have none of it)
------------------------------------------------------------------------------
The forward applied ``Z = keep / (1 - p)`` to ``P`` (``keep`` the Philox mask of
:mod:`numba_flash.philox`: element ``(b, h, i, j)``, ``h`` the query head, ``i``/``j`` global
indices, so it is exactly ``numba_flash.dropout_mask(seed, B, H, Nq, Nk, p)``) and returned
``O = (P * Z) V``.  The backward redraws the same bits from ``(seed, b, h, i, j)`` (no mask is
stored) and applies the chain rule through ``Z``::

    dV = (P * Z)^T dO                    dP = (dO V^T) * Z
    dS = P * (dP - D),   D_i = rowsum(dO_i * O_i)          (dQ, dK from dS as before)

``D`` is still the preprocess kernel's ``rowsum(dO * O)`` with the *dropped* ``O``, because::

    sum_c dO_ic O_ic = sum_c dO_ic sum_j P_ij Z_ij V_jc = sum_j P_ij Z_ij (dO V^T)_ij
                     = sum_j P_ij dP_ij

``lse`` is unaffected (the forward's ``l_i`` sums the undropped ``P``), so ``P = exp(S - lse)``
is recomputed exactly as without dropout.  Each block draws the keep bits of its current
``(Q_i, K_j)`` tile pair into ``keep_tile [BLOCK_M, BLOCK_N / 4]`` (int32; bit ``w`` of
``keep_tile[m, g]`` keeps key ``k_start + 4 g + w`` of row ``q_start + m``) with
:func:`~numba_flash.philox.philox_keep_bits4`, one Philox call per 4 keys spread over all
threads, in the same phase as the tile loads (so behind the barrier that already precedes
``p_and_ds``; no extra barrier).  A group no row can see (past ``Nq``/``Nk``, wholly after the
causal diagonal) is not drawn.  The ``S``/``dP`` micro-tile gives each thread columns strided by
``COL_T``, not 4 consecutive ones, hence the shared ``keep_tile`` rather than per-thread draws
(which would cost 4x the Philox calls).  ``p_tile`` then holds ``P * Z`` (for ``dV``) and
``ds_tile`` ``P * (dP * Z - D)``.  ``dropout_p = 0`` never reaches these kernels: the op runs the
plain ones.  ``keep_tile`` adds ``4 BLOCK_M BLOCK_N / 4`` bytes of shared memory.

The dropout kernels take one more argument, the tuple ``dropout = (seed_lo, seed_hi,
threshold, keep_scale)`` (the ``numpy.uint32`` values of
:func:`numba_flash.philox.dropout_params` and ``1 / (1 - p)`` in the compute type); the plain
kernels get ``()``, an empty tuple that adds no kernel parameter, so their PTX is what it was
before dropout existed.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, int32, types

from ..backend import on_simulator
from ..philox import philox_keep_bits4
from .common import (HEAD_DIMS, SMEM_LIMIT, acc_dtype, compute_type, numba_array_type,
                     padded_head_dim)


#: GPU tiles ``(BLOCK_M, BLOCK_N)`` per padded head dim, for 4-byte and 8-byte compute.  BLOCK_N
#: is the larger one: each K/V block streams all of Q, dO and the dQ atomics once, so that
#: traffic scales with Nk / BLOCK_N; BLOCK_M only sets the work between barriers.
GPU_TILES = {
    4: {16: (32, 64), 32: (32, 64), 64: (32, 32), 128: (8, 32), 256: (4, 16)},
    8: {16: (32, 32), 32: (16, 32), 64: (16, 16), 128: (4, 16), 256: (4, 4)},
}
GPU_THREADS = 128

#: one element of padding per shared row, so threads reading a column hit distinct banks.
PAD = 1

#: simulator: small tiles, few threads (each CUDA thread is a Python thread).
SIM_BLOCK = 8
SIM_THREADS = 16

#: one-thread-per-element kernels (preprocess, cast).
GPU_ELEM_THREADS = 128


def _word(dtype):
    """Bytes of one compute-type element in the shared tiles (float16 tiles hold float32)."""
    return acc_dtype(dtype).itemsize


def default_tiles(head_dim, dtype, simulator=None):
    """``(BLOCK_M, BLOCK_N, HEAD_DIM, THREADS)`` for this backend: small in the simulator."""
    hd = padded_head_dim(head_dim)
    if on_simulator() if simulator is None else simulator:
        return SIM_BLOCK, SIM_BLOCK, hd, SIM_THREADS
    block_m, block_n = GPU_TILES[_word(dtype)][hd]
    return block_m, block_n, hd, GPU_THREADS


def elem_threads():
    return SIM_THREADS if on_simulator() else GPU_ELEM_THREADS


def shared_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, dropout=False):
    """Static shared memory of one dK/dV or dQ block (the budget in the module docstring)."""
    row = HEAD_DIM + PAD
    words = 2 * (BLOCK_M + BLOCK_N) * row + 2 * BLOCK_M * BLOCK_N + 2 * BLOCK_M
    keep_bytes = 4 * BLOCK_M * (BLOCK_N // 4) if dropout else 0  # int32 keep_tile
    return _word(dtype) * words + keep_bytes


def layout(ROWS, COLS, THREADS):
    """Split ``THREADS`` over a ``ROWS x COLS`` tile: ``(COL_T, ROW_T, TR, TC)``.

    ``COL_T`` threads across columns (16 wide, wider when the tile is short), ``ROW_T`` down the
    rows; each thread owns ``TR x TC`` elements strided by ``ROW_T`` and ``COL_T``.  When the tile
    has fewer rows than ``ROW_T`` the threads with row index >= ROWS sit that phase out.
    """
    col_t = min(COLS, THREADS, max(16, THREADS // ROWS))
    row_t = THREADS // col_t
    assert COLS % col_t == 0 and (ROWS % row_t == 0 or row_t > ROWS), (ROWS, COLS, THREADS)
    return col_t, row_t, max(1, ROWS // row_t), COLS // col_t


@functools.lru_cache(maxsize=None)
def tile_functions(BLOCK_M, BLOCK_N, HEAD_DIM, THREADS, dtype, DROPOUT):
    """Device functions shared by :func:`dkdv_kernel` and :func:`dq_kernel` (inlined)."""
    assert not DROPOUT or BLOCK_N % 4 == 0  # whole groups of 4 keys per Philox call
    acc_t = compute_type(dtype)
    NEG_INF = -math.inf
    A_COL_T, A_ROW_T, A_TR, A_TC = layout(BLOCK_M, BLOCK_N, THREADS)     # S, dP, P, dS
    C_COL_T, C_ROW_T, C_TR, C_TC = layout(BLOCK_M, HEAD_DIM, THREADS)    # dQ
    A_TILE = A_TR * A_TC
    GROUPS = BLOCK_N // 4  # dropout: groups of 4 keys (one Philox call each) per tile row

    @cuda.jit(device=True, inline="always")
    def load_tile(x, b, h, start, ROWS, tile, tid):
        """``tile[:ROWS, :HEAD_DIM] <- x[b, h, start:start + ROWS, :]``, zero past the array."""
        n = x.shape[2]
        d = x.shape[3]
        for idx in range(tid, ROWS * HEAD_DIM, THREADS):
            r = idx // HEAD_DIM
            c = idx % HEAD_DIM  # consecutive threads read consecutive columns: coalesced
            if start + r < n and c < d:
                tile[r, c] = acc_t(x[b, h, start + r, c])
            else:
                tile[r, c] = acc_t(0.0)

    @cuda.jit(device=True, inline="always")
    def load_row_stats(lse, delta, b, h, q_start, lse_sh, delta_sh, tid):
        """``lse`` and ``D`` of the Q tile's rows; rows past Nq get ``lse = -inf`` (P = 0)."""
        nq = lse.shape[2]
        for m in range(tid, BLOCK_M, THREADS):
            if q_start + m < nq:
                lse_sh[m] = acc_t(lse[b, h, q_start + m])
                delta_sh[m] = delta[b, h, q_start + m]
            else:
                lse_sh[m] = acc_t(NEG_INF)
                delta_sh[m] = acc_t(0.0)

    @cuda.jit(device=True, inline="always")
    def draw_keep(dropout, b, h, q_start, k_start, nq, nk, causal, keep_tile, tid):
        """DROPOUT: ``keep_tile[m, g]`` <- keep bits of keys ``k_start + 4g .. + 3`` of row
        ``q_start + m`` (global indices: the mask of :func:`numba_flash.dropout_mask`)."""
        seed_lo, seed_hi, threshold, _keep_scale = dropout
        offset = nk - nq  # bottom-right causal alignment
        for idx in range(tid, BLOCK_M * GROUPS, THREADS):
            m = idx // GROUPS
            g = idx % GROUPS
            row = q_start + m
            key = k_start + 4 * g
            bits = int32(0)  # a group no row sees is not drawn: its P is 0 anyway
            if row < nq and key < nk and (not causal or key <= row + offset):
                bits = philox_keep_bits4(seed_lo, seed_hi, b, h, row, key >> 2, threshold)
            keep_tile[m, g] = bits

    @cuda.jit(device=True, inline="always")
    def p_and_ds(q_tile, k_tile, v_tile, do_tile, lse_sh, delta_sh, p_tile, ds_tile,
                 q_start, k_start, nq, nk, scale, causal, dropout, keep_tile, tid):
        """THE place P and dS are made: ``p_tile <- P``, ``ds_tile <- P * (dP - D)``.

        ``S = Q_i K_j^T`` and ``dP = dO_i V_j^T`` as one ``A_TR x A_TC`` micro-tile per thread,
        then per element ``P = exp(scale * S - lse)`` (0 where masked, past the arrays, or in a
        row with ``lse = -inf``) and ``dS = P * (dP - D)``.  DROPOUT: with ``Z = keep / (1 - p)``
        from ``keep_tile``, ``p_tile <- P * Z`` and ``ds_tile <- P * (dP * Z - D)``.
        """
        ar = tid // A_COL_T
        ac = tid % A_COL_T
        if ar < BLOCK_M:
            s = cuda.local.array(A_TILE, acc_t)
            dp = cuda.local.array(A_TILE, acc_t)
            kc = cuda.local.array(A_TC, acc_t)
            vc = cuda.local.array(A_TC, acc_t)
            for e in range(A_TILE):
                s[e] = acc_t(0.0)
                dp[e] = acc_t(0.0)
            # -- S = Q_i K_j^T and dP = dO_i V_j^T over the (zero-padded) head dim
            for c in range(HEAD_DIM):
                for j in range(A_TC):
                    kc[j] = k_tile[ac + j * A_COL_T, c]
                    vc[j] = v_tile[ac + j * A_COL_T, c]
                for i in range(A_TR):
                    qv = q_tile[ar + i * A_ROW_T, c]
                    dov = do_tile[ar + i * A_ROW_T, c]
                    for j in range(A_TC):
                        s[i * A_TC + j] += qv * kc[j]
                        dp[i * A_TC + j] += dov * vc[j]
            # [docs:bwd-p-ds]
            # -- P = exp(scale S - lse), dS = P (dP - D); masked / empty rows give exactly 0
            offset = nk - nq  # bottom-right causal alignment
            for i in range(A_TR):
                m = ar + i * A_ROW_T
                row = q_start + m
                lse_i = lse_sh[m]
                for j in range(A_TC):
                    n = ac + j * A_COL_T
                    col = k_start + n
                    visible = row < nq and col < nk and lse_i != acc_t(NEG_INF)
                    if causal:
                        visible = visible and col <= row + offset
                    p = acc_t(0.0)
                    ds = acc_t(0.0)
                    if visible:
                        p = math.exp(s[i * A_TC + j] * scale - lse_i)
                        if DROPOUT:  # compile-time; DROPOUT: Z = keep / (1 - p_drop)
                            z = acc_t(0.0)
                            if (keep_tile[m, n >> 2] >> (n & 3)) & 1:  # k_start % 4 == 0
                                z = dropout[3]
                            ds = p * (dp[i * A_TC + j] * z - delta_sh[m])  # dP = (dO V^T) Z
                            p = p * z  # DROPOUT: dV takes the dropped P * Z
                        else:
                            ds = p * (dp[i * A_TC + j] - delta_sh[m])
                    p_tile[m, n] = p
                    ds_tile[m, n] = ds
            # [/docs:bwd-p-ds]

    @cuda.jit(device=True, inline="always")
    def ds_k(ds_tile, k_tile, dq_acc, tid):
        """``dq_acc += dS K_j`` on this thread's ``C_TR x C_TC`` micro-tile of dQ_i."""
        cr = tid // C_COL_T
        cc = tid % C_COL_T
        if cr < BLOCK_M:
            kc = cuda.local.array(C_TC, acc_t)
            for n in range(BLOCK_N):
                for j in range(C_TC):
                    kc[j] = k_tile[n, cc + j * C_COL_T]
                for i in range(C_TR):
                    dsv = ds_tile[cr + i * C_ROW_T, n]
                    for j in range(C_TC):
                        dq_acc[i * C_TC + j] += dsv * kc[j]

    return load_tile, load_row_stats, draw_keep, p_and_ds, ds_k


@functools.lru_cache(maxsize=None)
def dkdv_kernel(BLOCK_M, BLOCK_N, HEAD_DIM, THREADS, dtype, DROPOUT):
    """Build ``kernel(q, k, v, do, lse, delta, dq_accum, dk, dv, scale, causal, dq_atomic,
    dropout)``.

    K/V tiles outer.  ``scale`` must be of the compute type; ``causal`` (int 0/1) masks
    bottom-right; ``dq_atomic`` (int 0/1) says whether to add ``scale * dS K_j`` into
    ``dq_accum`` (a zeroed float32 / float64 buffer).  ``dropout`` is ``()`` for the plain
    kernel, ``(seed_lo, seed_hi, threshold, keep_scale)`` with ``DROPOUT`` (module docstring).
    """
    dtype = np.dtype(dtype)
    assert shared_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, DROPOUT) <= SMEM_LIMIT or on_simulator()
    acc_t = compute_type(dtype)
    ROW = HEAD_DIM + PAD
    B_COL_T, B_ROW_T, B_TR, B_TC = layout(BLOCK_N, HEAD_DIM, THREADS)    # dK, dV
    C_COL_T, C_ROW_T, C_TR, C_TC = layout(BLOCK_M, HEAD_DIM, THREADS)    # dQ
    B_TILE = B_TR * B_TC
    C_TILE = C_TR * C_TC
    GROUPS = BLOCK_N // 4
    load_tile, load_row_stats, draw_keep, p_and_ds, ds_k = tile_functions(
        BLOCK_M, BLOCK_N, HEAD_DIM, THREADS, dtype, DROPOUT)

    @cuda.jit
    def backward_dkdv(q, k, v, do, lse, delta, dq_accum, dk, dv, scale, causal, dq_atomic,
                      dropout):
        tid = cuda.threadIdx.x
        k_start = cuda.blockIdx.x * BLOCK_N
        b = cuda.blockIdx.y
        hk = cuda.blockIdx.z
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]
        group = q.shape[1] // k.shape[1]
        k_tile = cuda.shared.array((BLOCK_N, ROW), acc_t)
        v_tile = cuda.shared.array((BLOCK_N, ROW), acc_t)
        q_tile = cuda.shared.array((BLOCK_M, ROW), acc_t)
        do_tile = cuda.shared.array((BLOCK_M, ROW), acc_t)
        p_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        ds_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        lse_sh = cuda.shared.array(BLOCK_M, acc_t)
        delta_sh = cuda.shared.array(BLOCK_M, acc_t)
        if DROPOUT:  # compile-time: the plain kernel has no keep_tile and draws nothing
            keep_tile = cuda.shared.array((BLOCK_M, GROUPS), int32)
        else:
            keep_tile = lse_sh  # a stand-in argument, never read without DROPOUT

        # -- this block's K_j, V_j: loaded once, used for every Q tile of every head in the group
        load_tile(k, b, hk, k_start, BLOCK_N, k_tile, tid)
        load_tile(v, b, hk, k_start, BLOCK_N, v_tile, tid)
        cuda.syncthreads()  # k_tile and v_tile are complete before any thread reads them

        br = tid // B_COL_T
        bc = tid % B_COL_T
        dk_acc = cuda.local.array(B_TILE, acc_t)
        dv_acc = cuda.local.array(B_TILE, acc_t)
        doc = cuda.local.array(B_TC, acc_t)
        qc = cuda.local.array(B_TC, acc_t)
        dq_acc = cuda.local.array(C_TILE, acc_t)
        for e in range(B_TILE):
            dk_acc[e] = acc_t(0.0)
            dv_acc[e] = acc_t(0.0)

        # [docs:bwd-dkdv-loop]
        # causal: Q tiles wholly before the diagonal (every row < k_start - offset) see no key here
        first_tile = 0
        if causal:
            first_tile = max(0, k_start - (nk - nq)) // BLOCK_M
        n_q_tiles = (nq + BLOCK_M - 1) // BLOCK_M

        for g in range(group):
            h = hk * group + g  # query heads h of the group all read kv head hk
            for qi in range(first_tile, n_q_tiles):
                q_start = qi * BLOCK_M
                load_tile(q, b, h, q_start, BLOCK_M, q_tile, tid)
                load_tile(do, b, h, q_start, BLOCK_M, do_tile, tid)
                load_row_stats(lse, delta, b, h, q_start, lse_sh, delta_sh, tid)
                if DROPOUT:  # DROPOUT: this (Q_i, K_j) pair's keep bits, redrawn from the seed
                    draw_keep(dropout, b, h, q_start, k_start, nq, nk, causal, keep_tile, tid)
                cuda.syncthreads()  # Q_i, dO_i, lse, D (keep bits) are in shared memory before P

                p_and_ds(q_tile, k_tile, v_tile, do_tile, lse_sh, delta_sh, p_tile, ds_tile,
                         q_start, k_start, nq, nk, scale, causal, dropout, keep_tile, tid)
                cuda.syncthreads()  # all of P and dS are written before other threads read them

                # -- dV_j += P^T dO_i (DROPOUT: (P Z)^T dO_i) and dK_j += dS^T Q_i (scale
                #    applied once, at the end)
                if br < BLOCK_N:
                    for m in range(BLOCK_M):
                        for j in range(B_TC):
                            doc[j] = do_tile[m, bc + j * B_COL_T]
                            qc[j] = q_tile[m, bc + j * B_COL_T]
                        for i in range(B_TR):
                            pv = p_tile[m, br + i * B_ROW_T]
                            dsv = ds_tile[m, br + i * B_ROW_T]
                            for j in range(B_TC):
                                dv_acc[i * B_TC + j] += pv * doc[j]
                                dk_acc[i * B_TC + j] += dsv * qc[j]

                # [docs:bwd-dq-atomic]
                # -- dQ_i += scale * dS K_j, added atomically (other K/V blocks add to it too)
                if dq_atomic:
                    for e in range(C_TILE):
                        dq_acc[e] = acc_t(0.0)
                    ds_k(ds_tile, k_tile, dq_acc, tid)
                    cr = tid // C_COL_T
                    cc = tid % C_COL_T
                    if cr < BLOCK_M:
                        for i in range(C_TR):
                            row = q_start + cr + i * C_ROW_T
                            for j in range(C_TC):
                                c = cc + j * C_COL_T
                                if row < nq and c < d:
                                    cuda.atomic.add(dq_accum, (b, h, row, c),
                                                    dq_acc[i * C_TC + j] * scale)
                # [/docs:bwd-dq-atomic]
                cuda.syncthreads()  # done reading q/do/p/ds tiles before the next Q tile lands

        # -- write dK_j, dV_j once: this block owns rows k_start.. of kv head hk
        if br < BLOCK_N:
            for i in range(B_TR):
                key = k_start + br + i * B_ROW_T
                for j in range(B_TC):
                    c = bc + j * B_COL_T
                    if key < nk and c < d:
                        dk[b, hk, key, c] = dk_acc[i * B_TC + j] * scale
                        dv[b, hk, key, c] = dv_acc[i * B_TC + j]
        # [/docs:bwd-dkdv-loop]

    return backward_dkdv


@functools.lru_cache(maxsize=None)
def dq_kernel(BLOCK_M, BLOCK_N, HEAD_DIM, THREADS, dtype, DROPOUT):
    """Build ``kernel(q, k, v, do, lse, delta, dq_out, scale, causal, dropout)``: deterministic
    dQ; ``dropout`` as in :func:`dkdv_kernel`."""
    dtype = np.dtype(dtype)
    assert shared_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, DROPOUT) <= SMEM_LIMIT or on_simulator()
    acc_t = compute_type(dtype)
    ROW = HEAD_DIM + PAD
    C_COL_T, C_ROW_T, C_TR, C_TC = layout(BLOCK_M, HEAD_DIM, THREADS)    # dQ
    C_TILE = C_TR * C_TC
    GROUPS = BLOCK_N // 4
    load_tile, load_row_stats, draw_keep, p_and_ds, ds_k = tile_functions(
        BLOCK_M, BLOCK_N, HEAD_DIM, THREADS, dtype, DROPOUT)

    @cuda.jit
    def backward_dq(q, k, v, do, lse, delta, dq_out, scale, causal, dropout):
        tid = cuda.threadIdx.x
        q_start = cuda.blockIdx.x * BLOCK_M
        b = cuda.blockIdx.y
        h = cuda.blockIdx.z
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]
        hk = h // (q.shape[1] // k.shape[1])
        k_tile = cuda.shared.array((BLOCK_N, ROW), acc_t)
        v_tile = cuda.shared.array((BLOCK_N, ROW), acc_t)
        q_tile = cuda.shared.array((BLOCK_M, ROW), acc_t)
        do_tile = cuda.shared.array((BLOCK_M, ROW), acc_t)
        p_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        ds_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        lse_sh = cuda.shared.array(BLOCK_M, acc_t)
        delta_sh = cuda.shared.array(BLOCK_M, acc_t)
        if DROPOUT:  # compile-time: the plain kernel has no keep_tile and draws nothing
            keep_tile = cuda.shared.array((BLOCK_M, GROUPS), int32)
        else:
            keep_tile = lse_sh  # a stand-in argument, never read without DROPOUT

        # -- this block's Q_i, dO_i, lse, D: loaded once (the first barrier below covers them)
        load_tile(q, b, h, q_start, BLOCK_M, q_tile, tid)
        load_tile(do, b, h, q_start, BLOCK_M, do_tile, tid)
        load_row_stats(lse, delta, b, h, q_start, lse_sh, delta_sh, tid)

        n_kv_tiles = (nk + BLOCK_N - 1) // BLOCK_N
        if causal:  # stop after the last K/V tile the tile's last row can see
            last_key = min(nq, q_start + BLOCK_M) - 1 + (nk - nq)
            n_kv_tiles = min(n_kv_tiles, last_key // BLOCK_N + 1) if last_key >= 0 else 0

        dq_acc = cuda.local.array(C_TILE, acc_t)
        for e in range(C_TILE):
            dq_acc[e] = acc_t(0.0)
        # [docs:bwd-dq-loop]
        for kj in range(n_kv_tiles):
            k_start = kj * BLOCK_N
            load_tile(k, b, hk, k_start, BLOCK_N, k_tile, tid)
            load_tile(v, b, hk, k_start, BLOCK_N, v_tile, tid)
            if DROPOUT:  # DROPOUT: this (Q_i, K_j) pair's keep bits, redrawn from the seed
                draw_keep(dropout, b, h, q_start, k_start, nq, nk, causal, keep_tile, tid)
            cuda.syncthreads()  # K_j, V_j, keep bits (first time: Q_i, dO_i, lse, D) complete

            p_and_ds(q_tile, k_tile, v_tile, do_tile, lse_sh, delta_sh, p_tile, ds_tile,
                     q_start, k_start, nq, nk, scale, causal, dropout, keep_tile, tid)
            cuda.syncthreads()  # all of dS is written before other threads read it

            ds_k(ds_tile, k_tile, dq_acc, tid)  # dQ_i += dS K_j, same order every run
            cuda.syncthreads()  # done reading k_tile / ds_tile before the next K/V tile lands
        # [/docs:bwd-dq-loop]

        # -- every element of dQ_i written exactly once (0 for rows that see no key)
        cr = tid // C_COL_T
        cc = tid % C_COL_T
        if cr < BLOCK_M:
            for i in range(C_TR):
                row = q_start + cr + i * C_ROW_T
                for j in range(C_TC):
                    c = cc + j * C_COL_T
                    if row < nq and c < d:
                        dq_out[b, h, row, c] = dq_acc[i * C_TC + j] * scale

    return backward_dq


@functools.lru_cache(maxsize=None)
def preprocess_kernel(THREADS, dtype):
    """Build ``kernel(o, do, delta, dq_accum)``: ``delta = rowsum(dO * O)``, ``dq_accum = 0``."""
    acc_t = compute_type(dtype)

    @cuda.jit
    def backward_preprocess(o, do, delta, dq_accum):
        # [docs:bwd-preprocess]
        i = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        b = cuda.blockIdx.y
        h = cuda.blockIdx.z
        if i < o.shape[2]:
            acc = acc_t(0.0)
            for c in range(o.shape[3]):
                acc += acc_t(do[b, h, i, c]) * acc_t(o[b, h, i, c])
                dq_accum[b, h, i, c] = acc_t(0.0)
            delta[b, h, i] = acc
        # [/docs:bwd-preprocess]

    return backward_preprocess


@functools.lru_cache(maxsize=None)
def cast_kernel(THREADS, src_dtype, dst_dtype):
    """Build ``kernel(src, dst)``: ``dst = src`` converted, both ``[B, H, N, d]``."""

    @cuda.jit
    def backward_cast(src, dst):
        idx = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        b = cuda.blockIdx.y
        h = cuda.blockIdx.z
        d = src.shape[3]
        if idx < src.shape[2] * d:
            dst[b, h, idx // d, idx % d] = src[b, h, idx // d, idx % d]

    return backward_cast


#: the dropout specialisations the compile tier builds (padded head dim, dtype): a subset, to keep
#: the family's compile time in check (each dropout build carries Philox; ~1-4 s per arch).
#: Other head dims compile the same device code with other tile constants.
DROPOUT_CONFIGS = ((64, np.float16), (128, np.float16), (64, np.float32), (128, np.float32),
                   (64, np.float64))


def compile_configs():
    """Every backward configuration the package can launch on a GPU, for the compile tier: the
    plain kernels at the default tiles of every padded head dim and dtype, and the ``DROPOUT``
    kernels for :data:`DROPOUT_CONFIGS` only (float16/float32 at HEAD_DIM 64 and 128, float64
    at 64; the rest share their code and differ only in tile constants)."""
    dropout_set = {(hd, np.dtype(dt)) for hd, dt in DROPOUT_CONFIGS}
    for dtype in (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)):
        acc = acc_dtype(dtype)
        a4, a3 = numba_array_type(dtype, 4), numba_array_type(acc, 3)
        acc4 = numba_array_type(acc, 4)
        acc_nb = compute_type(dtype)
        f64_ok = dtype == np.float64
        no_drop = types.Tuple(())
        drop = types.Tuple((types.uint32, types.uint32, types.uint32, acc_nb))
        yield {"name": f"backward preprocess {dtype.name}",
               "kernel": preprocess_kernel(GPU_ELEM_THREADS, dtype),
               "args": (a4, a4, a3, acc4), "float64_ok": f64_ok}
        if dtype == np.float16:
            yield {"name": "backward cast float32->float16",
                   "kernel": cast_kernel(GPU_ELEM_THREADS, acc, dtype),
                   "args": (acc4, a4), "float64_ok": False}
        lse3 = numba_array_type(acc, 3)
        for hd in HEAD_DIMS:
            bm, bn, _, threads = default_tiles(hd, dtype, simulator=False)
            for dropout in (False, True) if (hd, dtype) in dropout_set else (False,):
                tag = f"M{bm} N{bn} D{hd} {dtype.name}{' dropout' if dropout else ''}"
                drop_t = drop if dropout else no_drop
                yield {"name": f"backward dkdv {tag}",
                       "kernel": dkdv_kernel(bm, bn, hd, threads, dtype, dropout),
                       "args": (a4, a4, a4, a4, lse3, a3, acc4, a4, a4, acc_nb, types.int64,
                                types.int64, drop_t),
                       "float64_ok": f64_ok}
                yield {"name": f"backward dq {tag}",
                       "kernel": dq_kernel(bm, bn, hd, threads, dtype, dropout),
                       "args": (a4, a4, a4, a4, lse3, a3, acc4, acc_nb, types.int64, drop_t),
                       "float64_ok": f64_ok}
