"""The warp-GEMM stage: a warp's share of ``C += A B`` on ``mma.sync.m16n8k16``, operands from
shared memory (``ldmatrix``) or registers (the analog of FA2's ``gemm`` / ``gemm_rs``).

Every tensor-core kernel computes its products through the factories here; none writes a
k-loop of ``mma`` calls itself.  ``[docs: tensor-cores.md]`` draws the fragments.

Fragment views (one lane's registers as 2-D local arrays with compile-time indices)
-----------------------------------------------------------------------------------
Lane ``(g, t)`` (``g = lane >> 2``, ``t = lane & 3``) of a warp that owns ``16 M_TILES`` rows:

* the **accumulator** ``acc`` is float32 ``[2 M_TILES, 2 N_FRAGS]``: element ``(r, c)`` is row
  ``16 (r >> 1) + 8 (r & 1) + g`` and column ``8 (c >> 1) + 2 t + (c & 1)`` of the warp's
  ``16 M_TILES x 8 N_FRAGS`` block (:data:`ACC_ROWS`, :data:`ACC_COLS`): the ``C`` fragment of
  the ``mma`` of row tile ``mt`` and column fragment ``n`` is ``acc[2 mt, 2 n]``, ``acc[2 mt, 2 n
  + 1]``, ``acc[2 mt + 1, 2 n]``, ``acc[2 mt + 1, 2 n + 1]``.  A lane's row ``r`` is one row of
  the tile for all its columns, so a row reduction is the lane's own values then its quad
  (:mod:`numba_flash.kernels.mainloop.online_softmax`);
* ``A`` in registers is uint32 ``[M_TILES, K_STEPS, 4]``: the ``ldmatrix.x4`` of each 16 x 16
  block (:func:`make_load_a`);
* ``A`` from an accumulator (``P`` or ``dS`` of the previous product) is that float32 view:
  the ``A`` block ``(mt, kc)`` packs ``acc[2 mt + h, 4 kc + j]`` in pairs, rounded to the
  element type (the ``C`` layout of two 8-column fragments is the ``A`` layout of 16 columns).

Operands in shared memory are row-major tiles of 16-bit elements with rows of ``RB`` bytes
(:func:`~numba_flash.kernels.ptx.stages.row_bytes`: padded so an ``ldmatrix`` has no bank
conflict), addressed in bytes (``*_byte``) from the start of the kernel's ``uint32`` arena and
including this lane's :func:`lane_offset`:

* ``A`` (``M x K``): ``ldmatrix.x4`` of block ``(mt, kc)`` at ``a_byte + 16 RB mt + 32 kc``
  (``KIND_A``); ``"smem_t"``: ``A`` stored transposed (``K x M``, e.g. ``dS`` from ``dS^T``),
  read with ``.trans`` at ``a_byte + 16 RB kc + 32 mt`` (``KIND_B`` offsets);
* ``B`` (``K x N``): stored as ``N`` rows of ``K`` (a K tile for ``Q K^T``): one ``x4`` at
  ``b_byte + 16 RB p + 32 kc`` gives the ``B`` fragments of columns ``16 p .. 16 p + 15``
  (``KIND_B``); or row-major (``V`` for ``P V``, ``B_TRANS``): ``.trans`` at ``b_byte + 16 RB kc
  + 32 p`` (``KIND_A``).

Each ``B`` fragment is read once per k-step and used by all ``M_TILES`` row tiles: a warp that
owns 32 rows reads half the shared bytes per flop of one that owns 16 (the shared-read bound
of docs/resources.md).
"""

from __future__ import annotations

import functools

import math

from numba import cuda, float32, int32, uint32, uint64

from ..core.jit import device_jit, kernel_jit, static_for
from ..ptx.mma import WARP, mma_ops
from ..ptx.mma_fp8 import mma_m16n8k32_e4m3, pack_e4m3x4
from ..ptx.stages import ldmatrix_x4, ldmatrix_x4_trans
from .tile_scores import Layout

_device = functools.partial(device_jit, inline=True)

#: which row of an ``x4``'s four 8 x 8 matrices a lane points at
#: (:func:`numba_flash.kernels.ptx.stages.ldmatrix_rows`): ``KIND_A`` for an ``A`` block (matrices
#: down the rows first) and a ``B`` read by ``.trans`` from a row-major tile; ``KIND_B`` for the
#: ``B`` fragments of two 8-row blocks (``N`` rows of ``K``) and an ``A`` read by ``.trans``
#: from a stored ``A^T``.
KIND_A, KIND_B = 0, 1

#: ``A`` operand sources of :func:`make_gemm`
A_SOURCES = ("regs", "acc", "smem", "smem_t")


