"""``numba_flash.forward_varlen``: the forward over a packed batch of sequences of different
lengths (flash-attn's ``flash_attn_varlen_func``), one launch for the whole batch, with K/V
packed or in a paged KV cache (``block_table``: the prefill of prompts over a paged cache runs
in the tiled forward kernel, not the decode kernel), and with a user's variant (``score_mod``,
``mask_mod``, ``block_mask``, ``aux_tensors``: ``b`` the sequence, positions within it)."""

from __future__ import annotations

import importlib
from typing import NamedTuple

import numpy as np

from ..frontend.cache_args import (cache_memory, check_prefill_table, cumulative_total,
                                   validate_prefill_table)
from ..frontend.fp8 import fp8_inputs
from ..frontend.sparse import sparse_forward_varlen
from ..frontend import ArrayCall
from ..frontend.validate import is_c_contiguous
from ..frontend.sim_time import tiled_work
from ..frontend.validate import (ATTENTION_DTYPES, INT32_MAX, allow_empty, array_info,
                                 check_array, check_bool, check_same_dtype, check_same_kind,
                                 check_out, check_scale, is_device_array)
from ..frontend.empty import into_outs, no_key_outputs
from ..frontend.plans import plan_key, run_or_build
from ..frontend.variants import (check_packed_qkv, check_seqlens, check_sink, check_value_shape,
                                 check_variants, reads_seqlens)
from ..kernels.core.common import acc_dtype, cdiv
from ..kernels.forward.simt import forward_grid, forward_kernel
from ..kernels.forward.config import default_tiles, forward_simt_config, vector_tiles
from ..philox import dropout_params
from ..frontend.kernel_args import kernel_variant, user_build
from ..frontend.arrays import host_ints


class PagedQKVShape(NamedTuple):
    """What :func:`_check_paged_qkv` finds: the dims of ``q [total_q, H, d]`` and of the paged
    caches ``k [num_blocks, Hkv, block_size, d]``, ``v [.., d_v]``, and their shared dtype."""

    total_q: int
    h: int
    hkv: int
    n_blocks: int
    block_size: int
    d: int
    d_v: int
    dtype: np.dtype


def _check_paged_qkv(q, k, v):
    """``q [total_q, H, d]``, ``k`` and ``v`` paged caches ``[num_blocks, Hkv, block_size, d]``
    (``v``: ``d_v``); returns a :class:`PagedQKVShape`.  ``total_q`` and ``num_blocks`` may be
    0 (an empty batch; a cache of no block holds no key: :func:`forward_varlen` then asks
    ``cu_seqlens_k`` to count none)."""
    qs, qd = check_array("q", q, 3, ATTENTION_DTYPES, (0,))
    ks, kd = check_array("k", k, 4, ATTENTION_DTYPES, (0,))
    vs, vd = check_array("v", v, 4, ATTENTION_DTYPES, (0,))
    dtype = check_same_dtype({"q": qd, "k": kd, "v": vd})
    check_same_kind({"q": q, "k": k, "v": v})
    total_q, h, d = qs
    check_value_shape(ks, vs, True)
    n_blocks, hkv, block_size, dk = ks
    if dk != d:
        raise ValueError(f"k: expected head dim {d} (from q) in dim 3 of the paged cache "
                         f"[num_blocks, Hkv, block_size, d], got {dk}")
    if h % hkv:
        raise ValueError(f"k: expected a number of kv heads (dim 1 of the paged cache) that "
                         f"divides the {h} query heads of q (GQA), got {hkv}")
    if d > 256:
        raise ValueError(f"q: expected head dim 1..256, got {d}")
    rows = n_blocks * hkv * block_size
    if rows > INT32_MAX:  # the kernel addresses cache rows with 32-bit indices
        raise ValueError(f"k: expected num_blocks * Hkv * block_size <= 2**31 - 1 (32-bit cache "
                         f"rows), got {n_blocks} * {hkv} * {block_size} = {rows}")
    return PagedQKVShape(total_q, h, hkv, n_blocks, block_size, d, vs[3], dtype)


def _table_int32(call, block_table):
    """The table as the kernel reads it: int32, an entry outside the int32 range clamped to -1
    or 2**31 - 1 (still outside [0, num_blocks): the kernel's check sees it as bad)."""
    dt = array_info("block_table", block_table)[1]
    if dt == np.int32:
        return call.input(block_table)
    xp = call._cupy if call._cupy is not None else np
    x = block_table if call._cupy is not None else np.asarray(block_table)
    if dt.kind == "u":
        x = xp.minimum(x.astype(xp.uint64), xp.uint64(INT32_MAX))
    else:
        x = xp.clip(x.astype(xp.int64), -1, INT32_MAX)
    return call.input(x.astype(xp.int32))


