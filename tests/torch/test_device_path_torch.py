"""numba_flash.torch's device path on the stand-in device (issue 60, parts 3 and 4): the code
CUDA tensors take (zero-copy device views, outputs allocated by torch and passed as ``out=``,
torch's current stream) run here on CPU tensors under :func:`bridge.standin_tensors`, down to
the launch, each launch run in the simulator from its packed bytes
(``standin.device(execute=True)``).

* Results equal the host path's bit for bit (the same kernels in the same simulator) and the
  float64 reference within the kernel tests' tolerances.
* A steady call (its signature seen before: the ops replay their launch plans) synchronises
  nothing, copies nothing between host and device and does no device work outside its
  launches.  What it allocates is counted exactly: on the stand-in, the ``softmax_lse`` that
  the ops allocate themselves (they take no ``out=`` for it); on torch's side, the outputs and
  the heads-first copies of ``[B, N, H, d]`` tensors that the ops need C-contiguous: none for
  the dense forward and the SIMT backward (the simulator's), whose kernels read flash-attn's
  memory through its strides (issue 61); the tensor-core backward's still.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
import numba_flash.standin as sd  # noqa: E402
import numba_flash.torch as nft  # noqa: E402
from numba_flash import reference  # noqa: E402
from numba_flash.frontend import plans  # noqa: E402
from numba_flash.torch import bridge, ops  # noqa: E402

from helpers import assert_close, assert_scaled_close  # noqa: E402
from torch_helpers import randn  # noqa: E402

#: the handle of "torch's current stream" on the stand-in: every launch must be on it
STREAM = 0x7A00


@contextlib.contextmanager
def device_path():
    """CPU tensors on the device path, launches run in the simulator: yields ``(mode,
    driver)`` (:class:`bridge.StandInTensors`, the stand-in's driver)."""
    with bridge.standin_tensors(stream=STREAM) as mode, sd.device(execute=True) as driver:
        yield mode, driver


@contextlib.contextmanager
def same_on_device(run):
    """``run()`` on the host path, then on the device path: the same results, every launch on
    torch's stream; yields ``(mode, driver, results)`` (:func:`device_path`'s, and the device
    path's results) for the steady counts."""
    host = run()
    with device_path() as (mode, driver):
        dev = run()
        _on_stream(driver)
        _equal(dev, host)
        yield mode, driver, dev


def _steady(mode, call, pre=None):
    """``call()`` twice (the first builds the launch plans), then once counted: ``(stand-in
    counters, torch allocations, torch copies)`` of that call (``pre()`` before each call,
    uncounted: a forward before a backward).  No device sync, copy or foreign work, and no new
    plan, in the counted call."""
    for _ in range(2):
        if pre is not None:
            pre()
        call()
    if pre is not None:
        pre()
    before = plans.plan_stats()
    mode.reset()
    with sd.count() as c:
        call()
    assert plans.plan_stats() == before, "a steady call built a plan"
    assert (c.syncs, c.d2h, c.h2d, c.foreign) == (0, 0, 0, 0), c.log
    return c, mode.allocations, mode.copies


def _on_stream(driver):
    assert driver.launches and {r.stream for r in driver.launches} == {STREAM}


def _hf(x):
    """A ``[B, N, H, d]`` tensor as a float64 ``[B, H, N, d]`` array."""
    return x.detach().double().numpy().transpose(0, 2, 1, 3)


def _equal(a, b):
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


# -- dense ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_flash_attn_func_forward_backward(gen, dtype):
    """Forward and backward through autograd (causal GQA): the device path's results equal the
    host path's and the reference; steady calls on torch's stream with 0 syncs."""
    q = randn(gen, 1, 5, 4, 8, dtype=dtype, requires_grad=True)
    k, v = (randn(gen, 1, 7, 2, 8, dtype=dtype, requires_grad=True) for _ in range(2))
    g = randn(gen, 1, 5, 4, 8, dtype=dtype)

    def run():
        out, lse, _ = nft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out, (q, k, v), g))

    with same_on_device(run) as (mode, driver, dev):
        state = {}

        def forward():
            state["out"] = nft.flash_attn_func(q, k, v, causal=True)

        # forward: nothing allocated on the stand-in (o and lse are out= / lse_out=); torch:
        # o ([B, N, H, d], written through its strides) and the lse; no copy (q, k, v read
        # where they lie)
        c, allocs, copies = _steady(mode, forward)
        assert (c.allocations, c.launches, allocs, copies) == (0, 1, 2, 0), (c.log, mode.log)
        # backward: no allocation on the stand-in (dq, dk, dv are out=, the work arrays the
        # plan's, zeroed by memsets); torch: dq, dk, dv ([B, N, H, d]) and no copy (the SIMT
        # backward, the simulator's, reads and writes through strides, as the tensor-core one
        # does on a GPU: tests/kernels/test_strided_backward_mma.py counts it)
        c, allocs, copies = _steady(mode, lambda: state["out"].backward(g), forward)
        assert (c.allocations, allocs, copies) == (0, 3, 0), (c.log, mode.log)
    want_o, want_lse = reference.attention(*(_hf(x) for x in (q, k, v)), causal=True)
    want_g = reference.attention_backward(_hf(g), *(_hf(x) for x in (q, k, v)), causal=True)
    if dtype == torch.float32:
        assert_close(_hf(dev[0]), want_o, np.float32)
        assert_close(dev[1].numpy(), want_lse, np.float32)
        for got, want in zip(dev[2:], want_g):
            assert_scaled_close(_hf(got), want, 4e-6)
    else:   # bfloat16 in and out (its words through the kernels)
        assert_scaled_close(_hf(dev[0]), want_o, 1e-2)
        for got, want in zip(dev[2:], want_g):
            assert_scaled_close(_hf(got), want, 3e-2)


