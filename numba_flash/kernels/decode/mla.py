"""MLA's absorbed decode on tensor cores: one latent cache read as keys and again as values
(or, ``OWN_V``, a key cache and a value cache of its own: GQA and the token-sparse forward).

Contract (as :func:`numba_flash.decode` with ``v_cache=None, head_dim_v=D_V``, for the calls
:mod:`numba_flash.ops.decode` sends here): per sequence ``b``, query token ``i`` and head ``h``,
``o = softmax(scale q K^T) V`` and ``lse`` over the keys ``[lo, hi)`` the row sees (causal and
window aligned bottom-right at ``L = cache_seqlens[b]``, no key before ``cache_leftpad[b]``),
``K`` the ``D_QK``-wide cache rows and ``V`` their first ``D_V`` columns (``OWN_V``: the
``D_V``-wide rows of the value cache, the same slots).  A row that sees no key:
``o = 0``, ``lse = -inf``; a NaN / inf in ``q`` or in a key row it sees: NaN (the forward's
rule).  A sequence with a bad length or table entry: ``o = lse = NaN``, nothing outside the
cache read.  16-bit operands, float32 accumulation and softmax; ``P`` rounded to the input type
(as the tensor-core forward).  ``GATHER``: the keys are the token's list ``kv_indices[b, kvh or
0, i]``, a tile's rows gathered through their pages, masked by row flags (sparse-attention.md).
``KV_FP8``: an e4m3 latent cache (``kv_descale[0]`` folded into the scale, ``kv_descale[1]``
into ``o``): each stage holds a tile's bytes, widened after it lands into one 16-bit tile the
GEMMs read (:func:`make_widen_word`; exact, NaN kept).

Grid / block (:class:`~numba_flash.kernels.decode.config.MlaDecodeConfig`)
-----------------------------------------------------------------
grid = ``(B * Hkv * Nq * chunks, splits)``, block = ``32 NUM_WARPS`` threads.  Block ``(x, s)``
serves 16 query heads (chunk ``z`` of kv head ``kvh``'s group; heads past the group are zero
rows, never written) of one query token ``i``, over split ``s`` of the sequence's keys (the
decode's split rule, :mod:`numba_flash.kernels.decode.split_kv`, with ``STEP = BLOCK_N``).  All 16
rows of a block see the same keys, so a key is seen by every row or by none: the copy zero-fills the
rows of keys outside the block's range, and a tensor core never multiplies a ``P = 0`` by a
stale or non-finite ``V``.

Warps: all four hold the same 16 rows.  ``S = Q K^T`` is split by columns: warp ``w`` computes
the partial product over its ``K_STEPS_W`` k-steps (its Q fragments stay in registers, 36 a
lane at 576), writes it to shared memory, and after a barrier every warp sums the four partials
in one fixed order, so every warp holds the same ``S``, runs the same online softmax (the same
``m_i``, ``l_i``) and accumulates its own ``D_V / 4`` columns of ``o`` from ``P`` in registers
(:func:`~numba_flash.kernels.mainloop.warp_gemm.make_gemm`, ``A`` from the accumulator, ``V`` read
with ``ldmatrix.trans`` from the key tile's first ``D_V`` columns).  The per-tile step reads as its
stages: copy, GEMM, partial-sum exchange, tile scores, softmax update, GEMM.

Output: one split and no sink: the epilogue writes ``o`` and ``lse``; else float32 partials
``(o_part, lse_part)`` that :func:`~numba_flash.kernels.decode.merge.merge_kernel` combines, adding
a learnable sink once.  ``STRIDED``: ``q`` is read and ``o`` written through their element
strides (:func:`make_mla_io`, the split-KV decode's ``b s0 + h s1 + i s2``: flash-attn's ``[B,
Nq, H, d]`` memory as ``[B, H, Nq, d]`` without a copy), in the prologue's q copy and the
epilogue's stores only; the key loop is the C build's.  ``[docs: flash-decoding.md]`` (MLA) and
``[docs: tensor-cores.md]`` (the fragments).

Shared memory: ``STAGES`` key tiles of ``BLOCK_N`` rows of ``2 D_QK + 16`` bytes (``OWN_V``: each
followed by its value tile, rows of ``2 D_V + 16`` bytes; Q is staged through the first before the
loop), then the warps' float32 partial ``S`` (16 rows of ``SP_ROW`` words each): 42.5 KiB at 576 /
512, 39 KiB at 256 / 256 with ``OWN_V``.  ``KV_FP8``: one 16-bit key tile (Q staged through
it), then ``STAGES`` tiles of e4m3 rows (``D_QK`` bytes each), then the partial ``S``: 42.3 KiB
at 576 / 512.
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

from numba import cuda, float32, int32, int64, uint32

from ..core.common import GRID_X_MAX, make_elem_strides
from ..core.elements import element_ops
from ..core.jit import device_jit, kernel_jit, static_for
from ..mainloop.online_softmax import (
    RESCALE_LOG2, EpilogueRows, make_epilogue, make_online_softmax,
)
from ..ptx.fp8 import e4m3x4_to_f16x2, e4m3x4_to_float32
from ..ptx.mma import mma_ops
from ..ptx.stages import (
    LOG2E, SHARED_ALIGN, cp_async16, cp_async_commit, cp_async_wait_all,
)
from ..mainloop.tile_scores import Layout, ScoreArgs, make_tile_scores_pair
from ..core.config import MMA_DTYPES
from .config import MlaDecodeConfig, mla_decode_config
from ..mainloop.visibility import key_bounds, tile_key_range
from ..mainloop.warp_gemm import (
    ACC_COLS, ACC_ROWS, KIND_A, KIND_B, lane_offset, make_gemm, make_load_a,
)

__all__ = ["MlaDecodeConfig", "mla_decode_config", "mla_decode_kernel", "mla_decode_grid"]

_stage = functools.partial(device_jit, own_module=True, inline=True)

#: every row of a block is the same query token: the tile-scores stage's row offsets are 0
SAME_ROW = Layout(2, 0, 0)


def mla_decode_grid(b, hkv, nq, group, splits):
    """``(B * Hkv * Nq * chunks, splits)``: ``chunks = ceil(group / 16)`` blocks of 16 heads
    (a ValueError naming ``q`` past CUDA's x limit)."""
    chunks = -(-group // 16)
    x = int(b) * int(hkv) * int(nq) * chunks
    if x > GRID_X_MAX:
        raise ValueError(f"q: expected B * Hkv * Nq * ceil(group / 16) <= {GRID_X_MAX} (the "
                         f"CUDA grid's x limit), got {b} * {hkv} * {nq} * {chunks} = {x}")
    return (max(1, x), splits)


@functools.lru_cache(maxsize=None)
def make_row_copy(THREADS_PER_ROW, ROW_CHUNKS):
    """``copy_row(smem, dst_byte, src, src_elem, ok, part)``: this thread's 16-byte chunks
    ``part, part + THREADS_PER_ROW, ...`` of one ``ROW_CHUNKS``-chunk row (consecutive threads
    on consecutive chunks: coalesced) from element ``src_elem`` of ``src`` (16-bit elements: 8
    a chunk) to ``dst_byte``, by ``cp.async``; zeros when not ``ok`` (nothing read).  A row
    whose chunks the threads do not divide (an e4m3 row of 576 bytes: 36 chunks, 8 threads)
    gives the last pass to the first threads only."""
    PER_THREAD = -(-ROW_CHUNKS // THREADS_PER_ROW)
    EVEN = ROW_CHUNKS % THREADS_PER_ROW == 0

    @_stage
    def copy_row(smem, dst_byte, src, src_elem, ok, part):
        elem0 = src_elem + 8 * part if ok else src_elem * 0   # one address; chunks at offsets
        n_bytes = 16 if ok else 0
        dst0 = dst_byte + 16 * part
        for c in range(PER_THREAD):
            if EVEN or c < PER_THREAD - 1 or part + THREADS_PER_ROW * c < ROW_CHUNKS:
                cp_async16(smem, dst0 + 16 * THREADS_PER_ROW * c, src,
                           elem0 + 8 * THREADS_PER_ROW * c, n_bytes)

    return copy_row


@_stage
def skip_copy(smem, dst_byte, src, src_elem, ok, part):
    """No copy (a latent cache's value rows are its key rows, already in the tile)."""
    pass


@functools.lru_cache(maxsize=None)
def make_widen_word(DTYPE, TPR):
    """``widen_word(i, ctx)``, ``ctx = (smem, src, dst)``: word ``src + TPR i`` of ``smem``
    (four e4m3) as the two 16-bit pairs at ``dst + 2 TPR i``: exact (every e4m3 value is a
    float16 and a bfloat16 one; NaN stays NaN, a zero-filled row zeros).  float16: the two
    ``cvt.rn.f16x2.e4m3x2`` alone; bfloat16: through float32 (``pack_bf16x2``)."""
    _mma, pack2 = mma_ops(DTYPE)

    # unsigned indices: a signed one gets Numba's negative-index fix-up (a compare, a select
    # and a multiply-add an access: 104 IMAD in the float16 build's tile step, 36 words)
    if DTYPE == "float16":
        def widen_word(i, ctx):
            smem, src, dst = ctx
            lo, hi = e4m3x4_to_f16x2(smem[src + uint32(TPR * i)])
            smem[dst + uint32(2 * TPR * i)] = lo
            smem[dst + uint32(2 * TPR * i + 1)] = hi
    else:
        def widen_word(i, ctx):
            smem, src, dst = ctx
            vals = e4m3x4_to_float32(smem[src + uint32(TPR * i)])
            smem[dst + uint32(2 * TPR * i)] = pack2(vals[0], vals[1])
            smem[dst + uint32(2 * TPR * i + 1)] = pack2(vals[2], vals[3])
    return widen_word


#: the MLA decode's key-tile stages (:func:`make_mla_tile_stages`)
MlaTileStages = namedtuple("MlaTileStages",
                           "load_tile load_listed_tile mask_listed exchange_s widen_tile")


@functools.lru_cache(maxsize=None)
def make_mla_tile_stages(cfg):
    """The key-tile stages of the MLA decode of ``cfg`` (:data:`MlaTileStages`): ``load_tile``
    (a key tile through the block table into a stage) and ``exchange_s`` (the warps' partial
    ``S`` summed in one order)."""
    D_QK, BLOCK_N, NUM_WARPS, THREADS, RB = (cfg.D_QK, cfg.BLOCK_N, cfg.NUM_WARPS, cfg.THREADS,
                                             cfg.ROW_BYTES)
    SP_ROW = cfg.SP_ROW
    OWN_V, D_V, RBV = cfg.OWN_V, cfg.D_V, cfg.V_ROW_BYTES
    TILE_BYTES = cfg.STAGE_BYTES             # a stage: the K tile (then OWN_V's V tile)
    V_TILE = cfg.V_TILE                      # the V tile's offset in its stage (OWN_V)
    SP_WARP = 16 * SP_ROW                    # words of one warp's partial S
    ROWS = 2                                 # a lane's rows: g and g + 8
    KEYS = BLOCK_N // 4                      # a lane's scores per row
    NEG_INF = float32(-math.inf)
    KV_FP8 = cfg.KV_FP8
    STAGE0 = cfg.WIDE_BYTES                  # the first stage (KV_FP8: after the 16-bit tile)
    ROW_STAGED = D_QK if KV_FP8 else RB      # bytes of a staged key row (e4m3: unpadded)
    ROW_ELEMS = D_QK // 2 if KV_FP8 else D_QK   # 16-bit elements of a cache row
    copy_key = make_row_copy(THREADS // BLOCK_N, D_QK // (16 if KV_FP8 else 8))
    TPR = THREADS // BLOCK_N                 # threads a tile row (its copy's and widening's)
    F8_ROW_WORDS = D_QK // 4                 # KV_FP8: words of a staged row (4 e4m3 each)
    assert not KV_FP8 or F8_ROW_WORDS % TPR == 0
    widen_words = static_for(F8_ROW_WORDS // TPR, make_widen_word(cfg.DTYPE, TPR))
    # OWN_V: a tile row's value row after its key row (else the key rows are the values)
    copy_value = make_row_copy(THREADS // BLOCK_N, D_V // 8) if OWN_V else skip_copy

    @_stage
    def key_row(kc, key, ok):
        """``(elem, v_elem, ok, bad)``: the first element of key ``key``'s cache row (when
        ``ok``) and of its value row (``OWN_V``), found through its page; a table entry outside
        the cache clears ``ok`` and sets ``bad``."""
        block_size, b = kc.block_size, kc.b
        bad = False
        elem = int64(0)
        v_elem = int64(0)
        if ok:
            j = key // block_size
            blk = int64(b)
            if kc.paged:
                blk = int64(kc.table[b, j])
            if blk < 0 or blk >= kc.n_blocks:
                ok = False
                bad = True
            # the row of the cache's memory (its order's strides; kvh's rows made once)
            row = blk * kc.strides[0] + (kc.kvh_rows + (key - j * block_size) * kc.strides[2])
            elem = row * ROW_ELEMS
            v_elem = row * D_V
        return elem, v_elem, ok, bad

    @_stage
    def load_tile(smem, stage, cache, k_start, k_end, kc, tid):
        """The key rows ``k_start ..`` (those below ``k_end``; the rest zeros) into ``stage``:
        thread ``tid`` copies its chunks of row ``tid // (THREADS / BLOCK_N)``, looking up the
        row's page; a table entry outside the cache is not read (zeros) and returned as bad.
        One copy group (empty past the last tile)."""
        row = tid // (THREADS // BLOCK_N)
        key = k_start + row
        elem, v_elem, ok, bad = key_row(kc, key, key < k_end)
        part = tid % (THREADS // BLOCK_N)   # spelled out: a named constant gives 6 more SASS
        copy_key(smem, STAGE0 + stage * TILE_BYTES + row * ROW_STAGED, cache, elem, ok, part)
        copy_value(smem, stage * TILE_BYTES + V_TILE + row * RBV, kc.v, v_elem, ok, part)
        cp_async_commit()
        return bad

    # [docs:mla-gather]
    @_stage
    def load_listed_tile(smem, seen, stage, cache, t_start, t_end, kc, listed, keys, tid):
        """``GATHER``: the key rows of list entries ``t_start ..`` (below ``t_end``) into
        ``stage``, each through its own page; ``seen[stage, row]`` says whether the row's
        key is one the block's rows see (``keys``: ``(lo, hi)``, the window and causal bounds
        of the token, the pad and the length folded in; -1, hidden and bad entries: a zero row
        and 0).  An entry outside ``[-1, seqlen)`` or a bad table entry is never read and is
        returned as bad."""
        row = tid // (THREADS // BLOCK_N)
        t = t_start + row
        j = int32(-1)
        if t < t_end:
            j = int32(listed[t])
        elem, v_elem, ok, bad_page = key_row(kc, j, keys[0] <= j and j < keys[1])
        bad = bad_page or j < -1 or j >= kc.seqlen
        part = tid % (THREADS // BLOCK_N)   # spelled out: a named constant gives 6 more SASS
        copy_key(smem, STAGE0 + stage * TILE_BYTES + row * ROW_STAGED, cache, elem, ok, part)
        copy_value(smem, stage * TILE_BYTES + V_TILE + row * RBV, kc.v, v_elem, ok, part)
        if tid % (THREADS // BLOCK_N) == 0:
            seen[stage, row] = 1 if ok else 0
        cp_async_commit()
        return bad

    @_stage
    def mask_listed(s, seen, stage, t):
        """``GATHER``: ``S = -inf`` for the tile's keys the rows do not see (a zero key row
        scores 0, not ``-inf``); the lane's key ``c`` is column ``8 (c >> 1) + 2 t + (c & 1)``."""
        for r in range(ROWS):
            for c in range(KEYS):
                if seen[stage, 8 * (c >> 1) + 2 * t + (c & 1)] == 0:
                    s[r, c] = NEG_INF
    # [/docs:mla-gather]

    @_stage
    def exchange_s(sp, s, warp, g, t):
        """Write this warp's partial ``S`` to shared memory (``sp``), then (after the barrier)
        sum the ``NUM_WARPS`` partials in one order: every warp gets the same ``S``."""
        for r in range(ROWS):
            for c in range(KEYS):
                sp[warp * SP_WARP + (g + 8 * r) * SP_ROW + 8 * (c >> 1) + 2 * t + (c & 1)] = \
                    s[r, c]
        cuda.syncthreads()  # every warp's partial S is in shared memory before any sums them
        for r in range(ROWS):
            for c in range(KEYS):
                off = (g + 8 * r) * SP_ROW + 8 * (c >> 1) + 2 * t + (c & 1)
                total = sp[off]
                for w in range(1, NUM_WARPS):
                    total += sp[off + w * SP_WARP]
                s[r, c] = total

    @_stage
    def own_s(sp, s, warp, g, t):
        """One warp: its ``S`` is the whole product (nothing to exchange)."""
        pass

    @_stage
    def widen_tile(smem, stage, tid):
        """``KV_FP8``: the e4m3 bytes of ``stage`` into the 16-bit key tile at byte 0 (rows of
        ``RB`` bytes, as a 16-bit stage's): the ``TPR`` threads of a row (those that copied it)
        take its words ``part, part + TPR, ...``, unrolled (:func:`make_widen_word`)."""
        row = tid // (THREADS // BLOCK_N)
        part = tid % (THREADS // BLOCK_N)   # spelled out: a named constant gives 6 more SASS
        widen_words((smem, uint32((STAGE0 + stage * TILE_BYTES) // 4 + row * F8_ROW_WORDS
                                  + part), uint32(row * (RB // 4) + 2 * part)))

    return MlaTileStages(load_tile, load_listed_tile, mask_listed,
                         exchange_s if NUM_WARPS > 1 else own_s, widen_tile)


#: the MLA block's place (:func:`make_mla_block`): sequence ``b``, kv head ``kvh``, query token
#: ``token``, ``split``; its heads ``[h0, h_end)`` (a head at or past ``h_end`` is a zero row);
#: the sequence's length, ``bad_len``, ``offset`` (token i at key column i + offset) and the
#: window ``(left, right)``; the split's keys ``[lo, s_hi)`` (all tokens: the pages checked),
#: the entries the block reads ``[r_lo, r_hi)`` (its row's keys, or ``GATHER``'s list entries),
#: the keys ``(lo, hi)`` its rows see and ``GATHER``'s index list
MlaBlock = namedtuple("MlaBlock", "b kvh token split h0 h_end seqlen bad_len offset left right "
                      "lo s_hi r_lo r_hi keys listed")


@functools.lru_cache(maxsize=None)
def make_mla_block(cfg):
    """The prologue's stage ``block_keys(q, table, seqlens, leftpad, va, paged, n_kv_heads,
    block_size, split_target, split_min, kv_indices)``: the :data:`MlaBlock` of block ``(x,
    s)``, which rows, keys and split (the decode's split rule, from ``L`` and the pad alone)."""
    BLOCK_N, GATHER = cfg.BLOCK_N, cfg.GATHER

    @_stage
    def block_keys(q, table, seqlens, leftpad, va, paged, n_kv_heads, block_size, split_target,
                   split_min, kv_indices):
        n_heads = q.shape[1]
        nq = q.shape[2]
        hkv = n_kv_heads
        group = n_heads // hkv
        chunks = (group + 15) // 16
        bx = cuda.blockIdx.x
        z = bx % chunks
        token = int32(bx // chunks % nq)          # every row of the block is query token i
        kvh = bx // chunks // nq % hkv
        b = bx // chunks // nq // hkv
        split = cuda.blockIdx.y
        h0 = kvh * group + z * 16                 # the block's first head
        h_end = kvh * group + group               # heads at or past it are zero rows
        seqlen = seqlens[b]
        pad = leftpad[b]
        capacity = block_size * (table.shape[1] if paged else 1)
        bad_len = seqlen < 0 or seqlen > capacity or pad < 0 or pad > seqlen
        offset = seqlen - nq                      # bottom-right: token i at key column i + offset
        left, right = va.window
        # the split's keys (decode's rule, from L and the pad alone), then this row's share
        klo, khi = tile_key_range(0, nq, offset, seqlen, left, right)
        klo = max(klo, pad)
        khi = max(khi, klo)
        size = max(split_min, (khi - klo + split_target - 1) // split_target)
        size = (size + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        lo = klo + split * size
        s_hi = min(lo + size, khi)                # the split's keys end (all tokens)
        row_lo, row_hi = key_bounds(token, offset, seqlen, left, right)
        r_lo = int32(max(lo, row_lo, pad))
        r_hi = int32(min(lo + size, khi, row_hi))
        listed = kv_indices[0, 0, 0]
        if GATHER:   # the split takes list entries [r_lo, r_hi); the rows see keys [k_lo, k_hi)
            listed = kv_indices[b, kvh if kv_indices.shape[1] > 1 else 0, token]
            topk = kv_indices.shape[3]
            size = max(split_min, (topk + split_target - 1) // split_target)
            size = (size + BLOCK_N - 1) // BLOCK_N * BLOCK_N
            r_lo = int32(split * size)
            r_hi = int32(min(r_lo + size, topk))
        if bad_len:
            r_hi = r_lo                           # read nothing; the output is NaN
        keys = (int32(max(row_lo, pad)), int32(min(row_hi, seqlen)))   # (GATHER) the rows see
        return MlaBlock(b, kvh, token, split, h0, h_end, seqlen, bad_len, offset, left, right,
                        lo, s_hi, r_lo, r_hi, keys, listed)

    return block_keys


@functools.lru_cache(maxsize=None)
def make_mla_io(cfg):
    """``(q_elem, o_rows)``: where a block's ``q`` and ``o`` rows lie.  ``q_elem(q, b, h,
    token)``: the first element of q's row ``(b, h, token)``; ``o_rows(o, b, token, elem0,
    nq)``: ``(o_elem0, o_row)``, the first ``o`` element of head 0 of ``(b, token)`` and the
    elements from one head to the next (``elem0 = (b H) Nq + token``).  C-contiguous ``q`` and a
    flat ``o`` (their ``[B, H, Nq, d]`` C order), or ``STRIDED``: views read and written
    through their element strides (:func:`~numba_flash.kernels.core.common.make_elem_strides`,
    as the split-KV decode reads its q: ``b s0 + h s1 + token s2``)."""
    D_QK, D_V = cfg.D_QK, cfg.D_V
    elem_strides = make_elem_strides(2)      # 16-bit q and o (bfloat16 as its words)

    if cfg.STRIDED:
        @_stage
        def q_elem(q, b, h, token):
            qs = elem_strides(q)
            return b * qs[0] + h * qs[1] + token * qs[2]

        @_stage
        def o_rows(o, b, token, elem0, nq):
            os_ = elem_strides(o)
            return b * os_[0] + token * os_[2], os_[1]
    else:
        @_stage
        def q_elem(q, b, h, token):
            return ((b * q.shape[1] + h) * q.shape[2] + token) * D_QK

        @_stage
        def o_rows(o, b, token, elem0, nq):
            return elem0 * D_V, nq * D_V

    return q_elem, o_rows


@functools.lru_cache(maxsize=None)
def make_mla_steps(cfg):
    """``(step_full, step_masked, step_listed)``: the MLA decode's per-tile stage ``step(n,
    k_start, x)`` (``x``: the :data:`MlaStep`) for a whole key tile, the block's last tile
    (masked per key) and, ``GATHER``, a tile of list entries: copy, GEMM, partial-sum exchange,
    tile scores, softmax update, GEMM."""
    BLOCK_N, STAGES, DTYPE, KV_FP8 = cfg.BLOCK_N, cfg.STAGES, cfg.DTYPE, cfg.KV_FP8
    RB, RBV, K_STEPS_W, V_COLS_W = cfg.ROW_BYTES, cfg.V_ROW_BYTES, cfg.K_STEPS_W, cfg.V_COLS_W
    TILE_BYTES = cfg.STAGE_BYTES             # a stage: the K tile (then OWN_V's V tile)
    ROWS = 2                                 # a lane's rows: g and g + 8
    KEYS = BLOCK_N // 4                      # a lane's scores per row
    COLS = V_COLS_W // 4                     # a lane's output columns per row
    ZERO = float32(0.0)
    XOR = (1, 2)                             # a row's 4 lanes (its quad)
    gemm_s = make_gemm(1, BLOCK_N // 16, K_STEPS_W, "regs", False, RB, RB, DTYPE)  # Q K^T
    gemm_pv = make_gemm(1, V_COLS_W // 16, BLOCK_N // 16, "acc", True, RB, RBV, DTYPE)  # P V
    scores_masked, scores_full = make_tile_scores_pair(ROWS, KEYS, SAME_ROW, ACC_COLS, True,
                                                       False, False, None, float32)
    _init, softmax_update, _fin = make_online_softmax(ROWS, KEYS, COLS, XOR, "ex2", float32,
                                                      RESCALE_LOG2)
    load_tile, load_listed_tile, mask_listed, exchange_s, widen_tile = make_mla_tile_stages(cfg)

    def make_step(MASKED, LISTED=False):
        """One key tile; ``MASKED`` (compile time): the tile reaches past the block's last key
        (the split's end or the row's), so its scores are masked per key; ``LISTED``
        (``GATHER``): the tile is ``BLOCK_N`` list entries, copied through
        :func:`load_listed_tile` and masked by their seen flags."""
        tile_scores = scores_masked if MASKED else scores_full

        if LISTED:
            @_stage
            def load_next(smem, stage, k_start, x):
                return load_listed_tile(smem, x.seen, stage, x.cache, k_start, x.bounds[0],
                                        x.kc, x.listed, x.keys, x.tid)

            @_stage
            def mask_scores(s, n, k_start, x):     # keys the rows do not see
                mask_listed(s, x.seen, n % STAGES, x.t)
        else:
            @_stage
            def load_next(smem, stage, k_start, x):
                return load_tile(smem, stage, x.cache, k_start, x.bounds[0], x.kc, x.tid)

            @_stage
            def mask_scores(s, n, k_start, x):     # mask the tile's end
                tile_scores(s, x.sa, x.token, k_start + 2 * x.t, x.bounds, False)

        # [docs:mla-step]
        @_stage
        def step(n, k_start, x):   # x: the MlaStep
            smem, sp = x.smem, x.sp
            qf, s, acc, m_i, l_i, bad_sh = x.qf, x.s, x.acc, x.m_i, x.l_i, x.bad_sh
            warp, g, t, k_b, v_b = x.warp, x.g, x.t, x.k_b, x.v_b
            r_hi = x.bounds[0]
            kb = 0 if KV_FP8 else (n % STAGES) * TILE_BYTES   # (KV_FP8: the widened tile)
            cp_async_wait_all()
            cuda.syncthreads()  # tile n landed for all; every warp is done with tile n - 1
            if k_start + BLOCK_N < r_hi:   # tile n + 1 lands under this one
                if load_next(smem, (n + 1) % STAGES, k_start + BLOCK_N, x):
                    bad_sh[0] = 1
            if KV_FP8:                                                   # e4m3 -> 16-bit
                widen_tile(smem, n % STAGES, x.tid)
                cuda.syncthreads()  # the widened tile is whole before any warp's ldmatrix
            for r in range(ROWS):
                for c in range(KEYS):
                    s[r, c] = ZERO
            gemm_s(s, qf, smem, 0, kb + k_b)                             # S_w = Q_w K_w^T
            exchange_s(sp, s, warp, g, t)                                # S = sum_w S_w
            mask_scores(s, n, k_start, x)                                # the tile's mask
            softmax_update(s, acc, m_i, l_i, x.exp_scale)                # m_i, l_i, P, acc *= a
            gemm_pv(acc, s, smem, 0, kb + v_b)                           # acc_w += P V_w
        # [/docs:mla-step]

        return step

    return make_step(False), make_step(True), make_step(False, LISTED=True)


#: the cache rows a block reads (``load_tile``): the block table, batch ``b``, the rows before
#: its kv head's in a block (``kvh * strides[1]``), block size, paged (0/1), the cache's blocks,
#: the sequence's length, the value cache (``OWN_V``; else the latent cache again, unread), the
#: cache's row strides ``(block, head, slot)`` (its memory order's: both caches alike)
CacheRows = namedtuple("CacheRows", "table b kvh_rows block_size paged n_blocks seqlen v strides")
#: the MLA step's context: shared memory (the key tiles, the warps' partial S), the cache and
#: its rows, the score arguments; the lane's register arrays and the bad-entry flag; its
#: coordinates and K / V fragment offsets; the query token, the bounds, the exponent factor;
#: ``GATHER``: the token's list, the tiles' seen flags and the keys ``(lo, hi)`` the rows see
MlaStep = namedtuple("MlaStep", "smem sp cache kc sa qf s acc m_i l_i bad_sh tid warp g t k_b v_b "
                     "token bounds exp_scale listed seen keys")


@functools.lru_cache(maxsize=None)
def mla_decode_kernel(cfg):
    """Build ``kernel(q, cache, table, seqlens, leftpad, o, lse, o_part, lse_part, va, paged,
    n_cache_blocks, n_kv_heads, block_size, strides, split_target, split_min, partial,
    kv_indices, v_cache, kv_descale)`` for the
    :class:`~numba_flash.kernels.decode.config.MlaDecodeConfig` ``cfg``.

    ``q``: the uint16 view of ``[B, H, Nq, D_QK]`` (C-contiguous; ``STRIDED``: a view whose last dim
    is contiguous, read through its element strides); ``cache``: the uint16 view of the cache's
    memory as rows ``[num_blocks * Hkv * block_size, D_QK]`` (slot ``s`` of kv head ``h`` in block
    ``n`` at row ``n * strides[0] + h * strides[1] + s * strides[2]``, int64: heads-first memory
    ``(Hkv block_size, block_size, 1)``, tokens-first ``(block_size Hkv, 1, Hkv)``); ``table``:
    int32 ``[B, max_blocks]`` (``paged`` = 1; else sequence ``b`` is block ``b`` of ``block_size =
    Nmax`` slots); ``seqlens``, ``leftpad``: int32 ``[B]``; ``o``: the flat view of ``[B, H, Nq,
    D_V]`` (float16, or bfloat16's uint16 words; ``STRIDED``: the ``[B, H, Nq, D_V]`` view itself,
    written through its element strides), ``lse`` float32 ``[B H Nq]``; with ``partial`` = 1,
    ``o_part`` float32 ``[splits B H Nq D_V]`` and ``lse_part`` ``[splits B H Nq]`` (flat) instead;
    ``va``: the :class:`~numba_flash.kernels.core.variant.Variant` (its ``scale`` and ``window``);
    ``kv_indices``: int32 ``[B, Hkv or 1, Nq, topk]`` with ``GATHER``, else a ``[1, 1, 1, 1]``
    stand-in; ``v_cache``: ``OWN_V``: the uint16 view of the value cache as rows
    ``[num_blocks * Hkv * block_size, D_V]`` (the key rows' numbering), else ``cache`` again
    (unread); ``kv_descale``: float32 ``[2, B, Hkv]``, ``KV_FP8``'s K and V descales
    (``cache`` then the uint16 view of the e4m3 bytes, rows ``[.., D_QK / 2]``), else unread."""
    assert isinstance(cfg, MlaDecodeConfig) and cfg.DTYPE in MMA_DTYPES
    assert cfg.D_QK % 64 == 0 and cfg.D_V % 64 == 0 and (cfg.OWN_V or cfg.D_V <= cfg.D_QK)
    D_QK, D_V, BLOCK_N, STAGES, DTYPE = cfg.D_QK, cfg.D_V, cfg.BLOCK_N, cfg.STAGES, cfg.DTYPE
    GATHER = cfg.GATHER
    NUM_WARPS, THREADS, RB, RBV = cfg.NUM_WARPS, cfg.THREADS, cfg.ROW_BYTES, cfg.V_ROW_BYTES
    K_STEPS_W, V_COLS_W, SP_ROW = cfg.K_STEPS_W, cfg.V_COLS_W, cfg.SP_ROW
    assert THREADS % BLOCK_N == 0
    TILE_BYTES = cfg.STAGE_BYTES             # a stage: the K tile (then OWN_V's V tile)
    V_TILE = cfg.V_TILE                      # the V tile's offset in its stage (OWN_V)
    SMEM_WORDS = (cfg.WIDE_BYTES + STAGES * TILE_BYTES) // 4   # the key tiles (16-bit pairs;
    # KV_FP8: the widened tile, then the stages' bytes)
    SP_WARP = 16 * SP_ROW                    # words of one warp's partial S
    SP_WORDS = NUM_WARPS * SP_WARP if NUM_WARPS > 1 else 1   # the warps' partial S (float32)
    ROWS = 2                                 # a lane's rows: g and g + 8
    KEYS = BLOCK_N // 4                      # a lane's scores per row
    COLS = V_COLS_W // 4                     # a lane's output columns per row
    ROW_CHUNKS = D_QK // 8                   # 16-byte chunks of a cache row
    NAN = float32(math.nan)
    NEG_INF = float32(-math.inf)
    LOG2E_F = float32(LOG2E)
    XOR = (1, 2)                             # a row's 4 lanes (its quad)

    # -- the stages
    load_q = make_load_a(1, K_STEPS_W, RB)
    softmax_init, _update, _fin = make_online_softmax(ROWS, KEYS, COLS, XOR, "ex2", float32,
                                                      RESCALE_LOG2)
    # o and lse rows are heads: lse's row stride is Nq
    epilogue_o = make_epilogue(ROWS, COLS, XOR, ACC_ROWS, ACC_COLS, element_ops(DTYPE)[1],
                               float32, True, cfg.STRIDED)
    epilogue_part = make_epilogue(ROWS, COLS, XOR, ACC_ROWS, ACC_COLS, element_ops("float32")[1],
                                  float32, True)
    copy_q_row = make_row_copy(THREADS // 16, ROW_CHUNKS)
    q_elem, o_rows = make_mla_io(cfg)         # q's rows and o's: C order, or their strides
    load_tile, load_listed_tile, _mask, _exchange, _widen = make_mla_tile_stages(cfg)
    KV_FP8 = cfg.KV_FP8
    block_keys = make_mla_block(cfg)          # the block's rows, keys and split
    step_full, step_masked, step_listed = make_mla_steps(cfg)   # one key tile

    @kernel_jit
    def mla_decode(q, cache, table, seqlens, leftpad, o, lse, o_part, lse_part, va, paged,
                   n_cache_blocks, n_kv_heads, block_size, strides, split_target, split_min,
                   partial, kv_indices, v_cache, kv_descale):
        # -- which rows, keys and split
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2                 # the lane's rows g, g + 8 (heads h0 + g, h0 + g + 8)
        t = lane & 3                  # the lane's key / column pair 2t, 2t + 1 of a fragment
        n_heads = q.shape[1]
        nq = q.shape[2]
        n_splits = cuda.gridDim.y
        blk = block_keys(q, table, seqlens, leftpad, va, paged, n_kv_heads, block_size,
                         split_target, split_min, kv_indices)
        b, kvh, token, h0, h_end = blk.b, blk.kvh, blk.token, blk.h0, blk.h_end
        r_lo, r_hi, listed, keys = blk.r_lo, blk.r_hi, blk.listed, blk.keys

        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SHARED_ALIGN)
        sp = cuda.shared.array(SP_WORDS, float32)
        bad_sh = cuda.shared.array(1, int32)
        seen = cuda.shared.array((STAGES, BLOCK_N), int32)   # GATHER: a tile row's key is seen
        qf = cuda.local.array((1, K_STEPS_W, 4), uint32)
        s = cuda.local.array((ROWS, KEYS), float32)
        acc = cuda.local.array((ROWS, COLS), float32)
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)

        # -- prologue: the 16 heads' q rows (zeros past the group) through stage 0, each warp's
        # fragments of its k-steps into registers, then the first key tile
        if tid == 0:
            bad_sh[0] = 0
        q_row = tid // (THREADS // 16)
        h = h0 + q_row
        copy_q_row(smem, q_row * RB, q, q_elem(q, b, h, token), h < h_end, tid % (THREADS // 16))
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()  # the q tile is complete before any warp reads its fragments
        load_q(qf, smem, lane_offset(lane, RB, KIND_A) + 32 * K_STEPS_W * warp)
        cuda.syncthreads()  # every warp holds its fragments: stage 0 takes the first key tile
        kc = CacheRows(table, b, kvh * strides[1], block_size, paged, n_cache_blocks, blk.seqlen,
                       v_cache, strides)
        if GATHER:
            if r_lo < r_hi and load_listed_tile(smem, seen, 0, cache, r_lo, r_hi, kc, listed, keys,
                                                tid):
                bad_sh[0] = 1
        elif r_lo < r_hi and load_tile(smem, 0, cache, r_lo, r_hi, kc, tid):
            bad_sh[0] = 1
        # every page of the split's keys (all tokens): a bad entry any token reads makes the
        # whole sequence NaN (GATHER: each listed key's page, as it is read)
        if paged and not blk.bad_len and not GATHER:
            if blk.lo < blk.s_hi:
                j = blk.lo // block_size + tid
                while j <= (blk.s_hi - 1) // block_size:
                    if table[b, j] < 0 or table[b, j] >= n_cache_blocks:
                        bad_sh[0] = 1
                    j += THREADS
        softmax_init(m_i, l_i, acc)
        scale = va.scale                          # KV_FP8: K's descale folds into the scale
        if KV_FP8:
            scale = va.scale * kv_descale[0, b, kvh]
        sa = score_args(scale, b, blk.offset, nq)
        ctx = MlaStep(smem, sp, cache, kc, sa, qf, s, acc, m_i, l_i, bad_sh, tid, warp, g, t,
                      lane_offset(lane, RB, KIND_B) + 32 * K_STEPS_W * warp,   # K: the warp's
                      # V: the warp's columns (OWN_V: in the stage's V tile)
                      lane_offset(lane, RBV, KIND_A) + 2 * V_COLS_W * warp + V_TILE,
                      token, (r_hi, blk.left, blk.right), scale * LOG2E_F, listed, seen, keys)

        # -- the key tiles: whole ones unmasked, the last (past r_hi) masked
        n = 0
        k_start = r_lo
        if GATHER:   # tiles of list entries, each masked by its seen flags
            while k_start < r_hi:
                step_listed(n, k_start, ctx)
                n += 1
                k_start += BLOCK_N
        else:
            while k_start + BLOCK_N <= r_hi:
                step_full(n, k_start, ctx)
                n += 1
                k_start += BLOCK_N
            if k_start < r_hi:
                step_masked(n, k_start, ctx)
        cuda.syncthreads()  # every thread's bad-entry flag is in shared memory
        if blk.bad_len or bad_sh[0] != 0:
            for r in range(ROWS):
                m_i[r] = NAN                      # o = lse = NaN (finalize's NaN path)
                l_i[r] = NAN
        if KV_FP8:                                # V's descale scales o (linear in acc)
            v_scale = kv_descale[1, b, kvh]
            for r in range(ROWS):
                for c in range(COLS):
                    acc[r, c] *= v_scale

        # -- epilogue: o = acc / l and lse, or float32 partials for the merge
        cols = (2 * t + V_COLS_W * warp, D_V)
        row0 = h0 + g
        elem0 = b * n_heads * nq + token          # (b, h, i) is element elem0 + h nq
        if partial:
            part0 = blk.split * (o_part.shape[0] // (n_splits * D_V))
            epilogue_part(o_part, lse_part, acc, m_i, l_i, scale,
                          EpilogueRows(row0, h_end, (part0 + elem0) * D_V, nq * D_V,
                                       part0 + elem0, t == 0 and warp == 0, nq), cols, NEG_INF)
        else:
            o_elem0, o_row = o_rows(o, b, token, elem0, nq)
            epilogue_o(o, lse, acc, m_i, l_i, scale,
                       EpilogueRows(row0, h_end, o_elem0, o_row, elem0, t == 0 and warp == 0,
                                    nq),
                       cols, NEG_INF)

    return mla_decode


@device_jit(inline=True)
def score_args(scale, b, offset, nq):
    """The tile-scores stage's :class:`~numba_flash.kernels.mainloop.tile_scores.ScoreArgs` of a
    block (no softcap, ALiBi or user functions on this path: only ``offset`` and ``nq`` are
    read)."""
    zero = float32(0.0)
    return ScoreArgs(scale, zero, zero, zero, offset, nq, int32(b), int32(0), ())
