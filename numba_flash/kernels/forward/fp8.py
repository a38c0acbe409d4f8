"""FlashAttention forward on fp8 tensor cores: e4m3 ``Q K^T`` and ``P V`` on
``mma.sync.m16n8k32`` (sm_89+), FA3's descales, ``o`` in bfloat16 or float16.

Contract (the tensor-core forward's, :func:`numba_flash.reference.attention`, on the dequantised
inputs): with ``q = q8 q_descale[b, kvh]``, ``k = k8 k_descale[b, kvh]``, ``v = v8 v_descale[b,
kvh]`` (``kvh`` the query head's kv head), per ``(b, h)`` and query row ``i``, ``o_i =
softmax(s_i) V`` and ``lse_i`` over the keys the row sees (causal / window bottom-right,
:mod:`numba_flash.kernels.mainloop.visibility`), ``s = scale q . k`` through softcap and ALiBi;
a learnable sink joins the denominator; a row that sees no key gets ``o = 0``, ``lse = -inf``
(or the sink); a NaN in ``q`` or in a key the row sees makes ``o`` and ``lse`` NaN, a NaN
``v[j, c]`` of a key it sees makes ``o[i, c]`` NaN (e4m3fn has no inf).  ``Q K^T`` and ``P V``
multiply e4m3 bytes and accumulate in float32; ``P`` is packed to e4m3 as ``P 2**P_OFFSET``
with ``P <= 2**RESCALE`` (:class:`~numba_flash.kernels.forward.config.ForwardFp8Config`: the
largest ``P`` lands at 256 of e4m3's 448, never clipped), the offset and ``v_descale`` undone in
the epilogue.

:func:`forward_fp8_kernel` ``(cfg)`` builds ``kernel(q, k, v, v8, o, lse, descale, va)``: ``q``,
``k`` uint16 views of the e4m3 ``[B, H(kv), N, d]`` (byte pairs: the 16-bit tile copies move
them unchanged), ``v`` its uint32 view ``[B, Hkv, N, d / 4]`` (four values a word), ``v8`` its
uint8 view (the NaN fix-up's reads), ``o`` the flat view of ``[B, H, Nq, d]`` (float16, or
bfloat16's uint16 words), ``lse`` flat float32, ``descale`` float32 ``[3, B, Hkv]`` (q, k, v),
``va`` the :class:`~numba_flash.kernels.core.variant.Variant`.  ``STRIDED``: ``q``, ``k``, ``v``,
``v8`` and ``o`` are 4-D views read (``o`` written) through their own strides (``v`` its
``[B, Hkv, N, d / 4]`` word view), the 16-bit forward's :func:`~numba_flash.kernels.forward.
mma.make_operand_bases` on the byte pairs.  Grid ``(ceil(Nq / 64) B H,)``
(Q tiles fastest), block 128 threads: warp ``w`` owns rows ``16 w ..`` of the Q tile.

Shared memory (``cfg.SMEM_BYTES``): the Q tile and the K tile (rows of ``d + 16`` bytes, by
``cp.async``) and the ``V^T`` tile: row ``c`` holds value column ``c`` of the tile's keys in the
order the ``P`` registers pack them (:func:`~numba_flash.kernels.ptx.mma_fp8.p_key_of_k`),
written by the threads from 32-bit loads of four keys' words, their bytes transposed in
registers (:func:`make_vt_fill`).  One K/V tile at a time (no pipeline yet: the readable
first build; the SASS tier counts it).

The per-tile step reads as its stages: K and ``V^T`` in, ``S = Q K^T``, the tile's scores
(:func:`~numba_flash.kernels.mainloop.tile_scores.make_tile_scores`), the online softmax
(threshold ``RESCALE``), ``acc += P V`` (:func:`~numba_flash.kernels.mainloop.warp_gemm.
make_gemm` with ``DTYPE = "e4m3"``).  ``[docs: fp8.md]``.
"""

