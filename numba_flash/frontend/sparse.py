"""Token-sparse attention's index lists on the host: the checks of ``kv_indices``.

``kv_indices`` (DeepSeek V3.2's DSA, FA4's ``gather_kv_indices``) is an integer ``[B, G, Nq,
topk]`` array: query token ``i`` of sequence ``b`` attends to the key positions
``kv_indices[b, g, i, :]`` only, ``-1`` meaning "no key", with ``G = Hkv`` (the query heads of
kv head ``g`` share its list, as DSA's indexer gives one list per token and kv head) or ``G =
1`` (one list for every head).  A position is the key's index in its sequence (in a paged
cache: token ``t``, found through the block table as any other, never a physical slot).

Repeats are rejected (``validate``): a key listed twice would count twice in the kernels'
softmax, while :func:`numba_flash.reference.sparse_attention` counts it once.  Without
validation (device inputs) an entry outside ``[-1, L)`` makes its token's rows NaN and is
never dereferenced; a repeat then counts twice.  The story: docs/sparse-attention.md.
"""

from __future__ import annotations

import numpy as np

from .arrays import host_ints
from .validate import INT_DTYPES, array_info, array_module, check_array


def check_kv_indices(kv_indices, b, hkv, nq, name="kv_indices"):
    """Shape and dtype of an index list array (before any copy): integers ``[B, Hkv or 1, Nq,
    topk]`` (``topk >= 1``).  Returns ``topk``.  A float array is a ``TypeError``, a shape
    that does not fit a ``ValueError``, both naming ``name``."""
    shape, dtype = array_info(name, kv_indices)
    if dtype not in INT_DTYPES:
        raise TypeError(f"{name}: expected an integer array (int32 key positions, -1 for none), "
                        f"got dtype {dtype}")
    shape, _ = check_array(name, kv_indices, 4, INT_DTYPES)
    heads = (hkv,) if hkv == 1 else (hkv, 1)
    if shape[0] != b or shape[1] not in heads or shape[2] != nq:
        raise ValueError(f"{name}: expected shape [B, Hkv or 1, Nq, topk] = [{b}, "
                         f"{' or '.join(map(str, heads))}, {nq}, topk], got {list(shape)}")
    return int(shape[3])


def validate_kv_indices(kv_indices, lengths, name="kv_indices"):
    """The value checks on a host copy: every entry in ``[-1, lengths[b])`` (the keys sequence
    ``b`` has) and no key listed twice in one list; a ``ValueError`` naming ``name``, the first
    bad entry and where it is."""
    idx = host_ints(kv_indices).astype(np.int64)
    lengths = np.asarray(lengths, np.int64).reshape(-1, 1, 1, 1)
    bad = (idx < -1) | (idx >= lengths)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{name}: expected entries in [-1, cache_seqlens[b]) (key positions of "
                         f"the sequence, -1 for none), got {int(idx[at])} at {list(at)} "
                         f"(length {int(lengths.reshape(-1)[at[0]])})")
    ordered = np.sort(idx, axis=-1)
    repeat = (ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0)
    if repeat.any():
        at = tuple(int(i) for i in np.argwhere(repeat)[0])
        raise ValueError(f"{name}: expected each key at most once per list, got key "
                         f"{int(ordered[at])} twice in list {list(at[:3])}")


def kernel_indices(call, kv_indices):
    """The lists as the kernel reads them: int32 (as given when int32; otherwise clipped to
    ``[-2, 2**31 - 1]`` first, on the array's own device, so that an entry past int32 stays
    bad, never wraps into a valid key)."""
    if np.dtype(array_info("kv_indices", kv_indices)[1]) == np.int32:
        return call.input(kv_indices)
    xp = array_module(kv_indices)
    return call.input(xp.clip(kv_indices, -2, np.iinfo(np.int32).max).astype(np.int32))
