"""GPU only (marked ``gpu``, skipped without a CUDA device): CuPy arrays in, CuPy arrays out, on
the same device, zero copy, with the same results as NumPy inputs; Numba device arrays too."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, randn
from numba_flash.kernels.core.common import cdiv

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp():
    return pytest.importorskip("cupy")


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_forward_cupy_matches_numpy(cp, rng, dtype, causal):
    q, k, v = (randn(rng, (2, 4, 129, 64), dtype), randn(rng, (2, 2, 200, 64), dtype),
               randn(rng, (2, 2, 200, 64), dtype))
    o_np, lse_np = numba_flash.forward(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    o, lse = numba_flash.forward(dq, dk, dv, causal=causal, return_lse=True)
    assert isinstance(o, cp.ndarray) and o.device == dq.device and o.dtype == dtype
    np.testing.assert_array_equal(o.get(), o_np)
    np.testing.assert_array_equal(lse.get(), lse_np)
    want, _ = ref.attention(q, k, v, causal=causal)
    assert_close(o.get(), want, dtype, scale=max(1.0, np.abs(want).max()))


def test_forward_cupy_non_contiguous_and_unmodified(cp, rng):
    base = cp.asarray(randn(rng, (1, 4, 64, 128), np.float32))
    q = base[:, :, :, ::2]  # non-contiguous view, d = 64
    k = base[:, :2, :, 1::2]
    v = base[:, 2:, :, ::2]
    before = base.copy()
    o = numba_flash.forward(q, k, v)
    want, _ = ref.attention(q.get(), k.get(), v.get())
    assert_close(o.get(), want, np.float32)
    assert bool((base == before).all())


# Spins for ``cycles`` clock ticks, then copies ``src`` into ``dst``: queued on a stream ahead of a
# launch, it makes a launch on any other stream read ``dst`` before it is written.
_SPIN_THEN_COPY = r"""
extern "C" __global__ void spin_then_copy(const float* src, float* dst, int n, long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}
"""


def test_forward_runs_on_the_current_cupy_stream(cp, rng):
    """forward() must run on CuPy's current stream, after the work queued there: a kernel that
    writes q only after ~0.5 s of spinning is queued first on a non-blocking stream (which does
    not synchronise with the legacy default stream). Launched on any other stream, forward would
    read q's zeros and return zeros; on the right one it sees q."""
    q_host = randn(rng, (1, 2, 256, 64), np.float32)
    src = cp.asarray(q_host)
    q = cp.zeros_like(src)
    numba_flash.forward(src, src, src, causal=True)  # compile first: JIT time would hide a race
    spin = cp.RawKernel(_SPIN_THEN_COPY, "spin_then_copy")
    cp.cuda.Device().synchronize()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        spin((cdiv(q.size, 256),), (256,), (src, q, np.int32(q.size), np.int64(10**9)))
        o = numba_flash.forward(q, q, q, causal=True)
    stream.synchronize()
    want, _ = ref.attention(q_host, q_host, q_host, causal=True)
    assert_close(o.get(), want, np.float32)


def test_backward_and_decode_cupy(cp, rng):
    q = randn(rng, (1, 4, 70, 32), np.float32)
    k = randn(rng, (1, 2, 90, 32), np.float32)
    do = randn(rng, q.shape, np.float32)
    o, lse = numba_flash.forward(q, k, k, causal=True, return_lse=True)
    grads = numba_flash.backward(*(cp.asarray(x) for x in (do, q, k, k, o, lse)), causal=True)
    assert all(isinstance(g, cp.ndarray) for g in grads)
    want = ref.attention_backward(do, q, k, k, causal=True)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g.get(), w, atol=1e-4 * max(1.0, np.abs(w).max()))
    seqlens = np.array([90], np.int32)
    od = numba_flash.decode(cp.asarray(q[:, :, -1]), cp.asarray(k), cp.asarray(k),
                            cache_seqlens=cp.asarray(seqlens))
    assert isinstance(od, cp.ndarray)
    wd, _ = ref.paged_decode(q[:, :, -1], k, k, seqlens)
    assert_close(od.get(), wd, np.float32)


