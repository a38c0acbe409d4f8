"""FlashAttention forward on tensor cores: float16 or bfloat16 ``Q K^T`` and ``P V`` on
``mma.sync.m16n8k16``, composed of the mainloop stages.

Contract (the SIMT forward's, :func:`numba_flash.reference.attention`): per ``(b, h)`` and query
row ``i``, ``o_i = softmax(s_i) V`` and ``lse_i = log sum_j exp(s_ij)`` (natural log) over the keys
the row sees (:mod:`numba_flash.kernels.mainloop.visibility`), ``s = scale q . k`` through softcap,
ALiBi and a user's ``score_mod``; a row that sees no key gets ``o = 0``, ``lse = -inf``; a NaN or
inf in ``q`` or in a key the row sees makes ``o`` and ``lse`` NaN, a non-finite ``v[j, c]`` of a
key it sees makes ``o[i, c]`` NaN.  Dropout multiplies the ``P`` of ``P V`` by ``keep / (1 - p)``
(``lse`` stays undropped), ``keep`` the Philox draw of :func:`numba_flash.dropout_mask`.  ``Q K^T``
and ``P V`` take 16-bit operands and accumulate in float32 (``P`` rounded to the input type, as
flash-attn); the softmax is float32.

:func:`forward_mma_kernel` ``(cfg)`` builds ``kernel(q, k, v, o, lse, va)`` for a
:class:`~numba_flash.kernels.forward.config.ForwardMmaConfig` (tiles:
:data:`~numba_flash.kernels.forward.config.FORWARD_MMA_TILES`): ``NUM_WARPS`` warps, warp ``w``
owning the ``M_TILES`` 16-row tiles from row ``16 M_TILES w``; ``BLOCK_N`` keys a K/V tile;
``STAGES`` K/V buffers; ``Q_IN_REGS``; ``HEAD_DIM`` (``d`` rounded up to 16); ``DTYPE``; the flags
``DROPOUT``, ``SOFTCAP``, ``ALIBI``, ``VEC`` (16-byte ``cp.async`` copies, else 16-bit loads),
``USER``, ``OWN_V``.  ``q``, ``k``, ``v`` are uint16 views of ``[B, H(kv), N, d]``, ``o`` and
``lse`` flat views (bfloat16 ``o``: its uint16 words).  Grid ``(ceil(Nq / BLOCK_M) B H,)``
(:func:`forward_grid`, Q tiles fastest), block ``32 NUM_WARPS`` threads; lane ``(g, t)`` holds rows
``g + 8 h + 16 mt`` of its tiles and keys / columns ``8 n + 2 t (+1)``
(:mod:`~numba_flash.kernels.mainloop.warp_gemm`).  Shared memory: one static ``uint32`` arena,
``STAGES`` x (K tile, V tile) of rows of ``2 HEAD_DIM + 16`` bytes (V ``2 HEAD_DIM_V + 16``), Q in
the last stage (one stage: V's buffer) until its fragments are in registers, else in a region of
its own; at most 48 KiB.

The per-tile step (FA4's ``compute_one_n_block``) is the stages in order:
:func:`~numba_flash.kernels.mainloop.warp_gemm.make_gemm` ``S = Q K^T``,
:func:`~numba_flash.kernels.mainloop.tile_scores.make_tile_scores` (masked or unmasked build),
:func:`~numba_flash.kernels.mainloop.online_softmax.make_online_softmax`, dropout on ``P``, ``acc
+= P V`` (``P`` from the ``S`` registers); the epilogue (``make_epilogue``) writes ``o = acc / l``
and ``lse``.

File: the launch helpers (:func:`vector_copies`, :func:`forward_grid`), the block's coordinates
(:class:`ForwardBlock`), the row stages (scores, softmax, dropout, non-finite ``v``), the kernel
factory (pipeline, step, tile walk, epilogue), the compile tier's entries.  The fragments, the
pipeline's waits and barriers, the non-finite rule and the measured figures: docs/tensor-cores.md.
"""

from __future__ import annotations

import functools
from collections import namedtuple
from typing import NamedTuple

from numba import cuda, float32, int32, int64, types, uint32, uint64

