"""fp8 (e4m3) inputs on the host: which arrays may be e4m3, and FA3's descale factors.

An e4m3 array is ``ml_dtypes.float8_e4m3fn`` (NumPy), or uint8 bytes under ``qkv_dtype`` /
``kv_cache_dtype="fp8_e4m3"`` (a CuPy array's form; :mod:`numba_flash.torch` passes
``torch.float8_e4m3fn`` tensors so).  Its values are scaled: the real value is the stored one
times its *descale*, float32 ``[B, Hkv]`` as FA3's ``k_descale`` / ``v_descale`` (one factor per
sequence and kv head; a per-tensor scale is that array filled with one value).  The kernels
widen e4m3 exactly (in registers, or into a 16-bit shared-memory tile: MLA's tensor-core
decode; :mod:`numba_flash.kernels.ptx.fp8`, sm_89+) and fold the descales into a scale they
already apply; new values are written as the e4m3 of ``x /
descale``, saturated (:func:`numba_flash.append_kv`).  e5m2 is not built (a ``TypeError`` naming the
array).  The reference: :func:`numba_flash.reference.dequantize`; the story:
docs/flash-decoding.md#an-fp8-e4m3-cache.
"""

from __future__ import annotations

import numpy as np

from ..backend import on_simulator
from .kernel_choice import cuda_cc
from .validate import ATTENTION_DTYPES, array_info, array_module, check_array, is_device_array

try:  # ml_dtypes is a dependency (bfloat16 on the host); guard the names for older versions
    import ml_dtypes

    E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
    E5M2 = np.dtype(ml_dtypes.float8_e5m2)
except (ImportError, AttributeError):  # pragma: no cover - ml_dtypes without fp8
    E4M3 = E5M2 = None

#: the element types a KV cache may have: the attention dtypes and e4m3
CACHE_DTYPES = ATTENTION_DTYPES + ((E4M3,) if E4M3 is not None else ())
#: the element types an e4m3 cache's queries and outputs may have
FP8_QUERY_DTYPES = ("float16", "bfloat16", "float32")
#: the compute capability of the e4m3 conversions (``cvt.rn.f16x2.e4m3x2``)
FP8_MIN_CC = (8, 9)


#: ``kv_cache_dtype`` (vLLM's name): ``"auto"`` (the caches' own dtype) or ``"fp8_e4m3"`` (uint8
#: caches holding e4m3 bytes: how a device array carries them, CuPy having no fp8 dtype)
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


def cache_dtype_as_given(name, dtype, kv_cache_dtype, flag="kv_cache_dtype"):
    """The cache's element type with ``kv_cache_dtype`` applied: ``"fp8_e4m3"`` reads a uint8
    (or e4m3) cache as e4m3; ``"auto"`` keeps it.  ``ValueError`` / ``TypeError`` name the
    argument (``flag``: the option's name, ``qkv_dtype`` for the forward's inputs)."""
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"{flag}: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return dtype
    if np.dtype(dtype) not in (np.dtype(np.uint8), E4M3):
        raise TypeError(f"{name}: expected uint8 (or float8_e4m3fn) with "
                        f"{flag}='fp8_e4m3', got {np.dtype(dtype).name}")
    return E4M3


def fp8_inputs(named, qkv_dtype):
    """Whether a forward's ``q``, ``k``, ``v`` (``{name: array}``) take the fp8 path: any of them
    e4m3, or ``qkv_dtype="fp8_e4m3"`` (each then uint8 or e4m3: how a CuPy array, which has no
    fp8 dtype, carries e4m3 bytes; a ``TypeError`` names the one that is not).  A bad
    ``qkv_dtype`` is a ``ValueError`` naming it."""
    given = [cache_dtype_as_given(n, array_info(n, x)[1], qkv_dtype, "qkv_dtype")
             for n, x in named.items()]
    return any(is_e4m3(dt) for dt in given)


def check_cache_array(name, x, kv_cache_dtype):
    """``(shape, dtype)`` of a KV cache as the kernels read it: :func:`check_array` over
    :data:`CACHE_DTYPES` (and uint8 under ``kv_cache_dtype="fp8_e4m3"``), the dtype then
    :func:`cache_dtype_as_given`."""
    uint8 = (np.dtype(np.uint8),) if kv_cache_dtype == "fp8_e4m3" else ()
    shape, dtype = check_array(name, x, 4, CACHE_DTYPES + uint8)
    return shape, cache_dtype_as_given(name, dtype, kv_cache_dtype)


