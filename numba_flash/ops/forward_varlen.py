"""``numba_flash.forward_varlen``: the forward over a packed batch of sequences of different
lengths (flash-attn's ``flash_attn_varlen_func``), one launch for the whole batch."""

from __future__ import annotations

import numpy as np

from ..backend import on_simulator
from ..frontend import ArrayCall
from ..frontend.sim_time import tiled_work
from ..frontend.validate import check_bool, check_same_kind, check_scale
from ..frontend.variants import check_cu_seqlens_pair, check_packed_qkv, check_variants
from ..kernels.common import acc_dtype, cdiv
from ..kernels.forward import default_tiles, forward_grid, forward_kernel, launch_config
from ..philox import dropout_params


def forward_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
                   causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   softmax_scale=None, dropout_p=0.0, seed=0, return_lse=False):
    """Attention over a packed batch: ``o [total_q, H, d]``, or ``(o, lse)`` with
    ``return_lse=True`` (``lse [H, total_q]``, float32, float64 for float64 inputs).

    ``q`` is ``[total_q, H, d]``, ``k`` and ``v`` are ``[total_k, Hkv, d]`` (GQA as in
    :func:`numba_flash.forward`).  ``cu_seqlens_q`` / ``cu_seqlens_k`` are integer ``[B + 1]``
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
    """
    total_q, h, _hkv, total_k, d, dtype = check_packed_qkv(q, k, v)
    cu_q, len_q, cu_k, len_k = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                                                     max_seqlen_q, max_seqlen_k)
    check_same_kind({"q": q, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k})
    b = len(len_q)
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    scale = check_scale(softmax_scale, d)
    seed_lo, seed_hi, threshold, keep_scale = dropout_params(dropout_p, seed)
    window, left, right, softcap, alibi = check_variants(
        causal, window_size, softcap, alibi_slopes, b, h, nq=int(len_q.max()),
        nk=int(len_k.max()))  # window edges past the longest sequence: unbounded
    use_dropout = float(dropout_p) > 0.0

    BLOCK_M, BLOCK_N, HEAD_DIM = default_tiles(d, dtype)
    block, threads_m, threads_n = launch_config(BLOCK_M, BLOCK_N, HEAD_DIM, on_simulator())
    # the varlen kernel always carries the score modifiers (off: softcap 0, zero slopes)
    kern = forward_kernel(BLOCK_M, BLOCK_N, HEAD_DIM, np.dtype(dtype), threads_m, threads_n,
                          use_dropout, True, True)
    acc_t = acc_dtype(dtype)
    dropout = ((seed_lo, seed_hi, threshold, acc_t.type(keep_scale)) if use_dropout else ())

    call = ArrayCall({"q": q, "k": k, "v": v})
    call.reserve({"o": ((total_q, h, d), dtype), "lse": ((h, total_q), acc_t)})
    dq, dk, dv = call.input(q), call.input(k), call.input(v)
    slopes = alibi if alibi is not None else np.zeros((b, h), np.float32)
    mods = (acc_t.type(softcap), acc_t.type(1.0 / softcap if softcap > 0.0 else 0.0),
            call.input(slopes))
    seqs = (call.input(cu_q), call.input(cu_k))
    o = call.empty((total_q, h, d), dtype)
    lse = call.empty((h, total_q), acc_t)
    n_q_tiles = cdiv(max(1, int(len_q.max())), BLOCK_M)  # the longest sequence's Q tiles
    call.launch(kern, forward_grid(n_q_tiles, b * h), block, dq, dk, dv, o, lse,
                acc_t.type(scale), (np.int32(left), np.int32(right)), mods, dropout, seqs,
                work=tiled_work("forward", zip(len_q, len_k), h, BLOCK_M, BLOCK_N, left,
                                right, block[0] * block[1], HEAD_DIM))
    if return_lse:
        return call.result(o), call.result(lse)
    return call.result(o)