def test_packed_forms(gen):
    """qkv- and kv-packed forms (unbind views: strided, read where they lie by the forward,
    copied heads-first by torch for the backward): as the host path, with the dense wrapper's
    counts."""
    qkv = randn(gen, 1, 6, 3, 2, 8, requires_grad=True)
    q = randn(gen, 1, 4, 2, 8, requires_grad=True)
    kv = randn(gen, 1, 6, 2, 1, 8, requires_grad=True)
    g6, g4 = randn(gen, 1, 6, 2, 8), randn(gen, 1, 4, 2, 8)

    def qkv_call():
        return nft.flash_attn_qkvpacked_func(qkv, causal=True)

    def kv_call():
        return nft.flash_attn_kvpacked_func(q, kv)

    def run():
        a, b = qkv_call(), kv_call()
        return (a, b, *torch.autograd.grad(a, qkv, g6), *torch.autograd.grad(b, (q, kv), g4))

    host = run()
    with device_path() as (mode, _driver):
        _equal(run(), host)
        # forward and backward as the dense wrapper's: q, k, v read where they lie in the one
        # buffer (overlapping views starting apart: the launch plans replay them)
        for call, grad, bwd_copies in ((qkv_call, g6, 0), (kv_call, g4, 0)):
            state = {}

            def forward(call=call):
                state["out"] = call()

            c, allocs, copies = _steady(mode, forward)
            assert (c.allocations, allocs, copies) == (0, 2, 0), (c.log, mode.log)
            c, allocs, copies = _steady(mode, lambda grad=grad: state["out"].backward(grad),
                                        forward)
            assert (c.allocations, allocs, copies) == (0, 3, bwd_copies), (c.log, mode.log)
    o, _ = reference.attention(*(_hf(x) for x in qkv.unbind(2)), causal=True)
    assert_close(_hf(host[0]), o, np.float32)


#: what a steady call with ALiBi slopes or a learnable sink does on the host besides its
#: launches: ``(syncs, device-to-host copies, foreign device work)`` of the forward, then of the
#: backward.  The front end reads no device slope or sink value (``check_values`` is for host
#: arrays: it was an ``isfinite().all()`` / ``isnan().any()`` read back, a synchronisation
#: each); the backward still sums ``dsink`` with 14 array operations (no synchronisation).
FRONT_END_SYNCS = {
    "alibi": ((0, 0, 0), (0, 0, 0)),
    "sink": ((0, 0, 0), (0, 0, 14)),
}


