"""Rotary position embedding (RoPE), flash-attn's ``apply_rotary_emb``.

Math
----
Token ``n`` of sequence ``b`` sits at position ``p = off_b + n * STEP`` (``off_b`` an int for
the batch or ``offsets[b]``; ``STEP`` is 1, or 0 when every token of a row takes the row's
offset, as flash-attn rotates a non-causal decode's queries).  With ``R = rotary_dim / 2``
angles per position (``cos``, ``sin`` ``[max_position, R]``), pair ``i < R`` of the head dims
turns by the angle whose cosine is ``c = cos[p, i]`` and sine ``s = sin[p, i]``::

    (x_1, x_2) -> (x_1 c - x_2 s,  x_2 c + x_1 s)

where the pair is ``(x[i], x[i + R])`` (GPT-NeoX halves) or, ``INTERLEAVED``, ``(x[2i], x[2i +
1])`` (GPT-J); the dims from ``2R`` to ``d`` pass through unchanged.  Computed in float32
(float64 for float64), written in the input dtype (bfloat16: loads and stores of
:mod:`~numba_flash.kernels.core.elements`, round to nearest even).

A position outside ``[0, max_position)`` (an unvalidated call) reads no table entry: its
rotated dims are NaN, the passed-through dims are copied.

Grid / block
------------
grid = ``(B * H * N,)``, block = ``(THREADS,)``: block ``x`` is row ``(b, h, n)`` of ``x [B, H,
N, d]`` (``n = x % N``, ``h = x // N % H``, ``b = x // N // H``); thread ``t`` writes the
elements ``t, t + THREADS, ...`` of the row, each reading itself and its pair partner
(coalesced along ``d``).

Shared memory
-------------
None.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, int64

from ..core.common import GPU_ROW_THREADS, compute_type, grid_x, numba_array_type, row_threads
from ..core.elements import element_ops
from ..core.jit import kernel_jit

#: threads per block: the row kernels' (one per head-dim element up to 128 on a GPU)
GPU_THREADS = GPU_ROW_THREADS
default_threads = row_threads


def rotary_grid(b, h, n, name="x"):
    """``(x,)``: one block per row; a ``ValueError`` past CUDA's x limit."""
    return grid_x(name, "B * H * N", b, h, n)


@functools.lru_cache(maxsize=None)
def rotary_kernel(THREADS, dtype, INTERLEAVED):
    """Build (once per configuration) ``kernel(x, cos, sin, offsets, out, offset0, step,
    per_seq)``: ``x``, ``out`` ``[B, H, N, d]`` (indexed through their own strides: ``x`` may be a
    view whose last dim is contiguous, flash-attn's ``[B, N, H, d]`` memory transposed, each
    layout its own specialisation); ``cos``, ``sin`` ``[max_position, R]`` in
    ``x``'s dtype; ``offsets`` ``[B]`` ints read when ``per_seq`` is 1 (else ``offset0`` is every
    row's offset); ``step`` 1 or 0 (see the module docstring).  int32 scalars."""
    acc_t = compute_type(dtype)
    load, store = element_ops(dtype)      # bfloat16: its words in, rounded words out
    NAN = acc_t(math.nan)

    @kernel_jit
    def apply_rotary(x, cos, sin, offsets, out, offset0, step, per_seq):
        tid = cuda.threadIdx.x
        bx = cuda.blockIdx.x
        n_heads = x.shape[1]
        n_tok = x.shape[2]
        d = x.shape[3]
        n = bx % n_tok
        h = bx // n_tok % n_heads
        b = bx // n_tok // n_heads
        off = int64(offset0)
        if per_seq:
            off = int64(offsets[b])
        pos = off + n * step                  # 64-bit: an offset near 2**31 cannot wrap
        R = cos.shape[1]                      # angles per position: rotary_dim / 2
        ok = 0 <= pos and pos < cos.shape[0]  # else NaN, and no table read
        for e in range(tid, d, THREADS):
            if e < 2 * R:
                # my pair: index i, whether I am its first element, my partner's dim
                if INTERLEAVED:
                    i = e // 2
                    first = e % 2 == 0
                    partner = e + 1 if first else e - 1
                else:
                    i = e % R
                    first = e < R
                    partner = e + R if first else e - R
                val = NAN
                if ok:
                    c = load(cos[pos, i])
                    s = load(sin[pos, i])
                    me = load(x[b, h, n, e])
                    other = load(x[b, h, n, partner])
                    if first:
                        val = me * c - other * s  # x_1 c - x_2 s
                    else:
                        val = me * c + other * s  # x_2 c + x_1 s
                out[b, h, n, e] = store(val)
            else:
                out[b, h, n, e] = x[b, h, n, e]   # past rotary_dim: passed through (bits)

    return apply_rotary


def kernel_args_types(dtype, int_dtype=np.int32, strided=False):
    """The launch signature; ``strided``: ``x`` a view (layout "A", read through its strides)."""
    from numba import types

    x_t = numba_array_type(dtype, 4)
    if strided:
        x_t = types.Array(x_t.dtype, 4, "A")
    return (x_t, numba_array_type(dtype, 2), numba_array_type(dtype, 2),
            numba_array_type(int_dtype, 1), numba_array_type(dtype, 4), types.int32,
            types.int32, types.int32)
