"""The online-softmax stage: ``m_i``, ``l_i`` and the rescaled accumulator of the rows a lane
holds, updated tile by tile, and the epilogue that turns them into ``o`` and ``lse``.

The one home of the update and of its ``l = 0`` / NaN rules; the tiled forwards (SIMT and
tensor-core) call it.  ``[docs: online-softmax.md, tiled-forward.md]`` derive it.

Layout
------
A lane holds ``ROWS`` rows of the tile; for each its scores ``s[r, 0:COLS]`` (this lane's keys
of the tile, ``-inf`` for a key the row does not see) and its accumulator ``acc[r,
0:ACC_COLS]`` (this lane's output columns).  A row's keys are spread over the lanes whose ids
differ in the bits of ``XOR`` (compile time: ``(1, 2)`` for an ``mma`` fragment's quad,
``(THREADS_N / 2, ..., 1)`` for the SIMT forward's row of threads, ``()`` for a lane that holds
whole rows): its max is combined over them every tile by ``shfl_xor`` in that order, its sum
once, at the end (the partial sums share ``m_i``).

Per tile and row (:func:`make_online_softmax`'s ``update``)::

    m_new = max(m_i, rowmax(s));  m_use = m_new, or 0 while the row has seen no key
    alpha = exp(m_i - m_use);  p = exp(s - m_use);  l_i = alpha l_i + rowsum(p);  acc *= alpha

``EXP`` (compile time) says how ``exp`` is taken: ``"ex2"`` for scores in raw ``q . k`` units
with the scale folded into the exponent, ``exp(scale (x - m)) = ex2(x c - m c)`` with ``c =
scale log2(e)`` (one FFMA and one MUFU.EX2 per score; the tensor-core forward), or ``"exp"``
for scores in natural units, ``exp(x - m)`` (float32: ``ex2((x - m) log2 e)``, float64:
libdevice ``exp``; the SIMT forward).  The max is ``max.f32`` (NaN loses); a NaN score still
makes ``p`` and so ``l_i`` NaN.  ``s`` leaves holding ``p``.

The epilogue (``finalize``): ``l = 0`` (the row saw no key) gives ``o = 0``, ``lse = -inf``;
otherwise ``1 / l`` and ``lse = m lse_scale + log(l)`` (NaN when ``l`` is: a NaN score).
"""

from __future__ import annotations

import functools
import math
from collections import namedtuple

from numba import cuda, float32, int32

from ..core.jit import device_jit, static_for
from ..ptx.stages import ex2, fma, fmax, make_exp_e, shfl_xor, store_at, warp_any

_device = functools.partial(device_jit, inline=True)

#: what the update's row stages read (:func:`make_online_softmax`): the scores, accumulator,
#: ``m_i``, ``l_i``, the rows' new max and rescale factors, the rescale flag, the exponent factor
SoftmaxRows = namedtuple("SoftmaxRows", "s acc m_i l_i mx alpha need c")
#: the epilogue's rows (:func:`make_epilogue`): the lane's first row, the rows, where its ``o``
#: and ``lse`` elements start, whether this lane writes ``lse``, ``lse``'s row stride
EpilogueRows = namedtuple("EpilogueRows", "row0 nq o_elem0 o_row lse_elem0 write_lse lse_row")
#: what the epilogue's row stage reads
EpilogueArgs = namedtuple("EpilogueArgs", "o lse acc m_i l_i lse_scale rows cols sink")

#: how the update takes ``exp`` (see the module docstring)
EXP_MODES = ("ex2", "exp")

#: the tensor-core forward's ``RESCALE`` (:func:`make_online_softmax`): ``m_i`` stays until a
#: row max passes it by ``2**8`` (``P <= 256``: exact in float16 / bfloat16 and float32)
RESCALE_LOG2 = 8.0


@functools.lru_cache(maxsize=None)
def make_lane_reduce(XOR, combine):
    """``reduce(x)``: ``x`` combined with the ``x`` of the lanes whose ids differ in the bits of
    ``XOR``, one ``shfl_xor`` per entry in that order (``combine``: a two-argument device
    function; every lane gets the same bits)."""
    if not XOR:
        @_device
        def same(x):
            return x
        return same
    first = XOR[0]
    rest = make_lane_reduce(XOR[1:], combine)

    @_device
    def reduce(x):
        return rest(combine(x, shfl_xor(x, first)))

    return reduce


