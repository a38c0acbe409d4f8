"""FlashAttention forward on Hopper's warpgroup tensor-core instruction (``wgmma.mma_async``,
sm_90a), composed of the mainloop stages.

Contract: the tensor-core forward's (:mod:`numba_flash.kernels.forward.mma`, whose docstring states
it: ``o``, ``lse``, the visibility rules, the variants, the non-finite rules, dropout's Philox
mask); ``Q K^T`` and ``P V`` take 16-bit operands with float32 accumulation, ``P`` rounded to the
input type, the softmax in float32.  Head dims up to 128
(:data:`~numba_flash.kernels.forward.config.WGMMA_HEAD_DIMS`).

:func:`forward_wgmma_kernel` ``(cfg)`` builds ``kernel(q, k, v, o, lse, va)`` (the arguments of
:func:`~numba_flash.kernels.forward.mma.forward_mma_kernel`) for a
:class:`~numba_flash.kernels.forward.config.ForwardWgmmaConfig` (tiles: ``FORWARD_WGMMA_TILES``):
``WARPGROUPS``, ``BLOCK_N``, ``HEAD_DIM``, ``DTYPE``, the variant flags, ``VEC``, ``OVERLAP``
(FA3's intra-warpgroup overlap: tile ``j``'s softmax under tile ``j - 1``'s ``P V``) and
``STRIDED`` (``q``, ``k``, ``v``, ``o`` through their strides: the ``mma.sync`` forward's
:func:`~numba_flash.kernels.forward.mma.make_operand_bases`).  Grid
``(ceil(Nq / BLOCK_M) B H,)`` (Q tiles fastest), block ``128 WARPGROUPS`` threads; warpgroup ``wg``
owns rows ``64 wg ..`` of the Q tile, warp ``w`` of the block rows ``16 w ..``.

Shared memory is dynamic (``SMEM_BYTES``; past 48 KiB opted into at launch): from the first
1024-byte boundary (the 128-byte swizzle's pattern), Q (``BLOCK_M x HEAD_DIM``), then two stages of
(K, V), each ``BLOCK_N x HEAD_DIM``, every tile a
:class:`~numba_flash.kernels.ptx.wgmma.TileLayout` in the 128-byte swizzle, written by 16-byte
``cp.async`` (16-bit loads without ``VEC``); the ``wgmma`` reads K as a K-major and V as an
MN-major operand of the same storage.  Tile ``j`` sits in stage ``j mod 2``.

The per-tile step is the ``mma.sync`` forward's with the warpgroup's GEMM
(:func:`~numba_flash.kernels.ptx.wgmma.make_warpgroup_gemm`: ``S = Q K^T`` SS, ``acc += P V`` RS
with ``P`` packed from the ``S`` registers): a warp's 16 rows of the ``wgmma`` accumulator *are* an
``mma.sync`` fragment (:func:`~numba_flash.kernels.ptx.wgmma.make_fragment_view`), so the score,
softmax, dropout and epilogue stages run with ``M_TILES = 1``.

File: the kernel factory (copies, the step, the tile walk, the epilogue) and the compile tier's
entry.  The pipeline (proxy fences, buffers by tile parity, operands before any ``wgmma``, the
first step's "tile -1"), the tiles and the machine-code counts:
docs/wgmma.md#the-warpgroup-forward.
"""

from __future__ import annotations

import functools
from collections import namedtuple

from numba import cuda, float32, int32, int64, uint32

