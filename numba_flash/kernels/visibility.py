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

``causal=True`` is ``right = 0`` (:func:`window_bounds` folds it in on the host), so plain
causal attention is ``(-1, 0)``, no mask is ``(-1, -1)`` and Mistral-style local attention is
``(W - 1, 0)``.  The keys row ``i`` sees are the half-open range ``[lo, hi)`` of
:func:`key_bounds`; it may be empty (``hi <= lo``): such a row has ``o = 0``, ``lse = -inf``.

Scores (:func:`make_score_mod`)
-------------------------------
For a visible key the kernels compute ``s = scale * q . k`` and then, in this order:

1. non-finite -> NaN: an ``inf`` or NaN score (a NaN or inf in ``q`` or in a visible ``k``)
   becomes NaN, so the row's ``o`` and ``lse`` come out NaN (an ``-inf`` score would otherwise
   look like a masked key);
2. softcap (``softcap > 0``, Gemma-2): ``s = softcap * tanh(s / softcap)``;
3. ALiBi (``slope``): ``s = s - slope * |c - j|``.

A key the row does not see gets ``-inf`` instead, whatever ``k`` holds, so a masked key never
affects a row.  The backward needs ``ds_raw = ds * (1 - tanh^2)`` through the softcap:
:func:`make_softcap_grad`.

Tiles (:func:`tile_key_range`, :func:`tile_full_range`, :func:`tile_query_range`)
--------------------------------------------------------------------------------
``key_bounds`` is monotone in the row (both ends grow with ``i``), so for a Q tile of rows
``[q_start, q_end)``:

* the keys *some* row sees are ``[lo(q_start), hi(q_end - 1))``: K/V tiles outside are never
  loaded (windowed attention costs O(N * window), causal skips the upper triangle);
* the keys *every* row sees are ``[lo(q_end - 1), hi(q_start))``: a K/V tile inside needs no
  per-element mask;
* a K/V tile that overlaps the first range but is not inside the second is masked element by
  element with :func:`is_visible`.

The backward's K/V-outer loop needs the inverse, the query rows that see some key of a K/V tile
``[k_start, k_end)``: :func:`tile_query_range`.

Each device function has a plain-Python twin of the same name with a ``_py`` suffix (the very
same source) so that the host, the tests and the docs can call the rule directly.
"""

from __future__ import annotations

import functools
import math

from numba import cuda

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
_device = functools.partial(cuda.jit, device=True, inline=True)
key_bounds = _device(key_bounds_py)
is_visible = _device(is_visible_py)
tile_key_range = _device(tile_key_range_py)
tile_full_range = _device(tile_full_range_py)
tile_query_range = _device(tile_query_range_py)
tile_needs_mask = _device(tile_needs_mask_py)


@functools.lru_cache(maxsize=None)
def make_score_mod(SOFTCAP, ALIBI, acc_t):
    """Build the device function ``score_mod(s, row, key, offset, softcap, inv_softcap, slope)``
    for a visible key's scaled score ``s`` (compute type ``acc_t``): non-finite -> NaN, then
    softcap (compile-time ``SOFTCAP``), then ALiBi (compile-time ``ALIBI``).

    ``softcap``, ``inv_softcap = 1 / softcap`` and ``slope`` must already be of type ``acc_t``
    (unused ones may be 0).  ``row`` / ``key`` / ``offset`` are the global indices of
    :func:`key_bounds`.
    """
    INF = acc_t(math.inf)
    NAN = acc_t(math.nan)

    def score_mod(s, row, key, offset, softcap, inv_softcap, slope):
        # 1. an inf or NaN score (NaN or inf in q or in a visible k) poisons the row
        if not abs(s) < INF:
            s = NAN
        # 2. softcap: s -> softcap * tanh(s / softcap)
        if SOFTCAP:
            s = softcap * math.tanh(s * inv_softcap)
        # 3. ALiBi: s -> s - slope * |c - j|, c = row + offset (the distance as acc_t: no f64)
        if ALIBI:
            s -= slope * acc_t(abs(row + offset - key))
        return s

    score_mod.__name__ = f"score_mod_{int(SOFTCAP)}{int(ALIBI)}"
    return _device(score_mod)


@functools.lru_cache(maxsize=None)
def make_softcap_grad(SOFTCAP, acc_t):
    """Build ``softcap_grad(s_capped, inv_softcap)``: the factor ``d s_capped / d s = 1 -
    tanh^2 = 1 - (s_capped / softcap)^2`` the backward multiplies ``dS`` by (1 without softcap).

    ``s_capped`` is the softcapped score *before* ALiBi (ALiBi's bias has no gradient).
    """
    ONE = acc_t(1.0)

    def softcap_grad(s_capped, inv_softcap):
        if SOFTCAP:
            t = s_capped * inv_softcap
            return ONE - t * t
        return ONE

    return _device(softcap_grad)

