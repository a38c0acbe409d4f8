"""Kernel configurations and the tile choices (the analog of FA2's ``Kernel_traits`` and FA3's
``tile_size.h``): one named tuple per kernel family, its derived sizes as properties, and one
tile-choice function per family whose comments say which limit each choice hits.

A kernel factory takes its family's configuration (compile-time constants); the ops ask the
tile-choice function for the configuration of a call; the compile tier lists the
configurations the tile choices produce (``compile_configs()`` of each kernel module) and the
test suite selects among them by their fields, never by name
(:func:`numba_flash.compile_check.in_suite`).  So a new tile shape is one line here.

Limits the choices meet (per block, sm_80 and sm_90): static shared memory <= 48 KiB
(:data:`~numba_flash.kernels.common.SMEM_LIMIT`; no dynamic opt-in), no register spill and no
stack frame (the compile tier fails on either), 255 registers per thread.
"""

from __future__ import annotations

from typing import NamedTuple

from ..backend import on_simulator
from .common import SMEM_LIMIT, padded_head_dim

#: the 16-bit element types of the tensor-core kernels
MMA_DTYPES = ("float16", "bfloat16")


def mma_row_bytes(head_dim):
    """Bytes of one shared row of ``head_dim`` 16-bit elements, padded by 16 so that the 8 rows
    of an ``ldmatrix`` fall in 8 distinct 16-byte bank groups."""
    return 2 * head_dim + 16


