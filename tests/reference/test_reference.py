"""Reference tier: the float64 oracle against direct formulas, against itself, and (for the
backward) against finite differences."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from numba_flash import reference as ref


# -- softmax ---------------------------------------------------------------------------------
@given(hnp.arrays(np.float64, st.integers(1, 40),
                  elements=st.floats(-1e3, 1e3, allow_nan=False)))
@settings(max_examples=200, deadline=None)
def test_online_softmax_equals_softmax(x):
    np.testing.assert_allclose(ref.online_softmax(x), ref.softmax(x), rtol=1e-12, atol=1e-15)
    m, l = ref.online_softmax_stats(x)
    assert m == x.max()
    assert math.isclose(l, np.exp(x - x.max()).sum(), rel_tol=1e-12)


@given(hnp.arrays(np.float64, st.integers(1, 40),
                  elements=st.one_of(st.floats(-1e3, 1e3), st.just(-math.inf))),
       st.integers(0, 39))
@settings(max_examples=200, deadline=None)
def test_online_softmax_masked_entries(x, keep):
    """-inf entries (leading, trailing, anywhere; issue 21 item 2): 0 in the softmax, nothing in
    the stats, the same as the three-pass softmax (one finite entry at least)."""
    x = x.copy()
    x[keep % x.size] = 0.25
    y = ref.online_softmax(x)
    np.testing.assert_allclose(y, ref.softmax(x), rtol=1e-12, atol=1e-15)
    assert (y[np.isneginf(x)] == 0).all()
    m, l = ref.online_softmax_stats(x)
    assert m == x.max()
    assert math.isclose(l, np.exp(x - x.max()).sum(), rel_tol=1e-12)


def test_online_softmax_stats_leading_and_all_masked():
    assert ref.online_softmax_stats([-math.inf, 1.0]) == (1.0, 1.0)
    assert ref.online_softmax_stats([-math.inf, -math.inf, 2.0, -math.inf]) == (2.0, 1.0)
    assert ref.online_softmax_stats([-math.inf, -math.inf]) == (-math.inf, 0.0)
    # no visible entry: no softmax, NaN everywhere in both forms (torch gives NaN too)
    assert np.isnan(ref.softmax([-math.inf, -math.inf])).all()
    assert np.isnan(ref.online_softmax([-math.inf, -math.inf])).all()


def test_softmax_large_logits_do_not_overflow():
    y = ref.softmax(np.array([1000.0, 999.0, -1000.0]))
    np.testing.assert_allclose(y, [1 / (1 + math.exp(-1)), math.exp(-1) / (1 + math.exp(-1)), 0.0])


def test_softmax_rejects_bad_shapes():
    with pytest.raises(ValueError, match="x: expected a non-empty 1-D"):
        ref.softmax(np.zeros((2, 2)))
    with pytest.raises(ValueError):
        ref.online_softmax(np.zeros(0))


# -- attention -------------------------------------------------------------------------------
def naive_attention(q, k, v, causal, scale):
    """A loop over (b, h, i): the formula spelled out element by element."""
    b_, h_, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    o = np.zeros(q.shape)
    lse = np.full(q.shape[:3], -np.inf)
    for b in range(b_):
        for h in range(h_):
            kh = h // (h_ // hkv)
            for i in range(nq):
                js = [j for j in range(nk) if not causal or j <= i + nk - nq]
                if not js:
                    continue
                s = np.array([scale * q[b, h, i] @ k[b, kh, j] for j in js])
                lse[b, h, i] = math.log(sum(math.exp(x) for x in s))
                p = np.exp(s - lse[b, h, i])
                o[b, h, i] = sum(p[t] * v[b, kh, j] for t, j in enumerate(js))
    return o, lse


SHAPES = [  # (B, H, Hkv, Nq, Nk, d)
    (1, 1, 1, 1, 1, 1), (2, 4, 2, 5, 7, 3), (1, 3, 1, 9, 4, 8), (2, 2, 2, 6, 6, 5),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_naive_loops(shape, causal):
    rng = np.random.default_rng(0)
    b, h, hkv, nq, nk, d = shape
    q = rng.standard_normal((b, h, nq, d))
    k = rng.standard_normal((b, hkv, nk, d))
    v = rng.standard_normal((b, hkv, nk, d))
    o, lse = ref.attention(q, k, v, causal=causal)
    o2, lse2 = naive_attention(q, k, v, causal, 1 / math.sqrt(d))
    np.testing.assert_allclose(o, o2, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse2))
    np.testing.assert_allclose(lse[np.isfinite(lse)], lse2[np.isfinite(lse2)], atol=1e-12)


def test_causal_rows_without_keys_are_zero_and_minus_inf():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 5, 4))
    k = rng.standard_normal((1, 1, 2, 4))
    o, lse = ref.attention(q, k, k, causal=True)
    # bottom-right: query i sees key j iff j <= i - 3
    assert np.all(o[0, 0, :3] == 0) and np.all(lse[0, 0, :3] == -np.inf)
    assert np.all(np.isfinite(lse[0, 0, 3:]))
    assert not np.isnan(o).any()


def test_attention_large_logits_finite():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 4, 8)) * 1e3
    k = rng.standard_normal((1, 2, 6, 8)) * 1e3
    o, lse = ref.attention(q, k, k)
    assert np.isfinite(o).all() and np.isfinite(lse).all()


@given(st.integers(1, 2), st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]), st.integers(1, 9),
       st.integers(1, 9), st.integers(1, 6), st.integers(1, 5), st.integers(1, 5), st.booleans())
@settings(max_examples=60, deadline=None)
def test_blocked_equals_direct(b, heads, nq, nk, d, bm, bn, causal):
    h, hkv = heads
    rng = np.random.default_rng(b * 1000 + nq * 100 + nk * 10 + d)
    q = rng.standard_normal((b, h, nq, d))
    k = rng.standard_normal((b, hkv, nk, d))
    v = rng.standard_normal((b, hkv, nk, d))
    o, lse = ref.attention(q, k, v, causal=causal)
    o2, lse2 = ref.blocked_attention(q, k, v, bm, bn, causal=causal)
    np.testing.assert_allclose(o2, o, atol=1e-12)
    np.testing.assert_array_equal(lse2 == -np.inf, lse == -np.inf)
    np.testing.assert_allclose(lse2[np.isfinite(lse2)], lse[np.isfinite(lse)], atol=1e-12)


def test_blocked_with_dropout_equals_direct():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, 7, 4)) for _ in range(3))
    keep = rng.random((1, 2, 7, 7)) > 0.3
    o, _ = ref.attention(q, k, v, causal=True, dropout_mask=keep, dropout_p=0.3)
    o2, _ = ref.blocked_attention(q, k, v, 3, 2, causal=True, dropout_mask=keep, dropout_p=0.3)
    np.testing.assert_allclose(o2, o, atol=1e-12)


def test_dropout_scales_kept_probabilities():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 1, 3, 4)) for _ in range(3))
    keep = np.ones((1, 1, 3, 3), bool)
    keep[0, 0, 1, 2] = False
    o, lse = ref.attention(q, k, v, dropout_mask=keep, dropout_p=0.5)
    _, p, lse0 = ref._probabilities(q, k, False, 0.5)
    np.testing.assert_allclose(lse, lse0)
    np.testing.assert_allclose(o[0, 0], (p[0, 0] * keep[0, 0] * 2.0) @ v[0, 0])


# -- backward --------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(2, 2), (4, 2), (3, 1)])
@pytest.mark.parametrize("dropout", [False, True])
def test_backward_matches_finite_differences(causal, heads, dropout):
    rng = np.random.default_rng(5)
    h, hkv = heads
    nq, nk, d = 4, 6, 3
    q = rng.standard_normal((1, h, nq, d))
    k = rng.standard_normal((1, hkv, nk, d))
    v = rng.standard_normal((1, hkv, nk, d))
    do = rng.standard_normal((1, h, nq, d))
    keep = (rng.random((1, h, nq, nk)) > 0.25) if dropout else None
    p = 0.25 if dropout else 0.0
    kw = dict(causal=causal, dropout_mask=keep, dropout_p=p)
    dq, dk, dv = ref.attention_backward(do, q, k, v, **kw)

    def loss(q_, k_, v_):
        return float((ref.attention(q_, k_, v_, **kw)[0] * do).sum())

    eps = 1e-6
    for x, dx in ((q, dq), (k, dk), (v, dv)):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args_p = [xp if y is x else y for y in (q, k, v)]
            args_m = [xm if y is x else y for y in (q, k, v)]
            num[idx] = (loss(*args_p) - loss(*args_m)) / (2 * eps)
        np.testing.assert_allclose(dx, num, atol=1e-7, rtol=1e-6)


def test_backward_fully_masked_rows_give_zero_gradients():
    rng = np.random.default_rng(6)
    q = rng.standard_normal((1, 1, 5, 3))
    k = rng.standard_normal((1, 1, 2, 3))
    do = rng.standard_normal((1, 1, 5, 3))
    dq, dk, dv = ref.attention_backward(do, q, k, k, causal=True)
    assert np.all(dq[0, 0, :3] == 0)
    assert all(np.isfinite(x).all() for x in (dq, dk, dv))


# -- merge_states and paged decode -----------------------------------------------------------
@pytest.mark.parametrize("cuts", [[3], [1, 4], [2, 3, 5], [0, 0, 7]])
def test_merge_of_parts_equals_whole(cuts):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 2, 3, 4))
    k = rng.standard_normal((2, 2, 8, 4))
    v = rng.standard_normal((2, 2, 8, 4))
    o, lse = ref.attention(q, k, v)
    bounds = [0] + cuts + [8]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            parts.append(ref.attention(q, k[:, :, a:b], v[:, :, a:b]))
        else:  # an empty part: lse = -inf, o arbitrary (here garbage) must not matter
            parts.append((np.full(o.shape, 123.0), np.full(lse.shape, -np.inf)))
    o2, lse2 = ref.merge_states(np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts]))
    np.testing.assert_allclose(o2, o, atol=1e-12)
    np.testing.assert_allclose(lse2, lse, atol=1e-12)


def test_merge_all_empty_parts():
    o, lse = ref.merge_states(np.ones((2, 3, 4)), np.full((2, 3), -np.inf))
    assert np.all(o == 0) and np.all(lse == -np.inf)


def test_notes_wrong_merge_is_wrong():
    """The notes' wrong_merge keeps the first block's max (and iterates ``blocks[1]``)."""
    rng = np.random.default_rng(8)
    x = np.concatenate([rng.standard_normal(4), rng.standard_normal(4) + 10])
    vals = rng.standard_normal((8, 2))
    blocks = []
    for a in (0, 4):
        s = x[a:a + 4]
        m = s.max()
        p = np.exp(s - m)
        blocks.append({"m": m, "l": p.sum(), "o": p @ vals[a:a + 4]})
    want = ref.softmax(x) @ vals
    # the notes' correct_merge (fixed-point): equals the direct softmax
    m, l, o = -np.inf, 0.0, 0.0
    for b in blocks:
        m_new = max(m, b["m"])
        l = l * np.exp(m - m_new) + b["l"] * np.exp(b["m"] - m_new)
        o = o * np.exp(m - m_new) + b["o"] * np.exp(b["m"] - m_new)
        m = m_new
    np.testing.assert_allclose(o / l, want, atol=1e-12)
    # wrong_merge with blocks[1:] (the intent): exponents taken against the stale max
    m, l, o = blocks[0]["m"], blocks[0]["l"], blocks[0]["o"]
    for b in blocks[1:]:
        l = l + b["l"] * np.exp(b["m"] - m)
        o = o + b["o"] * np.exp(b["m"] - m)
    # same maths when nothing overflows: the "wrong" merge is only numerically fragile...
    np.testing.assert_allclose(o / l, want, atol=1e-9)
    # ...and overflows once the max grows by more than ~709
    with np.errstate(over="ignore", invalid="ignore"):
        big = blocks[1]["m"] + 800 - blocks[0]["m"]
        assert not np.isfinite(blocks[1]["l"] * np.exp(big))


@pytest.mark.parametrize("block_size", [1, 3, 4])
def test_paged_decode_equals_contiguous(block_size):
    rng = np.random.default_rng(9)
    b, h, hkv, d, nmax = 3, 4, 2, 5, 10
    seqlens = np.array([1, 10, 7])
    k = rng.standard_normal((b, hkv, nmax, d))
    v = rng.standard_normal((b, hkv, nmax, d))
    q = rng.standard_normal((b, h, d))
    nblk = -(-nmax // block_size)
    perm = rng.permutation(b * nblk)
    table = perm.reshape(b, nblk)
    kc = np.full((b * nblk, hkv, block_size, d), np.nan)
    vc = np.full((b * nblk, hkv, block_size, d), np.nan)
    for s in range(b):
        for t in range(seqlens[s]):
            kc[table[s, t // block_size], :, t % block_size] = k[s, :, t]
            vc[table[s, t // block_size], :, t % block_size] = v[s, :, t]
    o1, lse1 = ref.paged_decode(q, k, v, seqlens)
    o2, lse2 = ref.paged_decode(q, kc, vc, seqlens, table)
    np.testing.assert_allclose(o2, o1, atol=1e-12)
    np.testing.assert_allclose(lse2, lse1, atol=1e-12)
    o3, _ = ref.attention(q[1:2, :, None], k[1:2], v[1:2])
    np.testing.assert_allclose(o1[1], o3[0, :, 0], atol=1e-12)
