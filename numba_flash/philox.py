"""Philox4x32-10 counter-based random numbers, on the device and in NumPy, and the dropout draw.

Philox4x32-10 (Salmon, Moraes, Dror, Shaw, "Parallel Random Numbers: As Easy as 1, 2, 3",
SC'11; the Random123 library) maps a 128-bit counter ``(c0, c1, c2, c3)`` and a 64-bit key
``(k0, k1)`` to four 32-bit words.  It is a pure function: any thread draws the number of any
element without state, so the backward redraws the forward's dropout mask.  The round, the
``uint32`` typing that makes the device and the simulator agree bit for bit (``mul.wide.u32``
products, no float64) and a kernel's use: docs/dropout.md, "Philox in the code".

The dropout draw (the exact contract; :func:`numba_flash.dropout_mask` reproduces it): for the
scores ``S[b, h, i, j]`` (``b`` batch, ``h`` *query* head, ``i`` query row, ``j`` key column;
all 0-based) and an integer ``seed`` in ``[0, 2**64)``::

    key     = (seed & 0xFFFFFFFF, seed >> 32)                  # (seed_lo, seed_hi)
    counter = (j // 4, i, h, b)                                 # one Philox call per 4 columns
    draw    = philox4x32_10(counter, key)[j % 4]                # uniform on [0, 2**32)
    keep    = draw >= threshold,   threshold = min(round(p * 2**32), 2**32 - 1)

so ``P(keep) = 1 - threshold / 2**32`` (``1 - p`` to within ``2**-33``), ``p = 0`` keeps every
element and a kept probability is scaled by ``1 / (1 - p)``.  Nothing else enters (tile sizes,
thread mapping, causal masking, GQA), so the forward and backward kernels draw identical masks.

Device API (``device_jit``; integer arguments of any integer type holding a value in
``[0, 2**32)``; results exact and identical in the simulator and on the device):

* ``philox4x32_10_device(c0, c1, c2, c3, k0, k1) -> (r0, r1, r2, r3)`` (``uint32`` each);
* ``philox_keep(seed_lo, seed_hi, b, h, i, j, threshold) -> bool``: keep element ``(b, h, i,
  j)``; one Philox call per element;
* ``philox_keep_bits4(seed_lo, seed_hi, b, h, i, jq, threshold) -> int32``: bit ``w`` is set
  iff element ``(b, h, i, 4 * jq + w)`` is kept; one call for four columns (those ``>= Nk`` of
  the last group are drawn too, and the caller ignores them).

``seed_lo``, ``seed_hi`` and ``threshold`` are the ``numpy.uint32`` values of
:func:`dropout_params`.  Host API: :func:`philox4x32` / :func:`philox4x32_10`, the NumPy twin
(``counter [..., 4]`` and ``key [..., 2]``, broadcast against each other, -> ``[..., 4]``
``uint32``); :func:`dropout_params`, which validates ``(dropout_p, seed)`` and converts them to
``(seed_lo, seed_hi, threshold, scale)`` (the forward/backward ops reuse it); :func:`keep_mask`,
the keep-mask ``[B, H, Nq, Nk]`` drawn with the twin (unchecked; the validated entry point is
:func:`numba_flash.dropout_mask`).
"""

from __future__ import annotations

import math
import numbers

import numpy as np
from numba import int32, uint32, uint64

from .kernels.core.jit import device_jit

__all__ = [
    "philox4x32", "philox4x32_10", "philox4x32_10_device", "philox_keep", "philox_keep_bits4",
    "dropout_params", "keep_mask", "PHILOX_M0", "PHILOX_M1", "PHILOX_W0", "PHILOX_W1",
]

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
ROUNDS = 10

# uint64 constants for the device function: a signed literal mixed with uint64 is float64 there.
_M0 = np.uint64(PHILOX_M0)
_M1 = np.uint64(PHILOX_M1)
_W0 = np.uint64(PHILOX_W0)
_W1 = np.uint64(PHILOX_W1)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)