def round16(head_dim):
    """``head_dim`` rounded up to a multiple of 16 (an ``mma`` k-step)."""
    return -(-head_dim // 16) * 16


#: properties of every tensor-core configuration: threads of a block (32 a warp) and the bytes
#: of a padded shared row; a V tile's width and row bytes (a value head dim of its own)
_THREADS = property(lambda cfg: 32 * cfg.NUM_WARPS, doc="Threads of a block: 32 a warp.")
_ROW_BYTES = property(lambda cfg: mma_row_bytes(cfg.HEAD_DIM), doc="Bytes of a shared row.")
_OWNED_ROWS = property(lambda cfg: 16 * cfg.M_TILES * cfg.NUM_WARPS,
                       doc="Rows a block owns: 16 per row tile of each warp.")
_V_DIM = property(lambda cfg: cfg.HEAD_DIM_V or cfg.HEAD_DIM,
                  doc="The V tile's (and dO's, o's, dV's) compile-time width: HEAD_DIM_V, or "
                      "HEAD_DIM.")
_V_ROW_BYTES = property(lambda cfg: mma_row_bytes(cfg.V_DIM), doc="Bytes of a shared V row.")


def _flags_name(cfg):
    """The compile tier's words for a tensor-core configuration's flags."""
    return "".join(f" {n}" for n, f in (("dropout", cfg.DROPOUT), ("softcap", cfg.SOFTCAP),
                                         ("alibi", cfg.ALIBI), ("ld16", not cfg.VEC),
                                         ("score_mod mask_mod block_mask",
                                          cfg.USER is not None),
                                         ("own d_v", getattr(cfg, "OWN_V", False))) if f)


# -- the tensor-core forward -----------------------------------------------------------------
class ForwardMmaConfig(NamedTuple):
    """The tensor-core forward's kernel configuration (:mod:`numba_flash.kernels.forward_mma`).

    ``NUM_WARPS`` warps, each owning ``M_TILES`` tiles of 16 query rows; ``BLOCK_N`` keys per
    K/V tile; ``STAGES`` K/V buffers (1: one K and one V buffer, V_j copied under ``Q K_j^T``
    and K_{j+1} under ``P V_j``, as FA2); ``Q_IN_REGS``: Q's ``A`` fragments stay in registers
    (else Q keeps a shared region and is read at every k-step); ``HEAD_DIM`` compile-time (``d``
    zero-padded to it unless ``VEC``); the element type and the compile-time variant flags;
    ``USER``: a user's ``(score_mod, mask_mod, BLOCKS)`` or None; ``OWN_V``: ``v`` (and ``o``)
    have a head dim of their own, ``d_v``, in V tiles ``HEAD_DIM_V`` wide (0: ``HEAD_DIM``;
    off, V shares K's addresses and width)."""

    NUM_WARPS: int
    M_TILES: int
    BLOCK_N: int
    HEAD_DIM: int
    STAGES: int = 2
    Q_IN_REGS: bool = True
    DTYPE: str = "float16"
    DROPOUT: bool = False
    SOFTCAP: bool = False
    ALIBI: bool = False
    VEC: bool = True
    USER: object = None
    OWN_V: bool = False
    HEAD_DIM_V: int = 0

    THREADS = _THREADS
    ROW_BYTES = _ROW_BYTES
    BLOCK_M = _OWNED_ROWS  # query rows of a block
    V_DIM = _V_DIM
    V_ROW_BYTES = _V_ROW_BYTES

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
                f"{dv} S{self.STAGES}{'' if self.Q_IN_REGS else ' Qsmem'}{_flags_name(self)} "
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


def forward_mma_tiles(head_dim, simulator=None, mods=False):
    """``(NUM_WARPS, M_TILES, BLOCK_N, STAGES, Q_IN_REGS)`` of the tensor-core forward for head
    dim ``d`` (1..256) on this backend (:data:`FORWARD_MMA_TILES`, with ``mods`` (per-element
    work) :data:`FORWARD_MMA_MODS_TILES` where it has the head dim,
    :data:`FORWARD_MMA_SIM_TILES`)."""
    if simulator is None:
        simulator = on_simulator()
    if simulator:
        return FORWARD_MMA_SIM_TILES
    hd = padded_head_dim(head_dim)
    return (FORWARD_MMA_MODS_TILES.get(hd) if mods else None) or FORWARD_MMA_TILES[hd]


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
        nw, mt, bn, stages, q_regs = forward_mma_tiles(head_dim, simulator, mods)
        return ForwardMmaConfig(nw, mt, bn, padded_head_dim(head_dim), stages, q_regs, dtype,
                                **flags)
    flags.update(OWN_V=True, HEAD_DIM_V=round16(head_dim_v))
    hd = round16(head_dim)
    for width in (head_dim_v, max(head_dim, head_dim_v)):
        nw, mt, bn, stages, q_regs = forward_mma_tiles(width, simulator, mods)
        cfg = ForwardMmaConfig(nw, mt, bn, hd, stages, q_regs, dtype, **flags)
        if cfg.SMEM_BYTES <= SMEM_LIMIT and (q_regs is False or mt * hd <= 128):
            return cfg
    return cfg


# -- the warpgroup (wgmma) forward, sm_90a ---------------------------------------------------
#: shared memory of one Hopper block past the 48 KiB of a static array: dynamic, opted into at
#: launch (227 KiB on sm_90; the driver attribute ``MAX_DYNAMIC_SHARED_SIZE_BYTES``)
SMEM_LIMIT_SM90 = 227 * 1024

#: bytes of alignment slack: the swizzled tiles start on a 1024-byte shared address
#: (:func:`~numba_flash.kernels.wgmma.align_pad`), and dynamic shared memory promises 16
ARENA_SLACK = 1024


class WgmmaForwardConfig(NamedTuple):
    """The warpgroup forward's kernel configuration (:mod:`numba_flash.kernels.forward_wgmma`).

    ``WARPGROUPS`` warpgroups of 128 threads, each owning 64 query rows (a warp 16 of them:
    the ``mma.sync`` fragment view with one row tile); ``BLOCK_N`` keys per K/V tile (the ``N``
    of ``S = Q K^T``'s ``wgmma``); ``HEAD_DIM`` 64 or 128 (``d`` zero-padded to it unless
    ``VEC``), every tile in the 128-byte swizzle; the element type and the variant flags as
    :class:`ForwardMmaConfig`.  Shared memory is dynamic (Q for the whole loop, then two
    stages of K and V: the pipeline's K and V buffers alternate by tile parity), past 48 KiB
    opted into at launch."""

    WARPGROUPS: int
    BLOCK_N: int
    HEAD_DIM: int
    OVERLAP: bool = True
    DTYPE: str = "float16"
    DROPOUT: bool = False
    SOFTCAP: bool = False
    ALIBI: bool = False
    VEC: bool = True
    USER: object = None

    SWIZZLE = 128
    STAGES = 2   # K_j and K_{j+1}, V_{j-1} and V_j (kernels/forward_wgmma.py's pipeline)

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
                f"D{self.HEAD_DIM}{'' if self.OVERLAP else ' serial'}{_flags_name(self)} "
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
WGMMA_FORWARD_TILES = {
    64: (2, 192, False),
    128: (2, 128, True),
}

#: the builds with per-element work (dropout, softcap, ALiBi, a user's variant) and the 16-bit
#: loads (no 16-byte copies): 64 keys a tile, a third of the unrolled per-score code of 192
#: (the 16-bit loads at 192 keys spilled 16 B)
WGMMA_FORWARD_MODS_TILES = {
    64: (2, 64, True),
    128: (2, 64, True),
}

#: the simulator's tiles: one warpgroup (128 Python threads), 16 keys, the overlap
WGMMA_FORWARD_SIM_TILES = (1, 16, True)


def wgmma_head_dim(head_dim):
    """The compile-time ``HEAD_DIM`` of the warpgroup forward for ``d`` (1..128)."""
    return next(h for h in WGMMA_HEAD_DIMS if h >= head_dim)


def wgmma_forward_config(head_dim, dtype="float16", simulator=None, **flags):
    """The :class:`WgmmaForwardConfig` of a call (``head_dim`` 1..128; ``flags``: ``DROPOUT``,
    ``SOFTCAP``, ``ALIBI``, ``VEC``, ``USER``; per-element work or ``VEC=False`` take
    :data:`WGMMA_FORWARD_MODS_TILES`)."""
    if simulator is None:
        simulator = on_simulator()
    hd = wgmma_head_dim(head_dim)
    mods = (any(flags.get(f) for f in ("DROPOUT", "SOFTCAP", "ALIBI", "USER"))
            or flags.get("VEC") is False)
    if simulator:
        wg, bn, overlap = WGMMA_FORWARD_SIM_TILES
    else:
        wg, bn, overlap = (WGMMA_FORWARD_MODS_TILES if mods else WGMMA_FORWARD_TILES)[hd]
    return WgmmaForwardConfig(wg, bn, hd, overlap, dtype, **flags)


# -- the tensor-core backward ----------------------------------------------------------------
class BackwardMmaConfig(NamedTuple):
    """The tensor-core backward's kernel configuration (:mod:`numba_flash.kernels.backward_mma`),
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
    (DeepSeek's (192, 128)) every tile column is its array's, as in a ``d_v = d`` build."""

    KIND: str
    NUM_WARPS: int
    M_TILES: int
    STEP: int
    HEAD_DIM: int
    STAGES: int = 2
    DTYPE: str = "float16"
    DROPOUT: bool = False
    SOFTCAP: bool = False
    ALIBI: bool = False
    VEC: bool = True
    USER: object = None
    WANT_DV: bool = True
    WANT_DK: bool = True
    DQ_ATOMIC: bool = True
    COL0: int = 0
    ACC_DIM: int = 0
    OWN_V: bool = False
    HEAD_DIM_V: int = 0
    PAD_COLS: bool = False

    THREADS = _THREADS
    ROW_BYTES = _ROW_BYTES
    BLOCK = _OWNED_ROWS  # rows a block owns: keys (dkdv) or queries (dq)
    V_DIM = _V_DIM
    V_ROW_BYTES = _V_ROW_BYTES

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
        flags = _flags_name(self)
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
    the pass of :func:`numba_flash.kernels.backward_mma.dkdv_passes`).  ``head_dim_v``: a value
    head dim of its own (``OWN_V``): Q and K tiles ``d`` rounded up to 16 wide, V and dO tiles
    ``d_v`` rounded up to 16 (``HEAD_DIM_V``), on the tiles of :func:`backward_mma_tiles`."""
    nw, mt, step, stages = backward_mma_tiles(head_dim, kind, simulator,
                                              flags.get("USER") is not None, head_dim_v)
    if head_dim_v is None:
        return BackwardMmaConfig(kind, nw, mt, step, padded_head_dim(head_dim), stages, dtype,
                                 **flags)
    return BackwardMmaConfig(kind, nw, mt, step, round16(head_dim), stages, dtype, OWN_V=True,
                             HEAD_DIM_V=round16(head_dim_v),
                             PAD_COLS=bool(head_dim % 16 or head_dim_v % 16), **flags)


# -- MLA's absorbed decode on tensor cores ---------------------------------------------------
class MlaDecodeConfig(NamedTuple):
    """The tensor-core decode of one latent cache read as keys (``D_QK`` columns) and values
    (its first ``D_V``) (:mod:`numba_flash.kernels.mla_decode`): ``NUM_WARPS`` warps hold the
    same 16 query heads; warp ``w`` computes ``S``'s share of k-steps ``w K_STEPS_W ..`` and
    accumulates ``o``'s columns ``w D_V / NUM_WARPS ..``; key tiles of ``BLOCK_N`` rows,
    ``STAGES`` of them in flight."""

    D_QK: int = 576
    D_V: int = 512
    BLOCK_N: int = 16
    DTYPE: str = "float16"

    #: tile n + 1 is copied under tile n's math (one stage would leave the copy unoverlapped;
    #: a third 16-key tile of 576 passes 48 KiB with the partial scores)
    STAGES = 2
    #: four warps: ``o``'s 16 x 512 float32 accumulator is 64 registers a lane split four
    #: ways (one warp: 256, past the 255-register file), and S's 36 k-steps of Q fragments
    #: are 36 registers a lane split four ways (all in one warp: 144)
    NUM_WARPS = 4
    M_TILES = 1
    THREADS = _THREADS

    @property
    def ROW_BYTES(self):
        """Bytes of a shared key row (:func:`mma_row_bytes` of ``D_QK``)."""
        return mma_row_bytes(self.D_QK)

    @property
    def K_STEPS_W(self):
        """A warp's k-steps of ``S = Q K^T`` (16 columns each)."""
        return self.D_QK // 16 // self.NUM_WARPS

    @property
    def V_COLS_W(self):
        """A warp's columns of ``o``."""
        return self.D_V // self.NUM_WARPS

    @property
    def SP_ROW(self):
        """Words of a row of a warp's partial ``S`` in shared memory: ``BLOCK_N + 8`` (a lane
        pair's 8-byte accesses of 4 rows of a half-warp fall in distinct banks)."""
        return self.BLOCK_N + 8

    @property
    def SMEM_BYTES(self):
        """``STAGES`` key tiles (Q is staged through the first before the loop), then the
        warps' partial ``S`` (float32, 16 rows each)."""
        return self.STAGES * self.BLOCK_N * self.ROW_BYTES + self.NUM_WARPS * 16 * self.SP_ROW * 4

    @property
    def name(self):
        return (f"mla_decode W{self.NUM_WARPS} N{self.BLOCK_N} D{self.D_QK}/{self.D_V} "
                f"S{self.STAGES} {self.DTYPE}")