# [docs:lane-offset]
@_device
def lane_offset(lane, RB, KIND):
    """Byte offset of the row this lane points at in a 16 x 16 block of a tile with ``RB``-byte
    rows: lane ``8 m + r`` gives row ``r`` of matrix ``m``; ``KIND_A`` matrices are (rows 0-7,
    cols 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15), ``KIND_B`` (0-7, 0-7), (0-7, 8-15), (8-15,
    0-7), (8-15, 8-15).  The one home of the ``ldmatrix`` lane rule."""
    mat = lane >> 3
    r8 = lane & 7
    if KIND == KIND_A:
        return int32((r8 + 8 * (mat & 1)) * RB + 16 * (mat >> 1))
    return int32((r8 + 8 * (mat >> 1)) * RB + 16 * (mat & 1))
# [/docs:lane-offset]


#: the accumulator's layouts (:class:`~numba_flash.kernels.mainloop.tile_scores.Layout`): row ``r``
#: of a lane is row ``16 (r >> 1) + 8 (r & 1)`` of the warp's block (plus ``g``), column ``c`` is
#: column ``8 (c >> 1) + (c & 1)`` (plus ``2 t``)
ACC_ROWS = Layout(2, 16, 8)
ACC_COLS = Layout(2, 8, 1)


@functools.lru_cache(maxsize=None)
def make_load_a(M_TILES, K_STEPS, RB, TRANS=False):
    """``load_a(a, smem, a_byte)``: ``a[mt, kc, :]`` = the ``ldmatrix.x4`` of ``A`` block
    ``(mt, kc)`` of the row-major tile at ``a_byte`` (this lane's ``KIND_A`` offset included);
    ``TRANS``: of ``A`` stored transposed (``ldmatrix.trans`` at ``a_byte + 16 RB kc + 32 mt``,
    ``KIND_B`` offset), as :func:`make_gemm`'s ``"smem_t"``."""

    @_device
    def load_a(a, smem, a_byte):
        for mt in range(M_TILES):
            for kc in range(K_STEPS):
                if TRANS:
                    a[mt, kc, 0], a[mt, kc, 1], a[mt, kc, 2], a[mt, kc, 3] = ldmatrix_x4_trans(
                        smem, a_byte + 16 * RB * kc + 32 * mt)
                else:
                    a[mt, kc, 0], a[mt, kc, 1], a[mt, kc, 2], a[mt, kc, 3] = ldmatrix_x4(
                        smem, a_byte + 16 * RB * mt + 32 * kc)

    return load_a


@functools.lru_cache(maxsize=None)
def make_pack_a(DTYPE, P_SCALE=1.0):
    """``pack_a(af, a, mt, kc)``: ``A`` block ``(mt, kc)`` from the float32 accumulator view
    ``a`` into ``af[mt, 0:4]``.  16-bit: two ``C`` fragments (8 columns each) are one ``A``
    block of 16, packed in pairs (``C``'s layout is ``A``'s).  ``"e4m3"``: a k-step is 32 keys,
    four ``C`` fragments; each register packs four of the lane's own columns times ``P_SCALE``
    (columns ``8 kc .. 8 kc + 3``, then ``+ 4 .. + 7``: keys ``p_key_of_k`` of the k-step,
    :mod:`~numba_flash.kernels.ptx.mma_fp8`, an order the ``B`` tile must share)."""
    if DTYPE != "e4m3":
        _mma, pack2 = mma_ops(DTYPE)

        @_device
        def pack_a(af, a, mt, kc):
            r = 2 * mt
            c = 4 * kc
            af[mt, 0] = pack2(a[r, c], a[r, c + 1])
            af[mt, 1] = pack2(a[r + 1, c], a[r + 1, c + 1])
            af[mt, 2] = pack2(a[r, c + 2], a[r, c + 3])
            af[mt, 3] = pack2(a[r + 1, c + 2], a[r + 1, c + 3])

        return pack_a
    PS = float32(P_SCALE)

    # [docs:pack-p-e4m3]
    @_device
    def pack_a_e4m3(af, a, mt, kc):
        r = 2 * mt
        c = 8 * kc
        af[mt, 0] = pack_e4m3x4(a[r, c] * PS, a[r, c + 1] * PS, a[r, c + 2] * PS,
                                a[r, c + 3] * PS)
        af[mt, 1] = pack_e4m3x4(a[r + 1, c] * PS, a[r + 1, c + 1] * PS, a[r + 1, c + 2] * PS,
                                a[r + 1, c + 3] * PS)
        af[mt, 2] = pack_e4m3x4(a[r, c + 4] * PS, a[r, c + 5] * PS, a[r, c + 6] * PS,
                                a[r, c + 7] * PS)
        af[mt, 3] = pack_e4m3x4(a[r + 1, c + 4] * PS, a[r + 1, c + 5] * PS,
                                a[r + 1, c + 6] * PS, a[r + 1, c + 7] * PS)
    # [/docs:pack-p-e4m3]

    return pack_a_e4m3


