"""flash-attn 2's ``flash_attn_interface`` functions on numba_flash's kernels: the same names,
arguments, defaults, layouts and return values.

Layouts (flash-attn's): dense ``q [batch_size, seqlen_q, nheads, headdim]``, ``k``, ``v``
``[batch_size, seqlen_k, nheads_k, headdim]``; packed (varlen) ``[total, nheads, headdim]`` with
``cu_seqlens`` int32 ``[batch_size + 1]``.  ``out`` has q's shape and dtype (contiguous);
``softmax_lse`` is ``[batch_size, nheads, seqlen_q]`` (dense) or ``[nheads, total_q]``
(varlen).  The rules (bottom-right causal alignment, ``window_size``, ``softcap``,
``alibi_slopes``, GQA/MQA, dropout) are flash-attn's and :func:`numba_flash.forward`'s.

Where numba_flash goes further than flash-attn: float32 and float64 as well as float16 and
bfloat16 (the kernels compute float16 and bfloat16 in float32, float64 in float64;
``softmax_lse`` is float64 for float64 inputs, float32 otherwise), any head dim 1..256 (no
padding to a multiple of 8), CPU tensors (in the Numba CUDA simulator: slow, tiny shapes). Where
it differs: a query row that sees no key has ``out = 0`` as in flash-attn and ``softmax_lse =
-inf`` (flash-attn stores +inf there); dropout masks come from numba_flash's Philox counter
layout (reproducible with ``torch.manual_seed``, not the same bits as flash-attn's); ``S_dmask``
(``return_attn_probs`` with ``dropout_p > 0``; empty otherwise, as flash-attn) is exact
``[batch_size, nheads, seqlen_q, seqlen_k]`` (varlen: ``[batch_size, nheads, max_seqlen_q,
max_seqlen_k]``) where flash-attn pads both to a multiple of 128, computed on the host in
float64 (testing only).

Not here yet: ``flash_attn_with_kvcache`` (:func:`numba_flash.decode` does its work on
NumPy/CuPy arrays), and ``block_table`` in :func:`flash_attn_varlen_func` (a
``NotImplementedError`` unless None; :func:`numba_flash.forward_varlen` takes one).
"""

from __future__ import annotations

import torch

from . import checks
from .autograd import FlashAttnFunc, FlashAttnVarlenFunc

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func"]


def _distinct(*tensors):
    """Under torch.compile, a copy of each tensor passed a second time (Dynamo cannot trace an
    autograd.Function given one tensor twice, e.g. ``cu_seqlens_q is cu_seqlens_k``); eager
    calls get the tensors as they are."""
    if not torch.compiler.is_compiling():
        return tensors
    seen, out = [], []
    for t in tensors:
        dup = t is not None and any(t is s for s in seen)
        out.append(t.clone() if dup else t)
        seen.append(t)
    return tuple(out)


def _dense(q, k, v, names, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
           deterministic, return_attn_probs):
    """Check and run dense attention; ``names`` are the user's names for q, k, v."""
    opts = checks.check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size,
                                softcap, deterministic, return_attn_probs)
    checks.check_alibi(alibi_slopes)
    checks.check_device({names[0]: q, names[1]: k, names[2]: v, "alibi_slopes": alibi_slopes})
    p, scale, causal, window, softcap, deterministic, probs = opts
    q, k, v = _distinct(q, k, v)
    return FlashAttnFunc.apply(q, k, v, p, scale, causal, window, softcap, alibi_slopes,
                               deterministic, probs, torch.is_grad_enabled())


def _check_dense(q, k, v, q_name="q", k_name="k", v_name="v"):
    qs = checks.check_tensor(q_name, q, 4, checks.DENSE)
    ks = checks.check_tensor(k_name, k, 4, checks.DENSE)
    vs = checks.check_tensor(v_name, v, 4, checks.DENSE)
    checks.check_same_dtype({q_name: q, k_name: k, v_name: v})
    checks.check_kv_shapes(qs, ks, vs, k_name, v_name, q_name=q_name)


