"""The token-sparse page's numbers, computed by running numba_flash in the simulator.

``docs/sparse-attention.md`` quotes the output of::

    python docs/examples/sparse_demo.py

A paged float64 cache with shuffled pages, four query heads of one kv head sharing each list
(a DSA-style decode step of two tokens), the decode, the forward over the same keys as a
contiguous ``k``, and the backward, each against ``numba_flash.reference`` in float64; then the
dense equivalence (every key listed) and a repeated key rejected.
"""

from __future__ import annotations

import numpy as np

import numba_flash as nf
from numba_flash import reference as ref
from report import err


def main():
    rng = np.random.default_rng(7)
    b, h, hkv, nq, d, page, topk = 2, 4, 1, 2, 16, 8, 6
    lens = np.array([29, 41])
    pages = [-(-n // page) for n in lens]
    k_cache = rng.standard_normal((sum(pages) + 2, hkv, page, d))
    v_cache = rng.standard_normal(k_cache.shape)
    order = rng.permutation(len(k_cache))
    table = np.full((b, max(pages)), -1, np.int32)
    table[0, :pages[0]], table[1, :pages[1]] = order[:pages[0]], order[pages[0]:sum(pages)]
    q = rng.standard_normal((b, h, nq, d))
    idx = np.full((b, hkv, nq, topk), -1, np.int32)
    for s in range(b):
        for i in range(nq):
            idx[s, 0, i, :topk - 1] = rng.choice(lens[s], topk - 1, replace=False)
    print(f"lists [B, Hkv, Nq, topk] = {list(idx.shape)}; sequence 0, token 0: "
          f"{idx[0, 0, 0].tolist()}")
    o, lse = nf.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                       kv_indices=idx, causal=True, return_lse=True)
    want_o, want_lse = ref.paged_decode(q, k_cache, v_cache, lens, table, kv_indices=idx,
                                        causal=True)
    print(f"decode over the paged cache (causal):  max |o - ref| {err(np.abs(o - want_o).max())}"
          f", max |lse - ref| {err(np.abs(lse - want_lse).max())}")

    k = np.stack([ref.gather_paged(k_cache, table, lens[1], 1)])      # sequence 1 alone
    v = np.stack([ref.gather_paged(v_cache, table, lens[1], 1)])
    qs, lists = q[1:], idx[1:]
    o, lse = nf.forward(qs, k, v, kv_indices=lists, return_lse=True)
    want_o, want_lse = ref.sparse_attention(qs, k, v, lists)
    print(f"forward over contiguous k, v:           max |o - ref| {err(np.abs(o - want_o).max())}")
    do = rng.standard_normal(o.shape)
    got = nf.backward(do, qs, k, v, o, lse, kv_indices=lists)
    want = ref.sparse_attention_backward(do, qs, k, v, lists)
    worst = max(np.abs(g - w).max() for g, w in zip(got, want))
    print(f"backward (dq, dk, dv):                  max |grad - ref| {err(worst)}")
    listed_keys = set(lists[lists >= 0].tolist())
    print(f"list entries read: {int((lists >= 0).sum())} of Nq x Nk = "
          f"{lists.shape[2] * k.shape[2]}; distinct keys listed: {len(listed_keys)}; "
          f"rows of dk that are not 0: {int(np.any(got[1][0, 0] != 0, axis=1).sum())}")

    every = np.full((b, 1, nq, max(lens)), -1, np.int32)
    for s in range(b):
        every[s, 0, :, :lens[s]] = np.arange(lens[s])
    dense = nf.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, num_splits=1)
    listed = nf.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table,
                       kv_indices=every, num_splits=1)
    print(f"every key listed, one split: bitwise the dense decode: {np.array_equal(dense, listed)}")
    twice = idx.copy()
    twice[0, 0, 0, 1] = twice[0, 0, 0, 0]
    try:
        nf.decode(q, k_cache, v_cache, cache_seqlens=lens, block_table=table, kv_indices=twice)
    except ValueError as e:
        print(f"a key listed twice: ValueError: {e}")


if __name__ == "__main__":
    main()
