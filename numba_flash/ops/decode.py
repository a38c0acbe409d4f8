"""``numba_flash.decode`` (FlashDecoding over a contiguous or paged KV cache) and
``numba_flash.merge_states`` (the log-sum-exp merge of partial attention states).

The decode is one launch (:mod:`numba_flash.kernels.decode.split_kv`): split-KV blocks, and the last
block of each (sequence, kv head) to finish merges the splits.  With CuPy inputs and the default
``validate=False`` a call only enqueues work on the current stream (no host copy of
``cache_seqlens`` or ``block_table``, no synchronisation), and a call of a signature seen before
replays its launch plan (:mod:`numba_flash.frontend.plans`: its split partials and counters are
the plan's); with ``out=`` (and ``lse_out=``) it allocates nothing, so a serving loop can capture
it in a CUDA graph after a first call, or make its plan ahead with
:func:`numba_flash.decode_plan`; the kernel itself checks every table entry and length it
uses.  With flash_attn_with_kvcache's extras the call composes launches on the same stream:
the rotary kernel on ``q`` and ``k_new`` (:mod:`numba_flash.ops.rotary`), the append kernel
(:mod:`numba_flash.ops.kv_cache`; its new lengths feed the decode launch on the device), then
the decode kernel, which reads ``cache_leftpad`` itself and ``cache_batch_idx`` as a
one-column block table.

Empty batches (:mod:`numba_flash.frontend.empty`) are answered after every check (and the
validation) without a launch: ``B = 0`` (``q [0, H, (Nq,) d]``, ``cache_seqlens [0]``) or
``Nq = 0`` gives empty outputs; a cache that holds no key (a contiguous one with ``Nmax = 0``,
a paged one with no block; every length then 0, which ``validate`` checks) gives ``o = 0``,
``lse = -inf`` (``sink_h`` with a learnable sink; unvalidated, a length other than 0 makes its
rows NaN, as the kernel would); ``k_new`` into such a cache is the room error.  ``H = 0`` or
``d = 0`` is a ``ValueError``.

Split policy (batch invariance)
-------------------------------
Each sequence's split boundaries come from its own length only (computed in the kernel, see
:func:`numba_flash.kernels.decode.config.split_policy`): with ``num_splits=None`` enough splits
that one sequence fills the GPU (the SM count is a constant, 132), of at least 256 keys (16 in the
simulator); with ``num_splits=S`` a split covers ``cdiv(L, S)`` keys rounded up to a whole block
step.  The grid spans the most splits any sequence the cache can hold may have; splits past a
sequence's end are empty (``lse = -inf``) and the combine skips them.  So one sequence's result
is bitwise the same alone or beside any other sequences (flash-attn issue #1897).
"""

from __future__ import annotations

import dataclasses

from typing import NamedTuple

import numpy as np

from ..backend import on_simulator
from ..frontend import ArrayCall
from ..frontend.plans import plan_key, run_or_build
from ..frontend.arrays import host_ints, kernel_ints, strided_view
from ..frontend.sim_time import SimWork
from ..frontend.validate import (
    ATTENTION_DTYPES, FLOAT_DTYPES, INT32_MAX, INT_DTYPES, allow_empty, array_info, array_module,
    check_array, check_bool, check_int, check_out, check_same_dtype, check_same_kind, check_scale,
    is_c_contiguous, is_device_array,
)
from ..frontend.empty import is_empty, no_key_outputs
from ..frontend.variants import (check_alibi, check_sink, check_sink_values, check_softcap,
                                 check_value_shape, check_window, clamp_window, sink_logits)
from ..kernels.core.common import acc_dtype, cdiv
from ..kernels.decode.config import (
    aligned_to, block_step, decode_grid, launch_shape, padded_head_dim, split_grid, split_policy,
    vector_loads,
)
from ..kernels.decode.split_kv import cache_views, decode_kernel
from ..kernels.decode.merge import (
    default_threads as merge_threads, fold_rows, merge_grid, merge_kernel,
)
from ..kernels.decode.mla import mla_decode_config, mla_decode_grid, mla_decode_kernel
from ..kernels.forward.mma import vector_copies
from ..kernels.core.config import MMA_DTYPES
from ..kernels.mainloop.visibility import window_bounds
from ..frontend.fp8 import check_cache_array, check_descales, check_fp8_cache
from ..frontend.kernel_args import (device_constant, kernel_variant, no_descale, no_indices,
                                     no_sink)
from ..frontend.sparse import check_kv_indices, kernel_indices, validate_kv_indices
from ..frontend.cache_args import (
    HEADS_FIRST, cache_memory, cache_tables, check_batch_idx, check_batch_rows, check_new_kv,
    check_same_order, check_writable_cache, kernel_strides, launch_append, row_strides,
    validate_append, write_back,
)
from ..frontend.cache_args import check_positions, check_rotary_tables, launch_rotary

def _check_num_splits(num_splits):
    """``None`` or an int in ``[1, 2**31 - 1]`` (more splits than key tiles are clamped)."""
    if num_splits is None:
        return None
    return check_int("num_splits", num_splits, 1, INT32_MAX,
                     what="an int >= 1 (at most 2**31 - 1) or None")


def _first_bad(mask):
    idx = np.argwhere(mask)
    return tuple(int(i) for i in idx[0]) if idx.size else None


def _check_lengths_and_table(seqlens, table, n_cache, block_size, n_blocks, paged):
    """Value checks on the host copies; ``n_cache`` is Nmax (contiguous) or num_blocks (paged).

    Comparisons run in the arrays' own dtypes and messages print Python ints, so a uint64 value
    shows as passed (never a wrapped negative)."""
    bad = _first_bad(seqlens < 0)  # 0 is an empty cache (o = 0, lse = -inf), as flash-attn
    if bad:
        i = bad[0]
        raise ValueError(f"cache_seqlens: expected every entry >= 0, got {int(seqlens[i])} at "
                         f"index {i}")
    if not paged:
        bad = _first_bad(seqlens > n_cache)
        if bad:
            i = bad[0]
            raise ValueError(f"cache_seqlens: expected every entry <= Nmax = {n_cache} (k_cache "
                             f"dim 2), got {int(seqlens[i])} at index {i}")
        return
    # [docs:paged-validation]
    max_blocks = table.shape[1]
    bad = _first_bad(seqlens > max_blocks * block_size)
    if bad:
        i = bad[0]
        n = int(seqlens[i])
        raise ValueError(
            f"cache_seqlens: entry {i} = {n} needs {-(-n // block_size)} blocks of {block_size} "
            f"tokens, but block_table has {max_blocks} per sequence")
    live = (seqlens.astype(np.int64) + block_size - 1) // block_size
    for b in range(table.shape[0]):
        entries = table[b, :live[b]]
        out = np.flatnonzero((entries < 0) | (entries >= n_blocks))
        if out.size:
            j = out[0]
            raise ValueError(
                f"block_table: expected entries covering live tokens in [0, {n_blocks}) "
                f"(num_blocks of k_cache), got {int(entries[j])} at [{b}, {j}]")
    # [/docs:paged-validation]


def _alibi(alibi_slopes, b, h, check_values):
    """``alibi_slopes`` as float32 ``[B, H]`` (:func:`~numba_flash.frontend.variants.check_alibi`;
    ``check_values``: also reject NaN/inf slopes, which reads device values on the host;
    without it only the dtype and shape are checked, on the host, and a non-finite slope gives
    non-finite scores)."""
    return check_alibi(alibi_slopes, b, h, check_values=check_values)


def _check_variant(score_mod, mask_mod, block_mask, aux_tensors, dtype):
    """A user's variant of the decode (:func:`numba_flash.flex.launch.prepare_variant`),
    checked before any launch; None without one.  No block mask: a decode row reads the few
    key tiles of its sequence anyway, so ``mask_mod`` is evaluated per key."""
    if block_mask is not None:
        raise ValueError(f"block_mask: expected None (decode evaluates mask_mod per key: pass "
                         f"the block mask's mask_mod as mask_mod), got "
                         f"{type(block_mask).__name__}")
    from ..flex.functions import check_aux_tensors
    aux = check_aux_tensors(aux_tensors)  # a tuple of arrays (TypeError otherwise)
    if score_mod is None and mask_mod is None and not aux:
        return None
    from ..flex.launch import prepare_variant
    return prepare_variant(score_mod, mask_mod, aux, compute_dtype=acc_dtype(dtype))


