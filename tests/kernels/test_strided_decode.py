"""Decode's q, new tokens and output in flash-attn's ``[B, Nq, H, d]`` memory (issue 61): the
split-KV kernels read ``q`` (16-byte loads from its element strides, or element loads) and
write ``out=`` through their strides, and the append reads ``k_new`` / ``v_new`` through
theirs, so a chunk of several query tokens (speculative decoding, a chunked prefill) passes as
``transpose(0, 2, 1, 3)`` views with no copy; so does MLA's tensor-core kernel (its ``STRIDED``
build: ``q``'s rows copied to shared memory from its element strides, ``o`` stored through
``out``'s, and the merge of its splits' partials writes ``out`` through them too).  Against the
float64 reference (``kvcache_decode``, ``paged_decode``), outputs NaN-poisoned (conftest), a
sentinel between ``out``'s rows, the inputs unchanged, and the arrays launched checked to be
views of the caller's (no copy).

Tolerances: tests/kernels/test_decode_kernel.py's (the same kernels, only addresses differ).
"""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16

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


@pytest.mark.parametrize("layout, dtype, num_splits", [
    ("bnhd", np.float16, 2),          # flash-attn's [B, Nq, H, d] q and out=; partials merged
    ("head slice", bfloat16, 1)])     # q and out= head slices at an offset; one split
def test_mla_tensor_cores_read_q_and_write_out_in_place(rng, launched, layout,  # noqa: F811
                                                        dtype, num_splits):
    """MLA's tensor-core decode (576 / 512, two causal query tokens, two sequences) reads a
    strided q and writes a strided out= where they lie: the values of the float64 reference, the
    sentinels between out's rows untouched, q unchanged, and both reaching the launches as views
    of the caller's memory (the kernel's q; out in the launch that writes it: the kernel with one
    split, the merge with two).  An out= whose elements overlap is refused."""
    from helpers import assert_scaled_close
    b, h, nq, d, d_v = 2, 4, 2, 576, 512
    lens = np.array([21, 9])
    k, _, table = paged_cache(rng, b, 1, d, lens, 16, np.float16)
    k = k.astype(dtype)
    if layout == "bnhd":
        q = _bnhd(rng, b, nq, h, d, np.float16).astype(dtype)
        mem = np.full((b, nq, h + 1, d_v), SENTINEL, dtype)
        out = mem[:, :, 1:].transpose(0, 2, 1, 3)
    else:   # heads 1 .. h of h + 2 (an offset), rows padded by 8 sentinels
        q = randn(rng, (b, h + 2, nq, d), np.float16, scale=0.5).astype(dtype)[:, 1:h + 1]
        mem = np.full((b, h + 1, nq, d_v + 8), SENTINEL, dtype)
        out = mem[:, 1:, :, :d_v]
    assert not q.flags.c_contiguous and not out.flags.c_contiguous
    q0 = q.copy()
    kw = dict(head_dim_v=d_v, cache_seqlens=lens, block_table=table, causal=True, kernel="mma")
    o, lse = numba_flash.decode(q, k, None, out=out, return_lse=True, num_splits=num_splits,
                                **kw)
    assert o is out
    want_o, want_lse = ref.paged_decode(q, k, k[..., :d_v], lens, table, causal=True)
    if dtype == np.float16:
        assert_close(o, want_o, np.float16, name="o")
    else:   # test_mla_decode.py's bfloat16 bound
        assert_scaled_close(np.asarray(o, np.float64), want_o, 1.6e-2, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    gaps = mem[:, :, 0] if layout == "bnhd" else np.concatenate(
        [mem[:, 0].reshape(-1), mem[:, 1:, :, d_v:].reshape(-1)])
    assert (np.asarray(gaps, np.float64) == SENTINEL).all(), "out: a gap element written"
    np.testing.assert_array_equal(np.asarray(q, np.float64), np.asarray(q0, np.float64))
    assert len(launched) == (2 if num_splits > 1 else 1)
    assert any(_shares(a, q) for a in launched[0] if hasattr(a, "_ary")), "q copied"
    assert any(_shares(a, mem) for a in launched[-1] if hasattr(a, "_ary")), "out= copied into"
    overlapping = np.lib.stride_tricks.as_strided(mem, out.shape, (0,) + out.strides[1:])
    with pytest.raises(ValueError, match="^out: expected a view whose last dim is contiguous "
                                         "and whose elements do not overlap"):
        numba_flash.decode(q, k, None, out=overlapping, **kw)
