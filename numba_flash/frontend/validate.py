"""Argument checks shared by every public entry point.

Every check runs before any kernel launch and raises ``TypeError`` for a wrong type or dtype and
``ValueError`` for a wrong shape or value.  Each message names the argument, what was expected
and what came.  Nothing here copies or modifies an input.
"""

from __future__ import annotations

from collections import namedtuple
import contextlib
import contextvars
import math
import numbers

import ml_dtypes
import numpy as np

#: the host bfloat16 dtype (NumPy has none; ``ml_dtypes.bfloat16`` is the one JAX uses)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
#: the float dtypes :func:`numba_flash.decode` and :func:`numba_flash.merge_states` take
FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
#: the dtypes the attention ops take (forward, backward, varlen, ring, softmax, naive forward):
#: :data:`FLOAT_DTYPES` and bfloat16
ATTENTION_DTYPES = FLOAT_DTYPES + (BFLOAT16,)
INT_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64,
                                         np.uint8, np.uint16, np.uint32, np.uint64))


def is_device_array(x) -> bool:
    """True for CuPy arrays, Numba device arrays and anything with ``__cuda_array_interface__``."""
    return hasattr(x, "__cuda_array_interface__")


def array_module(x):
    """The array module of ``x``: numpy, the stand-in device for its arrays
    (:mod:`numba_flash.standin`), or cupy for any other device array (on the GPU backend CuPy
    is the array library)."""
    if is_device_array(x):
        if type(x).__module__ == "numba_flash.standin":
            import numba_flash.standin as standin

            return standin
        import cupy

        return cupy
    return np


def array_info(name, x):
    """Return ``(shape, dtype)`` of a NumPy or device array, or raise ``TypeError``."""
    if isinstance(x, np.ndarray):
        return x.shape, x.dtype
    if is_device_array(x):
        cai = x.__cuda_array_interface__
        # a bfloat16 CuPy array (CuPy >= 14 with ml_dtypes) says so in its dtype; its CAI
        # typestr is only "<V2"
        if getattr(x, "dtype", None) == BFLOAT16:
            return tuple(cai["shape"]), BFLOAT16
        return tuple(cai["shape"]), np.dtype(cai["typestr"])
    raise TypeError(
        f"{name}: expected a numpy.ndarray, a CuPy array or an object with "
        f"__cuda_array_interface__, got {type(x).__module__}.{type(x).__qualname__}"
    )


def _rank_text(ndims):
    """``(4,)`` -> "4-D", ``(3, 4)`` -> "3-D or 4-D", ``range(2, 10)`` -> "2-D to 9-D"."""
    ranks = sorted(set(int(n) for n in ndims))
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-D to {ranks[-1]}-D"
    return " or ".join(f"{n}-D" for n in ranks)


#: the axes each named array may have empty within :func:`allow_empty` (``{name: axes}``)
_EMPTY_AXES = contextvars.ContextVar("numba_flash_empty_axes", default={})


@contextlib.contextmanager
def allow_empty(**axes):
    """Within the block, :func:`check_array` of an array named as a keyword takes zero on the
    axes given (``allow_empty(k_cache=(0, 2))``), where its caller passes no ``empty_axes``: how
    an op that answers empty batches (:mod:`numba_flash.frontend.empty`) lets the shared checks
    of its arguments (a cache, ``k_new``) take them."""
    token = _EMPTY_AXES.set({**_EMPTY_AXES.get(), **axes})
    try:
        yield
    finally:
        _EMPTY_AXES.reset(token)


def check_array(name, x, ndim, dtypes=FLOAT_DTYPES, empty_axes=None):
    """Check type, dtype, rank and non-emptiness; return ``(shape, dtype)``.

    ``ndim`` is one rank or several (a tuple or a ``range``: ``range(2, 10)`` reads "a 2-D to 9-D
    array" in the message).  ``empty_axes``: the axes that may be 0 (an empty batch or key set,
    :mod:`numba_flash.frontend.empty`); any other empty axis is a ``ValueError`` ("expected no
    empty dimension").  None: the axes :func:`allow_empty` gives ``name``, else none."""
    shape, dtype = array_info(name, x)
    if dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype in ({allowed}), got {dtype}")
    ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if len(shape) not in ndims:
        raise ValueError(f"{name}: expected a {_rank_text(ndims)} array, got shape {shape} "
                         f"({len(shape)}-D)")
    if empty_axes is None:
        empty_axes = _EMPTY_AXES.get().get(name, ())
    if any(s == 0 and i not in empty_axes for i, s in enumerate(shape)):
        raise ValueError(f"{name}: expected no empty dimension, got shape {shape}")
    return shape, dtype