def decode(q, k_cache, v_cache, *, cache_seqlens, block_table=None, causal=False,
           softmax_scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
           num_splits=None, return_lse=False, validate=None, k_new=None, v_new=None,
           rotary_cos=None, rotary_sin=None, rotary_interleaved=True, cache_batch_idx=None,
           cache_leftpad=None, score_mod=None, mask_mod=None, block_mask=None, aux_tensors=(),
           learnable_sink=None, head_dim_v=None, kernel="auto", k_descale=None, v_descale=None,
           kv_cache_dtype="auto", kv_indices=None, out=None, lse_out=None):
    """Attention of a few new query tokens against a KV cache (FlashDecoding split-KV), with
    flash-attn's ``flash_attn_with_kvcache`` extras (append, rotary, batch indices, left pad).

    * ``q``: ``[B, H, d]`` (one token per sequence) or ``[B, H, Nq, d]``.
    * contiguous cache (``block_table=None``): ``k_cache``, ``v_cache`` ``[Bc, Hkv, Nmax, d]``
      (``Bc = B`` unless ``cache_batch_idx`` is given); sequence ``b`` uses positions ``0 ..
      cache_seqlens[b] - 1`` of cache row ``b``.
    * paged cache: ``k_cache``, ``v_cache`` ``[num_blocks, Hkv, block_size, d]`` (any block
      size) and an integer ``block_table`` ``[B, max_blocks]``: token ``t`` of sequence ``b`` is
      in physical block ``block_table[b, t // block_size]`` at slot ``t % block_size``.  Entries
      past a sequence's live blocks are ignored (may be -1).
    * the caches' memory: the axis order above is the arguments', the memory's is read from
      their strides: heads-first (C-contiguous), tokens-first (flash-attn's, vLLM's ``[n, N,
      Hkv, d]`` memory passed as its ``transpose(0, 2, 1, 3)`` view) or any other order of the
      three outer axes with the last dim contiguous, read (and appended to) where it lies, no
      copy (:func:`numba_flash.frontend.cache_args.cache_memory`; ``v_cache`` in ``k_cache``'s
      order, else it is copied into it).  A cache with gaps between its rows whose outer
      strides are whole rows of ``d`` (a fused projection's ``k`` / ``v`` slices,
      ``qkv[:, :, 1]`` of a ``[B, N, 3, H, d]`` buffer as ``[B, H, N, d]``; ``v_cache`` with
      ``k_cache``'s row strides) is read where it lies too, as the rows of its memory
      (:func:`~numba_flash.frontend.cache_args.gapped_rows`), but for ``k_new`` (a cache
      appended to) and NumPy caches on a GPU; other caches with gaps (strides that are not
      whole rows, a negative stride) are copied.
    * ``cache_seqlens``: integer ``[B]``, each in ``[0, Nmax]`` (paged: within the table); a
      length of 0 is an empty cache: every row gets ``o = 0``, ``lse = -inf``.
    * ``k_new``, ``v_new``: ``[B, Hkv, Nnew, d]``, appended to the caches at ``cache_seqlens``
      before attending (:func:`numba_flash.append_kv`; the caches are written in place, and the
      attention sees ``cache_seqlens + Nnew`` keys).  ``cache_seqlens`` itself is not modified:
      the caller adds ``Nnew``.  The cache must have room, and a paged cache's table must give
      each new token a slot no other token uses (blocks shared for reading are fine; both
      checked under ``validate``).
    * ``rotary_cos``, ``rotary_sin``: ``[max_position, rotary_dim / 2]`` in ``q``'s dtype (with
      ``k_new`` only, as flash-attn): ``k_new`` token ``i`` is rotated at position
      ``cache_seqlens[b] + i``, and ``q`` token ``i`` at ``cache_seqlens[b] + i`` when ``causal``
      or a window edge is set (in ``[0, capacity)``), else every query token at
      ``cache_seqlens[b]`` (flash-attn's rule; :func:`numba_flash.apply_rotary`).  Positions are
      cache indices (``cache_leftpad`` does not shift them, as in flash-attn).
      ``rotary_interleaved``: ``True`` (flash-attn's default here) pairs ``(x[2i], x[2i+1])``
      (GPT-J), ``False`` the halves (GPT-NeoX).
    * ``cache_batch_idx``: integer ``[B]``, the cache row of each sequence (contiguous caches
      only, as flash-attn); entries in ``[0, Bc)``, distinct when appending.
    * ``cache_leftpad``: integer ``[B]``: sequence ``b``'s keys are positions ``[cache_leftpad[b],
      cache_seqlens[b] (+ Nnew))``, the tokens before it are not part of the sequence (the
      causal / window / ALiBi alignment is to the sequence's end, as flash-attn).  Contiguous or
      paged.
    * ``causal``, ``window_size=(left, right)``, ``softcap``, ``alibi_slopes`` (float32 ``[H]``
      or ``[B, H]``): flash-attn's variants, bottom-right aligned: query token ``i`` of ``Nq``
      sits at key column ``i + L - Nq`` (``causal`` is ``right = 0``; see
      :mod:`numba_flash.kernels.mainloop.visibility`).  GQA/MQA: query head ``h`` reads kv head
      ``h // (H // Hkv)``.
    * a value head dim of its own: ``v_cache`` (and ``v_new``) ``[..., d_v]`` with ``d_v`` in
      1..256 (``o`` has ``d_v`` columns; the default scale stays ``1/sqrt(d)``).  MLA's
      absorbed decode: ``v_cache=None`` and ``head_dim_v=d_v``: the value is the first
      ``d_v`` columns of ``k_cache`` itself (one latent cache ``[.., d]``, ``d`` up to 576 as
      DeepSeek's ``512 + 64``, read twice, never copied); not with ``k_new``: new tokens'
      rows go in with ``numba_flash.append_kv(k_cache, None, rows, None, ...)`` first.
    * ``kernel``: ``"auto"`` (default), ``"mma"`` or ``"simt"``.  The tensor-core decode
      (:mod:`numba_flash.kernels.decode.mla`: 16 heads of one query token per block share each
      read of the cache) takes float16 / bfloat16 caches with ``d`` and ``d_v`` multiples of
      64 and no softcap, ALiBi or user functions: MLA's latent cache (e4m3 too), or K and V
      caches of their own.  ``"auto"`` takes it for every latent-cache call it serves and for
      token-sparse calls (``kv_indices``) with at least 8 query heads a kv head (half its
      16-row tile); ``"mma"`` asks for it (a ``ValueError`` naming ``kernel`` says why it
      cannot), ``"simt"`` keeps the split-KV SIMT kernel every other call runs.
    * ``learnable_sink``: float32 ``[H]`` (gpt-oss's attention sinks, as
      :func:`numba_flash.forward`): a key with no value in every row's denominator, ``lse``
      included; a row that sees no key gets ``o = 0``, ``lse = sink_h``.  With several splits
      the combine adds it once (a split's partial is the softmax of its own keys alone).
    * an fp8 cache: ``k_cache`` and ``v_cache`` of dtype ``ml_dtypes.float8_e4m3fn`` (NumPy)
      beside a float16, bfloat16 or float32 ``q`` (``o`` in ``q``'s dtype), ``d`` and ``d_v``
      multiples of 4 (``d`` at least 16), and FA3's descale factors ``k_descale``,
      ``v_descale`` float32 ``[B, Hkv]`` (None: 1): key ``j``'s values are ``k_cache *
      k_descale[b, kvh]`` (the same for V).  Widened exactly in registers (a GPU of compute
      capability >= 8.9; the SIMT kernel); ``k_new`` / ``v_new`` (in ``q``'s dtype) are written
      as the e4m3 of ``x / descale`` (round to nearest even, saturated to +-448).  MLA's
      latent cache in e4m3 (``v_cache=None``): ``k_descale`` scales keys and values (the same
      bytes; ``v_descale`` must be None); with a float16 / bfloat16 ``q`` and head dims
      multiples of 64 the tensor-core decode (its tiles widened to 16 bits in shared memory).
      e5m2 is a ``TypeError``.  The
      reference: :func:`numba_flash.reference.dequantize`.  ``kv_cache_dtype="fp8_e4m3"``
      (vLLM's name; default ``"auto"``): uint8 caches read as e4m3 bytes, the form a CuPy
      array (no fp8 dtype) carries them in.
    * ``kv_indices``: token-sparse attention (DeepSeek V3.2's DSA, FA4's ``gather_kv_indices``):
      integer ``[B, Hkv or 1, Nq, topk]``, query token ``i`` sees only the key positions
      ``kv_indices[b, kvh or 0, i]`` (tokens of its sequence, as ``kv_idx`` below; -1: none),
      and-ed with every rule above (a listed key past the diagonal stays hidden).  The kernel
      reads only the listed rows (a block per query token, its heads sharing the list; the
      splits divide the list).  Validated: entries in ``[-1, L)`` (``L`` after the append), no
      key twice in a list (:mod:`numba_flash.frontend.sparse`); without validation a bad
      entry makes its token's rows NaN.  The SIMT kernel, or the tensor-core one (a tile of
      16 or 32 list entries' K and V rows gathered into shared memory, each through its page).
      The reference: :func:`numba_flash.reference.sparse_attention`.
    * ``num_splits``: ``None`` (enough splits to fill the GPU, from each sequence's own length),
      ``1`` (no split) or any ``S`` in ``[1, 2**31 - 1]`` (clamped to the key tiles of the
      cache's capacity).
    * ``validate``: check ``cache_seqlens``, ``block_table``, ``cache_batch_idx``,
      ``cache_leftpad``, the room for ``k_new`` and the rotary positions on the host before any
      launch (nothing is written when one fails), with a ``ValueError`` naming the argument.
      Default ``True`` for NumPy inputs and ``False`` for device (CuPy) inputs, where the call
      then never waits for the GPU.  Without validation nothing outside the cache is ever read
      or written: an appended token that does not fit is skipped; a sequence whose length is
      outside ``[0, capacity]``, whose left pad is outside ``[0, L]``, whose
      ``cache_batch_idx`` is outside ``[0, Bc)`` or whose table has an entry outside ``[0,
      num_blocks)`` for a key that some query row sees gets ``o = NaN`` and ``lse = NaN``; a
      rotary position past the tables rotates to NaN.

    Your own variant (FlexAttention's functions, :mod:`numba_flash.flex`, as
    :func:`numba_flash.forward` takes them; every dtype, contiguous or paged):

    * ``mask_mod(b, h, q_idx, kv_idx, *aux_tensors) -> bool``: True where the query sees the
      key, and-ed with ``causal`` / ``window_size``;
    * ``score_mod(score, b, h, q_idx, kv_idx, *aux_tensors) -> float``: the score the softmax
      uses, from the score after scale, softcap and ALiBi;
    * ``aux_tensors``: a tuple of arrays the functions read (moved to the inputs' device).

    Their arguments: ``b`` the sequence (the row of ``q``, not its ``cache_batch_idx`` row),
    ``h`` the query head, ``kv_idx`` the key's position in its sequence (token ``t`` of the
    cache, never a physical page slot) and ``q_idx = cache_seqlens[b] (+ Nnew) - Nq + i`` for
    query token ``i``: the ``q_idx`` and ``kv_idx`` that :func:`numba_flash.forward` of the
    whole sequence gives that row.  With ``cache_leftpad`` both stay cache positions (the
    keys are ``kv_idx`` in ``[cache_leftpad[b], L)``, as the rotary positions): a function
    that wants positions from the pad subtracts it (``cache_leftpad`` as an aux tensor).  The
    functions run only for keys the built-in rules let a row see.  ``block_mask`` is not
    taken (``ValueError``): a decode row reads its few key tiles anyway, so ``mask_mod`` is
    evaluated per key.  :func:`numba_flash.reference.kvcache_decode` takes the same functions.

    Launches: the rotary kernel on ``q`` and on ``k_new`` (with rotary tables), the append
    kernel (with ``k_new``), then the decode kernel, on one stream.

    Non-finite values (as torch SDPA): a NaN/inf in a query row or in a key the row sees makes
    that row's ``o`` and ``lse`` NaN; a NaN/inf in ``v[j, c]`` of a key the row sees makes
    ``o[.., c]`` non-finite; stale slots (past ``cache_seqlens``, before the left pad), other
    sequences' blocks and keys outside the window never affect a row; a row that sees no key
    gets ``o = 0``, ``lse = -inf``.

    Returns ``o`` in ``q``'s shape and dtype, and with ``return_lse`` also ``lse`` (``[B, H]`` or
    ``[B, H, Nq]``, float32; float64 for float64 inputs).  NumPy in, NumPy out; CuPy in, CuPy out.
    Element types: float16, float32, float64 and bfloat16 (``ml_dtypes.bfloat16``; computed in
    float32, ``o`` bfloat16); ``q``, the caches, ``k_new``/``v_new`` and the rotary tables share
    one (a mix is a ``TypeError`` naming the argument).  Empty batches (``B`` or ``Nq`` 0, a
    cache that holds no key): no launch, ``o = 0``, ``lse = -inf`` / ``sink_h`` (module doc).

    ``out``: an array of ``o``'s shape and dtype (of ``q``'s kind) that ``o`` is written into
    and returned as: C-contiguous, or (a ``[B, H, Nq, d]`` ``q``) a view whose last dim is
    contiguous and whose elements do not overlap (flash-attn's ``[B, Nq, H, d]`` memory as its
    ``transpose(0, 2, 1, 3)``: the split-KV kernels write it through its strides, MLA's
    tensor-core kernel into a new array copied into it); ``lse_out``: the same for ``lse``,
    C-contiguous (written, and returned with ``return_lse``).  ``q`` ``[B, H, Nq, d]``,
    ``k_new``, ``v_new``: such views are read where they lie (the split-KV kernels, the append;
    MLA's tensor-core kernel copies ``q``).  With device arrays and ``validate`` off a call
    never waits for the GPU, and a call of a signature seen before (shapes, strides, dtypes, address
    alignment, options, stream) replays its launch plan (:mod:`numba_flash.frontend.plans`):
    its work arrays (split partials, counters) are the plan's, so with ``out`` it allocates
    nothing.  :func:`numba_flash.decode_plan` makes such a plan ahead of the first call
    (FlashInfer's plan / run), for a loop a CUDA graph captures.
    """
    kw = dict(cache_seqlens=cache_seqlens, block_table=block_table, causal=causal,
              softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
              alibi_slopes=alibi_slopes, num_splits=num_splits, return_lse=return_lse,
              validate=validate, k_new=k_new, v_new=v_new, rotary_cos=rotary_cos,
              rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved,
              cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad, score_mod=score_mod,
              mask_mod=mask_mod, block_mask=block_mask, aux_tensors=aux_tensors,
              learnable_sink=learnable_sink, head_dim_v=head_dim_v, kernel=kernel,
              k_descale=k_descale, v_descale=v_descale, kv_cache_dtype=kv_cache_dtype,
              kv_indices=kv_indices, out=out, lse_out=lse_out)
    if block_mask is None and type(aux_tensors) is tuple:
        arrays = (q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, rotary_cos,
                  rotary_sin, cache_batch_idx, cache_leftpad, alibi_slopes, learnable_sink,
                  k_descale, v_descale, kv_indices, lse_out, out) + aux_tensors
        key = plan_key("decode", arrays, (causal, softmax_scale, window_size, softcap,
                                          num_splits, return_lse, validate, rotary_interleaved,
                                          score_mod, mask_mod, block_mask, head_dim_v, kernel,
                                          kv_cache_dtype))
        if key is not None:
            return run_or_build(key, _decode, arrays, q, k_cache, v_cache, **kw)
    return _decode(q, k_cache, v_cache, **kw)


