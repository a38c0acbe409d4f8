"""A user's attention variant on torch tensors, with autograd: ``score_mod``, ``mask_mod``, a
block mask and aux tensors (learnable ones included) for :func:`numba_flash.torch.flex_attention`
and for FlashAttention-4's arguments of :func:`numba_flash.torch.flash_attn_func` /
:func:`~numba_flash.torch.flash_attn_varlen_func`.

:class:`VariantFunc` runs :func:`numba_flash.forward` (:func:`~numba_flash.forward_varlen`)
and its backward on views of the tensors (:mod:`numba_flash.torch.bridge`) in one of three
layouts: ``"bnhd"`` (flash-attn's ``[B, N, H, d]``), ``"bhnd"`` (FlexAttention's ``[B, H, N,
d]``) and ``"varlen"`` (packed ``[total, H, d]`` with ``cu_seqlens``).  An aux tensor that
requires grad gets its gradient from the user's ``aux_grad`` (:mod:`numba_flash.frontend.aux_grad`).

The user's functions are Python callables, which ``torch.library`` custom ops cannot take: this
path is eager only (``torch.compile`` runs it outside the graph: :func:`torch.compiler.disable`).
:func:`check_variant` runs every check before any launch.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
from torch.autograd.function import once_differentiable

import numba_flash

from . import bridge

__all__ = ["VariantSpec", "VariantFunc", "check_variant", "from_score_mod_bwd", "run_variant"]


class VariantSpec(NamedTuple):
    """Everything but the differentiable tensors, checked (:func:`check_variant`)."""

    layout: str                      # "bnhd", "bhnd" or "varlen"
    scale: float
    causal: bool
    window: tuple
    softcap: float
    alibi: Optional[torch.Tensor]    # float32 slopes (no gradient) or None
    dropout_p: float
    deterministic: bool
    score_mod: object
    mask_mod: object
    block_mask: object               # numba_flash.flex.BlockMask or None
    score_mod_grad: object
    aux_grad: object
    cu_seqlens: tuple = ()           # varlen: (cu_seqlens_q, cu_seqlens_k) tensors
    max_seqlens: tuple = ()          # varlen: (max_seqlen_q, max_seqlen_k)


def _heads_first(t, layout):
    """A q/k/v/o tensor as the ``[B, H, N, d]`` array (``"varlen"``: packed as it is)."""
    return bridge.heads_first(t) if layout == "bnhd" else bridge.packed(t)


def _out(a, layout, device):
    """A result array back in the layout the tensors came in."""
    return bridge.seq_first(a, device) if layout == "bnhd" else bridge.to_tensor(a, device)


def _kw(spec, aux_arrays, sink=None):
    """The keyword arguments the NumPy front end's forward and backward share."""
    kw = dict(causal=spec.causal, softmax_scale=spec.scale, window_size=spec.window,
              softcap=spec.softcap, score_mod=spec.score_mod, mask_mod=spec.mask_mod,
              block_mask=spec.block_mask, aux_tensors=aux_arrays,
              alibi_slopes=bridge.optional_array(spec.alibi),
              learnable_sink=bridge.optional_array(sink))
    if spec.layout == "varlen":
        kw.update(max_seqlen_q=spec.max_seqlens[0], max_seqlen_k=spec.max_seqlens[1])
    return kw


def _cu(spec):
    return tuple(bridge.as_array(c) for c in spec.cu_seqlens)


