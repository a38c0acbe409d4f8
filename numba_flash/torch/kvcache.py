"""flash-attn 2's ``flash_attn_with_kvcache`` and the paged form of ``flash_attn_varlen_func``
(``block_table``) on numba_flash's kernels, for torch tensors.

Layouts (flash-attn's): ``q [batch_size, seqlen_q, nheads, headdim]``; a contiguous cache
``k_cache``, ``v_cache`` ``[batch_size_cache, seqlen_cache, nheads_k, headdim]``; a paged one
``[num_blocks, page_block_size, nheads_k, headdim]`` with ``block_table`` int32 ``[batch_size,
max_num_blocks_per_seq]`` (any ``page_block_size``: flash-attn asks for a multiple of 256);
new tokens ``k``, ``v`` ``[batch_size, seqlen_new, nheads_k, headdim]``.  The caches are handed
to :func:`numba_flash.decode` as their heads-first views (``cache.transpose(1, 2)``,
``[blocks, nheads_k, slots, headdim]``: its documented axis order), whose strides say that the
memory is tokens-first; the kernels read (and the append writes) flash-attn's memory where it
lies, through its strides (:func:`numba_flash.frontend.cache_args.cache_memory`): no copy, on
the CPU and on the device path alike, for flash-attn's layout, a heads-first buffer passed as
``cache.transpose(1, 2)``, or any other order of the three outer axes with a contiguous last
dim.

:func:`flash_attn_with_kvcache` is one :func:`numba_flash.decode` call (rotary on ``q`` and
``k``, the append of ``k``, ``v`` into the caches, the split-KV decode), which validates every
index and length on the host first for CPU tensors (for CUDA tensors only with
``validate=True``: it reads them back, a synchronisation).  The caches are written in place (the
appended tokens and nothing else changes), where they lie; no other tensor is written.  On
the device path (CUDA tensors: :mod:`numba_flash.torch.bridge`; no synchronisation, ``out``
allocated by torch) a cache whose memory is no such order (rows with gaps between them, a
last dim that is not contiguous) is copied by torch to a heads-first buffer every call, and
back after an append (``O(cache)`` traffic per call).

:func:`paged_varlen` is ``flash_attn_varlen_func(..., block_table=...)``: packed queries over a
paged cache in the tiled forward kernel (:func:`numba_flash.forward_varlen`), forward only as
flash-attn (a backward through it raises).
"""

from __future__ import annotations

import numbers

import torch

import numba_flash
from numba_flash.frontend.cache_args import HEADS_FIRST, in_order, memory_order

from . import bridge, checks

__all__ = ["flash_attn_with_kvcache", "paged_varlen"]

_CACHE = "(batch_size_cache, seqlen_cache, nheads_k, headdim)"
_PAGED = "(num_blocks, page_block_size, nheads_k, headdim)"
_INTS = (torch.int32, torch.int64)


def _int_tensor(name, x, ndim, layout, empty_axes=(0,)):
    """An integer tensor of rank ``ndim`` (int32 as flash-attn; int64 taken too) or None; its
    ``empty_axes`` may be 0 (``batch_size``: an empty batch)."""
    if x is None:
        return None
    checks.check_tensor(name, x, ndim, layout, dtypes=_INTS, empty_axes=empty_axes)
    return x


def _seqlens(cache_seqlens, b, capacity, device):
    """``cache_seqlens``: an int (every sequence), an integer tensor ``(batch_size,)``, or None
    (every sequence fills its cache, as flash-attn)."""
    if cache_seqlens is None:
        return bridge.empty((b,), torch.int32, device).fill_(capacity)
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        return bridge.empty((b,), torch.int32, device).fill_(int(cache_seqlens))
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens: expected an int or an int32 torch.Tensor (batch_size,), "
                        f"got {type(cache_seqlens).__name__}")
    return _int_tensor("cache_seqlens", cache_seqlens, 1, "(batch_size,)")


def _num_splits(num_splits):
    """flash-attn's ``num_splits``: 0 (a heuristic) -> None, else the count."""
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits: expected an int (0: automatic), got "
                        f"{type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits: expected an int >= 0 (0: automatic), got {num_splits}")
    return None if num_splits == 0 else int(num_splits)


