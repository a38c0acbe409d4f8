"""Kernel tier: the contract the three teaching forwards share (``naive_forward``,
``row_forward``, ``tiled_forward_teach``: docs/naive-forward.md, docs/row-forward.md,
docs/tiled-forward.md), each op against the float64 reference on the same cases.  Outputs are
NaN-poisoned before launch (conftest).  Each kernel's own file compares it with the reference
over dtypes and shapes."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import reference as ref
from numba_flash.teach.ops.naive_forward import naive_forward
from numba_flash.teach.ops.row_forward import row_forward
from numba_flash.teach.ops.tiled_forward import tiled_forward_teach
from helpers import assert_close, randn

OPS = {"naive_forward": naive_forward, "row_forward": row_forward,
       "tiled_forward_teach": tiled_forward_teach}


@pytest.fixture(params=sorted(OPS))
def op(request):
    return OPS[request.param]


def test_rows_without_keys_give_zero_and_minus_inf(rng, op):
    q = randn(rng, (1, 1, 6, 4), np.float32)
    k = randn(rng, (1, 1, 2, 4), np.float32)
    o, lse = op(q, k, k, causal=True)
    # rows 0..3 see no key (j <= i + 2 - 6 < 0), rows 4, 5 see 1 and 2 keys
    assert np.all(o[0, 0, :4] == 0) and np.all(lse[0, 0, :4] == -np.inf)
    assert np.all(np.isfinite(lse[0, 0, 4:]))


def test_large_logits_and_custom_scale(rng, op):
    """Scores ~1e3 whose max moves from key to key (and from tile to tile): alpha = exp(m_old -
    m_new) underflows to 0 for what came before, which must then drop out, not turn into inf or
    NaN."""
    q = randn(rng, (1, 2, 4, 8), np.float32, scale=30.0)
    k = randn(rng, (1, 2, 19, 8), np.float32, scale=30.0)
    v = randn(rng, (1, 2, 19, 8), np.float32)
    o, lse = op(q, k, v, softmax_scale=0.9)
    o_ref, lse_ref = ref.attention(q, k, v, softmax_scale=0.9)
    # float32 rounding of scores ~1e3 (~1e-4) moves the near one-hot P: measured (naive kernel,
    # 50 cases) 3.7e-5 on o and 2.0e-7 relative on lse; bounds 4x those
    assert_close(o, o_ref, np.float32, scale=1.5e-4 / 2e-5, name="o")
    assert np.abs(lse - lse_ref).max() <= 8e-7 * np.abs(lse_ref).max()


def test_inputs_not_modified_and_non_contiguous(rng, op):
    base = randn(rng, (1, 2, 8, 6), np.float32)
    q = base[:, :, ::2]
    k = randn(rng, (1, 2, 5, 6), np.float32)
    before = (base.copy(), k.copy())
    o, _ = op(q, k, k)
    assert_close(o, ref.attention(q, k, k)[0], np.float32)
    np.testing.assert_array_equal(base, before[0])
    np.testing.assert_array_equal(k, before[1])


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(q=np.zeros((1, 2, 3), np.float32)), ValueError, "q: expected a 4-D array"),
    (dict(k=np.zeros((1, 3, 4, 4), np.float32), v=np.zeros((1, 3, 4, 4), np.float32)),
     ValueError, "k: expected a number of kv heads"),
    (dict(v=np.zeros((1, 2, 5, 4), np.float32)), ValueError, "v: expected the shape of k"),
    (dict(v=np.zeros((1, 2, 4, 4), np.float64)), TypeError, "v: expected dtype float32"),
    (dict(causal=1), TypeError, "causal: expected a bool"),
    (dict(softmax_scale=0.0), ValueError, "softmax_scale: expected a finite number > 0"),
    (dict(softmax_scale=-1.0), ValueError, "softmax_scale: expected a finite number > 0"),
])
def test_rejects_bad_arguments(op, kwargs, exc, msg):
    args = dict(q=np.zeros((1, 2, 4, 4), np.float32), k=np.zeros((1, 2, 4, 4), np.float32),
                v=np.zeros((1, 2, 4, 4), np.float32))
    args.update(kwargs)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=msg):
        op(q, k, v, **args)
