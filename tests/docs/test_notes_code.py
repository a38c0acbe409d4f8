"""Every claim the docs make about the source notes' code, checked on the transcribed code."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numba_flash import reference as ref
from notes_code import (notes_correct_merge, notes_online_softmax, notes_online_softmax_fixed_l,
                        notes_wrong_merge, notes_wrong_merge_sliced, partial_states, to_lse_form)


def test_notes_online_softmax_wrong_on_increasing_input():
    x = [1.0, 2.0]
    got = notes_online_softmax(x)
    np.testing.assert_allclose(got, [1 / (2 + math.exp(-1))] * 2)  # both entries 0.4223
    assert abs(sum(got) - 1) > 0.1
    # with l fixed (multiply), the stale exponents remain: out = [1, 1] / l
    np.testing.assert_allclose(notes_online_softmax_fixed_l(x), [1 / (1 + math.exp(-1))] * 2)


@given(st.lists(st.floats(-50, 50), min_size=1, max_size=12))
@settings(max_examples=200, deadline=None)
def test_notes_code_right_exactly_when_first_element_is_the_max(x):
    """Both bugs vanish when the running max never changes after the first element: why the code
    passes a casual test on, e.g., a descending input."""
    want = ref.softmax(x)
    err = np.abs(np.asarray(notes_online_softmax(x)) - want).max()
    if max(x) == x[0]:
        assert err < 1e-12
    elif max(x) - x[0] > 1e-3:
        assert err > 1e-9


def test_fixing_l_alone_is_not_enough():
    x = [0.0, 1.0, 5.0]
    assert np.abs(np.asarray(notes_online_softmax_fixed_l(x)) - ref.softmax(x)).max() > 0.1
    # ... but its l is now right: the normaliser of the final max
    assert math.isclose(1 / notes_online_softmax_fixed_l(x)[-1], ref.online_softmax_stats(x)[1])


def test_notes_wrong_merge_iterates_dict_keys():
    rng = np.random.default_rng(0)
    blocks = partial_states(rng.standard_normal(8), rng.standard_normal((8, 2)), [3, 6])
    with pytest.raises(TypeError, match="string indices"):
        notes_wrong_merge(blocks)


def test_sliced_merge_right_when_maxima_close_and_writes_into_input():
    rng = np.random.default_rng(1)
    s, v = rng.standard_normal(8), rng.standard_normal((8, 2))
    p = np.exp(s - s.max())
    want = (p / p.sum()) @ v
    blocks = partial_states(s, v, [3, 6])
    o0 = blocks[0]["o"].copy()
    np.testing.assert_allclose(notes_wrong_merge_sliced(blocks), want, rtol=1e-12)
    assert not np.allclose(blocks[0]["o"], o0)  # `o += ...` aliased the first block's array
    np.testing.assert_allclose(notes_correct_merge(partial_states(s, v, [3, 6])), want, rtol=1e-12)


@pytest.mark.parametrize("dtype, gap, ok_gap", [(np.float64, 800.0, 700.0),
                                                (np.float32, 100.0, 80.0)])
def test_sliced_merge_overflows_when_maxima_differ(dtype, gap, ok_gap):
    rng = np.random.default_rng(2)
    s, v = rng.standard_normal(8), rng.standard_normal((8, 2))
    for g, fails in ((gap, True), (ok_gap, False)):
        t = s.copy()
        t[3:] += g
        p = np.exp(t - t.max())
        want = (p / p.sum()) @ v
        with np.errstate(over="ignore", invalid="ignore"):
            got = notes_wrong_merge_sliced(partial_states(t, v, [3, 6], dtype))
        assert np.isnan(got).any() == fails
        o, lse = ref.merge_states(*to_lse_form(partial_states(t, v, [3, 6], dtype)))
        np.testing.assert_allclose(o, want, rtol=1e-5, atol=1e-6)  # the lse merge never overflows
        np.testing.assert_allclose(
            notes_correct_merge(partial_states(t, v, [3, 6], dtype)), want, rtol=1e-5, atol=1e-6)


def test_notes_paged_kernel_bugs():
    from notes_code import (c_ceil_of_int_division, ceil_div, notes_paged_attention,
                            paged_example)
    rng = np.random.default_rng(0)
    scale = 0.5
    # as written (m_s never updated), only the last block read counts: factor = exp(-inf) = 0
    Q, table, kv, want = paged_example(rng, 12, scale)
    got = notes_paged_attention(Q, table, kv, 12, 4, 1, scale)
    last = ref.attention(Q[None, None], kv[0, table[2], 1][None, None],
                         kv[1, table[2], 1][None, None], softmax_scale=scale)[0][0, 0]
    np.testing.assert_allclose(got, last, atol=1e-12)
    assert np.abs(got - want).max() > 0.1
    np.testing.assert_allclose(notes_paged_attention(Q, table, kv, 12, 4, 1, scale,
                                                     store_max=True), want, atol=1e-12)
    # C's ceil(int / int) drops the ragged last block; ceil_div keeps it
    assert c_ceil_of_int_division(10, 4) == 2 and ceil_div(10, 4) == 3
    Q, table, kv, want = paged_example(rng, 10, scale)
    assert np.abs(notes_paged_attention(Q, table, kv, 10, 4, 1, scale, store_max=True)
                  - want).max() > 0.1
    np.testing.assert_allclose(notes_paged_attention(Q, table, kv, 10, 4, 1, scale, ceil_div,
                                                     True), want, atol=1e-12)
    # a -1 inside the live range is skipped silently: finite and wrong, no error
    Q, table, kv, want = paged_example(rng, 12, scale)
    table[1] = -1
    got = notes_paged_attention(Q, table, kv, 12, 4, 1, scale, ceil_div, True)
    assert np.isfinite(got).all() and np.abs(got - want).max() > 0.1
