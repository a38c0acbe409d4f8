"""Which keys a query row sees, and the score it gets: the one home of the visibility rule.

Every attention kernel (forward, backward, decode, tensor-core) and the float64 reference
(:func:`numba_flash.reference.visible_mask`, :func:`numba_flash.reference.attention`) follow the
rule written here; nothing else re-derives it.

The rule (flash-attn's conventions)
-----------------------------------
Queries are aligned bottom-right against the keys: with ``offset = Nk - Nq``, query row ``i``
sits at key column ``c = i + offset``.  With a window ``(left, right)`` (``-1`` = unbounded):

    row ``i`` sees key ``j``  iff  ``0 <= j < Nk``  and  ``(left < 0 or j >= c - left)``
                                                   and  ``(right < 0 or j <= c + right)``

``causal=True`` is ``right = 0`` (:func:`window_bounds` folds it in on the host).  The keys row
``i`` sees are the half-open range ``[lo, hi)`` of :func:`key_bounds`, monotone in the row; it may
be empty: such a row has ``o = 0``, ``lse = -inf``.

Scores: a visible key's score is :func:`make_score`'s (its docstring holds the exact contract):
from the raw ``qk = q . k`` of the unscaled inputs, ``s = qk * scale`` rounded once, a non-finite
``s`` -> NaN, softcap (``softcap > 0``; ``1 - tanh^2`` is the backward's factor of ``dS``), ALiBi
``s - slope * |c - j|``, so the backward's ``P = exp(s - lse)`` is made of the forward's very
scores.  :func:`make_score_mod` is the same steps after the scale, on an already scaled score
(decode: no backward recomputes its scores).  A key the row does not see gets ``-inf`` from the
caller, whatever ``k`` holds.

Tiles: for a Q tile of rows ``[q_start, q_end)``, :func:`tile_key_range` gives the keys *some* row
sees (K/V tiles outside are never loaded), :func:`tile_full_range` the keys *every* row sees (a K/V
tile inside needs no per-element mask, :func:`tile_needs_mask`), and a tile in the first range but
not inside the second is masked with :func:`is_visible`; the backward's K/V-outer loop takes the
inverse, :func:`tile_query_range`.  A user's block mask (:mod:`numba_flash.flex`) classifies tiles
as EMPTY, FULL or PARTIAL: :func:`make_tile_kind`, :func:`make_next_tile`, :func:`make_pair_mask`,
:func:`make_tile_verdict`, :func:`make_tile_span`.

File: :func:`window_bounds`; the rule and the tile ranges as plain Python (``*_py``: the host, the
tests and the docs call them) and the same source as device functions (no suffix); the scores; the
block-mask helpers.  Why these conventions, and the tile classification drawn and counted:
docs/causal-tiles.md, docs/variants.md.
"""

from __future__ import annotations

import functools
import math

from numba import float64, int32
from numba.cuda import libdevice

from ...backend import on_simulator
from ..core.jit import device_jit

#: ``left`` / ``right`` of an unbounded side of the window.
UNBOUNDED = -1


def window_bounds(causal, window_size):
    """``(left, right)`` ints for the kernels from ``causal`` and a validated ``window_size``.

    ``causal=True`` sets ``right = 0`` (as flash-attn does); ``-1`` means unbounded.
    """
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    return left, right


# [docs:key-bounds]
def key_bounds_py(row, offset, nk, left, right):
    """``(lo, hi)``: query row ``row`` sees exactly the keys ``lo <= j < hi`` (none if hi <= lo)."""
    c = row + offset  # the key column this query sits at (bottom-right alignment)
    lo = 0
    if left >= 0:
        lo = max(0, c - left)
    hi = nk
    if right >= 0:
        hi = min(nk, c + right + 1)
    return lo, hi
# [/docs:key-bounds]



# [docs:tile-ranges]
def is_visible_py(row, key, offset, nk, left, right):
    """True iff query row ``row`` sees key ``key`` (the rule of :func:`key_bounds_py`)."""
    c = row + offset
    return (0 <= key and key < nk and (left < 0 or key >= c - left)
            and (right < 0 or key <= c + right))


