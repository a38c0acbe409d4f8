"""``numba_flash.append_kv``: write new tokens' K/V into a contiguous or paged KV cache.

One launch (:mod:`numba_flash.kernels.cache.append`) copies the new rows and writes the new
lengths.  The caches are written in place, in their own memory order (heads-first, or
tokens-first: flash-attn's ``[.., N, Hkv, d]`` memory passed as its ``transpose(0, 2, 1, 3)``
view; :func:`~numba_flash.frontend.cache_args.cache_memory`): a device cache where it lies, no
copy; a NumPy cache in the simulator too, and on a GPU through a device copy written back into
it.  Every other input is left as it came.  The shape and host value checks and the launch live in
:mod:`numba_flash.frontend.cache_args`, which :func:`numba_flash.decode` (``k_new``/``v_new``)
shares.
"""

from __future__ import annotations

import numpy as np

from ..frontend import ArrayCall
from ..frontend.plans import plan_key, run_or_build
from ..frontend.arrays import host_ints, kernel_ints
from ..frontend.cache_args import (
    cache_memory, cache_tables, check_batch_idx, check_new_kv, check_same_order,
    check_writable_cache, launch_append, validate_append, write_back,
)
from ..frontend.fp8 import check_cache_array, check_descales, check_fp8_gpu, is_e4m3
from ..frontend.validate import (
    INT_DTYPES, array_info, check_array, check_bool, check_same_dtype, check_same_kind,
    check_value_shape, is_device_array,
)


def append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table=None,
              cache_batch_idx=None, *, validate=None, k_descale=None, v_descale=None,
              kv_cache_dtype="auto"):
    """Write ``k_new``, ``v_new`` into the caches at each sequence's current length, in place.

    * ``k_cache``, ``v_cache``: contiguous ``[Bc, Hkv, Nmax, d]`` (``block_table=None``) or paged
      ``[num_blocks, Hkv, block_size, d]`` with ``block_table`` ``[B, max_blocks]`` (the layouts
      of :func:`numba_flash.decode`), in that order in memory (heads-first) or tokens-first
      (``[Bc, Nmax, Hkv, d]`` / ``[num_blocks, block_size, Hkv, d]`` memory, flash-attn's,
      passed as its ``transpose(0, 2, 1, 3)`` view), or any other order of the three outer
      axes with the last dim contiguous: written in place where they lie (no copy; a device
      cache in none of those orders is refused, as its writes would be lost).
    * ``k_new``, ``v_new``: ``[B, Hkv, Nnew, d]``, the caches' dtype (float16/32/64 or
      ``ml_dtypes.bfloat16``: copied as their 16-bit words).  ``v_cache`` and ``v_new`` may
      have a head dim of their own, ``d_v``.  MLA's latent cache (:func:`numba_flash.decode`
      with ``v_cache=None``): ``v_cache=None``, ``v_new=None`` and ``k_new`` the new tokens'
      whole latent rows (e4m3: ``k_descale`` alone).
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

    * e4m3 caches (``ml_dtypes.float8_e4m3fn``, both): ``k_new``, ``v_new`` float16, bfloat16
      or float32, written as the e4m3 of ``x / k_descale[b, kvh]`` (``v_descale`` for V; float32
      ``[B, Hkv]``, None: 1), rounded to nearest even and saturated to +-448, the inverse of
      :func:`numba_flash.decode`'s reading of them; ``kv_cache_dtype="fp8_e4m3"``: uint8 caches
      (a device array's form) holding e4m3 bytes.

    Returns the new lengths ``cache_seqlens + Nnew`` as a new array (int32 for int32 lengths,
    else int64); ``cache_seqlens`` itself is not modified.  One kernel launch.

    Device arrays without ``validate``: no synchronisation, and a call of a signature seen
    before replays its launch plan (:mod:`numba_flash.frontend.plans`).
    """
    args = (k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, cache_batch_idx)
    kw = dict(validate=validate, k_descale=k_descale, v_descale=v_descale,
              kv_cache_dtype=kv_cache_dtype)
    key = plan_key("append_kv", args + (k_descale, v_descale), (validate, kv_cache_dtype))
    if key is not None:
        return run_or_build(key, _append_kv, args + (k_descale, v_descale), *args, **kw)
    return _append_kv(*args, **kw)


