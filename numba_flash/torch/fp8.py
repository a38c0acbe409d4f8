"""FlashAttention-3's fp8 forward for torch tensors: ``torch.float8_e4m3fn`` ``q``, ``k``, ``v``
in :func:`numba_flash.torch.flash_attn_func` (and its packed forms ``flash_attn_qkvpacked_func``,
``flash_attn_kvpacked_func``) and :func:`numba_flash.torch.flash_attn_varlen_func`, with FA3's
keywords ``q_descale``, ``k_descale``, ``v_descale``.

The stored values times their descales are the real ones (FA3's meaning): the scores are ``(q8
k8^T) * q_descale * k_descale * softmax_scale`` and ``out = (P v8) * v_descale``, each descale
float32 ``(batch_size, nheads_k)`` (one factor per sequence and kv head; None: 1).  ``out`` is
bfloat16 (FA3's output type for fp8 inputs), ``softmax_lse`` float32.  The call is
:func:`numba_flash.forward` / :func:`numba_flash.forward_varlen` on the tensors' bytes (uint8
NumPy or CuPy views, ``t.view(torch.uint8)``: no copy, nothing written) with
``qkv_dtype="fp8_e4m3"``, one route for CPU and CUDA tensors (the CUDA one has not run on a
GPU), so the head dim (a multiple of 32 up to 256), the descales' dtype and shape and the
options the fp8 kernels refuse (``dropout_p > 0``) are the front end's checks and messages
(docs/fp8.md).  Causal, ``window_size``, ``softcap``, ``alibi_slopes``, GQA/MQA and
``learnable_sink`` work as with 16-bit inputs.

Forward only, as FA3's fp8 path: the call runs when inputs require grad (in grad mode too), and
a backward through its output raises ``NotImplementedError``.  Not taken here, each a
``TypeError`` / ``ValueError`` naming the argument before anything runs: ``float8_e5m2`` (and
the other fp8 formats), a mix of fp8 and another dtype, FlashAttention-4's variant arguments,
``gather_kv_indices`` and ``block_table`` (the NumPy front end takes the first and the last on
e4m3; this path does not pass them yet).
Descales with 16-bit inputs reach the NumPy front end, whose ``ValueError`` ("q_descale:
expected None without e4m3 inputs") the caller gets unchanged.  Eager mode: this path has no
``torch.library`` custom op, and ``torch.compile`` over it is untested.
"""

from __future__ import annotations

import torch

import numba_flash

from . import bridge, checks

__all__ = ["check_format", "fp8_call", "fp8_dense", "fp8_varlen"]

#: torch's e4m3 (FA3's fp8 input type), None on a torch without it
E4M3 = bridge.E4M3_TORCH
#: torch's fp8 formats; only e4m3 is built, the others are refused by name
FP8_DTYPES = tuple(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")) if d is not None)
#: the dtypes ``q``, ``k``, ``v`` may have on the fp8 path (16-bit ones reach the front end's
#: refusal of their descales)
DTYPES = checks.DTYPES + ((E4M3,) if E4M3 is not None else ())

_DESCALE = "(batch_size, nheads_k)"
_VARIANT_NAMES = ("score_mod", "score_mod_bwd", "mask_mod", "aux_tensors",
                  "block_sparse_tensors", "score_mod_grad", "aux_grad")


def _name(dtype):
    return str(dtype).replace("torch.", "")


def fp8_call(tensors, descales):
    """True when a call takes the fp8 path: a ``q``, ``k`` or ``v`` of an fp8 dtype (e4m3, or
    another to be refused by name) or a descale given."""
    return (any([isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES for t in tensors])
            or any([d is not None for d in descales.values()]))


def check_format(name, x):
    """An fp8 tensor of a format other than e4m3 (``float8_e5m2``, ...): a ``TypeError``
    naming ``name``."""
    if isinstance(x, torch.Tensor) and x.dtype in FP8_DTYPES and x.dtype != E4M3:
        raise TypeError(f"{name}: expected dtype float8_e4m3fn for fp8 inputs (FA3's; "
                        f"{_name(x.dtype)} is not built), got {_name(x.dtype)}")


def _check_inputs(names, tensors, ndim, layout):
    """``q``, ``k``, ``v`` (``names`` the user's, a packed tensor's name repeated): dense torch
    tensors of rank ``ndim``, e4m3 or (descales with 16-bit inputs: the front end refuses
    those) a 16/32/64-bit float, one dtype for all three.  Returns their shapes."""
    for name, x in zip(names, tensors):
        check_format(name, x)
    shapes = [checks.check_tensor(name, x, ndim, layout, DTYPES)
              for name, x in zip(names, tensors)]
    checks.check_same_dtype(dict(zip(names, tensors)))
    return shapes


def _check_descales(descales):
    """Each descale None or a dense torch tensor; its dtype (float32) and shape
    ``(batch_size, nheads_k)`` are the front end's checks."""
    for name, x in descales.items():
        if x is None:
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected None or a float32 torch.Tensor {_DESCALE}, got "
                            f"{type(x).__module__}.{type(x).__qualname__}")
        checks.check_dense(name, x)


