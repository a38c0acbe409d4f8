"""Merging partial attention states with the log-sum-exp rule (FlashDecoding stage 2).

Math
----
Part ``p`` of a row holds a normalised output ``o_p`` over its own key set and that set's
log-sum-exp ``lse_p``.  Over the union of the (disjoint) key sets::

    m   = max_p lse_p
    w_p = exp(lse_p - m)                  (the part's share of the softmax mass, up to 1/W)
    W   = sum_p w_p,   lse = m + log W,   o = (sum_p w_p o_p) / W

A part with ``lse_p = -inf`` saw no key: it is skipped, not added as ``w_p = 0`` (a garbage ``o_p``
cannot leak in, and the bits do not depend on how many empty parts a launch has: the split-KV
decode's batch invariance); a row whose parts are all ``-inf`` gets ``o = 0, lse = -inf``.  A
learnable sink is one more part, ``lse_p = sink``, ``o_p = 0``, joined once here, never inside a
split (``sink = -inf``: none).  Non-finite parts follow :func:`numba_flash.reference.merge_states`:
a NaN ``lse_p`` makes the row NaN, a ``+inf`` one gives ``lse = +inf`` and ``o = NaN``, a NaN in a
non-empty ``o_p`` reaches ``o``.

The device functions are the whole rule: :func:`make_merge_functions` (``merge_stats``,
``merge_element``), called by this file's :func:`merge_kernel` and by the decode's fused combine
(:mod:`numba_flash.kernels.decode.split_kv`); :func:`make_state_merge` is the same rule on the
online softmax's ``(m_p, l_p)`` (the decode's merge of its key groups).

Grid / block
------------
grid = ``(rows,)`` (:func:`merge_grid`: the x dimension, limit 2**31 - 1, never y or z, limit
65535), block = ``(THREADS,)``.  Every thread of block ``row`` computes the row's ``m`` and ``W``
(the ``P`` lse values are the same few words for all threads: broadcast loads), then thread ``t``
merges the head-dim elements ``t, t + THREADS, ...`` (coalesced); thread 0 writes ``lse``.  No
shared memory.  Parts are read in their dtype and merged in float32 (float64 for float64 parts);
``o`` is written in the output dtype (bfloat16: the loads and stores of
:mod:`~numba_flash.kernels.core.elements`).  :data:`PAIRS`: the (part, output) dtypes launched.

The derivation, the notes' ``wrong_merge`` and the non-finite cases, run: docs/merge-states.md; the
sink: docs/variants.md#attention-sinks.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, float64

from ..core.common import (
    GPU_ROW_THREADS, GRID_X_MAX, compute_type, row_threads,
)
from ..core.elements import BFLOAT16, element_ops
from ..core.jit import device_jit, kernel_jit

#: threads per block: the row kernels' (one per head-dim element up to 128 on a GPU)
GPU_THREADS = GPU_ROW_THREADS
default_threads = row_threads


def merge_grid(rows):
    """``(grid, why)``: the merge grid for ``rows`` rows (x only); raises ValueError past the
    CUDA limit.  A function of its own so that a CPU test checks it."""
    if rows > GRID_X_MAX:
        raise ValueError(f"o_parts: expected at most {GRID_X_MAX} rows (the CUDA grid's x limit),"
                         f" got {rows}")
    return (int(rows),)


@functools.lru_cache(maxsize=None)
def make_state_merge(acc_t):
    """``merge_states_ml(m_parts, l_parts, col) -> (m, W)``: the same rule on unnormalised
    partial states ``(m_p, l_p)`` (a running max and its sum of ``exp(s - m_p)``, the online
    softmax's), parts ``m_parts[p, col]`` in order: ``m = max_p m_p`` over the parts with ``l_p
    != 0`` (a part that saw no key is skipped; NaN wins), ``W = sum_p l_p exp(m_p - m)``; the
    caller rescales part ``p``'s accumulator by ``exp(m_p - m)`` (0 for an empty part).  The
    decode's merge of its key groups (:mod:`~numba_flash.kernels.decode.split_kv`)."""
    NEG_INF = acc_t(-math.inf)
    ZERO = acc_t(0.0)

    def merge_states_ml(m_parts, l_parts, col):
        m = NEG_INF
        for p in range(m_parts.shape[0]):
            if l_parts[p, col] != ZERO and not m_parts[p, col] <= m:
                m = m_parts[p, col]
        total = ZERO
        for p in range(m_parts.shape[0]):
            l_p = l_parts[p, col]
            if l_p != ZERO:
                total += l_p * math.exp(m_parts[p, col] - m)
        return m, total

    return device_jit(inline=True)(merge_states_ml)


@functools.lru_cache(maxsize=None)
def make_merge_functions(acc_t, part_dtype=None):
    """``(merge_stats, merge_element)``, device functions in the compute type ``acc_t``;
    ``o_parts`` elements are read by ``part_dtype``'s load (:mod:`~.elements`; default: the
    compute type itself, the decode's float32 / float64 workspace).

    ``merge_stats(lse_parts, row, sink) -> (m, total, lse)`` over the parts ``lse_parts[:, row]``
    in order ``p = 0, 1, ...`` and the row's learnable sink logit (``-inf``: none), a part with
    ``o_p = 0`` added last; ``merge_element(o_parts, lse_parts, row, c, m, total)`` is
    ``o[row, c]``.  ``total`` is 0 for a row with no key (then ``o = 0``) and NaN for a row whose
    ``o`` is NaN.
    """
    load, _ = element_ops(part_dtype if part_dtype is not None
                          else (np.float64 if acc_t == float64 else np.float32))
    NEG_INF = acc_t(-math.inf)
    INF = acc_t(math.inf)
    NAN = acc_t(math.nan)
    ZERO = acc_t(0.0)

    # [docs:merge-skip-empty]
    def merge_stats(lse_parts, row, sink):
        # -- m = max_p lse_p over the non-empty parts and the sink; a NaN part poisons the row
        sink = acc_t(sink)
        m = sink
        nan = False
        for p in range(lse_parts.shape[0]):
            x = acc_t(lse_parts[p, row])
            if x != x:
                nan = True
            elif x > m:
                m = x
        if nan:
            return NAN, NAN, NAN
        if m == INF:            # infinite mass: lse = +inf, the weights inf/inf are undefined
            return m, NAN, INF
        if m == NEG_INF:        # no part saw a key
            return m, ZERO, NEG_INF
        # -- W = sum_p exp(lse_p - m), skipping empty parts (exactly, not as + 0), then the sink
        total = ZERO
        for p in range(lse_parts.shape[0]):
            x = acc_t(lse_parts[p, row])
            if x != NEG_INF:
                total += math.exp(x - m)
        if sink != NEG_INF:
            total += math.exp(sink - m)
        return m, total, m + math.log(total)

    def merge_element(o_parts, lse_parts, row, c, m, total):
        if total != total:
            return NAN
        if total == ZERO:
            return ZERO
        out = ZERO
        for p in range(lse_parts.shape[0]):
            x = acc_t(lse_parts[p, row])
            if x != NEG_INF:
                out += math.exp(x - m) * load(o_parts[p, row, c])
        return out / total
    # [/docs:merge-skip-empty]

    device = functools.partial(device_jit, inline=True)
    return device(merge_stats), device(merge_element)


@functools.lru_cache(maxsize=None)
def merge_kernel(THREADS, part_dtype, out_dtype, STRIDED=False):
    """Build (once per configuration) ``kernel(o_parts, lse_parts, sink, o, lse)``.

    ``o_parts`` ``[P, rows, d]`` in ``part_dtype``; ``lse_parts`` ``[P, rows]`` and ``lse``
    ``[rows]`` in the compute type of ``part_dtype``; ``o`` ``[rows, d]`` in ``out_dtype``;
    ``sink`` float32 ``[rows]`` (each row's learnable sink logit) or ``[1]`` (``[-inf]``: none).
    ``STRIDED``: the rows as three axes read and written through the arrays' own strides,
    ``o_parts`` ``[P, R0, R1, R2, d]``, ``lse_parts`` ``[P, R0, R1, R2]`` and ``o`` ``[R0, R1,
    R2, d]`` views (``rows = R0 R1 R2``, row ``(r0 R1 + r1) R2 + r2``: :func:`fold_rows`), e.g.
    parts stacked from flash-attn's ``[B, N, H, d]`` outputs, or MLA's decode merging into a
    caller's strided ``out=``; ``sink`` and ``lse`` as above.
    """
    merge_stats, merge_element = make_merge_functions(compute_type(part_dtype),
                                                      np.dtype(part_dtype))
    _, store = element_ops(out_dtype)

    if STRIDED:
        @kernel_jit
        def merge_states_strided(o_parts, lse_parts, sink, o, lse):
            row = cuda.blockIdx.x
            tid = cuda.threadIdx.x
            n1, n2 = o_parts.shape[2], o_parts.shape[3]
            r2 = row % n2
            r1 = row // n2 % n1
            r0 = row // n2 // n1
            # the row's parts as [P, R2, d] and [P, R2] views (strides kept: no copy), row r2
            o_row, lse_row_parts = o_parts[:, r0, r1], lse_parts[:, r0, r1]
            m, total, lse_row = merge_stats(lse_row_parts, r2,
                                            sink[row if sink.shape[0] > 1 else 0])
            for c in range(tid, o_parts.shape[4], THREADS):
                o[r0, r1, r2, c] = store(merge_element(o_row, lse_row_parts, r2, c, m, total))
            if tid == 0:
                lse[row] = lse_row

        return merge_states_strided

    @kernel_jit
    def merge_states(o_parts, lse_parts, sink, o, lse):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        m, total, lse_row = merge_stats(lse_parts, row, sink[row if sink.shape[0] > 1 else 0])
        # -- o = sum_p w_p o_p / W for this thread's head-dim elements (coalesced along d)
        for c in range(tid, o_parts.shape[2], THREADS):
            o[row, c] = store(merge_element(o_parts, lse_parts, row, c, m, total))
        if tid == 0:
            lse[row] = lse_row

    return merge_states


def fold_rows(shape, *strides):
    """The row axes ``shape`` (``o_parts.shape[1:-1]``) folded for the ``STRIDED`` build: axes
    of one element dropped and neighbours merged where every array's ``strides`` (its row axes'
    strides, one tuple per array) allow (the outer stride is the inner one times the inner
    length): a tuple of at most three lengths, padded with ones in front, whose C order is the
    rows' C order, or None where more than three axes remain (the caller copies)."""
    axes = [i for i, n in enumerate(shape) if int(n) != 1]
    groups = []
    for i in axes:
        if groups and all(int(st[groups[-1][-1]]) == int(st[i]) * int(shape[i])
                          for st in strides):
            groups[-1].append(i)
        else:
            groups.append([i])
    if len(groups) > 3:
        return None
    lengths = [int(np.prod([int(shape[i]) for i in g])) for g in groups]
    return (1,) * (3 - len(lengths)) + tuple(lengths)


#: (part dtype, output dtype) pairs the package launches: merge_states keeps the parts' dtype;
#: MLA's decode merges float32 partials.
PAIRS = (
    (np.dtype(np.float16), np.dtype(np.float16)),
    (np.dtype(np.float32), np.dtype(np.float32)),
    (np.dtype(np.float64), np.dtype(np.float64)),
    (BFLOAT16, BFLOAT16),
    # MLA's tensor-core decode (kernels/decode/mla.py): float32 partials into its output
    (np.dtype(np.float32), np.dtype(np.float16)),
    (np.dtype(np.float32), BFLOAT16),
)
