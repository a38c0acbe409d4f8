"""``numba_flash.append_kv``: write new tokens' K/V into a contiguous or paged KV cache.

One launch (:mod:`numba_flash.kernels.cache.append`) copies the new rows and writes the new lengths.
The caches are written in place (NumPy caches: the device copy is written back into them; a
CuPy cache must be C-contiguous, it is written where it lies); every other input is left as it
came.  The shape checks and the host value checks live here so that
:func:`numba_flash.decode` (``k_new``/``v_new``) shares them.
"""

from __future__ import annotations

import numpy as np

from ..frontend import ArrayCall
from ..frontend.arrays import host_ints, kernel_ints
from ..frontend.sim_time import SimWork
from ..frontend.validate import (
    ATTENTION_DTYPES, INT32_MAX, INT_DTYPES, check_array, check_bool, check_same_dtype,
    check_same_kind, check_value_shape, is_device_array,
)
from ..kernels.cache.append import append_grid, append_kernel, default_threads

def check_writable_cache(name, x):
    """A cache written in place: a writable NumPy array, or a C-contiguous device array (a
    strided one would be copied and the writes lost)."""
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            raise ValueError(f"{name}: expected a writable array (it is written in place), got "
                             "a read-only one")
    elif is_device_array(x):
        cai = x.__cuda_array_interface__
        strides = cai.get("strides")
        if strides is not None:
            itemsize = np.dtype(cai["typestr"]).itemsize
            want, acc = [], itemsize
            for s in reversed(cai["shape"]):
                want.insert(0, acc)
                acc *= s
            if tuple(strides) != tuple(want):
                raise ValueError(f"{name}: expected a C-contiguous device array (it is written "
                                 f"in place), got strides {tuple(strides)}")


def check_new_kv(k_new, v_new, b, hkv, d, dtype, k_name="k_new", v_name="v_new", d_v=None):
    """``k_new`` ``[B, Hkv, Nnew, d]``, ``v_new`` ``[B, Hkv, Nnew, d_v]`` (``d_v``: the value
    cache's head dim, default ``d``) in the caches' dtype; returns ``Nnew``."""
    d_v = d if d_v is None else d_v
    ks, kd = check_array(k_name, k_new, 4, ATTENTION_DTYPES)
    vs, vd = check_array(v_name, v_new, 4, ATTENTION_DTYPES)
    check_same_dtype({"k_cache": dtype, k_name: kd, v_name: vd})
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
            j = first_bad((cbi < 0) | (cbi >= n_cache))
            if j is not None:
                raise ValueError(f"cache_batch_idx: expected entries in [0, {n_cache}) (dim 0 of "
                                 f"k_cache), got {int(cbi[j])} at index {j}")
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
                  nnew, d, dtype):
    """One append launch on device arrays (the caches as their ``[rows, d]`` views); returns
    the device array of new lengths (``d_len``'s dtype)."""
    threads = default_threads()
    grid = append_grid(b, hkv, nnew)
    new_lens = call.empty((b,), d_len.dtype)
    call.launch(append_kernel(threads, np.dtype(dtype), bool(paged)), grid, (threads,), dk, dv,
                dkn, dvn, d_len, d_table, new_lens, np.int32(n_cache), np.int32(n_slots),
                work=SimWork("merge", b * hkv * nnew * max(d, threads)))
    return new_lens


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
    """NumPy caches are written in place: the device copy back into the caller's array (a
    bfloat16 cache's words into its words: bits, not a uint16 -> bfloat16 value conversion)."""
    if not call.on_device:
        host = dev.copy_to_host().reshape(user.shape)
        (user.view(host.dtype) if user.dtype != host.dtype else user)[...] = host


