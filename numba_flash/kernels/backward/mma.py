"""FlashAttention backward on tensor cores: the five products on ``mma.sync.m16n8k16``, composed
of the mainloop stages.

Contract (the SIMT backward's, :mod:`numba_flash.kernels.backward.simt`): with ``P = exp(s -
lse)`` through the forward's own score function
(:func:`~numba_flash.kernels.mainloop.tile_scores.make_score_fn`), ``D = rowsum(dO * O)`` (the
SIMT preprocess kernel) and ``Z = keep / (1 - p)`` (1 without dropout; ``keep`` of
:func:`numba_flash.philox.philox_keep`, the mask of :func:`numba_flash.dropout_mask`)::

    dV = (P Z)^T dO      dP = (dO V^T) Z      dS = P (dP - D) grad
    dK = scale dS^T Q    dQ = scale dS K

``grad``: the softcap's ``1 - t^2`` times a user's ``score_mod_grad`` (1 without either).  A key
a row does not see, a row past ``Nq`` and a row with ``lse = -inf`` give exactly ``P = dS = 0``.
Operands are the 16-bit inputs (``DTYPE``: float16 or bfloat16; the kernels read uint16 views);
``P Z`` and ``dS`` are rounded from float32 (as flash-attn); accumulation is float32.  ``lse``,
``D``, ``dq_accum`` and the dK / dV outputs (float32, per query head: the op sums each GQA
group) are flat float32 views.

Kernels (a :class:`~numba_flash.kernels.backward.config.BackwardMmaConfig`, tiles in
:data:`~numba_flash.kernels.backward.config.BACKWARD_MMA_TILES`; 1-D grids of
:func:`numba_flash.kernels.backward.simt.fold_grid`):

1. :func:`dkdv_mma_kernel`: one block per ``(K/V tile of BLOCK keys, b, query head)``, warp ``w``
   owning ``M_TILES`` 16-key tiles; it walks the query tiles of ``STEP`` rows that see its keys,
   ``STAGES`` in flight; ``dK``, ``dV`` stay in registers.  ``DQ_ATOMIC``: ``dQ += scale dS K``
   by float32 atomics into ``dq_accum``.  ``WANT_DV`` / ``WANT_DK``, ``COL0`` / ``ACC_DIM``: the
   outputs and columns of this launch (:func:`dkdv_passes`).
2. :func:`dq_mma_kernel` (``deterministic=True``): one block per ``(query tile of BLOCK rows, b,
   h)``, walking K/V tiles of ``STEP`` keys; no atomics, bitwise reproducible (:func:`dq_passes`).

Compile time besides the tiles: ``DROPOUT``, ``SOFTCAP``, ``ALIBI``, ``VEC`` (16-byte copies),
``USER`` (:mod:`numba_flash.flex`), ``OWN_V`` / ``HEAD_DIM_V`` (``v``, ``do``, ``dv`` of ``d_v``
columns; :data:`ONE_PASS_COLUMNS`), ``PAD_COLS``, ``STRIDED`` (``q``, ``k``, ``v``, ``do`` read
through their strides: :func:`make_backward_bases`).  Shared memory: one static ``uint32`` arena of
rows of ``2 HEAD_DIM + 16`` bytes (V and dO ``2 HEAD_DIM_V + 16``; the pad: conflict-free
``ldmatrix``), ``BackwardMmaConfig.SMEM_BYTES``, at most 48 KiB.

File: the pass splits, the stages (the element step ``make_tile_p_ds``, ``dS^T``'s store, the
dK/dV step), the two kernels, the compile tier's entry.  How: docs/tensor-cores.md#the-backward.
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

from numba import cuda, float32, int32, types, uint32, uint64

from ...backend import on_simulator
from ...philox import philox_keep
from .simt import unfold_block
from ..core.common import SMEM_LIMIT, log_tile, make_elem_strides
from ..core.jit import device_jit, kernel_jit, static_for
from ..ptx.stages import (
    SHARED_ALIGN,
    EXP_BITS, LOG2E, cp_async_wait_all, ex2, fma, in_loop, load_u16, make_pair_load,
    make_row_stride, make_tile_copy, make_tile_scan, red_add,
)
from ..mainloop.tile_scores import make_score_args, make_score_fn
from .config import BACKWARD_MMA_TILES, BackwardMmaConfig, backward_mma_config, backward_mma_tiles
from ..core.config import MMA_DTYPES, round16
from ..core.variant import variant_type
from ..mainloop.tile_walk import KvWalk, make_kv_walk, make_tile_walk
from ..mainloop.visibility import (
    BLOCK_EMPTY, is_visible, make_tile_kind, make_tile_span, make_tile_verdict, tile_query_range,
)
from ..mainloop.warp_gemm import (
    KIND_A, KIND_B, lane_offset, make_gemm, make_load_a, make_nan_columns,
)

__all__ = ["MMA_DTYPES", "BackwardMmaConfig", "backward_mma_config", "backward_mma_tiles",
           "ONE_PASS_COLUMNS", "column_shares", "dkdv_passes", "dq_passes", "full_query_rows",
           "dkdv_mma_kernel", "dq_mma_kernel"]

_stage = functools.partial(device_jit, own_module=True, inline=True)

# -- the contexts the stages pass (named: a stage reads its fields by name)
#: thread ``tid``'s place in the tensor-core backward (:func:`make_backward_block`)
BackwardBlock = namedtuple("BackwardBlock",
                           "warp lane g t tile b h bh hk nq nk d offset left right sa")
#: what ``tile_p_ds``'s row stage reads (:func:`make_tile_p_ds`)
PdsTile = namedtuple("PdsTile", "s dp nlse2 dl row0 col0 sa bounds va umask exp_scale")
#: the dK/dV kernel's walk over query tiles (``next_q``, ``visit``)
QueryWalk = namedtuple("QueryWalk", "user b h kt nq nk t_hi span tid")


def make_stage_load(load_pair, FIRST_BYTE, STAGE_BYTES):
    """``load(smem, stage, x, y, base, t, t_hi, n, d, tid, y_at)``: tile ``t`` of the pair
    ``x``, ``y`` (Q and dO, or K and V) into pipeline stage ``stage`` of the arena from byte
    ``FIRST_BYTE`` (one copy group; none past ``t_hi``; ``y_at``: ``y``'s base and head dim,
    ``x``'s unless ``OWN_V``), by ``load_pair`` (:func:`~numba_flash.kernels.ptx.stages.
    make_pair_load`)."""

    @_stage
    def load(smem, stage, x, y, base, t, t_hi, n, d, tid, y_at):
        load_pair(smem, FIRST_BYTE + stage * STAGE_BYTES, x, y, base, t, t_hi, n, d, tid, y_at)

    return load

#: one dK/dV pass holds both accumulators (``M_TILES (HEAD_DIM + V_DIM) / 2`` registers a lane)
#: while the two widths sum to at most this: (192, 128)'s 160 registers measured without a spill;
#: at 256 + 256 they would be the whole register file
ONE_PASS_COLUMNS = 320
#: the deterministic dQ kernel's accumulator fits in one pass up to this width (at 256, 128
#: accumulators beside the fragments spilled)
DQ_ONE_PASS_COLUMNS = 192
#: the widest share of columns a pass accumulates where one pass does not hold them all
PASS_COLUMNS = 128


def column_shares(width):
    """``[(COL0, ACC_DIM)]``: ``width`` columns in shares of at most :data:`PASS_COLUMNS`, each
    a multiple of 16 but the last (256: ``(0, 128), (128, 128)``)."""
    n = -(-width // PASS_COLUMNS)
    size = round16(-(-width // n))
    return [(c, min(size, width - c)) for c in range(0, width, size)]


def dkdv_passes(head_dim, deterministic, head_dim_v=None):
    """The dK/dV launches of one backward as :class:`~numba_flash.kernels.backward.config.
    BackwardMmaConfig` fields, for ``HEAD_DIM`` and ``HEAD_DIM_V`` (``head_dim_v``, None: the
    same): one pass (every output, atomic dQ unless ``deterministic``) while the two widths sum
    to at most :data:`ONE_PASS_COLUMNS`, else a pass per share of dV's columns, then per share
    of dK's (:func:`column_shares`: at 256 four passes of 128 columns, 64 registers a lane; the
    first dK pass also adds dQ)."""
    width_v = head_dim_v or head_dim
    if head_dim + width_v <= ONE_PASS_COLUMNS:
        return [dict(WANT_DV=True, WANT_DK=True, DQ_ATOMIC=not deterministic)]
    return ([dict(WANT_DV=True, WANT_DK=False, DQ_ATOMIC=False, COL0=c, ACC_DIM=n)
             for c, n in column_shares(width_v)]
            + [dict(WANT_DV=False, WANT_DK=True, DQ_ATOMIC=not deterministic and c == 0,
                    COL0=c, ACC_DIM=n) for c, n in column_shares(head_dim)])


def dq_passes(head_dim):
    """The deterministic dQ kernel's launches (``COL0``, ``ACC_DIM`` fields): one up to
    :data:`DQ_ONE_PASS_COLUMNS`, else one per share of the columns (:func:`column_shares`)."""
    if head_dim <= DQ_ONE_PASS_COLUMNS:
        return [dict()]
    return [dict(COL0=c, ACC_DIM=n) for c, n in column_shares(head_dim)]


def full_query_rows_py(k_start, k_end, offset, nq, nk, left, right):
    """``(r_lo, r_hi)``: the query rows that see every key of ``[k_start, k_end)`` (none unless
    ``k_end <= Nk``): ``lo(i) <= k_start`` and ``hi(i) >= k_end`` in the terms of
    :func:`~numba_flash.kernels.mainloop.visibility.key_bounds`, i.e. ``k_end - 1 - right <= i +
    offset <= k_start + left`` (an unbounded side: no limit), within ``[0, Nq)``."""
    r_lo = 0
    if right >= 0:
        r_lo = max(0, k_end - 1 - right - offset)
    r_hi = nq
    if left >= 0:
        r_hi = min(nq, k_start + left - offset + 1)
    if k_end > nk:
        r_hi = r_lo
    return r_lo, max(r_lo, r_hi)


full_query_rows = device_jit(own_module=True, inline=True)(full_query_rows_py)


@functools.lru_cache(maxsize=None)
def make_backward_block(ALIBI):
    """``backward_block(q, k, va, tid, tiles) -> BackwardBlock`` of thread ``tid``: its warp,
    lane and fragment coordinates ``g = lane >> 2``, ``t = lane & 3``; its block's tile of the
    folded grid (:func:`numba_flash.kernels.backward.simt.fold_grid`), sequence ``b`` and query
    head ``h`` (``bh = b H + h``), the kv head ``hk`` it reads (GQA), the sizes, ``offset = nk -
    nq``, the window ``(left, right)`` and the scores' ``ScoreArgs`` (``ALIBI``: the slope read)."""
    score_args = make_score_args(ALIBI, float32)

    @_stage
    def backward_block(q, k, va, tid, tiles):
        n_heads = q.shape[1]
        tile, b, h = unfold_block(cuda.blockIdx.x, tiles, n_heads)
        nq, nk = q.shape[2], k.shape[2]
        left, right = va.window
        lane = tid & 31
        return BackwardBlock(tid >> 5, lane, lane >> 2, lane & 3, tile, b, h, b * n_heads + h,
                             h // (n_heads // k.shape[1]), nq, nk, q.shape[3], nk - nq, left,
                             right, score_args(va, b, h, nk - nq, nq))

    return backward_block


#: where a block's operands start (:func:`make_backward_bases`): Q's row ``q_row0`` and the
#: ``d`` its tile copies take (``STRIDED``: the pair ``(d, row stride)``), ``do_at = (dO's
#: base, its d)``, K's row ``k_row0`` and its ``d``, ``v_at = (V's base, its d)``, and the
#: value head dim ``d_v``
BackwardBases = namedtuple("BackwardBases", "q_base q_d do_at k_base k_d v_at d_v")


@functools.lru_cache(maxsize=None)
def make_backward_bases(STRIDED, OWN_V):
    """``backward_bases(q, k, v, do, blk, q_row0, k_row0) ->`` :data:`BackwardBases` of the block
    ``blk`` (:data:`BackwardBlock`): C-contiguous ``[B, H(kv), N, d]`` arrays, or (``STRIDED``)
    views read through their strides (:func:`~numba_flash.kernels.core.common.make_elem_strides`:
    each operand starts at ``b s0 + h s1``, its rows ``s2`` apart, dO's and V's strides their
    own)."""
    strides = make_elem_strides(2)   # 16-bit elements

    if STRIDED:
        @_stage
        def backward_bases(q, k, v, do, blk, q_row0, k_row0):
            qs, ks, vs, ds = strides(q), strides(k), strides(v), strides(do)
            d_v = v.shape[3] if OWN_V else blk.d
            return BackwardBases(
                blk.b * qs[0] + blk.h * qs[1] + q_row0 * qs[2], (blk.d, qs[2]),
                (blk.b * ds[0] + blk.h * ds[1] + q_row0 * ds[2], (d_v, ds[2])),
                blk.b * ks[0] + blk.hk * ks[1] + k_row0 * ks[2], (blk.d, ks[2]),
                (blk.b * vs[0] + blk.hk * vs[1] + k_row0 * vs[2], (d_v, vs[2])), d_v)
    else:
        @_stage
        def backward_bases(q, k, v, do, blk, q_row0, k_row0):
            q_rows = (blk.b * q.shape[1] + blk.h) * blk.nq + q_row0    # rows before Q's first
            k_rows = (blk.b * k.shape[1] + blk.hk) * blk.nk + k_row0
            d_v = blk.d     # V's and dO's head dim and bases: K's and Q's, or their own
            v_at = (k_rows * blk.d, blk.d)
            do_at = (q_rows * blk.d, blk.d)
            if OWN_V:
                d_v = v.shape[3]
                v_at = (k_rows * d_v, d_v)
                do_at = (q_rows * d_v, d_v)
            return BackwardBases(q_rows * blk.d, blk.d, do_at, k_rows * blk.d, blk.d, v_at, d_v)

    return backward_bases


def _user_parts(USER):
    """``(FNS, MASK_MOD, BLOCKS)`` of a backward ``USER = (score_mod, mask_mod,
    score_mod_grad, BLOCKS)`` (None: ``(None, False, None)``)."""
    if USER is None:
        return None, False, None
    return tuple(USER[:3]), USER[1] is not None, USER[3]


# [docs:mma-p-ds]
@functools.lru_cache(maxsize=None)
def make_tile_p_ds(ROWS, COLS, KEY_ROWS, MASKED, DROPOUT, SOFTCAP, ALIBI, FNS):
    """``tile_p_ds(s, dp, nlse2, dl, row0, col0, sa, bounds, va, umask, exp_scale)``: the
    element-wise step of both kernels over a lane's ``ROWS x COLS`` accumulator view
    (:mod:`~numba_flash.kernels.mainloop.warp_gemm`): ``s`` (raw ``q . k``) becomes ``P Z`` and
    ``dp`` (``dO . v``) becomes ``dS``.  ``KEY_ROWS``: the view's rows are keys (``row0 + 16 (r >>
    1) + 8 (r & 1)``) and its columns queries (``col0 + 8 (c >> 1) + (c & 1)``), as in the dK/dV
    kernel; else the other way (dQ).  ``nlse2[i]`` (``-lse log2 e``) and ``dl[i]`` (``D``) are
    indexed by the lane's query slot.  ``MASKED``: ``(0, 0)`` where the row does not see the key
    (the window ``bounds = (nk, left, right)``), lies past ``Nq`` or has ``lse = -inf`` (and where
    the user's ``mask_mod`` says no)."""
    user_score = FNS[0] if FNS is not None else None
    RAW = not (SOFTCAP or ALIBI or user_score is not None)  # scale folded into ex2
    GRAD = SOFTCAP or user_score is not None
    score_fn = make_score_fn(RAW, SOFTCAP, ALIBI, FNS, float32)
    ZERO = float32(0.0)
    INF = float32(math.inf)   # nlse2 of a row with lse = -inf (it sees no key)
    LOG2E_F = float32(LOG2E)

    @_stage
    def p_ds(s, dp, nlse2, delta, row, key, sa, bounds, va, umask, exp_scale):
        if MASKED:
            nk, left, right = bounds
            if not (row < sa.nq and nlse2 != INF
                    and is_visible(row, key, sa.offset, nk, left, right)):
                return ZERO, ZERO
        ok, x, grad = score_fn(s, row, key, sa, umask)  # the forward's score, so its P
        if not ok:
            return ZERO, ZERO   # the user's mask_mod (a PARTIAL tile, or no block mask)
        p = ex2(fma(x, exp_scale if RAW else LOG2E_F, nlse2))  # exp(s - lse): FFMA + MUFU.EX2
        if DROPOUT:
            seed_lo, seed_hi, threshold, keep_scale = va.dropout
            z = keep_scale if philox_keep(seed_lo, seed_hi, sa.b, sa.h, row, key,
                                          threshold) else ZERO
            pz = p * z
            ds = p * (dp * z - delta)
        else:
            pz = p
            ds = p * (dp - delta)
        if GRAD:
            ds = ds * grad
        return pz, ds

    @_stage
    def row_p_ds(r, x):
        s, dp = x.s, x.dp
        first = x.row0 + 16 * (r >> 1) + 8 * (r & 1)
        for c in range(COLS):
            second = x.col0 + 8 * (c >> 1) + (c & 1)
            i = c if KEY_ROWS else r      # the lane's query slot
            row = second if KEY_ROWS else first
            key = first if KEY_ROWS else second
            s[r, c], dp[r, c] = p_ds(s[r, c], dp[r, c], x.nlse2[i], x.dl[i], row, key, x.sa,
                                     x.bounds, x.va, x.umask, x.exp_scale)

    rows = static_for(ROWS, row_p_ds)

    @_stage
    def tile_p_ds(s, dp, nlse2, dl, row0, col0, sa, bounds, va, umask, exp_scale):
        rows(PdsTile(s, dp, nlse2, dl, row0, col0, sa, bounds, va, umask, exp_scale))

    return tile_p_ds
# [/docs:mma-p-ds]


@functools.lru_cache(maxsize=None)
def make_store_t(M_TILES, N_FRAGS, DTYPE, RB):
    """``store_t(smem, byte, c)``: a lane's float32 accumulator view ``c`` (``[2 M_TILES, 2
    N_FRAGS]``) as 16-bit pairs into the row-major shared tile at ``byte`` (``RB``-byte rows):
    accumulator row ``r`` is tile row ``16 (r >> 1) + 8 (r & 1) + g``, the pair of columns
    ``2 n, 2 n + 1`` tile columns ``8 n + 2 t, + 1`` (one 32-bit word)."""
    from ..ptx.mma import mma_ops
    _mma, pack2 = mma_ops(DTYPE)

    @_stage
    def store_t(smem, byte, c, g, t):
        for r in range(2 * M_TILES):
            w = (byte + (16 * (r >> 1) + 8 * (r & 1) + g) * RB) // 4 + t
            for n in range(N_FRAGS):
                smem[w + 4 * n] = pack2(c[r, 2 * n], c[r, 2 * n + 1])

    return store_t


#: the dK/dV kernel's walk over query tiles (:func:`make_query_walk`)
QueryWalkStages = namedtuple("QueryWalkStages", "next_q visit")


@functools.lru_cache(maxsize=None)
def make_query_walk(cfg):
    """``next_q(qt, w)`` and ``visit(qt, w)`` of the dK/dV kernel's walk over the query tiles
    (``w``: a :data:`QueryWalk`): the tile after ``qt``, skipping a block mask's EMPTY ones,
    and the verdict on tile ``qt`` (and the simulator's tile log)."""
    _fns, MASK_MOD, BLOCKS = _user_parts(cfg.USER)
    BLOCK_M, BLOCK_N = cfg.STEP, cfg.BLOCK
    LOG = on_simulator() and cfg.USER is not None  # the simulator's tile log (common.TILE_LOG)
    # the block mask's verdict on (Q tile, this K/V tile), visibility.py
    tile_kind = make_tile_kind(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None
    verdict = make_tile_verdict(BLOCKS, MASK_MOD, BLOCK_N)

    @_stage
    def next_q(qt, w):
        """The query tile after ``qt`` (``t_hi`` past the last): the next, or the next one the
        block mask does not call EMPTY for this K/V tile."""
        qt += 1
        if BLOCKS is not None:
            while qt < w.t_hi and tile_kind(w.user[0], w.b, w.h, qt * BLOCK_M,
                                            min(qt * BLOCK_M + BLOCK_M, w.nq), w.kt,
                                            w.nk) == BLOCK_EMPTY:
                qt += 1
        return min(qt, w.t_hi)

    @_stage
    def visit(qt, w):
        """The verdict on (query tile ``qt``, this K/V tile) (and the simulator's tile log)."""
        if LOG and w.tid == 0:
            log_tile(w.b, w.h, qt * BLOCK_M, w.kt)
        return verdict(w.user, w.b, w.h, qt * BLOCK_M, min(qt * BLOCK_M + BLOCK_M, w.nq), w.kt,
                       w.nk, w.span[0] <= qt and qt < w.span[1])

    return QueryWalkStages(next_q, visit)


#: the dK/dV kernel's per-row stages outside the step's products (:func:`make_dkdv_rows`)
DkdvRows = namedtuple("DkdvRows", "bad_do_fixup atomic_dq store_dkdv")


@functools.lru_cache(maxsize=None)
def make_dkdv_rows(cfg):
    """The dK/dV kernel's row stages (:data:`DkdvRows`): ``bad_do_fixup`` (a non-finite dO
    into dV's columns), ``atomic_dq`` (``dq_accum += scale dS K`` for a column pair) and
    ``store_dkdv`` (the lane's dK and dV rows, once)."""
    FNS, MASK_MOD, _blocks = _user_parts(cfg.USER)
    M_TILES, BLOCK_M, DTYPE, OWN_V = cfg.M_TILES, cfg.STEP, cfg.DTYPE, cfg.OWN_V
    WANT_DV, WANT_DK, COL0 = cfg.WANT_DV, cfg.WANT_DK, cfg.COL0
    FULL_WIDTH = cfg.VEC and not cfg.PAD_COLS   # every column of each tile is its input's
    EXP_MASK = EXP_BITS[DTYPE]
    ROWS = 2 * M_TILES              # the lane's keys
    ACOLS = cfg.ACC // 4            # the lane's dK columns
    ACOLS_V = cfg.ACC_V // 4        # the lane's dV columns
    Q_TILES = BLOCK_M // 16
    ZERO = float32(0.0)
    RAW = not (cfg.SOFTCAP or cfg.ALIBI or (FNS is not None and FNS[0] is not None))
    score_fn = make_score_fn(RAW, cfg.SOFTCAP, cfg.ALIBI, FNS, float32)
    row_stride = make_row_stride(cfg.STRIDED)

    @_stage
    def bad_do_fixup(dv_acc, do, do_at, q_start, key0, g, t, sa, bounds, umask):
        """Rare: a non-finite ``dO[i, c]`` (zeroed in the tile) makes ``dV[j, c]`` NaN for every
        key ``j`` row ``i`` sees (the reference's ``P * NaN``); read from global memory.  Bit
        ``c`` of ``bad[r]``: the lane's column ``c`` for its key ``r`` (bits, not array
        indices, in the run-time loop: ``dv_acc`` stays in registers)."""
        nk, left, right = bounds
        d = do.shape[3]
        do_base, do_row = do_at[0], row_stride(do_at[1])   # (STRIDED: dO's own row stride)
        bad = cuda.local.array(ROWS, uint64)
        for r in range(ROWS):
            bad[r] = uint64(0)
        for i in range(min(BLOCK_M, sa.nq - q_start)):
            row = q_start + i
            cols = uint64(0)
            for c in range(ACOLS_V):
                col = COL0 + 2 * t + 8 * (c >> 1) + (c & 1)
                x = uint32(load_u16(do, do_base + row * do_row + col)) if col < d else uint32(0)
                if (x & EXP_MASK) == EXP_MASK:
                    cols |= uint64(1) << uint64(c)
            if cols != uint64(0):
                mark_keys(BadKeys(bad, cols, row, key0, sa, bounds, umask))
        nan_columns(dv_acc, bad)

    @_stage
    def mark_key(r, x):
        nk, left, right = x.bounds
        key = x.key0 + 16 * (r >> 1) + 8 * (r & 1)
        if is_visible(x.row, key, x.sa.offset, nk, left, right) and (
                not MASK_MOD or score_fn(ZERO, x.row, key, x.sa, x.umask)[0]):
            x.bad[r] |= x.cols

    mark_keys = static_for(ROWS, mark_key)

    nan_columns = make_nan_columns(ROWS, ACOLS_V)

    @_stage
    def atomic_dq(dq_accum, c, tile_row, d, col, q_start, nq, g, scale, MASKED_ROWS):
        """``dq_accum += scale c`` for the lane's ``2 Q_TILES`` query rows and its columns
        ``col, col + 1, col + 8, col + 9`` of one column pair."""
        for r in range(2 * Q_TILES):
            m = 16 * (r >> 1) + 8 * (r & 1) + g
            if not MASKED_ROWS or q_start + m < nq:
                base = (tile_row + uint64(m)) * uint64(d) + uint64(col)
                for e in range(4):
                    off = 8 * (e >> 1) + (e & 1)
                    if FULL_WIDTH or col + off < d:
                        red_add(dq_accum, base + uint64(off), c[r, e] * scale)

    @_stage
    def store_row(r, x):
        d, d_v = x.dims
        t, row_base = x.t, x.row_base
        dk_out, dv_out, dk_acc, dv_acc = x.dk_out, x.dv_out, x.dk_acc, x.dv_acc
        key = x.key0 + 16 * (r >> 1) + 8 * (r & 1)
        if key < x.nk:
            base = (row_base + uint64(key)) * uint64(d) + uint64(COL0 + 2 * t)
            base_v = base
            if OWN_V:
                base_v = (row_base + uint64(key)) * uint64(d_v) + uint64(COL0 + 2 * t)
            for c in range(ACOLS if WANT_DK else 0):
                off = 8 * (c >> 1) + (c & 1)
                if FULL_WIDTH or COL0 + 2 * t + off < d:
                    dk_out[base + uint64(off)] = dk_acc[r, c] * x.scale
            for c in range(ACOLS_V if WANT_DV else 0):
                off = 8 * (c >> 1) + (c & 1)
                if FULL_WIDTH or COL0 + 2 * t + off < d_v:
                    dv_out[base_v + uint64(off)] = dv_acc[r, c]

    store_rows = static_for(ROWS, store_row)

    @_stage
    def store_dkdv(dk_out, dv_out, dk_acc, dv_acc, row_base, key0, nk, dims, t, scale):
        store_rows(DkdvStore(dk_out, dv_out, dk_acc, dv_acc, row_base, key0, nk, dims, t, scale))

    return DkdvRows(bad_do_fixup, atomic_dq, store_dkdv)


# -- the dK/dV kernel's contexts
#: the dK/dV step's context: shared memory, the variant and score arguments; the global inputs;
#: the lane's register arrays; its coordinates and shared-memory offsets
DkdvStep = namedtuple("DkdvStep", "smem va sa "
                      "q do lse delta dq_accum qo_base q_d row_base d bounds do_at "
                      "st dpt dk_acc dv_acc nlse2 dl da dqc "
                      "tid warp g t key0 a_lane q_b ds_lane")
#: the keys a non-finite dO row marks (``bad_do_fixup``'s row stage)
BadKeys = namedtuple("BadKeys", "bad cols row key0 sa bounds umask")
#: what the dK/dV kernel's store stage reads
DkdvStore = namedtuple("DkdvStore", "dk_out dv_out dk_acc dv_acc row_base key0 nk dims t scale")


#: the dK/dV kernel's copies and scans of its tiles (:func:`make_dkdv_loads`)
DkdvLoads = namedtuple("DkdvLoads", "copy_k copy_v scan_k scan_q scan_do load_q")


@functools.lru_cache(maxsize=None)
def make_dkdv_loads(cfg):
    """The dK/dV kernel's tile loads (:data:`DkdvLoads`): ``copy_k`` / ``copy_v`` (the block's K
    and V, once), ``scan_k`` (K's inf / NaN to 0), ``scan_q`` / ``scan_do`` (those of a masked
    query tile's Q and dO) and ``load_q`` (Q and dO of a query tile into a pipeline stage)."""
    BLOCK_M, BLOCK_N, HEAD_DIM, THREADS = cfg.STEP, cfg.BLOCK, cfg.HEAD_DIM, cfg.THREADS
    VEC, DTYPE, PAD = cfg.VEC, cfg.DTYPE, cfg.PAD_COLS
    HEAD_DIM_V, RB, RB_V = cfg.V_DIM, cfg.ROW_BYTES, cfg.V_ROW_BYTES
    QS_BYTE = BLOCK_N * (RB + RB_V + cfg.DS_ROW_BYTES)   # the stages: past K, V and dS^T
    STAGE_BYTES = BLOCK_M * (RB + RB_V)  # one stage: Q, then dO
    # the copies' and scans' thread offsets of Q / dO recomputed per tile (stages.in_loop): at
    # 255 registers they spilled otherwise; a user's build (registers of its own) spilled more
    # with them
    PER_TILE = cfg.USER is None
    STRIDED = cfg.STRIDED
    load_pair = make_pair_load(BLOCK_M, HEAD_DIM, RB, THREADS, VEC, BLOCK_M * RB, PER_TILE,
                               cfg.OWN_V, cfg.HEAD_DIM_V, PAD, STRIDED)
    return DkdvLoads(copy_k=make_tile_copy(BLOCK_N, HEAD_DIM, RB, THREADS, VEC, PAD, STRIDED),
                     copy_v=make_tile_copy(BLOCK_N, HEAD_DIM_V, RB_V, THREADS, VEC, PAD, STRIDED),
                     # (each scan with its copy's chunk plan: STRIDED)
                     scan_k=make_tile_scan(BLOCK_N, HEAD_DIM, RB, THREADS, DTYPE, False,
                                           STRIDED),
                     scan_q=make_tile_scan(BLOCK_M, HEAD_DIM, RB, THREADS, DTYPE, PER_TILE,
                                           STRIDED),
                     scan_do=make_tile_scan(BLOCK_M, HEAD_DIM_V, RB_V, THREADS, DTYPE, PER_TILE,
                                            STRIDED),
                     load_q=make_stage_load(load_pair, QS_BYTE, STAGE_BYTES))


@functools.lru_cache(maxsize=None)
def make_dkdv_step(cfg, MASKED):
    """``step(qt, qt_next, stage, t_hi, x, umask)``: the dK/dV kernel's work on query tile
    ``qt`` (``x``: the :data:`DkdvStep`; ``MASKED``: not every row sees every key of the block,
    or some lie past ``Nq``): ``-lse log2 e`` and ``D`` of the lane's queries, ``S^T = K Q^T``,
    ``dP^T = V dO^T``, ``P^T Z`` and ``dS^T`` (:func:`make_tile_p_ds`), ``dV``, ``dK`` and
    (``DQ_ATOMIC``) ``dq_accum``; tile ``qt_next``'s copy into the other stage runs beneath
    (one stage: after the math)."""
    FNS = _user_parts(cfg.USER)[0]
    NUM_WARPS, M_TILES, BLOCK_M, HEAD_DIM, Q_STAGES = (cfg.NUM_WARPS, cfg.M_TILES, cfg.STEP,
                                                       cfg.HEAD_DIM, cfg.STAGES)
    WANT_DV, WANT_DK, DQ_ATOMIC, DTYPE = cfg.WANT_DV, cfg.WANT_DK, cfg.DQ_ATOMIC, cfg.DTYPE
    HEAD_DIM_V, RB_V = cfg.V_DIM, cfg.V_ROW_BYTES   # V, dO, dV: HEAD_DIM's unless OWN_V
    BLOCK_N, RB, DS_RB = cfg.BLOCK, cfg.ROW_BYTES, cfg.DS_ROW_BYTES
    SAME_RB = RB_V == RB            # V and dO rows as K's and Q's: the same lane offsets
    K_BYTE, V_BYTE, DS_BYTE = 0, BLOCK_N * RB, BLOCK_N * (RB + RB_V)
    QS_BYTE = DS_BYTE + BLOCK_N * DS_RB
    STAGE_BYTES = BLOCK_M * (RB + RB_V)  # one stage: Q, then dO
    DO_OFF = BLOCK_M * RB
    WARP_KEYS_BYTES = 16 * M_TILES * RB   # one warp's keys in K's tile
    WARP_V_BYTES = 16 * M_TILES * RB_V    # and in V's
    COL0, ACC, ACC_V = cfg.COL0, cfg.ACC, cfg.ACC_V
    ROWS = 2 * M_TILES              # the lane's keys
    QCOLS = BLOCK_M // 4            # the lane's queries per step
    K_STEPS = HEAD_DIM // 16
    K_STEPS_V = HEAD_DIM_V // 16
    Q_TILES = BLOCK_M // 16
    P_STEPS = BLOCK_N // 16         # k-steps of dQ = dS K (16 keys each)
    D_PAIRS = HEAD_DIM // 16
    PAIRS_PER_WARP = -(-D_PAIRS // NUM_WARPS)
    EXACT_PAIRS = D_PAIRS % NUM_WARPS == 0
    NEED_DS = WANT_DK or DQ_ATOMIC
    ZERO = float32(0.0)
    NEG_INF = float32(-math.inf)
    LOG2E_F = float32(LOG2E)
    gemm_st = make_gemm(M_TILES, Q_TILES, K_STEPS, "smem", False, RB, RB, DTYPE)  # K Q^T
    gemm_dpt = make_gemm(M_TILES, Q_TILES, K_STEPS_V, "smem", False, RB_V, RB_V, DTYPE)  # V dO^T
    gemm_dk = make_gemm(M_TILES, ACC // 16, Q_TILES, "acc", True, RB, RB, DTYPE)  # dS^T Q
    gemm_dv = make_gemm(M_TILES, ACC_V // 16, Q_TILES, "acc", True, RB, RB_V, DTYPE)  # P^T dO
    gemm_dq = make_gemm(Q_TILES, 1, P_STEPS, "regs", True, DS_RB, RB, DTYPE)  # dS K
    load_ds = make_load_a(Q_TILES, P_STEPS, DS_RB, True)
    store_ds = make_store_t(M_TILES, QCOLS // 2, DTYPE, DS_RB)
    loads, rows = make_dkdv_loads(cfg), make_dkdv_rows(cfg)
    scan_q, scan_do, load_q = loads.scan_q, loads.scan_do, loads.load_q
    bad_do_fixup, atomic_dq = rows.bad_do_fixup, rows.atomic_dq
    tile_p_ds = make_tile_p_ds(ROWS, QCOLS, True, MASKED, cfg.DROPOUT, cfg.SOFTCAP, cfg.ALIBI,
                               FNS)

    # [docs:mma-dkdv-step]
    @_stage
    def step(qt, qt_next, stage, t_hi, x, umask):   # x: the DkdvStep
        q, do, lse, delta, dq_accum = x.q, x.do, x.lse, x.delta, x.dq_accum
        smem, va, sa = x.smem, x.va, x.sa
        qo_base, row_base, d, bounds, do_at = x.qo_base, x.row_base, x.d, x.bounds, x.do_at
        q_d = x.q_d     # the loads' d (STRIDED: with Q's row stride); d: dq_accum's
        st, dpt, dk_acc, dv_acc = x.st, x.dpt, x.dk_acc, x.dv_acc
        nlse2, dl, da, dqc = x.nlse2, x.dl, x.da, x.dqc
        tid, warp, g, t, key0 = x.tid, x.warp, x.g, x.t, x.key0
        a_lane, q_b, ds_lane = x.a_lane, x.q_b, x.ds_lane
        # the lane offsets, per tile (in_loop: each derived address is not held across the
        # loop in a register of its own)
        a_lane = in_loop(a_lane)
        k_t = K_BYTE + a_lane                     # K's rows for dQ (all warps)
        k_a = k_t + WARP_KEYS_BYTES * warp        # this warp's K rows
        q_t = a_lane + 32 * (COL0 // 16)          # Q^T for dK
        ds_a = DS_BYTE + in_loop(ds_lane)
        q_b = in_loop(q_b)
        if SAME_RB:   # V's and dO's rows are K's and Q's width
            v_a, do_t, do_b = k_a + (V_BYTE - K_BYTE), q_t, q_b
        else:         # their own width: their own lane offsets
            ln = in_loop(tid) & 31
            v_a = V_BYTE + lane_offset(ln, RB_V, KIND_A) + WARP_V_BYTES * warp
            do_t = lane_offset(ln, RB_V, KIND_A) + 32 * (COL0 // 16)   # dO^T for dV
            do_b = lane_offset(ln, RB_V, KIND_B)
        q_start = qt * BLOCK_M
        qb = QS_BYTE + (stage * STAGE_BYTES if Q_STAGES > 1 else 0)
        tile_row = row_base + uint64(q_start)
        for c in range(QCOLS):   # -lse log2 e and D of the lane's queries
            m = 8 * (c >> 1) + 2 * t + (c & 1)
            nlse2[c] = -NEG_INF
            dl[c] = ZERO
            if not MASKED or q_start + m < sa.nq:
                nlse2[c] = -(lse[tile_row + uint64(m)] * LOG2E_F)
                dl[c] = delta[tile_row + uint64(m)]
        cp_async_wait_all()
        do_bad = 0
        if MASKED:  # 0 * inf = NaN on the tensor cores: zero this thread's Q, dO chunks
            scan_q(smem, qb, sa.nq - q_start, tid)
            do_bad = cuda.syncthreads_or(  # Q/dO landed and zeroed; any non-finite dO?
                1 if scan_do(smem, qb + DO_OFF, sa.nq - q_start, tid) else 0)
        else:
            cuda.syncthreads()  # Q/dO tile qt landed for all; all warps are done with qt - 1
        if Q_STAGES > 1:  # the next Q tile's copy runs under this tile's math
            load_q(smem, stage ^ 1, q, do, qo_base, qt_next, t_hi, sa.nq, q_d, tid, do_at)
        for r in range(ROWS):
            for c in range(QCOLS):
                st[r, c] = ZERO
                dpt[r, c] = ZERO
        gemm_st(st, st, smem, k_a, qb + q_b)                          # S^T = K Q^T
        if NEED_DS:
            gemm_dpt(dpt, dpt, smem, v_a, qb + DO_OFF + do_b)          # dP^T = V dO^T
        tile_p_ds(st, dpt, nlse2, dl, key0, q_start + 2 * t, sa, bounds, va, umask,
                  va.scale * LOG2E_F)                                 # P^T Z, dS^T
        if WANT_DV:
            gemm_dv(dv_acc, st, smem, 0, qb + DO_OFF + do_t)          # dV += (P Z)^T dO
            if MASKED and do_bad:
                bad_do_fixup(dv_acc, do, do_at, q_start, key0, g, t, sa, bounds, umask)
        if WANT_DK:
            gemm_dk(dk_acc, dpt, smem, 0, qb + q_t)                    # dK += dS^T Q
        if DQ_ATOMIC:
            store_ds(smem, DS_BYTE + 16 * M_TILES * DS_RB * warp, dpt, g, t)
        if DQ_ATOMIC or Q_STAGES == 1:
            cuda.syncthreads()  # dS^T complete for every warp; all are done with Q/dO of qt
        if Q_STAGES == 1:
            load_q(smem, 0, q, do, qo_base, qt_next, t_hi, sa.nq, q_d, tid, do_at)
        if DQ_ATOMIC:  # dQ += scale dS K: the warps split dQ's column pairs
            load_ds(da, smem, ds_a)
            for i in range(PAIRS_PER_WARP):
                p = warp + i * NUM_WARPS
                if EXACT_PAIRS or p < D_PAIRS:
                    for r in range(2 * Q_TILES):
                        for e in range(4):
                            dqc[r, e] = ZERO
                    gemm_dq(dqc, da, smem, 0, k_t + 32 * p)
                    atomic_dq(dq_accum, dqc, tile_row, d, 16 * p + 2 * t, q_start, sa.nq,
                              g, va.scale, MASKED)
    # [/docs:mma-dkdv-step]

    return step


@functools.lru_cache(maxsize=None)
def dkdv_mma_kernel(cfg):
    """Build ``kernel(q, k, v, do, lse, delta, dq_accum, dk_out, dv_out, va, tiles)`` for a
    ``"dkdv"`` :class:`~numba_flash.kernels.backward.config.BackwardMmaConfig`.

    ``q, k, v, do``: uint16 views of the ``DTYPE`` ``[B, H(kv), N, d]`` (C-contiguous);
    ``lse``, ``delta``: flat float32 views of ``[B, H, Nq]``; ``dq_accum``: the flat float32 view
    of ``[B, H, Nq, d]`` (atomics, with ``DQ_ATOMIC``); ``dk_out``, ``dv_out``: flat float32
    views of ``[B, H, Nk, d]`` (this query head's share, dK times ``scale``; with ``OWN_V``,
    ``v``, ``do`` and ``dv_out`` have ``d_v = v.shape[3]`` columns); ``va``: the
    :class:`~numba_flash.kernels.core.variant.Variant`; ``tiles = ceil(Nk / BLOCK)``."""
    assert cfg.KIND == "dkdv" and cfg.DTYPE in MMA_DTYPES and cfg.HEAD_DIM % 16 == 0
    BLOCKS = _user_parts(cfg.USER)[2]
    M_TILES, BLOCK_M, Q_STAGES, OWN_V = cfg.M_TILES, cfg.STEP, cfg.STAGES, cfg.OWN_V
    DQ_ATOMIC = cfg.DQ_ATOMIC
    BLOCK_N, RB, DS_RB = cfg.BLOCK, cfg.ROW_BYTES, cfg.DS_ROW_BYTES
    K_BYTE, V_BYTE = 0, BLOCK_N * RB   # K's tile, then V's (make_dkdv_step)
    SMEM_WORDS = cfg.SMEM_BYTES // 4
    ROWS = 2 * M_TILES              # the lane's keys
    QCOLS = BLOCK_M // 4            # the lane's queries per step
    ACOLS = cfg.ACC // 4            # the lane's dK columns
    ACOLS_V = cfg.ACC_V // 4        # the lane's dV columns
    Q_TILES = BLOCK_M // 16
    DQ_ROWS = 2 * Q_TILES           # the lane's rows of a dQ column pair
    P_STEPS = BLOCK_N // 16         # k-steps of dQ = dS K (16 keys each)
    ZERO = float32(0.0)
    # -- the stages
    loads = make_dkdv_loads(cfg)
    copy_k, copy_v, scan_k, load_q = loads.copy_k, loads.copy_v, loads.scan_k, loads.load_q
    next_q, visit = make_query_walk(cfg)
    store_dkdv = make_dkdv_rows(cfg).store_dkdv
    backward_block = make_backward_block(cfg.ALIBI)
    backward_bases = make_backward_bases(cfg.STRIDED, OWN_V)
    step_masked = make_dkdv_step(cfg, True)
    step_full = make_dkdv_step(cfg, False)
    walk = make_tile_walk(step_full, step_masked, visit, next_q, Q_STAGES,
                          1 if BLOCKS is None else 0)

    # a user's functions stay out of the on-disk kernel cache (their code is not in this
    # package's sources, which key it): such a build is compiled in each process
    @kernel_jit(cache=cfg.USER is None)
    def backward_dkdv_mma(q, k, v, do, lse, delta, dq_accum, dk_out, dv_out, va, tiles):
        tid = cuda.threadIdx.x
        blk = backward_block(q, k, va, tid, tiles)   # this block's K/V tile, this lane
        k_start = blk.tile * BLOCK_N
        k_end = min(k_start + BLOCK_N, blk.nk)
        key0 = k_start + 16 * M_TILES * blk.warp + blk.g   # the lane's first key (rows of S^T)

        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SHARED_ALIGN)
        st = cuda.local.array((ROWS, QCOLS), float32)     # S^T, then P^T Z
        dpt = cuda.local.array((ROWS, QCOLS), float32)    # dP^T, then dS^T
        dk_acc = cuda.local.array((ROWS, ACOLS), float32)
        dv_acc = cuda.local.array((ROWS, ACOLS_V), float32)
        nlse2 = cuda.local.array(QCOLS, float32)          # -lse log2 e of the lane's queries
        dl = cuda.local.array(QCOLS, float32)             # D of the lane's queries
        da = cuda.local.array((Q_TILES, P_STEPS, 4), uint32)  # dQ's A fragments (dS)
        dqc = cuda.local.array((DQ_ROWS, 4), float32)          # dQ of one column pair
        for r in range(ROWS):
            for c in range(ACOLS):
                dk_acc[r, c] = ZERO
            for c in range(ACOLS_V):
                dv_acc[r, c] = ZERO

        q_lo, q_hi = tile_query_range(k_start, k_end, blk.offset, blk.nq, blk.left, blk.right)
        r_lo, r_hi = full_query_rows(k_start, k_start + BLOCK_N, blk.offset, blk.nq, blk.nk,
                                     blk.left, blk.right)
        t_lo = int32(q_lo // BLOCK_M)
        t_hi = int32((q_hi + BLOCK_M - 1) // BLOCK_M)
        f_lo = int32(min(max((r_lo + BLOCK_M - 1) // BLOCK_M, t_lo), t_hi))
        f_hi = int32(min(max(r_hi // BLOCK_M, f_lo), t_hi))  # unmasked Q tiles: [f_lo, f_hi)

        # -- prologue: K and V (K's inf / NaN zeroed: it multiplies dS = 0 in dQ), the first
        # query tile (the block mask's first non-EMPTY one) into stage 0
        # this block's K and V rows, the (b, h) start of Q and dO (STRIDED: with row strides)
        ob = backward_bases(q, k, v, do, blk, 0, k_start)
        copy_k(smem, K_BYTE, k, ob.k_base, k_end - k_start, ob.k_d, tid)
        copy_v(smem, V_BYTE, v, ob.v_at[0], k_end - k_start, ob.v_at[1], tid)
        # the unmasked Q tiles' bounds live in shared memory: read once per tile, they cost
        # no register across the loop (at 255, ptxas spilled them to local memory)
        span = cuda.shared.array(2, int32)
        if tid == 0:
            span[0] = f_lo
            span[1] = f_hi
        w = QueryWalk(va.user, blk.b, blk.h, blk.tile, blk.nq, blk.nk, t_hi, span, tid)
        qt = next_q(t_lo - 1, w)   # the first query tile (the block mask's first non-EMPTY one)
        load_q(smem, 0, q, do, ob.q_base, qt, t_hi, blk.nq, ob.q_d, tid, ob.do_at)
        cp_async_wait_all()
        if DQ_ATOMIC:
            scan_k(smem, K_BYTE, k_end - k_start, tid)   # own chunks: no barrier before
        cuda.syncthreads()  # the tile span is written before any thread's first verdict

        # (b, h) as a uint32: the grid has < 2**31 blocks, and a 32-bit value is one register
        ctx = DkdvStep(smem, va, blk.sa,
                       q, do, lse, delta, dq_accum, ob.q_base, ob.q_d,
                       uint64(uint32(blk.bh)) * uint64(blk.nq), blk.d,
                       (blk.nk, blk.left, blk.right), ob.do_at,
                       st, dpt, dk_acc, dv_acc, nlse2, dl, da, dqc,
                       tid, blk.warp, blk.g, blk.t, key0, lane_offset(blk.lane, RB, KIND_A),
                       lane_offset(blk.lane, RB, KIND_B), lane_offset(blk.lane, DS_RB, KIND_B))
        walk(qt, next_q(qt, w), t_hi, w, ctx)

        # -- this query head's dK (times scale) and dV, in float32
        store_dkdv(dk_out, dv_out, dk_acc, dv_acc, uint64(uint32(blk.bh)) * uint64(blk.nk), key0,
                   blk.nk, (blk.d, ob.d_v), blk.t, va.scale)

    return backward_dkdv_mma


# -- the dQ kernel's contexts
#: the dQ step's context: shared memory, the variant and score arguments; the K/V inputs; the
#: lane's register arrays; its coordinates and shared-memory offsets
DqStep = namedtuple("DqStep", "smem va sa k v kv_base nk d bounds v_at qf dof s dp acc nlse2 dl "
                    "tid t row0 q_a k_b k_t do_a v_b")
#: the dQ kernel's row statistics stage and store stage
DqRowStats = namedtuple("DqRowStats", "nlse2 dl lse delta row_base row0 nq")
DqStore = namedtuple("DqStore", "dq_accum acc row_base row0 nq d t scale")


@functools.lru_cache(maxsize=None)
def dq_mma_kernel(cfg):
    """Build ``kernel(q, k, v, do, lse, delta, dq_accum, va, tiles)`` for a ``"dq"``
    :class:`~numba_flash.kernels.backward.config.BackwardMmaConfig`: ``dq_accum = scale * dS K``
    (float32, its flat view) without atomics (``deterministic=True``); arguments as
    :func:`dkdv_mma_kernel`, ``tiles = ceil(Nq / BLOCK)``.  ``COL0``, ``ACC_DIM``: only dQ's
    columns ``COL0 .. COL0 + ACC - 1`` (:func:`dq_passes`)."""
    assert cfg.KIND == "dq" and cfg.DTYPE in MMA_DTYPES and cfg.HEAD_DIM % 16 == 0
    FNS, MASK_MOD, BLOCKS = _user_parts(cfg.USER)
    LOG = on_simulator() and cfg.USER is not None
    M_TILES, BLOCK_N, HEAD_DIM, KV_STAGES, DTYPE = (cfg.M_TILES, cfg.STEP, cfg.HEAD_DIM,
                                                    cfg.STAGES, cfg.DTYPE)
    OWN_V = cfg.OWN_V
    BLOCK_M, THREADS, RB = cfg.BLOCK, cfg.THREADS, cfg.ROW_BYTES
    HEAD_DIM_V, RB_V = cfg.V_DIM, cfg.V_ROW_BYTES   # V, dO: HEAD_DIM's unless OWN_V
    Q_BYTE, DO_BYTE, KV_BYTE = 0, BLOCK_M * RB, BLOCK_M * (RB + RB_V)
    KV_TILE = BLOCK_N * RB
    STAGE_BYTES = BLOCK_N * (RB + RB_V)   # one stage: K, then V
    COL0, ACC = cfg.COL0, cfg.ACC
    SMEM_WORDS = cfg.SMEM_BYTES // 4
    ROWS = 2 * M_TILES
    KEYS = BLOCK_N // 4
    ACOLS = ACC // 4
    K_STEPS = HEAD_DIM // 16
    K_STEPS_V = HEAD_DIM_V // 16
    ZERO = float32(0.0)
    NEG_INF = float32(-math.inf)
    LOG2E_F = float32(LOG2E)
    Q_REGS = cfg.Q_IN_REGS          # Q, dO fragments in registers, else from shared memory
    A_SRC = "regs" if Q_REGS else "smem"
    load_a = make_load_a(M_TILES, K_STEPS, RB)
    load_a_v = make_load_a(M_TILES, K_STEPS_V, RB_V)
    gemm_s = make_gemm(M_TILES, BLOCK_N // 16, K_STEPS, A_SRC, False, RB, RB, DTYPE)      # Q K^T
    gemm_dp = make_gemm(M_TILES, BLOCK_N // 16, K_STEPS_V, A_SRC, False, RB_V, RB_V, DTYPE)
    gemm_dq = make_gemm(M_TILES, ACC // 16, BLOCK_N // 16, "acc", True, RB, RB, DTYPE)
    STRIDED = cfg.STRIDED
    copy_q = make_tile_copy(BLOCK_M, HEAD_DIM, RB, THREADS, cfg.VEC, cfg.PAD_COLS, STRIDED)
    copy_do = make_tile_copy(BLOCK_M, HEAD_DIM_V, RB_V, THREADS, cfg.VEC, cfg.PAD_COLS, STRIDED)
    scan_k = make_tile_scan(BLOCK_N, HEAD_DIM, RB, THREADS, DTYPE, STRIDED=STRIDED)  # (its copy)
    tile_span = make_tile_span(BLOCK_N)
    backward_block = make_backward_block(cfg.ALIBI)
    backward_bases = make_backward_bases(STRIDED, OWN_V)

    load_pair = make_pair_load(BLOCK_N, HEAD_DIM, RB, THREADS, cfg.VEC, KV_TILE, False, OWN_V,
                               cfg.HEAD_DIM_V, cfg.PAD_COLS, STRIDED)

    load_kv = make_stage_load(load_pair, KV_BYTE, STAGE_BYTES)   # K and V of a key tile

    def make_step(MASKED):
        tile_p_ds = make_tile_p_ds(ROWS, KEYS, False, MASKED, cfg.DROPOUT, cfg.SOFTCAP,
                                   cfg.ALIBI, FNS)

        # [docs:mma-dq-step]
        @_stage
        def step(kt, kt_next, stage, t_hi, x, umask):   # x: the DqStep
            smem, s, dp = x.smem, x.s, x.dp
            k_start = kt * BLOCK_N
            kb = KV_BYTE + (stage * STAGE_BYTES if KV_STAGES > 1 else 0)
            cp_async_wait_all()
            if MASKED:
                scan_k(smem, kb, x.nk - k_start, x.tid)  # K inf / NaN -> 0: it multiplies dS = 0
            cuda.syncthreads()  # tile kt landed for all threads; all warps are done with kt - 1
            if KV_STAGES > 1:  # the next tile's copy runs under this tile's math
                load_kv(smem, stage ^ 1, x.k, x.v, x.kv_base, kt_next, t_hi, x.nk, x.d, x.tid,
                        x.v_at)
            for r in range(ROWS):
                for c in range(KEYS):
                    s[r, c] = ZERO
                    dp[r, c] = ZERO
            gemm_s(s, x.qf, smem, Q_BYTE + x.q_a, kb + x.k_b)                  # S = Q K^T
            gemm_dp(dp, x.dof, smem, DO_BYTE + x.do_a, kb + KV_TILE + x.v_b)   # dP = dO V^T
            tile_p_ds(s, dp, x.nlse2, x.dl, x.row0, k_start + 2 * x.t, x.sa, x.bounds, x.va,
                      umask, x.va.scale * LOG2E_F)                             # dS (in dp)
            gemm_dq(x.acc, dp, smem, 0, kb + x.k_t)                            # dQ += dS K
            if KV_STAGES == 1:
                cuda.syncthreads()  # every warp is done with this K/V tile: the next one
                load_kv(smem, 0, x.k, x.v, x.kv_base, kt_next, t_hi, x.nk, x.d, x.tid, x.v_at)
        # [/docs:mma-dq-step]

        return step

    step_masked = make_step(True)
    step_full = make_step(False)
    walk, nxt = make_kv_walk(step_full, step_masked, BLOCKS, MASK_MOD, BLOCK_N, KV_STAGES,
                             1, LOG)

    @_stage
    def row_stats(r, x):
        row = x.row0 + 16 * (r >> 1) + 8 * (r & 1)
        x.nlse2[r] = -NEG_INF              # rows past Nq: lse = -inf (P = 0 on masked tiles)
        x.dl[r] = ZERO
        if row < x.nq:
            x.nlse2[r] = -(x.lse[x.row_base + uint64(row)] * LOG2E_F)
            x.dl[r] = x.delta[x.row_base + uint64(row)]

    load_stats = static_for(ROWS, row_stats)

    @_stage
    def store_row(r, x):
        row = x.row0 + 16 * (r >> 1) + 8 * (r & 1)
        if row < x.nq:
            base = (x.row_base + uint64(row)) * uint64(x.d)
            for c in range(ACOLS):
                col = COL0 + 2 * x.t + 8 * (c >> 1) + (c & 1)
                if col < x.d:
                    x.dq_accum[base + uint64(col)] = x.acc[r, c] * x.scale

    store_rows = static_for(ROWS, store_row)

    @kernel_jit(cache=cfg.USER is None)  # a user's functions stay off the on-disk kernel cache
    def backward_dq_mma(q, k, v, do, lse, delta, dq_accum, va, tiles):
        tid = cuda.threadIdx.x
        blk = backward_block(q, k, va, tid, tiles)   # this block's Q tile, this lane
        q_start = blk.tile * BLOCK_M
        q_end = min(q_start + BLOCK_M, blk.nq)
        row0 = q_start + 16 * M_TILES * blk.warp + blk.g   # the lane's first row
        row_base = uint64(uint32(blk.bh)) * uint64(blk.nq)

        smem = cuda.shared.array(SMEM_WORDS, uint32, alignment=SHARED_ALIGN)
        qf = cuda.local.array((M_TILES, K_STEPS, 4) if Q_REGS else (1, 1, 4),
                              uint32)   # Q's A fragments (with Q_REGS)
        dof = cuda.local.array((M_TILES, K_STEPS_V, 4) if Q_REGS else (1, 1, 4),
                               uint32)  # dO's
        s = cuda.local.array((ROWS, KEYS), float32)             # S, then P
        dp = cuda.local.array((ROWS, KEYS), float32)            # dP, then dS
        acc = cuda.local.array((ROWS, ACOLS), float32)
        nlse2 = cuda.local.array(ROWS, float32)
        dl = cuda.local.array(ROWS, float32)
        for r in range(ROWS):
            for c in range(ACOLS):
                acc[r, c] = ZERO
        load_stats(DqRowStats(nlse2, dl, lse, delta, row_base, row0, blk.nq))

        # the K/V tiles rows [q_start, q_end) visit, and the unmasked ones [f_lo, f_hi)
        t_lo, t_hi, f_lo, f_hi = tile_span(q_start, q_end, blk.offset, blk.nk, blk.left, blk.right)
        if q_start + BLOCK_M > blk.nq:   # rows past Nq: every tile masked
            f_hi = f_lo
        w = KvWalk(va.user, blk.b, blk.h, q_start, q_end, blk.nk, t_hi, f_lo, f_hi, tid)

        # -- prologue: Q and dO of the block's rows (their fragments into registers), the
        # first K/V tile
        # (STRIDED: the bases and row strides of each operand's own view)
        ob = backward_bases(q, k, v, do, blk, q_start, 0)
        copy_q(smem, Q_BYTE, q, ob.q_base, q_end - q_start, ob.q_d, tid)
        copy_do(smem, DO_BYTE, do, ob.do_at[0], q_end - q_start, ob.do_at[1], tid)
        kt = nxt(t_lo - 1, w)   # the first tile (a block mask's EMPTY tiles are never loaded)
        load_kv(smem, 0, k, v, ob.k_base, kt, t_hi, blk.nk, ob.k_d, tid, ob.v_at)   # + Q, dO
        cp_async_wait_all()
        cuda.syncthreads()  # Q and dO landed for all before any warp reads its fragments
        a_off = 16 * M_TILES * RB * blk.warp + lane_offset(blk.lane, RB, KIND_A)
        do_off = 16 * M_TILES * RB_V * blk.warp + lane_offset(blk.lane, RB_V, KIND_A)
        if Q_REGS:
            load_a(qf, smem, Q_BYTE + a_off)
            load_a_v(dof, smem, DO_BYTE + do_off)

        ctx = DqStep(smem, va, blk.sa,
                     k, v, ob.k_base, blk.nk, ob.k_d, (blk.nk, blk.left, blk.right), ob.v_at,
                     qf, dof, s, dp, acc, nlse2, dl,
                     tid, blk.t, row0, a_off, lane_offset(blk.lane, RB, KIND_B),
                     lane_offset(blk.lane, RB, KIND_A) + 32 * (COL0 // 16), do_off,
                     lane_offset(blk.lane, RB_V, KIND_B))
        walk(kt, nxt(kt, w), t_hi, w, ctx)

        # -- dQ (times scale), in float32
        store_rows(DqStore(dq_accum, acc, row_base, row0, blk.nq, blk.d, blk.t, va.scale))

    return backward_dq_mma


def compile_config(cfg):
    """The compile tier's entry of one configuration (its Numba argument types)."""
    u16 = types.Array(types.uint16, 4, "A" if cfg.STRIDED else "C")   # (a view's strides)
    f32_1 = types.Array(types.float32, 1, "C")
    user_t = ()
    if cfg.USER is not None:  # kinds and the two aux arrays of _user_build
        user_t = (types.Array(types.int8, 4, "C"), types.Array(types.float32, 2, "C"),
                  types.Array(types.int32, 2, "C"))
    va_t = variant_type(types.float32, cfg.DROPOUT, user_t)
    m_tiles, hd, acc, step = cfg.M_TILES, cfg.HEAD_DIM, cfg.ACC, cfg.STEP
    if cfg.KIND == "dkdv":
        args = (u16, u16, u16, u16, f32_1, f32_1, f32_1, f32_1, f32_1, va_t, types.int64)
        pairs = hd // 16
        # one query tile per warp on the common path: S^T, dP^T, dV, dK and the warp's dQ pairs
        mma = (m_tiles * (step // 8) * (hd // 16) * (1 + int(cfg.WANT_DK or cfg.DQ_ATOMIC))
               + m_tiles * (acc // 8) * (step // 16) * (int(cfg.WANT_DV) + int(cfg.WANT_DK))
               + ((step // 16) * 2 * (cfg.BLOCK // 16) * -(-pairs // cfg.NUM_WARPS)
                  if cfg.DQ_ATOMIC else 0))
        kernel = dkdv_mma_kernel(cfg)
    else:
        args = (u16, u16, u16, u16, f32_1, f32_1, f32_1, va_t, types.int64)
        # one K/V tile per warp: S, dP (M_TILES (STEP / 8) (HEAD_DIM / 16) each), dQ
        mma = 2 * m_tiles * (step // 8) * (hd // 16) + m_tiles * (step // 16) * (acc // 8)
        kernel = dq_mma_kernel(cfg)
    return {"name": cfg.name, "config": cfg, "kernel": kernel, "args": args,
            "float64_ok": False, "mma": True, "sass": {"expect_mma": mma}}


assert all(backward_mma_config(hd, kind, simulator=False, **p).SMEM_BYTES <= SMEM_LIMIT
           for hd in BACKWARD_MMA_TILES for kind in ("dkdv", "dq") for p in
           (dkdv_passes(hd, False) if kind == "dkdv" else dq_passes(hd)))
