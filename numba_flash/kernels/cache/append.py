"""Writing new tokens' keys and values into a KV cache (the other half of decode).

Math
----
None: a copy (into e4m3 caches, ``FP8``: the e4m3 of ``x / descale``, saturated).  Sequence ``b``
holds ``L = cache_seqlens[b]`` tokens; its ``Nnew`` new tokens ``k_new[b, :, i]``, ``v_new[b, :,
i]`` go to positions ``t = L + i`` of the sequence, and the new length is ``L + Nnew``.  Position
``t`` lives, as in :mod:`numba_flash.kernels.decode.split_kv`, in

* a contiguous cache ``[Bc, Hkv, Nmax, d]``: row ``b`` (or ``cache_batch_idx[b]``), slot ``t``;
* a paged cache ``[num_blocks, Hkv, block_size, d]``: physical block ``block_table[b, t //
  block_size]``, slot ``t % block_size``.

Both are one layout here: a contiguous cache is ``Bc`` blocks of ``block_size = Nmax`` slots,
and ``cache_batch_idx`` is then a one-column block table (``PAGED`` with ``[B, 1]``).  The kernel
writes the caches through ``[rows, d]`` views of their memory, as decode reads them: slot
``slot`` of kv head ``kvh`` in block ``blk`` is row ``blk * block + kvh * head + slot * slot``
(``strides``: heads-first memory ``[.., Hkv, N, d]`` has ``(Hkv N, N, 1)``, tokens-first
``[.., N, Hkv, d]``, flash-attn's, ``(N Hkv, 1, Hkv)``;
:func:`numba_flash.frontend.cache_args.row_strides`).

Every write is checked on the device: a token whose position is negative or past the capacity
(``Nmax``, or ``max_blocks * block_size``), or whose table entry is outside ``[0,
num_blocks)``, is skipped, so an unvalidated call (device arrays, ``validate=False``) never
writes outside the cache.  The host validation of :func:`numba_flash.append_kv` rejects such
calls before the launch.

Grid / block
------------
grid = ``(B * Hkv * Nnew,)`` (x: up to 2**31 - 1 blocks), block = ``(THREADS,)``: block ``x``
copies token ``i = x % Nnew`` of kv head ``kvh = x // Nnew % Hkv`` of sequence ``b = x // Nnew
// Hkv``; thread ``t`` copies the head-dim elements ``t, t + THREADS, ...`` of K and V
(consecutive threads on consecutive elements: coalesced reads and writes).  Thread 0 of block
``(b, 0, 0)`` writes ``new_lens[b] = L + Nnew``, so the call is one launch.

Shared memory
-------------
None.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int64

from ..core.common import GPU_ROW_THREADS, grid_x, numba_array_type, row_threads
from ..core.elements import element_ops
from ..core.jit import kernel_jit
from ..ptx.fp8 import float32_to_e4m3

#: threads per block: the row kernels' (one per head-dim element up to 128 on a GPU)
GPU_THREADS = GPU_ROW_THREADS
default_threads = row_threads


def append_grid(b, hkv, nnew):
    """``(x,)``: one block per new token row; a ``ValueError`` past CUDA's x limit."""
    return grid_x("k_new", "B * Hkv * Nnew", b, hkv, nnew)


