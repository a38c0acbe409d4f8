"""numba_flash as an attention implementation of Hugging Face transformers.

:func:`register_transformers` puts :func:`attention_forward` in transformers'
``AttentionInterface`` and its flash-attention mask function in ``AttentionMaskInterface``
under one name, so ``AutoModel.from_config(cfg, attn_implementation="numba_fa")`` (or
``from_pretrained``) runs numba_flash.  Both registrations are needed: an attention function
registered alone is given ``attention_mask=None`` for a padded batch, which would silently
attend to the padding.  The mask function hands over the 2-D padding mask ``[batch, kv_len]``
(or None when nothing is padded); :func:`attention_forward` then packs the valid tokens
(:func:`~numba_flash.torch.unpad_input`), runs :func:`~numba_flash.torch.flash_attn_varlen_func`
and scatters the result back (padded query positions get 0).  GQA models pass their kv heads
as they are (no repeat).
"""

from __future__ import annotations

from .bert_padding import pad_input, unpad_input
from .interface import flash_attn_func, flash_attn_varlen_func

__all__ = ["register_transformers", "attention_forward"]


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention-function contract: ``query [B, H, Nq, d]``, ``key``/``value``
    ``[B, Hkv, Nk, d]``, ``attention_mask`` None or 2-D ``[B, Nk]`` (1 = token) from the mask
    function; returns ``(attn_output [B, Nq, H, d], None)`` (no attention weights).

    ``is_causal`` (default ``module.is_causal``) is bottom-right aligned as in flash-attn;
    ``sliding_window`` ``w`` becomes ``window_size=(w - 1, w - 1)`` as transformers' own
    flash-attention path does; ``softcap`` and ``scaling`` pass through.
    """
    if kwargs.get("output_attentions", False):
        raise ValueError("output_attentions: numba_flash computes no attention weights; use "
                         "attn_implementation='eager' to get them")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    opts = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal,
                window_size=window, softcap=float(softcap or 0.0))
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, N, heads, d]
    if attention_mask is None:
        return flash_attn_func(q, k, v, **opts), None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (k.shape[0], k.shape[1]):
        raise ValueError(f"attention_mask: expected the 2-D padding mask [batch, kv_len] "
                         f"{(k.shape[0], k.shape[1])} that the numba_flash mask function "
                         f"gives, got shape {tuple(attention_mask.shape)}")
    # [docs:torch-padded-batch]
    b, nq = q.shape[:2]
    mask_k = attention_mask.bool()
    mask_q = mask_k[:, -nq:]  # the queries are the last nq positions (decoding with a cache)
    q_p, idx_q, cu_q, max_q, _ = unpad_input(q, mask_q)
    k_p, _idx_k, cu_k, max_k, _ = unpad_input(k, mask_k)
    v_p = unpad_input(v, mask_k)[0]
    out = flash_attn_varlen_func(q_p, k_p, v_p, cu_q, cu_k, max_q, max_k, **opts)
    return pad_input(out, idx_q, b, nq), None
    # [/docs:torch-padded-batch]


def register_transformers(name="numba_fa"):
    """Register numba_flash in transformers as ``attn_implementation=name``; returns ``name``.

    ``name`` must not contain "flash": transformers takes such a name as a request for one of
    its own or a hub flash-attention kernel and refuses a registered function.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name: expected a name without 'flash' (transformers reserves those "
                         f"for its flash-attention kernels), got {name!r}")
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask
    except ImportError as exc:
        raise ImportError("register_transformers needs transformers: pip install "
                          "'numba_flash[transformers]'") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