#: :func:`decode`'s array arguments in a launch plan's order (its ``aux_tensors`` follow)
DECODE_ARRAYS = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "k_new", "v_new",
                 "rotary_cos", "rotary_sin", "cache_batch_idx", "cache_leftpad", "alibi_slopes",
                 "learnable_sink", "k_descale", "v_descale", "kv_indices", "lse_out", "out")
#: its other arguments, in the plan key's order
DECODE_OPTIONS = ("causal", "softmax_scale", "window_size", "softcap", "num_splits",
                  "return_lse", "validate", "rotary_interleaved", "score_mod", "mask_mod",
                  "block_mask", "head_dim_v", "kernel", "kv_cache_dtype")


def _defaults():
    import inspect

    return {n: p.default for n, p in inspect.signature(decode).parameters.items()
            if p.default is not inspect.Parameter.empty}


def decode_options_key(options):
    """The plan key's options tuple of a :func:`decode` call with keyword ``options`` (the
    rest at their defaults), as :func:`decode` builds it."""
    full = {**_defaults(), **options}
    return tuple(full[n] for n in DECODE_OPTIONS)


def decode_unplanned(q, k_cache, v_cache, **options):
    """:func:`decode`'s checks and launches with keyword ``options`` (the rest at their
    defaults): the ordinary path, which :func:`numba_flash.decode_plan` records."""
    return _decode(q, k_cache, v_cache, **{**_defaults(), **options})


def decode_output(q, k_cache, v_cache, options):
    """A new ``o`` for a call on ``q`` (an array of ``q``'s library, shape ``q.shape[:-1] +
    (d_v,)``, ``q``'s dtype): the ``out`` of a plan's runs."""
    from ..frontend.arrays import device_module

    d_v = options.get("head_dim_v") if v_cache is None else v_cache.shape[-1]
    xp = device_module(q, "q")
    return xp.empty(tuple(q.shape[:-1]) + (int(d_v),), q.dtype)