# [docs:warp-gemm]
@functools.lru_cache(maxsize=None)
def make_gemm(M_TILES, N_PAIRS, K_STEPS, A_SRC, B_TRANS, RB_A, RB_B, DTYPE, P_SCALE=1.0):
    """``gemm(acc, a, smem, a_byte, b_byte)``: ``acc += A B`` for the warp's ``16 M_TILES`` rows
    and ``16 N_PAIRS`` columns over ``16 K_STEPS`` of the inner dimension (the views and
    addresses of the module docstring).  ``A_SRC``: ``"regs"`` (``a`` uint32 ``[M_TILES,
    K_STEPS, 4]``), ``"acc"`` (``a`` a float32 accumulator view ``[2 M_TILES, 4 K_STEPS]``,
    packed to ``DTYPE``), ``"smem"`` / ``"smem_t"`` (``A`` at ``a_byte``; ``a`` unused);
    ``B_TRANS``: ``B`` row-major (``.trans``), else ``N`` rows of ``K``.  The loop order is
    k-step, then ``B`` fragment pair, then row tile: each ``B`` ``ldmatrix`` feeds ``2
    M_TILES`` ``mma``.  ``DTYPE = "e4m3"``: ``mma.sync.m16n8k32`` on bytes, a k-step 32 of them
    (the same byte addresses; ``B`` K-major only), ``"acc"`` packed by :func:`make_pack_a`
    times ``P_SCALE``."""
    assert A_SRC in A_SOURCES
    mma = mma_m16n8k32_e4m3 if DTYPE == "e4m3" else mma_ops(DTYPE)[0]
    assert DTYPE != "e4m3" or not (B_TRANS or A_SRC == "smem_t")   # no .trans for bytes
    pack_a = make_pack_a(DTYPE, P_SCALE)
    A_REGS = A_SRC == "regs"
    A_ACC = A_SRC == "acc"
    A_TRANS = A_SRC == "smem_t"

    @_device
    def gemm(acc, a, smem, a_byte, b_byte):
        af = cuda.local.array((M_TILES, 4), uint32)  # this k-step's A blocks (registers)
        for kc in range(K_STEPS):
            for mt in range(M_TILES):
                if A_REGS:
                    for i in range(4):
                        af[mt, i] = a[mt, kc, i]
                elif A_ACC:  # P (or dS) from the previous product's accumulator
                    pack_a(af, a, mt, kc)
                elif A_TRANS:
                    af[mt, 0], af[mt, 1], af[mt, 2], af[mt, 3] = ldmatrix_x4_trans(
                        smem, a_byte + 16 * RB_A * kc + 32 * mt)
                else:
                    af[mt, 0], af[mt, 1], af[mt, 2], af[mt, 3] = ldmatrix_x4(
                        smem, a_byte + 16 * RB_A * mt + 32 * kc)
            for p in range(N_PAIRS):
                if B_TRANS:
                    b0, b1, b2, b3 = ldmatrix_x4_trans(smem, b_byte + 16 * RB_B * kc + 32 * p)
                else:
                    b0, b1, b2, b3 = ldmatrix_x4(smem, b_byte + 16 * RB_B * p + 32 * kc)
                for mt in range(M_TILES):
                    r = 2 * mt
                    c = 4 * p
                    acc[r, c], acc[r, c + 1], acc[r + 1, c], acc[r + 1, c + 1] = mma(
                        af[mt, 0], af[mt, 1], af[mt, 2], af[mt, 3], b0, b1,
                        acc[r, c], acc[r, c + 1], acc[r + 1, c], acc[r + 1, c + 1])
                    acc[r, c + 2], acc[r, c + 3], acc[r + 1, c + 2], acc[r + 1, c + 3] = mma(
                        af[mt, 0], af[mt, 1], af[mt, 2], af[mt, 3], b2, b3,
                        acc[r, c + 2], acc[r, c + 3], acc[r + 1, c + 2], acc[r + 1, c + 3])

    return gemm
# [/docs:warp-gemm]



