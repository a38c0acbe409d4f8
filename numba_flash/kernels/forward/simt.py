"""FlashAttention forward on SIMT cores: one thread block per Q tile, K/V tiles streamed through
shared memory, a register micro-tile per thread.

Contract (:func:`numba_flash.reference.attention`): per ``(b, h)`` and query row ``i``, ``o_i =
softmax(s_i) V`` and ``lse_i = m_i + log l_i`` over the keys the row sees, ``s`` the one score of
:mod:`numba_flash.kernels.mainloop.visibility` (``make_score``: ``(q . k) * scale``, non-finite
-> NaN, then softcap and ALiBi in the ``SCORE_MOD`` build, then a user's ``score_mod``), which
the backward recomputes bit for bit; a learnable sink (``va.sink``) is one more term of ``l``.
A row that sees no key gets ``o = 0``, ``lse = -inf``; a NaN score makes its ``o``, ``lse`` NaN.
Dropout multiplies the ``P`` of ``P V`` by ``keep / (1 - p)``, ``keep`` exactly
``numba_flash.dropout_mask(seed, B, H, Nq, Nk, p)`` (varlen: indices within the sequence), drawn
tile by tile, never stored; ``lse`` stays undropped.

:func:`forward_kernel` ``(cfg)`` builds ``kernel(q, k, v, o, lse, va, seqs)`` for a
:class:`~numba_flash.kernels.forward.config.ForwardSimtConfig`: compile-time ``BLOCK_M``,
``BLOCK_N``, ``HEAD_DIM`` (16/32/64/128/256), the dtype, ``THREADS_M x THREADS_N`` and the flags
``DROPOUT``, ``SCORE_MOD``, ``VARLEN``, ``PAGED``, ``USER``, ``VEC`` (``cp.async`` copies),
``OWN_V`` (``v``, ``o`` of ``d_v`` columns).  The window ``(left, right)`` (causal: ``right =
0``), softcap and ALiBi slopes are run time (``va``).  Layouts: ``q [B, H, Nq, d]``, ``k``/``v
[B, Hkv, Nk, d]`` (kv head ``h // (H // Hkv)``); ``VARLEN``: ``q [total_q, H, d]``, ``k``/``v
[total_k, Hkv, d]``, ``lse [H, total_q]``, sequence ``b`` the rows ``cu_seqlens[b]:cu_seqlens[b
+ 1]``; ``PAGED`` (varlen only): ``k``/``v`` caches ``[num_blocks, Hkv, block_size, d]`` read as
``[num_blocks * Hkv * block_size, d]`` views of their memory, key ``t`` of sequence ``b`` at slot
``s = t % block_size`` of block ``n = block_table[b, t // block_size]``, memory row ``n
strides[0] + hk strides[1] + s strides[2]`` (the cache's memory order's row strides, launch
parameters: heads-first ``(Hkv block_size, block_size, 1)``, flash-attn's tokens-first
``(block_size Hkv, 1, Hkv)``, frontend/cache_args.row_strides); an entry outside ``[0, num_blocks)``
makes that key's ``k`` NaN and ``v`` 0, without a read.  float16 and bfloat16 compute in
float32, float64 in float64 (:mod:`~numba_flash.kernels.core.elements`); ``lse`` is stored in
the compute type.

Grid ``(ceil(Nq / BLOCK_M), y, z)`` (:func:`forward_grid`, ``bh = blockIdx.z * gridDim.y +
blockIdx.y``), block ``(THREADS_N, THREADS_M)``: thread ``(tx, ty)`` owns rows ``ty + i
THREADS_M``, score columns ``tx + j THREADS_N`` and the 16-byte chunks ``tx + c THREADS_N`` of
``acc``.  Shared memory (at most 48 KiB): ``q_tile``, ``k_tile`` (rows padded by one chunk),
``v_tile``, ``p_tile`` (rows padded by ``P_PAD``), dropout's ``keep_tile``, paged ``page_sh``.

File: the stage factories (loads, products, P stages, rows, per-tile step), :func:`forward_kernel`,
:func:`forward_grid`, the compile tier's names, argument types and selections; tile tables,
launch bounds and ``shared_bytes``: kernels/forward/config.py.  Derivation, thread mapping, pads,
copies, barriers, ptxas figures: docs/optimised-forward.md; masks and variants:
docs/causal-tiles.md, docs/variants.md; dropout: docs/dropout.md; paged: docs/paged-attention.md.
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

import numpy as np
from numba import cuda, int32, types, uint32

from ...backend import on_simulator
from ...philox import philox_keep_bits4
from ..core.common import (
    GRID_YZ_MAX, acc_dtype, clamp_rows, compute_type, log_tile, make_elem_strides,
    make_packed_strides, numba_array_type,
)
from ..ptx.stages import (
    cp_async16, cp_async_commit, cp_async_wait_all, cp_async_wait_one, lds16, load_at,
    make_row_dot,
)
from ..core.elements import element_ops, kernel_dtype
from ..core.jit import device_jit, kernel_jit
from ..mainloop.online_softmax import EpilogueRows, make_epilogue, make_online_softmax, sink_of
from ..mainloop.tile_scores import Layout, make_score_args, make_score_fn, make_tile_scores_pair
from ..core.variant import variant_type
from ..mainloop.visibility import (
    BLOCK_EMPTY, BLOCK_PARTIAL, key_bounds, make_tile_kind, tile_full_range, tile_key_range,
    tile_needs_mask,
)
from .config import VEC_BYTES, jit_options, launch_bounds


_device = functools.partial(device_jit, inline=True)


#: a stage of the kernel, called only from this module's kernels: in the simulator the Python
#: function itself even where it reads ``cuda`` (``cuda.local.array``), see ``device_jit``
_stage = functools.partial(device_jit, own_module=True)

# -- the contexts the step reads by name
#: the block's shared tiles (``page_sh``: the cache rows of a paged tile's keys)
ForwardTiles = namedtuple("ForwardTiles", "q_tile k_tile v_tile p_tile keep_tile page_sh")
#: where the K/V tiles come from: the arrays, the flat element of row 0 and the row stride,
#: ``d``, the bounds ``(nk, left, right)``, the paged cache (:data:`PagedKv`, or ``()``), the
#: last tile, and V's ``(elem0, row, d_v)``
KvSource = namedtuple("KvSource", "k v kv_elem0 kv_row d bounds paged kt_end v_at")
#: a paged cache: the block table, block size, its row strides ``(block, head, slot)``, blocks,
#: this block's kv head
PagedKv = namedtuple("PagedKv", "block_table block_size row_strides n_blocks hk")
#: the thread's register arrays: S, the output accumulator, a V row, m_i, l_i
ForwardFrags = namedtuple("ForwardFrags", "s acc vr m_i l_i")



#: the SIMT forward's tile loads (:func:`make_simt_loads`)
SimtLoads = namedtuple("SimtLoads", "page_rows copy_q copy_k copy_v")


@functools.lru_cache(maxsize=None)
def make_simt_loads(cfg):
    """The SIMT forward's copies into shared memory (:data:`SimtLoads`): ``page_rows`` (a paged
    tile's cache rows) and ``copy_q`` / ``copy_k`` / ``copy_v`` (``make_copy_rows``)."""
    BLOCK_M, BLOCK_N, HEAD_DIM, THREADS = cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS
    VEC, PAGED, W, VW, CH = cfg.VEC, cfg.PAGED, cfg.WORD, cfg.VW, cfg.CH
    K_STRIDE = cfg.K_STRIDE
    dtype = cfg.np_dtype
    acc_t = compute_type(dtype)
    # the element-type stage (kernels/core/elements.py): q, k, v elements in
    load = element_ops(dtype)[0]

    @_device
    def page_rows(page_sh, block_table, b, hk, k_start, nk, block_size, row_strides, n_blocks,
                  tid):
        """PAGED: ``page_sh[r]`` = the row of key ``k_start + r`` in the ``[num_blocks * Hkv *
        block_size, d]`` view of the cache's memory (``row_strides``: ``(block, head, slot)``
        rows, int32, in its memory order), or -1 where its table entry is outside ``[0,
        num_blocks)`` or past the table (never dereferenced); keys past ``nk`` are not loaded at
        all.  One lookup (a 32-bit division, one table read) per key row of the tile, 32-bit
        indices."""
        for r in range(tid, BLOCK_N, THREADS):
            key = int32(k_start + r)
            row = int32(-1)
            if key < nk:
                # token key is in table column j_blk at slot key - j_blk * block_size
                # (unsigned: a 32-bit division)
                j_blk = int32(uint32(key) // uint32(block_size))
                if j_blk < block_table.shape[1]:
                    entry = block_table[uint32(b), uint32(j_blk)]
                    if 0 <= entry and entry < n_blocks:
                        row = int32(entry * row_strides[0] + int32(hk) * row_strides[1]
                                    + (key - j_blk * block_size) * row_strides[2])
            page_sh[r] = row

    def make_copy_rows(N_ROWS, STRIDE, PAGED_ROWS):
        """``copy_rows(tile, x, elem0, row_stride, rows_valid, d, page_sh, bad, tid)``: rows
        ``0 .. N_ROWS-1`` of a tile into ``tile[r, 0:HEAD_DIM]`` (row length ``STRIDE``).  Row
        ``r`` is the ``d`` elements of ``x``'s flat view from ``elem0 + r * row_stride``
        (``PAGED_ROWS``: from ``page_sh[r] * d``, and a row -1 is filled with ``bad``, nothing
        read); rows ``>= rows_valid`` and columns ``>= d`` are zeros.  Thread ``tid`` copies the
        16-byte chunks ``tid, tid + THREADS, ...`` (chunk ``idx`` is row ``idx // CH``, columns
        ``VW * (idx % CH) ...``): ``VEC`` by ``cp.async`` (the caller commits and waits), else
        element by element through the element-type stage."""
        COPIES = N_ROWS * CH // THREADS

        @_device
        def copy_rows(tile, x, elem0, row_stride, rows_valid, d, page_sh, bad, tid):
            for it in range(COPIES):
                idx = tid + it * THREADS
                r = idx // CH
                c0 = (idx % CH) * VW
                ok = r < rows_valid
                if PAGED_ROWS:
                    prow = page_sh[r]
                    src = np.int64(prow) * d
                    if ok and prow < 0:  # a bad table entry: not read
                        for e in range(VW):
                            tile[r, c0 + e] = bad
                        continue
                else:
                    src = elem0 + r * row_stride
                if VEC:  # d is a multiple of VW: a chunk is all inside or all past d
                    live = ok and c0 < d
                    cp_async16(tile, (r * STRIDE + c0) * W, x, src + c0 if live else 0,
                               VEC_BYTES if live else 0)
                else:
                    for e in range(VW):
                        if ok and c0 + e < d:
                            tile[r, c0 + e] = load(load_at(x, src + c0 + e))
                        else:
                            tile[r, c0 + e] = acc_t(0.0)

        return copy_rows

    copy_q = make_copy_rows(BLOCK_M, HEAD_DIM, False)
    copy_k = make_copy_rows(BLOCK_N, K_STRIDE, PAGED)
    copy_v = make_copy_rows(BLOCK_N, HEAD_DIM, PAGED)

    return SimtLoads(page_rows, copy_q, copy_k, copy_v)


#: the SIMT forward's tile products (:func:`make_simt_products`)
SimtProducts = namedtuple("SimtProducts", "qk_tile load_v_row pv_tile")


@functools.lru_cache(maxsize=None)
def make_simt_products(cfg):
    """The SIMT forward's products on the shared tiles (:data:`SimtProducts`): ``qk_tile``
    (``S = Q K^T``), ``load_v_row`` (a thread's columns of a V row) and ``pv_tile`` (``acc +=
    P V``)."""
    BLOCK_N, HEAD_DIM, THREADS_M, THREADS_N = cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS_M, \
        cfg.THREADS_N
    TM, TN, TD, W, VW = cfg.TM, cfg.TN, cfg.TD, cfg.WORD, cfg.VW
    K_STRIDE, P_STRIDE = cfg.K_STRIDE, cfg.P_STRIDE
    TC = TD // VW                 # the thread's acc column chunks (of VW columns each)
    acc_t = compute_type(cfg.np_dtype)

    # byte steps of the shared tiles (compile time): a thread's rows and chunks sit at these
    # offsets from its first, so every 16-byte load below is one base register + an immediate
    Q_ROW_STEP = THREADS_M * HEAD_DIM * W   # q_tile rows ty, ty + THREADS_M, ...
    K_ROW_STEP = THREADS_N * K_STRIDE * W   # k_tile keys tx, tx + THREADS_N, ...
    P_ROW_STEP = THREADS_M * P_STRIDE * W   # p_tile rows
    V_ROW = HEAD_DIM * W                    # one v_tile row
    V_CHUNK_STEP = THREADS_N * VEC_BYTES    # a thread's V chunks tx, tx + THREADS_N, ...

    # [docs:fwd-qk]
    row_dot = make_row_dot(TM, TN, Q_ROW_STEP, K_ROW_STEP, HEAD_DIM * W, acc_t)

    @_stage
    def qk_tile(s, q_tile, k_tile, ty, tx):
        """``s[i, j] = q . k`` of the thread's rows ``ty + i THREADS_M`` and keys ``tx + j
        THREADS_N`` (raw, unscaled), one FMA per column in column order (the stage of
        :func:`~numba_flash.kernels.ptx.stages.make_row_dot`, the backward's too)."""
        for i in range(TM):
            for j in range(TN):
                s[i, j] = acc_t(0.0)
        row_dot(s, q_tile, k_tile, int32(ty * HEAD_DIM * W), int32(tx * K_STRIDE * W))
    # [/docs:fwd-qk]

    # [docs:fwd-pv-stage]
    @_stage
    def load_v_row(vr, v_tile, n, tx):
        """``vr`` = the thread's ``TD`` columns of ``v_tile`` row ``n``: chunks ``tx + g
        THREADS_N`` (``TC`` 16-byte loads; a warp's 8 threads read 128 consecutive bytes)."""
        v_byte = int32(n * V_ROW + tx * VEC_BYTES)
        for g in range(TC):
            t = lds16(v_tile, v_byte + g * V_CHUNK_STEP)
            for e in range(VW):
                vr[g * VW + e] = t[e]

    @_stage
    def pv_tile(acc, p_tile, v_tile, ty, tx):
        """``acc += P V`` over the whole tile, keys in order: per chunk of ``VW`` keys one
        16-byte load of ``P`` per row and ``VW TC`` of ``V`` feed ``TM TD VW`` FMAs."""
        pr = cuda.local.array((TM, VW), acc_t)
        vr = cuda.local.array(TD, acc_t)
        p_byte = int32(ty * P_STRIDE * W)       # row ty, key 0
        n0 = int32(0)  # the chunk's first key (a while loop, as in qk_tile)
        while n0 < BLOCK_N:
            for i in range(TM):
                t = lds16(p_tile, p_byte + n0 * W + i * P_ROW_STEP)
                for e in range(VW):
                    pr[i, e] = t[e]
            for e in range(VW):
                load_v_row(vr, v_tile, n0 + e, tx)
                for i in range(TM):
                    for c in range(TD):
                        acc[i, c] += pr[i, e] * vr[c]
            n0 = int32(n0 + VW)
    # [/docs:fwd-pv-stage]

    return SimtProducts(qk_tile, load_v_row, pv_tile)


#: the SIMT forward's stages on P (:func:`make_simt_p_stages`)
SimtPStages = namedtuple("SimtPStages", "store_p draw_keep pv_masked")


@functools.lru_cache(maxsize=None)
def make_simt_p_stages(cfg):
    """The SIMT forward's stages on P (:data:`SimtPStages`): ``store_p`` (P, or dropout's P Z,
    into ``p_tile``), ``draw_keep`` (dropout's keep bits) and ``pv_masked`` (``acc += P V``
    over the keys each row sees)."""
    BLOCK_M, BLOCK_N, THREADS_M, THREADS_N = cfg.BLOCK_M, cfg.BLOCK_N, cfg.THREADS_M, \
        cfg.THREADS_N
    TM, TN, TD, GROUPS, THREADS = cfg.TM, cfg.TN, cfg.TD, cfg.GROUPS, cfg.THREADS
    DROPOUT, SCORE_MOD, USER = cfg.DROPOUT, cfg.SCORE_MOD, cfg.USER
    user_score, user_mask, _blocks = USER if USER is not None else (None, None, None)
    FNS = (user_score, user_mask) if USER is not None else None
    U_MASK = user_mask is not None
    USER_FN = user_score is not None or U_MASK
    acc_t = compute_type(cfg.np_dtype)
    score_fn = make_score_fn(False, None if SCORE_MOD else False, SCORE_MOD, FNS, acc_t)
    load_v_row = make_simt_products(cfg).load_v_row

    @_device
    def sees(row, key, sa, umask):
        """A row inside the sequence that the user's mask_mod lets see the key (True without
        one, or on a FULL tile): the user's code never sees a padding row."""
        if row >= sa.nq:
            return False
        return not U_MASK or score_fn(acc_t(0.0), row, key, sa, umask)[0]

    # [docs:fwd-store-p]
    @_stage
    def store_p(s, p_tile, keep_tile, ty, tx, va):
        """``P`` (``s``, after the softmax update) into ``p_tile`` for ``P V``; with dropout
        ``P Z``: keep -> ``P / (1 - p)``, drop -> 0 (``l_i`` and so ``lse`` stay undropped)."""
        for i in range(TM):
            r = ty + i * THREADS_M
            for j in range(TN):
                col = tx + j * THREADS_N
                p = s[i, j]
                if DROPOUT:
                    keep_scale = va.dropout[3]
                    # [docs:fwd-dropout-apply]
                    p = p * keep_scale if (keep_tile[r, col >> 2] >> (col & 3)) & 1 else \
                        acc_t(0.0)
                    # [/docs:fwd-dropout-apply]
                p_tile[r, col] = p
    # [/docs:fwd-store-p]

    @_stage
    def draw_keep(keep_tile, va, sa, q_start, k_start, bounds, tid):
        """Dropout: bit ``w`` of ``keep_tile[r, g]`` keeps key ``k_start + 4 g + w`` of row
        ``q_start + r`` (indices within the sequence, so the mask ignores tiles); a group of 4
        keys the row does not see at all (or a row past Nq) is not drawn: it is 0."""
        seed_lo, seed_hi, threshold, _keep = va.dropout
        nk, left, right = bounds
        # [docs:fwd-dropout-draw]
        for idx in range(tid, BLOCK_M * GROUPS, THREADS):
            r = idx // GROUPS
            g = idx % GROUPS
            row = q_start + r
            key = k_start + 4 * g
            lo, hi = key_bounds(row, sa.offset, nk, left, right)
            bits = int32(0)
            if row < sa.nq and key < hi and key + 4 > lo:
                bits = philox_keep_bits4(seed_lo, seed_hi, sa.b, sa.h, row, key >> 2, threshold)
            keep_tile[r, g] = bits
        # [/docs:fwd-dropout-draw]

    # [docs:fwd-pv-masked]
    @_stage
    def pv_masked(acc, p_tile, v_tile, vr, sa, q_start, k_start, bounds, ty, tx, umask):
        """``acc += P V`` where a key the row does not see adds nothing, not even ``0 * NaN``
        from a NaN value (a tile that crosses the band's edges or ``Nk``)."""
        nk, left, right = bounds
        for n in range(BLOCK_N):
            key = k_start + n
            load_v_row(vr, v_tile, n, tx)
            for i in range(TM):
                row = q_start + ty + i * THREADS_M
                lo, hi = key_bounds(row, sa.offset, nk, left, right)
                if lo <= key and key < hi and (not USER_FN or sees(row, key, sa, umask)):
                    pv = p_tile[ty + i * THREADS_M, n]
                    for c in range(TD):
                        acc[i, c] += pv * vr[c]
    # [/docs:fwd-pv-masked]

    return SimtPStages(store_p, draw_keep, pv_masked)


#: the SIMT forward's flat row offsets (:func:`make_simt_rows`)
FlatRows = namedtuple("FlatRows", "q_row q_elem0 kv_row kv_elem0 v_row v_elem0")
SimtRows = namedtuple("SimtRows", "flat_rows epilogue_rows side_tiles")


@functools.lru_cache(maxsize=None)
def make_simt_rows(cfg):
    """Where a block's rows sit in the flat arrays (:data:`SimtRows`): ``flat_rows(...)``, the
    flat element of row 0 of this ``(b, h)``'s Q, K and V and their row strides
    (:data:`FlatRows`: batched ``[B, H, N, d]`` or, ``VARLEN``, packed ``[total, H, d]``; V at
    K's addresses unless ``OWN_V``), and ``epilogue_rows(...)``, the
    :data:`~numba_flash.kernels.mainloop.online_softmax.EpilogueRows` of its ``o`` and ``lse``
    (``o [B, H, Nq, d_v]``, ``lse [B, H, Nq]``; ``VARLEN``: ``o [total_q, H, d_v]``, ``lse [H,
    total_q]``); ``side_tiles(...)``: dropout's ``keep_tile`` and a paged tile's ``page_sh``
    (shared arrays; stand-ins a build without them never reads) and the :data:`PagedKv`."""
    BLOCK_M, BLOCK_N, VARLEN, OWN_V = cfg.BLOCK_M, cfg.BLOCK_N, cfg.VARLEN, cfg.OWN_V
    DROPOUT, PAGED, STRIDED = cfg.DROPOUT, cfg.PAGED, cfg.STRIDED
    KEEP_STRIDE = cfg.GROUPS + 1  # padded row length of keep_tile
    ITEM = np.dtype(kernel_dtype(cfg.np_dtype)).itemsize
    strides = make_elem_strides(ITEM)

    if STRIDED and VARLEN:   # packed [total, H, d] views: token and head strides (PAGED: q
        # and o's; the caches' rows are page_rows', K's and V's here unread)
        packed_strides = make_packed_strides(ITEM)

        @_device
        def flat_rows(q, k, v, b, h, hk, bh, q0, k0, nq, nk, d, d_v, n_heads, n_kv_heads):
            qs, ks, vs = packed_strides(q), packed_strides(k), packed_strides(v)
            return FlatRows(qs[0], np.int64(q0) * qs[0] + h * qs[1], ks[0],
                            np.int64(k0) * ks[0] + hk * ks[1], vs[0],
                            np.int64(k0) * vs[0] + hk * vs[1])

        @_device
        def epilogue_rows(o, row0, write_lse, nq, q0, h, bh, d_v, n_heads, total_q):
            os_ = packed_strides(o)   # o [total_q, H, d_v], lse [H, total_q]
            return EpilogueRows(row0, nq, np.int64(q0) * os_[0] + h * os_[1], os_[0],
                                np.int64(h) * total_q + q0, write_lse, 1)
    elif STRIDED:   # batched [B, H, N, d] views read through their own strides
        @_device
        def flat_rows(q, k, v, b, h, hk, bh, q0, k0, nq, nk, d, d_v, n_heads, n_kv_heads):
            qs, ks, vs = strides(q), strides(k), strides(v)
            return FlatRows(qs[2], b * qs[0] + h * qs[1], ks[2], b * ks[0] + hk * ks[1],
                            vs[2], b * vs[0] + hk * vs[1])

        @_device
        def epilogue_rows(o, row0, write_lse, nq, q0, h, bh, d_v, n_heads, total_q):
            os_ = strides(o)
            return EpilogueRows(row0, nq, (bh // n_heads) * os_[0] + h * os_[1], os_[2],
                                np.int64(bh) * nq, write_lse, 1)
    else:
        flat_rows, epilogue_rows = make_contiguous_rows(VARLEN, OWN_V)

    @_device
    def side_tiles(q_tile, p_tile, seqs, n_kv_heads, hk):
        if DROPOUT:  # compile-time: the plain kernel has no keep_tile
            keep_tile = cuda.shared.array((BLOCK_M, KEEP_STRIDE), int32)
        else:
            keep_tile = p_tile  # unused: store_p reads it only with DROPOUT
        if PAGED:  # the cache row of each key of the K/V tile (page_rows)
            page_sh = cuda.shared.array(BLOCK_N, int32)
            paged = PagedKv(seqs[2], seqs[3], seqs[6], seqs[5], hk)
        else:
            page_sh = q_tile  # unused: copy_k / copy_v read it only when PAGED
            paged = ()
        return keep_tile, page_sh, paged

    return SimtRows(flat_rows, epilogue_rows, side_tiles)


@functools.lru_cache(maxsize=None)
def make_contiguous_rows(VARLEN, OWN_V):
    """:func:`make_simt_rows`'s ``(flat_rows, epilogue_rows)`` of C-contiguous arrays (the
    arrays themselves unread: their shapes, given, say where each row lies)."""

    @_device
    def flat_rows(q, k, v, b, h, hk, bh, q0, k0, nq, nk, d, d_v, n_heads, n_kv_heads):
        q_row = n_heads * d if VARLEN else d
        kv_row = n_kv_heads * d if VARLEN else d
        q_elem0 = (np.int64(q0) * n_heads + h) * d if VARLEN else np.int64(bh) * nq * d
        kv_elem0 = ((np.int64(k0) * n_kv_heads + hk) * d if VARLEN
                    else np.int64(b * n_kv_heads + hk) * nk * d)
        v_row = kv_row                        # V at K's addresses, unless it has its own width
        v_elem0 = kv_elem0
        if OWN_V:
            v_row = n_kv_heads * d_v if VARLEN else d_v
            v_elem0 = ((np.int64(k0) * n_kv_heads + hk) * d_v if VARLEN
                       else np.int64(b * n_kv_heads + hk) * nk * d_v)
        return FlatRows(q_row, q_elem0, kv_row, kv_elem0, v_row, v_elem0)

    @_device
    def epilogue_rows(o, row0, write_lse, nq, q0, h, bh, d_v, n_heads, total_q):
        if VARLEN:  # o [total_q, H, d_v], lse [H, total_q]
            return EpilogueRows(row0, nq, (np.int64(q0) * n_heads + h) * d_v, n_heads * d_v,
                                np.int64(h) * total_q + q0, write_lse, 1)
        return EpilogueRows(row0, nq, np.int64(bh) * nq * d_v, d_v, np.int64(bh) * nq,
                            write_lse, 1)

    return flat_rows, epilogue_rows


@functools.lru_cache(maxsize=None)
def make_simt_step(cfg):
    """The SIMT forward's per-tile step (FA4's ``compute_one_n_block``): ``step(kt, masked,
    umask, tiles, kv, lane, va, sa, frags)`` loads K_j and V_j, computes ``S = Q K^T``, the
    scores (the score of kernels/mainloop/visibility.py through tile_scores.py, which the
    backward recomputes exactly: scale and non-finite -> NaN always; softcap and ALiBi in the
    ``SCORE_MOD`` build, softcap switched at run time by softcap > 0), the online softmax
    update and ``acc += P V``."""
    BLOCK_N, THREADS_M, THREADS_N = cfg.BLOCK_N, cfg.THREADS_M, cfg.THREADS_N
    VEC, DROPOUT, SCORE_MOD, PAGED, USER = cfg.VEC, cfg.DROPOUT, cfg.SCORE_MOD, cfg.PAGED, \
        cfg.USER
    TM, TN, TD = cfg.TM, cfg.TN, cfg.TD
    FNS = tuple(USER[:2]) if USER is not None else None
    acc_t = compute_type(cfg.np_dtype)
    NAN = math.nan
    # a row's THREADS_N threads: the butterfly offsets of its max and sum
    XOR = tuple((THREADS_N >> 1) >> st for st in range(THREADS_N.bit_length() - 1))
    scores_masked, scores_full = make_tile_scores_pair(
        TM, TN, Layout(1, THREADS_M, 0), Layout(1, THREADS_N, 0), False,
        None if SCORE_MOD else False, SCORE_MOD, FNS, acc_t)
    _init, softmax_update, _fin = make_online_softmax(TM, TN, TD, XOR, "exp", acc_t)
    page_rows, _copy_q, copy_k, copy_v = make_simt_loads(cfg)
    qk_tile, _load_v_row, pv_tile = make_simt_products(cfg)
    store_p, draw_keep, pv_masked = make_simt_p_stages(cfg)

    # [docs:fwd-step]
    @_stage
    def step(kt, masked, umask, tiles, kv, lane, va, sa, frags):
        """One K/V tile: load K and V, ``S = Q K^T``, scores, the softmax update, ``acc += P
        V``; ``masked``: the tile crosses the band's edges (or asks the user's mask_mod)."""
        q_tile, k_tile, v_tile, p_tile = tiles.q_tile, tiles.k_tile, tiles.v_tile, tiles.p_tile
        keep_tile, page_sh = tiles.keep_tile, tiles.page_sh
        k, v, kv_elem0, kv_row, d = kv.k, kv.v, kv.kv_elem0, kv.kv_row, kv.d
        bounds, paged, kt_end = kv.bounds, kv.paged, kv.kt_end
        v_elem0, v_row, d_v = kv.v_at
        tid, ty, tx, q_start = lane
        s, acc, vr, m_i, l_i = frags.s, frags.acc, frags.vr, frags.m_i, frags.l_i
        k_start = kt * BLOCK_N
        nk = bounds[0]
        # -- K_j and V_j into shared memory (two cp.async groups: V may still land while S is
        # computed), zero past Nk and past the true head dim; a bad page table entry is read
        # as k = NaN, v = 0 (the rows that see the key get NaN)
        kv_start = kv_elem0 + k_start * kv_row
        copy_k(k_tile, k, kv_start, kv_row, nk - k_start, d, page_sh, acc_t(NAN), tid)
        if VEC:
            cp_async_commit()
        copy_v(v_tile, v, v_elem0 + k_start * v_row, v_row, nk - k_start, d_v, page_sh,
               acc_t(0.0), tid)
        if VEC:
            cp_async_commit()
            cp_async_wait_one()  # this thread's K chunks have landed (V may not have)
        if DROPOUT:
            draw_keep(keep_tile, va, sa, q_start, k_start, bounds, tid)
        cuda.syncthreads()  # k_tile (and keep_tile) are complete before any read
        qk_tile(s, q_tile, k_tile, ty, tx)                              # S = Q K^T
        if masked:                                                      # scores, -inf masked
            scores_masked(s, sa, q_start + ty, k_start + tx, bounds, umask)
        else:
            scores_full(s, sa, q_start + ty, k_start + tx, bounds, umask)
        if PAGED:
            # the next tile's rows: this tile's loads (page_sh's only readers) are done, and
            # the next loads come after two more barriers (no barrier of its own)
            if kt + 1 < kt_end:
                page_rows(page_sh, paged.block_table, sa.b, paged.hk, k_start + BLOCK_N, nk,
                          paged.block_size, paged.row_strides, paged.n_blocks, tid)
        softmax_update(s, acc, m_i, l_i, acc_t(0.0))                    # m_i, l_i, P, acc
        store_p(s, p_tile, keep_tile, ty, tx, va)
        if VEC:
            cp_async_wait_all()  # this thread's V chunks have landed
        cuda.syncthreads()  # p_tile (and v_tile) are complete before P V reads them
        if masked:                                                      # acc += P V
            pv_masked(acc, p_tile, v_tile, vr, sa, q_start, k_start, bounds, ty, tx, umask)
        else:
            pv_tile(acc, p_tile, v_tile, ty, tx)
        cuda.syncthreads()  # k/v/p/keep_tile are fully read before the next tile
    # [/docs:fwd-step]

    return step


@functools.lru_cache(maxsize=None)
def forward_kernel(cfg):
    """Build (once per :class:`~numba_flash.kernels.forward.config.ForwardSimtConfig`) ``kernel(q,
    k, v, o, lse, va, seqs)``.

    * ``o``, ``lse``: flat views of ``[B, H, Nq, d]`` / ``[B, H, Nq]`` (``VARLEN``: ``[total_q,
      H, d]`` / ``[H, total_q]``), ``lse`` in the compute type;
    * ``va``: the :class:`~numba_flash.kernels.core.variant.Variant` (scalars in the compute type;
      ``softcap = 0`` and zero slopes switch the modifiers off in the ``SCORE_MOD`` build, the
      only one that reads them; ``dropout`` filled with ``DROPOUT``; ``user = (kinds,) + aux``
      with ``USER``);
    * ``seqs``: ``()`` for the batched layout (``q [B, H, Nq, d]``), else ``(cu_seqlens_q,
      cu_seqlens_k)`` (int32 ``[B + 1]``) for the packed layout ``VARLEN`` (``q [total_q, H,
      d]``, ``k``/``v [total_k, Hkv, d]``); with ``PAGED`` (varlen only) ``(cu_seqlens_q,
      cu_seqlens_k, block_table, block_size, n_kv_heads, num_blocks, row_strides)``: ``k``/``v``
      are the paged caches ``[num_blocks, Hkv, block_size, d]`` as ``[num_blocks * Hkv *
      block_size, d]`` views of their memory, ``block_table`` int32 ``[B, max_blocks]``, the
      three sizes ``np.int32`` and ``row_strides`` three ``np.int32``, the memory's ``(block,
      head, slot)`` row strides (see the module docstring).

    An empty tuple adds no kernel parameter, so a flag that is off costs nothing.
    """
    BLOCK_M, BLOCK_N, HEAD_DIM, THREADS = cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS
    THREADS_M, THREADS_N, USER, VEC, OWN_V = (cfg.THREADS_M, cfg.THREADS_N, cfg.USER, cfg.VEC,
                                              cfg.OWN_V)
    DROPOUT, SCORE_MOD, VARLEN, PAGED = cfg.DROPOUT, cfg.SCORE_MOD, cfg.VARLEN, cfg.PAGED
    dtype = cfg.np_dtype
    assert BLOCK_M % THREADS_M == 0 and BLOCK_N % THREADS_N == 0 and HEAD_DIM % THREADS_N == 0
    assert THREADS_M & (THREADS_M - 1) == 0 and THREADS_N & (THREADS_N - 1) == 0
    assert THREADS_N <= 32  # a row's THREADS_N threads are consecutive lanes of one warp
    assert not DROPOUT or BLOCK_N % 4 == 0  # whole groups of 4 keys per Philox call
    assert VARLEN or not PAGED  # a paged K/V is read by the packed (varlen) build only
    # a user's variant (numba_flash.flex): (score_mod, mask_mod, BLOCKS) device code
    user_score, user_mask, BLOCKS = USER if USER is not None else (None, None, None)
    assert USER is None or SCORE_MOD  # varlen: b is the sequence (paged too)
    U_MASK = user_mask is not None
    tile_kind = make_tile_kind(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None
    LOG = on_simulator() and USER is not None  # the simulator's tile log (common.TILE_LOG)
    acc_t = compute_type(dtype)
    # the element-type stage (kernels/core/elements.py): o elements out
    store = element_ops(dtype)[1]
    TM, TN, TD, VW, CH = cfg.TM, cfg.TN, cfg.TD, cfg.VW, cfg.CH   # the thread's share, chunks
    K_STRIDE, P_STRIDE = cfg.K_STRIDE, cfg.P_STRIDE              # padded shared rows
    assert TD % VW == 0 and BLOCK_N % VW == 0
    # a row's THREADS_N threads: the butterfly offsets of its max and sum
    XOR = tuple((THREADS_N >> 1) >> st for st in range(THREADS_N.bit_length() - 1))
    # compile-time trip counts of the cooperative copies (16-byte chunks per thread)
    assert (BLOCK_M * CH) % THREADS == 0 and (BLOCK_N * CH) % THREADS == 0
    ALIGN = None if on_simulator() else VEC_BYTES  # tiles 16-byte aligned (no kwarg in cudasim)
    ROWS = Layout(1, THREADS_M, 0)           # a thread's rows ty + i THREADS_M
    # -- the stages: the score of kernels/mainloop/visibility.py through tile_scores.py (the
    # backward recomputes exactly these scores: scale and non-finite -> NaN always; softcap and
    # ALiBi in the SCORE_MOD build, softcap switched at run time by softcap > 0), the online softmax
    # and its epilogue (online_softmax.py)
    score_args = make_score_args(SCORE_MOD, acc_t)   # the slope read with SCORE_MOD
    softmax_init, _update, _fin = make_online_softmax(TM, TN, TD, XOR, "exp", acc_t)
    epilogue = make_epilogue(TM, TD, XOR, ROWS, Layout(VW, THREADS_N * VW, 1), store, acc_t,
                             STRIDED_O=cfg.STRIDED)
    page_rows, copy_q, _copy_k, _copy_v = make_simt_loads(cfg)
    flat_rows, epilogue_rows, side_tiles = make_simt_rows(cfg)

    step = make_simt_step(cfg)


    # a user's functions stay out of the on-disk kernel cache (their code does not key it)
    @kernel_jit(cache=USER is None, **jit_options(BLOCK_M, BLOCK_N, HEAD_DIM, dtype))
    def flash_forward(q, k, v, o, lse, va, seqs):
        # `& (T - 1)`: a no-op telling the compiler tx, ty >= 0 (no negative-index fix-up)
        # [docs:fwd-index]
        tx = cuda.threadIdx.x & (THREADS_N - 1)
        ty = cuda.threadIdx.y & (THREADS_M - 1)
        tid = ty * THREADS_N + tx
        # (batch, head) pairs fold into grid y and z: gridDim.y <= 65535 (see forward_grid)
        bh = cuda.blockIdx.z * cuda.gridDim.y + cuda.blockIdx.y
        if VARLEN:  # q [total_q, H, d], k and v [total_k, Hkv, d] (PAGED: caches, see above)
            n_batch = seqs[0].shape[0] - 1
            n_heads = q.shape[1]
            if PAGED:
                n_kv_heads = seqs[4]
            else:
                n_kv_heads = k.shape[1]
        else:       # q [B, H, Nq, d], k and v [B, Hkv, Nk, d]
            n_batch = q.shape[0]
            n_heads = q.shape[1]
            n_kv_heads = k.shape[1]
        if bh >= n_batch * n_heads:
            return  # a spare block of the last z slice (the whole block leaves: no barrier hangs)
        b = bh // n_heads
        h = bh % n_heads
        hk = h // (n_heads // n_kv_heads)  # GQA: query head h reads kv head h // group
        if VARLEN:  # sequence b: rows [q0, q0 + nq) of q, [k0, k0 + nk) of k and v
            # clamped into the packed arrays: an unvalidated cu_seqlens never sends a block
            # outside them (the paged keys are positions, bounded by their table instead)
            q0, nq = clamp_rows(seqs[0][b], seqs[0][b + 1], q.shape[0])
            if PAGED:   # key positions, each bounded by the table (int32: a page's division)
                k0 = seqs[1][b]
                nk = seqs[1][b + 1] - k0
            else:
                k0, nk = clamp_rows(seqs[1][b], seqs[1][b + 1], k.shape[0])
            d = q.shape[2]
        else:
            q0 = 0
            k0 = 0
            nq = q.shape[2]
            nk = k.shape[2]
            d = q.shape[3]
        d_v = d
        if OWN_V:
            d_v = v.shape[v.ndim - 1]         # the value head dim (o's), its own
        q_start = cuda.blockIdx.x * BLOCK_M
        if q_start >= nq:
            return  # varlen: a sequence shorter than the longest has fewer Q tiles
        # [/docs:fwd-index]
        left, right = va.window
        # bottom-right alignment: query row r sits at key column r + nk - nq
        sa = score_args(va, b, h, nk - nq, nq)

        # [docs:fwd-arrays]
        q_tile = cuda.shared.array((BLOCK_M, HEAD_DIM), acc_t, alignment=ALIGN)
        k_tile = cuda.shared.array((BLOCK_N, K_STRIDE), acc_t, alignment=ALIGN)
        v_tile = cuda.shared.array((BLOCK_N, HEAD_DIM), acc_t, alignment=ALIGN)
        p_tile = cuda.shared.array((BLOCK_M, P_STRIDE), acc_t, alignment=ALIGN)
        s = cuda.local.array((TM, TN), acc_t)
        acc = cuda.local.array((TM, TD), acc_t)
        vr = cuda.local.array(TD, acc_t)  # a V row's columns of this thread (masked P V)
        m_i = cuda.local.array(TM, acc_t)
        l_i = cuda.local.array(TM, acc_t)
        # [/docs:fwd-arrays]
        # dropout's keep bits, a paged tile's cache rows (stand-ins when the build has none)
        keep_tile, page_sh, paged = side_tiles(q_tile, p_tile, seqs, n_kv_heads, hk)
        # the flat element of row 0 of this (b, h)'s Q, K and V, and their row strides
        q_row, q_elem0, kv_row, kv_elem0, v_row, v_elem0 = flat_rows(
            q, k, v, b, h, hk, bh, q0, k0, nq, nk, d, d_v, n_heads, n_kv_heads)

        # [docs:fwd-load-q]
        # -- load q_tile = Q_i (unscaled: the score contract scales q . k), zero past Nq and
        # past the true head dim
        copy_q(q_tile, q, q_elem0 + q_start * q_row, q_row, nq - q_start, d, page_sh,
               acc_t(0.0), tid)
        if VEC:
            cp_async_commit()
            cp_async_wait_all()
        softmax_init(m_i, l_i, acc)
        cuda.syncthreads()  # q_tile is complete before the first S reads it
        # [/docs:fwd-load-q]

        # [docs:fwd-tile-range]
        # -- which K/V tiles (visibility.py): keys outside [kv_lo, kv_hi) no row of this Q tile
        # sees, so their tiles are never loaded (causal: after the diagonal; a window: outside
        # the band); a tile inside [full_lo, full_hi), which every row sees whole, needs no mask
        q_end = min(nq, q_start + BLOCK_M)
        kv_lo, kv_hi = tile_key_range(q_start, q_end, sa.offset, nk, left, right)
        full_lo, full_hi = tile_full_range(q_start, q_end, sa.offset, nk, left, right)
        kt_first = kv_lo // BLOCK_N
        kt_end = (kv_hi + BLOCK_N - 1) // BLOCK_N if kv_hi > kv_lo else kt_first
        # [/docs:fwd-tile-range]
        if PAGED:
            page_rows(page_sh, seqs[2], b, hk, kt_first * BLOCK_N, nk, seqs[3], seqs[6],
                      seqs[5], tid)
            cuda.syncthreads()  # page_sh holds the first tile's rows before its loads read them

        # [docs:fwd-load-kv]
        tiles = ForwardTiles(q_tile, k_tile, v_tile, p_tile, keep_tile, page_sh)
        kv = KvSource(k, v, kv_elem0, kv_row, d, (nk, left, right), paged, kt_end,
                      (v_elem0, v_row, d_v))
        lane = (tid, ty, tx, q_start)
        frags = ForwardFrags(s, acc, vr, m_i, l_i)
        for kt in range(kt_first, kt_end):
            k_start = kt * BLOCK_N
            masked = tile_needs_mask(k_start, k_start + BLOCK_N, full_lo, full_hi)
            umask = U_MASK  # the user's mask_mod runs on this tile (a block mask may say no)
            if BLOCKS is not None:
                kind = tile_kind(va.user[0], b, h, q_start, q_end, kt, nk)
                if kind == BLOCK_EMPTY:
                    continue  # no row of this Q tile sees a key of it: never loaded
                umask = kind == BLOCK_PARTIAL
            if LOG and tid == 0:
                log_tile(b, h, q_start, kt)
            step(kt, masked or umask, umask, tiles, kv, lane, va, sa, frags)
        # [/docs:fwd-load-kv]

        # [docs:fwd-epilogue]
        # -- epilogue: l = sum of the row's partial l_i (a butterfly of warp shuffles: every
        # lane gets the same bits); O = acc / l, lse = m + log(l)
        rows = epilogue_rows(o, q_start + ty, tx == 0, nq, q0, h, bh, d_v, n_heads, q.shape[0])
        epilogue(o, lse, acc, m_i, l_i, acc_t(1.0), rows, (tx * VW, d_v), sink_of(va.sink, h))
        # [/docs:fwd-epilogue]

    return flash_forward


def forward_grid(n_q_tiles, n_bh):
    """``(x, y, z)`` launch grid: ``x`` the Q tiles, ``(b, h)`` pairs as ``bh = z * y_size + y``.

    ``gridDim.y`` (and ``.z``) may not exceed 65535 on CUDA, so ``B * H`` pairs are split into
    ``z = ceil(B H / 65535)`` slices of ``y = ceil(B H / z)``; the kernel returns at once from the
    at most ``z - 1`` spare blocks with ``bh >= B H``.
    """
    n_bh = max(1, int(n_bh))
    z = -(-n_bh // GRID_YZ_MAX)
    y = -(-n_bh // z)
    return (max(1, int(n_q_tiles)), y, z)


def config_name(BLOCK_M, BLOCK_N, HEAD_DIM, THREADS_M, THREADS_N, dtype, dropout=False,
                score_mod=False, varlen=False, paged=False):
    """The compile tier's name of one configuration, e.g. ``forward M64 N32 D64 T8x8 float32``,
    ``forward varlen M64 N32 D64 T8x8 mods dropout float32`` or ``forward varlen paged M64 N32
    D64 T16x8 mods float16``."""
    return (f"forward{' varlen' if varlen else ''}{' paged' if paged else ''} M{BLOCK_M} "
            f"N{BLOCK_N} D{HEAD_DIM} "
            f"T{THREADS_M}x{THREADS_N}{' mods' if score_mod else ''}"
            f"{' dropout' if dropout else ''} {np.dtype(dtype).name}")


def kernel_arg_types(cfg, user=()):
    """The Numba argument types of ``forward_kernel(cfg)(q, k, v, o, lse, va, seqs)`` (``user``:
    the types of ``(kinds,) + aux`` of a user build; ``PAGED``: int32 table and sizes, 2-D
    caches)."""
    dt = cfg.np_dtype
    acc = compute_type(dt)
    arr = numba_array_type(dt, 3 if cfg.VARLEN else 4)
    o_t = numba_array_type(dt, 1)
    if cfg.STRIDED:   # views: their own strides
        arr = o_t = types.Array(arr.dtype, arr.ndim, "A")
    kv = numba_array_type(dt, 2) if cfg.PAGED else arr
    seqs_t = (types.UniTuple(numba_array_type(np.int32, 1), 2) if cfg.VARLEN
              else types.Tuple(()))
    if cfg.PAGED:
        cu_t = numba_array_type(np.int32, 1)
        seqs_t = types.Tuple((cu_t, cu_t, numba_array_type(np.int32, 2), types.int32,
                              types.int32, types.int32, types.UniTuple(types.int32, 3)))
    return (arr, kv, kv, o_t, numba_array_type(acc_dtype(dt), 1),
            variant_type(acc, cfg.DROPOUT, user), seqs_t)


def kernel_flags():
    """``(DROPOUT, SCORE_MOD, VARLEN)`` of every compiled kernel: the batched kernel with and
    without the score modifiers, the varlen kernel always with them (softcap and ALiBi are
    switched off at run time there), each with and without dropout.  Causal and the window are
    run-time arguments of every kernel."""
    for varlen in (False, True):
        for score_mod in ((True,) if varlen else (False, True)):
            for dropout in (False, True):
                yield dropout, score_mod, varlen


#: the input dtypes whose builds copy tiles by ``cp.async`` (``config.vector_tiles``); the compile
#: tier's other rows of them are named ``... elementwise``
VEC_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


#: the bfloat16 configurations the compile tier builds: ``{HEAD_DIM: dropout flags}``, a
#: representative selection (the bfloat16 kernel is the float16 kernel with other loads and
#: stores, same tiles and threads): every flag at HEAD_DIM 64, the kernels without dropout at 128.
BF16_CONFIGS = {64: (False, True), 128: (False,)}


#: the paged varlen configurations the compile tier builds (``forward_varlen`` with a
#: ``block_table``), a selection: ``{dtype: head dims}``, without dropout.  The paged build is
#: the varlen build with another K/V row address (:func:`forward_kernel`'s ``PAGED``), so
#: float16 and float32 at HEAD_DIM 64 and 128 stand for the rest (the dropout builds at
#: HEAD_DIM 64 build clean too: docs/paged-attention.md, "Prefill").
PAGED_CONFIGS = {np.dtype(np.float16): (64, 128), np.dtype(np.float32): (64, 128)}


def compile_config(cfg, name_suffix="", user=()):
    """The compile tier's entry of one configuration."""
    return {
        "name": config_name(cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS_M, cfg.THREADS_N,
                            cfg.np_dtype, cfg.DROPOUT, cfg.SCORE_MOD, cfg.VARLEN,
                            cfg.PAGED) + (" strided" if cfg.STRIDED else "") + name_suffix,
        "config": cfg,
        "kernel": forward_kernel(cfg),
        "args": kernel_arg_types(cfg, user),
        "launch_bounds": launch_bounds(cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.np_dtype),
        "float64_ok": cfg.DTYPE == "float64",
        # the SASS tier's loop: the K/V loop holds >= 75% of the kernel's static FFMAs, but at
        # d <= 32 the epilogue's per-row log, reciprocal and sink term (straight-line, run once)
        # are more than a quarter of them (d = 32 float32, ptxas 13 for sm_90: 196 of 263)
        "sass": {"share": 0.65} if cfg.HEAD_DIM <= 32 else {},
    }
