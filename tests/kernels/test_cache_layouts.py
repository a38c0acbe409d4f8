"""KV caches in their own memory order (issue 61, the cache part): ``numba_flash.decode`` and
``numba_flash.append_kv`` take a cache in the documented axis order ``[n, Hkv, N, d]`` and read
its memory order from its strides: heads-first (C-contiguous) or tokens-first (flash-attn's and
vLLM's ``[n, N, Hkv, d]`` memory, passed as its ``transpose(0, 2, 1, 3)`` view), paged or
contiguous, or any other order of the three outer axes.  The kernels read and write such a
cache where it lies (the rows of its memory through launch-time strides), with no copy.

Every case runs against the float64 reference (``paged_decode``, ``kvcache_decode``,
``append_kv``) with NaN-poisoned outputs (conftest) and NaN in every cache slot the call must
not read; the caches are written only in the appended slots (bitwise against the reference's
append), every other input is left as it came.  Zero copies are checked two ways: the arrays
the kernels are launched with are views of the caller's memory (:func:`_launched_caches`), and
on the stand-in device a steady call does no device work outside its launches.
"""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16, float8_e4m3fn

import numba_flash
import numba_flash.standin as sd
from numba_flash import reference as ref
from numba_flash.frontend import ArrayCall, plans
from numba_flash.frontend.cache_args import (
    HEADS_FIRST, TOKENS_FIRST, cache_memory, memory_order, row_strides,
)
from helpers import assert_close, assert_scaled_close, randn
from test_decode_kernel import LSE_DTYPE, contiguous_cache, paged_cache

#: the memory orders of the tests: heads-first, tokens-first, and heads outermost
#: (``[Hkv, n, N, d]`` memory, as some engines keep one buffer per kv head)
ORDERS = {"heads-first": HEADS_FIRST, "tokens-first": TOKENS_FIRST, "heads-outer": (1, 0, 2)}


def in_memory(x, order):
    """A copy of the ``[n, Hkv, N, d]`` array ``x`` whose memory is in ``order`` (outer axes,
    outermost first), returned in the documented axis order: what a caller passes."""
    perm = tuple(order) + (3,)
    back = tuple(perm.index(a) for a in range(4))
    mem = np.ascontiguousarray(x.transpose(perm))
    out = mem.transpose(back)
    assert memory_order(out.shape, out.strides, out.itemsize) in (order, HEADS_FIRST)
    return out


@pytest.fixture
def launched(monkeypatch):
    """The cache arrays each launch got (the kernels' first cache arguments), to check that
    they are views of the caller's memory (no copy)."""
    seen = []
    real = ArrayCall.launch

    def launch(self, kernel, grid, block, *args, **kw):
        seen.append(args)
        return real(self, kernel, grid, block, *args, **kw)

    monkeypatch.setattr(ArrayCall, "launch", launch)
    return seen


def _shares(dev, host):
    ary = getattr(dev, "_ary", dev)
    return np.shares_memory(np.asarray(ary), host.view(np.uint8) if host.dtype.itemsize == 1
                            else host)


def _launched_caches(launched, *caches):
    """Every cache array given shares memory with some array a launch got (zero copy)."""
    for cache in caches:
        assert any(_shares(a, cache) for args in launched for a in args
                   if hasattr(a, "_ary") or isinstance(a, np.ndarray)), \
            "a cache reached the kernels as a copy"


# -- the host side -------------------------------------------------------------------------------
def test_memory_orders_and_row_strides():
    """Strides say the order: heads-first, tokens-first, heads outermost; a size-1 axis takes
    any stride (heads-first first); rows with gaps or a strided last dim are no order (a
    copy)."""
    x = np.zeros((3, 2, 5, 8), np.float16)            # [n, Hkv, N, d]
    for name, order in ORDERS.items():
        y = in_memory(x, order)
        mem = cache_memory(y, y)
        assert mem.order == order, name
        assert mem.k.flags.c_contiguous and np.shares_memory(mem.k, y)
    assert row_strides((3, 2, 5), HEADS_FIRST) == (10, 5, 1)
    assert row_strides((3, 2, 5), TOKENS_FIRST) == (10, 1, 2)
    assert row_strides((3, 2, 5), (1, 0, 2)) == (5, 15, 1)
    one = np.zeros((3, 5, 1, 8)).transpose(0, 2, 1, 3)   # Hkv = 1: both orders
    assert cache_memory(one).order == HEADS_FIRST
    gaps = np.zeros((3, 5, 2, 16))[..., :8].transpose(0, 2, 1, 3)
    assert memory_order(gaps.shape, gaps.strides, gaps.itemsize) is None
    assert cache_memory(gaps).order == HEADS_FIRST and not cache_memory(gaps).k.flags.c_contiguous
    # a value cache in another order than the key cache's: read in the key cache's order
    mem = cache_memory(in_memory(x, TOKENS_FIRST), x)
    assert mem.order == TOKENS_FIRST and not mem.v.flags.c_contiguous


