"""The float64 oracle: plain NumPy, one readable function per formula.

Every kernel in :mod:`numba_flash` is tested against these functions.  Everything here computes in
float64 whatever the input dtype, and nothing here is tuned for speed.

Conventions shared with the kernels
-----------------------------------
* ``q`` is ``[B, H, Nq, d]``; ``k`` and ``v`` are ``[B, Hkv, Nk, d]`` with ``H`` a multiple of
  ``Hkv`` (grouped-query attention; ``Hkv == 1`` is multi-query attention).  Query head ``h`` reads
  kv head ``h // (H // Hkv)``.  ``v`` may have a head dim of its own, ``[B, Hkv, Nk, d_v]``
  (MLA-style prefill: ``o`` then has ``d_v`` columns; every function here takes it).
* ``scale`` defaults to ``1 / sqrt(d)`` (``d`` of q and k); the scores are ``S = scale * Q K^T``.
* Causal masking is aligned bottom-right, as in flash-attn >= 2.1: query ``i`` sees key ``j`` iff
  ``j <= i + Nk - Nq``.  When ``Nq > Nk`` the first ``Nq - Nk`` rows see no key at all; such a
  row has ``o = 0`` and ``lse = -inf`` (never NaN).
* Sliding window ``window_size = (left, right)`` (``-1`` = unbounded; ``causal`` means
  ``right = 0``): query ``i`` sees key ``j`` iff ``i + Nk - Nq - left <= j <= i + Nk - Nq + right``
  (:func:`visible_mask`, the rule of :mod:`numba_flash.kernels.mainloop.visibility`).
* Score modifiers, applied to a visible key's scaled score ``s`` in this order: ``softcap > 0``
  gives ``softcap * tanh(s / softcap)``; ``alibi_slopes`` (``[H]`` or ``[B, H]``) subtract
  ``slope * |i + Nk - Nq - j|``.
* Non-finite inputs, as torch SDPA: a NaN or inf in a query row, or in a key that the row sees,
  makes that row's ``o`` and ``lse`` NaN; a NaN or inf in ``v[j, c]`` of a key ``j`` the row sees
  makes ``o[i, c]`` non-finite; a key the row does not see never affects it; a row that sees no
  key has ``o = 0``, ``lse = -inf``.
* ``lse[i] = log(sum_j exp(S[i, j]))`` over the visible keys: the natural log of the row's softmax
  denominator.  ``P = exp(S - lse)`` recovers the probabilities exactly.
* Dropout acts on the normalised probabilities: ``O = (P * keep / (1 - p)) V``; ``lse`` is
  computed from the undropped ``P`` and is unaffected by dropout.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

__all__ = [
    "softmax",
    "online_softmax",
    "online_softmax_stats",
    "attention",
    "dequantize",
    "sparse_attention",
    "attention_backward",
    "attention_varlen",
    "attention_backward_varlen",
    "visible_mask",
    "alibi_slopes",
    "blocked_attention",
    "merge_states",
    "gather_paged",
    "paged_decode",
    "causal_visible",
    "append_kv",
    "apply_rotary",
    "kvcache_decode",
]


# ----------------------------------------------------------------------------------------------
# softmax
# ----------------------------------------------------------------------------------------------
def softmax(x):
    r"""Numerically stable softmax of a 1-D vector, in three passes.

    .. math:: m = \max_i x_i,\quad l = \sum_i e^{x_i - m},\quad y_i = e^{x_i - m} / l

    Subtracting the maximum changes nothing mathematically (it cancels between numerator and
    denominator) and keeps every exponent <= 0, so ``exp`` cannot overflow.

    A ``-inf`` entry (masked) gets ``y_i = 0``.  A vector that is ``-inf`` everywhere has no
    softmax (``0 / 0``) and gives NaN everywhere, as torch does; so does a NaN anywhere.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"x: expected a non-empty 1-D array, got shape {x.shape}")
    m = x.max()
    with np.errstate(invalid="ignore"):  # all -inf: -inf - (-inf) = NaN, the documented result
        e = np.exp(x - m)
        return e / e.sum()


# [docs:online-softmax-stats]
def online_softmax_stats(x):
    r"""The one-pass part of the online softmax: running max ``m`` and running sum ``l``.

    For each new element ``x_k`` (Milakov & Gimelshein, 2018):

    .. math::
        m_{new} = \max(m_{old}, x_k),\qquad
        l \leftarrow l \cdot e^{m_{old} - m_{new}} + e^{x_k - m_{new}}

    The old sum is *multiplied* by ``exp(m_old - m_new)`` because every term in it was taken
    against the old maximum.  After the pass ``l = sum_i exp(x_i - m)`` with ``m = max(x)``.

    A ``-inf`` element (a masked entry) is skipped: it adds ``exp(-inf) = 0`` and moves no
    maximum, while computing it before any finite element would give ``exp(-inf - (-inf)) =
    NaN``.  All ``-inf`` gives ``(-inf, 0)``; a NaN gives ``l = NaN``.
    """
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"x: expected a non-empty 1-D array, got shape {x.shape}")
    m = -math.inf
    l = 0.0
    for xk in map(float, x):
        if xk == -math.inf:  # masked: contributes exactly nothing
            continue
        m_new = max(m, xk)
        l = l * math.exp(m - m_new) + math.exp(xk - m_new)
        m = m_new
    return m, l
# [/docs:online-softmax-stats]


# [docs:online-softmax]
def online_softmax(x):
    r"""Softmax with the online normaliser: one pass for (m, l), a second pass to normalise.

    A *normalised* softmax cannot be written in a single pass over ``x``: the first output
    ``exp(x_0 - m) / l`` depends on the maximum and the sum of the whole vector, which are known
    only after the last element has been read.  What one pass can do is compute ``(m, l)``
    together (instead of the classic max pass followed by a sum pass); a second pass then writes
    ``y_i = exp(x_i - m) / l``.  FlashAttention gets away with one pass over K/V only because it
    never needs the probabilities themselves, only ``P V``, which it rescales as ``m`` grows.

    The source notes claim a one-pass version; their code adds ``exp(m - x)`` to ``l`` where it
    must multiply, and stores exponents taken against stale maxima.  See ``docs/online-softmax.md``.
    ``-inf`` entries and an all ``-inf`` vector give what :func:`softmax` gives (0; NaN).
    """
    m, l = online_softmax_stats(x)
    x = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):  # all -inf: NaN, as softmax
        return np.exp(x - m) / l
