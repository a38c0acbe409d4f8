"""FlashAttention backward (SIMT): ``P`` recomputed from ``lse``, K/V tiles outer, dQ by atomics.

Contract (:func:`numba_flash.reference.attention_backward`): with ``S`` the forward's own scores
(:func:`~numba_flash.kernels.mainloop.visibility.make_score`, bit for bit), ``P = exp(S - lse)``,
``D = rowsum(dO * O)`` and ``Z = keep / (1 - p)`` (1 without dropout)::

    dV = (P Z)^T dO      dP = (dO V^T) Z      dS = P (dP - D) grad
    dQ = scale dS K      dK = scale dS^T Q

``grad``: softcap's slope ``1 - t^2`` times a user's ``score_mod_grad`` (1 without either; ALiBi
has no gradient).  A key a row does not see, and a row with ``lse = -inf``, give ``P = dS = 0``.
Arrays ``[B, H(kv), N, d]``, GQA's kv head ``h // (H / Hkv)``; varlen: the packed arrays as one
batch ``[1, H, total, d]`` with int32 ``cu_seqlens``.

Kernels, each on the 1-D grid of :func:`fold_grid` (block ``(tile, b, h)``, tile fastest):
0. :func:`row_mass_kernel`, float32 only ("The stored lse"): row ``i`` of ``dO`` divided by
   ``c_i = sum_j P_ij`` where ``c_i - 1`` is within the rounding of the float32 ``lse``;
1. :func:`preprocess_kernel`: ``delta = rowsum(dO * O)``, ``dq_accum = 0``;
2. :func:`dkdv_kernel`: one block per ``(K/V tile, b, query head)``, this head's dK, dV in
   registers, written once; with ``dq_atomic`` also ``dq_accum += scale dS K`` by atomics;
3. :func:`dq_kernel` (``deterministic=True``): one block per ``(Q tile, b, h)``, dQ in registers;
4. :func:`reduce_kernel`: a GQA group's dK/dV summed in a fixed order, or dQ cast.

Compile time (a :class:`~numba_flash.kernels.backward.config.BackwardSimtConfig`): ``BLOCK_M``,
``BLOCK_N``, ``HEAD_DIM`` (16/32/64/128/256), ``THREADS``, the dtype, ``DROPOUT``, ``USER``; on the
GPU ``launch_bounds = (THREADS, MIN_BLOCKS)`` (``min_blocks``: 2 to 5 blocks, 255 to 96 registers).
Run time: ``va`` (:mod:`~numba_flash.kernels.core.variant`: window with causal as ``right = 0``,
softcap, ALiBi slopes, dropout's seed), ``varlen``, ``dq_atomic``.  Shared memory, in the compute
type (float32 for 16-bit inputs; :func:`shared_bytes`, at most 48 KiB; ``w`` bytes an element,
``VW = 16 / w``): ``k_tile``, ``v_tile [BLOCK_N, HEAD_DIM + VW]``, ``q_tile``, ``do_tile [BLOCK_M,
HEAD_DIM + VW]``, ``p_tile``, ``ds_tile [BLOCK_M, BLOCK_N]``, ``lse``, ``delta [BLOCK_M]``: ``w (2
(BLOCK_M + BLOCK_N)(HEAD_DIM + VW) + 2 BLOCK_M BLOCK_N + 2 BLOCK_M)`` bytes, plus the int32
``keep_tile [BLOCK_M, BLOCK_N / 4]`` with dropout and the 4-byte ``do_bad`` flag.

File: row pads, the grid, :func:`layout` (micro-tiles), the stages (:func:`make_tile_loads`,
:func:`make_block_stages`, :func:`tile_functions`), the kernels 2, 3, 0, 1, 4, the compile tier's
selections; tiles and ``min_blocks``: kernels/backward/config.py.  Derivations, "The stored lse",
non-finite inputs, variants: docs/backward.md; dropout: docs/dropout.md; thread mapping, shared
memory, registers: docs/optimised-forward.md#the-backwards-inner-steps-16-bytes-at-a-time.
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple
from typing import NamedTuple

import numpy as np
from numba import cuda, int32, int64

from ...backend import on_simulator
from ...philox import philox_keep_bits4
from ..core.jit import device_jit, kernel_jit, range_for, static_for
from ..core.common import (
    FULL_MASK, GRID_X_MAX, SMEM_LIMIT, clamp_rows, compute_type, log_tile,
)
from ..core.elements import BFLOAT16, element_ops
from ..mainloop.online_softmax import sink_of
from ..ptx.stages import lds16, make_exp_e, make_row_dot
from ..mainloop.tile_scores import make_score_args, make_score_fn
from ..mainloop.visibility import (
    is_visible, key_bounds, make_pair_mask, tile_key_range, tile_query_range,
)
from .config import (
    GPU_ELEM_THREADS, GPU_ROW_LANES, SIM_ROW_LANES, SIM_THREADS, _word, default_tiles, min_blocks,
)


#: bytes of one vector shared-memory load (``ld.shared.v4``): 4 float32 or 2 float64
VEC_BYTES = 16


class TileFunctions(NamedTuple):
    """The stages the SIMT backward's kernels share (:func:`tile_functions`)."""

    load_tile: object
    load_tile_finite: object
    load_row_stats: object
    draw_keep: object
    p_and_ds: object
    ds_k: object
    block_setup: object
    shared_tiles: object
    make_load_run: object
    p_row_sums: object


class SharedTiles(NamedTuple):
    """A block's shared tiles (``shared_tiles()``): K_j, V_j (``BLOCK_N`` rows), Q_i, dO_i
    (``BLOCK_M``), P and dS (``BLOCK_M x BLOCK_N``), the rows' lse and D, the keep bits."""

    k_tile: object
    v_tile: object
    q_tile: object
    do_tile: object
    p_tile: object
    ds_tile: object
    lse_sh: object
    delta_sh: object
    keep_tile: object


class Sequence(NamedTuple):
    """Sequence ``b``'s place in the arrays (:func:`tile_functions`'s ``sequence``): the batch
    index ``bb``, its first query row ``q0`` and ``nq`` queries, first key ``k0`` and ``nk``
    keys."""

    bb: int
    q0: int
    nq: int
    k0: int
    nk: int


class BackwardBlock(NamedTuple):
    """A block of the folded grid (``block_setup``): its ``tile``, batch ``b``, query head
    ``h`` and kv head ``hk``, its sequence's place in the arrays (as :class:`Sequence`) and its
    score arguments ``sa``."""

    tile: int
    b: int
    h: int
    hk: int
    bb: int
    q0: int
    nq: int
    k0: int
    nk: int
    sa: object


class RowPds(NamedTuple):
    """What ``p_and_ds``'s row stage reads: the thread's ``S`` and ``dP`` micro-tile, its first
    row ``ar`` and key ``ac``, the tiles' origins, the shared row stats and output tiles, the
    score arguments and the mask's inputs."""

    s: object
    dp: object
    ar: int
    ac: int
    q_start: int
    k_start: int
    lse_sh: object
    delta_sh: object
    p_tile: object
    ds_tile: object
    sa: object
    nk: int
    left: int
    right: int
    dropout: object
    keep_tile: object
    umask: bool


def row_pad(dtype):
    """Padding of a Q/dO/K/V shared row, in elements: one 16-byte chunk (4 float32, 2 float64),
    so every row starts 16-byte aligned (the S / dP step reads 16 bytes of a row at a time) and
    8 consecutive rows start in 8 distinct groups of 4 banks (no conflict when 8 threads read
    one chunk of 8 rows)."""
    return VEC_BYTES // _word(dtype)


