"""FlashAttention backward on tensor cores: the five products on ``mma.sync.m16n8k16``.

Math (as :mod:`numba_flash.kernels.backward`, the SIMT kernels)
---------------------------------------------------------------
With ``P = exp(mod(scale Q K^T) - lse)`` recomputed from the forward's ``lse``, ``D =
rowsum(dO * O)`` (the SIMT preprocess kernel) and ``Z = keep / (1 - p)`` (1 without dropout)::

    dV = (P Z)^T dO      dP = (dO V^T) Z      dS = P (dP - D) (1 - t^2)
    dK = scale dS^T Q    dQ = scale dS K

``t = tanh(s / softcap)`` (the factor is 1 without softcap; ALiBi has no gradient).  The scores
follow the contract of :func:`~numba_flash.kernels.visibility.make_score` (as the SIMT kernels
do): ``Q K^T`` (here ``K Q^T``, the same float16 products) accumulated in float32, times
``scale`` rounded once, then the modifiers.  The tensor-core forward folds the scale into its
``ex2`` exponent instead, so ``P = exp(s - lse)`` matches its ``P`` to a few ulps of ``|s|``
(1e-5 relative at ``|s|`` = 150), far below the float16 rounding of ``P`` and ``dS`` here.
A key a row does not see, a row past ``Nq`` and a row with ``lse = -inf`` (it sees no key)
give exactly ``P = dS = 0``.  The float16 operands of each product: ``Q``, ``K``, ``V``,
``dO`` as stored; ``P Z`` and ``dS`` rounded from float32 to float16 (as flash-attn does);
accumulation in float32.

Kernels
-------
1. :func:`dkdv_mma_kernel`: one block per ``(K/V tile of BLOCK_N = 16 NUM_WARPS keys, b, query
   head h)`` (a 1-D grid, :func:`numba_flash.kernels.backward.fold_grid`).  Each warp owns 16
   keys; ``k_tile``, ``v_tile`` are loaded once, then the block walks the 16-row Q tiles that see
   some key of the tile (:func:`~numba_flash.kernels.visibility.tile_query_range`).  Per Q tile
   each warp computes the *transposed* products, keys as rows: ``S^T = K Q^T`` and ``dP^T = V
   dO^T`` (``B`` = rows of ``q_tile`` / ``do_tile``, :func:`~numba_flash.kernels.mma.load_b_frag`),
   ``P^T`` and ``dS^T`` element-wise on the accumulator fragments, then ``dV += (P Z)^T dO`` and
   ``dK += dS^T Q`` with ``A`` straight from those registers (two 8-query fragments are one
   16-query ``A`` fragment) and ``B`` = ``dO`` / ``Q`` read untransposed
   (:func:`~numba_flash.kernels.mma.load_b_frag_t`; for ``Q`` and ``K``, whose non-finite
   entries already made ``dS`` NaN where a row sees the key, the ``_finite`` variant stores them
   as 0 so that ``dS = 0`` of a pair the row does not see stays 0 on the tensor core).  ``dK``,
   ``dV`` stay in registers and are
   written once, in float32, per query head; the op sums each GQA group and casts
   (``reduce_kernel``, fixed order).  With ``DQ_ATOMIC`` the block also needs ``dS`` with
   queries as rows: each warp stores its ``dS^T`` fragment into ``ds_sh [16, BLOCK_N]``
   (float32), and after a barrier the warps split the ``HEAD_DIM / 8`` output fragments of
   ``dQ_i += dS K_j`` and ``cuda.atomic.add`` them into the float32 ``dq_accum``.
   ``WANT_DV`` / ``WANT_DK`` select the outputs: at ``HEAD_DIM = 256`` both accumulators would
   need 256 registers per lane, so the op runs the kernel twice (dV; then dK and dQ).
2. :func:`dq_mma_kernel` (``deterministic=True``): one block per ``(Q tile of 16 NUM_WARPS rows,
   b, h)``, a warp per 16 rows, looping over the K/V tiles (:func:`dq_block_n` keys) the rows see
   (:func:`~numba_flash.kernels.visibility.tile_key_range`): ``S = Q K^T``, ``dP = dO V^T`` (as
   the forward), ``P``, ``dS`` on the fragments, ``dQ += dS K`` (``A`` from registers, ``B`` =
   ``K`` untransposed), in a fixed order: no atomics, bitwise reproducible.

A non-finite ``dO_i`` makes ``D_i`` non-finite (the preprocess sums ``dO_i * O_i``), so ``dS``
is NaN at the pairs row ``i`` sees and 0 elsewhere; for ``dV`` the dkdv block learns from ``D``
that its Q tile holds such a row (``cuda.syncthreads_or`` on its existing barrier) and runs the
rare path (:func:`_dv_masked_function`): ``dO`` with non-finite halves as 0, then a 0/1 product
that makes ``dV[j, c]`` NaN where a row seeing key ``j`` has a non-finite ``dO[row, c]``, so a
key a row does not see gets nothing from that row's ``dO``.

Dropout: the keep bit of element ``(b, h, i, j)`` is :func:`numba_flash.philox.philox_keep`
(the mask of :func:`numba_flash.dropout_mask`); in ``dkdv`` a lane's 4 elements of a fragment
are 2 keys x 2 queries, each its own Philox group, so each takes one call.

Shared memory (uint32 words of two float16; ``W = HEAD_DIM / 2 + 4``, the ``+ 4`` against bank
conflicts): dkdv ``k_tile, v_tile [BLOCK_N, W]``, ``q_tile, do_tile [16, W]``, ``ds_sh
[16, BLOCK_N + 1]`` float32, ``lse_sh, delta_sh [16]``; dq ``q_tile, do_tile [BLOCK_M, W]``,
``k_tile, v_tile [dq_block_n, W]``.  At most 48 KiB for every head dim of :data:`GPU_WARPS`
(:func:`shared_bytes`).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, types, uint32

from ..backend import on_simulator
from ..philox import philox_keep
from .common import HEAD_DIMS, SMEM_LIMIT, padded_head_dim
from .mma import (a_frag_from_c, half2_bits, load_a_frag, load_b_frag, load_b_frag_t,
                  load_b_frag_t_finite, mma_m16n8k16, pack_half2)
from .visibility import is_visible, make_score, tile_key_range, tile_query_range
from .jit import kernel_jit

#: warps per block on the GPU, per padded head dim (dkdv: BLOCK_N = 16 NUM_WARPS keys; dq:
#: BLOCK_M = 16 NUM_WARPS rows, BLOCK_N = :func:`dq_block_n` keys)
GPU_WARPS = {16: 4, 32: 4, 64: 4, 128: 2, 256: 1}
#: the simulator: one warp (32 Python threads)
SIM_WARPS = 1

#: head dims whose dK and dV accumulators do not fit in registers together: two dkdv passes
SPLIT_HEAD_DIMS = (256,)


def dq_block_n(NUM_WARPS, HEAD_DIM):
    """Keys per K/V tile of the dQ kernel: ``16 NUM_WARPS``, but 16 from head dim 128 on (with
    every flag the 16 dS elements per lane of 32 keys pushed sm_90 over 255 registers)."""
    return 16 if HEAD_DIM >= 128 else 16 * NUM_WARPS


def shared_bytes(NUM_WARPS, HEAD_DIM):
    """``(dkdv, dq)`` static shared memory of one block (the budget in the module docstring)."""
    w = HEAD_DIM // 2 + 4
    n = 16 * NUM_WARPS
    dkdv = 4 * (2 * n * w + 2 * 16 * w + 16 * (n + 1) + 2 * 16)
    dq = 4 * (2 * n * w + 2 * dq_block_n(NUM_WARPS, HEAD_DIM) * w)
    return dkdv, dq


def default_tiles(head_dim, simulator=None):
    """``(NUM_WARPS, HEAD_DIM)`` for a head dim ``d`` (1..256) on this backend."""
    if simulator is None:
        simulator = on_simulator()
    hd = padded_head_dim(head_dim)
    return (SIM_WARPS if simulator else GPU_WARPS[hd]), hd


@functools.lru_cache(maxsize=None)
def _element_functions(DROPOUT, SOFTCAP, ALIBI):
    """``p_ds(s, dp, row, key, ...) -> (p Z, dS)``: THE element-wise step of both kernels."""
    score = make_score(SOFTCAP, ALIBI, float32)  # the forward's score, so P is the forward's
    ZERO = float32(0.0)
    NEG_INF = float32(-math.inf)

    @cuda.jit(device=True, inline=True)
    def p_ds(s, dp, b, h, row, key, nq, nk, offset, left, right, scale, lse_i, delta_i,
             softcap, inv_softcap, slope, dropout):
        """``(P Z, dS)`` of element ``(row, key)`` from its raw ``s = q . k`` and ``dp =
        dO . v``; ``(0, 0)`` where the row does not see the key or sees none."""
        if not (row < nq and lse_i != NEG_INF and is_visible(row, key, offset, nk, left, right)):
            return ZERO, ZERO
        x, grad = score(s, scale, row, key, offset, softcap, inv_softcap, slope)  # 1 - tanh^2
        p = math.exp(x - lse_i)
        if DROPOUT:
            seed_lo, seed_hi, threshold, keep_scale = dropout
            z = keep_scale if philox_keep(seed_lo, seed_hi, b, h, row, key, threshold) else ZERO
            return p * z, p * (dp * z - delta_i) * grad
        return p, p * (dp - delta_i) * grad

    return p_ds


@functools.lru_cache(maxsize=None)
def _load_functions(HEAD_DIM, THREADS):
    WORDS = HEAD_DIM // 2

    @cuda.jit(device=True, inline=True)
    def load_rows(x, b, h, start, end, ROWS, tile, tid):
        """``tile[:ROWS]`` <- rows ``start ..`` of ``x[b, h]`` (uint16 float16 bits) as packed
        pairs, zero at rows >= ``end`` and columns >= d."""
        d = x.shape[3]
        for idx in range(tid, ROWS * WORDS, THREADS):
            r = idx // WORDS
            c = 2 * (idx % WORDS)
            lo = 0
            hi = 0
            if start + r < end:
                if c < d:
                    lo = x[b, h, start + r, c]
                if c + 1 < d:
                    hi = x[b, h, start + r, c + 1]
            tile[r, idx % WORDS] = half2_bits(lo, hi)

    return load_rows


_LOW16 = uint32(0xFFFF)
_SHIFT16 = uint32(16)
_EXP16 = uint32(0x7C00)  # float16 exponent bits: all set = inf or NaN
_ONE16 = uint32(0x3C00)  # float16 1.0


@cuda.jit(device=True, inline=True)
def _nonfinite_half(h):
    """float16 1.0 if the float16 bit pattern ``h`` is inf or NaN, else 0."""
    return _ONE16 if (h & _EXP16) == _EXP16 else uint32(0)


@cuda.jit(device=True, inline=True)
def _nonfinite_indicator(word):
    """A register of two float16: 1.0 where a half of ``word`` is inf or NaN, else 0."""
    return half2_bits(_nonfinite_half(uint32(word & _LOW16)),
                      _nonfinite_half(uint32(word >> _SHIFT16)))


@functools.lru_cache(maxsize=None)
def _dv_masked_function(HEAD_DIM):
    """``dv_masked(a0..a3, do_tile, dv_acc, seen_t, ...)``: the rare ``dV += (P Z)^T dO`` of a
    Q tile holding a non-finite ``dO``, where a key a row does not see must get nothing from it
    (``P = 0`` there, but the tensor core computes ``0 * NaN = NaN``).  ``dO`` goes in with its
    non-finite halves as 0; then ``seen (0/1) x non-finite (0/1)``, one more product on the tensor
    cores, counts for each ``dV[key, c]`` the rows that see the key and have a non-finite
    ``dO[row, c]``, and those elements become NaN (the reference's ``P * NaN`` or ``P * inf``:
    non-finite either way)."""
    D_FRAGS = HEAD_DIM // 8
    ZERO = float32(0.0)
    ONE = float32(1.0)
    NAN = float32(math.nan)

    @cuda.jit(device=True, inline=True)
    def dv_masked(a0, a1, a2, a3, do_tile, dv_acc, seen_t, q_start, key0, key1, offset, nk, left,
                  right, g, t):
        for n in range(D_FRAGS):
            b0, b1 = load_b_frag_t_finite(do_tile, 0, 8 * n, g, t)
            dv_acc[n, 0], dv_acc[n, 1], dv_acc[n, 2], dv_acc[n, 3] = mma_m16n8k16(
                a0, a1, a2, a3, b0, b1, dv_acc[n, 0], dv_acc[n, 1], dv_acc[n, 2], dv_acc[n, 3])
        # seen^T in the layout of st: query 8 f + 2 t + (e & 1), key key0 (e < 2) or key1
        for f in range(2):
            for e in range(4):
                key = key0 if e < 2 else key1
                row = q_start + 8 * f + 2 * t + (e & 1)
                seen_t[f, e] = ONE if is_visible(row, key, offset, nk, left, right) else ZERO
        s0, s1, s2, s3 = a_frag_from_c(seen_t, 0, 1)
        for n in range(D_FRAGS):
            b0, b1 = load_b_frag_t(do_tile, 0, 8 * n, g, t)
            h0, h1, h2, h3 = mma_m16n8k16(s0, s1, s2, s3, _nonfinite_indicator(b0),
                                          _nonfinite_indicator(b1), ZERO, ZERO, ZERO, ZERO)
            if h0 > ZERO:
                dv_acc[n, 0] = NAN
            if h1 > ZERO:
                dv_acc[n, 1] = NAN
            if h2 > ZERO:
                dv_acc[n, 2] = NAN
            if h3 > ZERO:
                dv_acc[n, 3] = NAN

    return dv_masked


def _variant_args():
    """Numba types of the kernels' trailing arguments (see :func:`dkdv_mma_kernel`)."""
    return (types.float32, types.UniTuple(types.int32, 2), types.UniTuple(types.float32, 2),
            types.Array(types.float32, 2, "C"))


