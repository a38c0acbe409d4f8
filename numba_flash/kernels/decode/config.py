"""Decode's kernel configurations: the split-KV decode (:class:`DecodeConfig` with its derived
sizes, its tile choice :func:`launch_shape` and split policy :func:`split_policy`, the SM count
that policy fills) and MLA's absorbed decode on tensor cores (:class:`MlaDecodeConfig`).
Shared limits and helpers: :mod:`numba_flash.kernels.core.config`.
"""

from __future__ import annotations

import numpy as np

from ...backend import on_simulator
from ..core.common import GRID_X_MAX, GRID_YZ_MAX
from ..core.elements import BFLOAT16
from ..core.config import KernelConfig, kernel_config, mma_row_bytes
from ..ptx.address import is_aligned


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
    element loads test one bound for K and V), ``KV_FP8`` (an e4m3 cache read as 32-bit
    words: 16 values per 16-byte load with ``VEC``, else 4 per word load with ``d`` and
    ``d_v`` multiples of 4, as MLA's 576-wide latent cache; widened in registers and scaled by
    the kernel's ``kv_descale``),
    ``GATHER`` (token-sparse: each query token's keys are the positions its index list gives,
    a block per token), ``SLOT_STRIDE`` (a page's consecutive slots are not consecutive rows of
    the cache's memory, as in a tokens-first cache ``[.., N, Hkv, d]``: the slot stride is the
    launch parameter's; off, it is one row, a constant: heads-first memory)."""

    VEC: bool = True
    PAGED: bool = True
    SOFTCAP: bool = False
    ALIBI: bool = False
    SPLIT_PAGES: bool = False
    OWN_V: bool = False
    KV_FP8: bool = False
    GATHER: bool = False
    SLOT_STRIDE: bool = False
    THREADS: int
    LANES: int
    CHUNK: int
    U: int
    ROWS: int

    # a lane's share of a K/V row, the block's steps and the reduce-scatter (decode/split_kv.py)
    @property
    def DPL(self):
        """Elements of a K/V row per lane."""
        return self.HEAD_DIM // self.LANES

    @property
    def NCH(self):
        """Chunks of ``CHUNK`` contiguous elements per lane."""
        return self.DPL // self.CHUNK

    @property
    def COL(self):
        """Element ``j`` of a lane is column ``lane * CHUNK + COL[j]``: chunk ``j // CHUNK`` of the
        lane starts ``LANES * CHUNK`` columns further per chunk (the group's lanes cover a row
        side by side)."""
        return tuple((j // self.CHUNK) * self.LANES * self.CHUNK + j % self.CHUNK
                     for j in range(self.DPL))

    @property
    def NG(self):
        """Key groups per block."""
        return self.THREADS // self.LANES

    @property
    def STEP(self):
        """Keys per block step (:func:`block_step`)."""
        return block_step(self.THREADS, self.LANES, self.U)

    @property
    def RD(self):
        """Per-lane q / accumulator registers (``ROWS * DPL``)."""
        return self.ROWS * self.DPL

    @property
    def UD(self):
        """Per-lane K (and V) registers of one step (``U * DPL``)."""
        return self.U * self.DPL

    @property
    def LOG_ROWS(self):
        return self.ROWS.bit_length() - 1

    @property
    def LOG_LANES(self):
        return self.LANES.bit_length() - 1

    @property
    def LANE_OF(self):
        """A lane that owns row ``r`` after the reduce-scatter (the row's bits as offset bits)."""
        return tuple(sum(self.LANES >> (i + 1) for i in range(self.LOG_ROWS)
                         if r & (self.ROWS >> (i + 1))) for r in range(self.ROWS))

    @property
    def BF16_PAIRS(self):
        """bfloat16 with 16-byte loads: the caches come as float32 views (two bfloat16 words per
        float32 element, :func:`~numba_flash.kernels.decode.split_kv.cache_views`), so
        ``load16`` reads 8 of them as 4 float32 whose bits are split: low word ``bits << 16``,
        high word ``bits & 0xFFFF0000`` (both exact)."""
        return self.VEC and self.DTYPE == "bfloat16" and not self.KV_FP8

    @property
    def EW(self):
        """Cache elements per element of the kernel's view (2: :attr:`BF16_PAIRS`; 4: an e4m3
        cache read as float32 words)."""
        return 4 if self.KV_FP8 else 2 if self.BF16_PAIRS else 1

    @property
    def Q_VEC(self):
        """q read by ``load16`` (bfloat16 q, or q beside an e4m3 cache, whose chunks are 16
        elements: element loads, in the prologue only)."""
        return self.VEC and not self.BF16_PAIRS and not self.KV_FP8

    @property
    def V4(self):
        """q values (compute type) per 16-byte shared load: 4 float32, 2 float64."""
        return CHUNK_BYTES // (8 if self.DTYPE == "float64" else 4)

    @property
    def QP(self):
        """16-byte pieces of q per lane and row."""
        return -(-self.DPL // self.V4)

    @property
    def Q_WORDS(self):
        """Compute-type words of ``q_sh``."""
        return self.ROWS * self.QP * self.LANES * self.V4

    @property
    def USER_FN(self):
        """A user's ``score_mod`` or ``mask_mod`` is there (either may hide a key)."""
        return self.USER is not None and (self.USER[0] is not None or self.USER[1] is not None)


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


# -- decode's tile choice and split policy -----------------------------------------------
#: GPU block: 4 warps.  A key group is the ``HEAD_DIM / CHUNK`` lanes (at most 32) that hold one
#: K/V row: 16 at float16 ``HEAD_DIM = 128``, so a warp reads two keys per load instruction.
GPU_THREADS = 128
#: keys a key group takes per step (loads of several keys in flight per warp)
GPU_KEYS_PER_STEP = 2
#: bytes one lane loads per chunk: one ``ld.global.nc.v4.u32`` (:func:`~.stages.load16`)
CHUNK_BYTES = 16
#: per-lane registers for q and for the accumulator (``ROWS * DPL`` values each) the GPU row
#: cap keeps (float64: values of two registers, half as many); see :func:`gpu_rows_max`
GPU_ROW_REGS = 32
#: simulator block: every CUDA thread is a Python thread, keep them few; 4 lanes per key group
#: so that shuffles, several elements per lane and several key groups are all exercised.
SIM_THREADS = 8
SIM_LANES = 4
SIM_KEYS_PER_STEP = 2
#: rows per block in the simulator (the GPU's come from :func:`gpu_rows_max`); kept as
#: ``SIM_BLOCK_M`` for the I/O model of docs/io-complexity.md.
SIM_ROWS_MAX = 4
SIM_BLOCK_M = SIM_ROWS_MAX
#: row counts a kernel is compiled for (the smallest that holds ``G * Nq`` is used)
ROW_CHOICES = (1, 2, 4, 8)
#: streaming multiprocessors the docs' split counts assume (H100 SXM / H200: 132); a launch
#: fills its own device's (:func:`~numba_flash.kernels.decode.config.sm_count`)
SM_COUNT = DEFAULT_SM_COUNT
#: blocks per SM the default split count aims at when the batch alone does not fill the GPU
TARGET_BLOCKS_PER_SM = 4
#: smallest split by default: enough keys per block to amortise its partial state
GPU_MIN_SPLIT_TOKENS = 256
SIM_MIN_SPLIT_TOKENS = 16
DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), BFLOAT16)


def padded_head_dim(d):
    """The compiled head dim for ``d``: the next power of two, at least 16 on the GPU (one of
    ``kernels.common.HEAD_DIMS``) and at least 2 in the simulator (where every padded lane
    costs time)."""
    return max(2 if on_simulator() else 16, 1 << (int(d) - 1).bit_length())


def lane_layout(dtype, HEAD_DIM, simulator=None):
    """``(LANES, CHUNK)``: lanes per key group and contiguous elements per lane chunk.  On the
    GPU a chunk is 16 bytes (8 float16, 4 float32, 2 float64) and a group has ``HEAD_DIM /
    CHUNK`` lanes, at most 32 (then each lane holds several chunks, ``LANES * CHUNK`` columns
    apart).  The simulator keeps ``SIM_LANES`` lanes and a chunk of at most 16 bytes
    (``HEAD_DIM / SIM_LANES`` elements when that is fewer: element loads, not 16-byte ones);
    a 1-byte element (an e4m3 cache, read 16 bytes or 4 at a time) keeps whole chunks there
    too."""
    if simulator is None:
        simulator = on_simulator()
    full = CHUNK_BYTES // np.dtype(dtype).itemsize
    if simulator and np.dtype(dtype).itemsize == 1 and HEAD_DIM >= full:
        return max(1, min(SIM_LANES, HEAD_DIM // full)), full
    if simulator:
        lanes = min(SIM_LANES, HEAD_DIM)
        return lanes, min(full, HEAD_DIM // lanes)
    chunk = min(full, HEAD_DIM)
    return min(32, HEAD_DIM // chunk), chunk


def vector_loads(dtype, d, HEAD_DIM, CHUNK, *arrays):
    """The ``VEC`` build (16-byte loads, no per-element test): ``d == HEAD_DIM``, a chunk of 16
    bytes and every array's data 16-byte aligned (rows then are too; checked in the simulator
    too)."""
    if d != HEAD_DIM or CHUNK * np.dtype(dtype).itemsize != CHUNK_BYTES:
        return False
    return aligned_to(CHUNK_BYTES, *arrays)


def aligned_to(n_bytes, *arrays):
    """Every device array's data ``n_bytes``-aligned: the real pointers, in the simulator too
    (its twins raise :class:`~numba_flash.kernels.ptx.address.MisalignedAddressError` where a
    GPU faults)."""
    return is_aligned(n_bytes, *arrays)


def gpu_rows_max(dtype, HEAD_DIM):
    """Most query rows per GPU block: at most ``LANES`` (the reduce-scatter gives each row a
    lane), 8, and ``GPU_ROW_REGS // DPL`` (half for float64) so that the per-lane q and
    accumulator (``ROWS * DPL`` values each) stay in registers: float16 4 rows from ``HEAD_DIM
    = 32`` to 256 (2 at 16), float32 8 up to 128 and 4 at 256, float64 4.  Checked with ptxas
    (docs/resources.md): past these, LLVM stops unrolling the row loops or ptxas spills."""
    lanes, _ = lane_layout(dtype, HEAD_DIM, simulator=False)
    dpl = HEAD_DIM // lanes
    regs = GPU_ROW_REGS // (2 if np.dtype(dtype) == np.float64 else 1)
    return max(1, min(8, lanes, regs // dpl))


def gpu_min_blocks(dtype, HEAD_DIM):
    """Resident blocks per SM the GPU kernel is compiled for (``launch_bounds``): 3 (at most
    168 registers per thread: two keys of 8 elements per lane in flight, K and V, beside 4
    rows of accumulators) for float16/float32 up to ``HEAD_DIM = 128``, softcap / ALiBi
    included; else 2 (up to 255: ``HEAD_DIM = 256`` and float64 need more)."""
    if np.dtype(dtype) == np.float64 or HEAD_DIM > 128:
        return 2
    return 3


def keys_per_step(rows, dpl):
    """``U``: 2 keys per group step (two K/V rows of each group in flight); 1 when the
    accumulator registers (``rows * dpl``) are over 32, or a lane holds more than 16 elements
    of a row (the 1024-wide MLA build: two keys' K and V, 128 registers, went to a 544 B
    stack), where 2 would not fit the registers."""
    return 1 if rows * dpl > 32 or dpl > 16 else GPU_KEYS_PER_STEP


def launch_shape(dtype, HEAD_DIM, n_rows, simulator=None, **flags):
    """The tile choice: the :class:`~numba_flash.kernels.decode.config.DecodeConfig` for a group of
    ``n_rows = G * Nq`` query rows (``flags``: ``VEC``, ``PAGED``, ``SOFTCAP``, ``ALIBI``,
    ``SPLIT_PAGES``, ``USER``, ``KV_FP8``): lanes and chunks of :func:`lane_layout` (of the
    cache's element: one byte with ``KV_FP8``), the fewest of :data:`ROW_CHOICES` rows that hold
    ``n_rows`` (at most :func:`gpu_rows_max`: registers), :func:`keys_per_step` keys per
    step."""
    if simulator is None:
        simulator = on_simulator()
    cache_dtype = np.uint8 if flags.get("KV_FP8") else dtype
    lanes, chunk = lane_layout(cache_dtype, HEAD_DIM, simulator)
    name = np.dtype(dtype).name
    if simulator:
        rows_max = min(SIM_ROWS_MAX, lanes)
        rows = next((r for r in ROW_CHOICES if r >= n_rows and r <= rows_max), rows_max)
        return DecodeConfig(THREADS=SIM_THREADS, LANES=lanes, CHUNK=chunk, U=SIM_KEYS_PER_STEP,
                            ROWS=rows, HEAD_DIM=HEAD_DIM, DTYPE=name, **flags)
    rows_max = gpu_rows_max(cache_dtype, HEAD_DIM)
    rows = next((r for r in ROW_CHOICES if r >= n_rows and r <= rows_max), rows_max)
    return DecodeConfig(THREADS=GPU_THREADS, LANES=lanes, CHUNK=chunk,
                        U=keys_per_step(rows, HEAD_DIM // lanes), ROWS=rows, HEAD_DIM=HEAD_DIM,
                        DTYPE=name, **flags)


def split_policy(num_splits, hkv, step):
    """``(split_target, split_min)`` (runtime ints of the kernel; see the module docstring);
    ``step`` is the kernel's ``STEP`` (keys per block step, :func:`block_step`).

    ``num_splits=None``: enough splits that one sequence fills the GPU,
    ``cdiv(SMs * TARGET_BLOCKS_PER_SM, Hkv)`` (``SMs``: the device's,
    :func:`~numba_flash.kernels.decode.config.sm_count`), of at least ``GPU_MIN_SPLIT_TOKENS`` keys
    (the simulator: splits of 16 keys).  The batch size is deliberately not an input: a split
    count from ``B`` would make one sequence's bits depend on what else is in the batch.
    ``num_splits=S``: ``S`` splits of equal size (a multiple of ``step``), so fewer when the
    sequence has fewer key tiles of ``step`` keys than ``S``.
    """
    sim = on_simulator()
    if num_splits is None:
        if sim:
            return GRID_YZ_MAX, SIM_MIN_SPLIT_TOKENS
        return -(-sm_count() * TARGET_BLOCKS_PER_SM // hkv), GPU_MIN_SPLIT_TOKENS
    return min(int(num_splits), GRID_YZ_MAX), step


def split_size(n_keys, split_target, split_min, step):
    """Keys per split for a sequence whose query rows see ``n_keys`` keys: the kernel's formula
    (module docstring), on the host."""
    size = max(split_min, -(-n_keys // split_target))
    return -(-size // step) * step


def gpu_splits(n_keys, hkv, num_splits=None, dtype=np.float16, HEAD_DIM=128, n_rows=1):
    """``(splits, size)`` a GPU launch uses for one sequence of ``n_keys`` visible keys (the
    docs' and the benchmark's tables; the same constants as a launch on the GPU)."""
    lanes, _ = lane_layout(dtype, HEAD_DIM, simulator=False)
    rows = next((r for r in ROW_CHOICES if r >= n_rows and r <= gpu_rows_max(dtype, HEAD_DIM)),
                gpu_rows_max(dtype, HEAD_DIM))
    step = block_step(GPU_THREADS, lanes, keys_per_step(rows, HEAD_DIM // lanes))
    if num_splits is None:
        target, smin = -(-SM_COUNT * TARGET_BLOCKS_PER_SM // hkv), GPU_MIN_SPLIT_TOKENS
    else:
        target, smin = min(int(num_splits), GRID_YZ_MAX), step
    size = split_size(n_keys, target, smin, step)
    return -(-n_keys // size), size


def block_step(THREADS, LANES, U):
    """``STEP``: keys a block covers per step (``NG * U``)."""
    return THREADS // LANES * U


def split_grid(split_target, split_min, capacity):
    """Splits in the grid: at most ``split_target`` and no more than the capacity has
    ``split_min``-key pieces (so a huge ``num_splits`` is clamped to the key tiles that exist)."""
    return max(1, min(split_target, -(-int(capacity) // split_min), GRID_YZ_MAX))


def decode_grid(b, hkv, chunks, splits):
    """``(x, y)`` grid of the decode kernel; checked against CUDA's limits (a CPU test runs it
    with ``B * Hkv`` past 65535)."""
    x = int(b) * int(hkv) * int(chunks)
    if x > GRID_X_MAX:
        raise ValueError(f"q: expected B * Hkv * row chunks (times Nq with kv_indices) <= "
                         f"{GRID_X_MAX} (the CUDA grid's x limit), got {b} * {hkv} * {chunks} "
                         f"= {x}")
    if not 1 <= splits <= GRID_YZ_MAX:
        raise ValueError(f"num_splits: expected 1..{GRID_YZ_MAX} splits in the grid, got {splits}")
    return (x, int(splits))


def launch_bounds(THREADS, dtype, HEAD_DIM):
    """``(max threads per block, min resident blocks per SM)`` of the kernel (``kernel_jit``
    drops it in the simulator)."""
    return (THREADS, gpu_min_blocks(dtype, HEAD_DIM))


# -- MLA's absorbed decode on tensor cores (and a cache with values of its own) ------------
@kernel_config
class MlaDecodeConfig:
    """The tensor-core decode of one latent cache read as keys (``D_QK`` columns) and values
    (its first ``D_V``), or with ``OWN_V`` of a key cache and a value cache of its own
    (:mod:`numba_flash.kernels.decode.mla`): ``NUM_WARPS`` warps hold the same 16 query heads;
    warp ``w`` computes ``S``'s share of k-steps ``w K_STEPS_W ..`` and accumulates ``o``'s
    columns ``w D_V / NUM_WARPS ..``; key tiles of ``BLOCK_N`` rows, ``STAGES`` of them in
    flight."""

    D_QK: int = 576
    D_V: int = 512
    BLOCK_N: int = 16
    DTYPE: str = "float16"
    #: token-sparse: a tile's keys are ``BLOCK_N`` entries of the query token's list, each row
    #: found through its own page (:mod:`numba_flash.kernels.decode.mla`)
    GATHER: bool = False
    #: the values are rows of a cache of their own, ``D_V`` wide (GQA's K and V caches, the
    #: token-sparse forward's ``k`` and ``v``): a stage holds a V tile after its K tile
    OWN_V: bool = False
    #: the warps sharing a block's 16 rows (:func:`mla_decode_config` picks it by the head dims)
    NUM_WARPS: int = 4
    #: an e4m3 latent cache (not with ``OWN_V``): the stages hold the tiles' bytes
    #: (``cp.async``), widened after each tile lands into one 16-bit tile the GEMMs read
    KV_FP8: bool = False
    #: ``q`` read and ``o`` written through their element strides (views whose last dim is
    #: contiguous: flash-attn's ``[B, Nq, H, d]`` memory as ``[B, H, Nq, d]``, a head slice),
    #: in the prologue and the epilogue only; off, C-contiguous ``q`` and a flat ``o``
    STRIDED: bool = False

    #: tile n + 1 is copied under tile n's math (one stage would leave the copy unoverlapped;
    #: a third 16-key tile of 576 passes 48 KiB with the partial scores)
    STAGES = 2
    M_TILES = 1

    @property
    def THREADS(self):
        return 32 * self.NUM_WARPS

    @property
    def ROW_BYTES(self):
        """Bytes of a shared key row (:func:`mma_row_bytes` of ``D_QK``)."""
        return mma_row_bytes(self.D_QK)

    @property
    def V_ROW_BYTES(self):
        """Bytes of a shared value row: ``OWN_V``: :func:`mma_row_bytes` of ``D_V``; else the
        key row (the values are its first ``D_V`` columns)."""
        return mma_row_bytes(self.D_V) if self.OWN_V else self.ROW_BYTES

    @property
    def V_TILE(self):
        """The V tile's byte offset in its stage: after the K tile (``OWN_V``), else 0 (the
        values are the key rows)."""
        return self.BLOCK_N * self.ROW_BYTES if self.OWN_V else 0

    @property
    def STAGE_BYTES(self):
        """Bytes of a stage: the K tile, then (``OWN_V``) the V tile; ``KV_FP8``: the K tile's
        e4m3 bytes (``D_QK`` a row, unpadded: only the widening reads them)."""
        if self.KV_FP8:
            return self.BLOCK_N * self.D_QK
        return self.BLOCK_N * (self.ROW_BYTES + (self.V_ROW_BYTES if self.OWN_V else 0))

    @property
    def WIDE_BYTES(self):
        """``KV_FP8``: the one 16-bit key tile the stages are widened into, before the stages
        (Q is staged through it before the loop); else 0 (the GEMMs read the stages)."""
        return self.BLOCK_N * self.ROW_BYTES if self.KV_FP8 else 0

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
        """``KV_FP8``'s widened 16-bit tile (:attr:`WIDE_BYTES`), ``STAGES`` stages (Q is staged
        through the first shared bytes before the loop), then the warps' partial ``S``
        (float32, 16 rows each; one warp: none)."""
        sp = self.NUM_WARPS * 16 * self.SP_ROW * 4 if self.NUM_WARPS > 1 else 4
        return self.WIDE_BYTES + self.STAGES * self.STAGE_BYTES + sp

    @property
    def name(self):
        return (f"mla_decode W{self.NUM_WARPS} N{self.BLOCK_N} D{self.D_QK}/{self.D_V} "
                f"S{self.STAGES} {self.DTYPE}{' own_v' if self.OWN_V else ''}"
                f"{' kv_indices' if self.GATHER else ''}{' e4m3 cache' if self.KV_FP8 else ''}"
                f"{' strided' if self.STRIDED else ''}")


def mla_decode_config(d_qk, d_v, dtype="float16", gather=False, own_v=False, kv_fp8=False):
    """The :class:`MlaDecodeConfig` of a call: four warps and 16-key tiles, two in flight (2 x
    16 x 1168 B of keys + 6 KiB of partial scores = 42.5 KiB at 576 / 512: 32-key tiles in two
    stages would pass the 48 KiB static limit, and one stage leaves the copy unoverlapped;
    ``own_v`` with ``d_qk = d_v = 256``: 2 x 16 x (528 + 528) B + 6 KiB = 39 KiB); one warp
    and 32-key tiles up to 128 / 128.  ``d_qk`` a multiple of 64
    (16-column k-steps split four ways), ``d_v`` a multiple of 64 (16-column ``B`` pairs split
    four ways), ``d_v <= d_qk`` for a latent cache, both at most 256 with ``own_v``."""
    # warps: a lane holds 16 D_V / (32 W) accumulator floats and D_QK / (4 W) registers of Q
    # fragments; four at 576 / 512 (one warp: 256 + 144, past the 255-register file), one up
    # to 128 / 128 (64 + 32: no partial-S exchange, no softmax repeated in four warps; 245
    # SASS a 16-key tile at four warps, 258 at one: the issue bound 140 -> 531 TFLOP/s)
    warps = 1 if max(d_qk, d_v) <= 128 else 4
    # one warp: 32-key tiles (the per-tile copy set-up, barrier and softmax over twice the
    # keys: 368 SASS for 64 mma, the mma.sync ceiling; 2 x 32 x 544 B = 34 KiB at 128 / 128)
    block_n = 32 if warps == 1 else 16
    # kv_fp8 (a latent cache): one 16-bit tile (18.3 KiB at 576) + two stages of bytes (2 x 9
    # KiB) + the partial scores (6 KiB) = 42.5 KiB, as the 16-bit build's two 16-bit stages
    assert not (kv_fp8 and own_v), "an e4m3 cache on tensor cores: MLA's latent one"
    return MlaDecodeConfig(D_QK=d_qk, D_V=d_v, BLOCK_N=block_n, DTYPE=dtype, GATHER=gather,
                           OWN_V=own_v, NUM_WARPS=warps, KV_FP8=kv_fp8)
