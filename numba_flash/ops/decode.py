"""``numba_flash.decode`` (FlashDecoding over a contiguous or paged KV cache) and
``numba_flash.merge_states`` (the log-sum-exp merge of partial attention states).

The decode runs in two launches: the split-KV kernel (:mod:`numba_flash.kernels.decode`) writes
one partial ``(o, lse)`` per split, the combine kernel (:mod:`numba_flash.kernels.merge`) merges
them into the output dtype.  The combine always runs, even with one split (then it is an exact
identity up to the final rounding): one code path, and the same bits whatever the batch holds.

Split policy (batch invariance)
-------------------------------
Each sequence's split boundaries come from its own length only: with ``num_splits=None`` a
split covers a fixed number of tokens (512 on the GPU, like vLLM's partitions; 16 in the
simulator), with an explicit ``num_splits=S`` a split covers ``cdiv(L, S)`` tokens rounded up to
a whole tile.  The grid spans the largest split count in the batch; splits past a sequence's end
write empty partials (``lse = -inf``), which the combine skips.  So one sequence's result is
bitwise the same alone or beside any other sequences (flash-attn issue #1897).
"""

from __future__ import annotations

import numbers

import numpy as np
from numba import cuda

from ..frontend import ArrayCall
from ..frontend.validate import (
    FLOAT_DTYPES, INT_DTYPES, check_array, check_bool, check_same_dtype, check_same_kind,
    check_scale, is_device_array,
)
from ..kernels.common import acc_dtype, cdiv, compute_type
from ..kernels.decode import (
    decode_split_kernel, default_split_tokens, default_tiles, padded_head_dim,
)
from ..kernels.merge import default_threads as merge_threads, merge_kernel


def _host_ints(x):
    """Host copy of a small integer array (NumPy as is; a device array is copied to the host).

    cache_seqlens and block_table are validated value by value before any launch, which needs
    their values on the host: for device arrays this is a small device-to-host copy.
    """
    if is_device_array(x):
        return cuda.as_cuda_array(x).copy_to_host()
    return np.asarray(x)


def _check_num_splits(num_splits):
    if num_splits is None:
        return None
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits: expected an int or None, got {type(num_splits).__name__}")
    if num_splits < 1:
        raise ValueError(f"num_splits: expected an int >= 1 or None, got {num_splits}")
    return int(num_splits)


def _check_lengths_and_table(seqlens, table, n_cache, block_size, n_blocks, paged):
    """Value checks on the host copies; ``n_cache`` is Nmax (contiguous) or num_blocks (paged)."""
    bad = np.flatnonzero(seqlens < 1)
    if bad.size:
        i = bad[0]
        raise ValueError(f"cache_seqlens: expected every entry >= 1, got {seqlens[i]} at index {i}")
    if not paged:
        bad = np.flatnonzero(seqlens > n_cache)
        if bad.size:
            i = bad[0]
            raise ValueError(f"cache_seqlens: expected every entry <= Nmax = {n_cache} (k_cache "
                             f"dim 2), got {seqlens[i]} at index {i}")
        return
    # [docs:paged-validation]
    max_blocks = table.shape[1]
    live = (seqlens.astype(np.int64) + block_size - 1) // block_size
    bad = np.flatnonzero(live > max_blocks)
    if bad.size:
        i = bad[0]
        raise ValueError(
            f"cache_seqlens: entry {i} = {seqlens[i]} needs {live[i]} blocks of {block_size} "
            f"tokens, but block_table has {max_blocks} per sequence")
    for b in range(table.shape[0]):
        entries = table[b, :live[b]].astype(np.int64)
        out = np.flatnonzero((entries < 0) | (entries >= n_blocks))
        if out.size:
            j = out[0]
            raise ValueError(
                f"block_table: expected entries covering live tokens in [0, {n_blocks}) "
                f"(num_blocks of k_cache), got {entries[j]} at [{b}, {j}]")
    # [/docs:paged-validation]


