"""Decode's q, new tokens and output in flash-attn's ``[B, Nq, H, d]`` memory (issue 61): the
split-KV kernels read ``q`` (16-byte loads from its element strides, or element loads) and
write ``out=`` through their strides, and the append reads ``k_new`` / ``v_new`` through
theirs, so a chunk of several query tokens (speculative decoding, a chunked prefill) passes as
``transpose(0, 2, 1, 3)`` views with no copy; so does MLA's tensor-core kernel (its ``STRIDED``
build: ``q``'s rows copied to shared memory from its element strides, ``o`` stored through
``out``'s, and the merge of its splits' partials writes ``out`` through them too).  Against the
float64 reference (``kvcache_decode``, ``paged_decode``), outputs NaN-poisoned (conftest), a
sentinel between ``out``'s rows, the inputs unchanged, and the arrays launched checked to be
views of the caller's (no copy).  A fused projection's ``k`` / ``v`` slices (``qkv[:, :, 1]``
of a ``[B, N, 3, H, d]`` buffer: rows with gaps between them) are caches the kernels read where
they lie, as the rows of their memory through the views' own row strides; caches whose strides
are not whole rows, negative strides and caches appended to are still copied.

Tolerances: tests/kernels/test_decode_kernel.py's (the same kernels, only addresses differ).
"""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16

import numba_flash
import numba_flash.standin as sd
from numba_flash import reference as ref
from numba_flash.frontend import plans
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


def fused_kv(rng, b, n, h, d, dtype, lens, shift=0):
    """``(qkv, k, v)``: a fused projection ``[B, N, 3, H, d]`` (flash-attn's qkvpacked memory)
    and its key and value slices as ``[B, H, N, d]`` caches (rows with gaps between them: the
    q slice, NaN, so that a read of it shows); the slots past each length NaN; the buffer
    ``shift`` elements past a 16-byte boundary (1: no row 16-byte aligned)."""
    size = b * n * 3 * h * d
    raw = np.empty(size + 32, dtype)
    start = -raw.ctypes.data % 16 // raw.itemsize + shift
    qkv = raw[start:start + size].reshape(b, n, 3, h, d)
    qkv[...] = randn(rng, qkv.shape, np.float32, scale=0.5).astype(dtype)
    qkv[:, :, 0] = np.nan
    for i, length in enumerate(lens):
        qkv[i, int(length):] = np.nan
    return qkv, qkv[:, :, 1].transpose(0, 2, 1, 3), qkv[:, :, 2].transpose(0, 2, 1, 3)


def _at(seen, x):
    """Some launch got an array that starts at ``x``'s first element and shares its memory
    (``x`` itself, or the rows of its memory: no copy)."""
    ptr = x.__array_interface__["data"][0]
    return any(_shares(a, x) and np.asarray(a._ary).__array_interface__["data"][0] == ptr
               for args in seen for a in args if hasattr(a, "_ary"))


