"""FlashAttention backward on tensor cores: the five products on ``mma.sync.m16n8k16``.

Math (as :mod:`numba_flash.kernels.backward`, the SIMT kernels)
---------------------------------------------------------------
With ``P = exp(mod(scale Q K^T) - lse)`` recomputed from the forward's ``lse``, ``D =
rowsum(dO * O)`` (the SIMT preprocess kernel) and ``Z = keep / (1 - p)`` (1 without dropout)::

    dV = (P Z)^T dO      dP = (dO V^T) Z      dS = P (dP - D) (1 - t^2)
    dK = scale dS^T Q    dQ = scale dS K

``t = tanh(s / softcap)`` (the factor is 1 without softcap; ALiBi has no gradient).  ``P`` is
the tensor-core forward's (:mod:`numba_flash.kernels.forward_mma`): without modifiers the raw
``q . k`` (float32 accumulation of the 16-bit products, ``K Q^T`` here: the same products) goes
into ``ex2(qk * scale log2(e) - lse log2(e))``, one FFMA and one ``ex2.approx``
(:func:`~numba_flash.kernels.stages.ex2`), the forward's ``exp(scale (qk - m)) / l`` with its
``lse = scale m + log l``; with softcap or ALiBi the score of
:func:`~numba_flash.kernels.visibility.make_score` (natural units) goes into ``ex2(s log2(e) -
lse log2(e))``.  A key a row does not see and a row past ``Nq`` give exactly ``P = dS = 0``.
The 16-bit operands (``DTYPE``: float16 or bfloat16, a compile-time choice through
:func:`~numba_flash.kernels.mma.mma_ops`): ``Q``, ``K``, ``V``, ``dO`` as stored; ``P Z`` and
``dS`` rounded from float32 (as flash-attn does); accumulation in float32.

Kernels
-------
1. :func:`dkdv_mma_kernel`: one block per ``(K/V tile of BLOCK_N = 16 NUM_WARPS keys, b, query
   head h)`` (a 1-D grid, :func:`numba_flash.kernels.backward.fold_grid`); each warp owns 16
   keys.  K and V are copied once (``cp.async``), then the block walks the Q tiles of
   :data:`BLOCK_M` = 16 rows that see some key of the tile
   (:func:`~numba_flash.kernels.visibility.tile_query_range`), Q and dO double-buffered (the next
   tile's copy runs under this tile's math).  Per Q tile each warp computes the *transposed*
   products, keys as rows: ``S^T = K Q^T``, ``dP^T = V dO^T`` (``A`` = its K / V rows by
   ``ldmatrix``, ``B`` = Q / dO rows by ``ldmatrix``), ``P^T`` and ``dS^T`` on the accumulator
   fragments, then ``dV += (P Z)^T dO`` and ``dK += dS^T Q`` (``A`` straight from those
   registers, ``B`` from the row-major Q / dO tiles by ``ldmatrix.trans``).  ``dK``, ``dV`` stay
   in registers and are written once, in float32, per query head; the op sums each GQA group
   and casts (``reduce_kernel``, fixed order).  With ``DQ_ATOMIC`` each warp also writes its
   ``dS^T`` as 16-bit pairs into shared memory (the very registers of the ``dK`` product), and
   after a barrier the warps split the column pairs of ``dQ_i += scale dS K_j``: ``A`` = ``dS``
   by ``ldmatrix.trans`` of the stored ``dS^T``, ``B`` = K by ``ldmatrix.trans``, then float32
   ``atomic.add`` into ``dq_accum``.  ``WANT_DV`` / ``WANT_DK`` select the outputs and ``COL0``
   / ``ACC_DIM`` the columns: at ``HEAD_DIM = 256`` both accumulators would need 256 registers
   per lane (and even one, 128, spills beside the scores), so the op runs the kernel four times
   (:func:`dkdv_passes`: each half of dV, each half of dK, dQ with the first), recomputing the
   scores in each.
2. :func:`dq_mma_kernel` (``deterministic=True``): one block per ``(Q tile of 16 NUM_WARPS rows,
   b, h)``, a warp per 16 rows, Q and dO copied once, looping over the double-buffered K/V tiles
   of :func:`dq_block_n` keys the rows see (:func:`~numba_flash.kernels.visibility.tile_key_range`)
   as the forward does: ``S = Q K^T``, ``dP = dO V^T``, ``dS`` on the fragments, ``dQ += dS K``
   (``A`` from the registers, ``B`` = K by ``ldmatrix.trans``), in a fixed order: no atomics,
   bitwise reproducible.

Full and masked tiles (one step compiled twice, as the forward's)
-----------------------------------------------------------------
A (Q tile, K/V tile) pair where every row sees every key, all rows below ``Nq`` and all keys
below ``Nk`` (:func:`full_query_rows` for the dK/dV loop,
:func:`~numba_flash.kernels.visibility.tile_full_range` for dQ's) runs the unmasked step: no
per-element visibility test, no bounds, no non-finite handling.  That is exact: a non-finite
``q`` or ``k`` of a pair a row sees has made the row's ``lse`` NaN, so its ``P``, ``dS`` are NaN
anyway, and a non-finite ``v`` or ``dO`` reaches only pairs the row sees, which is every pair of
the tile.  The other pairs run the masked step: ``P = dS = 0`` where the row does not see the key
(or lies past ``Nq``, or has ``lse = -inf``), and since a tensor core computes ``0 * inf =
NaN``, each thread zeroes the inf / NaN elements of the chunks it copied
(:func:`~numba_flash.kernels.stages.make_tile_scan`) of the operands that multiply such a zero:
``Q`` (for ``dK = dS^T Q``) and ``dO`` (``dV = P^T dO``) in the dK/dV kernel, ``K`` (``dQ = dS K``)
once, after its copy, and in the dQ kernel's masked steps.  Scores made from a zeroed value
are finite where the reference's are not, but only in rows whose ``lse`` is NaN (so ``P`` is
NaN) or for keys the row does not see (so ``P`` is 0).  A zeroed ``dO[i, c]`` (rare: the block
learns it from the scan, ``cuda.syncthreads_or`` on the step's barrier) leaves ``dS`` non-finite
through ``D_i``, and a fix-up makes ``dV[j, c]`` NaN for every key ``j`` row ``i`` sees (read
again from global memory, where it is still inf / NaN): the reference's ``P * NaN``.

Dropout: the keep bit of element ``(b, h, i, j)`` is :func:`numba_flash.philox.philox_keep`
(the mask of :func:`numba_flash.dropout_mask`), one call per element.

A user's variant (``USER``, :mod:`numba_flash.flex`; compile time, so ``USER=None`` builds the
code above and nothing else)
-------------------------------------------------------------------------------------------
``score_mod`` runs on the score of :func:`~numba_flash.kernels.visibility.make_score` (after
scale, softcap, ALiBi), as the tensor-core forward applies it, and ``P = ex2(x log2(e) - lse
log2(e))`` of that ``x``; the chain rule multiplies ``dS`` by ``score_mod_grad`` at the score
``score_mod`` received: ``dS = P (dP - D) (1 - t^2) score_mod_grad(s)`` before ``scale``.
``mask_mod`` is and-ed into the visibility of the masked step, so a build with one and no
block mask runs every tile masked.  With a block mask (:func:`~numba_flash.kernels.
visibility.make_tile_kind` on its classification) each loop visits only the tiles it does not
call EMPTY, in order, the double buffer loading the next visited tile: the dK/dV kernel's Q
tiles of its K/V tile, the dQ kernel's K/V tiles of its Q tile; a FULL tile inside the bounds
runs the unmasked step and a FULL one on a causal / window edge the masked step without
``mask_mod``.  In the simulator thread 0 of each block logs every tile pair it computes
(:func:`~numba_flash.kernels.common.log_tile`: ``(b, h, q_start, key tile)``).

Shared memory (one static ``uint32`` array, rows of ``RB = 2 HEAD_DIM + 16`` bytes, the pad
putting the 8 rows of an ``ldmatrix`` in distinct banks): dK/dV: K and V tiles (``BLOCK_N``
rows each), ``Q_STAGES`` (2, or 1 where two would pass 48 KiB: ``HEAD_DIM`` 256) stages of a Q
and a dO tile (16 rows each) and, with ``DQ_ATOMIC``, ``dS^T`` (``BLOCK_N`` rows of 16 pairs +
16 bytes); dQ: Q and dO (``16 NUM_WARPS`` rows each) and ``KV_STAGES`` stages of a K and a V tile
(:func:`dq_block_n` rows each).  :func:`shared_bytes`; at most 48 KiB for every head dim of
:data:`GPU_WARPS`.  Inputs are read as 16-bit words (``uint16`` views); with ``d == HEAD_DIM`` and
16-byte aligned tensors by ``cp.async`` (``VEC``), else by 16-bit loads with zero-padded columns.
Index arithmetic: per-thread copy offsets from one base per tile; ``lse``, ``D`` and ``dq_accum``
are flat views indexed by one unsigned 64-bit base per tile plus 32-bit offsets.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, types, uint32, uint64

from ..backend import on_simulator
from ..philox import philox_keep
from .common import HEAD_DIMS, SMEM_LIMIT, log_tile, padded_head_dim
from .jit import device_jit, kernel_jit
from .mma import MMA_DTYPES, make_a_frag_from_c, mma_ops
from .stages import (EXP_BITS, LOG2E, cp_async_commit, cp_async_wait_all, ex2, fma,
                     ldmatrix_x4, ldmatrix_x4_trans, load_u16, make_tile_copy, make_tile_scan,
                     row_bytes)
from .visibility import (BLOCK_EMPTY, BLOCK_FULL, BLOCK_PARTIAL, is_visible, make_next_tile,
                         make_score, make_tile_kind, tile_full_range, tile_key_range,
                         tile_query_range)

#: warps per block on the GPU, per padded head dim (dkdv: BLOCK_N = 16 NUM_WARPS keys; dq:
#: BLOCK_M = 16 NUM_WARPS rows, BLOCK_N = :func:`dq_block_n` keys)
GPU_WARPS = {16: 4, 32: 4, 64: 4, 128: 2, 256: 1}
#: the simulator: one warp (32 Python threads)
SIM_WARPS = 1

#: query rows per step of the dK/dV kernel (each warp's S^T: its 16 keys x 16 queries)
BLOCK_M = 16

#: head dims whose dK and dV accumulators do not fit in registers together: dkdv passes of
#: half the columns (:func:`dkdv_passes`)
SPLIT_HEAD_DIMS = (256,)


def dkdv_passes(head_dim, deterministic):
    """The dK/dV launches of one backward: ``(want_dv, want_dk, dq_atomic, col0, acc_dim)``
    each.  One pass (every output, atomic dQ unless ``deterministic``), or at a head dim of
    :data:`SPLIT_HEAD_DIMS` four, each accumulating half the columns of dV or of dK (64
    registers per lane; the first dK pass also adds dQ)."""
    if head_dim not in SPLIT_HEAD_DIMS:
        return [(True, True, not deterministic, 0, head_dim)]
    half = head_dim // 2
    return [(True, False, False, 0, half), (True, False, False, half, half),
            (False, True, not deterministic, 0, half), (False, True, False, half, half)]

__all__ = ["MMA_DTYPES", "GPU_WARPS", "SIM_WARPS", "BLOCK_M", "SPLIT_HEAD_DIMS", "dkdv_passes",
           "dq_passes", "dq_block_n",
           "shared_bytes", "default_tiles", "full_query_rows", "dkdv_mma_kernel",
           "dq_mma_kernel", "compile_configs"]


def dq_passes(head_dim):
    """``(col0, acc_dim)`` of each launch of the deterministic dQ kernel: one, or two halves at
    a head dim of :data:`SPLIT_HEAD_DIMS`."""
    if head_dim not in SPLIT_HEAD_DIMS:
        return [(0, head_dim)]
    return [(0, head_dim // 2), (head_dim // 2, head_dim // 2)]


def dq_block_n(NUM_WARPS, HEAD_DIM):
    """Keys per K/V tile of the dQ kernel: 64 up to head dim 32, 32 at 64, 16 from 128 on (two
    stages of K and V within 48 KiB) and with one warp (the simulator)."""
    if NUM_WARPS == 1 or HEAD_DIM >= 128:
        return 16
    return 64 if HEAD_DIM <= 32 else 32


def _dkdv_layout(NUM_WARPS, HEAD_DIM):
    """``(Q_STAGES, bytes)`` of the dK/dV kernel's shared memory."""
    rb = row_bytes(HEAD_DIM)
    n = 16 * NUM_WARPS
    fixed = 2 * n * rb + n * (2 * BLOCK_M + 16)      # K, V, dS^T
    stage = 2 * BLOCK_M * rb                          # Q, dO
    stages = 2 if fixed + 2 * stage <= SMEM_LIMIT else 1
    return stages, fixed + stages * stage