# [/docs:online-softmax]


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------
def _scale(d, softmax_scale):
    return 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)


def causal_visible(nq, nk):
    """Boolean ``[nq, nk]``: query ``i`` sees key ``j`` iff ``j <= i + nk - nq`` (bottom-right)."""
    return visible_mask(nq, nk, causal=True)


# [docs:visible-mask]
def visible_mask(nq, nk, *, causal=False, window_size=(-1, -1)):
    """Boolean ``[nq, nk]``: query ``i`` sees key ``j`` iff ``c - left <= j <= c + right`` with
    ``c = i + nk - nq`` (bottom-right alignment), ``-1`` meaning an unbounded side and ``causal``
    meaning ``right = 0``.  Any Python int works as an edge: one at or past the sequence
    (``left >= nk``, ``right >= nq``) already sees every key on its side."""
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    c = np.arange(nq)[:, None] + (nk - nq)
    j = np.arange(nk)[None, :]
    vis = np.ones((nq, nk), dtype=bool)
    if 0 <= left < nk:  # (a larger edge is unbounded; int64 arithmetic cannot overflow here)
        vis &= j >= c - left
    if 0 <= right < nq:
        vis &= j <= c + right
    return vis
# [/docs:visible-mask]


def alibi_slopes(h):
    """The ALiBi paper's head slopes, float32 ``[h]`` (Press et al., 2022): ``2^(-8 i / h)`` for
    ``i = 1..h`` when ``h`` is a power of two; otherwise those of the power of two ``n`` below
    ``h``, followed by every other slope of ``2 n``."""
    h = int(h)

    def powers(n):
        return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)

    n = 1 << (h.bit_length() - 1)  # the largest power of two <= h
    slopes = powers(n) if n == h else np.concatenate([powers(n), powers(2 * n)[::2][: h - n]])
    return slopes.astype(np.float32)


