"""Every claim the docs make about the source notes' code, checked on the transcribed code."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from numba_flash import reference as ref
import notes_code as nc
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
    # ... and then the unbounded sum(exp(S[r] - m_new)) adds the previous block's stale scores
    # of the ragged last block to l (not to O): wrong until the sum stops at valid_tokens
    assert np.abs(notes_paged_attention(Q, table, kv, 10, 4, 1, scale, ceil_div, True)
                  - want).max() > 1e-2
    np.testing.assert_allclose(notes_paged_attention(Q, table, kv, 10, 4, 1, scale, ceil_div,
                                                     True, True), want, atol=1e-12)
    # a full last block has no stale column: the bound changes nothing there
    Q, table, kv, want = paged_example(rng, 12, scale)
    np.testing.assert_allclose(notes_paged_attention(Q, table, kv, 12, 4, 1, scale, ceil_div,
                                                     True), want, atol=1e-12)
    # a -1 inside the live range is skipped silently: finite and wrong, no error
    table[1] = -1
    got = notes_paged_attention(Q, table, kv, 12, 4, 1, scale, ceil_div, True, True)
    assert np.isfinite(got).all() and np.abs(got - want).max() > 0.1


def test_notes_triton_kernel_q8():
    from notes_code import run_notes_triton
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((12, 4)) for _ in range(3))
    want, lse = (x[0, 0] for x in ref.attention(q[None, None], k[None, None], v[None, None]))
    with pytest.raises(TypeError, match="keepdim"):
        run_notes_triton(q, k, v)
    with pytest.raises(ValueError, match=r"rank mismatch: \[4, 1\], \[4\]"):
        run_notes_triton(q, k, v, keep="keep_dims")
    o, l_out, m_out = run_notes_triton(q, k, v, keep="keep_dims", stats_1d=True)
    np.testing.assert_allclose(o, want, atol=1e-12)
    np.testing.assert_allclose(m_out + np.log(l_out), lse, atol=1e-12)
    # a ragged last K/V tile: masked keys load as 0, score 0, and get probability
    q, k, v = (rng.standard_normal((10, 4)) for _ in range(3))
    want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
    o = run_notes_triton(q, k, v, keep="keep_dims", stats_1d=True)[0]
    assert np.abs(o - want).max() > 1e-2


def test_triton_stand_in_store_is_bounded():
    from notes_code import TritonStandIn, _Pointer
    tl = TritonStandIn()
    out = np.zeros(4)
    with pytest.raises(IndexError):
        tl.store(_Pointer(out) + np.arange(5), np.ones(5))
    tl.store(_Pointer(out) + np.arange(5), np.ones(5), mask=np.arange(5) < 4)
    np.testing.assert_array_equal(out, 1.0)


def test_notes_batch_wrapper_q9():
    from notes_code import (flash_attention_batch, notes_flash_attention_batch,
                            notes_flash_attention_batch_bh)
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((2, 3, 8, 4)) for _ in range(3))
    with pytest.raises(NameError, match="BH"):
        notes_flash_attention_batch(q, k, v, 4, 4)
    with pytest.raises(ValueError, match="too many values to unpack"):
        notes_flash_attention_batch_bh(q, k, v, 4, 4)
    np.testing.assert_allclose(flash_attention_batch(q, k, v, 4, 4), ref.attention(q, k, v)[0],
                               atol=1e-12)


@pytest.mark.parametrize("n, d, br, bc", [(256, 64, 64, 64), (96, 16, 32, 16), (64, 8, 16, 32)])
def test_loop_orders_count_round_trips_q10(n, d, br, bc):
    from notes_code import kv_outer_forward, notes_flash_attention_v2_forward, q_outer_forward
    rng = np.random.default_rng(n)
    q, k, v = (rng.standard_normal((n, d)) for _ in range(3))
    want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
    o1, h1 = kv_outer_forward(q, k, v, br, bc)
    o2, h2 = q_outer_forward(q, k, v, br, bc)
    np.testing.assert_allclose(o1, want, atol=1e-12)
    np.testing.assert_allclose(o2, want, atol=1e-12)
    tr, tc = n // br, n // bc
    # K/V outer: K, V read once; Q and O read once per K/V block; O, l, m written 1 + Tc times
    assert (h1.reads["K"], h1.reads["V"]) == (n * d, n * d)
    assert h1.reads["Q"] == h1.reads["O"] == tc * n * d
    assert h1.writes["O"] == (1 + tc) * n * d and h1.writes["l"] == h1.writes["m"] == (1 + tc) * n
    # Q outer: Q read once, K/V once per Q block, O and lse written once
    assert h2.reads["Q"] == n * d and h2.reads["K"] == h2.reads["V"] == tr * n * d
    assert h2.writes["O"] == n * d and h2.writes["lse"] == n and h2.reads["O"] == 0
    with np.errstate(invalid="ignore"):
        assert np.isnan(notes_flash_attention_v2_forward(q, k, v, br, bc)).all()


# -- the notes' errors the pages show by runs (questions 2, 3/5/6, 7, 8, 9.1, 12, 13) ----------
def test_q8_tl_dot_rules():
    """tl.dot as Triton checks it: D = BLOCK = 4 fails the size rule in both Triton generations;
    at 16 the float32 P times float16 V fails the dtype rule; P cast to V's dtype is right."""
    from notes_code import StrictDotStandIn, run_notes_triton
    rng = np.random.default_rng(5)
    fixes = dict(keep="keep_dims", stats_1d=True)
    for rule, msg in (("triton<=3.2", "M >= 16, N >= 16 and K >= 16"),
                      ("triton>=3.3", "M >= 1, N >= 1 and K >= 16")):
        q, k, v = (rng.standard_normal((8, 4)).astype(np.float16) for _ in range(3))
        with pytest.raises(AssertionError, match=msg):
            run_notes_triton(q, k, v, 4, lambda pid: StrictDotStandIn(pid, rule), p_cast=True,
                             **fixes)
        q, k, v = (rng.standard_normal((32, 16)).astype(np.float16) for _ in range(3))
        with pytest.raises(AssertionError, match="Got fp32 and fp16"):
            run_notes_triton(q, k, v, 16, lambda pid: StrictDotStandIn(pid, rule), **fixes)
        o, _, _ = run_notes_triton(q, k, v, 16, lambda pid: StrictDotStandIn(pid, rule),
                                   p_cast=True, **fixes)
        want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
        assert np.abs(o - want).max() < 2e-3  # P rounded to float16: measured 1.5e-4


