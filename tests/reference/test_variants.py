"""Reference tier: the visibility rule, window, softcap, ALiBi, varlen and non-finite inputs.

The rule's one home is :mod:`numba_flash.kernels.mainloop.visibility` (device functions with
plain-Python twins); :func:`numba_flash.reference.visible_mask` mirrors it.  Both are checked here
against the rule written out element by element, and the reference's variants against direct
formulas.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.frontend.variants import check_alibi, check_cu_seqlens, check_softcap, check_window
from numba_flash.kernels.mainloop import visibility as vis

WINDOWS = [(-1, -1), (-1, 0), (2, 0), (0, 0), (3, 1), (-1, 2), (1, -1), (5, 5)]


def rule(i, j, nq, nk, left, right):
    """The issue's words: query i sits at key column i + Nk - Nq and sees key j iff
    j >= c - left (left >= 0) and j <= c + right (right >= 0)."""
    c = i + nk - nq
    return 0 <= j < nk and (left < 0 or j >= c - left) and (right < 0 or j <= c + right)


@pytest.mark.parametrize("nq,nk", [(1, 1), (5, 5), (3, 7), (7, 3), (6, 11)])
@pytest.mark.parametrize("window", WINDOWS)
def test_rule_everywhere_agrees(nq, nk, window):
    left, right = window
    want = np.array([[rule(i, j, nq, nk, left, right) for j in range(nk)] for i in range(nq)])
    assert (ref.visible_mask(nq, nk, window_size=window) == want).all()
    off = nk - nq
    for i in range(nq):
        lo, hi = vis.key_bounds_py(i, off, nk, left, right)
        assert [lo <= j < hi for j in range(nk)] == list(want[i])
        assert [vis.is_visible_py(i, j, off, nk, left, right) for j in range(nk)] == list(want[i])
    # tile ranges: every Q tile x K/V tile pair, tiles of 2 and 3
    for bm, bn in [(2, 3), (3, 2), (1, 1)]:
        for q_start in range(0, nq, bm):
            q_end = min(nq, q_start + bm)
            rows = want[q_start:q_end]
            kv_lo, kv_hi = vis.tile_key_range_py(q_start, q_end, off, nk, left, right)
            some = rows.any(axis=0)
            assert [kv_lo <= j < kv_hi for j in range(nk)] == list(some)
            full_lo, full_hi = vis.tile_full_range_py(q_start, q_end, off, nk, left, right)
            every = rows.all(axis=0)
            assert [full_lo <= j < full_hi for j in range(nk)] == list(every)
            for k_start in range(0, nk, bn):
                k_end = min(nk, k_start + bn)
                block = rows[:, k_start:k_end]
                needs = vis.tile_needs_mask_py(k_start, k_end, full_lo, full_hi)
                assert needs == (not block.all())
        for k_start in range(0, nk, bn):
            k_end = min(nk, k_start + bn)
            q_lo, q_hi = vis.tile_query_range_py(k_start, k_end, off, nq, left, right)
            seen = want[:, k_start:k_end].any(axis=1)
            assert [q_lo <= i < q_hi for i in range(nq)] == list(seen)


def test_causal_is_right_zero():
    assert vis.window_bounds(True, (-1, -1)) == (-1, 0)
    assert vis.window_bounds(True, (4, 3)) == (4, 0)
    assert vis.window_bounds(False, (4, 3)) == (4, 3)
    assert (ref.visible_mask(4, 6, causal=True) == ref.causal_visible(4, 6)).all()
    assert (ref.visible_mask(4, 6, causal=True, window_size=(-1, 5))
            == ref.visible_mask(4, 6, window_size=(-1, 0))).all()


def direct_attention(q, k, v, scale, window, softcap, slopes, causal=False):
    """Row by row, key by key: the definition, with nothing vectorised."""
    b, h, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    left, right = vis.window_bounds(causal, window)
    o = np.zeros((b, h, nq, d))
    lse = np.full((b, h, nq), -np.inf)
    for bb, hh, i in itertools.product(range(b), range(h), range(nq)):
        hk = hh // (h // hkv)
        scores, rows = [], []
        for j in range(nk):
            if not rule(i, j, nq, nk, left, right):
                continue
            s = scale * float(np.dot(q[bb, hh, i], k[bb, hk, j]))
            if softcap:
                s = softcap * math.tanh(s / softcap)
            if slopes is not None:
                s -= float(np.broadcast_to(slopes, (b, h))[bb, hh]) * abs(i + nk - nq - j)
            scores.append(s)
            rows.append(v[bb, hk, j])
        if scores:
            m = max(scores)
            w = np.exp(np.array(scores) - m)
            lse[bb, hh, i] = m + math.log(w.sum())
            o[bb, hh, i] = (w[:, None] * np.array(rows)).sum(0) / w.sum()
    return o, lse


@pytest.mark.parametrize("window", [(-1, -1), (2, 0), (1, 3), (0, -1)])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
@pytest.mark.parametrize("alibi", [None, "H", "BH"])
def test_attention_variants_match_direct(rng, window, softcap, alibi):
    b, h, hkv, nq, nk, d = 2, 4, 2, 5, 7, 3
    q = rng.standard_normal((b, h, nq, d)) * 2
    k = rng.standard_normal((b, hkv, nk, d)) * 2
    v = rng.standard_normal((b, hkv, nk, d))
    slopes = {None: None, "H": ref.alibi_slopes(h),
              "BH": rng.uniform(0, 1, (b, h)).astype(np.float32)}[alibi]
    o, lse = ref.attention(q, k, v, window_size=window, softcap=softcap, alibi_slopes=slopes,
                           softmax_scale=0.7)
    o_d, lse_d = direct_attention(q, k, v, 0.7, window, softcap, slopes)
    np.testing.assert_allclose(o, o_d, atol=1e-12)
    np.testing.assert_allclose(lse, lse_d, atol=1e-12)


def test_alibi_slopes_match_the_paper():
    def paper(n):  # ALiBi's reference code (Press et al., 2022)
        def pow2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start**i for i in range(n)]
        if math.log2(n).is_integer():
            return pow2(n)
        c = 2 ** math.floor(math.log2(n))
        return pow2(c) + paper(2 * c)[0::2][: n - c]
    for n in (1, 2, 6, 8, 12, 16, 20):
        np.testing.assert_allclose(ref.alibi_slopes(n), paper(n), rtol=1e-7)


@pytest.mark.parametrize("window,softcap,alibi", [((2, 1), 0.0, False), ((-1, 0), 2.0, True),
                                                  ((3, -1), 1.0, False)])
def test_backward_variants_finite_differences(rng, window, softcap, alibi):
    b, h, hkv, nq, nk, d = 1, 2, 1, 4, 5, 3
    q = rng.standard_normal((b, h, nq, d))
    k = rng.standard_normal((b, hkv, nk, d))
    v = rng.standard_normal((b, hkv, nk, d))
    do = rng.standard_normal((b, h, nq, d))
    slopes = ref.alibi_slopes(h) if alibi else None
    kw = dict(window_size=window, softcap=softcap, alibi_slopes=slopes)
    grads = ref.attention_backward(do, q, k, v, **kw)
    eps = 1e-6
    for x, g in zip((q, k, v), grads):
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            args_p = [xp if y is x else y for y in (q, k, v)]
            args_m = [xm if y is x else y for y in (q, k, v)]
            fp = (ref.attention(*args_p, **kw)[0] * do).sum()
            fm = (ref.attention(*args_m, **kw)[0] * do).sum()
            num[idx] = (fp - fm) / (2 * eps)
        np.testing.assert_allclose(g, num, atol=1e-7)


def test_varlen_is_each_sequence_alone(rng):
    lens_q, lens_k = [3, 0, 5, 1], [4, 2, 5, 6]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    h, hkv, d = 4, 2, 3
    q = rng.standard_normal((cu_q[-1], h, d))
    k = rng.standard_normal((cu_k[-1], hkv, d))
    v = rng.standard_normal((cu_k[-1], hkv, d))
    do = rng.standard_normal(q.shape)
    slopes = rng.uniform(0, 1, (4, h)).astype(np.float32)
    kw = dict(causal=True, window_size=(2, -1), softcap=1.0, alibi_slopes=slopes)
    o, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, **kw)
    dq, dk, dv = ref.attention_backward_varlen(do, q, k, v, cu_q, cu_k, **kw)
    assert o.shape == q.shape and lse.shape == (h, cu_q[-1])
    for bb in range(4):
        sq, sk = slice(cu_q[bb], cu_q[bb + 1]), slice(cu_k[bb], cu_k[bb + 1])
        if lens_q[bb] == 0:
            continue
        def t(x):
            return x.transpose(1, 0, 2)[None]
        kwb = dict(kw, alibi_slopes=slopes[bb])
        ob, lb = ref.attention(t(q[sq]), t(k[sk]), t(v[sk]), **kwb)
        np.testing.assert_allclose(o[sq], ob[0].transpose(1, 0, 2), atol=1e-13)
        np.testing.assert_allclose(lse[:, sq], lb[0], atol=1e-13)
        g = ref.attention_backward(t(do[sq]), t(q[sq]), t(k[sk]), t(v[sk]), **kwb)
        np.testing.assert_allclose(dq[sq], g[0][0].transpose(1, 0, 2), atol=1e-13)
        np.testing.assert_allclose(dk[sk], g[1][0].transpose(1, 0, 2), atol=1e-13)
        np.testing.assert_allclose(dv[sk], g[2][0].transpose(1, 0, 2), atol=1e-13)


def test_non_finite_semantics(rng):
    b, h, nq, nk, d = 1, 1, 4, 6, 3
    q = rng.standard_normal((b, h, nq, d))
    k = rng.standard_normal((b, h, nk, d))
    v = rng.standard_normal((b, h, nk, d))
    # causal, Nk - Nq = 2: row 0 sees keys 0..2, row 3 sees keys 0..5
    q1 = q.copy()
    q1[0, 0, 1, 0] = np.nan
    o, lse = ref.attention(q1, k, v, causal=True)
    assert np.isnan(o[0, 0, 1]).all() and np.isnan(lse[0, 0, 1])
    assert np.isfinite(np.delete(o[0, 0], 1, axis=0)).all()
    for bad in (np.nan, np.inf, -np.inf):
        k1 = k.copy()
        k1[0, 0, 4, 1] = bad  # key 4: seen by rows 2 and 3 only
        o, lse = ref.attention(q, k1, v, causal=True)
        assert np.isnan(o[0, 0, 2:]).all() and np.isnan(lse[0, 0, 2:]).all()
        assert np.isfinite(o[0, 0, :2]).all() and np.isfinite(lse[0, 0, :2]).all()
        v1 = v.copy()
        v1[0, 0, 5, 2] = bad  # key 5: seen by row 3 only, column 2
        o, lse = ref.attention(q, k, v1, causal=True)
        assert not np.isfinite(o[0, 0, 3, 2]) and np.isfinite(lse).all()
        assert np.isfinite(np.delete(o[0, 0].ravel(), 3 * d + 2)).all()
    # a row that sees no key: o = 0, lse = -inf, whatever the data
    o, lse = ref.attention(q[:, :, :3], k[:, :, :1], v[:, :, :1], causal=True)
    assert (o[0, 0, :2] == 0).all() and (lse[0, 0, :2] == -np.inf).all()


def test_variant_argument_checks():
    assert check_window((-1, 3)) == (-1, 3)
    assert check_window(np.array([2, 0])) == (2, 0)
    with pytest.raises(TypeError, match="window_size"):
        check_window(3)
    with pytest.raises(TypeError, match="window_size: expected left"):
        check_window((1.5, 0))
    with pytest.raises(ValueError, match="window_size: expected right >= -1"):
        check_window((0, -2))
    with pytest.raises(ValueError, match="window_size: expected a pair"):
        check_window((1, 2, 3))
    assert check_softcap(0) == 0.0
    for bad, exc in ((-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
                     ("1", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="softcap"):
            check_softcap(bad)
    a = check_alibi(np.ones(3, np.float32), 2, 3)
    assert a.shape == (2, 3) and a.dtype == np.float32 and a.flags.c_contiguous
    with pytest.raises(TypeError, match="alibi_slopes: expected dtype float32"):
        check_alibi(np.ones(3), 2, 3)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(3,\) or \(2, 3\)"):
        check_alibi(np.ones(4, np.float32), 2, 3)
    with pytest.raises(ValueError, match="alibi_slopes: expected finite"):
        check_alibi(np.array([1, np.nan, 1], np.float32), 2, 3)
    cu, lens = check_cu_seqlens("cu_seqlens_q", np.array([0, 2, 2, 5], np.int64), 5, 3,
                                "max_seqlen_q")
    assert cu.dtype == np.int32 and list(lens) == [2, 0, 3]
    for arr, total, mx, msg, exc in [
        (np.array([1, 2, 5]), 5, 3, "expected 0 first", ValueError),
        (np.array([0, 2, 4]), 5, 3, "expected the packed length 5 last", ValueError),
        (np.array([0, 3, 2, 5]), 5, 3, "non-decreasing", ValueError),
        (np.array([0, 2, 5]), 5, 2, "max_seqlen_q: expected at least", ValueError),
        (np.array([0.0, 5.0]), 5, 5, "integer array", TypeError),
        (np.array([[0, 5]]), 5, 5, "1-D array", ValueError),
    ]:
        with pytest.raises(exc, match=msg):
            check_cu_seqlens("cu_seqlens_q", arr, total, mx, "max_seqlen_q")



def test_merge_states_non_finite_parts():
    o = np.array([[[1.0, 2.0]], [[np.nan, np.nan]], [[3.0, 4.0]]])  # 3 parts, 1 row, d = 2
    lse = np.array([[0.5], [-np.inf], [0.5]])
    om, lm = ref.merge_states(o, lse)  # an empty part's garbage o never leaks in
    np.testing.assert_allclose(om, [[2.0, 3.0]])
    np.testing.assert_allclose(lm, [0.5 + math.log(2.0)])
    om, lm = ref.merge_states(o[[0, 2]], np.array([[0.5], [np.nan]]))
    assert np.isnan(om).all() and np.isnan(lm).all()
    om, lm = ref.merge_states(o[[0, 2]], np.array([[0.5], [np.inf]]))
    assert np.isnan(om).all() and (lm == np.inf).all()
    om, lm = ref.merge_states(o[[0, 1]], np.array([[-np.inf], [-np.inf]]))
    assert (om == 0).all() and (lm == -np.inf).all()


def test_backward_non_finite_rule(rng):
    """A non-finite k or q makes the gradients of the rows / keys that see it NaN, and nothing
    else: the rows that do not see the key keep the gradients they have without it."""
    b, h, nq, nk, d = 1, 1, 6, 6, 3
    q = rng.standard_normal((b, h, nq, d))
    k = rng.standard_normal((b, h, nk, d))
    v = rng.standard_normal((b, h, nk, d))
    do = rng.standard_normal((b, h, nq, d))
    kw = dict(causal=True, window_size=(1, -1))  # row i sees keys i-1, i
    k1 = k.copy()
    k1[0, 0, 4, 0] = np.inf  # seen by rows 4 and 5
    dq, dk, dv = ref.attention_backward(do, q, k1, v, **kw)
    clean = ref.attention_backward(do, q, k, v, **kw)
    assert np.isnan(dq[0, 0, 4:]).all()
    np.testing.assert_allclose(dq[0, 0, :4], clean[0][0, 0, :4], atol=1e-14)
    q1 = q.copy()
    q1[0, 0, 1, 2] = np.nan  # row 1 sees keys 0 and 1
    dq, dk, dv = ref.attention_backward(do, q1, k, v, **kw)
    assert np.isnan(dk[0, 0, :2]).all()
    np.testing.assert_allclose(dk[0, 0, 2:], clean[1][0, 0, 2:], atol=1e-14)
