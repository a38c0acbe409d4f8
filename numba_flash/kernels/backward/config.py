"""The backward's kernel configurations: the SIMT kernels' (:class:`BackwardSimtConfig`; their
tile choices, :data:`~numba_flash.kernels.backward.config.GPU_TILES`) and the tensor-core kernels'
(:class:`BackwardMmaConfig`) and the token-sparse backward's (:class:`SparseBackwardConfig`), each
tile choice commented with the limit it hits.  Shared limits
and helpers: :mod:`numba_flash.kernels.core.config`.
"""

from __future__ import annotations

import numpy as np

from ...backend import on_simulator
from ..core.common import padded_head_dim
from ..core.config import KernelConfig, WarpMmaConfig, kernel_config, round16
from ..core.common import acc_dtype


# -- the SIMT backward ---------------------------------------------------------------------
@kernel_config
class BackwardSimtConfig(KernelConfig):
    """The SIMT backward's kernel configuration (:mod:`numba_flash.kernels.backward.simt`), one
    for its dK/dV, dQ and row-mass kernels: ``BLOCK_M x BLOCK_N`` tiles (query rows x keys) on
    ``THREADS`` threads, the compile-time ``HEAD_DIM``, the input ``DTYPE`` (a NumPy dtype;
    float16 / bfloat16 compute in float32), ``DROPOUT`` and ``USER`` (a user's ``(score_mod,
    mask_mod, score_mod_grad, BLOCKS)`` or None)."""

    BLOCK_M: int
    BLOCK_N: int
    THREADS: int
    DROPOUT: bool = False


def backward_simt_config(tiles, dtype, dropout=False, user=None):
    """The :class:`BackwardSimtConfig` of ``tiles = (BLOCK_M, BLOCK_N, HEAD_DIM, THREADS)``
    (:func:`~numba_flash.kernels.backward.config.default_tiles`) for ``dtype`` and the flags."""
    import numpy as np

    block_m, block_n, head_dim, threads = tiles
    return BackwardSimtConfig(BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, THREADS=threads,
                              DTYPE=np.dtype(dtype), DROPOUT=bool(dropout), USER=user)


#: GPU tiles ``(BLOCK_M, BLOCK_N)`` per padded head dim, for 4-byte and 8-byte compute.  BLOCK_N
#: is the larger one: each K/V block streams all of Q, dO and the dQ atomics once, so that
#: traffic scales with Nk / BLOCK_N; BLOCK_M only sets the work between barriers.
GPU_TILES = {
    4: {16: (32, 64), 32: (32, 64), 64: (32, 32), 128: (8, 32), 256: (4, 16)},
    8: {16: (32, 32), 32: (16, 32), 64: (16, 16), 128: (4, 16), 256: (4, 4)},
}


GPU_THREADS = 128


#: simulator: small tiles, few threads (each CUDA thread is a Python thread).
SIM_BLOCK = 8


SIM_THREADS = 16


#: one-thread-per-element kernels (reduce/cast) and the preprocess block.
GPU_ELEM_THREADS = 128


#: preprocess: lanes that share one row of dO * O (a warp on the GPU; the simulator's 16-thread
#: blocks use 8 lanes per row, so a simulated warp holds two rows).
GPU_ROW_LANES = 32


SIM_ROW_LANES = 8


#: resident blocks per SM the GPU kernels are compiled for, ``launch_bounds = (THREADS,
#: MIN_BLOCKS)``: ptxas then keeps registers at or under 65536 / (128 * MIN_BLOCKS) per thread
#: (5: 96, 4: 128, 3: 168, 2: 255).  Each value is the largest that assembles without spills
#: or a stack frame for sm_80 and sm_90 (ptxas 13) and, at most 5, that the block's shared
#: memory allows on an H100/H200 (228 KiB per SM: 5 blocks of ~43 KiB); the compile tier fails
#: on any spill.  Keyed by word size, then HEAD_DIM; the dropout builds where they differ.  The
#: unrolled 16-byte steps need more registers than scalar ones: fewer warps per SM for more work
#: per instruction, which a GPU must weigh (unmeasured; the sweeps that set these values:
#: docs/optimised-forward.md#the-backwards-registers-and-occupancy).
DKDV_MIN_BLOCKS = {4: {16: 2, 32: 2, 64: 2, 128: 2, 256: 3},
                   8: {16: 2, 32: 2, 64: 2, 128: 3, 256: 3}}


