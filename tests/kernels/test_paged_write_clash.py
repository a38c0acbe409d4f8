"""Issue 37, item 1: an append into a paged cache (``append_kv``, ``decode(k_new=...)``) whose
block table sends two new tokens to one physical slot, or a new token onto a token a sequence
already holds, is a ValueError naming ``block_table`` before anything is written; blocks shared
for reading (a common prefix) still work."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref

BS, D = 4, 8


def _cache(rng, num_blocks):
    k = rng.standard_normal((num_blocks, 1, BS, D)).astype(np.float32)
    return k, rng.standard_normal(k.shape).astype(np.float32)


def _new(rng, b, nnew=1):
    return (rng.standard_normal((b, 1, nnew, D)).astype(np.float32) for _ in range(2))


def _append(kc, vc, kn, vn, lens, table):
    return numba_flash.append_kv(kc, vc, kn, vn, lens, block_table=table)


def _decode(kc, vc, kn, vn, lens, table):
    q = np.ones((len(lens), 1, D), np.float32)
    return numba_flash.decode(q, kc, vc, cache_seqlens=lens, block_table=table, k_new=kn,
                              v_new=vn)


CLASHES = {  # (lengths, block table, Nnew, the message's words)
    # the repro: both sequences append token 3 into block 0, slot 3
    "two sequences, one slot": ([3, 3], [[0, 1], [0, 1]], 1, "sequences 0 and 1"),
    # sequence 1 shares sequence 0's half-full block and appends onto sequence 0's token 2
    "append onto a held token": ([3, 2], [[0, 1], [0, 2]], 1, "sequence 0 holds its token 2"),
    # one sequence whose table lists block 0 twice: tokens 3 and 7 go to one slot
    "a block listed twice": ([3], [[0, 0, 1]], 5, "sequence 0 would write tokens 3 and 7"),
    # a new token onto the sequence's own token 0 (block 0 listed again further on)
    "onto its own token": ([4], [[0, 0]], 1, "sequence 0 holds its token 0"),
}


@pytest.mark.parametrize("op", [_append, _decode], ids=["append_kv", "decode"])
@pytest.mark.parametrize("case", list(CLASHES))
def test_a_write_clash_is_a_value_error_and_writes_nothing(rng, op, case):
    lens, table, nnew, words = CLASHES[case]
    lens, table = np.array(lens, np.int32), np.array(table, np.int32)
    kc, vc = _cache(rng, 3)
    kn, vn = _new(rng, len(lens), nnew)
    before = kc.copy(), vc.copy()
    with pytest.raises(ValueError, match="^block_table: ") as e:
        op(kc, vc, kn, vn, lens, table)
    assert words in str(e.value), str(e.value)
    np.testing.assert_array_equal(kc, before[0])
    np.testing.assert_array_equal(vc, before[1])


def test_a_shared_prefix_is_read_by_both_and_appended_apart(rng):
    """Prefix caching: sequences 0 and 1 share the full block 0 (4 tokens) and append into
    blocks of their own; decode with k_new equals the reference on the gathered caches."""
    kc, vc = _cache(rng, 4)
    lens = np.array([6, 4], np.int32)
    table = np.array([[0, 1], [0, 2]], np.int32)
    kn, vn = _new(rng, 2)
    q = rng.standard_normal((2, 2, D)).astype(np.float32)
    want_k, want_v, want_lens = ref.append_kv(kc, vc, kn, vn, lens, table)
    o = numba_flash.decode(q, kc, vc, cache_seqlens=lens, block_table=table, k_new=kn, v_new=vn)
    np.testing.assert_array_equal(kc, want_k)
    np.testing.assert_array_equal(vc, want_v)
    o_ref, _ = ref.paged_decode(q, kc, vc, want_lens, table)
    np.testing.assert_allclose(o, o_ref, atol=2e-6)  # float32: measured 3e-7