def tile_key_range_py(q_start, q_end, offset, nk, left, right):
    """``(kv_lo, kv_hi)``: the keys that some row of ``[q_start, q_end)`` sees (empty if
    ``kv_hi <= kv_lo``): ``lo`` of the first row to ``hi`` of the last.  K/V tiles wholly
    outside are never loaded."""
    kv_lo = 0
    if left >= 0:
        kv_lo = max(0, q_start + offset - left)
    kv_hi = nk
    if right >= 0:
        kv_hi = min(nk, q_end - 1 + offset + right + 1)
    return kv_lo, max(kv_lo, kv_hi)


def tile_full_range_py(q_start, q_end, offset, nk, left, right):
    """``(full_lo, full_hi)``: the keys that every row of ``[q_start, q_end)`` sees (``lo`` of
    the last row to ``hi`` of the first); a K/V tile inside runs the unmasked step."""
    full_lo = 0
    if left >= 0:
        full_lo = max(0, q_end - 1 + offset - left)
    full_hi = nk
    if right >= 0:
        full_hi = min(nk, q_start + offset + right + 1)
    return full_lo, max(full_lo, full_hi)


def tile_query_range_py(k_start, k_end, offset, nq, left, right):
    """``(q_lo, q_hi)``: the query rows that see some key of ``[k_start, k_end)`` (keys inside
    ``[0, Nk)``), for the backward's K/V-outer loop.  Row ``i`` sees key ``j`` iff
    ``j - right <= i + offset <= j + left``, so the rows are
    ``[k_start - right - offset, k_end - 1 + left - offset]`` (an unbounded side: all rows)."""
    q_lo = 0
    if right >= 0:
        q_lo = max(0, k_start - right - offset)
    q_hi = nq
    if left >= 0:
        q_hi = min(nq, k_end - 1 + left - offset + 1)
    return q_lo, max(q_lo, q_hi)


def tile_needs_mask_py(k_start, k_end, full_lo, full_hi):
    """True unless the K/V tile ``[k_start, k_end)`` lies inside the fully visible keys."""
    return k_start < full_lo or k_end > full_hi
# [/docs:tile-ranges]


# the device versions: the same source, compiled for the GPU (and run as is by the simulator)
_device = functools.partial(device_jit, inline=True)
key_bounds = _device(key_bounds_py)
is_visible = _device(is_visible_py)
tile_key_range = _device(tile_key_range_py)
tile_full_range = _device(tile_full_range_py)
tile_query_range = _device(tile_query_range_py)
tile_needs_mask = _device(tile_needs_mask_py)


def _mul_py(x, y):
    return x * y


def _fmul_rn(x, y):
    return libdevice.fmul_rn(x, y)


def _dmul_rn(x, y):
    return libdevice.dmul_rn(x, y)


# ``x * y`` rounded once, never fused with a following add into an FMA.  NVVM contracts
# ``a * b + c`` by default, so a score ``qk * scale`` that flows into ``exp(s - m)`` in the
# forward and ``exp(s - lse)`` in the backward could be rounded in one and fused in the other;
# PTX ``mul.rn`` (libdevice ``fmul_rn`` / ``dmul_rn``) is never contracted.  The simulator
# (its NumPy scalars round every product; it cannot run libdevice) multiplies plainly.
if on_simulator():
    _MUL_F32 = _MUL_F64 = _device(_mul_py)
else:
    _MUL_F32 = _device(_fmul_rn)
    _MUL_F64 = _device(_dmul_rn)


