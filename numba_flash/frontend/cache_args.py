"""The KV cache's host pieces shared by :func:`numba_flash.append_kv`,
:func:`numba_flash.apply_rotary` and :func:`numba_flash.decode` (which appends ``k_new`` /
``v_new`` and rotates them): the caches' memory order (:func:`cache_memory`: heads-first,
tokens-first or any other order of the three outer axes, read where it lies), the shape and
value checks of an append, its launch and write-back, and the rotary tables' checks and launch;
and the paged prefill's table checks (:func:`numba_flash.forward_varlen` with ``block_table``,
16-bit and e4m3).
"""

from __future__ import annotations

import itertools
import sys
from typing import NamedTuple

import numpy as np

from ..kernels.cache.append import append_grid, append_kernel
from ..kernels.cache.append import default_threads as append_threads
from .arrays import host_ints, kernel_ints
from .fp8 import FP8_QUERY_DTYPES
from .kernel_args import device_constant, no_descale
from .sim_time import SimWork
from .validate import (
    ATTENTION_DTYPES, INT32_MAX, INT_DTYPES, array_info, check_array, check_same_dtype,
    is_device_array,
)
from ..kernels.cache.rotary import default_threads as rotary_threads
from ..kernels.cache.rotary import rotary_grid, rotary_kernel


def cumulative_total(name, cu_seqlens):
    """The last entry of ``cu_seqlens`` (the packed length it must end with), or -1 where the
    array is not one :func:`~numba_flash.frontend.variants.check_cu_seqlens` accepts (which
    then says why)."""
    shape, dtype = array_info(name, cu_seqlens)
    if dtype.kind not in "iu" or len(shape) != 1 or shape[0] < 2:
        return -1
    return int(host_ints(cu_seqlens)[-1])


def check_prefill_table(block_table, b):
    """``block_table``: an integer ``[B, max_blocks]`` array; returns its shape."""
    ts, _ = check_array("block_table", block_table, 2, INT_DTYPES)
    if ts[0] != b:
        raise ValueError(f"block_table: expected {b} rows (B, from cu_seqlens_q), got shape "
                         f"{ts}")
    return ts


def validate_prefill_table(table, len_k, block_size, n_blocks):
    """Host checks of a paged prefill's table (``forward_varlen(..., block_table=)``, 16-bit and
    e4m3): room for each sequence's keys, and every entry that holds one of them in ``[0,
    num_blocks)``; a ``ValueError`` naming ``block_table``."""
    max_blocks = table.shape[1]
    need = (np.asarray(len_k, np.int64) + block_size - 1) // block_size
    for b, n in enumerate(need):
        if n > max_blocks:
            raise ValueError(
                f"block_table: sequence {b} has {int(len_k[b])} keys (cu_seqlens_k), which need "
                f"{int(n)} blocks of {block_size} tokens, but block_table has {max_blocks} per "
                f"sequence")
        entries = table[b, :n]
        out = np.flatnonzero((entries < 0) | (entries >= n_blocks))
        if out.size:
            j = int(out[0])
            raise ValueError(
                f"block_table: expected the entries holding a sequence's keys in [0, "
                f"{n_blocks}) (num_blocks, dim 0 of k), got {int(entries[j])} at [{b}, {j}]")


def check_writable_cache(name, x):
    """A cache written in place: a writable NumPy array, or a device array the kernels write
    where it lies (:func:`cache_memory`: its last dim contiguous and its three outer axes, in
    some order, C-contiguous; another one would be copied and the writes lost)."""
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            raise ValueError(f"{name}: expected a writable array (it is written in place), got "
                             "a read-only one")
    elif is_device_array(x):
        shape, strides, itemsize = _geometry(x)
        if memory_order(shape, strides, itemsize) is None:
            raise ValueError(f"{name}: expected a device array whose memory is its axes in some "
                             f"order of the first three, the last contiguous (heads-first "
                             f"[.., Hkv, N, d], tokens-first [.., N, Hkv, d]: it is written in "
                             f"place), got shape {tuple(shape)} and strides {tuple(strides)}")