from __future__ import annotations

import functools
from collections import namedtuple

from numba import cuda, float32, int64, types, uint32

from ..core.common import SMEM_LIMIT, make_elem_strides
from ..core.elements import element_ops
from ..core.jit import device_jit, kernel_jit
from ..core.variant import variant_type
from ..mainloop.online_softmax import EpilogueRows, make_epilogue, make_online_softmax, sink_of
from ..mainloop.tile_scores import ScoreArgs, make_tile_scores_pair
from ..mainloop.tile_walk import KvWalk, make_kv_walk
from ..mainloop.visibility import make_tile_span
from ..mainloop.warp_gemm import (
    ACC_COLS, ACC_ROWS, KIND_A, KIND_B, lane_offset, make_gemm, make_load_a,
)
from ..ptx.stages import (
    EXP_BITS, LOG2E, SHARED_ALIGN, cp_async_commit, cp_async_wait_all, make_row_stride,
    make_tile_copy,
)
from .config import ForwardFp8Config, forward_fp8_config
from .mma import make_forward_block, make_operand_bases, make_row_stages

__all__ = ["ForwardFp8Config", "forward_fp8_config", "forward_fp8_kernel", "make_vt_fill",
           "compile_config"]

_stage = functools.partial(device_jit, own_module=True, inline=True)

#: e4m3fn's NaN: all exponent and mantissa bits set (``S.1111.111``; the NaN fix-up's mask)
NAN_BITS = EXP_BITS["e4m3"]
#: the compute capability the compile tier builds this kernel for: sm_89's native e4m3
#: ``mma.sync`` (QMMA.16832); sm_90 has none (ptxas emulates it: conversions and HMMA.16816)
CC = (8, 9)


