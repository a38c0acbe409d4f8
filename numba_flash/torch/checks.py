"""Argument checks of :mod:`numba_flash.torch`, in flash-attn's layouts and argument names.

They run before anything is launched or recorded for autograd: ``TypeError`` for a wrong type
or dtype, ``ValueError`` for a wrong shape, value or device, each naming the argument, what was
expected and what came.  Scalars (``dropout_p``, ``softmax_scale``, ``causal``, ``window_size``,
``softcap``, ``deterministic``) go through the NumPy front end's own checks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backend import backend
from ..frontend.validate import check_bool, check_scale
from ..frontend.variants import check_softcap, check_window
from ..philox import check_dropout_p

#: the dtypes the kernels take
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

DENSE = "(batch_size, seqlen, nheads, headdim)"
PACKED = "(total, nheads, headdim)"
#: the axes an empty batch or key set leaves 0: dense ``batch_size`` and ``seqlen``, packed
#: ``total`` (every sequence empty on that side)
DENSE_EMPTY, PACKED_EMPTY = (0, 1), (0,)


def _dtype_text(dtypes):
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_dense(name, x):
    """``x`` (a torch tensor) is dense: strided, with values.  A sparse, nested, quantized or
    meta tensor is a ``TypeError`` naming the argument and the way back to a dense one, before
    anything converts it (torch's own errors name no argument)."""
    if x.is_nested:
        got, fix = "a nested tensor", f"torch.nested.to_padded_tensor({name}, 0.0)"
    elif x.layout != torch.strided:
        got, fix = f"a {str(x.layout).replace('torch.', '')} tensor", f"{name}.to_dense()"
    elif x.is_quantized:
        got = f"a quantized tensor ({str(x.dtype).replace('torch.', '')})"
        fix = f"{name}.dequantize()"
    elif x.is_meta:
        got, fix = "a meta tensor (a shape without values)", "a CPU or CUDA tensor"
    else:
        return
    raise TypeError(f"{name}: expected a dense (strided) tensor with values, got {got}; "
                    f"pass {fix}")


def check_tensor(name, x, ndim, layout, dtypes=DTYPES, empty_axes=()):
    """``x`` is a dense torch tensor (:func:`check_dense`) of rank ``ndim`` (``layout`` names its
    axes), a dtype in ``dtypes``, no empty dimension but on ``empty_axes`` (an empty batch or
    key set, which the NumPy front end answers without a launch).  Returns its shape as a
    tuple."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {layout}, got "
                        f"{type(x).__module__}.{type(x).__qualname__}")
    check_dense(name, x)
    if x.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in ({_dtype_text(dtypes)}), got "
                        f"{str(x.dtype).replace('torch.', '')}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor {layout}, got shape "
                         f"{tuple(x.shape)} ({x.dim()}-D)")
    shape = tuple(x.shape)
    if 0 in shape and any([s == 0 and i not in empty_axes for i, s in enumerate(shape)]):
        raise ValueError(f"{name}: expected no empty dimension, got shape {shape}")
    return shape


#: the integer dtypes of FA4's ``gather_kv_indices``
INDEX_DTYPES = (torch.int32, torch.int64)


def check_gather_indices(lists, b, nq, dropout_p, variant):
    """FA4's ``gather_kv_indices``: a dense int32 / int64 tensor ``(batch_size, seqlen_q,
    topk)`` (``nq`` None: packed, ``(total_q, topk)`` with ``b = total_q``), without dropout or
    a variant (or, packed, a ``block_table``): ``TypeError`` / ``ValueError`` naming it; the
    values are the front end's checks, :mod:`numba_flash.frontend.sparse`."""
    if nq is None:
        shape = check_tensor("gather_kv_indices", lists, 2, "(total_q, topk)", INDEX_DTYPES,
                             PACKED_EMPTY)
        if shape[0] != b:
            raise ValueError(f"gather_kv_indices: expected shape ({b}, topk) (total_q of q), "
                             f"got {shape}")
    else:
        shape = check_tensor("gather_kv_indices", lists, 3, "(batch_size, seqlen_q, topk)",
                             INDEX_DTYPES, DENSE_EMPTY)
        if shape[:2] != (b, nq):
            raise ValueError(f"gather_kv_indices: expected shape ({b}, {nq}, topk) (batch_size "
                             f"and seqlen_q of q), got {shape}")
    if dropout_p or variant:
        raise ValueError("gather_kv_indices: expected no dropout_p and no variant arguments "
                         "(score_mod, mask_mod, aux_tensors, block_sparse_tensors, a "
                         "block_table) with the token-sparse lists, got "
                         + ("dropout_p > 0" if dropout_p else "another of them"))


def check_device(named):
    """All tensors in ``{name: tensor or None}`` on one device, a CPU or (CUDA backend only) a
    CUDA one.  Returns that device."""
    items = [(n, x) for n, x in named.items() if x is not None]
    first_name, first = items[0]
    device = first.device
    for name, x in items[1:]:
        if x.device != device:
            raise ValueError(f"{name}: expected a tensor on {device} (the device of "
                             f"{first_name}), got one on {x.device}")
    if device.type == "cuda":
        if backend() != "cuda":
            raise ValueError(f"{first_name}: a CUDA tensor needs numba_flash's CUDA backend, but "
                             "kernels run in the simulator here (no usable GPU); pass CPU "
                             "tensors")
    elif device.type != "cpu":
        raise ValueError(f"{first_name}: expected a CPU or CUDA tensor, got one on {device}")
    return device


