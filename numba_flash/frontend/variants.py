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
from typing import NamedTuple

import numpy as np

from .validate import (ATTENTION_DTYPES, INT32_MAX, INT64_MAX, array_info, array_module,
                       check_array, check_bool, check_int, check_int_array, check_same_dtype,
                       check_same_kind, check_value_shape, is_device_array)


#: The bound past which a window edge is clamped to unbounded when the caller does not pass its
#: sequence lengths (:func:`clamp_window`): exact for sequences of up to 2**30 queries and keys.
WINDOW_SAFE = 2**30


def check_window(window_size):
    """``window_size``: a pair ``(left, right)`` (a tuple or list, or a 1-D integer array of two)
    of ints (Python or NumPy, not bool) in ``[-1, 2**63 - 1]`` (-1 = unbounded).  Returns the
    two as Python ints (as passed; :func:`clamp_window` makes them safe for a kernel)."""
    if not isinstance(window_size, (tuple, list, np.ndarray)):
        raise TypeError(f"window_size: expected a pair (left, right) of ints (a tuple or list), "
                        f"got {type(window_size).__name__}")
    if np.ndim(window_size) != 1 or len(window_size) != 2:
        raise ValueError(f"window_size: expected a pair (left, right), got "
                         f"{np.size(window_size)} entries: {tuple(np.ravel(window_size))!r}")
    out = []
    for side, w in zip(("left", "right"), window_size):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window_size: expected {side} an int >= -1, got "
                            f"{type(w).__name__} {w!r}")
        if int(w) < -1:
            raise ValueError(f"window_size: expected {side} >= -1 (-1 = unbounded), got {int(w)}")
        if int(w) > INT64_MAX:
            raise ValueError(f"window_size: expected {side} <= 2**63 - 1 (an int64; any edge at "
                             f"or past the sequence length is unbounded), got {int(w)}")
        out.append(int(w))
    return tuple(out)


def clamp_window(left, right, nq=None, nk=None):
    """``(left, right)`` with every edge at or past the sequence clamped to -1 (unbounded).

    Row ``i`` of ``Nq`` sits at key column ``c = i + Nk - Nq`` and sees keys ``c - left <= j <=
    c + right`` within ``[0, Nk)``: ``left >= Nk`` reaches past key 0 for every row and ``right
    >= Nq`` past key ``Nk - 1``, so either is the same as -1 (exactly: no row's keys change).
    ``nq`` / ``nk`` are the longest query and key sequences (varlen: the longest of the batch,
    decode: the cache capacity); without them the bound is :data:`WINDOW_SAFE` (``2**30``), exact
    for sequences up to that length.

    Why this cannot overflow: afterwards every edge is -1 or below ``max(Nq, Nk)`` (or 2**30),
    so every value :mod:`numba_flash.kernels.mainloop.visibility` computes from the edges (``c -
    left``, ``c + right + 1``, ``k_end - 1 + left - offset + 1``, ...: at most one edge plus indices
    below ``Nq + Nk``) lies within ``(-2**31, 2**31)`` whenever ``Nq + Nk <= 2**30``, in the
    simulator's int32 arithmetic (the edges reach it as ``np.int32``) as well as in the GPU's
    int64 (the sizes are int64 there).  Before the clamp, ``right = 2**31 - 1`` wrapped
    ``c + right + 1`` to a negative int32 (a silently wrong output) and ``2**31`` did not fit
    the ``np.int32`` the kernels take at all.
    """
    lim_left = WINDOW_SAFE if nk is None else int(nk)
    lim_right = WINDOW_SAFE if nq is None else int(nq)
    return (-1 if left >= lim_left else left), (-1 if right >= lim_right else right)


