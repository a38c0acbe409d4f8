"""Token-sparse attention on the host: the checks of ``kv_indices``, the forward's route
(:func:`sparse_forward`) and the backward's mask (:func:`sparse_mask`).

``kv_indices`` (DeepSeek V3.2's DSA, FA4's ``gather_kv_indices``) is an integer ``[B, G, Nq,
topk]`` array: query token ``i`` of sequence ``b`` attends to the key positions
``kv_indices[b, g, i, :]`` only, ``-1`` meaning "no key", with ``G = Hkv`` (the query heads of
kv head ``g`` share its list, as DSA's indexer gives one list per token and kv head) or ``G =
1`` (one list for every head).  A position is the key's index in its sequence (in a paged
cache: token ``t``, found through the block table as any other, never a physical slot).

Repeats are rejected (``validate``): a key listed twice would count twice in the kernels'
softmax, while :func:`numba_flash.reference.sparse_attention` counts it once.  Without
validation (device inputs) an entry outside ``[-1, L)`` makes its token's rows NaN and is
never dereferenced; a repeat then counts twice.

The forward (``numba_flash.forward(..., kv_indices=)``) runs as the token-sparse decode does
(:func:`numba_flash.decode` with ``kv_indices``): ``k`` and ``v`` read as a contiguous cache of
``Nk`` keys per sequence, a block per query token whose rows are the heads of one kv head
(they share the list, as DSA's indexer and FlashMLA's sparse prefill have it), the list split
over blocks: ``O(Nq * topk)`` work.  On tensor cores (float16 / bfloat16, head dims multiples
of 64, no softcap or ALiBi; ``kernel="auto"`` with at least 8 heads a kv head) a tile of 32
list entries (16 past head dims 128) is gathered by ``cp.async`` into shared memory, K and V
rows each through their page (:mod:`numba_flash.kernels.decode.mla`, ``OWN_V``); on the SIMT
kernel each key row is gathered into the registers of the lanes that use it
(:mod:`numba_flash.kernels.decode.split_kv`, ``GATHER``).  The backward reads the listed keys
too (:mod:`numba_flash.kernels.backward.sparse`); a ``deterministic`` one gets
the lists as the dense kernels' ``mask_mod`` (:func:`sparse_mask`: a dense ``[B, G, Nq, Nk]``
int8 table of listed keys, the dense ``O(Nq * Nk)`` work).  The story and its machine-code
count: docs/sparse-attention.md.
"""

from __future__ import annotations

import importlib

import numpy as np

from .arrays import host_ints
from .validate import (
    ATTENTION_DTYPES, INT_DTYPES, array_info, array_module, check_array,
    check_dense_options_off, check_qkv, is_device_array,
)


def check_kv_indices(kv_indices, b, hkv, nq, name="kv_indices"):
    """Shape and dtype of an index list array (before any copy): integers ``[B, Hkv or 1, Nq,
    topk]`` (``topk >= 1``; ``B`` and ``Nq`` may be 0, an empty batch).  Returns ``topk``.  A
    float array is a ``TypeError``, a shape that does not fit a ``ValueError``, both naming
    ``name``."""
    shape, dtype = array_info(name, kv_indices)
    if dtype not in INT_DTYPES:
        raise TypeError(f"{name}: expected an integer array (int32 key positions, -1 for none), "
                        f"got dtype {dtype}")
    shape, _ = check_array(name, kv_indices, 4, INT_DTYPES, (0, 2))
    heads = (hkv,) if hkv == 1 else (hkv, 1)
    if shape[0] != b or shape[1] not in heads or shape[2] != nq:
        raise ValueError(f"{name}: expected shape [B, Hkv or 1, Nq, topk] = [{b}, "
                         f"{' or '.join(map(str, heads))}, {nq}, topk], got {list(shape)}")
    return int(shape[3])


def validate_kv_indices(kv_indices, lengths, name="kv_indices"):
    """The value checks on a host copy: every entry in ``[-1, lengths[b])`` (the keys sequence
    ``b`` has) and no key listed twice in one list; a ``ValueError`` naming ``name``, the first
    bad entry and where it is."""
    raw = host_ints(kv_indices)
    if raw.dtype.kind == "u" and raw.size and raw.max() > np.iinfo(np.int32).max:
        raise ValueError(f"{name}: expected entries in [-1, cache_seqlens[b]) (key positions of "
                         f"the sequence, -1 for none), got {int(raw.max())}")
    idx = raw.astype(np.int64)
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