@pytest.mark.parametrize("variant", sorted(FRONT_END_SYNCS))
def test_front_end_value_checks(gen, variant):
    q, k, v = (randn(gen, 1, 4, 2, 8, requires_grad=True) for _ in range(3))
    kw = ({"alibi_slopes": torch.tensor([0.25, 0.5])} if variant == "alibi"
          else {"learnable_sink": torch.zeros(2, requires_grad=True)})
    counts = []
    with device_path():
        for _ in range(3):
            with sd.count() as f:
                out = nft.flash_attn_func(q, k, v, causal=True, **kw)
            with sd.count() as b:
                out.sum().backward()
        for c in (f, b):
            counts.append((c.syncs, c.d2h, c.foreign))
    assert tuple(counts) == FRONT_END_SYNCS[variant], (f.log, b.log)


# -- varlen ---------------------------------------------------------------------------------------
def _op_allocations(call):
    """The stand-in allocations of a steady ``call()`` of an op itself (its third call)."""
    call()
    call()
    with sd.count() as c:
        call()
    return c.allocations


def test_flash_attn_varlen_func_forward_backward(gen):
    """Packed (varlen) forward and backward through autograd: as the host path and the
    reference; no sync.  Packed [total, H, d] tensors are what the ops read: no copy but
    dout's (autograd's gradient of a sum is a broadcast view).  On the stand-in a steady call
    allocates exactly what ``forward_varlen`` / ``backward_varlen`` called directly on device
    arrays allocate (the wrappers add nothing there); torch allocates ``out`` and ``dq, dk,
    dv`` where the ops take them as ``out=`` (:func:`ops.varlen_out`)."""
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    q, k, v = (randn(gen, 5, 2, 8, requires_grad=True) for _ in range(3))

    def run():
        out, lse, _ = nft.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, causal=True,
                                                 return_attn_probs=True)
        return (out, lse, *torch.autograd.grad(out.sum(), (q, k, v)))

    fwd_out, bwd_out = ops.varlen_out(), ops.varlen_out(backward=True)
    with same_on_device(run) as (mode, driver, dev):
        state = {}

        def forward():
            state["out"] = nft.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, causal=True)

        c, allocs, copies = _steady(mode, forward)
        assert (allocs, copies) == (2 * int(fwd_out), 0), mode.log
        # the ops on stand-in arrays of the same signatures
        dq, dk, dv, dcu = (sd.asarray(x.detach().numpy()) for x in (q, k, v, cu))
        kw = dict(max_seqlen_q=3, max_seqlen_k=3, causal=True)
        o_out = sd.empty(dq.shape, dq.dtype)
        o, lse = numba_flash.forward_varlen(dq, dk, dv, dcu, dcu, return_lse=True, **kw)
        lse_out = sd.empty(lse.shape, lse.dtype)
        assert c.allocations == _op_allocations(lambda: numba_flash.forward_varlen(
            dq, dk, dv, dcu, dcu, return_lse=True, **kw,
            **({"out": o_out, "lse_out": lse_out} if fwd_out else {}))), c.log
        c, allocs, copies = _steady(mode, lambda: state["out"].sum().backward(), forward)
        assert (allocs, copies) == (3 * bwd_out, 1), mode.log
        do = sd.asarray(np.ones(dq.shape, np.float32))
        grads = tuple(sd.empty(x.shape, x.dtype) for x in (dq, dk, dv))
        assert c.allocations == _op_allocations(lambda: numba_flash.backward_varlen(
            do, dq, dk, dv, o, lse, dcu, dcu, **kw, **({"out": grads} if bwd_out else {}))
        ), c.log
    want_o, want_lse = reference.attention_varlen(*(x.detach().double().numpy()
                                                    for x in (q, k, v)), cu.numpy(), cu.numpy(),
                                                  causal=True)
    assert_close(dev[0].detach().numpy(), want_o, np.float32)
    assert_close(dev[1].numpy(), want_lse, np.float32)


def test_fp8_forward_reads_flash_attn_layout_in_place(gen):
    """FA3's fp8 ``flash_attn_func`` (e4m3 ``[B, N, H, d]`` tensors, descales of 1): the e4m3
    forward reads q, k, v where they lie and writes ``out`` (bfloat16, ``[B, N, H, d]``) in
    place: no torch copy; as the host path."""
    q, k, v = (randn(gen, 1, 9, 2, 32).to(torch.float8_e4m3fn) for _ in range(3))

    def run():
        return (nft.flash_attn_func(q, k, v, causal=True),)

    with same_on_device(run) as (mode, driver, dev):
        c, allocs, copies = _steady(mode, run)
        assert copies == 0, mode.log
    want, _ = reference.attention(*(_hf(x) for x in (q, k, v)), causal=True)
    assert_scaled_close(_hf(dev[0]), want, 4e-2)


