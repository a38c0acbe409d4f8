"""Attention sinks in the decode and the merge (issue 35): the split-KV decode (contiguous and
paged, several splits) adds a row's sink once, in the fused combine or, with one split, where
the split writes its output; :func:`numba_flash.merge_states` adds it as one more part with
``o_p = 0``.  Against the float64 reference (``learnable_sink`` of
:func:`numba_flash.reference.kvcache_decode` / ``merge_states``), at the bounds of
test_decode_kernel.py (the sink adds one exp and one division per row).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn
from test_decode_kernel import LSE_DTYPE, contiguous_cache, paged_cache


def _sinks(rng, h):
    s = (rng.standard_normal(h) + 2.0).astype(np.float32)   # a real share of each row's mass
    s[-1] = -np.inf                                           # the last head has none
    return s


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_with_a_sink(rng, num_splits, paged):
    """GQA, a multi-token causal query with a window, one empty sequence (o = 0, lse = sink)."""
    b, h, hkv, nq, d = 3, 4, 2, 2, 8
    lens = np.array([29, 0, 7])
    if paged:
        k, v, table = paged_cache(rng, b, hkv, d, lens, 5, np.float32)
    else:
        k, v = contiguous_cache(rng, b, hkv, 32, d, lens, np.float32)
        table = None
    q = randn(rng, (b, h, nq, d))
    sink = _sinks(rng, h)
    kw = dict(causal=True, window_size=(11, 0), learnable_sink=sink)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                num_splits=num_splits, return_lse=True, **kw)
    want_o, want_lse, _, _ = ref.kvcache_decode(q, k, v, lens, block_table=table, **kw)
    assert_close(o, want_o, np.float32, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    assert (o[1] == 0).all()
    np.testing.assert_array_equal(lse[1], np.broadcast_to(sink[:, None], (h, nq)))


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_decode_sink_dtypes_softcap_alibi(rng, dtype):
    b, h, hkv, d = 2, 2, 1, 16
    lens = np.array([37, 4])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 8, dtype)
    q = randn(rng, (b, h, d), dtype)
    sink = _sinks(rng, h)
    kw = dict(softcap=4.0, alibi_slopes=np.array([0.3, 0.1], np.float32), learnable_sink=sink)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, num_splits=4,
                                return_lse=True, **kw)
    want_o, want_lse = ref.paged_decode(q, k, v, lens, table, **kw)
    assert_close(o, want_o, dtype, name="o")
    assert_close(lse, want_lse, LSE_DTYPE[dtype], name="lse")


def test_a_sink_far_above_every_score(rng):
    """A sink 60 nats above the scores: o ~ e^-60 (the divisor l + e^(sink - m) is computed
    against the keys' max, the lse against max(m, sink)): finite, not 0/0, lse = the sink."""
    b, h, d = 1, 2, 8
    lens = np.array([20])
    k, v = contiguous_cache(rng, b, 1, 20, d, lens, np.float32)
    q = randn(rng, (b, h, d))
    sink = np.array([60.0, 80.0], np.float32)
    for splits in (1, 3):
        o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=splits,
                                    return_lse=True, learnable_sink=sink)
        want_o, want_lse = ref.paged_decode(q, k, v, lens, learnable_sink=sink)
        assert np.isfinite(o).all()
        assert_close(o, want_o, np.float32, name="o")
        np.testing.assert_allclose(lse, want_lse, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_merge_of_split_partials_with_a_sink_is_the_unsplit_attention(rng, dtype):
    """Three disjoint key sets (one empty) merged with the sink == attention over all keys with
    it: the sink joins once, not per part."""
    b, h, nq, d = 2, 3, 5, 16
    q = randn(rng, (b, h, nq, d), dtype)
    k, v = randn(rng, (b, h, 18, d), dtype), randn(rng, (b, h, 18, d), dtype)
    sink = _sinks(rng, h)
    parts = [numba_flash.forward(q, k[:, :, s], v[:, :, s], return_lse=True)
             for s in (slice(0, 7), slice(7, 18))]
    empty = (np.full(q.shape, np.nan, dtype), np.full(q.shape[:-1], -np.inf, LSE_DTYPE[dtype]))
    parts.insert(1, empty)   # a part that saw no key: its o is never read
    o_parts = np.stack([p[0] for p in parts])
    lse_parts = np.stack([p[1] for p in parts])
    o, lse = numba_flash.merge_states(o_parts, lse_parts, learnable_sink=sink[:, None])
    want_o, want_lse = ref.attention(q, k, v, learnable_sink=sink)
    assert_close(o, want_o, dtype, name="o")
    assert_close(lse, want_lse, LSE_DTYPE[dtype], name="lse")
    # the reference merge says the same, and a row with no non-empty part gets o = 0, lse = sink
    r_o, r_lse = ref.merge_states(o_parts, lse_parts, learnable_sink=sink[:, None])
    np.testing.assert_allclose(r_lse, want_lse, atol=1e-5)
    o, lse = numba_flash.merge_states(o_parts[1:2], lse_parts[1:2], learnable_sink=sink[:, None])
    assert (o == 0).all()
    np.testing.assert_array_equal(lse, np.broadcast_to(sink[:, None], (b, h, nq)))


@pytest.mark.parametrize("sink, err, words", [
    (np.zeros(3, np.float64), TypeError, "dtype float32"),
    (np.zeros(5, np.float32), ValueError, "learnable_sink"),
    (np.array([0.0, np.nan, 0.0], np.float32), ValueError, "NaN"),
])
def test_a_bad_sink_is_named(rng, sink, err, words):
    q = randn(rng, (1, 3, 8))
    k, v = contiguous_cache(rng, 1, 1, 4, 8, [4], np.float32)
    with pytest.raises(err) as info:
        numba_flash.decode(q, k, v, cache_seqlens=np.array([4]), learnable_sink=sink)
    assert "learnable_sink" in str(info.value) and words in str(info.value)
    o_parts, lse_parts = randn(rng, (2, 1, 3, 8)), randn(rng, (2, 1, 3))
    bad = sink if sink.shape != (3,) or sink.dtype != np.float32 else sink[None]
    with pytest.raises(err) as info:
        numba_flash.merge_states(o_parts, lse_parts, learnable_sink=bad)
    assert "learnable_sink" in str(info.value) and words in str(info.value)