def check_same_dtype(named):
    """All arrays in ``{name: dtype}`` share one dtype; raise ``TypeError`` naming the odd one."""
    items = list(named.items())
    first_name, first = items[0]
    for name, dtype in items[1:]:
        if dtype != first:
            raise TypeError(f"{name}: expected dtype {first} (the dtype of {first_name}), "
                            f"got {dtype}")
    return first


def check_same_kind(named):
    """All arrays live on the host (NumPy) or all on the device; mixing is a ``TypeError``."""
    kinds = {name: ("device" if is_device_array(x) else "numpy") for name, x in named.items()}
    if len(set(kinds.values())) > 1:
        desc = ", ".join(f"{n}={k}" for n, k in kinds.items())
        raise TypeError(f"expected all arrays on the host (NumPy) or all on the GPU, got {desc}")


def check_out(name, out, shape, dtype, like, like_name="q", strided=False):
    """``out=``: None, or an array the op writes its result into and returns: of ``like``'s
    kind (NumPy, or a device array), dtype ``dtype``, shape ``shape`` and C-contiguous
    (a ``TypeError`` / ``ValueError`` naming ``name`` otherwise).  ``strided``: a view whose
    last dim is contiguous and whose elements do not overlap (:func:`disjoint_view`) will do
    too (the op writes it through its strides, or copies into it)."""
    if out is None:
        return None
    got, got_dtype = array_info(name, out)
    if is_device_array(out) != is_device_array(like):
        kind = "a device" if is_device_array(like) else "a NumPy"
        raise TypeError(f"{name}: expected {kind} array, as {like_name}, got "
                        f"{type(out).__module__}.{type(out).__qualname__}")
    if got_dtype != np.dtype(dtype):
        raise TypeError(f"{name}: expected dtype {np.dtype(dtype)}, got {got_dtype}")
    if tuple(got) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(got)}")
    contiguous = is_c_contiguous(out)
    if strided and not contiguous:
        if not disjoint_view(out):
            raise ValueError(f"{name}: expected a view whose last dim is contiguous and whose "
                             f"elements do not overlap (written in place), got shape "
                             f"{tuple(got)} with strides {getattr(out, 'strides', None)}")
    elif not contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array (written in place), got "
                         f"strides {getattr(out, 'strides', None)}")
    return out


def is_c_contiguous(x):
    """Whether the (host or device) array ``x`` is C-contiguous."""
    flags = getattr(x, "flags", None)
    if flags is not None:
        return bool(flags.c_contiguous)
    return x.__cuda_array_interface__.get("strides") is None


def disjoint_view(x):
    """Whether the array ``x`` (with ``strides``) is a view a kernel can write through its
    strides: its last dim contiguous, every stride positive and in whole elements, and no two
    elements at one address (each axis, by increasing stride, steps past the whole extent of
    the axes below it)."""
    size = np.dtype(x.dtype).itemsize
    dims = sorted((int(st), int(n)) for n, st in zip(x.shape, x.strides) if int(n) > 1)
    if x.shape[-1] > 1 and int(x.strides[-1]) != size:
        return False
    extent = size
    for st, n in dims:
        if st <= 0 or st % size or st < extent:
            return False
        extent = st * n
    return True


def check_grad_outs(out, q, k, v, dtype, strided=False):
    """``out=`` of a backward: None, or ``(dq, dk, dv)`` of ``q``'s, ``k``'s and ``v``'s
    shapes and the gradients' dtype ``dtype`` (each checked by :func:`check_out`; ``strided``:
    non-overlapping strided views too)."""
    if out is None:
        return None
    if not isinstance(out, tuple) or len(out) != 3:
        raise TypeError(f"out: expected None or a tuple (dq, dk, dv), got "
                        f"{type(out).__name__}")
    return tuple(check_out(f"out[{i}] ({n})", x, array_info(n, like)[0], dtype, q,
                           strided=strided)
                 for i, (n, x, like) in enumerate(zip(("dq", "dk", "dv"), out, (q, k, v))))


#: the axes of a ``[B, H, N, d]`` array that an empty batch or key set leaves 0 (``B``, ``N``)
BATCH_AND_SEQ = (0, 2)