# ------------------------------------------------------------------------------------------------
# device side
# ------------------------------------------------------------------------------------------------
# [docs:philox-round]
@device_jit(inline="never")
def _philox_round(c0, c1, c2, c3, k0, k1):
    """One Philox4x32 round on the uint32 words ``c`` with the uint32 round key ``k``."""
    p0 = _M0 * uint64(c0)  # 32x32 -> 64-bit product (mul.wide.u32 on the device)
    p1 = _M1 * uint64(c2)
    hi0 = uint32(p0 >> _SHIFT32)
    lo0 = uint32(p0 & _MASK32)
    hi1 = uint32(p1 >> _SHIFT32)
    lo1 = uint32(p1 & _MASK32)
    # uint32 ^ uint32 is typed uint64 on the device: cast back so every word stays 32-bit
    return uint32(hi1 ^ c1 ^ k0), lo1, uint32(hi0 ^ c3 ^ k1), lo0


@device_jit(inline="never")
def philox4x32_10_device(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 of counter ``(c0, c1, c2, c3)`` and key ``(k0, k1)``: four ``uint32``.

    Every argument must hold a value in ``[0, 2**32)`` (any integer type); the results are
    bit-identical to :func:`philox4x32_10` in the simulator and on the device.
    """
    x0, x1, x2, x3 = uint32(c0), uint32(c1), uint32(c2), uint32(c3)  # the counter's words
    kk0, kk1 = uint32(k0), uint32(k1)  # the round key
    x0, x1, x2, x3 = _philox_round(x0, x1, x2, x3, kk0, kk1)  # round 1
    for _ in range(ROUNDS - 1):  # rounds 2..10, each after a key bump (mod 2**32)
        kk0 = uint32((uint64(kk0) + _W0) & _MASK32)
        kk1 = uint32((uint64(kk1) + _W1) & _MASK32)
        x0, x1, x2, x3 = _philox_round(x0, x1, x2, x3, kk0, kk1)
    return x0, x1, x2, x3
# [/docs:philox-round]


# [docs:philox-keep-bits4]
@device_jit(inline="never")
def philox_keep_bits4(seed_lo, seed_hi, b, h, i, jq, threshold):
    """Keep bits of columns ``4*jq .. 4*jq+3`` of row ``(b, h, i)``: bit ``w`` set iff kept."""
    r0, r1, r2, r3 = philox4x32_10_device(jq, i, h, b, seed_lo, seed_hi)
    t = uint32(threshold)
    bits = int32(0)
    if r0 >= t:
        bits = int32(bits | int32(1))
    if r1 >= t:
        bits = int32(bits | int32(2))
    if r2 >= t:
        bits = int32(bits | int32(4))
    if r3 >= t:
        bits = int32(bits | int32(8))
    return bits
# [/docs:philox-keep-bits4]


@device_jit(inline="never")
def philox_keep(seed_lo, seed_hi, b, h, i, j, threshold):
    """True iff element ``(b, h, i, j)`` of the attention probabilities is kept (not dropped)."""
    r0, r1, r2, r3 = philox4x32_10_device(j >> 2, i, h, b, seed_lo, seed_hi)
    w = j & 3
    r = r0
    if w == 1:
        r = r1
    elif w == 2:
        r = r2
    elif w == 3:
        r = r3
    return r >= uint32(threshold)


# ------------------------------------------------------------------------------------------------
# host side: the NumPy twin
# ------------------------------------------------------------------------------------------------
def _as_words(name, x, n):
    """``x`` as a uint64 array of 32-bit words with last axis ``n``, or raise."""
    a = np.asarray(x)
    if a.dtype.kind not in "ui":
        raise TypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    if a.ndim == 0 or a.shape[-1] != n:
        raise ValueError(f"{name}: expected shape [..., {n}], got {a.shape}")
    if a.size and (a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise ValueError(f"{name}: expected 32-bit words in [0, 2**32), got values outside")
    return a.astype(np.uint64)


def philox4x32(counter, key, rounds=ROUNDS):
    """Philox4x32-``rounds`` in NumPy: ``counter [..., 4]``, ``key [..., 2]`` -> ``[..., 4]``.

    ``counter`` and ``key`` hold 32-bit words (any integer dtype) and broadcast against each
    other over their leading axes.  ``rounds=10`` is the standard Philox4x32-10.
    """
    c = _as_words("counter", counter, 4)
    k = _as_words("key", key, 2)
    shape = np.broadcast_shapes(c.shape[:-1], k.shape[:-1])
    c0, c1, c2, c3 = (np.broadcast_to(c[..., w], shape) for w in range(4))
    k0 = np.broadcast_to(k[..., 0], shape)
    k1 = np.broadcast_to(k[..., 1], shape)
    for r in range(int(rounds)):
        if r:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        p0 = _M0 * c0
        p1 = _M1 * c2
        c0, c1, c2, c3 = ((p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _MASK32,
                          (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _MASK32)
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def philox4x32_10(counter, key):
    """Philox4x32-10 in NumPy (the twin of :func:`philox4x32_10_device`); see :func:`philox4x32`."""
    return philox4x32(counter, key, 10)


# ------------------------------------------------------------------------------------------------
# dropout parameters and the mask
# ------------------------------------------------------------------------------------------------
def check_dropout_p(dropout_p):
    """A real number in ``[0, 1)``; returns it as a Python float."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a real number in [0, 1), got "
                        f"{type(dropout_p).__name__}")
    p = float(dropout_p)
    if math.isnan(p) or not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a real number in [0, 1), got {dropout_p!r}")
    return p


