"""FlashAttention forward on tensor cores: float16 ``Q K^T`` and ``P V`` on ``mma.sync.m16n8k16``.

Math (as :mod:`numba_flash.kernels.forward`, the SIMT kernel)
-------------------------------------------------------------
For one ``(b, h)`` and a Q tile, per K/V tile ``j`` and per query row: ``S = scale * Q K_j^T``
(float16 inputs, float32 accumulation on the tensor cores), masked and modified by the rule of
:mod:`numba_flash.kernels.visibility` (``-inf`` for a key the row does not see; non-finite ->
NaN, softcap, ALiBi for one it sees), then the online softmax in float32::

    m_new = max(m_i, rowmax(S));  alpha = exp(m_i - m_new);  P = exp(S - m_new)
    l_i = alpha l_i + rowsum(P);  acc = alpha acc + P V_j  (P rounded to float16 for the mma)

and at the end ``O = acc / l_i`` (float16), ``lse = m_i + log(l_i)`` (float32).  A row that sees
no key ends with ``l_i = 0``: ``o = 0``, ``lse = -inf``; a NaN score (NaN or inf in ``q`` or in a
visible ``k``) makes ``m_i``, ``l_i`` NaN: ``o`` and ``lse`` NaN.  Dropout multiplies the ``P``
fed to ``P V`` by ``keep / (1 - p)`` (``l_i`` and ``lse`` stay undropped); ``keep`` of element
``(b, h, i, j)`` is the Philox draw of :func:`numba_flash.dropout_mask`.

Fragments, not threads, own the tiles
-------------------------------------
Each warp owns 16 query rows.  Its ``S`` for ``BLOCK_N`` keys is ``BLOCK_N / 8`` accumulator
fragments (:mod:`numba_flash.kernels.mma`): lane ``(g, t)`` (``g = lane >> 2``, ``t = lane % 4``)
holds rows ``g`` and ``g + 8`` and, per 8-key fragment ``n``, keys ``8n + 2t`` and ``8n + 2t + 1``.
So the online softmax runs on the accumulator registers: a row's max and sum are the lane's own
values combined over the 4 lanes of its quad (:func:`~numba_flash.kernels.mma.quad_max`, two
``shfl_xor_sync``; the partial sums are combined once, at the end, since they share ``m_i``).
``P`` goes straight from the ``S`` registers to the ``A`` registers of ``P V``
(:func:`~numba_flash.kernels.mma.pack_half2`): two 8-key ``S`` fragments are exactly one
16-key ``A`` fragment.  ``acc`` is ``HEAD_DIM / 8`` accumulator fragments per lane.

Non-finite ``v``: a key a row does not see must not touch it, but a tensor core computes
``0 * NaN = NaN``.  So a non-finite ``v`` element is stored as 0 in ``vt_tile`` and the tile is
flagged (``v_bad``).  For a flagged tile (rare) the block reloads ``vt_tile`` as a 0/1 indicator
of the non-finite elements and runs one more product on the tensor cores, ``seen (0/1) x
indicator``: where it counts a visible key with a non-finite ``v[j, c]``, ``acc`` becomes NaN
(the reference's rule).  Everything stays in fragments with compile-time register indices.

Grid / block
------------
grid = ``(ceil(Nq / BLOCK_M) * B * H,)`` (:func:`forward_grid`: Q tiles fastest, then the
flattened ``(b, h)``; x allows 2**31 - 1 blocks, so any ``B * H`` fits), block =
``32 * NUM_WARPS`` threads, ``BLOCK_M = 16 * NUM_WARPS``.  The kv head is ``h // (H // Hkv)``.
K/V tiles outside the keys some row of the Q tile sees are never loaded
(:func:`~numba_flash.kernels.visibility.tile_key_range`: causal skips the upper triangle,
a window costs O(window)); tiles inside the keys every row sees skip the per-element mask.

Shared memory (uint32 words, each two float16)
----------------------------------------------
* ``q_tile  [BLOCK_M, HEAD_DIM / 2 + 4]``: Q, a row per query (``A`` of ``S = Q K^T``);
* ``k_tile  [BLOCK_N, HEAD_DIM / 2 + 4]``: K, a row per key (``B`` of ``S``, ``.col`` layout);
* ``vt_tile [HEAD_DIM, BLOCK_N / 2 + 4]``: V transposed, a row per head-dim column (``B`` of
  ``P V``), packed key pairs;
* ``v_bad   [1]`` int32: the tile holds a non-finite ``v``.

The ``+ 4`` pad puts the 8 rows ``g`` of a fragment load into distinct banks.  In total
``4 (BLOCK_M + BLOCK_N) (HEAD_DIM / 2 + 4) + 4 HEAD_DIM (BLOCK_N / 2 + 4) + 4`` bytes, at most
48 KiB for every tile choice of :data:`GPU_TILES` (:func:`shared_bytes`).  Inputs are read as
their float16 bit patterns (``uint16`` views): no conversion on load.
"""