def test_numba_device_arrays(rng):
    from numba import cuda

    x = randn(rng, (3, 300), np.float32)
    y = numba_flash.softmax(cuda.to_device(x))
    assert cuda.is_cuda_array(y)
    want = np.stack([ref.softmax(r) for r in x])
    assert_close(y.copy_to_host(), want, np.float32)


@pytest.mark.parametrize("kernel", ["simt", "mma"])
def test_bfloat16_cupy_in_and_out_matches_numpy(cp, rng, kernel):
    """CuPy bfloat16 arrays (CuPy >= 14 with ml_dtypes) in, CuPy bfloat16 out, the same bits as
    the NumPy (ml_dtypes) call; the backward too.  Written without a GPU: unrun until one runs
    the suite."""
    import ml_dtypes

    bf16 = np.dtype(ml_dtypes.bfloat16)
    try:
        cp.zeros(1, bf16)
    except Exception as exc:  # an older CuPy: no bfloat16 dtype
        pytest.skip(f"this CuPy has no bfloat16 arrays: {exc}")
    q, k, v = (randn(rng, (1, 4, 129, 64), np.float32).astype(bf16),
               randn(rng, (1, 2, 200, 64), np.float32).astype(bf16),
               randn(rng, (1, 2, 200, 64), np.float32).astype(bf16))
    o_np, lse_np = numba_flash.forward(q, k, v, causal=True, return_lse=True, kernel=kernel)
    dq, dk, dv = cp.asarray(q), cp.asarray(k), cp.asarray(v)
    o, lse = numba_flash.forward(dq, dk, dv, causal=True, return_lse=True, kernel=kernel)
    assert isinstance(o, cp.ndarray) and o.dtype == bf16 and o.device == dq.device
    np.testing.assert_array_equal(o.get().view(np.uint16), o_np.view(np.uint16))
    np.testing.assert_array_equal(lse.get(), lse_np)
    do = randn(rng, q.shape, np.float32).astype(bf16)
    g_np = numba_flash.backward(do, q, k, v, o_np, lse_np, causal=True, deterministic=True,
                                kernel="simt")
    g = numba_flash.backward(cp.asarray(do), dq, dk, dv, o, lse, causal=True,
                             deterministic=True, kernel="simt")
    for a, b in zip(g, g_np):
        assert a.dtype == bf16
        np.testing.assert_array_equal(a.get().view(np.uint16), b.view(np.uint16))


def test_fp8_forward_and_decode_cupy_uint8(cp, rng):
    """e4m3 on CuPy (no fp8 dtype): uint8 q, k, v with qkv_dtype="fp8_e4m3" and device
    descales, and a uint8 cache with kv_cache_dtype="fp8_e4m3": the NumPy e4m3 calls' bits."""
    from ml_dtypes import float8_e4m3fn

    q, k, v = (rng.standard_normal(s).astype(float8_e4m3fn)
               for s in ((1, 4, 40, 64), (1, 2, 70, 64), (1, 2, 70, 64)))
    scales = [rng.uniform(0.5, 2.0, (1, 2)).astype(np.float32) for _ in range(3)]
    names = ("q_descale", "k_descale", "v_descale")
    want = numba_flash.forward(q, k, v, causal=True, return_lse=True, out_dtype="float16",
                               **dict(zip(names, scales)))
    got = numba_flash.forward(*(cp.asarray(x.view(np.uint8)) for x in (q, k, v)),
                              qkv_dtype="fp8_e4m3", causal=True, return_lse=True,
                              out_dtype="float16",
                              **{n: cp.asarray(s) for n, s in zip(names, scales)})
    for g, w in zip(got, want):
        assert isinstance(g, cp.ndarray)
        np.testing.assert_array_equal(g.get(), w)
    # varlen with CuPy slopes and sink (the per-sequence path's xp arrays)
    packed = [x[0].transpose(1, 0, 2).copy() for x in (q, k, v)]
    cu_q, cu_k = np.array([0, 15, 40], np.int32), np.array([0, 30, 70], np.int32)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    sink = np.array([0.5, -1.0, 0.0, 2.0], np.float32)
    kw = dict(max_seqlen_q=25, max_seqlen_k=40, causal=True, return_lse=True,
              out_dtype="float16")
    want = numba_flash.forward_varlen(*packed, cu_q, cu_k, alibi_slopes=slopes,
                                      learnable_sink=sink, **kw)
    got = numba_flash.forward_varlen(*(cp.asarray(x.view(np.uint8)) for x in packed),
                                     cp.asarray(cu_q), cp.asarray(cu_k), qkv_dtype="fp8_e4m3",
                                     alibi_slopes=cp.asarray(slopes),
                                     learnable_sink=cp.asarray(sink), **kw)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.get(), w)
    lens = np.array([70], np.int32)
    qd = randn(rng, (1, 4, 64), np.float16)
    want = numba_flash.decode(qd, k, v, cache_seqlens=lens, k_descale=scales[1],
                              v_descale=scales[2])
    got = numba_flash.decode(cp.asarray(qd), cp.asarray(k.view(np.uint8)),
                             cp.asarray(v.view(np.uint8)), cache_seqlens=cp.asarray(lens),
                             kv_cache_dtype="fp8_e4m3", k_descale=cp.asarray(scales[1]),
                             v_descale=cp.asarray(scales[2]))
    np.testing.assert_array_equal(got.get(), want)