def _check_variant(score_mod, mask_mod, block_mask, aux_tensors, dtype, b, h, max_q, max_k,
                   max_seqlen_q, max_seqlen_k):
    """A user's variant of a packed batch (:func:`numba_flash.flex.launch.prepare_variant`),
    checked before any launch: ``B`` the number of sequences, a block mask's ``Nq`` / ``Nk``
    from the longest sequence's lengths (``max_q`` / ``max_k``: read on the host whenever there
    is a block mask) up to ``max_seqlen_q`` / ``max_seqlen_k``; ``None`` without one."""
    if score_mod is None and mask_mod is None and block_mask is None and not aux_tensors:
        return None
    from ..flex.launch import prepare_variant
    return prepare_variant(score_mod, mask_mod, aux_tensors, block_mask,
                           compute_dtype=acc_dtype(dtype),
                           shape=(b, h, max_q, max_k),
                           max_seqlens=(int(max_seqlen_q), int(max_seqlen_k)))


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
                   causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   softmax_scale=None, dropout_p=0.0, seed=0, return_lse=False,
                   block_table=None, validate=None, score_mod=None, mask_mod=None,
                   block_mask=None, aux_tensors=(), learnable_sink=None, kv_indices=None,
                   kernel="auto", q_descale=None, k_descale=None, v_descale=None,
                   out_dtype=None, qkv_dtype="auto", out=None, lse_out=None):
    """Attention over a packed batch: ``o [total_q, H, d]``, or ``(o, lse)`` with
    ``return_lse=True`` (``lse [H, total_q]``, float32, float64 for float64 inputs).

    ``q`` is ``[total_q, H, d]``, ``k`` and ``v`` are ``[total_k, Hkv, d]`` (GQA as in
    :func:`numba_flash.forward`); the SIMT kernel (packed, and paged for ``q``) reads views
    whose last dim is contiguous where they lie (a fused projection's ``qkv[:, i]`` slices, a
    head slice at an offset: no copy); a view with a strided last dim or a negative stride is
    copied.
    ``cu_seqlens_q`` / ``cu_seqlens_k`` are integer ``[B + 1]``
    arrays (entries in ``[0, 2**31 - 1]``, 0 first, the packed length last, non-decreasing;
    anything else is a ``ValueError`` / ``TypeError`` naming the array): sequence ``b`` is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of ``q`` against rows
    ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of ``k`` and ``v``.  ``max_seqlen_q`` /
    ``max_seqlen_k`` are ints in ``[0, 2**31 - 1]``, at least the longest sequence.  A window
    edge at or past the longest sequence is unbounded on that side.

    Each sequence is an independent :func:`numba_flash.forward` with its own bottom-right
    alignment (query ``i`` of sequence ``b`` sits at key column ``i + nk_b - nq_b``), and the same
    ``causal``, ``window_size``, ``softcap``, ``alibi_slopes`` (``[H]`` or ``[B, H]``, float32)
    and non-finite rules; a sequence with no keys gives ``o = 0``, ``lse = -inf`` for its rows.
    This equals :func:`numba_flash.reference.attention_varlen`.

    Dropout: sequence ``b``'s keep-mask ``[H, nq_b, nk_b]`` is
    ``numba_flash.dropout_mask(seed, B, H, nq_b, nk_b, dropout_p)[b]``: the Philox counter of
    element ``(b, h, i, j)`` uses the sequence index ``b`` as the batch index and the row ``i`` and
    key ``j`` *within the sequence* (not the packed positions), so a sequence draws the same mask
    as batch entry ``b`` of a padded batch would.

    Paged K/V (``block_table`` given; the prefill of a paged KV cache): ``k`` and ``v`` are
    caches ``[num_blocks, Hkv, block_size, d]`` in :func:`numba_flash.decode`'s layout (any
    ``block_size``; read in their memory order, as :func:`numba_flash.decode` reads them, with
    no copy: heads-first, flash-attn's / vLLM's tokens-first ``[num_blocks, block_size, Hkv,
    d]`` memory passed as its ``cache.transpose(0, 2, 1, 3)`` view, or any order of the outer
    axes with the last dim contiguous; a cache whose rows have gaps is copied) and
    ``block_table`` an integer ``[B, max_blocks]`` array: key ``t`` of
    sequence ``b`` is in physical block ``block_table[b, t // block_size]`` at slot
    ``t % block_size``.  ``cu_seqlens_k`` keeps its meaning as a cumulative count, as in
    flash-attn's ``flash_attn_varlen_func(..., block_table=...)`` (its ``varlen_fwd`` takes
    sequence ``b``'s key count as ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` and, with a table,
    reads those keys from position 0 of the sequence's table row, not from packed offsets; we
    take no ``seqused_k``): sequence ``b`` attends to tokens ``0 .. cu_seqlens_k[b + 1] -
    cu_seqlens_k[b] - 1`` of its table row, and the last entry is the total key count (no
    packed ``k`` to match).  Table entries past a sequence's keys are ignored (may be -1).
    Everything else (variants, GQA, dropout, ``lse``) is as above; the result equals the call
    on the keys gathered into packed ``k``/``v`` bit for bit.  ``validate`` (default ``True``
    for NumPy inputs, ``False`` for device arrays): check on the host, before the launch, that
    the table has room for each sequence's keys and that every entry holding one is in ``[0,
    num_blocks)`` (a ``ValueError`` naming ``block_table``).  Without it the kernel checks
    each entry before it reads through it: nothing outside the cache or the table is read,
    and a query row that sees a key whose entry is bad (or past the table) gets ``o = NaN``,
    ``lse = NaN``; the other rows are as validated.  (``numba_flash.backward_varlen`` takes no
    table.)

    Your own variant (:func:`numba_flash.forward`'s ``score_mod``, ``mask_mod``, ``block_mask``,
    ``aux_tensors``; :mod:`numba_flash.flex`): inside the kernel ``b`` is the sequence index and
    ``q_idx`` / ``kv_idx`` the query's and key's positions *within* sequence ``b`` (from 0), so
    a function means for sequence ``b`` what it means for the batched :func:`numba_flash.forward`
    of that sequence alone at batch index ``b``; an aux array indexed by a position holds it per
    sequence (e.g. ``doc [B, max_seqlen]``, not one entry per packed token).  A block mask comes
    from ``create_block_mask(mask_mod, B, H, Nq, Nk, ...)`` with ``B`` the number of sequences
    (or 1/None: the same for all) and ``Nq``, ``Nk`` the longest sequence's lengths (or
    ``max_seqlen_q`` / ``max_seqlen_k``, or anything in between): the mask is then evaluated
    over ``[Nq x Nk]`` for every sequence, positions past a shorter sequence included, so pad
    its aux arrays to that size (those evaluations can only make a block PARTIAL; the kernel
    never calls the functions there).  EMPTY tiles are never loaded, as in ``forward``.  A
    variant runs on the SIMT forward (the only varlen kernel), the paged prefill
    (``block_table``) included.

    ``kv_indices`` (token-sparse, as :func:`numba_flash.forward`'s): integer ``[total_q, Hkv or
    1, topk]``, packed row ``r``'s keys as positions within its sequence (-1: none), with or
    without ``block_table``; the gathering decode kernels over a right-aligned padded copy of
    ``q`` (:func:`numba_flash.frontend.sparse.sparse_forward_varlen`; ``k`` and ``v`` read in
    place; the tensor-core gather where :func:`numba_flash.forward`'s ``kernel="auto"`` takes
    it).  Not with dropout or the user's functions.

    fp8 (FA3's API, as :func:`numba_flash.forward`'s): e4m3 ``q``, ``k``, ``v`` with
    ``q_descale``, ``k_descale``, ``v_descale`` (float32 ``[B, Hkv]``, a row per sequence),
    ``out_dtype`` and ``kernel`` (``"auto"`` / ``"mma"``, or ``"wgmma"`` for Hopper's e4m3
    build), causal, window, softcap, ALiBi, GQA and sinks, packed or paged (the prefill over an
    e4m3 cache: each sequence's keys gathered through its table row); one launch a sequence
    (:func:`numba_flash.ops.forward_fp8.forward_varlen_fp8`); ``qkv_dtype="fp8_e4m3"``: uint8
    inputs read as e4m3 (CuPy's form, as :func:`numba_flash.forward`'s).  ``kernel`` is
    ``"auto"`` otherwise.

    Empty batches (:mod:`numba_flash.frontend.empty`): ``total_q = 0`` or ``total_k = 0`` (every
    sequence empty on that side; ``cu_seqlens`` of zeros) is answered after every check, without
    a launch: ``o = 0``, ``lse = -inf`` (``sink_h`` with a learnable sink; flash-attn stores
    ``+inf``), packed or paged (a cache of no block then too); ``H = 0`` or ``d = 0`` is a
    ``ValueError``.

    ``out``: an array of ``o``'s shape ``[total_q, H, d_v]`` and dtype (C-contiguous, or a
    view whose last dim is contiguous and whose elements do not overlap, e.g. ``buf[:, :, :d]``
    of a wider buffer: written through its strides, paged too, the elements between its rows
    untouched; of the inputs' kind) that ``o`` is written into and returned as; ``lse_out``:
    the same for ``lse``, C-contiguous (written, and returned with ``return_lse``); not with
    e4m3 inputs or ``kv_indices`` yet (a ``ValueError`` naming the argument).

    Device arrays (CuPy): the call runs on the current stream and returns before the GPU
    finishes.  Device ``cu_seqlens`` are read and checked on the host (as NumPy ones always
    are; a synchronisation) only with ``validate=True``, or with a ``block_mask`` or
    ``kv_indices`` (which need the lengths); otherwise only their dtype and shape are checked
    (a non-int32 one is converted on the device), the launch is sized by ``max_seqlen_q`` /
    ``max_seqlen_k`` (flash-attn's contract: at least the longest sequence; a window edge at or
    past them is unbounded, the same result as at or past the longest) and nothing waits for
    the GPU.  An unvalidated bad ``cu_seqlens`` is not caught: the kernels take the offsets as
    they are, so offsets past ``total_q`` / ``total_k`` or an unordered ``cu_seqlens`` read and
    write outside ``q``, ``k``, ``v``, ``o`` and ``lse`` (the paged cache and its table stay
    bounded: each entry is checked before use), and the rows of a sequence longer than
    ``max_seqlen_q`` are left unwritten; pass ``validate=True`` for offsets not known to be
    good.  A call of a signature seen before (shapes, strides, dtypes, address alignment,
    options, ``max_seqlen_q`` / ``max_seqlen_k``, the stream) replays its launch plan
    (:mod:`numba_flash.frontend.plans`): no checks or configuration again, only the results
    allocated (nothing with ``out`` and without ``return_lse``) and the launch made, with the
    ``cu_seqlens`` (and ``block_table``) of this call; dropout, a ``block_mask``, ``validate=True``
    and a non-int32 ``cu_seqlens`` or table run the ordinary path every call.
    """
    kw = dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
              softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed,
              return_lse=return_lse, block_table=block_table, validate=validate,
              score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
              aux_tensors=aux_tensors, learnable_sink=learnable_sink, kv_indices=kv_indices,
              kernel=kernel, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
              out_dtype=out_dtype, qkv_dtype=qkv_dtype, out=out, lse_out=lse_out)
    if dropout_p == 0.0 and block_mask is None and type(aux_tensors) is tuple:
        # one array as both cu_seqlens (self-attention): once (a plan's arrays never overlap)
        cu_k = None if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k
        arrays = (q, k, v, cu_seqlens_q, cu_k, block_table, alibi_slopes, learnable_sink,
                  q_descale, k_descale, v_descale, kv_indices, out, lse_out) + aux_tensors
        key = plan_key("forward_varlen", arrays, (
            max_seqlen_q, max_seqlen_k, causal, window_size, softcap, softmax_scale,
            return_lse, validate, score_mod, mask_mod, kernel, out_dtype, qkv_dtype))
        if key is not None:
            return run_or_build(key, _forward_varlen, arrays, q, k, v, cu_seqlens_q,
                                cu_seqlens_k, **kw)
    return _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)


