"""Reference tier: the NumPy Philox4x32 twin and the dropout keep-mask (fast, no kernels)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

import numba_flash
from numba_flash.philox import dropout_params, philox4x32, philox4x32_10

# Known answers of Random123 (Salmon et al., SC'11), file ``tests/kat_vectors`` of the Random123
# distribution, the "philox4x32 7" and "philox4x32 10" lines; copied from
# DEShawResearch/Random123-Boost, libs/random/test/test_philox.cpp (commit 916db91a), whose
# comment says they are "cut-and-pasted from the kat_vectors file in the original Random123
# distribution".  Columns: rounds, counter (4 words), key (2 words), expected (4 words).
KAT = """
7  00000000 00000000 00000000 00000000 00000000 00000000   5f6fb709 0d893f64 4f121f81 4f730a48
7  ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   5207ddc2 45165e59 4d8ee751 8c52f662
7  243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   4dfccaba 190a87f0 c47362ba b6b5242a
10 00000000 00000000 00000000 00000000 00000000 00000000   6627e8d5 e169c58d bc57ac4c 9b00dbd8
10 ffffffff ffffffff ffffffff ffffffff ffffffff ffffffff   408f276d 41c83b0e a20bc7c6 6d5451fd
10 243f6a88 85a308d3 13198a2e 03707344 a4093822 299f31d0   d16cfe09 94fdcceb 5001e420 24126ea1
"""
KAT_ROWS = [
    (int(w[0]), [int(x, 16) for x in w[1:5]], [int(x, 16) for x in w[5:7]],
     [int(x, 16) for x in w[7:11]])
    for w in (line.split() for line in KAT.strip().splitlines())
]


def philox_scalar(counter, key, rounds=10):
    """An independent scalar Philox4x32 on Python ints (Random123's round and key schedule)."""
    c, (k0, k1) = list(counter), key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ k1, p0 & 0xFFFFFFFF]
    return c


# ------------------------------------------------------------------------------------------------
# the generator
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rounds, counter, key, want", KAT_ROWS)
def test_known_answers(rounds, counter, key, want):
    got = philox4x32(np.array(counter, np.uint32), np.array(key, np.uint32), rounds)
    assert got.dtype == np.uint32 and got.shape == (4,)
    assert [int(x) for x in got] == want
    assert philox_scalar(counter, key, rounds) == want
    if rounds == 10:
        assert [int(x) for x in philox4x32_10(counter, key)] == want


def test_twin_matches_scalar_on_random_words(rng):
    ctr = rng.integers(0, 2**32, (200, 4), dtype=np.uint64)
    key = rng.integers(0, 2**32, (200, 2), dtype=np.uint64)
    ctr[:4] = 0xFFFFFFFF  # high bits set everywhere
    key[:2] = 0xFFFFFFFF
    got = philox4x32_10(ctr, key)
    want = np.array([philox_scalar(c, k) for c, k in zip(ctr.tolist(), key.tolist())], np.uint32)
    np.testing.assert_array_equal(got, want)


def test_twin_broadcasts_counter_and_key(rng):
    ctr = rng.integers(0, 2**32, (3, 1, 4), dtype=np.uint32)
    key = rng.integers(0, 2**32, (5, 2), dtype=np.uint32)
    got = philox4x32_10(ctr, key)
    assert got.shape == (3, 5, 4) and got.dtype == np.uint32
    for a in range(3):
        for b in range(5):
            assert got[a, b].tolist() == philox_scalar(ctr[a, 0].tolist(), key[b].tolist())
    # one key for many counters, any integer dtype holding 32-bit words
    ctr64 = ctr[:, 0].astype(np.int64)
    np.testing.assert_array_equal(philox4x32_10(ctr64, key[0]), got[:, 0])


