"""Argument checks for the attention variants: window, softcap, ALiBi, variable-length batches.

Same contract as :mod:`numba_flash.frontend.validate`: every check runs before any launch,
raises ``TypeError`` for a wrong type or dtype and ``ValueError`` for a wrong shape or value, and
names the argument, what was expected and what came.  Nothing here modifies an input; where a
kernel needs another layout (ALiBi slopes broadcast to ``[B, H]``, ``cu_seqlens`` as int32) a new
array is made.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from .validate import (array_info, check_array, check_same_dtype, check_same_kind,
                       is_device_array)


def check_window(window_size):
    """``window_size``: a pair ``(left, right)`` of ints >= -1 (-1 = unbounded).  Returns ints."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__"):
        raise TypeError(f"window_size: expected a pair (left, right) of ints, got "
                        f"{type(window_size).__name__}")
    if len(window_size) != 2:
        raise ValueError(f"window_size: expected a pair (left, right), got {len(window_size)} "
                         f"entries: {tuple(window_size)!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window_size: expected {side} an int >= -1, got "
                            f"{type(w).__name__} {w!r}")
        if int(w) < -1:
            raise ValueError(f"window_size: expected {side} >= -1 (-1 = unbounded), got {int(w)}")
        out.append(int(w))
    return tuple(out)


def check_softcap(softcap):
    """``softcap``: a finite real >= 0 (0 = off).  Returns a Python float."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a real number >= 0, got {type(softcap).__name__}")
    s = float(softcap)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"softcap: expected a finite number >= 0 (0 = off), got {softcap!r}")
    return s


def _xp(x):
    """The array module of ``x``: numpy, or cupy for a device array."""
    if is_device_array(x):
        import cupy  # a device array here means the GPU backend, where CuPy is the array library

        return cupy
    return np


def check_alibi(alibi_slopes, b, h):
    """``alibi_slopes``: ``None``, or float32 ``[H]`` or ``[B, H]``, finite.

    Returns ``None`` or a new C-contiguous float32 ``[B, H]`` array of the same kind (NumPy or
    CuPy) that the kernels read as ``slope = alibi[b, h]``.
    """
    if alibi_slopes is None:
        return None
    shape, dtype = array_info("alibi_slopes", alibi_slopes)
    if dtype != np.float32:
        raise TypeError(f"alibi_slopes: expected dtype float32 (as flash-attn), got {dtype}")
    if shape not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes: expected shape ({h},) or ({b}, {h}) (H or B x H), got "
                         f"{shape}")
    xp = _xp(alibi_slopes)
    a = xp.asarray(alibi_slopes)
    if not bool(xp.isfinite(a).all()):
        raise ValueError("alibi_slopes: expected finite values, got a NaN or inf")
    return xp.ascontiguousarray(xp.broadcast_to(a, (b, h)), dtype=xp.float32)


def check_cu_seqlens(name, cu_seqlens, total, max_seqlen, max_name):
    """``cu_seqlens`` of a packed batch: an integer 1-D array ``[B + 1]``, 0 first, ``total``
    (the packed length of the matching tensor) last, non-decreasing, no sequence longer than
    ``max_seqlen``.

    Returns ``(cu_int32, lengths)``: a new C-contiguous int32 array of the same kind (NumPy or
    CuPy) for the kernels, and the host NumPy int64 sequence lengths (a CuPy ``cu_seqlens`` is
    copied to the host once to check it, as flash-attn's varlen API needs ``max_seqlen`` there).
    """
    shape, dtype = array_info(name, cu_seqlens)
    if dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array (int32), got dtype {dtype}")
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name}: expected a 1-D array [B + 1] with B >= 1, got shape {shape}")
    host = cu_seqlens.get() if hasattr(cu_seqlens, "get") else np.asarray(cu_seqlens)
    vals = [int(x) for x in host]  # Python ints: a uint64 value shows as the value passed
    if vals[0] != 0:
        raise ValueError(f"{name}: expected 0 first, got {vals[0]}")
    if vals[-1] != total:
        raise ValueError(f"{name}: expected the packed length {total} last, got {vals[-1]}")
    lengths = np.diff(np.array(vals, dtype=np.int64))
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"{name}: expected non-decreasing values, got {vals[i]} then "
                         f"{vals[i + 1]} at index {i}")
    if isinstance(max_seqlen, (bool, np.bool_)) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(f"{max_name}: expected an int, got {type(max_seqlen).__name__}")
    if int(max_seqlen) < int(lengths.max()):
        raise ValueError(f"{max_name}: expected at least the longest sequence of {name} "
                         f"({int(lengths.max())}), got {int(max_seqlen)}")
    if vals[-1] >= 2**31:
        raise ValueError(f"{name}: expected a packed length < 2**31 (int32 offsets), got "
                         f"{vals[-1]}")
    xp = _xp(cu_seqlens)
    return xp.ascontiguousarray(xp.asarray(cu_seqlens), dtype=xp.int32), lengths


def check_variants(causal, window_size, softcap, alibi_slopes, b, h):
    """The three variant arguments of an attention op at once, after ``causal`` (a checked bool).

    Returns ``(window, left, right, softcap, alibi)``: the validated ``window_size``, the
    kernels' window bounds with ``causal`` folded in (:func:`~numba_flash.kernels.visibility.
    window_bounds`), ``softcap`` as a float and the ALiBi slopes as float32 ``[B, H]`` or ``None``.
    """
    from ..kernels.visibility import window_bounds  # the kernels import frontend, not back

    window = check_window(window_size)
    left, right = window_bounds(causal, window)
    return window, left, right, check_softcap(softcap), check_alibi(alibi_slopes, b, h)


def check_packed_qkv(q, k, v):
    """``q [total_q, H, d]``, ``k`` and ``v [total_k, Hkv, d]``; returns ``(total_q, H, Hkv,
    total_k, d, dtype)``."""
    (qs, qd) = check_array("q", q, 3)
    (ks, kd) = check_array("k", k, 3)
    (vs, vd) = check_array("v", v, 3)
    dtype = check_same_dtype({"q": qd, "k": kd, "v": vd})
    check_same_kind({"q": q, "k": k, "v": v})
    total_q, h, d = qs
    if ks != vs:
        raise ValueError(f"v: expected the shape of k {ks}, got {vs}")
    total_k, hkv, dk = ks
    if dk != d:
        raise ValueError(f"k: expected head dim {d} (from q), got {dk}")
    if h % hkv:
        raise ValueError(f"k: expected a number of kv heads that divides the {h} query heads of "
                         f"q (GQA), got {hkv}")
    if d > 256:
        raise ValueError(f"q: expected head dim 1..256, got {d}")
    return total_q, h, hkv, total_k, d, dtype


def check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                          max_seqlen_k):
    """Both ``cu_seqlens`` of a packed batch (:func:`check_cu_seqlens`), with the same number of
    sequences.  Returns ``(cu_q, len_q, cu_k, len_k)``."""
    cu_q, len_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q,
                                   "max_seqlen_q")
    cu_k, len_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k,
                                   "max_seqlen_k")
    if len(len_q) != len(len_k):
        raise ValueError(f"cu_seqlens_k: expected {len(len_q) + 1} entries (B + 1, from "
                         f"cu_seqlens_q), got {len(len_k) + 1}")
    return cu_q, len_q, cu_k, len_k
