"""numba_flash as an attention implementation of Hugging Face transformers.

:func:`register_transformers` puts :func:`attention_forward` in transformers'
``AttentionInterface`` and its flash-attention mask function in ``AttentionMaskInterface``
under one name, so ``AutoModel.from_config(cfg, attn_implementation="numba_fa")`` (or
``from_pretrained``) runs numba_flash.  Both registrations are needed: an attention function
registered alone is given ``attention_mask=None`` for a padded batch, which would silently
attend to the padding.  The mask function hands over the 2-D padding mask ``[batch, kv_len]``
(or None when nothing is padded); :func:`attention_forward` then packs the valid tokens
(:func:`~numba_flash.torch.unpad_input`), runs :func:`~numba_flash.torch.flash_attn_varlen_func`
and scatters the result back (padded query positions get 0).  Sequences packed into one row
without padding (``position_ids`` that restart, or ``cu_seq_lens_q/k`` from
``DataCollatorWithFlattening``) run as a packed batch too, as in transformers' own flash path.
GQA models pass their kv heads as they are (no repeat).

Every keyword the attention modules of the causal LMs served here (Llama, Mistral, Qwen2,
Gemma2, GPT-OSS; BERT-style encoders too) pass is either honoured (``dropout``, ``scaling``,
``sliding_window``, ``softcap``, ``is_causal``, GPT-OSS's sinks ``s_aux`` as
``learnable_sink``, ``position_ids``, ``cu_seq_lens_q/k``, ``max_length_q/k``,
``deterministic``), refused (``output_attentions=True``: no attention weights here), or on the
list :data:`HARMLESS_KWARGS` of keywords that cannot change the attention; any other keyword is
a ``TypeError`` naming it, never silently dropped.
"""

from __future__ import annotations

import torch

from .bert_padding import pad_input, unpad_input
from .interface import flash_attn_func, flash_attn_varlen_func

__all__ = ["register_transformers", "attention_forward", "HARMLESS_KWARGS"]