def _varlen(q, k, v, names, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, block_table=None):
    if block_table is not None:
        raise NotImplementedError("block_table: paged K/V in flash_attn_varlen_func is not "
                                  "supported by numba_flash.torch; pass block_table=None "
                                  "(numba_flash.decode takes a block table)")
    qs = checks.check_tensor(names[0], q, 3, checks.PACKED)
    ks = checks.check_tensor(names[1], k, 3, checks.PACKED)
    vs = checks.check_tensor(names[2], v, 3, checks.PACKED)
    checks.check_same_dtype({names[0]: q, names[1]: k, names[2]: v})
    checks.check_kv_shapes(qs, ks, vs, names[1], names[2], dense=False, q_name=names[0])
    checks.check_cu_seqlens(names[3], cu_seqlens_q)
    checks.check_cu_seqlens(names[4], cu_seqlens_k)
    for name, m in ((names[5], max_seqlen_q), (names[6], max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{name}: expected an int, got {type(m).__name__}")
    opts = checks.check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size,
                                softcap, deterministic, return_attn_probs)
    checks.check_alibi(alibi_slopes)
    checks.check_device({names[0]: q, names[1]: k, names[2]: v, names[3]: cu_seqlens_q,
                         names[4]: cu_seqlens_k, "alibi_slopes": alibi_slopes})
    p, scale, causal, window, softcap, deterministic, probs = opts
    q, k, v, cu_seqlens_q, cu_seqlens_k = _distinct(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, p, scale, causal, window, softcap,
                                     alibi_slopes, deterministic, probs, torch.is_grad_enabled())


def _check_packed(name, x, ndim, axis, count, layout):
    """A packed tensor (qkv: ``count`` 3, kv: 2 along ``axis``); returns its shape."""
    shape = checks.check_tensor(name, x, ndim, layout)
    if shape[axis] != count:
        raise ValueError(f"{name}: expected {count} along dim {axis} of {layout}, got shape "
                         f"{shape}")
    return shape


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """Attention of ``qkv [batch_size, seqlen, 3, nheads, headdim]`` (q, k, v stacked on dim 2).

    Returns ``out [batch_size, seqlen, nheads, headdim]``, or ``(out, softmax_lse, S_dmask)``
    with ``return_attn_probs=True``; arguments as :func:`flash_attn_func`.  The gradient is
    ``dqkv`` of qkv's shape.
    """
    _check_packed("qkv", qkv, 5, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    _check_dense(q, k, v, "qkv", "qkv", "qkv")
    return _dense(q, k, v, ("qkv", "qkv", "qkv"), dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """Attention of ``q [batch_size, seqlen_q, nheads, headdim]`` over ``kv [batch_size,
    seqlen_k, 2, nheads_k, headdim]`` (k, v stacked on dim 2; GQA when ``nheads_k < nheads``).

    Returns as :func:`flash_attn_func`; the gradients are ``dq`` and ``dkv`` of kv's shape.
    """
    _check_packed("kv", kv, 5, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    _check_dense(q, k, v, "q", "kv", "kv")
    return _dense(q, k, v, ("q", "kv", "kv"), dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """Attention of ``q [batch_size, seqlen_q, nheads, headdim]`` over ``k``, ``v``
    ``[batch_size, seqlen_k, nheads_k, headdim]`` (GQA/MQA: ``nheads`` a multiple of
    ``nheads_k``; query head ``h`` reads kv head ``h // (nheads // nheads_k)``).

    ``dropout_p``: probability of dropping an attention probability (0.0 in evaluation; the seed
    is drawn from torch's default generator and kept for the backward).  ``softmax_scale``:
    default ``headdim ** -0.5``.  ``causal``: mask aligned to the bottom-right corner (query
    ``i`` sees key ``j <= i + seqlen_k - seqlen_q``; a row that sees no key gives 0).
    ``window_size = (left, right)``: keys ``i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k
    - seqlen_q + right`` (-1: unbounded).  ``softcap > 0``: scores ``softcap * tanh(s /
    softcap)`` (0 = off; negative is a ValueError here).  ``alibi_slopes``: float32 ``(nheads,)``
    or ``(batch_size, nheads)``, adds ``-slope * |i + seqlen_k - seqlen_q - j|`` (no gradient).
    ``deterministic``: a backward without atomics (bitwise reproducible).
    ``return_attn_probs``: also return ``softmax_lse [batch_size, nheads, seqlen_q]`` and
    ``S_dmask`` (testing only; see the module docstring).

    Returns ``out [batch_size, seqlen_q, nheads, headdim]`` in q's dtype, or ``(out,
    softmax_lse, S_dmask)``.  dtypes float16, bfloat16, float32, float64; CPU tensors
    run in the simulator, CUDA tensors on the GPU on torch's current stream.
    """
    _check_dense(q, k, v)
    return _dense(q, k, v, ("q", "k", "v"), dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """Packed-batch attention of ``qkv [total, 3, nheads, headdim]`` with ``cu_seqlens`` int32
    ``[batch_size + 1]`` and ``max_seqlen`` (at least the longest sequence).

    Returns ``out [total, nheads, headdim]``, or ``(out, softmax_lse [nheads, total],
    S_dmask)``; arguments as :func:`flash_attn_varlen_func`.
    """
    _check_packed("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    names = ("qkv", "qkv", "qkv", "cu_seqlens", "cu_seqlens", "max_seqlen", "max_seqlen")
    return _varlen(q, k, v, names, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


_VARLEN_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """Packed-batch attention of ``q [total_q, nheads, headdim]`` over ``kv [total_k, 2,
    nheads_k, headdim]``; arguments and returns as :func:`flash_attn_varlen_func`."""
    _check_packed("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    names = ("q", "kv", "kv") + _VARLEN_NAMES[3:]
    return _varlen(q, k, v, names, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over a packed batch: sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b +
    1]`` of ``q [total_q, nheads, headdim]`` against rows ``cu_seqlens_k[b]:cu_seqlens_k[b +
    1]`` of ``k``, ``v [total_k, nheads_k, headdim]``, each with its own bottom-right alignment.

    ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 ``[batch_size + 1]`` (0 first, the packed length
    last, non-decreasing) on q's device; ``max_seqlen_q`` / ``max_seqlen_k``: ints, at least the
    longest sequence.  The other arguments as :func:`flash_attn_func`; sequence ``b`` draws its
    dropout mask as batch entry ``b`` of a padded batch would.  ``block_table`` (paged K/V) is
    not supported (``NotImplementedError`` unless None).

    Returns ``out [total_q, nheads, headdim]``, or ``(out, softmax_lse [nheads, total_q],
    S_dmask)`` with ``return_attn_probs=True``.
    """
    return _varlen(q, k, v, _VARLEN_NAMES, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, block_table)
