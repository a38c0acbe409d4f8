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
padding to a multiple of 8), CPU tensors (in the Numba CUDA simulator: slow, tiny shapes),
and FlashAttention-3's fp8 forward (``torch.float8_e4m3fn`` ``q``, ``k``, ``v`` with
``q_descale``, ``k_descale``, ``v_descale``; ``out`` bfloat16; :mod:`numba_flash.torch.fp8`)
in :func:`flash_attn_func`, its packed forms and :func:`flash_attn_varlen_func`. Where
it differs: a query row that sees no key has ``out = 0`` as in flash-attn and ``softmax_lse =
-inf`` (flash-attn stores +inf there), an empty batch or key set (``batch_size``, ``seqlen_q``
or ``seqlen_k`` 0; varlen ``total_q`` or ``total_k`` 0) included, answered without a launch
with zero gradients; dropout masks come from numba_flash's Philox counter
layout (reproducible with ``torch.manual_seed``, not the same bits as flash-attn's); ``S_dmask``
(``return_attn_probs`` with ``dropout_p > 0``; empty otherwise, as flash-attn) is exact
``[batch_size, nheads, seqlen_q, seqlen_k]`` (varlen: ``[batch_size, nheads, max_seqlen_q,
max_seqlen_k]``) where flash-attn pads both to a multiple of 128, computed on the host in
float64 (testing only).

``flash_attn_with_kvcache`` and ``flash_attn_varlen_func(..., block_table=...)`` are in
:mod:`numba_flash.torch.kvcache`; FlashAttention-4's variant arguments (``score_mod``,
``score_mod_bwd``, ``mask_mod``, ``aux_tensors``, ``block_sparse_tensors``) in
:mod:`numba_flash.torch.variants`.
"""

from __future__ import annotations

import torch

from . import checks
from .autograd import FlashAttnFunc, FlashAttnVarlenFunc
from .fp8 import DTYPES as fp8_DTYPES, check_format, fp8_call, fp8_dense, fp8_varlen

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
           deterministic, return_attn_probs, learnable_sink=None, gather_kv_indices=None):
    """Check and run dense attention; ``names`` are the user's names for q, k, v."""
    opts = checks.check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size,
                                softcap, deterministic, return_attn_probs)
    checks.check_alibi(alibi_slopes)
    checks.check_sink(learnable_sink, q.shape[2])
    checks.check_device({names[0]: q, names[1]: k, names[2]: v, "alibi_slopes": alibi_slopes,
                         "learnable_sink": learnable_sink, "gather_kv_indices": gather_kv_indices})
    q, k, v = _distinct(q, k, v)
    return FlashAttnFunc.apply(q, k, v, opts.dropout_p, opts.softmax_scale, opts.causal,
                               opts.window_size, opts.softcap, alibi_slopes, opts.deterministic,
                               opts.return_attn_probs, torch.is_grad_enabled(), learnable_sink,
                               gather_kv_indices)


def _check_dense(q, k, v, q_name="q", k_name="k", v_name="v"):
    qs = checks.check_tensor(q_name, q, 4, checks.DENSE, empty_axes=checks.DENSE_EMPTY)
    ks = checks.check_tensor(k_name, k, 4, checks.DENSE, empty_axes=checks.DENSE_EMPTY)
    vs = checks.check_tensor(v_name, v, 4, checks.DENSE, empty_axes=checks.DENSE_EMPTY)
    checks.check_same_dtype({q_name: q, k_name: k, v_name: v})
    checks.check_kv_shapes(qs, ks, vs, k_name, v_name, q_name=q_name)