def _decode(q, k_cache, v_cache, *, cache_seqlens, block_table, causal, softmax_scale,
            window_size, softcap, alibi_slopes, num_splits, return_lse, validate, k_new, v_new,
            rotary_cos, rotary_sin, rotary_interleaved, cache_batch_idx, cache_leftpad,
            score_mod, mask_mod, block_mask, aux_tensors, learnable_sink, head_dim_v, kernel,
            k_descale, v_descale, kv_cache_dtype, kv_indices, out, lse_out):
    """:func:`decode`'s checks and launches (its ordinary path, and what a plan records)."""
    s = _check_caches(q, k_cache, v_cache, head_dim_v=head_dim_v, k_new=k_new, v_new=v_new,
                      cache_seqlens=cache_seqlens, block_table=block_table,
                      cache_batch_idx=cache_batch_idx, kv_cache_dtype=kv_cache_dtype)
    unit_descale = k_descale is None and v_descale is None   # ones: a device constant
    kv_descale = check_descales({"k_descale": k_descale, "v_descale": v_descale}, s.b, s.hkv,
                                s.kv_fp8, (q, k_cache, v_cache))
    if s.kv_fp8 and s.latent:   # MLA: the value is the latent cache's bytes, K's descale
        _latent_descale(kv_descale, v_descale)
    if kv_indices is not None:
        s = s._replace(topk=check_kv_indices(kv_indices, s.b, s.hkv, s.nq))
    arrays = _decode_arrays(s, q, k_cache, v_cache, cache_seqlens, block_table=block_table,
                            kv_indices=kv_indices,
                            alibi_slopes=alibi_slopes, k_new=k_new, v_new=v_new,
                            rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                            cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad)
    new = _check_new_tokens(s, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin,
                            rotary_interleaved, cache_leftpad)
    check_same_kind(arrays)
    # the caches in their memory order (heads-first, tokens-first, ...): C-contiguous views
    # the kernels read (and the append writes) through row strides, no copy; without an
    # append, views whose rows have gaps (a fused projection's k / v slices) as the rows of
    # their memory where the kernels get them in place (the simulator, device arrays)
    mem = cache_memory(k_cache, None if s.latent else v_cache,
                       gaps=k_new is None and (on_simulator() or is_device_array(k_cache)))
    arrays["k_cache"] = mem.k
    if not s.latent:
        arrays["v_cache"] = mem.v
    # (a strided out= of a [B, H, Nq, d] q: written through its strides, or copied into)
    out = check_out("out", out, s.qs[:-1] + (s.d_v,), s.dtype, q, strided=not s.single)
    lse_out = check_out("lse_out", lse_out, s.qs[:-1], acc_dtype(s.dtype), q)
    opts = _check_options(s, arrays, q, k_cache, causal=causal, return_lse=return_lse,
                          softmax_scale=softmax_scale, window_size=window_size, softcap=softcap,
                          num_splits=num_splits, score_mod=score_mod, mask_mod=mask_mod,
                          block_mask=block_mask, aux_tensors=aux_tensors, validate=validate,
                          alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                          kernel=kernel)
    capacity = s.n_slots * (block_table_shape(block_table)[1] if s.paged else 1)
    window = opts.window
    # flash-attn rotates the queries at their own positions when the mask depends on them
    q_step = int(opts.causal or 0 <= window[0] < capacity or 0 <= window[1] < capacity)

    call = ArrayCall(arrays)  # rejects device arrays in the simulator, before any copy
    seqlens = None
    if opts.validate:  # every check before the first launch: nothing is written when one fails
        seqlens = _validate_on_host(s, new, q_step, cache_seqlens=cache_seqlens,
                                    block_table=block_table, cache_batch_idx=cache_batch_idx,
                                    cache_leftpad=cache_leftpad)
        if kv_indices is not None:
            validate_kv_indices(kv_indices, seqlens)
    if is_empty(s.b, s.nq, s.n_cache, capacity):   # no row, or no key: no launch
        answer = _no_key_answer(s, arrays, opts, new, cache_seqlens, cache_batch_idx,
                                cache_leftpad)
        o, lse = answer if opts.return_lse else (answer, None)
        if out is not None:
            out[...] = o
            o = out
        if lse_out is not None and lse is not None:
            lse_out[...] = lse
            lse = lse_out
        return (o, lse) if opts.return_lse else o
    plan = _launch_plan(s, opts, capacity)
    _reserve(call, s, new, plan)
    # both kernels read q through its strides (flash-attn's [B, Nq, H, d] memory as it lies)
    dev = _device_inputs(call, s, new, q_step, q=q, mem=mem, k_new=k_new, v_new=v_new,
                         rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                         cache_seqlens=cache_seqlens, block_table=block_table,
                         cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                         kv_descale=kv_descale, unit_descale=unit_descale)
    lengths = seqlens if opts.validate else [capacity] * s.b
    out4 = None if out is None else out.reshape(s.b, s.h, s.nq, s.d_v)
    lse4 = None if lse_out is None else lse_out.reshape(s.b, s.h, s.nq)
    if plan.mla is not None:   # the tensor-core decode (kernels/decode/mla.py)
        o, lse = _mla_decode_mma(
            call, dev.q, dev.k, dev.table, dev.paged, dev.lengths, dev.leftpad, plan.mla,
            shape=MlaShape(s.b, s.h, s.hkv, s.nq, s.d, s.d_v),
            dtype=s.dtype, scale=opts.scale, window=(plan.left, plan.right), sink=opts.sink,
            n_cache=s.n_cache, n_slots=s.n_slots, strides=dev.strides,
            lengths=lengths if s.topk is None else [s.topk] * s.b,
            lists=no_indices(call) if kv_indices is None else kernel_indices(call, kv_indices),
            v_cache=None if s.latent else dev.v,
            kv_descale=None if kv_descale is None else _descale(call, kv_descale, unit_descale),
            out=out4,
            lse_out=lse4)
    else:
        d_descale = None if kv_descale is None else _descale(call, kv_descale, unit_descale)
        o, lse = _launch_split_kv(call, dev, s, opts, plan, lengths, d_descale, kv_indices,
                                  out4, lse4)
    if k_new is not None:  # NumPy caches: the appended tokens back into the caller's arrays
        write_back(call, mem.k, dev.k)   # (nothing to do where the kernels wrote them there)
        write_back(call, mem.v, dev.v)
    return _outputs(call, s, o, lse, opts.return_lse, out, lse_out)


class DecodeShape(NamedTuple):
    """The checked dims of a :func:`decode` call (:func:`_check_caches`): ``q`` of shape ``qs``
    as ``[B, H, Nq, d]`` (``single``: given as ``[B, H, d]``), the caches ``[n_cache, Hkv,
    n_slots, d]`` with values ``d_v`` wide (``latent``: MLA's one cache, ``v_cache=None``),
    ``paged`` with a block table, ``kv_fp8``: e4m3 caches (``dtype`` is then ``q``'s), ``topk``:
    the length of ``kv_indices``' lists (None: dense)."""

    qs: tuple
    dtype: np.dtype
    b: int
    h: int
    nq: int
    d: int
    d_v: int
    hkv: int
    n_cache: int
    n_slots: int
    single: bool
    latent: bool
    paged: bool
    kv_fp8: bool
    topk: object = None


def _latent_descale(kv_descale, v_descale):
    """An e4m3 latent cache's descales (``[2, B, Hkv]``): the value is the key's bytes, scaled by
    ``k_descale``, so ``v_descale`` must be None."""
    if v_descale is not None:
        raise ValueError("v_descale: expected None with v_cache=None (the value is k_cache's "
                         "first head_dim_v columns, scaled by k_descale), got an array")
    kv_descale[1] = kv_descale[0]


def _no_key_answer(s, arrays, opts, new, cache_seqlens, cache_batch_idx, cache_leftpad):
    """:func:`decode` of no row (``B`` or ``Nq`` 0) or of a cache that holds no key (checked
    and, with ``validate``, validated): ``o = 0``, ``lse = -inf`` or the sink's logit
    (:mod:`numba_flash.frontend.empty`), no launch.  Unvalidated, the rows the kernels would
    make NaN are NaN: a length (after the append) other than 0, a left pad other than 0, a
    ``cache_batch_idx`` entry outside ``[0, Bc)`` (computed on the arrays' own device)."""
    def bad(xp):   # on the arrays' own device: no host copy
        rows = (xp.asarray(cache_seqlens) != 0) | (new.nnew > 0)
        if cache_leftpad is not None:
            rows |= xp.asarray(cache_leftpad) != 0
        if cache_batch_idx is not None:
            cbi = xp.asarray(cache_batch_idx)
            rows |= (cbi < 0) | (cbi >= s.n_cache)
        return rows.reshape((s.b, 1) if s.single else (s.b, 1, 1))

    lse_shape = s.qs[:-1]
    o, lse = no_key_outputs(arrays, lse_shape + (s.d_v,), s.dtype, lse_shape, acc_dtype(s.dtype),
                            opts.sink, bad=None if opts.validate else bad)
    return (o, lse) if opts.return_lse else o


#: the axes of decode's arrays an empty batch (``B``, ``Nq``) or an empty cache (``Bc``,
#: ``Nmax``; paged: ``num_blocks``, a table of no column) leaves 0
_EMPTY_CACHE_AXES, _EMPTY_PAGED_AXES = (0, 2), (0,)


def _check_caches(q, k_cache, v_cache, *, head_dim_v, k_new, v_new, cache_seqlens, block_table,
                  cache_batch_idx, kv_cache_dtype="auto"):
    """The shape and dtype checks of ``q``, the caches, ``cache_seqlens``, ``block_table`` and
    ``cache_batch_idx`` (in :func:`decode`'s order); returns a :class:`DecodeShape`.  Empty
    batches and caches pass (:func:`_no_key_answer` answers them)."""
    q_rank = len(array_info("q", q)[0])
    qs, dtype = check_array("q", q, (3, 4), ATTENTION_DTYPES, (0,) if q_rank == 3 else (0, 2))
    cache_axes = _EMPTY_CACHE_AXES if block_table is None else _EMPTY_PAGED_AXES
    with allow_empty(k_cache=cache_axes, v_cache=cache_axes, cache_batch_idx=(0,)):
        return _check_cache_shapes(qs, dtype, k_cache, v_cache, head_dim_v=head_dim_v,
                                   k_new=k_new, v_new=v_new, cache_seqlens=cache_seqlens,
                                   block_table=block_table, cache_batch_idx=cache_batch_idx,
                                   kv_cache_dtype=kv_cache_dtype)