@functools.lru_cache(maxsize=None)
def make_mods(SOFTCAP, ALIBI, acc_t):
    """``mods(s, row, key, offset, softcap, inv_softcap, slope) -> (s, dcap)``: steps 3-5 of
    :func:`make_score` on a scaled score (the one copy of that code)."""
    mul = _MUL_F64 if acc_t == float64 else _MUL_F32
    INF = acc_t(math.inf)
    NAN = acc_t(math.nan)
    ONE = acc_t(1.0)

    def mods(s, row, key, offset, softcap, inv_softcap, slope):
        # 3. an inf or NaN score (NaN or inf in q or in a visible k) poisons the row
        if not abs(s) < INF:
            s = NAN
        dcap = ONE
        # 4. softcap: s -> softcap * tanh(s / softcap); dcap = d s / d s_in = 1 - tanh^2
        if SOFTCAP:
            t = math.tanh(s * inv_softcap)
            s = mul(softcap, t)
            dcap = ONE - t * t
        # 5. ALiBi: s -> s - slope * |c - j|, c = row + offset (the distance as acc_t: no f64)
        if ALIBI:
            s -= slope * acc_t(abs(row + offset - key))
        return s, dcap

    mods.__name__ = f"score_mods_{int(SOFTCAP)}{int(ALIBI)}"
    return _device(mods)


@functools.lru_cache(maxsize=None)
def make_score(SOFTCAP, ALIBI, acc_t):
    """Build ``score(qk, scale, row, key, offset, softcap, inv_softcap, slope) -> (s, dcap)``:
    THE score of a visible key, for the kernels whose scores a backward recomputes (the SIMT
    forward and backward, also varlen, and the tensor-core backward).  The backward recomputes
    ``P = exp(s - lse)``
    from the forward's ``lse``, so its ``s`` must be the forward's bit for bit: with scores near
    150 one ulp is 1.5e-5, a relative error of 1.5e-5 in ``P``, and the recomputed ``P`` no
    longer sums to 1 (measured before the forward and backward shared this function: float32
    ``dv`` errors 6-12x those of plain float32 attention).

    The contract (``acc_t`` arithmetic, float32 for float16 inputs, each step rounded once):

    1. ``qk``: the raw dot product ``sum_c q[row, c] k[key, c]`` of the *unscaled* inputs,
       accumulated in ``acc_t`` (SIMT: one FMA per ``c = 0 .. HEAD_DIM - 1`` in order, from 0;
       tensor cores: float16 products accumulated in float32 by ``mma.sync``, 16 columns per
       step, in order; the backward's ``K Q^T`` is the forward's ``Q K^T`` transposed).
       ``q`` is never pre-multiplied by ``scale``: ``(q * scale) . k`` rounds differently;
    2. ``s = qk * scale``, rounded (PTX ``mul.rn``: never fused into a following add);
    3. an ``inf`` or NaN ``s`` (a NaN or inf in ``q`` or in this ``k``) becomes NaN, so the
       row's ``o`` and ``lse`` come out NaN (an ``-inf`` would look like a masked key);
    4. softcap (``SOFTCAP``; the SIMT kernels take the ``SOFTCAP`` build at run time when
       ``softcap > 0``): ``t = tanh(s * inv_softcap)``, ``s = softcap * t`` (rounded, never
       fused); ``dcap = 1 - t * t`` is ``d s / d (qk * scale)``, the factor of ``dS`` (1
       without softcap);
    5. ALiBi (``ALIBI``; a slope of 0 leaves ``s`` exactly as it is): ``s = s - slope *
       |row + offset - key|`` (the distance as ``acc_t``); no gradient.

    ``scale``, ``softcap``, ``inv_softcap = 1 / softcap`` and ``slope`` are ``acc_t`` values
    (unused ones may be 0); ``row``, ``key`` and ``offset = Nk - Nq`` are the indices of
    :func:`key_bounds` (within the sequence for varlen).  A key the row does not see gets
    ``-inf`` from the caller, never a score.  The forward's ``lse`` is ``m + log(l)`` over these
    ``s`` (natural log, in ``acc_t``) and its ``P`` is ``exp(s - m) / l``; the backward's ``P``
    is ``exp(s - lse)`` with the same ``s``.

    The tensor-core forward (:mod:`numba_flash.kernels.forward.mma`) calls this function only
    with a modifier (softcap, ALiBi or a user's ``score_mod``, through
    :func:`~numba_flash.kernels.mainloop.tile_scores.make_score_fn`); without one it keeps the
    raw ``qk`` and folds the scale into its exponent (``ex2.approx(qk * scale log2(e) - m scale
    log2(e))``, ``lse = scale m + log l``), so its ``P`` and ``lse`` match this contract only
    to a few ulps of ``|s|`` (about 1e-5 relative at ``|s|`` = 150), far below the float16
    rounding of its output and of the backward's ``P``, ``dS`` operands (2^-11); a float32
    tensor-core path would have to follow the contract exactly.
    """
    mul = _MUL_F64 if acc_t == float64 else _MUL_F32
    mods = make_mods(SOFTCAP, ALIBI, acc_t)

    def score(qk, scale, row, key, offset, softcap, inv_softcap, slope):
        return mods(mul(qk, scale), row, key, offset, softcap, inv_softcap, slope)

    score.__name__ = f"score_{int(SOFTCAP)}{int(ALIBI)}"
    return _device(score)


