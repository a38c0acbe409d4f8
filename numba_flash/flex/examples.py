"""Example user functions (the docs' and the compile tier's): each a plain Python function of
scalars, as a user writes one."""

from __future__ import annotations

from .atomics import atomic_add

__all__ = ["relative_bias", "relative_bias_grad", "relative_bias_aux_grad", "document_mask",
           "prefix_lm_mask"]


def relative_bias(score, b, h, q_idx, kv_idx, bias):
    """T5-style relative position bias: ``bias[h, q_idx - kv_idx + bias.shape[1] // 2]``."""
    return score + bias[h, q_idx - kv_idx + bias.shape[1] // 2]


def relative_bias_grad(score, b, h, q_idx, kv_idx, bias):
    """d relative_bias / d score."""
    return 1.0


def relative_bias_aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, bias):
    """The gradient of relative_bias w.r.t. its table: d score_mod / d bias[h, q_idx - kv_idx +
    c] = 1, so that entry gains ``grad_score`` (``grads[0]``: the table's gradient)."""
    atomic_add(grads[0], (h, q_idx - kv_idx + bias.shape[1] // 2), grad_score)


def document_mask(b, h, q_idx, kv_idx, doc):
    """Packed documents: a token sees the tokens of its own document (``doc[b, i]``: the
    document of token ``i``)."""
    return doc[b, q_idx] == doc[b, kv_idx]


def prefix_lm_mask(b, h, q_idx, kv_idx, prefix):
    """Prefix-LM: every token sees the prefix (``prefix[b]`` tokens) bidirectionally, the rest
    causally."""
    return kv_idx < prefix[b] or kv_idx <= q_idx