@functools.lru_cache(maxsize=None)
def append_kernel(THREADS, dtype, PAGED, FP8=False, WRITE_V=True):
    """Build (once per configuration) ``kernel(k_cache, v_cache, k_new, v_new, seqlens, table,
    new_lens, n_cache_blocks, block_size, strides, descale)``.

    ``k_cache``, ``v_cache``: the caches' ``[num_blocks * Hkv * block_size, d]`` views of their
    memory (written), ``strides`` int64 ``(block, head, slot)``: their rows between
    consecutive physical blocks, kv heads and slots (both caches alike);
    ``k_new``, ``v_new`` ``[B, Hkv, Nnew, d]``; ``seqlens`` and ``new_lens`` (written) ``[B]``
    ints; ``table`` ``[B, max_blocks]`` ints when ``PAGED`` (else unused, sequence ``b`` is
    block ``b``); ``n_cache_blocks`` (``num_blocks``, or ``Bc``) and ``block_size`` (``Nmax``
    for a contiguous cache) int32.  ``FP8``: e4m3 caches (their bytes, uint8): a new value
    ``x`` (``dtype``: float16, bfloat16 as its words, float32) is written as the e4m3 of ``x /
    descale[0 or 1, b, kvh]`` (K, V; float32 ``[2, B, Hkv]``), rounded to nearest even and
    saturated (:func:`~numba_flash.kernels.ptx.fp8.float32_to_e4m3`); else copied as it is
    (``descale`` unread).  ``WRITE_V=False``: MLA's latent cache, ``k_new`` the whole rows
    (``v_cache``, ``v_new`` unread).
    """
    load, _store = element_ops(dtype) if FP8 else (None, None)

    @kernel_jit
    def append_kv(k_cache, v_cache, k_new, v_new, seqlens, table, new_lens, n_cache_blocks,
                  block_size, strides, descale):
        tid = cuda.threadIdx.x
        bx = cuda.blockIdx.x
        hkv = k_new.shape[1]
        nnew = k_new.shape[2]
        d = k_new.shape[3]
        i = bx % nnew                         # my token among the new ones
        kvh = bx // nnew % hkv
        b = bx // nnew // hkv
        seqlen = seqlens[b]
        if tid == 0 and kvh == 0 and i == 0:
            new_lens[b] = seqlen + nnew
        # -- where token L + i lives; ok is False for a position or entry outside the cache
        t = int64(seqlen) + i                 # 64-bit: L near 2**31 cannot wrap
        ok = seqlen >= 0
        blk = int64(b)
        slot = t
        if PAGED:
            j = t // block_size               # >= 0 when ok
            ok = ok and j < table.shape[1]
            if ok:
                entry = table[b, j]
                ok = 0 <= entry and entry < n_cache_blocks
                blk = int64(entry)
            slot = t - j * block_size
        else:
            ok = ok and t < block_size
        # the token's row of the caches' memory (its order's strides)
        row = blk * strides[0] + int64(kvh) * strides[1] + slot * strides[2]
        if ok and FP8:                        # quantised: e4m3 of x / descale
            k_div = descale[0, b, kvh]
            v_div = descale[1, b, kvh]
            for c in range(tid, d, THREADS):
                k_cache[row, c] = float32_to_e4m3(float32(load(k_new[b, kvh, i, c])) / k_div)
            if WRITE_V:
                for c in range(tid, v_new.shape[3], THREADS):
                    v_cache[row, c] = float32_to_e4m3(float32(load(v_new[b, kvh, i, c])) / v_div)
        elif ok:                              # a bad token is skipped: nothing outside is written
            for c in range(tid, d, THREADS):
                k_cache[row, c] = k_new[b, kvh, i, c]
            if WRITE_V:
                for c in range(tid, v_new.shape[3], THREADS):   # d_v: v's own head dim (or d)
                    v_cache[row, c] = v_new[b, kvh, i, c]

    return append_kv


def kernel_args_types(dtype, int_dtype=np.int32, FP8=False):
    """Numba argument types of :func:`append_kernel` for ``int_dtype`` lengths and tables
    (``FP8``: uint8 caches)."""
    from numba import types

    cache = types.Array(types.uint8, 2, "C") if FP8 else numba_array_type(dtype, 2)
    return (cache, cache, numba_array_type(dtype, 4), numba_array_type(dtype, 4),
            numba_array_type(int_dtype, 1), numba_array_type(int_dtype, 2),
            numba_array_type(int_dtype, 1), types.int32, types.int32,
            types.UniTuple(types.int64, 3), numba_array_type(np.float32, 3))