#: the kernels a token-sparse forward runs on: ``"auto"`` (the tensor-core decode where it
#: applies, :func:`numba_flash.ops.decode._mma_decode`), ``"simt"`` (the split-KV SIMT decode),
#: ``"mma"`` (the tensor-core decode, a ValueError naming ``kernel`` where it cannot)
SPARSE_KERNELS = ("auto", "simt", "mma")

#: what :func:`check_dense_options_off` says a token-sparse call is
_SPARSE_CONTEXT = "kv_indices (token-sparse attention runs the gathering decode kernels)"


def sparse_forward(q, k, v, kv_indices, *, causal, softmax_scale, return_lse, window_size,
                   softcap, alibi_slopes, learnable_sink, kernel, out=None, lse_out=None,
                   **dense_only):
    """:func:`numba_flash.forward` with ``kv_indices`` (see there); ``dense_only``: the
    options of :data:`~numba_flash.frontend.validate.DENSE_FORWARD_OPTIONS`, each a
    ``ValueError`` naming it when set.  ``q``, ``k``, ``v``, ``out`` and ``lse_out`` go to
    :func:`numba_flash.decode` as they are: ``q`` read and ``out`` written through their
    strides (flash-attn's ``[B, N, H, d]`` memory where it lies), ``k``, ``v`` read as caches
    in their memory order (tokens-first: no copy), or, a fused projection's slices (rows with
    gaps between them, whole rows apart), as the rows of their memory: no copy; other views
    with gaps are copied."""
    check_dense_options_off(dense_only, _SPARSE_CONTEXT)
    if kernel not in SPARSE_KERNELS:
        raise ValueError(f"kernel: expected one of {SPARSE_KERNELS} with kv_indices (the gather "
                         f"runs on the decode kernels), got {kernel!r}")
    # an empty batch, query block or key set: decode's answer (o = 0, lse = -inf or the sink)
    s = check_qkv(q, k, v, dtypes=ATTENTION_DTYPES, value_dim=True, empty=True)
    xp = array_module(q)
    lengths = xp.full((s.b,), s.nk, dtype=np.int32)   # every sequence: Nk keys
    # the decode op imported by name, as the kernel choice imports the tensor-core ops
    # (frontend/kernel_choice.py): the front end routes between ops, no op imports another
    decode = importlib.import_module("numba_flash.ops.decode").decode
    return decode(q, k, v, cache_seqlens=lengths, causal=causal, softmax_scale=softmax_scale,
                  window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                  learnable_sink=learnable_sink, return_lse=return_lse, kv_indices=kv_indices,
                  kernel=kernel, out=out, lse_out=lse_out)


def listed_keys(b, h, q_idx, kv_idx, listed, list_of_head):
    """The backward's ``mask_mod``: key ``kv_idx`` is in query ``q_idx``'s list (``listed``:
    int8 ``[B, G, Nq, Nk]``, ``list_of_head[h]`` the list of query head ``h``)."""
    return listed[b, list_of_head[h], q_idx, kv_idx] != 0


