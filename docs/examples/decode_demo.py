"""The decode pages' numbers, computed by running ``numba_flash.decode`` in the simulator.

``docs/flash-decoding.md`` and ``docs/paged-attention.md`` quote the output of::

    python docs/examples/decode_demo.py starvation   # grid sizes on a GPU, from the launch code
    python docs/examples/decode_demo.py invariance   # alone vs in a batch: the same bits
    python docs/examples/decode_demo.py last-row     # decode == last row(s) of causal attention
    python docs/examples/decode_demo.py paged        # NaN in stale slots, -1 entries, validation

``tests/docs/test_decode_demo.py`` checks every claim printed here.
"""

from __future__ import annotations

import sys

import numpy as np

import numba_flash as nf
from numba_flash import reference as ref
from report import err
from numba_flash.kernels.decode import config as kdecode
from numba_flash.kernels.core.common import cdiv

#: streaming multiprocessors of the GPU the starvation table assumes (H100 SXM / H200: 132)
SMS = 132


# -- starvation ------------------------------------------------------------------------------
def forward_style_blocks(b, h, nq, block_m):
    """Thread blocks of a prefill-style forward grid (Q tiles x batch x heads) for a decode."""
    return cdiv(nq, block_m) * b * h


def decode_blocks(seqlens, h, hkv, nq=1, d=128):
    """``(blocks, splits, keys per split)`` of numba_flash.decode on a GPU (float16, its own
    launch constants: :func:`numba_flash.kernels.decode.config.gpu_splits`)."""
    rows = (h // hkv) * nq
    splits, size = kdecode.gpu_splits(int(max(seqlens)), hkv, HEAD_DIM=d, n_rows=rows)
    per_block = min(rows, kdecode.gpu_rows_max(np.float16, d))
    return splits * len(seqlens) * hkv * cdiv(rows, per_block), splits, size


def starvation():
    block_m = 64  # a prefill Q tile (the forward's float16 default at HEAD_DIM = 64)
    print(f"GPU with {SMS} SMs; one query token per sequence; Q tile BLOCK_M = {block_m}")
    print(f"{'B':>3s} {'H':>3s} {'Hkv':>4s} {'L':>7s} | {'forward-style':>13s} {'keys/block':>10s}"
          f" {'rows used':>9s} | {'split-KV':>8s} {'splits':>6s} {'keys/block':>10s}")
    print(f"(split-KV: {kdecode.SM_COUNT} SMs x {kdecode.TARGET_BLOCKS_PER_SM} blocks / Hkv splits"
          f" per sequence, at least {kdecode.GPU_MIN_SPLIT_TOKENS} keys each; d = 128 float16)")
    for b, h, hkv, length in ((1, 32, 8, 32768), (1, 64, 8, 131072), (4, 32, 8, 8192),
                              (64, 32, 8, 2048)):
        fwd = forward_style_blocks(b, h, 1, block_m)
        dec, splits, size = decode_blocks([length] * b, h, hkv)
        print(f"{b:3d} {h:3d} {hkv:4d} {length:7d} | {fwd:13d} {length:10d} {f'1/{block_m}':>9s} |"
              f" {dec:8d} {splits:6d} {size:10d}")
    dec, splits, size = decode_blocks([32768], 32, 8)
    print(f"so a 32K-token sequence alone fills the GPU with split-KV: {dec} blocks, "
          f"{dec / SMS:.1f} per SM, of {size} keys each")


# -- batch invariance ------------------------------------------------------------------------
def make_cache(rng, seqlens, hkv, d, dtype=np.float32, nmax=None):
    """A contiguous cache [B, Hkv, Nmax, d] with NaN in every slot past each sequence's end."""
    nmax = nmax or int(max(seqlens))
    k = rng.standard_normal((len(seqlens), hkv, nmax, d)).astype(dtype)
    v = rng.standard_normal((len(seqlens), hkv, nmax, d)).astype(dtype)
    for i, n in enumerate(seqlens):
        k[i, :, n:] = np.nan
        v[i, :, n:] = np.nan
    return k, v


def batch_vs_alone(rng, num_splits=None, dtype=np.float32):
    """Sequence 1 of a 4-sequence batch, decoded in the batch and alone: ``(o_batch, o_alone)``."""
    seqlens = np.array([70, 23, 41, 9], np.int32)
    h, hkv, d = 4, 2, 8
    k, v = make_cache(rng, seqlens, hkv, d, dtype)
    q = rng.standard_normal((4, h, d)).astype(dtype)
    o_batch = nf.decode(q, k, v, cache_seqlens=seqlens, num_splits=num_splits)
    n = int(seqlens[1])
    o_alone = nf.decode(q[1:2], k[1:2, :, :n], v[1:2, :, :n], cache_seqlens=seqlens[1:2],
                        num_splits=num_splits)
    return o_batch[1], o_alone[0]


def batch_dependent_splits(rng, dtype=np.float32):
    """The same sequence decoded with the split count a batch-size heuristic would pick: enough
    splits to fill the GPU alone (8), fewer in a batch (2).  ``(o_with_2, o_with_8)``."""
    h, hkv, d, n = 4, 2, 8, 70
    k, v = make_cache(rng, [n], hkv, d, dtype)
    q = rng.standard_normal((1, h, d)).astype(dtype)
    return (nf.decode(q, k, v, cache_seqlens=np.array([n], np.int32), num_splits=2)[0],
            nf.decode(q, k, v, cache_seqlens=np.array([n], np.int32), num_splits=8)[0])


def bits_report(a, b):
    same = a.tobytes() == b.tobytes()
    diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return (f"bitwise equal: {same}; elements that differ: {int((a != b).sum())} of {a.size};"
            f" max |diff| {diff.max():.3g}")


def invariance():
    rng = np.random.default_rng(11)
    print(f"cache_seqlens = [70, 23, 41, 9]; simulator split size "
          f"{kdecode.SIM_MIN_SPLIT_TOKENS} tokens: the batch grid has cdiv(70, 16) = 5 splits,")
    print("sequence 1 (23 tokens) alone has 2; its splits 2..4 in the batch are empty (lse = -inf)")
    for dtype in (np.float32, np.float16):
        a, b = batch_vs_alone(np.random.default_rng(11), dtype=dtype)
        print(f"  {np.dtype(dtype).name:8s} num_splits=None, in batch vs alone: "
              f"{bits_report(a, b)}")
    a, b = batch_vs_alone(rng, num_splits=3)
    print(f"  float32  num_splits=3,    in batch vs alone: {bits_report(a, b)}")
    a, b = batch_dependent_splits(np.random.default_rng(5))
    print("a batch-dependent policy (split count from the batch size), same 70-token sequence:")
    print(f"  float32  2 splits vs 8 splits:              {bits_report(a, b)}")


# -- decode is the last row of causal attention ----------------------------------------------
def last_rows(rng, nq_new, dtype):
    """Decode the last ``nq_new`` tokens of a 37-token sequence against all 37 cached keys, and
    the float64 oracle's causal attention of the whole sequence: ``(decode_out, its last rows)``."""
    h, hkv, n, d = 4, 2, 37, 8
    q = rng.standard_normal((1, h, n, d)).astype(dtype)
    k = rng.standard_normal((1, hkv, n, d)).astype(dtype)
    v = rng.standard_normal((1, hkv, n, d)).astype(dtype)
    want = ref.attention(q, k, v, causal=True)[0][:, :, n - nq_new:]
    got = nf.decode(q[:, :, n - nq_new:], k, v, cache_seqlens=np.array([n], np.int32),
                    causal=True)
    return got, want


def last_row():
    print("causal attention of a 37-token sequence (H = 4, Hkv = 2, d = 8, float64 oracle) vs")
    print("decode of its last Nq tokens against the 37 cached keys (bottom-right causal):")
    for dtype in (np.float64, np.float32, np.float16):
        for nq in (1, 3):
            got, want = last_rows(np.random.default_rng(3), nq, dtype)
            print(f"  {np.dtype(dtype).name:8s} Nq={nq}: max |decode - oracle| "
                  f"{err(np.abs(got - want).max())}")


# -- paged -----------------------------------------------------------------------------------
def paged_case(rng, dtype=np.float32):
    """A paged cache with NaN in every stale slot and free block, -1 past each live range.

    Returns ``(q, k_cache, v_cache, seqlens, table)``; block_size 4, 16 physical blocks."""
    h, hkv, d, bs, n_blocks = 4, 2, 8, 4, 16
    seqlens = np.array([10, 5, 23], np.int32)
    k = np.full((n_blocks, hkv, bs, d), np.nan, dtype)
    v = np.full((n_blocks, hkv, bs, d), np.nan, dtype)
    table = np.full((3, 8), -1, np.int32)
    free = list(rng.permutation(n_blocks))
    for b, n in enumerate(seqlens):
        for lb in range(cdiv(int(n), bs)):
            pb = free.pop()
            table[b, lb] = pb
            live = min(bs, int(n) - lb * bs)
            k[pb, :, :live] = rng.standard_normal((hkv, live, d))
            v[pb, :, :live] = rng.standard_normal((hkv, live, d))
    q = rng.standard_normal((3, h, d)).astype(dtype)
    return q, k, v, seqlens, table


def to_contiguous(cache, table, seqlens):
    """The same tokens in a contiguous [B, Hkv, Nmax, d] cache (NaN past each end)."""
    out = np.full((len(seqlens), cache.shape[1], int(max(seqlens)), cache.shape[3]), np.nan,
                  cache.dtype)
    for b, n in enumerate(seqlens):
        out[b, :, :n] = ref.gather_paged(cache, table, int(n), b)
    return out


def paged():
    q, k, v, seqlens, table = paged_case(np.random.default_rng(7))
    stale = int(np.isnan(k).any(axis=(1, 3)).sum())
    print(f"cache_seqlens = {seqlens.tolist()}, block_size = 4, 16 physical blocks")
    print("block_table =")
    print("  " + str(table).replace("\n", "\n  "))
    print(f"NaN in {int(np.isnan(k).sum())} of {k.size} k_cache elements "
          f"({stale} of {k.shape[0] * k.shape[2]} slots: free blocks and the tails of last blocks)")
    o = nf.decode(q, k, v, cache_seqlens=seqlens, block_table=table)
    want, _ = ref.paged_decode(q, k, v, seqlens, table)
    print(f"decode: all finite {bool(np.isfinite(o).all())}, max |o - oracle| "
          f"{err(np.abs(o - want).max())}")
    kc, vc = to_contiguous(k, table, seqlens), to_contiguous(v, table, seqlens)
    oc = nf.decode(q, kc, vc, cache_seqlens=seqlens)
    print(f"same tokens in a contiguous cache: {bits_report(o, oc)}")
    print("bad tables are rejected before any launch (validate=True, the default for NumPy):")
    for label, bad_table, bad_lens in (
            ("-1 inside a live range", _with(table, (0, 1), -1), seqlens),
            ("entry >= num_blocks", _with(table, (2, 5), 16), seqlens),
            ("seqlen past the table", table[:, :5], seqlens)):
        try:
            nf.decode(q, k, v, cache_seqlens=bad_lens, block_table=bad_table)
            print(f"  {label}: accepted (!)")
        except ValueError as exc:
            print(f"  {label}: ValueError: {exc}")
    print("validate=False (the default for CuPy: no host round trip) reads nothing outside the "
          "cache;")
    print("the sequence with the bad entry gets NaN, the others are unchanged:")
    bad = _with(table, (0, 1), 16)
    ob, lb = nf.decode(q, k, v, cache_seqlens=seqlens, block_table=bad, validate=False,
                       return_lse=True)
    print(f"  entry 16 (= num_blocks) at [0, 1]: sequence 0 o all NaN {bool(np.isnan(ob[0]).all())}"
          f", lse NaN {bool(np.isnan(lb[0]).all())}; sequences 1, 2 {bits_report(ob[1:], o[1:])}")


def _with(table, idx, value):
    t = table.copy()
    t[idx] = value
    return t


COMMANDS = {"starvation": starvation, "invariance": invariance, "last-row": last_row,
            "paged": paged}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]]()
