"""FlashDecoding stage 1: split-KV attention of a few query rows against a (paged) KV cache.

Math
----
Sequence ``b`` has ``L = cache_seqlens[b]`` cached keys.  Its key range ``[0, L)`` is cut into
splits of ``split_size[b]`` tokens (chosen from ``L`` alone, see :mod:`numba_flash.ops.decode`).
For every query row ``r`` and split ``s`` with keys ``J_s`` this kernel computes the *partial*
state

.. math::
    S_{rj} = \\text{scale}\\; q_r \\cdot k_j,\\quad
    \\text{lse}_{rs} = \\log \\sum_{j \\in J_s,\\ \\text{visible}} e^{S_{rj}},\\quad
    o_{rs} = \\sum_{j} e^{S_{rj} - \\text{lse}_{rs}}\\, v_j

walking ``J_s`` tile by tile (``BLOCK_N`` tokens) with the online softmax: per tile
``m_new = max(m_i, rowmax S)``, ``alpha = exp(m_i - m_new)``, ``P = exp(S - m_new)``,
``l_i = alpha l_i + rowsum P``, ``acc = alpha acc + P V``; finally ``o = acc / l_i`` and
``lse = m_i + log l_i``.  A split that sees no key writes ``o = 0, lse = -inf``.  The combine
kernel (:mod:`numba_flash.kernels.merge`) merges the splits with the log-sum-exp rule.

Causal (``Nq > 1`` query tokens, bottom-right): query token ``i`` sees key ``j`` iff
``j <= i + L - Nq``.

Grid / block
------------
grid = ``(num_splits, B * Hkv, cdiv(G * Nq, BLOCK_M))``, block = ``(THREADS,)``.  Block
``(s, b * Hkv + kvh, z)`` handles split ``s`` of sequence ``b`` for the query rows
``z * BLOCK_M ...`` of kv head ``kvh``'s GQA group, where row ``r = g * Nq + i`` is query head
``kvh * G + g`` at token ``i`` (``G = H // Hkv``).  With ``G * Nq <= BLOCK_M`` (the usual case:
8 rows on the GPU) every K/V element of the split is read from global memory exactly once, by
one block, for all the heads of its group.

Per tile the block

1. looks up where each of the ``BLOCK_N`` tokens lives: physical block ``block_table[b, t // bs]``,
   slot ``t % bs``, or marks it dead (past the split / sequence).  A contiguous cache
   ``[B, Hkv, Nmax, d]`` is the paged layout with one block of ``Nmax`` slots per sequence and
   the table ``[[0], [1], ...]``, so one kernel (no ``PAGED`` flag, half the compile tier) serves
   both; the lookup costs one division and one cached load per token per tile;
2. loads the K and V tiles, consecutive threads on consecutive head-dim elements (coalesced),
   writing 0 for dead tokens and padded dims: a slot past the sequence's end or a block the
   sequence does not own is never read, so stale NaN cannot leak in;
3. computes the scores ``S[r, n]`` (``-inf`` where masked), one (row, token) pair per thread;
4. reduces each row's max over ``SEGS = THREADS // BLOCK_M`` segments, then exponentiates;
5. rescales and accumulates ``acc`` (registers: thread ``t`` owns the elements
   ``t + j * THREADS`` of the flattened ``[BLOCK_M, HEAD_DIM]`` accumulator).

Shared memory
-------------
``q_tile[BLOCK_M, HEAD_DIM]`` (compute type, pre-scaled), ``k_tile[BLOCK_N, HEAD_DIM + KPAD]``
and ``v_tile[BLOCK_N, HEAD_DIM]`` (input dtype; the padding makes a K row an odd number of 32-bit
words so the score loop, where a warp reads 32 tokens at one dim, is free of bank conflicts),
``s_tile[BLOCK_M, BLOCK_N]``, two ``[BLOCK_M, SEGS]`` reduction buffers and a few per-row and
per-token words.  :func:`gpu_tiles` keeps K + V under 16 KiB; the largest configuration (float64,
``HEAD_DIM = 256``) uses 34.5 KiB, float16 ``HEAD_DIM = 128`` 22.5 KiB (<= 48 KiB static).

float16 caches are read as float16 and computed in float32; float64 computes in float64.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda, int32, types

from ..backend import on_simulator
from .common import HEAD_DIMS, acc_dtype, compute_type, numba_array_type

#: GPU launch shape: 4 warps; 8 query rows per block (a GQA group of up to 8 heads at Nq = 1).
GPU_THREADS = 128
GPU_BLOCK_M = 8
#: simulator launch shape: every CUDA thread is a Python thread, keep them few.
SIM_THREADS = 8
SIM_BLOCK_M = 4
SIM_BLOCK_N = 4
#: KV tokens per split when ``num_splits=None`` (vLLM uses 512-token partitions).
GPU_SPLIT_TOKENS = 512
SIM_SPLIT_TOKENS = 16
DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))
#: K + V tile budget in shared memory (bytes): small enough for several blocks per SM.
KV_TILE_BYTES = 16 * 1024


def padded_head_dim(d):
    """The compiled head dim for ``d``: the next power of two, at least 16 on the GPU (one of
    :data:`HEAD_DIMS`) and at least 2 in the simulator (where every padded lane costs time)."""
    return max(2 if on_simulator() else 16, 1 << (int(d) - 1).bit_length())


def gpu_tiles(dtype, HEAD_DIM):
    """``(THREADS, BLOCK_M, BLOCK_N)`` for the GPU: K + V tiles within :data:`KV_TILE_BYTES`."""
    itemsize = np.dtype(dtype).itemsize
    block_n = KV_TILE_BYTES // (2 * HEAD_DIM * itemsize)
    block_n = max(4, min(64, 1 << (block_n.bit_length() - 1)))
    return GPU_THREADS, GPU_BLOCK_M, block_n


def default_tiles(dtype, HEAD_DIM):
    """``(THREADS, BLOCK_M, BLOCK_N)`` for the backend in use."""
    if on_simulator():
        return SIM_THREADS, SIM_BLOCK_M, SIM_BLOCK_N
    return gpu_tiles(dtype, HEAD_DIM)


def default_split_tokens():
    return SIM_SPLIT_TOKENS if on_simulator() else GPU_SPLIT_TOKENS


@functools.lru_cache(maxsize=None)
def decode_split_kernel(THREADS, BLOCK_M, BLOCK_N, HEAD_DIM, dtype):
    """Build (once per configuration) the stage-1 kernel

    ``kernel(q, k_cache, v_cache, block_table, seqlens, split_size, o_part, lse_part, scale,
    causal)``

    ``q`` ``[B, H, Nq, d]``; caches ``[num_blocks, Hkv, block_size, d]`` with ``block_table``
    int32 ``[B, max_blocks]`` (a contiguous ``[B, Hkv, Nmax, d]`` cache is the same layout with
    one block of ``Nmax`` slots per sequence and the table ``[[0], [1], ...]``); ``seqlens``
    and ``split_size`` int32 ``[B]``; ``o_part`` ``[splits, B * H * Nq, d]`` and ``lse_part`` ``[splits, B * H * Nq]`` in
    the compute type; ``scale`` a compute-type scalar; ``causal`` an int (0 or 1).

    ``causal`` is a runtime flag, not a compile-time one: it costs one integer comparison per
    score and halves the compile tier (which has a budget of ~90 s for the family).
    """
    assert THREADS % BLOCK_M == 0, "each row's max/sum reduction gets THREADS // BLOCK_M threads"
    assert (BLOCK_M * HEAD_DIM) % THREADS == 0, "the accumulator splits evenly over the threads"
    assert (BLOCK_N * HEAD_DIM) % THREADS == 0, "a K/V tile splits evenly over the threads"
    dtype = np.dtype(dtype)
    acc_t = compute_type(dtype)
    in_t = numba_array_type(dtype, 1).dtype
    SEGS = THREADS // BLOCK_M
    ACC = BLOCK_M * HEAD_DIM // THREADS        # accumulator (and q) elements per thread
    LOADS = BLOCK_N * HEAD_DIM // THREADS      # K (and V) elements per thread per tile
    KPAD = 2 if dtype.itemsize == 2 else 1     # K row = an odd number of 32-bit words
    K_COLS = HEAD_DIM + KPAD
    NEG_INF = -math.inf

    @cuda.jit
    def decode_split(q, k_cache, v_cache, block_table, seqlens, split_size, o_part, lse_part,
                     scale, causal):
        # [docs:decode-block-coords]
        split = cuda.blockIdx.x
        b = cuda.blockIdx.y // k_cache.shape[1]
        kvh = cuda.blockIdx.y % k_cache.shape[1]
        tid = cuda.threadIdx.x
        n_heads = q.shape[1]
        nq = q.shape[2]
        d = q.shape[3]
        group = n_heads // k_cache.shape[1]
        n_rows = group * nq                      # query rows of this GQA group
        row0 = cuda.blockIdx.z * BLOCK_M         # first row of this block's chunk
        seqlen = seqlens[b]
        lo = split * split_size[b]
        hi = min(lo + split_size[b], seqlen)     # lo >= hi: an empty split
        block_size = k_cache.shape[2]           # tokens per physical block
        # [/docs:decode-block-coords]

        q_tile = cuda.shared.array((BLOCK_M, HEAD_DIM), acc_t)
        k_tile = cuda.shared.array((BLOCK_N, K_COLS), in_t)
        v_tile = cuda.shared.array((BLOCK_N, HEAD_DIM), in_t)
        s_tile = cuda.shared.array((BLOCK_M, BLOCK_N), acc_t)
        seg_max = cuda.shared.array((BLOCK_M, SEGS), acc_t)
        seg_sum = cuda.shared.array((BLOCK_M, SEGS), acc_t)
        m_sh = cuda.shared.array(BLOCK_M, acc_t)
        l_sh = cuda.shared.array(BLOCK_M, acc_t)
        alpha_sh = cuda.shared.array(BLOCK_M, acc_t)
        tok_blk = cuda.shared.array(BLOCK_N, int32)
        tok_slot = cuda.shared.array(BLOCK_N, int32)

        # -- prologue: pre-scaled q rows of this chunk (0 for padded dims / missing rows)
        for j in range(ACC):
            e = tid + j * THREADS
            r = e // HEAD_DIM
            c = e % HEAD_DIM
            row = row0 + r
            val = acc_t(0.0)
            if row < n_rows and c < d:
                val = acc_t(q[b, kvh * group + row // nq, row % nq, c]) * scale
            q_tile[r, c] = val
        # thread (r_own, seg) owns row r_own's softmax statistics in steps 4 and 5
        r_own = tid // SEGS
        seg = tid % SEGS
        if seg == 0:
            m_sh[r_own] = acc_t(NEG_INF)
            l_sh[r_own] = acc_t(0.0)
        acc = cuda.local.array(ACC, acc_t)
        for j in range(ACC):
            acc[j] = acc_t(0.0)
        cuda.syncthreads()  # q_tile and the row state are written before any thread reads them

        for t0 in range(lo, hi, BLOCK_N):
            # [docs:decode-token-lookup]
            # -- 1. where each token of the tile lives; -1 marks a dead token (never loaded)
            for n in range(tid, BLOCK_N, THREADS):
                t = t0 + n
                blk = -1
                slot = 0
                if t < hi:
                    blk = block_table[b, t // block_size]
                    slot = t % block_size
                tok_blk[n] = blk
                tok_slot[n] = slot
            cuda.syncthreads()  # token addresses are known before the tile loads use them
            # [/docs:decode-token-lookup]

            # [docs:decode-tile-load]
            # -- 2. K and V tiles, coalesced along the head dim; masked loads write 0
            for j in range(LOADS):
                e = tid + j * THREADS
                n = e // HEAD_DIM
                c = e % HEAD_DIM
                blk = tok_blk[n]
                if blk >= 0 and c < d:
                    k_tile[n, c] = k_cache[blk, kvh, tok_slot[n], c]
                    v_tile[n, c] = v_cache[blk, kvh, tok_slot[n], c]
                else:
                    k_tile[n, c] = 0
                    v_tile[n, c] = 0
            cuda.syncthreads()  # the whole K/V tile is in shared memory before the scores read it
            # [/docs:decode-tile-load]

            # -- 3. scores S[r, n] = (scale q_r) . k_n, -inf where masked
            for p in range(tid, BLOCK_M * BLOCK_N, THREADS):
                r = p // BLOCK_N
                n = p % BLOCK_N
                row = row0 + r
                visible = row < n_rows and tok_blk[n] >= 0
                if causal:  # bottom-right: token i of nq sees key t iff t <= i + L - nq
                    visible = visible and t0 + n <= row % nq + seqlen - nq
                s = acc_t(NEG_INF)
                if visible:
                    s = acc_t(0.0)
                    for c in range(d):          # runtime bound: no padded lanes, no unroll
                        s += q_tile[r, c] * acc_t(k_tile[n, c])
                s_tile[r, n] = s
            cuda.syncthreads()  # every score of the tile is written before the row max reads it

            # -- 4a. row max, first per segment of the row's tokens
            mx = acc_t(NEG_INF)
            for n in range(seg, BLOCK_N, SEGS):
                mx = max(mx, s_tile[r_own, n])
            seg_max[r_own, seg] = mx
            cuda.syncthreads()  # all segment maxima are in before each row's max is formed

            # -- 4b. m_new, P = exp(S - m_new) in place, per-segment sums, alpha
            m_old = m_sh[r_own]
            m_new = m_old
            for k in range(SEGS):
                m_new = max(m_new, seg_max[r_own, k])
            psum = acc_t(0.0)
            for n in range(seg, BLOCK_N, SEGS):
                p_val = acc_t(0.0)
                if m_new != NEG_INF:             # a row with no visible key yet keeps P = 0
                    p_val = math.exp(s_tile[r_own, n] - m_new)
                s_tile[r_own, n] = p_val
                psum += p_val
            seg_sum[r_own, seg] = psum
            if seg == 0:
                alpha = acc_t(1.0)
                if m_new != NEG_INF:
                    alpha = math.exp(m_old - m_new)
                alpha_sh[r_own] = alpha
            cuda.syncthreads()  # P, the segment sums and alpha are written before the P V update

            # -- 5. acc = alpha acc + P V (registers); row owners update m_i and l_i
            # (rows past n_rows have P = 0 and alpha = 1: harmless, and never written out)
            for j in range(ACC):
                acc[j] *= alpha_sh[(tid + j * THREADS) // HEAD_DIM]
            for n in range(min(BLOCK_N, hi - t0)):  # live tokens of the tile (P = 0 past them)
                for j in range(ACC):
                    e = tid + j * THREADS
                    acc[j] += s_tile[e // HEAD_DIM, n] * acc_t(v_tile[n, e % HEAD_DIM])
            if seg == 0:
                l_new = l_sh[r_own] * alpha_sh[r_own]
                for k in range(SEGS):
                    l_new += seg_sum[r_own, k]
                l_sh[r_own] = l_new
                m_sh[r_own] = m_new
            cuda.syncthreads()  # this tile is consumed before the next one overwrites the tiles

        # -- epilogue: normalised partial o and lse; an empty split writes o = 0, lse = -inf
        for j in range(ACC):
            e = tid + j * THREADS
            r = e // HEAD_DIM
            c = e % HEAD_DIM
            row = row0 + r
            if row < n_rows and c < d:
                l_row = l_sh[r]
                out = acc_t(0.0)
                if l_row > acc_t(0.0):
                    out = acc[j] / l_row
                grow = (b * n_heads + kvh * group + row // nq) * nq + row % nq
                o_part[split, grow, c] = out
        row = row0 + r_own
        if seg == 0 and row < n_rows:
            l_row = l_sh[r_own]
            lse = acc_t(NEG_INF)
            if l_row > acc_t(0.0):
                lse = m_sh[r_own] + math.log(l_row)
            grow = (b * n_heads + kvh * group + row // nq) * nq + row % nq
            lse_part[split, grow] = lse

    return decode_split


def compile_configs():
    """Every stage-1 configuration the package can launch on a GPU, for the compile tier."""
    i32_2d = numba_array_type(np.int32, 2)
    i32_1d = numba_array_type(np.int32, 1)
    for dtype in DTYPES:
        acc_np = acc_dtype(dtype)
        arr4 = numba_array_type(dtype, 4)
        for HEAD_DIM in HEAD_DIMS:
            threads, block_m, block_n = gpu_tiles(dtype, HEAD_DIM)
            yield {
                "name": f"decode {dtype.name} D={HEAD_DIM} M={block_m} N={block_n}",
                "kernel": decode_split_kernel(threads, block_m, block_n, HEAD_DIM, dtype),
                "args": (arr4, arr4, arr4, i32_2d, i32_1d, i32_1d,
                         numba_array_type(acc_np, 3), numba_array_type(acc_np, 2),
                         compute_type(dtype), types.int32),
                "float64_ok": dtype == np.float64,
            }
