"""create_block_mask against a brute-force classification of the element mask (host only)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash.flex import EMPTY, FULL, PARTIAL, create_block_mask


def _table_mask(b, h, q_idx, kv_idx, table):
    return table[b, h, q_idx, kv_idx]


def _brute(dense, qb, kb):
    B, H, Nq, Nk = dense.shape
    nq, nk = -(-Nq // qb), -(-Nk // kb)
    kind = np.empty((B, H, nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            blk = dense[:, :, i * qb:(i + 1) * qb, j * kb:(j + 1) * kb]
            anyv, allv = blk.any(axis=(2, 3)), blk.all(axis=(2, 3))
            kind[:, :, i, j] = np.where(allv, FULL, np.where(anyv, PARTIAL, EMPTY))
    return kind


@pytest.mark.parametrize("shape, block", [((2, 3, 40, 70), 16), ((1, 2, 33, 17), (32, 16)),
                                          ((1, 1, 16, 16), 16)])
def test_classification_equals_brute_force(rng, shape, block):
    # blocks of mostly-False, mostly-True and mixed entries so every kind occurs
    dense = rng.random(shape) < rng.choice([0.0, 0.5, 1.0], size=shape[:2] + (1, 1))
    dense[..., :8, :8] = True
    bm = create_block_mask(_table_mask, *shape, aux_tensors=(dense,), BLOCK_SIZE=block)
    qb, kb = (block, block) if isinstance(block, int) else block
    np.testing.assert_array_equal(bm.kind, _brute(dense, qb, kb))
    np.testing.assert_array_equal(bm.to_dense(), dense)


def test_index_lists_follow_the_classification(rng):
    dense = rng.random((1, 2, 64, 96)) < 0.5
    dense[0, 0, :32, :] = False  # empty rows of blocks
    dense[0, 1, :, 48:] = True   # full blocks
    bm = create_block_mask(_table_mask, 1, 2, 64, 96, aux_tensors=(dense,), BLOCK_SIZE=16)
    for kind, num, idx in ((PARTIAL, bm.kv_num_blocks, bm.kv_indices),
                           (FULL, bm.full_kv_num_blocks, bm.full_kv_indices)):
        for h in range(2):
            for i in range(bm.kind.shape[2]):
                want = np.flatnonzero(bm.kind[0, h, i] == kind)
                assert num[0, h, i] == want.size
                np.testing.assert_array_equal(idx[0, h, i, :want.size], want)
                assert (idx[0, h, i, want.size:] == -1).all()
    for kind, num, idx in ((PARTIAL, bm.q_num_blocks, bm.q_indices),
                           (FULL, bm.full_q_num_blocks, bm.full_q_indices)):
        for j in range(bm.kind.shape[3]):
            want = np.flatnonzero(bm.kind[0, 1, :, j] == kind)
            assert num[0, 1, j] == want.size
            np.testing.assert_array_equal(idx[0, 1, j, :want.size], want)


def test_document_mask_skips_cross_document_blocks():
    doc = np.repeat(np.arange(4, dtype=np.int32), [40, 8, 50, 30])[None]

    def same_doc(b, h, q_idx, kv_idx, doc):
        return doc[b, q_idx] == doc[b, kv_idx]

    bm = create_block_mask(same_doc, 1, None, 128, 128, aux_tensors=(doc,), BLOCK_SIZE=16)
    assert bm.shape == (1, 1, 128, 128)
    dense = doc[0][:, None] == doc[0][None, :]
    np.testing.assert_array_equal(bm.kind[0, 0], _brute(dense[None, None], 16, 16)[0, 0])
    assert bm.sparsity() > 0.5  # four documents: most blocks cross a document boundary
    assert "sparsity" in str(bm)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(mask_mod=lambda b, h, q: True), TypeError, "4 arguments"),
    (dict(mask_mod=np.add), TypeError, "plain Python function"),
    (dict(mask_mod=lambda b, h, q, k: 1.5), TypeError, "return a bool"),
    (dict(mask_mod=lambda b, h, q, k: len(q) > k), TypeError, "could not compile"),
    (dict(aux_tensors=([1, 2],)), TypeError, "aux_tensors[0]"),
    (dict(aux_tensors=np.zeros(3)), TypeError, "tuple of arrays"),
    (dict(BLOCK_SIZE=24), ValueError, "powers of 2"),
    (dict(BLOCK_SIZE=8), ValueError, ">= 16"),
    (dict(BLOCK_SIZE=(16, 16, 16)), ValueError, "Q_BLOCK"),
    (dict(Nq=0), ValueError, "Nq"),
    (dict(B=2.0), TypeError, "B: expected an int"),
])
def test_bad_input(kwargs, exc, words):
    args = dict(mask_mod=_causal, B=1, H=1, Nq=32, Nk=32)
    args.update(kwargs)
    with pytest.raises(exc) as e:
        create_block_mask(**args)
    assert words in str(e.value)


def test_aux_arrays_are_not_modified(rng):
    table = rng.random((1, 1, 20, 20)) < 0.5
    before = table.copy()
    create_block_mask(_table_mask, 1, 1, 20, 20, aux_tensors=(table,), BLOCK_SIZE=16)
    np.testing.assert_array_equal(table, before)