@functools.lru_cache(maxsize=None)
def make_score_mod(SOFTCAP, ALIBI, acc_t):
    """Build ``score_mod(s, row, key, offset, softcap, inv_softcap, slope)``: steps 3-5 of
    :func:`make_score` (non-finite -> NaN, softcap, ALiBi; the same device code) on an already
    scaled score ``s``, for a kernel whose probabilities no backward recomputes (decode).  A
    kernel paired with a backward calls :func:`make_score` on the raw ``q . k``, so that the
    scale multiply follows the contract too.
    """
    mods = make_mods(SOFTCAP, ALIBI, acc_t)

    def score_mod(s, row, key, offset, softcap, inv_softcap, slope):
        return mods(s, row, key, offset, softcap, inv_softcap, slope)[0]

    score_mod.__name__ = f"score_mod_{int(SOFTCAP)}{int(ALIBI)}"
    return _device(score_mod)


#: a block mask's kinds (numba_flash.flex.block_mask): EMPTY, PARTIAL, FULL
BLOCK_EMPTY, BLOCK_PARTIAL, BLOCK_FULL = 0, 1, 2


@functools.lru_cache(maxsize=None)
def make_tile_kind(Q_BLOCK, KV_BLOCK, BLOCK_N):
    """Build ``tile_kind(kinds, b, h, q_start, q_end, kt, nk)``: a block mask's verdict on
    K/V tile ``kt`` (keys ``[kt BLOCK_N, min(kt BLOCK_N + BLOCK_N, nk))``) for the query rows
    ``[q_start, q_end)``: EMPTY when every ``[Q_BLOCK x KV_BLOCK]`` block the tile overlaps is
    empty, FULL when every one is full, else PARTIAL.  ``kinds`` is the int8
    ``[B or 1, H or 1, q blocks, kv blocks]`` classification of
    :func:`numba_flash.flex.create_block_mask` (a dimension of 1 broadcasts).  Any tile and
    block sizes work: a tile of a kernel with smaller tiles lies in one block, and one with
    larger tiles takes the verdict of all the blocks it covers."""

    @_device
    def tile_kind(kinds, b, h, q_start, q_end, kt, nk):
        bb = b if kinds.shape[0] > 1 else 0
        hh = h if kinds.shape[1] > 1 else 0
        k_start = kt * BLOCK_N
        k_end = min(k_start + BLOCK_N, nk)
        seen = 0
        full = 1
        for qi in range(q_start // Q_BLOCK, (q_end - 1) // Q_BLOCK + 1):
            for kj in range(k_start // KV_BLOCK, (k_end - 1) // KV_BLOCK + 1):
                kind = kinds[bb, hh, qi, kj]
                if kind != BLOCK_EMPTY:
                    seen = 1
                if kind != BLOCK_FULL:
                    full = 0
        if seen == 0:
            return BLOCK_EMPTY
        return BLOCK_FULL if full == 1 else BLOCK_PARTIAL

    return tile_kind


@functools.lru_cache(maxsize=None)
def make_next_tile(Q_BLOCK, KV_BLOCK, BLOCK_N):
    """Build ``next_tile(kinds, b, h, q_start, q_end, kt, t_hi, nk)``: the first K/V tile ``>=
    kt`` that the block mask (:func:`make_tile_kind`) does not call EMPTY for the query rows
    ``[q_start, q_end)``, ``t_hi`` if none: how a kernel's K/V loop walks a block mask."""
    tile_kind = make_tile_kind(Q_BLOCK, KV_BLOCK, BLOCK_N)

    @_device
    def next_tile(kinds, b, h, q_start, q_end, kt, t_hi, nk):
        while kt < t_hi and tile_kind(kinds, b, h, q_start, q_end, kt, nk) == BLOCK_EMPTY:
            kt += 1
        return kt

    return next_tile


@functools.lru_cache(maxsize=None)
def make_pair_mask(BLOCKS, MASK_MOD, BLOCK_N):
    """Build ``pair_mask(user, b, h, q_start, q_end, kt, nk) -> (empty, umask)`` for the SIMT
    backward's loops: ``empty``, a block mask (``BLOCKS``, :func:`make_tile_kind` on
    ``user[0]``) calls the pair of Q rows ``[q_start, q_end)`` and K/V tile ``kt`` EMPTY (never
    loaded); ``umask``, ``mask_mod`` runs on the pair (PARTIAL; every pair without a block
    mask, when there is a ``mask_mod``)."""
    if BLOCKS is None:
        @_device
        def pair_mask(user, b, h, q_start, q_end, kt, nk):
            return False, MASK_MOD

        return pair_mask
    tile_kind = make_tile_kind(BLOCKS[0], BLOCKS[1], BLOCK_N)

    @_device
    def pair_mask(user, b, h, q_start, q_end, kt, nk):
        kind = tile_kind(user[0], b, h, q_start, q_end, kt, nk)
        return kind == BLOCK_EMPTY, kind == BLOCK_PARTIAL

    return pair_mask


@functools.lru_cache(maxsize=None)
def make_tile_verdict(BLOCKS, MASK_MOD, BLOCK_N):
    """Build ``verdict(user, b, h, q_start, q_end, kt, nk, full) -> (unmasked, umask)`` for a
    (Q rows ``[q_start, q_end)``, K/V tile ``kt``) pair a kernel's loop visits: ``unmasked``,
    the step compiled without masks runs it (``full``: every row sees every key of the pair by
    the window rule, and no user's ``mask_mod`` needs asking: none, or a block mask
    (``BLOCKS``, :func:`make_tile_kind` on ``user[0]``) calls the pair FULL); ``umask``: the
    masked step asks ``mask_mod`` (a PARTIAL pair; every pair without a block mask)."""
    tile_kind = make_tile_kind(BLOCKS[0], BLOCKS[1], BLOCK_N) if BLOCKS is not None else None

    @_device
    def verdict(user, b, h, q_start, q_end, kt, nk, full):
        kind = BLOCK_PARTIAL if MASK_MOD else BLOCK_FULL
        if BLOCKS is not None:
            kind = tile_kind(user[0], b, h, q_start, q_end, kt, nk)
        return full and kind == BLOCK_FULL, kind == BLOCK_PARTIAL

    return verdict


@functools.lru_cache(maxsize=None)
def make_tile_span(BLOCK_N):
    """Build ``tile_span(q_start, q_end, offset, nk, left, right) -> (t_lo, t_hi, f_lo, f_hi)``:
    the K/V tiles of ``BLOCK_N`` keys that rows ``[q_start, q_end)`` visit, ``[t_lo, t_hi)``
    (:func:`tile_key_range`), and among them those every row sees whole, ``[f_lo, f_hi)``
    (:func:`tile_full_range`: they run the unmasked step), as int32."""

    @_device
    def tile_span(q_start, q_end, offset, nk, left, right):
        kv_lo, kv_hi = tile_key_range(q_start, q_end, offset, nk, left, right)
        full_lo, full_hi = tile_full_range(q_start, q_end, offset, nk, left, right)
        t_lo = int32(kv_lo // BLOCK_N)
        t_hi = int32((kv_hi + BLOCK_N - 1) // BLOCK_N)
        f_lo = int32(min(max((full_lo + BLOCK_N - 1) // BLOCK_N, t_lo), t_hi))
        f_hi = int32(min(max(full_hi // BLOCK_N, f_lo), t_hi))
        return t_lo, t_hi, f_lo, f_hi

    return tile_span
