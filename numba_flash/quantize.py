"""Quantising attention inputs to e4m3 on the host: :func:`quantize_e4m3`, FA3's descales from
the values, with FA3's optional Hadamard rotation of ``q`` and ``k`` ("incoherent processing").

``quantize_e4m3(q, k, v)`` returns ``(q8, k8, v8, q_descale, k_descale, v_descale)`` for
:func:`numba_flash.forward`: per sequence ``b`` and kv head ``g`` (the query heads of its group
together, as FA3's ``q_descale`` is ``[B, Hkv]``), ``descale = amax / 448`` and ``x8 = e4m3(x /
descale)`` (round to nearest even; ``amax = 0`` gives descale 1).  ``rotate=True`` multiplies
``q`` and ``k`` along the head dim by the orthonormal Hadamard matrix ``H / sqrt(d)`` (``d`` a
power of two) before quantising: ``(q H)(k H)^T = q k^T``, so attention is unchanged, while a
few large channels (outliers) are spread over all ``d``, which shrinks ``amax`` against the
typical value and so the relative rounding of the small ones.  ``v`` is never rotated (``o``
would come out rotated).  The error it saves: docs/fp8.md's table.
"""

from __future__ import annotations

import numpy as np

from .frontend.validate import ATTENTION_DTYPES, check_bool, check_qkv, is_device_array
from .kernels.ptx.fp8 import E4M3_MAX   # the largest finite e4m3: each group's amax maps to it


def hadamard(d):
    """The orthonormal ``d x d`` Hadamard matrix ``H / sqrt(d)`` (Sylvester's construction;
    ``d`` a power of two), float64."""
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


def _quantize(x, groups):
    """``(x8, descale)`` of ``x`` ``[B, Hx, N, d]`` (float64) with one descale per ``(b, g)``
    over ``groups`` kv heads (``Hx / groups`` heads each)."""
    import ml_dtypes

    b, hx = x.shape[:2]
    per = hx // groups
    amax = np.abs(x.reshape(b, groups, per * x.shape[2] * x.shape[3])).max(axis=-1)
    descale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    scaled = x / np.repeat(descale.astype(np.float64), per, axis=1)[:, :, None, None]
    return scaled.astype(np.float32).astype(ml_dtypes.float8_e4m3fn), descale


def quantize_e4m3(q, k, v, *, rotate=False):
    """``(q8, k8, v8, q_descale, k_descale, v_descale)``: e4m3 inputs and FA3's float32 ``[B,
    Hkv]`` descales for :func:`numba_flash.forward` (the module docstring).  ``q`` ``[B, H, Nq,
    d]``, ``k``, ``v`` ``[B, Hkv, Nk, d]`` NumPy float16 / bfloat16 / float32 / float64; with
    ``rotate`` ``d`` must be a power of two (a ``ValueError`` naming ``rotate`` otherwise)."""
    s = check_qkv(q, k, v, dtypes=ATTENTION_DTYPES)
    rotate = check_bool("rotate", rotate)
    if is_device_array(q):
        raise TypeError("q: expected NumPy arrays (the quantiser runs on the host; CuPy has no "
                        "fp8 dtype), got a device array")
    arrays = [np.asarray(x).astype(np.float64) for x in (q, k, v)]
    if rotate:
        if s.d & (s.d - 1):
            raise ValueError(f"rotate: expected a head dim that is a power of two (the Hadamard "
                             f"matrix), got {s.d}")
        h = hadamard(s.d)
        arrays[0], arrays[1] = arrays[0] @ h, arrays[1] @ h
    (q8, qd), (k8, kd), (v8, vd) = (_quantize(x, s.hkv) for x in arrays)
    return q8, k8, v8, qd, kd, vd
