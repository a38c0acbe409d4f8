"""``numba_flash.apply_rotary``: rotary position embedding as flash-attn's ``apply_rotary_emb``
(:mod:`numba_flash.kernels.cache.rotary`); its table checks and launch, which
:func:`numba_flash.decode` shares for ``rotary_cos``/``rotary_sin``, live in
:mod:`numba_flash.frontend.cache_args`."""

from __future__ import annotations

import numbers

import numpy as np

from ..frontend import ArrayCall
from ..frontend.plans import plan_key, run_or_build
from ..frontend.arrays import host_ints, kernel_ints
from ..frontend.kernel_args import device_constant
from ..frontend.cache_args import check_positions, check_rotary_tables, launch_rotary
from ..frontend.validate import (
    ATTENTION_DTYPES, INT32_MAX, INT_DTYPES, check_array, check_bool, check_int, check_same_kind,
    is_device_array,
)


def apply_rotary(x, cos, sin, *, interleaved=False, seqlen_offsets=0, validate=None):
    """Rotary position embedding: flash-attn's ``apply_rotary_emb(x, cos, sin, interleaved,
    seqlen_offsets=...)``, on this package's layout.

    * ``x``: ``[B, H, N, d]`` (heads before tokens, the layout of ``q`` and of the caches in
      :func:`numba_flash.decode`), float16/32/64 or ``ml_dtypes.bfloat16``.  It is read
      through its strides where it lies, with no copy, when its last dim is contiguous:
      flash-attn's ``[B, N, H, d]`` memory passed as its ``x.transpose(0, 2, 1, 3)`` view, a
      fused QKV projection's slice, a head or batch slice at an offset (another view is
      copied first).
    * ``cos``, ``sin``: ``[max_position, rotary_dim / 2]``, ``x``'s dtype, ``rotary_dim <= d``;
      the dims past ``rotary_dim`` pass through unchanged.
    * ``interleaved``: ``False`` (default, GPT-NeoX): pairs ``(x[i], x[i + rotary_dim / 2])``;
      ``True`` (GPT-J): pairs ``(x[2i], x[2i + 1])``.  Pair ``i`` of token ``n`` of sequence
      ``b`` turns by ``cos[p, i]``, ``sin[p, i]`` at position ``p = seqlen_offsets[b] + n``:
      ``(x_1, x_2) -> (x_1 cos - x_2 sin, x_2 cos + x_1 sin)``.
    * ``seqlen_offsets``: an int, or integer ``[B]`` (each sequence's first position, e.g. the
      tokens already in a KV cache), >= 0.
    * ``validate``: check on the host that every position is below ``max_position`` (the default
      for NumPy inputs; a ``ValueError`` naming ``cos``).  Without it (device arrays) a position
      outside the tables gives NaN in the rotated dims and reads nothing outside them.

    Returns a new C-contiguous array ``[B, H, N, d]`` of ``x``'s dtype (computed in float32,
    float64 for float64); ``x`` is not modified.

    Device arrays without ``validate``: no synchronisation, and a call of a signature seen
    before replays its launch plan (:mod:`numba_flash.frontend.plans`); with
    ``seqlen_offsets`` an int (a new plan per value) the ordinary path runs every call.
    """
    kw = dict(interleaved=interleaved, seqlen_offsets=seqlen_offsets, validate=validate)
    if not isinstance(seqlen_offsets, numbers.Integral):
        arrays = (x, cos, sin, seqlen_offsets)
        key = plan_key("apply_rotary", arrays, (interleaved, validate))
        if key is not None:
            return run_or_build(key, _apply_rotary, arrays, x, cos, sin, **kw)
    return _apply_rotary(x, cos, sin, **kw)


def _apply_rotary(x, cos, sin, *, interleaved, seqlen_offsets, validate):
    """:func:`apply_rotary`'s checks and launches (its ordinary path, and what a plan records)."""
    xs, dtype = check_array("x", x, 4, ATTENTION_DTYPES)
    b, h, n, d = xs
    max_position, _ = check_rotary_tables(cos, sin, d, dtype)
    interleaved = check_bool("interleaved", interleaved)
    arrays = {"x": x, "cos": cos, "sin": sin}
    per_seq = not isinstance(seqlen_offsets, numbers.Integral) or isinstance(
        seqlen_offsets, (bool, np.bool_))
    if per_seq:
        if isinstance(seqlen_offsets, (bool, np.bool_, float, str)) or seqlen_offsets is None:
            raise TypeError("seqlen_offsets: expected an int or an integer array [B], got "
                            f"{type(seqlen_offsets).__name__}")
        (ob,), _ = check_array("seqlen_offsets", seqlen_offsets, 1, INT_DTYPES)
        if ob != b:
            raise ValueError(f"seqlen_offsets: expected shape ({b},) (the batch of x), got "
                             f"({ob},)")
        arrays["seqlen_offsets"] = seqlen_offsets
        offset0 = 0
    else:
        offset0 = check_int("seqlen_offsets", seqlen_offsets, 0, INT32_MAX)
    check_same_kind(arrays)
    on_device = any(is_device_array(a) for a in arrays.values())
    validate = check_bool("validate", (not on_device) if validate is None else validate)

    call = ArrayCall(arrays)
    if validate:
        if per_seq:
            off = host_ints(seqlen_offsets)
            bad = np.flatnonzero(off < 0)
            if bad.size:
                i = int(bad[0])
                raise ValueError(f"seqlen_offsets: expected entries >= 0, got {int(off[i])} at "
                                 f"index {i}")
            last = off.astype(np.float64) + (n - 1)
        else:
            last = np.full(b, offset0 + n - 1, np.float64)
        check_positions("cos", np.minimum(last, 2.0**62), max_position,
                        "seqlen_offsets[b] + N - 1")
    d_off = (kernel_ints(call, seqlen_offsets, "seqlen_offsets") if per_seq
             else device_constant(call, "no_offsets", np.zeros((1,), np.int32)))
    # the kernel indexes x through its strides (Numba's own indexing): a view whose last dim
    # is contiguous (flash-attn's [B, N, H, d] memory, a fused projection's slice) as it lies
    out = launch_rotary(call, call.input(x, strided=True), call.input(cos), call.input(sin),
                        d_off, offset0, 1, per_seq, interleaved, dtype)
    return call.result(out)