def _dq_layout(NUM_WARPS, HEAD_DIM):
    """``(KV_STAGES, bytes)`` of the dQ kernel's shared memory."""
    rb = row_bytes(HEAD_DIM)
    fixed = 2 * 16 * NUM_WARPS * rb                   # Q, dO
    stage = 2 * dq_block_n(NUM_WARPS, HEAD_DIM) * rb  # K, V
    stages = 2 if fixed + 2 * stage <= SMEM_LIMIT else 1
    return stages, fixed + stages * stage


def shared_bytes(NUM_WARPS, HEAD_DIM):
    """``(dkdv, dq)`` static shared memory of one block (the budget in the module docstring)."""
    return _dkdv_layout(NUM_WARPS, HEAD_DIM)[1], _dq_layout(NUM_WARPS, HEAD_DIM)[1]


def default_tiles(head_dim, simulator=None):
    """``(NUM_WARPS, HEAD_DIM)`` for a head dim ``d`` (1..256) on this backend."""
    if simulator is None:
        simulator = on_simulator()
    hd = padded_head_dim(head_dim)
    return (SIM_WARPS if simulator else GPU_WARPS[hd]), hd


def full_query_rows_py(k_start, k_end, offset, nq, nk, left, right):
    """``(r_lo, r_hi)``: the query rows that see every key of ``[k_start, k_end)`` (none unless
    ``k_end <= Nk``): ``lo(i) <= k_start`` and ``hi(i) >= k_end`` in the terms of
    :func:`~numba_flash.kernels.visibility.key_bounds`, i.e. ``k_end - 1 - right <= i + offset
    <= k_start + left`` (an unbounded side: no limit), within ``[0, Nq)``."""
    r_lo = 0
    if right >= 0:
        r_lo = max(0, k_end - 1 - right - offset)
    r_hi = nq
    if left >= 0:
        r_hi = min(nq, k_start + left - offset + 1)
    if k_end > nk:
        r_hi = r_lo
    return r_lo, max(r_lo, r_hi)


full_query_rows = device_jit(own_module=True, inline=True)(full_query_rows_py)


def _variant_args():
    """Numba types of the kernels' trailing arguments (see :func:`dkdv_mma_kernel`)."""
    return (types.float32, types.UniTuple(types.int32, 2), types.UniTuple(types.float32, 2),
            types.Array(types.float32, 2, "C"))