# -- decode --------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", list(ORDERS), ids=list(ORDERS))
@pytest.mark.parametrize("dtype, d, block_size, num_splits", [
    (np.float32, 8, 3, 2),        # element loads, a block size U does not divide
    (np.float32, 8, 8, None),
    (np.float16, 32, 8, 3),       # 16-byte loads (VEC): key u is u slot strides further
    (np.float16, 32, 3, 2),       # VEC, each key through its own page (SPLIT_PAGES)
    (bfloat16, 32, 4, 1),         # bfloat16 word pairs, VEC
    (np.float64, 8, 1, 2),
])
def test_paged_gqa_shuffled_pages(rng, launched, order, dtype, d, block_size, num_splits):
    """A paged cache with shuffled pages, NaN stale slots and spare pages, GQA 4:2, causal
    with two query tokens: as the heads-first decode of the same values (the reference)."""
    b, h, hkv = 2, 4, 2
    lens = np.array([int(rng.integers(2, 30)), 33])
    k, v, table = paged_cache(rng, b, hkv, d, lens, block_size, np.float32)
    k, v = in_memory(k.astype(dtype), ORDERS[order]), in_memory(v.astype(dtype), ORDERS[order])
    q = randn(rng, (b, h, 2, d), np.float32, scale=0.5).astype(dtype)
    kk, vv = k.copy(), v.copy()
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, causal=True,
                                num_splits=num_splits, return_lse=True)
    want_o, want_lse = ref.paged_decode(q, k, v, lens, table, causal=True)
    tol = np.float16 if dtype == bfloat16 else dtype
    assert_close(o.astype(np.float64), want_o, tol, scale=4.0 if dtype == bfloat16 else 1.0,
                 name="o")
    assert_close(lse, want_lse, LSE_DTYPE[np.float32 if dtype == bfloat16 else dtype],
                 name="lse")
    np.testing.assert_array_equal(k.view(np.uint8), kk.view(np.uint8))   # read, not written
    np.testing.assert_array_equal(v.view(np.uint8), vv.view(np.uint8))
    _launched_caches(launched, k, v)


@pytest.mark.parametrize("order", list(ORDERS), ids=list(ORDERS))
def test_the_build_and_its_16_byte_loads(rng, monkeypatch, order):
    """The build a cache's order takes: ``SLOT_STRIDE`` only where a slot is not one row
    (tokens-first), 16-byte loads (``VEC``) in every order."""
    import numba_flash.ops.decode as op
    from numba_flash.kernels.decode import split_kv

    cfgs, loads = [], []
    build, load16 = op.decode_kernel, split_kv.load16
    monkeypatch.setattr(op, "decode_kernel", lambda cfg: cfgs.append(cfg) or build(cfg))
    monkeypatch.setattr(split_kv, "load16", lambda src, e: loads.append(e) or load16(src, e))
    k, v, table = paged_cache(rng, 1, 2, 32, [13], 4, np.float16)
    k, v = in_memory(k, ORDERS[order]), in_memory(v, ORDERS[order])
    q = randn(rng, (1, 4, 32), np.float16, scale=0.5)
    o = numba_flash.decode(q, k, v, cache_seqlens=np.array([13]), block_table=table)
    assert_close(o, ref.paged_decode(q, k, v, np.array([13]), table)[0], np.float16, name="o")
    assert [c.SLOT_STRIDE for c in cfgs] == [order == "tokens-first"] and cfgs[0].VEC
    assert loads


