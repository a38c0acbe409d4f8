"""``numba_flash.backward``: attention gradients recomputed from the forward's ``lse``.

The launch sequence (:func:`numba_flash.frontend.backward_launch.launch_backward`) is what
``backward`` and :func:`numba_flash.backward_varlen` share (the same kernels; varlen passes the
packed arrays as one batch and the ``cu_seqlens``).
"""

from __future__ import annotations

from ..frontend import ArrayCall
from ..frontend.plans import plan_key, run_or_build
from ..frontend.kernel_args import check_backward_args
from ..frontend.variants import check_sink
from ..frontend.aux_grad import aux_gradients, prepare_aux_grad
from ..frontend.kernel_choice import choose_backward_kernel
from ..frontend.backward_launch import launch_backward, sink_gradient
from ..frontend.sparse import (
    as_dtype, check_sparse_options, kernel_indices, sparse_mask, validate_lists,
)
from ..frontend.kernel_args import kernel_variant
from ..frontend.sim_time import SimWork
from ..frontend.validate import array_info, check_grad_outs
from ..frontend.empty import is_empty, no_key_gradients
from ..kernels.backward.config import elem_threads, sparse_backward_config
from ..kernels.backward.simt import fold_grid, reduce_kernel
from ..kernels.backward.sparse import sparse_backward_kernel
from ..kernels.core.common import acc_dtype, cdiv


