"""Exercise (docs/paged-attention.md): find a key in a paged KV cache, and refuse a bad table.

``decode`` below is a one-query decode kernel over a paged cache (one thread per query head, one
block per sequence): ``k_cache`` and ``v_cache`` are ``[num_blocks, Hkv, block_size, d]``,
``block_table [B, max_blocks]``, ``cache_seqlens [B]``.  It asks ``cache_page`` where token ``t``
of sequence ``b`` lives.  Write ``cache_page``: return ``(page, slot)``, the physical block and
the slot in it, or ``(-1, 0)`` when the table entry is not a block of the cache (the kernel then
gives the whole sequence ``o = NaN``, ``lse = NaN`` and reads nothing more of it).  The table is
data from another component: assume nothing about an entry you have not checked.

Check: ``python -m pytest -n 0 docs/exercises/test_paged_lookup.py --exercises``.
"""

from __future__ import annotations

import math

import numpy as np

import numba_flash  # noqa: F401  (first: selects the simulator when there is no GPU)
from numba import cuda

HEAD_DIM = 8


@cuda.jit(device=True)
def cache_page(block_table, n_blocks, b, t, block_size):
    """``(page, slot)`` of token ``t`` of sequence ``b``; ``(-1, 0)`` for a bad table entry."""
    return -1, 0  # TODO


@cuda.jit
def decode(q, k_cache, v_cache, block_table, seqlens, o, lse, scale):
    b = cuda.blockIdx.x
    h = cuda.threadIdx.x
    h_kv = h // (q.shape[1] // k_cache.shape[1])
    n_blocks, block_size, d = k_cache.shape[0], k_cache.shape[2], q.shape[2]
    acc = cuda.local.array(HEAD_DIM, np.float64)
    for c in range(d):
        acc[c] = 0.0
    m_i, l_i, bad = -math.inf, 0.0, False
    for t in range(seqlens[b]):
        page, slot = cache_page(block_table, n_blocks, b, t, block_size)
        if page == -1:                          # cache_page's answer for a bad entry
            bad = True
            break
        s = 0.0
        for c in range(d):
            s += q[b, h, c] * k_cache[page, h_kv, slot, c]
        s *= scale
        m_new = max(m_i, s)
        alpha, p = math.exp(m_i - m_new), math.exp(s - m_new)
        l_i = alpha * l_i + p
        for c in range(d):
            acc[c] = alpha * acc[c] + p * v_cache[page, h_kv, slot, c]
        m_i = m_new
    for c in range(d):
        o[b, h, c] = math.nan if bad else (acc[c] / l_i if l_i > 0 else 0.0)
    lse[b, h] = math.nan if bad else (m_i + math.log(l_i) if l_i > 0 else -math.inf)


def run(q, k_cache, v_cache, block_table, seqlens, wrap=lambda name, a: a):
    """Launch on NumPy arrays (``q [B, H, d]`` float64); returns ``(o, lse)``."""
    bsz, h, d = q.shape
    o = np.full(q.shape, np.inf)
    lse = np.full((bsz, h), np.inf)
    args = [wrap(n, a) for n, a in zip(("q", "k_cache", "v_cache", "block_table", "seqlens"),
                                       (q, k_cache, v_cache, block_table, seqlens))]
    decode[bsz, h](*args, o, lse, 1 / math.sqrt(d))
    return o, lse
