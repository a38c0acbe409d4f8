"""The tile-scores stage: from a lane's raw ``q . k`` values and their (row, key) places to the
masked, scaled, softcapped, ALiBi'd, user-modified scores (FA4's ``mask_fn``).

One function per element, :func:`make_score_fn`, holds the order of the score contract of
:func:`~numba_flash.kernels.mainloop.visibility.make_score` (scale, non-finite -> NaN, softcap,
ALiBi) followed by the user's ``score_mod`` and ``mask_mod`` (:mod:`numba_flash.flex`); the forwards
call it on their tiles through :func:`make_tile_scores` and the backwards call it to recompute
``P`` (and the chain-rule factor of ``dS``) of the very same scores.

The per-call values travel in a :class:`ScoreArgs` named tuple built once per block.  A lane's
tile ``s[r, c]`` (``ROWS x COLS``) is row ``row0 + offset(ROW_LAYOUT, r)`` and key ``key0 +
offset(KEY_LAYOUT, c)``: a :class:`Layout` says where a lane's i-th row or column lies (the
accumulator layouts of :mod:`~numba_flash.kernels.mainloop.warp_gemm` for a tensor-core fragment, a
thread's strided rows and keys for the SIMT forward).
"""

from __future__ import annotations

import collections
import functools
from typing import NamedTuple
import math

from ..core.jit import device_jit, static_for
from .visibility import key_bounds, make_mods, make_score

_device = functools.partial(device_jit, inline=True)