from ...backend import on_simulator
from ..core.elements import element_ops
from .mma import (
    DropoutRows, compile_args, forward_grid, make_forward_block, make_operand_bases,
    make_row_stages,
)
from ..core.jit import device_jit, kernel_jit
from ..mainloop.online_softmax import (
    RESCALE_LOG2, EpilogueRows, make_epilogue, make_online_softmax, make_rescale, sink_of,
)
from ..ptx.stages import cp_async_commit, cp_async_wait_all, make_row_stride, make_tile_rows
from ..mainloop.tile_scores import make_tile_scores_pair
from ..mainloop.tile_walk import KvWalk, make_kv_walk
from ..core.config import MMA_DTYPES
from .config import SMEM_LIMIT_SM90, WGMMA_HEAD_DIMS, ForwardWgmmaConfig, forward_wgmma_config
from ..mainloop.visibility import make_tile_span
from ..mainloop.warp_gemm import ACC_COLS, ACC_ROWS
from ..ptx.wgmma import (
    ARENA_ALIGN, CC, TileLayout, align_pad, fence_proxy_async, make_a_pack, make_tile_copy,
    make_tile_scan, make_warpgroup_gemm, smem_address, warp_uniform, wgmma_wait_group,
)

#: the warpgroup forward's step context: shared memory, the variant and score arguments, the
#: arena's alignment pad; the K/V inputs; the lane's register arrays (``pa``: P's A
#: fragments, ``prev``: the P V in flight); its coordinates, descriptor base, exponent factor
ForwardWgmmaStep = namedtuple("ForwardWgmmaStep", "smem va sa pad k v kv_base nk d hk bounds "
                              "v_at s acc m_i l_i pa alpha prev tid t row0 q_addr base "
                              "exp_scale")

__all__ = ["MMA_DTYPES", "WGMMA_HEAD_DIMS", "ForwardWgmmaConfig", "forward_wgmma_config",
           "forward_grid", "forward_wgmma_kernel"]

_stage = functools.partial(device_jit, own_module=True, inline=True)


#: the warpgroup forward's K/V copy stages (:func:`make_wgmma_kv_loads`)
WgmmaKvLoads = namedtuple("WgmmaKvLoads", "load_tile load_kv zero_tile")