def _decode_cache(cache, writes, order=None):
    """``(array, copy, order)``: the heads-first array the kernels read (and, with ``writes``,
    write), the tensor to copy back into ``cache`` afterwards (None when the array is
    ``cache``'s own memory) and the array's memory order, for :func:`numba_flash.decode` and
    the paged prefill (:func:`numba_flash.forward_varlen` with ``block_table``), which read a
    cache in its own memory order (:func:`~numba_flash.frontend.cache_args.cache_memory`): the
    heads-first view of ``cache``'s own memory (flash-attn's tokens-first layout, a
    heads-first buffer, any order of the outer axes with a contiguous last dim), no copy; on
    the host a strided view (numba_flash writes the result back into it).  On the device
    path a cache in no such order, or not in ``order`` (the key cache's: a value cache shares
    its row numbering), is torch's copy in that order (heads-first when None), written back
    when ``writes``; ``order``: the memory order of the array given."""
    heads_first = cache.transpose(1, 2)
    own = memory_order(tuple(heads_first.shape), heads_first.stride(), 1)
    if not bridge.is_device(cache.device):
        return bridge.as_heads_first(cache), None, own
    if own is not None and (order is None or in_order(tuple(heads_first.shape),
                                                      heads_first.stride(), 1, order)):
        return bridge.device_array(heads_first), None, order or own
    order = order or HEADS_FIRST
    back = tuple(order.index(a) for a in range(3)) + (3,)
    tmp = bridge.contiguous(heads_first.permute(*order, 3)).permute(*back)
    return bridge.device_array(tmp), tmp if writes else None, order


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, learnable_sink=None, head_dim_v=None,
                            q_descale=None, k_descale=None, v_descale=None, validate=None):
    """flash-attn's ``flash_attn_with_kvcache``: attention of ``q`` against a KV cache, after
    appending ``k``, ``v`` to it in place (rotated by ``rotary_cos``/``rotary_sin`` first).

    * ``k_cache``, ``v_cache``: ``(batch_size_cache, seqlen_cache, nheads_k, headdim)``, or
      paged ``(num_blocks, page_block_size, nheads_k, headdim)`` with ``block_table`` int32
      ``(batch_size, max_num_blocks_per_seq)``;
    * ``k``, ``v`` (optional): ``(batch_size, seqlen_new, nheads_k, headdim)``, written into
      the caches at positions ``cache_seqlens[b], cache_seqlens[b] + 1, ...`` (in place) before
      the attention, which then sees ``cache_seqlens + seqlen_new`` keys;
    * ``rotary_cos``, ``rotary_sin``: ``(seqlen_ro, rotary_dim / 2)`` (with ``k``, ``v`` only):
      ``k`` rotated at positions ``cache_seqlens[b] + i``; ``q`` at ``cache_seqlens[b] + i``
      when ``causal`` or a window is set, else all at ``cache_seqlens[b]``;
      ``rotary_interleaved``: GPT-J pairs (default True) or GPT-NeoX halves;
    * ``cache_seqlens``: int or int32 ``(batch_size,)`` (None: the whole cache);
      ``cache_batch_idx``: int32 ``(batch_size,)``, the cache row of each sequence (contiguous
      caches); ``cache_leftpad``: int32 ``(batch_size,)``, where each sequence's keys start;
    * ``softmax_scale``, ``causal`` (bottom-right), ``window_size``, ``softcap``,
      ``alibi_slopes`` (float32 ``(nheads,)`` or ``(batch_size, nheads)``): as
      :func:`numba_flash.torch.flash_attn_func`;
    * ``num_splits``: 0 (automatic), 1 (no split) or the number of KV splits;
    * ``learnable_sink`` (keyword): float32 ``(nheads,)`` attention-sink logits (gpt-oss), added
      once per row (in the split-KV merge, not per split); no gradient here.
    * a value head dim of its own: ``v_cache`` (and ``v``) with a last dim ``headdim_v`` of its
      own; MLA's absorbed decode: ``v_cache=None`` and ``head_dim_v`` (keyword): the value is
      the first ``head_dim_v`` columns of ``k_cache`` (one latent cache, ``headdim`` up to 576;
      no ``k``, ``v``; :func:`numba_flash.decode`, whose tensor-core kernel it runs for
      float16 / bfloat16 head dims that are multiples of 64).
    * an fp8 cache (FA3's keywords): ``k_cache``, ``v_cache`` ``torch.float8_e4m3fn`` beside a
      float16 / bfloat16 / float32 ``q``, ``k``, ``v``; ``k_descale``, ``v_descale`` float32
      ``(batch_size, nheads_k)`` (None: 1); ``q_descale`` must be None (``q`` is not fp8
      here); MLA's latent cache in e4m3 (``v_cache=None``: ``k_descale`` scales both).
      :func:`numba_flash.decode`'s e4m3 cache, the tensors passed as their bytes with
      ``kv_cache_dtype="fp8_e4m3"`` (CPU or CUDA alike; the CUDA path has not run on a GPU).

    Returns ``out (batch_size, seqlen_q, nheads, headdim)``, and with ``return_softmax_lse``
    also ``softmax_lse (batch_size, nheads, seqlen_q)`` (float32; float64 for float64; ``-inf``
    for a row that sees no key, where flash-attn stores +inf).  No gradient (as flash-attn).
    An empty batch (``batch_size`` or ``seqlen_q`` 0) gives empty outputs, a cache that holds
    no key (``seqlen_cache = 0``, a paged one of no block; every length 0) ``out = 0`` and
    ``softmax_lse = -inf`` (or the sink's logit), without a launch (:func:`numba_flash.decode`).
    ``validate`` (keyword; None: True for CPU tensors, False for CUDA ones): every index and
    length is checked on the host before anything is launched or written (a ``ValueError``
    naming the argument: flash-attn raises ``RuntimeError``).  On CUDA tensors that reads them
    back (a synchronisation every call), so by default they are not checked there: a bad one
    gives NaN rows and nothing outside the caches is read or written
    (:func:`numba_flash.decode`'s ``validate``), and the call never waits for the GPU.
    """
    qs = checks.check_tensor("q", q, 4, "(batch_size, seqlen_q, nheads, headdim)",
                             empty_axes=checks.DENSE_EMPTY)
    paged = block_table is not None
    layout = _PAGED if paged else _CACHE
    cache_dtypes = checks.DTYPES + ((bridge.E4M3_TORCH,) if bridge.E4M3_TORCH else ())
    cache_empty = (0,) if paged else (0, 1)   # no block; no row or no slot
    ks = checks.check_tensor("k_cache", k_cache, 4, layout, cache_dtypes, cache_empty)
    fp8 = k_cache.dtype == bridge.E4M3_TORCH
    named = {"q": q} if fp8 else {"q": q, "k_cache": k_cache}
    vs = ks
    if v_cache is not None:
        vs = checks.check_tensor("v_cache", v_cache, 4, layout, cache_dtypes, cache_empty)
        if fp8 and v_cache.dtype != k_cache.dtype:
            raise TypeError(f"v_cache: expected dtype float8_e4m3fn (the dtype of k_cache), got "
                            f"{str(v_cache.dtype).replace('torch.', '')}")
        if not fp8:
            named["v_cache"] = v_cache
        if vs[:3] != ks[:3]:
            raise ValueError(f"v_cache: expected the shape of k_cache {ks} but for the last "
                             f"dim (headdim_v), got {vs}")
    elif head_dim_v is None:
        raise ValueError("head_dim_v: expected the value head dim with v_cache=None (MLA's "
                         "absorbed decode: the first head_dim_v columns of k_cache), got None")
    elif k is not None or v is not None:
        raise ValueError("k: expected None with v_cache=None (a latent cache is appended to "
                         "with numba_flash.append_kv first), got a tensor")
    if (k is None) != (v is None):
        raise ValueError(f"{'v' if v is None else 'k'}: expected a tensor with "
                         f"{'k' if v is None else 'v'} (both or neither), got None")
    if k is not None:
        new = "(batch_size, seqlen_new, nheads_k, headdim)"
        kns = checks.check_tensor("k", k, 4, new, empty_axes=(0,))
        if checks.check_tensor("v", v, 4, new, empty_axes=(0,)) != kns[:3] + (vs[3],):
            raise ValueError(f"v: expected shape {kns[:3] + (vs[3],)} (k's, with v_cache's "
                             f"headdim), got {tuple(v.shape)}")
        if (kns[0], kns[2], kns[3]) != (qs[0], ks[2], ks[3]):
            raise ValueError(f"k: expected shape {new} = ({qs[0]}, seqlen_new, {ks[2]}, {ks[3]}) "
                             f"(batch_size from q, nheads_k and headdim from k_cache), got {kns}")
        named.update(k=k, v=v)
    checks.check_same_dtype(named)
    for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if x is not None:
            checks.check_tensor(name, x, 2, "(seqlen_ro, rotary_dim / 2)")
            named[name] = x
    ints = {"block_table": _int_tensor("block_table", block_table, 2,
                                       "(batch_size, max_num_blocks_per_seq)", (0, 1)),
            "cache_batch_idx": _int_tensor("cache_batch_idx", cache_batch_idx, 1,
                                           "(batch_size,)"),
            "cache_leftpad": _int_tensor("cache_leftpad", cache_leftpad, 1, "(batch_size,)")}
    checks.check_alibi(alibi_slopes)
    checks.check_sink(learnable_sink, qs[2])
    if q_descale is not None:
        raise ValueError("q_descale: expected None (q is float16, bfloat16 or float32 here; only "
                         "the cache is fp8), got a tensor")
    if fp8:   # the caches as their bytes (any device, any strides: a view, written in place),
        k_cache = k_cache.view(torch.uint8)     # read as e4m3 under kv_cache_dtype
        v_cache = None if v_cache is None else v_cache.view(torch.uint8)
    capacity = ks[1] * (block_table.shape[1] if paged else 1)
    seqlens = _seqlens(cache_seqlens, qs[0], capacity, q.device)
    device = checks.check_device({**named, **ints, "cache_seqlens": seqlens,
                                  "k_cache": k_cache, "v_cache": v_cache,   # (fp8: not in named)
                                  "alibi_slopes": alibi_slopes, "learnable_sink": learnable_sink,
                                  "k_descale": k_descale, "v_descale": v_descale})
    splits = _num_splits(num_splits)
    checks.check_options(qs[3], 0.0, softmax_scale, causal, window_size, softcap, False, False)

    on_device = bridge.is_device(device)
    if validate is None:
        validate = not on_device
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected None, True or False, got {type(validate).__name__}")

    def arr(x):
        return None if x is None else bridge.packed(x)

    with bridge.on_device(device):
        kc, k_copy, order = _decode_cache(k_cache, k is not None)
        vc, v_copy, _ = ((None, None, None) if v_cache is None
                         else _decode_cache(v_cache, k is not None, order))
        d_v = vs[3] if v_cache is not None else head_dim_v
        # q, k, v and out in flash-attn's [B, N, H, d] memory where they lie (the split-KV
        # kernels and the append read and write them through their strides; MLA's tensor-core
        # kernel copies q and writes a new o copied into out)
        res = bridge.SeqFirstOut((qs[0], qs[1], qs[2], d_v), q.dtype, device, strided=True)
        lse_t, lse_a = bridge.lse_out((qs[0], qs[2], qs[1]), q)
        o, lse = numba_flash.decode(
            bridge.heads_first_view(q), kc, vc, cache_seqlens=arr(seqlens),
            block_table=arr(block_table), causal=causal, softmax_scale=softmax_scale,
            window_size=window_size, softcap=softcap, alibi_slopes=arr(alibi_slopes),
            num_splits=splits, return_lse=True, validate=validate,
            k_new=None if k is None else bridge.heads_first_view(k),
            v_new=None if v is None else bridge.heads_first_view(v),
            rotary_cos=arr(rotary_cos), rotary_sin=arr(rotary_sin),
            rotary_interleaved=rotary_interleaved, cache_batch_idx=arr(cache_batch_idx),
            cache_leftpad=arr(cache_leftpad),
            learnable_sink=arr(learnable_sink), head_dim_v=head_dim_v,
            k_descale=arr(k_descale), v_descale=arr(v_descale),
            kv_cache_dtype="fp8_e4m3" if fp8 else "auto", out=res.array, lse_out=lse_a)
        out = res.result()
        lse = lse_t
        for cache, copy in ((k_cache, k_copy), (v_cache, v_copy)):
            if copy is not None:  # a cache in no memory order the kernels read: written back
                bridge.copy_into(cache, copy.transpose(1, 2))
    return (out, lse) if return_softmax_lse else out