@pytest.mark.parametrize("order", ["tokens-first", "heads-outer"])
def test_contiguous_cache_and_batch_idx(rng, launched, order):
    """A contiguous ``[B, Nmax, Hkv, d]`` cache (flash-attn's), with and without
    ``cache_batch_idx`` (a one-column table of cache rows), a left pad and a window."""
    b, h, hkv, d, nmax = 2, 6, 3, 16, 24
    lens = np.array([9, 21])
    k, v = contiguous_cache(rng, 3, hkv, nmax, d, [9, 0, 21], np.float32)
    k, v = in_memory(k, ORDERS[order]), in_memory(v, ORDERS[order])
    q = randn(rng, (b, h, d), np.float32)
    cbi = np.array([0, 2], np.int32)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, cache_batch_idx=cbi,
                                cache_leftpad=np.array([2, 0], np.int32), window_size=(7, 0),
                                num_splits=2, return_lse=True)
    want_o, want_lse = ref.kvcache_decode(q, k, v, lens, cache_batch_idx=cbi,
                                          cache_leftpad=np.array([2, 0], np.int32),
                                          window_size=(7, 0))[:2]
    assert_close(o, want_o, np.float32, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    o2 = numba_flash.decode(q, k[[0, 2]], v[[0, 2]], cache_seqlens=lens)   # (a copy, gathered)
    want2 = ref.paged_decode(q, k[[0, 2]], v[[0, 2]], lens)[0]
    assert_close(o2, want2, np.float32, name="o")
    _launched_caches(launched, k, v)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_e4m3_tokens_first(rng, launched, paged):
    """e4m3 caches tokens-first (their bytes read through the strides, 16-byte loads at d =
    16 and word loads at d = 24), descales per (sequence, kv head)."""
    from test_decode_fp8 import descales, reference

    b, h, hkv = 2, 4, 2
    lens = np.array([13, 27])
    for d in (16, 24):
        if paged:
            k, v, table = paged_cache(rng, b, hkv, d, lens, 4, np.float32)
        else:
            k, v = contiguous_cache(rng, b, hkv, 32, d, lens, np.float32)
            table = None
        k8 = in_memory(k.astype(float8_e4m3fn), TOKENS_FIRST)
        v8 = in_memory(v.astype(float8_e4m3fn), TOKENS_FIRST)
        kd, vd = descales(rng, b, hkv)
        q = randn(rng, (b, h, d), np.float16)
        o, lse = numba_flash.decode(q, k8, v8, cache_seqlens=lens, block_table=table,
                                    k_descale=kd, v_descale=vd, num_splits=2, return_lse=True)
        want_o, want_lse = reference(q, k8, v8, kd, vd, lens, table)
        assert_close(o, want_o, np.float16, name="o")
        assert_close(lse, want_lse, np.float32, name="lse")
        _launched_caches(launched, k8, v8)


def test_token_lists_tokens_first(rng, launched):
    """Token-sparse decode (``kv_indices``, the gather) over a tokens-first paged cache."""
    b, h, hkv, d, topk = 2, 4, 2, 8, 6
    lens = np.array([11, 20])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 4, np.float32)
    k, v = in_memory(k, TOKENS_FIRST), in_memory(v, TOKENS_FIRST)
    q = randn(rng, (b, h, 1, d), np.float32)
    idx = np.full((b, hkv, 1, topk), -1, np.int32)
    for i, n in enumerate(lens):
        for g in range(hkv):
            idx[i, g, 0, :4] = rng.choice(int(n), 4, replace=False)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, kv_indices=idx,
                                return_lse=True)
    want_o, want_lse = ref.paged_decode(q, k, v, lens, table, kv_indices=idx)
    assert_close(o, want_o, np.float32, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    _launched_caches(launched, k, v)


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_mla_latent_cache_tokens_first(rng, launched, kernel):
    """MLA's latent cache tokens-first with two kv heads (the value its first d_v columns), on
    the SIMT kernel and the tensor-core one."""
    b, h, hkv, d, d_v = 2, 4, 2, 128, 64
    lens = np.array([21, 37])
    k, _, table = paged_cache(rng, b, hkv, d, lens, 16, np.float16)
    k = in_memory(k, TOKENS_FIRST)
    q = randn(rng, (b, h, d), np.float16, scale=0.3)
    o, lse = numba_flash.decode(q, k, None, head_dim_v=d_v, cache_seqlens=lens,
                                block_table=table, num_splits=2, return_lse=True, kernel=kernel)
    want_o, want_lse = ref.paged_decode(q, k, k[..., :d_v], lens, table)
    assert_close(o, want_o, np.float16, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    _launched_caches(launched, k)


def test_value_cache_in_another_order(rng):
    """A tokens-first key cache beside a heads-first value cache: the value cache is read in
    the key cache's order (a copy: the kernels number both caches' rows alike); right."""
    b, h, hkv, d = 2, 4, 2, 8
    lens = np.array([7, 12])
    k, v, table = paged_cache(rng, b, hkv, d, lens, 4, np.float32)
    kt = in_memory(k, TOKENS_FIRST)
    o = numba_flash.decode(randn(rng, (b, h, d), np.float32), kt, v, cache_seqlens=lens,
                           block_table=table)
    assert np.isfinite(o).all()
    q = randn(rng, (b, h, d), np.float32)
    o = numba_flash.decode(q, kt, v, cache_seqlens=lens, block_table=table)
    assert_close(o, ref.paged_decode(q, k, v, lens, table)[0], np.float32, name="o")


# -- appends -------------------------------------------------------------------------------------
def _room(rng, paged, b, hkv, d, lens, nnew, dtype, block_size=4):
    if paged:
        return paged_cache(rng, b, hkv, d, np.asarray(lens) + nnew, block_size, dtype)
    k, v = contiguous_cache(rng, b, hkv, int(max(lens)) + nnew + 2, d, lens, dtype)
    return k, v, None


@pytest.mark.parametrize("order", ["tokens-first", "heads-outer"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_append_kv_in_place(rng, launched, order, paged, dtype):
    """append_kv into a cache in its own order: the new tokens land where the reference puts
    them, every other byte of the caches and every other input unchanged."""
    b, hkv, d, nnew = 2, 2, 8, 3
    lens = np.array([5, 10], np.int32)
    k, v, table = _room(rng, paged, b, hkv, d, lens, nnew, dtype)
    k, v = in_memory(k, ORDERS[order]), in_memory(v, ORDERS[order])
    kn, vn = randn(rng, (b, hkv, nnew, d), dtype), randn(rng, (b, hkv, nnew, d), dtype)
    want_k, want_v, want_lens = ref.append_kv(k, v, kn, vn, lens, table)
    keep = [x.copy() for x in (kn, vn, lens)]
    new_lens = numba_flash.append_kv(k, v, kn, vn, lens, block_table=table)
    np.testing.assert_array_equal(new_lens, want_lens)
    np.testing.assert_array_equal(k.view(np.uint16 if dtype == np.float16 else np.uint32),
                                  want_k.view(np.uint16 if dtype == np.float16 else np.uint32))
    np.testing.assert_array_equal(v.astype(np.float64), want_v.astype(np.float64))
    for x, y in zip(keep, (kn, vn, lens)):
        np.testing.assert_array_equal(x, y)
    _launched_caches(launched, k, v)


def test_append_latent_e4m3_tokens_first(rng, launched):
    """append_kv into an e4m3 cache tokens-first: the new slots hold the e4m3 of x / descale,
    every other byte as it was."""
    from test_decode_fp8 import _quantised, check_e4m3_append, descales

    b, hkv, d, nnew = 2, 2, 16, 2
    lens = np.array([3, 9])
    k, v, table = paged_cache(rng, b, hkv, d, lens + nnew, 4, np.float32, poison=False)
    k8 = in_memory(k.astype(float8_e4m3fn), TOKENS_FIRST)
    v8 = in_memory(v.astype(float8_e4m3fn), TOKENS_FIRST)
    kd, vd = descales(rng, b, hkv)
    kn = randn(rng, (b, hkv, nnew, d), np.float16)
    vn = randn(rng, (b, hkv, nnew, d), np.float16)
    before_k, before_v = k8.copy(), v8.copy()
    numba_flash.append_kv(k8, v8, kn, vn, lens, table, k_descale=kd, v_descale=vd)
    check_e4m3_append(k8, v8, before_k, before_v, _quantised(kn, kd), _quantised(vn, vd),
                      lens, table, 4)
    _launched_caches(launched, k8, v8)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_decode_appends_into_tokens_first_caches(rng, launched, paged):
    """decode(k_new=, v_new=) with rotary: the rotated k and v land in the tokens-first caches
    in place (NaN slots elsewhere stay NaN), the attention sees them; as kvcache_decode."""
    from test_decode_kvcache import K_TOL, make_case, run_and_check

    case = make_case(rng, paged=paged, lens=(6, 11), nnew=2, nq=2, dtype=np.float32)
    case["k_cache"] = in_memory(case["k_cache"], TOKENS_FIRST)
    case["v_cache"] = in_memory(case["v_cache"], TOKENS_FIRST)
    assert K_TOL
    run_and_check(case, np.float32, causal=True, num_splits=2)
    _launched_caches(launched, case["k_cache"], case["v_cache"])


def test_a_copy_is_written_back(rng):
    """A NumPy cache in no order (rows with gaps) is copied and, after an append, written back
    into the caller's memory: still in place for the caller."""
    b, hkv, d, nnew = 2, 2, 8, 1
    lens = np.array([2, 5], np.int32)
    k, v, _ = _room(rng, False, b, hkv, d, lens, nnew, np.float32)
    wide_k = np.zeros(k.shape[:3] + (2 * d,), np.float32)
    wide_v = np.zeros(k.shape[:3] + (2 * d,), np.float32)
    wide_k[..., :d], wide_v[..., :d] = k, v
    kg, vg = wide_k[..., :d], wide_v[..., :d]
    kn, vn = randn(rng, (b, hkv, nnew, d), np.float32), randn(rng, (b, hkv, nnew, d), np.float32)
    want_k, want_v, _ = ref.append_kv(kg, vg, kn, vn, lens)
    numba_flash.append_kv(kg, vg, kn, vn, lens)
    np.testing.assert_array_equal(kg, want_k)
    np.testing.assert_array_equal(vg, want_v)
    assert not wide_k[..., d:].any()


# -- the device path: zero copies, plans ---------------------------------------------------------
def _dev(x):
    return sd.adopt(np.ascontiguousarray(x))


def test_device_path_reads_and_writes_tokens_first_in_place(rng):
    """Stand-in device arrays: a tokens-first paged cache (the transposed view of flash-attn's
    memory) is decoded and appended to with no copy and no device work outside the launches
    (0 foreign operations), the steady call replays its plan (tokens-first is a signature of
    its own), and the appended tokens land in the caller's memory."""
    b, h, hkv, d, bs, nnew = 2, 4, 2, 16, 4, 1
    lens = np.array([5, 9], np.int32)
    k, v, table = paged_cache(rng, b, hkv, d, lens + 3 * nnew, bs, np.float32, poison=False)
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3))   # flash-attn's memory [n, N, Hkv, d]
    vt = np.ascontiguousarray(v.transpose(0, 2, 1, 3))
    q = randn(rng, (b, h, d), np.float32)
    kn, vn = randn(rng, (b, hkv, nnew, d), np.float32), randn(rng, (b, hkv, nnew, d), np.float32)
    kd, vd = _dev(kt), _dev(vt)
    args = [_dev(x) for x in (q, table, kn, vn)]
    out = sd.empty((b, h, d), np.float32)
    kc, vc = kd.transpose(0, 2, 1, 3), vd.transpose(0, 2, 1, 3)
    state = {"lens": lens.copy()}
    host_k, host_v = k.copy(), v.copy()

    def step():
        ld = _dev(state["lens"])
        numba_flash.decode(args[0], kc, vc, cache_seqlens=ld, block_table=args[1],
                           k_new=args[2], v_new=args[3], out=out)
        state["lens"] = state["lens"] + nnew

    with sd.device(execute=True):
        step()
        before = plans.plan_stats()["plans"]
        step()
        with sd.count() as c:
            step()
        assert plans.plan_stats()["plans"] == before
    assert (c.syncs, c.d2h, c.h2d, c.foreign) == (0, 0, 0, 0), c.log
    # the three appends, in the caller's tokens-first memory
    lens_now = lens.copy()
    for _ in range(3):
        host_k, host_v, lens_now = ref.append_kv(host_k, host_v, kn, vn, lens_now, table)
    np.testing.assert_array_equal(kt.transpose(0, 2, 1, 3), host_k)
    np.testing.assert_array_equal(vt.transpose(0, 2, 1, 3), host_v)
    want = ref.paged_decode(q, host_k, host_v, lens_now, table)[0]
    assert_scaled_close(out._a, want, 2e-5, name="o")


def test_device_append_into_a_cache_in_no_order_is_refused(rng):
    """A device cache written in place must be in some memory order (else its writes would land
    in a copy), and the value cache in the key cache's order."""
    k = sd.adopt(np.zeros((2, 2, 8, 32), np.float32))[..., :16]
    kn = sd.adopt(np.zeros((2, 2, 1, 16), np.float32))
    lens = sd.adopt(np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="k_cache: expected a device array whose memory"):
        numba_flash.append_kv(k, k, kn, kn, lens)
    kt = sd.adopt(np.zeros((2, 8, 2, 16), np.float32)).transpose(0, 2, 1, 3)
    vh = sd.adopt(np.zeros((2, 2, 8, 16), np.float32))
    with pytest.raises(ValueError, match="v_cache: expected the memory order of k_cache"):
        numba_flash.append_kv(kt, vh, kn, kn, lens)