# [docs:vt-fill]
@functools.lru_cache(maxsize=None)
def make_vt_fill(BLOCK_N, HEAD_DIM, RBT, THREADS, STRIDED=False):
    """``fill(smem, vt_byte, v, row0, nk, tid) -> bad``: the ``V^T`` tile of keys ``row0 ..
    row0 + BLOCK_N - 1`` (row ``row0`` of ``v``'s word view ``[rows, HEAD_DIM / 4]``;
    ``STRIDED``: ``row0 = (b, hk, key)`` of its view ``[B, Hkv, N, HEAD_DIM / 4]``; keys
    ``>= nk`` zeros): shared row ``c`` at ``vt_byte + c RBT`` holds column ``c``'s bytes in the
    ``P`` packing's key order (byte ``k`` of each 32-key step: key ``p_key_of_k(k)``).  A thread
    takes four such bytes ``k .. k + 3`` (keys ``2t, 2t + 1, 2t + 8, 2t + 9`` of a 16-key half)
    for four columns: four 32-bit loads, a 4 x 4 byte transpose in registers, four 32-bit
    stores.  A NaN byte is stored as 0 and reported (``bad``): the kernel's fix-up reads it
    from global memory for the rows that see it."""
    QUADS = BLOCK_N // 4                 # groups of four key bytes a column
    WORDS = HEAD_DIM // 4                # groups of four columns (a word of each key row)
    ITEMS = QUADS * WORDS
    BYTE = uint32(0xFF)

    if STRIDED:
        @_stage
        def v_word(v, at, key, col4):   # a strided view, through its strides
            return v[at[0], at[1], at[2] + key, col4]
    else:
        @_stage
        def v_word(v, at, key, col4):
            return v[at + key, col4]

    @_stage
    def fill(smem, vt_byte, v, row0, nk, tid):
        bad = False
        for item in range(tid, ITEMS, THREADS):
            quad = item // WORDS         # key bytes 4 quad .. 4 quad + 3 (consecutive threads:
            col4 = item % WORDS          # consecutive words of the same keys: coalesced)
            k0 = 4 * quad
            base = k0 - k0 % 16 + (k0 % 16) // 2     # 16 h + 2 t: keys base, +1, +8, +9
            w = cuda.local.array(4, uint32)
            for j in range(4):
                key = base + (j & 1) + 8 * (j >> 1)
                w[j] = v_word(v, row0, key, col4) if key < nk else uint32(0)
            for i in range(4):           # output word i: column 4 col4 + i, its four keys
                out = uint32(0)
                for j in range(4):
                    byte = (w[j] >> uint32(8 * i)) & BYTE
                    if (byte & uint32(NAN_BITS)) == uint32(NAN_BITS):
                        byte = uint32(0)
                        bad = True
                    out |= byte << uint32(8 * j)
                smem[(vt_byte + (4 * col4 + i) * RBT + k0) // 4] = out
        return bad
    # [/docs:vt-fill]

    return fill


#: the fp8 step's context: shared memory; K's word view and its first element, V's word view
#: and first row, its byte view (the NaN fix-up), the kv head; the score arguments and the
#: bounds ``(nk, left, right)``; the lane's register arrays; its coordinates and fragment
#: offsets; the exponent factor
Fp8Tile = namedtuple("Fp8Tile", "smem k v v8 kv_elem k_d v_row hk sa bounds qf s acc m_i l_i "
                     "tid t row0 q_a k_b v_b exp_scale")


#: where a block's e4m3 operands start (:func:`make_fp8_bases`): Q's first row and the ``d``
#: its copy takes (byte pairs; ``STRIDED``: with the row stride), K's (b, hk) start and ``d``,
#: V's word view's start (a row, or ``STRIDED`` the ``(b, hk, key)`` of its 4-D view)
Fp8Bases = namedtuple("Fp8Bases", "q_elem0 q_d kv_elem k_d v_row")


@functools.lru_cache(maxsize=None)
def make_fp8_bases(HEAD_DIM, STRIDED):
    """``(fp8_bases, v_tile)``: ``fp8_bases(q, k, fb) ->`` :data:`Fp8Bases` of the block ``fb``
    (C-contiguous ``[B, H(kv), N, d / 2]`` byte-pair views, or ``STRIDED`` views read through
    their strides), and ``v_tile(v_row, k_start)``: the fill's start of the tile at key
    ``k_start``."""
    strides = make_elem_strides(2)   # the byte pairs' 16-bit elements
    PAIRS = HEAD_DIM // 2

    if STRIDED:
        @_stage
        def fp8_bases(q, k, fb):
            qs, ks = strides(q), strides(k)
            return Fp8Bases(fb.b * qs[0] + fb.h * qs[1] + fb.q_start * qs[2], (PAIRS, qs[2]),
                            fb.b * ks[0] + fb.hk * ks[1], (PAIRS, ks[2]), (fb.b, fb.hk, 0))

        @_stage
        def v_tile(v_row, k_start):
            return (v_row[0], v_row[1], v_row[2] + k_start)
    else:
        @_stage
        def fp8_bases(q, k, fb):
            kv_row = (fb.b * k.shape[1] + fb.hk) * int64(fb.nk)   # the kv head's first key row
            return Fp8Bases((fb.bh * fb.nq + fb.q_start) * PAIRS, PAIRS, kv_row * PAIRS, PAIRS,
                            kv_row)

        @_stage
        def v_tile(v_row, k_start):
            return v_row + k_start

    return fp8_bases, v_tile


@functools.lru_cache(maxsize=None)
def forward_fp8_kernel(cfg):
    """Build ``kernel(q, k, v, v8, o, lse, descale, va)`` for the
    :class:`~numba_flash.kernels.forward.config.ForwardFp8Config` ``cfg`` (the module
    docstring's contract and views)."""
    assert isinstance(cfg, ForwardFp8Config) and cfg.HEAD_DIM % 32 == 0
    assert cfg.SMEM_BYTES <= SMEM_LIMIT
    BLOCK_M, BLOCK_N, HEAD_DIM, THREADS = cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS
    SOFTCAP, ALIBI, Q_IN_REGS, USER = cfg.SOFTCAP, cfg.ALIBI, cfg.Q_IN_REGS, cfg.USER
    user_score, user_mask, BLOCKS = USER if USER is not None else (None, None, None)
    FNS = (user_score, user_mask) if USER is not None else None
    MASK_MOD = user_mask is not None
    RB, RBT = cfg.ROW_BYTES, cfg.VT_ROW_BYTES
    K_BYTE = BLOCK_M * RB                # the K tile after the Q tile
    VT_BYTE = K_BYTE + BLOCK_N * RB      # the V^T tile after the K tile
    SMEM_WORDS = cfg.SMEM_BYTES // 4
    ROWS = 2                             # a lane's rows: g, g + 8 of its warp's 16
    KEYS = BLOCK_N // 4                  # a lane's scores a row
    COLS = HEAD_DIM // 4                 # a lane's output columns a row
    K_STEPS = HEAD_DIM // 32             # Q K^T's k-steps (32 bytes each)
    RAW = not (SOFTCAP or ALIBI or user_score is not None)   # scale folded into the exponent
    ZERO = float32(0.0)
    ONE = float32(1.0)
    LOG2E_F = float32(LOG2E)
    XOR = (1, 2)                         # a row's four lanes (its quad)
    UNDO_P = float32(2.0 ** -cfg.P_OFFSET)

    load_q = make_load_a(1, K_STEPS, RB)
    gemm_qk = make_gemm(1, BLOCK_N // 16, K_STEPS, "regs" if Q_IN_REGS else "smem", False, RB,
                        RB, "e4m3")
    gemm_pv = make_gemm(1, HEAD_DIM // 16, BLOCK_N // 32, "acc", False, RB, RBT, "e4m3",
                        P_SCALE=2.0 ** cfg.P_OFFSET)
    scores_masked, scores_full = make_tile_scores_pair(ROWS, KEYS, ACC_ROWS, ACC_COLS, RAW,
                                                       SOFTCAP, ALIBI, FNS, float32)
    softmax_init, softmax_update, _fin = make_online_softmax(ROWS, KEYS, COLS, XOR, "ex2",
                                                             float32, cfg.RESCALE)
    STRIDED = cfg.STRIDED
    epilogue = make_epilogue(ROWS, COLS, XOR, ACC_ROWS, ACC_COLS, element_ops(cfg.OUT)[1],
                             float32, STRIDED_O=STRIDED)
    copy_q = make_tile_copy(BLOCK_M, HEAD_DIM // 2, RB, THREADS, True, False,   # byte pairs
                            STRIDED)
    copy_k = make_tile_copy(BLOCK_N, HEAD_DIM // 2, RB, THREADS, True, False, STRIDED)
    fill_vt = make_vt_fill(BLOCK_N, HEAD_DIM, RBT, THREADS, STRIDED)
    fp8_bases, v_tile = make_fp8_bases(HEAD_DIM, STRIDED)
    row_stride = make_row_stride(STRIDED)
    o_start = make_operand_bases(STRIDED, False)[1]
    tile_span = make_tile_span(BLOCK_N)
    forward_block = make_forward_block(BLOCK_M, 16, RAW, ALIBI)
    _dropout, nonfinite_v_fixup = make_row_stages(ROWS, KEYS, COLS, BLOCK_N, "e4m3", RAW,
                                                  SOFTCAP, ALIBI, FNS)

    def make_step(MASKED):
        """One K/V tile; ``MASKED``: the tile is not inside the keys every row of the Q tile
        sees, so its scores are masked per element."""
        tile_scores = scores_masked if MASKED else scores_full

        # [docs:fp8-step]
        @_stage
        def step(kt, x, umask):   # x: the Fp8Tile; umask: the tile needs the user's mask_mod
            smem, s, acc, m_i, l_i = x.smem, x.s, x.acc, x.m_i, x.l_i
            k_start = kt * BLOCK_N
            nk = x.bounds[0]
            cuda.syncthreads()  # every warp is done with tile kt - 1's K and V^T
            copy_k(smem, K_BYTE, x.k, x.kv_elem + k_start * row_stride(x.k_d), nk - k_start,
                   x.k_d, x.tid)
            cp_async_commit()
            v_bad = fill_vt(smem, VT_BYTE, x.v, v_tile(x.v_row, k_start), nk - k_start, x.tid)
            cp_async_wait_all()
            v_bad = cuda.syncthreads_or(1 if v_bad else 0)  # K, V^T landed; any NaN in V?
            for r in range(ROWS):
                for c in range(KEYS):
                    s[r, c] = ZERO
            gemm_qk(s, x.qf, smem, x.q_a, K_BYTE + x.k_b)                     # S = Q K^T
            tile_scores(s, x.sa, x.row0, k_start + 2 * x.t, x.bounds, umask)  # masks, mods
            softmax_update(s, acc, m_i, l_i, x.exp_scale)                     # m_i, l_i, P
            gemm_pv(acc, s, smem, 0, VT_BYTE + x.v_b)                         # acc += P V
            if v_bad:
                nonfinite_v_fixup(acc, x.v8, x.hk, x.sa, x.row0, x.bounds, k_start, x.t, umask)
        # [/docs:fp8-step]

        return step

    step_masked = make_step(True)
    step_full = make_step(False)

    # a user's variant: the tile walk's verdicts (a block mask's EMPTY tiles skipped, its FULL
    # ones unmasked, mask_mod on the others); without one the plain loop below
    def walk_full(t, ahead, stage, t_hi, x, umask):
        step_full(t, x, umask)

    def walk_masked(t, ahead, stage, t_hi, x, umask):
        step_masked(t, x, umask)

    if USER is None:
        @_stage
        def run_tiles(t_lo, t_hi, f_lo, f_hi, w, x):
            """The K/V tiles the rows visit: masked at the edges, plain inside."""
            for kt in range(t_lo, t_hi):
                if kt < f_lo or kt >= f_hi:
                    step_masked(kt, x, True)
                else:
                    step_full(kt, x, True)
    else:
        walk, nxt = make_kv_walk(_stage(walk_full), _stage(walk_masked), BLOCKS, MASK_MOD,
                                 BLOCK_N, 1, 1)

        @_stage
        def run_tiles(t_lo, t_hi, f_lo, f_hi, w, x):
            """The tiles by the walk's verdicts (``w``: its :data:`KvWalk`)."""
            kt = nxt(t_lo - 1, w)
            walk(kt, nxt(kt, w), t_hi, w, x)

    # a user's functions stay out of the on-disk kernel cache (as the 16-bit builds)
    @kernel_jit(cache=USER is None)
    def flash_forward_fp8(q, k, v, v8, o, lse, descale, va):
        tid = cuda.threadIdx.x
        fb = forward_block(q, k, va, tid, cuda.blockIdx.x)   # which rows, heads, warp, lane
        b, h, hk, nq, nk, warp, lane, t = fb.b, fb.h, fb.hk, fb.nq, fb.nk, fb.warp, fb.lane, fb.t
        # the scores' scale: softmax_scale q_descale k_descale (FA3's), per (b, kv head)
        scale = va.scale * descale[0, b, hk] * descale[1, b, hk]
        sa = ScoreArgs(scale, fb.sa.softcap, fb.sa.inv_softcap, fb.sa.slope, fb.offset, nq, b, h,
                       fb.sa.aux)
        row0 = fb.row0

        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SHARED_ALIGN)
        qf = cuda.local.array((1, K_STEPS, 4), uint32)
        s = cuda.local.array((ROWS, KEYS), float32)
        acc = cuda.local.array((ROWS, COLS), float32)
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)

        # -- prologue: the Q tile (and its fragments into registers)
        ob = fp8_bases(q, k, fb)   # where the operands start (STRIDED: with row strides)
        copy_q(smem, 0, q, ob.q_elem0, fb.q_end - fb.q_start, ob.q_d, tid)
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()  # the Q tile is complete before any warp reads its fragments
        q_a = 16 * RB * warp + lane_offset(lane, RB, KIND_A)
        if Q_IN_REGS:
            load_q(qf, smem, q_a)
        softmax_init(m_i, l_i, acc)

        # -- the K/V tiles the rows visit: masked at the edges, plain inside
        t_lo, t_hi, f_lo, f_hi = tile_span(fb.q_start, fb.q_end, fb.offset, nk, fb.left,
                                           fb.right)
        x = Fp8Tile(smem, k, v, v8, ob.kv_elem, ob.k_d, ob.v_row, hk, sa,
                    (nk, fb.left, fb.right), qf, s, acc, m_i, l_i, tid, t, row0, q_a,
                    lane_offset(lane, RB, KIND_B), lane_offset(lane, RBT, KIND_B),
                    scale * LOG2E_F if RAW else LOG2E_F)
        run_tiles(t_lo, t_hi, f_lo, f_hi,
                  KvWalk(va.user, b, h, fb.q_start, fb.q_end, nk, t_hi, f_lo, f_hi, tid), x)

        # -- epilogue: o = acc v_descale 2**-P_OFFSET / l, lse (raw-unit m times the scale)
        undo = descale[2, b, hk] * UNDO_P
        for r in range(ROWS):
            for c in range(COLS):
                acc[r, c] *= undo
        row_base = int64(fb.bh) * nq
        o_elem0, o_row = o_start(o, fb.bh, row_base, HEAD_DIM)
        epilogue(o, lse, acc, m_i, l_i, scale if RAW else ONE,
                 EpilogueRows(row0, nq, o_elem0, o_row, row_base, t == 0, 1),
                 (2 * t, HEAD_DIM), sink_of(va.sink, h))

    return flash_forward_fp8