def test_varlen_fused_projection_forward_backward_without_a_copy(gen):
    """A fused projection's packed slices (``qkv.unbind(1)`` of ``[total, 3, H, d]``) through
    ``flash_attn_varlen_func`` and autograd with a contiguous gradient: the forward and the
    backward read q, k, v, out and dout where they lie and write dq, dk, dv in place (no torch
    copy; 0 allocations on the stand-in); the results are the host path's and the
    reference's."""
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    qkv = randn(gen, 5, 3, 2, 8, requires_grad=True)
    g = randn(gen, 5, 2, 8)

    def run():
        q, k, v = qkv.unbind(1)
        out = nft.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, causal=True)
        return (out, *torch.autograd.grad(out, (qkv,), g))

    with same_on_device(run) as (mode, driver, dev):
        state = {}

        def forward():
            state["out"] = nft.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, 3, 3, causal=True)

        c, allocs, copies = _steady(mode, forward)
        assert copies == 0, mode.log
        c, allocs, copies = _steady(mode, lambda: state["out"].backward(g), forward)
        assert copies == 0, mode.log
    x = qkv.detach().double().numpy()
    want_o, _ = reference.attention_varlen(x[:, 0], x[:, 1], x[:, 2], cu.numpy(), cu.numpy(),
                                           causal=True)
    assert_close(dev[0].detach().numpy(), want_o, np.float32)
    want_g = reference.attention_backward_varlen(g.double().numpy(), x[:, 0], x[:, 1], x[:, 2],
                                                 cu.numpy(), cu.numpy(), causal=True)
    for i, w in enumerate(want_g):
        assert_scaled_close(dev[1][:, i].numpy(), w, 4e-6)


def test_paged_varlen_prefill_reads_flash_attn_caches_in_place(gen):
    """``flash_attn_varlen_func(..., block_table=)`` over caches in flash-attn's tokens-first
    ``[num_blocks, page, Hkv, d]`` memory and a fused projection's q (``qkv[:, 0]`` of ``[total,
    3, H, d]``): read where they lie (the paged prefill reads the caches' row strides and q's
    strides: no torch copy; torch allocates out, written in place, the op the lse), as the host
    path and the reference."""
    hkv, d, page = 2, 8, 4
    kc, vc = (randn(gen, 6, page, hkv, d) for _ in range(2))
    table = torch.tensor([[4, 0], [1, 5]], dtype=torch.int32)
    cu_q = torch.tensor([0, 3, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 13], dtype=torch.int32)
    q = randn(gen, 5, 3, 4, d)[:, 0]

    def run():
        return (nft.flash_attn_varlen_func(q, kc, vc, cu_q, cu_k, 3, 7, causal=True,
                                           block_table=table),)

    with same_on_device(run) as (mode, driver, dev):
        c, allocs, copies = _steady(mode, run)
        assert (c.allocations, allocs, copies) == (1, 1, 0), (c.log, mode.log)
    b_rows = [torch.cat([kv[table[b].long()].reshape(-1, hkv, d) for b in range(2)])
              for kv in (kc, vc)]
    k_packed = torch.cat([b_rows[0][8 * b:8 * b + n] for b, n in ((0, 6), (1, 7))])
    v_packed = torch.cat([b_rows[1][8 * b:8 * b + n] for b, n in ((0, 6), (1, 7))])
    want, _ = reference.attention_varlen(q.double().numpy(), k_packed.double().numpy(),
                                         v_packed.double().numpy(), cu_q.numpy(), cu_k.numpy(),
                                         causal=True)
    assert_close(dev[0].numpy(), want, np.float32)


# -- flash_attn_with_kvcache ----------------------------------------------------------------------
def _kvcache_case(gen, nq, nnew, heads_first_cache, paged=False):
    b, h, hkv, cap, d = 2, 4, 2, 12, 16
    q = randn(gen, b, nq, h, d)
    n, slots = (6, 4) if paged else (b, cap)   # paged: 6 pages of 4 slots, 3 a sequence
    if heads_first_cache:   # heads-first buffers, handed over as flash-attn's layout
        kc, vc = (randn(gen, n, hkv, slots, d).transpose(1, 2) for _ in range(2))
    else:
        kc, vc = randn(gen, n, slots, hkv, d), randn(gen, n, slots, hkv, d)
    new = {} if not nnew else dict(k=randn(gen, b, nnew, hkv, d), v=randn(gen, b, nnew, hkv, d))
    if paged:
        new["block_table"] = torch.tensor([[4, 0, 2], [1, 5, 3]], dtype=torch.int32)
    return q, kc, vc, new, torch.tensor([5, 9], dtype=torch.int32)