@functools.lru_cache(maxsize=None)
def make_wgmma_kv_loads(cfg):
    """The K/V copy stages of the warpgroup forward of ``cfg`` (:data:`WgmmaKvLoads`):
    ``load_tile`` (one K or V tile), ``load_kv`` (a step's copies, one group) and ``zero_tile``
    (the zero "V of tile -1" of the first step's ``P V``)."""
    BLOCK_N, HEAD_DIM, THREADS, VEC = cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS, cfg.VEC
    KV_LAY = TileLayout(BLOCK_N, HEAD_DIM, cfg.SWIZZLE).check()
    KV_BYTE = cfg.Q_BYTES                   # stage s: K at KV_BYTE + 2 s TILE, V after it
    TILE = cfg.TILE_BYTES
    copy_kv = make_tile_copy(KV_LAY, THREADS, VEC, cfg.STRIDED)
    STRIDED = cfg.STRIDED
    tile_rows = make_tile_rows(BLOCK_N)

    if cfg.STRIDED:
        @_stage
        def stride_and_width(dd):   # a strided view's: the pair (d, row stride)
            return dd[1], dd[0]
    else:
        @_stage
        def stride_and_width(dd):   # VEC (d == HEAD_DIM): a compile-time row stride
            return (HEAD_DIM if VEC else dd), dd

    @_stage
    def load_tile(smem, tile_byte, x, kv_base, kt, nk, d, tid):
        """Issue the copy of K (or V) tile ``kt``: 32-bit row counts and, with ``VEC`` (``d ==
        HEAD_DIM``), the compile-time row stride (a thread's offsets are loop constants);
        ``STRIDED``: ``d`` is the pair ``(d, row stride)``, the stride a run-time one."""
        stride, width = stride_and_width(d)
        if STRIDED:   # (one IMAD.WIDE: stages.make_tile_rows)
            base, rows = tile_rows(kv_base, kt, nk, stride)
        else:
            base = kv_base + kt * BLOCK_N * stride
            rows = int32(min(int32(BLOCK_N), int32(nk - kt * BLOCK_N)))   # in 1 .. BLOCK_N
        copy_kv(smem, tile_byte, x, base, stride, rows, width, tid)

    @_stage
    def load_kv(smem, pad, stage, k, v, kv_base, kt, kt_ahead, t_hi, nk, d, tid, v_at):
        """At tile ``kt`` (in ``stage``): K of the next tile ``kt_ahead`` into the other stage
        (its K was tile ``kt - 1``'s, whose ``S`` is complete), V of tile ``kt`` into this
        stage (its V was tile ``kt - 2``'s, whose ``P V`` is complete): one copy group, which
        the next step waits for whole.  ``v_at``: V's base and ``d`` (K's without
        ``STRIDED``)."""
        if kt_ahead < t_hi:
            load_tile(smem, pad + KV_BYTE + 2 * TILE * (1 - stage), k, kv_base, kt_ahead, nk, d,
                      tid)
        load_tile(smem, pad + KV_BYTE + 2 * TILE * stage + TILE, v, v_at[0], kt, nk, v_at[1],
                  tid)
        cp_async_commit()

    @_stage
    def zero_tile(smem, tile_byte, tid):
        """Zeros in a tile (this thread's words, ordinary stores: the first step's fence and
        barrier publish them): the "V of tile -1" the first step's ``P V`` reads, with ``P``
        zero (0 * NaN would be NaN; shared memory starts as anything)."""
        for i in range(TILE // (4 * THREADS)):
            smem[(tile_byte >> 2) + tid + i * THREADS] = uint32(0)

    return WgmmaKvLoads(load_tile, load_kv, zero_tile)


@functools.lru_cache(maxsize=None)
def forward_wgmma_kernel(cfg):
    """Build ``kernel(q, k, v, o, lse, va)`` for the :class:`~numba_flash.kernels.forward.config.
    ForwardWgmmaConfig` ``cfg``: the arguments of :func:`~numba_flash.kernels.forward.mma.
    forward_mma_kernel` (uint16 views of ``q``, ``k``, ``v`` ``[B, H(kv), N, d]``; the flat
    ``o`` and ``lse``; the :class:`~numba_flash.kernels.core.variant.Variant`), launched with
    ``cfg.SMEM_BYTES`` of dynamic shared memory."""
    WARPGROUPS, BLOCK_N, HEAD_DIM, OVERLAP = cfg.WARPGROUPS, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.OVERLAP
    DTYPE, USER = cfg.DTYPE, cfg.USER
    DROPOUT, SOFTCAP, ALIBI, VEC = cfg.DROPOUT, cfg.SOFTCAP, cfg.ALIBI, cfg.VEC
    assert HEAD_DIM in WGMMA_HEAD_DIMS and BLOCK_N % 16 == 0 and DTYPE in MMA_DTYPES
    assert cfg.STAGES == 2   # K and V buffers alternate by tile parity (module docstring)
    BLOCK_M, THREADS = cfg.BLOCK_M, cfg.THREADS
    ROWS = 2                        # a lane's rows: g and g + 8 of its warp's 16
    KEYS = BLOCK_N // 4             # a lane's scores per row
    COLS = HEAD_DIM // 4            # a lane's output columns per row
    user_score, user_mask, BLOCKS = USER if USER is not None else (None, None, None)
    FNS = (user_score, user_mask) if USER is not None else None
    MASK_MOD = user_mask is not None
    RAW = not (SOFTCAP or ALIBI or user_score is not None)  # scale folded into the exponent
    ONE = float32(1.0)
    LOG = on_simulator()            # compile time: the tile log exists only in the simulator
    XOR = (1, 2)                    # a row's 4 lanes (its quad)

    # -- shared memory (module docstring): Q, then STAGES x (K, V), 1024-byte aligned tiles
    Q_LAY = TileLayout(BLOCK_M, HEAD_DIM, cfg.SWIZZLE).check()
    KV_LAY = TileLayout(BLOCK_N, HEAD_DIM, cfg.SWIZZLE).check()
    assert cfg.Q_BYTES % ARENA_ALIGN == 0 and cfg.TILE_BYTES % ARENA_ALIGN == 0
    KV_BYTE = cfg.Q_BYTES                   # stage s: K at KV_BYTE + 2 s TILE, V after it
    P_WORDS = BLOCK_N // 4                  # a lane's P, packed to 16 bits: P V's A registers
    TILE = cfg.TILE_BYTES
    Q_WG = Q_LAY.descriptor("K", 0, mn0=64).start if WARPGROUPS > 1 else 0  # a warpgroup's rows

    # -- the stages (module docstring)
    operands_qk, issue_qk, complete_qk = make_warpgroup_gemm(BLOCK_N, KV_LAY, "K", DTYPE,
                                                             A_LAYOUT=Q_LAY, ACCUMULATE=False)
    operands_pv, issue_pv, complete_pv = make_warpgroup_gemm(HEAD_DIM, KV_LAY, "MN", DTYPE)
    p_pack, _p_words = make_a_pack(BLOCK_N // 16, DTYPE)
    scores_masked, scores_full = make_tile_scores_pair(ROWS, KEYS, ACC_ROWS, ACC_COLS, RAW,
                                                       SOFTCAP, ALIBI, FNS, float32)
    # the O rescale waits until the P V in flight has landed: the update hands alpha out
    softmax_init, softmax_update, _finalize = make_online_softmax(
        ROWS, KEYS, COLS, XOR, "ex2", float32, RESCALE_LOG2, ALPHA_OUT=True)
    rescale = make_rescale(ROWS, COLS)
    epilogue = make_epilogue(ROWS, COLS, XOR, ACC_ROWS, ACC_COLS, element_ops(DTYPE)[1], float32,
                             STRIDED_O=cfg.STRIDED)
    operand_bases, o_start = make_operand_bases(cfg.STRIDED, False)
    row_stride = make_row_stride(cfg.STRIDED)
    dropout_rows, nonfinite_v_fixup = make_row_stages(ROWS, KEYS, COLS, BLOCK_N, DTYPE, RAW,
                                                      SOFTCAP, ALIBI, FNS)
    copy_q = make_tile_copy(Q_LAY, THREADS, VEC)
    zero_nonfinite_v = make_tile_scan(KV_LAY, THREADS, DTYPE)
    tile_span = make_tile_span(BLOCK_N)
    forward_block = make_forward_block(BLOCK_M, 16, RAW, ALIBI)   # a warp: 16 rows

    load_tile, load_kv, zero_tile = make_wgmma_kv_loads(cfg)

    @_stage
    def publish(smem, v_byte, prev, nk, tid):
        """The step's one barrier: this thread's copies (K_j and V_{j-1}, issued a step ago)
        landed, V_{j-1}'s inf / NaN halves zeroed when tile ``j - 1`` was masked (0 * NaN = NaN
        on a tensor core), fenced for the async proxy; returns whether any thread zeroed one."""
        cp_async_wait_all()
        if prev[1]:
            bad = zero_nonfinite_v(smem, v_byte, nk - prev[0] * BLOCK_N, tid)
            fence_proxy_async()  # the copies and the zeroing, seen by the wgmma
            return cuda.syncthreads_or(1 if bad else 0)  # landed for all; any non-finite v?
        fence_proxy_async()  # this thread's copies, seen by the wgmma
        cuda.syncthreads()  # K_j, V_{j-1} landed for all; every wgmma of tile j - 1's S done
        return 0

    @_stage
    def finish_pv(d_o, acc, v_bad, v, hk, sa, row0, bounds, t, prev):
        """Wait for the ``P V`` of tile ``prev[0]`` and take its accumulator; rarely, the
        non-finite ``v`` rule of that tile (its mask_mod verdict ``prev[2]``)."""
        wgmma_wait_group(0)
        complete_pv(d_o, acc)
        if v_bad:
            nonfinite_v_fixup(acc, v, hk, sa, row0, bounds, prev[0] * BLOCK_N, t, prev[2] != 0)

    def make_step(MASKED):
        """One K/V tile ``j``; ``MASKED`` (compile time): its scores are masked per element
        (it is not inside the keys every row of the Q tile sees, or a user's mask_mod asks)."""
        tile_scores = scores_masked if MASKED else scores_full

        # [docs:wgmma-step]
        @_stage
        def step(kt, kt_ahead, stage, t_hi, x, umask):   # x: the ForwardWgmmaStep
            s, acc, m_i, l_i = x.s, x.acc, x.m_i, x.l_i
            pa, alpha, prev = x.pa, x.alpha, x.prev
            smem, va, sa, pad = x.smem, x.va, x.sa, x.pad
            k, v, kv_base, nk, d, hk, bounds = x.k, x.v, x.kv_base, x.nk, x.d, x.hk, x.bounds
            tid, t, row0, q_addr, base, exp_scale = (x.tid, x.t, x.row0, x.q_addr, x.base,
                                                     x.exp_scale)
            k_byte = pad + KV_BYTE + 2 * TILE * stage           # K_j (V_j lands after it)
            v_prev = pad + KV_BYTE + 2 * TILE * (1 - stage) + TILE  # V_{j-1}
            v_bad = publish(smem, v_prev, prev, nk, tid)
            load_kv(smem, pad, stage, k, v, kv_base, kt, kt_ahead, t_hi, nk, d, tid, x.v_at)
            d_o, p_regs = operands_pv(acc, pa)    # P V's registers, before any mma is issued
            d_s, _ = operands_qk(s, s)
            d_s = issue_qk(d_s, None, smem, q_addr, base + k_byte)    # S_j = Q K_j^T
            d_o = issue_pv(d_o, p_regs, smem, 0, base + v_prev)       # acc += P_{j-1} V_{j-1}
            if OVERLAP:
                wgmma_wait_group(1)  # S_j complete; P V stays in flight under the softmax
            else:
                finish_pv(d_o, acc, v_bad, v, hk, sa, row0, bounds, t, prev)  # both complete
            complete_qk(d_s, s)
            tile_scores(s, sa, row0, kt * BLOCK_N + 2 * t, bounds, umask)  # mask, score mods
            moved = softmax_update(s, alpha, m_i, l_i, exp_scale)     # m_i, l_i, P; alpha
            if DROPOUT:
                dropout_rows(DropoutRows(s, va, sa, row0, kt * BLOCK_N + 2 * t, nk))
            if OVERLAP:
                finish_pv(d_o, acc, v_bad, v, hk, sa, row0, bounds, t, prev)  # P V landed
            if moved:
                rescale(acc, alpha)                                   # acc *= alpha
            p_pack(s, pa)                                             # P_j for the next step
            prev[0], prev[1], prev[2], prev[3] = kt, int32(MASKED), int32(umask), stage
        # [/docs:wgmma-step]

        return step

    step_masked = make_step(True)
    step_full = make_step(False)

    walk, nxt = make_kv_walk(step_full, step_masked, BLOCKS, MASK_MOD, BLOCK_N, cfg.STAGES, 1,
                             LOG)

    # a user's functions stay out of the on-disk kernel cache (as the mma.sync forward); the
    # launch bounds the compile tier counts with (255 registers for 256 threads)
    @kernel_jit(cache=USER is None, launch_bounds=THREADS)
    def flash_forward_wgmma(q, k, v, o, lse, va):
        tid = int32(cuda.threadIdx.x)
        fb = forward_block(q, k, va, tid, cuda.blockIdx.x)   # which rows, heads, warp, lane

        smem = cuda.shared.array(0, uint32)   # dynamic: cfg.SMEM_BYTES
        pad = align_pad(smem)                 # the tiles from a 1024-byte boundary
        base = smem_address(smem)             # arena byte x is shared address base + x
        s = cuda.local.array((ROWS, KEYS), float32)
        acc = cuda.local.array((ROWS, COLS), float32)
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)
        pa = cuda.local.array(P_WORDS, uint32)     # P of the previous tile, packed
        alpha = cuda.local.array(ROWS, float32)    # this tile's rescale of acc
        prev = cuda.local.array(4, int32)          # the previous tile: kt, masked, umask, stage
        for i in range(P_WORDS):                   # "tile -1": P = 0 against V = 0
            pa[i] = uint32(0)
        prev[0], prev[1], prev[2], prev[3] = -1, 0, 0, 1

        t_lo, t_hi, f_lo, f_hi = tile_span(fb.q_start, fb.q_end, fb.offset, fb.nk, fb.left,
                                           fb.right)
        # where this block's rows of q, k, v start, and their d (STRIDED: with row strides)
        ob = operand_bases(q, k, v, o, fb)
        # the walk's context
        w = KvWalk(va.user, fb.b, fb.h, fb.q_start, fb.q_end, fb.nk, t_hi, f_lo, f_hi, tid)

        # -- prologue: Q, and K of the first tile (a block mask's EMPTY tiles are never loaded)
        copy_q(smem, pad, q, ob.q_elem0, row_stride(ob.q_d), fb.q_end - fb.q_start, fb.d, tid)
        kt = nxt(t_lo - 1, w)
        if kt < t_hi:
            load_tile(smem, pad + KV_BYTE, k, ob.kv_base, kt, fb.nk, ob.k_d, tid)
        cp_async_commit()   # the first step's barrier publishes Q and K_0 with its wait
        zero_tile(smem, pad + KV_BYTE + 3 * TILE, tid)   # stage 1's V: the first P V's
        softmax_init(m_i, l_i, acc)

        q_addr = base + pad + warp_uniform(tid >> 7) * Q_WG   # this warpgroup's Q rows
        ctx = ForwardWgmmaStep(smem, va, fb.sa, pad,
                               k, v, ob.kv_base, fb.nk, ob.k_d, fb.hk,
                               (fb.nk, fb.left, fb.right), ob.v_at,
                               s, acc, m_i, l_i, pa, alpha, prev,
                               tid, fb.t, fb.row0, q_addr, base, fb.exp_scale)
        walk(kt, nxt(kt, w), t_hi, w, ctx)
        if prev[0] >= 0:   # the last tile's P V
            v_last = pad + KV_BYTE + 2 * TILE * prev[3] + TILE
            v_bad = publish(smem, v_last, prev, fb.nk, tid)
            d_o, p_regs = operands_pv(acc, pa)
            finish_pv(issue_pv(d_o, p_regs, smem, 0, base + v_last), acc, v_bad, v, fb.hk, fb.sa,
                      fb.row0, (fb.nk, fb.left, fb.right), fb.t, prev)
        else:   # no tile to visit: Q's copies still land before the block exits
            cp_async_wait_all()

        # -- epilogue: o = acc / l, lse = m lse_scale + log(l) (m in raw units without mods)
        row_base = int64(uint32(fb.bh)) * fb.nq
        o_elem0, o_row = o_start(o, fb.bh, row_base, fb.d)
        epilogue(o, lse, acc, m_i, l_i, va.scale if RAW else ONE,
                 EpilogueRows(fb.row0, fb.nq, o_elem0, o_row, row_base, fb.t == 0, 1),
                 (2 * fb.t, fb.d),
                 sink_of(va.sink, uint32(fb.bh) % uint32(q.shape[1])))

    return flash_forward_wgmma


def compile_config(cfg):
    """The compile tier's entry of one configuration (the mma.sync forward's argument types)."""
    return {
        "name": cfg.name,
        "config": cfg,
        "kernel": forward_wgmma_kernel(cfg),
        "args": compile_args(cfg),
        "float64_ok": False,
        "cc": CC,
        "launch_bounds": cfg.THREADS,
        "dynamic_smem": cfg.SMEM_BYTES,
        # per warpgroup and K/V tile: Q K^T in HEAD_DIM / 16 m64n{BLOCK_N}k16, P V in
        # BLOCK_N / 16 m64n{HEAD_DIM}k16
        "hgmma": ((cfg.BLOCK_N, cfg.HEAD_DIM // 16), (cfg.HEAD_DIM, cfg.BLOCK_N // 16)),
        # one K/V tile: each warp issues every HGMMA of its warpgroup
        "sass": {"expect_mma": cfg.HEAD_DIM // 16 + cfg.BLOCK_N // 16},
    }


assert all(forward_wgmma_config(hd, simulator=False).SMEM_BYTES <= SMEM_LIMIT_SM90
           for hd in WGMMA_HEAD_DIMS)