def compile_args(cfg, V_NDIM=2):
    """The Numba argument types of :func:`forward_fp8_kernel` ``(q, k, v, v8, o, lse, descale,
    va)`` (and of the warpgroup build's, whose ``v`` word view is flat: ``V_NDIM`` 1)."""
    strided = cfg.STRIDED
    layout = "A" if strided else "C"
    u16 = types.Array(types.uint16, 4, layout)
    o_t = types.Array(types.float16 if cfg.OUT == "float16" else types.uint16,
                      4 if strided else 1, layout)
    user_t = ()
    if cfg.USER is not None:   # the catalog's user build: kinds, then its two aux arrays
        user_t = (types.Array(types.int8, 4, "C"), types.Array(types.float32, 2, "C"),
                  types.Array(types.int32, 2, "C"))
    return (u16, u16, types.Array(types.uint32, 4 if strided else V_NDIM, layout),
            types.Array(types.uint8, 4, layout), o_t,
            types.Array(types.float32, 1, "C"), types.Array(types.float32, 3, "C"),
            variant_type(types.float32, False, user_t))


def compile_config(cfg):
    """The compile tier's entry of one configuration (the catalog builds it for :data:`CC`)."""
    return {
        "name": cfg.name,
        "config": cfg,
        "kernel": forward_fp8_kernel(cfg),
        "args": compile_args(cfg),
        "float64_ok": False,
        "mma": True,
        # one K/V tile a warp: Q K^T (BLOCK_N / 8) (d / 32) mma and P V (d / 8) (BLOCK_N / 32)
        "sass": {"expect_mma": 2 * (cfg.BLOCK_N // 8) * (cfg.HEAD_DIM // 32)},
    }