DKDV_MIN_BLOCKS_DROPOUT = {4: {64: 2, 128: 2}, 8: {64: 2}}


DQ_MIN_BLOCKS = {4: {16: 2, 32: 4, 64: 3, 128: 3, 256: 4},
                 8: {16: 3, 32: 5, 64: 3, 128: 5, 256: 5}}


DQ_MIN_BLOCKS_DROPOUT = {4: {64: 2, 128: 3}, 8: {64: 3}}


def _word(dtype):
    """Bytes of one compute-type element in the shared tiles (float16 tiles hold float32)."""
    return acc_dtype(dtype).itemsize


def default_tiles(head_dim, dtype, simulator=None):
    """``(BLOCK_M, BLOCK_N, HEAD_DIM, THREADS)`` for this backend: small in the simulator."""
    hd = padded_head_dim(head_dim)
    if on_simulator() if simulator is None else simulator:
        return SIM_BLOCK, SIM_BLOCK, hd, SIM_THREADS
    block_m, block_n = GPU_TILES[_word(dtype)][hd]
    return block_m, block_n, hd, GPU_THREADS


def min_blocks(kind, HEAD_DIM, dtype, DROPOUT):
    """``MIN_BLOCKS`` of the ``"dkdv"`` or ``"dq"`` kernel (see :data:`DKDV_MIN_BLOCKS`)."""
    plain, dropout = ((DQ_MIN_BLOCKS, DQ_MIN_BLOCKS_DROPOUT) if kind == "dq"
                      else (DKDV_MIN_BLOCKS, DKDV_MIN_BLOCKS_DROPOUT))
    word = _word(dtype)
    if DROPOUT and HEAD_DIM in dropout[word]:
        return dropout[word][HEAD_DIM]
    return plain[word][HEAD_DIM]


def elem_threads():
    return SIM_THREADS if on_simulator() else GPU_ELEM_THREADS


def row_lanes():
    return SIM_ROW_LANES if on_simulator() else GPU_ROW_LANES


