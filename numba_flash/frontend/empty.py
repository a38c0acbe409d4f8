"""The answers to empty batches and empty key sets, made without a kernel launch.

A serving loop meets them: a batch of no sequences (``B = 0``, varlen ``total_q = 0``), query
blocks of no rows (``Nq = 0``) or sequences with no keys yet (``Nk = 0``, varlen ``total_k =
0``, an empty cache).  numba_flash answers them as the documented rule for a row that sees no
key says, which is also what :mod:`numba_flash.reference` gives:

* forward and decode: ``o = 0`` and ``lse = -inf``, or ``lse = sink_h`` with a learnable sink
  (no row at all: empty outputs of the right shapes);
* backward: ``dq``, ``dk``, ``dv`` zero (``dq`` of a row that sees no key, ``dk`` / ``dv`` of
  keys no row sees), ``dsink`` from its formula (0 for the forward's own ``o`` and ``lse``),
  the aux tensors' gradients zero.

flash-attn (2 and 3, ``flash_api.cpp``) also answers ``seqlen_k = 0`` without a launch, with
``out = 0`` but ``softmax_lse = +inf`` (so that its backward's ``exp(s - lse)`` is 0); numba_flash
keeps ``-inf`` there, as for every row that sees no key (its backward gives 0 gradients for such
rows as well).  ``H = 0`` and ``d = 0`` stay errors.

Each op checks every argument first, exactly as for a non-empty call, then calls one of these
before anything is copied to the device: the results are new arrays of the inputs' kind (NumPy,
or CuPy on the inputs' device: no host copy of a device array) and the inputs' dtypes.
"""

from __future__ import annotations

import numpy as np

from .arrays import ArrayCall
from ..kernels.core.common import acc_dtype
from .validate import array_info, array_module, is_device_array


def is_empty(*dims):
    """True when any of the sizes ``dims`` is 0 (an empty batch, query block or key set)."""
    return any(int(n) == 0 for n in dims)


def _module(call, arrays):
    """The array module of the results: the device call's (CuPy) for device inputs, NumPy
    otherwise."""
    if not call.on_device:
        return np
    xp = getattr(call, "xp", None)   # the array library the call runs its device arrays on
    return xp if xp is not None else array_module(
        next(x for x in arrays.values() if is_device_array(x)))


def _sink_rows(xp, sink, ndim, head_axis):
    """``sink [H]`` shaped to broadcast along ``head_axis`` of an ``ndim``-D ``lse``."""
    shape = [1] * ndim
    shape[head_axis] = -1
    return xp.asarray(sink).reshape(shape)


def no_key_outputs(arrays, o_shape, dtype, lse_shape, lse_dtype, sink=None, head_axis=1,
                   bad=None, return_lse=True):
    """``o = 0`` ``[o_shape]`` in ``dtype`` and ``lse`` ``[lse_shape]`` in ``lse_dtype``, filled
    with ``-inf`` or, given the checked float32 ``sink [H]``, ``sink_h`` along ``head_axis``:
    every row sees no key.  ``arrays``: the call's inputs by name (their kind and device are the
    results'; device arrays in the simulator are its usual ``TypeError``).  ``bad``: None, or
    ``bad(xp)``, a boolean ``xp`` array of ``lse``'s rank (broadcast against it) of the rows an
    unvalidated call makes NaN (both ``o`` and ``lse``).  Returns ``(o, lse)``, or ``o``
    without ``return_lse``."""
    call = ArrayCall(arrays, op="empty")   # checks the kinds, launches nothing
    xp = _module(call, arrays)
    with call.device():
        o = xp.zeros(o_shape, dtype)
        lse = xp.full(lse_shape, -np.inf, lse_dtype)
        if sink is not None and lse.size:
            lse[...] = _sink_rows(xp, sink, len(lse_shape), head_axis).astype(lse_dtype)
        if bad is not None and lse.size:
            rows = bad(xp)
            lse = xp.where(rows, xp.asarray(np.nan, lse_dtype), lse).astype(lse_dtype)
            o = xp.where(rows[..., None], xp.asarray(np.nan, o.dtype), o).astype(o.dtype)
    return (o, lse) if return_lse else o


def into_outs(o, lse, out, lse_out, return_lse):
    """An empty call's answer ``(o, lse)`` as the op returns it: written into the caller's
    ``out`` / ``lse_out`` when given (and those returned), ``lse`` only with ``return_lse``."""
    if out is not None:
        out[...] = o
        o = out
    if lse_out is not None:
        lse_out[...] = lse
        lse = lse_out
    return (o, lse) if return_lse else o


def zero_gradients(arrays, like):
    """Zero gradients of the arrays ``like`` (a sequence of ``(shape, dtype)``), of the kind of
    the call's inputs ``arrays`` (by name): what a backward over no row or no key gives."""
    call = ArrayCall(arrays, op="empty")
    xp = _module(call, arrays)
    with call.device():
        return tuple(xp.zeros(shape, dtype) for shape, dtype in like)


def no_key_gradients(do, q, k, v, o, lse, sink, aux, dtype):
    """The gradients of a backward over no row or no key (every argument checked): ``dq``,
    ``dk``, ``dv`` zero in the inputs' shapes, dtypes and kind, ``dsink`` (with the checked
    ``sink``) from its formula, :func:`~numba_flash.frontend.backward_launch.sink_gradient` (0
    for the forward's ``o`` and ``lse``), and with ``aux`` (a prepared ``aux_grad``) its zero
    gradients.  :func:`numba_flash.backward` and :func:`numba_flash.backward_varlen` (packed
    arrays) share it."""
    from .backward_launch import sink_gradient

    arrays = {"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse}
    grads = zero_gradients(arrays, [array_info(n, arrays[n]) for n in ("q", "k", "v")])
    if sink is not None:
        grads += (sink_gradient(do, o, lse, sink),)
    if aux is not None:
        grads += aux_zero_gradients(arrays, aux.variant.aux, dtype)
    return grads


def aux_zero_gradients(arrays, aux, dtype):
    """The aux tensors' gradients of a backward over nothing: zeros of each aux tensor's shape,
    in its dtype when it is a float one, else the compute type of ``dtype`` (as
    :func:`numba_flash.frontend.aux_grad.aux_gradients` returns them)."""
    acc_t = acc_dtype(dtype)
    like = []
    for a in aux:
        dt = np.dtype(a.dtype)
        like.append((tuple(a.shape), dt if dt.kind == "f" else acc_t))
    return zero_gradients(arrays, like)
