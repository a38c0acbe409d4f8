"""flash-attn's ``bert_padding`` helpers: a padded batch to the packed layout of the varlen
functions and back (plain torch indexing; autograd flows through both)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["unpad_input", "pad_input"]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """Pack the tokens a mask selects, as flash-attn's ``unpad_input``.

    ``hidden_states``: ``(batch, seqlen, ...)``; ``attention_mask``: ``(batch, seqlen)`` bool or
    int, 1 for a valid token; ``unused_mask``: optional, same shape, 1 for a token that is
    allocated but unused (packed too, not counted in ``seqused``).

    Returns ``(hidden_states [total_nnz, ...], indices [total_nnz] (int64, into the flattened
    ``batch * seqlen`` positions), cu_seqlens [batch + 1] (int32), max_seqlen_in_batch (int),
    seqused [batch] (int32))``.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
        raise ValueError("hidden_states: expected a tensor (batch, seqlen, ...), got "
                         f"{getattr(hidden_states, 'shape', type(hidden_states).__name__)}")
    for name, m in (("attention_mask", attention_mask), ("unused_mask", unused_mask)):
        if m is None and name == "unused_mask":
            continue
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(hidden_states.shape[:2]):
            raise ValueError(f"{name}: expected a tensor of shape (batch, seqlen) "
                             f"{tuple(hidden_states.shape[:2])}, got "
                             f"{getattr(m, 'shape', type(m).__name__)}")
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
    ``indices`` (from :func:`unpad_input`), zeros elsewhere, as flash-attn's ``pad_input``."""
    out = hidden_states.new_zeros((batch * seqlen, *hidden_states.shape[1:]))
    out = out.index_put((indices,), hidden_states)
    return out.reshape(batch, seqlen, *hidden_states.shape[1:])