def _append_kv(k_cache, v_cache, k_new, v_new, cache_seqlens, block_table, cache_batch_idx, *,
               validate, k_descale, v_descale, kv_cache_dtype):
    """:func:`append_kv`'s checks and launches (its ordinary path, and what a plan records)."""
    ks, dtype = check_cache_array("k_cache", k_cache, kv_cache_dtype)
    latent = v_cache is None                  # MLA: one latent cache, k_new its whole rows
    if latent:
        for name, x in (("v_new", v_new), ("v_descale", v_descale)):
            if x is not None:
                raise ValueError(f"{name}: expected None with v_cache=None (a latent cache: "
                                 f"k_new holds each token's whole row), got an array")
        vs = ks
    else:
        vs, vd = check_cache_array("v_cache", v_cache, kv_cache_dtype)
        check_same_dtype({"k_cache": dtype, "v_cache": vd})
        check_value_shape(ks, vs, True, "k_cache", "v_cache")   # v_cache: d_v of its own or d
    n_cache, hkv, n_slots, d = ks
    d_v = vs[3]
    (b,), _ = check_array("cache_seqlens", cache_seqlens, 1, INT_DTYPES)
    fp8 = is_e4m3(dtype)
    if fp8:
        check_fp8_gpu("k_cache")
    nnew = check_new_kv(k_new, k_new if latent else v_new, b, hkv, d, None if fp8 else dtype,
                        d_v=d_v)
    kv_descale = check_descales({"k_descale": k_descale, "v_descale": v_descale}, b, hkv, fp8,
                                (k_cache, k_new))
    paged = block_table is not None
    arrays = {"k_cache": k_cache, "k_new": k_new, "cache_seqlens": cache_seqlens}
    if not latent:
        arrays.update(v_cache=v_cache, v_new=v_new)
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
    if not latent:
        check_writable_cache("v_cache", v_cache)
        check_same_order(k_cache, v_cache)
    on_device = any(is_device_array(x) for x in arrays.values())
    validate = check_bool("validate", (not on_device) if validate is None else validate)

    call = ArrayCall(arrays)  # rejects device arrays in the simulator, before any copy
    if validate:
        validate_append(host_ints(cache_seqlens), host_ints(block_table) if paged else None,
                        host_ints(cache_batch_idx) if cache_batch_idx is not None else None,
                        nnew, n_cache, n_slots, paged)
    as_bytes = fp8 and not on_device   # e4m3 travels as its bytes (Numba has no fp8 dtype)
    rows = n_cache * hkv * n_slots
    mem = cache_memory(*((x.view(np.uint8) if as_bytes else x) if x is not None else None
                         for x in (k_cache, None if latent else v_cache)))
    dk = call.input(mem.k).reshape(rows, d)   # the caches' memory as rows: no copy
    new_dtype = array_info("k_new", k_new)[1]
    dkn = call.input(k_new)
    if latent:   # no value rows (the kernel built without them; dv, dvn unread)
        dv, dvn = dk, dkn
    else:
        dv = call.input(mem.v).reshape(rows, d_v)
        dvn = call.input(v_new)
    d_len = kernel_ints(call, cache_seqlens, "cache_seqlens")
    is_paged, d_table = cache_tables(call, block_table, cache_batch_idx, b)
    new_lens = launch_append(call, dk, dv, dkn, dvn, d_len, d_table, is_paged, n_cache,
                             n_slots, b, hkv, nnew, d, new_dtype, kv_descale, not latent,
                             mem.strides, unit_descale=k_descale is None and v_descale is None)
    write_back(call, mem.k, dk)
    if not latent:
        write_back(call, mem.v, dv)
    return call.result(new_lens)