def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=None,
              cache_batch_idx=None, *, validate=None):
    """Write ``k_new``, ``v_new`` into the caches at each sequence's current length, in place.

    * ``k_cache``, ``v_cache``: contiguous ``[Bc, Hkv, Nmax, d]`` (``block_table=None``) or paged
      ``[num_blocks, Hkv, block_size, d]`` with ``block_table`` ``[B, max_blocks]`` (the layouts
      of :func:`numba_flash.decode`).  Written in place.
    * ``k_new``, ``v_new``: ``[B, Hkv, Nnew, d]``, the caches' dtype (float16/32/64 or
      ``ml_dtypes.bfloat16``: copied as their 16-bit words).  ``v_cache`` and ``v_new`` may
      have a head dim of their own, ``d_v`` (MLA-style caches).
    * ``cache_seqlens``: integer ``[B]``, the tokens each sequence holds; token ``i`` of
      sequence ``b`` goes to position ``cache_seqlens[b] + i``.
    * ``cache_batch_idx``: integer ``[B]``, the cache row of each sequence (contiguous caches
      only, as flash-attn; default ``arange(B)``, which needs ``Bc == B``).
    * ``validate``: check the values on the host first (default for NumPy inputs): a cache too
      small for the new tokens, a table without room or with a bad entry where they go, a
      table that sends two new tokens to one physical slot or a new token onto a slot a
      sequence already holds (blocks shared for reading, as a common prefix, are fine), a
      ``cache_batch_idx`` entry outside ``[0, Bc)`` or repeated, a negative length: a
      ``ValueError`` naming the argument, and nothing is written.  Without validation (the
      default for device arrays: no host copy, no synchronisation) a token that would land
      outside the cache is skipped, and of two tokens sent to one slot either may land.

    Returns the new lengths ``cache_seqlens + Nnew`` as a new array (int32 for int32 lengths,
    else int64); ``cache_seqlens`` itself is not modified.  One kernel launch.
    """
    ks, dtype = check_array("k_cache", k_cache, 4, ATTENTION_DTYPES)
    vs, vd = check_array("v_cache", v_cache, 4, ATTENTION_DTYPES)
    check_same_dtype({"k_cache": dtype, "v_cache": vd})
    check_value_shape(ks, vs, True, "k_cache", "v_cache")   # v_cache: d_v of its own or d
    n_cache, hkv, n_slots, d = ks
    d_v = vs[3]
    (b,), _ = check_array("cache_seqlens", cache_seqlens, 1, INT_DTYPES)
    nnew = check_new_kv(k_new, v_new, b, hkv, d, dtype, d_v=d_v)
    paged = block_table is not None
    arrays = {"k_cache": k_cache, "v_cache": v_cache, "k_new": k_new, "v_new": v_new,
              "cache_seqlens": cache_seqlens}
    if paged:
        ts, _ = check_array("block_table", block_table, 2, INT_DTYPES)
        if ts[0] != b:
            raise ValueError(f"block_table: expected {b} rows (the batch of cache_seqlens), got "
                             f"shape {ts}")
        arrays["block_table"] = block_table
    check_batch_idx(cache_batch_idx, b, paged)
    if cache_batch_idx is not None:
        arrays["cache_batch_idx"] = cache_batch_idx
    elif not paged and n_cache != b:
        raise ValueError(f"k_cache: expected batch size {b} (from cache_seqlens) in dim 0 of a "
                         f"contiguous cache without cache_batch_idx, got {n_cache}")
    check_same_kind(arrays)
    check_writable_cache("k_cache", k_cache)
    check_writable_cache("v_cache", v_cache)
    on_device = any(is_device_array(x) for x in arrays.values())
    validate = check_bool("validate", (not on_device) if validate is None else validate)

    call = ArrayCall(arrays)  # rejects device arrays in the simulator, before any copy
    if validate:
        validate_append(host_ints(cache_seqlens), host_ints(block_table) if paged else None,
                        host_ints(cache_batch_idx) if cache_batch_idx is not None else None,
                        nnew, n_cache, n_slots, paged)
    dk = call.input(k_cache).reshape(n_cache * hkv * n_slots, d)
    dv = call.input(v_cache).reshape(n_cache * hkv * n_slots, d_v)
    d_len = kernel_ints(call, cache_seqlens, "cache_seqlens")
    is_paged, d_table = cache_tables(call, block_table, cache_batch_idx, b)
    new_lens = launch_append(call, dk, dv, call.input(k_new), call.input(v_new), d_len, d_table,
                             is_paged, n_cache, n_slots, b, hkv, nnew, d, dtype)
    write_back(call, k_cache, dk)
    write_back(call, v_cache, dv)
    return call.result(new_lens)