def check_seed(seed):
    """An integer in ``[0, 2**64)`` (Python or NumPy integer, not bool); returns a Python int."""
    from .frontend.validate import check_int  # the one integer check of every kernel argument

    return check_int("seed", seed, 0, 2**64 - 1, what="an integer in [0, 2**64)")


def dropout_params(dropout_p, seed):
    """Validate ``dropout_p`` and ``seed``; return ``(seed_lo, seed_hi, threshold, scale)``.

    ``seed_lo = seed & 0xFFFFFFFF`` and ``seed_hi = seed >> 32`` (the Philox key) and
    ``threshold = min(round(dropout_p * 2**32), 2**32 - 1)`` are ``numpy.uint32`` (pass them to
    kernels as they are); ``scale = 1 / (1 - dropout_p)`` is a Python float (cast it to the
    kernel's compute type).  An element is kept iff its draw is ``>= threshold``.
    Raises ``TypeError``/``ValueError`` naming the argument.
    """
    p = check_dropout_p(dropout_p)
    s = check_seed(seed)
    # [docs:philox-dropout-params]
    threshold = min(int(round(p * 2.0**32)), 2**32 - 1)  # p * 2**32 is exact in float64
    return (np.uint32(s & 0xFFFFFFFF), np.uint32(s >> 32), np.uint32(threshold), 1.0 / (1.0 - p))
    # [/docs:philox-dropout-params]


# [docs:philox-keep-mask]
def keep_mask(seed_lo, seed_hi, threshold, B, H, Nq, Nk):
    """The bool keep-mask ``[B, H, Nq, Nk]`` drawn with the NumPy twin (arguments unchecked)."""
    nq4 = -(-Nk // 4)
    key = np.array([seed_lo, seed_hi], np.uint64)
    # counter (j // 4, i, h, b) for one (b, h) slab at a time, to bound the host memory
    jq, ii = np.meshgrid(np.arange(nq4, dtype=np.uint64), np.arange(Nq, dtype=np.uint64),
                         indexing="ij")
    keep = np.empty((B, H, Nq, Nk), dtype=bool)
    ctr = np.empty((Nq, nq4, 4), np.uint64)
    ctr[..., 0] = jq.T
    ctr[..., 1] = ii.T
    for b in range(B):
        ctr[..., 3] = b
        for h in range(H):
            ctr[..., 2] = h
            draws = philox4x32_10(ctr, key).reshape(Nq, nq4 * 4)[:, :Nk]
            keep[b, h] = draws >= np.uint32(threshold)
    return keep
# [/docs:philox-keep-mask]