@pytest.mark.parametrize("counter, key, exc, msg", [
    (np.zeros(3, np.uint32), np.zeros(2, np.uint32), ValueError,
     r"counter: expected shape \[\.\.\., 4\]"),
    (np.zeros(4, np.uint32), np.zeros((2, 3), np.uint32), ValueError,
     r"key: expected shape \[\.\.\., 2\]"),
    (np.zeros(4, np.float32), np.zeros(2, np.uint32), TypeError,
     "counter: expected an integer array"),
    (np.array([0, 0, 0, -1]), np.zeros(2, np.uint32), ValueError, "counter: expected 32-bit words"),
    (np.zeros(4, np.uint32), np.array([0, 2**32]), ValueError, "key: expected 32-bit words"),
])
def test_twin_rejects_bad_words(counter, key, exc, msg):
    with pytest.raises(exc, match=msg):
        philox4x32_10(counter, key)


def test_draws_are_uniform(rng):
    """Chi-square of the top 6 bits of 2**16 draws per output word against 64 equal bins."""
    ctr = np.zeros((2**14, 4), np.uint32)
    ctr[:, 0] = np.arange(2**14)  # consecutive counters: the way the mask uses them
    draws = philox4x32_10(ctr, rng.integers(0, 2**32, 2, dtype=np.uint32))
    for w in range(4):
        counts = np.bincount(draws[:, w] >> 26, minlength=64)
        assert stats.chisquare(counts).pvalue > 1e-4, w


# ------------------------------------------------------------------------------------------------
# dropout parameters
# ------------------------------------------------------------------------------------------------
def test_dropout_params_values():
    lo, hi, thr, scale = dropout_params(0.25, 0x0123456789ABCDEF)
    assert (lo, hi) == (0x89ABCDEF, 0x01234567)
    assert all(isinstance(x, np.uint32) for x in (lo, hi, thr))
    assert thr == 2**30 and scale == pytest.approx(4.0 / 3.0, rel=1e-15)
    assert dropout_params(0.0, 0)[2] == 0 and dropout_params(0, np.uint64(7))[:2] == (7, 0)
    # p so close to 1 that round(p * 2**32) == 2**32: clamped, the keep rate stays 2**-32
    assert dropout_params(1.0 - 2.0**-40, 2**64 - 1)[:3] == (2**32 - 1, 2**32 - 1, 2**32 - 1)
    assert dropout_params(np.float32(0.5), np.int32(3))[2] == 2**31


@pytest.mark.parametrize("p, exc", [
    (-0.1, ValueError), (1.0, ValueError), (1.5, ValueError), (math.nan, ValueError),
    (math.inf, ValueError), ("0.1", TypeError), (True, TypeError), (None, TypeError),
    (np.bool_(False), TypeError), (0.1 + 0j, TypeError),
])
def test_bad_dropout_p_rejected(p, exc):
    with pytest.raises(exc, match="dropout_p: expected a real number in"):
        dropout_params(p, 0)
    with pytest.raises(exc, match="dropout_p"):
        numba_flash.dropout_mask(0, 1, 1, 2, 2, p)


@pytest.mark.parametrize("seed, exc", [
    (-1, ValueError), (2**64, ValueError), (1.0, TypeError), (True, TypeError),
    ("3", TypeError), (None, TypeError), (np.float64(1.0), TypeError), (np.int64(-5), ValueError),
])
def test_bad_seed_rejected(seed, exc):
    with pytest.raises(exc, match=r"seed: expected an integer in \[0, 2\*\*64\)"):
        numba_flash.dropout_mask(seed, 1, 1, 2, 2, 0.5)


@pytest.mark.parametrize("dims, name, exc", [
    ((0, 1, 1, 1), "B", ValueError), ((1, -2, 1, 1), "H", ValueError),
    ((1, 1, 2.0, 1), "Nq", TypeError), ((1, 1, 1, True), "Nk", TypeError),
    ((1, 1, 1, None), "Nk", TypeError), ((2**32 + 1, 1, 1, 1), "B", ValueError),
])
def test_bad_dims_rejected(dims, name, exc):
    with pytest.raises(exc, match=f"{name}: expected a positive int"):
        numba_flash.dropout_mask(1, *dims, 0.5)