class Layout(collections.namedtuple("Layout", ["INNER", "OUTER", "STEP"])):
    """Where a lane's ``i``-th row (or column) of a tile lies, relative to its first:
    ``offset(i) = (i // INNER) OUTER + (i % INNER) STEP``.  A tensor-core accumulator's rows
    are ``Layout(2, 16, 8)`` (rows ``g``, ``g + 8`` of each 16-row tile) and its columns
    ``Layout(2, 8, 1)`` (``2 t``, ``2 t + 1`` of each 8-column fragment); a SIMT thread's strided
    rows ``Layout(1, THREADS_M, 0)``.  Kernels loop over ``(i // INNER, i % INNER)``: nested
    compile-time loops that unroll, with offsets as immediates."""

    __slots__ = ()

    def offset(self, i):
        return (i // self.INNER) * self.OUTER + (i % self.INNER) * self.STEP


class ScoreArgs(collections.namedtuple(
        "ScoreArgs", ["scale", "softcap", "inv_softcap", "slope", "offset", "nq", "b", "h",
                      "aux"])):
    """The run-time values of a block's scores: ``scale``, ``softcap`` and ``1 / softcap`` (0 when
    off), the ALiBi ``slope`` of ``(b, h)`` (0 when off), ``offset = Nk - Nq`` (the bottom-right
    alignment), ``nq`` (rows at or past it are padding: no user code sees them), ``b`` and
    ``h`` (the user functions' indices: the sequence and query head) and ``aux`` (the user's
    aux arrays, ``()`` without a user variant)."""

    __slots__ = ()


@functools.lru_cache(maxsize=None)
def make_score_args(ALIBI, acc_t):
    """``score_args(va, b, h, offset, nq) -> ScoreArgs`` of a block from its
    :class:`~numba_flash.kernels.core.variant.Variant` (the ALiBi slope of ``(b, h)`` read only
    with ``ALIBI``; 0 otherwise)."""
    ZERO = acc_t(0.0)

    @_device
    def score_args(va, b, h, offset, nq):
        slope = ZERO
        if ALIBI:
            slope = acc_t(va.alibi[b, h])
        return ScoreArgs(va.scale, va.softcap, va.inv_softcap, slope, offset, nq, b, h,
                         va.user[1:])

    return score_args


def _user(USER):
    """``(score_mod, mask_mod, score_mod_grad)`` of a user variant (``None``: none)."""
    fns = tuple(USER) if USER is not None else ()
    return (fns + (None, None, None))[:3]


# [docs:score-fn]
@functools.lru_cache(maxsize=None)
def make_score_fn(RAW, SOFTCAP, ALIBI, USER, acc_t, PRESCALED=False):
    """``score_fn(x, row, key, sa, umask) -> (visible, s, grad)`` for a key inside the row's
    window bounds and a row ``< nq`` (the caller checks both):

    * ``visible``: False when the user's ``mask_mod`` (asked only with ``umask``: a PARTIAL tile
      of a block mask, or every tile without one) says no;
    * ``s``: ``RAW``: ``x`` itself (raw ``q . k``; the caller folds the scale into its
      exponent); else the score of :func:`~numba_flash.kernels.mainloop.visibility.make_score`
      (``SOFTCAP`` / ``ALIBI`` compile-time; ``SOFTCAP=None``: the SIMT forward's run-time switch on
      ``softcap > 0``), then the user's ``score_mod``;
    * ``grad``: ``d s / d (scale qk)`` (the softcap's ``1 - t^2`` times ``score_mod_grad`` at
      the score ``score_mod`` received), for the backward's ``dS``; 1 without either.

    ``USER``: ``None`` or ``(score_mod, mask_mod[, score_mod_grad])`` CUDA device functions or
    None, called with ``(.., b, h, row, key, *sa.aux)``.  ``PRESCALED``: ``x`` is already
    ``scale q . k`` (decode pre-scales ``q``, and no backward recomputes its scores): steps 3-5
    only (:func:`~numba_flash.kernels.mainloop.visibility.make_score_mod`)."""
    user_score, user_mask, user_grad = _user(USER)
    U_SCORE = user_score is not None
    U_MASK = user_mask is not None
    U_GRAD = user_grad is not None
    assert not (RAW and (U_SCORE or SOFTCAP or ALIBI))
    RUNTIME_CAP = SOFTCAP is None
    make = make_mods if PRESCALED else make_score   # (x, [scale,] row, key, ...) -> (s, grad)
    score = make(RUNTIME_CAP or bool(SOFTCAP), ALIBI, acc_t)
    score_alibi = make(False, ALIBI, acc_t)  # SOFTCAP=None with softcap = 0
    ONE = acc_t(1.0)

    @_device
    def score_fn(x, row, key, sa, umask):
        if U_MASK and umask and not user_mask(sa.b, sa.h, row, key, *sa.aux):
            return False, x, ONE
        if RAW:
            return True, x, ONE
        if PRESCALED and RUNTIME_CAP and not sa.softcap > acc_t(0.0):
            s, grad = score_alibi(x, row, key, sa.offset, sa.softcap, sa.inv_softcap, sa.slope)
        elif PRESCALED:
            s, grad = score(x, row, key, sa.offset, sa.softcap, sa.inv_softcap, sa.slope)
        elif RUNTIME_CAP and not sa.softcap > acc_t(0.0):
            s, grad = score_alibi(x, sa.scale, row, key, sa.offset, sa.softcap, sa.inv_softcap,
                                  sa.slope)
        else:
            s, grad = score(x, sa.scale, row, key, sa.offset, sa.softcap, sa.inv_softcap,
                            sa.slope)
        if U_SCORE:  # after scale, softcap and ALiBi (the compute type, whatever it returns)
            if U_GRAD:
                grad = grad * acc_t(user_grad(s, sa.b, sa.h, row, key, *sa.aux))
            s = acc_t(user_score(s, sa.b, sa.h, row, key, *sa.aux))
        return True, s, grad

    return score_fn
# [/docs:score-fn]


#: what :func:`make_tile_scores`' row stage reads, and its key stage (row ``r``: ``row``, its
#: window ``[lo, hi)``)
ScoreRows = collections.namedtuple("ScoreRows", "s sa row0 key0 bounds umask")
ScoreKeys = collections.namedtuple("ScoreKeys", "s sa r row key0 lo hi umask")


# [docs:tile-scores]
@functools.lru_cache(maxsize=None)
def make_tile_scores(ROWS, COLS, ROW_LAYOUT, KEY_LAYOUT, MASKED, RAW, SOFTCAP, ALIBI, USER,
                     acc_t):
    """``tile_scores(s, sa, row0, key0, bounds, umask)``: ``s[r, c]`` (raw ``q . k`` of row
    ``row0 + ROW_LAYOUT.offset(r)`` and key ``key0 + KEY_LAYOUT.offset(c)``) becomes its score
    (:func:`make_score_fn`) or ``-inf`` where the row does not see the key.  ``MASKED`` (compile
    time): the tile is not inside the keys every row sees, so each key is checked against its
    row's window ``bounds = (nk, left, right)`` (:func:`~numba_flash.kernels.mainloop.visibility.
    key_bounds`); rows ``>= nq`` get ``-inf`` wherever user code would be asked.  ``RAW``: only
    the masks apply, and an inf / NaN raw score becomes NaN (one sum of the tile decides whether
    to look: the non-finite rule of the score contract, at one FADD per score on the common
    path)."""
    user_score, user_mask, _grad = _user(USER)
    USER_FN = user_score is not None or user_mask is not None
    score_fn = make_score_fn(RAW, SOFTCAP, ALIBI, USER, acc_t)
    NEG_INF = acc_t(-math.inf)
    INF = acc_t(math.inf)
    NAN = acc_t(math.nan)
    ZERO = acc_t(0.0)
    PER_ELEMENT = MASKED or not RAW or USER_FN
    R_IN, R_OUT, R_STEP = ROW_LAYOUT
    C_IN, C_OUT, C_STEP = KEY_LAYOUT

    @_device
    def element(c, ctx):
        """Key ``c`` of the lane's row ``ctx.r`` (compile time after inlining)."""
        s, sa, r, row = ctx.s, ctx.sa, ctx.r, ctx.row
        key = ctx.key0 + (c // C_IN) * C_OUT + (c % C_IN) * C_STEP
        if MASKED and not (ctx.lo <= key and key < ctx.hi):
            s[r, c] = NEG_INF
        elif USER_FN and row >= sa.nq:
            s[r, c] = NEG_INF  # a padding row: no user code sees it
        else:
            ok, x, _g = score_fn(s[r, c], row, key, sa, ctx.umask)
            s[r, c] = x if ok else NEG_INF

    # a score function with tanh or a user's code is long: each key its own copy, so the
    # compiler never keeps a loop that would index s at run time (s on the stack)
    elements = static_for(COLS, element)

    @_device
    def score_row(r, ctx):
        s, sa, key0 = ctx.s, ctx.sa, ctx.key0
        nk, left, right = ctx.bounds
        row = ctx.row0 + (r // R_IN) * R_OUT + (r % R_IN) * R_STEP
        lo, hi = key_bounds(row, sa.offset, nk, left, right)
        if RAW and not USER_FN:  # the mask alone: a short loop the compiler unrolls
            for c in range(COLS):
                key = key0 + (c // C_IN) * C_OUT + (c % C_IN) * C_STEP
                if not (lo <= key and key < hi):
                    s[r, c] = NEG_INF
        else:
            elements(ScoreKeys(s, sa, r, row, key0, lo, hi, ctx.umask))

    score_rows = static_for(ROWS, score_row)

    @_device
    def tile_scores(s, sa, row0, key0, bounds, umask):
        if RAW:
            total = ZERO
            for r in range(ROWS):
                for c in range(COLS):
                    total += s[r, c]
            if not abs(total) < INF:   # rare: an inf / NaN score (in q or k) -> NaN
                for r in range(ROWS):
                    for c in range(COLS):
                        if not abs(s[r, c]) < INF:
                            s[r, c] = NAN
        if PER_ELEMENT:
            score_rows(ScoreRows(s, sa, row0, key0, bounds, umask))

    return tile_scores
# [/docs:tile-scores]


class TileScores(NamedTuple):
    """The two builds of :func:`make_tile_scores` a mainloop uses: ``masked`` for a tile some
    row sees only in part (each key checked against its row's bounds), ``full`` for a tile
    every row sees whole."""
    masked: object
    full: object


def make_tile_scores_pair(ROWS, COLS, ROW_LAYOUT, KEY_LAYOUT, RAW, SOFTCAP, ALIBI, USER, acc_t):
    """Both builds (:class:`TileScores`) of :func:`make_tile_scores` for one layout."""
    return TileScores(*(make_tile_scores(ROWS, COLS, ROW_LAYOUT, KEY_LAYOUT, masked, RAW,
                                         SOFTCAP, ALIBI, USER, acc_t) for masked in (True, False)))