@functools.lru_cache(maxsize=None)
def dkdv_mma_kernel(NUM_WARPS, HEAD_DIM, DROPOUT=False, SOFTCAP=False, ALIBI=False,
                    WANT_DV=True, WANT_DK=True, DQ_ATOMIC=True):
    """Build ``kernel(q, k, v, do, lse, delta, dq_accum, dk_out, dv_out, scale, window, mods,
    alibi, tiles, dropout)``.

    ``q, k, v, do``: uint16 views of float16 ``[B, H(kv), N, d]``; ``lse``, ``delta`` float32
    ``[B, H, Nq]``; ``dq_accum`` float32 ``[B, H, Nq, d]`` (atomics, with ``DQ_ATOMIC``);
    ``dk_out``, ``dv_out`` float32 ``[B, H, Nk, d]`` (this query head's share, unscaled dK times
    ``scale``); ``scale`` float32; ``window`` ``(left, right)`` int32; ``mods`` ``(softcap,
    1/softcap)`` float32; ``alibi`` float32 ``[B, H]``; ``tiles`` = ceil(Nk / BLOCK_N);
    ``dropout`` ``()`` or ``(seed_lo, seed_hi, threshold, keep_scale)``.
    """
    BLOCK_N = 16 * NUM_WARPS
    THREADS = 32 * NUM_WARPS
    ROW_W = HEAD_DIM // 2 + 4
    DS_W = BLOCK_N + 1          # padded row of ds_sh
    D_FRAGS = HEAD_DIM // 8
    K_STEPS = HEAD_DIM // 16
    P_STEPS = BLOCK_N // 16
    NEED_DS = WANT_DK or DQ_ATOMIC
    ZERO = float32(0.0)
    NEG_INF = float32(-math.inf)
    INF = float32(math.inf)
    p_ds = _element_functions(DROPOUT, SOFTCAP, ALIBI)
    load_rows = _load_functions(HEAD_DIM, THREADS)
    dv_masked = _dv_masked_function(HEAD_DIM)

    @kernel_jit
    def backward_dkdv_mma(q, k, v, do, lse, delta, dq_accum, dk_out, dv_out, scale, window,
                          mods, alibi, tiles, dropout):
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
        k_start = (bx % tiles) * BLOCK_N
        offset = nk - nq
        left, right = window
        softcap, inv_softcap = mods
        slope = ZERO
        if ALIBI:
            slope = alibi[b, h]
        key0 = k_start + 16 * warp + g     # the lane's two keys (rows of S^T)
        key1 = key0 + 8

        k_tile = cuda.shared.array((BLOCK_N, ROW_W), types.uint32)
        v_tile = cuda.shared.array((BLOCK_N, ROW_W), types.uint32)
        q_tile = cuda.shared.array((16, ROW_W), types.uint32)
        do_tile = cuda.shared.array((16, ROW_W), types.uint32)
        ds_sh = cuda.shared.array((16, DS_W), float32)
        lse_sh = cuda.shared.array(16, float32)
        delta_sh = cuda.shared.array(16, float32)
        st = cuda.local.array((2, 4), float32)      # S^T, then P^T Z (keys x 16 queries)
        seen_t = cuda.local.array((2, 4), float32)  # rare path: 1 where the row sees the key
        dpt = cuda.local.array((2, 4), float32)     # dP^T, then dS^T
        dk_acc = cuda.local.array((D_FRAGS, 4), float32)
        dv_acc = cuda.local.array((D_FRAGS, 4), float32)

        load_rows(k, b, hk, k_start, nk, BLOCK_N, k_tile, tid)
        load_rows(v, b, hk, k_start, nk, BLOCK_N, v_tile, tid)
        for n in range(D_FRAGS):
            for e in range(4):
                dk_acc[n, e] = ZERO
                dv_acc[n, e] = ZERO

        q_lo, q_hi = tile_query_range(k_start, min(k_start + BLOCK_N, nk), offset, nq, left,
                                      right)
        for qt in range(q_lo // 16, (q_hi + 15) // 16):
            q_start = qt * 16
            # -- the Q tile: Q and dO rows, lse and D
            load_rows(q, b, h, q_start, nq, 16, q_tile, tid)
            load_rows(do, b, h, q_start, nq, 16, do_tile, tid)
            bad = int32(0)  # a non-finite D: that row's dO holds an inf or NaN
            for m in range(tid, 16, THREADS):
                if q_start + m < nq:
                    lse_sh[m] = lse[b, h, q_start + m]
                    dm = delta[b, h, q_start + m]
                    delta_sh[m] = dm
                    if not abs(dm) < INF:
                        bad = int32(1)
                else:
                    lse_sh[m] = NEG_INF
                    delta_sh[m] = ZERO
            # every tile of this step is complete before fragment loads; and every thread learns
            # whether a row of this Q tile has a non-finite dO
            do_bad = cuda.syncthreads_or(bad)

            # -- S^T = K Q^T and dP^T = V dO^T: keys as rows, 2 fragments of 8 queries
            for n in range(2):
                for e in range(4):
                    st[n, e] = ZERO
                    dpt[n, e] = ZERO
            for kc in range(K_STEPS):
                a0, a1, a2, a3 = load_a_frag(k_tile, 16 * warp, 8 * kc, g, t)
                for n in range(2):
                    b0, b1 = load_b_frag(q_tile, 8 * n, 8 * kc, g, t)
                    st[n, 0], st[n, 1], st[n, 2], st[n, 3] = mma_m16n8k16(
                        a0, a1, a2, a3, b0, b1, st[n, 0], st[n, 1], st[n, 2], st[n, 3])
                if NEED_DS:
                    a0, a1, a2, a3 = load_a_frag(v_tile, 16 * warp, 8 * kc, g, t)
                    for n in range(2):
                        b0, b1 = load_b_frag(do_tile, 8 * n, 8 * kc, g, t)
                        dpt[n, 0], dpt[n, 1], dpt[n, 2], dpt[n, 3] = mma_m16n8k16(
                            a0, a1, a2, a3, b0, b1, dpt[n, 0], dpt[n, 1], dpt[n, 2], dpt[n, 3])

            # -- P^T Z and dS^T element by element (row = query, key as the fragment row)
            for n in range(2):
                for e in range(4):
                    m = 8 * n + 2 * t + (e & 1)          # query within the Q tile
                    key = key0 if e < 2 else key1
                    pz, ds = p_ds(st[n, e], dpt[n, e], b, h, q_start + m, key, nq, nk, offset,
                                  left, right, scale, lse_sh[m], delta_sh[m], softcap,
                                  inv_softcap, slope, dropout)
                    st[n, e] = pz
                    dpt[n, e] = ds

            # -- dV += (P Z)^T dO and dK += dS^T Q: A from the registers, B = dO / Q rows
            if WANT_DV:
                a0, a1, a2, a3 = a_frag_from_c(st, 0, 1)
                if do_bad:
                    dv_masked(a0, a1, a2, a3, do_tile, dv_acc, seen_t, q_start, key0, key1,
                              offset, nk, left, right, g, t)
                else:
                    for n in range(D_FRAGS):
                        b0, b1 = load_b_frag_t(do_tile, 0, 8 * n, g, t)
                        dv_acc[n, 0], dv_acc[n, 1], dv_acc[n, 2], dv_acc[n, 3] = mma_m16n8k16(
                            a0, a1, a2, a3, b0, b1,
                            dv_acc[n, 0], dv_acc[n, 1], dv_acc[n, 2], dv_acc[n, 3])
            if WANT_DK:
                a0, a1, a2, a3 = a_frag_from_c(dpt, 0, 1)
                for n in range(D_FRAGS):
                    b0, b1 = load_b_frag_t_finite(q_tile, 0, 8 * n, g, t)
                    dk_acc[n, 0], dk_acc[n, 1], dk_acc[n, 2], dk_acc[n, 3] = mma_m16n8k16(
                        a0, a1, a2, a3, b0, b1,
                        dk_acc[n, 0], dk_acc[n, 1], dk_acc[n, 2], dk_acc[n, 3])

            if DQ_ATOMIC:
                # -- dQ_i += scale dS K_j: dS with queries as rows through shared memory
                for n in range(2):
                    for e in range(4):
                        ds_sh[8 * n + 2 * t + (e & 1), 16 * warp + g + 8 * (e >> 1)] = dpt[n, e]
                cuda.syncthreads()  # ds_sh holds every warp's dS^T before any warp reads rows
                for n in range(warp, D_FRAGS, NUM_WARPS):  # the warps split dQ's columns
                    c0 = ZERO
                    c1 = ZERO
                    c2 = ZERO
                    c3 = ZERO
                    for kk in range(P_STEPS):
                        kb = 16 * kk + 2 * t
                        a0 = pack_half2(ds_sh[g, kb], ds_sh[g, kb + 1])
                        a1 = pack_half2(ds_sh[g + 8, kb], ds_sh[g + 8, kb + 1])
                        a2 = pack_half2(ds_sh[g, kb + 8], ds_sh[g, kb + 9])
                        a3 = pack_half2(ds_sh[g + 8, kb + 8], ds_sh[g + 8, kb + 9])
                        b0, b1 = load_b_frag_t_finite(k_tile, 16 * kk, 8 * n, g, t)
                        c0, c1, c2, c3 = mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
                    col = 8 * n + 2 * t
                    for r in range(2):
                        row = q_start + g + 8 * r
                        if row < nq:
                            if col < d:
                                cuda.atomic.add(dq_accum, (b, h, row, col),
                                                (c0 if r == 0 else c2) * scale)
                            if col + 1 < d:
                                cuda.atomic.add(dq_accum, (b, h, row, col + 1),
                                                (c1 if r == 0 else c3) * scale)
            cuda.syncthreads()  # q/do_tile, lse/delta_sh and ds_sh are read: next Q tile

        # -- this query head's dK (times scale) and dV, in float32
        for n in range(D_FRAGS):
            for e in range(4):
                key = key0 if e < 2 else key1
                c = 8 * n + 2 * t + (e & 1)
                if key < nk and c < d:
                    if WANT_DK:
                        dk_out[b, h, key, c] = dk_acc[n, e] * scale
                    if WANT_DV:
                        dv_out[b, h, key, c] = dv_acc[n, e]

    return backward_dkdv_mma


@functools.lru_cache(maxsize=None)
def dq_mma_kernel(NUM_WARPS, HEAD_DIM, DROPOUT=False, SOFTCAP=False, ALIBI=False):
    """Build ``kernel(q, k, v, do, lse, delta, dq_accum, scale, window, mods, alibi, tiles,
    dropout)``: ``dq_accum = scale * dS K`` (float32) without atomics (``deterministic=True``);
    arguments as :func:`dkdv_mma_kernel`, ``tiles = ceil(Nq / BLOCK_M)``."""
    BLOCK_M = 16 * NUM_WARPS
    BLOCK_N = dq_block_n(NUM_WARPS, HEAD_DIM)
    THREADS = 32 * NUM_WARPS
    ROW_W = HEAD_DIM // 2 + 4
    D_FRAGS = HEAD_DIM // 8
    K_STEPS = HEAD_DIM // 16
    N_FRAGS = BLOCK_N // 8
    P_STEPS = BLOCK_N // 16
    ZERO = float32(0.0)
    p_ds = _element_functions(DROPOUT, SOFTCAP, ALIBI)
    load_rows = _load_functions(HEAD_DIM, THREADS)

    @kernel_jit
    def backward_dq_mma(q, k, v, do, lse, delta, dq_accum, scale, window, mods, alibi, tiles,
                        dropout):
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
        q_start = (bx % tiles) * BLOCK_M
        offset = nk - nq
        left, right = window
        softcap, inv_softcap = mods
        slope = ZERO
        if ALIBI:
            slope = alibi[b, h]
        row0 = q_start + 16 * warp + g
        row1 = row0 + 8
        lse0 = float32(-math.inf)
        lse1 = float32(-math.inf)
        delta0 = ZERO
        delta1 = ZERO
        if row0 < nq:
            lse0 = lse[b, h, row0]
            delta0 = delta[b, h, row0]
        if row1 < nq:
            lse1 = lse[b, h, row1]
            delta1 = delta[b, h, row1]

        q_tile = cuda.shared.array((BLOCK_M, ROW_W), types.uint32)
        do_tile = cuda.shared.array((BLOCK_M, ROW_W), types.uint32)
        k_tile = cuda.shared.array((BLOCK_N, ROW_W), types.uint32)
        v_tile = cuda.shared.array((BLOCK_N, ROW_W), types.uint32)
        s = cuda.local.array((N_FRAGS, 4), float32)
        dp = cuda.local.array((N_FRAGS, 4), float32)
        acc = cuda.local.array((D_FRAGS, 4), float32)

        load_rows(q, b, h, q_start, nq, BLOCK_M, q_tile, tid)
        load_rows(do, b, h, q_start, nq, BLOCK_M, do_tile, tid)
        for n in range(D_FRAGS):
            for e in range(4):
                acc[n, e] = ZERO

        kv_lo, kv_hi = tile_key_range(q_start, min(q_start + BLOCK_M, nq), offset, nk, left,
                                      right)
        for kt in range(kv_lo // BLOCK_N, (kv_hi + BLOCK_N - 1) // BLOCK_N):
            k_start = kt * BLOCK_N
            load_rows(k, b, hk, k_start, nk, BLOCK_N, k_tile, tid)
            load_rows(v, b, hk, k_start, nk, BLOCK_N, v_tile, tid)
            cuda.syncthreads()  # K/V (and, first time, Q/dO) tiles complete before fragments

            # -- S = Q K^T and dP = dO V^T (queries as rows, as the forward)
            for n in range(N_FRAGS):
                for e in range(4):
                    s[n, e] = ZERO
                    dp[n, e] = ZERO
            for kc in range(K_STEPS):
                a0, a1, a2, a3 = load_a_frag(q_tile, 16 * warp, 8 * kc, g, t)
                e0, e1, e2, e3 = load_a_frag(do_tile, 16 * warp, 8 * kc, g, t)
                for n in range(N_FRAGS):
                    b0, b1 = load_b_frag(k_tile, 8 * n, 8 * kc, g, t)
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma_m16n8k16(
                        a0, a1, a2, a3, b0, b1, s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                    b0, b1 = load_b_frag(v_tile, 8 * n, 8 * kc, g, t)
                    dp[n, 0], dp[n, 1], dp[n, 2], dp[n, 3] = mma_m16n8k16(
                        e0, e1, e2, e3, b0, b1, dp[n, 0], dp[n, 1], dp[n, 2], dp[n, 3])

            # -- dS element by element
            for n in range(N_FRAGS):
                for e in range(4):
                    key = k_start + 8 * n + 2 * t + (e & 1)
                    row = row0 if e < 2 else row1
                    _pz, ds = p_ds(s[n, e], dp[n, e], b, h, row, key, nq, nk, offset, left,
                                   right, scale, lse0 if e < 2 else lse1,
                                   delta0 if e < 2 else delta1, softcap, inv_softcap, slope,
                                   dropout)
                    s[n, e] = ds

            # -- dQ += dS K: A from the registers, B = K rows read untransposed
            for kk in range(P_STEPS):
                a0, a1, a2, a3 = a_frag_from_c(s, 2 * kk, 2 * kk + 1)
                for n in range(D_FRAGS):
                    b0, b1 = load_b_frag_t_finite(k_tile, 16 * kk, 8 * n, g, t)
                    acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma_m16n8k16(
                        a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
            cuda.syncthreads()  # every warp is done with k_tile / v_tile: next K/V tile

        for n in range(D_FRAGS):
            for e in range(4):
                row = row0 if e < 2 else row1
                c = 8 * n + 2 * t + (e & 1)
                if row < nq and c < d:
                    dq_accum[b, h, row, c] = acc[n, e] * scale

    return backward_dq_mma


def compile_configs():
    """A representative set for the compile tier: the dK/dV kernel (with atomic dQ) at every
    head dim (256: its two passes), the deterministic dQ kernel at 64 and 128, and every flag
    (dropout, softcap, ALiBi) at 128.  Causal and windows are runtime arguments."""
    u16 = types.Array(types.uint16, 4, "C")
    f32_3 = types.Array(types.float32, 3, "C")
    f32_4 = types.Array(types.float32, 4, "C")
    drop_t = types.Tuple((types.uint32, types.uint32, types.uint32, types.float32))
    scale_t, window_t, mods_t, alibi_t = _variant_args()
    i64 = types.int64

    def flags_name(dropout, softcap, alibi):
        return "".join(f" {n}" for n, f in (("dropout", dropout), ("softcap", softcap),
                                             ("alibi", alibi)) if f)

    plan = [(hd, False, False, False, True, True) for hd in HEAD_DIMS if hd not in SPLIT_HEAD_DIMS]
    plan += [(256, False, False, False, True, False), (256, False, False, False, False, True)]
    plan += [(128, True, True, True, True, True)]
    for hd, dropout, softcap, alibi, want_dv, want_dk in plan:
        nw = GPU_WARPS[hd]
        parts = "dv" if not want_dk else ("dk dq" if not want_dv else "dk dv dq")
        yield {
            "name": f"backward_mma dkdv ({parts}) W{nw} N{16 * nw} D{hd}"
                    f"{flags_name(dropout, softcap, alibi)} float16",
            "kernel": dkdv_mma_kernel(nw, hd, dropout, softcap, alibi, want_dv, want_dk,
                                      want_dk),
            "args": (u16, u16, u16, u16, f32_3, f32_3, f32_4, f32_4, f32_4, scale_t, window_t,
                     mods_t, alibi_t, i64, drop_t if dropout else types.Tuple(())),
            "float64_ok": False,
            "mma": True,
        }
    for hd, dropout, softcap, alibi in ((64, False, False, False), (128, True, True, True)):
        nw = GPU_WARPS[hd]
        yield {
            "name": f"backward_mma dq W{nw} M{16 * nw} D{hd}{flags_name(dropout, softcap, alibi)}"
                    " float16",
            "kernel": dq_mma_kernel(nw, hd, dropout, softcap, alibi),
            "args": (u16, u16, u16, u16, f32_3, f32_3, f32_4, scale_t, window_t, mods_t,
                     alibi_t, i64, drop_t if dropout else types.Tuple(())),
            "float64_ok": False,
            "mma": True,
        }


assert all(max(shared_bytes(nw, hd)) <= SMEM_LIMIT for hd, nw in GPU_WARPS.items())