class _VariantSaved(NamedTuple):
    """What :class:`VariantFunc`'s forward saves for its backward: the inputs, the outputs, the
    dropout seed, the sink (or None) and the aux tensors (``save_for_backward`` takes them
    flat, in this order: :meth:`tensors`, :meth:`of`)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    rng_state: torch.Tensor
    sink: Optional[torch.Tensor]
    aux: tuple

    def tensors(self):
        """The flat tuple ``save_for_backward`` takes."""
        return (*self[:-1], *self.aux)

    @classmethod
    def of(cls, saved):
        """From ``ctx.saved_tensors``."""
        n = len(cls._fields) - 1
        return cls(*saved[:n], tuple(saved[n:]))


class VariantFunc(torch.autograd.Function):
    """``(out, lse)`` of attention with a user's variant; gradients for ``q``, ``k``, ``v``, the
    learnable sink (``sink``: float32 ``[H]`` or None) and every aux tensor that requires grad
    (``lse`` is not differentiable)."""

    @staticmethod
    def forward(ctx, spec, q, k, v, sink, *aux):
        rng_state = bridge.draw_seed(spec.dropout_p)
        aux_arrays = tuple(bridge.as_array(a) for a in aux)
        args = tuple(_heads_first(x, spec.layout) for x in (q, k, v))
        kw = _kw(spec, aux_arrays, sink)
        with bridge.on_device(q.device):
            if spec.layout == "varlen":
                o, lse = numba_flash.forward_varlen(*args, *_cu(spec), return_lse=True,
                                                    dropout_p=spec.dropout_p,
                                                    seed=int(rng_state[0]), **kw)
            else:
                o, lse = numba_flash.forward(*args, return_lse=True, dropout_p=spec.dropout_p,
                                             seed=int(rng_state[0]), **kw)
            out, lse = _out(o, spec.layout, q.device), bridge.to_tensor(lse, q.device)
        ctx.save_for_backward(*_VariantSaved(q, k, v, out, lse, rng_state, sink, aux).tensors())
        ctx.spec = spec
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        s = _VariantSaved.of(ctx.saved_tensors)
        spec, aux, device = ctx.spec, s.aux, s.q.device
        want_aux = [ctx.needs_input_grad[5 + i] for i in range(len(aux))]
        aux_arrays = tuple(bridge.as_array(a) for a in aux)
        args = tuple(_heads_first(x, spec.layout)
                     for x in (dout.contiguous(), s.q, s.k, s.v, s.out))
        kw = _kw(spec, aux_arrays, s.sink)
        kw.update(score_mod_grad=spec.score_mod_grad, deterministic=spec.deterministic,
                  dropout_p=spec.dropout_p, seed=int(s.rng_state[0]),
                  aux_grad=spec.aux_grad if any(want_aux) else None)
        with bridge.on_device(device):
            if spec.layout == "varlen":
                grads = numba_flash.backward_varlen(*args, bridge.as_array(s.lse), *_cu(spec),
                                                    **kw)
            else:
                grads = numba_flash.backward(*args, bridge.as_array(s.lse), **kw)
            dq, dk, dv = (_out(g, spec.layout, device) for g in grads[:3])
            dsink = None
            if s.sink is not None:    # (dq, dk, dv, dsink, *aux grads)
                dsink = bridge.to_tensor(grads[3], device) if ctx.needs_input_grad[4] else None
                grads = grads[:3] + grads[4:]
            aux_grads = [None] * len(aux)
            for i, g in enumerate(grads[3:]):
                if want_aux[i]:
                    aux_grads[i] = bridge.to_tensor(g, device).to(aux[i].dtype)
        return (None, dq, dk, dv, dsink, *aux_grads)


def from_score_mod_bwd(score_mod_bwd, n_aux, dtype):
    """FlashAttention-4's ``score_mod_bwd(grad, score, b, h, q_idx, kv_idx, *aux)`` (the
    gradient w.r.t. the score, from the gradient ``grad`` w.r.t. ``score_mod``'s output) as our
    ``score_mod_grad(score, b, h, q_idx, kv_idx, *aux)`` (``d score_mod / d score``): the same
    function called with ``grad = 1`` in the compute type (the chain rule is linear in
    ``grad``).  The wrapper is generated with the exact arity the checks ask for."""
    from numba_flash.flex.functions import check_mod

    if score_mod_bwd is None:
        return None
    fixed = ("grad",) + ("score", "b", "h", "q_idx", "kv_idx")
    try:
        check_mod("score_mod", score_mod_bwd, n_aux + 1)  # one more leading argument: grad
    except TypeError as e:
        raise TypeError(f"score_mod_bwd: expected FlashAttention-4's score_mod_bwd("
                        f"{', '.join(fixed)}, *aux) with {n_aux} aux tensor(s) ({e})") from None
    aux = "".join(f", aux{i}" for i in range(n_aux))
    src = (f"def score_mod_grad(score, b, h, q_idx, kv_idx{aux}):\n"
           f"    return score_mod_bwd(ONE, score, b, h, q_idx, kv_idx{aux})\n")
    one = np.float64(1.0) if dtype == torch.float64 else np.float32(1.0)
    namespace = {"score_mod_bwd": score_mod_bwd, "ONE": one}
    exec(compile(src, f"<score_mod_grad of {score_mod_bwd.__name__}>", "exec"), namespace)
    return namespace["score_mod_grad"]


def _tensor_aux(aux_tensors, device, names):
    """``aux_tensors`` as a tuple of torch tensors on ``device``."""
    if aux_tensors is None:
        return ()
    if not isinstance(aux_tensors, (tuple, list)):
        raise TypeError(f"aux_tensors: expected a tuple or list of torch tensors, got "
                        f"{type(aux_tensors).__name__}")
    for i, a in enumerate(aux_tensors):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"aux_tensors[{i}]: expected a torch.Tensor, got "
                            f"{type(a).__module__}.{type(a).__qualname__}")
        if a.device != device:
            raise ValueError(f"aux_tensors[{i}]: expected a tensor on {device} (the device of "
                             f"{names[0]}), got one on {a.device}")
        if a.dtype == torch.bfloat16 or a.dtype.is_complex:
            raise TypeError(f"aux_tensors[{i}]: expected a bool, integer, float16, float32 or "
                            f"float64 tensor, got {str(a.dtype).replace('torch.', '')}")
    return tuple(aux_tensors)


def check_variant(q, k, v, names, aux_tensors, block_mask, score_mod, score_mod_grad,
                  aux_grad, dropout_p):
    """The torch-side checks of a variant, before any launch (the NumPy front end checks the
    functions, the block mask's shape and the rest): aux tensors on q's device, a
    ``score_mod_grad`` when the backward will run, an ``aux_grad`` (of the right arity,
    that Numba compiles) when an aux tensor requires grad.  Returns the aux tensors."""
    from numba_flash.flex import BlockMask
    from numba_flash.frontend.aux_grad import check_aux_grad

    aux = _tensor_aux(aux_tensors, q.device, names)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask: expected a numba_flash.flex.BlockMask (from "
                        f"numba_flash.torch.create_block_mask), got "
                        f"{type(block_mask).__module__}.{type(block_mask).__qualname__}")
    grad = torch.is_grad_enabled()
    if grad and score_mod is not None and score_mod_grad is None and any(
            x.requires_grad for x in (q, k, v, *aux)):  # the backward runs (aux: beside dq...)
        raise ValueError(f"score_mod_grad: the gradients of {names[0]}, {names[1]}, {names[2]} "
                         f"through score_mod {score_mod.__name__} need its derivative d "
                         f"score_mod / d score (a function of the same arguments), got None")
    needs_aux = [i for i, a in enumerate(aux) if a.requires_grad]
    if grad and needs_aux and aux_grad is None:
        raise ValueError(f"aux_grad: aux_tensors[{needs_aux[0]}] requires grad, which needs "
                         f"aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, *aux) adding "
                         f"its gradient (numba_flash.flex.atomic_add), got None")
    if aux_grad is not None:
        check_aux_grad(aux_grad, tuple(bridge.as_array(a) for a in aux),
                       np.float64 if q.dtype == torch.float64 else np.float32, dropout_p)
    return aux


@torch.compiler.disable
def run_variant(spec, q, k, v, aux, learnable_sink=None):
    """``(out, lse)`` through :class:`VariantFunc` (eager: Python callables)."""
    return VariantFunc.apply(spec, q, k, v, learnable_sink, *aux)
