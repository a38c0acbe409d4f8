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
