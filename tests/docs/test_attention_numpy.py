"""docs/attention-numpy.md: every Python block of the page run alone, and its NumPy attention
against the package's float64 reference (shapes, GQA, causal with Nq != Nk, empty rows)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import attention_numpy as an
from numba_flash import reference as ref
from test_cuda_basics import page_blocks, run_alone

PAGE = Path(__file__).resolve().parents[2] / "docs" / "attention-numpy.md"


def test_every_python_block_of_the_page_runs_alone(tmp_path):
    blocks = [code for _, code in page_blocks(PAGE.read_text())]
    assert len(blocks) == 5
    for code, rc, err in run_alone(blocks, tmp_path, preload=False):  # NumPy only
        assert rc == 0, f"this block of {PAGE.name} fails alone:\n{code}\n{err[-1500:]}"


@pytest.mark.parametrize("B, H, Hkv, nq, nk, d, causal", [
    (2, 4, 2, 5, 7, 8, True), (1, 3, 1, 6, 4, 16, True), (1, 2, 2, 3, 9, 4, False),
    (1, 4, 4, 8, 8, 5, True), (3, 2, 1, 1, 6, 3, False), (1, 6, 3, 7, 1, 2, True)])
def test_attention_matches_reference(B, H, Hkv, nq, nk, d, causal):
    rng = np.random.default_rng([B, H, Hkv, nq, nk, d, causal])
    q = rng.standard_normal((B, H, nq, d))
    k, v = (rng.standard_normal((B, Hkv, nk, d)) for _ in range(2))
    args = [x.copy() for x in (q, k, v)]
    o, lse = an.attention(q, k, v, causal=causal)
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    assert all(np.array_equal(a, b) for a, b in zip(args, (q, k, v)))  # inputs untouched
    assert o.shape == (B, H, nq, d) and lse.shape == (B, H, nq)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))  # rows seeing no key
    fin = np.isfinite(lse_ref)
    # float64 against float64: measured 4.4e-16 (o) and 0 (lse) over these cases
    assert np.abs(o - o_ref).max() < 1e-13 and np.abs(lse[fin] - lse_ref[fin]).max() < 1e-13
    np.testing.assert_array_equal(o[~fin], 0.0)
    scale = 0.3
    o2, _ = an.attention(q, k, v, causal=causal, scale=scale)
    assert np.abs(o2 - ref.attention(q, k, v, causal=causal, softmax_scale=scale)[0]).max() < 1e-13


def test_attention_rejects_a_head_count_that_is_not_a_multiple():
    q = np.zeros((1, 3, 2, 4))
    k = np.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match="H = 3 .* Hkv = 2"):
        an.attention(q, k, k)


def test_one_head_is_the_formula():
    q, k, v, o = an.demo_one_head()
    o_ref, _ = ref.attention(q[None, None], k[None, None], v[None, None])
    assert np.abs(o - o_ref[0, 0]).max() < 1e-13


def test_softmax_overflow_and_max_trick():
    s, naive, stable, lse = an.demo_softmax()
    assert np.isnan(naive).all()
    np.testing.assert_allclose(stable, ref.softmax(s), rtol=0, atol=1e-15)
    assert abs(lse - (1000 + np.log(1 + np.exp(-1) + np.exp(-2)))) < 1e-12
    x = np.random.default_rng(0).standard_normal((3, 7))
    np.testing.assert_allclose(an.softmax_naive(x), an.softmax_stable(x), rtol=1e-14)
    np.testing.assert_allclose(an.log_sum_exp(x), np.log(np.exp(x).sum(-1)), rtol=1e-14)


@pytest.mark.parametrize("nq, nk", [(4, 4), (2, 5), (5, 3), (1, 1), (3, 8)])
def test_causal_mask_is_the_reference_rule(nq, nk):
    np.testing.assert_array_equal(an.causal_mask(nq, nk), ref.visible_mask(nq, nk, causal=True))


def test_gqa_index_map():
    assert an.demo_gqa() == [0, 0, 0, 0, 1, 1, 1, 1]
    for H, Hkv in ((4, 4), (4, 1), (6, 3)):
        assert [an.kv_head(h, H, Hkv) for h in range(H)] == list(np.arange(H) // (H // Hkv))