@functools.lru_cache(maxsize=None)
def make_nan_columns(ROWS, COLS):
    """``nan_columns(acc, bits)``: ``acc[r, c] = NaN`` for every column ``c`` whose bit is set in
    ``bits[r]`` (uint64, one word per accumulator row): the rare non-finite fix-ups mark columns
    by bits in their run-time loops, so ``acc`` is indexed by compile-time indices alone (a
    run-time index would put it on the stack)."""
    NAN = float32(math.nan)

    def nan_row(r, ctx):
        acc, bits = ctx
        for c in range(COLS):
            acc[r, c] = NAN if (bits[r] >> uint64(c)) & uint64(1) else acc[r, c]

    rows = static_for(ROWS, nan_row)

    @_device
    def nan_columns(acc, bits):
        rows((acc, bits))

    return nan_columns


@functools.lru_cache(maxsize=None)
def warp_gemm_kernel(M_TILES, K, N, DTYPE="float16", A_SRC="smem"):
    """``kernel(a, bt, v, s, o)``: one warp, the stage end to end as the attention kernels use
    it.  16-bit bits (uint16) ``a [16 M_TILES, K]``, ``bt [N, K]`` (a row per column of ``B``,
    as K rows are) and ``v [N, 16]``: ``s = a @ bt.T`` (float32 ``[16 M_TILES, N]``) with ``A``
    from shared memory (``A_SRC = "smem"``) or from registers (``"regs"``, read once by
    :func:`make_load_a`), and ``o = P @ v`` with ``P = s`` rounded to ``DTYPE`` as the ``A``
    of the next product (``"acc"``) and ``B`` from the row-major ``v`` (``.trans``).  The tiles
    go through :func:`~numba_flash.kernels.ptx.stages.make_tile_copy` (``cp.async``); ``K``, ``N``
    multiples of 16."""
    from ..ptx.stages import cp_async_commit, cp_async_wait_all, make_tile_copy, row_bytes

    assert K % 16 == 0 and N % 16 == 0 and A_SRC in ("smem", "regs")
    M = 16 * M_TILES
    ROWS, N_COLS, K_STEPS = 2 * M_TILES, N // 4, K // 16   # the accumulator views' sizes
    RB_A, RB_V = row_bytes(K), row_bytes(16)
    BT_BYTE, V_BYTE = M * RB_A, (M + N) * RB_A
    WORDS = (V_BYTE + N * RB_V) // 4
    copy_a = make_tile_copy(M, K, RB_A, WARP, True)
    copy_bt = make_tile_copy(N, K, RB_A, WARP, True)
    copy_v = make_tile_copy(N, 16, RB_V, WARP, True)
    load_a = make_load_a(M_TILES, K // 16, RB_A)
    gemm_s = make_gemm(M_TILES, N // 16, K // 16, A_SRC, False, RB_A, RB_A, DTYPE)
    gemm_o = make_gemm(M_TILES, 1, N // 16, "acc", True, RB_A, RB_V, DTYPE)

    @kernel_jit
    def warp_gemm_probe(a, bt, v, s, o):
        lane = cuda.threadIdx.x
        g = lane >> 2
        t = lane & 3
        smem = cuda.shared.array(WORDS, uint32)
        copy_a(smem, 0, a, 0, M, K, lane)
        copy_bt(smem, BT_BYTE, bt, 0, N, K, lane)
        copy_v(smem, V_BYTE, v, 0, N, 16, lane)
        cp_async_commit()
        cp_async_wait_all()
        cuda.syncthreads()  # every lane's copies have landed before any ldmatrix reads them
        af = cuda.local.array((M_TILES, K_STEPS, 4), uint32)
        acc_s = cuda.local.array((ROWS, N_COLS), float32)
        acc_o = cuda.local.array((ROWS, 4), float32)
        for r in range(2 * M_TILES):
            for c in range(N // 4):
                acc_s[r, c] = float32(0.0)
            for c in range(4):
                acc_o[r, c] = float32(0.0)
        a_byte = lane_offset(lane, RB_A, KIND_A)
        if A_SRC == "regs":
            load_a(af, smem, a_byte)
        gemm_s(acc_s, af, smem, a_byte, BT_BYTE + lane_offset(lane, RB_A, KIND_B))
        gemm_o(acc_o, acc_s, smem, 0, V_BYTE + lane_offset(lane, RB_V, KIND_A))
        for r in range(2 * M_TILES):      # the accumulator views (module docstring)
            row = 16 * (r >> 1) + 8 * (r & 1) + g
            for c in range(N // 4):
                s[row, 8 * (c >> 1) + (c & 1) + 2 * t] = acc_s[r, c]
            for c in range(4):
                o[row, 8 * (c >> 1) + (c & 1) + 2 * t] = acc_o[r, c]

    return warp_gemm_probe