#: Keywords transformers passes down to the attention function (through the layers' ``**kwargs``)
#: that cannot change the attention output; :func:`attention_forward` takes and ignores them.
HARMLESS_KWARGS = frozenset({
    "use_cache",  # the cache was updated before the call: key/value already hold it
    "output_hidden_states",  # which per-layer hidden states the model returns, not their values
    "output_router_logits",  # MoE router outputs (GPT-OSS, Mixtral), not the attention
    "num_items_in_batch",  # the loss's normaliser (gradient accumulation), read by the loss
    "encoder_hidden_states",  # BERT-style layers hand it on: the module projected key/value from
    #                           it already (cross-attention) or does not use it (self-attention)
    "seq_idx",  # Mamba layers' packed-sequence index; attention reads packing from
    #             cu_seq_lens_q/k or position_ids (as transformers' flash path, which ignores it)
})


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, s_aux=None,
                      position_ids=None, cu_seq_lens_q=None, cu_seq_lens_k=None,
                      max_length_q=None, max_length_k=None, output_attentions=False,
                      deterministic=False, **kwargs):
    """transformers' attention-function contract: ``query [B, H, Nq, d]``, ``key``/``value``
    ``[B, Hkv, Nk, d]``, ``attention_mask`` None or 2-D ``[B, Nk]`` (1 = token) from the mask
    function; returns ``(attn_output [B, Nq, H, d], None)`` (no attention weights).

    ``is_causal`` (default ``module.is_causal``) is bottom-right aligned as in flash-attn;
    ``sliding_window`` ``w`` becomes ``window_size=(w - 1, w - 1)`` as transformers' own
    flash-attention path does; ``softcap``, ``scaling``, ``dropout`` and ``deterministic`` pass
    through.  ``s_aux`` (GPT-OSS's ``sinks``, one logit per query head) is the kernels'
    ``learnable_sink``, cast to float32 (the cast is differentiable: the gradient reaches the
    parameter in its own dtype).  ``position_ids`` / ``cu_seq_lens_q/k`` / ``max_length_q/k``
    split a row of packed sequences (:func:`_packed_sequences`).  ``output_attentions=True`` is
    a ``ValueError``; a keyword not named here nor in :data:`HARMLESS_KWARGS` is a
    ``TypeError`` naming it.
    """
    unexpected = sorted(set(kwargs) - HARMLESS_KWARGS)
    if unexpected:
        names = ", ".join(repr(n) for n in unexpected)
        plural = "s" if len(unexpected) > 1 else ""
        raise TypeError(f"attention_forward: unexpected keyword argument{plural} {names} "
                        f"(numba_flash does not know what it would change, so it "
                        f"refuses it rather than drop it; known harmless: "
                        f"{', '.join(sorted(HARMLESS_KWARGS))})")
    if output_attentions:
        raise ValueError("output_attentions: numba_flash computes no attention weights; use "
                         "attn_implementation='eager' to get them")
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", False))
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    sink = None if s_aux is None else s_aux.float()  # the kernels' sink is float32
    opts = dict(dropout_p=float(dropout), softmax_scale=scaling, causal=causal,
                window_size=window, softcap=float(softcap or 0.0),
                deterministic=bool(deterministic), learnable_sink=sink)
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # [B, N, heads, d]
    if attention_mask is None:
        packed = _packed_sequences(q, k, position_ids, cu_seq_lens_q, cu_seq_lens_k,
                                   max_length_q, max_length_k)
        if packed is None:
            return flash_attn_func(q, k, v, **opts), None
        heads = (q.shape[2:], k.shape[2:])
        out = flash_attn_varlen_func(q.reshape(-1, *heads[0]), k.reshape(-1, *heads[1]),
                                     v.reshape(-1, *heads[1]), *packed, **opts)
        return out.reshape(q.shape), None
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (k.shape[0], k.shape[1]):
        raise ValueError(f"attention_mask: expected the 2-D padding mask [batch, kv_len] "
                         f"{(k.shape[0], k.shape[1])} that the numba_flash mask function "
                         f"gives, got shape {tuple(attention_mask.shape)} (a mask shorter than "
                         f"the keys comes from a StaticCache: use the default DynamicCache)")
    # [docs:torch-padded-batch]
    b, nq = q.shape[:2]
    mask_k = attention_mask.bool()
    mask_q = mask_k[:, -nq:]  # the queries are the last nq positions (decoding with a cache)
    # flash-attn's (tokens, indices, cu_seqlens, max_seqlen, seqused): seqused is not needed
    q_p, idx_q, cu_q, max_q = unpad_input(q, mask_q)[:4]
    k_p, _idx_k, cu_k, max_k = unpad_input(k, mask_k)[:4]
    v_p = unpad_input(v, mask_k)[0]
    out = flash_attn_varlen_func(q_p, k_p, v_p, cu_q, cu_k, max_q, max_k, **opts)
    return pad_input(out, idx_q, b, nq), None
    # [/docs:torch-padded-batch]


def _packed_sequences(q, k, pos, cu_q, cu_k, max_q, max_k):
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of several sequences packed
    into one row without padding, or None: from transformers' ``cu_seq_lens_q/k`` and
    ``max_length_q/k`` keywords (``DataCollatorWithFlattening``; a missing maximum is read off
    the offsets, one offset tensor without the other is a ValueError), or, as transformers' own
    flash path does, from ``position_ids`` ``pos`` of a batch of one that restart (each sequence
    starts at the smallest position id)."""
    if (cu_q is None) != (cu_k is None):
        given, missing = ("cu_seq_lens_q", "cu_seq_lens_k") if cu_k is None else (
            "cu_seq_lens_k", "cu_seq_lens_q")
        raise ValueError(f"{missing}: expected a tensor with {given} (the offsets of a packed "
                         f"row come in pairs), got None")
    if cu_q is not None:
        cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
        return (cu_q, cu_k, int(max_q if max_q is not None else cu_q.diff().max()),
                int(max_k if max_k is not None else cu_k.diff().max()))
    if (pos is None or q.shape[0] != 1 or q.shape[1] == 1 or q.shape[1] != k.shape[1]
            or pos.numel() != q.shape[1]):
        return None
    pos = pos.reshape(-1)
    starts = (pos == pos.min()).nonzero().view(-1).to(torch.int32)
    if starts.numel() == 1:  # one sequence: the dense path
        return None
    cu = torch.cat((starts, torch.tensor([pos.numel()], dtype=torch.int32,
                                         device=starts.device)))
    longest = int(cu.diff().max())
    return cu, cu, longest, longest


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
        from numba_flash.install_hints import pip_extra

        raise ImportError(f"register_transformers needs transformers: "
                          f"{pip_extra('transformers')}") from exc
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name