def check_softcap(softcap):
    """``softcap``: a finite real >= 0 (0 = off).  Returns a Python float."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a real number >= 0, got {type(softcap).__name__}")
    s = float(softcap)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"softcap: expected a finite number >= 0 (0 = off), got {softcap!r}")
    return s


def check_alibi(alibi_slopes, b, h, check_values=None):
    """``alibi_slopes``: ``None``, or float32 ``[H]`` or ``[B, H]``, finite.

    Returns ``None`` or a C-contiguous float32 ``[B, H]`` array of the same kind (NumPy or
    CuPy) that the kernels read as ``slope = alibi[b, h]`` (``[B, H]`` slopes already so: the
    same memory, no copy; ``[H]`` ones broadcast into a new array).  ``check_values`` (default:
    for host arrays only) refuses NaN / inf slopes; a device array's values are not read (that
    would wait for the GPU): a non-finite slope gives non-finite scores.
    """
    if alibi_slopes is None:
        return None
    shape, dtype = array_info("alibi_slopes", alibi_slopes)
    if dtype != np.float32:
        raise TypeError(f"alibi_slopes: expected dtype float32 (as flash-attn), got {dtype}")
    if shape not in ((h,), (b, h)):
        raise ValueError(f"alibi_slopes: expected shape ({h},) or ({b}, {h}) (H or B x H), got "
                         f"{shape}")
    xp = array_module(alibi_slopes)
    a = xp.asarray(alibi_slopes)
    if check_values is None:
        check_values = not is_device_array(alibi_slopes)
    if check_values and not bool(xp.isfinite(a).all()):
        raise ValueError("alibi_slopes: expected finite values, got a NaN or inf")
    if shape == (b, h) and a.flags.c_contiguous:
        return a
    return xp.ascontiguousarray(xp.broadcast_to(a, (b, h)), dtype=xp.float32)


def sink_logits(learnable_sink, why):
    """``(shape, xp, array)`` of a given ``learnable_sink`` (NumPy or CuPy: ``xp``), whose dtype
    must be float32 (a TypeError saying ``why`` otherwise); shape and values unchecked."""
    shape, dtype = array_info("learnable_sink", learnable_sink)
    if dtype != np.float32:
        raise TypeError(f"learnable_sink: expected dtype float32 ({why}), got {dtype}")
    xp = array_module(learnable_sink)
    return shape, xp, xp.asarray(learnable_sink)


def check_sink(learnable_sink, h, check_values=None):
    """``learnable_sink``: ``None``, or one logit per query head, float32 ``[H]``, finite or
    ``-inf`` (a head without a sink).  Returns ``None`` or a C-contiguous float32 ``[H]``
    array of the same kind (NumPy or CuPy).  ``check_values=False`` (default for a device
    array: a call that never waits for the GPU) checks the dtype and shape only: a NaN logit
    gives NaN rows."""
    if learnable_sink is None:
        return None
    if check_values is None:
        check_values = not is_device_array(learnable_sink)
    shape, xp, s = sink_logits(learnable_sink, "one logit per head, as flash-attn")
    if shape != (h,):
        raise ValueError(f"learnable_sink: expected shape ({h},) (one per query head), got "
                         f"{shape}")
    if check_values:
        check_sink_values(s)
    return xp.ascontiguousarray(s, dtype=xp.float32)


def check_sink_values(s):
    """Sink logits (NumPy or CuPy) are finite or ``-inf`` (no sink): a NaN or ``+inf`` is a
    ValueError naming ``learnable_sink`` (a device array is read on the host)."""
    xp = array_module(s)
    if bool(xp.isnan(s).any()) or bool((s == xp.inf).any()):
        raise ValueError("learnable_sink: expected finite logits (or -inf: no sink), got a NaN "
                         "or +inf")


def check_cu_seqlens(name, cu_seqlens, total, max_seqlen, max_name, read=True):
    """``cu_seqlens`` of a packed batch: an integer 1-D array ``[B + 1]`` of entries in
    ``[0, 2**31 - 1]`` (int32 offsets), 0 first, ``total`` (the packed length of the matching
    tensor) last, non-decreasing, no sequence longer than ``max_seqlen`` (an int in
    ``[0, 2**31 - 1]``).

    Returns ``(cu_int32, lengths)``: a C-contiguous int32 array of the same kind (NumPy or
    CuPy) for the kernels (the array itself when it is one already), and the host NumPy int64
    sequence lengths (a device ``cu_seqlens`` is copied to the host once to check it: a
    synchronisation, which a launch plan cannot replay).

    ``read=False`` (a device ``cu_seqlens`` the caller does not validate): only the dtype, the
    shape and ``max_seqlen`` are checked, nothing is read on the host, and ``lengths`` is None;
    the caller sizes the launch by ``max_seqlen``.  A non-int32 or non-contiguous array is
    converted on the device (entries outside the int32 range do not survive it).
    """
    shape, dtype = array_info(name, cu_seqlens)
    if dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array (int32), got dtype {dtype}")
    if len(shape) != 1 or shape[0] < 2:
        raise ValueError(f"{name}: expected a 1-D array [B + 1] with B >= 1, got shape {shape}")
    xp = array_module(cu_seqlens)
    if not read:
        check_int(max_name, max_seqlen, 0, INT32_MAX)
        return xp.ascontiguousarray(xp.asarray(cu_seqlens), dtype=xp.int32), None
    if xp is not np:
        from .plans import note_host_read

        note_host_read(name)
    host = cu_seqlens.get() if hasattr(cu_seqlens, "get") else np.asarray(cu_seqlens)
    # the range first (compared in the array's own dtype): no uint64 or int64 entry can wrap or
    # overflow in the checks below, and the int32 cast of the kernels' copy is exact
    vals = check_int_array(name, host, 0, INT32_MAX, dtype=np.int64).tolist()
    if vals[0] != 0:
        raise ValueError(f"{name}: expected 0 first, got {vals[0]}")
    if vals[-1] != total:
        raise ValueError(f"{name}: expected the packed length {total} last, got {vals[-1]}")
    lengths = np.diff(np.array(vals, dtype=np.int64))
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"{name}: expected non-decreasing values, got {vals[i]} then "
                         f"{vals[i + 1]} at index {i}")
    max_seqlen = check_int(max_name, max_seqlen, 0, INT32_MAX)
    if max_seqlen < int(lengths.max()):
        raise ValueError(f"{max_name}: expected at least the longest sequence of {name} "
                         f"({int(lengths.max())}), got {max_seqlen}")
    return xp.ascontiguousarray(xp.asarray(cu_seqlens), dtype=xp.int32), lengths


class CheckedVariants(NamedTuple):
    """What :func:`check_variants` returns: the clamped window, the kernels' window bounds,
    the softcap and the ALiBi slopes."""

    #: ``window_size`` validated, edges at or past the sequence clamped to -1
    window: tuple
    left: int
    right: int
    softcap: float
    #: float32 ``[B, H]`` of the inputs' kind, or None
    alibi: object


def check_variants(causal, window_size, softcap, alibi_slopes, b, h, nq=None, nk=None):
    """The three variant arguments of an attention op at once, after ``causal`` (a checked bool).

    Returns a :class:`CheckedVariants` ``(window, left, right, softcap, alibi)``: the validated
    ``window_size`` with edges at or past the sequence clamped to -1 (:func:`clamp_window`;
    ``nq`` / ``nk`` are the longest query / key sequence, ``None``: the 2**30 bound), the
    kernels' window bounds from it with ``causal`` folded in
    (:func:`~numba_flash.kernels.mainloop.visibility.window_bounds`), ``softcap`` as a float and
    the ALiBi slopes as float32 ``[B, H]`` or ``None``.  The bounds fit an int32.
    """
    from ..kernels.mainloop.visibility import window_bounds  # the kernels import frontend, not back

    window = clamp_window(*check_window(window_size), nq, nk)
    left, right = window_bounds(causal, window)
    return CheckedVariants(window, left, right, check_softcap(softcap),
                           check_alibi(alibi_slopes, b, h))


class PackedQKVShape(NamedTuple):
    """What :func:`check_packed_qkv` finds: the dims of ``q [total_q, H, d]`` and ``k [total_k,
    Hkv, d]`` and the dtype the three share."""

    total_q: int
    h: int
    hkv: int
    total_k: int
    d: int
    dtype: np.dtype


class PackedQKVShapeDv(NamedTuple):
    """:class:`PackedQKVShape` with ``d_v``, the head dim of ``v [total_k, Hkv, d_v]`` (what
    :func:`check_packed_qkv` finds with ``value_dim=True``)."""

    total_q: int
    h: int
    hkv: int
    total_k: int
    d: int
    d_v: int
    dtype: np.dtype


def check_packed_qkv(q, k, v, value_dim=False, empty=False):
    """``q [total_q, H, d]``, ``k`` and ``v [total_k, Hkv, d]``; returns a
    :class:`PackedQKVShape` ``(total_q, H, Hkv, total_k, d, dtype)``.  ``value_dim``: ``v
    [total_k, Hkv, d_v]`` may have a head dim of its own (1..256), and the return is a
    :class:`PackedQKVShapeDv` ``(total_q, H, Hkv, total_k, d, d_v, dtype)``.  ``empty``:
    ``total_q`` and ``total_k`` may be 0 (every sequence empty on that side: the varlen ops
    answer it without a launch, :mod:`numba_flash.frontend.empty`)."""
    axes = (0,) if empty else ()
    (qs, qd) = check_array("q", q, 3, ATTENTION_DTYPES, axes)
    (ks, kd) = check_array("k", k, 3, ATTENTION_DTYPES, axes)
    (vs, vd) = check_array("v", v, 3, ATTENTION_DTYPES, axes)
    dtype = check_same_dtype({"q": qd, "k": kd, "v": vd})
    check_same_kind({"q": q, "k": k, "v": v})
    total_q, h, d = qs
    check_value_shape(ks, vs, value_dim)
    total_k, hkv, dk = ks
    if dk != d:
        raise ValueError(f"k: expected head dim {d} (from q), got {dk}")
    if h % hkv:
        raise ValueError(f"k: expected a number of kv heads that divides the {h} query heads of "
                         f"q (GQA), got {hkv}")
    if d > 256:
        raise ValueError(f"q: expected head dim 1..256, got {d}")
    if value_dim:
        return PackedQKVShapeDv(total_q, h, hkv, total_k, d, vs[-1], dtype)
    return PackedQKVShape(total_q, h, hkv, total_k, d, dtype)


class CuSeqlens(NamedTuple):
    """What :func:`check_seqlens` returns: the kernels' int32 ``cu_seqlens``, the host int64
    lengths (None where the arrays were not read) and the longest sequences."""

    cu_q: object
    len_q: object
    cu_k: object
    len_k: object
    #: the longest query / key sequence: from the lengths when read, else ``max_seqlen_q`` /
    #: ``max_seqlen_k`` (flash-attn's contract: at least the longest), capped at the totals
    max_q: int
    max_k: int

    @property
    def n_seq(self):
        """The number of sequences ``B``."""
        return int(self.cu_q.shape[0]) - 1


def check_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k,
                  read=True):
    """Both ``cu_seqlens`` of a packed batch (:func:`check_cu_seqlens`, ``read`` as there), with
    the same number of sequences; a :class:`CuSeqlens`.  Not read, the longest sequences are
    taken as ``max_seqlen_q`` / ``max_seqlen_k``, capped at the packed totals (``total_k``
    None: unknown, a paged cache's count)."""
    cu_q, len_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q,
                                   "max_seqlen_q", read)
    cu_k, len_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k,
                                   "max_seqlen_k", read)
    if cu_q.shape[0] != cu_k.shape[0]:
        raise ValueError(f"cu_seqlens_k: expected {cu_q.shape[0]} entries (B + 1, from "
                         f"cu_seqlens_q), got {cu_k.shape[0]}")
    if read:
        return CuSeqlens(cu_q, len_q, cu_k, len_k, int(len_q.max()), int(len_k.max()))
    # not read: no sequence is longer than max_seqlen, nor (good offsets) than its packed total
    max_q, max_k = int(max_seqlen_q), int(max_seqlen_k)
    return CuSeqlens(cu_q, None, cu_k, None, min(max_q, total_q),
                     max_k if total_k is None else min(max_k, total_k))


def check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                          max_seqlen_k):
    """Both ``cu_seqlens`` of a packed batch read and checked on the host
    (:func:`check_seqlens`).  Returns ``(cu_q, len_q, cu_k, len_k)``."""
    return check_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                         max_seqlen_k)[:4]


def reads_seqlens(q, cu_seqlens_q, cu_seqlens_k, validate, *needs):
    """Whether a varlen op reads its ``cu_seqlens`` on the host and checks them
    (:func:`check_cu_seqlens`): NumPy ones always; device ones with ``validate=True`` (a bool;
    None: True for NumPy ``q``, False for a device one) or when an argument of ``needs`` (a
    ``block_mask``, ``kv_indices``: they need the lengths) is given."""
    if not (is_device_array(cu_seqlens_q) and is_device_array(cu_seqlens_k)):
        return True
    if any(x is not None for x in needs):
        return True
    return check_bool("validate", not is_device_array(q) if validate is None else validate)