#: What :func:`check_qkv` finds: the dims of ``q [B, H, Nq, d]`` and ``k [B, Hkv, Nk, d]`` and the
#: dtype the three share.
QKVShape = namedtuple("QKVShape", "b h hkv nq nk d dtype")


#: :class:`QKVShape` with ``d_v``, the head dim of ``v [B, Hkv, Nk, d_v]`` (what :func:`check_qkv`
#: finds with ``value_dim=True``).
QKVShapeDv = namedtuple("QKVShapeDv", "b h hkv nq nk d d_v dtype")


def check_qkv(q, k, v, q_name="q", k_name="k", v_name="v", dtypes=ATTENTION_DTYPES,
              value_dim=False, empty=False):
    """Check the ``[B, H, Nq, d]`` / ``[B, Hkv, Nk, d]`` attention contract (``dtypes``: the
    element dtypes allowed, one for all three; mixing bfloat16 with another is a ``TypeError``
    naming the odd argument).  ``value_dim``: ``v`` may have a head dim of its own,
    ``[B, Hkv, Nk, d_v]`` with ``d_v`` in 1..256.  ``empty``: ``B``, ``Nq`` and ``Nk`` may be 0
    (an op that answers empty batches, :mod:`numba_flash.frontend.empty`); ``H`` and ``d``
    never.

    Returns a :class:`QKVShape` ``(B, H, Hkv, Nq, Nk, d, dtype)`` (``value_dim``: a
    :class:`QKVShapeDv` ``(B, H, Hkv, Nq, Nk, d, d_v, dtype)``).
    """
    axes = BATCH_AND_SEQ if empty else ()
    (qs, qd) = check_array(q_name, q, 4, dtypes, axes)
    (ks, kd) = check_array(k_name, k, 4, dtypes, axes)
    (vs, vd) = check_array(v_name, v, 4, dtypes, axes)
    dtype = check_same_dtype({q_name: qd, k_name: kd, v_name: vd})
    check_same_kind({q_name: q, k_name: k, v_name: v})
    b, h, nq, d = qs
    if d > 256:
        raise ValueError(f"{q_name}: expected head dim 1..256, got {d}")
    check_value_shape(ks, vs, value_dim, k_name, v_name)
    d_v = vs[3]
    bk, hkv, nk, dk = ks
    if bk != b:
        raise ValueError(f"{k_name}: expected batch size {b} (from {q_name}), got {bk}")
    if dk != d:
        raise ValueError(f"{k_name}: expected head dim {d} (from {q_name}), got {dk}")
    if h % hkv:
        raise ValueError(
            f"{k_name}: expected a number of kv heads that divides the {h} query heads of "
            f"{q_name} (GQA), got {hkv}"
        )
    if d > 256:
        raise ValueError(f"{q_name}: expected head dim 1..256, got {d}")
    if value_dim:
        return QKVShapeDv(b, h, hkv, nq, nk, d, d_v, dtype)
    return QKVShape(b, h, hkv, nq, nk, d, dtype)