def mla_decode_config(d_qk, d_v, dtype="float16"):
    """The :class:`MlaDecodeConfig` of a call: 16-key tiles, two in flight (2 x 16 x 1168 B of
    keys + 6 KiB of partial scores = 42.5 KiB at 576 / 512: 32-key tiles in two stages would
    pass the 48 KiB static limit, and one stage leaves the copy unoverlapped).  ``d_qk`` a
    multiple of 64 (16-column k-steps split four ways), ``d_v`` a multiple of 64 (16-column
    ``B`` pairs split four ways), ``d_v <= d_qk``."""
    return MlaDecodeConfig(d_qk, d_v, 16, dtype)


# -- the SIMT forward ------------------------------------------------------------------------
class ForwardConfig(NamedTuple):
    """The SIMT forward's kernel configuration (:mod:`numba_flash.kernels.forward`):
    ``BLOCK_M x BLOCK_N`` tiles of ``THREADS_M x THREADS_N`` threads (thread ``(tx, ty)`` owns
    rows ``ty + i THREADS_M`` and keys ``tx + j THREADS_N``), ``HEAD_DIM`` compile-time, the
    input ``DTYPE`` (a NumPy dtype name; float16 / bfloat16 compute in float32) and the
    compile-time flags: ``DROPOUT``, ``SCORE_MOD`` (softcap and ALiBi, switched at run time),
    ``VARLEN`` (packed sequences), ``PAGED`` (K/V through a block table, varlen only),
    ``USER`` (a user's ``(score_mod, mask_mod, BLOCKS)``), ``VEC`` (16-byte ``cp.async`` tile
    copies), ``OWN_V`` (``v`` has a head dim of its own, ``d_v``: V and ``o`` addressed at
    their width; off, V shares K's addresses, the build of every ``d_v == d`` call)."""

    BLOCK_M: int
    BLOCK_N: int
    HEAD_DIM: int
    DTYPE: str
    THREADS_M: int
    THREADS_N: int
    DROPOUT: bool = False
    SCORE_MOD: bool = False
    VARLEN: bool = False
    PAGED: bool = False
    USER: object = None
    VEC: bool = False
    OWN_V: bool = False

    @property
    def THREADS(self):
        return self.THREADS_M * self.THREADS_N

    @property
    def WORD(self):
        """Bytes of a compute element in the tiles: 8 for float64, else 4 (float32)."""
        return 8 if self.DTYPE == "float64" else 4


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
FORWARD_TILES = {
    4: {16: (64, 16, 16, 4), 32: (64, 32, 16, 8), 64: (64, 32, 16, 8), 128: (32, 16, 8, 8),
        256: (16, 8, 8, 8)},
    8: {16: (32, 16, 8, 8), 32: (32, 16, 8, 8), 64: (32, 16, 8, 8), 128: (16, 8, 8, 8),
        256: (4, 8, 4, 8)},
}
#: the score-modifier build's tiles where they differ (softcap / ALiBi, a user's variant, every
#: varlen build): none today (the plain build's d = 32 tiles are the ones this table held)
FORWARD_MODS_TILES = {}


