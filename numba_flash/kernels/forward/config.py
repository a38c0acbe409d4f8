"""The forward's kernel configurations and tile choices (FA3's ``tile_size.h``): the SIMT forward
(:class:`ForwardSimtConfig`), the ``mma.sync`` forward (:class:`ForwardMmaConfig`) and the warpgroup
forward (:class:`ForwardWgmmaConfig`), each tile choice commented with the limit it hits.
Shared limits and helpers: :mod:`numba_flash.kernels.core.config`.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np

from ...backend import on_simulator
from ..core.common import HEAD_DIMS, SMEM_LIMIT, acc_dtype, padded_head_dim
from ..ptx.address import is_aligned
from ..core.config import (
    KernelConfig, TensorCoreConfig, WarpMmaConfig, kernel_config, round16,
)


# -- the SIMT forward ------------------------------------------------------------------------
@kernel_config
class ForwardSimtConfig(KernelConfig):
    """The SIMT forward's kernel configuration (:mod:`numba_flash.kernels.forward.simt`):
    ``BLOCK_M x BLOCK_N`` tiles of ``THREADS_M x THREADS_N`` threads (thread ``(tx, ty)`` owns
    rows ``ty + i THREADS_M`` and keys ``tx + j THREADS_N``), ``HEAD_DIM`` compile-time, the
    input ``DTYPE`` (a NumPy dtype name; float16 / bfloat16 compute in float32) and the
    compile-time flags: ``DROPOUT``, ``SCORE_MOD`` (softcap and ALiBi, switched at run time),
    ``VARLEN`` (packed sequences), ``PAGED`` (K/V through a block table, varlen only),
    ``USER`` (a user's ``(score_mod, mask_mod, BLOCKS)``), ``VEC`` (16-byte ``cp.async`` tile
    copies), ``OWN_V`` (``v`` has a head dim of its own, ``d_v``: V and ``o`` addressed at
    their width; off, V shares K's addresses, the build of every ``d_v == d`` call),
    ``STRIDED`` (``q``, ``k``, ``v`` and ``o`` read and written through their own strides,
    views whose last dim is contiguous: batched ``[B, H, N, d]`` or, ``VARLEN``, packed
    ``[total, H, d]``; ``PAGED``: ``q`` and ``o``, the caches' rows are the table's either
    way; off, C-contiguous)."""

    BLOCK_M: int
    BLOCK_N: int
    THREADS_M: int
    THREADS_N: int
    DROPOUT: bool = False
    SCORE_MOD: bool = False
    VARLEN: bool = False
    PAGED: bool = False
    VEC: bool = False
    OWN_V: bool = False
    STRIDED: bool = False

    @property
    def THREADS(self):
        return self.THREADS_M * self.THREADS_N

    @property
    def WORD(self):
        """Bytes of a compute element in the tiles: 8 for float64, else 4 (float32)."""
        return 8 if self.DTYPE == "float64" else 4

    # the thread's share of the tiles and the shared rows' layout (kernels/forward/simt.py)
    @property
    def TM(self):
        """Tile rows per thread (of S, P and the output accumulator)."""
        return self.BLOCK_M // self.THREADS_M

    @property
    def TN(self):
        """S columns (keys) per thread."""
        return self.BLOCK_N // self.THREADS_N

    @property
    def TD(self):
        """Output accumulator columns per thread."""
        return self.HEAD_DIM // self.THREADS_N

    @property
    def VW(self):
        """Compute elements of one 16-byte chunk: 4 float32, 2 float64."""
        return VEC_BYTES // self.WORD

    @property
    def CH(self):
        """16-byte chunks of a tile row."""
        return self.HEAD_DIM // self.VW

    @property
    def K_STRIDE(self):
        """``k_tile`` row length: padded by one chunk (bank-conflict free reads)."""
        return self.HEAD_DIM + self.VW

    @property
    def P_STRIDE(self):
        """``p_tile`` row length (:data:`P_PAD`)."""
        return self.BLOCK_N + P_PAD

    @property
    def GROUPS(self):
        """Dropout: groups of 4 keys (one Philox call each) per tile row."""
        return self.BLOCK_N // 4


#: the SIMT forward's GPU tiles ``(BLOCK_M, BLOCK_N, THREADS_M, THREADS_N)`` per compute word
#: (4: float16 / bfloat16 / float32, 8: float64) and padded head dim.  Every thread owns 4 rows
#: of S where the tile allows (a 16-byte load of a K row then feeds 4 x 4 FMAs, one of acc's V
#: chunks 4 x 4: FFMA dominates the loop, docs/resources.md) while everything stays under 48
#: KiB of shared memory and ``THREADS_N`` 16-byte chunks fit in a head row (``THREADS_N * 16 /
#: word <= HEAD_DIM``).  float32 at HEAD_DIM = 16 takes 64 x 16 tiles: 4 keys per thread (8 kept
#: S on the stack in the softcap/ALiBi build, 128 B); at HEAD_DIM = 32 64 x 32 tiles, 4 keys per
#: thread (with 64 x 64, 8 keys, the stage-built kernel keeps S, 128 B, on the stack: the
#: score stage's loop over a thread's keys stays rolled; 2026-12-02).  float64 at 16 / 32 takes
#: 32 x 16 (2 keys per thread: 4 kept the softcap/ALiBi build's S, 128 B, on the stack).
FORWARD_SIMT_TILES = {
    4: {16: (64, 16, 16, 4), 32: (64, 32, 16, 8), 64: (64, 32, 16, 8), 128: (32, 16, 8, 8),
        256: (16, 8, 8, 8)},
    8: {16: (32, 16, 8, 8), 32: (32, 16, 8, 8), 64: (32, 16, 8, 8), 128: (16, 8, 8, 8),
        256: (4, 8, 4, 8)},
}
#: the score-modifier build's tiles where they differ (softcap / ALiBi, a user's variant, every
#: varlen build): none today (the plain build's d = 32 tiles are the ones this table held)
FORWARD_SIMT_MODS_TILES = {}


def forward_simt_tiles(head_dim, dtype, mods=False):
    """``(BLOCK_M, BLOCK_N, THREADS_M, THREADS_N)`` of the SIMT forward's GPU build for head dim
    ``d`` and input ``dtype`` (``mods``: the score-modifier build), from
    :data:`FORWARD_SIMT_TILES` / :data:`FORWARD_SIMT_MODS_TILES`."""
    import numpy as np

    word = 8 if np.dtype(dtype) == np.float64 else 4
    hd = padded_head_dim(head_dim)
    return ((FORWARD_SIMT_MODS_TILES.get(word, {}).get(hd) if mods else None)
            or FORWARD_SIMT_TILES[word][hd])



#: at most this many 32-bit registers for a thread's ``acc`` micro-tile, and as many for S.
MAX_TILE_REGS = 64


#: the GPU tile choices (:data:`~numba_flash.kernels.forward.config.FORWARD_SIMT_TILES`, and those
#: of the score-modifier build,
#: :data:`~numba_flash.kernels.forward.config.FORWARD_SIMT_MODS_TILES`); each ``(BLOCK_M, BLOCK_N,
#: HEAD_DIM)`` appears once, so a tile names its threads (:func:`thread_layout`)
GPU_TILES = FORWARD_SIMT_TILES


GPU_MODS_TILES = FORWARD_SIMT_MODS_TILES


_GPU_THREADS = {(bm, bn, hd): (tm_, tn_) for tables in (GPU_TILES, GPU_MODS_TILES)
                for table in tables.values() for hd, (bm, bn, tm_, tn_) in table.items()}


#: simulator defaults: small tiles and few threads (each CUDA thread is a Python thread).
SIM_BLOCK = 8


SIM_THREADS = 4


SIM_EXPLICIT = ((8, 8), (16, 8), (8, 16), (16, 16))


#: padding of a ``p_tile`` row, in elements: with 8 threads per row (4 thread rows per warp) the
#: scalar stores of ``P`` then hit 32 distinct banks, and rows stay 16-byte aligned
P_PAD = 8


#: bytes of one vector access (``cp.async``, ``ld.shared.v4``): 4 float32 or 2 float64
VEC_BYTES = 16


def _word(dtype):
    """Bytes of one compute-type element in the shared tiles (float16 tiles hold float32)."""
    return acc_dtype(dtype).itemsize


def gpu_tiles(head_dim, dtype, mods=False):
    """The GPU default ``(BLOCK_M, BLOCK_N, HEAD_DIM)`` for a head dim ``d`` and input dtype
    (``mods``: of the score-modifier build, :data:`GPU_MODS_TILES`)."""
    block_m, block_n = forward_simt_tiles(head_dim, dtype, mods)[:2]
    return block_m, block_n, padded_head_dim(head_dim)


def thread_layout(BLOCK_M, BLOCK_N, HEAD_DIM, simulator=False):
    """``(THREADS_M, THREADS_N)``: thread rows and columns of a block for these tiles (the GPU
    tiles of :data:`GPU_TILES` name theirs; the simulator's run 4 x 4 threads)."""
    if simulator:
        return min(SIM_THREADS, BLOCK_M), min(SIM_THREADS, BLOCK_N, HEAD_DIM // 4)
    if (BLOCK_M, BLOCK_N, HEAD_DIM) in _GPU_THREADS:
        return _GPU_THREADS[BLOCK_M, BLOCK_N, HEAD_DIM]
    return min(16, BLOCK_M), min(8, BLOCK_N, HEAD_DIM // 4)


def shared_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, dropout=False, paged=False):
    """Static shared memory of one block (the budget: docs/optimised-forward.md, "The
    shared-memory budget")."""
    vw = VEC_BYTES // _word(dtype)  # elements of a 16-byte chunk: the k_tile row pad
    words = (BLOCK_M * HEAD_DIM + BLOCK_N * (HEAD_DIM + vw) + BLOCK_N * HEAD_DIM
             + BLOCK_M * (BLOCK_N + P_PAD))
    keep_bytes = 4 * BLOCK_M * (BLOCK_N // 4 + 1) if dropout else 0  # int32 keep_tile
    page_bytes = 4 * BLOCK_N if paged else 0  # int32 page_sh
    return _word(dtype) * words + keep_bytes + page_bytes


def tile_problem(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, simulator=False, dropout=False):
    """Why these tiles cannot run on a GPU (shared memory, registers), or ``None`` if they can."""
    tm_, tn_ = thread_layout(BLOCK_M, BLOCK_N, HEAD_DIM, simulator)
    if dropout and BLOCK_N % 4:
        return f"BLOCK_N = {BLOCK_N} is not a multiple of 4 (one Philox call per 4 keys)"
    smem = shared_bytes(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, dropout)
    if smem > SMEM_LIMIT:
        return f"{smem} B of shared memory > {SMEM_LIMIT} B"
    vw = VEC_BYTES // _word(dtype)
    if HEAD_DIM % (tn_ * vw) or BLOCK_N % vw:
        return (f"{tn_} threads x {vw}-element chunks do not tile HEAD_DIM = {HEAD_DIM} and "
                f"BLOCK_N = {BLOCK_N}")
    regs_per = _word(dtype) // 4
    acc_regs = (BLOCK_M // tm_) * (HEAD_DIM // tn_) * regs_per
    s_regs = (BLOCK_M // tm_) * (BLOCK_N // tn_) * regs_per
    if max(acc_regs, s_regs) > MAX_TILE_REGS:
        return f"{max(acc_regs, s_regs)} registers per thread for one micro-tile > {MAX_TILE_REGS}"
    return None


#: ``launch_bounds`` minimum resident blocks per SM, per ``(compute word, HEAD_DIM)``, where
#: ptxas showed it pays; elsewhere a bound made ptxas use the allowance or spill, so none is set.
#: Since the 16-byte rebuild (issue 22) the HEAD_DIM = 16 kernel has 64 threads: 4 blocks of them
#: cap nothing (162 registers); kept until a GPU measures whether a bound pays at the new tiles
#: (the ptxas figures: docs/optimised-forward.md#occupancy-measured-by-ptxas).
GPU_MIN_BLOCKS = {(4, 16): 4}


def gpu_min_blocks(HEAD_DIM, dtype):
    """Resident blocks per SM the GPU kernel is compiled for (``launch_bounds``), or ``None``."""
    return GPU_MIN_BLOCKS.get((_word(dtype), HEAD_DIM))


def launch_bounds(BLOCK_M, BLOCK_N, HEAD_DIM, dtype, simulator=False):
    """``(threads, min_blocks)`` for ``cuda.jit(launch_bounds=...)``, or ``None``."""
    blocks = gpu_min_blocks(HEAD_DIM, dtype)
    if blocks is None:
        return None
    tm_, tn_ = thread_layout(BLOCK_M, BLOCK_N, HEAD_DIM, simulator)
    return (tm_ * tn_, blocks)


def jit_options(BLOCK_M, BLOCK_N, HEAD_DIM, dtype):
    """``cuda.jit`` options: ``launch_bounds`` on the GPU where set (the simulator has none)."""
    if on_simulator():
        return {}
    bounds = launch_bounds(BLOCK_M, BLOCK_N, HEAD_DIM, dtype)
    return {} if bounds is None else {"launch_bounds": bounds}


def vector_tiles(dtype, d, head_dim, *arrays):
    """The ``VEC`` build: float32 / float64 inputs (the tiles' own type) whose rows are whole
    16-byte chunks (``d`` a multiple of 4 float32 / 2 float64; chunks past ``d`` up to
    ``head_dim`` are zero-filled) and every array's data 16-byte aligned, so each tile row is
    copied by ``cp.async``; else element by element (float16 and bfloat16 inputs are widened to
    float32 on the way).  The pointers are checked in the simulator too (its ``cp.async`` twin
    raises on a misaligned address, as the GPU faults)."""
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)) or d % (VEC_BYTES // dt.itemsize):
        return False
    return is_aligned(VEC_BYTES, *arrays)


def explicit_tiles(head_dim, dtype, simulator=None, mods=False):
    """``{(BLOCK_M, BLOCK_N): HEAD_DIM}``: the tiles a caller may ask for with ``block_m=`` /
    ``block_n=`` for head dim ``d``, in this order of preference.

    On the GPU they are the default tiles of every compile-time head dim that can hold ``d``; a
    choice runs in that head dim's default kernel (``d`` zero-padded up to it), so explicit tiles
    never need a kernel that the compile tier does not already build.  They exist for tests and
    experiments (smaller or non-square tiles), not for speed.  ``mods``: of the score-modifier
    build (its default tiles).  In the simulator (no compile tier, and every tile element costs
    Python time) they are the small tiles ``SIM_EXPLICIT``.
    """
    if simulator is None:
        simulator = on_simulator()
    hd0 = padded_head_dim(head_dim)
    if simulator:
        return {pair: hd0 for pair in SIM_EXPLICIT}
    out = {}
    for hd in HEAD_DIMS:
        if hd >= hd0:
            out.setdefault(gpu_tiles(hd, dtype, mods)[:2], hd)
    return out


def choose_tiles(head_dim, dtype, block_m=None, block_n=None, mods=False):
    """``(BLOCK_M, BLOCK_N, HEAD_DIM)`` for a call: the backend default, or the explicit choice.

    ``block_m`` / ``block_n`` must already be validated ints (or None).  A ``ValueError`` names
    the argument and lists the allowed pairs when the choice is not one of :func:`explicit_tiles`.
    """
    if block_m is None and block_n is None:
        return default_tiles(head_dim, dtype, mods)
    allowed = explicit_tiles(head_dim, dtype, mods=mods)
    for (bm, bn), hd in allowed.items():
        if block_m in (None, bm) and block_n in (None, bn):
            return bm, bn, hd
    # blame block_m if no pair has it, else block_n
    if block_m is not None and all(bm != block_m for bm, _ in allowed):
        name = "block_m"
    else:
        name = "block_n"
    pairs = ", ".join(f"({bm}, {bn})" for bm, bn in allowed)
    raise ValueError(
        f"{name}: expected (block_m, block_n) in [{pairs}] for head dim {head_dim} and dtype "
        f"{np.dtype(dtype).name}, got ({block_m}, {block_n})"
    )


def default_tiles(head_dim, dtype, mods=False):
    """``(BLOCK_M, BLOCK_N, HEAD_DIM)`` for this backend (``mods``: the score-modifier build):
    small in the simulator."""
    if on_simulator():
        return SIM_BLOCK, SIM_BLOCK, padded_head_dim(head_dim)
    return gpu_tiles(head_dim, dtype, mods)


def launch_config(BLOCK_M, BLOCK_N, HEAD_DIM, simulator):
    """``(block, THREADS_M, THREADS_N)`` for the kernel launch."""
    tm_, tn_ = thread_layout(BLOCK_M, BLOCK_N, HEAD_DIM, simulator)
    return (tn_, tm_), tm_, tn_


def forward_simt_config(head_dim, dtype, dropout=False, score_mod=False, varlen=False, paged=False,
                   vec=False, user=None, tiles=None, simulator=None, own_v=False, strided=False):
    """The :class:`~numba_flash.kernels.forward.config.ForwardSimtConfig` of a launch: the backend's
    default tiles (``score_mod``: the score-modifier build's, :data:`GPU_MODS_TILES`) or
    ``tiles = (BLOCK_M, BLOCK_N, HEAD_DIM)`` (:func:`choose_tiles`), their threads
    (:func:`thread_layout`) and the flags."""
    if simulator is None:
        simulator = on_simulator()
    if tiles is None:
        tiles = ((SIM_BLOCK, SIM_BLOCK, padded_head_dim(head_dim)) if simulator
                 else gpu_tiles(head_dim, dtype, score_mod or user is not None))
    bm, bn, hd = tiles
    tm_, tn_ = thread_layout(bm, bn, hd, simulator)
    return ForwardSimtConfig(BLOCK_M=bm, BLOCK_N=bn, HEAD_DIM=hd, DTYPE=np.dtype(dtype).name,
                             THREADS_M=tm_, THREADS_N=tn_, DROPOUT=dropout,
                             SCORE_MOD=score_mod or user is not None, VARLEN=varlen, PAGED=paged,
                             USER=user, VEC=vec, OWN_V=own_v, STRIDED=strided)


# -- the tensor-core forward -----------------------------------------------------------------
@kernel_config
class ForwardMmaConfig(WarpMmaConfig):
    """The tensor-core forward's kernel configuration (:mod:`numba_flash.kernels.forward.mma`).

    ``NUM_WARPS`` warps, each owning ``M_TILES`` tiles of 16 query rows; ``BLOCK_N`` keys per
    K/V tile; ``STAGES`` K/V buffers (1: one K and one V buffer, V_j copied under ``Q K_j^T``
    and K_{j+1} under ``P V_j``, as FA2); ``Q_IN_REGS``: Q's ``A`` fragments stay in registers
    (else Q keeps a shared region and is read at every k-step); ``HEAD_DIM`` compile-time (``d``
    zero-padded to it unless ``VEC``); the element type and the compile-time variant flags;
    ``USER``: a user's ``(score_mod, mask_mod, BLOCKS)`` or None; ``OWN_V``: ``v`` (and ``o``)
    have a head dim of their own, ``d_v``, in V tiles ``HEAD_DIM_V`` wide (0: ``HEAD_DIM``;
    off, V shares K's addresses and width); ``STRIDED``: ``q``, ``k``, ``v`` and ``o`` are read
    and written through their own strides (views whose last dim is contiguous: flash-attn's
    ``[B, N, H, d]`` memory, a fused QKV projection's slices), off C-contiguous."""

    BLOCK_N: int
    Q_IN_REGS: bool = True
    STRIDED: bool = False

    @property
    def BLOCK_M(self):
        """Query rows of a block."""
        return self.OWNED_ROWS

    @property
    def STAGE_BYTES(self):
        """One pipeline stage: a K tile, then a V tile."""
        return self.BLOCK_N * (self.ROW_BYTES + self.V_ROW_BYTES)

    @property
    def Q_BYTE(self):
        """Where Q's tile sits: with ``Q_IN_REGS``, in a buffer the loop fills only after its
        first barrier (when every warp holds its fragments): the last stage, or with one stage
        V's buffer; else in a region of its own after the stages."""
        if not self.Q_IN_REGS:
            return self.STAGES * self.STAGE_BYTES
        if self.STAGES == 1:
            return self.BLOCK_N * self.ROW_BYTES
        return (self.STAGES - 1) * self.STAGE_BYTES

    @property
    def SMEM_BYTES(self):
        """Static shared memory of one block."""
        q = self.BLOCK_M * self.ROW_BYTES
        return max(self.STAGES * self.STAGE_BYTES, self.Q_BYTE + q)

    @property
    def name(self):
        """The compile tier's name: ``forward_mma W4 M128 N64 D64 S2 [flags] float16``."""
        dv = f" Dv{self.HEAD_DIM_V}" if self.HEAD_DIM_V else ""
        return (f"forward_mma W{self.NUM_WARPS} M{self.BLOCK_M} N{self.BLOCK_N} D{self.HEAD_DIM}"
                f"{dv} S{self.STAGES}{'' if self.Q_IN_REGS else ' Qsmem'}{self.flags_name} "
                f"{self.DTYPE}")


#: the tensor-core forward's tiles per padded head dim on a GPU: ``(NUM_WARPS, M_TILES, BLOCK_N,
#: STAGES, Q_IN_REGS)``.  Two 16-row tiles per warp (32 rows) share every K and V fragment read
#: from shared memory: 32 flop per shared byte, twice the bound of 16 rows (docs/resources.md).
FORWARD_MMA_TILES = {
    # 3 stages of K + V (6 / 10 KiB each; Q's 128 rows fit in one): K/V two tiles ahead
    16: (4, 2, 64, 3, True),
    32: (4, 2, 64, 3, True),
    # a stage is 18 KiB: 3 would pass 48 KiB, so 2 (36 KiB, Q in the second until the loop)
    64: (4, 2, 64, 2, True),
    # acc (128 registers per lane) + Q's fragments (64) + S spill past 255 registers: Q stays in
    # shared memory (17 KiB for 2 warps x 32 rows), read at every k-step (24 KiB per warp and
    # tile with K and V: 21 flop per shared byte); beside it one K and one V buffer of 32 keys
    # (2 x 8.5 KiB; a second stage would pass 48 KiB)
    128: (2, 2, 32, 1, False),
    # acc alone is 128 registers per lane: one row tile, Q read from shared memory per k-step
    256: (1, 1, 16, 2, False),
}

#: the tiles of the builds with per-element work (dropout, softcap, ALiBi, a user's variant)
#: where they differ: with 32 rows per warp the unrolled per-element code (a tanh, a Philox draw
#: per score) spills past 255 registers at d = 64 (a user's variant) and d = 128, so one
#: 16-row tile per warp (Q's fragments in registers, 2 stages: 36 / 34 KiB)
FORWARD_MMA_MODS_TILES = {
    64: (4, 1, 64, 2, True),
    128: (4, 1, 32, 2, True),
}

#: the simulator's tiles: one warp (32 Python threads), two row tiles, 16 keys, 2 stages
FORWARD_MMA_SIM_TILES = (1, 2, 16, 2, True)


#: a row of the tile tables: the :class:`ForwardMmaConfig` fields it sets
ForwardMmaTiles = namedtuple("ForwardMmaTiles", "NUM_WARPS M_TILES BLOCK_N STAGES Q_IN_REGS")


def forward_mma_tiles(head_dim, simulator=None, mods=False):
    """The :data:`ForwardMmaTiles` of the tensor-core forward for head dim ``d`` (1..256) on
    this backend (:data:`FORWARD_MMA_TILES`, with ``mods`` (per-element work)
    :data:`FORWARD_MMA_MODS_TILES` where it has the head dim, :data:`FORWARD_MMA_SIM_TILES`)."""
    if simulator is None:
        simulator = on_simulator()
    if simulator:
        return ForwardMmaTiles(*FORWARD_MMA_SIM_TILES)
    hd = padded_head_dim(head_dim)
    return ForwardMmaTiles(*((FORWARD_MMA_MODS_TILES.get(hd) if mods else None)
                             or FORWARD_MMA_TILES[hd]))


def forward_mma_config(head_dim, dtype="float16", simulator=None, head_dim_v=None, **flags):
    """The :class:`ForwardMmaConfig` of a call (``flags``: ``DROPOUT``, ``SOFTCAP``, ``ALIBI``,
    ``VEC``, ``USER``).  ``head_dim_v``: a value head dim of its own (``OWN_V``): K and Q tiles
    ``HEAD_DIM`` = ``head_dim`` rounded up to 16 wide, V tiles and ``o``'s accumulator
    ``HEAD_DIM_V`` = ``head_dim_v`` rounded up to 16 (each shared budget its own width), with
    the tiles of ``head_dim_v``'s padded head dim (the accumulator's registers decide them)
    where they fit in 48 KiB and Q's fragments (``M_TILES HEAD_DIM / 4`` registers) stay within
    the d = 64 build's 32, else those of the
    larger of the two (DeepSeek's (192, 128): K 192 wide, V 128, the d = 128 tiles, 46 KiB)."""
    mods = any(flags.get(f) for f in ("DROPOUT", "SOFTCAP", "ALIBI", "USER"))
    if head_dim_v is None:
        tiles = forward_mma_tiles(head_dim, simulator, mods)
        return ForwardMmaConfig(**tiles._asdict(), HEAD_DIM=padded_head_dim(head_dim),
                                DTYPE=dtype, **flags)
    flags.update(OWN_V=True, HEAD_DIM_V=round16(head_dim_v))
    hd = round16(head_dim)
    for width in (head_dim_v, max(head_dim, head_dim_v)):
        tiles = forward_mma_tiles(width, simulator, mods)
        cfg = ForwardMmaConfig(**tiles._asdict(), HEAD_DIM=hd, DTYPE=dtype, **flags)
        if cfg.SMEM_BYTES <= SMEM_LIMIT and (tiles.Q_IN_REGS is False
                                             or tiles.M_TILES * hd <= 128):
            return cfg
    return cfg


# -- the warpgroup (wgmma) forward, sm_90a ---------------------------------------------------
#: shared memory of one Hopper block past the 48 KiB of a static array: dynamic, opted into at
#: launch (227 KiB on sm_90; the driver attribute ``MAX_DYNAMIC_SHARED_SIZE_BYTES``)
SMEM_LIMIT_SM90 = 227 * 1024

#: bytes of alignment slack: the swizzled tiles start on a 1024-byte shared address
#: (:func:`~numba_flash.kernels.ptx.wgmma.align_pad`), and dynamic shared memory promises 16
ARENA_SLACK = 1024


class WarpgroupBlock:
    """A block of ``WARPGROUPS`` warpgroups (the warpgroup forwards' configurations), each
    owning 64 query rows, a warp 16 of them."""

    @property
    def NUM_WARPS(self):
        """Warps of a block: 4 a warpgroup."""
        return 4 * self.WARPGROUPS

    @property
    def THREADS(self):
        """Threads of a block: 128 a warpgroup."""
        return 128 * self.WARPGROUPS

    @property
    def BLOCK_M(self):
        """Query rows of a block: 64 a warpgroup."""
        return 64 * self.WARPGROUPS


@kernel_config
class ForwardWgmmaConfig(WarpgroupBlock, TensorCoreConfig):
    """The warpgroup forward's kernel configuration (:mod:`numba_flash.kernels.forward.wgmma`).

    ``WARPGROUPS`` warpgroups of 128 threads, each owning 64 query rows (a warp 16 of them:
    the ``mma.sync`` fragment view with one row tile); ``BLOCK_N`` keys per K/V tile (the ``N``
    of ``S = Q K^T``'s ``wgmma``); ``HEAD_DIM`` 64 or 128 (``d`` zero-padded to it unless
    ``VEC``), every tile in the 128-byte swizzle; the element type and the variant flags as
    :class:`ForwardMmaConfig`.  Shared memory is dynamic (Q for the whole loop, then two
    stages of K and V: the pipeline's K and V buffers alternate by tile parity), past 48 KiB
    opted into at launch.  ``STRIDED``: ``q``, ``k``, ``v`` and ``o`` read and written through
    their own strides (as :class:`ForwardMmaConfig`'s)."""

    WARPGROUPS: int
    BLOCK_N: int
    OVERLAP: bool = True
    STRIDED: bool = False

    SWIZZLE = 128
    STAGES = 2   # K_j and K_{j+1}, V_{j-1} and V_j (kernels/forward/wgmma.py's pipeline)

    @property
    def Q_BYTES(self):
        """Q's tile (read by every ``S = Q K^T``: it keeps its region)."""
        return 2 * self.BLOCK_M * self.HEAD_DIM

    @property
    def TILE_BYTES(self):
        """One K (or V) tile."""
        return 2 * self.BLOCK_N * self.HEAD_DIM

    @property
    def SMEM_BYTES(self):
        """Dynamic shared memory of one block: Q, ``STAGES`` x (K, V), the alignment slack."""
        return self.Q_BYTES + 2 * self.STAGES * self.TILE_BYTES + ARENA_SLACK

    @property
    def name(self):
        """The compile tier's name: ``forward_wgmma WG2 M128 N128 D64 S2 [flags] float16``."""
        return (f"forward_wgmma WG{self.WARPGROUPS} M{self.BLOCK_M} N{self.BLOCK_N} "
                f"D{self.HEAD_DIM}{'' if self.OVERLAP else ' serial'}{self.flags_name} "
                f"{self.DTYPE}")


#: the warpgroup forward's head dims (the 128-byte swizzle takes rows of 64 elements; past 128
#: the output accumulator (``d / 2`` registers) and S's crowd 255 registers)
WGMMA_HEAD_DIMS = (64, 128)

#: its tiles on a GPU: ``(WARPGROUPS, BLOCK_N, OVERLAP)``.  Two warpgroups (128 rows) share each
#: K / V tile (half the copies per row).  ``OVERLAP``: FA3's intra-warpgroup overlap, tile
#: ``j``'s softmax under tile ``j - 1``'s ``P V`` (else both products are waited for before the
#: softmax; the other warpgroup's softmax fills the tensor cores).  255 registers a thread, one
#: block (8 warps) an SM.
#: d = 64: 192 keys (the fixed per-tile work over more flop: 785 instructions per 192 x 4096
#: flop, 4.09; 128 keys issued 577, 4.51), without the overlap (with it: 807, 4.20, the P of
#: the product in flight held through the softmax); 16 + 2 x 48 KiB = 112 KiB.  d = 128: 128
#: keys with the overlap (613 per 256 x 4096 flop, 2.39; without: 614); 32 + 2 x 64 = 160 KiB
FORWARD_WGMMA_TILES = {
    64: (2, 192, False),
    128: (2, 128, True),
}

#: the builds with per-element work (dropout, softcap, ALiBi, a user's variant) and the 16-bit
#: loads (no 16-byte copies): 64 keys a tile, a third of the unrolled per-score code of 192
#: (the 16-bit loads at 192 keys spilled 16 B)
FORWARD_WGMMA_MODS_TILES = {
    64: (2, 64, True),
    128: (2, 64, True),
}

#: the simulator's tiles: one warpgroup (128 Python threads), 16 keys, the overlap
FORWARD_WGMMA_SIM_TILES = (1, 16, True)


def wgmma_head_dim(head_dim):
    """The compile-time ``HEAD_DIM`` of the warpgroup forward for ``d`` (1..128)."""
    return next(h for h in WGMMA_HEAD_DIMS if h >= head_dim)


def forward_wgmma_config(head_dim, dtype="float16", simulator=None, **flags):
    """The :class:`ForwardWgmmaConfig` of a call (``head_dim`` 1..128; ``flags``: ``DROPOUT``,
    ``SOFTCAP``, ``ALIBI``, ``VEC``, ``USER``; per-element work or ``VEC=False`` take
    :data:`FORWARD_WGMMA_MODS_TILES`)."""
    if simulator is None:
        simulator = on_simulator()
    hd = wgmma_head_dim(head_dim)
    mods = (any(flags.get(f) for f in ("DROPOUT", "SOFTCAP", "ALIBI", "USER"))
            or flags.get("VEC") is False)
    if simulator:
        wg, bn, overlap = FORWARD_WGMMA_SIM_TILES
    else:
        wg, bn, overlap = (FORWARD_WGMMA_MODS_TILES if mods else FORWARD_WGMMA_TILES)[hd]
    return ForwardWgmmaConfig(WARPGROUPS=wg, BLOCK_N=bn, HEAD_DIM=hd, OVERLAP=overlap, DTYPE=dtype,
                              **flags)


# -- the fp8 (e4m3) forwards ------------------------------------------------------------------
@kernel_config
class Fp8ForwardOptions:
    """What both e4m3 forwards take beside their tiles: the output type ``OUT`` (``"bfloat16"``
    or ``"float16"``), the flags ``SOFTCAP``, ``ALIBI``, a user's variant ``USER`` and how
    ``P`` is packed (``P_OFFSET``, ``RESCALE``)."""

    OUT: str = "bfloat16"
    SOFTCAP: bool = False
    ALIBI: bool = False
    #: a user's variant: ``(score_mod, mask_mod, BLOCKS)`` device code (the 16-bit builds'
    #: ``USER``), or None
    USER: object = None
    #: P's exponent offset for the e4m3 cast: the largest P lands at 2**8 = 256 of 448,
    #: values down to 2**-13 keep e4m3's 3 mantissa bits (unscaled: down to 2**-6 only)
    P_OFFSET: int = 4
    #: the lazy rescale's threshold (log2): P <= 2**4 before the offset (FA4's fp8 fix,
    #: flash-attention #2694: 4 + 4 <= log2(448) = 8.8; the 16-bit forward's 8 would clip)
    RESCALE: float = 4.0

    @property
    def fp8_flags(self):
        """The name's flags: `` SOFTCAP ALIBI`` and the user's functions given."""
        flags = "".join(f" {f}" for f in ("SOFTCAP", "ALIBI") if getattr(self, f))
        if self.USER is not None:
            flags += "".join(f" {n}" for n, f in zip(("score_mod", "mask_mod", "block_mask"),
                                                     self.USER) if f is not None)
        return flags


# the e4m3 forward on mma.sync m16n8k32
@kernel_config
class ForwardFp8Config(Fp8ForwardOptions):
    """The e4m3 forward (:mod:`numba_flash.kernels.forward.fp8`): four warps of 16 query rows
    each (``BLOCK_M = 64``), ``BLOCK_N``-key tiles, ``HEAD_DIM`` (``d``, a multiple of 32: one
    ``m16n8k32`` k-step), the output type ``OUT`` (``"bfloat16"`` or ``"float16"``) and the
    flags ``SOFTCAP``, ``ALIBI``.  ``P`` is packed to e4m3 as ``P 2**P_OFFSET``, ``P`` itself at
    most ``2**RESCALE`` (the lazy rescale's threshold): ``RESCALE + P_OFFSET <= log2(448)``
    keeps every packed ``P`` finite and unsaturated.  ``STRIDED``: ``q``, ``k``, ``v`` and ``o``
    read and written through their own strides (as :class:`ForwardMmaConfig`'s)."""

    HEAD_DIM: int
    BLOCK_N: int = 64
    STRIDED: bool = False

    BLOCK_M = 64
    NUM_WARPS = 4
    THREADS = 128
    M_TILES = 1

    @property
    def Q_IN_REGS(self):
        """Q's fragments in registers up to d = 64 (8 a lane); past it read from shared memory
        each tile (the d = 128 build with Q in registers and 64-key tiles passed 255 registers
        and spilled on sm_90)."""
        return self.HEAD_DIM <= 64

    @property
    def ROW_BYTES(self):
        """Bytes of a shared Q or K row: ``d`` e4m3 bytes, padded by 16 (``ldmatrix`` rows in
        eight distinct 16-byte bank groups)."""
        return self.HEAD_DIM + 16

    @property
    def VT_ROW_BYTES(self):
        """Bytes of a shared row of ``V^T`` (one value column over the tile's keys)."""
        return self.BLOCK_N + 16

    @property
    def SMEM_BYTES(self):
        """The Q tile, the K tile, the ``V^T`` tile (no pipeline: one K/V tile at a time)."""
        return ((self.BLOCK_M + self.BLOCK_N) * self.ROW_BYTES
                + self.HEAD_DIM * self.VT_ROW_BYTES)

    @property
    def name(self):
        return (f"forward_fp8 W{self.NUM_WARPS} M{self.BLOCK_M} N{self.BLOCK_N} "
                f"D{self.HEAD_DIM} e4m3->{self.OUT}{self.fp8_flags}"
                f"{' strided' if self.STRIDED else ''}")


def forward_fp8_config(head_dim, out="bfloat16", **flags):
    """The :class:`ForwardFp8Config` of a call: 64-key tiles at d = 64 (15 KiB of shared
    memory), 32-key tiles past it (d = 128: 64 keys spilled with Q in registers; 32 keys, Q from
    shared memory, 168 registers on sm_89, 20 KiB; d = 256: 64 keys would need 2 x 64 x 272 +
    256 x 80 B = 55 KiB, past the 48 KiB static limit; 32: 38 KiB)."""
    return ForwardFp8Config(HEAD_DIM=head_dim, BLOCK_N=32 if head_dim > 64 else 64, OUT=out,
                            **flags)


# -- the fp8 (e4m3) forward on Hopper's wgmma -------------------------------------------------
@kernel_config
class ForwardWgmmaFp8Config(WarpgroupBlock, Fp8ForwardOptions):
    """The e4m3 warpgroup forward (:mod:`numba_flash.kernels.forward.wgmma_fp8`):
    ``WARPGROUPS`` warpgroups of 64 query rows, ``BLOCK_N``-key tiles, ``HEAD_DIM`` (64, 128 or
    256), the output type ``OUT`` and the flags ``SOFTCAP``, ``ALIBI``; ``P`` packed as
    :class:`ForwardFp8Config` packs it (``P_OFFSET``, ``RESCALE``).  Every tile is e4m3 bytes
    in a swizzled :class:`~numba_flash.kernels.ptx.wgmma.TileLayout` counted in byte pairs
    (a 32-byte ``k32`` step is a 16-bit ``k16`` step's bytes): Q and K K-major (rows of ``d``
    bytes), ``V^T`` K-major (``d`` rows of ``BLOCK_N`` bytes, keys in ``P``'s packing order).
    ``STRIDED``: ``q``, ``k``, ``v`` and ``o`` read and written through their own strides."""

    HEAD_DIM: int
    BLOCK_N: int = 128
    WARPGROUPS: int = 2
    STRIDED: bool = False

    STAGES = 2   # K_j and K_{j+1}, V^T_{j-1} and V^T_j (the 16-bit warpgroup forward's pipeline)

    @property
    def SWIZZLE_QK(self):
        """Q's and K's swizzle: their rows are ``d`` bytes (64 at d = 64, else 128)."""
        return min(128, self.HEAD_DIM)

    @property
    def SWIZZLE_VT(self):
        """``V^T``'s swizzle: its rows are ``BLOCK_N`` bytes (32, 64 or 128)."""
        return min(128, self.BLOCK_N)

    @property
    def Q_BYTES(self):
        return self.BLOCK_M * self.HEAD_DIM

    @property
    def TILE_BYTES(self):
        """One K tile, or one ``V^T`` tile (the same bytes, transposed)."""
        return self.BLOCK_N * self.HEAD_DIM

    @property
    def SMEM_BYTES(self):
        """Dynamic shared memory: Q, ``STAGES`` x (K, ``V^T``), the alignment slack."""
        return self.Q_BYTES + 2 * self.STAGES * self.TILE_BYTES + ARENA_SLACK

    @property
    def name(self):
        return (f"forward_wgmma_fp8 WG{self.WARPGROUPS} M{self.BLOCK_M} N{self.BLOCK_N} "
                f"D{self.HEAD_DIM} e4m3->{self.OUT}{self.fp8_flags}"
                f"{' strided' if self.STRIDED else ''}")


#: the e4m3 warpgroup forward's head dims (its tiles hold whole rows of d bytes)
WGMMA_FP8_HEAD_DIMS = (64, 128, 256)

#: its tiles on a GPU: ``BLOCK_N`` by head dim, two warpgroups (128 rows) sharing each K / V^T
#: tile.  64 and 128: 128 keys (S: 64 float32 a thread beside d / 2 of O; the V^T rows are one
#: 128-byte swizzle row); 256: 64 keys (O alone is 128 registers a thread: S at 128 keys would
#: pass 255).  Shared memory: d = 128 16 + 2 x (16 + 16) = 80 KiB; d = 256 32 + 2 x 32 = 96 KiB
FORWARD_WGMMA_FP8_TILES = {64: 128, 128: 128, 256: 32}

#: ... with softcap or ALiBi (per-score work beside S: more live registers a key)
FORWARD_WGMMA_FP8_MODS_TILES = {64: 64, 128: 64, 256: 32}

#: the simulator's tiles: one warpgroup (128 Python threads), 32 keys (one k32 step of P V)
FORWARD_WGMMA_FP8_SIM_TILES = (1, 32)


def forward_wgmma_fp8_config(head_dim, out="bfloat16", simulator=None, **flags):
    """The :class:`ForwardWgmmaFp8Config` of a call (``head_dim`` one of
    :data:`WGMMA_FP8_HEAD_DIMS`: the tiles hold whole rows, no padding)."""
    if simulator is None:
        simulator = on_simulator()
    if head_dim not in WGMMA_FP8_HEAD_DIMS:
        raise ValueError(f"head_dim: expected one of {WGMMA_FP8_HEAD_DIMS}, got {head_dim}")
    hd = head_dim
    mods = flags.get("SOFTCAP") or flags.get("ALIBI") or flags.get("USER") is not None
    wg, bn = FORWARD_WGMMA_FP8_SIM_TILES if simulator else (
        2, (FORWARD_WGMMA_FP8_MODS_TILES if mods else FORWARD_WGMMA_FP8_TILES)[hd])
    return ForwardWgmmaFp8Config(HEAD_DIM=hd, BLOCK_N=bn, WARPGROUPS=wg, OUT=out, **flags)