def _check_varlen(q, k, v, names, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The packed tensors, ``cu_seqlens`` and ``max_seqlen`` of a varlen call."""
    qs = checks.check_tensor(names[0], q, 3, checks.PACKED, empty_axes=checks.PACKED_EMPTY)
    ks = checks.check_tensor(names[1], k, 3, checks.PACKED, empty_axes=checks.PACKED_EMPTY)
    vs = checks.check_tensor(names[2], v, 3, checks.PACKED, empty_axes=checks.PACKED_EMPTY)
    checks.check_same_dtype({names[0]: q, names[1]: k, names[2]: v})
    checks.check_kv_shapes(qs, ks, vs, names[1], names[2], dense=False, q_name=names[0])
    checks.check_cu_seqlens(names[3], cu_seqlens_q)
    checks.check_cu_seqlens(names[4], cu_seqlens_k)
    for name, m in ((names[5], max_seqlen_q), (names[6], max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{name}: expected an int, got {type(m).__name__}")


def _varlen(q, k, v, names, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs, learnable_sink=None, gather_kv_indices=None):
    _check_varlen(q, k, v, names, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    opts = checks.check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size,
                                softcap, deterministic, return_attn_probs)
    checks.check_alibi(alibi_slopes)
    checks.check_sink(learnable_sink, q.shape[1])
    checks.check_device({names[0]: q, names[1]: k, names[2]: v, names[3]: cu_seqlens_q,
                         names[4]: cu_seqlens_k, "alibi_slopes": alibi_slopes,
                         "learnable_sink": learnable_sink, "gather_kv_indices": gather_kv_indices})
    # q, k, v, cu_seqlens_q, cu_seqlens_k: the first five arguments of the apply
    tensors = _distinct(q, k, v, cu_seqlens_q, cu_seqlens_k)
    return FlashAttnVarlenFunc.apply(*tensors, max_seqlen_q, max_seqlen_k, opts.dropout_p,
                                     opts.softmax_scale, opts.causal, opts.window_size,
                                     opts.softcap, alibi_slopes, opts.deterministic,
                                     opts.return_attn_probs, torch.is_grad_enabled(),
                                     learnable_sink, gather_kv_indices)


def _has_variant(*args):
    """True when any of FlashAttention-4's variant arguments (or ours) is given."""
    return any([a is not None for a in args])


def _variant(layout, q, k, v, names, cu_seqlens, max_seqlens, dropout_p, softmax_scale, causal,
             window_size, softcap, alibi_slopes, deterministic, return_attn_probs, score_mod,
             score_mod_bwd, mask_mod, aux_tensors, block_sparse_tensors, score_mod_grad,
             aux_grad, learnable_sink=None):
    """Attention with a user's variant (:mod:`numba_flash.torch.variants`), FlashAttention-4's
    arguments: ``score_mod(score, b, h, q_idx, kv_idx, *aux_tensors)``, its backward either as
    FlashAttention-4's ``score_mod_bwd(grad, score, b, h, q_idx, kv_idx, *aux_tensors)`` (the
    gradient w.r.t. the score) or as our ``score_mod_grad(score, b, h, q_idx, kv_idx,
    *aux_tensors)`` (``d score_mod / d score``), ``mask_mod(b, h, q_idx, kv_idx,
    *aux_tensors)`` and-ed with ``causal`` / ``window_size`` (FlashAttention-4 drops those with
    a ``mask_mod``), ``block_sparse_tensors`` a :class:`numba_flash.flex.BlockMask`
    (:func:`numba_flash.torch.create_block_mask`), and ``aux_grad`` for aux tensors that require
    grad.  ``return_attn_probs``: ``S_dmask`` is empty (not taken with dropout)."""
    from .variants import VariantSpec, check_variant, from_score_mod_bwd, run_variant

    opts = checks.check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size,
                                softcap, deterministic, return_attn_probs)
    checks.check_alibi(alibi_slopes)
    checks.check_sink(learnable_sink, q.shape[-2])
    named = {names[0]: q, names[1]: k, names[2]: v, "alibi_slopes": alibi_slopes,
             "learnable_sink": learnable_sink}
    named.update(zip(names[3:5], cu_seqlens))
    checks.check_device(named)
    p, probs = opts.dropout_p, opts.return_attn_probs
    if score_mod_bwd is not None and score_mod_grad is not None:
        raise ValueError("score_mod_grad: expected None with score_mod_bwd (FlashAttention-4's "
                         "form of the same derivative), got both")
    if probs and p > 0.0:
        raise ValueError("return_attn_probs: S_dmask with dropout is not taken with a user's "
                         "variant; pass dropout_p=0 or return_attn_probs=False")
    n_aux = len(aux_tensors) if isinstance(aux_tensors, (tuple, list)) else 0
    score_mod_grad = score_mod_grad or from_score_mod_bwd(score_mod_bwd, n_aux, q.dtype)
    aux = check_variant(q, k, v, names, aux_tensors, block_sparse_tensors, score_mod,
                        score_mod_grad, aux_grad, p)
    spec = VariantSpec(layout=layout, scale=opts.softmax_scale, causal=opts.causal,
                       window=opts.window_size, softcap=opts.softcap, alibi=alibi_slopes,
                       dropout_p=p, deterministic=opts.deterministic, score_mod=score_mod,
                       mask_mod=mask_mod, block_mask=block_sparse_tensors,
                       score_mod_grad=score_mod_grad, aux_grad=aux_grad,
                       cu_seqlens=tuple(cu_seqlens), max_seqlens=tuple(max_seqlens))
    out, lse = run_variant(spec, q, k, v, aux, learnable_sink)
    return (out, lse, q.new_empty((0,))) if probs else out