from ...backend import on_simulator
from ...philox import philox_keep_bits4
from ..core.common import GRID_X_MAX, SMEM_LIMIT, make_elem_strides
from ..core.elements import element_ops
from ..core.jit import device_jit, kernel_jit, static_for
from ..mainloop.online_softmax import (
    RESCALE_LOG2, EpilogueRows, make_epilogue, make_online_softmax, sink_of,
)
from ..ptx.address import is_aligned
from ..ptx.stages import (
    SHARED_ALIGN,
    EXP_BITS, LOG2E, cp_async_commit, cp_async_wait, make_row_stride, make_tile_copy,
    make_tile_copy_at,
    make_tile_scan,
)
from ..mainloop.tile_scores import make_score_args, make_score_fn, make_tile_scores_pair
from ..mainloop.tile_walk import KvWalk, make_kv_walk
from .config import FORWARD_MMA_TILES, ForwardMmaConfig, forward_mma_config, forward_mma_tiles
from ..core.config import MMA_DTYPES
from ..core.variant import variant_type
from ..mainloop.visibility import key_bounds, make_tile_span
from ..mainloop.warp_gemm import (
    ACC_COLS, ACC_ROWS, KIND_A, KIND_B, lane_offset, make_gemm, make_load_a, make_nan_columns,
)

__all__ = ["MMA_DTYPES", "ForwardMmaConfig", "forward_mma_config", "forward_mma_tiles",
           "forward_grid", "ForwardBlock", "make_forward_block", "forward_mma_kernel",
           "vector_copies"]

_stage = functools.partial(device_jit, own_module=True, inline=True)


def vector_copies(d, head_dim, *arrays, d_v=None):
    """The ``VEC`` build: ``d == head_dim`` and every array's data 16-byte aligned (the
    ``cp.async`` path), checked on the real pointers in the simulator too (where the twins
    raise :class:`~numba_flash.kernels.ptx.address.MisalignedAddressError` as the GPU faults):
    an offset view takes the element-wise build.  With a value head dim of its own (``d_v``,
    ``OWN_V``): ``d`` and ``d_v`` multiples of 8 (16-byte chunks, the rest of ``head_dim``
    zero-filled: :func:`~numba_flash.kernels.ptx.stages.make_tile_copy`'s ``PAD``).  ``arrays``:
    device arrays, or (simulator) NumPy arrays the kernel will read at their own address."""
    if d_v is not None and d_v != d:
        if d % 8 or d_v % 8:
            return False
    elif d != head_dim:
        return False
    return is_aligned(16, *arrays)


def forward_grid(nq, b, h, block_m):
    """The 1-D launch grid: ``ceil(Nq / BLOCK_M) * B * H`` blocks (ValueError past 2**31 - 1)."""
    n = -(-nq // block_m) * b * h
    if n > GRID_X_MAX:
        raise ValueError(f"q: {n} blocks of {block_m} query rows exceed the grid limit "
                         f"{GRID_X_MAX} (B * H * ceil(Nq / {block_m}))")
    return (max(1, n),)


#: the row stages' contexts (:func:`make_row_stages`): dropout's rows, and the rows a
#: non-finite ``v`` element's key marks
DropoutRows = namedtuple("DropoutRows", "s va sa row0 key0 nk")
MarkRows = namedtuple("MarkRows", "row_bad cols key row0 sa bounds umask")
#: the mma forward's step context: shared memory, the variant and score arguments; the K/V
#: inputs; the lane's register arrays; its coordinates, shared offsets and exponent factor
ForwardMmaStep = namedtuple("ForwardMmaStep", "smem va sa k v kv_base nk d hk bounds v_at "
                            "qf s acc m_i l_i tid t row0 q_a k_b v_b exp_scale")


class ForwardBlock(NamedTuple):
    """What one lane of a tensor-core forward block works on (:func:`make_forward_block`): its
    ``warp``, ``lane`` and fragment coordinates ``g = lane >> 2`` (rows ``g``, ``g + 8`` of each
    16-row tile) and ``t = lane & 3`` (key / column pair ``2t, 2t + 1``); the block's ``bh = b
    H + h`` (batch ``b``, head ``h``), the kv head ``hk`` it reads (GQA), its query rows
    ``[q_start, q_end)`` of ``nq``, ``nk`` keys of head dim ``d``, ``offset = nk - nq``
    (queries aligned bottom-right against the keys), the window ``(left, right)``; the score
    stage's ``sa``, the lane's first row ``row0`` and ``exp_scale``, the exponent's factor (the
    softmax scale folded in where scores stay raw q.k)."""

    warp: int
    lane: int
    g: int
    t: int
    bh: int
    b: int
    h: int
    hk: int
    q_start: int
    q_end: int
    nq: int
    nk: int
    d: int
    offset: int
    left: int
    right: int
    sa: object
    row0: int
    exp_scale: float


@functools.lru_cache(maxsize=None)
def make_forward_block(BLOCK_M, WARP_ROWS, RAW, ALIBI):
    """``forward_block(q, k, va, tid, block) -> ForwardBlock`` of thread ``tid`` in grid block
    ``block`` (:func:`forward_grid`: ``bh * ceil(Nq / BLOCK_M)`` + the query tile); a warp
    owns ``WARP_ROWS`` rows of the tile; ``RAW``: the scale is folded into the exponent."""
    score_args = make_score_args(ALIBI, float32)
    LOG2E_F = float32(LOG2E)

    @device_jit(inline=True)
    def forward_block(q, k, va, tid, block):
        # in the order the kernels computed these before this function (a register allocation
        # at ptxas's 255 depends on it: the d = 128 goal build spilled with another order)
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2
        t = lane & 3
        n_heads = q.shape[1]
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]
        n_qt = (nq + BLOCK_M - 1) // BLOCK_M
        bh = block // n_qt
        b = bh // n_heads
        h = bh % n_heads
        hk = h // (n_heads // k.shape[1])  # GQA: query head h reads kv head h // group
        q_start = (block % n_qt) * BLOCK_M
        q_end = min(q_start + BLOCK_M, nq)
        offset = nk - nq
        left, right = va.window
        sa = score_args(va, b, h, offset, nq)
        row0 = q_start + WARP_ROWS * warp + g
        exp_scale = va.scale * LOG2E_F if RAW else LOG2E_F
        return ForwardBlock(warp, lane, g, t, bh, b, h, hk, q_start, q_end, nq, nk, d, offset,
                            left, right, sa, row0, exp_scale)

    return forward_block