def check_scale(softmax_scale, d, dtype=None):
    """``None`` means ``1/sqrt(d)``; otherwise a finite positive real number, and with the
    inputs' ``dtype`` one the kernels can use in the compute type (float32 for float16, bfloat16
    and float32 inputs, float64 for float64): a normal number whose product with ``log2(e)``
    (the tensor-core forward's exponent constant) is finite, so at most ``max / log2(e)``
    (2.36e38 in float32).  ``1e39`` with float32 inputs would become ``inf`` on the way to the
    kernel, ``1e-39`` a subnormal.

    A scale within range can still make a score ``scale * q . k`` overflow (``2e38`` with a
    dot product of 2): such a score is non-finite, and a row with one gets ``o`` and ``lse``
    NaN (the SIMT kernels and decode: :func:`numba_flash.kernels.mainloop.visibility.make_score`,
    the rule for a NaN or inf input).  Nothing clamps the scores.  torch's ``softmax(scale * q @
    k^T)`` also gives NaN for a ``+inf`` score or a row of ``-inf``, but weight 0 to a ``-inf``
    score beside a finite one."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError("softmax_scale: expected a real number or None, got "
                        f"{type(softmax_scale).__name__}")
    try:
        s = float(softmax_scale)
    except OverflowError:  # an int beyond float64
        s = math.inf
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"softmax_scale: expected a finite number > 0, got {softmax_scale!r}")
    if dtype is not None:
        from ..kernels.core.common import acc_dtype

        ct = acc_dtype(dtype)
        lo, hi = float(np.finfo(ct).tiny), float(np.finfo(ct).max) / math.log2(math.e)
        if not lo <= s <= hi:
            raise ValueError(
                f"softmax_scale: expected a number in [{lo:.4g}, {hi:.4g}] ({np.dtype(dtype)} "
                f"inputs compute in {ct}: a normal number whose product with log2(e) is "
                f"finite), got {softmax_scale!r}")
    return s


def check_bool(name, x):
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__}")
    return bool(x)


def check_tile(name, x, allowed):
    """Explicit tile sizes must be one of the compiled set (so the compile tier covers them)."""
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected an int or None, got {type(x).__name__}")
    if int(x) not in allowed:
        raise ValueError(f"{name}: expected one of {sorted(allowed)}, got {x}")
    return int(x)


#: the bounds of a kernel's int32 / int64 integer arguments
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def bound_text(n):
    """An integer bound as a reader writes it: ``2**31 - 1``, ``2**63``, ``-2**63``, ``0``."""
    for k in (15, 16, 31, 32, 63, 64):
        for text, value in ((f"2**{k}", 2**k), (f"2**{k} - 1", 2**k - 1), (f"-2**{k}", -(2**k))):
            if n == value:
                return text
    return str(n)


def check_int(name, x, lo, hi, what=None):
    """A Python or NumPy integer (not a bool) in ``[lo, hi]``; returns it as a Python int.

    The one check for every integer scalar that reaches a kernel (``max_seqlen_q``,
    ``num_splits``, shapes): ``TypeError`` for anything that is not an integer (a float, a bool,
    a string, ``None``), ``ValueError`` for a value outside ``[lo, hi]``, which is compared as a
    Python int, so a ``numpy.uint64`` of 2**63 or a ``10**20`` is reported as passed and never
    wraps or overflows.  Both messages name the argument; ``what`` replaces the default
    description ``"an int in [lo, hi]"``.
    """
    what = what or f"an int in [{bound_text(lo)}, {bound_text(hi)}]"
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name}: expected {what}, got {type(x).__name__} {x!r}")
    v = int(x)
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected {what}, got {v}")
    return v


def check_int_array(name, x, lo, hi, dtype=np.int32):
    """Entries of a host integer array in ``[lo, hi]``; returns a new C-contiguous ``dtype`` copy.

    The one conversion for every integer array that reaches a kernel (``cu_seqlens_q/k``):
    ``TypeError`` for a non-integer dtype (float, bool), ``ValueError`` naming the first entry
    outside ``[lo, hi]`` (compared in the array's own dtype, printed as a Python int, so a uint64
    entry of 2**63 shows as passed instead of wrapping to a negative int64), before the cast
    (which then cannot wrap: ``[lo, hi]`` must lie within ``dtype``).
    """
    values = np.asarray(x)
    if values.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected an integer array (entries in [{bound_text(lo)}, "
                        f"{bound_text(hi)}]), got dtype {values.dtype}")
    info = np.iinfo(values.dtype)
    if lo > info.max or hi < info.min:  # no value of this dtype is in range
        bad = np.ones(values.shape, dtype=bool)
    else:  # each bound is compared only where the dtype holds it, so nothing overflows
        bad = np.zeros(values.shape, dtype=bool)
        if lo > info.min:
            bad |= values < lo
        if hi < info.max:
            bad |= values > hi
    if bad.any():
        i = tuple(int(j) for j in np.argwhere(bad)[0])
        where = i[0] if len(i) == 1 else list(i)
        raise ValueError(f"{name}: expected entries in [{bound_text(lo)}, {bound_text(hi)}], "
                         f"got {int(values[i])} at index {where}")
    return np.ascontiguousarray(values, dtype=dtype)


def int_values(name, values):
    """Integer array values as int64, raising ``ValueError`` with the value as passed when one
    does not fit (a uint64 2**64 - 1 would otherwise wrap to -1 and be reported as -1)."""
    values = np.asarray(values)
    if values.dtype.kind == "u" and values.dtype.itemsize == 8:
        big = np.flatnonzero(values > np.uint64(np.iinfo(np.int64).max))
        if big.size:
            i = int(big[0])
            raise ValueError(f"{name}: expected entries below 2**63, got {int(values.flat[i])} "
                             f"at index {i}")
    return values.astype(np.int64)


def check_backward_arrays(do, q, k, v, o, lse, value_dim=False, empty=False):
    """The backward's arrays: :func:`check_qkv` for ``q, k, v``; ``do`` and ``o`` of ``q``'s
    shape and dtype (``value_dim``: ``v`` may have a head dim of its own, ``d_v``, and so do
    ``do`` and ``o``); ``lse [B, H, Nq]`` in the compute dtype (float32, float64 for float64);
    all on one side (host or GPU).  ``empty``: ``B``, ``Nq``, ``Nk`` may be 0 (as
    :func:`check_qkv`'s).  Returns what :func:`check_qkv` returns."""
    checked = check_qkv(q, k, v, value_dim=value_dim, empty=empty)
    axes = BATCH_AND_SEQ if empty else ()
    b, h, nq, d = checked.b, checked.h, checked.nq, checked.d
    dtype = checked.dtype
    d_v = checked.d_v if value_dim else d
    do_shape, do_dtype = check_array("do", do, 4, ATTENTION_DTYPES, axes)
    o_shape, o_dtype = check_array("o", o, 4, ATTENTION_DTYPES, axes)
    check_same_dtype({"q": dtype, "do": do_dtype, "o": o_dtype})
    for name, shape in (("do", do_shape), ("o", o_shape)):
        if shape != (b, h, nq, d_v):
            what = "q" if d_v == d else "q with v's head dim"
            raise ValueError(f"{name}: expected the shape of {what} {(b, h, nq, d_v)}, got "
                             f"{shape}")
    from ..kernels.core.common import acc_dtype  # the compute dtype, which lse is stored in

    lse_shape, _ = check_array("lse", lse, 3, (acc_dtype(dtype),), axes)
    if lse_shape != (b, h, nq):
        raise ValueError(f"lse: expected shape {(b, h, nq)} ([B, H, Nq] of q), got {lse_shape}")
    check_same_kind({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    return checked


def check_value_shape(ks, vs, value_dim, k_name="k", v_name="v", d_v_max=256):
    """``v``'s shape against ``k``'s: equal, or (``value_dim``) equal but for the last dim, a
    value head dim ``d_v`` in 1..``d_v_max``."""
    if not value_dim:
        if ks != vs and ks[:-1] == vs[:-1]:
            raise ValueError(f"{v_name}: expected the shape of {k_name} {ks} (a value head dim "
                             f"of its own, {vs[-1]}, is taken by the attention ops and "
                             f"decode; not by this op yet), got {vs}")
        if ks != vs:
            raise ValueError(f"{v_name}: expected the shape of {k_name} {ks}, got {vs}")
        return
    if vs[:-1] != ks[:-1]:
        raise ValueError(f"{v_name}: expected shape {ks[:-1] + ('d_v',)} (the dims of {k_name} "
                         f"but the last: a value head dim of its own), got {vs}")
    if vs[-1] > d_v_max:
        raise ValueError(f"{v_name}: expected a value head dim d_v in 1..{d_v_max}, got "
                         f"{vs[-1]}")


#: forward's options only the dense kernels take (dropout, tile shapes, the user's functions),
#: with the value that means "off" (the token-sparse and the fp8 forwards take none of them)
DENSE_FORWARD_OPTIONS = {"dropout_p": 0.0, "block_m": None, "block_n": None, "score_mod": None,
                         "mask_mod": None, "block_mask": None, "aux_tensors": ()}


def _is_off(given, off):
    """``given`` is the value of :data:`DENSE_FORWARD_OPTIONS` that means off (None, a zero
    dropout, an empty list or tuple of aux tensors)."""
    if off is None:
        return given is None
    if isinstance(off, tuple):
        return given is not None and len(tuple(given)) == 0
    return given == off


def check_dense_options_off(given, context):
    """Each of :data:`DENSE_FORWARD_OPTIONS` in ``given`` (a dict of the call's values) off,
    else a ``ValueError`` naming it: ``"{name}: expected {off} with {context}, got ..."``."""
    for name, off in DENSE_FORWARD_OPTIONS.items():
        value = given.get(name, off)
        if not _is_off(value, off):
            raise ValueError(f"{name}: expected {off!r} with {context}, got {value!r}")