@_device
def _add(a, b):
    return a + b


def _vmax(acc_t):
    """The row max of the compute type: ``max.f32`` for float32; float64 keeps the larger."""
    if acc_t == float32:
        return fmax

    @_device
    def dmax(a, b):
        return a if a > b else b

    return dmax


# [docs:online-softmax-stage]
@functools.lru_cache(maxsize=None)
def make_online_softmax(ROWS, COLS, ACC_COLS, XOR, EXP, acc_t, RESCALE=None, ALPHA_OUT=False):
    """``(init, update, finalize)`` for a lane's ``ROWS`` rows of ``COLS`` scores and
    ``ACC_COLS`` accumulator columns, reduced over the lanes of ``XOR`` (module docstring):

    * ``init(m_i, l_i, acc)``: ``m_i = -inf``, ``l_i = 0``, ``acc = 0``;
    * ``update(s, acc, m_i, l_i, c)``: one tile (``c``: the exponent scale of ``EXP = "ex2"``,
      unused with ``"exp"``); ``s`` becomes ``P``;
    * ``finalize(m_i, l_i, r, lse_scale, sink) -> (inv_l, lse)`` for row ``r`` (``lse_scale``:
      the scale of raw-unit ``m``, 1 in natural units; ``sink``: a learnable sink's logit in
      natural units, a key with no value in the denominator, ``-inf`` for none); every lane of
      ``XOR`` must call it.

    ``update`` returns the last row's ``alpha`` (a lane that holds one row of a decode rescales
    the accumulator rows other lanes hold with it).  ``ALPHA_OUT``: the accumulator is not
    touched (it may be in flight in an asynchronous product): ``update(s, alpha, m_i, l_i, c)``
    writes each row's ``alpha`` into ``alpha[ROWS]`` and returns whether any is not 1 (the
    caller applies them with :func:`make_rescale` once the accumulator is its own).

    ``RESCALE``: ``None`` moves ``m_i`` to every new row max (``acc *= alpha`` every tile);
    ``"moved"`` rescales a row only when its max moved (a branch per lane: decode, whose lane
    holds whole rows); a number ``T`` (``"ex2"`` only; FA4's conditional rescaling) keeps
    ``m_i`` until some row of the
    warp's max passes it by more than ``T`` in ``log2`` units (``(m_new - m_i) c > T``), so most
    tiles skip the rescale (a branch taken by the whole warp or none: :func:`~numba_flash.
    kernels.stages.warp_any`).  ``P`` is then ``exp(s - m_i) <= 2**T``, exact in float32 and in
    float16 for ``T <= 8``; ``l_i`` and ``acc`` hold the same stale ``m_i``, so ``o`` and
    ``lse`` are the same quantities (the rounding differs by ulps).  Every row's body is its own
    inlined copy (:func:`~numba_flash.kernels.core.jit.static_for`): the arrays stay in registers.
    """
    assert EXP in EXP_MODES
    EX2 = EXP == "ex2"
    assert not EX2 or acc_t == float32
    MOVED = RESCALE == "moved"
    KEEP_ACC = not ALPHA_OUT
    LAZY = RESCALE is not None and not MOVED
    assert not LAZY or EX2
    T = float32(RESCALE if LAZY else 0.0)
    NEG_INF = acc_t(-math.inf)
    ZERO = acc_t(0.0)
    ONE = acc_t(1.0)
    vmax = _vmax(acc_t)
    row_max = make_lane_reduce(XOR, vmax)    # over the row's lanes
    row_sum = make_lane_reduce(XOR, _add)
    exp_e = make_exp_e(4 if acc_t == float32 else 8)

    @_device
    def init_row(r, ctx):
        m_i, l_i, acc = ctx
        m_i[r] = NEG_INF
        l_i[r] = ZERO
        for c in range(ACC_COLS):
            acc[r, c] = ZERO

    init_rows = static_for(ROWS, init_row)

    @_device
    def init(m_i, l_i, acc):
        init_rows((m_i, l_i, acc))

    @_device
    def max_row(r, x):
        """``mx[r]``: the row's max over its lanes (with the current ``m_i``); ``alpha[r] =
        1``; ``need[0]`` set if it moves ``m_i`` past ``RESCALE`` (``x``: :data:`SoftmaxRows`)."""
        s, m_i, mx, alpha, c = x.s, x.m_i, x.mx, x.alpha, x.c
        m = m_i[r]
        for j in range(COLS):
            m = vmax(m, s[r, j])
        m = row_max(m)                             # the row's other lanes
        mx[r] = m
        alpha[r] = ONE
        if LAZY and (m_i[r] == NEG_INF or not (m - m_i[r]) * c <= T):  # past T (or NaN)
            x.need[0] = 1

    @_device
    def rescale_row(r, x):
        """``m_i = mx``, ``acc *= alpha`` (``alpha = exp(m_old - m_new)``, kept for ``l_i``)."""
        acc, m_i, mx, alpha, c = x.acc, x.m_i, x.mx, x.alpha, x.c
        if not MOVED or mx[r] != m_i[r]:           # ("moved": only when the max moved, or NaN)
            m_use = mx[r] if mx[r] != NEG_INF else ZERO  # no visible key yet: exp against 0
            if EX2:
                alpha[r] = ex2(fma(m_i[r], c, -(m_use * c)))
            else:
                alpha[r] = exp_e(m_i[r] - m_use)
            m_i[r] = mx[r]
            if KEEP_ACC:   # (ALPHA_OUT: the caller rescales later)
                for j in range(ACC_COLS):
                    acc[r, j] *= alpha[r]

    @_device
    def p_row(r, x):
        """``P = exp(s - m_i)``; ``l_i = alpha l_i + `` this lane's part of the row sum."""
        s, m_i, l_i, alpha, c = x.s, x.m_i, x.l_i, x.alpha, x.c
        m_use = m_i[r] if m_i[r] != NEG_INF else ZERO
        k = -(m_use * c)
        lane_sum = ZERO
        for j in range(COLS):
            if EX2:
                p = ex2(fma(s[r, j], c, k))
            else:
                p = exp_e(s[r, j] - m_use)
            s[r, j] = p
            lane_sum += p
        l_i[r] = alpha[r] * l_i[r] + lane_sum

    max_rows = static_for(ROWS, max_row)
    rescale_rows = static_for(ROWS, rescale_row)
    p_rows = static_for(ROWS, p_row)

    @_device
    def update(s, acc, m_i, l_i, c):
        mx = cuda.local.array(ROWS, acc_t)        # the rows' new max
        alpha = cuda.local.array(ROWS, acc_t)     # their rescale factors (1 when kept)
        need = cuda.local.array(1, int32)
        need[0] = 0
        rows = SoftmaxRows(s, acc, m_i, l_i, mx, alpha, need, c)
        max_rows(rows)
        moved = True
        if not LAZY:
            rescale_rows(rows)
        elif warp_any(need[0] != 0):              # the whole warp rescales, or none of it
            rescale_rows(rows)
        else:
            moved = False
        p_rows(rows)
        if ALPHA_OUT:
            for r in range(ROWS):
                acc[r] = alpha[r]
            return moved
        return alpha[ROWS - 1]

    @_device
    def finalize(m_i, l_i, r, lse_scale, sink):
        l_row = row_sum(l_i[r])
        m = m_i[r] * lse_scale
        a = ONE
        if sink != NEG_INF:   # l = l_row e^(m - m_f) + e^(sink - m_f) against m_f = max(m, sink)
            sink = acc_t(sink)                     # (float32 in Variant: float64 kernels widen)
            m_f = m if m > sink else sink          # a NaN row stays NaN through l_row
            a = exp_e(m - m_f)                     # 0 for a row that saw no key (m = -inf)
            l_row = l_row * a + exp_e(sink - m_f)
            m = m_f
        elif l_row == ZERO:                        # no visible key: o = 0, lse = -inf
            return ZERO, NEG_INF
        # l > 0, or NaN (a NaN score): then o and lse are NaN too.  One log and one reciprocal
        # for both paths (a / l would be a second, longer division; a = 1: the same bits)
        return a * (ONE / l_row), m + math.log(l_row)

    return init, update, finalize