def listed_table(kv_indices, nk, h):
    """``(listed, list_of_head)``: the lists as a dense int8 ``[B, G, Nq, Nk]`` table (1 where
    listed) and each query head's list, int32 ``[H]`` (``h // (H / G)``), on the lists' own
    device."""
    xp = array_module(kv_indices)
    idx = xp.asarray(kv_indices).astype(np.int64)
    rows = int(np.prod(idx.shape[:3]))
    table = xp.zeros((rows, nk + 1), dtype=np.int8)   # column nk: where the -1 entries go
    where = xp.where(idx >= 0, idx, nk).reshape(rows, idx.shape[3])
    table[xp.arange(rows)[:, None], where] = 1        # (a fancy-index store: NumPy and CuPy)
    listed = xp.ascontiguousarray(table[:, :nk]).reshape(idx.shape[:3] + (nk,))
    heads = (xp.arange(h, dtype=np.int32) // (h // idx.shape[1])).astype(np.int32)
    return listed, heads


def check_sparse_options(**user):
    """The backward's arguments a token-sparse call does not take: ``mask_mod``,
    ``block_mask``, ``score_mod``, ``score_mod_grad``, ``aux_grad``, ``aux_tensors`` (the lists
    are the mask) and ``dropout_p`` (the forward takes none): each a ``ValueError`` naming it
    when given."""
    for name in ("mask_mod", "block_mask", "score_mod", "score_mod_grad", "aux_grad"):
        if user.get(name) is not None:
            raise ValueError(f"{name}: expected None with kv_indices (the lists are the "
                             f"backward's mask), got {user[name]!r}")
    if tuple(user.get("aux_tensors") or ()) != ():
        raise ValueError("aux_tensors: expected () with kv_indices, got "
                         f"{len(user['aux_tensors'])} arrays")
    if user.get("dropout_p"):
        raise ValueError(f"dropout_p: expected 0.0 with kv_indices (the token-sparse forward "
                         f"takes no dropout), got {user['dropout_p']!r}")


def validate_lists(kv_indices, b, hkv, nq, lengths, validate=None):
    """:func:`check_kv_indices`, then (``validate``; default: host lists)
    :func:`validate_kv_indices` against ``lengths``."""
    check_kv_indices(kv_indices, b, hkv, nq)
    if validate is None:
        validate = not is_device_array(kv_indices)
    if validate:
        validate_kv_indices(kv_indices, lengths)


def as_dtype(x, dtype):
    """A compute-type result (NumPy or CuPy) in the inputs' element type."""
    return x if x.dtype == dtype else x.astype(dtype)


def sparse_mask(q, k, v, kv_indices):
    """The deterministic backward of :func:`sparse_forward`'s lists: ``(mask_mod,
    aux_tensors)`` for the dense backward (:func:`listed_keys` over :func:`listed_table`), the
    lists always validated on the host (device lists included: a dense table of a bad entry
    would mark another key, not a NaN row)."""
    s = check_qkv(q, k, v, dtypes=ATTENTION_DTYPES, value_dim=True, empty=True)
    validate_lists(kv_indices, s.b, s.hkv, s.nq, [s.nk] * s.b, validate=True)
    return listed_keys, listed_table(kv_indices, s.nk, s.h)


def _packed_lists_shape(kv_indices):
    """The shape of packed lists, after the dtype check (a float array: ``TypeError`` naming
    ``kv_indices``, before any cast could truncate it)."""
    shape, dtype = array_info("kv_indices", kv_indices)
    if dtype not in INT_DTYPES:
        raise TypeError(f"kv_indices: expected an integer array (int32 key positions, -1 for "
                        f"none), got dtype {dtype}")
    return shape


def sparse_forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, kv_indices, *, block_table,
                          causal, softmax_scale, return_lse, window_size, softcap, alibi_slopes,
                          learnable_sink, validate, **dense_only):
    """:func:`numba_flash.forward_varlen` with ``kv_indices`` (integer ``[total_q, Hkv or 1,
    topk]``: query row ``r``'s keys, positions within its sequence).  Run as the token-sparse
    decode of a padded batch: ``q`` right-aligned into ``[B, H, max_q, d]`` (row ``i`` of
    sequence ``b`` at ``max_q - nq_b + i``, so the bottom-right alignment of each sequence
    holds: its key column is ``i + nk_b - nq_b``), the padded rows listing no key; packed
    ``k`` / ``v`` read in place as a paged cache of one-key pages (a ``[B, max_k]`` table of
    packed rows, ``cu_seqlens_k[b] + t``), or through the caller's ``block_table``.  Returns
    ``o [total_q, H, d_v]`` (and ``lse [H, total_q]``)."""
    check_dense_options_off(dense_only, _SPARSE_CONTEXT)
    xp = array_module(q)
    qs = array_info("q", q)[0]       # (q, k, v and cu_seqlens checked by forward_varlen)
    cu_q = np.asarray(host_ints(cu_seqlens_q), np.int64)
    cu_k = np.asarray(host_ints(cu_seqlens_k), np.int64)
    n_seq = len(cu_q) - 1
    len_q, len_k = np.diff(cu_q), np.diff(cu_k)
    shape = _packed_lists_shape(kv_indices)
    if len(shape) != 3 or shape[0] != qs[0]:
        raise ValueError(f"kv_indices: expected shape [total_q, Hkv or 1, topk] = [{qs[0]}, "
                         f"Hkv or 1, topk] with cu_seqlens, got {list(shape)}")
    max_q = int(len_q.max(initial=0))   # 0: no query row, decode's empty answer
    at = tuple(xp.asarray(a) for a in _padded_rows(cu_q, max_q))   # (sequence, padded row)
    q_pad = xp.zeros((n_seq, max_q) + tuple(qs[1:]), q.dtype)
    q_pad[at] = q
    lists = xp.full((n_seq, max_q) + tuple(shape[1:]), -1, np.int32)
    lists[at] = xp.asarray(kv_indices).astype(np.int64).clip(-2, np.iinfo(np.int32).max)
    if block_table is None:   # packed rows as one-key pages: no copy of k or v
        ks = array_info("k", k)[0]
        k_cache = k.reshape(ks[0], ks[1], 1, ks[2])
        v_cache = v.reshape(ks[0], ks[1], 1, array_info("v", v)[0][2])
        table = np.zeros((n_seq, max(1, int(len_k.max(initial=0)))), np.int32)
        for b in range(n_seq):
            table[b, :len_k[b]] = cu_k[b] + np.arange(len_k[b])
        block_table = xp.asarray(table)
    else:
        k_cache, v_cache = k, v
    decode = importlib.import_module("numba_flash.ops.decode").decode
    # q_pad: the padded batch's [B, max_q, H, d] memory, read through its strides
    o, lse = decode(q_pad.transpose(0, 2, 1, 3), k_cache, v_cache,
                    cache_seqlens=xp.asarray(len_k.astype(np.int32)), block_table=block_table,
                    causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                    softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                    return_lse=True, validate=validate,
                    kv_indices=xp.ascontiguousarray(lists.transpose(0, 2, 1, 3)), kernel="auto")
    o = o.transpose(0, 2, 1, 3)[at]
    lse = xp.ascontiguousarray(lse.transpose(0, 2, 1)[at].T)
    return (o, lse) if return_lse else o


