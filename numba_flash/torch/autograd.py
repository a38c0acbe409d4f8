"""The ``torch.autograd.Function`` pair behind :mod:`numba_flash.torch.interface`: the forward
op saves ``q, k, v, out, softmax_lse``, the dropout seed (``rng_state``) and the learnable sink
(None without one; its gradient ``dsink`` comes from the backward op); the backward runs
numba_flash's backward from them (``P`` recomputed from ``lse``, the dropout mask redrawn from
the seed).  The packed forms (qkv, kv) call these on views of the packed tensor, so autograd
assembles ``dqkv`` / ``dkv`` from ``dq, dk, dv``.

``softmax_lse`` and ``S_dmask`` (``return_attn_probs=True``) are marked non-differentiable: a
loss that reaches them raises torch's "does not require grad" error instead of giving a wrong
gradient.  The backward is once-differentiable (a double backward is an error).
"""

from __future__ import annotations

from typing import NamedTuple

from collections import namedtuple
import torch
from torch.autograd.function import once_differentiable

from . import ops  # noqa: F401  (registers torch.ops.numba_flash.*)


def _finish(ctx, out, lse, s_dmask, return_softmax):
    if not return_softmax:
        return out
    ctx.mark_non_differentiable(lse, s_dmask)
    return out, lse, s_dmask


def _wants_grad(q, k, v, learnable_sink):
    return any([x is not None and x.requires_grad for x in (q, k, v, learnable_sink)])


def _sink_grad(ctx, index, dsink):
    """``dsink`` for the sink input at ``index`` when it wants one (else None)."""
    return dsink if ctx.needs_input_grad[index] else None


#: What :class:`FlashAttnFunc`'s forward saves for its backward (``save_for_backward``'s order):
#: the inputs, the outputs, the dropout seed, the sink and FA4's token-sparse lists (or None).
_DenseSaved = namedtuple("_DenseSaved", "q k v out lse rng_state sink lists")


#: :class:`FlashAttnFunc`'s scalar arguments (and ALiBi slopes) its backward needs.
_DenseArgs = namedtuple("_DenseArgs", "dropout_p scale causal left right softcap alibi_slopes "
                                      "deterministic")


class FlashAttnFunc(torch.autograd.Function):
    """Dense ``[B, N, H, d]`` attention (``flash_attn_func`` and its packed forms)."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax, is_grad_enabled,
                learnable_sink=None, gather_kv_indices=None):
        out, lse, s_dmask, rng_state = torch.ops.numba_flash.fwd(
            q, k, v, dropout_p, softmax_scale, causal, window_size[0], window_size[1], softcap,
            alibi_slopes, return_softmax and dropout_p > 0, learnable_sink, gather_kv_indices)
        if is_grad_enabled and _wants_grad(q, k, v, learnable_sink):
            ctx.save_for_backward(*_DenseSaved(q, k, v, out, lse, rng_state, learnable_sink,
                                               gather_kv_indices))
            ctx.args = _DenseArgs(dropout_p, softmax_scale, causal, window_size[0],
                                  window_size[1], softcap, alibi_slopes, deterministic)
        return _finish(ctx, out, lse, s_dmask, return_softmax)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, *_unused):
        s, a = _DenseSaved(*ctx.saved_tensors), ctx.args
        dq, dk, dv, dsink = torch.ops.numba_flash.bwd(
            dout, s.q, s.k, s.v, s.out, s.lse, a.dropout_p, a.scale, a.causal, a.left, a.right,
            a.softcap, a.alibi_slopes, a.deterministic, s.rng_state, s.sink, s.lists)
        return (dq, dk, dv) + (None,) * 9 + (_sink_grad(ctx, -2, dsink), None)


class _VarlenSaved(NamedTuple):
    """What :class:`FlashAttnVarlenFunc`'s forward saves for its backward
    (``save_for_backward``'s order): :class:`_DenseSaved`'s and the ``cu_seqlens``."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    rng_state: torch.Tensor
    sink: object
    lists: object = None


#: :class:`FlashAttnVarlenFunc`'s scalar arguments (and ALiBi slopes) its backward needs.
_VarlenArgs = namedtuple("_VarlenArgs", "max_q max_k dropout_p scale causal left right softcap "
                                        "alibi_slopes deterministic")


class FlashAttnVarlenFunc(torch.autograd.Function):
    """Packed ``[total, H, d]`` attention over ``cu_seqlens`` (``flash_attn_varlen_func`` and its
    packed forms)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                return_softmax, is_grad_enabled, learnable_sink=None, gather_kv_indices=None):
        out, lse, s_dmask, rng_state = torch.ops.numba_flash.varlen_fwd(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            softmax_scale, causal, window_size[0], window_size[1], softcap, alibi_slopes,
            return_softmax and dropout_p > 0, learnable_sink, gather_kv_indices)
        if is_grad_enabled and _wants_grad(q, k, v, learnable_sink):
            ctx.save_for_backward(*_VarlenSaved(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                                rng_state, learnable_sink, gather_kv_indices))
            ctx.args = _VarlenArgs(max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                   window_size[0], window_size[1], softcap, alibi_slopes,
                                   deterministic)
        return _finish(ctx, out, lse, s_dmask, return_softmax)

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, *_unused):
        s = _VarlenSaved(*ctx.saved_tensors)   # the packed inputs, outputs, cu_seqlens
        a = ctx.args                           # the _VarlenArgs
        dq, dk, dv, dsink = torch.ops.numba_flash.varlen_bwd(
            dout, s.q, s.k, s.v, s.out, s.lse, s.cu_q, s.cu_k, a.max_q, a.max_k, a.dropout_p,
            a.scale, a.causal, a.left, a.right, a.softcap, a.alibi_slopes, a.deterministic,
            s.rng_state, s.sink, s.lists)
        return (dq, dk, dv) + (None,) * 13 + (_sink_grad(ctx, -2, dsink), None)