# [docs:cache-memory-order]
#: a cache's axes ``(blocks, kv heads, slots)`` from the outermost in memory: heads-first
#: ``[num_blocks, Hkv, block_size, d]`` (numba_flash's documented order) and tokens-first
#: ``[num_blocks, block_size, Hkv, d]`` (flash-attn's, vLLM's), passed as its
#: ``transpose(0, 2, 1, 3)`` view
HEADS_FIRST = (0, 1, 2)
TOKENS_FIRST = (0, 2, 1)
_ORDERS = (HEADS_FIRST, TOKENS_FIRST) + tuple(
    o for o in itertools.permutations(range(3)) if o not in (HEADS_FIRST, TOKENS_FIRST))


def in_order(shape, strides, itemsize, order):
    """Whether a ``[n, Hkv, N, d]`` array's ``transpose(order + (3,))`` is C-contiguous (byte
    ``strides``, or element strides with ``itemsize`` 1; an axis of one element takes any
    stride; an empty array is in every order)."""
    if any(int(n) == 0 for n in shape):
        return True
    want = itemsize
    for ax in reversed(tuple(order) + (3,)):
        if int(shape[ax]) != 1 and int(strides[ax]) != want:
            return False
        want *= int(shape[ax])
    return True


def memory_order(shape, strides, itemsize):
    """The order of a ``[n, Hkv, N, d]`` cache's outer axes in memory (outermost first) for
    which its ``transpose(order + (3,))`` is C-contiguous (:func:`in_order`; heads-first
    first, then tokens-first, where axes of one element make several true), or None: the
    memory is not one such order (gaps between rows, or a last dim that is not
    contiguous)."""
    for order in _ORDERS:
        if in_order(shape, strides, itemsize, order):
            return order
    return None


def row_strides(shape, order):
    """``(block, head, slot)``: the rows (``d`` elements) between consecutive physical blocks,
    kv heads and slots of a ``[n, Hkv, N, d]`` cache whose memory is in ``order``: the key row
    of slot ``s`` of kv head ``h`` in block ``n`` is row ``n * block + h * head + s * slot``
    of its memory (heads-first: ``(Hkv N, N, 1)``; tokens-first: ``(N Hkv, 1, Hkv)``)."""
    strides = [0, 0, 0]
    rows = 1
    for ax in reversed(order):
        strides[ax] = rows
        rows *= int(shape[ax])
    return tuple(strides)
# [/docs:cache-memory-order]


class CacheMemory(NamedTuple):
    """The caches as the kernels take them (:func:`cache_memory`): ``k``, ``v`` the callers'
    arrays in their memory order (C-contiguous views, or a copy where no order is one; ``v``
    None for a latent cache), ``order`` that order and ``strides`` the :func:`row_strides`
    the kernels read them through (launch parameters: :func:`kernel_strides`).  With
    ``gapped`` (:func:`gapped_rows`: views whose rows have gaps between them, a fused
    projection's ``k`` / ``v`` slices), ``k`` and ``v`` are the rows of the callers' memory
    from each view's first element (C-contiguous ``[rows, d]`` and ``[rows, d_v]`` views, no
    copy), ``strides`` the views' own row strides and ``order`` None."""

    k: object
    v: object
    order: tuple
    strides: tuple
    gapped: bool = False


def _geometry(x):
    """``(shape, byte strides, itemsize)`` of a NumPy or device array (a
    ``__cuda_array_interface__`` without strides is C-contiguous)."""
    strides = getattr(x, "strides", None)
    if strides is None:
        cai = x.__cuda_array_interface__
        itemsize = np.dtype(cai["typestr"]).itemsize
        strides = cai.get("strides")
        if strides is None:
            strides, acc = [], itemsize
            for n in reversed(cai["shape"]):
                strides.insert(0, acc)
                acc *= n
        return tuple(cai["shape"]), tuple(strides), itemsize
    return tuple(x.shape), tuple(strides), np.dtype(x.dtype).itemsize


