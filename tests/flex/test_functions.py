"""User functions: arity checks and the fingerprint that keys their compilations."""

from __future__ import annotations

import pytest

from numba_flash.flex import check_mod, fingerprint, host_function

OFFSET = 3


def _shifted(b, h, q_idx, kv_idx):
    return q_idx + OFFSET >= kv_idx


def test_fingerprint_follows_globals_closures_and_code():
    global OFFSET
    before = fingerprint(_shifted)
    assert host_function(_shifted)(0, 0, 0, 3)
    OFFSET = 0
    try:
        assert fingerprint(_shifted) != before
        # the recompiled CPU function sees the new global, never the stale compilation
        assert not host_function(_shifted)(0, 0, 0, 3)
    finally:
        OFFSET = 3

    def make(w):
        def window(b, h, q_idx, kv_idx):
            return abs(q_idx - kv_idx) <= w
        return window

    assert fingerprint(make(2)) == fingerprint(make(2))
    assert fingerprint(make(2)) != fingerprint(make(3))
    assert fingerprint(lambda s, b, h, q, k: s * 2) != fingerprint(lambda s, b, h, q, k: s * 3)


@pytest.mark.parametrize("name, fn, n_aux, words", [
    ("score_mod", lambda s, b, h, q: s, 0, "5 arguments"),
    ("score_mod", lambda s, b, h, q, k: s, 1, "6 arguments"),
    ("mask_mod", lambda *a: True, 0, "only positional"),
    ("mask_mod", lambda b, h, q, k, *, x=1: True, 0, "only positional"),
    ("score_mod", "tanh", 0, "plain Python function"),
])
def test_bad_functions(name, fn, n_aux, words):
    with pytest.raises(TypeError) as e:
        check_mod(name, fn, n_aux)
    assert words in str(e.value) and name in str(e.value)


def test_good_functions_pass_through():
    fn = lambda s, b, h, q, k, bias: s + bias[h, q - k]  # noqa: E731
    assert check_mod("score_mod", fn, 1) is fn
    assert check_mod("mask_mod", None, 0) is None


def test_prepare_variant_checks_before_any_launch():
    import numpy as np

    from numba_flash.flex import create_block_mask
    from numba_flash.flex.launch import prepare_variant

    bias = np.zeros((2, 9), np.float32)

    def rel(score, b, h, q_idx, kv_idx, bias):
        return score + bias[h, q_idx - kv_idx + 4]

    def causal(b, h, q_idx, kv_idx, bias):
        return q_idx >= kv_idx

    assert prepare_variant() is None
    uv = prepare_variant(rel, causal, (bias,), shape=(1, 2, 5, 5))
    assert uv.aux[0] is bias and uv.kinds is None and len(uv.key) == 5
    # the key follows the code: the same functions give the same key
    assert prepare_variant(rel, causal, (bias,)).key == uv.key
    with pytest.raises(ValueError, match="score_mod_grad"):
        prepare_variant(rel, None, (bias,), needs_grad=True)
    with pytest.raises(ValueError, match="aux_tensors"):
        prepare_variant(aux_tensors=(bias,))
    with pytest.raises(TypeError, match="return a float"):
        prepare_variant(lambda s, b, h, q, k: q > k)
    with pytest.raises(TypeError, match="return a bool"):
        prepare_variant(mask_mod=lambda b, h, q, k: 1.0 * q)
    bm = create_block_mask(causal, 1, 2, 32, 32, aux_tensors=(bias,), BLOCK_SIZE=16)
    uv = prepare_variant(None, None, (bias,), bm, shape=(3, 2, 32, 32))
    assert uv.mask_mod is not None and uv.block == (16, 16) and uv.kinds.shape == (1, 2, 2, 2)
    with pytest.raises(ValueError, match="block_mask: expected a mask for"):
        prepare_variant(None, None, (bias,), bm, shape=(1, 2, 32, 48))
    with pytest.raises(ValueError, match="mask_mod: expected the function"):
        prepare_variant(None, lambda b, h, q, k, x: True, (bias,), bm)
    with pytest.raises(TypeError, match="block_mask: expected"):
        prepare_variant(None, causal, (bias,), "dense")
