"""``numba_flash.backward_varlen``: gradients of attention over a packed variable-length batch
(with a user's variant too: ``b`` the sequence, positions within it)."""

from __future__ import annotations

import numpy as np

from ..frontend import ArrayCall
from ..frontend.sparse import sparse_backward_varlen
from ..frontend.validate import (ATTENTION_DTYPES, check_array, check_bool, check_same_dtype,
                                 check_same_kind, check_scale)
from ..frontend.variants import (check_cu_seqlens_pair, check_packed_qkv, check_sink,
                                 check_variants)
from ..kernels.core.common import acc_dtype
from ..philox import dropout_params
from ..frontend.aux_grad import aux_gradients, prepare_aux_grad
from ..frontend.backward_launch import launch_backward, sink_gradient
from ..frontend.empty import no_key_gradients


def _as_batch(x):
    """A packed ``[total, H, d]`` array as the kernels' one batch ``[1, H, total, d]`` (a view;
    the launch makes it contiguous)."""
    return x[None].transpose(0, 2, 1, 3)


def _unpack(x):
    """A result ``[1, H, total, d]`` back to packed ``[total, H, d]`` (NumPy or CuPy)."""
    xp = np
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy as xp  # a CuPy result means CuPy inputs on the GPU backend
    return xp.ascontiguousarray(x[0].transpose(1, 0, 2))


def backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q,
                    max_seqlen_k, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, softmax_scale=None, dropout_p=0.0, seed=0,
                    deterministic=False, score_mod=None, mask_mod=None, score_mod_grad=None,
                    block_mask=None, aux_tensors=(), aux_grad=None, learnable_sink=None,
                    kv_indices=None):
    """Gradients ``(dq, dk, dv)`` of :func:`numba_flash.forward_varlen`, packed like the inputs
    (with the forward's ``learnable_sink``, ``(dq, dk, dv, dsink)``: see
    :func:`numba_flash.backward`).  ``kv_indices``: the token-sparse forward's packed lists
    (:func:`numba_flash.forward_varlen`): :func:`numba_flash.backward` with them over a
    right-aligned padded batch (:func:`numba_flash.frontend.sparse.sparse_backward_varlen`).

    ``q``, ``o``, ``do`` are ``[total_q, H, d]``, ``k``, ``v`` ``[total_k, Hkv, d]`` (GQA: ``H`` a
    multiple of ``Hkv``), ``lse`` ``[H, total_q]`` (float32; float64 for float64 inputs); sequence
    ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` against rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k``/``v`` (int32 ``[B + 1]``, 0 first, the packed
    length last, non-decreasing; ``max_seqlen_q``/``max_seqlen_k`` at least the longest).  Each
    sequence is independent, with its own bottom-right alignment for ``causal`` and
    ``window_size``; ``softcap``, ``alibi_slopes`` (``[H]`` or ``[B, H]``), ``softmax_scale``
    and ``deterministic`` as in :func:`numba_flash.backward`.  An empty sequence is allowed; a
    query row of a sequence with no keys gets ``dq = 0``, keys no query sees ``dk = dv = 0``.

    Dropout: sequence ``b`` draws element ``(b, h, i, j)`` (``i``, ``j`` within the sequence)
    of :func:`numba_flash.dropout_mask`, i.e. ``dropout_mask(seed, B, H, nq_b, nk_b, p)[b]``.

    The kernels are those of :func:`numba_flash.backward`, reading the packed batch as one
    ``[1, H, total, d]`` batch; the NumPy (CuPy) inputs are transposed into that layout once and
    the gradients back (O(total * d) copies next to the O(total * max_seqlen * d) work).

    A user's variant: the forward's ``score_mod``, ``mask_mod``, ``block_mask`` and
    ``aux_tensors`` (:func:`numba_flash.forward_varlen`: ``b`` the sequence index, ``q_idx`` /
    ``kv_idx`` positions within the sequence, a block mask for ``B`` sequences and the longest
    sequence's ``Nq``, ``Nk``) and, with a ``score_mod``, ``score_mod_grad(score, b, h, q_idx,
    kv_idx, *aux)``, d score_mod / d score (a ``score_mod`` without it is a ``ValueError``), as
    in :func:`numba_flash.backward`: the SIMT kernels apply the mask per element (a block
    mask's EMPTY tiles are not skipped in the backward yet).  ``aux_grad`` as in
    :func:`numba_flash.backward` (``b`` the sequence, positions within it): the call then
    returns ``(dq, dk, dv, *aux_grads)``.

    Empty batches: ``total_q = 0`` or ``total_k = 0`` (every sequence empty on that side) is
    answered after every check, without a launch: zero gradients (``dsink`` and the aux
    gradients as :func:`numba_flash.backward` gives them there).
    """
    qkv = check_packed_qkv(q, k, v, value_dim=True, empty=True)
    total_q, h, total_k = qkv.total_q, qkv.h, qkv.total_k
    d, d_v, dtype = qkv.d, qkv.d_v, qkv.dtype
    q_shape = (total_q, h, d_v)       # do and o: v's head dim (d, or its own)
    do_shape, do_dtype = check_array("do", do, 3, ATTENTION_DTYPES, (0,))
    o_shape, o_dtype = check_array("o", o, 3, ATTENTION_DTYPES, (0,))
    check_same_dtype({"q": dtype, "do": do_dtype, "o": o_dtype})
    for name, shape in (("do", do_shape), ("o", o_shape)):
        if shape != q_shape:
            what = "q" if d_v == d else "q with v's head dim"
            raise ValueError(f"{name}: expected the shape of {what} {q_shape}, got {shape}")
    lse_dtype = acc_dtype(dtype)
    lse_shape, _ = check_array("lse", lse, 2, (lse_dtype,), (1,))
    if lse_shape != (h, total_q):
        raise ValueError(f"lse: expected shape {(h, total_q)} ([H, total_q] of q), got "
                         f"{lse_shape}")
    check_same_kind({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse,
                     "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k})
    cu_q, len_q, cu_k, len_k = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                                                     max_seqlen_q, max_seqlen_k)
    n_seq = len(len_q)
    if kv_indices is not None:   # token-sparse: numba_flash.backward over a padded batch
        return sparse_backward_varlen(
            do, q, k, v, o, lse, cu_q, cu_k, kv_indices, causal=causal,
            softmax_scale=softmax_scale, deterministic=deterministic, dropout_p=dropout_p,
            seed=seed, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
            score_mod=score_mod, mask_mod=mask_mod, score_mod_grad=score_mod_grad,
            block_mask=block_mask, aux_tensors=aux_tensors, aux_grad=aux_grad,
            learnable_sink=learnable_sink)
    causal = check_bool("causal", causal)
    deterministic = check_bool("deterministic", deterministic)
    scale = check_scale(softmax_scale, d, dtype)
    dropout_params(dropout_p, seed)  # checks dropout_p and seed
    var = check_variants(
        causal, window_size, softcap, alibi_slopes, n_seq, h, nq=int(len_q.max()),
        nk=int(len_k.max()))  # window edges past the longest sequence: unbounded
    left, right, softcap, alibi = var.left, var.right, var.softcap, var.alibi
    variant = None
    if (score_mod is not None or mask_mod is not None or block_mask is not None or aux_tensors
            or score_mod_grad is not None or aux_grad is not None):
        from ..flex.launch import prepare_variant
        variant = prepare_variant(score_mod, mask_mod, aux_tensors, block_mask,
                                  score_mod_grad=score_mod_grad, needs_grad=True,
                                  compute_dtype=lse_dtype,
                                  shape=(n_seq, h, int(len_q.max()), int(len_k.max())),
                                  max_seqlens=(int(max_seqlen_q), int(max_seqlen_k)))
    aux = prepare_aux_grad(aux_grad, variant, dtype, dropout_p)
    if d_v != d and aux is not None:
        raise ValueError(f"aux_grad: expected None with a value head dim of its own ({d_v}, "
                         f"not {d}): the aux gradients take d_v == d only so far")
    sink = check_sink(learnable_sink, h)
    if total_q == 0 or total_k == 0:   # every sequence empty on one side: no launch
        return no_key_gradients(do, q, k, v, o, lse, sink, aux, dtype)

    call = ArrayCall({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    ins = [call.input(_as_batch(x)) for x in (do, q, k, v, o)]
    lse_in = call.input(lse[None])
    dq, dk, dv = launch_backward(
        call, *ins, lse_in, n_seq=n_seq, max_nq=int(len_q.max()), max_nk=int(len_k.max()),
        cu_q=call.input(cu_q), cu_k=call.input(cu_k), varlen=True, dtype=dtype, scale=scale,
        left=left, right=right, softcap=softcap, alibi=alibi, deterministic=deterministic,
        dropout_p=dropout_p, seed=seed, lens=zip(len_q, len_k), user_variant=variant,
        sink=None if sink is None else call.input(sink))
    grads = tuple(_unpack(call.result(x)) for x in (dq, dk, dv))
    if sink is not None:
        grads += (sink_gradient(do, o, lse, sink),)
    if aux is None:
        return grads
    return grads + aux_gradients(
        aux, *(_as_batch(x) for x in (do, q, k, v, o)), lse[None], cu_seqlens=(cu_q, cu_k),
        max_nq=int(len_q.max()), max_nk=int(len_k.max()), dtype=dtype, scale=scale, left=left,
        right=right, softcap=softcap, alibi=alibi)