def _check_cache_shapes(qs, dtype, k_cache, v_cache, *, head_dim_v, k_new, v_new,
                        cache_seqlens, block_table, cache_batch_idx, kv_cache_dtype):
    """:func:`_check_caches` after ``q``'s own check (``qs``, ``dtype``)."""
    ks, kd = check_cache_array("k_cache", k_cache, kv_cache_dtype)
    latent = v_cache is None                  # MLA: the value is k_cache's first head_dim_v
    if latent:
        vd = kd
        if head_dim_v is None:
            raise ValueError("head_dim_v: expected the value head dim (an int: the first "
                             "head_dim_v columns of k_cache are the value, MLA's absorbed "
                             "decode) with v_cache=None, got None")
        d_v = check_int("head_dim_v", head_dim_v, 1, min(ks[3], 512),
                        what=f"an int in 1..{min(ks[3], 512)} (at most k_cache's head dim)")
        if k_new is not None or v_new is not None:
            raise ValueError("k_new: expected None with v_cache=None (appending to a latent "
                             "cache: numba_flash.append_kv first), got an array")
        vs = ks[:3] + (d_v,)
    else:
        vs, vd = check_cache_array("v_cache", v_cache, kv_cache_dtype)
        if head_dim_v is not None:
            raise ValueError(f"head_dim_v: expected None with a v_cache (its head dim, "
                             f"{vs[3]}, is the value's), got {head_dim_v!r}")
    kv_fp8 = check_fp8_cache(kd, vd, dtype, ks[3], vs[3],
                             "head_dim_v" if latent else "v_cache")
    if not kv_fp8:
        dtype = check_same_dtype({"q": dtype, "k_cache": kd, "v_cache": vd})
    paged = block_table is not None
    single = len(qs) == 3
    b, h, nq, d = (qs[0], qs[1], 1, qs[2]) if single else qs
    check_value_shape(ks, vs, True, "k_cache", "v_cache", 512 if latent else 256)
    d_v = vs[3]
    n_cache, hkv, n_slots, dk = ks
    if dk != d:
        raise ValueError(f"k_cache: expected head dim {d} (from q), got {dk}")
    if d > (576 if latent else 256):
        raise ValueError(f"q: expected head dim 1..256 (1..576 with an MLA latent cache, "
                         f"v_cache=None), got {d}")
    if h % hkv:
        raise ValueError(f"k_cache: expected a number of kv heads that divides the {h} query "
                         f"heads of q (GQA), got {hkv}")
    check_batch_idx(cache_batch_idx, b, paged)
    if not paged and cache_batch_idx is None and n_cache != b:
        raise ValueError(f"k_cache: expected batch size {b} (from q) in dim 0 of a contiguous "
                         f"cache, got {n_cache}")
    (ls,), _ = check_array("cache_seqlens", cache_seqlens, 1, INT_DTYPES, (0,))
    if ls != b:
        raise ValueError(f"cache_seqlens: expected shape ({b},) (batch of q), got ({ls},)")
    if paged:
        ts, _ = check_array("block_table", block_table, 2, INT_DTYPES, (0, 1))
        if ts[0] != b:
            raise ValueError(f"block_table: expected {b} rows (batch of q), got shape {ts}")
    return DecodeShape(qs, dtype, b, h, nq, d, d_v, hkv, n_cache, n_slots, single, latent, paged,
                       kv_fp8)


def _decode_arrays(s, q, k_cache, v_cache, cache_seqlens, **optional):
    """The call's arrays by name (for :func:`check_same_kind` and :class:`ArrayCall`): ``q``,
    the caches, ``cache_seqlens`` and each optional array given."""
    arrays = {"q": q, "k_cache": k_cache, "cache_seqlens": cache_seqlens}
    if not s.latent:
        arrays["v_cache"] = v_cache
    arrays.update({n: x for n, x in optional.items() if x is not None})
    return arrays


class NewTokens(NamedTuple):
    """``k_new`` / ``v_new`` and the rotary tables of a :func:`decode` call, checked:
    ``append`` with ``k_new``, of ``nnew`` tokens; ``rotary`` with tables of ``max_position``
    rows."""

    append: bool
    nnew: int
    rotary: bool
    max_position: object
    interleaved: bool


def _check_new_tokens(s, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin,
                      rotary_interleaved, cache_leftpad):
    """The checks of the append (``k_new``, ``v_new``), the rotary tables, ``rotary_interleaved``
    and ``cache_leftpad``'s shape; returns :class:`NewTokens`."""
    if (k_new is None) != (v_new is None):
        have, miss = ("k_new", "v_new") if v_new is None else ("v_new", "k_new")
        raise ValueError(f"{miss}: expected an array with {have} (both or neither), got None")
    nnew = 0
    if k_new is not None:
        with allow_empty(k_new=(0,), v_new=(0,)):   # B = 0: an empty batch appends nothing
            nnew = check_new_kv(k_new, v_new, s.b, s.hkv, s.d, s.dtype, d_v=s.d_v,
                                dtype_of="q" if s.kv_fp8 else "k_cache")
        check_writable_cache("k_cache", k_cache)
        check_writable_cache("v_cache", v_cache)
        check_same_order(k_cache, v_cache)
    rotary = rotary_cos is not None or rotary_sin is not None
    max_position = None
    if rotary:
        if rotary_cos is None or rotary_sin is None:
            miss = "rotary_cos" if rotary_cos is None else "rotary_sin"
            raise ValueError(f"{miss}: expected an array with the other rotary table (both or "
                             "neither), got None")
        if k_new is None:
            raise ValueError("rotary_cos: expected k_new and v_new with the rotary tables (q and "
                             "k_new are rotated as they are appended, as flash-attn), got "
                             "k_new=None")
        max_position, _ = check_rotary_tables(rotary_cos, rotary_sin, s.d, s.dtype,
                                              names=("rotary_cos", "rotary_sin"))
    rotary_interleaved = check_bool("rotary_interleaved", rotary_interleaved)
    if cache_leftpad is not None:
        (lp,), _ = check_array("cache_leftpad", cache_leftpad, 1, INT_DTYPES, (0,))
        if lp != s.b:
            raise ValueError(f"cache_leftpad: expected shape ({s.b},) (batch of q), got ({lp},)")
    return NewTokens(k_new is not None, nnew, rotary, max_position, rotary_interleaved)


class DecodeOptions(NamedTuple):
    """The scalar options of a :func:`decode` call, checked (:func:`_check_options`); ``alibi``
    float32 ``[B, H]`` or None, ``sink`` float32 ``[H]`` or None, ``mla_mma``: the
    tensor-core decode (MLA's kernel, :func:`_mma_decode`) runs the call."""

    causal: bool
    return_lse: bool
    scale: float
    window: tuple
    softcap: float
    num_splits: object
    variant: object
    validate: bool
    alibi: object
    sink: object
    mla_mma: bool


def _check_options(s, arrays, q, k_cache, *, causal, return_lse, softmax_scale, window_size,
                   softcap, num_splits, score_mod, mask_mod, block_mask, aux_tensors, validate,
                   alibi_slopes, learnable_sink, kernel):
    """The flags, scale, variants, ``num_splits``, ``validate`` (default: on for host arrays),
    ALiBi slopes, sink and kernel choice, in :func:`decode`'s order: a :class:`DecodeOptions`."""
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    scale = check_scale(softmax_scale, s.d, s.dtype)
    window = check_window(window_size)
    softcap = check_softcap(softcap)
    num_splits = _check_num_splits(num_splits)
    variant = _check_variant(score_mod, mask_mod, block_mask, aux_tensors, s.dtype)
    on_device = any(is_device_array(x) for x in arrays.values())
    if validate is None:
        validate = not on_device
    validate = check_bool("validate", validate)
    alibi = None
    if alibi_slopes is not None:
        alibi = _alibi(alibi_slopes, s.b, s.h, check_values=validate or not on_device)
    sink = check_sink(learnable_sink, s.h, check_values=validate or not on_device)
    mla_mma = _mma_decode(kernel, s, softcap, alibi_slopes, variant,
                          [arrays[n] for n in ("q", "k_cache", "v_cache") if n in arrays])
    return DecodeOptions(causal, return_lse, scale, window, softcap, num_splits, variant,
                         validate, alibi, sink, mla_mma)


def _validate_on_host(s, new, q_step, *, cache_seqlens, block_table, cache_batch_idx,
                      cache_leftpad):
    """``validate=True``: the value checks of the lengths, tables, batch indices, room for the
    append, rotary positions and left pads on host copies, before any launch; returns the
    lengths the attention sees (``cache_seqlens + Nnew``)."""
    nq, n_cache, n_slots, paged = s.nq, s.n_cache, s.n_slots, s.paged
    nnew = new.nnew
    seqlens = host_ints(cache_seqlens)
    table = host_ints(block_table) if paged else None
    cbi = host_ints(cache_batch_idx) if cache_batch_idx is not None else None
    if new.append:
        validate_append(seqlens, table, cbi, nnew, n_cache, n_slots, paged)
    elif cbi is not None:
        check_batch_rows(cbi, n_cache)
    if new.rotary:
        last_k = seqlens.astype(np.float64) + nnew - 1
        last_q = seqlens.astype(np.float64) + (nq - 1) * q_step
        check_positions("rotary_cos", np.maximum(last_k, last_q), new.max_position,
                        "cache_seqlens[b] + max(Nnew, Nq) - 1" if q_step else
                        "cache_seqlens[b] + Nnew - 1")
    seqlens = seqlens.astype(np.int64) + nnew if nnew else seqlens
    _check_lengths_and_table(seqlens, table, n_slots if not paged else n_cache,
                             n_slots, n_cache, paged)
    if cache_leftpad is not None:
        pads = host_ints(cache_leftpad)
        bad = np.flatnonzero((pads < 0) | (pads > seqlens))
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"cache_leftpad: expected entries in [0, cache_seqlens[b]"
                             f"{' + Nnew' if nnew else ''}], got {int(pads[i])} at index {i} "
                             f"(length {int(seqlens[i])})")
    return seqlens