def forward_tiles(head_dim, dtype, mods=False):
    """``(BLOCK_M, BLOCK_N, THREADS_M, THREADS_N)`` of the SIMT forward's GPU build for head dim
    ``d`` and input ``dtype`` (``mods``: the score-modifier build), from
    :data:`FORWARD_TILES` / :data:`FORWARD_MODS_TILES`."""
    import numpy as np

    word = 8 if np.dtype(dtype) == np.float64 else 4
    hd = padded_head_dim(head_dim)
    return (FORWARD_MODS_TILES.get(word, {}).get(hd) if mods else None) or FORWARD_TILES[word][hd]


# -- decode ----------------------------------------------------------------------------------
class DecodeConfig(NamedTuple):
    """The split-KV decode kernel's configuration (:mod:`numba_flash.kernels.decode`): blocks
    of ``THREADS`` threads in key groups of ``LANES`` lanes, each lane holding ``CHUNK``
    contiguous elements of a K/V row per 16-byte load; ``U`` keys per group step; ``ROWS`` query
    rows per block (its tile choice: :func:`numba_flash.kernels.decode.launch_shape`); the
    compile-time head dim, element type and flags: ``VEC`` (16-byte loads), ``PAGED`` (a block
    table), ``SOFTCAP``, ``ALIBI``, ``SPLIT_PAGES`` (a block size ``U`` does not divide),
    ``USER`` (a user's ``(score_mod, mask_mod)``), ``OWN_V`` (V read at a width of its own,
    ``d_v = o.shape[3]``: a ``v_cache [.., d_v]`` or MLA's latent cache read twice; off, the
    element loads test one bound for K and V)."""

    THREADS: int
    LANES: int
    CHUNK: int
    U: int
    ROWS: int
    HEAD_DIM: int
    DTYPE: str
    VEC: bool = True
    PAGED: bool = True
    SOFTCAP: bool = False
    ALIBI: bool = False
    SPLIT_PAGES: bool = False
    USER: object = None
    OWN_V: bool = False


#: the SM count of the GPU the docs' figures describe (an H200); a launch asks its own device
DEFAULT_SM_COUNT = 132


def sm_count():
    """Streaming multiprocessors of the current GPU (the split-KV policy fills them); in the
    simulator, and wherever the device cannot be asked, :data:`DEFAULT_SM_COUNT`."""
    if on_simulator():
        return DEFAULT_SM_COUNT
    try:
        from numba import cuda

        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # no driver (a CPU machine building PTX): the documented default
        return DEFAULT_SM_COUNT