# -- the tensor-core backward ----------------------------------------------------------------
@kernel_config
class BackwardMmaConfig(WarpMmaConfig):
    """The tensor-core backward's kernel configuration (:mod:`numba_flash.kernels.backward.mma`),
    for both of its kernels (``KIND``):

    * ``"dkdv"``: a block owns ``BLOCK = 16 M_TILES NUM_WARPS`` keys (``M_TILES`` 16-key tiles
      per warp) and walks the query tiles of ``STEP`` rows, ``STAGES`` of them in flight; it
      accumulates the dK / dV columns ``COL0 .. COL0 + ACC_DIM - 1`` (``WANT_DK`` / ``WANT_DV``)
      and, with ``DQ_ATOMIC``, adds dQ with float32 atomics;
    * ``"dq"``: a block owns ``BLOCK`` query rows and walks the K/V tiles of ``STEP`` keys (the
      deterministic dQ, columns ``COL0 ..``).

    Both keep their own operands' fragments where the table says (:data:`BACKWARD_MMA_TILES`).
    ``OWN_V``: ``v`` and ``do`` (so ``dv``) have a head dim of their own, ``d_v``, in V and dO
    tiles ``HEAD_DIM_V`` wide (``d_v`` rounded up to 16; Q and K tiles ``HEAD_DIM``, ``d``'s),
    each shared budget its own (16-byte copies with the chunks past each width zero-filled when
    ``VEC``, else 16-bit loads; off, V and dO share K's and Q's width and addresses).
    ``PAD_COLS`` (``OWN_V``): ``d`` or ``d_v`` is not a multiple of 16, so a tile has columns
    past its array's width (zero-filled chunks, every output column tested); without it
    (DeepSeek's (192, 128)) every tile column is its array's, as in a ``d_v = d`` build.
    ``STRIDED``: ``q``, ``k``, ``v`` and ``do`` are read through their own strides (views whose
    last dim is contiguous: flash-attn's ``[B, N, H, d]`` memory); off, C-contiguous."""

    KIND: str
    STEP: int
    WANT_DV: bool = True
    WANT_DK: bool = True
    DQ_ATOMIC: bool = True
    COL0: int = 0
    ACC_DIM: int = 0
    PAD_COLS: bool = False
    STRIDED: bool = False

    @property
    def BLOCK(self):
        """Rows a block owns: keys (dkdv) or queries (dq)."""
        return self.OWNED_ROWS

    @property
    def ACC(self):
        """dK's (and dQ's) accumulated columns (``ACC_DIM``, all of ``HEAD_DIM`` when 0)."""
        return self.ACC_DIM or self.HEAD_DIM

    @property
    def ACC_V(self):
        """dV's accumulated columns (``ACC_DIM``, all of ``V_DIM`` when 0)."""
        return self.ACC_DIM or self.V_DIM

    @property
    def Q_IN_REGS(self):
        """dq: Q's and dO's ``A`` fragments stay in registers for the whole block (``4 M_TILES
        (HEAD_DIM + V_DIM) / 16`` registers: 64 at d = 128), else every step reads them from
        shared memory (d = 256: 128 registers of fragments beside the 64 of the dQ half spilled
        220 B)."""
        return self.M_TILES * (self.HEAD_DIM + self.V_DIM) <= 256

    @property
    def DS_ROW_BYTES(self):
        """A dS^T row (dkdv with ``DQ_ATOMIC``): ``STEP`` queries of 16 bits, + 16 bytes."""
        return 2 * self.STEP + 16

    @property
    def SMEM_BYTES(self):
        """Static shared memory: dkdv: K, V (``BLOCK`` rows each), dS^T, ``STAGES`` x (Q, dO)
        of ``STEP`` rows; dq: Q, dO (``BLOCK`` rows each), ``STAGES`` x (K, V) of ``STEP``."""
        rb = self.ROW_BYTES + self.V_ROW_BYTES   # a row of each operand pair: K + V, Q + dO
        if self.KIND == "dkdv":
            return self.BLOCK * rb + self.BLOCK * self.DS_ROW_BYTES + self.STAGES * self.STEP * rb
        return self.BLOCK * rb + self.STAGES * self.STEP * rb

    @property
    def name(self):
        """The compile tier's name, e.g. ``backward_mma dkdv (dk dv dq) W2 N64 M16 D64 S2
        float16`` (dkdv: ``N`` keys of a block, ``M`` queries per step; dq the other way)."""
        flags = self.flags_name
        if self.KIND == "dkdv":
            parts = " ".join(p for p, w in (("dk", self.WANT_DK), ("dv", self.WANT_DV),
                                            ("dq", self.DQ_ATOMIC)) if w)
            shape = f"N{self.BLOCK} M{self.STEP}"
        else:
            parts, shape = "dq", f"M{self.BLOCK} N{self.STEP}"
        acc, width = ((self.ACC_V, self.V_DIM) if self.KIND == "dkdv" and not self.WANT_DK
                      else (self.ACC, self.HEAD_DIM))   # a dV pass: dV's columns
        cols = f" c{self.COL0}-{self.COL0 + acc - 1}" if acc < width else ""
        dv = f" Dv{self.HEAD_DIM_V}" if self.HEAD_DIM_V else ""
        return (f"backward_mma {self.KIND} ({parts}{cols}) W{self.NUM_WARPS} {shape} "
                f"D{self.HEAD_DIM}{dv} S{self.STAGES}{flags} {self.DTYPE}")