class LaunchPlan(NamedTuple):
    """How a :func:`decode` call launches (:func:`_launch_plan`): the split-KV tile choice
    ``cfg`` (a DecodeConfig) for ``head_dim`` lanes, ``chunks`` row chunks per (sequence, kv
    head), the split policy (``step`` keys a block step, ``split_target``, ``split_min``,
    ``n_splits``), the kernels' window bounds, the SIMT ``grid`` (None with ``mla``: MLA's
    :class:`MlaPlan`), and ``n_parts`` float partials for the merge."""

    cfg: object
    head_dim: int
    chunks: int
    step: int
    split_target: int
    split_min: int
    n_splits: int
    left: int
    right: int
    grid: object
    mla: object
    n_parts: int


def _launch_plan(s, opts, capacity):
    """The launch shape and split policy of a call (each sequence's split size from its own
    length): a :class:`LaunchPlan`."""
    b, h, hkv, nq, d, d_v = s.b, s.h, s.hkv, s.nq, s.d, s.d_v
    HEAD_DIM = padded_head_dim(max(d, d_v))   # one lane layout holds both widths
    group = h // hkv
    gather = s.topk is not None   # token-sparse: a block per query token, its heads its rows
    block_rows = group if gather else group * nq
    shape = launch_shape(s.dtype, HEAD_DIM, block_rows,   # the tile choice (a DecodeConfig)
                         KV_FP8=s.kv_fp8, GATHER=gather)
    threads, lanes = shape.THREADS, shape.LANES
    keys_per_step, rows = shape.U, shape.ROWS
    chunks = cdiv(block_rows, rows) * (nq if gather else 1)   # blocks per (sequence, kv head)
    num_splits = opts.num_splits
    # [docs:decode-split-policy]
    step = block_step(threads, lanes, keys_per_step)
    split_target, split_min = split_policy(num_splits, hkv, step)
    n_splits = split_grid(split_target, split_min, s.topk if gather else capacity)
    # [/docs:decode-split-policy]
    # window edges at or past the capacity (keys) or Nq (queries) are unbounded: int32-safe
    left, right = window_bounds(opts.causal, clamp_window(*opts.window, nq, capacity))
    grid = mla = None
    if opts.mla_mma:   # MLA's tensor-core kernel: its own grid, splits and partials
        mla = _mla_plan(d, d_v, s.dtype, num_splits, b, h, hkv, nq,
                        s.topk if gather else capacity, opts.sink, gather, not s.latent,
                        s.kv_fp8)
        n_parts = mla.n_splits if mla.partial else 0
    else:
        # [docs:decode-grid]
        grid = decode_grid(b, hkv, chunks, n_splits)
        # [/docs:decode-grid]
        n_parts = n_splits if n_splits > 1 else 0
    return LaunchPlan(shape, HEAD_DIM, chunks, step, split_target, split_min, n_splits, left,
                      right, grid, mla, n_parts)


def _reserve(call, s, new, plan):
    """The device memory the call allocates, checked before any copy (:meth:`ArrayCall.reserve`)."""
    rows_total = s.b * s.h * s.nq
    call.reserve({"o": ((rows_total, s.d_v), s.dtype),
                  "o_part": ((plan.n_parts, rows_total, s.d_v), acc_dtype(s.dtype)),
                  "rotated q and k_new": ((rows_total + s.b * s.hkv * new.nnew
                                           if new.rotary else 0, s.d), s.dtype)})


class DeviceCache(NamedTuple):
    """A call's device arrays as the decode kernels read them (:func:`_device_inputs`): ``q``
    ``[B, H, Nq, d]`` (rotated), the caches' memory as rows ``k`` ``[n_cache * Hkv * n_slots,
    d]`` (a cache with gaps between its rows: the rows of its memory from its first element),
    ``v`` (``d_v`` wide; ``k`` itself for a latent cache), the ``lengths`` the attention
    sees (after the append), the block ``table`` (``paged``: read through it), the left pads,
    and ``strides``, the rows between the caches' blocks, kv heads and slots
    (:func:`~numba_flash.frontend.cache_args.row_strides` of their memory order)."""

    q: object
    k: object
    v: object
    lengths: object
    paged: bool
    table: object
    leftpad: object
    strides: tuple


def _device_inputs(call, s, new, q_step, *, q, mem, k_new, v_new, rotary_cos,
                   rotary_sin, cache_seqlens, block_table, cache_batch_idx, cache_leftpad,
                   kv_descale=None, unit_descale=False):
    """The inputs on the device, with ``q`` and ``k_new`` rotated and ``k_new`` / ``v_new``
    appended (those launches on the call's stream): a :class:`DeviceCache`.  ``mem``: the
    caches in their memory order (:func:`~numba_flash.frontend.cache_args.cache_memory`).  The
    kernels read a ``[B, H, Nq, d]`` q through its strides (a view whose last dim is contiguous,
    as it lies; a ``[B, H, d]`` q is copied), the append ``k_new`` and ``v_new``."""
    b, hkv, nnew, d, d_v = s.b, s.hkv, new.nnew, s.d, s.d_v
    n_cache, n_slots, dtype = s.n_cache, s.n_slots, s.dtype
    dq = call.input(q, strided=not s.single)
    if s.single:  # [B, H, d] -> [B, H, 1, d] after the copy: Numba device arrays take no None index
        dq = dq.reshape(dq.shape[0], dq.shape[1], 1, dq.shape[2])
    # the kernel reads the caches' memory as rows [num_blocks * Hkv * block_size, d] (in
    # their memory order: row blk * strides[0] + kvh * strides[1] + slot * strides[2]), one
    # index per key row, fewer registers than four; a view, no copy
    k_cache, v_cache = mem.k, mem.v
    if s.kv_fp8 and not is_device_array(k_cache):   # e4m3 travels as its bytes (Numba has no
        k_cache = k_cache.view(np.uint8)                # fp8 dtype)
        v_cache = None if s.latent else v_cache.view(np.uint8)
    # (a cache whose rows have gaps: already the rows of its memory, mem.gapped)
    n_rows = k_cache.shape[0] if mem.gapped else n_cache * hkv * n_slots
    dk_ = call.input(k_cache).reshape(n_rows, d)
    # MLA: the value rows are the key rows (the kernel reads their first d_v columns)
    dv_ = dk_ if s.latent else call.input(v_cache).reshape(n_rows, d_v)
    d_len = kernel_ints(call, cache_seqlens, "cache_seqlens")
    # [docs:contiguous-as-paged]
    # a contiguous cache needs no table: the kernel reads block b with block_size = Nmax;
    # with cache_batch_idx it is a paged cache of Bc blocks of Nmax slots, the indices its
    # one-column table
    paged_kernel, d_table = cache_tables(call, block_table, cache_batch_idx, b)
    # [/docs:contiguous-as-paged]
    if k_new is not None:  # rotate q and k_new (at the old lengths), then append: new lengths
        dkn, dvn = call.input(k_new, strided=True), call.input(v_new, strided=True)
        if new.rotary:
            d_cos, d_sin = call.input(rotary_cos), call.input(rotary_sin)
            dq = launch_rotary(call, dq, d_cos, d_sin, d_len, 0, q_step, 1, new.interleaved,
                               dtype)
            dkn = launch_rotary(call, dkn, d_cos, d_sin, d_len, 0, 1, 1, new.interleaved,
                                dtype)
        d_len = launch_append(call, dk_, dv_, dkn, dvn, d_len, d_table, paged_kernel, n_cache,
                              n_slots, b, hkv, nnew, d, dtype, kv_descale, strides=mem.strides,
                              unit_descale=unit_descale)
    d_pad = (kernel_ints(call, cache_leftpad, "cache_leftpad") if cache_leftpad is not None
             else device_constant(call, ("no_leftpad", b), np.zeros((b,), np.int32)))
    return DeviceCache(dq, dk_, dv_, d_len, paged_kernel, d_table, d_pad, mem.strides)


def _descale(call, kv_descale, unit):
    """An e4m3 cache's ``[2, B, Hkv]`` descales on the device: a device constant of ones when
    none was given (``unit``: the same memory every call, so a plan replays it), else copied
    in as given."""
    if unit:
        return device_constant(call, ("unit_descale",) + tuple(kv_descale.shape), kv_descale)
    return call.input(kv_descale)