def _padded_rows(cu, n_pad):
    """``(seq_of, pos)``: each packed row's sequence and its row in a right-aligned padded batch
    of ``n_pad`` rows a sequence (host int64 arrays)."""
    lens = np.diff(cu)
    seq_of = np.repeat(np.arange(len(lens)), lens)
    return seq_of, n_pad - lens[seq_of] + (np.arange(int(cu[-1])) - cu[seq_of])


def sparse_backward_varlen(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, kv_indices, *,
                           validate=None, **kw):
    """:func:`numba_flash.backward_varlen` with the forward's packed ``kv_indices``: queries
    and keys right-aligned into a padded batch (each sequence keeps its key-query distances, so
    the causal, window and ALiBi rules hold), the lists validated against each sequence's keys
    and shifted by its padding, :func:`numba_flash.backward` with them (``kw``: its arguments),
    the gradients packed back.  Padded rows have ``lse = +inf``: ``P = 0`` there, so they add
    nothing (to ``dsink`` either; ``-inf`` would make it ``inf * 0``)."""
    xp = array_module(q)
    cu_q = np.asarray(host_ints(cu_seqlens_q), np.int64)
    cu_k = np.asarray(host_ints(cu_seqlens_k), np.int64)
    n_seq = len(cu_q) - 1
    len_k = np.diff(cu_k)
    # 0 rows or keys (every sequence empty on that side): the backward's zero gradients
    max_q = int(np.diff(cu_q).max(initial=0))
    max_k = int(len_k.max(initial=0))
    shape = _packed_lists_shape(kv_indices)
    if len(shape) != 3 or shape[0] != int(cu_q[-1]):
        raise ValueError(f"kv_indices: expected shape [total_q, Hkv or 1, topk] = "
                         f"[{int(cu_q[-1])}, Hkv or 1, topk], got {list(shape)}")
    at_q = tuple(xp.asarray(a) for a in _padded_rows(cu_q, max_q))
    at_k = tuple(xp.asarray(a) for a in _padded_rows(cu_k, max_k))

    def padded(x, at, n, fill=0.0):
        out = xp.full((n_seq, n) + tuple(x.shape[1:]), fill, x.dtype)
        out[at] = x
        return out.transpose(0, 2, 1, 3)   # [B, H, N, d] views: the kernels read strides

    lists = xp.full((n_seq, max_q) + tuple(shape[1:]), -1, np.int64)
    lists[at_q] = xp.asarray(kv_indices).astype(np.int64).clip(-2, np.iinfo(np.int32).max)
    lists = lists.transpose(0, 2, 1, 3)
    validate_lists(lists, n_seq, shape[1], max_q, len_k, validate)   # before the shift
    shift = xp.asarray((max_k - len_k).reshape(-1, 1, 1, 1))
    lists = xp.where(lists >= 0, lists + shift, lists)      # (clipped: no entry wraps in int32)
    lists = xp.ascontiguousarray(lists.clip(-2, np.iinfo(np.int32).max)).astype(np.int32)
    lse_pad = xp.full((n_seq, max_q, lse.shape[0]), np.inf, lse.dtype)
    lse_pad[at_q] = xp.asarray(lse).T
    backward = importlib.import_module("numba_flash.ops.backward").backward
    grads = backward(padded(do, at_q, max_q), padded(q, at_q, max_q), padded(k, at_k, max_k),
                     padded(v, at_k, max_k), padded(o, at_q, max_q),
                     xp.ascontiguousarray(lse_pad.transpose(0, 2, 1)), kv_indices=lists,
                     **kw)
    dq, dk, dv = (g.transpose(0, 2, 1, 3)[at] for g, at in zip(grads[:3], (at_q, at_k, at_k)))
    return (dq, dk, dv) + tuple(grads[3:])