class PagedVarlenFunc(torch.autograd.Function):
    """``(out, lse)`` of the paged prefill (``run()``), with a backward that raises (flash-attn
    has none)."""

    @staticmethod
    def forward(ctx, run, q, k, v):
        out, lse = run()
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("flash_attn_varlen_func: there is no gradient with block_table "
                                  "(paged K/V), as in flash-attn; pass packed k, v for training")


def _gather(cache, block_table, cu_k):
    """The keys of each sequence gathered from a paged cache into packed ``[total_k, nheads_k,
    headdim]`` (host, for ``S_dmask``: testing only)."""
    bs = cache.shape[1]
    parts = []
    cu = cu_k.tolist()
    for b in range(len(cu) - 1):
        t = torch.arange(cu[b + 1] - cu[b])
        parts.append(cache[block_table[b].long().cpu()[t // bs], t % bs])
    return torch.cat(parts)


def paged_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 softmax_scale, causal, window_size, softcap, alibi_slopes, return_attn_probs,
                 block_table):
    """``flash_attn_varlen_func(..., block_table=...)``: ``q (total_q, nheads, headdim)``
    against paged caches ``k``, ``v`` ``(num_blocks, page_block_size, nheads_k, headdim)``;
    sequence ``b`` reads keys ``0 .. cu_seqlens_k[b + 1] - cu_seqlens_k[b] - 1`` of its table
    row (flash-attn's meaning of ``cu_seqlens_k`` with a table).  Forward only."""
    from .ops import _varlen_s_dmask

    checks.check_tensor("q", q, 3, checks.PACKED, empty_axes=checks.PACKED_EMPTY)
    ks = checks.check_tensor("k", k, 4, _PAGED, empty_axes=(0,))   # (no block: no key)
    if checks.check_tensor("v", v, 4, _PAGED, empty_axes=(0,)) != ks:
        raise ValueError(f"v: expected the shape of k {ks}, got {tuple(v.shape)}")
    checks.check_same_dtype({"q": q, "k": k, "v": v})
    _int_tensor("block_table", block_table, 2, "(batch_size, max_num_blocks_per_seq)", (1,))
    checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q)
    checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k)
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"{name}: expected an int, got {type(m).__name__}")
    opts = checks.check_options(q.shape[-1], dropout_p, softmax_scale, causal, window_size,
                                softcap, False, return_attn_probs)
    checks.check_alibi(alibi_slopes)
    device = checks.check_device({"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q,
                                  "cu_seqlens_k": cu_seqlens_k, "block_table": block_table,
                                  "alibi_slopes": alibi_slopes})
    p, scale, window = opts.dropout_p, opts.softmax_scale, opts.window_size
    causal, softcap, probs = opts.causal, opts.softcap, opts.return_attn_probs
    seed = int(bridge.draw_seed(p)[0])

    def run():
        from .ops import varlen_out

        with bridge.on_device(device):
            out = bridge.empty(q.shape, q.dtype, device) if varlen_out() else None
            # the caches in their own memory order (flash-attn's tokens-first), q where it
            # lies (a fused projection's slice: read through its strides): no copy
            kc, _, order = _decode_cache(k, False)
            vc = _decode_cache(v, False, order)[0]
            o, lse = numba_flash.forward_varlen(
                bridge.packed_view(q), kc, vc,
                *bridge.packed_arrays(cu_seqlens_q, cu_seqlens_k),
                max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                window_size=window, softcap=softcap, softmax_scale=scale,
                alibi_slopes=bridge.optional_array(alibi_slopes), dropout_p=p, seed=seed,
                return_lse=True, block_table=bridge.packed(block_table),
                **({} if out is None else {"out": bridge.as_array(out)}))
            return (bridge.to_tensor(o, device) if out is None else out,
                    bridge.to_tensor(lse, device))

    out, lse = PagedVarlenFunc.apply(run, q, k, v)
    if not probs:
        return out
    if p > 0.0:
        s_dmask = _varlen_s_dmask(q, _gather(k, block_table, cu_seqlens_k.cpu()), cu_seqlens_q,
                                  cu_seqlens_k, max_seqlen_q, max_seqlen_k, seed, p, scale,
                                  causal, window, softcap, alibi_slopes)
    else:
        s_dmask = q.new_empty((0,))
    return out, lse, s_dmask