#: the tensor-core backward's tiles per padded head dim on a GPU: ``{head dim: (dkdv, dq)}``,
#: each ``(NUM_WARPS, M_TILES, STEP, STAGES)``.  The dK/dV kernel's warps own keys, its step is a
#: tile of queries; the dQ kernel's warps own query rows (Q and dO fragments in registers, read
#: from shared memory once), its step a K/V tile.  A fragment a warp reads from shared memory
#: feeds all its M_TILES row tiles (the shared-read bound of docs/resources.md).
BACKWARD_MMA_TILES = {
    16: ((4, 1, 16, 2), (4, 1, 64, 2)),
    32: ((4, 1, 16, 2), (4, 1, 64, 2)),
    # dkdv: 2 warps x 32 keys (K, V 18 KiB, dS^T 3 KiB, one stage of Q and dO 4.5 KiB: 26
    # KiB); dK, dV accumulators 2 x 64 registers per lane: at 255 registers a second stage of
    # Q and dO spilled (28 B, ptxas 13), one stage does not
    # dq: 4 warps x 16 rows, 32 keys per tile, 2 stages (Q, dO 18 KiB + 18 KiB)
    64: ((2, 2, 16, 1), (4, 1, 32, 2)),
    # dkdv: 16 keys per warp (dK, dV: 128 registers); 32 queries per step so each K and V
    # fragment feeds two query tiles; one stage of Q and dO (17 KiB: two would pass 48 KiB)
    # dq: 2 warps x 16 rows, 16 keys per tile, 2 stages
    128: ((2, 1, 32, 1), (2, 1, 16, 2)),
    # one warp, half the columns per pass (dkdv_passes, dq_passes); one stage of Q and dO (and
    # of K and V in dq: two would pass 48 KiB)
    256: ((1, 1, 16, 1), (1, 1, 16, 1)),
}

#: the simulator's tiles: one warp (32 Python threads), two row tiles, 16 per step
BACKWARD_MMA_SIM_TILES = ((1, 2, 16, 2), (1, 2, 16, 2))


#: the dK/dV kernel of a user's variant (its functions and aux arrays hold registers of their
#: own) keeps two stages of Q and dO at d = 64: with the table's one, ptxas spilled 92 B at 255
#: registers (19 local loads per tile), with two 28 B (6)
BACKWARD_MMA_USER_DKDV_STAGES = {64: 2}


#: the tiles of a value head dim of its own, ``{(HEAD_DIM, HEAD_DIM_V): (dkdv, dq)}``, where
#: the row of the wider width (the default) does not suit.  DeepSeek's (192, 128) (MLA prefill;
#: the 256 row is one warp): dkdv: 2 warps x 16 keys in one pass, dK's accumulator (96
#: registers a lane) beside dV's (64): 255 registers, no spill at 16 queries a step (32 spilled
#: 84 B), so two stages of Q and dO (K + V 21 KiB, dS^T 1.5, 2 x 10.5: 44 KiB): 731
#: instructions per 104 HMMA on sm_90, bound by the shared reads (374 TFLOP/s); dq: 2 warps x 16
#: rows, 16 keys a tile, 2 stages (Q and dO read from shared memory: their fragments would be 80
#: registers; 42 KiB): 326 per 64 HMMA, mma-bound
BACKWARD_MMA_OWN_V_TILES = {
    (192, 128): ((2, 1, 16, 2), (2, 1, 16, 2)),
}


def backward_mma_tiles(head_dim, kind, simulator=None, user=False, head_dim_v=None):
    """``(NUM_WARPS, M_TILES, STEP, STAGES)`` of the tensor-core backward's ``kind`` (``"dkdv"``
    or ``"dq"``) kernel for head dim ``d`` on this backend (``user``: a user's variant;
    ``head_dim_v``: a value head dim of its own: :data:`BACKWARD_MMA_OWN_V_TILES`, else the
    row of the wider of the two)."""
    if simulator is None:
        simulator = on_simulator()
    if simulator:
        return BACKWARD_MMA_SIM_TILES[0 if kind == "dkdv" else 1]
    width = padded_head_dim(max(head_dim, head_dim_v or 0))
    row = BACKWARD_MMA_TILES[width]
    if head_dim_v is not None:
        row = BACKWARD_MMA_OWN_V_TILES.get((round16(head_dim), round16(head_dim_v)), row)
    nw, mt, step, stages = row[0 if kind == "dkdv" else 1]
    if user and kind == "dkdv":
        stages = BACKWARD_MMA_USER_DKDV_STAGES.get(width, stages)
    return nw, mt, step, stages