def decode(q, k_cache, v_cache, *, cache_seqlens, block_table=None, causal=False,
           softmax_scale=None, num_splits=None, return_lse=False):
    """Attention of a few new query tokens against a KV cache (FlashDecoding split-KV).

    * ``q``: ``[B, H, d]`` (one token per sequence) or ``[B, H, Nq, d]``.
    * contiguous cache (``block_table=None``): ``k_cache``, ``v_cache`` ``[B, Hkv, Nmax, d]``;
      sequence ``b`` uses positions ``0 .. cache_seqlens[b] - 1``.
    * paged cache: ``k_cache``, ``v_cache`` ``[num_blocks, Hkv, block_size, d]`` and an integer
      ``block_table`` ``[B, max_blocks]``: token ``t`` of sequence ``b`` is in physical block
      ``block_table[b, t // block_size]`` at slot ``t % block_size``.  Entries past a sequence's
      live blocks are ignored (may be -1).
    * ``cache_seqlens``: integer ``[B]``, each in ``[1, Nmax]`` (paged: within the table).
    * ``causal``: bottom-right, query token ``i`` of ``Nq`` sees key ``j`` iff
      ``j <= i + L - Nq``.  GQA/MQA: query head ``h`` reads kv head ``h // (H // Hkv)``.
    * ``num_splits``: ``None`` (fixed tokens per split, from each sequence's own length), ``1``
      (no split) or any ``S >= 1``.

    Returns ``o`` in ``q``'s shape and dtype, and with ``return_lse`` also ``lse`` (``[B, H]`` or
    ``[B, H, Nq]``, float32; float64 for float64 inputs).  NumPy in, NumPy out; CuPy in, CuPy out.
    """
    qs, dtype = check_array("q", q, (3, 4))
    ks, kd = check_array("k_cache", k_cache, 4)
    vs, vd = check_array("v_cache", v_cache, 4)
    dtype = check_same_dtype({"q": dtype, "k_cache": kd, "v_cache": vd})
    paged = block_table is not None
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "cache_seqlens": cache_seqlens}
    if paged:
        arrays["block_table"] = block_table
    check_same_kind(arrays)
    single = len(qs) == 3
    b, h, nq, d = (qs[0], qs[1], 1, qs[2]) if single else qs
    if vs != ks:
        raise ValueError(f"v_cache: expected the shape of k_cache {ks}, got {vs}")
    n_cache, hkv, n_slots, dk = ks
    if dk != d:
        raise ValueError(f"k_cache: expected head dim {d} (from q), got {dk}")
    if d > 256:
        raise ValueError(f"q: expected head dim 1..256, got {d}")
    if h % hkv:
        raise ValueError(f"k_cache: expected a number of kv heads that divides the {h} query "
                         f"heads of q (GQA), got {hkv}")
    if not paged and n_cache != b:
        raise ValueError(f"k_cache: expected batch size {b} (from q) in dim 0 of a contiguous "
                         f"cache, got {n_cache}")
    (ls,), _ = check_array("cache_seqlens", cache_seqlens, 1, INT_DTYPES)
    if ls != b:
        raise ValueError(f"cache_seqlens: expected shape ({b},) (batch of q), got ({ls},)")
    if paged:
        ts, _ = check_array("block_table", block_table, 2, INT_DTYPES)
        if ts[0] != b:
            raise ValueError(f"block_table: expected {b} rows (batch of q), got shape {ts}")
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    scale = check_scale(softmax_scale, d)
    num_splits = _check_num_splits(num_splits)

    call = ArrayCall(arrays)  # rejects device arrays in the simulator, before any copy
    seqlens = _host_ints(cache_seqlens).astype(np.int64)
    table = _host_ints(block_table) if paged else None
    _check_lengths_and_table(seqlens, table, n_slots if not paged else n_cache,
                             n_slots, n_cache, paged)

    # -- launch shape and split policy (each sequence's split size from its own length)
    HEAD_DIM = padded_head_dim(d)
    threads, block_m, block_n = default_tiles(dtype, HEAD_DIM)
    # [docs:decode-split-policy]
    if num_splits is None:
        split_size = np.full(b, default_split_tokens(), np.int64)
        n_splits = int(cdiv(seqlens, split_size).max())
    else:
        split_size = cdiv(cdiv(seqlens, num_splits), block_n) * block_n
        n_splits = num_splits
    # [/docs:decode-split-policy]
    rows = b * h * nq
    acc_t = acc_dtype(dtype)

    dq = call.input(q[:, :, None, :] if single else q)
    dk_ = call.input(k_cache)
    dv_ = call.input(v_cache)
    # [docs:contiguous-as-paged]
    # a contiguous cache is the paged layout with one block of Nmax slots per sequence
    table32 = table.astype(np.int32) if paged else np.arange(b, dtype=np.int32)[:, None]
    # [/docs:contiguous-as-paged]
    d_table = cuda.to_device(np.ascontiguousarray(table32), stream=call.stream)
    d_len = cuda.to_device(seqlens.astype(np.int32), stream=call.stream)
    d_split = cuda.to_device(split_size.astype(np.int32), stream=call.stream)
    o_part = call.empty((n_splits, rows, d), acc_t)
    lse_part = call.empty((n_splits, rows), acc_t)
    kernel = decode_split_kernel(threads, block_m, block_n, HEAD_DIM, dtype)
    # [docs:decode-grid]
    grid = (n_splits, b * hkv, cdiv((h // hkv) * nq, block_m))
    # [/docs:decode-grid]
    call.launch(kernel, grid, (threads,), dq, dk_, dv_, d_table, d_len, d_split, o_part,
                lse_part, compute_type(dtype)(scale), np.int32(causal and nq > 1))
    # (Nq = 1 sees every key even when causal: the mask is skipped then)

    o = call.empty((rows, d), dtype)
    lse = call.empty((rows,), acc_t)
    mthreads = merge_threads()
    call.launch(merge_kernel(mthreads, acc_t, dtype), (rows,), (mthreads,), o_part, lse_part,
                o, lse)
    out = call.result(o).reshape(qs)
    if not return_lse:
        return out
    return out, call.result(lse).reshape(qs[:-1])


def merge_states(o_parts, lse_parts):
    """Merge partial attention states over disjoint key sets, stacked on axis 0.

    ``o_parts`` ``[P, ..., d]`` (float16/32/64), ``lse_parts`` ``[P, ...]`` (float32; float64
    for float64 ``o_parts``).  Returns ``(o, lse)`` of shapes ``[..., d]`` (``o_parts``' dtype)
    and ``[...]``: ``lse = log sum_p exp(lse_p)``, ``o = sum_p exp(lse_p - lse) o_p``.  Parts
    with ``lse_p = -inf`` contribute nothing; if all are ``-inf``, ``o = 0`` and
    ``lse = -inf``.  Used by cascade / ring attention and by :func:`decode`'s combine step.
    """
    os_, dtype = check_array("o_parts", o_parts, tuple(range(2, 10)), FLOAT_DTYPES)
    acc_t = acc_dtype(dtype)
    ls_, ldt = check_array("lse_parts", lse_parts, tuple(range(1, 9)), FLOAT_DTYPES)
    if ldt != acc_t:
        raise TypeError(f"lse_parts: expected dtype {acc_t} (for o_parts of dtype {dtype}), "
                        f"got {ldt}")
    if ls_ != os_[:-1]:
        raise ValueError(f"lse_parts: expected shape {os_[:-1]} (o_parts.shape[:-1]), got {ls_}")
    check_same_kind({"o_parts": o_parts, "lse_parts": lse_parts})
    n_parts, d = os_[0], os_[-1]
    rows = int(np.prod(os_[1:-1], dtype=np.int64))

    call = ArrayCall({"o_parts": o_parts, "lse_parts": lse_parts})
    d_o = call.input(o_parts).reshape(n_parts, rows, d)
    d_l = call.input(lse_parts).reshape(n_parts, rows)
    o = call.empty((rows, d), dtype)
    lse = call.empty((rows,), acc_t)
    threads = merge_threads()
    call.launch(merge_kernel(threads, dtype, dtype), (rows,), (threads,), d_o, d_l, o, lse)
    return call.result(o).reshape(os_[1:]), call.result(lse).reshape(ls_[1:])
