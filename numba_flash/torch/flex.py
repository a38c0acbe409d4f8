"""FlexAttention's interface on numba_flash's kernels: :func:`flex_attention` and
:func:`create_block_mask` with ``torch.nn.attention.flex_attention``'s layout (``[B, H, N, d]``)
and argument order, numba_flash's own arguments after theirs.

Where it differs from FlexAttention (docs/torch.md has the migration table):

* the functions are plain Python on scalars, compiled by Numba (run as Python in the simulator),
  and the tensors they read are passed as ``aux_tensors`` and arrive as extra arguments
  (``score_mod(score, b, h, q_idx, kv_idx, *aux)``), not captured in a closure;
* the backward needs ``score_mod_grad(score, b, h, q_idx, kv_idx, *aux)``, ``d score_mod / d
  score`` (FlexAttention differentiates the function itself), and a learnable aux tensor needs
  ``aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, *aux)`` adding its gradient with
  :func:`numba_flash.flex.atomic_add` (:mod:`numba_flash.frontend.aux_grad`);
* the block mask is :class:`numba_flash.flex.BlockMask` (host-side, any block size that is a
  power of 2 >= 16), evaluated on the CPU (Numba); ``mask_mod=`` also works without one;
* ``kernel_options`` and ``return_aux`` are not taken.
"""

from __future__ import annotations

import torch

from ..frontend.validate import check_bool, check_scale
from . import checks
from .variants import VariantSpec, check_variant, run_variant

__all__ = ["flex_attention", "create_block_mask"]


def flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None,
                   enable_gqa=False, return_lse=False, aux_tensors=(), score_mod_grad=None,
                   aux_grad=None, mask_mod=None):
    """Attention of ``query [B, H, Nq, d]`` over ``key``, ``value`` ``[B, Hkv, Nk, d]`` with a
    user's ``score_mod`` / ``mask_mod`` / ``block_mask``, FlexAttention's semantics.

    * ``score_mod(score, b, h, q_idx, kv_idx, *aux_tensors) -> float``: the score the softmax
      uses, from ``score = scale * q . k``;
    * ``block_mask``: a :class:`numba_flash.flex.BlockMask` (:func:`create_block_mask`) of a
      ``mask_mod(b, h, q_idx, kv_idx, *aux_tensors) -> bool`` (True: the query sees the key);
      EMPTY blocks are skipped, FULL ones skip the function.  ``mask_mod=`` gives the mask
      without a block mask (every element evaluated);
    * ``scale``: default ``d ** -0.5``; ``enable_gqa``: allow ``Hkv < H`` (``H`` a multiple;
      query head ``h`` reads kv head ``h // (H // Hkv)``), as FlexAttention;
    * ``aux_tensors``: tensors the functions read, on the inputs' device (not captured in a
      closure); ``score_mod_grad``: ``d score_mod / d score`` (needed for gradients of
      ``query``/``key``/``value`` through a ``score_mod``); ``aux_grad``: adds the gradient of
      the aux tensors that require grad (see :mod:`numba_flash.frontend.aux_grad`).

    Returns ``out [B, H, Nq, d]`` in the inputs' dtype, and with ``return_lse=True`` also
    ``lse [B, H, Nq]`` (natural log, float32; float64 for float64 inputs; not differentiable).
    A row that sees no key has ``out = 0``, ``lse = -inf``.  float16, bfloat16, float32 and
    float64; CPU tensors run in the simulator, CUDA tensors on the GPU.
    """
    names = ("query", "key", "value")
    qs = checks.check_tensor("query", query, 4, "(B, H, Nq, d)")
    ks = checks.check_tensor("key", key, 4, "(B, Hkv, Nk, d)")
    vs = checks.check_tensor("value", value, 4, "(B, Hkv, Nk, d)")
    checks.check_same_dtype({"query": query, "key": key, "value": value})
    checks.check_device({"query": query, "key": key, "value": value})
    if ks != vs:
        raise ValueError(f"value: expected the shape of key {ks}, got {vs}")
    if ks[0] != qs[0] or ks[3] != qs[3]:
        raise ValueError(f"key: expected batch {qs[0]} and head dim {qs[3]} (from query), got "
                         f"shape {ks}")
    enable_gqa = check_bool("enable_gqa", enable_gqa)
    if ks[1] != qs[1] and not enable_gqa:
        raise ValueError(f"key: expected {qs[1]} heads (those of query; pass enable_gqa=True "
                         f"for grouped-query attention), got {ks[1]}")
    return_lse = check_bool("return_lse", return_lse)
    try:
        scale = check_scale(scale, qs[3])
    except (TypeError, ValueError) as e:  # FlexAttention's name for it
        raise type(e)(str(e).replace("softmax_scale", "scale", 1)) from None
    aux = check_variant(query, key, value, names, aux_tensors, block_mask, score_mod,
                        score_mod_grad, aux_grad, 0.0)
    spec = VariantSpec(layout="bhnd", scale=scale, causal=False,
                       window=(-1, -1), softcap=0.0, alibi=None, dropout_p=0.0,
                       deterministic=False, score_mod=score_mod, mask_mod=mask_mod,
                       block_mask=block_mask, score_mod_grad=score_mod_grad, aux_grad=aux_grad)
    out, lse = run_variant(spec, query, key, value, aux)
    return (out, lse) if return_lse else out


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128,
                      aux_tensors=()):
    """FlexAttention's ``create_block_mask``: evaluate ``mask_mod(b, h, q_idx, kv_idx,
    *aux_tensors)`` over ``[B, H, Q_LEN, KV_LEN]`` (``B`` / ``H`` None: broadcast) and classify
    each ``BLOCK_SIZE`` block (an int or ``(Q_BLOCK, KV_BLOCK)``, powers of 2 >= 16) as empty,
    partial or full: a :class:`numba_flash.flex.BlockMask`
    (:func:`numba_flash.flex.create_block_mask`).  The mask is evaluated on the host (Numba on
    the CPU; ``aux_tensors`` are copied there for it) and the result serves tensors on any
    device (``device`` is accepted for FlexAttention's signature).  Pass the same
    ``aux_tensors`` to the attention call."""
    from numba_flash.flex import create_block_mask as create

    from .bridge import as_array

    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device):
        raise TypeError(f"device: expected a str or torch.device, got {type(device).__name__}")
    if aux_tensors is None:
        aux_tensors = ()
    if not isinstance(aux_tensors, (tuple, list)):
        raise TypeError(f"aux_tensors: expected a tuple or list of torch tensors, got "
                        f"{type(aux_tensors).__name__}")
    host = []
    for i, a in enumerate(aux_tensors):
        if not isinstance(a, torch.Tensor):
            raise TypeError(f"aux_tensors[{i}]: expected a torch.Tensor, got "
                            f"{type(a).__module__}.{type(a).__qualname__}")
        host.append(as_array(a.detach().cpu()))
    return create(mask_mod, B, H, Q_LEN, KV_LEN, aux_tensors=tuple(host), BLOCK_SIZE=BLOCK_SIZE)