def _check_packed(name, x, ndim, axis, count, layout, dtypes=checks.DTYPES):
    """A packed tensor (qkv: ``count`` 3, kv: 2 along ``axis``); returns its shape.  The axes
    before ``axis`` (``batch_size``, ``seqlen``; varlen ``total``) may be 0, an empty batch."""
    empty = tuple(range(axis)) if dtypes is checks.DTYPES else ()   # (e4m3: not yet)
    shape = checks.check_tensor(name, x, ndim, layout, dtypes, empty)
    if shape[axis] != count:
        raise ValueError(f"{name}: expected {count} along dim {axis} of {layout}, got shape "
                         f"{shape}")
    return shape


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False, *,
                              learnable_sink=None, q_descale=None, k_descale=None,
                              v_descale=None):
    """Attention of ``qkv [batch_size, seqlen, 3, nheads, headdim]`` (q, k, v stacked on dim 2).

    Returns ``out [batch_size, seqlen, nheads, headdim]``, or ``(out, softmax_lse, S_dmask)``
    with ``return_attn_probs=True``; arguments as :func:`flash_attn_func` (``learnable_sink``
    and FA3's fp8: a ``torch.float8_e4m3fn`` qkv with ``q_descale``, ``k_descale``,
    ``v_descale``, forward only, ``out`` bfloat16).  The gradient is ``dqkv`` of qkv's shape.
    """
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if fp8_call((qkv,), descales):
        check_format("qkv", qkv)
        _check_packed("qkv", qkv, 5, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)",
                      fp8_DTYPES)
        q, k, v = qkv.unbind(2)
        return fp8_dense(q, k, v, ("qkv", "qkv", "qkv"), descales, dropout_p, softmax_scale,
                         causal, window_size, softcap, alibi_slopes, deterministic,
                         return_attn_probs, learnable_sink)
    _check_packed("qkv", qkv, 5, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(2)
    _check_dense(q, k, v, "qkv", "qkv", "qkv")
    return _dense(q, k, v, ("qkv", "qkv", "qkv"), dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False, *,
                             learnable_sink=None, q_descale=None, k_descale=None,
                             v_descale=None):
    """Attention of ``q [batch_size, seqlen_q, nheads, headdim]`` over ``kv [batch_size,
    seqlen_k, 2, nheads_k, headdim]`` (k, v stacked on dim 2; GQA when ``nheads_k < nheads``).

    Returns as :func:`flash_attn_func` (``learnable_sink`` and FA3's fp8 too: ``q``, ``kv``
    ``torch.float8_e4m3fn`` with ``q_descale``, ``k_descale``, ``v_descale``); the gradients
    are ``dq`` and ``dkv`` of kv's shape (none for fp8).
    """
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if fp8_call((q, kv), descales):
        check_format("kv", kv)
        _check_packed("kv", kv, 5, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)",
                      fp8_DTYPES)
        k, v = kv.unbind(2)
        return fp8_dense(q, k, v, ("q", "kv", "kv"), descales, dropout_p, softmax_scale,
                         causal, window_size, softcap, alibi_slopes, deterministic,
                         return_attn_probs, learnable_sink)
    _check_packed("kv", kv, 5, 2, 2, "(batch_size, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(2)
    _check_dense(q, k, v, "q", "kv", "kv")
    return _dense(q, k, v, ("q", "kv", "kv"), dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, score_mod=None, score_mod_bwd=None,
                    mask_mod=None, aux_tensors=None, block_sparse_tensors=None,
                    score_mod_grad=None, aux_grad=None, learnable_sink=None,
                    gather_kv_indices=None, q_descale=None, k_descale=None, v_descale=None):
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
    softmax_lse, S_dmask)``.  ``batch_size``, ``seqlen_q`` or ``seqlen_k`` 0: no launch, ``out =
    0``, ``softmax_lse = -inf`` (the sink's logit with ``learnable_sink``; flash-attn: +inf),
    zero gradients (not with fp8 inputs yet).  dtypes float16, bfloat16, float32, float64, and
    float8_e4m3fn (FA3's fp8, below); CPU tensors run in the simulator, CUDA tensors on the
    GPU on torch's current stream.

    FlashAttention-3's fp8 (keyword only; :mod:`numba_flash.torch.fp8`): ``q``, ``k``, ``v``
    ``torch.float8_e4m3fn`` (headdim a multiple of 32 up to 256) with ``q_descale``,
    ``k_descale``, ``v_descale`` float32 ``(batch_size, nheads_k)`` (None: 1): scores ``(q k^T)
    * q_descale * k_descale * softmax_scale``, ``out = (P v) * v_descale``; ``out`` bfloat16
    (FA3's), ``softmax_lse`` float32.  Causal, window, softcap, ALiBi, GQA and
    ``learnable_sink`` as above; not dropout, the variant arguments or ``gather_kv_indices``.
    Forward only, as FA3: a backward through an fp8 call raises ``NotImplementedError``.  CPU
    tensors only so far.  A descale with 16-bit inputs is the NumPy front end's ``ValueError``.

    FlashAttention-4's variant arguments (keyword only; :func:`_variant`): ``score_mod``,
    ``score_mod_bwd``, ``mask_mod``, ``aux_tensors``, ``block_sparse_tensors``, and ours,
    ``score_mod_grad`` and ``aux_grad``.  FlashAttention-4's ``learnable_sink``: float32
    ``(nheads,)`` attention-sink logits (gpt-oss; :func:`numba_flash.forward`), with a gradient
    when it requires grad (``softmax_lse`` then includes the sink).

    FlashAttention-4's ``gather_kv_indices``: integer ``(batch_size, seqlen_q, topk)``, query
    ``i`` sees only the keys its row lists (-1: none; token-sparse attention,
    :func:`numba_flash.forward`'s ``kv_indices`` shared by every head), with autograd (the
    backward reads the listed keys only; ``deterministic``: the dense kernels masked by the
    lists); not with dropout or the variant arguments.
    """
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if fp8_call((q, k, v), descales):
        return fp8_dense(q, k, v, ("q", "k", "v"), descales, dropout_p, softmax_scale, causal,
                         window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                         learnable_sink, gather_kv_indices,
                         dict(score_mod=score_mod, score_mod_bwd=score_mod_bwd,
                              mask_mod=mask_mod, aux_tensors=aux_tensors,
                              block_sparse_tensors=block_sparse_tensors,
                              score_mod_grad=score_mod_grad, aux_grad=aux_grad))
    _check_dense(q, k, v)
    if gather_kv_indices is not None:
        checks.check_gather_indices(gather_kv_indices, q.shape[0], q.shape[1], dropout_p,
                                    _has_variant(score_mod, score_mod_bwd, mask_mod, aux_tensors,
                                                 block_sparse_tensors, score_mod_grad,
                                                 aux_grad))
    if _has_variant(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_sparse_tensors,
                    score_mod_grad, aux_grad):
        return _variant("bnhd", q, k, v, ("q", "k", "v"), (), (), dropout_p, softmax_scale,
                        causal, window_size, softcap, alibi_slopes, deterministic,
                        return_attn_probs, score_mod, score_mod_bwd, mask_mod, aux_tensors,
                        block_sparse_tensors, score_mod_grad, aux_grad, learnable_sink)
    return _dense(q, k, v, ("q", "k", "v"), dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs, learnable_sink,
                  gather_kv_indices)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False, *, learnable_sink=None):
    """Packed-batch attention of ``qkv [total, 3, nheads, headdim]`` with ``cu_seqlens`` int32
    ``[batch_size + 1]`` and ``max_seqlen`` (at least the longest sequence).

    Returns ``out [total, nheads, headdim]``, or ``(out, softmax_lse [nheads, total],
    S_dmask)``; arguments as :func:`flash_attn_varlen_func` (``learnable_sink`` too).
    """
    _check_packed("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(1)
    names = ("qkv", "qkv", "qkv", "cu_seqlens", "cu_seqlens", "max_seqlen", "max_seqlen")
    return _varlen(q, k, v, names, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, learnable_sink)


_VARLEN_NAMES = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False, *, learnable_sink=None):
    """Packed-batch attention of ``q [total_q, nheads, headdim]`` over ``kv [total_k, 2,
    nheads_k, headdim]``; arguments (``learnable_sink`` too) and returns as
    :func:`flash_attn_varlen_func`."""
    _check_packed("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(1)
    names = ("q", "kv", "kv") + _VARLEN_NAMES[3:]
    return _varlen(q, k, v, names, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   deterministic, return_attn_probs, learnable_sink)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *,
                           score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                           block_sparse_tensors=None, score_mod_grad=None, aux_grad=None,
                           learnable_sink=None, gather_kv_indices=None, q_descale=None,
                           k_descale=None, v_descale=None):
    """Attention over a packed batch: sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b +
    1]`` of ``q [total_q, nheads, headdim]`` against rows ``cu_seqlens_k[b]:cu_seqlens_k[b +
    1]`` of ``k``, ``v [total_k, nheads_k, headdim]``, each with its own bottom-right alignment.

    ``cu_seqlens_q`` / ``cu_seqlens_k``: int32 ``[batch_size + 1]`` (0 first, the packed length
    last, non-decreasing) on q's device; ``max_seqlen_q`` / ``max_seqlen_k``: ints, at least the
    longest sequence.  The other arguments as :func:`flash_attn_func`; sequence ``b`` draws its
    dropout mask as batch entry ``b`` of a padded batch would.

    ``block_table`` (paged K/V, int32 ``[batch_size, max_num_blocks_per_seq]``): ``k``, ``v``
    are caches ``[num_blocks, page_block_size, nheads_k, headdim]`` and sequence ``b`` reads
    keys ``0 .. cu_seqlens_k[b + 1] - cu_seqlens_k[b] - 1`` of its table row, as flash-attn
    (:func:`numba_flash.torch.kvcache.paged_varlen`); forward only (a backward raises).

    FlashAttention-4's variant arguments and ``learnable_sink`` as :func:`flash_attn_func`
    (``b`` the sequence, positions within it; not with ``block_table``).

    FlashAttention-4's ``gather_kv_indices``: integer ``(total_q, topk)``, packed row ``r``'s
    keys as positions within its sequence (-1: none), with autograd, as :func:`flash_attn_func`'s
    (not with ``block_table``, dropout or the variant arguments).

    FlashAttention-3's fp8 as :func:`flash_attn_func`'s: ``q``, ``k``, ``v``
    ``torch.float8_e4m3fn`` with ``q_descale``, ``k_descale``, ``v_descale`` float32
    ``(batch_size, nheads_k)`` (a row per sequence); ``out`` bfloat16, forward only, not with
    ``block_table`` (an fp8 paged cache: :func:`numba_flash.torch.flash_attn_with_kvcache`) or
    ``gather_kv_indices``.

    Returns ``out [total_q, nheads, headdim]``, or ``(out, softmax_lse [nheads, total_q],
    S_dmask)`` with ``return_attn_probs=True``.  ``total_q`` or ``total_k`` 0 (every sequence
    empty on that side): no launch, ``out = 0``, ``softmax_lse = -inf`` (or the sink's logit),
    zero gradients.
    """
    descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    if fp8_call((q, k, v), descales):
        return fp8_varlen(q, k, v, _VARLEN_NAMES, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, descales, dropout_p, softmax_scale, causal, window_size,
                          softcap, alibi_slopes, deterministic, return_attn_probs,
                          learnable_sink, gather_kv_indices,
                          dict(score_mod=score_mod, score_mod_bwd=score_mod_bwd,
                               mask_mod=mask_mod, aux_tensors=aux_tensors,
                               block_sparse_tensors=block_sparse_tensors,
                               score_mod_grad=score_mod_grad, aux_grad=aux_grad), block_table)
    variant = _has_variant(score_mod, score_mod_bwd, mask_mod, aux_tensors, block_sparse_tensors,
                           score_mod_grad, aux_grad)
    if gather_kv_indices is not None:
        checks.check_gather_indices(gather_kv_indices, q.shape[0], None, dropout_p,
                                    variant or block_table is not None)
    if block_table is not None:
        if learnable_sink is not None:
            raise ValueError("learnable_sink: expected None with block_table (the paged varlen "
                             "path here is forward-only flash-attn 2; use "
                             "flash_attn_with_kvcache(..., learnable_sink=...)), got a tensor")
        if variant:
            raise ValueError("block_table: a user's variant (score_mod, mask_mod, aux_tensors, "
                             "block_sparse_tensors) is not taken with a paged K/V cache here; "
                             "pass block_table=None")
        from .kvcache import paged_varlen

        return paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, softmax_scale, causal, window_size, softcap,
                            alibi_slopes, return_attn_probs, block_table)
    if variant:
        _check_varlen(q, k, v, _VARLEN_NAMES, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                      max_seqlen_k)
        return _variant("varlen", q, k, v, _VARLEN_NAMES, (cu_seqlens_q, cu_seqlens_k),
                        (max_seqlen_q, max_seqlen_k), dropout_p, softmax_scale, causal,
                        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
                        score_mod, score_mod_bwd, mask_mod, aux_tensors, block_sparse_tensors,
                        score_mod_grad, aux_grad, learnable_sink)
    return _varlen(q, k, v, _VARLEN_NAMES, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, learnable_sink,
                   gather_kv_indices)