def _expand_kv(x, h):
    """Repeat kv heads so that query head ``h`` lines up with kv head ``h // (H // Hkv)``."""
    hkv = x.shape[1]
    if h % hkv:
        raise ValueError(f"H={h} is not a multiple of Hkv={hkv}")
    return np.repeat(x, h // hkv, axis=1)


def _fold_groups(dx, hkv):
    """Sum a gradient ``[B, H, N, d]`` over each GQA group to ``[B, Hkv, N, d]``."""
    b, h, n, d = dx.shape
    return dx.reshape(b, hkv, h // hkv, n, d).sum(axis=2)


def _elementwise(fn, *arrays):
    """``fn`` applied to every element of the broadcast ``arrays`` in plain Python (a user's
    function of scalars, evaluated as Python evaluates it), as float64."""
    return np.frompyfunc(fn, len(arrays), 1)(*arrays).astype(np.float64)


def _user_tuple(score_mod, mask_mod, aux_tensors):
    """``None`` without user functions, else ``(score_mod, mask_mod, aux)`` for :func:`_scores`."""
    if score_mod is None and mask_mod is None:
        return None
    return score_mod, mask_mod, tuple(aux_tensors)


def _user_mods(s, vis, score_mod, mask_mod, aux):
    """A user's ``mask_mod`` (and-ed into ``vis``) and ``score_mod`` (on the modified scores)
    over ``[B, H, Nq, Nk]``; returns ``(s, vis, s_pre)`` with ``s_pre`` the scores ``score_mod``
    received (for ``score_mod_grad``)."""
    b, h, nq, nk = s.shape
    idx = np.ix_(np.arange(b), np.arange(h), np.arange(nq), np.arange(nk))
    vis = np.broadcast_to(vis, s.shape)
    if mask_mod is not None:
        vis = vis & _elementwise(lambda *a: bool(mask_mod(*a, *aux)), *idx).astype(bool)
    s_pre = s
    if score_mod is not None:
        with np.errstate(invalid="ignore", over="ignore"):  # np.float64: a Python float
            # would round to float32 against a float32 aux value (NumPy's weak scalars)
            s = _elementwise(lambda x, *a: float(score_mod(np.float64(x), *a, *aux)), s, *idx)
    return s, vis, s_pre


# [docs:reference-scores]
def _scores(q, k, scale, causal, window_size, softcap, alibi, user=None):
    """``(s, vis, t)``: the modified scores ``[B, H, Nq, Nk]`` (``-inf`` where not visible), the
    visibility mask and ``tanh(s_raw / softcap)`` (``None`` without softcap) for the backward.
    ``user``: ``(score_mod, mask_mod, aux_tensors)`` applied after the built-in modifiers (see
    :func:`attention`); then ``t`` is ``(t, s_pre)`` with ``s_pre`` the scores ``score_mod``
    received."""
    nq, nk = q.shape[2], k.shape[2]
    vis = visible_mask(nq, nk, causal=causal, window_size=window_size)[None, None]
    with np.errstate(invalid="ignore", over="ignore"):
        s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    s = np.where(np.isfinite(s), s, np.nan)  # 1. an inf or NaN score poisons its row
    t = None
    if softcap:  # 2. softcap
        t = np.tanh(s / softcap)
        s = softcap * t
    if alibi is not None:  # 3. ALiBi: minus slope * distance from the query's own column
        slopes = np.broadcast_to(np.asarray(alibi, dtype=np.float64), (q.shape[0], q.shape[1]))
        dist = np.abs(np.arange(nq)[:, None] + (nk - nq) - np.arange(nk)[None, :])
        s = s - slopes[:, :, None, None] * dist[None, None]
    if user is not None:  # 4. the user's score_mod and mask_mod
        s, vis, s_pre = _user_mods(s, vis, *user)
        t = (t, s_pre)
    return np.where(vis, s, -np.inf), vis, t
# [/docs:reference-scores]


def _softmax_rows(s, sink=None):
    """``(p, lse)`` of masked scores: a row with no visible key has ``P = 0``, ``lse = -inf``; a
    row with a NaN score has ``lse`` NaN and ``P`` NaN at the keys it sees (0 elsewhere).
    ``sink``: a learnable sink, one logit per head (``[H]``, scores ``[B, H, Nq, Nk]``): a key
    with no value that every row sees, so it joins each row's denominator (``lse`` includes it:
    a row that sees no key has ``P = 0``, ``lse = sink``)."""
    if sink is not None:
        col = np.broadcast_to(np.asarray(sink, np.float64)[None, :, None, None],
                              s.shape[:-1] + (1,))
        p, lse = _softmax_rows(np.concatenate([s, col], axis=-1))
        return p[..., :-1], lse
    if s.shape[-1] == 0:  # no keys at all
        return np.zeros(s.shape), np.full(s.shape[:-1], -np.inf)
    with np.errstate(invalid="ignore"):
        m = s.max(axis=-1, keepdims=True)  # NaN if the row holds a NaN
        m_safe = np.where(np.isfinite(m), m, 0.0)
        l = np.exp(s - m_safe).sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(np.isnan(l), np.nan, np.where(l > 0, m_safe + np.log(l), -np.inf))
        p = np.where(l > 0, np.exp(s - np.where(np.isfinite(lse), lse, 0.0)), 0.0)
    p = np.where(np.isnan(l) & (s != -np.inf), np.nan, p)  # NaN where the row sees a key
    return p, lse[..., 0]


def _probabilities(q, k, causal, scale, window_size=(-1, -1), softcap=0.0, alibi=None):
    """Scores, lse and probabilities in float64; fully masked rows give P = 0, lse = -inf."""
    s, _, _ = _scores(q, k, scale, causal, window_size, softcap, alibi)
    p, lse = _softmax_rows(s)
    return s, p, lse


def _pv(p, v, vis):
    """``P V`` in which a key the row does not see contributes nothing, even a NaN ``v``, and a
    non-finite ``v[j, c]`` of a visible key makes ``o[i, c]`` NaN."""
    bad = ~np.isfinite(v)
    o = np.einsum("bhij,bhjd->bhid", p, np.where(bad, 0.0, v))
    if bad.any():
        seen = np.broadcast_to(vis, p.shape).astype(np.float64)
        hit = np.einsum("bhij,bhjd->bhid", seen, bad.astype(np.float64)) > 0
        o = np.where(hit, np.nan, o)
    return o


def _keep_scale(dropout_mask, dropout_p, shape):
    if dropout_mask is None:
        if dropout_p:
            raise ValueError("dropout_p > 0 needs the dropout_mask it was drawn with")
        return 1.0
    keep = np.broadcast_to(np.asarray(dropout_mask, dtype=bool), shape)
    return keep / (1.0 - dropout_p)


def dequantize(x, descale):
    """Low-precision values as float64: ``x`` ``[B, Hx, N, d]`` (fp8 e4m3 through ml_dtypes, or
    any dtype) times its descale factor ``descale`` ``[B, Hkv]`` (FA3's ``q_descale``,
    ``k_descale``, ``v_descale``), head ``h`` taking ``descale[b, h // (Hx // Hkv)]``: the
    query heads of a GQA group share their kv head's factor.  The fp8 reference is
    ``attention(dequantize(q, q_descale), dequantize(k, k_descale), dequantize(v, v_descale))``:
    FA3's ``S = (Q K^T) q_descale k_descale scale`` and ``O = (P V) v_descale``, exactly."""
    x = np.asarray(x).astype(np.float64)
    descale = np.asarray(descale, dtype=np.float64)
    b, hx = x.shape[:2]
    if descale.ndim != 2 or descale.shape[0] != b or hx % descale.shape[1]:
        raise ValueError(f"descale: expected [B, Hkv] = [{b}, a divisor of {hx}], got "
                         f"{list(descale.shape)}")
    per_head = np.repeat(descale, hx // descale.shape[1], axis=1)
    return x * per_head[:, :, None, None]


def attention(q, k, v, *, causal=False, softmax_scale=None, dropout_mask=None, dropout_p=0.0,
              window_size=(-1, -1), softcap=0.0, alibi_slopes=None, score_mod=None,
              mask_mod=None, aux_tensors=(), learnable_sink=None):
    r"""Exact attention in float64, returning ``(o, lse)``.

    .. math::
        S = \text{mod}(\text{scale}\; Q K^T),\qquad
        \text{lse}_i = \log \sum_{j \text{ visible}} e^{S_{ij}},\qquad
        P_{ij} = e^{S_{ij} - \text{lse}_i},\qquad
        O = \Big(P \odot \frac{\text{keep}}{1-p}\Big) V

    ``mod`` is softcap then ALiBi (see the module docstring); "visible" follows ``causal`` and
    ``window_size`` (:func:`visible_mask`).  ``dropout_mask`` is the boolean keep-mask
    ``[B, H, Nq, Nk]`` (see :func:`numba_flash.dropout_mask`); ``None`` means no dropout.

    A user's variant (FlexAttention's functions, :mod:`numba_flash.flex`), evaluated per element
    in plain Python: ``mask_mod(b, h, q_idx, kv_idx, *aux_tensors) -> bool`` is and-ed with
    ``causal`` / ``window_size``; ``score_mod(score, b, h, q_idx, kv_idx, *aux_tensors) ->
    float`` takes the score after scale, softcap and ALiBi and returns the one the softmax uses.

    ``learnable_sink`` (``[H]``, gpt-oss's attention sinks): one logit per query head that joins
    every row's denominator as a key with no value, ``o_i = sum_j e^{S_ij} v_j / (e^{sink_h} +
    sum_j e^{S_ij})`` and ``lse_i = log(e^{sink_h} + sum_j e^{S_ij})``; a row that sees no key
    has ``o = 0``, ``lse = sink_h``.  Dropout acts on the keys' probabilities as without it.

    Empty batches: ``B``, ``Nq`` or ``Nk`` 0 gives outputs of those shapes, every row ``o = 0``,
    ``lse = -inf`` (or ``sink_h``) when ``Nk = 0``, as :func:`numba_flash.forward` answers them.
    """
    q = np.asarray(q, dtype=np.float64)
    h = q.shape[1]
    k = _expand_kv(np.asarray(k, dtype=np.float64), h)
    v = _expand_kv(np.asarray(v, dtype=np.float64), h)
    user = _user_tuple(score_mod, mask_mod, aux_tensors)
    s, vis, _ = _scores(q, k, _scale(q.shape[-1], softmax_scale), causal, window_size, softcap,
                        alibi_slopes, user)
    p, lse = _softmax_rows(s, learnable_sink)
    p_drop = p * _keep_scale(dropout_mask, dropout_p, p.shape)
    return _pv(p_drop, v, vis), lse


def sparse_attention(q, k, v, kv_indices, *, causal=False, softmax_scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, learnable_sink=None):
    """Token-sparse attention (DeepSeek V3.2's DSA, FA4's ``gather_kv_indices``) in float64,
    returning ``(o, lse)`` as :func:`attention`.

    Query row ``i`` of head ``h`` sees only the keys listed in ``kv_indices[b, g, i]``:
    ``kv_indices`` is an integer ``[B, G, Nq, topk]`` array with ``G = Hkv`` (``g`` is ``h``'s kv
    head: the heads of a GQA group share their list, as DSA's indexer does) or ``G = 1`` (one
    list for every head); ``-1`` is "no key".  A key listed twice counts once (the kernels'
    front end rejects repeats), and the built-in rules still hide what they hide: a listed key
    past the causal diagonal or outside the window stays hidden.  A row that keeps no key has
    ``o = 0``, ``lse = -inf`` (``lse = sink_h`` with ``learnable_sink``).  Only the listed keys
    can make a row NaN.  An index outside ``[-1, Nk)`` is a ``ValueError`` naming
    ``kv_indices``.
    """
    q = np.asarray(q, dtype=np.float64)
    h = q.shape[1]
    k = _expand_kv(np.asarray(k, dtype=np.float64), h)
    v = _expand_kv(np.asarray(v, dtype=np.float64), h)
    idx = np.asarray(kv_indices)
    b, nq, nk = q.shape[0], q.shape[2], k.shape[2]
    if (idx.ndim != 4 or idx.shape[0] != b or idx.shape[2] != nq or h % idx.shape[1]
            or not np.issubdtype(idx.dtype, np.integer)):
        raise ValueError(f"kv_indices: expected integers [B, Hkv or 1, Nq, topk] = [{b}, a "
                         f"divisor of {h}, {nq}, topk], got {idx.dtype} {list(idx.shape)}")
    if idx.size and (idx.min() < -1 or idx.max() >= nk):
        raise ValueError(f"kv_indices: expected entries in [-1, {nk}), got {idx.min()} .. "
                         f"{idx.max()}")
    listed = _listed(idx, h, nk)
    s, vis, _ = _scores(q, k, _scale(q.shape[-1], softmax_scale), causal, window_size, softcap,
                        alibi_slopes)
    vis = vis & listed
    p, lse = _softmax_rows(np.where(vis, s, -np.inf), learnable_sink)
    return _pv(p, v, vis), lse


def _listed(idx, h, nk):
    """``[B, H, Nq, Nk]`` bool: key ``j`` is in query ``i``'s list (of head ``h``'s kv head)."""
    listed = np.zeros(idx.shape[:3] + (nk,), bool)
    bi, gi, qi, ti = np.nonzero(idx >= 0)
    listed[bi, gi, qi, idx[bi, gi, qi, ti]] = True
    return np.repeat(listed, h // idx.shape[1], axis=1)


def sparse_attention_backward(do, q, k, v, kv_indices, **kw):
    """Gradients of :func:`sparse_attention` (``kw``: its variants; ``(dq, dk, dv)``, ``dsink``
    with a ``learnable_sink``): :func:`attention_backward` with the lists as its mask."""
    listed = _listed(np.asarray(kv_indices), np.shape(q)[1], np.shape(k)[2])
    return attention_backward(do, q, k, v, mask_mod=lambda b, h, i, j: bool(listed[b, h, i, j]),
                              **kw)


def attention_backward(
    do, q, k, v, *, causal=False, softmax_scale=None, dropout_mask=None, dropout_p=0.0,
    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, score_mod=None, mask_mod=None,
    score_mod_grad=None, aux_tensors=(), learnable_sink=None,
):
    r"""Gradients ``(dq, dk, dv)`` of :func:`attention`'s ``o`` for an upstream gradient ``do``
    (``(dq, dk, dv, dsink)`` with a ``learnable_sink``).

    With :math:`Z = \text{keep}/(1-p)` (1 without dropout) and :math:`\tilde P = P \odot Z`:

    .. math::
        dV = \tilde P^T dO,\quad dP = (dO\,V^T) \odot Z,\quad
        D_i = \sum_j dP_{ij} P_{ij} = \sum_c dO_{ic} O_{ic},\\
        dS = P \odot (dP - D) \odot (1 - t^2),\quad dQ = \text{scale}\; dS\,K,\quad
        dK = \text{scale}\; dS^T Q

    where :math:`t = \tanh(\text{scale}\, q \cdot k / \text{softcap})` is the softcap's slope
    (the factor is 1 without softcap; ALiBi's bias has no gradient).  Non-finite ``q`` or ``k``
    follow the forward's rule: they make the gradients of the rows (keys) that see them NaN and
    never touch a row that does not see them; so does a non-finite ``do[i, c]`` (``dq`` of row
    ``i``, ``dk`` and ``dv[:, c]`` of the keys row ``i`` sees).  ``dk`` and ``dv`` are summed
    over the query heads of each GQA group, in ``k``'s shape.

    With a ``score_mod``, ``score_mod_grad(score, b, h, q_idx, kv_idx, *aux_tensors)`` is its
    derivative with respect to ``score`` (at the score it received): ``dS`` is multiplied by it
    before the softcap factor.  A ``score_mod`` without ``score_mod_grad`` is a ``ValueError``.

    A sink changes ``P`` (its denominator) and nothing else of the formulas (it has no value:
    its ``dP`` is 0); its own gradient is :math:`dsink_h = -\sum_{b,i} e^{sink_h -
    lse_{bhi}} D_{bhi}`, ``[H]``.  ``B``, ``Nq`` or ``Nk`` 0: zero gradients (and ``dsink``).
    """
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("score_mod_grad: the backward of a score_mod needs its derivative "
                         "d score_mod / d score, got None")
    q = np.asarray(q, dtype=np.float64)
    do = np.asarray(do, dtype=np.float64)
    hkv = np.shape(k)[1]
    h = q.shape[1]
    k = _expand_kv(np.asarray(k, dtype=np.float64), h)
    v = _expand_kv(np.asarray(v, dtype=np.float64), h)
    scale = _scale(q.shape[-1], softmax_scale)
    user = _user_tuple(score_mod, mask_mod, aux_tensors)
    s, vis, t = _scores(q, k, scale, causal, window_size, softcap, alibi_slopes, user)
    s_pre = None
    if user is not None:
        t, s_pre = t
    p, lse = _softmax_rows(s, learnable_sink)
    z = _keep_scale(dropout_mask, dropout_p, p.shape)
    p_drop = p * z
    o = np.einsum("bhij,bhjd->bhid", p_drop, v)
    # a non-finite do[i, c] reaches dv[j, c] of the keys j row i sees, never the others (P = 0
    # there, but 0 * NaN would be NaN)
    fin_do = np.isfinite(do)
    dv = np.einsum("bhij,bhid->bhjd", p_drop, np.where(fin_do, do, 0.0))
    vis_bh = np.broadcast_to(vis, p.shape)
    for bi, hi, i, c in zip(*np.nonzero(~fin_do)):
        dv[bi, hi, :, c] += np.where(vis_bh[bi, hi, i], p_drop[bi, hi, i] * do[bi, hi, i, c], 0.0)
    dp = np.einsum("bhid,bhjd->bhij", do, v) * z
    d_row = (do * o).sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        ds = np.where(vis, p * (dp - d_row), 0.0)  # a key the row does not see: exactly 0
    if score_mod is not None:  # the chain rule through the user's score_mod
        b_, h_, nq_, nk_ = ds.shape
        idx = np.ix_(np.arange(b_), np.arange(h_), np.arange(nq_), np.arange(nk_))
        aux = tuple(aux_tensors)
        with np.errstate(invalid="ignore", over="ignore"):
            grad = _elementwise(lambda x, *a: float(score_mod_grad(np.float64(x), *a, *aux)),
                                s_pre, *idx)
        ds = np.where(vis, ds * grad, 0.0)
    if t is not None:
        ds = ds * np.where(vis, 1.0 - t * t, 0.0)
    # a non-finite k (q) reaches dq (dk) only through the NaN dS of the rows that see it
    dq = scale * np.einsum("bhij,bhjd->bhid", ds, np.where(np.isfinite(k), k, 0.0))
    dk = scale * np.einsum("bhij,bhid->bhjd", ds, np.where(np.isfinite(q), q, 0.0))
    if learnable_sink is None:
        return dq, _fold_groups(dk, hkv), _fold_groups(dv, hkv)
    sink = np.asarray(learnable_sink, np.float64)
    with np.errstate(invalid="ignore"):
        # a -inf sink's weight is 0, also in a row with no key (lse = -inf: exp would be NaN)
        w = np.where(sink[None, :, None] == -np.inf, 0.0, np.exp(sink[None, :, None] - lse))
        dsink = 0.0 - (w * d_row[..., 0]).sum(axis=(0, 2))
    return dq, _fold_groups(dk, hkv), _fold_groups(dv, hkv), dsink


class _Sequence(NamedTuple):
    """One sequence of a packed batch: its rows of ``q`` and its rows of ``k`` and ``v``."""

    rows: slice
    keys: slice


def _sequences(cu_seqlens_q, cu_seqlens_k):
    """The :class:`_Sequence` of each sequence of a packed batch, in order."""
    cq = [int(x) for x in np.asarray(cu_seqlens_q)]
    ck = [int(x) for x in np.asarray(cu_seqlens_k)]
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq)} entries, cu_seqlens_k {len(ck)}")
    return [_Sequence(slice(q0, q1), slice(k0, k1))
            for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:])]