#: the smallest ``A_TR x A_TC`` micro-tile of S and dP whose row loop :func:`tile_functions`
#: unrolls with :func:`~numba_flash.kernels.core.jit.static_for`; smaller ones take a ``range`` loop
#: the compiler unrolls by itself.  Measured with ptxas 13 for sm_90: with the range
#: loop the 4 x 4 tiles (d = 16, 32 at BLOCK_N = 64) put s and dp on the stack (128 B) and the
#: 4 x 2 tiles (float32 d = 64) spill 16 B in dQ; unrolled both fit.  The 2 x 1 tile of float64
#: d = 64 takes 242 registers with the range loop, 255 and a 40 B spill unrolled.
STATIC_TILE = 8


def shared_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, dropout=False):
    """Static shared memory of one dK/dV or dQ block (the budget in the module docstring)."""
    row = HEAD_DIM + row_pad(dtype)
    words = 2 * (BLOCK_M + BLOCK_N) * row + 2 * BLOCK_M * BLOCK_N + 2 * BLOCK_M
    keep_bytes = 4 * BLOCK_M * (BLOCK_N // 4) if dropout else 0  # int32 keep_tile
    return _word(dtype) * words + keep_bytes + 4  # + the dK/dV kernel's int32 do_bad flag


# [docs:bwd-grid]
def fold_grid(tiles, batch, heads):
    """The 1-D grid ``(tiles * batch * heads,)`` of a backward kernel; block ``x`` is tile
    ``x % tiles`` of ``(b, h) = divmod(x // tiles, heads)`` (:func:`unfold_block`).

    Everything goes into ``gridDim.x`` (limit 2**31 - 1) because ``gridDim.y`` and ``.z`` stop
    at 65535, which ``B * H`` passes easily (70000 heads of a batch, say).
    """
    n = int(tiles) * int(batch) * int(heads)
    if n > GRID_X_MAX:
        raise ValueError(f"backward: {tiles} tiles x {batch} batch x {heads} heads = {n} blocks "
                         f"exceed CUDA's grid limit {GRID_X_MAX}")
    return (n,)


def unfold_block_py(bx, tiles, heads):
    """``(tile, b, h)`` of block ``bx`` of :func:`fold_grid`."""
    tile = bx % tiles
    bh = bx // tiles
    return tile, bh // heads, bh % heads
# [/docs:bwd-grid]


unfold_block = device_jit(inline=True)(unfold_block_py)


def backward_grids(b, h, hkv, nq, nk, d, dtype, simulator=None):
    """Every grid the backward op launches for these sizes, by kernel name: a CPU test checks
    that each stays inside CUDA's limits (``x`` < 2**31, ``y``, ``z`` <= 65535)."""
    block_m, block_n, _, _ = default_tiles(d, dtype, simulator)
    sim = on_simulator() if simulator is None else simulator
    t = SIM_THREADS if sim else GPU_ELEM_THREADS
    rows = t // (SIM_ROW_LANES if sim else GPU_ROW_LANES)
    return {
        "preprocess": fold_grid(-(-nq // rows), b, h),
        "dkdv": fold_grid(-(-nk // block_n), b, h),
        "dq": fold_grid(-(-nq // block_m), b, h),
        "reduce dq": fold_grid(-(-(nq * d) // t), b, h),
        "reduce dkdv": fold_grid(-(-(nk * d) // t), b, hkv),
    }


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
def make_key_tiles(BLOCK_M, BLOCK_N):
    """``key_tiles(q_start, nq, nk, left, right) -> (q_end, first, last)``: the end of the Q
    tile from ``q_start`` and the K/V tiles ``[first, last)`` holding a key some of its rows
    see (:func:`~numba_flash.kernels.mainloop.visibility.tile_key_range`; none if no row sees a
    key)."""

    @device_jit(own_module=True, inline="always")
    def key_tiles(q_start, nq, nk, left, right):
        q_end = min(q_start + BLOCK_M, nq)
        kv_lo, kv_hi = tile_key_range(q_start, q_end, nk - nq, nk, left, right)
        first_tile = kv_lo // BLOCK_N
        last_tile = (kv_hi + BLOCK_N - 1) // BLOCK_N if kv_hi > kv_lo else first_tile
        return q_end, first_tile, last_tile

    return key_tiles


@functools.lru_cache(maxsize=None)
def make_dq_write(BLOCK_M, HEAD_DIM, THREADS, ATOMIC):
    """``dq_write(out, dq_acc, bb, h, q0, q_start, nq, d, scale, tid)``: this thread's micro-tile
    of dQ_i (:func:`layout` of ``BLOCK_M x HEAD_DIM``), times ``scale``, into ``out[bb, h, q0 +
    q_start + row, c]`` for its rows ``< nq`` and columns ``< d``: added atomically
    (``ATOMIC``: the dK/dV kernel, whose other K/V blocks add to it too) or stored (the
    deterministic dQ kernel, which writes each element once)."""
    C_COL_T, C_ROW_T, C_TR, C_TC = layout(BLOCK_M, HEAD_DIM, THREADS)

    @device_jit(own_module=True, inline="always")
    def dq_write(out, dq_acc, bb, h, q0, q_start, nq, d, scale, tid):
        cr = tid // C_COL_T
        cc = tid % C_COL_T
        if cr < BLOCK_M:
            for i in range(C_TR):
                row = q_start + cr + i * C_ROW_T
                for j in range(C_TC):
                    c = cc * C_TC + j
                    if row < nq and c < d:
                        if ATOMIC:
                            cuda.atomic.add(out, (bb, h, q0 + row, c),
                                            dq_acc[i * C_TC + j] * scale)
                        else:
                            out[bb, h, q0 + row, c] = dq_acc[i * C_TC + j] * scale

    return dq_write


#: the SIMT backward's loads (:func:`make_tile_loads`)
TileLoads = namedtuple("TileLoads", "make_load_run load_tile load_tile_finite load_row_stats "
                       "draw_keep")


@functools.lru_cache(maxsize=None)
def make_tile_loads(cfg):
    """The SIMT backward's loads into shared memory and registers (:data:`TileLoads`):
    ``make_load_run`` (a thread's run of a shared row, 16 bytes at a time where it can),
    ``load_tile`` / ``load_tile_finite`` (a Q, dO, K or V tile), ``load_row_stats`` (lse and
    D of the Q tile's rows) and ``draw_keep`` (dropout's keep bits of a tile pair)."""
    BLOCK_M, BLOCK_N, HEAD_DIM, THREADS = cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS
    dtype = cfg.DTYPE
    acc_t = compute_type(dtype)
    load = element_ops(dtype)[0]  # the element-type stage: q, k, v, dO elements in
    NEG_INF = -math.inf
    INF = acc_t(math.inf)
    GROUPS = BLOCK_N // 4  # dropout: groups of 4 keys (one Philox call each) per tile row
    W = _word(dtype)                        # bytes of one compute element in the tiles
    VW = VEC_BYTES // W                     # elements of one 16-byte chunk

    def make_load_run(COUNT, TILE_ROW_BYTES):
        """``load_run(dst, at, tile, row, col0)``: ``dst[at:at + COUNT] = tile[row, col0:col0 +
        COUNT]`` (a thread's contiguous run of a shared row): ``COUNT / VW`` 16-byte loads where
        the run is whole chunks of a 16-byte aligned row, else element by element."""
        VEC = COUNT % VW == 0 and TILE_ROW_BYTES % VEC_BYTES == 0

        def load_run(dst, at, tile, row, col0):
            if VEC:
                byte0 = int32(row * TILE_ROW_BYTES + col0 * W)
                for g in range(COUNT // VW):
                    t = lds16(tile, byte0 + g * VEC_BYTES)
                    for e in range(VW):
                        dst[at + g * VW + e] = t[e]
            else:
                for e in range(COUNT):
                    dst[at + e] = tile[row, col0 + e]

        return device_jit(own_module=True, inline="always")(load_run)

    def make_load_tile(FINITE):
        def load_tile(x, bb, h, start, end, ROWS, tile, tid):
            """``tile[:ROWS, :HEAD_DIM] <- x[bb, h, start:start + ROWS, :]``, zero at rows >= end
            and columns >= d; with ``FINITE`` (dO in the dK/dV kernel) every inf / NaN stored
            as 0."""
            d = x.shape[3]
            for idx in range(tid, ROWS * HEAD_DIM, THREADS):
                r = idx // HEAD_DIM
                c = idx % HEAD_DIM  # consecutive threads read consecutive columns: coalesced
                if start + r < end and c < d:
                    v = load(x[bb, h, start + r, c])
                    if FINITE and not abs(v) < INF:
                        v = acc_t(0.0)
                    tile[r, c] = v
                else:
                    tile[r, c] = acc_t(0.0)

        return device_jit(own_module=True, inline="always")(load_tile)

    load_tile = make_load_tile(False)
    load_tile_finite = make_load_tile(True)

    @device_jit(own_module=True, inline="always")
    def load_row_stats(lse, delta, bb, h, start, end, lse_sh, delta_sh, tid):
        """``lse`` and ``D`` of the Q tile's rows; rows past the end get ``lse = -inf`` (P = 0).
        Returns 1 if a row this thread loaded has a non-finite ``D = rowsum(dO * O)``, which is
        the case whenever that row's ``dO`` holds an inf or NaN (``inf * x`` and ``NaN * x`` are
        never finite, nor is any sum with them), else 0."""
        bad = int32(0)
        for m in range(tid, BLOCK_M, THREADS):
            if start + m < end:
                lse_sh[m] = acc_t(lse[bb, h, start + m])
                dm = delta[bb, h, start + m]
                delta_sh[m] = dm
                if not abs(dm) < INF:
                    bad = int32(1)
            else:
                lse_sh[m] = acc_t(NEG_INF)
                delta_sh[m] = acc_t(0.0)
        return bad

    @device_jit(own_module=True, inline="always")
    def draw_keep(dropout, b, h, q_start, k_start, nq, nk, left, right, keep_tile, tid):
        """DROPOUT: ``keep_tile[m, g]`` <- keep bits of keys ``k_start + 4g .. + 3`` of row
        ``q_start + m`` (indices within the sequence: the mask of
        :func:`numba_flash.dropout_mask`, batch index ``b``)."""
        seed_lo, seed_hi, threshold, _keep_scale = dropout
        offset = nk - nq  # bottom-right alignment
        for idx in range(tid, BLOCK_M * GROUPS, THREADS):
            m = idx // GROUPS
            g = idx % GROUPS
            row = q_start + m
            key = k_start + 4 * g
            bits = int32(0)  # a group no row sees is not drawn: its P is 0 anyway
            lo, hi = key_bounds(row, offset, nk, left, right)
            if row < nq and key < hi and key + 4 > lo:
                bits = philox_keep_bits4(seed_lo, seed_hi, b, h, row, key >> 2, threshold)
            keep_tile[m, g] = bits

    return TileLoads(make_load_run, load_tile, load_tile_finite, load_row_stats, draw_keep)


#: the SIMT backward's block stages (:func:`make_block_stages`)
BlockStages = namedtuple("BlockStages", "shared_tiles block_setup")


@functools.lru_cache(maxsize=None)
def make_block_stages(cfg):
    """A block's shared tiles and coordinates (:data:`BlockStages`): ``shared_tiles()`` (a
    :class:`SharedTiles`) and ``block_setup(...)`` (a :class:`BackwardBlock`)."""
    BLOCK_M, BLOCK_N, HEAD_DIM = cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM
    dtype, DROPOUT = cfg.DTYPE, cfg.DROPOUT
    acc_t = compute_type(dtype)
    GROUPS = BLOCK_N // 4  # dropout: groups of 4 keys (one Philox call each) per tile row

    ROW = HEAD_DIM + row_pad(dtype)
    ALIGN = None if on_simulator() else VEC_BYTES  # 16-byte aligned rows (no kwarg in cudasim)

    @device_jit(own_module=True, inline="always")
    def shared_tiles():
        """The shared tiles both kernels use: ``k_tile``, ``v_tile`` (``BLOCK_N`` rows),
        ``q_tile``, ``do_tile`` (``BLOCK_M``), ``p_tile``, ``ds_tile`` (``BLOCK_M x BLOCK_N``),
        ``lse_sh``, ``delta_sh`` and, with ``DROPOUT``, ``keep_tile`` (else ``lse_sh`` stands
        in, never read)."""
        k_tile = cuda.shared.array((BLOCK_N, ROW), acc_t, alignment=ALIGN)
        v_tile = cuda.shared.array((BLOCK_N, ROW), acc_t, alignment=ALIGN)
        q_tile = cuda.shared.array((BLOCK_M, ROW), acc_t, alignment=ALIGN)
        do_tile = cuda.shared.array((BLOCK_M, ROW), acc_t, alignment=ALIGN)
        p_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t, alignment=ALIGN)
        ds_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t, alignment=ALIGN)
        lse_sh = cuda.shared.array(BLOCK_M, acc_t)
        delta_sh = cuda.shared.array(BLOCK_M, acc_t)
        if DROPOUT:  # compile-time: the plain kernel has no keep_tile and draws nothing
            keep_tile = cuda.shared.array((BLOCK_M, GROUPS), int32)
        else:
            keep_tile = lse_sh
        return SharedTiles(k_tile, v_tile, q_tile, do_tile, p_tile, ds_tile, lse_sh, delta_sh,
                           keep_tile)

    score_args = make_score_args(True, acc_t)   # the slope read: ALiBi is a run-time switch

    @device_jit(own_module=True, inline="always")
    def block_setup(q, k, cu_q, cu_k, va, varlen, tiles):
        """This block's :class:`BackwardBlock`: its tile of the folded grid, sequence and query
        head (``hk`` its kv head, GQA), the sequence's place in the arrays (``sequence``) and
        its scores' :class:`~numba_flash.kernels.mainloop.tile_scores.ScoreArgs`."""
        tile, b, h = unfold_block(int64(cuda.blockIdx.x), tiles, q.shape[1])
        hk = h // (q.shape[1] // k.shape[1])  # the kv head this query head reads (GQA)
        seq = sequence(q, k, cu_q, cu_k, varlen, b)
        sa = score_args(va, b, h, seq.nk - seq.nq, seq.nq)
        return BackwardBlock(tile, b, h, hk, seq.bb, seq.q0, seq.nq, seq.k0, seq.nk, sa)

    @device_jit(own_module=True, inline="always")
    def sequence(q, k, cu_q, cu_k, varlen, b):
        """Sequence ``b``'s :class:`Sequence`: the array batch index, first row and length of its
        queries and keys (dense: ``b``, 0, Nq, 0, Nk; varlen: the packed arrays are one batch
        ``[1, H, total, d]`` and sequence ``b`` is rows ``cu[b]:cu[b + 1]``)."""
        if varlen:   # clamped into the packed arrays (an unvalidated cu_seqlens stays inside)
            q0, nq = clamp_rows(cu_q[b], cu_q[b + 1], q.shape[2])
            k0, nk = clamp_rows(cu_k[b], cu_k[b + 1], k.shape[2])
            return Sequence(int64(0), int64(q0), int64(nq), int64(k0), int64(nk))
        return Sequence(int64(b), int64(0), int64(q.shape[2]), int64(0), int64(k.shape[2]))

    return BlockStages(shared_tiles, block_setup)


@functools.lru_cache(maxsize=None)
def tile_functions(cfg):
    """Device functions shared by :func:`dkdv_kernel` and :func:`dq_kernel` (inlined).

    ``USER``: ``None`` or a user's variant ``(score_mod, mask_mod, score_mod_grad, BLOCKS)``
    (CUDA device functions or None, :mod:`numba_flash.flex`; ``BLOCKS``: ``(Q_BLOCK,
    KV_BLOCK)`` of a block mask or None); its arrays arrive as the kernels' last argument
    ``user = (kinds,) + aux`` (``kinds``, the block mask's classification, read by the kernels'
    tile loops with ``BLOCKS``: EMPTY tiles are skipped, and ``p_and_ds`` applies ``mask_mod``
    only with ``umask``, i.e. off on a FULL tile)."""
    BLOCK_M, BLOCK_N, HEAD_DIM, THREADS = cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS
    dtype, DROPOUT, USER = cfg.DTYPE, cfg.DROPOUT, cfg.USER
    assert not DROPOUT or BLOCK_N % 4 == 0  # whole groups of 4 keys per Philox call
    acc_t = compute_type(dtype)
    NEG_INF = -math.inf
    INF = acc_t(math.inf)
    A_COL_T, A_ROW_T, A_TR, A_TC = layout(BLOCK_M, BLOCK_N, THREADS)     # S, dP, P, dS
    C_COL_T, C_ROW_T, C_TR, C_TC = layout(BLOCK_M, HEAD_DIM, THREADS)    # dQ
    W = _word(dtype)                        # bytes of one compute element in the tiles
    VW = VEC_BYTES // W                     # elements of one 16-byte chunk
    ROW_BYTES = (HEAD_DIM + VW) * W         # one padded Q/dO/K/V row (row_pad)
    A_ROW_STEP = A_ROW_T * ROW_BYTES        # a thread's rows ar, ar + A_ROW_T, ... of Q, dO
    A_KEY_STEP = A_COL_T * ROW_BYTES        # its keys ac, ac + A_COL_T, ... of K, V

    exp_e = make_exp_e(W)  # float32: ex2.approx(x log2 e), as the forward's; float64: exp

    tl = make_tile_loads(cfg)
    make_load_run = tl.make_load_run
    load_tile, load_tile_finite, load_row_stats, draw_keep = (tl.load_tile, tl.load_tile_finite,
                                                              tl.load_row_stats, tl.draw_keep)
    shared_tiles, block_setup = make_block_stages(cfg)

    # S and dP: a thread's A_TR rows (of Q, dO) and A_TC keys (of K, V), 16 bytes at a time
    row_dot = make_row_dot(A_TR, A_TC, A_ROW_STEP, A_KEY_STEP, HEAD_DIM * W, acc_t)
    # the forward's own score (tile_scores.py), so that P = exp(s - lse) is the forward's P:
    # times scale, NaN check, softcap, ALiBi (a slope of 0 is exact: s - 0 * distance = s, so
    # ALiBi runs always and softcap is a runtime branch, as in the forward), then the user's
    # score_mod, mask_mod and score_mod_grad
    FNS = tuple(USER[:3]) if USER is not None else None
    score_fn = make_score_fn(False, None, True, FNS, acc_t)

    # [docs:bwd-p-ds]
    @device_jit(own_module=True, inline="always")
    def p_ds(s, dp, lse_i, delta_i, row, col, m, n, sa, nk, left, right, dropout, keep_tile,
             umask):
        """One element's ``(P, dS)`` (with DROPOUT ``(P Z, dS)``) from its ``S`` and ``dP``."""
        if not (row < sa.nq and lse_i != acc_t(NEG_INF)
                and is_visible(row, col, sa.offset, nk, left, right)):
            return acc_t(0.0), acc_t(0.0)
        ok, x, grad = score_fn(s, row, col, sa, umask)  # the forward's score; grad: d s / d (qk)
        if not ok:
            return acc_t(0.0), acc_t(0.0)   # the user's mask_mod
        p = exp_e(x - lse_i)
        if DROPOUT:  # compile-time; Z = keep / (1 - p_drop)
            z = acc_t(0.0)
            if (keep_tile[m, n >> 2] >> (n & 3)) & 1:  # k_start % 4 == 0
                z = dropout[3]
            return p * z, p * (dp * z - delta_i) * grad  # dV takes the dropped P * Z
        return p, p * (dp - delta_i) * grad
    # [/docs:bwd-p-ds]

    def row_p_ds(i, r):
        """Row ``i`` of the thread's micro-tile into ``p_tile`` and ``ds_tile`` (``r``:
        :class:`RowPds`)."""
        m = r.ar + i * A_ROW_T
        for j in range(A_TC):
            n = r.ac + j * A_COL_T
            r.p_tile[m, n], r.ds_tile[m, n] = p_ds(
                r.s[i, j], r.dp[i, j], r.lse_sh[m], r.delta_sh[m], r.q_start + m,
                r.k_start + n, m, n, r.sa, r.nk, r.left, r.right, r.dropout, r.keep_tile,
                r.umask)

    # the rows' loop: static (unrolled by us) for micro-tiles of STATIC_TILE elements or more,
    # where the compiler keeps a range loop and puts s and dp on the stack; smaller ones it
    # unrolls itself and schedules better than the static calls (see STATIC_TILE)
    p_ds_rows = (static_for if A_TR * A_TC >= STATIC_TILE else range_for)(A_TR, row_p_ds)

    @device_jit(own_module=True, inline="always")
    def p_and_ds(q_tile, k_tile, v_tile, do_tile, lse_sh, delta_sh, p_tile, ds_tile,
                 q_start, k_start, nk, left, right, sa, dropout, keep_tile, tid, umask):
        """THE place P and dS are made: ``p_tile <- P``, ``ds_tile <- dS``.

        ``S = Q_i K_j^T`` and ``dP = dO_i V_j^T`` as one ``A_TR x A_TC`` micro-tile per thread,
        then per element the visibility rule
        (:func:`~numba_flash.kernels.mainloop.visibility.is_visible`) and the score modifiers (NaN
        check, softcap, ALiBi), ``P = exp(s - lse)`` (0 where not visible, past the arrays, or in a
        row with ``lse = -inf``) and ``dS = P * (dP - D) * (1 - tanh^2)`` (the factor only with
        softcap).  DROPOUT: with ``Z = keep / (1 - p)`` from ``keep_tile``, ``p_tile <- P * Z`` and
        ``ds_tile <- P * (dP * Z - D) * (1 - tanh^2)``.  A user's variant: ``mask_mod`` and-ed
        into the visibility (with ``umask``: the tile is not FULL in a block mask), ``score_mod``
        on the modified score and its ``score_mod_grad`` (at the score it received) multiplied
        into the factor.
        """
        ar = tid // A_COL_T
        ac = tid % A_COL_T
        if ar < BLOCK_M:
            s = cuda.local.array((A_TR, A_TC), acc_t)
            dp = cuda.local.array((A_TR, A_TC), acc_t)
            for i in range(A_TR):
                for j in range(A_TC):
                    s[i, j] = acc_t(0.0)
                    dp[i, j] = acc_t(0.0)
            # [docs:bwd-s-dp]
            # -- S = Q_i K_j^T and dP = dO_i V_j^T over the (zero-padded) head dim, one
            #    product after the other (half the chunk registers of both at once)
            row_dot(s, q_tile, k_tile, int32(ar * ROW_BYTES), int32(ac * ROW_BYTES))
            row_dot(dp, do_tile, v_tile, int32(ar * ROW_BYTES), int32(ac * ROW_BYTES))
            # [/docs:bwd-s-dp]
            # -- P = exp(score(S) - lse), dS = P (dP - D) (1 - tanh^2); invisible keys and
            #    empty rows give exactly 0
            p_ds_rows(RowPds(s, dp, ar, ac, q_start, k_start, lse_sh, delta_sh, p_tile, ds_tile,
                             sa, nk, left, right, dropout, keep_tile, umask))

    # [docs:bwd-row-mass]
    @device_jit(own_module=True, inline="always")
    def p_row_sums(q_tile, k_tile, lse_sh, sums, q_start, k_start, nk, left, right, sa, tid,
                   umask):
        """``sums[i] += P`` over this thread's keys of the K/V tile, for its ``A_TR`` rows
        (:func:`row_mass_kernel`): ``S`` by the same ``row_dot`` and score as ``p_and_ds``,
        ``P = exp(s - lse)`` the same bits as there."""
        ar = tid // A_COL_T
        ac = tid % A_COL_T
        if ar < BLOCK_M:
            s = cuda.local.array((A_TR, A_TC), acc_t)
            for i in range(A_TR):
                for j in range(A_TC):
                    s[i, j] = acc_t(0.0)
            row_dot(s, q_tile, k_tile, int32(ar * ROW_BYTES), int32(ac * ROW_BYTES))
            for i in range(A_TR):
                m = ar + i * A_ROW_T
                row = q_start + m
                lse_i = lse_sh[m]
                for j in range(A_TC):
                    col = k_start + ac + j * A_COL_T
                    if (row < sa.nq and lse_i != acc_t(NEG_INF)
                            and is_visible(row, col, sa.offset, nk, left, right)):
                        ok, x, _grad = score_fn(s[i, j], row, col, sa, umask)
                        if ok:
                            sums[i] += exp_e(x - lse_i)
    # [/docs:bwd-row-mass]

    load_k_cols = make_load_run(C_TC, ROW_BYTES)       # a dQ thread's columns of a K row
    load_ds_keys = make_load_run(VW, BLOCK_N * W)      # one chunk of keys of a dS row
    assert BLOCK_N % VW == 0, (BLOCK_N, VW)
    DS_RUN = C_TR * VW                                 # a dQ thread's dS values of one chunk

    @device_jit(own_module=True, inline="always")
    def ds_k(ds_tile, k_tile, dq_acc, tid):
        """``dq_acc += dS K_j`` on this thread's ``C_TR x C_TC`` micro-tile of dQ_i: rows
        ``cr + i C_ROW_T``, the contiguous columns ``cc C_TC ...``.  Per chunk of ``VW`` keys
        (in key order) one 16-byte load of dS per row and ``C_TC / VW`` of each K row."""
        cr = tid // C_COL_T
        cc = tid % C_COL_T
        if cr < BLOCK_M:
            kc = cuda.local.array(C_TC, acc_t)
            dsr = cuda.local.array(DS_RUN, acc_t)
            n0 = int32(0)
            while n0 < BLOCK_N:
                for i in range(C_TR):
                    load_ds_keys(dsr, i * VW, ds_tile, cr + i * C_ROW_T, n0)
                for e in range(VW):
                    load_k_cols(kc, 0, k_tile, n0 + e, cc * C_TC)
                    for j in range(C_TC):
                        # a non-finite K reaches dQ only through the NaN dS of the rows that
                        # see it; a row that does not see it gets 0, not 0 * inf
                        if not abs(kc[j]) < INF:
                            kc[j] = acc_t(0.0)
                    for i in range(C_TR):
                        for j in range(C_TC):
                            dq_acc[i * C_TC + j] += dsr[i * VW + e] * kc[j]
                n0 = int32(n0 + VW)

    return TileFunctions(load_tile, load_tile_finite, load_row_stats, draw_keep, p_and_ds, ds_k,
                         block_setup, shared_tiles, make_load_run, p_row_sums)


@functools.lru_cache(maxsize=None)
def dkdv_kernel(cfg):
    """Build ``kernel(q, k, v, do, lse, delta, dq_accum, dk_out, dv_out, cu_q, cu_k, va, varlen,
    tiles, dq_atomic)``.

    K/V tiles outer, one block per ``(K/V tile, b, query head h)`` on the folded grid
    (:func:`fold_grid`, ``tiles`` K/V tiles per sequence).  ``dk_out``/``dv_out`` are
    compute-type arrays with ``H`` heads: this query head's share of dK, dV (the op sums a GQA
    group afterwards).  ``va``: the :class:`~numba_flash.kernels.core.variant.Variant` (``scale``,
    ``softcap`` (0 = off) and ``inv_softcap`` in the compute type; the window, causal folded in;
    ``alibi`` float32 ``[B, H]``, zeros without ALiBi; ``dropout`` filled with ``DROPOUT``;
    ``user = (kinds,) + aux`` with ``USER``, :func:`tile_functions`); ``varlen`` (0/1) reads
    sequence ``b`` from ``cu_q``/``cu_k``; ``dq_atomic`` (0/1) adds ``scale * dS K_j`` into the
    zeroed ``dq_accum``.
    """
    BLOCK_M, BLOCK_N, HEAD_DIM, THREADS = cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS
    dtype, DROPOUT, USER = cfg.DTYPE, cfg.DROPOUT, cfg.USER
    dtype = np.dtype(dtype)
    assert shared_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, DROPOUT) <= SMEM_LIMIT or on_simulator()
    acc_t = compute_type(dtype)
    INF = acc_t(math.inf)
    NAN = acc_t(math.nan)
    ROW = HEAD_DIM + row_pad(dtype)
    B_COL_T, B_ROW_T, B_TR, B_TC = layout(BLOCK_N, HEAD_DIM, THREADS)    # dK, dV
    C_COL_T, C_ROW_T, C_TR, C_TC = layout(BLOCK_M, HEAD_DIM, THREADS)    # dQ
    B_TILE = B_TR * B_TC
    C_TILE = C_TR * C_TC
    fns = tile_functions(cfg)
    load_tile, load_tile_finite, load_row_stats = fns.load_tile, fns.load_tile_finite, \
        fns.load_row_stats
    draw_keep, p_and_ds, ds_k = fns.draw_keep, fns.p_and_ds, fns.ds_k
    block_setup, shared_tiles, make_load_run = fns.block_setup, fns.shared_tiles, fns.make_load_run
    dq_add = make_dq_write(BLOCK_M, HEAD_DIM, THREADS, True)   # dQ_i += scale dS K_j
    W = _word(dtype)
    load_do_cols = make_load_run(B_TC, ROW * W)      # a dK/dV thread's columns of a dO row
    load_q_cols = load_do_cols                        # ... and of a Q row
    load_p_keys = make_load_run(B_TR, BLOCK_N * W)   # its keys of a P (dS) row
    load = element_ops(dtype)[0]  # the element-type stage: a dO element in
    user_mask = USER[1] if USER is not None else None
    U_MASK = user_mask is not None
    BLOCKS = USER[3] if USER is not None else None
    # a block mask's verdict on (Q tile, this K/V tile) (visibility.py); built only with one
    pair_mask = make_pair_mask(BLOCKS, U_MASK, BLOCK_N)
    LOG = on_simulator() and USER is not None  # the simulator's tile log (common.TILE_LOG)

    @device_jit(own_module=True, inline="always")
    def mark_non_finite_do(do, delta, dv_out, bb, h, q0, k0, k_start, nq, nk, left, right, br,
                           bc, b, user):
        """Rare, once this thread's ``dV`` is written: some query row has a non-finite dO,
        which ``do_tile`` stored as 0.  ``dV[key, c]`` (this thread's elements of
        ``dv_out``) becomes NaN where a row that sees the key has an inf or NaN ``dO[row, c]``
        (the reference's ``P * inf`` or ``P * NaN``: not finite either way); a key the row does
        not see keeps its finite ``dV``.  From global memory and over all rows (a row that
        does not see the keys is skipped by the rule), so that no register of the loop stays
        live for it."""
        d = do.shape[3]
        offset = nk - nq
        for row in range(nq):
            if not abs(delta[bb, h, q0 + row]) < INF:  # this row's dO holds an inf or NaN
                for i in range(B_TR):
                    key = k_start + br * B_TR + i
                    if key < nk and is_visible(row, key, offset, nk, left, right) and (
                            not U_MASK or user_mask(b, h, row, key, *user[1:])):
                        for j in range(B_TC):
                            c = bc * B_TC + j
                            if c < d:
                                if not abs(load(do[bb, h, q0 + row, c])) < INF:
                                    dv_out[bb, h, k0 + key, c] = NAN

    @kernel_jit(launch_bounds=(THREADS, min_blocks("dkdv", HEAD_DIM, dtype, DROPOUT)),
                cache=USER is None)  # a user's functions stay off the disk cache
    def backward_dkdv(q, k, v, do, lse, delta, dq_accum, dk_out, dv_out, cu_q, cu_k, va,
                      varlen, tiles, dq_atomic):
        sh = shared_tiles()
        k_tile, v_tile, q_tile, do_tile = sh.k_tile, sh.v_tile, sh.q_tile, sh.do_tile
        p_tile, ds_tile, lse_sh, delta_sh = sh.p_tile, sh.ds_tile, sh.lse_sh, sh.delta_sh
        keep_tile = sh.keep_tile
        tid = cuda.threadIdx.x
        blk = block_setup(q, k, cu_q, cu_k, va, varlen, tiles)
        tile, b, h, hk, sa = blk.tile, blk.b, blk.h, blk.hk, blk.sa
        bb, q0, nq, k0, nk = blk.bb, blk.q0, blk.nq, blk.k0, blk.nk
        k_start = tile * BLOCK_N
        if k_start >= nk:
            return  # varlen: past this sequence's keys (the whole block leaves together)
        d = q.shape[3]
        scale, (left, right), dropout, user = va.scale, va.window, va.dropout, va.user

        do_bad = cuda.shared.array(1, int32)  # 1 once a row of a Q tile has a non-finite dO
        if tid == 0:
            do_bad[0] = int32(0)

        # -- this block's K_j, V_j: loaded once, used for every Q tile that sees them
        load_tile(k, bb, hk, k0 + k_start, k0 + nk, BLOCK_N, k_tile, tid)
        load_tile(v, bb, hk, k0 + k_start, k0 + nk, BLOCK_N, v_tile, tid)
        # k_tile and v_tile are complete before any thread reads them (and do_bad = 0 before
        # any thread may raise it)
        cuda.syncthreads()

        br = tid // B_COL_T
        bc = tid % B_COL_T
        dk_acc = cuda.local.array(B_TILE, acc_t)
        dv_acc = cuda.local.array(B_TILE, acc_t)
        doc = cuda.local.array(B_TC, acc_t)
        qc = cuda.local.array(B_TC, acc_t)
        pr = cuda.local.array(B_TR, acc_t)
        dsr = cuda.local.array(B_TR, acc_t)
        dq_acc = cuda.local.array(C_TILE, acc_t)
        for e in range(B_TILE):
            dk_acc[e] = acc_t(0.0)
            dv_acc[e] = acc_t(0.0)

        # [docs:bwd-dkdv-loop]
        # only the Q tiles holding a row that sees a key of this tile (causal, window) are loaded
        k_end = min(k_start + BLOCK_N, nk)
        q_lo, q_hi = tile_query_range(k_start, k_end, nk - nq, nq, left, right)
        first_tile = q_lo // BLOCK_M
        last_tile = (q_hi + BLOCK_M - 1) // BLOCK_M if q_hi > q_lo else first_tile

        for qi in range(first_tile, last_tile):
            q_start = qi * BLOCK_M
            # mask_mod runs on this pair of tiles (a block mask may say no, or EMPTY)
            empty, umask = pair_mask(user, b, h, q_start, min(q_start + BLOCK_M, nq), tile, nk)
            if empty:
                continue  # no row of Q tile qi sees a key of this tile: never loaded
            if LOG and tid == 0:
                log_tile(b, h, q_start, tile)
            load_tile(q, bb, h, q0 + q_start, q0 + nq, BLOCK_M, q_tile, tid)
            # dO with inf / NaN as 0: a non-finite dO still makes dS NaN where its row sees a
            # key (through D), and mark_non_finite_do puts it into dV there alone
            load_tile_finite(do, bb, h, q0 + q_start, q0 + nq, BLOCK_M, do_tile, tid)
            bad = load_row_stats(lse, delta, bb, h, q0 + q_start, q0 + nq, lse_sh, delta_sh,
                                 tid)
            if DROPOUT:  # DROPOUT: this (Q_i, K_j) pair's keep bits, redrawn from the seed
                draw_keep(dropout, b, h, q_start, k_start, nq, nk, left, right, keep_tile, tid)
            if bad:  # a row with a non-finite D: its dO holds an inf or NaN (or its o does)
                do_bad[0] = int32(1)
            cuda.syncthreads()  # Q_i, dO_i, lse, D (keep bits) are in shared memory before P

            p_and_ds(q_tile, k_tile, v_tile, do_tile, lse_sh, delta_sh, p_tile, ds_tile,
                     q_start, k_start, nk, left, right, sa, dropout, keep_tile, tid, umask)
            cuda.syncthreads()  # all of P and dS are written before other threads read them

            # -- dV_j += P^T dO_i (DROPOUT: (P Z)^T dO_i) and dK_j += dS^T Q_i (scale
            #    applied once, at the end)
            #    the thread's keys br B_TR ... and columns bc B_TC ... are contiguous: per
            #    query row one load_run each of dO, Q (16-byte loads where B_TC is whole
            #    chunks) and of P, dS (where B_TR is) feed 2 B_TR B_TC FMAs
            if br < BLOCK_N:
                m = int32(0)  # a while loop, not range(): 32-bit, as in row_dot
                while m < BLOCK_M:
                    load_do_cols(doc, 0, do_tile, m, bc * B_TC)
                    load_q_cols(qc, 0, q_tile, m, bc * B_TC)
                    for j in range(B_TC):
                        if not abs(qc[j]) < INF:  # non-finite Q: as K in ds_k
                            qc[j] = acc_t(0.0)
                    load_p_keys(pr, 0, p_tile, m, br * B_TR)
                    load_p_keys(dsr, 0, ds_tile, m, br * B_TR)
                    for i in range(B_TR):
                        for j in range(B_TC):
                            dv_acc[i * B_TC + j] += pr[i] * doc[j]
                            dk_acc[i * B_TC + j] += dsr[i] * qc[j]
                    m = int32(m + 1)

            # [docs:bwd-dq-atomic]
            # -- dQ_i += scale * dS K_j, added atomically (other K/V blocks add to it too)
            if dq_atomic:
                for e in range(C_TILE):
                    dq_acc[e] = acc_t(0.0)
                ds_k(ds_tile, k_tile, dq_acc, tid)
                dq_add(dq_accum, dq_acc, bb, h, q0, q_start, nq, d, scale, tid)
            # [/docs:bwd-dq-atomic]
            cuda.syncthreads()  # done reading q/do/p/ds tiles before the next Q tile lands

        # -- write this query head's dK_j, dV_j once (zeros if no row sees the tile)
        if br < BLOCK_N:
            for i in range(B_TR):
                key = k_start + br * B_TR + i
                for j in range(B_TC):
                    c = bc * B_TC + j
                    if key < nk and c < d:
                        dk_out[bb, h, k0 + key, c] = dk_acc[i * B_TC + j] * scale
                    if key < nk and c < dv_out.shape[3]:   # d_v: v's own head dim, or d
                        dv_out[bb, h, k0 + key, c] = dv_acc[i * B_TC + j]
            if do_bad[0]:  # rare: a non-finite dO reaches the dV of the keys its row sees alone
                mark_non_finite_do(do, delta, dv_out, bb, h, q0, k0, k_start, nq, nk, left,
                                   right, br, bc, b, user)
        # [/docs:bwd-dkdv-loop]

    return backward_dkdv


@functools.lru_cache(maxsize=None)
def dq_kernel(cfg):
    """Build ``kernel(q, k, v, do, lse, delta, dq_out, cu_q, cu_k, va, varlen, tiles)``:
    deterministic dQ, one block per
    ``(Q tile, b, h)`` on the folded grid; the arguments as in :func:`dkdv_kernel`."""
    BLOCK_M, BLOCK_N, HEAD_DIM, THREADS = cfg.BLOCK_M, cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS
    dtype, DROPOUT, USER = cfg.DTYPE, cfg.DROPOUT, cfg.USER
    dtype = np.dtype(dtype)
    assert shared_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, DROPOUT) <= SMEM_LIMIT or on_simulator()
    acc_t = compute_type(dtype)
    C_COL_T, C_ROW_T, C_TR, C_TC = layout(BLOCK_M, HEAD_DIM, THREADS)    # dQ
    C_TILE = C_TR * C_TC
    fns = tile_functions(cfg)
    load_tile, load_row_stats, draw_keep = fns.load_tile, fns.load_row_stats, fns.draw_keep
    p_and_ds, ds_k, block_setup, shared_tiles = fns.p_and_ds, fns.ds_k, fns.block_setup, \
        fns.shared_tiles
    dq_store = make_dq_write(BLOCK_M, HEAD_DIM, THREADS, False)
    U_MASK = USER is not None and USER[1] is not None
    BLOCKS = USER[3] if USER is not None else None
    key_tiles = make_key_tiles(BLOCK_M, BLOCK_N)
    # a block mask's verdict on (this Q tile, K/V tile) (visibility.py); built only with one
    pair_mask = make_pair_mask(BLOCKS, U_MASK, BLOCK_N)
    LOG = on_simulator() and USER is not None  # the simulator's tile log (common.TILE_LOG)

    @kernel_jit(launch_bounds=(THREADS, min_blocks("dq", HEAD_DIM, dtype, DROPOUT)),
                cache=USER is None)  # a user's functions stay off the disk cache
    def backward_dq(q, k, v, do, lse, delta, dq_out, cu_q, cu_k, va, varlen, tiles):
        tid = cuda.threadIdx.x
        blk = block_setup(q, k, cu_q, cu_k, va, varlen, tiles)
        q_start = blk.tile * BLOCK_M
        if q_start >= blk.nq:
            return  # varlen: past this sequence's queries (the whole block leaves together)
        d = q.shape[3]
        scale, (left, right), dropout, user = va.scale, va.window, va.dropout, va.user
        sh = shared_tiles()
        k_tile, v_tile, q_tile, do_tile = sh.k_tile, sh.v_tile, sh.q_tile, sh.do_tile
        p_tile, ds_tile, lse_sh, delta_sh = sh.p_tile, sh.ds_tile, sh.lse_sh, sh.delta_sh
        keep_tile = sh.keep_tile

        # -- this block's Q_i, dO_i, lse, D: loaded once (the first barrier below covers them)
        load_tile(q, blk.bb, blk.h, blk.q0 + q_start, blk.q0 + blk.nq, BLOCK_M, q_tile, tid)
        load_tile(do, blk.bb, blk.h, blk.q0 + q_start, blk.q0 + blk.nq, BLOCK_M, do_tile, tid)
        load_row_stats(lse, delta, blk.bb, blk.h, blk.q0 + q_start, blk.q0 + blk.nq, lse_sh,
                       delta_sh, tid)

        # only the K/V tiles holding a key some row of this tile sees (causal, window)
        q_end, first_tile, last_tile = key_tiles(q_start, blk.nq, blk.nk, left, right)

        dq_acc = cuda.local.array(C_TILE, acc_t)
        for e in range(C_TILE):
            dq_acc[e] = acc_t(0.0)
        # [docs:bwd-dq-loop]
        for kj in range(first_tile, last_tile):
            k_start = kj * BLOCK_N
            # mask_mod runs on this pair of tiles (a block mask may say no, or EMPTY)
            empty, umask = pair_mask(user, blk.b, blk.h, q_start, q_end, kj, blk.nk)
            if empty:
                continue  # no row of this Q tile sees a key of tile kj: never loaded
            if LOG and tid == 0:
                log_tile(blk.b, blk.h, q_start, kj)
            load_tile(k, blk.bb, blk.hk, blk.k0 + k_start, blk.k0 + blk.nk, BLOCK_N, k_tile, tid)
            load_tile(v, blk.bb, blk.hk, blk.k0 + k_start, blk.k0 + blk.nk, BLOCK_N, v_tile, tid)
            if DROPOUT:  # DROPOUT: this (Q_i, K_j) pair's keep bits, redrawn from the seed
                draw_keep(dropout, blk.b, blk.h, q_start, k_start, blk.nq, blk.nk, left, right,
                          keep_tile, tid)
            cuda.syncthreads()  # K_j, V_j, keep bits (first time: Q_i, dO_i, lse, D) complete

            p_and_ds(q_tile, k_tile, v_tile, do_tile, lse_sh, delta_sh, p_tile, ds_tile,
                     q_start, k_start, blk.nk, left, right, blk.sa, dropout, keep_tile, tid, umask)
            cuda.syncthreads()  # all of dS is written before other threads read it

            ds_k(ds_tile, k_tile, dq_acc, tid)  # dQ_i += dS K_j, same order every run
            cuda.syncthreads()  # done reading k_tile / ds_tile before the next K/V tile lands
        # [/docs:bwd-dq-loop]

        # -- every element of dQ_i written exactly once (0 for rows that see no key)
        dq_store(dq_out, dq_acc, blk.bb, blk.h, blk.q0, q_start, blk.nq, d, scale, tid)

    return backward_dq


#: :func:`row_mass_kernel`'s window: row ``i``'s ``dO`` is divided by ``c_i`` when ``|c_i - 1|
#: <= |lse_i| 2^-23 + 2^-20``, i.e. when ``lse_i`` is within one or two ulps (``|lse_i| 2^-23``
#: is one to two float32 ulps of it) of the log-sum-exp of exactly the keys given, allowing
#: 2^-20 (8 ulps of 1) for the rounding of ``c_i``'s own sum.
MASS_LSE_ULPS = 2.0 ** -23
MASS_SLACK = 2.0 ** -20


@functools.lru_cache(maxsize=None)
def row_mass_kernel(cfg):
    """Build ``kernel(q, k, do, lse, do_out, cu_q, cu_k, va, varlen, tiles)``: the float32
    backward's first kernel (why: docs/backward.md#what-the-forward-keeps-one-number-per-row).  One
    block per ``(Q tile, b, h)`` on the folded grid, the K/V tiles of :func:`dq_kernel`'s loop
    (window, block mask): ``c_i = sum_j P_ij`` (``P = exp(s - lse)`` of ``p_and_ds``, bit for bit)
    plus the sink's ``exp(sink_h - lse_i)``, summed per thread and then per row in a fixed order;
    then ``do_out[i] = dO[i] / c_i`` (times the compute-type ``1 / c_i``) where ``|c_i - 1|`` is
    inside the window (:data:`MASS_LSE_ULPS`, :data:`MASS_SLACK`), else ``dO[i]`` as it is."""
    BLOCK_M, BLOCK_N, THREADS = cfg.BLOCK_M, cfg.BLOCK_N, cfg.THREADS
    dtype, USER = cfg.DTYPE, cfg.USER
    dtype = np.dtype(dtype)
    acc_t = compute_type(dtype)
    A_COL_T, A_ROW_T, A_TR, _A_TC = layout(BLOCK_M, BLOCK_N, THREADS)
    fns = tile_functions(cfg)
    load_tile, block_setup, shared_tiles = fns.load_tile, fns.block_setup, fns.shared_tiles
    p_row_sums = fns.p_row_sums
    key_tiles = make_key_tiles(BLOCK_M, BLOCK_N)
    load = element_ops(dtype)[0]
    exp_e = make_exp_e(_word(dtype))
    NEG_INF = -math.inf
    LSE_ULPS = acc_t(MASS_LSE_ULPS)
    SLACK = acc_t(MASS_SLACK)
    BLOCKS = USER[3] if USER is not None else None
    U_MASK = USER is not None and USER[1] is not None
    pair_mask = make_pair_mask(BLOCKS, U_MASK, BLOCK_N)

    @kernel_jit(cache=USER is None)  # a user's functions stay off the disk cache
    def backward_row_mass(q, k, do, lse, do_out, cu_q, cu_k, va, varlen, tiles):
        tid = cuda.threadIdx.x
        blk = block_setup(q, k, cu_q, cu_k, va, varlen, tiles)
        q_start = blk.tile * BLOCK_M
        if q_start >= blk.nq:
            return  # varlen: past this sequence's queries (the whole block leaves together)
        left, right = va.window
        sums = cuda.local.array(A_TR, acc_t)   # the thread's rows' partial sums of P
        for i in range(A_TR):
            sums[i] = acc_t(0.0)
        sh = shared_tiles()   # delta_sh holds the rows' 1 / c_i
        k_tile, q_tile, p_tile, lse_sh, inv_sh = (sh.k_tile, sh.q_tile, sh.p_tile, sh.lse_sh,
                                                  sh.delta_sh)
        load_tile(q, blk.bb, blk.h, blk.q0 + q_start, blk.q0 + blk.nq, BLOCK_M, q_tile, tid)
        for m in range(tid, BLOCK_M, THREADS):
            lse_sh[m] = acc_t(NEG_INF)
            if q_start + m < blk.nq:
                lse_sh[m] = acc_t(lse[blk.bb, blk.h, blk.q0 + q_start + m])

        q_end, first_tile, last_tile = key_tiles(q_start, blk.nq, blk.nk, left, right)
        for kj in range(first_tile, last_tile):
            k_start = kj * BLOCK_N
            empty, umask = pair_mask(va.user, blk.b, blk.h, q_start, q_end, kj, blk.nk)
            if empty:
                continue
            load_tile(k, blk.bb, blk.hk, blk.k0 + k_start, blk.k0 + blk.nk, BLOCK_N, k_tile, tid)
            cuda.syncthreads()  # K_j (first time: Q_i, lse) complete
            p_row_sums(q_tile, k_tile, lse_sh, sums, q_start, k_start, blk.nk, left, right,
                       blk.sa, tid, umask)
            cuda.syncthreads()  # done reading k_tile before the next K/V tile lands

        # each thread's partial sums into p_tile[row, its column thread], then one thread per
        # row adds them in order (deterministic: no atomics)
        ar = tid // A_COL_T
        ac = tid % A_COL_T
        if ar < BLOCK_M:
            for i in range(A_TR):
                p_tile[ar + i * A_ROW_T, ac] = sums[i]
        cuda.syncthreads()  # every thread's partial sums are in p_tile before a row adds them
        sink = sink_of(va.sink, blk.h)
        for m in range(tid, BLOCK_M, THREADS):
            lse_m = lse_sh[m]
            c = acc_t(0.0)
            for t in range(A_COL_T):
                c += p_tile[m, t]
            if sink != acc_t(NEG_INF) and lse_m != acc_t(NEG_INF):
                c += exp_e(acc_t(sink) - lse_m)
            inv = acc_t(1.0)
            # c = 0 (a row that sees no key, lse = +inf), NaN (a NaN lse or score): as given
            if c > acc_t(0.0) and abs(c - acc_t(1.0)) <= abs(lse_m) * LSE_ULPS + SLACK:
                inv = acc_t(1.0) / c
            inv_sh[m] = inv
        cuda.syncthreads()  # every row's 1 / c_i is in inv_sh before any thread scales dO
        d_v = do.shape[3]
        for idx in range(tid, BLOCK_M * d_v, THREADS):
            r = idx // d_v
            col = idx % d_v  # consecutive threads, consecutive columns: coalesced
            if q_start + r < blk.nq:
                row = blk.q0 + q_start + r
                do_out[blk.bb, blk.h, row, col] = load(do[blk.bb, blk.h, row, col]) * inv_sh[r]

    return backward_row_mass


@functools.lru_cache(maxsize=None)
def preprocess_kernel(THREADS, LANES, dtype):
    """Build ``kernel(o, do, delta, dq_accum, tiles)``: ``delta = rowsum(dO * O)`` and
    ``dq_accum = 0``; ``LANES`` consecutive threads per row, ``THREADS // LANES`` rows per block,
    grid :func:`fold_grid` with ``tiles = ceil(N / (THREADS // LANES))``."""
    assert THREADS % LANES == 0 and 32 % LANES == 0
    acc_t = compute_type(dtype)
    load = element_ops(dtype)[0]
    ROWS = THREADS // LANES
    STEPS = LANES.bit_length() - 1  # log2(LANES) butterfly steps

    @kernel_jit
    def backward_preprocess(o, do, delta, dq_accum, tiles):
        # [docs:bwd-preprocess]
        tile, b, h = unfold_block(int64(cuda.blockIdx.x), tiles, o.shape[1])
        lane = cuda.threadIdx.x % LANES
        i = tile * ROWS + cuda.threadIdx.x // LANES  # this thread's row
        d = o.shape[3]
        acc = acc_t(0.0)
        if i < o.shape[2]:
            # the row's LANES threads read consecutive columns: one coalesced access per step
            for c in range(lane, d, LANES):
                acc += load(do[b, h, i, c]) * load(o[b, h, i, c])
            for c in range(lane, dq_accum.shape[3], LANES):   # q's head dim (d, or not o's)
                dq_accum[b, h, i, c] = acc_t(0.0)
        # butterfly sum over the row's lanes (every lane of the warp takes part, converged)
        for s in range(STEPS):
            acc += cuda.shfl_xor_sync(FULL_MASK, acc, LANES >> (s + 1))
        if i < o.shape[2] and lane == 0:
            delta[b, h, i] = acc
        # [/docs:bwd-preprocess]

    return backward_preprocess


@functools.lru_cache(maxsize=None)
def reduce_kernel(THREADS, src_dtype, dst_dtype):
    """Build ``kernel(src, dst, tiles)``: ``dst[b, g] = sum of src[b, g * G : (g + 1) * G]``
    over the heads (``G = src.shape[1] // dst.shape[1]``: a GQA group's dK or dV, or ``G = 1``,
    a plain cast of the float32 dQ accumulator), converted to ``dst``'s dtype.  One thread per
    element of ``dst [B, Hd, N, d]``; grid :func:`fold_grid` with ``tiles = ceil(N d / THREADS)``.
    """
    acc_t = compute_type(src_dtype)
    store = element_ops(dst_dtype)[1]  # the element-type stage: dQ, dK, dV elements out

    @kernel_jit
    def backward_reduce(src, dst, tiles):
        tile, b, g = unfold_block(int64(cuda.blockIdx.x), tiles, dst.shape[1])
        idx = tile * THREADS + cuda.threadIdx.x
        d = dst.shape[3]
        group = src.shape[1] // dst.shape[1]
        if idx < dst.shape[2] * d:
            n = idx // d
            c = idx % d
            acc = acc_t(0.0)
            for j in range(group):  # fixed order: deterministic
                acc += src[b, g * group + j, n, c]
            dst[b, g, n, c] = store(acc)

    return backward_reduce


#: the dropout specialisations the compile tier builds (padded head dim, dtype): a subset, to keep
#: the family's compile time in check (each dropout build carries Philox; ~1-4 s per arch).
#: Other head dims compile the same device code with other tile constants.
DROPOUT_CONFIGS = ((64, np.float16), (128, np.float16), (64, np.float32), (128, np.float32),
                   (64, np.float64), (64, BFLOAT16))

#: the padded head dims the compile tier builds the bfloat16 dK/dV and dQ kernels for: a
#: representative selection (the bfloat16 kernels are the float16 ones with other loads, same
#: tiles); preprocess and reduce are built for bfloat16 as for every dtype.
BF16_HEAD_DIMS = (64, 128)

#: the padded head dims the compile tier builds :func:`row_mass_kernel` (float32 only) for: the
#: others compile the same device code with other tile constants.
ROW_MASS_HEAD_DIMS = (64, 128)