@pytest.mark.parametrize("nq, nnew, heads_first_cache, paged, counts", [
    # (torch allocations, torch copies): out ([B, 1, H, d]: its heads-first view is
    # C-contiguous, written in place) and the lse; flash-attn's cache layout is read and
    # appended to where it lies (the kernels read its strides): no copy, no write-back
    (1, 0, False, False, (2, 0)),
    (1, 1, False, False, (2, 0)),
    (1, 1, False, True, (2, 0)),
    # heads-first caches: no copy; two query tokens: q, k, v (two new tokens each) read and
    # out written in flash-attn's [B, 2, H, d] memory through their strides: no copy
    (2, 2, True, False, (2, 0)),
], ids=["decode", "append", "paged-append", "append-2-heads-first-cache"])
def test_flash_attn_with_kvcache(gen, nq, nnew, heads_first_cache, paged, counts):
    """Decode (with and without appending k / v, in place): as the host path and the float64
    reference; a steady call replays decode's plan (1 launch, +1 with an append): no sync,
    only the lse the op allocates on the stand-in, and no copy of a cache."""
    q, kc, vc, new, lens = _kvcache_case(gen, nq, nnew, heads_first_cache, paged)
    caches = {}

    def run(where):
        k, v = caches[where] = (kc.clone(), vc.clone())   # appended to in place
        if heads_first_cache:   # clone() keeps the strides
            assert k.transpose(1, 2).is_contiguous()
        return nft.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                           return_softmax_lse=True, **new)

    host = run("host")
    with device_path() as (mode, driver):
        dev = run("device")
        _on_stream(driver)
        _equal(dev + caches["device"], host + caches["host"])
        k, v = caches["device"]
        c, allocs, copies = _steady(mode, lambda: nft.flash_attn_with_kvcache(
            q, k, v, cache_seqlens=lens, causal=True, **new))
        assert (c.allocations, c.launches) == (0, 1 + ("k" in new)), c.log
        assert (allocs, copies) == counts, mode.log
    table = new.get("block_table")
    kw = {n: _hf(x) for n, x in (("k_new", new.get("k")), ("v_new", new.get("v")))
          if x is not None}
    want = reference.kvcache_decode(_hf(q), _hf(kc), _hf(vc), lens.numpy(), causal=True,
                                    block_table=None if table is None else table.numpy(), **kw)
    assert_close(_hf(dev[0]), want[0], np.float32)
    assert_close(dev[1].numpy(), want[1], np.float32)
    assert_close(_hf(caches["device"][0]), want[2], np.float32)


def test_kvcache_int_seqlens_and_device_validation(gen):
    """An int ``cache_seqlens`` is a torch tensor made each call (one allocation, filled on
    the stream); the device path does not validate (no host read: 0 syncs) unless asked,
    while ``validate=True`` reads the lengths on the host (a sync each call, unplanned)."""
    q, kc, vc, _new, _lens = _kvcache_case(gen, 1, 0, True)
    with device_path() as (mode, _driver):
        c, allocs, copies = _steady(mode, lambda: nft.flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=7))
        assert (c.allocations, allocs, copies) == (0, 3, 0), (c.log, mode.log)
        with sd.count() as c:
            nft.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, validate=True)
        assert c.syncs >= 1 and c.d2h >= 1, c.log
        with pytest.raises(ValueError, match="cache_seqlens"):
            nft.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=13, validate=True)
    with pytest.raises(TypeError, match="validate"):
        nft.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=7, validate=1)


def test_host_path_is_unchanged():
    """Outside the test mode CPU tensors take the NumPy path (zero-copy views, validated)."""
    t = torch.ones(2, 3)
    assert isinstance(bridge.as_array(t), np.ndarray) and not bridge.is_device(t.device)
    with bridge.standin_tensors():
        assert type(bridge.as_array(t)) is sd.ndarray and bridge.is_device(t.device)
    assert isinstance(bridge.as_array(t), np.ndarray)
