"""Decode's kernel configurations: the split-KV decode (:class:`DecodeConfig`, the SM count its
split policy fills) and MLA's absorbed decode on tensor cores (:class:`MlaDecodeConfig`).
Shared limits and helpers: :mod:`numba_flash.kernels.core.config`.
"""

from __future__ import annotations

from ...backend import on_simulator
from ..core.config import KernelConfig, kernel_config, mma_row_bytes


# -- decode ----------------------------------------------------------------------------------
@kernel_config
class DecodeConfig(KernelConfig):
    """The split-KV decode kernel's configuration (:mod:`numba_flash.kernels.decode.split_kv`):
    blocks of ``THREADS`` threads in key groups of ``LANES`` lanes, each lane holding ``CHUNK``
    contiguous elements of a K/V row per 16-byte load; ``U`` keys per group step; ``ROWS`` query
    rows per block (its tile choice: :func:`numba_flash.kernels.decode.split_kv.launch_shape`); the
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
    VEC: bool = True
    PAGED: bool = True
    SOFTCAP: bool = False
    ALIBI: bool = False
    SPLIT_PAGES: bool = False
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


# -- MLA's absorbed decode on tensor cores ---------------------------------------------------
@kernel_config
class MlaDecodeConfig:
    """The tensor-core decode of one latent cache read as keys (``D_QK`` columns) and values
    (its first ``D_V``) (:mod:`numba_flash.kernels.decode.mla`): ``NUM_WARPS`` warps hold the
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
    THREADS = 32 * NUM_WARPS

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
    return MlaDecodeConfig(D_QK=d_qk, D_V=d_v, BLOCK_N=16, DTYPE=dtype)