# [/docs:online-softmax-stage]


@functools.lru_cache(maxsize=None)
def make_rescale(ROWS, ACC_COLS):
    """``rescale(acc, alpha)``: ``acc[r, :] *= alpha[r]``, the deferred half of an ``ALPHA_OUT``
    update (:func:`make_online_softmax`)."""

    @_device
    def rescale(acc, alpha):
        for r in range(ROWS):
            for j in range(ACC_COLS):
                acc[r, j] *= alpha[r]

    return rescale


@_device
def sink_of(sinks, h):
    """Query head ``h``'s learnable sink logit from
    :class:`~numba_flash.kernels.core.variant.Variant`'s ``sink`` (``[H]``; a one-element
    ``[-inf]``: no sink)."""
    return sinks[int32(h) if sinks.shape[0] > 1 else int32(0)]   # (one index type)


@functools.lru_cache(maxsize=None)
def make_epilogue(ROWS, ACC_COLS, XOR, ROW_LAYOUT, COL_LAYOUT, store, acc_t,
                  LSE_STRIDE=False, STRIDED_O=False):
    """``epilogue(o, lse, acc, m_i, l_i, lse_scale, rows, cols, sink)``: ``o = acc / l`` and ``lse``
    of the lane's rows (:func:`make_online_softmax`'s ``finalize``), written through flat views.
    ``rows``: :data:`EpilogueRows` ``(row0, nq, o_elem0, o_row, lse_elem0, write_lse, lse_row)``:
    row ``r`` of the lane is ``row0 + offset(ROW_LAYOUT, r)`` (written if ``< nq``), its ``o``
    elements start at ``o_elem0 + row o_row`` and its ``lse`` is ``lse[lse_elem0 + row lse_row]``
    (``lse_row = 1`` without ``LSE_STRIDE``; written by the lanes with ``write_lse``); ``cols =
    (col0, d)``: accumulator column ``c`` is ``col0 + offset(COL_LAYOUT, c)`` (written if ``< d``);
    ``sink``: the rows' learnable sink logit (``-inf``: none; see ``finalize``).  ``store``: the
    element type's store (``elements.element_ops``).  ``STRIDED_O``: ``o`` is the caller's
    strided view (any shape), its elements counted in memory from its first one
    (:func:`~numba_flash.kernels.ptx.stages.store_at`). Layouts:
    :class:`~numba_flash.kernels.mainloop.tile_scores.Layout`."""
    _init, _update, finalize = make_online_softmax(ROWS, 0, ACC_COLS, XOR, "exp", acc_t)
    R_IN, R_OUT, R_STEP = ROW_LAYOUT
    C_IN, C_OUT, C_STEP = COL_LAYOUT

    @_device
    def store_row(r, x):
        rows, o, acc = x.rows, x.o, x.acc
        row0, nq, o_elem0, o_row, lse_elem0 = (rows.row0, rows.nq, rows.o_elem0, rows.o_row,
                                               rows.lse_elem0)
        col0, d = x.cols
        inv_l, row_lse = finalize(x.m_i, x.l_i, r, x.lse_scale, x.sink)
        row = row0 + (r // R_IN) * R_OUT + (r % R_IN) * R_STEP
        if row < nq:
            base = o_elem0 + row * o_row
            for ci in range(ACC_COLS // C_IN):
                for ce in range(C_IN):
                    col = col0 + ci * C_OUT + ce * C_STEP
                    if col < d:
                        if STRIDED_O:
                            store_at(o, base + col, store(acc[r, ci * C_IN + ce] * inv_l))
                        else:
                            o[base + col] = store(acc[r, ci * C_IN + ce] * inv_l)
            if rows.write_lse:
                if LSE_STRIDE:
                    x.lse[lse_elem0 + row * rows.lse_row] = row_lse
                else:
                    x.lse[lse_elem0 + row] = row_lse

    store_rows = static_for(ROWS, store_row)

    @_device
    def epilogue(o, lse, acc, m_i, l_i, lse_scale, rows, cols, sink):
        store_rows(EpilogueArgs(o, lse, acc, m_i, l_i, lse_scale, rows, cols, sink))

    return epilogue
