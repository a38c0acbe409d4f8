"""FlashDecoding: split-KV attention of a few query rows against a (paged) KV cache, with the
combine fused into the same launch.

Contract (:func:`numba_flash.reference.attention` of the last ``Nq`` rows): sequence ``b`` has ``L
= seqlens[b]`` cached keys, ``Nq`` new query tokens aligned bottom-right (token ``i`` at key column
``i + L - Nq``) and, with ``leftpad[b] = P``, keys ``[P, L)`` only.  The keys some row sees,
``[klo, khi)`` (:func:`~numba_flash.kernels.mainloop.visibility.tile_key_range`: window, causal,
``L``, ``P``), are cut into splits of ``size = round_up(max(split_min, cdiv(khi - klo,
split_target)), STEP)`` keys, from the sequence's own ``L`` only (batch invariance).  Each split's
partial state ``(o_rs, lse_rs)`` (online softmax over ``S_rj = scale q_r . k_j`` through
:mod:`~numba_flash.kernels.mainloop.visibility`'s score modifier) merges by the log-sum-exp rule
(:func:`~numba_flash.kernels.decode.merge.make_merge_functions`) in the last block of its
``(sequence, kv head, row chunk)`` to finish; one split writes ``o`` directly.  A bad table entry
for a key some row sees, or a bad ``L`` or ``P``, gives the sequence ``o = lse = NaN``, and nothing
outside the cache is read.

:func:`decode_kernel` ``(cfg)`` builds the kernel for a
:class:`~numba_flash.kernels.decode.config.DecodeConfig`: ``THREADS``, ``LANES`` (a key group's
lanes), ``CHUNK`` (elements of 16 bytes), ``U`` (keys a group takes per step), ``ROWS`` (the
smallest of 1, 2, 4, 8 that holds ``G * Nq`` within a register budget), ``HEAD_DIM``, the dtype and
the flags ``VEC`` (16-byte loads), ``PAGED``, ``SOFTCAP``, ``ALIBI``, ``SPLIT_PAGES`` (a block size
``U`` does not divide), ``USER``, ``OWN_V``, ``KV_FP8``, ``GATHER`` (token-sparse: a block per
query token, its keys the positions of its list, docs/sparse-attention.md), ``SLOT_STRIDE`` (a
cache whose consecutive slots are not consecutive rows of its memory: tokens-first; the caches
are read through launch-time row strides, docs/paged-attention.md).

Grid ``(B * Hkv * chunks, splits)``: x is ``(b * Hkv + kvh) * chunks + z``, y the split; block
``(THREADS,)``.  Block ``(x, s)`` serves the query rows ``r = g * Nq + i`` of kv head ``kvh``'s GQA
group in chunk ``z`` of ``ROWS`` rows.  ``NG = THREADS // LANES`` key groups; lane ``l`` of a group
holds the ``DPL = HEAD_DIM // LANES`` elements ``l * CHUNK + LANES * CHUNK * i + e`` of a K or V
row (:mod:`~numba_flash.kernels.decode.config`'s ``lane_layout``) and a ``ROWS x DPL``
accumulator in registers.  Shared memory: ``q_sh`` (each lane's pieces of the rows, in the
lane's own row order: :func:`make_own_row_of`) and ``acc_sh [ROWS, HEAD_DIM]`` (compute
type), ``m_sh``, ``l_sh [NG, ROWS]``, per-row ``M``, ``W``, ``lse`` and two flags: 2.6-8.4
KiB, never the limit; registers are (``gpu_min_blocks``).  The float32 workspace ``o_part``,
``lse_part`` and the int32 ``counters`` hold the splits' partials and tickets.  float16 and
bfloat16 caches compute in float32 (bfloat16 through float32 views, :func:`cache_views`),
float64 in float64.

File: the kernel's contexts (:data:`DecodeRows`, :data:`SeqKeys`, :data:`OwnRow`,
:data:`BlockCoords`, :data:`DecodeStep`), its stage factories (:func:`make_load_q_rows`,
:func:`make_key_loads` from :func:`make_kv_rows`, :func:`make_key_cursor`,
:func:`make_tile_load` and :func:`make_gather_keys`; :func:`make_own_row_stages`,
:func:`make_decode_epilogue`, :func:`make_block_coords`, :func:`make_decode_step`), the kernel,
the compile tier's types; the tile choice and split policy:
:mod:`~numba_flash.kernels.decode.config`.  How and why, with the machine-code counts:
docs/flash-decoding.md (the kernel section); the block table: docs/paged-attention.md.
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

import numpy as np
from numba import cuda, int32, int64, types, uint32, uint64

from ..core.common import FULL_MASK, acc_dtype, compute_type, make_elem_strides, numba_array_type
from ..core.elements import (
    element_ops, float32_bits, float32_from_bits, is_bfloat16,
)
from ..core.jit import device_jit, kernel_jit
from ..core.variant import variant_type
from ..mainloop.online_softmax import make_online_softmax, sink_of
from ..mainloop.tile_scores import ScoreArgs, make_score_fn
from ..mainloop.visibility import key_bounds, make_score_mod, tile_key_range
from ..ptx.fp8 import e4m3x4_to_float32
from ..ptx.stages import SHARED_ALIGN, in_loop, lds16, load16, load_at, shfl_xor
from .config import launch_bounds
from .merge import make_merge_functions, make_state_merge

#: bfloat16 bits: the upper word of a float32 (the lower one is ``bits << 16``)
_HI_WORD = uint32(0xFFFF0000)
_SHIFT16 = uint32(16)


#: the block's rows: sequence ``b``, kv head ``kvh`` (its GQA ``group`` of query heads), the
#: chunk's first row ``row0`` of the group's ``n_rows = group * nq``, the split of ``n_splits``;
#: with ``GATHER`` the block's one query token ``tok`` (its rows are heads: ``n_rows = group``)
DecodeRows = namedtuple("DecodeRows", "b kvh group row0 n_rows nq split n_splits tok")
#: the sequence's keys: ``[pad, seqlen)``, row ``i`` at key column ``i + offset``, the window
#: ``(left, right)`` and ``khi``, the end of the keys some row sees
SeqKeys = namedtuple("SeqKeys", "seqlen pad offset left right khi")
#: a lane's own row after the reduce-scatter (:func:`make_own_row_stages`): its index ``r`` in
#: the chunk, ``live``, the keys ``[lo, hi)`` it sees, its query head ``h`` and column ``q_col``
OwnRow = namedtuple("OwnRow", "r live lo hi h q_col")
#: a key's place in the block table: entry ``j_blk``, ``slot`` in the page (or a step of them)
KeyCursor = namedtuple("KeyCursor", "j_blk slot")
#: per-lane constants of the cache layout: a block's rows before my head's, cache rows and view
#: elements per physical block, my first view element of a row, the table's last column, my
#: first view element in a physical block (``VEC``), my sequence's first table element
#: (``PAGED``), and the rows (``slot_rows``) and view elements (``slot_elems``) from a slot to
#: the next (1 and a row heads-first, ``Hkv`` rows tokens-first: the cache's memory order)
CacheLayout = namedtuple("CacheLayout",
                         "kvh_rows row_stride blk_elems col0_v last_entry lane_elem0 table0 "
                         "slot_rows slot_elems slot_step")
#: the stages of the kernel (:func:`make_key_loads`, :func:`make_own_row_stages`,
#: :func:`make_decode_epilogue`)
KeyLoads = namedtuple("KeyLoads",
                      "first_keys next_keys cache_layout locate_keys resolve_key gather_keys "
                      "share_keys load_keys widen")
OwnRowStages = namedtuple("OwnRowStages",
                          "own_row own_score_args own_scores own_softmax accumulate")
DecodeEpilogue = namedtuple("DecodeEpilogue", "merge_groups write_split combine")

#: a stage of the kernel: inlined into it, in a module of its own
_stage = functools.partial(device_jit, own_module=True, inline="always")



def _types(cfg):
    """``(acc_t, load, store)``: the compute type of ``cfg.DTYPE`` and its element <-> compute
    type stages (:mod:`numba_flash.kernels.core.elements`)."""
    return (compute_type(cfg.np_dtype),) + tuple(element_ops(cfg.np_dtype))


@functools.lru_cache(maxsize=None)
def make_row_coords(cfg):
    """The stage ``row_coords(rows, row, nq)``: ``(h, tok)``, the query head and token of row
    ``row`` of the block's GQA group: rows ``g * nq + i`` (head ``g`` of the group, token
    ``i``), or with ``GATHER`` the heads of the block's one token (an index list per token:
    every row of the block walks the same keys).  ``nq``: the caller's own ``Nq`` (a shape of
    the array it indexes: with one more value live across the kernel, a dense build's step
    took 3 instructions more)."""
    if cfg.GATHER:
        @_stage
        def row_coords(rows, row, nq):
            return rows.kvh * rows.group + row, rows.tok
    else:
        @_stage
        def row_coords(rows, row, nq):
            return rows.kvh * rows.group + row // nq, row % nq
    return row_coords


@functools.lru_cache(maxsize=None)
def make_own_row_of(cfg):
    """The stage ``own_row_of(lane)``: ``r_own``, the row of the block's chunk that lane
    ``lane`` of a key group owns after the reduce-scatter (:func:`make_own_row_stages`): the
    lane's top ``LOG_ROWS`` offset bits (butterfly step ``i`` keeps the half of the rows whose
    bit ``ROWS >> (i + 1)`` is the lane's bit ``LANES >> (i + 1)``); 0 with one row (a
    constant: the one-row build's code does not change).  It is also the lane's row order in
    ``q_sh`` (:func:`make_load_q_rows`)."""
    SHIFT = cfg.LOG_LANES - cfg.LOG_ROWS
    if cfg.ROWS == 1:
        @_stage
        def own_row_of(lane):
            return int32(0)
    else:
        @_stage
        def own_row_of(lane):
            return int32(lane >> SHIFT)
    return own_row_of


@functools.lru_cache(maxsize=None)
def make_load_q_rows(cfg):
    """The prologue's stage ``load_q_rows``: the block's pre-scaled q rows into shared memory."""
    LANES, CHUNK, ROWS, DPL = cfg.LANES, cfg.CHUNK, cfg.ROWS, cfg.DPL
    NCH, COL, V4, QP, Q_VEC, USER_FN = cfg.NCH, cfg.COL, cfg.V4, cfg.QP, cfg.Q_VEC, cfg.USER_FN
    GATHER = cfg.GATHER
    acc_t, load, _store = _types(cfg)
    ZERO = acc_t(0.0)
    row_coords = make_row_coords(cfg)
    own_row_of = make_own_row_of(cfg)
    # q's element strides (a view of flash-attn's [B, Nq, H, d] memory as well as a C array:
    # read once a row in the prologue, nothing held across the key loop)
    q_strides = make_elem_strides(cfg.np_dtype.itemsize)

    @_stage
    def load_q_rows(q, q_sh, acc, rows, seq, lo, hi, scale, lane, grp, col0):
        """The pre-scaled q rows into ``q_sh`` (group 0 writes every lane's pieces: ``QP`` pieces
        of ``V4`` values per lane and row, lane-interleaved, read back 16 bytes at a time),
        ``acc = 0``; returns ``full``: every row sees every key of ``[lo, hi)`` (no mask; never
        with a user's function: its mask may hide any key, its score may be -inf, and either
        makes p "not seen").  A lane's rows go in its own order: row ``r`` into slot ``r ^
        r_own`` (:func:`make_own_row_of`; only the lane reads its pieces), so that its
        reduce-scatter keeps the lower half of its slots at every step and selects nothing
        (:func:`make_own_row_stages`' ``own_scores``)."""
        b, row0, n_rows = rows.b, rows.row0, rows.n_rows
        nq = q.shape[2]
        d = q.shape[3]
        q_val = cuda.local.array(DPL, acc_t)
        full = not USER_FN and not GATHER   # (a list's keys: -1, hidden or repeated)
        r_own = own_row_of(lane)              # my rows' order in q_sh
        for r in range(ROWS):
            row = row0 + r
            h, tok = row_coords(rows, row, nq)
            live_row = row < n_rows
            if grp == 0:
                if Q_VEC:
                    for j in range(DPL):
                        q_val[j] = ZERO
                    if live_row:
                        qs = q_strides(q)
                        e0 = b * qs[0] + h * qs[1] + tok * qs[2] + col0
                        for i in range(NCH):
                            qc = load16(q, e0 + i * (LANES * CHUNK))
                            for e in range(CHUNK):
                                q_val[i * CHUNK + e] = qc[e] * scale
                else:
                    for j in range(DPL):
                        c = col0 + COL[j]
                        val = ZERO
                        if live_row and c < d:
                            val = load(q[b, h, tok, c]) * scale
                        q_val[j] = val
                for pc in range(QP):
                    for e in range(V4):
                        val = ZERO
                        if pc * V4 + e < DPL:
                            val = q_val[pc * V4 + e]
                        q_sh[(((r ^ r_own) * QP + pc) * LANES + lane) * V4 + e] = val
            for j in range(DPL):
                acc[r * DPL + j] = ZERO
            lo_r, hi_r = key_bounds(tok, seq.offset, seq.seqlen, seq.left, seq.right)
            if live_row and (lo_r > lo or hi_r < hi):
                full = False                  # some row does not see every key of the split
        return full

    return load_q_rows


@functools.lru_cache(maxsize=None)
def make_kv_rows(cfg):
    """``(load_key, widen)``: one key's K and V chunks from a 16-byte-aligned view element into
    my registers (``VEC``; bfloat16 pairs split, e4m3 words kept), and ``KV_FP8``'s widening
    of those words to float32 (:func:`make_tile_load` reads the keys through them)."""
    LANES, CHUNK, U, EW = cfg.LANES, cfg.CHUNK, cfg.U, cfg.EW
    DPL, NCH = cfg.DPL, cfg.NCH
    BF16_PAIRS, KV_FP8 = cfg.BF16_PAIRS, cfg.KV_FP8

    @_stage
    def load_key(k_cache, v_cache, e0, u, k_reg, v_reg):
        # key u's K and V chunks from view element e0 (16-byte loads) into the registers
        for i in range(NCH):
            kc = load16(k_cache, e0 + i * (LANES * CHUNK // EW))
            vc = load16(v_cache, e0 + i * (LANES * CHUNK // EW))
            if BF16_PAIRS:                    # 4 float32 = 8 bfloat16 words (low word first)
                for e in range(CHUNK // 2):
                    kb = float32_bits(kc[e])
                    vb = float32_bits(vc[e])
                    j0 = u * DPL + i * CHUNK + 2 * e
                    k_reg[j0] = float32_from_bits(uint32(kb << _SHIFT16))
                    v_reg[j0] = float32_from_bits(uint32(vb << _SHIFT16))
                    k_reg[j0 + 1] = float32_from_bits(uint32(kb & _HI_WORD))
                    v_reg[j0 + 1] = float32_from_bits(uint32(vb & _HI_WORD))
            elif KV_FP8:                      # 4 words = 16 e4m3 bytes, widened by widen()
                for e in range(CHUNK // 4):
                    k_reg[u * DPL + i * (CHUNK // 4) + e] = kc[e]
                    v_reg[u * DPL + i * (CHUNK // 4) + e] = vc[e]
            else:
                for e in range(CHUNK):
                    k_reg[u * DPL + i * CHUNK + e] = kc[e]
                    v_reg[u * DPL + i * CHUNK + e] = vc[e]

    @_stage
    def widen(raw, out):
        """``KV_FP8``: the e4m3 words :func:`load_key` left in ``raw`` (key ``u``'s ``DPL //
        4`` words from ``u * DPL``) as float32 values in ``out`` (``u * DPL + j``).  Called
        after :func:`load_keys`' branches, not in them: 16 words of a ROWS=2 step live across
        the branches instead of 64 float32 (168 registers, the cap, down to 138; the step's
        instructions the same, one ROWS=1 step one more)."""
        for u in range(U):
            for i in range(NCH):
                for e in range(CHUNK // 4):
                    vals = e4m3x4_to_float32(float32_bits(raw[u * DPL + i * (CHUNK // 4) + e]))
                    for w in range(4):
                        out[u * DPL + i * CHUNK + 4 * e + w] = vals[w]

    return load_key, widen


@functools.lru_cache(maxsize=None)
def make_key_cursor(cfg):
    """``(first_keys, next_keys, cache_layout)``: where my group's keys of a block step sit in
    the block table (a :class:`KeyCursor`, advanced one step at a time) and the per-lane
    constants of the cache's layout (:class:`CacheLayout`)."""
    CHUNK, U, HEAD_DIM, STEP, EW = cfg.CHUNK, cfg.U, cfg.HEAD_DIM, cfg.STEP, cfg.EW
    VEC, PAGED, SPLIT_PAGES, SLOT_STRIDE = cfg.VEC, cfg.PAGED, cfg.SPLIT_PAGES, cfg.SLOT_STRIDE

    # [docs:decode-token-lookup]
    @_stage
    def first_keys(lo, grp, block_size):
        """Where my group's first keys live: ``(lo_step, at, step)``.  The block's steps start
        at ``lo_step``, ``lo`` rounded down to a multiple of ``U`` (keys before ``lo`` are dead:
        with a block size that ``U`` divides, a group's ``U`` keys then always share one page);
        ``at`` is my first key's :class:`KeyCursor` (table index ``j_blk``, ``slot``: two
        divisions per split), ``step`` a block step's (``STEP`` keys).  Key positions are int32
        (lengths fit: the host checks them), cache rows int64."""
        lo_step = int32(lo // U * U)
        j_blk = int32((lo_step + grp * U) // block_size)
        slot = int32(lo_step + grp * U - j_blk * block_size)
        step_blk = int32(STEP // block_size)
        step_slot = int32(STEP - step_blk * block_size)
        return lo_step, KeyCursor(j_blk, slot), KeyCursor(step_blk, step_slot)

    @_stage
    def next_keys(j_blk, slot, step, block_size):
        """``(j_blk, slot)`` of my keys of the next block step: ``step`` further, one carry at
        most (scalars, not a :class:`KeyCursor`: with a tuple carried by the loop, ptxas built a
        step 4 instructions longer).  No branch: ``past``, the slot less a block, is negative
        (no carry: its sign adds -1 to ``j_blk + 1``) or the new slot (the smaller as uint32:
        a negative ``past`` is past ``2**31``); 3 instructions fewer than the test and two
        moves, which ptxas built with the compare twice."""
        slot = int32(slot + step.slot)        # < 2 block_size: exact as uint32
        past = int32(slot - block_size)
        j_blk = int32(j_blk + (step.j_blk + 1) + (past >> 31))
        slot = int32(min(uint32(slot), uint32(past)))
        return j_blk, slot
    # [/docs:decode-token-lookup]

    @_stage
    def cache_layout(b, kvh, lane, block_table, strides):
        """The :class:`CacheLayout` of my lane (constants of the walk) for a cache whose row of
        slot ``s`` of kv head ``h`` in physical block ``n`` is ``n * strides[0] + h *
        strides[1] + s * strides[2]`` (its memory order's; int64, the offsets in a block
        int32: the host checks them); the 64-bit ones that :func:`locate_keys` reads every
        step are :func:`_kept64` (NVVM re-derived them in the loop: 8 instructions of the
        e4m3 ROWS=2 step, 9 of the float16 ROWS=4 one)."""
        blk_rows, head_rows, slot_rows = strides
        if not SLOT_STRIDE:                                       # heads-first: a slot a row
            slot_rows = int64(1)
        kvh_rows = int32(kvh * int32(head_rows))                  # a block's rows before my head's
        blk_elems = blk_rows * (HEAD_DIM // EW)                   # view elements per block
        lane_elem0 = int64(kvh_rows) * (HEAD_DIM // EW) + lane * (CHUNK // EW)
        slot_elems = int32(slot_rows) * (HEAD_DIM // EW)         # (a block's offsets: int32)
        table0 = int64(uint32(b)) * block_table.shape[1]
        return CacheLayout(
            kvh_rows=kvh_rows,
            row_stride=blk_rows,                                  # cache rows per physical block
            blk_elems=_kept64(blk_elems) if VEC else blk_elems,
            col0_v=lane * (CHUNK // EW),                          # my first view element of a row
            last_entry=uint32(block_table.shape[1] - 1),          # (PAGED: >= 1 column)
            lane_elem0=_kept64(lane_elem0) if VEC and not SPLIT_PAGES else lane_elem0,
            table0=_kept64(table0) if PAGED else table0,
            slot_rows=int32(slot_rows),
            slot_elems=int32(slot_elems),
            slot_step=_kept64(int64(slot_elems)) if VEC and SLOT_STRIDE else int64(slot_elems))

    return first_keys, next_keys, cache_layout


@functools.lru_cache(maxsize=None)
def make_tile_load(cfg):
    """``(locate_keys, load_keys)``: a block step's keys of my group located through the block
    table (``key_ok``, ``key_at``), then their K and V rows into registers."""
    U, HEAD_DIM, EW = cfg.U, cfg.HEAD_DIM, cfg.EW
    VEC, PAGED, SPLIT_PAGES, OWN_V = cfg.VEC, cfg.PAGED, cfg.SPLIT_PAGES, cfg.OWN_V
    DPL, COL, SLOT_STRIDE, KV_FP8 = cfg.DPL, cfg.COL, cfg.SLOT_STRIDE, cfg.KV_FP8
    acc_t, load, _store = _types(cfg)
    ZERO = acc_t(0.0)
    load_key, _widen = make_kv_rows(cfg)

    # [docs:decode-tile-load]
    @_stage
    def locate_keys(key_ok, key_at, block_table, b, t0, j_blk, slot, lo32, hi32, n_cache_blocks,
                    block_size, keys):
        """Where my group's ``U`` keys ``t0 ..`` live: ``key_ok[u]`` (live and readable) and
        ``key_at[u]`` (view element with ``VEC``, else cache row); returns ``(step_ok,
        bad)``: every key of the step readable, and a live key met a bad table entry (never
        dereferenced).  A group's ``U`` keys are consecutive from a multiple of ``U``, so when
        ``U`` divides the block size (not ``SPLIT_PAGES``) they share one page: one table entry
        and one base address serve them all (key ``u`` is ``u`` slots further: ``u`` rows, an
        immediate offset, heads-first; with ``SLOT_STRIDE``, tokens-first, one add of the slot
        stride, a launch constant); with ``SPLIT_PAGES`` (an odd block size) each key finds its
        own page (one carry at most).
        ``j_blk``, ``slot``: key ``t0``'s table entry and slot; ``keys``: the
        :class:`CacheLayout`, per-lane constants."""
        kvh_rows, row_stride, blk_elems = keys.kvh_rows, keys.row_stride, keys.blk_elems
        bad = False
        if not SPLIT_PAGES:
            blk = int32(b)
            page_ok = True
            if PAGED:
                some_live = t0 < hi32 and int32(t0 + (U - 1)) >= lo32
                # (no branch: an index clamped into the table is always safe to read, and
                # only a live key's entry is used; my row's first element is held, table0)
                entry = load_at(block_table, keys.table0 + min(uint32(j_blk), keys.last_entry))
                page_ok = 0 <= entry and entry < n_cache_blocks
                if some_live and not page_ok:
                    bad = True                # never dereferenced
                blk = int32(entry)
            if VEC and SLOT_STRIDE:           # key 0's view element: its slot from mine
                # (unsigned and the stride made in the step: slot * stride is one
                # IMAD.WIDE.U32 with mine added; a stride widened before the loop made it a
                # 64-bit product, 5 instructions, or left a zero high word added, 2)
                slot_elems = in_loop(keys.slot_elems)
                first = int64(uint64(uint32(blk)) * uint64(blk_elems)
                              + (uint64(keys.lane_elem0)
                                 + uint64(uint32(slot)) * uint64(uint32(slot_elems))))
            elif VEC:                         # (heads-first: a slot is a row, a constant)
                first = (int64(uint32(blk)) * blk_elems
                         + (keys.lane_elem0 + int64(slot) * (HEAD_DIM // EW)))
            elif SLOT_STRIDE:                 # key 0's row inside its physical block
                first = (int64(uint32(blk)) * row_stride
                         + int32(kvh_rows + slot * keys.slot_rows))
            else:
                first = int64(uint32(blk)) * row_stride + int32(kvh_rows + slot)
            for u in range(U):
                t = int32(t0 + u)
                key_ok[u] = lo32 <= t and t < hi32 and page_ok
                if SLOT_STRIDE:               # key u: u slot strides further (one add)
                    key_at[u] = first + u * (keys.slot_step if VEC else keys.slot_rows)
                else:                         # key u: u rows further (an immediate offset)
                    key_at[u] = first + u * ((HEAD_DIM // EW) if VEC else 1)
        else:
            for u in range(U):
                t = int32(t0 + u)
                ss = int32(slot + u)
                jj = j_blk
                if ss >= block_size:          # u < U <= 2: one carry into the next entry
                    ss = int32(ss - block_size)
                    jj = int32(jj + 1)
                live = lo32 <= t and t < hi32
                ok = live
                blk = int32(b)
                if PAGED and live:
                    entry = load_at(block_table, keys.table0 + uint32(jj))
                    ok = 0 <= entry and entry < n_cache_blocks
                    blk = int32(entry)
                if live and not ok:
                    bad = True
                key_ok[u] = ok
                in_row = int32(kvh_rows + ss * keys.slot_rows)
                if VEC:
                    key_at[u] = (int64(uint32(blk)) * blk_elems
                                 + (int64(in_row) * (HEAD_DIM // EW) + keys.col0_v))
                else:
                    key_at[u] = int64(uint32(blk)) * row_stride + in_row
        step_ok = True
        for u in range(U):
            step_ok = step_ok and key_ok[u] != 0
        return step_ok, bad

    @_stage
    def load_keys(k_cache, v_cache, key_ok, key_at, step_ok, k_reg, v_reg, col0, d, d_v):
        """My group's K and V rows into registers, ``LANES`` lanes side by side along ``d``
        (V: ``d_v``, its own head dim or ``d``; ``VEC`` builds have ``d == d_v == HEAD_DIM``,
        or an MLA cache read twice, where V's columns past ``d_v`` are loaded and never
        written out): a dead or bad key reads nothing and keeps its stale registers (its p is
        "not seen")."""
        if VEC and step_ok:                   # every key readable: one branch, no test per key
            for u in range(U):
                load_key(k_cache, v_cache, key_at[u], u, k_reg, v_reg)
        elif VEC:                             # each key on its own
            for u in range(U):
                if key_ok[u] != 0:
                    load_key(k_cache, v_cache, key_at[u], u, k_reg, v_reg)
        elif KV_FP8:                          # padded head dim, e4m3: 32-bit words of 4
            k_words = k_cache.shape[1]        # values (d, d_v multiples of 4), zero past d;
            v_words = v_cache.shape[1]        # widen() reads them as the VEC build's words
            for u in range(U):                # (a latent V: K's rows, d / 4 words each)
                ok = key_ok[u] != 0
                # the row's first word of mine once, then constant offsets (indexing [row,
                # word] reloaded the strides and redid the 64-bit address for every word)
                k_at = key_at[u] * k_words + (col0 >> 2)
                v_at = key_at[u] * v_words + (col0 >> 2)
                for j in range(DPL // 4):
                    c = col0 + COL[4 * j]     # the word's first column
                    kw = ZERO                 # (+0.0: four e4m3 zeros)
                    vw = ZERO
                    if ok and c < d:
                        kw = load_at(k_cache, k_at + (COL[4 * j] >> 2))
                        if not OWN_V:
                            vw = load_at(v_cache, v_at + (COL[4 * j] >> 2))
                    if OWN_V and ok and c < d_v:
                        vw = load_at(v_cache, v_at + (COL[4 * j] >> 2))
                    k_reg[u * DPL + j] = kw
                    v_reg[u * DPL + j] = vw
        else:                                 # padded head dim: element loads, zero past d
            for u in range(U):
                ok = key_ok[u] != 0
                kv_row = key_at[u]
                for j in range(DPL):
                    c = col0 + COL[j]
                    kv = ZERO
                    vv = ZERO
                    if ok and c < d:
                        kv = load(k_cache[kv_row, c])
                        if not OWN_V:
                            vv = load(v_cache[kv_row, c])
                    if OWN_V and ok and c < d_v:
                        vv = load(v_cache[kv_row, c])
                    k_reg[u * DPL + j] = kv
                    v_reg[u * DPL + j] = vv
    # [/docs:decode-tile-load]

    return locate_keys, load_keys


@functools.lru_cache(maxsize=None)
def make_gather_keys(cfg):
    """``(resolve_key, gather_keys, share_keys)``: ``GATHER``'s keys, list entries resolved to
    cache rows through their pages, by each lane or shared across a warp by shuffles."""
    U, HEAD_DIM, EW, VEC, PAGED = cfg.U, cfg.HEAD_DIM, cfg.EW, cfg.VEC, cfg.PAGED

    # [docs:decode-gather]
    @_stage
    def resolve_key(listed, block_table, b, t, lo32, hi32, seqlen, n_cache_blocks, block_size,
                    page_div, keys):
        """``GATHER``: where entry ``t`` of the block's index list ``listed`` (int32
        ``kv_indices[b, kvh or 0, tok]``; live in ``[lo32, hi32)``) lives: ``(pos, row_at,
        bad)``, the key's position in its sequence (-1: none, or not readable), its first view
        element (``VEC``; a lane adds its column) or cache row, and whether the entry is bad
        (outside ``[-1, seqlen)``, or a bad table entry: never dereferenced).  The page is
        ``pos // block_size`` by a multiply and a shift (``page_div``, :func:`_page_divisor`)."""
        j = int32(-1)
        if lo32 <= t and t < hi32:
            j = int32(listed[t])
        ok = 0 <= j and j < seqlen
        bad = j < -1 or j >= seqlen
        blk = int32(b)
        slot = j
        if PAGED and ok:
            j_blk = uint32((uint64(j) * page_div[0]) >> page_div[1])   # j // block_size
            slot = int32(uint32(j) - j_blk * uint32(block_size))
            entry = block_table[uint32(b), j_blk]
            if 0 <= entry and entry < n_cache_blocks:
                blk = int32(entry)
            else:
                ok = False
                bad = True
        in_row = int32(keys.kvh_rows + slot * keys.slot_rows)
        if VEC:
            row_at = int64(uint32(blk)) * keys.blk_elems + int64(in_row) * (HEAD_DIM // EW)
        else:
            row_at = int64(uint32(blk)) * keys.row_stride + in_row
        return (j if ok else int32(-1)), row_at, bad

    @_stage
    def gather_keys(key_ok, key_at, key_pos, listed, block_table, rows, t0, lo32, hi32,
                    seqlen, n_cache_blocks, block_size, page_div, keys):
        """``GATHER``, each lane on its own (a warp too narrow for :func:`share_keys`): my
        group's ``U`` keys are list entries ``t0 ..`` (:func:`resolve_key`); fills ``key_pos``,
        ``key_ok``, ``key_at`` as :func:`locate_keys`; returns ``(step_ok, bad)``."""
        bad = False
        step_ok = True
        for u in range(U):
            pos, row_at, bad_u = resolve_key(listed, block_table, rows.b, int32(t0 + u), lo32,
                                             hi32, seqlen, n_cache_blocks, block_size, page_div,
                                             keys)
            bad = bad or bad_u
            key_pos[u] = pos
            key_ok[u] = pos >= 0
            key_at[u] = row_at + (keys.col0_v if VEC else 0)
            step_ok = step_ok and pos >= 0
        return step_ok, bad

    @_stage
    def share_keys(key_ok, key_at, key_pos, res_pos, res_at, src, keys):
        """``GATHER`` in a warp of ``KW`` keys a step: lane ``src + u`` of my warp resolved my
        group's key ``u`` of this step (:func:`resolve_key`, ``KW`` keys of ``WARP // KW``
        steps at once, one key a lane); fetch its position and row by shuffles (one
        resolution a warp for ``WARP`` keys, not one a lane per key); returns ``step_ok``."""
        step_ok = True
        for u in range(U):
            pos = cuda.shfl_sync(FULL_MASK, res_pos, src + u)
            row_at = cuda.shfl_sync(FULL_MASK, res_at, src + u)
            key_pos[u] = pos
            key_ok[u] = pos >= 0
            key_at[u] = row_at + (keys.col0_v if VEC else 0)
            step_ok = step_ok and pos >= 0
        return step_ok
    # [/docs:decode-gather]

    return resolve_key, gather_keys, share_keys


@functools.lru_cache(maxsize=None)
def make_key_loads(cfg):
    """The walk over the cache (:data:`KeyLoads`): where my group's keys live in the block table
    (:func:`make_key_cursor`, :func:`make_tile_load`, :func:`make_gather_keys`) and their K/V
    rows into registers (:func:`make_kv_rows`)."""
    _load_key, widen = make_kv_rows(cfg)
    first_keys, next_keys, cache_layout = make_key_cursor(cfg)
    locate_keys, load_keys = make_tile_load(cfg)
    resolve_key, gather_keys, share_keys = make_gather_keys(cfg)
    return KeyLoads(first_keys, next_keys, cache_layout, locate_keys, resolve_key, gather_keys,
                    share_keys, load_keys, widen)

@functools.lru_cache(maxsize=None)
def make_own_row_stages(cfg):
    """The per-step math of a lane's own row (:data:`OwnRowStages`): which row it owns after the
    reduce-scatter and its :class:`~numba_flash.kernels.mainloop.tile_scores.ScoreArgs`, the
    scores by reduce-scatter, the online softmax, ``acc = alpha acc + p v``."""
    LANES, U, ROWS, SOFTCAP, ALIBI = cfg.LANES, cfg.U, cfg.ROWS, cfg.SOFTCAP, cfg.ALIBI
    DPL, V4, QP, USER_FN = cfg.DPL, cfg.V4, cfg.QP, cfg.USER_FN
    LOG_ROWS, LOG_LANES = cfg.LOG_ROWS, cfg.LOG_LANES
    UR = U * ROWS                         # scores of one step: U keys x ROWS rows
    acc_t = compute_type(cfg.np_dtype)
    ONE = acc_t(1.0)
    NOT_SEEN = acc_t(-1.0)                # p of a key the row does not see
    NEG_INF = acc_t(-math.inf)
    ZERO = acc_t(0.0)
    score_mod = make_score_mod(SOFTCAP, ALIBI, acc_t)
    # the scores (tile_scores.py: q is pre-scaled, so steps 3-5 of the contract and the user's
    # functions) and the online softmax of a lane's own row (rescaled only when its max moved)
    score_fn = make_score_fn(False, SOFTCAP, ALIBI, cfg.USER, acc_t, True)
    _init, softmax_update, _fin = make_online_softmax(1, U, 0, (), "exp", acc_t, "moved")
    row_coords = make_row_coords(cfg)
    own_row_of = make_own_row_of(cfg)
    # key u's position in its sequence: its list entry (GATHER), or t0 + u of the cache walk
    if cfg.GATHER:
        @_stage
        def key_position(key_pos, t0, u):
            return key_pos[u]
    else:
        @_stage
        def key_position(key_pos, t0, u):
            return int32(t0 + u)


    @_stage
    def own_row(lane, rows, seq):
        """My own row: after the reduce-scatter, lane ``l`` holds the scores of row ``r_own``,
        the row whose bits are the lane's top ``LOG_ROWS`` offset bits (:func:`make_own_row_of`);
        returns its :class:`OwnRow`: the keys ``[lo, hi)`` it sees (int32 from here: key
        positions fit, the host checks the lengths) and the user's coordinates of it (query
        head ``h``, the query's column ``q_col``)."""
        r_own = own_row_of(lane)
        row_own = rows.row0 + r_own
        live_own = row_own < rows.n_rows
        h_own, tok_own = row_coords(rows, row_own, rows.nq)
        lo_own, hi_own = key_bounds(tok_own, seq.offset, seq.seqlen, seq.left, seq.right)
        lo_own = int32(max(lo_own, seq.pad))  # (pad >= 0 when the length is good)
        hi_own = int32(min(hi_own, seq.khi))
        if not live_own:                      # a padding row sees every key (never written)
            lo_own = int32(0)
            hi_own = int32(2**31 - 1)
        return OwnRow(r_own, live_own, lo_own, hi_own, int32(h_own), int32(tok_own + seq.offset))

    @_stage
    def own_score_args(va, rows, own):
        """The :class:`~numba_flash.kernels.mainloop.tile_scores.ScoreArgs` of my row (``offset``
        0: :class:`OwnRow` carries the query's column); ALiBi's slope read for a live row only
        (a padding row's head may be past ``H``)."""
        slope_own = ZERO
        if ALIBI and own.live:
            slope_own = acc_t(va.alibi[rows.b, own.h])
        return ScoreArgs(va.scale, va.softcap, va.inv_softcap, slope_own, 0, rows.nq,
                         int32(rows.b), own.h, va.user[1:])

    # [docs:decode-scores]
    @_stage
    def own_scores(s_own, q_sh, k_reg, q_byte):
        """Partial dots over my elements, then a reduce-scatter over the group's lanes: each
        butterfly step halves the rows a lane carries (it sends the half its partner keeps),
        the last steps are plain sums; ``s_own[0, u]``: my row's score of key ``u``.  My slot
        ``s`` holds row ``s ^ r_own`` (``q_sh`` is in my row order, :func:`make_load_q_rows`):
        at step ``i`` my partner's ``r_own`` differs in bit ``half = ROWS >> (i + 1)`` alone,
        so its slot ``j + half`` holds my slot ``j``'s row, and every lane keeps its lower
        ``half`` slots and sends the upper ones.  (Rows in one order for all lanes need a
        select by my half on both sides of every shuffle: 2 FSEL a shuffle, and ptxas re-read
        my half's bit from a packed register every step: 8 of a ROWS=2 step's instructions.)"""
        dots = cuda.local.array(UR, acc_t)
        part = cuda.local.array(ROWS, acc_t)
        for u in range(U):
            for s in range(ROWS):
                dots[u * ROWS + s] = ZERO
        for s in range(ROWS):                 # q read 16 bytes at a time, shared by the U keys
            for pc in range(QP):
                qv = lds16(q_sh, q_byte + (s * QP + pc) * (LANES * 16))
                for e in range(V4):
                    if pc * V4 + e < DPL:
                        for u in range(U):
                            dots[u * ROWS + s] += qv[e] * k_reg[u * DPL + pc * V4 + e]
        for u in range(U):
            for s in range(ROWS):
                part[s] = dots[u * ROWS + s]
            for i in range(LOG_ROWS):
                half = ROWS >> (i + 1)
                for j in range(half):
                    part[j] += shfl_xor(part[j + half], int32(LANES >> (i + 1)))
            sc = part[0]
            for i in range(LOG_ROWS, LOG_LANES):
                sc += shfl_xor(sc, int32(LANES >> (i + 1)))
            s_own[0, u] = sc

    @_stage
    def own_softmax(s_own, key_ok, key_pos, t0, own, sa, va, m_own, l_own):
        """The online softmax of my row (:mod:`~numba_flash.kernels.mainloop.online_softmax`, one
        row per lane: one exp per key per lane, not per row): the rule on key ``u``'s position
        (``t0 + u``, or ``key_pos[u]`` with ``GATHER``; ``lo <= t < hi`` as one unsigned
        compare, ``t - lo < hi - lo``: a key before ``lo`` wraps past ``2**31``, and two
        signed compares and their AND took a ROWS=2 step 2 instructions more), the score
        modifiers, then the update; ``s_own`` leaves holding ``p``, or ``NOT_SEEN`` (-1) for
        a key the row does not see (a visible key's NaN p stays NaN).  Returns ``alpha``."""
        live_own, lo_own, hi_own, q_own = own.live, own.lo, own.hi, own.q_col
        vis_own = cuda.local.array(U, types.boolean)
        for u in range(U):
            t = key_position(key_pos, t0, u)
            vis = key_ok[u] != 0 and uint32(t - lo_own) < uint32(max(hi_own - lo_own, 0))
            # the query's column q_own (sa.offset = 0): ALiBi's distance |q_own - t| and the
            # user's q_idx; the user's functions never see a padding row.  Without them
            # score_fn is score_mod: one path, and live_own stays out of the loop (ptxas kept
            # no predicate for it and redid its 64-bit compare every key of a ROWS=2 build),
            # taken for every key (no side effect; a key not seen gets -inf below): no
            # predicated moves (2 instructions of the e4m3 ROWS=2 step, 9 with softcap and
            # ALiBi)
            if USER_FN:
                if vis and live_own:
                    vis, x, _g = score_fn(s_own[0, u], q_own, t, sa, USER_FN)
                    s_own[0, u] = x
                elif vis:
                    s_own[0, u] = score_mod(s_own[0, u], q_own, t, sa.offset, sa.softcap,
                                            sa.inv_softcap, sa.slope)
            else:
                s_own[0, u] = score_mod(s_own[0, u], q_own, t, sa.offset, sa.softcap,
                                        sa.inv_softcap, sa.slope)
            vis_own[u] = vis
            if not vis:
                s_own[0, u] = NEG_INF         # not seen: no p, no p * v
        alpha = softmax_update(s_own, s_own, m_own, l_own, ZERO)
        for u in range(U):
            if not vis_own[u]:
                s_own[0, u] = NOT_SEEN
        return alpha

    @_stage
    def accumulate(acc, s_own, v_reg, alpha, row_lane, full):
        """``acc = alpha acc + p v``: each row's alpha and p from ``row_lane[r]``, a lane of
        my warp that owns row ``r`` (alpha is exactly 1 when the max did not move: the
        product changes nothing)."""
        a_row = cuda.local.array(ROWS, acc_t)
        p_row = cuda.local.array(UR, acc_t)
        moved = False
        for r in range(ROWS):                 # all shuffles first, in one straight run
            src = row_lane[r]
            a_row[r] = cuda.shfl_sync(FULL_MASK, alpha, src)
            moved = moved or a_row[r] != ONE
            for u in range(U):
                p_row[r * U + u] = cuda.shfl_sync(FULL_MASK, s_own[0, u], src)
        if moved:                             # rare once the max settles: one branch
            for r in range(ROWS):
                for j in range(DPL):
                    acc[r * DPL + j] *= a_row[r]
        if full:                              # every row sees every key of the step: no test
            for r in range(ROWS):
                for u in range(U):
                    for j in range(DPL):
                        acc[r * DPL + j] += p_row[r * U + u] * v_reg[u * DPL + j]
        else:
            for r in range(ROWS):
                for u in range(U):
                    if not p_row[r * U + u] < ZERO:   # seen (p >= 0, or NaN)
                        for j in range(DPL):
                            acc[r * DPL + j] += p_row[r * U + u] * v_reg[u * DPL + j]
    # [/docs:decode-scores]

    return OwnRowStages(own_row, own_score_args, own_scores, own_softmax, accumulate)


@functools.lru_cache(maxsize=None)
def make_decode_epilogue(cfg):
    """The block's end (:data:`DecodeEpilogue`): the merge of its key groups, the split's write,
    the fused combine of the splits (:mod:`~numba_flash.kernels.decode.merge`)."""
    THREADS, ROWS, HEAD_DIM, DPL, COL, NG = (cfg.THREADS, cfg.ROWS, cfg.HEAD_DIM, cfg.DPL, cfg.COL,
                                             cfg.NG)
    KV_FP8 = cfg.KV_FP8
    acc_t, _load, store = _types(cfg)
    row_coords = make_row_coords(cfg)
    NEG_INF = acc_t(-math.inf)
    NAN = acc_t(math.nan)
    ZERO = acc_t(0.0)
    merge_stats, merge_element = make_merge_functions(acc_t)
    merge_states_ml = make_state_merge(acc_t)


    @_stage
    def merge_groups(acc, acc_sh, m_sh, l_sh, stat_sh, grp, tid, col0):
        """Merge the ``NG`` group states of the block (fixed order: reproducible bits) by the
        log-sum-exp rule of :mod:`~numba_flash.kernels.decode.merge` (``merge_states_ml``):
        ``stat_sh`` gets each row's ``(m, W)``, ``acc_sh`` the rescaled sum of the groups'
        accumulators."""
        for r in range(ROWS):
            big_m, big_l = merge_states_ml(m_sh, l_sh, r)
            f = ZERO
            if l_sh[grp, r] != ZERO:
                f = math.exp(m_sh[grp, r] - big_m)
            for j in range(DPL):
                acc[r * DPL + j] *= f
            if tid == r:
                stat_sh[0, r] = big_m
                stat_sh[1, r] = big_l
        for g in range(NG):
            if grp == g:
                for r in range(ROWS):
                    for j in range(DPL):
                        c = col0 + COL[j]
                        if g == 0:
                            acc_sh[r, c] = acc[r * DPL + j]
                        else:
                            acc_sh[r, c] += acc[r * DPL + j]
            cuda.syncthreads()  # group g's share is added before group g + 1 adds its own

    @_stage
    def write_split(o, lse, o_part, lse_part, acc_sh, stat_sh, bad, empty_split, rows, tid,
                    sinks, v_scale):
        """This split's ``(o, lse)`` (one split: the output itself; else its partial): NaN for
        a bad sequence, 0 / -inf for no visible key; ``o`` times ``v_scale`` with ``KV_FP8``
        (V's descale, before the merge: the merge is linear in ``o``).  One split adds the
        rows' learnable sink here (``sinks``,
        :func:`~numba_flash.kernels.mainloop.online_softmax.sink_of`); with several, the combine
        adds it once, never a split.  The one split adds it with the combine's very arithmetic
        (:func:`~.merge.make_merge_functions`: its normalised ``o`` and ``lse`` merged with the
        sink as one part), so a sequence's result is the same bits whatever the grid's split
        count (a sequence alone, or beside a longer one whose cache needs more splits)."""
        b, row0, n_rows = rows.b, rows.row0, rows.n_rows
        split, n_splits = rows.split, rows.n_splits
        n_heads = o.shape[1]
        nq = o.shape[2]
        d = o.shape[3]
        if tid < ROWS:
            big_m = stat_sh[0, tid]
            big_l = stat_sh[1, tid]
            lse_r = NEG_INF
            if bad:
                lse_r = NAN
            elif big_l != ZERO:               # > 0, or NaN (a NaN score)
                lse_r = big_m + math.log(big_l)
            sink = NEG_INF
            if n_splits == 1 and not bad and row0 + tid < n_rows:
                sink = acc_t(sink_of(sinks, row_coords(rows, row0 + tid, nq)[0]))
            stat_sh[3, tid] = ZERO            # no sink to merge
            if sink != NEG_INF:               # a key with no value: in lse, and in o's divisor
                if big_l == ZERO:             # no key: o = 0, lse = sink
                    lse_r = sink
                else:                         # the combine's merge of (o, lse_r) and the sink
                    m_f = sink
                    if lse_r > m_f:
                        m_f = lse_r
                    w_0 = math.exp(lse_r - m_f)
                    total = w_0 + math.exp(sink - m_f)
                    lse_r = m_f + math.log(total)
                    stat_sh[0, tid] = w_0     # o = (0 + w_0 o_split) / total
                    stat_sh[3, tid] = total
            stat_sh[2, tid] = lse_r
        cuda.syncthreads()  # stat_sh holds each row's W and lse before the writes read them
        for e in range(tid, ROWS * HEAD_DIM, THREADS):
            r = e // HEAD_DIM
            c = e % HEAD_DIM
            row = row0 + r
            if row < n_rows and c < d:
                big_l = stat_sh[1, r]
                out = ZERO
                if bad:
                    out = NAN
                elif big_l != ZERO:
                    out = acc_sh[r, c] / big_l
                    if KV_FP8:
                        out *= v_scale
                    if stat_sh[3, r] != ZERO:  # one split, a sink: as the combine merges it
                        out = (ZERO + stat_sh[0, r] * out) / stat_sh[3, r]
                h, tok = row_coords(rows, row, nq)
                if n_splits == 1:
                    o[b, h, tok, c] = store(out)
                elif not empty_split:         # the merge never reads o of a -inf part
                    o_part[split, (b * n_heads + h) * nq + tok, c] = out
        if tid < ROWS and row0 + tid < n_rows:
            h, tok = row_coords(rows, row0 + tid, nq)
            if n_splits == 1:
                lse[b, h, tok] = stat_sh[2, tid]
            else:
                lse_part[split, (b * n_heads + h) * nq + tok] = stat_sh[2, tid]

    # [docs:decode-combine]
    @_stage
    def combine(o, lse, o_part, lse_part, counters, stat_sh, flag_sh, rows, bx, tid, sinks):
        """The fused combine: the last block of ``(b, kvh, z)`` to finish merges every split
        and the rows' learnable sink, once (:func:`~.merge.make_merge_functions`), then resets
        its counter."""
        b, row0, n_rows = rows.b, rows.row0, rows.n_rows
        n_splits = rows.n_splits
        n_heads = o.shape[1]
        nq = o.shape[2]
        d = o.shape[3]
        cuda.threadfence()    # this block's partial is visible device-wide before its ticket
        cuda.syncthreads()  # every thread's partial writes are fenced before thread 0 takes it
        if tid == 0:
            ticket = cuda.atomic.add(counters, bx, 1)
            flag_sh[1] = 1 if ticket == n_splits - 1 else 0
        cuda.syncthreads()  # flag_sh[1] (am I last?) is known to every thread
        if flag_sh[1] == 0:
            return
        cuda.threadfence()    # the other blocks' partials are read after their tickets
        if tid < ROWS and row0 + tid < n_rows:
            h, tok = row_coords(rows, row0 + tid, nq)
            grow = (b * n_heads + h) * nq + tok
            mm, tot, lse_row = merge_stats(lse_part, grow, sink_of(sinks, h))
            stat_sh[0, tid] = mm
            stat_sh[1, tid] = tot
            lse[b, h, tok] = lse_row
        cuda.syncthreads()  # each row's merge weights are in stat_sh before the elements use them
        for e in range(tid, ROWS * HEAD_DIM, THREADS):
            r = e // HEAD_DIM
            c = e % HEAD_DIM
            row = row0 + r
            if row < n_rows and c < d:
                h, tok = row_coords(rows, row, nq)
                grow = (b * n_heads + h) * nq + tok
                o[b, h, tok, c] = store(merge_element(
                    o_part, lse_part, grow, c, stat_sh[0, r], stat_sh[1, r]))
        if tid == 0:
            counters[bx] = 0    # ready for the next call (a captured CUDA graph replays it)
    # [/docs:decode-combine]

    return DecodeEpilogue(merge_groups, write_split, combine)


#: the block's place (:func:`make_block_coords`): its :data:`DecodeRows` and :data:`SeqKeys`, the
#: split's keys ``[lo, hi)`` (empty for a bad length), ``bad_len``, ``GATHER``'s page divisor
#: (:func:`_page_divisor`) and the block's index list
BlockCoords = namedtuple("BlockCoords", "rows seq lo hi bad_len page_div listed")
#: a block step's context (:func:`make_decode_step`): the caches, my group's keys (``key_ok``,
#: ``key_at``, ``key_pos``) and their K / V registers, ``dims = (col0, d, d_v)``, my scores
#: ``s_own``, q in shared memory and my lane, my row (:data:`OwnRow`, its score arguments), the
#: variant, my row's softmax state, the accumulator, each row's lane and ``full`` (an int32)
DecodeStep = namedtuple("DecodeStep", "k_cache v_cache key_ok key_at key_pos k_reg v_reg dims "
                        "s_own q_sh lane own sa va m_own l_own acc row_lane full")


@functools.lru_cache(maxsize=None)
def make_block_coords(cfg):
    """The prologue's stage ``block_coords(q, block_table, seqlens, leftpad, va, n_kv_heads,
    cache_block_size, split_target, split_min, kv_indices)``: the :data:`BlockCoords` of block
    ``(x, s)``, its rows (sequence, kv head, chunk, split; ``GATHER``: the token), its
    sequence's keys and the split's share of them, from the block index and the sequence's own
    length (batch invariance)."""
    ROWS, STEP, PAGED, GATHER = cfg.ROWS, cfg.STEP, cfg.PAGED, cfg.GATHER
    block_of, split_range, page_divisor, list_of = _block_stages(GATHER)

    @_stage
    def block_coords(q, block_table, seqlens, leftpad, va, n_kv_heads, cache_block_size,
                     split_target, split_min, kv_indices):
        # [docs:decode-block-coords]
        n_heads = q.shape[1]
        nq = q.shape[2]
        hkv = n_kv_heads
        group = n_heads // hkv
        n_rows = group * nq                   # query rows of this GQA group
        if GATHER:                            # a block per query token: its heads share a list
            n_rows = group
        chunks = (n_rows + ROWS - 1) // ROWS
        bx = cuda.blockIdx.x
        z = bx % chunks
        b, kvh, tok = block_of(bx // chunks, hkv, nq)
        split = cuda.blockIdx.y
        n_splits = cuda.gridDim.y
        row0 = z * ROWS                       # first row of this block's chunk
        seqlen = seqlens[b]
        pad = leftpad[b]                      # keys before it are not part of the sequence
        capacity = cache_block_size           # contiguous: Nmax
        if PAGED:
            capacity = block_table.shape[1] * cache_block_size
        bad_len = seqlen < 0 or seqlen > capacity or pad < 0 or pad > seqlen
        offset = seqlen - nq                  # bottom-right: token i sits at key column i + offset
        left, right = va.window
        # keys some query row sees, and this split's share of them (from L and the pad alone):
        # the sequence is [pad, L), aligned at its end, so the rule's columns are unchanged
        klo, khi = tile_key_range(0, nq, offset, seqlen, left, right)
        klo = max(klo, pad)
        khi = max(khi, klo)
        klo, khi, seq_end = split_range(klo, khi, seqlen, kv_indices)
        page_div = page_divisor(cache_block_size)   # (GATHER: j // block_size by a multiply)
        listed = list_of(kv_indices, b, kvh, tok)   # (GATHER: the block's index list)
        size = max(split_min, (khi - klo + split_target - 1) // split_target)
        size = (size + STEP - 1) // STEP * STEP   # whole block steps
        lo = klo + split * size
        hi = min(lo + size, khi)              # lo >= hi: an empty split
        if bad_len:
            hi = lo                           # read nothing; the output is NaN
        rows = DecodeRows(b, kvh, group, row0, n_rows, nq, split, n_splits, tok)
        seq = SeqKeys(seqlen, pad, offset, left, right, seq_end)
        # [/docs:decode-block-coords]
        return BlockCoords(rows, seq, lo, hi, bad_len, page_div, listed)

    return block_coords


@functools.lru_cache(maxsize=None)
def make_decode_step(cfg):
    """The loop's stage ``one_step(step_ok, t0, x)`` (``x``: the :data:`DecodeStep`)."""
    KV_FP8, UD = cfg.KV_FP8, cfg.UD
    acc_t = compute_type(cfg.np_dtype)
    walk = make_key_loads(cfg)            # the key walk: block table, K/V rows
    mine = make_own_row_stages(cfg)       # a lane's own row: scores, softmax, p v

    @_stage
    def one_step(step_ok, t0, x):
        """One block step once my group's keys are located (``x.key_ok``, ``x.key_at``,
        ``x.key_pos``, ``step_ok``; ``t0`` my first key): their K and V rows into registers,
        the scores, my row's online softmax, ``acc = alpha acc + p v`` (FA4's
        ``compute_one_n_block``: load, GEMM, softmax update, GEMM); ``x.full``: 1 when every
        row sees every key of the split.  An e4m3 cache's words are widened here, after the
        loads' branches (:func:`~make_kv_rows`' ``widen``)."""
        walk.load_keys(x.k_cache, x.v_cache, x.key_ok, x.key_at, step_ok, x.k_reg, x.v_reg,
                       x.dims[0], x.dims[1], x.dims[2])
        k_val = x.k_reg
        v_val = x.v_reg
        if KV_FP8:
            k_val = cuda.local.array(UD, acc_t)
            walk.widen(x.k_reg, k_val)
        mine.own_scores(x.s_own, x.q_sh, k_val, x.lane * 16)
        alpha = mine.own_softmax(x.s_own, x.key_ok, x.key_pos, t0, x.own, x.sa, x.va, x.m_own,
                                 x.l_own)
        if KV_FP8:
            v_val = cuda.local.array(UD, acc_t)
            walk.widen(x.v_reg, v_val)
        mine.accumulate(x.acc, x.s_own, v_val, alpha, x.row_lane, x.full != 0 and step_ok)

    return one_step


@functools.lru_cache(maxsize=None)
def decode_kernel(cfg):
    """Build (once per :class:`~numba_flash.kernels.decode.config.DecodeConfig`) the fused split-KV
    decode kernel

    ``kernel(q, k_cache, v_cache, block_table, seqlens, leftpad, o, lse, o_part, lse_part,
    counters, va, paged, n_cache_blocks, n_kv_heads, cache_block_size, cache_strides,
    split_target, split_min, kv_descale, kv_indices)``

    ``VEC``: 16-byte loads of q, K and V (``d == HEAD_DIM``, 16-byte aligned arrays and ``CHUNK``
    of 16 bytes: :func:`vector_loads`); ``PAGED``: read through the block table (``paged`` must
    agree); ``SPLIT_PAGES``: ``PAGED`` with a block size that ``U`` does not divide (a step's keys
    may lie in two pages); ``GATHER``: token-sparse attention, each query token's keys listed
    in ``kv_indices`` ``[B, Hkv or 1, Nq, topk]`` (key positions, -1 none; a block per token,
    its splits over the list; an entry outside ``[-1, L)`` makes the token's rows NaN).
    ``q``, ``o`` ``[B, H, Nq, d]``; ``lse`` ``[B, H, Nq]`` (compute type);
    caches ``[num_blocks, Hkv, block_size, d]`` passed as ``[num_blocks * Hkv * block_size, d]``
    views of their memory (the three sizes as ints), slot ``s`` of kv head ``h`` in block
    ``n`` at row ``n * cache_strides[0] + h * cache_strides[1] + s * cache_strides[2]`` (int64:
    heads-first memory ``(Hkv block_size, block_size, 1)``, tokens-first ``[.., block_size,
    Hkv, d]``, flash-attn's, ``(block_size Hkv, 1, Hkv)``), read through ``block_table`` ``[B,
    max_blocks]`` when ``paged`` is 1, or ``[B, Hkv, Nmax, d]`` (``num_blocks = B``,
    ``block_size = Nmax``, ``block_table`` unused) when 0; ``seqlens`` ``[B]`` (the end of each
    sequence's keys) and ``leftpad`` ``[B]`` (their start: keys before it are not part of the
    sequence); ``o_part``
    ``[splits, B * H * Nq, d]`` and ``lse_part`` ``[splits, B * H * Nq]`` (compute type, unused
    with one split) and ``counters`` int32 ``[grid x]``, zero; ``va`` the
    :class:`~numba_flash.kernels.core.variant.Variant`: ``scale``, ``softcap``, ``inv_softcap`` in
    the compute type, ``window = (left, right)`` (``-1`` unbounded, causal folded into ``right =
    0``), ``alibi`` float32 ``[B, H]`` (unused without ``ALIBI``), ``user`` ``(a stand-in for
    kinds,) + aux``, ``sink`` the learnable sink logits; the rest scalars.

    ``USER``: a user's variant (:mod:`numba_flash.flex`), ``(score_mod, mask_mod)`` CUDA device
    functions (either may be None), compile-time: ``va.user[1:]`` is the tuple of the user's aux
    arrays (``va.user = ()`` without ``USER``: no kernel parameter).  For a key ``t`` the built-in
    rules let a live row see, ``mask_mod(b, h, q_idx, t, *aux)`` decides whether it stays visible
    and ``score_mod(s, b, h, q_idx, t, *aux)`` replaces its score after scale, softcap and ALiBi;
    ``b`` is the sequence (the row of ``q``), ``h`` the query head, ``q_idx = L - Nq + i`` the
    query's column and ``t`` the key's position in the cache (all int32).  A build with ``USER``
    keeps out of the on-disk kernel cache (the user's code does not key it).
    """
    THREADS, LANES, CHUNK, U, ROWS = cfg.THREADS, cfg.LANES, cfg.CHUNK, cfg.U, cfg.ROWS
    HEAD_DIM, USER = cfg.HEAD_DIM, cfg.USER
    KV_FP8, GATHER = cfg.KV_FP8, cfg.GATHER
    NG, STEP, RD, UD, Q_WORDS = cfg.NG, cfg.STEP, cfg.RD, cfg.UD, cfg.Q_WORDS
    LANE_OF = cfg.LANE_OF
    assert LANES & (LANES - 1) == 0 and LANES <= 32 and THREADS % LANES == 0
    assert HEAD_DIM % (LANES * CHUNK) == 0 and ROWS <= THREADS
    dtype = cfg.np_dtype
    acc_t = compute_type(dtype)
    assert not cfg.VEC or CHUNK * (1 if KV_FP8 else dtype.itemsize) == 16, \
        "a VEC chunk is one 16-byte load"
    assert not KV_FP8 or CHUNK % 4 == 0, "an e4m3 cache is read in 32-bit words"
    assert U <= 2, "a key's slot carries into the next table entry at most once"
    assert ROWS & (ROWS - 1) == 0 and ROWS <= LANES, "the reduce-scatter gives each row a lane"
    # GATHER: a warp's GW groups take KW keys a step; its WARP lanes resolve BS steps' keys at
    # once, one key a lane (SHARE; a warp narrower than KW keys resolves per lane)
    WARP = min(32, THREADS)
    GW = max(1, WARP // LANES)
    KW = GW * U
    SHARE = cfg.GATHER and WARP % LANES == 0 and KW <= WARP
    BS = WARP // KW if SHARE else 1   # steps a batch (dense builds: 1, the loop unchanged)
    ZERO = acc_t(0.0)
    ONE = acc_t(1.0)
    softmax_init, _update, _fin = make_online_softmax(1, U, 0, (), "exp", acc_t, "moved")
    load_q_rows = make_load_q_rows(cfg)
    walk = make_key_loads(cfg)            # the key walk: block table, K/V rows
    mine = make_own_row_stages(cfg)       # a lane's own row: scores, softmax, p v
    epilogue = make_decode_epilogue(cfg)  # group merge, the split's write, the combine
    block_coords = make_block_coords(cfg)  # the block's rows, sequence and split keys
    one_step = make_decode_step(cfg)      # a block step: loads, scores, softmax, p v

    # a user's functions stay out of the on-disk kernel cache (their code does not key it)
    @kernel_jit(cache=USER is None, launch_bounds=launch_bounds(THREADS, dtype, HEAD_DIM))
    def decode_split(q, k_cache, v_cache, block_table, seqlens, leftpad, o, lse, o_part,
                     lse_part, counters, va, paged, n_cache_blocks, n_kv_heads,
                     cache_block_size, cache_strides, split_target, split_min, kv_descale,
                     kv_indices):
        tid = cuda.threadIdx.x
        lane = int32(tid % LANES)             # my elements: lane * CHUNK + COL[j], j < DPL
        grp = int32(tid // LANES)             # my key group
        col0 = lane * CHUNK                   # my first element of a K/V row
        rows, seq, lo, hi, bad_len, page_div, listed = block_coords(
            q, block_table, seqlens, leftpad, va, n_kv_heads, cache_block_size, split_target,
            split_min, kv_indices)
        b, kvh, seqlen, block_size = rows.b, rows.kvh, seq.seqlen, cache_block_size

        acc_sh = cuda.shared.array((ROWS, HEAD_DIM), acc_t)
        m_sh = cuda.shared.array((NG, ROWS), acc_t)
        l_sh = cuda.shared.array((NG, ROWS), acc_t)
        stat_sh = cuda.shared.array((4, ROWS), acc_t)
        flag_sh = cuda.shared.array(2, int32)
        q_sh = cuda.shared.array(Q_WORDS, acc_t, alignment=SHARED_ALIGN)   # read by lds16
        acc = cuda.local.array(RD, acc_t)
        q_scale = va.scale                    # an e4m3 cache: K's descale folds into q's
        if KV_FP8:
            q_scale = va.scale * kv_descale[0, b, kvh]
        # the loop's constants, made here and held in registers (in_loop, _kept64: a
        # volatile mov NVVM cannot re-derive in the loop): full as an int32 (as a bool ptxas
        # kept it as a bit of a packed register, extracted every step), each row's lane
        full = in_loop(int32(load_q_rows(q, q_sh, acc, rows, seq, lo, hi, q_scale, lane, grp,
                                         col0)))
        own = mine.own_row(lane, rows, seq)
        sa = mine.own_score_args(va, rows, own)
        m_own = cuda.local.array(1, acc_t)
        l_own = cuda.local.array(1, acc_t)
        softmax_init(m_own, l_own, acc_sh)
        row_lane = cuda.local.array(ROWS, int32)   # the lane of my warp that owns row r
        for r in range(ROWS):
            row_lane[r] = in_loop(int32(tid % 32 - lane + LANE_OF[r]))
        if tid == 0:
            flag_sh[0] = 0                    # a bad table entry was met
        cuda.syncthreads()  # q_sh is written and flag_sh cleared before any group uses them

        lo_step, at, step = walk.first_keys(lo, grp, block_size)
        j_blk, slot = at.j_blk, at.slot
        bad_entry = False
        k_reg = cuda.local.array(UD, acc_t)
        v_reg = cuda.local.array(UD, acc_t)
        key_ok = cuda.local.array(U, int32)   # key u is live and readable (1) or not (0)
        key_at = cuda.local.array(U, int64)   # key u: view element (VEC) or cache row
        key_pos = cuda.local.array(U, int32)  # GATHER: key u's position in its sequence
        s_own = cuda.local.array((1, U), acc_t)
        for j in range(UD):                   # (the stale registers of a dead key are finite)
            k_reg[j] = ZERO
            v_reg[j] = ZERO
        keys = walk.cache_layout(b, kvh, lane, block_table, cache_strides)
        base = lo_step
        w_lane = int32(tid % WARP)            # GATHER and SHARE: my lane in my warp,
        w_grp0 = int32(tid // WARP * GW)      # my warp's first key group
        res_pos = int32(-1)                   # and the key I resolved for this batch
        res_at = int64(0)
        dims = (col0, q.shape[3], o.shape[3])   # my first column, K's and V's widths
        x = DecodeStep(k_cache, v_cache, key_ok, key_at, key_pos, k_reg, v_reg, dims, s_own,
                       q_sh, lane, own, sa, va, m_own, l_own, acc, row_lane, full)
        if SHARE:   # GATHER: batches of BS steps, my warp's lanes resolve a batch's keys
            while base < int32(hi):           # the same trip count on every lane (shuffles)
                entry = int32(base + (w_lane // KW) * STEP + w_grp0 * U + w_lane % KW)
                res_pos, res_at, bad = walk.resolve_key(
                    listed, block_table, b, entry, int32(lo), int32(hi), seqlen,
                    n_cache_blocks, block_size, page_div, keys)
                bad_entry = bad_entry or bad
                batch_step = int32(0)
                while batch_step < BS and base < int32(hi):   # the steady state: shuffles
                    step_ok = walk.share_keys(key_ok, key_at, key_pos, res_pos, res_at,
                                              batch_step * KW + (grp - w_grp0) * U, keys)
                    one_step(step_ok, int32(base + grp * U), x)
                    base = int32(base + STEP)
                    batch_step = int32(batch_step + 1)
        else:       # the cache's keys in order (or GATHER in a warp too narrow to share)
            t0 = int32(base + grp * U)        # my first key; the loop's variable (base, and
            t_end = int32(hi + grp * U)       # t0 from it, took one more instruction a step)
            while t0 < t_end:                 # the same trip count on every lane (shuffles)
                if GATHER:
                    step_ok, bad = walk.gather_keys(key_ok, key_at, key_pos, listed,
                                                    block_table, rows, t0, int32(lo), int32(hi),
                                                    seqlen, n_cache_blocks, block_size,
                                                    page_div, keys)
                else:
                    step_ok, bad = walk.locate_keys(key_ok, key_at, block_table, b, t0, j_blk,
                                                    slot, int32(lo), int32(hi), n_cache_blocks,
                                                    block_size, keys)
                bad_entry = bad_entry or bad
                j_blk, slot = walk.next_keys(j_blk, slot, step, block_size)
                one_step(step_ok, t0, x)
                t0 = int32(t0 + STEP)

        if bad_entry:
            flag_sh[0] = 1
        if (lane & (LANES // ROWS - 1)) == 0:
            m_sh[grp, own.r] = m_own[0]       # one lane per row writes (all hold the same)
            l_sh[grp, own.r] = l_own[0]
        cuda.syncthreads()  # every group's (m, l) per row and the bad flag are in shared memory
        epilogue.merge_groups(acc, acc_sh, m_sh, l_sh, stat_sh, grp, tid, col0)
        bad = bad_len or flag_sh[0] != 0
        v_scale = ONE                         # an e4m3 cache: V's descale scales o
        if KV_FP8:
            v_scale = acc_t(kv_descale[1, b, kvh])
        epilogue.write_split(o, lse, o_part, lse_part, acc_sh, stat_sh, bad, hi <= lo and not bad,
                             rows, tid, va.sink, v_scale)
        if rows.n_splits > 1:
            epilogue.combine(o, lse, o_part, lse_part, counters, stat_sh, flag_sh, rows,
                             cuda.blockIdx.x, tid, va.sink)

    return decode_split


@functools.lru_cache(maxsize=None)
def _block_stages(GATHER):
    """``(block_of, split_range, page_divisor, list_of)``: the block's ``(b, kvh, tok)`` from
    ``bx // chunks`` (grid x is ``((b * Hkv + kvh) * Nq + tok) * chunks + z`` with ``GATHER``,
    else without ``tok``),
    and the range the splits divide with the end of the keys a row may see: the keys
    ``[klo, khi)`` some row sees, or with ``GATHER`` the index list's entries ``[0, topk)``
    (rows then see up to ``seqlen``), :func:`_page_divisor` (dense builds: unused zeros) and
    the block's index list (``kv_indices[b, kvh or 0, tok]``, a 1-D view made once).
    Chosen here, not by a branch in the kernel, so that
    a dense build's types (and machine code) are those it had before ``GATHER``."""
    if GATHER:
        @_stage
        def block_of(seq_head, hkv, nq):
            return seq_head // nq // hkv, seq_head // nq % hkv, seq_head % nq

        @_stage
        def split_range(klo, khi, seqlen, kv_indices):
            return 0, kv_indices.shape[3], seqlen

        page_divisor = _page_divisor

        @_stage
        def list_of(kv_indices, b, kvh, tok):
            return kv_indices[b, kvh if kv_indices.shape[1] > 1 else 0, tok]
    else:
        @_stage
        def block_of(seq_head, hkv, nq):
            return seq_head // hkv, seq_head % hkv, 0

        @_stage
        def split_range(klo, khi, seqlen, kv_indices):
            return klo, khi, khi

        @_stage
        def page_divisor(block_size):
            return uint64(0), uint64(0)

        @_stage
        def list_of(kv_indices, b, kvh, tok):
            return kv_indices[0, 0, 0]
    return block_of, split_range, page_divisor, list_of


@_stage
def _page_divisor(block_size):
    """``(m, s)`` with ``j // block_size == (j * m) >> s`` for every ``0 <= j < 2**31``
    (Granlund and Montgomery's division by an invariant integer: ``l = ceil(log2 d)``, ``s =
    31 + l``, ``m = ceil(2**s / d) < 2**32``): the gather divides each key's position by the
    page size with a multiply and a shift, the magic number made once a block (ptxas's
    division routine recomputed its reciprocal for every key)."""
    d = uint64(block_size)
    shift = uint64(31 + 32 - cuda.clz(uint32(block_size - 1)))
    return ((uint64(1) << shift) + d - uint64(1)) // d, shift


@_stage
def _kept64(x):
    """The int64 ``x``, through two volatile ``mov`` (:func:`~numba_flash.kernels.ptx.stages.
    in_loop`), for a constant of the key loop made before it: NVVM moves a loop-invariant
    product back into the loop (``hkv * block_size * HEAD_DIM / EW``, ``b`` times the
    table's columns: multiplied again every step), and a value a volatile ``mov`` made it
    can only hold in its two registers."""
    lo = in_loop(int32(x))
    hi = in_loop(int32(x >> 32))
    return (int64(hi) << 32) | int64(uint32(lo))


def cache_views(dtype, VEC, k_rows, v_rows):
    """The K/V cache arrays as the kernel reads them, from their ``[rows, d]`` device views:
    as they are, except bfloat16 with 16-byte loads (``VEC``): ``float32`` ``[rows, d / 2]``
    views of the words (no copy; the kernel splits each float32's bits into its two bfloat16),
    and an e4m3 cache (1-byte elements, ``KV_FP8``): ``float32`` ``[rows, d / 4]`` views."""
    if (VEC and is_bfloat16(dtype)) or np.dtype(k_rows.dtype).itemsize == 1:
        return k_rows.view(np.float32), v_rows.view(np.float32)
    return k_rows, v_rows


def kernel_args_types(dtype, ALIBI=False, VEC=True, aux=(), KV_FP8=False):
    """Numba argument types of :func:`decode_kernel` for int32 tables, lengths and index lists
    (``kv_indices``: a ``[1, 1, 1, 1]`` stand-in without ``GATHER``); ``aux``: the Numba types
    of a user build's aux arrays (``()``: no kernel parameter); ``KV_FP8``: e4m3 caches
    (float32 word views)."""
    acc_np = acc_dtype(dtype)
    acc_t = compute_type(dtype)
    i32 = types.int32
    cache_t = (numba_array_type(np.float32, 2) if (VEC and is_bfloat16(dtype)) or KV_FP8
               else numba_array_type(dtype, 2))
    user = (types.Array(types.int8, 4, "C"),) + tuple(aux) if aux else ()
    return (numba_array_type(dtype, 4), cache_t, cache_t,
            numba_array_type(np.int32, 2), numba_array_type(np.int32, 1),
            numba_array_type(np.int32, 1), numba_array_type(dtype, 4),
            numba_array_type(acc_np, 3), numba_array_type(acc_np, 3),
            numba_array_type(acc_np, 2), numba_array_type(np.int32, 1),
            variant_type(acc_t, False, user), i32, i32, i32, i32,
            types.UniTuple(types.int64, 3), i32, i32,
            numba_array_type(np.float32, 3), numba_array_type(np.int32, 4))