# ------------------------------------------------------------------------------------------------
# the mask
# ------------------------------------------------------------------------------------------------
def test_mask_follows_the_documented_counter_layout(rng):
    seed, p = 0xFEDCBA9876543210, 0.4
    mask = numba_flash.dropout_mask(seed, 2, 3, 5, 11, p)
    assert mask.shape == (2, 3, 5, 11) and mask.dtype == bool
    thr = round(p * 2**32)
    for b, h, i, j in np.ndindex(mask.shape):
        draw = philox_scalar([j // 4, i, h, b], [seed & 0xFFFFFFFF, seed >> 32])[j % 4]
        assert mask[b, h, i, j] == (draw >= thr), (b, h, i, j)


def test_mask_independent_of_shape_and_deterministic():
    """An element's draw depends on (b, h, i, j) only: tiles and shapes cannot change the mask."""
    big = numba_flash.dropout_mask(99, 3, 4, 9, 23, 0.3)
    small = numba_flash.dropout_mask(99, 2, 3, 5, 6, 0.3)
    np.testing.assert_array_equal(small, big[:2, :3, :5, :6])
    np.testing.assert_array_equal(numba_flash.dropout_mask(np.uint64(99), 3, 4, 9, 23, 0.3), big)


def test_zero_dropout_keeps_everything():
    assert numba_flash.dropout_mask(12345, 2, 2, 7, 9, 0.0).all()
    assert numba_flash.dropout_mask(2**64 - 1, 1, 1, 3, 5, 0).all()


def test_masks_differ_across_batches_heads_rows_columns_and_seeds():
    seed, p = 2024, 0.5
    m = numba_flash.dropout_mask(seed, 2, 2, 4, 64, p)
    slabs = {"batch": (m[0, 0], m[1, 0]), "head": (m[0, 0], m[0, 1]),
             "row": (m[0, 0, 0], m[0, 0, 1]), "column group": (m[..., :4], m[..., 4:8])}
    for name, (a, c) in slabs.items():
        # each pair of >= 64 independent fair bits agrees everywhere with prob <= 2**-64
        assert (a != c).any(), name
    for other in (seed + 1, seed + 2**32, seed ^ (1 << 63)):  # low word, high word, top bit
        assert (numba_flash.dropout_mask(other, 2, 2, 4, 64, p) != m).mean() > 0.3, other


@pytest.mark.parametrize("axis", [3, 2, 1, 0])
def test_neighbouring_keep_bits_uncorrelated(axis):
    """Pearson correlation of keep bits at distance 1 along each axis (within one Philox call,
    across calls, rows, heads, batches).  For independent bits it is ~N(0, 1/n): bound 5/sqrt(n)
    (a false alarm has probability ~6e-7)."""
    m = numba_flash.dropout_mask(7, 4, 4, 32, 64, 0.5).astype(np.float64)
    a = np.moveaxis(m, axis, -1)
    x, y = a[..., :-1].ravel(), a[..., 1:].ravel()
    n = x.size
    r = np.corrcoef(x, y)[0, 1]
    assert abs(r) < 5.0 / math.sqrt(n), (axis, r, n)
    if axis == 3:  # the four words of one Philox call against each other
        words = m.reshape(-1, 4)
        corr = np.corrcoef(words.T)[np.triu_indices(4, 1)]
        assert np.abs(corr).max() < 5.0 / math.sqrt(words.shape[0]), corr


@pytest.mark.parametrize("p", [0.05, 0.1, 0.25, 0.5, 0.75, 0.9])
@pytest.mark.parametrize("seed", [0, 0xDEADBEEFCAFEF00D])
def test_keep_rate_binomial(p, seed):
    B, H, Nq, Nk = 2, 4, 64, 96
    mask = numba_flash.dropout_mask(seed, B, H, Nq, Nk, p)
    n, kept = mask.size, int(mask.sum())
    q = 1.0 - dropout_params(p, seed)[2] / 2**32  # the exact keep probability
    assert abs(q - (1.0 - p)) <= 2.0**-33
    assert stats.binomtest(kept, n, q).pvalue > 1e-4, (kept, n, q)