def check_same_order(k_cache, v_cache):
    """Device caches written in place (an append) share a memory order (the kernels number
    both caches' rows alike, :func:`cache_memory`; a value cache in another order would be
    copied and its writes lost)."""
    if v_cache is None or not is_device_array(k_cache):
        return
    order = memory_order(*_geometry(k_cache)) or HEADS_FIRST
    if not in_order(*_geometry(v_cache), order):
        raise ValueError(f"v_cache: expected the memory order of k_cache (outer axes "
                         f"{order}, as its strides say: both are written in place through "
                         f"one row numbering), got strides {_geometry(v_cache)[1]}")


def _in_order(x, order):
    """``x`` transposed to ``order`` (no copy); ``x`` itself for heads-first."""
    return x if order == HEADS_FIRST else x.transpose(order + (3,))


def cache_memory(k_cache, v_cache=None, gaps=False):
    """:class:`CacheMemory` of a call's caches (``[n, Hkv, N, d]``, ``v_cache`` ``[.., d_v]`` or
    None): both read in ``k_cache``'s memory order where it is one (:func:`memory_order`),
    ``v_cache`` in the same order (they share the kernels' row numbering: a value cache in
    another order is transposed to the key cache's and copied by :meth:`ArrayCall.input`);
    else, with ``gaps`` (a caller that only reads the caches, and hands the kernels host
    arrays where they lie: the simulator, or device arrays), views whose rows have gaps between
    them read where they lie (:func:`gapped_rows`); else heads-first, the array
    :meth:`ArrayCall.input` copies to C order.  Heads-first too for another producer's arrays
    (no ``transpose``) and an order whose elements inside a block do not fit int32 (``((Hkv -
    1) head + (N - 1) slot + 1) d``: the kernels' offsets in a block; heads-first's are what
    the kernels always assumed)."""
    shape, strides, itemsize = _geometry(k_cache)
    order = memory_order(shape, strides, itemsize)
    if order is None and gaps:
        mem = gapped_rows(k_cache, v_cache)
        if mem is not None:
            return mem
    if order is None or not all(hasattr(x, "transpose") for x in (k_cache, v_cache)
                                if x is not None):
        order = HEADS_FIRST
    rows = row_strides(shape, order)
    if not _in_block_fits(shape, rows, shape[3]):
        order = HEADS_FIRST
        rows = row_strides(shape, order)
    return CacheMemory(_in_order(k_cache, order),
                       None if v_cache is None else _in_order(v_cache, order), order, rows)


def _in_block_fits(shape, rows, width):
    """Whether the kernels' offsets inside a block, ``((Hkv - 1) head + (N - 1) slot + 1)
    width`` elements (``rows``: the cache's row strides), fit int32."""
    return ((int(shape[1]) - 1) * rows[1] + (int(shape[2]) - 1) * rows[2] + 1) * int(width) \
        < 2**31


def _row_library(x):
    """The library whose arrays :func:`gapped_rows` views as rows: NumPy, the stand-in device
    or CuPy (its own ndarray); None for another producer's arrays (a Numba device array, a
    ``__cuda_array_interface__`` object: copied as before)."""
    if isinstance(x, np.ndarray):
        return np
    if type(x).__module__ == "numba_flash.standin":
        from .. import standin

        return standin
    cupy = sys.modules.get("cupy")
    if cupy is not None and type(x) is cupy.ndarray:
        return cupy
    return None