@pytest.mark.parametrize("dtype, d, shift, vec", [
    (np.float16, 32, 0, True),        # 16-byte loads of the gapped rows
    (np.float32, 24, 0, False),       # element loads (d below its padded head dim)
    (np.float16, 32, 1, False),       # rows not 16-byte aligned: element loads, no fault
], ids=["f16-vec", "f32-elements", "f16-unaligned"])
def test_decode_reads_fused_kv_slices_in_place(rng, launched, monkeypatch,  # noqa: F811
                                                dtype, d, shift, vec):
    """A contiguous cache that is a fused projection's k / v slices (MHA, two splits, two query
    tokens, causal): the kernels read the buffer's rows where they lie (16-byte loads only
    where the rows are aligned), the q slice between them never read, nothing copied or
    written."""
    import numba_flash.ops.decode as op

    cfgs = []
    build = op.decode_kernel
    monkeypatch.setattr(op, "decode_kernel", lambda cfg: cfgs.append(cfg) or build(cfg))
    b, h, n = 2, 2, 12
    lens = np.array([7, 12])
    qkv, k, v = fused_kv(rng, b, n, h, d, dtype, lens, shift)
    q = randn(rng, (b, h, 2, d), np.float32, scale=0.5).astype(dtype)
    before = qkv.copy()
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, causal=True, num_splits=2,
                                return_lse=True)
    want_o, want_lse = ref.kvcache_decode(q, k, v, lens, causal=True)[:2]
    assert_close(o, want_o, dtype, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    np.testing.assert_array_equal(qkv, before)
    assert [c.VEC for c in cfgs] == [vec]
    assert _at(launched, k) and _at(launched, v), "a fused slice reached the kernel as a copy"


def test_gapped_caches_still_copied(rng, launched):  # noqa: F811
    """Caches the kernels cannot read as rows of their memory are copied, and right: strides
    that are not whole rows (``[..., :16]`` of 24-element rows), a negative slot stride; and a
    fused projection's slices appended to (``k_new``): copied, the new tokens written back
    into the caller's slices."""
    b, h, d = 2, 2, 16
    lens = np.array([5, 9])
    q = randn(rng, (b, h, d), np.float32)
    wide = randn(rng, (2, b, h, 12, d + 8), np.float32)
    flipped = randn(rng, (2, b, h, 12, d), np.float32)[:, :, :, ::-1]
    for k, v in ((wide[0, ..., :d], wide[1, ..., :d]), (flipped[0], flipped[1])):
        launched.clear()
        o = numba_flash.decode(q, k, v, cache_seqlens=lens, num_splits=2)
        assert_close(o, ref.kvcache_decode(q, k, v, lens)[0], np.float32, name="o")
        assert not any(_shares(a, x) for x in (k, v) for args in launched for a in args
                       if hasattr(a, "_ary")), "a cache the kernels cannot read in place"
    qkv, k, v = fused_kv(rng, b, 12, h, d, np.float32, lens + 2)
    kn, vn = (randn(rng, (b, h, 2, d), np.float32) for _ in range(2))
    want_o, _, want_k, want_v = ref.kvcache_decode(q, k, v, lens, k_new=kn, v_new=vn)
    o = numba_flash.decode(q, k, v, cache_seqlens=lens, k_new=kn, v_new=vn)
    assert_close(o, want_o, np.float32, name="o")
    for got, want in ((k, want_k), (v, want_v)):
        for i, length in enumerate(lens + 2):   # the appended slots, and every live one
            np.testing.assert_array_equal(got[i, :, :length], want[i, :, :length])
    assert np.isnan(qkv[:, :, 0]).all(), "the q slice written"


def test_device_path_reads_fused_kv_slices_in_place(rng):
    """Stand-in device arrays: a fused projection's k / v slices decoded with no copy and no
    device work outside the launches (0 foreign operations); a second buffer of the same
    layout replays the first call's plan, reading its own memory."""
    b, h, n, d = 2, 2, 12, 16
    lens = np.array([7, 12], np.int32)
    q = randn(rng, (b, h, d), np.float32)
    out = sd.empty((b, h, d), np.float32)
    qd, ld = sd.adopt(q), sd.adopt(lens)
    with sd.device(execute=True):
        for step in range(2):   # the first call makes the plan (its constants copied in)
            qkv, k, v = fused_kv(rng, b, n, h, d, np.float32, lens)
            kv = sd.adopt(qkv)
            kc, vc = (kv[:, :, i].transpose(0, 2, 1, 3) for i in (1, 2))
            before = plans.plan_stats()["plans"]
            with sd.count() as c:
                numba_flash.decode(qd, kc, vc, cache_seqlens=ld, num_splits=2, out=out)
            assert_close(out._a, ref.kvcache_decode(q, k, v, lens)[0], np.float32, name="o")
            assert c.foreign == 0, c.log
    assert (c.syncs, c.d2h, c.h2d) == (0, 0, 0), c.log
    assert plans.plan_stats()["plans"] == before