def check_fp8_gpu(name, what="an e4m3 cache"):
    """On a GPU, compute capability >= 8.9 (the e4m3 conversions and ``mma.sync``), else a
    ``ValueError`` naming ``name`` (``what``: the thing that needs it); nothing in the
    simulator.  Asked only of calls that have e4m3 arrays."""
    cc = None if on_simulator() else cuda_cc()
    if cc is not None and tuple(cc) < FP8_MIN_CC:
        raise ValueError(f"{name}: {what} needs a GPU of compute capability >= 8.9 "
                         f"(the e4m3 conversions), got {cc[0]}.{cc[1]}")


def is_e4m3(dtype):
    """True for the e4m3 dtype (``ml_dtypes.float8_e4m3fn``)."""
    return E4M3 is not None and np.dtype(dtype) == E4M3


def check_fp8_cache(k_dtype, v_dtype, q_dtype, d, d_v, d_v_name="v_cache"):
    """With e4m3 caches: both caches e4m3 (MLA's latent cache, ``v_cache=None``: ``k_cache``),
    ``q`` float16 / bfloat16 / float32, ``d`` at least 16 and ``d``, ``d_v`` multiples of 4
    (the kernel reads 4 e4m3 per 32-bit word, 16 per 16-byte load where ``d`` is its padded
    head dim; ``d_v_name``: the argument ``d_v`` comes from), and a GPU of compute capability
    >= 8.9 (:func:`check_fp8_gpu`).  Returns whether the caches are e4m3; a ``TypeError`` (a
    mix, ``q``'s dtype) or ``ValueError`` names the argument (e5m2 never gets here:
    :data:`CACHE_DTYPES` leaves it out)."""
    k8, v8 = is_e4m3(k_dtype), is_e4m3(v_dtype)
    if not (k8 or v8):
        return False
    if k8 != v8:
        odd, other = ("v_cache", "k_cache") if k8 else ("k_cache", "v_cache")
        raise TypeError(f"{odd}: expected float8_e4m3fn (the dtype of {other}), got "
                        f"{np.dtype(v_dtype if k8 else k_dtype).name}")
    if np.dtype(q_dtype).name not in FP8_QUERY_DTYPES:
        raise TypeError(f"q: expected dtype in {FP8_QUERY_DTYPES} with an e4m3 cache, got "
                        f"{np.dtype(q_dtype).name}")
    if d < 16 or d % 4:
        raise ValueError(f"k_cache: expected a head dim that is a multiple of 4, at least 16, "
                         f"for an e4m3 cache (4 values per 32-bit load), got {d}")
    if d_v % 4:
        raise ValueError(f"{d_v_name}: expected a value head dim that is a multiple of 4 for an "
                         f"e4m3 cache (4 values per 32-bit load), got {d_v}")
    check_fp8_gpu("k_cache")
    return True


def check_descales(named, b, hkv, fp8, inputs=()):
    """FA3's descale factors ``{name: array or None}`` for ``(k, v)``: each float32 ``[B, Hkv]``
    (NumPy, or with device ``inputs`` device arrays too: FA3's CUDA tensors, read on the
    device, never copied to the host; a device descale beside host inputs is a ``TypeError``
    naming it), only with e4m3 inputs.  Returns the kernels' ``[len(named), B, Hkv]`` float32
    array (ones where None; a CuPy array when a descale is a device array), or None without
    e4m3."""
    on_device = any(is_device_array(x) for x in inputs)
    given = {name: x for name, x in named.items() if x is not None}
    for name, x in given.items():
        if not fp8:
            raise ValueError(f"{name}: expected None without e4m3 inputs (a descale factor "
                             f"scales fp8 values), got an array")
        shape, dtype = array_info(name, x)
        if is_device_array(x) and not on_device:
            raise TypeError(f"{name}: expected a NumPy array with NumPy inputs (device "
                            f"descales go with device arrays), got a device array")
        if dtype != np.float32:
            raise TypeError(f"{name}: expected dtype float32, got {dtype}")
        if tuple(shape) != (b, hkv):
            raise ValueError(f"{name}: expected shape ({b}, {hkv}) = [B, Hkv], got "
                             f"{tuple(shape)}")
    if not fp8:
        return None
    device = [x for x in given.values() if is_device_array(x)]
    xp = array_module(device[0]) if device else np
    out = xp.ones((len(named), b, hkv), np.float32)
    for i, name in enumerate(named):
        if name in given:
            out[i] = xp.asarray(given[name])
    return out