@functools.lru_cache(maxsize=None)
def make_row_stages(ROWS, KEYS, COLS, BLOCK_N, DTYPE, RAW, SOFTCAP, ALIBI, FNS):
    """``(dropout_rows, nonfinite_v_fixup)``: the per-row stages of a forward whose lanes hold
    the :mod:`~numba_flash.kernels.mainloop.warp_gemm` fragment view (``ROWS`` rows ``row0 + 16 (r
    >> 1) + 8 (r & 1)``, ``KEYS`` scores and ``COLS`` output columns a row): this kernel's and the
    warpgroup forward's (:mod:`~numba_flash.kernels.forward.wgmma`), whose warps hold one
    16-row tile of the same view.

    * ``dropout_rows(DropoutRows(s, va, sa, row0, key0, nk))``: ``P * keep / (1 - p)`` for
      ``P V``;
    * ``nonfinite_v_fixup(acc, v, hk, sa, row0, bounds, k_start, t, umask)``: rare, a
      non-finite ``v[j, c]`` of a key ``j`` the row sees makes ``o[i, c]`` NaN."""
    MASK_MOD = FNS is not None and FNS[1] is not None
    EXP_MASK = EXP_BITS[DTYPE]
    score_fn = make_score_fn(RAW, SOFTCAP, ALIBI, FNS, float32)
    ZERO = float32(0.0)

    @device_jit
    def dropout_row(r, x):
        """``P * keep / (1 - p)`` in the lane's row ``r`` (``x``: :data:`DropoutRows`): one
        Philox call per 8-key fragment covers the lane's 2 keys (``8 n + 2 t`` is even: both
        in a group of 4)."""
        s, sa = x.s, x.sa
        seed_lo, seed_hi, threshold, keep_scale = x.va.dropout
        row = x.row0 + 16 * (r >> 1) + 8 * (r & 1)
        for n in range(KEYS // 2):
            key = x.key0 + 8 * n
            bits = 0
            if row < sa.nq and key < x.nk:
                bits = philox_keep_bits4(seed_lo, seed_hi, sa.b, sa.h, row, key >> 2,
                                         threshold) >> (key & 3)
            for e in range(2):
                s[r, 2 * n + e] = s[r, 2 * n + e] * keep_scale if (bits >> e) & 1 else ZERO

    @device_jit
    def mark_row(r, x):
        """Row ``r`` of the lane sees key ``x.key``: its columns in ``x.cols`` join
        ``x.row_bad[r]`` (``x``: :data:`MarkRows`)."""
        nk, left, right = x.bounds
        sa, key = x.sa, x.key
        row = x.row0 + 16 * (r >> 1) + 8 * (r & 1)
        lo, hi = key_bounds(row, sa.offset, nk, left, right)
        if lo <= key and key < hi and (not MASK_MOD or (
                row < sa.nq and score_fn(ZERO, row, key, sa, x.umask)[0])):
            x.row_bad[r] |= x.cols

    mark_rows = static_for(ROWS, mark_row)
    nan_columns = make_nan_columns(ROWS, COLS)

    @device_jit
    def nonfinite_v_fixup(acc, v, hk, sa, row0, bounds, k_start, t, umask):
        """Read from global memory, where ``v`` is still inf / NaN (the shared copy was
        zeroed); the columns go through bit masks (bit ``c``: the lane's column ``c``), so
        ``acc`` is only indexed by compile-time indices and stays in registers."""
        nk = bounds[0]
        d = v.shape[3]
        row_bad = cuda.local.array(ROWS, uint64)
        for r in range(ROWS):
            row_bad[r] = uint64(0)
        for j in range(min(BLOCK_N, nk - k_start)):
            key = k_start + j
            cols = uint64(0)
            for c in range(COLS):
                col = 2 * t + 8 * (c >> 1) + (c & 1)
                if col < d and (v[sa.b, hk, key, col] & EXP_MASK) == EXP_MASK:
                    cols |= uint64(1) << uint64(c)
            if cols != uint64(0):
                mark_rows(MarkRows(row_bad, cols, key, row0, sa, bounds, umask))
        nan_columns(acc, row_bad)

    return static_for(ROWS, dropout_row), nonfinite_v_fixup


#: where a block's operands start (:func:`make_operand_bases`): Q's first row and its ``d``
#: (``STRIDED``: ``(d, row stride)``, as :func:`make_row_stride` reads it), K's (b, hk) base and
#: ``d``, ``v_at = (V's base, its d)``, and the value head dim ``d_v``
OperandBases = namedtuple("OperandBases", "q_elem0 q_d kv_base k_d v_at d_v")


@functools.lru_cache(maxsize=None)
def make_operand_bases(STRIDED, OWN_V):
    """``(operand_bases, o_start)``: ``operand_bases(q, k, v, o, fb) ->`` :data:`OperandBases` of
    the block ``fb`` (:class:`ForwardBlock`), and ``o_start(o, bh, row_base, d_v) -> (o_elem0,
    o_row)``, where its ``o`` rows start and their stride (after the K/V loop: nothing held
    across it).  C-contiguous ``[B, H(kv), N, d]`` arrays, or (``STRIDED``) views read through
    their strides (:func:`~numba_flash.kernels.core.common.make_elem_strides`)."""
    strides = make_elem_strides(2)   # 16-bit elements

    if STRIDED:
        @_stage
        def operand_bases(q, k, v, o, fb):
            qs, ks, vs = strides(q), strides(k), strides(v)
            d_v = v.shape[3] if OWN_V else fb.d
            return OperandBases(fb.b * qs[0] + fb.h * qs[1] + fb.q_start * qs[2], (fb.d, qs[2]),
                                fb.b * ks[0] + fb.hk * ks[1], (fb.d, ks[2]),
                                (fb.b * vs[0] + fb.hk * vs[1], (d_v, vs[2])), d_v)

        @_stage
        def o_start(o, bh, row_base, d_v):
            os_ = strides(o)
            n_heads = uint32(o.shape[1])
            return (int64(uint32(bh) // n_heads) * os_[0] + int64(uint32(bh) % n_heads) * os_[1],
                    os_[2])
    else:
        @_stage
        def operand_bases(q, k, v, o, fb):
            kv_base = (fb.b * k.shape[1] + fb.hk) * fb.nk * fb.d
            v_at = (kv_base, fb.d)         # V's base and head dim: K's, or (OWN_V) its own
            d_v = fb.d
            if OWN_V:
                d_v = v.shape[3]
                v_at = ((fb.b * k.shape[1] + fb.hk) * fb.nk * d_v, d_v)
            return OperandBases(((fb.b * q.shape[1] + fb.h) * fb.nq + fb.q_start) * fb.d, fb.d,
                                kv_base, fb.d, v_at, d_v)

        @_stage
        def o_start(o, bh, row_base, d_v):
            return row_base * d_v, d_v

    return operand_bases, o_start


#: the mma forward's K/V tile loads (:func:`make_kv_loads`)
KvLoads = namedtuple("KvLoads", "load_tile load_v_tile load_kv")


@functools.lru_cache(maxsize=None)
def make_kv_loads(cfg):
    """The K/V copy stages of the mma forward of ``cfg`` (:data:`KvLoads`): ``load_tile``
    (K, or V at K's width), ``load_v_tile`` (V at its own width with ``OWN_V``) and ``load_kv``
    (both, one copy group each, into a pipeline stage)."""
    BLOCK_N, HEAD_DIM, THREADS, VEC, OWN_V = (cfg.BLOCK_N, cfg.HEAD_DIM, cfg.THREADS, cfg.VEC,
                                              cfg.OWN_V)
    HEAD_DIM_V, RB_V, RB = cfg.V_DIM, cfg.V_ROW_BYTES, cfg.ROW_BYTES
    STAGE_BYTES, STRIDED = cfg.STAGE_BYTES, cfg.STRIDED
    KV_BYTES = BLOCK_N * RB         # one K tile (V's follows it)
    copy_kv = make_tile_copy(BLOCK_N, HEAD_DIM, RB, THREADS, VEC, OWN_V,   # (OWN_V: two widths)
                             STRIDED)
    copy_v = make_tile_copy(BLOCK_N, HEAD_DIM_V, RB_V, THREADS, VEC, OWN_V, STRIDED)
    row_stride = make_row_stride(STRIDED)
    copy_kv_at = copy_v_at = None   # (STRIDED: from each operand's own row 0)
    if STRIDED:
        copy_kv_at = make_tile_copy_at(BLOCK_N, HEAD_DIM, RB, THREADS, VEC, OWN_V)
        copy_v_at = make_tile_copy_at(BLOCK_N, HEAD_DIM_V, RB_V, THREADS, VEC, OWN_V)

    @_stage
    def load_tile(smem, smem_byte, x, kv_base, kt, t_hi, nk, d, tid):
        """Issue the copy of K (or V) tile ``kt`` to ``smem_byte`` as one copy group (an empty
        one past ``t_hi``: every step commits as many, so the waits count constants).  ``d``:
        the head dim, or (``STRIDED``) the pair ``(d, row stride)``."""
        if kt < t_hi:
            if STRIDED:   # 32-bit rows, from K's own row 0 (stages.make_tile_copy_at)
                first = int32(kt * BLOCK_N)
                copy_kv_at(smem, smem_byte, x, kv_base, first,
                           min(int32(BLOCK_N), int32(int32(nk) - first)), d, tid)
            else:
                copy_kv(smem, smem_byte, x, kv_base + kt * BLOCK_N * row_stride(d),
                        min(BLOCK_N, nk - kt * BLOCK_N), d, tid)
        cp_async_commit()

    @_stage
    def load_v_tile(smem, smem_byte, v, v_base, kt, t_hi, nk, d_v, tid):
        """:func:`load_tile` of a V tile (its own width with ``OWN_V``)."""
        if kt < t_hi:
            if STRIDED:
                first = int32(kt * BLOCK_N)
                copy_v_at(smem, smem_byte, v, v_base, first,
                          min(int32(BLOCK_N), int32(int32(nk) - first)), d_v, tid)
            else:
                copy_v(smem, smem_byte, v, v_base + kt * BLOCK_N * row_stride(d_v),
                       min(BLOCK_N, nk - kt * BLOCK_N), d_v, tid)
        cp_async_commit()

    @_stage
    def load_kv(smem, stage, k, v, kv_base, kt, t_hi, nk, d, tid, v_at):
        """K, then V, of tile ``kt`` into ``stage``: two copy groups (``v_at``: V's base and
        head dim, K's unless ``OWN_V``)."""
        load_tile(smem, stage * STAGE_BYTES, k, kv_base, kt, t_hi, nk, d, tid)
        load_v_tile(smem, stage * STAGE_BYTES + KV_BYTES, v, v_at[0], kt, t_hi, nk, v_at[1], tid)

    return KvLoads(load_tile, load_v_tile, load_kv)


@functools.lru_cache(maxsize=None)
def forward_mma_kernel(cfg):
    """Build ``kernel(q, k, v, o, lse, va)`` for the :class:`~numba_flash.kernels.forward.config.
    ForwardMmaConfig` ``cfg``.

    ``q``, ``k``, ``v``: uint16 views of the ``DTYPE`` ``[B, H(kv), N, d]`` inputs
    (C-contiguous); ``o``: the flat view of ``[B, H, Nq, d]`` (float16, or uint16 words for
    bfloat16); ``lse``: the flat float32 view of ``[B, H, Nq]``; ``va``: the
    :class:`~numba_flash.kernels.core.variant.Variant` (float32 scalars; ``user = (kinds,) + aux``
    with ``cfg.USER``).  A user's ``mask_mod`` runs on the tiles a block mask calls PARTIAL (on
    every tile without one), ``score_mod`` on every visible score, both only for rows ``< Nq``
    and keys ``< Nk``; EMPTY tiles are never loaded.
    """
    M_TILES, BLOCK_N, STAGES = cfg.M_TILES, cfg.BLOCK_N, cfg.STAGES
    HEAD_DIM, Q_IN_REGS, DTYPE, USER, OWN_V = (cfg.HEAD_DIM, cfg.Q_IN_REGS, cfg.DTYPE, cfg.USER,
                                               cfg.OWN_V)
    DROPOUT, SOFTCAP, ALIBI, VEC = cfg.DROPOUT, cfg.SOFTCAP, cfg.ALIBI, cfg.VEC
    HEAD_DIM_V, RB_V = cfg.V_DIM, cfg.V_ROW_BYTES   # V and o: HEAD_DIM unless OWN_V
    assert HEAD_DIM % 16 == 0 and BLOCK_N % 16 == 0 and DTYPE in MMA_DTYPES and STAGES >= 1
    BLOCK_M, THREADS, RB = cfg.BLOCK_M, cfg.THREADS, cfg.ROW_BYTES
    KV_BYTES = BLOCK_N * RB         # one K tile (V's follows it)
    STAGE_BYTES = cfg.STAGE_BYTES
    Q_BYTE = cfg.Q_BYTE
    SMEM_WORDS = cfg.SMEM_BYTES // 4
    ROWS = 2 * M_TILES              # a lane's rows (two per 16-row tile)
    KEYS = BLOCK_N // 4             # a lane's scores per row (two per 8-key fragment)
    COLS = HEAD_DIM_V // 4          # a lane's output columns per row
    K_STEPS = HEAD_DIM // 16
    user_score, user_mask, BLOCKS = USER if USER is not None else (None, None, None)
    FNS = (user_score, user_mask) if USER is not None else None
    MASK_MOD = user_mask is not None
    RAW = not (SOFTCAP or ALIBI or user_score is not None)  # scale folded into the exponent
    ZERO = float32(0.0)
    ONE = float32(1.0)
    LOG = on_simulator()            # compile time: the tile log exists only in the simulator
    XOR = (1, 2)                    # a row's 4 lanes (its quad)
    # m_i moves only when a row's max passes it by 2**8 (FA4): P <= 256, exact in float16 and
    # bfloat16; most tiles skip acc *= alpha (RESCALE_LOG2 in online_softmax.py)
    RESCALE = RESCALE_LOG2

    # -- the stages (module docstring)
    load_q = make_load_a(M_TILES, K_STEPS, RB)
    gemm_qk = make_gemm(M_TILES, BLOCK_N // 16, K_STEPS, "regs" if Q_IN_REGS else "smem",
                        False, RB, RB, DTYPE)
    gemm_pv = make_gemm(M_TILES, HEAD_DIM_V // 16, BLOCK_N // 16, "acc", True, RB, RB_V, DTYPE)
    scores_masked, scores_full = make_tile_scores_pair(ROWS, KEYS, ACC_ROWS, ACC_COLS, RAW,
                                                       SOFTCAP, ALIBI, FNS, float32)
    softmax_init, softmax_update, _finalize = make_online_softmax(ROWS, KEYS, COLS, XOR, "ex2",
                                                                  float32, RESCALE)
    epilogue = make_epilogue(ROWS, COLS, XOR, ACC_ROWS, ACC_COLS, element_ops(DTYPE)[1], float32,
                             STRIDED_O=cfg.STRIDED)
    copy_q = make_tile_copy(BLOCK_M, HEAD_DIM, RB, THREADS, VEC, OWN_V, cfg.STRIDED)
    operand_bases, o_start = make_operand_bases(cfg.STRIDED, OWN_V)
    zero_nonfinite_v = make_tile_scan(BLOCK_N, HEAD_DIM_V, RB_V, THREADS, DTYPE,
                                      STRIDED=cfg.STRIDED)   # (V's copy plan)
    # the groups a thread may leave in flight (docs/tensor-cores.md, the pipeline): at K_j, V_j
    # and the K/V of the STAGES - 2 tiles after it; at V_j, those tiles; in the prologue, Q's
    # followers.  One stage: K_j and V_j are the only groups in flight, each waited for alone
    wait_k = cp_async_wait(max(0, 2 * STAGES - 3))
    wait_v = cp_async_wait(max(0, 2 * STAGES - 2))
    wait_q = cp_async_wait(max(1, 2 * STAGES - 2))
    tile_span = make_tile_span(BLOCK_N)
    forward_block = make_forward_block(BLOCK_M, 16 * M_TILES, RAW, ALIBI)

    load_tile, load_v_tile, load_kv = make_kv_loads(cfg)

    dropout_rows, nonfinite_v_fixup = make_row_stages(ROWS, KEYS, COLS, BLOCK_N, DTYPE, RAW,
                                                      SOFTCAP, ALIBI, FNS)

    def make_step(MASKED):
        """One K/V tile; ``MASKED`` (compile time): the tile is not inside the keys every row
        of the Q tile sees (or a user's mask_mod asks), so its scores are masked per element
        and ``v`` gets the non-finite rule."""
        tile_scores = scores_masked if MASKED else scores_full

        # [docs:mma-step]
        @_stage
        def step(kt, kt_ahead, stage, t_hi, x, umask):   # x: the ForwardMmaStep
            smem, va, sa = x.smem, x.va, x.sa
            k, v, kv_base, nk, d = x.k, x.v, x.kv_base, x.nk, x.d
            hk, bounds, v_at = x.hk, x.bounds, x.v_at
            qf, s, acc, m_i, l_i = x.qf, x.s, x.acc, x.m_i, x.l_i
            tid, t, row0, exp_scale = x.tid, x.t, x.row0, x.exp_scale
            q_a, k_b, v_b = x.q_a, x.k_b, x.v_b
            k_start = kt * BLOCK_N
            kb = stage * STAGE_BYTES                  # this tile's stage
            wait_k()
            cuda.syncthreads()  # K of tile kt landed for all; all warps are done with kt - 1
            if STAGES == 1:    # V's one buffer is free: V_kt lands under Q K^T
                load_v_tile(smem, KV_BYTES, v, v_at[0], kt, t_hi, nk, v_at[1], tid)
            else:              # the stage tile kt - 1 used takes tile kt + STAGES - 1
                load_kv(smem, (stage + STAGES - 1) % STAGES, k, v, kv_base, kt_ahead, t_hi, nk,
                        d, tid, v_at)
            for r in range(ROWS):
                for c in range(KEYS):
                    s[r, c] = ZERO
            gemm_qk(s, qf, smem, q_a, kb + k_b)                        # S = Q K^T
            tile_scores(s, sa, row0, k_start + 2 * t, bounds, umask)   # mask, score mods
            softmax_update(s, acc, m_i, l_i, exp_scale)                # m_i, l_i, P, acc *= a
            if DROPOUT:
                dropout_rows(DropoutRows(s, va, sa, row0, k_start + 2 * t, nk))
            wait_v()
            v_bad = 0
            if MASKED:  # zero V's inf / NaN halves this thread copied (0 * NaN = NaN)
                v_bad = cuda.syncthreads_or(  # V landed and zeroed for all; any non-finite?
                    1 if zero_nonfinite_v(smem, kb + KV_BYTES, nk - k_start, tid) else 0)
            else:
                cuda.syncthreads()  # V of tile kt landed for all threads
            if STAGES == 1:    # every warp is done with K_kt: K of the next tile under P V
                load_tile(smem, 0, k, kv_base, kt_ahead, t_hi, nk, d, tid)
            gemm_pv(acc, s, smem, 0, kb + KV_BYTES + v_b)              # acc += P V
            if MASKED and v_bad:
                nonfinite_v_fixup(acc, v, hk, sa, row0, bounds, k_start, t, umask)
        # [/docs:mma-step]

        return step

    step_masked = make_step(True)
    step_full = make_step(False)

    walk, nxt = make_kv_walk(step_full, step_masked, BLOCKS, MASK_MOD, BLOCK_N, STAGES,
                             max(STAGES - 1, 1), LOG)

    # a user's functions stay out of the on-disk kernel cache (their code is not in this
    # package's sources, which key it): such a build is compiled in each process
    @kernel_jit(cache=USER is None)
    def flash_forward_mma(q, k, v, o, lse, va):
        tid = cuda.threadIdx.x
        fb = forward_block(q, k, va, tid, cuda.blockIdx.x)   # which rows, heads, warp, lane

        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SHARED_ALIGN)
        qf = cuda.local.array((M_TILES, K_STEPS, 4), uint32)
        s = cuda.local.array((ROWS, KEYS), float32)
        acc = cuda.local.array((ROWS, COLS), float32)
        m_i = cuda.local.array(ROWS, float32)
        l_i = cuda.local.array(ROWS, float32)

        # the K/V tiles rows [q_start, q_end) visit, and the unmasked ones [f_lo, f_hi)
        t_lo, t_hi, f_lo, f_hi = tile_span(fb.q_start, fb.q_end, fb.offset, fb.nk, fb.left,
                                           fb.right)
        # where this block's rows of q, k, v and o start, and their head dims (STRIDED: with
        # their row strides)
        ob = operand_bases(q, k, v, o, fb)
        kv_base, k_d, v_at, d_v = ob.kv_base, ob.k_d, ob.v_at, ob.d_v
        # the walk's context
        w = KvWalk(va.user, fb.b, fb.h, fb.q_start, fb.q_end, fb.nk, t_hi, f_lo, f_hi, tid)

        # -- prologue: Q, then K/V tiles 0 .. STAGES - 2 (tiles the block mask lets through)
        copy_q(smem, Q_BYTE, q, ob.q_elem0, fb.q_end - fb.q_start, ob.q_d, tid)
        cp_async_commit()
        kt = nxt(t_lo - 1, w)   # the first tile (a block mask's EMPTY tiles are never loaded)
        ahead = kt
        if STAGES == 1:  # K of the first tile (V follows in the loop)
            load_tile(smem, 0, k, kv_base, ahead, t_hi, fb.nk, k_d, tid)
            ahead = nxt(ahead, w)
        for i in range(STAGES - 1):
            load_kv(smem, i, k, v, kv_base, ahead, t_hi, fb.nk, k_d, tid, v_at)
            ahead = nxt(ahead, w)
        wait_q()
        cuda.syncthreads()  # Q's tile is complete before any warp reads its fragments
        q_a = Q_BYTE + 16 * M_TILES * RB * fb.warp + lane_offset(fb.lane, RB, KIND_A)
        if Q_IN_REGS:
            load_q(qf, smem, q_a)
        softmax_init(m_i, l_i, acc)

        # -- the K/V tiles in key order (and, with a block mask, those it does not call EMPTY)
        ctx = ForwardMmaStep(smem, va, fb.sa,
                             k, v, kv_base, fb.nk, k_d, fb.hk, (fb.nk, fb.left, fb.right), v_at,
                             qf, s, acc, m_i, l_i,
                             tid, fb.t, fb.row0, q_a, lane_offset(fb.lane, RB, KIND_B),
                             lane_offset(fb.lane, RB_V, KIND_A), fb.exp_scale)
        walk(kt, ahead, t_hi, w, ctx)

        # -- epilogue: o = acc / l, lse = m lse_scale + log(l) (m in raw units without mods)
        # (b, h) as a uint32 (the grid has < 2**31 blocks): one register across the loop
        row_base = int64(uint32(fb.bh)) * fb.nq
        o_elem0, o_row = o_start(o, fb.bh, row_base, d_v)
        epilogue(o, lse, acc, m_i, l_i, va.scale if RAW else ONE,
                 EpilogueRows(fb.row0, fb.nq, o_elem0, o_row, row_base, fb.t == 0, 1),
                 (2 * fb.t, d_v),
                 sink_of(va.sink, uint32(fb.bh) % uint32(q.shape[1])))   # (h from bh: no reg)

    return flash_forward_mma


def compile_args(cfg):
    """The Numba argument types ``(q, k, v, o, lse, va)`` of a tensor-core forward (this
    kernel's and the warpgroup forward's): 16-bit inputs as uint16, ``o`` float16 (bfloat16 as
    uint16), float32 ``lse``; a user's variant gets :func:`_user_build`'s kinds and aux
    arrays."""
    layout = "A" if getattr(cfg, "STRIDED", False) else "C"   # (a view's strides)
    u16 = types.Array(types.uint16, 4, layout)
    o_t = types.Array(types.float16 if cfg.DTYPE == "float16" else types.uint16,
                      4 if layout == "A" else 1, layout)
    user_t = ()
    if cfg.USER is not None:
        user_t = (types.Array(types.int8, 4, "C"), types.Array(types.float32, 2, "C"),
                  types.Array(types.int32, 2, "C"))
    return (u16, u16, u16, o_t, types.Array(types.float32, 1, "C"),
            variant_type(types.float32, cfg.DROPOUT, user_t))


def compile_config(cfg):
    """The compile tier's entry of one configuration (its Numba argument types)."""
    return {
        "name": cfg.name,
        "config": cfg,
        "kernel": forward_mma_kernel(cfg),
        "args": compile_args(cfg),
        "float64_ok": False,
        "mma": True,
        # one K/V tile per warp: Q K^T and P V, M_TILES (BLOCK_N / 8) (HEAD_DIM / 16) mma each
        "sass": {"expect_mma": 2 * cfg.M_TILES * (cfg.BLOCK_N // 8) * (cfg.HEAD_DIM // 16)},
    }


assert all(forward_mma_config(hd, simulator=False).SMEM_BYTES <= SMEM_LIMIT
           for hd in FORWARD_MMA_TILES)