def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, deterministic=False,
             dropout_p=0.0, seed=0, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
             kernel="auto", score_mod=None, mask_mod=None, score_mod_grad=None,
             block_mask=None, aux_tensors=(), aux_grad=None, learnable_sink=None,
             kv_indices=None, out=None):
    """Gradients ``(dq, dk, dv)`` of attention for the upstream gradient ``do`` (with a
    ``learnable_sink``, ``(dq, dk, dv, dsink)``; with ``aux_grad``, the aux tensors' gradients
    after them).

    ``q``, ``o``, ``do`` are ``[B, H, Nq, d]``; ``k``, ``v`` are ``[B, Hkv, Nk, d]`` (GQA: ``H`` a
    multiple of ``Hkv``); ``lse`` ``[B, H, Nq]`` is the forward's log-sum-exp, float32 (float64
    for float64 inputs).  Pass the forward's own arguments: ``causal`` masks bottom-right (query
    ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``); ``window_size = (left, right)`` keeps keys
    ``i + Nk - Nq - left <= j <= i + Nk - Nq + right`` (-1: unbounded side; causal sets
    ``right = 0``); ``softcap > 0`` caps scores as ``softcap * tanh(s / softcap)``;
    ``alibi_slopes`` (float32 ``[H]`` or ``[B, H]``) subtracts ``slope * |i + Nk - Nq - j|``;
    ``softmax_scale`` defaults to ``1/sqrt(d)``.  Each gradient comes in its input's shape and
    dtype; ``dk`` and ``dv`` are summed over each GQA group.

    ``P`` is recomputed from ``lse`` (see :mod:`numba_flash.kernels.backward.simt`).  dQ is summed
    over K/V blocks with atomic adds by default; ``deterministic=True`` computes it in a second
    kernel without atomics, so two runs give bitwise identical gradients (a little slower).

    Dropout: pass the forward's ``dropout_p`` (a real in ``[0, 1)``) and ``seed`` (an integer in
    ``[0, 2**64)``), and its dropped ``o``; the kernels redraw the forward's keep-mask
    (:func:`numba_flash.dropout_mask`) from the seed and differentiate through
    ``keep / (1 - dropout_p)``.  ``dropout_p = 0`` runs exactly the kernels without dropout.

    ``kernel``: "simt" (the FMA kernels here, every dtype), "mma" (tensor cores: the dtypes of
    :mod:`numba_flash.ops.backward_mma`'s ``MMA_DTYPES``: float16 and bfloat16) or
    "auto" (mma for those dtypes on a GPU of compute capability >= 8.0 where available, simt
    otherwise).  bfloat16 (``ml_dtypes.bfloat16``) computes in float32 and returns bfloat16.

    Non-finite inputs: a row whose ``lse`` is NaN (a NaN in its ``q`` or a visible key) gets NaN
    gradients; a row that sees no key (``lse = -inf``) gets ``dq = 0`` and adds nothing to
    ``dk``/``dv``; keys a row does not see never affect it.

    A user's variant (the forward's ``score_mod``, ``mask_mod``, ``block_mask``, ``aux_tensors``,
    see :func:`numba_flash.forward`) needs ``score_mod_grad(score, b, h, q_idx, kv_idx, *aux)``,
    d score_mod / d score, with a ``score_mod`` (``dS`` is multiplied by it, at the score
    ``score_mod`` received).  Both kernel families take it (``kernel`` chooses as without one);
    with a ``block_mask`` the tiles it calls EMPTY are never loaded in either backward loop
    (the dK/dV kernel's Q tiles of a K/V tile, the dQ kernel's K/V tiles of a Q tile), and FULL
    ones skip the per-element ``mask_mod``.

    Gradients of the aux tensors (a learned bias table, learnable ALiBi slopes):
    ``aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, *aux)`` adds ``grad_score * d
    score_mod / d aux`` into ``grads`` (one zero-initialised array per aux tensor, its shape, the
    compute type) with :func:`numba_flash.flex.atomic_add`; ``grad_score`` is the gradient of
    the loss w.r.t. ``score_mod``'s output, ``score`` the score ``score_mod`` received.  The
    call then returns ``(dq, dk, dv, *aux_grads)`` (each in its aux tensor's float dtype); one
    more kernel (:mod:`numba_flash.frontend.aux_grad`), no dropout.  The adds are atomic, so
    ``deterministic=True`` does not make the aux gradients bitwise reproducible.

    ``learnable_sink``: the forward's sink logits (float32 ``[H]``, :func:`numba_flash.forward`);
    ``lse`` holds the sink, so ``P`` and the kernels are unchanged, and ``dsink_h = -sum_{b,i}
    exp(sink_h - lse_bhi) D_bhi`` (``D = rowsum(dO * O)``) is summed on the host in float64
    (float32 ``[H]``, the sink's kind).

    ``kv_indices``: the token-sparse forward's lists (:func:`numba_flash.forward`): the
    gradients of that forward, from the listed keys only (:mod:`numba_flash.kernels.backward.
    sparse`: ``dk`` / ``dv`` added with atomics, the SIMT kernel); with ``deterministic=True``
    the dense kernels with the lists as their ``mask_mod`` instead (bitwise reproducible, the
    dense ``O(Nq * Nk)`` work and an int8 table of listed keys,
    :func:`numba_flash.frontend.sparse.sparse_mask`).  Not with dropout, a ``score_mod``,
    ``mask_mod`` or ``block_mask``.

    Empty batches (:mod:`numba_flash.frontend.empty`): ``B``, ``Nq`` or ``Nk`` 0 is answered
    after every check, without a launch: ``dq``, ``dk``, ``dv`` (and the aux gradients) zero,
    ``dsink`` from its formula (0 for the forward's ``o`` and ``lse``); ``H = 0`` or ``d = 0``
    is a ``ValueError``.

    NumPy in, NumPy out; CuPy in, CuPy out (GPU backend).

    ``out``: ``(dq, dk, dv)`` arrays of the gradients' shapes and dtypes (of the inputs' kind)
    written in place and returned: C-contiguous, or views whose last dim is contiguous and
    whose elements do not overlap (flash-attn's ``[B, N, H, d]`` memory as its
    ``transpose(0, 2, 1, 3)``), written through their strides (with ``kv_indices``: ``dq`` by
    the gathering kernel, ``dk`` / ``dv`` cast into from their compute-type sums).  ``do``,
    ``q``, ``k``, ``v``, ``o``: such views are read where they lie by the SIMT, the
    tensor-core and the token-sparse kernels (docs/tensor-cores.md, strided views).  Device arrays:
    no synchronisation, and a call of a signature seen before replays its launch plan
    (:mod:`numba_flash.frontend.plans`; its work arrays are kept, so with ``out`` a call
    allocates nothing); dropout, a ``block_mask``, a learnable sink (its gradient is summed
    with CuPy operations) and ``aux_grad`` run the ordinary path every call.  A device array's
    values (ALiBi slopes, sink logits) are not read on the host (that would wait for the GPU):
    a NaN or inf slope or logit there gives NaN rows instead of the ``ValueError`` a host array
    gets.
    """
    kw = dict(causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
              dropout_p=dropout_p, seed=seed, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, kernel=kernel, score_mod=score_mod, mask_mod=mask_mod,
              score_mod_grad=score_mod_grad, block_mask=block_mask, aux_tensors=aux_tensors,
              aux_grad=aux_grad, learnable_sink=learnable_sink, kv_indices=kv_indices, out=out)
    if (dropout_p == 0.0 and block_mask is None and aux_grad is None
            and type(aux_tensors) is tuple and (out is None or type(out) is tuple)):
        arrays = (do, q, k, v, o, lse, alibi_slopes, learnable_sink, kv_indices) + (
            out or (None, None, None)) + aux_tensors
        key = plan_key("backward", arrays, (causal, softmax_scale, deterministic, window_size,
                                            softcap, kernel, score_mod, mask_mod,
                                            score_mod_grad))
        if key is not None:
            return run_or_build(key, _backward, arrays, do, q, k, v, o, lse, **kw)
    return _backward(do, q, k, v, o, lse, **kw)