def check_same_dtype(named):
    items = list(named.items())
    first_name, first = items[0]
    for name, x in items[1:]:
        if x.dtype != first.dtype:
            raise TypeError(f"{name}: expected dtype {str(first.dtype).replace('torch.', '')} "
                            f"(the dtype of {first_name}), got "
                            f"{str(x.dtype).replace('torch.', '')}")


def check_kv_shapes(q_shape, k_shape, v_shape, k_name="k", v_name="v", dense=True, q_name="q"):
    """Shapes of ``q`` and ``k``/``v`` (``[B, N, H, d]`` dense, ``[total, H, d]`` packed): ``k``
    and ``v`` alike, same batch (dense) and head dim, query heads a multiple of kv heads (GQA),
    head dim at most 256; ``v`` may have a head dim of its own (``headdim_v`` 1..256, FA3's
    ``hdim_v``) when ``k_name != v_name`` (not a packed kv / qkv)."""
    own_v = k_name != v_name and tuple(k_shape[:-1]) == tuple(v_shape[:-1])
    if k_shape != v_shape and not own_v:
        raise ValueError(f"{v_name}: expected the shape of {k_name} {k_shape}, got {v_shape}")
    if own_v and v_shape[-1] > 256:
        raise ValueError(f"{v_name}: expected headdim_v 1..256, got {v_shape[-1]}")
    if dense and k_shape[0] != q_shape[0]:
        raise ValueError(f"{k_name}: expected batch_size {q_shape[0]} (from {q_name}), got "
                         f"{k_shape[0]}")
    if k_shape[-1] != q_shape[-1]:
        raise ValueError(f"{k_name}: expected headdim {q_shape[-1]} (from {q_name}), got "
                         f"{k_shape[-1]}")
    h, hkv = q_shape[-2], k_shape[-2]
    if h % hkv:
        raise ValueError(f"{k_name}: expected a number of heads (nheads_k) that divides the {h} "
                         f"heads of {q_name} (GQA), got {hkv}")
    if q_shape[-1] > 256:
        raise ValueError(f"{q_name}: expected headdim 1..256, got {q_shape[-1]}")


def check_alibi(alibi_slopes):
    """``alibi_slopes``: None or a tensor that does not require grad (there is no gradient for
    the slopes); dtype and shape are checked by the NumPy front end."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError("alibi_slopes: expected None or a float32 torch.Tensor (nheads,) or "
                        f"(batch_size, nheads), got {type(alibi_slopes).__name__}")
    check_dense("alibi_slopes", alibi_slopes)
    if alibi_slopes.requires_grad:
        raise ValueError("alibi_slopes: expected a tensor that does not require grad (there is "
                         "no backward for the ALiBi slopes), got requires_grad=True; pass "
                         "alibi_slopes.detach()")


def check_sink(learnable_sink, h):
    """``learnable_sink``: None or a float32 tensor ``(nheads,)`` (it may require grad: the
    backward gives ``dsink``); its values (no NaN or +inf) are checked by the NumPy front end."""
    if learnable_sink is None:
        return
    if not isinstance(learnable_sink, torch.Tensor):
        raise TypeError(f"learnable_sink: expected None or a float32 torch.Tensor ({h},), got "
                        f"{type(learnable_sink).__name__}")
    check_dense("learnable_sink", learnable_sink)
    if learnable_sink.dtype != torch.float32:
        raise TypeError(f"learnable_sink: expected dtype float32 (one logit per head, as "
                        f"flash-attn), got {str(learnable_sink.dtype).replace('torch.', '')}")
    if tuple(learnable_sink.shape) != (h,):
        raise ValueError(f"learnable_sink: expected shape ({h},) (one per query head), got "
                         f"{tuple(learnable_sink.shape)}")


def check_cu_seqlens(name, cu):
    """``cu_seqlens``: a 1-D integer tensor; its values are checked by the NumPy front end."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected an int32 torch.Tensor (batch_size + 1,), got "
                        f"{type(cu).__module__}.{type(cu).__qualname__}")
    check_dense(name, cu)
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype int32, got {str(cu.dtype).replace('torch.', '')}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name}: expected a 1-D tensor (batch_size + 1,) with batch_size >= 1, "
                         f"got shape {tuple(cu.shape)}")


class Options(NamedTuple):
    """The scalar arguments of an attention call, checked (:func:`check_options`)."""

    dropout_p: float
    softmax_scale: float
    causal: bool
    window_size: tuple
    softcap: float
    deterministic: bool
    return_attn_probs: bool


# Plain Python on Python scalars: under torch.compile it runs once at trace time (Dynamo cannot
# trace the NumPy calls inside the front end's checks) and its result is a graph constant.
@torch.compiler.assume_constant_result
def check_options(d, dropout_p, softmax_scale, causal, window_size, softcap, deterministic,
                  return_attn_probs):
    """The scalar arguments; returns them as an :class:`Options` ``(dropout_p, softmax_scale,
    causal, window_size, softcap, deterministic, return_attn_probs)`` as the custom ops take
    them (``softmax_scale`` None -> ``headdim ** -0.5``)."""
    return Options(check_dropout_p(dropout_p), check_scale(softmax_scale, d),
                   check_bool("causal", causal), check_window(window_size),
                   check_softcap(softcap), check_bool("deterministic", deterministic),
                   check_bool("return_attn_probs", return_attn_probs))