def _alibi_row(alibi_slopes, b):
    if alibi_slopes is None:
        return None
    a = np.asarray(alibi_slopes, dtype=np.float64)
    return a[b] if a.ndim == 2 else a


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_masks=None,
                     dropout_p=0.0, learnable_sink=None):
    """Attention over a packed batch, returning ``(o [total_q, H, d], lse [H, total_q])``.

    ``q`` is ``[total_q, H, d]`` and ``k``, ``v`` are ``[total_k, Hkv, d]``; sequence ``b`` is
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` against rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k`` and ``v``, each plain :func:`attention` with
    its own bottom-right alignment.  ``alibi_slopes`` is ``[H]`` or ``[B, H]``;
    ``dropout_masks`` is ``None`` or a list of per-sequence keep masks ``[H, nq_b, nk_b]``;
    ``learnable_sink`` ``[H]`` as :func:`attention` (a sequence's rows that see no key: ``lse =
    sink``; ``total_q`` or ``total_k`` 0, every sequence empty on that side: the same rule).
    """
    q = np.asarray(q, dtype=np.float64)
    o = np.zeros(q.shape[:2] + np.shape(v)[-1:])     # v's head dim (its own, or d)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    if learnable_sink is not None:   # a row of an empty sequence sees no key: lse = sink
        lse[:] = np.asarray(learnable_sink, np.float64)[:, None]
    for b, seq in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        if seq.rows.stop == seq.rows.start:
            continue
        qb = q[seq.rows].transpose(1, 0, 2)[None]
        kb = np.asarray(k, dtype=np.float64)[seq.keys].transpose(1, 0, 2)[None]
        vb = np.asarray(v, dtype=np.float64)[seq.keys].transpose(1, 0, 2)[None]
        mask = None if dropout_masks is None else np.asarray(dropout_masks[b])[None]
        ob, lb = attention(qb, kb, vb, causal=causal, softmax_scale=softmax_scale,
                           window_size=window_size, softcap=softcap,
                           alibi_slopes=_alibi_row(alibi_slopes, b), dropout_mask=mask,
                           dropout_p=dropout_p, learnable_sink=learnable_sink)
        o[seq.rows] = ob[0].transpose(1, 0, 2)
        lse[:, seq.rows] = lb[0]
    return o, lse


