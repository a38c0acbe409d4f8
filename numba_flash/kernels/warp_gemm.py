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
  (:mod:`numba_flash.kernels.online_softmax`);
* ``A`` in registers is uint32 ``[M_TILES, K_STEPS, 4]``: the ``ldmatrix.x4`` of each 16 x 16
  block (:func:`make_load_a`);
* ``A`` from an accumulator (``P`` or ``dS`` of the previous product) is that float32 view:
  the ``A`` block ``(mt, kc)`` packs ``acc[2 mt + h, 4 kc + j]`` in pairs, rounded to the
  element type (the ``C`` layout of two 8-column fragments is the ``A`` layout of 16 columns).

Operands in shared memory are row-major tiles of 16-bit elements with rows of ``RB`` bytes
(:func:`~numba_flash.kernels.stages.row_bytes`: padded so an ``ldmatrix`` has no bank
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

from numba import cuda, int32, uint32

from .jit import device_jit
from .mma import mma_ops
from .stages import ldmatrix_x4, ldmatrix_x4_trans
from .tile_scores import Layout

_device = functools.partial(device_jit, inline=True)

#: which row of an ``x4``'s four 8 x 8 matrices a lane points at
#: (:func:`numba_flash.kernels.stages.ldmatrix_rows`): ``KIND_A`` for an ``A`` block (matrices
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


#: the accumulator's layouts (:class:`~numba_flash.kernels.tile_scores.Layout`): row ``r`` of a
#: lane is row ``16 (r >> 1) + 8 (r & 1)`` of the warp's block (plus ``g``), column ``c`` is
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


# [docs:warp-gemm]
@functools.lru_cache(maxsize=None)
def make_gemm(M_TILES, N_PAIRS, K_STEPS, A_SRC, B_TRANS, RB_A, RB_B, DTYPE):
    """``gemm(acc, a, smem, a_byte, b_byte)``: ``acc += A B`` for the warp's ``16 M_TILES`` rows
    and ``16 N_PAIRS`` columns over ``16 K_STEPS`` of the inner dimension (the views and
    addresses of the module docstring).  ``A_SRC``: ``"regs"`` (``a`` uint32 ``[M_TILES,
    K_STEPS, 4]``), ``"acc"`` (``a`` a float32 accumulator view ``[2 M_TILES, 4 K_STEPS]``,
    packed to ``DTYPE``), ``"smem"`` / ``"smem_t"`` (``A`` at ``a_byte``; ``a`` unused);
    ``B_TRANS``: ``B`` row-major (``.trans``), else ``N`` rows of ``K``.  The loop order is
    k-step, then ``B`` fragment pair, then row tile: each ``B`` ``ldmatrix`` feeds ``2
    M_TILES`` ``mma``."""
    assert A_SRC in A_SOURCES
    mma, pack2 = mma_ops(DTYPE)
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
                elif A_ACC:  # two C fragments (8 columns each) are one A block of 16
                    r = 2 * mt
                    c = 4 * kc
                    af[mt, 0] = pack2(a[r, c], a[r, c + 1])
                    af[mt, 1] = pack2(a[r + 1, c], a[r + 1, c + 1])
                    af[mt, 2] = pack2(a[r, c + 2], a[r, c + 3])
                    af[mt, 3] = pack2(a[r + 1, c + 2], a[r + 1, c + 3])
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


def compile_configs():
    """The stage's own kernels for the compile tier: none yet (the tensor-core kernels build
    it); :func:`warp_gemm_test_kernel` is added with its twin tests."""
    return iter(())