def _refuse(q, variant, gather_kv_indices):
    """FlashAttention-4's variant arguments (``{name: value}``) and ``gather_kv_indices`` are
    not taken with e4m3 inputs: a ``ValueError`` naming the first one given.  (With 16-bit
    inputs and a descale the front end's refusal of the descale comes instead.)"""
    if q.dtype != E4M3:
        return
    given = [n for n, x in variant.items() if x is not None]
    if gather_kv_indices is not None:
        given.append("gather_kv_indices")
    if given:
        raise ValueError(f"{given[0]}: expected None with float8_e4m3fn inputs (the torch fp8 "
                         f"path passes no user variant or token-sparse lists yet), got "
                         f"{type(variant.get(given[0], gather_kv_indices)).__name__}")


def _inputs(tensors, heads_first):
    """``(arrays, qkv_dtype)`` for the front end: e4m3 tensors as their bytes
    (:func:`~numba_flash.torch.bridge.fp8_bytes`, CPU or CUDA) with ``"fp8_e4m3"``; 16-bit
    ones (descales given: the front end refuses those) as they are, ``"auto"``."""
    fp8 = tensors[0].dtype == E4M3
    arrays = [bridge.fp8_bytes(x) if fp8 else bridge.as_array(x) for x in tensors]
    if heads_first:
        arrays = [a.transpose(0, 2, 1, 3) for a in arrays]
    return arrays, "fp8_e4m3" if fp8 else "auto"


class Fp8ForwardFunc(torch.autograd.Function):
    """``(out, lse)`` of an fp8 call (``run()``), with a backward that raises (FA3's fp8 path
    is forward only).  ``q``, ``k``, ``v``, ``learnable_sink`` and the descales are its inputs
    so that a loss reaching ``out`` of inputs that require grad gets the error."""

    @staticmethod
    def forward(ctx, run, *inputs):
        out, lse = run()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("numba_flash.torch: there is no gradient through fp8 "
                                  "(float8_e4m3fn) attention; FA3's fp8 path is forward only. "
                                  "Pass float16 / bfloat16 tensors for training, or run the fp8 "
                                  "call under torch.no_grad()")


def _finish(run, inputs, return_attn_probs):
    """Run through :class:`Fp8ForwardFunc`; flash-attn's returns (``S_dmask`` empty: no
    dropout)."""
    out, lse = Fp8ForwardFunc.apply(run, *inputs)
    return (out, lse, out.new_empty((0,))) if return_attn_probs else out


