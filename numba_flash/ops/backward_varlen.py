"""``numba_flash.backward_varlen``: gradients of attention over a packed variable-length batch
(with a user's variant too: ``b`` the sequence, positions within it)."""

from __future__ import annotations

import numpy as np

from ..backend import on_simulator
from ..frontend import ArrayCall
from ..frontend.sparse import sparse_backward_varlen
from ..frontend.plans import plan_key, run_or_build
from ..frontend.validate import (ATTENTION_DTYPES, array_info, check_array, check_bool,
                                 check_grad_outs, check_same_dtype, check_same_kind,
                                 check_scale)
from ..frontend.variants import (check_packed_qkv, check_seqlens, check_sink, check_variants,
                                 reads_seqlens)
from ..kernels.core.common import acc_dtype
from ..philox import dropout_params
from ..frontend.aux_grad import aux_gradients, prepare_aux_grad
from ..frontend.backward_launch import launch_backward, sink_gradient
from ..frontend.empty import no_key_gradients


def _as_batch(x):
    """A packed ``[total, H, d]`` array as the kernels' one batch ``[1, H, total, d]`` (a strided
    view, given to the kernels as it is: they index through strides; a NumPy one is copied
    contiguous by its ``call.input`` only on a GPU)."""
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
                    kv_indices=None, validate=None, out=None):
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
    ``[1, H, total, d]`` batch: ``do``, ``q``, ``k``, ``v``, ``o`` and ``out`` are read and
    written in place through ``[1, H, total, d]`` strided views of the packed arrays (no copy:
    the kernels index every array by ``[b, h, row, column]``, so their builds for strided
    arrays take the views as they are), device arrays and, in the simulator, NumPy ones; so
    are packed views whose last dim is contiguous (a fused projection's ``qkv[:, i]`` of
    ``[total, 3, H, d]``, rows with gaps, a head slice).  NumPy arrays on a GPU are copied into
    that layout and the gradients back (O(total * d) copies next to the O(total * max_seqlen *
    d) work).

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

    ``out``: ``(dq, dk, dv)`` arrays of ``q``'s, ``k``'s and ``v``'s shapes and the inputs'
    dtype, of the inputs' kind, written in place and returned: C-contiguous, or views whose
    last dim is contiguous and no two elements share an address (the caller's data between
    their rows is left as it is); not with ``kv_indices`` yet (a ``ValueError`` naming
    ``out``).

    Device arrays (CuPy): no synchronisation.  ``validate`` (default ``True`` for NumPy inputs,
    ``False`` for device arrays) as in :func:`numba_flash.forward_varlen`: device
    ``cu_seqlens`` are read and checked on the host only with ``validate=True`` (or with a
    ``block_mask`` or ``kv_indices``); otherwise only their dtype and shape are checked, the
    launches are sized by ``max_seqlen_q`` / ``max_seqlen_k`` (at least the longest sequence)
    and a bad ``cu_seqlens`` is not caught: the kernels take its offsets as they are, so
    offsets past the packed totals or an unordered ``cu_seqlens`` read and write outside the
    arrays.  NumPy ``cu_seqlens`` are always checked.  A call of a signature seen before
    replays its launch plan (:mod:`numba_flash.frontend.plans`; work arrays kept, so with
    ``out`` a call allocates nothing); dropout, a ``block_mask``, a learnable sink (its
    gradient is summed with CuPy operations), ``aux_grad`` and ``validate=True`` run the
    ordinary path every call.
    """
    kw = dict(locals())   # the keyword arguments (the first thing done: only they are here)
    for name in ("do", "q", "k", "v", "o", "lse", "cu_seqlens_q", "cu_seqlens_k"):
        del kw[name]
    if (dropout_p == 0.0 and block_mask is None and aux_grad is None
            and type(aux_tensors) is tuple and (out is None or type(out) is tuple)):
        # one array as both cu_seqlens (self-attention): once (a plan's arrays never overlap)
        cu_k = None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k
        arrays = (do, q, k, v, o, lse, cu_seqlens_q, cu_k, alibi_slopes, learnable_sink,
                  kv_indices) + (out or (None, None, None)) + aux_tensors
        key = plan_key("backward_varlen", arrays, (
            max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic, window_size,
            softcap, score_mod, mask_mod, score_mod_grad, validate))
        if key is not None:
            return run_or_build(key, _backward_varlen, arrays, do, q, k, v, o, lse,
                                cu_seqlens_q, cu_seqlens_k, **kw)
    return _backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, **kw)


def _backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q,
                     max_seqlen_k, causal, window_size, softcap, alibi_slopes, softmax_scale,
                     dropout_p, seed, deterministic, score_mod, mask_mod, score_mod_grad,
                     block_mask, aux_tensors, aux_grad, learnable_sink, kv_indices, validate,
                     out):
    """:func:`backward_varlen`'s checks and launches (its ordinary path, and what a plan
    records)."""
    if kv_indices is not None and out is not None:
        raise ValueError("out: expected None with kv_indices (not taken there yet), got a "
                         "tuple")
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
    # NumPy cu_seqlens are read and checked on the host; device ones only when validated
    read = reads_seqlens(q, cu_seqlens_q, cu_seqlens_k, validate, block_mask, kv_indices)
    seqlens = check_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                            max_seqlen_k, read)
    cu_q, len_q, cu_k, len_k = seqlens[:4]
    n_seq, max_q, max_k = seqlens.n_seq, seqlens.max_q, seqlens.max_k
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
    var = check_variants(causal, window_size, softcap, alibi_slopes, n_seq, h, nq=max_q,
                         nk=max_k)  # window edges past the longest sequence: unbounded
    left, right, softcap, alibi = var.left, var.right, var.softcap, var.alibi
    variant = None
    if (score_mod is not None or mask_mod is not None or block_mask is not None or aux_tensors
            or score_mod_grad is not None or aux_grad is not None):
        from ..flex.launch import prepare_variant
        variant = prepare_variant(score_mod, mask_mod, aux_tensors, block_mask,
                                  score_mod_grad=score_mod_grad, needs_grad=True,
                                  compute_dtype=lse_dtype, shape=(n_seq, h, max_q, max_k),
                                  max_seqlens=(int(max_seqlen_q), int(max_seqlen_k)))
    aux = prepare_aux_grad(aux_grad, variant, dtype, dropout_p)
    if d_v != d and aux is not None:
        raise ValueError(f"aux_grad: expected None with a value head dim of its own ({d_v}, "
                         f"not {d}): the aux gradients take d_v == d only so far")
    # a device sink's values are checked with the lengths (reading them is a synchronisation)
    sink = check_sink(learnable_sink, h, check_values=read)
    outs = check_grad_outs(out, q, k, v, dtype, strided=True)
    if total_q == 0 or total_k == 0:   # every sequence empty on one side: no launch
        grads = no_key_gradients(do, q, k, v, o, lse, sink, aux, dtype)
        if outs is None:
            return grads
        for dst in outs:
            dst[...] = 0
        return outs + tuple(grads[3:])

    call = ArrayCall({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    shapes = [array_info(n, x)[0] for n, x in (("q", q), ("k", k), ("v", v))]
    # [1, H, total, d] views of the packed arrays (and of packed views whose last dim is
    # contiguous: a fused projection's qkv[:, i]), read and written through their strides
    in_place = call.on_device or on_simulator()
    if call.on_device:
        ins = [_as_batch(call.input(x, strided=True)) for x in (do, q, k, v, o)]
        packed = outs or tuple(call.empty(shape, dtype) for shape in shapes)
        lse_in = call.input(lse).reshape(1, h, total_q)   # C-contiguous, as lse[None] is not
    else:   # NumPy: the simulator's memory is the host's; on a GPU copied (and the gradients
        ins = [call.input(_as_batch(x), strided=True) for x in (do, q, k, v, o)]   # back)
        packed = (outs or tuple(np.empty(shape, dtype) for shape in shapes)) if in_place \
            else None
        lse_in = call.input(lse[None])
    batch_outs = tuple(_as_batch(x) for x in packed) if in_place else None
    lens = zip(len_q, len_k) if read else None   # (the simulator's time estimate)
    dq, dk, dv = launch_backward(
        call, *ins, lse_in, n_seq=n_seq, max_nq=max_q, max_nk=max_k, cu_q=call.input(cu_q),
        cu_k=call.input(cu_k), varlen=True, dtype=dtype, scale=scale, left=left, right=right,
        softcap=softcap, alibi=alibi, deterministic=deterministic, dropout_p=dropout_p,
        seed=seed, lens=lens, user_variant=variant,
        sink=None if sink is None else call.input(sink), outs=batch_outs)
    if call.on_device:
        grads = outs or tuple(call.result(x) for x in packed)
    elif in_place:   # (the simulator wrote the packed arrays themselves)
        grads = packed
    else:
        grads = tuple(_unpack(call.result(x)) for x in (dq, dk, dv))
        if outs is not None:   # the caller's out=: written, returned
            for dst, g in zip(outs, grads):
                dst[...] = g
            grads = outs
    if sink is not None:
        grads += (sink_gradient(do, o, lse, sink),)
    if aux is None:
        return grads
    return grads + aux_gradients(
        aux, *(_as_batch(x) for x in (do, q, k, v, o)), lse[None], cu_seqlens=(cu_q, cu_k),
        max_nq=max_q, max_nk=max_k, dtype=dtype, scale=scale, left=left, right=right,
        softcap=softcap, alibi=alibi)