def pitch_strides(shape, strides, itemsize):
    """The row strides ``(block, head, slot)`` of a non-empty ``[n, Hkv, N, d]`` view read as
    rows of its ``d`` elements where it lies: its last dim contiguous and its three outer
    strides (bytes) whole multiples of a row, ``d`` elements, none negative (an axis of one
    element takes 1: its index is always 0, and a slot stride of 1 keeps the kernels' build
    without ``SLOT_STRIDE``); None otherwise (a copy)."""
    d = int(shape[3])
    if any(int(n) == 0 for n in shape) or (d > 1 and int(strides[3]) != itemsize):
        return None
    pitch = d * itemsize
    rows = []
    for n, st in zip(shape[:3], strides[:3]):
        st = int(st)
        if int(n) == 1:
            rows.append(1)
        elif st < 0 or st % pitch:
            return None
        else:
            rows.append(st // pitch)
    return tuple(rows)


def _as_rows(xp, x, n_rows, width):
    """``x``'s memory from its first element as C-contiguous rows ``[n_rows, width]`` (a view
    of the same memory: NumPy's ``as_strided``, or a device array over the same pointer)."""
    itemsize = np.dtype(x.dtype).itemsize
    if xp is np:
        return np.lib.stride_tricks.as_strided(x, (n_rows, width), (width * itemsize, itemsize),
                                               writeable=False)
    mem = xp.cuda.UnownedMemory(int(x.data.ptr), n_rows * width * itemsize, x)
    return xp.ndarray((n_rows, width), x.dtype, memptr=xp.cuda.MemoryPointer(mem, 0))


def gapped_rows(k_cache, v_cache=None):
    """:class:`CacheMemory` (``gapped``) of caches whose rows have gaps between them, read where
    they lie: a fused projection's ``k`` / ``v`` slices (``qkv[:, :, 1]`` of a ``[B, N, 3, H,
    d]`` buffer as ``[B, H, N, d]``), a ``[.., :d]`` slice of wider rows.  Each cache's outer
    strides whole rows of its head dim (:func:`pitch_strides`), both caches' alike (they share
    the kernels' row numbering), its first element aligned to its dtype, NumPy, stand-in or
    CuPy arrays, and the offsets inside a block int32; the rows handed on are the memory from
    each view's first element to its last element (row ``n block + h head + s slot`` is
    element ``(n block + h head + s slot) d`` of it).  None where any of that fails (the caller
    copies, as before)."""
    caches = [x for x in (k_cache, v_cache) if x is not None]
    xp = _row_library(k_cache)
    geometry = [_geometry(x) for x in caches]
    rows = [pitch_strides(*g) for g in geometry]
    shape = geometry[0][0]
    if xp is None or rows[0] is None or any(r != rows[0] for r in rows) or \
            any(_row_library(x) is not xp for x in caches):
        return None
    ptrs = [x.__array_interface__["data"][0] if xp is np else int(x.data.ptr) for x in caches]
    if any(p % g[2] for p, g in zip(ptrs, geometry)) or \
            not _in_block_fits(shape, rows[0], max(int(g[0][3]) for g in geometry)):
        return None
    n_rows = sum((int(n) - 1) * r for n, r in zip(shape[:3], rows[0])) + 1
    views = [_as_rows(xp, x, n_rows, int(g[0][3])) for x, g in zip(caches, geometry)]
    return CacheMemory(views[0], views[1] if v_cache is not None else None, None, rows[0],
                       True)


def check_new_kv(k_new, v_new, b, hkv, d, dtype, k_name="k_new", v_name="v_new", d_v=None,
                 dtype_of="k_cache"):
    """``k_new`` ``[B, Hkv, Nnew, d]``, ``v_new`` ``[B, Hkv, Nnew, d_v]`` (``d_v``: the value
    cache's head dim, default ``d``) in ``dtype``, the dtype of ``dtype_of`` (the caches'; an
    e4m3 cache's new values: ``q``'s in decode, float16 / bfloat16 / float32 in append_kv, where
    ``dtype`` is None); returns ``Nnew``."""
    d_v = d if d_v is None else d_v
    ks, kd = check_array(k_name, k_new, 4, ATTENTION_DTYPES)
    vs, vd = check_array(v_name, v_new, 4, ATTENTION_DTYPES)
    if dtype is None and kd.name not in FP8_QUERY_DTYPES:
        raise TypeError(f"{k_name}: expected dtype in {FP8_QUERY_DTYPES} for an e4m3 cache, got "
                        f"{kd.name}")
    check_same_dtype({k_name: kd, v_name: vd} if dtype is None else
                     {dtype_of: dtype, k_name: kd, v_name: vd})
    if ks[0] != b or ks[1] != hkv or ks[3] != d:
        raise ValueError(f"{k_name}: expected shape [B, Hkv, Nnew, d] = [{b}, {hkv}, Nnew, {d}] "
                         f"(B from cache_seqlens, Hkv and d from k_cache), got {ks}")
    if vs != ks[:3] + (d_v,):
        raise ValueError(f"{v_name}: expected shape {ks[:3] + (d_v,)} ({k_name}'s, with the "
                         f"head dim of v_cache), got {vs}")
    return ks[2]


def check_batch_idx(cache_batch_idx, b, paged):
    """``cache_batch_idx``: integer ``[B]`` (contiguous caches only, as flash-attn)."""
    if cache_batch_idx is None:
        return
    if paged:
        raise ValueError("cache_batch_idx: expected None with a paged cache (block_table "
                         "already says where each sequence lives), got an array")
    (n,), _ = check_array("cache_batch_idx", cache_batch_idx, 1, INT_DTYPES)
    if n != b:
        raise ValueError(f"cache_batch_idx: expected shape ({b},) (the batch), got ({n},)")


def first_bad(mask):
    idx = np.flatnonzero(mask)
    return int(idx[0]) if idx.size else None


def check_batch_rows(cbi, n_cache):
    """``cache_batch_idx``'s host values: each a row of the cache, in ``[0, Bc)``."""
    j = first_bad((cbi < 0) | (cbi >= n_cache))
    if j is not None:
        raise ValueError(f"cache_batch_idx: expected entries in [0, {n_cache}) (dim 0 of "
                         f"k_cache), got {int(cbi[j])} at index {j}")


def validate_append(seqlens, table, cbi, nnew, n_cache, n_slots, paged):
    """Host value checks of an append, before anything is written: lengths >= 0, room for
    ``Nnew`` more tokens (contiguous: ``L + Nnew <= Nmax``; paged: the table has the blocks,
    the entries the new tokens go to are in ``[0, num_blocks)`` and give each new token a slot
    of its own, :func:`check_paged_writes`), ``cache_batch_idx`` entries in ``[0, Bc)`` and
    distinct (two sequences must not write one cache row)."""
    seqlens = np.asarray(seqlens)
    i = first_bad(seqlens < 0)
    if i is not None:
        raise ValueError(f"cache_seqlens: expected every entry >= 0, got {int(seqlens[i])} at "
                         f"index {i}")
    new = seqlens.astype(np.float64) + nnew           # exact for any int64 entry that matters
    if not paged:
        i = first_bad(new > n_slots)
        if i is not None:
            raise ValueError(
                f"k_cache: too small: sequence {i} holds {int(seqlens[i])} tokens and {nnew} "
                f"new ones do not fit in Nmax = {n_slots} (k_cache dim 2)")
        if cbi is not None:
            cbi = np.asarray(cbi)
            check_batch_rows(cbi, n_cache)
            vals, counts = np.unique(cbi, return_counts=True)
            if (counts > 1).any():
                dup = int(vals[counts > 1][0])
                raise ValueError(f"cache_batch_idx: expected distinct entries when appending "
                                 f"(two sequences would write one cache row), got {dup} twice")
        return
    max_blocks = table.shape[1]
    i = first_bad(new > max_blocks * n_slots)
    if i is not None:
        need = -(-(int(seqlens[i]) + nnew) // n_slots)
        raise ValueError(
            f"block_table: no room: sequence {i} holds {int(seqlens[i])} tokens and {nnew} new "
            f"ones need {need} blocks of {n_slots} tokens, but block_table has {max_blocks} per "
            "sequence")
    for b in range(table.shape[0]):
        first = int(seqlens[b]) // n_slots
        last = (int(seqlens[b]) + nnew - 1) // n_slots
        entries = table[b, first:last + 1]
        out = np.flatnonzero((entries < 0) | (entries >= n_cache))
        if out.size:
            j = first + int(out[0])
            raise ValueError(
                f"block_table: expected entries in [0, {n_cache}) (num_blocks of k_cache) for "
                f"the blocks the new tokens go to, got {int(table[b, j])} at [{b}, {j}]")
    if (seqlens.astype(np.int64) + nnew > INT32_MAX).any():
        raise ValueError("cache_seqlens: expected L + Nnew <= 2**31 - 1")
    check_paged_writes(seqlens.astype(np.int64), table, nnew, n_cache, n_slots)


def check_paged_writes(seqlens, table, nnew, n_cache, n_slots):
    """Every physical slot an append writes has one owner: no two new tokens go to one slot (two
    sequences, or one whose table lists a block twice), and no new token overwrites a token a
    sequence already holds (a shared block that one sequence appends to).  Sharing blocks for
    reading, as prefix caching does, is allowed: only the slots being written are checked.
    ``seqlens`` int64 and ``table`` with the room and the entries the writes use checked."""
    bs = n_slots
    pos = seqlens[:, None] + np.arange(nnew, dtype=np.int64)          # [B, Nnew] tokens written
    blk = np.take_along_axis(table, pos // bs, axis=1).astype(np.int64)
    key = (blk * bs + pos % bs).ravel()                               # physical slot of each
    order = np.argsort(key, kind="stable")
    same = np.flatnonzero(key[order][1:] == key[order][:-1])
    if same.size:
        (b0, t0), (b1, t1) = (divmod(int(order[i]), nnew) for i in (same[0], same[0] + 1))
        whose = f"sequence {b0}" if b0 == b1 else f"sequences {b0} and {b1}"
        raise ValueError(
            f"block_table: {whose} would write tokens {int(pos[b0, t0])} and {int(pos[b1, t1])} "
            f"into one slot (physical block {int(blk[b0, t0])}, slot {int(pos[b0, t0]) % bs}); "
            "blocks may be shared for reading (a common prefix), but each appended token needs "
            "a slot of its own")
    # the tokens each sequence holds: live[b, j] slots of its j-th block
    j = np.arange(table.shape[1], dtype=np.int64)
    live = np.clip(seqlens[:, None] - j * bs, 0, bs)
    held = (live > 0) & (table >= 0) & (table < n_cache)
    most = np.zeros(n_cache, np.int64)          # slots [0, most[p]) of block p hold a token
    np.maximum.at(most, table[held].astype(np.int64), live[held])
    hit = np.flatnonzero(pos.ravel() % bs < most[blk.ravel()])
    if hit.size:
        b, t = divmod(int(hit[0]), nnew)
        p, s = int(blk[b, t]), int(pos[b, t]) % bs
        owner, jj = (int(x[0]) for x in np.nonzero((table == p) & held & (live > s)))
        raise ValueError(
            f"block_table: sequence {b} would write its token {int(pos[b, t])} into physical "
            f"block {p}, slot {s}, where sequence {owner} holds its token {jj * bs + s}; a "
            "block shared for reading (a common prefix) must be copied before a sequence "
            "appends to it")


def launch_append(call, dk, dv, dkn, dvn, d_len, d_table, paged, n_cache, n_slots, b, hkv,
                  nnew, d, dtype, kv_descale=None, write_v=True, strides=None,
                  unit_descale=False):
    """One append launch on device arrays (the caches as their ``[rows, d]`` views in their
    memory order, ``strides`` their :func:`row_strides`; None: heads-first); returns the
    device array of new lengths (``d_len``'s dtype).  ``kv_descale``: e4m3 caches' float32
    ``[2, B, Hkv]`` descales (host or device; the new values are rounded into e4m3), None: a
    copy; ``unit_descale``: none was given (ones: a device constant, no copy each call);
    ``write_v=False``: a latent cache (``dv``, ``dvn`` unread)."""
    threads = append_threads()
    grid = append_grid(b, hkv, nnew)
    new_lens = call.empty((b,), d_len.dtype)
    fp8 = kv_descale is not None
    if not fp8:
        descale = no_descale(call)
    elif unit_descale:
        descale = device_constant(call, ("unit_descale",) + tuple(kv_descale.shape), kv_descale)
    else:
        descale = call.input(kv_descale)
    if strides is None:
        strides = row_strides((n_cache, hkv, n_slots), HEADS_FIRST)
    call.launch(append_kernel(threads, np.dtype(dtype), bool(paged), fp8, write_v), grid,
                (threads,), dk, dv, dkn, dvn, d_len, d_table, new_lens, np.int32(n_cache),
                np.int32(n_slots), kernel_strides(strides), descale,
                work=SimWork("merge", b * hkv * nnew * max(d, threads)))
    return new_lens


def kernel_strides(strides):
    """:func:`row_strides` as the kernels' launch parameter: a tuple of three int64."""
    return tuple(np.int64(s) for s in strides)


def cache_tables(call, block_table, cache_batch_idx, b):
    """``(paged, table)`` as the kernels read them: a paged cache's table; ``cache_batch_idx``
    as a one-column table (a contiguous cache is ``Bc`` blocks of ``Nmax`` slots); else no
    table (sequence ``b`` is block ``b``)."""
    if block_table is not None:
        return True, kernel_ints(call, block_table, "block_table")
    if cache_batch_idx is not None:
        return True, kernel_ints(call, cache_batch_idx, "cache_batch_idx").reshape(b, 1)
    return False, call.empty((1, 1), np.int32)


def write_back(call, user, dev):
    """NumPy caches are written in place: the device copy back into the caller's array
    (``user``: in its memory order, :attr:`CacheMemory.k`; a bfloat16 cache's words into its
    words: bits, not a uint16 -> bfloat16 value conversion).  Nothing to do where the
    simulator's kernels wrote the caller's memory itself (a zero-copy view of it)."""
    if not call.on_device:
        ary = getattr(dev, "_ary", None)      # the simulator's device array: a NumPy array
        if ary is not None and np.may_share_memory(ary, user):
            return
        host = dev.copy_to_host().reshape(user.shape)
        (user.view(host.dtype) if user.dtype != host.dtype else user)[...] = host


def check_rotary_tables(cos, sin, d, dtype, names=("cos", "sin")):
    """``cos``, ``sin``: ``[max_position, rotary_dim / 2]`` in ``x``'s dtype (as flash-attn),
    ``rotary_dim <= d``.  Returns ``(max_position, rotary_dim)``.  (The rotary dim is twice
    the tables' width, so it is even by construction.)"""
    cn, sn = names
    cs, cd = check_array(cn, cos, 2, ATTENTION_DTYPES)
    ss, sd = check_array(sn, sin, 2, ATTENTION_DTYPES)
    check_same_dtype({"x" if cn == "cos" else "q": dtype, cn: cd, sn: sd})
    if ss != cs:
        raise ValueError(f"{sn}: expected the shape of {cn} {cs}, got {ss}")
    rotary_dim = 2 * cs[1]
    if rotary_dim > d:
        raise ValueError(f"{cn}: expected [max_position, rotary_dim / 2] with rotary_dim <= the "
                         f"head dim {d}, got shape {cs} (rotary_dim {rotary_dim})")
    return cs[0], rotary_dim


def check_positions(name, last, max_position, what):
    """Every position a call reads (``last[b]`` is sequence ``b``'s largest) is below the
    tables' ``max_position``."""
    last = np.asarray(last, dtype=np.int64)
    bad = np.flatnonzero(last >= max_position)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{name}: too short: sequence {i} needs position {int(last[i])} "
                         f"({what}), but {name} has {max_position} positions (dim 0)")


def launch_rotary(call, dx, dcos, dsin, d_off, offset0, step, per_seq, interleaved, dtype):
    """One rotary launch on device arrays; returns the new device array."""
    b, h, n, d = dx.shape
    threads = rotary_threads()
    out = call.empty((b, h, n, d), dtype)
    call.launch(rotary_kernel(threads, np.dtype(dtype), bool(interleaved)),
                rotary_grid(b, h, n), (threads,), dx, dcos, dsin, d_off, out,
                np.int32(offset0), np.int32(step), np.int32(per_seq),
                work=SimWork("merge", b * h * n * max(d, threads)))
    return out