def fp8_dense(q, k, v, names, descales, dropout_p, softmax_scale, causal, window_size, softcap,
              alibi_slopes, deterministic, return_attn_probs, learnable_sink=None,
              gather_kv_indices=None, variant=None):
    """:func:`numba_flash.torch.flash_attn_func` on the fp8 path (the module docstring):
    ``q [batch_size, seqlen_q, nheads, headdim]``, ``k``, ``v [batch_size, seqlen_k, nheads_k,
    headdim]`` e4m3, ``descales`` ``{"q_descale": ..., "k_descale": ..., "v_descale": ...}``;
    ``names`` the user's names for q, k, v.  ``deterministic`` is accepted (there is no
    backward to make deterministic)."""
    qs, ks, vs = _check_inputs(names, (q, k, v), 4, checks.DENSE)
    checks.check_kv_shapes(qs, ks, vs, names[1], names[2], q_name=names[0])
    _refuse(q, variant or {}, gather_kv_indices)
    _check_descales(descales)
    opts = checks.check_options(qs[3], dropout_p, softmax_scale, causal, window_size, softcap,
                                deterministic, return_attn_probs)
    checks.check_alibi(alibi_slopes)
    checks.check_sink(learnable_sink, qs[2])
    device = checks.check_device({names[0]: q, names[1]: k, names[2]: v, **descales,
                                  "alibi_slopes": alibi_slopes,
                                  "learnable_sink": learnable_sink})

    def run():
        # [B, N, H, d] memory where it lies (the e4m3 mma.sync forward reads strides), and out
        # (bfloat16, FA3's) written in place through its strides
        arrays, qkv_dtype = _inputs((q, k, v), heads_first=True)
        res = bridge.SeqFirstOut(q.shape, torch.bfloat16, device, strided=True)
        with bridge.on_device(device):
            _o, lse = numba_flash.forward(
                *arrays, qkv_dtype=qkv_dtype, causal=opts.causal,
                softmax_scale=opts.softmax_scale, return_lse=True, dropout_p=opts.dropout_p,
                window_size=opts.window_size, softcap=opts.softcap,
                alibi_slopes=bridge.optional_array(alibi_slopes),
                learnable_sink=bridge.optional_array(learnable_sink), out=res.array,
                **{n: bridge.optional_array(x) for n, x in descales.items()})
            return res.result(), bridge.to_tensor(lse, device)

    return _finish(run, (q, k, v, learnable_sink, *descales.values()), opts.return_attn_probs)


def fp8_varlen(q, k, v, names, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
               descales, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
               deterministic, return_attn_probs, learnable_sink=None, gather_kv_indices=None,
               variant=None, block_table=None):
    """:func:`numba_flash.torch.flash_attn_varlen_func` on the fp8 path: packed e4m3 ``q
    [total_q, nheads, headdim]``, ``k``, ``v [total_k, nheads_k, headdim]``, the descales
    ``(batch_size, nheads_k)`` with a row per sequence; ``out [total_q, nheads, headdim]``
    bfloat16, ``softmax_lse [nheads, total_q]``.  Not with ``block_table`` here (the NumPy
    ``forward_varlen`` takes an e4m3 paged cache in its own layout; a torch one:
    :func:`numba_flash.torch.flash_attn_with_kvcache`)."""
    if block_table is not None:
        raise ValueError("block_table: expected None with fp8 inputs (the torch fp8 varlen path "
                         "reads packed k, v; an fp8 paged cache: flash_attn_with_kvcache), got "
                         f"{type(block_table).__name__}")
    qs, ks, vs = _check_inputs(names[:3], (q, k, v), 3, checks.PACKED)
    checks.check_kv_shapes(qs, ks, vs, names[1], names[2], dense=False, q_name=names[0])
    _refuse(q, variant or {}, gather_kv_indices)
    checks.check_cu_seqlens(names[3], cu_seqlens_q)
    checks.check_cu_seqlens(names[4], cu_seqlens_k)
    for name, m in ((names[5], max_seqlen_q), (names[6], max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{name}: expected an int, got {type(m).__name__}")
    _check_descales(descales)
    opts = checks.check_options(qs[2], dropout_p, softmax_scale, causal, window_size, softcap,
                                deterministic, return_attn_probs)
    checks.check_alibi(alibi_slopes)
    checks.check_sink(learnable_sink, qs[1])
    device = checks.check_device({names[0]: q, names[1]: k, names[2]: v,
                                  names[3]: cu_seqlens_q, names[4]: cu_seqlens_k, **descales,
                                  "alibi_slopes": alibi_slopes,
                                  "learnable_sink": learnable_sink})

    def run():
        arrays, qkv_dtype = _inputs((q, k, v), heads_first=False)
        with bridge.on_device(device):
            o, lse = numba_flash.forward_varlen(
                *arrays, bridge.as_array(cu_seqlens_q), bridge.as_array(cu_seqlens_k),
                qkv_dtype=qkv_dtype,
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=opts.causal,
                softmax_scale=opts.softmax_scale, return_lse=True, dropout_p=opts.dropout_p,
                window_size=opts.window_size, softcap=opts.softcap,
                alibi_slopes=bridge.optional_array(alibi_slopes),
                learnable_sink=bridge.optional_array(learnable_sink),
                **{n: bridge.optional_array(x) for n, x in descales.items()})
            return bridge.to_tensor(o, device), bridge.to_tensor(lse, device)

    return _finish(run, (q, k, v, learnable_sink, *descales.values()), opts.return_attn_probs)
