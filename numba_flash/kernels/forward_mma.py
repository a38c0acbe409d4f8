"""FlashAttention forward on tensor cores: float16 or bfloat16 ``Q K^T`` and ``P V`` on
``mma.sync.m16n8k16``.

Math (as :mod:`numba_flash.kernels.forward`, the SIMT kernel)
-------------------------------------------------------------
For one ``(b, h)`` and a Q tile, per K/V tile ``j`` and per query row: ``S = scale * Q K_j^T``
(float16 or bfloat16 inputs, float32 accumulation on the tensor cores), masked and modified by
the rule of :mod:`numba_flash.kernels.visibility` (``-inf`` for a key the row does not see;
non-finite -> NaN, softcap, ALiBi for one it sees), then the online softmax in float32::

    m_new = max(m_i, rowmax(S));  alpha = exp(m_i - m_new);  P = exp(S - m_new)
    l_i = alpha l_i + rowsum(P);  acc = alpha acc + P V_j  (P rounded to the input type)

and at the end ``O = acc / l_i`` (the input type), ``lse = m_i + log(l_i)`` (float32, natural log of
the scaled scores).  Without softcap and ALiBi, ``S`` and ``m_i`` stay in raw ``q . k`` units
and ``exp(scale (x - m))`` is ``ex2(x c - m c)`` with ``c = scale log2(e)``: one FFMA and one
``ex2.approx`` per score (:func:`~numba_flash.kernels.stages.ex2`); ``lse = scale m_i +
log(l_i)``.  With them, the modified scores are in natural units and ``c = log2(e)``.

A row that sees no key ends with ``l_i = 0``: ``o = 0``, ``lse = -inf``.  A NaN score (NaN or
inf in ``q`` or in a visible ``k``) makes ``P`` and so ``l_i`` NaN: ``o`` and ``lse`` NaN.
Finding it costs one sum of the tile's raw scores per lane: only when that sum is not finite do
the scores get the per-element test (the max is a plain ``max.f32``, which skips NaN; the NaN
reaches ``l_i`` through ``P``).  Dropout multiplies the ``P`` fed to ``P V`` by
``keep / (1 - p)`` (``l_i`` and ``lse`` stay undropped); ``keep`` of element ``(b, h, i, j)``
is the Philox draw of :func:`numba_flash.dropout_mask`.

Fragments, not threads, own the tiles
-------------------------------------
Each warp owns 16 query rows.  Its ``S`` for ``BLOCK_N`` keys is ``BLOCK_N / 8`` accumulator
fragments (:mod:`numba_flash.kernels.mma`): lane ``(g, t)`` (``g = lane >> 2``, ``t = lane % 4``)
holds rows ``g`` and ``g + 8`` and, per 8-key fragment ``n``, keys ``8n + 2t`` and ``8n + 2t + 1``.
So the online softmax runs on the accumulator registers: a row's max and sum are the lane's own
values combined over the 4 lanes of its quad (two ``shfl_xor_sync``; the partial sums are
combined once, at the end, since they share ``m_i``).  ``P`` goes straight from the ``S``
registers to the ``A`` registers of ``P V`` (:func:`~numba_flash.kernels.mma.a_frag_from_c`).
Q's ``A`` fragments are read once (``ldmatrix``) and stay in registers (``HEAD_DIM / 4`` per
lane, up to ``HEAD_DIM`` 128: :data:`Q_IN_REGS_MAX`; at 256 they would spill, so Q keeps its
own shared region and is read at every k-step); K's ``B`` fragments come from ``ldmatrix.x4``
(two 8-key fragments per instruction) and V's from ``ldmatrix.x4.trans`` on the row-major V
tile (:mod:`numba_flash.kernels.stages`).

Tiles, the double buffer and the masks
--------------------------------------
K/V tiles outside the keys some row of the Q tile sees are never loaded
(:func:`~numba_flash.kernels.visibility.tile_key_range`: causal skips the upper triangle, a window
costs O(window)). The tiles run in key order; one loop body (``make_step(MASKED)``) is compiled
twice and each tile takes one: the tiles inside the keys every row sees
(:func:`~numba_flash.kernels.visibility.tile_full_range`) run the unmasked step, with no per-element
mask and no ``v`` test, the others the masked one. Each step waits for its tile's ``cp.async``
group, passes one barrier (the tile is visible to every warp, and every warp is done with the other
stage), issues the next tile's copies into the other stage and computes; so tile ``j + 1``'s copy
runs under tile ``j``'s math. Rows past ``Nk`` (``Nq`` for Q) are zero-filled by the copy.

Non-finite ``v``: a key a row does not see has ``P = 0``, but a tensor core computes ``0 * NaN
= NaN``.  In an unmasked tile every row sees every key, so the NaN is the right answer.  In a
masked tile each thread zeroes the inf / NaN halves of the V chunks it copied and the block
learns whether there were any (``syncthreads_or``, which is also the barrier before ``P V``);
if so (rare), each lane marks ``acc`` NaN where a key its row sees has a non-finite ``v[j, c]``
(read again from global memory): the reference's rule.

Grid / block
------------
grid = ``(ceil(Nq / BLOCK_M) * B * H,)`` (:func:`forward_grid`: Q tiles fastest, then the
flattened ``(b, h)``; x allows 2**31 - 1 blocks, so any ``B * H`` fits), block =
``32 * NUM_WARPS`` threads, ``BLOCK_M = 16 * NUM_WARPS``.  The kv head is ``h // (H // Hkv)``.

Shared memory (one static ``uint32`` array, rows of ``RB = 2 HEAD_DIM + 16`` bytes)
-----------------------------------------------------------------------------------
Two stages, each a K tile then a V tile of ``BLOCK_N`` rows (``2 BLOCK_N RB`` bytes); Q's
``BLOCK_M`` rows sit in stage 1 until their fragments are in registers (the first barrier of the
loop frees it). In total ``max(4 BLOCK_N, 2 BLOCK_N + BLOCK_M) RB`` bytes, or ``(4 BLOCK_N +
BLOCK_M) RB`` when Q stays in shared memory (:func:`shared_bytes`), at most 48 KiB for every tile
choice of :data:`GPU_TILES`. The 16-byte pad of each row puts the 8 rows of an ``ldmatrix`` in
distinct banks. Inputs are read as their 16-bit patterns (``uint16`` views); with ``d ==
HEAD_DIM`` and 16-byte aligned tensors by ``cp.async`` (16 bytes per instruction), else by 16-bit
loads (zero-padded columns): a compile-time choice (``VEC``, :func:`vector_copies`), so the fast
build has no fallback code.

Element type (``DTYPE``, compile time: ``"float16"`` or ``"bfloat16"``)
----------------------------------------------------------------------
The kernel source is one for both: the copies move bits, and the element type picks the
tensor-core instruction and the float32-to-pair pack (:func:`~numba_flash.kernels.mma.mma_ops`:
``mma...f32.f16.f16.f32`` with ``cvt.rn.f16x2.f32``, or ``...f32.bf16.bf16.f32`` with
``cvt.rn.bf16x2.f32``, sm_80+), the exponent bits of the non-finite ``v`` rule
(:data:`~numba_flash.kernels.stages.EXP_BITS`) and the store of ``o``
(:func:`~numba_flash.kernels.elements.element_ops`: bfloat16 ``o`` is its uint16 words,
rounded to nearest even).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, types, uint32

from ..backend import on_simulator
from ..philox import philox_keep_bits4
from .common import FULL_MASK, GRID_X_MAX, HEAD_DIMS, SMEM_LIMIT, log_tile, padded_head_dim
from .elements import element_ops
from .jit import device_jit, kernel_jit
from .mma import make_a_frag_from_c, mma_ops, quad_sum
from .stages import (EXP_BITS, LOG2E, cp_async_commit, cp_async_wait_all, ex2, fma, fmax,
                     ldmatrix_x4, ldmatrix_x4_trans, make_tile_copy, make_tile_scan, row_bytes)
from .visibility import (BLOCK_FULL, key_bounds, make_next_tile, make_score_mod, make_tile_kind,
                         tile_full_range, tile_key_range)

#: GPU tiles per padded head dim: ``(NUM_WARPS, BLOCK_N)``; ``BLOCK_M = 16 * NUM_WARPS``.
GPU_TILES = {16: (4, 64), 32: (4, 64), 64: (4, 64), 128: (4, 32), 256: (1, 16)}

#: Q's A fragments stay in registers up to this head dim (at 256 they would spill: Q stays in
#: its own shared-memory region and is read by ldmatrix at each k-step)
Q_IN_REGS_MAX = 128

#: simulator tiles: one warp (32 Python threads) and 16 keys per tile
SIM_TILES = (1, 16)

#: the element types of the tensor-core forward (``DTYPE``)
MMA_DTYPES = ("float16", "bfloat16")


def shared_bytes(NUM_WARPS, BLOCK_N, HEAD_DIM):
    """Static shared memory of one block (the budget in the module docstring)."""
    if HEAD_DIM <= Q_IN_REGS_MAX:  # Q shares stage 1 until its fragments are in registers
        return max(4 * BLOCK_N, 2 * BLOCK_N + 16 * NUM_WARPS) * row_bytes(HEAD_DIM)
    return (4 * BLOCK_N + 16 * NUM_WARPS) * row_bytes(HEAD_DIM)


def vector_copies(d, head_dim, *arrays):
    """The ``VEC`` build: ``d == head_dim`` and every array's data 16-byte aligned (the
    ``cp.async`` path; on the simulator alignment does not matter)."""
    if d != head_dim:
        return False
    if on_simulator():
        return True
    return all(x.__cuda_array_interface__["data"][0] % 16 == 0 for x in arrays)


def default_tiles(head_dim, simulator=None):
    """``(NUM_WARPS, BLOCK_N, HEAD_DIM)`` for a head dim ``d`` (1..256) on this backend."""
    if simulator is None:
        simulator = on_simulator()
    hd = padded_head_dim(head_dim)
    nw, bn = SIM_TILES if simulator else GPU_TILES[hd]
    return nw, bn, hd


def forward_grid(nq, b, h, block_m):
    """The 1-D launch grid: ``ceil(Nq / BLOCK_M) * B * H`` blocks (ValueError past 2**31 - 1)."""
    n = -(-nq // block_m) * b * h
    if n > GRID_X_MAX:
        raise ValueError(f"q: {n} blocks of {block_m} query rows exceed the grid limit "
                         f"{GRID_X_MAX} (B * H * ceil(Nq / {block_m}))")
    return (max(1, n),)


@functools.lru_cache(maxsize=None)
def forward_mma_kernel(NUM_WARPS, BLOCK_N, HEAD_DIM, DROPOUT=False, SOFTCAP=False, ALIBI=False,
                       VEC=True, DTYPE="float16", USER=None):
    """Build ``kernel(q, k, v, o, lse, scale, window, mods, alibi, dropout, user)``.

    ``q``, ``k``, ``v``: uint16 views of the ``DTYPE`` (``"float16"`` or ``"bfloat16"``)
    ``[B, H(kv), N, d]`` inputs (C-contiguous); ``o`` float16, or uint16 words for bfloat16;
    ``lse`` float32.  ``scale`` float32; ``window = (left, right)`` int32 (causal
    folded in, :func:`~numba_flash.kernels.visibility.window_bounds`); ``mods = (softcap,
    1 / softcap)`` float32 (used with ``SOFTCAP``); ``alibi`` float32 ``[B, H]`` (read with
    ``ALIBI``); ``dropout`` ``()`` or ``(seed_lo, seed_hi, threshold, keep_scale)`` (with
    ``DROPOUT``).  ``VEC``: ``d == HEAD_DIM`` and 16-byte aligned ``q``, ``k``, ``v``
    (:func:`vector_copies`): tiles move by ``cp.async``; else by 16-bit loads.

    ``USER``: ``None``, or a user's variant (:mod:`numba_flash.flex`) as ``(score_mod,
    mask_mod, BLOCKS)``: CUDA device functions or None, and ``(Q_BLOCK, KV_BLOCK)`` of a block
    mask or None.  Then ``user = (kinds,) + aux_tensors`` (``kinds``: the block mask's int8
    classification ``[B or 1, H or 1, q blocks, kv blocks]``, read only with ``BLOCKS``);
    without it ``user = ()`` adds no kernel parameter and no instruction.  ``mask_mod`` runs on
    every tile a block mask calls PARTIAL (on every tile without one), ``score_mod`` on every
    visible score, both only for rows ``< Nq`` and keys ``< Nk`` (so a user's aux indexing
    never sees a padding position); EMPTY tiles are never loaded.
    """
    assert HEAD_DIM % 16 == 0 and BLOCK_N % 16 == 0
    assert DTYPE in MMA_DTYPES
    mma, _pack2 = mma_ops(DTYPE)            # the element type's mma.sync
    a_frag_from_c = make_a_frag_from_c(DTYPE)  # P into A registers, rounded to DTYPE
    store = element_ops(DTYPE)[1]           # o's elements
    EXP_MASK = EXP_BITS[DTYPE]              # exponent bits: all ones = inf or NaN
    BLOCK_M = 16 * NUM_WARPS
    THREADS = 32 * NUM_WARPS
    RB = row_bytes(HEAD_DIM)        # bytes of a padded shared row (Q, K or V)
    KV_BYTES = BLOCK_N * RB         # one K (or V) tile
    STAGE_BYTES = 2 * KV_BYTES      # one stage of the double buffer: K, then V
    SMEM_WORDS = shared_bytes(NUM_WARPS, BLOCK_N, HEAD_DIM) // 4
    N_FRAGS = BLOCK_N // 8          # S fragments per warp (8 keys each)
    D_FRAGS = HEAD_DIM // 8         # acc fragments per warp (8 output columns each)
    K_STEPS = HEAD_DIM // 16        # mma steps of S = Q K^T (Q's A fragments, in registers)
    P_STEPS = BLOCK_N // 16         # mma steps of P V
    user_score, user_mask, BLOCKS = USER if USER is not None else (None, None, None)
    SCORE_MOD = user_score is not None  # compile time: the user's functions are in the build
    MASK_MOD = user_mask is not None
    MODS = SOFTCAP or ALIBI or SCORE_MOD  # scores need per-element work even on unmasked tiles
    Q_IN_REGS = HEAD_DIM <= Q_IN_REGS_MAX
    Q_BYTE = STAGE_BYTES if Q_IN_REGS else 2 * STAGE_BYTES  # where Q's tile sits
    NEG_INF = float32(-math.inf)
    INF = float32(math.inf)
    NAN = float32(math.nan)
    ZERO = float32(0.0)
    ONE = float32(1.0)
    LOG2E_F = float32(LOG2E)
    score_mod = make_score_mod(SOFTCAP, ALIBI, float32)
    copy_kv = make_tile_copy(BLOCK_N, HEAD_DIM, RB, THREADS, VEC)
    copy_q = make_tile_copy(BLOCK_M, HEAD_DIM, RB, THREADS, VEC)
    zero_nonfinite_v = make_tile_scan(BLOCK_N, HEAD_DIM, RB, THREADS, DTYPE)

    @device_jit(own_module=True, inline=True)
    def load_kv(smem, stage_byte, k, v, kv_base, k_start, nk, d, tid):
        """Issue the copies of K/V rows ``k_start ..`` into the stage at ``stage_byte``."""
        rows = min(BLOCK_N, nk - k_start)
        base = kv_base + k_start * d
        copy_kv(smem, stage_byte, k, base, rows, d, tid)
        copy_kv(smem, stage_byte + KV_BYTES, v, base, rows, d, tid)

    @device_jit(own_module=True, inline=True)
    def sees(b, h, row, key, nq, umask, user):
        """The user's mask_mod for a key inside the row's causal / window bounds (True
        without one)."""
        if MASK_MOD and umask:
            return row < nq and user_mask(b, h, row, key, *user[1:])
        return True

    # the block mask's verdict per K/V tile and its walk (visibility.py), built only with one
    tile_kind = make_tile_kind(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None
    next_tile = make_next_tile(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None

    def make_step(MASKED):
        """One K/V tile; ``MASKED`` (compile time): the tile is not inside the keys every row
        of the Q tile sees, so scores get the per-element mask and ``v`` the non-finite rule."""

        @device_jit(own_module=True, inline=True)
        def step(kt, kt_next, stage, t_hi, smem, kv, frags, lanes, rows, sc, drop, user, umask):
            k, v, kv_base, nk, d, b, hk = kv
            qf, s, acc, m_i, l_i = frags
            tid, t, a_off, b_off, v_off = lanes
            row0, lo0, hi0, lo1, hi1, offset = rows
            scale, exp_scale, softcap, inv_softcap, slope = sc
            h, nq, seed_lo, seed_hi, threshold, keep_scale = drop
            k_start = kt * BLOCK_N
            kb = stage * STAGE_BYTES                      # this tile's stage
            cp_async_wait_all()
            cuda.syncthreads()  # tile kt landed for all threads; all warps are done with kt - 1
            if kt_next < t_hi:  # the next tile's copy runs under this tile's math
                load_kv(smem, STAGE_BYTES - kb, k, v, kv_base, kt_next * BLOCK_N, nk, d, tid)
                cp_async_commit()

            # [docs:mma-s]
            # -- S = Q K^T: Q's A fragments from registers, K's B fragments by ldmatrix (two
            # 8-key fragments per x4)
            for n in range(N_FRAGS):
                for e in range(4):
                    s[n, e] = ZERO
            for kc in range(K_STEPS):
                if Q_IN_REGS:
                    a0, a1, a2, a3 = qf[kc, 0], qf[kc, 1], qf[kc, 2], qf[kc, 3]
                else:
                    a0, a1, a2, a3 = ldmatrix_x4(smem, a_off + 32 * kc)
                for p in range(N_FRAGS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4(smem, kb + b_off + 16 * p * RB + 32 * kc)
                    n = 2 * p
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma(
                        a0, a1, a2, a3, b0, b1, s[n, 0], s[n, 1], s[n, 2], s[n, 3])
                    n = 2 * p + 1
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma(
                        a0, a1, a2, a3, b2, b3, s[n, 0], s[n, 1], s[n, 2], s[n, 3])
            # [/docs:mma-s]

            # [docs:mma-scores]
            # -- scores: raw q.k (exp_scale = scale log2 e) or, with softcap / ALiBi, scaled
            # and modified (exp_scale = log2 e); masked tiles set unseen keys to -inf
            if MODS:
                for n in range(N_FRAGS):
                    for e in range(4):
                        key = k_start + 8 * n + 2 * t + (e & 1)
                        row = row0 + 8 * (e >> 1)
                        lo = lo0 if e < 2 else lo1
                        hi = hi0 if e < 2 else hi1
                        if MASKED and not (lo <= key and key < hi):
                            s[n, e] = NEG_INF
                        elif (SCORE_MOD or MASK_MOD) and row >= nq:
                            s[n, e] = NEG_INF  # a padding row: the user's code never sees it
                        elif MASK_MOD and umask and not user_mask(b, h, row, key, *user[1:]):
                            s[n, e] = NEG_INF
                        else:
                            x = score_mod(s[n, e] * scale, row, key, offset, softcap,
                                          inv_softcap, slope)
                            if SCORE_MOD:  # the user's score_mod, after scale/softcap/ALiBi
                                x = user_score(x, b, h, row, key, *user[1:])
                            s[n, e] = x
            else:
                total = ZERO
                for n in range(N_FRAGS):
                    for e in range(4):
                        total += s[n, e]
                if not abs(total) < INF:   # rare: an inf / NaN score (in q or k) -> NaN
                    for n in range(N_FRAGS):
                        for e in range(4):
                            if not abs(s[n, e]) < INF:
                                s[n, e] = NAN
                if MASKED:
                    for n in range(N_FRAGS):
                        for e in range(4):
                            key = k_start + 8 * n + 2 * t + (e & 1)
                            lo = lo0 if e < 2 else lo1
                            hi = hi0 if e < 2 else hi1
                            if not (lo <= key and key < hi):
                                s[n, e] = NEG_INF
                            elif MASK_MOD and umask:  # the user's mask_mod (a PARTIAL tile)
                                row = row0 + 8 * (e >> 1)
                                if row >= nq or not user_mask(b, h, row, key, *user[1:]):
                                    s[n, e] = NEG_INF
            # [/docs:mma-scores]

            # [docs:mma-softmax]
            # -- online softmax on the fragments: rows g (e = 0, 1) and g + 8 (e = 2, 3);
            # exp(x - m) = ex2(x exp_scale - m exp_scale): one FFMA and one MUFU.EX2
            for r in range(2):
                mx = NEG_INF
                for n in range(N_FRAGS):
                    mx = fmax(mx, fmax(s[n, 2 * r], s[n, 2 * r + 1]))
                mx = fmax(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 1))   # over the row's 4 lanes
                mx = fmax(mx, cuda.shfl_xor_sync(FULL_MASK, mx, 2))
                m_new = fmax(m_i[r], mx)
                m_use = m_new if m_new != NEG_INF else ZERO    # no visible key yet: exp vs 0
                neg_m = -(m_use * exp_scale)
                alpha = ex2(fma(m_i[r], exp_scale, neg_m))
                m_i[r] = m_new
                row_sum = ZERO
                for n in range(N_FRAGS):
                    for e in range(2 * r, 2 * r + 2):
                        p = ex2(fma(s[n, e], exp_scale, neg_m))
                        s[n, e] = p
                        row_sum += p
                l_i[r] = alpha * l_i[r] + row_sum              # this lane's part of the row
                for n in range(D_FRAGS):
                    for e in range(2 * r, 2 * r + 2):
                        acc[n, e] *= alpha
            # [/docs:mma-softmax]

            if DROPOUT:
                # -- P * keep / (1 - p) for P V: one Philox call per row and fragment covers the
                # lane's 2 keys (8n + 2t is even, so both lie in one group of 4)
                for n in range(N_FRAGS):
                    key = k_start + 8 * n + 2 * t
                    for r in range(2):
                        row = row0 + 8 * r
                        bits = 0
                        if row < nq and key < nk:
                            bits = philox_keep_bits4(seed_lo, seed_hi, b, h, row, key >> 2,
                                                     threshold) >> (key & 3)
                        for e in range(2):
                            if (bits >> e) & 1:
                                s[n, 2 * r + e] *= keep_scale
                            else:
                                s[n, 2 * r + e] = ZERO

            v_bad = 0
            if MASKED:
                # a key a row does not see has P = 0, but 0 * NaN = NaN on the tensor cores:
                # each thread zeroes the inf / NaN halves of the V chunks it copied
                v_bad = cuda.syncthreads_or(
                    1 if zero_nonfinite_v(smem, kb + KV_BYTES, tid) else 0)  # zeroed V for all

            # [docs:mma-pv]
            # -- acc += P V: two S fragments are one A fragment of P; V's B fragments by
            # ldmatrix.trans from the row-major tile (two 8-column fragments per x4)
            for kk in range(P_STEPS):
                a0, a1, a2, a3 = a_frag_from_c(s, 2 * kk, 2 * kk + 1)
                for dp in range(D_FRAGS // 2):
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, kb + v_off + 16 * kk * RB + 32 * dp)
                    n = 2 * dp
                    acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma(
                        a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
                    n = 2 * dp + 1
                    acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma(
                        a0, a1, a2, a3, b2, b3, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
            # [/docs:mma-pv]

            if MASKED and v_bad:
                # -- rare: a non-finite v[j, c] of a key j the row sees makes o[i, c] NaN (the
                # reference's rule); read from global memory, where it is still inf / NaN
                for j in range(min(BLOCK_N, nk - k_start)):
                    key = k_start + j
                    for n in range(D_FRAGS):
                        for e in range(2):
                            c = 8 * n + 2 * t + e
                            if c < d and (v[b, hk, key, c] & EXP_MASK) == EXP_MASK:
                                if lo0 <= key and key < hi0 and sees(b, h, row0, key, nq,
                                                                     umask, user):
                                    acc[n, e] = NAN
                                if lo1 <= key and key < hi1 and sees(b, h, row0 + 8, key, nq,
                                                                     umask, user):
                                    acc[n, 2 + e] = NAN

        return step

    step_masked = make_step(True)
    step_full = make_step(False)

    LOG = on_simulator()  # compile time: the tile log exists only in the simulator

    # a user's functions stay out of the on-disk kernel cache (their code is not in this
    # package's sources, which key it): such a build is compiled in each process
    @kernel_jit(cache=USER is None)
    def flash_forward_mma(q, k, v, o, lse, scale, window, mods, alibi, dropout, user):
        # -- which block, warp and lane
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2                 # the lane's rows g and g + 8 of the warp's 16
        t = lane & 3                  # the lane's key / column pair 2t, 2t + 1 in each fragment
        n_heads = q.shape[1]
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]
        n_qt = (nq + BLOCK_M - 1) // BLOCK_M
        bh = cuda.blockIdx.x // n_qt
        b = bh // n_heads
        h = bh % n_heads
        hk = h // (n_heads // k.shape[1])  # GQA: query head h reads kv head h // group
        q_start = (cuda.blockIdx.x % n_qt) * BLOCK_M
        q_end = min(q_start + BLOCK_M, nq)
        offset = nk - nq                   # bottom-right alignment of queries against keys
        left, right = window
        softcap, inv_softcap = mods
        slope = ZERO
        if ALIBI:
            slope = alibi[b, h]
        seed_lo, seed_hi, threshold, keep_scale = 0, 0, 0, ONE
        if DROPOUT:
            seed_lo, seed_hi, threshold, keep_scale = dropout
        row0 = q_start + 16 * warp + g     # the lane's two query rows
        lo0, hi0 = key_bounds(row0, offset, nk, left, right)  # the keys [lo, hi) each row sees
        lo1, hi1 = key_bounds(row0 + 8, offset, nk, left, right)
        # scores stay in raw q.k units without modifiers (scale folded into the exponent)
        exp_scale = LOG2E_F if MODS else scale * LOG2E_F
        lse_scale = ONE if MODS else scale

        smem = cuda.shared.array(SMEM_WORDS, uint32)
        qf = cuda.local.array((K_STEPS, 4), uint32)
        s = cuda.local.array((N_FRAGS, 4), float32)
        acc = cuda.local.array((D_FRAGS, 4), float32)
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)

        # -- this lane's ldmatrix rows (stages.ldmatrix_rows): Q's A fragments (Q sits in
        # stage 1 until the loop starts, or in its own region), K's B, V's B (.trans)
        mat = lane >> 3
        r8 = lane & 7
        a_off = Q_BYTE + (16 * warp + r8 + 8 * (mat & 1)) * RB + 16 * (mat >> 1)
        b_off = (r8 + 8 * (mat >> 1)) * RB + 16 * (mat & 1)
        v_off = KV_BYTES + (r8 + 8 * (mat & 1)) * RB + 16 * (mat >> 1)

        kv_lo, kv_hi = tile_key_range(q_start, q_end, offset, nk, left, right)
        full_lo, full_hi = tile_full_range(q_start, q_end, offset, nk, left, right)
        t_lo = int32(kv_lo // BLOCK_N)
        t_hi = int32((kv_hi + BLOCK_N - 1) // BLOCK_N)
        f_lo = int32(min(max((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi))
        f_hi = int32(min(max(full_hi // BLOCK_N, f_lo), t_hi))  # unmasked tiles: [f_lo, f_hi)
        kv_base = (b * k.shape[1] + hk) * nk * d

        # -- prologue: Q (into stage 1 or its own region), the first K/V tile into stage 0,
        # one copy group
        q_base = ((b * n_heads + h) * nq + q_start) * d
        copy_q(smem, Q_BYTE, q, q_base, q_end - q_start, d, tid)
        kt0 = t_lo
        if BLOCKS is not None:  # a block mask: EMPTY tiles are never loaded
            kt0 = next_tile(user[0], b, h, q_start, q_end, t_lo, t_hi, nk)
        if kt0 < t_hi:
            load_kv(smem, 0, k, v, kv_base, kt0 * BLOCK_N, nk, d, tid)
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()  # Q's tile is complete before any warp reads its fragments
        if Q_IN_REGS:
            for kc in range(K_STEPS):
                qf[kc, 0], qf[kc, 1], qf[kc, 2], qf[kc, 3] = ldmatrix_x4(smem, a_off + 32 * kc)
        for r in range(2):
            m_i[r] = NEG_INF
            l_i[r] = ZERO
        for n in range(D_FRAGS):
            for e in range(4):
                acc[n, e] = ZERO

        # -- the K/V tiles in key order; the step is compiled masked and unmasked
        kv = (k, v, kv_base, nk, d, b, hk)
        frags = (qf, s, acc, m_i, l_i)
        lanes = (tid, t, a_off, b_off, v_off)
        rows = (row0, lo0, hi0, lo1, hi1, offset)
        sc = (scale, exp_scale, softcap, inv_softcap, slope)
        drop = (h, nq, seed_lo, seed_hi, threshold, keep_scale)
        if BLOCKS is None:
            for kt in range(t_lo, t_hi):
                if LOG and tid == 0:
                    log_tile(b, h, q_start, kt)
                stage = (kt - t_lo) & 1
                if f_lo <= kt and kt < f_hi and not MASK_MOD:  # every row sees it: no mask
                    step_full(kt, kt + 1, stage, t_hi, smem, kv, frags, lanes, rows, sc, drop,
                              user, False)
                else:
                    step_masked(kt, kt + 1, stage, t_hi, smem, kv, frags, lanes, rows, sc,
                                drop, user, True)
        else:  # visit the tiles the block mask does not call EMPTY, in key order
            kt = kt0
            stage = 0
            while kt < t_hi:
                if LOG and tid == 0:
                    log_tile(b, h, q_start, kt)
                kind = tile_kind(user[0], b, h, q_start, q_end, kt, nk)
                kt_next = next_tile(user[0], b, h, q_start, q_end, kt + 1, t_hi, nk)
                if f_lo <= kt and kt < f_hi and kind == BLOCK_FULL:  # inside the bounds: no mask
                    step_full(kt, kt_next, stage, t_hi, smem, kv, frags, lanes, rows, sc, drop,
                              user, False)
                else:
                    step_masked(kt, kt_next, stage, t_hi, smem, kv, frags, lanes, rows, sc,
                                drop, user, kind == 1)
                kt = kt_next
                stage ^= 1

        # -- epilogue: l = the quad's partial sums; o = acc / l, lse = m + log(l) (natural log
        # of the scaled scores: m is in raw units, times lse_scale)
        for r in range(2):
            row = row0 + 8 * r
            l_row = quad_sum(l_i[r])
            if l_row > ZERO:
                inv_l = ONE / l_row
                row_lse = m_i[r] * lse_scale + math.log(l_row)
            elif l_row == ZERO:   # no visible key: o = 0, lse = -inf
                inv_l = ZERO
                row_lse = NEG_INF
            else:                 # NaN: a non-finite score in the row
                inv_l = NAN
                row_lse = NAN
            if row < nq:
                for n in range(D_FRAGS):
                    for e in range(2):
                        c = 8 * n + 2 * t + e
                        if c < d:
                            o[b, h, row, c] = store(acc[n, 2 * r + e] * inv_l)
                if t == 0:
                    lse[b, h, row] = row_lse

    return flash_forward_mma


def compile_configs():
    """A representative set for the compile tier (the flags multiply: 5 head dims x dropout x
    softcap x ALiBi = 40 kernels would take minutes): every head dim plain, every flag at once
    at 128 and 256 (the largest register and shared-memory footprints), and the 16-bit-load
    build (``ld16``: ``d < HEAD_DIM`` or unaligned inputs) at 64 and, with every flag, 128.
    Causal and windows are runtime arguments: every configuration covers them.  bfloat16 (the
    same source with the bf16 mma, pack, exponent bits and store): D64 plain and D128 with every
    flag."""
    u16 = types.Array(types.uint16, 4, "C")
    f16 = types.Array(types.float16, 4, "C")
    lse_t = types.Array(types.float32, 3, "C")
    window_t = types.UniTuple(types.int32, 2)
    mods_t = types.UniTuple(types.float32, 2)
    alibi_t = types.Array(types.float32, 2, "C")
    drop_t = types.Tuple((types.uint32, types.uint32, types.uint32, types.float32))
    plan = [(hd, False, False, False, True, "float16") for hd in HEAD_DIMS]
    plan += [(128, True, True, True, True, "float16"), (256, True, True, True, True, "float16")]
    plan += [(64, False, False, False, False, "float16"),
             (128, True, True, True, False, "float16")]
    plan += [(64, False, False, False, True, "bfloat16"),
             (128, True, True, True, True, "bfloat16")]
    yield from _user_configs(u16, f16, lse_t, window_t, mods_t, alibi_t)
    for hd, dropout, softcap, alibi, vec, dtype in plan:
        nw, bn = GPU_TILES[hd]
        flags = "".join(f" {n}" for n, f in (("dropout", dropout), ("softcap", softcap),
                                              ("alibi", alibi), ("ld16", not vec)) if f)
        o_t = f16 if dtype == "float16" else u16  # bfloat16 o: its uint16 words
        yield {
            "name": f"forward_mma W{nw} M{16 * nw} N{bn} D{hd}{flags} {dtype}",
            "kernel": forward_mma_kernel(nw, bn, hd, dropout, softcap, alibi, vec, dtype),
            "args": (u16, u16, u16, o_t, lse_t, types.float32, window_t, mods_t, alibi_t,
                     drop_t if dropout else types.Tuple(()), types.Tuple(())),
            "float64_ok": False,
            "mma": True,
            # one K/V tile per warp: Q K^T and P V, (BLOCK_N / 8) (HEAD_DIM / 16) mma each
            "sass": {"expect_mma": 2 * (bn // 8) * (hd // 16)},
        }


assert all(shared_bytes(nw, bn, hd) <= SMEM_LIMIT for hd, (nw, bn) in GPU_TILES.items())


def _user_configs(u16, f16, lse_t, window_t, mods_t, alibi_t):
    """A user's variant (:mod:`numba_flash.flex.examples`: a relative-position bias score_mod and
    a document mask_mod with a block mask) at D64, float16: the device build of user functions
    called with ``*aux`` (the plain rows above are the ``score_mod=None`` build)."""
    from ..flex.examples import document_mask, relative_bias
    from ..flex.functions import device_function

    def biased(score, b, h, q_idx, kv_idx, bias, doc):  # every function gets every aux array
        return relative_bias(score, b, h, q_idx, kv_idx, bias)

    def documents(b, h, q_idx, kv_idx, bias, doc):
        return document_mask(b, h, q_idx, kv_idx, doc)

    nw, bn = GPU_TILES[64]
    user = (device_function(biased), device_function(documents), (128, 128))
    user_t = types.Tuple((types.Array(types.int8, 4, "C"), types.Array(types.float32, 2, "C"),
                          types.Array(types.int32, 2, "C")))
    yield {
        "name": f"forward_mma W{nw} M{16 * nw} N{bn} D64 score_mod mask_mod block_mask float16",
        "kernel": forward_mma_kernel(nw, bn, 64, False, False, False, True, "float16", user),
        "args": (u16, u16, u16, f16, lse_t, types.float32, window_t, mods_t, alibi_t,
                 types.Tuple(()), user_t),
        "float64_ok": False,
        "mma": True,
        "sass": {"expect_mma": 2 * (bn // 8) * (64 // 16)},
    }