def _backward(do, q, k, v, o, lse, *, causal, softmax_scale, deterministic, dropout_p, seed,
              window_size, softcap, alibi_slopes, kernel, score_mod, mask_mod, score_mod_grad,
              block_mask, aux_tensors, aux_grad, learnable_sink, kv_indices, out):
    """:func:`backward`'s checks and launches (its ordinary path, and what a plan records)."""
    if kv_indices is not None:   # the user's functions and dropout: not with the lists
        check_sparse_options(mask_mod=mask_mod, block_mask=block_mask, score_mod=score_mod,
                             score_mod_grad=score_mod_grad, aux_grad=aux_grad,
                             aux_tensors=aux_tensors, dropout_p=dropout_p)
    if kv_indices is not None and not deterministic:   # the gathering kernel
        return _sparse_backward(do, q, k, v, o, lse, kv_indices, causal=causal,
                                softmax_scale=softmax_scale, seed=seed,
                                window_size=window_size, softcap=softcap,
                                alibi_slopes=alibi_slopes, kernel=kernel,
                                learnable_sink=learnable_sink, out=out)
    if kv_indices is not None:   # deterministic: the dense kernels, the lists as their mask
        mask_mod, aux_tensors = sparse_mask(q, k, v, kv_indices)
    a = check_backward_args(do, q, k, v, o, lse, causal, softmax_scale, deterministic, dropout_p,
                            seed, window_size, softcap, alibi_slopes, score_mod, mask_mod,
                            score_mod_grad, block_mask, aux_tensors, empty=True)
    aux = prepare_aux_grad(aux_grad, a.variant, a.dtype, dropout_p)
    sink = check_sink(learnable_sink, a.h)
    if a.d_v != a.d and aux is not None:
        raise ValueError(f"aux_grad: expected None with a value head dim of its own ({a.d_v}, "
                         f"not {a.d}): the aux gradients take d_v == d only so far")
    choice = choose_backward_kernel(kernel, a.dtype)
    outs = check_grad_outs(out, q, k, v, a.dtype, strided=True)
    if is_empty(a.b, a.nq, a.nk):   # no row or no key: zero gradients, no launch
        return _no_key_answer(no_key_gradients(do, q, k, v, o, lse, sink, aux, a.dtype), outs)
    if choice.kernel == "mma":  # validated above, once: straight to the launches
        grads = choice.launcher()(
            do, q, k, v, o, lse, shape=a.shape, scale=a.scale, deterministic=a.deterministic,
            dropout_p=dropout_p, seed=seed, left=a.left, right=a.right, softcap=a.softcap,
            alibi=a.alibi, variant=a.variant, outs=outs)
    else:
        call = ArrayCall({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
        # the SIMT kernels index their arrays through their strides (Numba's own indexing):
        # views whose last dim is contiguous (flash-attn's [B, N, H, d] memory) as they lie
        ins = [call.input(x, strided=True) for x in (do, q, k, v, o)] + [call.input(lse)]
        dq, dk, dv = launch_backward(
            call, *ins, n_seq=a.b, max_nq=a.nq, max_nk=a.nk, cu_q=None, cu_k=None, varlen=False,
            dtype=a.dtype, scale=a.scale, left=a.left, right=a.right, softcap=a.softcap,
            alibi=a.alibi, deterministic=a.deterministic, dropout_p=dropout_p, seed=seed,
            user_variant=a.variant, sink=None if sink is None else call.input(sink), outs=outs)
        grads = (call.result(dq), call.result(dk), call.result(dv))
    if sink is not None:
        grads = tuple(grads) + (sink_gradient(do, o, lse, sink),)
    if aux is None:
        return grads
    return tuple(grads) + aux_gradients(aux, do, q, k, v, o, lse, max_nq=a.nq, max_nk=a.nk,
                                        dtype=a.dtype, scale=a.scale, left=a.left,
                                        right=a.right, softcap=a.softcap, alibi=a.alibi)


def _no_key_answer(grads, outs):
    """A backward over no row or no key: ``grads`` (:func:`~numba_flash.frontend.empty.
    no_key_gradients`), or the caller's ``outs`` zeroed in their place."""
    if outs is None:
        return grads
    for dst in outs:
        dst[...] = 0
    return outs + tuple(grads[3:])


def _sparse_backward(do, q, k, v, o, lse, kv_indices, *, causal, softmax_scale, seed,
                     window_size, softcap, alibi_slopes, kernel, learnable_sink, out):
    """:func:`backward` with ``kv_indices``, not ``deterministic``: the lists checked as the
    forward checks them (:func:`~numba_flash.frontend.sparse.sparse_mask`'s rules), then the
    token-sparse kernel (:mod:`numba_flash.kernels.backward.sparse`): ``dq`` written per block,
    ``dk`` / ``dv`` summed in compute-type buffers (atomics) and cast to the inputs' dtype.
    The kernel indexes its arrays through their strides (Numba's ``x[b, h, i, c]``): ``do``,
    ``q``, ``k``, ``v``, ``o`` and ``out``'s ``dq`` are read and written where they lie
    (flash-attn's ``[B, N, H, d]`` memory, a fused projection's slices), no copy."""
    if kernel not in ("auto", "simt"):
        raise ValueError(f"kernel: expected 'auto' or 'simt' with kv_indices (the token-sparse "
                         f"backward is a SIMT kernel), got {kernel!r}")
    a = check_backward_args(do, q, k, v, o, lse, causal, softmax_scale, False, 0.0, seed,
                            window_size, softcap, alibi_slopes, None, None, None, None, (),
                            empty=True)
    sink = check_sink(learnable_sink, a.h)
    validate_lists(kv_indices, a.b, a.hkv, a.nq, [a.nk] * a.b)
    outs = check_grad_outs(out, q, k, v, a.dtype, strided=True)
    if is_empty(a.b, a.nq, a.nk):
        return _no_key_answer(no_key_gradients(do, q, k, v, o, lse, sink, None, a.dtype), outs)
    acc_t = acc_dtype(a.dtype)
    call = ArrayCall({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse,
                      "kv_indices": kv_indices})
    ins = [call.input(x, strided=True) for x in (q, k, v, o, do)] + [call.input(lse)]
    outs = (None, None, None) if outs is None else outs
    dq = call.output(outs[0], (a.b, a.h, a.nq, a.d), a.dtype, strided=True)
    dk_acc = call.zeros((a.b, a.hkv, a.nk, a.d), acc_t)
    dv_acc = call.zeros((a.b, a.hkv, a.nk, a.d_v), acc_t)
    cfg = sparse_backward_config(max(a.d, a.d_v), a.dtype, softcap=a.softcap > 0.0,
                                 alibi=a.alibi is not None)
    va = kernel_variant(call, acc_t, a.scale, a.left, a.right, a.softcap, a.alibi)
    topk = int(array_info("kv_indices", kv_indices)[0][3])
    blocks = a.b * a.hkv * a.nq * cdiv(a.h // a.hkv, cfg.ROWS)
    call.launch(sparse_backward_kernel(cfg), (blocks,), (cfg.THREADS,), *ins,
                kernel_indices(call, kv_indices), dq, dk_acc, dv_acc, va,
                work=SimWork("backward", blocks * max(topk, cfg.THREADS) * cfg.ROWS,
                             blocks * cfg.ROWS * cfg.HEAD_DIM))
    grads = (call.result(dq),) + tuple(_cast_into(call, acc, dst, a.dtype)
                                       for acc, dst in ((dk_acc, outs[1]), (dv_acc, outs[2])))
    if sink is not None:
        grads += (sink_gradient(do, o, lse, sink),)
    return grads


def _cast_into(call, acc, out, dtype):
    """``dk`` or ``dv`` from its compute-type accumulator ``acc``: without ``out`` the
    accumulator itself in ``dtype`` (cast on its own device); with the caller's ``out`` (a
    C-contiguous array or a strided view) the cast written into it where it lies, by the
    SIMT backward's reduce kernel (its group of one: a plain cast through strides)."""
    if out is None:
        return as_dtype(call.result(acc), dtype)
    dst = call.output(out, acc.shape, dtype, strided=True)
    threads = elem_threads()
    ba, heads, n, width = acc.shape
    tiles = cdiv(n * width, threads)
    call.launch(reduce_kernel(threads, acc_dtype(dtype), dtype), fold_grid(tiles, ba, heads),
                (threads,), acc, dst, tiles,
                work=SimWork("backward_reduce", ba * heads * n * width))
    return call.result(dst)