def _launch_split_kv(call, dev, s, opts, plan, lengths, kv_descale=None, kv_indices=None,
                     out=None, lse_out=None):
    """The split-KV SIMT decode launch (:mod:`numba_flash.kernels.decode.split_kv`): each split
    block, and the last of each (sequence, kv head) to finish merges the splits.  ``lengths``:
    each sequence's key count for the simulator's estimate; ``kv_descale``: an e4m3 cache's
    ``[2, B, Hkv]`` descales (None: none); ``kv_indices``: token-sparse lists (None: dense).
    Returns device ``(o, lse)``."""
    b, h, hkv, nq, d, d_v = s.b, s.h, s.hkv, s.nq, s.d, s.d_v
    dtype, latent, grid, n_splits = s.dtype, s.latent, plan.grid, plan.n_splits
    shape, HEAD_DIM, step = plan.cfg, plan.head_dim, plan.step
    threads, chunk, keys_per_step = shape.THREADS, shape.CHUNK, shape.U
    acc_t = acc_dtype(dtype)
    rows_total = b * h * nq
    o = call.output(out, (b, h, nq, d_v), dtype, strided=True)   # (o[b, h, tok, c] writes)
    lse = call.output(lse_out, (b, h, nq), acc_t)
    if n_splits > 1:
        o_part = call.empty((n_splits, rows_total, d_v), acc_t)
        lse_part = call.empty((n_splits, rows_total), acc_t)
        counters = call.zeros((grid[0],), np.int32)
    else:  # one split writes o and lse directly
        o_part = call.empty((1, 1, 1), acc_t)
        lse_part = call.empty((1, 1), acc_t)
        counters = call.zeros((1,), np.int32)
    # 16-byte loads of q, K, V: d == HEAD_DIM, and V as wide (or the K rows themselves)
    vec = (d_v == d or latent) and vector_loads(np.uint8 if s.kv_fp8 else dtype, d, HEAD_DIM,
                                                chunk, dev.q, dev.k, dev.v)
    for name, x in (("k_cache", dev.k), ("v_cache", dev.v)):   # 32-bit word loads (host
        if s.kv_fp8 and not vec and not aligned_to(4, x):     # caches are copied aligned)
            raise ValueError(f"{name}: expected a 4-byte aligned e4m3 cache (4 values per "
                             f"load), got an unaligned view")
    # a block size that keys_per_step does not divide: a step's keys may straddle two pages
    split_pages = bool(dev.paged) and s.n_slots % keys_per_step != 0
    # the user's arrays: (a stand-in for kinds,) + aux
    variant = opts.variant
    va = kernel_variant(call, acc_t, opts.scale, plan.left, plan.right, opts.softcap,
                        opts.alibi, variant=variant, sink=opts.sink)
    kernel = decode_kernel(dataclasses.replace(
        shape, VEC=vec, PAGED=bool(dev.paged), SOFTCAP=opts.softcap > 0,
        ALIBI=opts.alibi is not None, SPLIT_PAGES=split_pages and kv_indices is None,
        OWN_V=d_v != d or latent, GATHER=kv_indices is not None,
        SLOT_STRIDE=dev.strides[2] != 1,   # (tokens-first: a slot is Hkv rows)
        USER=None if variant is None else (variant.score_mod, variant.mask_mod)))
    # the simulator's estimate: each block's steps of `step` keys, over each sequence's keys
    trips = sum(-(-int(n if s.topk is None else s.topk) // step) + n_splits - 1
                for n in lengths) * hkv * plan.chunks
    dk_read, dv_read = cache_views(dtype, vec, dev.k, dev.v)  # bfloat16 VEC: float32 word pairs
    call.launch(kernel, grid, (threads,), dev.q, dk_read, dv_read, dev.table, dev.lengths,
                dev.leftpad, o, lse, o_part, lse_part, counters, va, np.int32(dev.paged),
                np.int32(s.n_cache), np.int32(hkv), np.int32(s.n_slots),
                kernel_strides(dev.strides), np.int32(plan.split_target),
                np.int32(plan.split_min),
                no_descale(call) if kv_descale is None else kv_descale,
                no_indices(call) if kv_indices is None else kernel_indices(call, kv_indices),
                work=SimWork("decode", trips * threads,
                             grid[0] * grid[1] * threads * HEAD_DIM))
    return o, lse


def _outputs(call, s, o, lse, return_lse, out=None, lse_out=None):
    """``o`` in ``q``'s shape (``d_v`` columns; the caller's ``out`` itself when given), and
    ``lse`` with ``return_lse`` (``lse_out`` itself when given), as the caller's kind of
    array."""
    o = call.result(o)
    o = out if out is not None else o.reshape(s.qs[:-1] + (s.d_v,))
    if not return_lse:
        return o
    lse = call.result(lse)
    return o, lse_out if lse_out is not None else lse.reshape(s.qs[:-1])


#: the kernel choices of :func:`decode`
DECODE_KERNELS = ("auto", "simt", "mma")


#: the fewest query heads of a kv head for which ``kernel="auto"`` takes the tensor-core
#: decode with a value cache of its own and ``kv_indices``: half of the 16 rows of its tile
#: (fewer leave most of each ``mma`` to padding; the SIMT kernel then reads as few bytes)
MMA_MIN_GROUP = 8


def _mma_decode(kernel, s, softcap, alibi_slopes, variant, arrays):
    """Whether :func:`decode` runs the tensor-core decode (:mod:`numba_flash.kernels.decode.mla`,
    16 heads of one query token a block): it takes float16 / bfloat16 caches, or an e4m3
    latent cache beside a float16 / bfloat16 ``q`` (widened in shared memory), ``d`` and
    ``d_v`` multiples of 64, no softcap, ALiBi or user functions, 16-byte aligned ``q`` and
    caches on a GPU.  ``kernel="auto"`` takes it for MLA's latent cache (``v_cache=None``) and
    for token-sparse calls (``kv_indices``) with a value cache of its own and at least
    :data:`MMA_MIN_GROUP` query heads a kv head; ``"mma"`` asks for it (a ValueError naming
    ``kernel`` with the reason where it cannot), ``"simt"`` keeps the split-KV SIMT kernel."""
    if not isinstance(kernel, str) or kernel not in DECODE_KERNELS:
        raise ValueError(f"kernel: expected one of {DECODE_KERNELS}, got {kernel!r}")
    if kernel == "simt":
        return False
    d, d_v = s.d, s.d_v
    why = None
    if s.kv_fp8 and not s.latent:
        why = "float16 or bfloat16 caches, or an e4m3 latent cache (got e4m3 K and V caches)"
    elif np.dtype(s.dtype).name not in MMA_DTYPES:
        why = f"float16 or bfloat16 (got {np.dtype(s.dtype).name})"
    elif d % 64 or d_v % 64:
        why = f"head dims that are multiples of 64 (got d = {d} and d_v = {d_v})"
    elif softcap > 0 or alibi_slopes is not None or variant is not None:
        why = "no softcap, ALiBi, score_mod or mask_mod"
    elif not vector_copies(d, d, *(x for x in arrays
                                   if on_simulator() or hasattr(x, "__cuda_array_interface__"))):
        why = "16-byte aligned q and caches"
    if why is not None and kernel == "mma":
        raise ValueError(f"kernel: 'mma' (the tensor-core decode) takes {why}; pass "
                         f"kernel='auto' or 'simt'")
    if kernel == "auto" and not s.latent:   # GQA's own V: only token-sparse, a full tile
        return why is None and s.topk is not None and s.h // s.hkv >= MMA_MIN_GROUP
    return why is None


class MlaPlan(NamedTuple):
    """MLA's tensor-core decode of one call: its configuration, split policy (the decode's,
    with ``STEP = BLOCK_N``), grid, and whether it writes float32 partials for the merge."""

    cfg: object
    split_target: int
    split_min: int
    n_splits: int
    grid: tuple
    partial: bool


class MlaShape(NamedTuple):
    """The dims MLA's tensor-core decode launches over: ``q [B, H, Nq, d]``, ``Hkv`` cache heads,
    ``d_v`` value columns."""

    b: int
    h: int
    hkv: int
    nq: int
    d: int
    d_v: int


def _mla_plan(d, d_v, dtype, num_splits, b, h, hkv, nq, capacity, sink, gather=False,
              own_v=False, kv_fp8=False):
    """The :class:`MlaPlan` of a call (a ValueError past CUDA's grid limits)."""
    cfg = mla_decode_config(d, d_v, np.dtype(dtype).name, gather, own_v, kv_fp8)
    split_target, split_min = split_policy(num_splits, hkv, cfg.BLOCK_N)
    n_splits = split_grid(split_target, split_min, capacity)
    grid = mla_decode_grid(b, hkv, nq, h // hkv, n_splits)
    return MlaPlan(cfg, split_target, split_min, n_splits, grid, n_splits > 1 or sink is not None)


def _mla_decode_mma(call, dq, cache, table, paged, seqlens, leftpad, plan, *, shape, dtype, scale,
                    window, sink, n_cache, n_slots, lengths, lists, v_cache=None,
                    kv_descale=None, out=None, lse_out=None, strides=None):
    """The launches of MLA's tensor-core decode (:class:`MlaPlan` ``plan``, :class:`MlaShape`
    ``shape``) on validated device arrays (``cache``: the rows ``[n_cache * Hkv * n_slots,
    d]`` of its memory, ``strides`` their row strides, None: heads-first; ``v_cache``: a value
    cache's rows ``[.., d_v]`` (the same order), None for the latent cache;
    ``lists``: the int32 ``kv_indices``, or the kernel's stand-in; ``kv_descale``: an e4m3
    latent cache's device ``[2, B, Hkv]`` descales, ``cache`` its bytes): the kernel, then,
    with several splits or a learnable sink, the merge of its float32 partials (which adds the
    sink once).  A ``dq`` or ``out`` view (last dim contiguous) is read or written where it
    lies: the kernel's ``STRIDED`` build, and the merge's into a strided ``out``.  Returns
    device ``(o, lse)``."""
    b, h, hkv, nq = shape.b, shape.h, shape.hkv, shape.nq
    d_v = shape.d_v
    cfg, n_splits, partial = plan.cfg, plan.n_splits, plan.partial
    rows = b * h * nq
    f32 = np.float32
    o = call.output(out, (b, h, nq, d_v), dtype, strided=True)   # (a strided out=: in place)
    lse = call.output(lse_out, (b, h, nq), f32)
    o_strided = not is_c_contiguous(o)
    if o_strided or not is_c_contiguous(dq):   # q read, o written through their strides
        cfg = dataclasses.replace(cfg, STRIDED=True)
    o_part = call.empty((n_splits * rows * d_v,) if partial else (1,), f32)
    lse_part = call.empty((n_splits * rows,) if partial else (1,), f32)
    va = kernel_variant(call, f32, scale, *window)   # the sink joins in the merge, once
    trips = sum(-(-int(n) // cfg.BLOCK_N) + n_splits for n in lengths) * hkv * nq * \
        -(-(h // hkv) // 16)
    if strides is None:
        strides = row_strides((n_cache, hkv, n_slots), HEADS_FIRST)
    call.launch(mla_decode_kernel(cfg), plan.grid, (cfg.THREADS,), dq.view(np.uint16),
                cache.view(np.uint16), table, seqlens, leftpad,
                o if cfg.STRIDED else o.reshape(-1), lse.reshape(-1),
                o_part, lse_part, va, np.int32(paged), np.int32(n_cache), np.int32(hkv),
                np.int32(n_slots), kernel_strides(strides), np.int32(plan.split_target),
                np.int32(plan.split_min), np.int32(partial), lists,
                cache.view(np.uint16) if v_cache is None else v_cache.view(np.uint16),
                no_descale(call) if kv_descale is None else kv_descale,
                work=SimWork("forward_mma", trips * cfg.THREADS))
    if partial:
        xp = array_module(sink) if sink is not None else np
        row_sinks = (no_sink(call) if sink is None else call.input(xp.ascontiguousarray(
            xp.broadcast_to(xp.asarray(sink)[None, :, None], (b, h, nq))).reshape(-1)))
        threads = merge_threads()
        # a strided out=: the rows as (b, h, i), o written through its strides
        folded = (b, h, nq) if o_strided else (rows,)
        call.launch(merge_kernel(threads, np.dtype(f32), dtype, o_strided), merge_grid(rows),
                    (threads,), o_part.reshape((n_splits,) + folded + (d_v,)),
                    lse_part.reshape((n_splits,) + folded), row_sinks,
                    o if o_strided else o.reshape(rows, d_v), lse.reshape(rows),
                    work=SimWork("merge", n_splits * rows * d_v))
    return o, lse


def block_table_shape(block_table):
    return array_info("block_table", block_table)[0]


def merge_states(o_parts, lse_parts, learnable_sink=None):
    """Merge partial attention states over disjoint key sets, stacked on axis 0.

    ``o_parts`` ``[P, ..., d]`` (float16/32/64 or ``ml_dtypes.bfloat16``), ``lse_parts``
    ``[P, ...]`` (float32; float64 for float64 ``o_parts``).  Returns ``(o, lse)`` of shapes
    ``[..., d]`` (``o_parts``' dtype) and ``[...]``: ``lse = log sum_p exp(lse_p)``, ``o =
    sum_p exp(lse_p - lse) o_p``.  Parts with ``lse_p = -inf`` contribute nothing (whatever
    their ``o_p`` holds); if all are ``-inf``, ``o = 0`` and ``lse = -inf``.  A part with
    ``lse_p = NaN`` makes the row's ``o`` and ``lse`` NaN; ``lse_p = +inf`` gives ``lse =
    +inf`` and ``o = NaN``; a NaN in ``o_p`` of a non-empty part reaches ``o``.  Used by
    cascade / ring attention.

    ``learnable_sink`` (float32, broadcastable to ``lse_parts.shape[1:]``: e.g. ``sink[:, None]``
    for ``[P, B, H, N]`` parts; ``-inf``: none): the rows' attention-sink logits, added once
    as one more part with ``lse_p = sink`` and ``o_p = 0`` (the parts being the plain softmax
    of their own keys): the merge of split partials with the sink is the unsplit attention with
    it (a row whose parts are all empty gets ``o = 0``, ``lse = sink``).

    Views are read where they lie, through their strides, when ``o_parts``' last dim is
    contiguous and its row axes (``shape[1:-1]``) fold into at most three (neighbours whose
    strides chain merged, axes of one element dropped): parts stacked from flash-attn's ``[B,
    N, H, d]`` outputs and viewed ``[P, B, H, N, d]``, a head or batch slice; ``lse_parts``
    likewise when its last dim is contiguous.  Other views are copied first, as is a
    ``lse_parts`` whose last dim is strided.  ``o`` and ``lse`` are new C-contiguous arrays.

    Device arrays: no synchronisation, and a call of a signature seen before replays its
    launch plan (:mod:`numba_flash.frontend.plans`).
    """
    arrays = (o_parts, lse_parts, learnable_sink)
    key = plan_key("merge_states", arrays, ())
    if key is not None:
        return run_or_build(key, _merge_states, arrays, *arrays)
    return _merge_states(*arrays)


def _merge_states(o_parts, lse_parts, learnable_sink):
    """:func:`merge_states`'s checks and launch (its ordinary path, and what a plan
    records)."""
    shape, _ = array_info("o_parts", o_parts)
    if not 2 <= len(shape) <= 9:
        raise ValueError(f"o_parts: expected a 2-D to 9-D array [P, ..., d], got shape {shape} "
                         f"({len(shape)}-D)")
    os_, dtype = check_array("o_parts", o_parts, len(shape), ATTENTION_DTYPES)
    acc_t = acc_dtype(dtype)
    ls_, ldt = check_array("lse_parts", lse_parts, len(shape) - 1, FLOAT_DTYPES)
    if ldt != acc_t:
        raise TypeError(f"lse_parts: expected dtype {acc_t} (for o_parts of dtype {dtype}), "
                        f"got {ldt}")
    if ls_ != os_[:-1]:
        raise ValueError(f"lse_parts: expected shape {os_[:-1]} (o_parts.shape[:-1]), got {ls_}")
    arrays = {"o_parts": o_parts, "lse_parts": lse_parts}
    if learnable_sink is not None:
        arrays["learnable_sink"] = learnable_sink
    check_same_kind(arrays)
    n_parts, d = os_[0], os_[-1]
    rows = int(np.prod(os_[1:-1], dtype=np.int64))
    grid = merge_grid(rows)
    sink = _row_sinks(learnable_sink, ls_[1:])

    call = ArrayCall(arrays)
    folded = _strided_rows(o_parts, lse_parts)
    if folded is None:   # C-contiguous parts (or views copied to C order): rows flattened
        d_o = call.input(o_parts).reshape(n_parts, rows, d)
        d_l = call.input(lse_parts).reshape(n_parts, rows)
    else:                # views read where they lie, their rows folded into three axes
        d_o = call.input(o_parts, strided=True).reshape((n_parts,) + folded + (d,))
        d_l = call.input(lse_parts, strided=True).reshape((n_parts,) + folded)
    d_s = no_sink(call) if sink is None else call.input(sink)
    o = call.empty((rows, d), dtype)
    lse = call.empty((rows,), acc_t)
    threads = merge_threads()
    call.launch(merge_kernel(threads, dtype, dtype, folded is not None), grid, (threads,), d_o,
                d_l, d_s, o if folded is None else o.reshape(folded + (d,)), lse,
                work=SimWork("merge", n_parts * rows * d))
    return call.result(o).reshape(os_[1:]), call.result(lse).reshape(ls_[1:])


def _strided_rows(o_parts, lse_parts):
    """The row axes of :func:`merge_states`' parts folded into three (:func:`fold_rows`) when
    ``o_parts`` is a view the strided merge reads where it lies (its last dim contiguous:
    :func:`~numba_flash.frontend.arrays.strided_view`, e.g. parts stacked from flash-attn's
    ``[B, N, H, d]`` outputs viewed as ``[P, B, H, N, d]``), with ``lse_parts``' strides (its
    own where it too is such a view, else C order: it is copied); None for C-contiguous parts
    (the flat build), another producer's arrays (no strides) and views whose rows do not fold
    into three axes (copied to C order, as before)."""
    if is_c_contiguous(o_parts) and is_c_contiguous(lse_parts):
        return None
    o_st, l_st = getattr(o_parts, "strides", None), getattr(lse_parts, "strides", None)
    if o_st is None or l_st is None or not strided_view(o_parts):
        return None
    shape = tuple(int(n) for n in o_parts.shape[1:-1])
    if not strided_view(lse_parts):   # copied: C order (in elements: any unit will do)
        l_st = tuple(int(np.prod(lse_parts.shape[i + 1:], dtype=np.int64))
                     for i in range(len(lse_parts.shape)))
    return fold_rows(shape, tuple(o_st[1:-1]), tuple(l_st[1:]))


def _row_sinks(learnable_sink, row_shape):
    """``learnable_sink`` of :func:`merge_states` as one float32 logit per row (C order of
    ``row_shape``), NumPy or CuPy as given; None without one.  Checked: float32, broadcastable
    to ``row_shape``, no NaN or +inf."""
    if learnable_sink is None:
        return None
    shape, xp, s = sink_logits(learnable_sink, "one logit per row, as the attention ops take it")
    try:
        ok = np.broadcast_shapes(shape, tuple(row_shape)) == tuple(row_shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"learnable_sink: expected a shape broadcastable to {tuple(row_shape)} "
                         f"(lse_parts.shape[1:]), got {shape}")
    check_sink_values(s)
    return xp.ascontiguousarray(xp.broadcast_to(s, tuple(row_shape))).reshape(-1)
