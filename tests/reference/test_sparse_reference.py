"""reference.sparse_attention, the oracle of issue 47's token-sparse kernels: the listed keys
only, checked against dense attention (every key listed), a per-row gather written out, and
the edge rules (no key, a sink, repeats, the causal rule over a listed key, NaN outside the
list, GQA-shared lists, bad indices)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref


def _qkv(rng, b=2, h=4, hkv=2, nq=5, nk=9, d=8):
    return (rng.standard_normal((b, h, nq, d)), rng.standard_normal((b, hkv, nk, d)),
            rng.standard_normal((b, hkv, nk, d)))


def test_every_key_listed_is_dense_attention(rng):
    q, k, v = _qkv(rng)
    idx = np.broadcast_to(np.arange(9), (2, 1, 5, 9)).astype(np.int32)
    o, lse = ref.sparse_attention(q, k, v, idx, causal=True, softcap=5.0)
    want_o, want_lse = ref.attention(q, k, v, causal=True, softcap=5.0)
    np.testing.assert_allclose(o, want_o, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)


def test_random_top_k_is_attention_over_the_gathered_keys(rng):
    q, k, v = _qkv(rng)
    idx = np.stack([[[rng.permutation(9)[:4] for _ in range(5)] for _ in range(2)]
                    for _ in range(2)]).astype(np.int32)              # [B, Hkv, Nq, 4]
    idx[0, 1, 2, 1:] = -1                                              # a row with one key
    o, lse = ref.sparse_attention(q, k, v, idx)
    for b in range(2):
        for hq in range(4):
            g = hq // 2
            for i in range(5):
                keys = idx[b, g, i][idx[b, g, i] >= 0]
                s = q[b, hq, i] @ k[b, g, keys].T / np.sqrt(8)
                want_lse = np.log(np.exp(s - s.max()).sum()) + s.max()
                want_o = np.exp(s - want_lse) @ v[b, g, keys]
                np.testing.assert_allclose(o[b, hq, i], want_o, rtol=1e-12, atol=1e-13)
                np.testing.assert_allclose(lse[b, hq, i], want_lse, rtol=1e-13)


def test_edge_rules(rng):
    q, k, v = _qkv(rng, nq=2, nk=6)
    idx = np.full((2, 1, 2, 3), -1, np.int32)
    idx[:, :, 1] = [5, 5, 1]                     # a repeat counts once
    k[:, :, 3] = np.nan                           # never listed: cannot poison a row
    sink = rng.standard_normal(4)
    o, lse = ref.sparse_attention(q, k, v, idx, learnable_sink=sink)
    assert np.all(o[:, :, 0] == 0) and np.allclose(lse[:, :, 0], sink)   # no key: o = 0, sink
    single = idx.copy()
    single[:, :, 1] = [5, 1, -1]
    np.testing.assert_allclose(o, ref.sparse_attention(q, k, v, single, learnable_sink=sink)[0],
                               rtol=1e-14, atol=0)
    assert np.isfinite(o).all()
    hidden = ref.sparse_attention(q, k, v, np.full((2, 1, 2, 1), 5, np.int32), causal=True)
    assert np.all(hidden[0][:, :, 0] == 0) and np.all(hidden[1][:, :, 0] == -np.inf)  # 5 > 0 + 4


def test_bad_indices_are_named(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(ValueError, match=r"kv_indices: expected entries in \[-1, 9\)"):
        ref.sparse_attention(q, k, v, np.full((2, 1, 5, 2), 9, np.int32))
    with pytest.raises(ValueError, match="kv_indices: expected integers"):
        ref.sparse_attention(q, k, v, np.zeros((2, 3, 5, 2), np.int32))