def _forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k, causal,
                    window_size, softcap, alibi_slopes, softmax_scale, dropout_p, seed,
                    return_lse, block_table, validate, score_mod, mask_mod, block_mask,
                    aux_tensors, learnable_sink, kv_indices, kernel, q_descale, k_descale,
                    v_descale, out_dtype, qkv_dtype, out, lse_out):
    """:func:`forward_varlen`'s checks and launch (its ordinary path, and what a plan
    records)."""
    fp8 = fp8_inputs({"q": q, "k": k, "v": v}, qkv_dtype)
    if lse_out is not None and (fp8 or kv_indices is not None):
        raise ValueError("lse_out: expected None with e4m3 inputs or kv_indices (not taken "
                         "there yet), got an array")
    if out is not None and (fp8 or kv_indices is not None):
        raise ValueError("out: expected None with e4m3 inputs or kv_indices (not taken there "
                         "yet), got an array")
    if fp8:
        # fp8 (FA3's API, as numba_flash.forward's): the fp8 op, imported by name (no op
        # imports another)
        fp8 = importlib.import_module("numba_flash.ops.forward_fp8").forward_varlen_fp8
        with allow_empty(q=(0,), k=(0,), v=(0,)):   # it skips sequences without rows or keys
            return fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                       max_seqlen_k=max_seqlen_k, causal=causal, window_size=window_size,
                       softcap=softcap, alibi_slopes=alibi_slopes, softmax_scale=softmax_scale,
                       return_lse=return_lse, learnable_sink=learnable_sink, kernel=kernel,
                       q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                       out_dtype=out_dtype, qkv_dtype=qkv_dtype, block_table=block_table,
                       kv_indices=kv_indices, validate=validate, dropout_p=dropout_p,
                       score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
                       aux_tensors=aux_tensors)
    for name, x in (("q_descale", q_descale), ("k_descale", k_descale),
                    ("v_descale", v_descale), ("out_dtype", out_dtype)):
        if x is not None:
            raise ValueError(f"{name}: expected None without e4m3 inputs (FA3's fp8 API), got "
                             f"{x!r}")
    if kernel != "auto":
        raise ValueError(f"kernel: expected 'auto' (the varlen forward chooses its kernel; "
                         f"'mma' / 'wgmma' are for e4m3 inputs), got {kernel!r}")
    paged = block_table is not None
    # NumPy cu_seqlens are read and checked on the host; device ones only when validated
    read = reads_seqlens(q, cu_seqlens_q, cu_seqlens_k, validate, block_mask, kv_indices)
    if paged:
        qkv = _check_paged_qkv(q, k, v)
        # a count, no packed k (None: unknown, a device cu_seqlens_k not read)
        total_k = cumulative_total("cu_seqlens_k", cu_seqlens_k) if read else None
    else:
        qkv = check_packed_qkv(q, k, v, value_dim=True, empty=True)
        total_k = qkv.total_k
    total_q, h, hkv = qkv.total_q, qkv.h, qkv.hkv
    d, d_v, dtype = qkv.d, qkv.d_v, qkv.dtype
    seqlens = check_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q,
                            max_seqlen_k, read)
    cu_q, len_q, cu_k, len_k = seqlens[:4]
    kinds = {"q": q, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k}
    if paged:
        kinds["block_table"] = block_table
    check_same_kind(kinds)
    b = seqlens.n_seq
    # no sequence has a key (not read: max_seqlen_k = 0 says so)
    no_keys = total_k == 0 if total_k is not None else seqlens.max_k == 0
    if paged:   # (a table of no column for no key)
        with allow_empty(block_table=(1,) if no_keys else ()):
            check_prefill_table(block_table, b)
    if kv_indices is not None:   # token-sparse: the gathering decode kernel, padded rows
        return sparse_forward_varlen(
            q, k, v, cu_q, cu_k, kv_indices, block_table=block_table, causal=causal,
            softmax_scale=softmax_scale, return_lse=return_lse, window_size=window_size,
            softcap=softcap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
            validate=validate, dropout_p=dropout_p, score_mod=score_mod, mask_mod=mask_mod,
            block_mask=block_mask, aux_tensors=aux_tensors)
    if validate is None:
        validate = not is_device_array(q)
    validate = check_bool("validate", validate)
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    scale = check_scale(softmax_scale, d, dtype)
    seed_lo, seed_hi, threshold, keep_scale = dropout_params(dropout_p, seed)
    var = check_variants(
        causal, window_size, softcap, alibi_slopes, b, h, nq=seqlens.max_q,
        nk=seqlens.max_k)  # window edges past the longest sequence: unbounded
    left, right, softcap, alibi = var.left, var.right, var.softcap, var.alibi
    use_dropout = float(dropout_p) > 0.0
    # a device sink's values are checked with the lengths (reading them is a synchronisation)
    sink = check_sink(learnable_sink, h, check_values=read)
    variant = _check_variant(score_mod, mask_mod, block_mask, aux_tensors, dtype, b, h,
                             seqlens.max_q, seqlens.max_k, max_seqlen_q, max_seqlen_k)
    out = check_out("out", out, (total_q, h, d_v), dtype, q, strided=True)
    lse_out = check_out("lse_out", lse_out, (h, total_q), acc_dtype(dtype), q)
    if paged and validate:  # after every other check, before any launch
        validate_prefill_table(host_ints(block_table), len_k, qkv.block_size, qkv.n_blocks)
    if paged and qkv.n_blocks == 0 and not no_keys and total_k is not None:
        # (unvalidated: nothing to read from; not read: every key's entry is bad, NaN rows)
        raise ValueError(f"k: expected a paged cache of at least one block for the {total_k} "
                         f"keys cu_seqlens_k counts, got shape {array_info('k', k)[0]}")
    if total_q == 0 or no_keys:   # every sequence without rows or keys: no launch
        o, lse = no_key_outputs({"q": q, "k": k, "v": v, "block_table": block_table},
                                (total_q, h, d_v), dtype, (h, total_q), acc_dtype(dtype), sink,
                                head_axis=0)
        return into_outs(o, lse, out, lse_out, return_lse)

    acc_t = acc_dtype(dtype)
    call = ArrayCall({"q": q, "k": k, "v": v, "block_table": block_table})
    call.reserve({"o": ((total_q, h, d_v), dtype), "lse": ((h, total_q), acc_t)},
                 strided=True)
    # packed views whose last dim is contiguous (a fused projection's q, k, v, a head slice at
    # an offset) are read, and out= written, through their strides (paged or not); the paged
    # build's caches are read in their memory order through row strides (heads-first,
    # flash-attn's tokens-first [.., N, Hkv, d] passed as its transpose(0, 2, 1, 3) view, any
    # order of the outer axes: no copy; as C-contiguous memory whichever build)
    dq = call.input(q, strided=True)
    if paged:
        mem = cache_memory(k, v)
        dk, dv = call.input(mem.k), call.input(mem.v)
    else:
        dk, dv = call.input(k, strided=True), call.input(v, strided=True)
    o = call.output(out, (total_q, h, d_v), dtype, strided=True)
    strided = not all(is_c_contiguous(x) for x in (dq, dk, dv, o))
    # the varlen kernel always carries the score modifiers (off: softcap 0, zero slopes); a
    # user's variant rides on it; one HEAD_DIM holds d and d_v
    head_dim = default_tiles(max(d, d_v), dtype, mods=True)[2]
    vec = vector_tiles(dtype, d, head_dim, dq, dk, dv) and vector_tiles(dtype, d_v, head_dim)
    cfg = forward_simt_config(max(d, d_v), dtype, use_dropout, True, True, paged,
                              user=user_build(variant), vec=vec, own_v=d_v != d,
                              strided=strided)   # cp.async copies
    seqs = (call.input(cu_q), call.input(cu_k))
    if paged:  # the caches' memory as [num_blocks * Hkv * block_size, d] (row blk strides[0]
        # + hk strides[1] + slot strides[2], in its memory order: C-contiguous views, no copy)
        n_blocks, block_size = qkv.n_blocks, qkv.block_size
        rows = n_blocks * hkv * block_size
        dk, dv = dk.reshape(rows, d), dv.reshape(rows, d_v)
        seqs += (_table_int32(call, block_table), np.int32(block_size), np.int32(hkv),
                 np.int32(n_blocks), tuple(np.int32(x) for x in mem.strides))
    va = kernel_variant(call, acc_t, scale, left, right, softcap, alibi, (b, h),
                        (seed_lo, seed_hi, threshold, keep_scale) if use_dropout else None,
                        variant, sink)
    lse = call.output(lse_out, (h, total_q), acc_t)
    n_q_tiles = cdiv(max(1, seqlens.max_q), cfg.BLOCK_M)  # the longest sequence's Q tiles
    # (the simulator's time estimate: each sequence, or b of the longest when not read)
    lens = zip(len_q, len_k) if read else [(seqlens.max_q, seqlens.max_k)] * b
    call.launch(forward_kernel(cfg), forward_grid(n_q_tiles, b * h),
                (cfg.THREADS_N, cfg.THREADS_M), dq, dk, dv, o if strided else o.reshape(-1),
                lse.reshape(-1), va,
                seqs, work=tiled_work("forward", lens, h, cfg.BLOCK_M, cfg.BLOCK_N, left, right,
                                      cfg.THREADS, cfg.HEAD_DIM))
    if return_lse:
        return call.result(o), call.result(lse)
    return call.result(o)