@functools.lru_cache(maxsize=None)
def _element_function(MASKED, DROPOUT, SOFTCAP, ALIBI, FNS=None):
    """``p_ds(s, dp, nlse2, delta_i, b, h, row, key, ..., user, umask) -> (P Z, dS)``: THE
    element-wise step of both kernels.  ``s`` raw ``q . k``, ``dp = dO . v``, ``nlse2 = -lse
    log2(e)``; ``MASKED``: ``(0, 0)`` where the row does not see the key, lies past ``Nq`` or has
    ``lse = -inf`` (and, with ``umask``, where the user's ``mask_mod`` says no).

    ``FNS``: ``None`` or a user's ``(score_mod, mask_mod, score_mod_grad)`` (CUDA device
    functions or None; their aux arrays are ``user[1:]``).  The score is then the forward's
    (:mod:`numba_flash.kernels.forward_mma`): ``x = score_mod(mod(scale qk))`` in natural units,
    ``P = ex2(x log2(e) - lse log2(e))``, and ``dS`` is multiplied by ``score_mod_grad`` at the
    score ``score_mod`` received (the chain rule, beside the softcap's ``1 - t^2``)."""
    user_score, user_mask, user_grad = FNS if FNS is not None else (None, None, None)
    SCORE_MOD = user_score is not None
    MASK_MOD = user_mask is not None
    MODS = SOFTCAP or ALIBI or SCORE_MOD   # the score in natural units (make_score)
    GRAD = SOFTCAP or SCORE_MOD            # dS has a factor d x / d (scale qk)
    score = make_score(SOFTCAP, ALIBI, float32)  # the forward's score, so P is the forward's
    ZERO = float32(0.0)
    INF = float32(math.inf)   # nlse2 of a row with lse = -inf (it sees no key)
    LOG2E_F = float32(LOG2E)

    @device_jit(own_module=True, inline=True)
    def p_ds(s, dp, nlse2, delta_i, exp_scale, b, h, row, key, nq, nk, offset, left, right,
             scale, softcap, inv_softcap, slope, dropout, user, umask):
        if MASKED:
            if not (row < nq and nlse2 != INF
                    and is_visible(row, key, offset, nk, left, right)):
                return ZERO, ZERO
            if MASK_MOD and umask and not user_mask(b, h, row, key, *user[1:]):
                return ZERO, ZERO  # the user's mask_mod (a PARTIAL tile, or no block mask)
        if MODS:
            x, grad = score(s, scale, row, key, offset, softcap, inv_softcap, slope)
            if SCORE_MOD:  # the user's score_mod after scale / softcap / ALiBi, as the forward
                # (float32 whatever the user's code returns: a Python float would be float64)
                grad = grad * float32(user_grad(x, b, h, row, key, *user[1:]))
                x = float32(user_score(x, b, h, row, key, *user[1:]))
            p = ex2(fma(x, LOG2E_F, nlse2))
        else:
            p = ex2(fma(s, exp_scale, nlse2))         # exp(scale qk - lse): FFMA + MUFU.EX2
        if DROPOUT:
            seed_lo, seed_hi, threshold, keep_scale = dropout
            z = keep_scale if philox_keep(seed_lo, seed_hi, b, h, row, key, threshold) else ZERO
            pz = p * z
            ds = p * (dp * z - delta_i)
        else:
            pz = p
            ds = p * (dp - delta_i)
        if GRAD:
            ds = ds * grad
        return pz, ds

    return p_ds


def _user_parts(USER):
    """``(FNS, MASK_MOD, BLOCKS)`` of a backward ``USER = (score_mod, mask_mod,
    score_mod_grad, BLOCKS)`` (None: ``(None, False, None)``)."""
    if USER is None:
        return None, False, None
    return tuple(USER[:3]), USER[1] is not None, USER[3]


@device_jit(own_module=True, inline=True)
def _lane_offsets(lane, RB, RB2):
    """Byte offsets of this lane's ``ldmatrix`` row (:func:`~numba_flash.kernels.stages.
    ldmatrix_rows`) in a tile of ``RB``-byte rows: ``a`` (an ``A`` fragment; also ``bt``, a
    ``B`` by ``.trans``), ``b`` (the ``B`` fragments of two 8-row blocks; also ``at``: an ``A``
    by ``.trans`` of the stored ``A^T``), and ``b`` in a tile of ``RB2``-byte rows."""
    mat = lane >> 3
    r8 = lane & 7
    off_a = (r8 + 8 * (mat & 1)) * RB + 16 * (mat >> 1)
    off_b = (r8 + 8 * (mat >> 1)) * RB + 16 * (mat & 1)
    off_b2 = (r8 + 8 * (mat >> 1)) * RB2 + 16 * (mat & 1)
    return int32(off_a), int32(off_b), int32(off_b2)


