"""Decode's q, new tokens and output in flash-attn's ``[B, Nq, H, d]`` memory (issue 61): the
split-KV kernels read ``q`` (16-byte loads from its element strides, or element loads) and
write ``out=`` through their strides, and the append reads ``k_new`` / ``v_new`` through
theirs, so a chunk of several query tokens (speculative decoding, a chunked prefill) passes as
``transpose(0, 2, 1, 3)`` views with no copy; MLA's tensor-core kernel copies ``q`` and writes
a new ``o`` that the call copies into a strided ``out=``.  Against the float64 reference
(``kvcache_decode``), outputs NaN-poisoned (conftest), a sentinel between ``out``'s rows, the
inputs unchanged, and the arrays launched checked to be views of the caller's (no copy).

Tolerances: tests/kernels/test_decode_kernel.py's (the same kernels, only addresses differ).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.frontend.cache_args import TOKENS_FIRST
from helpers import assert_close, randn
from test_cache_layouts import _shares, in_memory, launched  # noqa: F401 (a fixture)
from test_decode_kernel import paged_cache

SENTINEL = 7.0


def _bnhd(rng, b, n, h, d, dtype):
    """A ``[B, H, N, d]`` view of ``[B, N, H, d]`` memory."""
    return randn(rng, (b, n, h, d), dtype, scale=0.5).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype,d", [(np.float16, 64), (np.float32, 48)],
                         ids=["f16-vec", "f32-elements"])
def test_decode_chunk_in_flash_attn_layout(rng, launched, dtype, d):  # noqa: F811
    """A chunk of 3 query tokens and 3 new tokens a sequence over a tokens-first paged cache,
    q, k_new, v_new and out= all [B, N, H, d] views (float16: q by 16-byte loads from its
    strides; float32 at d = 48: element loads)."""
    b, h, hkv, nq, nnew = 2, 4, 2, 3, 3
    lens = np.array([9, 20])
    k, v, table = paged_cache(rng, b, hkv, d, lens + nnew, 8, dtype)
    k, v = in_memory(k, TOKENS_FIRST), in_memory(v, TOKENS_FIRST)
    q = _bnhd(rng, b, nq, h, d, dtype)
    k_new, v_new = (_bnhd(rng, b, nnew, hkv, d, dtype) for _ in range(2))
    mem = np.full((b, nq, h + 1, d), SENTINEL, dtype)
    out = mem[:, :, 1:].transpose(0, 2, 1, 3)
    kw = dict(block_table=table, causal=True)
    want_o, want_lse, _, _ = ref.kvcache_decode(q, k, v, lens, k_new=k_new, v_new=v_new, **kw)
    before = [x.copy() for x in (q, k_new, v_new)]
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, k_new=k_new, v_new=v_new,
                                return_lse=True, out=out, num_splits=2, **kw)
    assert o is out
    assert_close(o, want_o, dtype, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    assert (mem[:, :, 0] == SENTINEL).all(), "out: a gap element written"
    for x, x0 in zip((q, k_new, v_new), before):
        np.testing.assert_array_equal(x, x0)
    for x in (q, k_new, v_new, mem):   # each reached a launch as a view of the caller's memory
        assert any(_shares(a, x) for args in launched for a in args
                   if hasattr(a, "_ary") or isinstance(a, np.ndarray)), "copied"


def test_mla_tensor_cores_copy_into_a_strided_out(rng):
    """MLA's tensor-core decode takes a C-contiguous q (a view is copied) and writes a new o,
    copied into the caller's strided out=: the values of the reference, the gaps kept."""
    b, h, hkv, nq, d, d_v = 1, 4, 1, 2, 128, 64
    lens = np.array([21])
    k, _, table = paged_cache(rng, b, hkv, d, lens, 16, np.float16)
    q = _bnhd(rng, b, nq, h, d, np.float16)
    mem = np.full((b, nq, h + 1, d_v), SENTINEL, np.float16)
    out = mem[:, :, 1:].transpose(0, 2, 1, 3)
    o = numba_flash.decode(q, k, None, head_dim_v=d_v, cache_seqlens=lens, block_table=table,
                           causal=True, out=out, kernel="mma")
    assert o is out
    want_o, _ = ref.paged_decode(q, k, k[..., :d_v], lens, table, causal=True)
    assert_close(o, want_o, np.float16, name="o")
    assert (mem[:, :, 0] == SENTINEL).all(), "out: a gap element written"
