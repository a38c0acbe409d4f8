"""flash-attn's ``bert_padding`` helpers: a padded batch to the packed layout of the varlen
functions and back (plain torch indexing; autograd flows through both).

Their arguments are checked first, as the attention functions' are: ``TypeError`` for a wrong
type, dtype or layout (sparse, nested, quantized, meta), ``ValueError`` for a wrong shape, device
or value (a mask entry other than 0/1, an index outside ``[0, batch * seqlen)`` or repeated, a
``batch`` or ``seqlen`` below 1), each naming the argument.  The value checks read the tensors
(one synchronisation on a GPU) and are skipped while ``torch.compile`` traces.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..frontend.validate import INT64_MAX, check_int
from .checks import check_dense

__all__ = ["unpad_input", "pad_input"]


def _tensor(name, x, what):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {what}, got "
                        f"{type(x).__module__}.{type(x).__qualname__}")
    check_dense(name, x)


def _same_device(name, x, ref_name, ref):
    if x.device != ref.device:
        raise ValueError(f"{name}: expected a tensor on {ref.device} (the device of {ref_name}), "
                         f"got one on {x.device}")


def _first(bad):
    """The index of the first True of a bool tensor, as a tuple."""
    return tuple(int(i) for i in torch.nonzero(bad)[0])


def _check_mask(name, m, shape, hidden_states):
    _tensor(name, m, f"of shape (batch, seqlen) {shape}")
    if tuple(m.shape) != shape:
        raise ValueError(f"{name}: expected a tensor of shape (batch, seqlen) {shape}, got "
                         f"{tuple(m.shape)}")
    if m.is_complex():
        raise TypeError(f"{name}: expected a bool, integer or float tensor of 0/1, got dtype "
                        f"{str(m.dtype).replace('torch.', '')}")
    _same_device(name, m, "hidden_states", hidden_states)
    if not torch.compiler.is_compiling():
        bad = (m != 0) & (m != 1)
        if bool(bad.any()):
            at = _first(bad)
            raise ValueError(f"{name}: expected entries 0 or 1 (1: a token), got "
                             f"{m[at].item()} at {list(at)}")


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Pack the tokens a mask selects, as flash-attn's ``unpad_input``.

    ``hidden_states``: ``(batch, seqlen, ...)``; ``attention_mask``: ``(batch, seqlen)`` bool or
    int, 1 for a valid token; ``unused_mask``: optional, same shape, 1 for a token that is
    allocated but unused (packed too, not counted in ``seqused``).

    Returns ``(hidden_states [total_nnz, ...], indices [total_nnz] (int64, into the flattened
    ``batch * seqlen`` positions), cu_seqlens [batch + 1] (int32), max_seqlen_in_batch (int),
    seqused [batch] (int32))``.
    """
    _tensor("hidden_states", hidden_states, "(batch, seqlen, ...)")
    if hidden_states.dim() < 2:
        raise ValueError("hidden_states: expected a tensor (batch, seqlen, ...), got shape "
                         f"{tuple(hidden_states.shape)}")
    shape = tuple(hidden_states.shape[:2])
    _check_mask("attention_mask", attention_mask, shape, hidden_states)
    if unused_mask is not None:
        _check_mask("unused_mask", unused_mask, shape, hidden_states)
        both = (attention_mask != 0) & (unused_mask != 0)
        if not torch.compiler.is_compiling() and bool(both.any()):
            raise ValueError(f"unused_mask: expected 0 where attention_mask is 1 (a token is "
                             f"used or unused, not both), got 1 at {list(_first(both))}")
    mask = attention_mask.to(torch.int32)
    all_masks = mask + unused_mask.to(torch.int32) if unused_mask is not None else mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen = int(seqlens.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen, used


def pad_input(hidden_states, indices, batch, seqlen):
    """Scatter packed ``hidden_states [total_nnz, ...]`` back to ``(batch, seqlen, ...)`` at
    ``indices`` (from :func:`unpad_input`), zeros elsewhere, as flash-attn's ``pad_input``.

    ``indices``: an integer tensor ``[total_nnz]`` of distinct entries in ``[0, batch *
    seqlen)``; ``batch``, ``seqlen``: ints >= 1."""
    _tensor("hidden_states", hidden_states, "(total_nnz, ...)")
    if hidden_states.dim() < 1:
        raise ValueError("hidden_states: expected a tensor (total_nnz, ...), got a 0-D one")
    _tensor("indices", indices, "(total_nnz,)")
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"indices: expected an integer tensor (total_nnz,), got dtype "
                        f"{str(indices.dtype).replace('torch.', '')}")
    n = hidden_states.shape[0]
    if tuple(indices.shape) != (n,):
        raise ValueError(f"indices: expected shape ({n},) (total_nnz, dim 0 of hidden_states), "
                         f"got {tuple(indices.shape)}")
    _same_device("indices", indices, "hidden_states", hidden_states)
    batch = check_int("batch", batch, 1, INT64_MAX, what="an int >= 1")
    seqlen = check_int("seqlen", seqlen, 1, INT64_MAX // batch,
                       what=f"an int >= 1 (batch * seqlen at most 2**63 - 1, batch = {batch})")
    if not torch.compiler.is_compiling() and n:
        bad = (indices < 0) | (indices >= batch * seqlen)
        if bool(bad.any()):
            (i,) = _first(bad)
            raise ValueError(f"indices: expected entries in [0, {batch * seqlen}) (batch * "
                             f"seqlen = {batch} * {seqlen}), got {int(indices[i])} at index {i}")
        values, counts = torch.unique(indices, return_counts=True)
        if values.numel() != n:
            raise ValueError(f"indices: expected distinct entries (two tokens would land on one "
                             f"position), got {int(values[counts > 1][0])} twice or more")
    shape = (batch * seqlen, *hidden_states.shape[1:])
    try:
        out = hidden_states.new_zeros(shape)
    except (RuntimeError, MemoryError) as exc:  # torch's allocator names no argument
        gib = math.prod(shape) * hidden_states.element_size() / 2**30
        raise MemoryError(f"pad_input: the output (batch, seqlen, ...) = {(batch, seqlen)} + "
                          f"{tuple(hidden_states.shape[1:])} ({gib:.1f} GiB) cannot be "
                          f"allocated ({str(exc).splitlines()[0]})") from None
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