def test_q5_stats_in_float16_overflow():
    from notes_code import notes_flash_forward_q_block
    rng = np.random.default_rng(6)
    q = (0.02 * rng.standard_normal((4, 8))).astype(np.float16)
    k = rng.standard_normal((70000, 8)).astype(np.float16)
    v = rng.standard_normal((70000, 8)).astype(np.float16)
    with np.errstate(over="ignore"):
        o, li = notes_flash_forward_q_block(q, k, v, 64, 1 / math.sqrt(8))
    assert np.isinf(li).all() and (o == 0).all()
    o32, li32 = notes_flash_forward_q_block(q, k, v, 64, 1 / math.sqrt(8), np.float32)
    want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
    assert np.isfinite(li32).all() and np.abs(o32 - want).max() < 1e-3 * np.abs(want).max()
    # |v| ~ 100: the float16 accumulator overflows at ~700 keys of similar score
    k, v = k[:1024], (100 + rng.standard_normal((1024, 8))).astype(np.float16)
    with np.errstate(over="ignore", invalid="ignore"):
        o, _ = notes_flash_forward_q_block(q, k, v, 64, 1 / math.sqrt(8))
    assert not np.isfinite(o).any()


def test_q6_returns_l_not_lse():
    from notes_code import notes_save_stats
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((8, 4)) for _ in range(3))
    o, L, m = notes_save_stats(q, k, v, 4, 4)
    o_ref, lse = ref.attention(q[None, None], k[None, None], v[None, None])
    np.testing.assert_allclose(o, o_ref[0, 0], atol=1e-14)
    np.testing.assert_allclose((m + np.log(L))[:, 0], lse[0, 0], atol=1e-14)
    assert np.abs(L[:, 0] - lse[0, 0]).min() > 0.1


def test_q7_fixed_tiled_backward_exact_at_every_tiling():
    from backward_demo import fixed_case, notes_case
    for bc in (12, 6, 4, 2):
        assert max(fixed_case(bc)) < 1e-13
    assert max(notes_case(4)) > 0.1  # the notes' version on the same inputs


