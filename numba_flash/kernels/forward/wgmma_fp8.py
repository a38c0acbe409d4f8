"""FlashAttention forward on Hopper's e4m3 warpgroup tensor cores (``wgmma.mma_async ...
m64nNk32.f32.e4m3.e4m3``, sm_90a): the fp8 forward's contract on the 16-bit warpgroup
forward's pipeline.

Contract: :mod:`numba_flash.kernels.forward.fp8`'s (FA3's descales, ``o`` in bfloat16 or
float16, ``lse`` float32, ``P`` packed to e4m3 as ``P 2**P_OFFSET`` with ``P <= 2**RESCALE``,
never clipped), for head dims 64, 128 and 256
(:data:`~numba_flash.kernels.forward.config.WGMMA_FP8_HEAD_DIMS`).

:func:`forward_wgmma_fp8_kernel` ``(cfg)`` builds ``kernel(q, k, v, v8, o, lse, descale, va)``
(the arguments of :func:`~numba_flash.kernels.forward.fp8.forward_fp8_kernel`, ``v`` as a flat
uint32 view) for a :class:`~numba_flash.kernels.forward.config.ForwardWgmmaFp8Config`, launched
with ``cfg.SMEM_BYTES`` of dynamic shared memory.  Grid ``(ceil(Nq / BLOCK_M) B H,)``, block
``128 WARPGROUPS`` threads; warpgroup ``wg`` owns rows ``64 wg ..`` of the Q tile.

Shared memory, from the first 1024-byte boundary: Q (``BLOCK_M`` rows of ``d`` bytes), then two
stages of (K, ``V^T``), each a :class:`~numba_flash.kernels.ptx.wgmma.TileLayout` counted in byte
pairs (a ``k32`` step of e4m3 is a ``k16`` step's 32 bytes: the 16-bit descriptors and copies
serve unchanged).  e4m3 ``wgmma`` reads both operands K-major (the ISA has no transpose for
8-bit types), so ``P V`` needs ``V^T``: ``d`` rows of ``BLOCK_N`` bytes, the keys of each
32-key step in the order the ``P`` registers pack them
(:func:`~numba_flash.kernels.ptx.mma_fp8.p_key_of_k`).  The threads write it
(:func:`make_vt_fill`): per item four 32-bit loads (four keys, four columns; eight lanes read a
32-byte sector of a key row), four ``prmt`` pairs, four 32-bit stores with no bank conflict
(lanes rotate which column they store first).  K comes by ``cp.async``.

The per-tile step is the 16-bit warpgroup forward's, with the overlap: one barrier (K_j and
``V^T_{j-1}`` landed and fenced for the async proxy), K_{j+1}'s copy issued, ``S_j = Q K_j^T``
and ``acc += P_{j-1} V_{j-1}`` issued, ``V^T_j`` written by the threads under both products,
tile ``j``'s scores and softmax once ``S_j`` is complete, ``P_j`` packed to e4m3.  A NaN byte of
``v`` in a masked tile is stored as 0 and the rows that see it are fixed up from global memory
(unmasked tiles let the tensor core carry it: every row sees every key).  ``[docs: fp8.md]``.
"""

from __future__ import annotations

import functools
from collections import namedtuple

from numba import cuda, float32, int32, int64, uint32

from ..core.elements import element_ops
from ..core.jit import device_jit, kernel_jit, static_fold
from ..mainloop.online_softmax import EpilogueRows, make_epilogue, make_online_softmax, \
    make_rescale, sink_of
from ..mainloop.tile_scores import ScoreArgs, make_tile_scores_pair
from ..mainloop.tile_walk import KvWalk, make_kv_walk
from ..mainloop.visibility import make_tile_span
from ..mainloop.warp_gemm import ACC_COLS, ACC_ROWS
from ..ptx.fp8 import byte_perm
from ..core.common import make_elem_strides
from ..ptx.stages import (
    cp_async_commit, cp_async_wait_all, load_at, make_row_stride, make_tile_rows,
)
from ..ptx.wgmma import (
    ARENA_ALIGN, TileLayout, align_pad, chunk_offset_device, fence_proxy_async, make_a_pack,
    make_tile_copy, make_warpgroup_gemm, smem_address, warp_uniform, wgmma_wait_group,
)
from .config import ForwardWgmmaFp8Config, forward_wgmma_fp8_config
from .fp8 import compile_args as fp8_compile_args, make_fp8_bases
from .mma import make_forward_block, make_operand_bases, make_row_stages