from __future__ import annotations

import functools
import math

from numba import cuda, float32, int32, types

from ..backend import on_simulator
from ..philox import philox_keep_bits4
from .common import HEAD_DIMS, SMEM_LIMIT, padded_head_dim
from .mma import (a_frag_from_c, half2_bits, load_a_frag, load_b_frag, mma_m16n8k16, pack_half2,
                  quad_max, quad_sum)
from .visibility import (key_bounds, make_score_mod, tile_full_range, tile_key_range,
                         tile_needs_mask)
from .jit import kernel_jit

#: GPU tiles per padded head dim: ``(NUM_WARPS, BLOCK_N)``; ``BLOCK_M = 16 * NUM_WARPS``.
GPU_TILES = {16: (4, 64), 32: (4, 64), 64: (4, 64), 128: (4, 32), 256: (2, 16)}

#: simulator tiles: one warp (32 Python threads) and 16 keys per tile
SIM_TILES = (1, 16)

#: largest grid.x
GRID_X_MAX = 2**31 - 1

_EXP_MASK = 0x7C00  # float16 exponent bits: all ones = inf or NaN
_ONE_BITS = 0x3C00  # float16 1.0


def shared_bytes(NUM_WARPS, BLOCK_N, HEAD_DIM):
    """Static shared memory of one block (the budget in the module docstring)."""
    words = (16 * NUM_WARPS + BLOCK_N) * (HEAD_DIM // 2 + 4) + HEAD_DIM * (BLOCK_N // 2 + 4) + 1
    return 4 * words


def default_tiles(head_dim, simulator=None):
    """``(NUM_WARPS, BLOCK_N, HEAD_DIM)`` for a head dim ``d`` (1..256) on this backend."""
    if simulator is None:
        simulator = on_simulator()
    hd = padded_head_dim(head_dim)
    nw, bn = SIM_TILES if simulator else GPU_TILES[hd]
    return nw, bn, hd


def forward_grid(nq, b, h, block_m):
    """The 1-D launch grid: ``ceil(Nq / BLOCK_M) * B * H`` blocks (ValueError past 2**31 - 1)."""
    n = -(-nq // block_m) * b * h
    if n > GRID_X_MAX:
        raise ValueError(f"q: {n} blocks of {block_m} query rows exceed the grid limit "
                         f"{GRID_X_MAX} (B * H * ceil(Nq / {block_m}))")
    return (max(1, n),)


@functools.lru_cache(maxsize=None)
def forward_mma_kernel(NUM_WARPS, BLOCK_N, HEAD_DIM, DROPOUT=False, SOFTCAP=False, ALIBI=False):
    """Build ``kernel(q, k, v, o, lse, scale, window, mods, alibi, dropout)``.

    ``q``, ``k``, ``v``: uint16 views of the float16 ``[B, H(kv), N, d]`` inputs; ``o`` float16,
    ``lse`` float32.  ``scale`` float32; ``window = (left, right)`` int32 (causal folded in,
    :func:`~numba_flash.kernels.visibility.window_bounds`); ``mods = (softcap, 1 / softcap)``
    float32 (used with ``SOFTCAP``); ``alibi`` float32 ``[B, H]`` (read with ``ALIBI``);
    ``dropout`` ``()`` or ``(seed_lo, seed_hi, threshold, keep_scale)`` (with ``DROPOUT``).
    """
    assert HEAD_DIM % 16 == 0 and BLOCK_N % 16 == 0
    BLOCK_M = 16 * NUM_WARPS
    THREADS = 32 * NUM_WARPS
    WORDS = HEAD_DIM // 2           # words of a packed Q / K row
    ROW_W = WORDS + 4               # padded row length of q_tile, k_tile
    PAIRS = BLOCK_N // 2            # key pairs of a vt_tile row
    VT_W = PAIRS + 4                # padded row length of vt_tile
    N_FRAGS = BLOCK_N // 8          # S fragments per warp (8 keys each)
    D_FRAGS = HEAD_DIM // 8         # acc fragments per warp (8 output columns each)
    K_STEPS = HEAD_DIM // 16        # mma steps of S = Q K^T
    P_STEPS = BLOCK_N // 16         # mma steps of P V
    NEG_INF = float32(-math.inf)
    NAN = float32(math.nan)
    ZERO = float32(0.0)
    ONE = float32(1.0)
    score_mod = make_score_mod(SOFTCAP, ALIBI, float32)

    @cuda.jit(device=True, inline=True)
    def seen(key, lo, hi):
        """1.0 if the row with visible keys [lo, hi) sees ``key``, else 0.0."""
        return ONE if (lo <= key and key < hi) else ZERO

    @cuda.jit(device=True, inline=True)
    def load_vt(vt_tile, v, b, hk, k_start, nk, d, tid, indicator):
        """vt_tile = V_j transposed as packed key pairs, zero outside V; a non-finite element
        is stored as 0 (``indicator``: every element as 1.0 if non-finite, else 0).  True if
        this thread met a non-finite element."""
        bad = False
        for idx in range(tid, HEAD_DIM * PAIRS, THREADS):
            c = idx % HEAD_DIM             # consecutive threads: consecutive columns
            key = k_start + 2 * (idx // HEAD_DIM)
            lo = 0
            hi = 0
            if c < d:
                if key < nk:
                    lo = v[b, hk, key, c]
                if key + 1 < nk:
                    hi = v[b, hk, key + 1, c]
            bad_lo = (lo & _EXP_MASK) == _EXP_MASK
            bad_hi = (hi & _EXP_MASK) == _EXP_MASK
            if indicator:
                lo = _ONE_BITS if bad_lo else 0
                hi = _ONE_BITS if bad_hi else 0
            else:
                if bad_lo:
                    lo = 0
                if bad_hi:
                    hi = 0
            vt_tile[c, idx // HEAD_DIM] = half2_bits(lo, hi)
            bad = bad or bad_lo or bad_hi
        return bad

    @kernel_jit
    def flash_forward_mma(q, k, v, o, lse, scale, window, mods, alibi, dropout):
        # -- which block, warp and lane
        tid = cuda.threadIdx.x
        warp = tid >> 5
        lane = tid & 31
        g = lane >> 2                 # the lane's rows g and g + 8 of the warp's 16
        t = lane & 3                  # the lane's key / column pair 2t, 2t + 1 in each fragment
        n_heads = q.shape[1]
        nq = q.shape[2]
        nk = k.shape[2]
        d = q.shape[3]
        n_qt = (nq + BLOCK_M - 1) // BLOCK_M
        bh = cuda.blockIdx.x // n_qt
        b = bh // n_heads
        h = bh % n_heads
        hk = h // (n_heads // k.shape[1])  # GQA: query head h reads kv head h // group
        q_start = (cuda.blockIdx.x % n_qt) * BLOCK_M
        q_end = min(q_start + BLOCK_M, nq)
        offset = nk - nq                   # bottom-right alignment of queries against keys
        left, right = window
        softcap, inv_softcap = mods
        slope = ZERO
        if ALIBI:
            slope = alibi[b, h]
        if DROPOUT:
            seed_lo, seed_hi, threshold, keep_scale = dropout
        row0 = q_start + 16 * warp + g     # the lane's two query rows
        row1 = row0 + 8
        lo0, hi0 = key_bounds(row0, offset, nk, left, right)  # the keys [lo, hi) each row sees
        lo1, hi1 = key_bounds(row1, offset, nk, left, right)

        q_tile = cuda.shared.array((BLOCK_M, ROW_W), types.uint32)
        k_tile = cuda.shared.array((BLOCK_N, ROW_W), types.uint32)
        vt_tile = cuda.shared.array((HEAD_DIM, VT_W), types.uint32)
        v_bad = cuda.shared.array(1, int32)
        s = cuda.local.array((N_FRAGS, 4), float32)
        acc = cuda.local.array((D_FRAGS, 4), float32)
        m_i = cuda.local.array(2, float32)
        l_i = cuda.local.array(2, float32)

        # -- load q_tile: packed float16 pairs, zero past Nq and past the true head dim
        for idx in range(tid, BLOCK_M * WORDS, THREADS):
            r = idx // WORDS
            c = 2 * (idx % WORDS)
            row = q_start + r
            lo = 0
            hi = 0
            if row < nq:
                if c < d:
                    lo = q[b, h, row, c]
                if c + 1 < d:
                    hi = q[b, h, row, c + 1]
            q_tile[r, idx % WORDS] = half2_bits(lo, hi)
        for r in range(2):
            m_i[r] = NEG_INF
            l_i[r] = ZERO
        for n in range(D_FRAGS):
            for e in range(4):
                acc[n, e] = ZERO

        kv_lo, kv_hi = tile_key_range(q_start, q_end, offset, nk, left, right)
        full_lo, full_hi = tile_full_range(q_start, q_end, offset, nk, left, right)
        for kt in range(kv_lo // BLOCK_N, (kv_hi + BLOCK_N - 1) // BLOCK_N):
            k_start = kt * BLOCK_N
            # -- load k_tile (rows of K) and vt_tile (V transposed), zero outside K/V
            if tid == 0:
                v_bad[0] = 0
            for idx in range(tid, BLOCK_N * WORDS, THREADS):
                r = idx // WORDS
                c = 2 * (idx % WORDS)
                key = k_start + r
                lo = 0
                hi = 0
                if key < nk:
                    if c < d:
                        lo = k[b, hk, key, c]
                    if c + 1 < d:
                        hi = k[b, hk, key, c + 1]
                k_tile[r, idx % WORDS] = half2_bits(lo, hi)
            cuda.syncthreads()  # v_bad = 0 is written before any thread may raise it
            if load_vt(vt_tile, v, b, hk, k_start, nk, d, tid, False):
                v_bad[0] = 1  # a non-finite v, stored as 0: handled after P V
            cuda.syncthreads()  # k_tile, vt_tile and v_bad are complete before any fragment load

            # [docs:mma-s]
            # -- S = Q K^T on the tensor cores: N_FRAGS accumulator fragments per warp
            for n in range(N_FRAGS):
                for e in range(4):
                    s[n, e] = ZERO
            for kc in range(K_STEPS):
                a0, a1, a2, a3 = load_a_frag(q_tile, 16 * warp, 8 * kc, g, t)
                for n in range(N_FRAGS):
                    b0, b1 = load_b_frag(k_tile, 8 * n, 8 * kc, g, t)
                    s[n, 0], s[n, 1], s[n, 2], s[n, 3] = mma_m16n8k16(
                        a0, a1, a2, a3, b0, b1, s[n, 0], s[n, 1], s[n, 2], s[n, 3])
            # [/docs:mma-s]

            # -- scale, mask (only tiles not inside the fully visible keys), score modifiers
            masked = tile_needs_mask(k_start, k_start + BLOCK_N, full_lo, full_hi)
            for n in range(N_FRAGS):
                for e in range(4):
                    row = row0 if e < 2 else row1
                    key = k_start + 8 * n + 2 * t + (e & 1)
                    x = s[n, e] * scale
                    lo = lo0 if e < 2 else lo1
                    hi = hi0 if e < 2 else hi1
                    if masked and not (lo <= key and key < hi):
                        x = NEG_INF
                    else:
                        x = score_mod(x, row, key, offset, softcap, inv_softcap, slope)
                    s[n, e] = x

            # [docs:mma-softmax]
            # -- online softmax on the fragments: rows g (e = 0, 1) and g + 8 (e = 2, 3)
            for r in range(2):
                mx = NEG_INF
                for n in range(N_FRAGS):
                    for e in range(2 * r, 2 * r + 2):
                        x = s[n, e]
                        mx = x if (x > mx or x != x) else mx   # a NaN wins
                mx = quad_max(mx)                              # over the row's 4 lanes
                m_new = mx if (mx > m_i[r] or mx != mx) else m_i[r]
                m_use = m_new if m_new != NEG_INF else ZERO    # no visible key yet: exp vs 0
                alpha = math.exp(m_i[r] - m_use)
                m_i[r] = m_new
                row_sum = ZERO
                for n in range(N_FRAGS):
                    for e in range(2 * r, 2 * r + 2):
                        p = math.exp(s[n, e] - m_use)
                        s[n, e] = p
                        row_sum += p
                l_i[r] = alpha * l_i[r] + row_sum              # this lane's part of the row
                for n in range(D_FRAGS):
                    for e in range(2 * r, 2 * r + 2):
                        acc[n, e] *= alpha
            # [/docs:mma-softmax]

            if DROPOUT:
                # -- P * keep / (1 - p) for P V: one Philox call per row and fragment covers the
                # lane's 2 keys (8n + 2t is even, so both lie in one group of 4)
                for n in range(N_FRAGS):
                    key = k_start + 8 * n + 2 * t
                    for r in range(2):
                        row = row0 + 8 * r
                        bits = 0
                        if row < nq and key < nk:
                            bits = philox_keep_bits4(seed_lo, seed_hi, b, h, row, key >> 2,
                                                     threshold) >> (key & 3)
                        for e in range(2):
                            if (bits >> e) & 1:
                                s[n, 2 * r + e] *= keep_scale
                            else:
                                s[n, 2 * r + e] = ZERO

            # [docs:mma-pv]
            # -- acc += P V on the tensor cores: two S fragments are one A fragment of P
            for kk in range(P_STEPS):
                a0, a1, a2, a3 = a_frag_from_c(s, 2 * kk, 2 * kk + 1)
                for n in range(D_FRAGS):
                    b0, b1 = load_b_frag(vt_tile, 8 * n, 8 * kk, g, t)
                    acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3] = mma_m16n8k16(
                        a0, a1, a2, a3, b0, b1, acc[n, 0], acc[n, 1], acc[n, 2], acc[n, 3])
            # [/docs:mma-pv]

            if v_bad[0]:
                # -- rare: a non-finite v[j, c] of a key j the row sees makes o[i, c] NaN.  The
                # count of such keys is itself a product: visible (0/1) x non-finite (0/1)
                cuda.syncthreads()  # every warp has read vt_tile for P V before it is replaced
                load_vt(vt_tile, v, b, hk, k_start, nk, d, tid, True)
                cuda.syncthreads()  # the 0/1 indicator tile is complete before fragment loads
                for kk in range(P_STEPS):
                    key = k_start + 16 * kk + 2 * t
                    a0 = pack_half2(seen(key, lo0, hi0), seen(key + 1, lo0, hi0))
                    a1 = pack_half2(seen(key, lo1, hi1), seen(key + 1, lo1, hi1))
                    a2 = pack_half2(seen(key + 8, lo0, hi0), seen(key + 9, lo0, hi0))
                    a3 = pack_half2(seen(key + 8, lo1, hi1), seen(key + 9, lo1, hi1))
                    for n in range(D_FRAGS):
                        b0, b1 = load_b_frag(vt_tile, 8 * n, 8 * kk, g, t)
                        h0, h1, h2, h3 = mma_m16n8k16(a0, a1, a2, a3, b0, b1, ZERO, ZERO, ZERO,
                                                      ZERO)
                        if h0 > ZERO:
                            acc[n, 0] = NAN
                        if h1 > ZERO:
                            acc[n, 1] = NAN
                        if h2 > ZERO:
                            acc[n, 2] = NAN
                        if h3 > ZERO:
                            acc[n, 3] = NAN
            cuda.syncthreads()  # every warp is done with k_tile / vt_tile / v_bad: next tile

        # -- epilogue: l = the quad's partial sums; o = acc / l, lse = m + log(l)
        for r in range(2):
            row = row0 + 8 * r
            l_row = quad_sum(l_i[r])
            if l_row > ZERO:
                inv_l = float32(1.0) / l_row
                row_lse = m_i[r] + math.log(l_row)
            elif l_row == ZERO:   # no visible key: o = 0, lse = -inf
                inv_l = ZERO
                row_lse = NEG_INF
            else:                 # NaN: a non-finite score in the row
                inv_l = NAN
                row_lse = NAN
            if row < nq:
                for n in range(D_FRAGS):
                    for e in range(2):
                        c = 8 * n + 2 * t + e
                        if c < d:
                            o[b, h, row, c] = acc[n, 2 * r + e] * inv_l
                if t == 0:
                    lse[b, h, row] = row_lse

    return flash_forward_mma


def compile_configs():
    """A representative set for the compile tier (the flags multiply: 5 head dims x dropout x
    softcap x ALiBi = 40 kernels would take minutes): every head dim plain, and every flag at
    once at 128 and 256 (the largest register and shared-memory footprints).  Causal and
    windows are runtime arguments: every configuration covers them."""
    u16 = types.Array(types.uint16, 4, "C")
    f16 = types.Array(types.float16, 4, "C")
    lse_t = types.Array(types.float32, 3, "C")
    window_t = types.UniTuple(types.int32, 2)
    mods_t = types.UniTuple(types.float32, 2)
    alibi_t = types.Array(types.float32, 2, "C")
    drop_t = types.Tuple((types.uint32, types.uint32, types.uint32, types.float32))
    plan = [(hd, False, False, False) for hd in HEAD_DIMS]
    plan += [(128, True, True, True), (256, True, True, True)]
    for hd, dropout, softcap, alibi in plan:
        nw, bn = GPU_TILES[hd]
        flags = "".join(f" {n}" for n, f in (("dropout", dropout), ("softcap", softcap),
                                              ("alibi", alibi)) if f)
        yield {
            "name": f"forward_mma W{nw} M{16 * nw} N{bn} D{hd}{flags} float16",
            "kernel": forward_mma_kernel(nw, bn, hd, dropout, softcap, alibi),
            "args": (u16, u16, u16, f16, lse_t, types.float32, window_t, mods_t, alibi_t,
                     drop_t if dropout else types.Tuple(())),
            "float64_ok": False,
            "mma": True,
        }


assert all(shared_bytes(nw, bn, hd) <= SMEM_LIMIT for hd, (nw, bn) in GPU_TILES.items())