def backward_mma_config(head_dim, kind, dtype="float16", simulator=None, head_dim_v=None,
                        **flags):
    """The :class:`BackwardMmaConfig` of a launch (``flags``: the variant flags and, for dkdv,
    the pass of :func:`numba_flash.kernels.backward.mma.dkdv_passes`).  ``head_dim_v``: a value
    head dim of its own (``OWN_V``): Q and K tiles ``d`` rounded up to 16 wide, V and dO tiles
    ``d_v`` rounded up to 16 (``HEAD_DIM_V``), on the tiles of :func:`backward_mma_tiles`."""
    nw, mt, step, stages = backward_mma_tiles(head_dim, kind, simulator,
                                              flags.get("USER") is not None, head_dim_v)
    if head_dim_v is None:
        return BackwardMmaConfig(KIND=kind, NUM_WARPS=nw, M_TILES=mt, STEP=step,
                                 HEAD_DIM=padded_head_dim(head_dim), STAGES=stages, DTYPE=dtype,
                                 **flags)
    return BackwardMmaConfig(KIND=kind, NUM_WARPS=nw, M_TILES=mt, STEP=step,
                             HEAD_DIM=round16(head_dim), STAGES=stages, DTYPE=dtype, OWN_V=True,
                             HEAD_DIM_V=round16(head_dim_v),
                             PAD_COLS=bool(head_dim % 16 or head_dim_v % 16), **flags)


# -- the token-sparse backward ------------------------------------------------------------------
@kernel_config
class SparseBackwardConfig(KernelConfig):
    """The token-sparse backward's configuration (:mod:`numba_flash.kernels.backward.sparse`):
    blocks of ``THREADS`` threads, each block the ``ROWS`` query heads of one token and kv head
    (they share the list), ``dq`` accumulated in shared ``[ROWS, HEAD_DIM]``; flags ``SOFTCAP``,
    ``ALIBI``."""

    THREADS: int
    ROWS: int
    SOFTCAP: bool = False
    ALIBI: bool = False


#: GPU block: 4 warps, a list entry a thread (DSA's top-k, 2048, is 16 entries a thread)
SPARSE_BWD_THREADS = 128
#: the simulator's: few Python threads, but more than one entry each and a partial last chunk
SIM_SPARSE_BWD_THREADS = 8
#: query heads a block holds: the shared dq accumulator, ROWS x HEAD_DIM compute words, is 8 KiB
#: at 8 x 256 float32 (16 KiB in float64): far from the 48 KiB limit, and a GQA group of 8 (or a
#: chunk of MLA's 128 heads) in one block reads each listed key once per 8 rows
SPARSE_BWD_ROWS = 8


def sparse_backward_config(head_dim, dtype, softcap=False, alibi=False, simulator=None):
    """The :class:`SparseBackwardConfig` of a call: ``HEAD_DIM`` the next power of two of
    ``max(d, d_v)`` (at least 16), the dtype's name, the flags."""
    if simulator is None:
        simulator = on_simulator()
    return SparseBackwardConfig(
        THREADS=SIM_SPARSE_BWD_THREADS if simulator else SPARSE_BWD_THREADS,
        ROWS=SPARSE_BWD_ROWS, HEAD_DIM=max(16, 1 << (int(head_dim) - 1).bit_length()),
        DTYPE=np.dtype(dtype).name, SOFTCAP=bool(softcap), ALIBI=bool(alibi))