__all__ = ["ForwardWgmmaFp8Config", "forward_wgmma_fp8_config", "forward_wgmma_fp8_kernel",
           "make_vt_fill", "vt_fill_probe_kernel", "compile_config", "CC"]

#: the compute capability the compile tier builds this kernel for (``wgmma``: sm_90a)
CC = (9, 0, "a")

_stage = functools.partial(device_jit, own_module=True, inline=True)

#: e4m3fn's NaN bytes are ``x & 0x7F == 0x7F``: the words' low seven bits of each byte, plus
#: one, carry into bit 7 exactly there (no carry leaves a byte)
_LOW7 = uint32(0x7F7F7F7F)
_ONES = uint32(0x01010101)
_HIGH = uint32(0x80808080)
_BYTE = uint32(0xFF)


@device_jit(inline=True)
def pair_selector(lo):
    """The ``prmt`` selector of ``(a.lo, b.lo, a.hi, b.hi)`` with ``hi = (lo + 2) % 4``: byte
    ``lo`` and byte ``hi`` of two words, interleaved (``lo`` a uint32 in 0..3)."""
    hi = uint32((lo + uint32(2)) & uint32(3))   # (uint32 arithmetic types as uint64: wrap)
    return uint32(lo | uint32(lo + uint32(4)) << uint32(4) | hi << uint32(8)
                  | uint32(hi + uint32(4)) << uint32(12))