def test_q13_stale_max_exact_unrescaled_wrong_at_any_gap():
    from notes_code import stale_max_merge, unrescaled_merge
    rng = np.random.default_rng(8)
    s, v = rng.standard_normal(8), rng.standard_normal((8, 2))
    for gap in (0.1, 1.0, 10.0):
        x = s.copy()
        x[:4] += 10 - x[:4].max()
        x[4:] += 10 + gap - x[4:].max()
        p = np.exp(x - x.max())
        exact = (p / p.sum()) @ v
        assert np.abs(stale_max_merge(partial_states(x, v, [4]), 10.0) - exact).max() < 1e-13
        assert np.abs(notes_correct_merge(partial_states(x, v, [4])) - exact).max() < 1e-13
        assert np.abs(unrescaled_merge(partial_states(x, v, [4])) - exact).max() > 1e-3
    x = s.copy()
    x[4:] += 1000
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isnan(stale_max_merge(partial_states(x, v, [4]), float(s[:4].max()))).all()


def test_q2_decode_moves_kv_once_either_way():
    from io_count import standard_attention_bytes, tiled_forward_bytes

    def total(d):
        return d["read"] + d["written"]

    for n in (4096, 131072):
        std = total(standard_attention_bytes(1, n, 64, 2))
        fl = total(tiled_forward_bytes(1, 1, 1, n, 64, 128, 64, 2, 4))
        assert 1.0 < std / fl < 1.05 and fl >= 2 * n * 64 * 2
    assert total(standard_attention_bytes(4096, 4096, 64, 2)) > 3.9 * total(
        tiled_forward_bytes(1, 1, 4096, 4096, 64, 128, 64, 2, 4))


def test_q9_1_q_strides_locate_k_only_for_equal_shapes(capsys):
    from notes_code import demo_strides
    demo_strides()
    lines = capsys.readouterr().out.splitlines()[2:]
    assert "notes: max |O - ref| < 1e-14" in lines[0]
    assert "notes: max |O - ref| < 1e-14" not in lines[1] and "IndexError" in lines[2]
    assert "notes: max |O - ref| < 1e-14" not in lines[3]
    assert all("fixed: max |O - ref| < 1e-14" in line for line in lines)


def test_q12_c_initialiser_nan_rows_for_very_negative_scores():
    from notes_code import ceil_div, notes_paged_attention, paged_example
    rng = np.random.default_rng(9)
    Q, table, kv, want = paged_example(rng, 12, 0.5)
    for c_init in (False, True):  # ordinary scores: the zero start is harmless
        got = notes_paged_attention(Q, table, kv, 12, 4, 1, 0.5, ceil_div, True, True,
                                    c_init=c_init)
        assert np.abs(got - want).max() < 1e-13
    kv = kv.copy()
    kv[0] = np.abs(kv[0]) + 1.0
    Q = -np.abs(Q) - 500.0
    with np.errstate(invalid="ignore"):
        got = notes_paged_attention(Q, table, kv, 12, 4, 1, 0.5, ceil_div, True, True,
                                    c_init=True)
        fine = notes_paged_attention(Q, table, kv, 12, 4, 1, 0.5, ceil_div, True, True)
    assert np.isfinite(got[0]).all() and np.isnan(got[1:]).all() and np.isfinite(fine).all()


def test_q31_comment_a_reference_is_not_one():
    """Question 3.1's ``Oi = O[...]  # a reference, modified directly``: the first update
    rebinds ``Oi`` to a new array, so only the final write-back makes O right."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((10, 3)) for _ in range(3))
    o, shares = nc.notes_q31_trusting_the_comment(q, k, v, 4, 3)
    assert shares[0] and not any(shares[1:4]) and (o == 0).all()
    want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
    np.testing.assert_allclose(nc.notes_flash_attention_forward(q, k, v, 4, 3), want, atol=1e-13)


def test_q6_as_printed_computes_only_the_last_q_tile():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((10, 3)) for _ in range(3))
    o, L, m = nc.notes_save_stats_as_printed(q, k, v, 4, 3)
    want = ref.attention(q[None, None], k[None, None], v[None, None])[0][0, 0]
    assert (o[:8] == 0).all() and (L[:8] == 0).all() and np.isneginf(m[:8]).all()
    np.testing.assert_allclose(o[8:], want[8:], atol=1e-13)