def test_decode_plan_in_a_cuda_graph_over_a_growing_cache(cp, rng):
    """Issue 60 on a GPU: a decode plan's run captured in a CUDA graph (CuPy's stream capture:
    a synchronisation or an allocation inside would fail the capture) and replayed step after
    step, the step's query and new token written into the captured arrays and the lengths
    advanced on the device between replays, equals the eager decode of the same cache."""
    b, h, hkv, d, cap = 2, 8, 2, 64, 96
    k0, v0 = randn(rng, (b, hkv, cap, d), np.float16), randn(rng, (b, hkv, cap, d), np.float16)
    lens0 = np.array([5, 40], np.int32)
    q, kn, vn = (cp.asarray(randn(rng, s, np.float16))
                 for s in ((b, h, d), (b, hkv, 1, d), (b, hkv, 1, d)))
    kc, vc, lens = cp.asarray(k0), cp.asarray(v0), cp.asarray(lens0)
    out = cp.empty((b, h, d), np.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        plan = numba_flash.decode_plan(q, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn,
                                       causal=True, out=out)
        plan.run(q, kc, vc, lens, k_new=kn, v_new=vn, out=out)   # the first run: compiled
        stream.synchronize()
        kc[...], vc[...] = cp.asarray(k0), cp.asarray(v0)        # the cache as it was
        stream.begin_capture()
        plan.run(q, kc, vc, lens, k_new=kn, v_new=vn, out=out)
        graph = stream.end_capture()
        kk, vv, ll = k0.copy(), v0.copy(), lens0.copy()
        for step in range(4):
            host = [randn(rng, x.shape, np.float16) for x in (q, kn, vn)]
            for x, y in zip((q, kn, vn), host):
                x.set(y, stream=stream)
            graph.launch(stream)
            stream.synchronize()
            want = ref.kvcache_decode(host[0], kk, vv, ll, k_new=host[1], v_new=host[2],
                                      causal=True)
            assert_close(out.get(), want[0], np.float16, name=f"o at step {step}")
            kk, vv = want[2].astype(np.float16), want[3].astype(np.float16)
            lens += 1
            ll = ll + 1


def test_steady_calls_never_synchronise(cp, rng, monkeypatch):
    """Issue 60 on a GPU: after a call of a signature (its plan built), a call of the same
    signature makes no synchronisation the driver sees: cudaStreamSynchronize, a
    device-to-host copy (both through CuPy here) are counted by patching CuPy's."""
    q, k, v = (cp.asarray(randn(rng, (1, 8, 256, 64), np.float16)) for _ in range(3))
    numba_flash.forward(q, k, v, causal=True)
    calls = []
    monkeypatch.setattr(cp.cuda.Stream, "synchronize",
                        lambda self: calls.append("Stream.synchronize"))
    monkeypatch.setattr(cp.ndarray, "get", lambda self, *a, **k: calls.append("get"))
    out = cp.empty_like(q)
    numba_flash.forward(q, k, v, causal=True, out=out)
    numba_flash.forward(q, k, v, causal=True, out=out)
    assert calls == []