# [docs:vt-fill-wgmma]
@functools.lru_cache(maxsize=None)
def make_vt_fill(BLOCK_N, HEAD_DIM, THREADS, SWIZZLE, MASKED, STRIDED=False):
    """``fill(smem, vt_byte, v, row0, nk, tid) -> bad``: the ``V^T`` tile of keys ``row0 ..
    row0 + BLOCK_N - 1`` (rows of ``v``'s flat uint32 view, ``HEAD_DIM / 4`` words a key;
    ``STRIDED``: ``row0 = (word, words a key)``, the tile's first word in ``v``'s memory and
    its key stride, ``v`` any view of the words whose last dim is contiguous) in
    the :class:`TileLayout` ``(HEAD_DIM, BLOCK_N / 2, SWIZZLE)`` at arena byte ``vt_byte``:
    row ``c`` holds column ``c``'s bytes, byte ``k`` of each 32-key step being key
    ``p_key_of_k(k)``.

    An item is four key bytes ``4 kq .. 4 kq + 3`` of a 16-byte chunk (keys ``16 chunk + 2 kq
    + (0, 1, 8, 9)``) for four columns (word ``col4`` of those keys): four loads, the 4 x 4 byte
    transpose in eight ``prmt``, four stores.  A warp's lanes are 8 words x 4 key quads: each
    load reads a 32-byte sector of four key rows, and each store hits 32 banks (lane ``cl``
    stores its columns from ``(cl >> 1) & 3`` on, so the rows of one store cover all eight
    swizzle phases).  A warp keeps its chunk and steps through column groups: 32 columns on,
    a row's swizzle phase is the same, so a thread's loads and stores are its first item's
    addresses plus constants.  ``MASKED`` (compile time): keys ``>= nk`` are zeros and a NaN
    byte is stored as 0, returning ``bad`` (the caller's fix-up); unmasked tiles are whole and
    keep their bytes."""
    LAY = TileLayout(HEAD_DIM, BLOCK_N // 2, SWIZZLE).check()
    W, ROWS = LAY.W, LAY.ROWS
    WORDS = HEAD_DIM // 4               # words of a key row
    COLG = HEAD_DIM // 32               # column groups of 8 words
    CHUNKS = BLOCK_N // 16              # 16-byte chunks of a V^T row
    NWARPS = THREADS // 32
    STEP = NWARPS // CHUNKS             # column groups between a warp's items
    ITEMS = COLG // STEP                # a warp's items
    assert NWARPS % CHUNKS == 0 and COLG % STEP == 0
    ROW_STEP = 32 * STEP                # V^T rows between a thread's items (a multiple of 8)
    # a V^T row ROW_STEP on: the next column block's rows or further down the same block
    STORE_STEP = ROW_STEP * W           # (one column block: BLOCK_N <= SWIZZLE bytes a row)
    assert CHUNKS * 16 <= W

    if STRIDED:
        @_stage
        def key_words(x):               # words between two keys: the view's own
            return x[8]

        @_stage
        def first_word(row0, key, col4):
            return row0[0] + key * row0[1] + col4

        @_stage
        def item_args(smem, v, at, store, r, sel_a, sel_b, keys, row0):
            return (smem, v, at, store, r, sel_a, sel_b, keys, row0[1])
    else:
        @_stage
        def key_words(x):               # a C-contiguous view's: compile time
            return WORDS

        @_stage
        def first_word(row0, key, col4):
            return (int64(row0) + key) * WORDS + col4

        @_stage
        def item_args(smem, v, at, store, r, sel_a, sel_b, keys, row0):
            return (smem, v, at, store, r, sel_a, sel_b, keys)

    @device_jit
    def item(j, x, bad):
        """Item ``j`` of the thread (``x``: ``(smem, v, at, store, r, sel_a, sel_b, keys)``,
        ``STRIDED``: and the words a key)."""
        smem, v, at, store = x[0], x[1], x[2], x[3]
        sel_a, sel_b, keys = x[5], x[6], x[7]     # (x[4]: the column stored first, r)
        stride = key_words(x)
        w = cuda.local.array(4, uint32)
        for i in range(4):              # keys + 0, 1, 8, 9 of word col4 + 8 STEP j
            off = (i & 1) + 8 * (i >> 1)
            if MASKED:
                w[i] = load_at(v, at + (off * stride + 8 * STEP * j)) if off < keys else \
                    uint32(0)
                nan = uint32(uint32((w[i] & _LOW7) + _ONES) & _HIGH)
                if nan != uint32(0):    # rare: zero the NaN bytes, report them
                    w[i] = uint32(w[i] & ~uint32((nan >> uint32(7)) * _BYTE))
                    bad |= nan
            else:
                w[i] = load_at(v, at + (off * stride + 8 * STEP * j))
        # the 4 x 4 transpose: out[i] = byte (r + i) % 4 of w[0..3] (column 4 col4 + that)
        xa = byte_perm(w[0], w[1], sel_a)       # bytes r, r + 2 of keys 0, 1
        xb = byte_perm(w[2], w[3], sel_a)       # ... of keys 8, 9
        ya = byte_perm(w[0], w[1], sel_b)       # bytes r + 1, r + 3
        yb = byte_perm(w[2], w[3], sel_b)
        k = j * STORE_STEP
        # unsigned word indices: a signed one gets Numba's negative-index fix-up (a compare
        # and a select a store)
        smem[uint32((store[0] + k) >> 2)] = byte_perm(xa, xb, uint32(0x5410))
        smem[uint32((store[1] + k) >> 2)] = byte_perm(ya, yb, uint32(0x5410))
        smem[uint32((store[2] + k) >> 2)] = byte_perm(xa, xb, uint32(0x7632))
        smem[uint32((store[3] + k) >> 2)] = byte_perm(ya, yb, uint32(0x7632))
        return bad

    items = static_fold(ITEMS, item)

    @_stage
    def fill(smem, vt_byte, v, row0, nk, tid):
        w = int32(tid) >> 5
        lane = int32(tid) & 31
        cl = lane & 7                   # the lane's word of its 8-word group
        kq = lane >> 3                  # the lane's key quad of its chunk
        chunk = w % CHUNKS              # the warp's chunk; its first column group w / CHUNKS
        col4 = 8 * (w // CHUNKS) + cl
        key = 16 * chunk + 2 * kq       # the item's first key (its others: + 1, 8, 9)
        r = uint32((cl >> 1) & 3)       # the column it stores first
        store = cuda.local.array(4, int32)
        for i in range(4):              # store i: V^T row 4 col4 + (r + i) % 4
            c = 4 * col4 + int32((r + uint32(i)) & uint32(3))
            store[i] = vt_byte + chunk_offset_device(c, chunk, ROWS, W) + 4 * kq
        at = first_word(row0, key, col4)
        x = item_args(smem, v, at, store, r, pair_selector(r), pair_selector(uint32((r + 1) & 3)),
                      int32(nk) - key, row0)
        return items(x, uint32(0)) != uint32(0)
    # [/docs:vt-fill-wgmma]

    return fill


@functools.lru_cache(maxsize=None)
def vt_fill_probe_kernel(BLOCK_N, HEAD_DIM, THREADS, SWIZZLE, MASKED):
    """``kernel(out, v, bad, nk)`` on one block of ``THREADS``: :func:`make_vt_fill` of the
    first ``BLOCK_N`` key rows of ``v`` (flat uint32) into shared memory, copied out to ``out``
    (uint32, the tile's words); ``bad[0] = 1`` when a thread reported a NaN byte (the tests'
    probe of the fill alone)."""
    fill = make_vt_fill(BLOCK_N, HEAD_DIM, THREADS, SWIZZLE, MASKED)
    WORDS = BLOCK_N * HEAD_DIM // 4

    @kernel_jit
    def vt_fill_probe(out, v, bad, nk):
        tid = cuda.threadIdx.x
        smem = cuda.shared.array(WORDS, uint32)
        b = fill(smem, 0, v, 0, nk, tid)
        cuda.syncthreads()  # every thread's stores before the copy out
        for i in range(tid, WORDS, THREADS):
            out[i] = smem[i]
        if b:
            bad[0] = 1

    return vt_fill_probe


#: the e4m3 warpgroup step's context: shared memory, the score arguments, the arena's pad; the
#: K view and the kv head's first K element (byte pairs), V's flat word view and first key
#: row, its byte view (the NaN fix-up), the kv head, the bounds ``(nk, left, right)``; the
#: lane's register arrays (``pa``: P's e4m3 A registers, ``prev``: the tile in flight); its
#: coordinates, Q's shared address, the arena's, the exponent factor
WgmmaFp8Step = namedtuple("WgmmaFp8Step", "smem sa pad k kv_elem k_d v v_row v8 hk bounds s acc "
                          "m_i l_i pa alpha prev tid t row0 q_addr base exp_scale")


def make_k_load(BLOCK_N, HALF, copy_k, STRIDED):
    """``load_k(smem, tile_byte, k, kv_elem, kt, nk, k_d, tid)``: issue the ``cp.async`` copy of
    K tile ``kt`` by ``copy_k`` (rows past ``nk`` zero; ``k_d``: its ``HALF`` byte pairs a row,
    ``STRIDED`` the pair with the row stride)."""
    row_stride = make_row_stride(STRIDED)
    tile_rows = make_tile_rows(BLOCK_N)

    @_stage
    def load_k(smem, tile_byte, k, kv_elem, kt, nk, k_d, tid):
        stride = row_stride(k_d)
        if STRIDED:   # (one IMAD.WIDE: stages.make_tile_rows)
            base, rows = tile_rows(kv_elem, kt, nk, stride)
        else:
            base = kv_elem + kt * BLOCK_N * stride
            rows = int32(min(int32(BLOCK_N), int32(nk - kt * BLOCK_N)))   # in 1 .. BLOCK_N
        copy_k(smem, tile_byte, k, base, stride, rows, HALF, tid)

    return load_k


@functools.lru_cache(maxsize=None)
def make_v_words(STRIDED):
    """``(v_start, v_tile)``: ``v_start(v, fb, kv_row)``, where the kv head's V words start for
    the fill (a key row of the flat view, or ``STRIDED`` ``(word, words a key)`` of a view
    through its strides), and ``v_tile(v_row, k0)``: the same at key ``k0``."""
    words = make_elem_strides(4)

    if STRIDED:
        @_stage
        def v_start(v, fb, kv_row):
            vs = words(v)
            return (fb.b * vs[0] + fb.hk * vs[1], int64(vs[2]))

        @_stage
        def v_tile(v_row, k0):
            return (v_row[0] + k0 * v_row[1], v_row[1])
    else:
        @_stage
        def v_start(v, fb, kv_row):
            return kv_row

        @_stage
        def v_tile(v_row, k0):
            return v_row + k0

    return v_start, v_tile


@functools.lru_cache(maxsize=None)
def forward_wgmma_fp8_kernel(cfg):
    """Build ``kernel(q, k, v, v8, o, lse, descale, va)`` for the
    :class:`~numba_flash.kernels.forward.config.ForwardWgmmaFp8Config` ``cfg`` (the module
    docstring's contract and views)."""
    assert isinstance(cfg, ForwardWgmmaFp8Config) and cfg.STAGES == 2
    WARPGROUPS, BLOCK_M, BLOCK_N, HEAD_DIM = cfg.WARPGROUPS, cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM
    THREADS, SOFTCAP, ALIBI, USER = cfg.THREADS, cfg.SOFTCAP, cfg.ALIBI, cfg.USER
    user_score, user_mask, BLOCKS = USER if USER is not None else (None, None, None)
    FNS = (user_score, user_mask) if USER is not None else None
    MASK_MOD = user_mask is not None
    ROWS = 2                        # a lane's rows: g and g + 8 of its warp's 16
    KEYS = BLOCK_N // 4             # a lane's scores a row
    COLS = HEAD_DIM // 4            # a lane's output columns a row
    HALF = HEAD_DIM // 2            # byte pairs of a Q / K row (the 16-bit copies' elements)
    RAW = not (SOFTCAP or ALIBI or user_score is not None)   # scale folded into the exponent
    ONE = float32(1.0)
    LOG2E_F = float32(1.4426950408889634)
    UNDO_P = float32(2.0 ** -cfg.P_OFFSET)
    XOR = (1, 2)                    # a row's 4 lanes (its quad)

    # -- shared memory (module docstring): Q, then 2 x (K, V^T), 1024-byte aligned tiles
    Q_LAY = TileLayout(BLOCK_M, HALF, cfg.SWIZZLE_QK).check()
    K_LAY = TileLayout(BLOCK_N, HALF, cfg.SWIZZLE_QK).check()
    VT_LAY = TileLayout(HEAD_DIM, BLOCK_N // 2, cfg.SWIZZLE_VT).check()
    TILE = cfg.TILE_BYTES
    assert K_LAY.BYTES == TILE == VT_LAY.BYTES and TILE % ARENA_ALIGN == 0
    assert cfg.Q_BYTES % ARENA_ALIGN == 0
    KV_BYTE = cfg.Q_BYTES           # stage s: K at KV_BYTE + 2 s TILE, V^T after it
    P_WORDS = BLOCK_N // 8          # a lane's P: 2 rows x BLOCK_N / 4 keys, four e4m3 a word
    Q_WG = Q_LAY.descriptor("K", 0, mn0=64).start if WARPGROUPS > 1 else 0

    # -- the stages (module docstring)
    operands_qk, issue_qk, complete_qk = make_warpgroup_gemm(BLOCK_N, K_LAY, "K", "e4m3",
                                                             A_LAYOUT=Q_LAY, ACCUMULATE=False)
    operands_pv, issue_pv, complete_pv = make_warpgroup_gemm(HEAD_DIM, VT_LAY, "K", "e4m3")
    p_pack, _p_words = make_a_pack(BLOCK_N // 32, "e4m3", 2.0 ** cfg.P_OFFSET)
    scores_masked, scores_full = make_tile_scores_pair(ROWS, KEYS, ACC_ROWS, ACC_COLS, RAW,
                                                       SOFTCAP, ALIBI, FNS, float32)
    softmax_init, softmax_update, _finalize = make_online_softmax(
        ROWS, KEYS, COLS, XOR, "ex2", float32, cfg.RESCALE, ALPHA_OUT=True)
    rescale = make_rescale(ROWS, COLS)
    STRIDED = cfg.STRIDED
    epilogue = make_epilogue(ROWS, COLS, XOR, ACC_ROWS, ACC_COLS, element_ops(cfg.OUT)[1],
                             float32, STRIDED_O=STRIDED)
    _dropout, nonfinite_v_fixup = make_row_stages(ROWS, KEYS, COLS, BLOCK_N, "e4m3", RAW,
                                                  SOFTCAP, ALIBI, FNS)
    copy_q = make_tile_copy(Q_LAY, THREADS, True)
    copy_k = make_tile_copy(K_LAY, THREADS, True, STRIDED)   # (a run-time row stride)
    fill_masked = make_vt_fill(BLOCK_N, HEAD_DIM, THREADS, cfg.SWIZZLE_VT, True, STRIDED)
    fill_full = make_vt_fill(BLOCK_N, HEAD_DIM, THREADS, cfg.SWIZZLE_VT, False, STRIDED)
    # where the operands start (STRIDED: through their strides), V's words, o's rows
    fp8_bases = make_fp8_bases(HEAD_DIM, STRIDED)[0]
    v_start, v_tile = make_v_words(STRIDED)
    o_start = make_operand_bases(STRIDED, False)[1]
    row_stride = make_row_stride(STRIDED)
    tile_span = make_tile_span(BLOCK_N)
    forward_block = make_forward_block(BLOCK_M, 16, RAW, ALIBI)   # a warp: 16 rows
    load_k = make_k_load(BLOCK_N, HALF, copy_k, STRIDED)

    @_stage
    def zero_tile(smem, tile_byte, tid):
        """Zeros in a tile (this thread's words: the first step's fence and barrier publish
        them): the "V^T of tile -1" the first step's ``P V`` reads, with ``P`` zero."""
        for i in range(TILE // (4 * THREADS)):
            smem[(tile_byte >> 2) + tid + i * THREADS] = uint32(0)

    @_stage
    def publish(prev):
        """The step's one barrier: this thread's K copies (issued a step ago) landed and its
        ``V^T`` stores fenced for the async proxy; after a masked tile, whether any thread
        zeroed a NaN byte of its ``V^T`` (the whole block takes the same branch)."""
        cp_async_wait_all()
        fence_proxy_async()  # this thread's copies and stores, seen by the wgmma
        if prev[1]:
            return cuda.syncthreads_or(prev[4])  # landed for all; any NaN zeroed in V^T?
        cuda.syncthreads()  # K_j, V^T_{j-1} landed for all; every wgmma of tile j - 1's S done
        return 0

    @_stage
    def finish_pv(d_o, acc, v_bad, x):
        """Wait for the ``P V`` of tile ``prev[0]`` and take its accumulator; rarely, the NaN
        ``v`` rule of that tile."""
        wgmma_wait_group(0)
        complete_pv(d_o, acc)
        if v_bad:
            nonfinite_v_fixup(acc, x.v8, x.hk, x.sa, x.row0, x.bounds, x.prev[0] * BLOCK_N, x.t,
                              x.prev[2] != 0)

    def make_step(MASKED):
        """One K/V tile ``j``; ``MASKED`` (compile time): its scores are masked per element."""
        tile_scores = scores_masked if MASKED else scores_full
        fill_vt = fill_masked if MASKED else fill_full

        # [docs:wgmma-fp8-step]
        @_stage
        def step(kt, kt_ahead, stage, t_hi, x, umask):   # x: the WgmmaFp8Step
            s, acc, m_i, l_i, pa, alpha, prev = x.s, x.acc, x.m_i, x.l_i, x.pa, x.alpha, x.prev
            smem, pad, base, tid, nk = x.smem, x.pad, x.base, x.tid, x.bounds[0]
            k_byte = pad + KV_BYTE + 2 * TILE * stage                # K_j, then V^T_j
            vt_prev = pad + KV_BYTE + 2 * TILE * (1 - stage) + TILE   # V^T_{j-1}
            v_bad = publish(prev)
            if kt_ahead < t_hi:   # K_{j+1} into the other stage (its K_{j-1} is read)
                load_k(smem, pad + KV_BYTE + 2 * TILE * (1 - stage), x.k, x.kv_elem, kt_ahead,
                       nk, x.k_d, tid)
            cp_async_commit()
            d_o, p_regs = operands_pv(acc, pa)    # P V's registers, before any mma is issued
            d_s, _ = operands_qk(s, s)
            d_s = issue_qk(d_s, None, smem, x.q_addr, base + k_byte)    # S_j = Q K_j^T
            d_o = issue_pv(d_o, p_regs, smem, 0, base + vt_prev)        # acc += P_{j-1} V_{j-1}
            bad = fill_vt(smem, k_byte + TILE, x.v, v_tile(x.v_row, kt * BLOCK_N),  # V^T_j,
                          nk - kt * BLOCK_N, tid)                        # under both products
            wgmma_wait_group(1)   # S_j complete; P V stays in flight under the softmax
            complete_qk(d_s, s)
            tile_scores(s, x.sa, x.row0, kt * BLOCK_N + 2 * x.t, x.bounds, umask)
            moved = softmax_update(s, alpha, m_i, l_i, x.exp_scale)    # m_i, l_i, P; alpha
            finish_pv(d_o, acc, v_bad, x)                               # P_{j-1} V_{j-1} landed
            if moved:
                rescale(acc, alpha)                                     # acc *= alpha
            p_pack(s, pa)                            # P_j 2**P_OFFSET as e4m3, next step's A
            prev[0], prev[1], prev[2], prev[3], prev[4] = kt, int32(MASKED), int32(umask), \
                stage, int32(bad)
        # [/docs:wgmma-fp8-step]

        return step

    walk, nxt = make_kv_walk(make_step(False), make_step(True), BLOCKS, MASK_MOD, BLOCK_N,
                             cfg.STAGES, 1)

    # a user's functions stay out of the on-disk kernel cache (as the 16-bit builds)
    @kernel_jit(cache=USER is None, launch_bounds=THREADS)
    def flash_forward_wgmma_fp8(q, k, v, v8, o, lse, descale, va):
        tid = int32(cuda.threadIdx.x)
        fb = forward_block(q, k, va, tid, cuda.blockIdx.x)   # which rows, heads, warp, lane
        b, hk, nq, nk = fb.b, fb.hk, fb.nq, fb.nk
        # the scores' scale: softmax_scale q_descale k_descale (FA3's), per (b, kv head)
        scale = va.scale * descale[0, b, hk] * descale[1, b, hk]
        sa = ScoreArgs(scale, fb.sa.softcap, fb.sa.inv_softcap, fb.sa.slope, fb.offset, nq, b,
                       fb.h, fb.sa.aux)

        smem = cuda.shared.array(0, uint32)   # dynamic: cfg.SMEM_BYTES
        pad = align_pad(smem)                 # the tiles from a 1024-byte boundary
        base = smem_address(smem)             # arena byte x is shared address base + x
        s = cuda.local.array((ROWS, KEYS), float32)
        acc = cuda.local.array((ROWS, COLS), float32)
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)
        pa = cuda.local.array(P_WORDS, uint32)   # P of the previous tile, e4m3
        alpha = cuda.local.array(ROWS, float32)
        prev = cuda.local.array(5, int32)   # the previous tile: kt, masked, umask, stage, bad
        for i in range(P_WORDS):            # "tile -1": P = 0 against V^T = 0
            pa[i] = uint32(0)
        prev[0], prev[1], prev[2], prev[3], prev[4] = -1, 0, 0, 1, 0

        t_lo, t_hi, f_lo, f_hi = tile_span(fb.q_start, fb.q_end, fb.offset, nk, fb.left,
                                           fb.right)
        ob = fp8_bases(q, k, fb)   # Q's and K's starts (byte pairs; STRIDED: row strides)
        v_row = v_start(v, fb, ob.v_row)
        w = KvWalk(va.user, b, fb.h, fb.q_start, fb.q_end, nk, t_hi, f_lo, f_hi, tid)

        # -- prologue: Q, K of the first tile, the zero V^T of "tile -1"
        copy_q(smem, pad, q, ob.q_elem0, row_stride(ob.q_d), fb.q_end - fb.q_start, HALF, tid)
        kt = nxt(t_lo - 1, w)
        if kt < t_hi:
            load_k(smem, pad + KV_BYTE, k, ob.kv_elem, kt, nk, ob.k_d, tid)
        cp_async_commit()   # the first step's barrier publishes Q and K_0 with its wait
        zero_tile(smem, pad + KV_BYTE + 3 * TILE, tid)   # stage 1's V^T: the first P V's
        softmax_init(m_i, l_i, acc)

        q_addr = base + pad + warp_uniform(tid >> 7) * Q_WG   # this warpgroup's Q rows
        ctx = WgmmaFp8Step(smem, sa, pad, k, ob.kv_elem, ob.k_d, v, v_row, v8, hk,
                           (nk, fb.left, fb.right), s, acc, m_i, l_i, pa, alpha, prev, tid,
                           fb.t, fb.row0, q_addr, base,
                           scale * LOG2E_F if RAW else LOG2E_F)
        walk(kt, nxt(kt, w), t_hi, w, ctx)
        if prev[0] >= 0:   # the last tile's P V
            v_bad = publish(prev)
            d_o, p_regs = operands_pv(acc, pa)
            d_o = issue_pv(d_o, p_regs, smem, 0, base + pad + KV_BYTE + 2 * TILE * prev[3]
                           + TILE)
            finish_pv(d_o, acc, v_bad, ctx)
        else:   # no tile to visit: Q's copies still land before the block exits
            cp_async_wait_all()

        # -- epilogue: o = acc v_descale 2**-P_OFFSET / l, lse (raw-unit m times the scale)
        undo = descale[2, b, hk] * UNDO_P
        for r in range(ROWS):
            for c in range(COLS):
                acc[r, c] *= undo
        row_base = int64(uint32(fb.bh)) * nq
        o_elem0, o_row = o_start(o, fb.bh, row_base, HEAD_DIM)
        epilogue(o, lse, acc, m_i, l_i, scale if RAW else ONE,
                 EpilogueRows(fb.row0, nq, o_elem0, o_row, row_base, fb.t == 0, 1),
                 (2 * fb.t, HEAD_DIM), sink_of(va.sink, fb.h))

    return flash_forward_wgmma_fp8


def compile_args(cfg):
    """The Numba argument types of :func:`forward_wgmma_fp8_kernel` ``(q, k, v, v8, o, lse,
    descale, va)``: the ``mma.sync`` fp8 forward's, ``v`` a flat word view."""
    return fp8_compile_args(cfg, V_NDIM=1)


def compile_config(cfg):
    """The compile tier's entry of one configuration (built for :data:`CC`, sm_90a)."""
    return {
        "name": cfg.name,
        "config": cfg,
        "kernel": forward_wgmma_fp8_kernel(cfg),
        "args": compile_args(cfg),
        "float64_ok": False,
        "cc": CC,
        "launch_bounds": cfg.THREADS,
        "dynamic_smem": cfg.SMEM_BYTES,
        # per warpgroup and K/V tile: Q K^T in d / 32 m64n{BLOCK_N}k32, P V in BLOCK_N / 32
        # m64n{d}k32
        "hgmma": ((cfg.BLOCK_N, cfg.HEAD_DIM // 32), (cfg.HEAD_DIM, cfg.BLOCK_N // 32)),
        "sass": {"expect_mma": cfg.HEAD_DIM // 32 + cfg.BLOCK_N // 32},
    }