@functools.lru_cache(maxsize=None)
def dkdv_mma_kernel(NUM_WARPS, HEAD_DIM, DROPOUT=False, SOFTCAP=False, ALIBI=False,
                    WANT_DV=True, WANT_DK=True, DQ_ATOMIC=True, VEC=True, DTYPE="float16",
                    COL0=0, ACC_DIM=None, USER=None):
    """Build ``kernel(q, k, v, do, lse, delta, dq_accum, dk_out, dv_out, scale, window, mods,
    alibi, tiles, dropout, user)``.

    ``q, k, v, do``: uint16 views of the ``DTYPE`` (``"float16"`` / ``"bfloat16"``) ``[B, H(kv),
    N, d]`` (C-contiguous); ``lse``, ``delta``: flat float32 views of ``[B, H, Nq]``;
    ``dq_accum``: the flat float32 view of ``[B, H, Nq, d]`` (atomics, with ``DQ_ATOMIC``);
    ``dk_out``, ``dv_out``: flat float32 views of ``[B, H, Nk, d]`` (this query head's share,
    dK times ``scale``); ``scale`` float32; ``window`` ``(left, right)`` int32; ``mods`` ``(softcap,
    1/softcap)`` float32; ``alibi`` float32 ``[B, H]``; ``tiles`` = ceil(Nk / BLOCK_N);
    ``dropout`` ``()`` or ``(seed_lo, seed_hi, threshold, keep_scale)``.  ``VEC``: ``d ==
    HEAD_DIM`` and 16-byte aligned inputs (``cp.async``); else 16-bit loads.  ``COL0``,
    ``ACC_DIM`` (default ``HEAD_DIM``): the block accumulates and writes only the dK / dV
    columns ``COL0 .. COL0 + ACC_DIM - 1`` (:func:`dkdv_passes`: at ``HEAD_DIM`` 256 each pass
    keeps 64 accumulator registers per lane), the scores still over all of ``HEAD_DIM``.

    ``USER``: ``None``, or a user's variant (:mod:`numba_flash.flex`) as ``(score_mod,
    mask_mod, score_mod_grad, BLOCKS)``: CUDA device functions or None, and ``(Q_BLOCK,
    KV_BLOCK)`` of a block mask or None.  Then ``user = (kinds,) + aux_tensors`` (``kinds``
    read only with ``BLOCKS``); without it ``user = ()`` adds no parameter and no instruction.
    A Q tile the block mask calls EMPTY for this K/V tile is never loaded; ``mask_mod`` runs on
    the PARTIAL ones (on every tile without a block mask), ``score_mod`` / ``score_mod_grad``
    on every pair a row sees (:func:`_element_function`), only for rows ``< Nq`` and keys
    ``< Nk``.
    """
    assert DTYPE in MMA_DTYPES and HEAD_DIM % 16 == 0
    FNS, MASK_MOD, BLOCKS = _user_parts(USER)
    user_mask = USER[1] if MASK_MOD else None
    LOG = on_simulator() and USER is not None  # the simulator's tile log (common.TILE_LOG)
    mma, _pack2 = mma_ops(DTYPE)
    a_frag_from_c = make_a_frag_from_c(DTYPE)
    EXP_MASK = EXP_BITS[DTYPE]
    BLOCK_N = 16 * NUM_WARPS
    THREADS = 32 * NUM_WARPS
    RB = row_bytes(HEAD_DIM)
    DS_RB = 2 * BLOCK_M + 16        # a dS^T row: 16 queries of 16 bits, + 16 against conflicts
    Q_STAGES, SMEM_BYTES = _dkdv_layout(NUM_WARPS, HEAD_DIM)
    SMEM_WORDS = SMEM_BYTES // 4
    K_BYTE = 0
    V_BYTE = BLOCK_N * RB
    DS_BYTE = 2 * BLOCK_N * RB
    QS_BYTE = DS_BYTE + BLOCK_N * DS_RB
    STAGE_BYTES = 2 * BLOCK_M * RB  # one stage: Q, then dO
    DO_OFF = BLOCK_M * RB
    D_FRAGS = HEAD_DIM // 8
    D_PAIRS = D_FRAGS // 2
    ACC_DIM = HEAD_DIM if ACC_DIM is None else ACC_DIM
    assert COL0 % 16 == 0 and ACC_DIM % 16 == 0 and COL0 + ACC_DIM <= HEAD_DIM
    A_FRAGS = ACC_DIM // 8          # dK / dV fragments this block accumulates
    A_PAIRS = A_FRAGS // 2
    P0 = COL0 // 16                 # its first column pair
    K_STEPS = HEAD_DIM // 16
    P_STEPS = BLOCK_N // 16         # k-steps of dQ = dS K (16 keys each)
    PAIRS_PER_WARP = -(-D_PAIRS // NUM_WARPS)
    EXACT_PAIRS = D_PAIRS % NUM_WARPS == 0
    # dS's A fragments for dQ held across the warp's column pairs (2 or fewer), else read per
    # pair (at HEAD_DIM 128 with dK and dV in registers the 8 more registers spilled on sm_80)
    DA_ONCE = PAIRS_PER_WARP <= 2
    NEED_DS = WANT_DK or DQ_ATOMIC
    ZERO = float32(0.0)
    NAN = float32(math.nan)
    NEG_INF = float32(-math.inf)
    LOG2E_F = float32(LOG2E)
    copy_kv = make_tile_copy(BLOCK_N, HEAD_DIM, RB, THREADS, VEC)
    copy_q = make_tile_copy(BLOCK_M, HEAD_DIM, RB, THREADS, VEC)
    scan_k = make_tile_scan(BLOCK_N, HEAD_DIM, RB, THREADS, DTYPE)
    scan_q = make_tile_scan(BLOCK_M, HEAD_DIM, RB, THREADS, DTYPE)

    @device_jit(own_module=True, inline=True)
    def load_q(smem, stage_byte, q, do, qo_base, q_start, nq, d, tid):
        """Issue the copies of Q and dO rows ``q_start ..`` into the stage at ``stage_byte``."""
        rows = min(BLOCK_M, nq - q_start)
        base = qo_base + q_start * d
        copy_q(smem, stage_byte, q, base, rows, d, tid)
        copy_q(smem, stage_byte + DO_OFF, do, base, rows, d, tid)

    @device_jit(own_module=True, inline=True)
    def sees(b, h, row, key, offset, nk, left, right, user, umask):
        """Row ``row`` (< Nq) sees key ``key``: the visibility rule and, with ``umask``, the
        user's mask_mod (called only for keys < Nk)."""
        if not is_visible(row, key, offset, nk, left, right):
            return False
        if MASK_MOD and umask:
            return user_mask(b, h, row, key, *user[1:])
        return True

    # the block mask's verdict on (Q tile of BLOCK_M rows, this K/V tile), visibility.py
    tile_kind = make_tile_kind(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None

    @device_jit(own_module=True, inline=True)
    def next_q_tile(kinds, b, h, qt, t_hi, kt, nq, nk):
        """The first Q tile ``>= qt`` the block mask does not call EMPTY (``t_hi`` if none)."""
        while qt < t_hi and tile_kind(kinds, b, h, qt * BLOCK_M, min(qt * BLOCK_M + BLOCK_M, nq),
                                      kt, nk) == BLOCK_EMPTY:
            qt += 1
        return qt

    def make_step(MASKED):
        p_ds = _element_function(MASKED, DROPOUT, SOFTCAP, ALIBI, FNS)

        @device_jit(own_module=True, inline=True)
        def step(qt, qt_next, stage, t_hi, smem, ins, frags, lanes, keys, sc, drop, user,
                 umask):
            q, do, lse, delta, dq_accum, qo_base, row_base, nq, nk, d, b, h = ins
            st, dpt, dk_acc, dv_acc, nlse2, dl, da = frags
            tid, warp, g, t, off_a, off_b, off_ds = lanes
            key0, key1, offset, left, right = keys
            scale, exp_scale, softcap, inv_softcap, slope = sc
            dropout = drop
            q_start = qt * BLOCK_M
            qb = QS_BYTE + (stage * STAGE_BYTES if Q_STAGES == 2 else 0)
            # -- lse (as -lse log2 e) and D of the lane's 4 queries 8 f + 2 t + j
            tile_row = row_base + uint64(q_start)
            for f in range(2):
                for j in range(2):
                    m = 8 * f + 2 * t + j
                    i = 2 * f + j
                    if MASKED and q_start + m >= nq:
                        nlse2[i] = -NEG_INF
                        dl[i] = ZERO
                    else:
                        nlse2[i] = -(lse[tile_row + uint64(m)] * LOG2E_F)
                        dl[i] = delta[tile_row + uint64(m)]
            cp_async_wait_all()
            do_bad = 0
            if MASKED:
                # 0 * inf = NaN on the tensor cores: each thread zeroes the inf / NaN elements of
                # the Q and dO chunks it copied; the barrier publishes them, and whether dO had any
                scan_q(smem, qb, tid)
                do_bad = cuda.syncthreads_or(1 if scan_q(smem, qb + DO_OFF, tid) else 0)
            else:
                cuda.syncthreads()  # Q/dO tile qt landed for all; all warps are done with qt - 1
            # the next tile's first row: q_start + BLOCK_M without a block mask (the plain
            # build's very expression, once the compiler folds (qt + 1 - qt))
            next_start = q_start + (qt_next - qt) * BLOCK_M
            if Q_STAGES == 2 and qt_next < t_hi:  # the next Q tile's copy runs under this math
                load_q(smem, QS_BYTE + STAGE_BYTES - (qb - QS_BYTE), q, do, qo_base,
                       next_start, nq, d, tid)
                cp_async_commit()

            # -- S^T = K Q^T and dP^T = V dO^T: keys as rows, 2 fragments of 8 queries; A = the
            # warp's K / V rows, B = Q / dO rows (ldmatrix, two 8-query fragments per x4)
            for n in range(2):
                for e in range(4):
                    st[n, e] = ZERO
                    dpt[n, e] = ZERO
            for kc in range(K_STEPS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, K_BYTE + 16 * RB * warp + off_a + 32 * kc)
                b0, b1, b2, b3 = ldmatrix_x4(smem, qb + off_b + 32 * kc)
                st[0, 0], st[0, 1], st[0, 2], st[0, 3] = mma(
                    a0, a1, a2, a3, b0, b1, st[0, 0], st[0, 1], st[0, 2], st[0, 3])
                st[1, 0], st[1, 1], st[1, 2], st[1, 3] = mma(
                    a0, a1, a2, a3, b2, b3, st[1, 0], st[1, 1], st[1, 2], st[1, 3])
                if NEED_DS:
                    a0, a1, a2, a3 = ldmatrix_x4(smem, V_BYTE + 16 * RB * warp + off_a + 32 * kc)
                    b0, b1, b2, b3 = ldmatrix_x4(smem, qb + DO_OFF + off_b + 32 * kc)
                    dpt[0, 0], dpt[0, 1], dpt[0, 2], dpt[0, 3] = mma(
                        a0, a1, a2, a3, b0, b1, dpt[0, 0], dpt[0, 1], dpt[0, 2], dpt[0, 3])
                    dpt[1, 0], dpt[1, 1], dpt[1, 2], dpt[1, 3] = mma(
                        a0, a1, a2, a3, b2, b3, dpt[1, 0], dpt[1, 1], dpt[1, 2], dpt[1, 3])

            # -- P^T Z and dS^T element by element (query 8 n + 2 t + (e & 1), key key0 / key1)
            for n in range(2):
                for e in range(4):
                    i = 2 * n + (e & 1)
                    pz, ds = p_ds(st[n, e], dpt[n, e], nlse2[i], dl[i], exp_scale, b, h,
                                  q_start + 8 * n + 2 * t + (e & 1), key0 if e < 2 else key1,
                                  nq, nk, offset, left, right, scale, softcap, inv_softcap,
                                  slope, dropout, user, umask)
                    st[n, e] = pz
                    dpt[n, e] = ds

            # -- dV += (P Z)^T dO and dK += dS^T Q: A from the registers, B = dO / Q by
            # ldmatrix.trans from their row-major tiles (two 8-column fragments per x4)
            if WANT_DV:
                a0, a1, a2, a3 = a_frag_from_c(st, 0, 1)
                for p in range(A_PAIRS):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, qb + DO_OFF + off_a + 32 * (P0 + p))
                    n = 2 * p
                    dv_acc[n, 0], dv_acc[n, 1], dv_acc[n, 2], dv_acc[n, 3] = mma(
                        a0, a1, a2, a3, b0, b1, dv_acc[n, 0], dv_acc[n, 1], dv_acc[n, 2],
                        dv_acc[n, 3])
                    n = 2 * p + 1
                    dv_acc[n, 0], dv_acc[n, 1], dv_acc[n, 2], dv_acc[n, 3] = mma(
                        a0, a1, a2, a3, b2, b3, dv_acc[n, 0], dv_acc[n, 1], dv_acc[n, 2],
                        dv_acc[n, 3])
                if MASKED and do_bad:
                    # -- rare: a non-finite dO[i, c] (zeroed in the tile) makes dV[j, c] NaN for
                    # every key j row i sees (the reference's P * NaN); read from global memory.
                    # Bit 2 n + e of bad0 / bad1: column 8 n + 2 t + e for key0 / key1 (bits,
                    # not array indices, in the runtime loop: dv_acc stays in registers)
                    bad0 = uint64(0)
                    bad1 = uint64(0)
                    for r in range(min(BLOCK_M, nq - q_start)):
                        row = q_start + r
                        sees0 = sees(b, h, row, key0, offset, nk, left, right, user, umask)
                        sees1 = sees(b, h, row, key1, offset, nk, left, right, user, umask)
                        if sees0 or sees1:
                            for n in range(A_FRAGS):
                                for e in range(2):
                                    c = COL0 + 8 * n + 2 * t + e
                                    x = uint32(load_u16(do, qo_base + row * d + c)) if c < d \
                                        else uint32(0)
                                    if (x & EXP_MASK) == EXP_MASK:
                                        bit = uint64(1) << uint64(2 * n + e)
                                        if sees0:
                                            bad0 |= bit
                                        if sees1:
                                            bad1 |= bit
                    for n in range(A_FRAGS):
                        for e in range(2):
                            if (bad0 >> uint64(2 * n + e)) & uint64(1):
                                dv_acc[n, e] = NAN
                            if (bad1 >> uint64(2 * n + e)) & uint64(1):
                                dv_acc[n, 2 + e] = NAN
            if NEED_DS:
                a0, a1, a2, a3 = a_frag_from_c(dpt, 0, 1)
                if WANT_DK:
                    for p in range(A_PAIRS):
                        b0, b1, b2, b3 = ldmatrix_x4_trans(smem, qb + off_a + 32 * (P0 + p))
                        n = 2 * p
                        dk_acc[n, 0], dk_acc[n, 1], dk_acc[n, 2], dk_acc[n, 3] = mma(
                            a0, a1, a2, a3, b0, b1, dk_acc[n, 0], dk_acc[n, 1], dk_acc[n, 2],
                            dk_acc[n, 3])
                        n = 2 * p + 1
                        dk_acc[n, 0], dk_acc[n, 1], dk_acc[n, 2], dk_acc[n, 3] = mma(
                            a0, a1, a2, a3, b2, b3, dk_acc[n, 0], dk_acc[n, 1], dk_acc[n, 2],
                            dk_acc[n, 3])
                if DQ_ATOMIC:
                    # dS^T as 16-bit pairs, keys as rows: the registers a0..a3 are rows key0 /
                    # key0 + 8, queries 2t, 2t+1 (a0, a1) and 8 + 2t, 9 + 2t (a2, a3)
                    w = (DS_BYTE + (16 * warp + g) * DS_RB) // 4 + t
                    smem[w] = a0
                    smem[w + 2 * DS_RB] = a1
                    smem[w + 4] = a2
                    smem[w + 2 * DS_RB + 4] = a3
            if DQ_ATOMIC or Q_STAGES == 1:
                cuda.syncthreads()  # dS^T complete for every warp; all are done with Q/dO of qt
            if Q_STAGES == 1 and qt_next < t_hi:   # one stage: the next copy after the barrier
                load_q(smem, QS_BYTE, q, do, qo_base, next_start, nq, d, tid)
                cp_async_commit()

            if DQ_ATOMIC:
                # -- dQ_i += scale dS K_j: A = dS by ldmatrix.trans of dS^T, B = K by
                # ldmatrix.trans; the warps split dQ's column pairs
                if DA_ONCE:
                    for kk in range(P_STEPS):
                        da[kk, 0], da[kk, 1], da[kk, 2], da[kk, 3] = ldmatrix_x4_trans(
                            smem, DS_BYTE + off_ds + 16 * DS_RB * kk)
                dq_tile = tile_row * uint64(d)
                for i in range(PAIRS_PER_WARP):
                    p = warp + i * NUM_WARPS
                    if EXACT_PAIRS or p < D_PAIRS:
                        c0 = ZERO
                        c1 = ZERO
                        c2 = ZERO
                        c3 = ZERO
                        c4 = ZERO
                        c5 = ZERO
                        c6 = ZERO
                        c7 = ZERO
                        for kk in range(P_STEPS):
                            if not DA_ONCE:  # read again per pair: fewer live registers
                                da[kk, 0], da[kk, 1], da[kk, 2], da[kk, 3] = ldmatrix_x4_trans(
                                    smem, DS_BYTE + off_ds + 16 * DS_RB * kk)
                            b0, b1, b2, b3 = ldmatrix_x4_trans(
                                smem, K_BYTE + off_a + 16 * RB * kk + 32 * p)
                            c0, c1, c2, c3 = mma(da[kk, 0], da[kk, 1], da[kk, 2], da[kk, 3],
                                                 b0, b1, c0, c1, c2, c3)
                            c4, c5, c6, c7 = mma(da[kk, 0], da[kk, 1], da[kk, 2], da[kk, 3],
                                                 b2, b3, c4, c5, c6, c7)
                        col = 16 * p + 2 * t
                        for r in range(2):
                            m = g + 8 * r
                            if not MASKED or q_start + m < nq:
                                base = dq_tile + uint64(uint32(m * d + col))
                                if VEC or col < d:
                                    cuda.atomic.add(dq_accum, base, (c0 if r == 0 else c2) * scale)
                                if VEC or col + 1 < d:
                                    cuda.atomic.add(dq_accum, base + uint64(1),
                                                    (c1 if r == 0 else c3) * scale)
                                if VEC or col + 8 < d:
                                    cuda.atomic.add(dq_accum, base + uint64(8),
                                                    (c4 if r == 0 else c6) * scale)
                                if VEC or col + 9 < d:
                                    cuda.atomic.add(dq_accum, base + uint64(9),
                                                    (c5 if r == 0 else c7) * scale)

        return step

    step_masked = make_step(True)
    step_full = make_step(False)

    # a user's functions stay out of the on-disk kernel cache (their code is not in this
    # package's sources, which key it): such a build is compiled in each process
    @kernel_jit(cache=USER is None)
    def backward_dkdv_mma(q, k, v, do, lse, delta, dq_accum, dk_out, dv_out, scale, window,
                          mods, alibi, tiles, dropout, user):
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        n_heads = q.shape[1]
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]
        bx = cuda.blockIdx.x
        bh = bx // tiles
        b = bh // n_heads
        h = bh % n_heads
        hk = h // (n_heads // k.shape[1])
        kt = bx % tiles                    # this block's K/V tile
        k_start = kt * BLOCK_N
        k_end = min(k_start + BLOCK_N, nk)
        offset = nk - nq
        left, right = window
        softcap, inv_softcap = mods
        slope = ZERO
        if ALIBI:
            slope = alibi[b, h]
        exp_scale = scale * LOG2E_F
        key0 = k_start + 16 * warp + g     # the lane's two keys (rows of S^T)
        key1 = key0 + 8

        smem = cuda.shared.array(SMEM_WORDS, uint32)
        st = cuda.local.array((2, 4), float32)      # S^T, then P^T Z (keys x 16 queries)
        dpt = cuda.local.array((2, 4), float32)     # dP^T, then dS^T
        dk_acc = cuda.local.array((A_FRAGS, 4), float32)
        dv_acc = cuda.local.array((A_FRAGS, 4), float32)
        nlse2 = cuda.local.array(4, float32)        # -lse log2 e of the lane's 4 queries
        dl = cuda.local.array(4, float32)           # D of the lane's 4 queries
        da = cuda.local.array((P_STEPS, 4), uint32)  # dQ's A fragments (dS)
        for n in range(A_FRAGS):
            for e in range(4):
                dk_acc[n, e] = ZERO
                dv_acc[n, e] = ZERO

        off_a, off_b, off_ds = _lane_offsets(lane, RB, DS_RB)
        q_lo, q_hi = tile_query_range(k_start, k_end, offset, nq, left, right)
        r_lo, r_hi = full_query_rows(k_start, k_start + BLOCK_N, offset, nq, nk, left, right)
        t_lo = int32(q_lo // BLOCK_M)
        t_hi = int32((q_hi + BLOCK_M - 1) // BLOCK_M)
        f_lo = int32(min(max((r_lo + BLOCK_M - 1) // BLOCK_M, t_lo), t_hi))
        f_hi = int32(min(max(r_hi // BLOCK_M, f_lo), t_hi))  # unmasked Q tiles: [f_lo, f_hi)

        # -- prologue: K and V (K's inf / NaN zeroed: it multiplies dS = 0 in dQ), the first Q
        # tile into stage 0
        kv_base = ((b * k.shape[1] + hk) * nk + k_start) * d
        qo_base = (b * n_heads + h) * nq * d
        copy_kv(smem, K_BYTE, k, kv_base, k_end - k_start, d, tid)
        copy_kv(smem, V_BYTE, v, kv_base, k_end - k_start, d, tid)
        qt0 = t_lo
        if BLOCKS is not None:  # a block mask: EMPTY Q tiles are never loaded
            qt0 = next_q_tile(user[0], b, h, t_lo, t_hi, kt, nq, nk)
        if qt0 < t_hi:
            load_q(smem, QS_BYTE, q, do, qo_base, qt0 * BLOCK_M, nq, d, tid)
        cp_async_commit()
        cp_async_wait_all()
        if DQ_ATOMIC:
            scan_k(smem, K_BYTE, tid)   # this thread's own chunks: no barrier before

        # (b, h) as a uint32: the grid has < 2**31 blocks, and a 32-bit value is one register
        ins = (q, do, lse, delta, dq_accum, qo_base, uint64(uint32(bh)) * uint64(nq), nq,
               nk, d, b, h)
        frags = (st, dpt, dk_acc, dv_acc, nlse2, dl, da)
        lanes = (tid, warp, g, t, off_a, off_b, off_ds)
        keys = (key0, key1, offset, left, right)
        sc = (scale, exp_scale, softcap, inv_softcap, slope)
        if BLOCKS is None:
            for qt in range(t_lo, t_hi):
                if LOG and tid == 0:
                    log_tile(b, h, qt * BLOCK_M, kt)
                stage = (qt - t_lo) & 1
                # every row sees every key of the tile (and no mask_mod to ask): no mask
                if f_lo <= qt and qt < f_hi and not MASK_MOD:
                    step_full(qt, qt + 1, stage, t_hi, smem, ins, frags, lanes, keys, sc,
                              dropout, user, False)
                else:
                    step_masked(qt, qt + 1, stage, t_hi, smem, ins, frags, lanes, keys, sc,
                                dropout, user, True)
        else:  # the Q tiles the block mask does not call EMPTY, in order
            qt = qt0
            stage = 0
            while qt < t_hi:
                if LOG and tid == 0:
                    log_tile(b, h, qt * BLOCK_M, kt)
                kind = tile_kind(user[0], b, h, qt * BLOCK_M, min(qt * BLOCK_M + BLOCK_M, nq),
                                 kt, nk)
                qt_next = next_q_tile(user[0], b, h, qt + 1, t_hi, kt, nq, nk)
                if f_lo <= qt and qt < f_hi and kind == BLOCK_FULL:  # FULL, inside the bounds
                    step_full(qt, qt_next, stage, t_hi, smem, ins, frags, lanes, keys, sc,
                              dropout, user, False)
                else:
                    step_masked(qt, qt_next, stage, t_hi, smem, ins, frags, lanes, keys, sc,
                                dropout, user, kind == BLOCK_PARTIAL)
                qt = qt_next
                stage ^= 1

        # -- this query head's dK (times scale) and dV, in float32 (flat: one base per key, so
        # the unrolled stores keep the accumulators in registers)
        for r in range(2):
            key = key0 + 8 * r
            if key < nk:
                base = ((uint64(uint32(bh)) * uint64(nk) + uint64(key)) * uint64(d)
                        + uint64(COL0 + 2 * t))
                for n in range(A_FRAGS):
                    for e in range(2):
                        if VEC or COL0 + 8 * n + 2 * t + e < d:
                            if WANT_DK:
                                dk_out[base + uint64(8 * n + e)] = dk_acc[n, 2 * r + e] * scale
                            if WANT_DV:
                                dv_out[base + uint64(8 * n + e)] = dv_acc[n, 2 * r + e]

    return backward_dkdv_mma


@functools.lru_cache(maxsize=None)
def dq_mma_kernel(NUM_WARPS, HEAD_DIM, DROPOUT=False, SOFTCAP=False, ALIBI=False, VEC=True,
                  DTYPE="float16", COL0=0, ACC_DIM=None, USER=None):
    """Build ``kernel(q, k, v, do, lse, delta, dq_accum, scale, window, mods, alibi, tiles,
    dropout, user)``: ``dq_accum = scale * dS K`` (float32, its flat view) without atomics
    (``deterministic=True``); arguments as :func:`dkdv_mma_kernel`, ``tiles = ceil(Nq /
    BLOCK_M)``.  ``COL0``, ``ACC_DIM``: only dQ's columns ``COL0 .. COL0 + ACC_DIM - 1``
    (:func:`dq_passes`: halves at ``HEAD_DIM`` 256, where 128 accumulators spill).  ``USER``
    as in :func:`dkdv_mma_kernel`: a K/V tile the block mask calls EMPTY for this Q tile is
    never loaded, a FULL one skips ``mask_mod``."""
    assert DTYPE in MMA_DTYPES and HEAD_DIM % 16 == 0
    FNS, MASK_MOD, BLOCKS = _user_parts(USER)
    LOG = on_simulator() and USER is not None  # the simulator's tile log (common.TILE_LOG)
    mma, _pack2 = mma_ops(DTYPE)
    a_frag_from_c = make_a_frag_from_c(DTYPE)
    BLOCK_M_DQ = 16 * NUM_WARPS
    BLOCK_N = dq_block_n(NUM_WARPS, HEAD_DIM)
    THREADS = 32 * NUM_WARPS
    RB = row_bytes(HEAD_DIM)
    KV_STAGES, SMEM_BYTES = _dq_layout(NUM_WARPS, HEAD_DIM)
    SMEM_WORDS = SMEM_BYTES // 4
    Q_BYTE = 0
    DO_BYTE = BLOCK_M_DQ * RB
    KV_BYTE = 2 * BLOCK_M_DQ * RB
    KV_TILE = BLOCK_N * RB
    STAGE_BYTES = 2 * KV_TILE       # one stage: K, then V
    ACC_DIM = HEAD_DIM if ACC_DIM is None else ACC_DIM
    assert COL0 % 16 == 0 and ACC_DIM % 16 == 0 and COL0 + ACC_DIM <= HEAD_DIM
    D_FRAGS = ACC_DIM // 8          # dQ fragments this block accumulates
    P0 = COL0 // 16                 # its first column pair
    K_STEPS = HEAD_DIM // 16
    N_FRAGS = BLOCK_N // 8
    P_STEPS = BLOCK_N // 16
    ZERO = float32(0.0)
    NEG_INF = float32(-math.inf)
    LOG2E_F = float32(LOG2E)
    copy_q = make_tile_copy(BLOCK_M_DQ, HEAD_DIM, RB, THREADS, VEC)
    copy_kv = make_tile_copy(BLOCK_N, HEAD_DIM, RB, THREADS, VEC)
    scan_k = make_tile_scan(BLOCK_N, HEAD_DIM, RB, THREADS, DTYPE)

    @device_jit(own_module=True, inline=True)
    def load_kv(smem, stage_byte, k, v, kv_base, k_start, nk, d, tid):
        """Issue the copies of K/V rows ``k_start ..`` into the stage at ``stage_byte``."""
        rows = min(BLOCK_N, nk - k_start)
        base = kv_base + k_start * d
        copy_kv(smem, stage_byte, k, base, rows, d, tid)
        copy_kv(smem, stage_byte + KV_TILE, v, base, rows, d, tid)

    # the block mask's verdict on (this Q tile, K/V tile kt), visibility.py
    tile_kind = make_tile_kind(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None

    next_kv_tile = make_next_tile(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None

    def make_step(MASKED):
        p_ds = _element_function(MASKED, DROPOUT, SOFTCAP, ALIBI, FNS)

        @device_jit(own_module=True, inline=True)
        def step(kt, kt_next, stage, t_hi, smem, ins, frags, lanes, rows, sc, drop, user,
                 umask):
            k, v, kv_base, nq, nk, d, b, h = ins
            s, dp, acc = frags
            tid, warp, t, off_a, off_b = lanes
            row0, nlse0, nlse1, delta0, delta1, offset, left, right = rows
            scale, exp_scale, softcap, inv_softcap, slope = sc
            k_start = kt * BLOCK_N
            kb = KV_BYTE + (stage * STAGE_BYTES if KV_STAGES == 2 else 0)
            # the next tile's first key: k_start + BLOCK_N without a block mask (the plain
            # build's very expression, once the compiler folds (kt + 1 - kt))
            next_start = k_start + (kt_next - kt) * BLOCK_N
            cp_async_wait_all()
            if MASKED:
                scan_k(smem, kb, tid)  # K's inf / NaN -> 0: it multiplies dS = 0 in dQ
            cuda.syncthreads()  # tile kt landed for all threads; all warps are done with kt - 1
            if KV_STAGES == 2 and kt_next < t_hi:  # the next tile's copy runs under this math
                load_kv(smem, KV_BYTE + STAGE_BYTES - (kb - KV_BYTE), k, v, kv_base,
                        next_start, nk, d, tid)
                cp_async_commit()

            # -- S = Q K^T and dP = dO V^T (queries as rows, as the forward): A = the warp's Q /
            # dO rows, B = K / V rows (ldmatrix, two 8-key fragments per x4)
            for n in range(N_FRAGS):
                for e in range(4):
                    s[n, e] = ZERO
                    dp[n, e] = ZERO
            for kc in range(K_STEPS):
                a0, a1, a2, a3 = ldmatrix_x4(smem, Q_BYTE + 16 * RB * warp + off_a + 32 * kc)
                e0, e1, e2, e3 = ldmatrix_x4(smem, DO_BYTE + 16 * RB * warp + off_a + 32 * kc)
                for p in range(N_FRAGS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, kb + off_b + 16 * RB * p + 32 * kc)
                    n = 2 * p
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma(
                        a0, a1, a2, a3, b0, b1, s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                    n = 2 * p + 1
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma(
                        a0, a1, a2, a3, b2, b3, s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                    b0, b1, b2, b3 = ldmatrix_x4(smem, kb + KV_TILE + off_b + 16 * RB * p
                                                 + 32 * kc)
                    n = 2 * p
                    dp[n, 0], dp[n, 1], dp[n, 2], dp[n, 3] = mma(
                        e0, e1, e2, e3, b0, b1, dp[n, 0], dp[n, 1], dp[n, 2], dp[n, 3])
                    n = 2 * p + 1
                    dp[n, 0], dp[n, 1], dp[n, 2], dp[n, 3] = mma(
                        e0, e1, e2, e3, b2, b3, dp[n, 0], dp[n, 1], dp[n, 2], dp[n, 3])

            # -- dS element by element (row row0 / row0 + 8, key k_start + 8 n + 2 t + (e & 1))
            for n in range(N_FRAGS):
                for e in range(4):
                    hi = e >= 2
                    _pz, ds = p_ds(s[n, e], dp[n, e], nlse1 if hi else nlse0,
                                   delta1 if hi else delta0, exp_scale, b, h,
                                   row0 + 8 if hi else row0, k_start + 8 * n + 2 * t + (e & 1),
                                   nq, nk, offset, left, right, scale, softcap, inv_softcap,
                                   slope, drop, user, umask)
                    s[n, e] = ds

            # -- dQ += dS K: A from the registers, B = K by ldmatrix.trans (two 8-column
            # fragments per x4)
            for kk in range(P_STEPS):
                a0, a1, a2, a3 = a_frag_from_c(s, 2 * kk, 2 * kk + 1)
                for p in range(D_FRAGS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, kb + off_a + 16 * RB * kk
                                                       + 32 * (P0 + p))
                    n = 2 * p
                    acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma(
                        a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
                    n = 2 * p + 1
                    acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma(
                        a0, a1, a2, a3, b2, b3, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
            if KV_STAGES == 1:
                cuda.syncthreads()  # every warp is done with this K/V tile: the next one
                if kt_next < t_hi:
                    load_kv(smem, KV_BYTE, k, v, kv_base, next_start, nk, d, tid)
                    cp_async_commit()

        return step

    step_masked = make_step(True)
    step_full = make_step(False)

    @kernel_jit(cache=USER is None)  # a user's functions stay off the on-disk kernel cache
    def backward_dq_mma(q, k, v, do, lse, delta, dq_accum, scale, window, mods, alibi, tiles,
                        dropout, user):
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        n_heads = q.shape[1]
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]
        bx = cuda.blockIdx.x
        bh = bx // tiles
        b = bh // n_heads
        h = bh % n_heads
        hk = h // (n_heads // k.shape[1])
        q_start = (bx % tiles) * BLOCK_M_DQ
        q_end = min(q_start + BLOCK_M_DQ, nq)
        offset = nk - nq
        left, right = window
        softcap, inv_softcap = mods
        slope = ZERO
        if ALIBI:
            slope = alibi[b, h]
        exp_scale = scale * LOG2E_F
        row0 = q_start + 16 * warp + g     # the lane's two query rows
        row_base = uint64(uint32(bh)) * uint64(nq)
        nlse0 = -NEG_INF                   # rows past Nq: lse = -inf (P = 0 on masked tiles)
        nlse1 = -NEG_INF
        delta0 = ZERO
        delta1 = ZERO
        if row0 < nq:
            nlse0 = -(lse[row_base + uint64(row0)] * LOG2E_F)
            delta0 = delta[row_base + uint64(row0)]
        if row0 + 8 < nq:
            nlse1 = -(lse[row_base + uint64(row0 + 8)] * LOG2E_F)
            delta1 = delta[row_base + uint64(row0 + 8)]

        smem = cuda.shared.array(SMEM_WORDS, uint32)
        s = cuda.local.array((N_FRAGS, 4), float32)     # S, then dS
        dp = cuda.local.array((N_FRAGS, 4), float32)
        acc = cuda.local.array((D_FRAGS, 4), float32)
        for n in range(D_FRAGS):
            for e in range(4):
                acc[n, e] = ZERO

        off_a, off_b, _off = _lane_offsets(lane, RB, RB)
        kv_lo, kv_hi = tile_key_range(q_start, q_end, offset, nk, left, right)
        full_lo, full_hi = tile_full_range(q_start, q_end, offset, nk, left, right)
        t_lo = int32(kv_lo // BLOCK_N)
        t_hi = int32((kv_hi + BLOCK_N - 1) // BLOCK_N)
        f_lo = int32(min(max((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi))
        f_hi = int32(min(max(full_hi // BLOCK_N, f_lo), t_hi))  # unmasked tiles: [f_lo, f_hi)
        if q_start + BLOCK_M_DQ > nq:   # rows past Nq: every tile masked
            f_hi = f_lo

        # -- prologue: Q and dO of the block's rows, the first K/V tile into stage 0
        kv_base = (b * k.shape[1] + hk) * nk * d
        qo_base = ((b * n_heads + h) * nq + q_start) * d
        copy_q(smem, Q_BYTE, q, qo_base, q_end - q_start, d, tid)
        copy_q(smem, DO_BYTE, do, qo_base, q_end - q_start, d, tid)
        kt0 = t_lo
        if BLOCKS is not None:  # a block mask: EMPTY K/V tiles are never loaded
            kt0 = next_kv_tile(user[0], b, h, q_start, q_end, t_lo, t_hi, nk)
        if kt0 < t_hi:
            load_kv(smem, KV_BYTE, k, v, kv_base, kt0 * BLOCK_N, nk, d, tid)
        cp_async_commit()

        ins = (k, v, kv_base, nq, nk, d, b, h)
        frags = (s, dp, acc)
        lanes = (tid, warp, t, off_a, off_b)
        rows = (row0, nlse0, nlse1, delta0, delta1, offset, left, right)
        sc = (scale, exp_scale, softcap, inv_softcap, slope)
        if BLOCKS is None:
            for kt in range(t_lo, t_hi):
                if LOG and tid == 0:
                    log_tile(b, h, q_start, kt)
                stage = (kt - t_lo) & 1
                # inside the keys every row sees (and no mask_mod to ask): no mask
                if f_lo <= kt and kt < f_hi and not MASK_MOD:
                    step_full(kt, kt + 1, stage, t_hi, smem, ins, frags, lanes, rows, sc,
                              dropout, user, False)
                else:
                    step_masked(kt, kt + 1, stage, t_hi, smem, ins, frags, lanes, rows, sc,
                                dropout, user, True)
        else:  # the K/V tiles the block mask does not call EMPTY, in key order
            kt = kt0
            stage = 0
            while kt < t_hi:
                if LOG and tid == 0:
                    log_tile(b, h, q_start, kt)
                kind = tile_kind(user[0], b, h, q_start, q_end, kt, nk)
                kt_next = next_kv_tile(user[0], b, h, q_start, q_end, kt + 1, t_hi, nk)
                if f_lo <= kt and kt < f_hi and kind == BLOCK_FULL:  # FULL, inside the bounds
                    step_full(kt, kt_next, stage, t_hi, smem, ins, frags, lanes, rows, sc,
                              dropout, user, False)
                else:
                    step_masked(kt, kt_next, stage, t_hi, smem, ins, frags, lanes, rows, sc,
                                dropout, user, kind == BLOCK_PARTIAL)
                kt = kt_next
                stage ^= 1

        # -- dQ (times scale), in float32
        for r in range(2):
            row = row0 + 8 * r
            if row < nq:
                base = (row_base + uint64(row)) * uint64(d)
                for n in range(D_FRAGS):
                    for e in range(2):
                        c = COL0 + 8 * n + 2 * t + e
                        if c < d:
                            dq_accum[base + uint64(c)] = acc[n, 2 * r + e] * scale

    return backward_dq_mma


def compile_configs():
    """A representative set for the compile tier: the dK/dV kernel (with atomic dQ) at every
    head dim (256: its two passes), the deterministic dQ kernel at 64 and 128, every flag
    (dropout, softcap, ALiBi) at 128, the 16-bit-load build (``ld16``) at 64 and bfloat16 at 64,
    and a user's variant at 64 (:func:`_user_configs`).  Causal and windows are runtime
    arguments."""
    yield from _user_configs()
    u16 = types.Array(types.uint16, 4, "C")
    f32_1 = types.Array(types.float32, 1, "C")
    drop_t = types.Tuple((types.uint32, types.uint32, types.uint32, types.float32))
    scale_t, window_t, mods_t, alibi_t = _variant_args()
    i64 = types.int64

    def flags_name(dropout, softcap, alibi, vec=True):
        return "".join(f" {n}" for n, f in (("dropout", dropout), ("softcap", softcap),
                                             ("alibi", alibi), ("ld16", not vec)) if f)

    F16 = "float16"
    plan = [(hd, False, False, False, True, True, True, F16, 0, hd) for hd in HEAD_DIMS
            if hd not in SPLIT_HEAD_DIMS]
    # HEAD_DIM 256: two of its four passes (dkdv_passes), the dV half and the dK half with dQ
    plan += [(256, False, False, False, True, False, True, F16, 0, 128),
             (256, False, False, False, False, True, True, F16, 0, 128)]
    plan += [(128, True, True, True, True, True, True, F16, 0, 128),
             (64, False, False, False, True, True, False, F16, 0, 64),
             (64, False, False, False, True, True, True, "bfloat16", 0, 64)]
    for hd, dropout, softcap, alibi, want_dv, want_dk, vec, dtype, c0, acc in plan:
        nw = GPU_WARPS[hd]
        parts = "dv" if not want_dk else ("dk dq" if not want_dv else "dk dv dq")
        cols = f" c{c0}-{c0 + acc - 1}" if acc < hd else ""
        pairs = hd // 16
        yield {
            "name": f"backward_mma dkdv ({parts}{cols}) W{nw} N{16 * nw} D{hd}"
                    f"{flags_name(dropout, softcap, alibi, vec)} {dtype}",
            "kernel": dkdv_mma_kernel(nw, hd, dropout, softcap, alibi, want_dv, want_dk,
                                      want_dk, vec, dtype, c0, acc),
            "args": (u16, u16, u16, u16, f32_1, f32_1, f32_1, f32_1, f32_1, scale_t, window_t,
                     mods_t, alibi_t, i64, drop_t if dropout else types.Tuple(()),
                     types.Tuple(())),
            "float64_ok": False,
            "mma": True,
            # one Q tile per warp on the common (unmasked) path: S^T, dP^T (2 K_STEPS each),
            # dV, dK (acc / 8 each), dQ (2 mma per column pair of this warp, per 16 keys)
            "sass": {"expect_mma": (2 * (hd // 16) * (1 + int(want_dk))
                                    + (acc // 8) * (int(want_dv) + int(want_dk))
                                    + (2 * -(-pairs // nw) * nw if want_dk else 0))},
        }
    for hd, dropout, softcap, alibi, dtype, acc in ((64, False, False, False, F16, 64),
                                                    (128, False, False, False, F16, 128),
                                                    (128, True, True, True, F16, 128),
                                                    (256, False, False, False, F16, 128),
                                                    (64, False, False, False, "bfloat16", 64)):
        nw = GPU_WARPS[hd]
        bn = dq_block_n(nw, hd)
        cols = f" c0-{acc - 1}" if acc < hd else ""
        yield {
            "name": f"backward_mma dq W{nw} M{16 * nw} D{hd}{cols}"
                    f"{flags_name(dropout, softcap, alibi)} {dtype}",
            "kernel": dq_mma_kernel(nw, hd, dropout, softcap, alibi, True, dtype, 0, acc),
            "args": (u16, u16, u16, u16, f32_1, f32_1, f32_1, scale_t, window_t, mods_t,
                     alibi_t, i64, drop_t if dropout else types.Tuple(()), types.Tuple(())),
            "float64_ok": False,
            "mma": True,
            # one K/V tile per warp: S, dP (N_FRAGS K_STEPS each), dQ (P_STEPS D_FRAGS)
            "sass": {"expect_mma": 2 * (bn // 8) * (hd // 16) + (bn // 16) * (acc // 8)},
        }


assert all(max(shared_bytes(nw, hd)) <= SMEM_LIMIT for hd, nw in GPU_WARPS.items())


def _user_configs():
    """A user's variant (:mod:`numba_flash.flex.examples`: a relative-position bias score_mod
    with its score_mod_grad and a document mask_mod with a block mask) in the dK/dV kernel
    (with atomic dQ) at D64, float16: the device build of user functions called with ``*aux``
    (the plain rows are the ``score_mod=None`` build)."""
    from ..flex.examples import document_mask, relative_bias, relative_bias_grad
    from ..flex.functions import device_function

    def biased(score, b, h, q_idx, kv_idx, bias, doc):  # every function gets every aux array
        return relative_bias(score, b, h, q_idx, kv_idx, bias)

    def biased_grad(score, b, h, q_idx, kv_idx, bias, doc):
        return relative_bias_grad(score, b, h, q_idx, kv_idx, bias)

    def documents(b, h, q_idx, kv_idx, bias, doc):
        return document_mask(b, h, q_idx, kv_idx, doc)

    u16 = types.Array(types.uint16, 4, "C")
    f32_1 = types.Array(types.float32, 1, "C")
    scale_t, window_t, mods_t, alibi_t = _variant_args()
    user = (device_function(biased), device_function(documents), device_function(biased_grad),
            (128, 128))
    user_t = types.Tuple((types.Array(types.int8, 4, "C"), types.Array(types.float32, 2, "C"),
                          types.Array(types.int32, 2, "C")))
    nw, hd = GPU_WARPS[64], 64
    yield {
        "name": f"backward_mma dkdv (dk dv dq) W{nw} N{16 * nw} D{hd} score_mod mask_mod "
                f"block_mask float16",
        "kernel": dkdv_mma_kernel(nw, hd, False, False, False, True, True, True, True,
                                  "float16", 0, hd, user),
        "args": (u16, u16, u16, u16, f32_1, f32_1, f32_1, f32_1, f32_1, scale_t, window_t,
                 mods_t, alibi_t, types.int64, types.Tuple(()), user_t),
        "float64_ok": False,
        "mma": True,
        # as the plain dK/dV row: S^T, dP^T, dV, dK and the warp's dQ column pairs
        "sass": {"expect_mma": 2 * (hd // 16) * 2 + (hd // 8) * 2 + 2 * -(-(hd // 16) // nw) * nw},
    }