def attention_backward_varlen(do, q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                              softmax_scale=None, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, dropout_masks=None, dropout_p=0.0,
                              learnable_sink=None):
    """Gradients ``(dq, dk, dv)`` of :func:`attention_varlen`, packed like ``q``, ``k``, ``v``
    (``(dq, dk, dv, dsink)`` with a ``learnable_sink``)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    do = np.asarray(do, dtype=np.float64)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    dsink = np.zeros(q.shape[1])
    for b, seq in enumerate(_sequences(cu_seqlens_q, cu_seqlens_k)):
        rows, keys = seq.rows, seq.keys
        if rows.stop == rows.start or keys.stop == keys.start:
            continue   # no key: o = 0, so D = 0 and nothing reaches dsink either
        def pack(x, s):
            return x[s].transpose(1, 0, 2)[None]
        mask = None if dropout_masks is None else np.asarray(dropout_masks[b])[None]
        g = attention_backward(pack(do, rows), pack(q, rows), pack(k, keys),
                               pack(v, keys), causal=causal, softmax_scale=softmax_scale,
                               window_size=window_size, softcap=softcap,
                               alibi_slopes=_alibi_row(alibi_slopes, b), dropout_mask=mask,
                               dropout_p=dropout_p, learnable_sink=learnable_sink)
        dq[rows] = g[0][0].transpose(1, 0, 2)
        dk[keys] = g[1][0].transpose(1, 0, 2)
        dv[keys] = g[2][0].transpose(1, 0, 2)
        if learnable_sink is not None:
            dsink += g[3]
    if learnable_sink is not None:
        return dq, dk, dv, dsink
    return dq, dk, dv


def blocked_attention(
    q, k, v, block_m, block_n, *, causal=False, softmax_scale=None, dropout_mask=None,
    dropout_p=0.0,
):
    r"""The tiled FlashAttention forward in NumPy: the bridge from the math to the kernels.

    Q tiles outer (one GPU thread block each), K/V tiles inner.  For each Q tile ``i`` keep the
    running row max ``m_i``, running sum ``l_i`` and unnormalised output ``acc``; for each K/V tile
    ``j``:

    .. math::
        S = \text{scale}\; Q_i K_j^T,\quad m_{new} = \max(m_i, \text{rowmax}(S)),\quad
        \alpha = e^{m_i - m_{new}},\quad P = e^{S - m_{new}},\\
        l_i \leftarrow \alpha\, l_i + \text{rowsum}(P),\quad
        acc \leftarrow \alpha\, acc + (P \odot Z) V_j

    and finally ``O_i = acc / l_i``, ``lse_i = m_i + log(l_i)``.  Causal: tiles wholly above the
    diagonal are skipped, tiles wholly below it need no mask, only tiles crossing it are masked.
    Returns the same ``(o, lse)`` as :func:`attention`.
    """
    q = np.asarray(q, dtype=np.float64)
    bsz, h, nq, d = q.shape
    k = _expand_kv(np.asarray(k, dtype=np.float64), h)
    v = _expand_kv(np.asarray(v, dtype=np.float64), h)
    nk = k.shape[2]
    scale = _scale(d, softmax_scale)
    offset = nk - nq  # bottom-right causal alignment
    keep = None if dropout_mask is None else np.asarray(dropout_mask, dtype=bool)
    o = np.zeros((bsz, h, nq, d))
    lse = np.full((bsz, h, nq), -np.inf)
    for b in range(bsz):
        for hh in range(h):
            # [docs:blocked-attention-loop]
            for q_start in range(0, nq, block_m):
                q_end = min(nq, q_start + block_m)
                q_tile = q[b, hh, q_start:q_end]
                m_i = np.full(q_end - q_start, -np.inf)
                l_i = np.zeros(q_end - q_start)
                acc = np.zeros((q_end - q_start, d))
                for k_start in range(0, nk, block_n):
                    k_end = min(nk, k_start + block_n)
                    if causal and k_start > q_end - 1 + offset:
                        break  # this tile and all after it lie wholly above the diagonal
                    s = scale * q_tile @ k[b, hh, k_start:k_end].T
                    if causal and k_end - 1 > q_start + offset:  # tile crosses the diagonal
                        vis = causal_visible(nq, nk)[q_start:q_end, k_start:k_end]
                        s = np.where(vis, s, -np.inf)
                    m_new = np.maximum(m_i, s.max(axis=1))
                    m_use = np.where(np.isfinite(m_new), m_new, 0.0)  # row still fully masked
                    alpha = np.exp(m_i - m_use)
                    p = np.exp(s - m_use[:, None])
                    l_i = alpha * l_i + p.sum(axis=1)
                    if keep is not None:
                        p = p * keep[b, hh, q_start:q_end, k_start:k_end] / (1.0 - dropout_p)
                    acc = alpha[:, None] * acc + p @ v[b, hh, k_start:k_end]
                    m_i = m_new
                seen = l_i > 0
                l_safe = np.where(seen, l_i, 1.0)[:, None]
                o[b, hh, q_start:q_end] = np.where(seen[:, None], acc / l_safe, 0.0)
                with np.errstate(divide="ignore"):
                    lse[b, hh, q_start:q_end] = np.where(seen, m_i + np.log(l_i), -np.inf)
            # [/docs:blocked-attention-loop]
    return o, lse


# ----------------------------------------------------------------------------------------------
# merging partial softmax states, paged decode
# ----------------------------------------------------------------------------------------------
def merge_states(o_parts, lse_parts, learnable_sink=None):
    r"""Merge partial attention states computed over disjoint key sets (stacked on axis 0).

    Each part ``p`` holds its own normalised output ``o_p`` and log-sum-exp ``lse_p``.  Then

    .. math::
        \text{lse} = \log \sum_p e^{\text{lse}_p},\qquad
        o = \sum_p e^{\text{lse}_p - \text{lse}}\; o_p

    A part with ``lse_p = -inf`` (it saw no key) contributes nothing, whatever its ``o_p``
    holds; if every part is ``-inf`` the result is ``o = 0``, ``lse = -inf``.  A part with
    ``lse_p = NaN`` makes ``o`` and ``lse`` NaN; a part with ``lse_p = +inf`` gives
    ``lse = +inf`` and ``o = NaN`` (as :mod:`numba_flash.kernels.decode.merge` does).

    ``learnable_sink`` (broadcastable to ``lse_parts.shape[1:]``; ``-inf``: none): the rows'
    attention-sink logits, one more part with ``lse_p = sink`` and ``o_p = 0`` (a key with no
    value), added once: the merge of split partials with it is the unsplit attention with it.
    """
    o_parts = np.asarray(o_parts, dtype=np.float64)
    lse_parts = np.asarray(lse_parts, dtype=np.float64)
    if o_parts.shape[:-1] != lse_parts.shape:
        raise ValueError(
            f"o_parts {o_parts.shape} and lse_parts {lse_parts.shape} disagree: expected "
            "o_parts.shape[:-1] == lse_parts.shape"
        )
    if learnable_sink is not None:   # the sink: a part of its own, o_p = 0
        sink = np.broadcast_to(np.asarray(learnable_sink, np.float64), lse_parts.shape[1:])
        o_parts = np.concatenate([o_parts, np.zeros((1,) + o_parts.shape[1:])])
        lse_parts = np.concatenate([lse_parts, sink[None]])
    # [docs:merge-states]
    m = lse_parts.max(axis=0)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    empty = lse_parts == -np.inf  # parts that saw no key weigh nothing, whatever their o holds
    w = np.where(empty, 0.0, np.exp(np.where(empty, 0.0, lse_parts - m_safe)))
    total = w.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = np.where(total > 0, m_safe + np.log(total), -np.inf)
        o_sum = (w[..., None] * np.where(empty[..., None], 0.0, o_parts)).sum(axis=0)
        o = np.where(total[..., None] > 0, o_sum / np.where(total > 0, total, 1.0)[..., None], 0.0)
    # a NaN part poisons the row (o and lse NaN); a +inf part gives lse = +inf and o = NaN
    poisoned = np.isnan(lse_parts).any(axis=0)
    infinite = (lse_parts == np.inf).any(axis=0) & ~poisoned
    lse = np.where(poisoned, np.nan, np.where(infinite, np.inf, lse))
    o = np.where((poisoned | infinite)[..., None], np.nan, o)
    return o, lse
    # [/docs:merge-states]


def gather_paged(cache, block_table, seqlen, b):
    """Logical ``[Hkv, seqlen, d]`` view of sequence ``b`` from a paged cache.

    ``cache`` is ``[num_blocks, Hkv, block_size, d]``; token ``t`` of sequence ``b`` lives in
    physical block ``block_table[b, t // block_size]`` at slot ``t % block_size``.
    """
    block_size = cache.shape[2]
    t = np.arange(seqlen)
    blocks = np.asarray(block_table)[b, t // block_size]
    return np.asarray(cache, dtype=np.float64)[blocks, :, t % block_size].transpose(1, 0, 2)


def paged_decode(q, k_cache, v_cache, cache_seqlens, block_table=None, *, causal=False,
                 softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 learnable_sink=None, kv_indices=None):
    """Decode attention against a KV cache, contiguous or paged, returning ``(o, lse)``.

    ``q`` is ``[B, H, d]`` (one token) or ``[B, H, Nq, d]``.  With ``block_table=None`` the cache
    is contiguous ``[B, Hkv, Nmax, d]`` and sequence ``b`` uses its first ``cache_seqlens[b]``
    positions; otherwise the cache is paged ``[num_blocks, Hkv, block_size, d]`` (see
    :func:`gather_paged`).  Each sequence is then plain :func:`attention` (bottom-right
    alignment, window, softcap, ALiBi ``[H]`` or ``[B, H]``, ``learnable_sink``) against its
    ``cache_seqlens[b]`` keys (none: ``o = 0``, ``lse = -inf`` or the sink; ``B = 0``: empty
    outputs); with ``kv_indices`` (``[B, Hkv or 1, Nq, topk]``, or ``[B, Hkv or
    1, topk]`` for a ``[B, H, d]`` q) it is :func:`sparse_attention` over those keys instead.
    """
    q = np.asarray(q, dtype=np.float64)
    single = q.ndim == 3
    q4 = q[:, :, None, :] if single else q
    outs, lses = [], []
    for b in range(q4.shape[0]):
        n = int(cache_seqlens[b])
        if block_table is None:
            kb = np.asarray(k_cache, dtype=np.float64)[b, :, :n]
            vb = np.asarray(v_cache, dtype=np.float64)[b, :, :n]
        else:
            kb = gather_paged(k_cache, block_table, n, b)
            vb = gather_paged(v_cache, block_table, n, b)
        kw = dict(causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                  softcap=softcap, alibi_slopes=_alibi_row(alibi_slopes, b),
                  learnable_sink=learnable_sink)
        if kv_indices is None:
            o, lse = attention(q4[b : b + 1], kb[None], vb[None], **kw)
        else:
            lists = np.asarray(kv_indices)[b : b + 1]   # [1, G, (Nq,) topk]
            o, lse = sparse_attention(q4[b : b + 1], kb[None], vb[None],
                                      lists[:, :, None] if lists.ndim == 3 else lists, **kw)
        outs.append(o[0])
        lses.append(lse[0])
    o, lse = _stack_rows(outs, lses, q4.shape[1:3], np.shape(v_cache)[-1])
    if single:
        return o[:, :, 0], lse[:, :, 0]
    return o, lse


def _stack_rows(outs, lses, rows, d_v):
    """Each sequence's ``o [H, Nq, d_v]`` and ``lse [H, Nq]`` stacked into a batch; an empty
    batch (no sequence) gives ``o [0, H, Nq, d_v]`` and ``lse [0, H, Nq]``."""
    if not outs:
        return np.zeros((0, *rows, d_v)), np.zeros((0, *rows))
    return np.stack(outs), np.stack(lses)


# ----------------------------------------------------------------------------------------------
# the KV cache of a generation loop: append, rotary, flash_attn_with_kvcache's decode
# ----------------------------------------------------------------------------------------------
def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=None,
              cache_batch_idx=None):
    """New caches with ``k_new``, ``v_new`` (``[B, Hkv, Nnew, d]``) written at each sequence's
    length, and the new lengths: ``(k_cache', v_cache', cache_seqlens + Nnew)``.

    Token ``i`` of sequence ``b`` goes to position ``t = cache_seqlens[b] + i``: in a contiguous
    cache ``[Bc, Hkv, Nmax, d]`` row ``cache_batch_idx[b]`` (default ``b``), slot ``t``; in a paged
    cache ``[num_blocks, Hkv, block_size, d]`` block ``block_table[b, t // block_size]``, slot
    ``t % block_size``.  A copy, so the caches keep their dtype (``k_new`` is cast to it); the
    inputs are not modified."""
    k_out, v_out = np.array(k_cache), np.array(v_cache)
    lens = np.asarray(cache_seqlens).astype(np.int64)
    b, _, nnew, _ = np.shape(k_new)
    for s in range(b):
        t = lens[s] + np.arange(nnew)
        if block_table is None:
            row = s if cache_batch_idx is None else int(cache_batch_idx[s])
            k_out[row, :, t] = np.asarray(k_new)[s].transpose(1, 0, 2)
            v_out[row, :, t] = np.asarray(v_new)[s].transpose(1, 0, 2)
        else:
            bs = k_out.shape[2]
            blocks = np.asarray(block_table)[s, t // bs]
            k_out[blocks, :, t % bs] = np.asarray(k_new)[s].transpose(1, 0, 2)
            v_out[blocks, :, t % bs] = np.asarray(v_new)[s].transpose(1, 0, 2)
    return k_out, v_out, lens + nnew


def apply_rotary(x, cos, sin, *, interleaved=False, seqlen_offsets=0):
    r"""Rotary position embedding (flash-attn's ``apply_rotary_emb``) in float64.

    ``x`` is ``[B, H, N, d]`` (this package's layout; flash-attn's is ``[B, N, H, d]``), ``cos``
    and ``sin`` ``[max_position, rotary_dim / 2]``; token ``n`` of sequence ``b`` is at position
    ``p = seqlen_offsets[b] + n`` (an int or ``[B]`` ints).  For each pair ``(x_1, x_2)`` of the
    first ``rotary_dim`` dims and ``c = cos[p, i]``, ``s = sin[p, i]``:

    .. math:: (x_1, x_2) \mapsto (x_1 c - x_2 s,\; x_2 c + x_1 s)

    the pairs being ``(x[i], x[i + rotary_dim / 2])`` (GPT-NeoX halves) or, with
    ``interleaved``, ``(x[2i], x[2i + 1])`` (GPT-J); dims past ``rotary_dim`` pass through."""
    x = np.asarray(x, dtype=np.float64)
    cos, sin = np.asarray(cos, dtype=np.float64), np.asarray(sin, dtype=np.float64)
    b, _, n, _ = x.shape
    half = cos.shape[1]
    pos = np.broadcast_to(np.asarray(seqlen_offsets, dtype=np.int64), (b,))[:, None] + np.arange(n)
    c, s = cos[pos][:, None], sin[pos][:, None]           # [B, 1, N, rotary_dim / 2]
    if interleaved:
        x1, x2 = x[..., 0:2 * half:2], x[..., 1:2 * half:2]
    else:
        x1, x2 = x[..., :half], x[..., half:2 * half]
    out = x.copy()
    r1, r2 = x1 * c - x2 * s, x2 * c + x1 * s
    if interleaved:
        out[..., 0:2 * half:2], out[..., 1:2 * half:2] = r1, r2
    else:
        out[..., :half], out[..., half:2 * half] = r1, r2
    return out


def kvcache_decode(q, k_cache, v_cache, cache_seqlens, *, k_new=None, v_new=None,
                   rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                   cache_batch_idx=None, cache_leftpad=None, block_table=None, causal=False,
                   softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   score_mod=None, mask_mod=None, aux_tensors=(), learnable_sink=None):
    """flash-attn's ``flash_attn_with_kvcache`` in float64: ``(o, lse, k_cache', v_cache')``.

    ``q`` ``[B, H, Nq, d]`` or ``[B, H, d]``; caches and ``block_table`` as :func:`paged_decode`.
    With ``rotary_cos``/``rotary_sin``, ``k_new`` is rotated at positions ``cache_seqlens[b] +
    i`` and ``q`` at ``cache_seqlens[b] + i`` when ``causal`` or a window edge is set (in ``[0,
    capacity)``), else every query token at ``cache_seqlens[b]`` (flash-attn's rule).  Then
    ``k_new``/``v_new`` are appended (:func:`append_kv`; the caches come back in float64) and
    sequence ``b`` attends to its keys ``[cache_leftpad[b], cache_seqlens[b] + Nnew)`` of cache
    row ``cache_batch_idx[b]``: plain :func:`attention` on that slice (bottom-right aligned to
    its length).

    ``score_mod`` / ``mask_mod`` (:func:`attention`'s) see the positions of the sequence as
    :func:`numba_flash.decode` gives them: ``b`` the sequence, ``q_idx = L - Nq + i`` for
    query token ``i`` (``L = cache_seqlens[b] + Nnew``) and ``kv_idx`` the key's cache position
    (``cache_leftpad[b] + j`` for key ``j`` of the slice).  A sequence with no key: ``o = 0``,
    ``lse = -inf`` (or the sink); ``B = 0``: empty ``o`` and ``lse``."""
    q = np.asarray(q, dtype=np.float64)
    single = q.ndim == 3
    q4 = q[:, :, None, :] if single else q
    b, _, nq, _ = q4.shape
    lens = np.asarray(cache_seqlens).astype(np.int64)

    def at_positions(s, q0, k0):
        """The user's functions for :func:`attention` of sequence ``s``'s rows over its key
        slice: row ``i`` is position ``q0 + i``, key ``j`` position ``k0 + j``, batch row ``s``."""
        out = {}
        if score_mod is not None:
            out["score_mod"] = lambda x, _, h, i, j, *a: score_mod(x, s, h, q0 + i, k0 + j, *a)
        if mask_mod is not None:
            out["mask_mod"] = lambda _, h, i, j, *a: mask_mod(s, h, q0 + i, k0 + j, *a)
        return out

    k_c = np.asarray(k_cache, dtype=np.float64)
    v_c = np.asarray(v_cache, dtype=np.float64)
    cap = (k_c.shape[2] if block_table is None else np.shape(block_table)[1] * k_c.shape[2])
    if rotary_cos is not None:
        left, right = window_size
        local = causal or 0 <= left < cap or 0 <= right < cap
        if local:
            q4 = apply_rotary(q4, rotary_cos, rotary_sin, interleaved=rotary_interleaved,
                              seqlen_offsets=lens)
        else:  # every query token at position cache_seqlens[b]
            q4 = np.concatenate([apply_rotary(q4[:, :, i:i + 1], rotary_cos, rotary_sin,
                                              interleaved=rotary_interleaved,
                                              seqlen_offsets=lens) for i in range(nq)], axis=2)
        k_new = apply_rotary(k_new, rotary_cos, rotary_sin, interleaved=rotary_interleaved,
                             seqlen_offsets=lens)
    if k_new is not None:
        k_c, v_c, lens = append_kv(k_c, v_c, np.asarray(k_new, dtype=np.float64),
                                   np.asarray(v_new, dtype=np.float64), lens, block_table,
                                   cache_batch_idx)
    outs, lses = [], []
    for s in range(b):
        lp = 0 if cache_leftpad is None else int(cache_leftpad[s])
        n = int(lens[s])
        if block_table is None:
            row = s if cache_batch_idx is None else int(cache_batch_idx[s])
            kb, vb = k_c[row, :, lp:n], v_c[row, :, lp:n]
        else:
            kb = gather_paged(k_c, block_table, n, s)[:, lp:]
            vb = gather_paged(v_c, block_table, n, s)[:, lp:]
        o, lse = attention(q4[s:s + 1], kb[None], vb[None], causal=causal,
                           softmax_scale=softmax_scale, window_size=window_size,
                           softcap=softcap, alibi_slopes=_alibi_row(alibi_slopes, s),
                           aux_tensors=aux_tensors, learnable_sink=learnable_sink,
                           **at_positions(s, n - nq, lp))
        outs.append(o[0])
        lses.append(lse[0])
    o, lse = _stack_rows(outs, lses, q4.shape[1:3], v_c.shape[-1])
    if single:
        o, lse = o[:, :, 0], lse[:, :, 0]
    return o, lse, k_c, v_c
