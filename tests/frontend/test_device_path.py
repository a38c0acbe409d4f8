"""The device path on the stand-in device (issue 60): the real host code of every op down to the
launch, counted and checked.

* Steady calls: after a first call of a signature (which builds its launch plan), a call
  synchronises nothing, copies nothing between host and device, does no device work outside
  its launches and, with ``out=``, allocates nothing (without ``out=`` exactly its results).
* Plans replay correctly: results of replayed calls, run in the simulator from their packed
  parameter bytes (``standin.device(execute=True)``), equal the float64 reference.
* Every packed launch matches the ``.entry`` parameter list NVVM writes for its argument types
  (count, sizes, order; :mod:`numba_flash.tools.entry_params`, compiled in the compile tier's
  mode).
* A decode plan captured in a CUDA graph (the stand-in's capture refuses allocations and
  synchronisations, as CUDA does) and replayed over a growing cache gives the eager results.
* The two host-path bugs the first GPU session met: a host ``[-inf]`` no-sink array beside
  CuPy arrays (every call raised ``TypeError``), and decode on arrays known only by
  ``__cuda_array_interface__`` (an ``IndexError`` on Numba device arrays).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
import numba_flash.standin as sd
from numba_flash import reference
from numba_flash.frontend import plans
from numba_flash.tools.entry_params import entry_param_sizes

from helpers import assert_close, assert_scaled_close

F16, F32 = np.float16, np.float32

#: every launch the steady-call tests made: (name, sig, sizes), for the PTX check
LAUNCHES = {}


def _rand(rng, shape, dtype=F32):
    return rng.standard_normal(shape).astype(dtype)


def _dev(*arrays):
    return tuple(sd.asarray(a) for a in arrays)


def _steady(call, results):
    """Call twice (the first builds the plan), then once counted: returns the counters.  The
    launches of the counted call are kept for the PTX check."""
    with sd.device() as driver:
        call()
        before = plans.plan_stats()["plans"]
        call()
        n = len(driver.launches)
        with sd.count() as c:
            call()
        assert plans.plan_stats()["plans"] == before, "the second call built a plan again"
        for rec in driver.launches[n:]:
            LAUNCHES[rec.name, repr(rec.sig)] = (rec.name, rec.sig, list(rec.sizes))
    assert (c.syncs, c.d2h, c.h2d, c.foreign) == (0, 0, 0, 0), c.log
    assert c.allocations == results, c.log
    return c


def _cases(rng):
    """``{name: (call, allocations of a steady call)}``: every op on the device path."""
    b, h, hkv, n, d = 1, 4, 2, 16, 32
    q, k, v = _dev(_rand(rng, (b, h, n, d)), _rand(rng, (b, hkv, n, d)),
                   _rand(rng, (b, hkv, n, d)))
    qh, kh, vh = (sd.asarray(x.get().astype(F16)) for x in (q, k, v))
    o_out = sd.empty((b, h, n, d), F32)
    lse_out = sd.empty((b, h, n), F32)
    oh_out = sd.empty((b, h, n, d), F16)
    o, lse = numba_flash.forward(q.get(), k.get(), v.get(), causal=True, return_lse=True)
    do, o, lse = _dev(_rand(rng, o.shape), o, lse)
    grads = tuple(sd.empty(x.shape, F32) for x in (q, k, v))
    oh, lseh = _dev(*numba_flash.forward(qh.get(), kh.get(), vh.get(), causal=True,
                                         return_lse=True))
    doh = sd.asarray(do.get().astype(F16))
    gradsh = tuple(sd.empty(x.shape, F16) for x in (qh, kh, vh))
    bd, pages, page = 2, 4, 8
    qd = sd.asarray(_rand(rng, (bd, h, d)))
    kc, vc = _dev(_rand(rng, (bd * pages, hkv, page, d)), _rand(rng, (bd * pages, hkv, page, d)))
    table = sd.asarray(rng.permutation(bd * pages).reshape(bd, pages).astype(np.int32))
    lens = sd.asarray(np.array([5, 27], np.int32))
    kcc, vcc = _dev(_rand(rng, (bd, hkv, 32, d)), _rand(rng, (bd, hkv, 32, d)))
    od = sd.empty((bd, h, d), F32)
    kn, vn = _dev(_rand(rng, (bd, hkv, 1, d)), _rand(rng, (bd, hkv, 1, d)))
    cos, sin = _dev(_rand(rng, (64, d // 2)), _rand(rng, (64, d // 2)))
    lat = sd.asarray(_rand(rng, (bd * pages, 1, page, 128), F16))
    ql = sd.asarray(_rand(rng, (bd, 16, 128), F16))
    ol = sd.empty((bd, 16, 64), F16)
    po, pl = _dev(_rand(rng, (3, bd, h, d)), _rand(rng, (3, bd, h)))
    e4m3 = ml_dtypes.float8_e4m3fn   # CuPy's form: uint8 bytes with qkv_dtype="fp8_e4m3"
    q8, k8, v8 = (sd.asarray(_rand(rng, x.shape).astype(e4m3).view(np.uint8))
                  for x in (q, k, v))
    o8 = sd.empty((b, h, n, d), ml_dtypes.bfloat16)
    kc8, vc8 = (sd.asarray(_rand(rng, x.shape).astype(e4m3).view(np.uint8)) for x in (kc, vc))
    plan = numba_flash.decode_plan(qd, kc, vc, cache_seqlens=lens, block_table=table)
    return {
        "forward simt": (lambda: numba_flash.forward(q, k, v, causal=True, out=o_out), 0),
        "forward simt, no out": (lambda: numba_flash.forward(q, k, v, return_lse=True), 2),
        "forward simt, lse_out": (lambda: numba_flash.forward(
            q, k, v, return_lse=True, out=o_out, lse_out=lse_out), 0),
        "forward mma": (lambda: numba_flash.forward(qh, kh, vh, causal=True, kernel="mma",
                                                    out=oh_out), 0),
        "forward wgmma": (lambda: numba_flash.forward(qh, kh, vh, kernel="wgmma",
                                                      out=oh_out), 0),
        "forward e4m3": (lambda: numba_flash.forward(q8, k8, v8, causal=True, out=o8,
                                                     qkv_dtype="fp8_e4m3"), 0),
        "backward simt": (lambda: numba_flash.backward(do, q, k, v, o, lse, causal=True,
                                                       out=grads), 0),
        "backward mma": (lambda: numba_flash.backward(doh, qh, kh, vh, oh, lseh, causal=True,
                                                      kernel="mma", out=gradsh), 0),
        "decode paged": (lambda: numba_flash.decode(qd, kc, vc, cache_seqlens=lens,
                                                    block_table=table, out=od), 0),
        "decode contiguous, splits": (lambda: numba_flash.decode(
            qd, kcc, vcc, cache_seqlens=lens, num_splits=3, out=od), 0),
        "decode k_new rotary": (lambda: numba_flash.decode(
            qd, kcc, vcc, cache_seqlens=lens, k_new=kn, v_new=vn, rotary_cos=cos,
            rotary_sin=sin, causal=True, out=od), 0),
        "decode e4m3 cache": (lambda: numba_flash.decode(
            qd, kc8, vc8, cache_seqlens=lens, block_table=table, kv_cache_dtype="fp8_e4m3",
            out=od), 0),
        "decode mla": (lambda: numba_flash.decode(ql, lat, None, cache_seqlens=lens,
                                                  block_table=table, head_dim_v=64, out=ol), 0),
        "decode plan run": (lambda: plan.run(qd, kc, vc, lens, table, out=od), 0),
        "append_kv": (lambda: numba_flash.append_kv(kcc, vcc, kn, vn, lens), 1),
        "apply_rotary": (lambda: numba_flash.apply_rotary(kn, cos, sin, seqlen_offsets=lens), 1),
        "merge_states": (lambda: numba_flash.merge_states(po, pl), 2),
    }


@pytest.fixture(scope="module")
def cases():
    return _cases(np.random.default_rng(60))


NAMES = ["forward simt", "forward simt, no out", "forward simt, lse_out", "forward mma",
         "forward wgmma", "forward e4m3",
         "backward simt", "backward mma", "decode paged", "decode contiguous, splits",
         "decode k_new rotary", "decode e4m3 cache", "decode mla", "decode plan run",
         "append_kv", "apply_rotary", "merge_states"]


def test_the_cases_are_every_op(cases):
    assert sorted(cases) == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_a_steady_call_syncs_copies_and_allocates_nothing(cases, name):
    call, results = cases[name]
    _steady(call, results)


def test_replayed_calls_are_right(rng):
    """Replays (plan-built) run in the simulator from their packed bytes: forward (SIMT and
    tensor cores), backward, paged decode and its plan, against the float64 reference."""
    q, k, v, do = (_rand(rng, (1, 2, 8, 16)) for _ in range(4))
    want_o, want_lse = reference.attention(q, k, v, causal=True)
    want_g = reference.attention_backward(do, q, k, v, causal=True)
    dq, dk, dv, ddo = _dev(q, k, v, do)
    with sd.device(execute=True):
        for _ in range(2):
            o, lse = numba_flash.forward(dq, dk, dv, causal=True, return_lse=True)
        assert_close(o.get(), want_o, F32)
        assert_close(lse.get(), want_lse, F32)
        for _ in range(2):
            grads = numba_flash.backward(ddo, dq, dk, dv, o, lse, causal=True)
        for got, want in zip(grads, want_g):
            assert_scaled_close(got.get(), want, 4e-6)
        qh, kh, vh = (sd.asarray(x.astype(F16)) for x in (q, k, v))
        for _ in range(2):
            oh = numba_flash.forward(qh, kh, vh, causal=True, kernel="mma")
        assert_scaled_close(oh.get().astype(np.float64), want_o, 2e-3)
    qd = _rand(rng, (2, 4, 16))
    kc, vc = _rand(rng, (6, 2, 4, 16)), _rand(rng, (6, 2, 4, 16))
    table = rng.permutation(6).reshape(2, 3).astype(np.int32)
    lens = np.array([3, 11], np.int32)
    want = reference.paged_decode(qd, kc, vc, lens, table)[0]
    args = _dev(qd, kc, vc, lens, table)
    with sd.device(execute=True):
        plan = numba_flash.decode_plan(args[0], args[1], args[2], cache_seqlens=args[3],
                                       block_table=args[4])
        for _ in range(2):
            assert_close(numba_flash.decode(*args[:3], cache_seqlens=args[3],
                                            block_table=args[4]).get(), want, F32)
            assert_close(plan.run(*args).get(), want, F32)


def test_every_launch_matches_its_ptx_parameters(cases, request):
    """The packed parameters of every launch above against the ``.entry`` list NVVM writes for
    the same argument types (one subprocess in the compile tier's mode; cached by signature in
    pytest's cache)."""
    for call, results in cases.values():   # (again: the tests above may run elsewhere)
        _steady(call, results)
    store = getattr(request.config, "cache", None)   # (none under -p no:cacheprovider)
    cache = None if store is None else store.mkdir("entry-params") / "sizes.json"
    sigs = [sig for _, sig, _ in LAUNCHES.values()]
    want = entry_param_sizes(sigs, cache=None if cache is None else str(cache))
    names = {n for n, _, _ in LAUNCHES.values()}
    assert {"flash_forward", "flash_forward_mma", "flash_forward_wgmma", "flash_forward_fp8",
            "decode_split",
            "append_kv", "merge_states"} <= names, names
    for name, sig, sizes in LAUNCHES.values():
        assert sizes == want[repr(sig)], f"{name}: packed {sizes} != PTX {want[repr(sig)]}"


def test_a_decode_plan_replays_in_a_graph_over_a_growing_cache(rng):
    """flash_attn_with_kvcache's loop: each step appends one token (k_new / v_new) and decodes;
    the step's run is captured once (no allocation, no synchronisation: the capture would
    raise) and the graph replayed for every later step, the step's values written into the
    captured arrays and the lengths advanced on the device between replays: every step's
    ``o`` equals the eager decode of the same cache."""
    b, h, hkv, d, cap = 2, 4, 2, 16, 12
    k0, v0 = _rand(rng, (b, hkv, cap, d)), _rand(rng, (b, hkv, cap, d))
    lens0 = np.array([2, 5], np.int32)
    qd, kn, vn = (sd.asarray(_rand(rng, s)) for s in ((b, h, d), (b, hkv, 1, d), (b, hkv, 1, d)))
    kc, vc, lens = sd.asarray(k0), sd.asarray(v0), sd.asarray(lens0)
    out = sd.empty((b, h, d), F32)
    kk, vv, ll = k0.copy(), v0.copy(), lens0.copy()
    stream = sd.cuda.Stream()   # a plan launches on the stream it was made on
    with sd.device(execute=True), stream:
        plan = numba_flash.decode_plan(qd, kc, vc, cache_seqlens=lens, k_new=kn, v_new=vn,
                                       causal=True, out=out)
        if True:
            stream.begin_capture()
            plan.run(qd, kc, vc, lens, k_new=kn, v_new=vn, out=out)
            graph = stream.end_capture()
        for step in range(4):
            for x in (qd, kn, vn):   # the step's values, into the captured arrays
                x.set(_rand(rng, x.shape))
            graph.launch(stream)
            want = reference.kvcache_decode(qd.get(), kk, vv, ll, k_new=kn.get(),
                                            v_new=vn.get(), causal=True)
            assert_close(out.get(), want[0], F32, name=f"o at step {step}")
            kk, vv = want[2], want[3]
            np.testing.assert_array_equal(kc.get(), kk)   # the graph appended the token
            lens[...] = lens + 1                           # the caller's length update
            ll = ll + 1


def test_a_capture_refuses_an_allocating_call(rng):
    """The stand-in's capture is strict: a decode call that allocates its output (no ``out``)
    raises inside a capture, as CUDA refuses a cudaMalloc there."""
    qd = sd.asarray(_rand(rng, (1, 2, 8)))
    kc = sd.asarray(_rand(rng, (1, 1, 4, 8)))
    lens = sd.asarray(np.array([3], np.int32))
    numba_flash.decode(qd, kc, kc, cache_seqlens=lens)
    stream = sd.cuda.Stream()
    with stream, pytest.raises(sd.CaptureError, match="allocation"):
        stream.begin_capture()
        try:
            numba_flash.decode(qd, kc, kc, cache_seqlens=lens)
        finally:
            stream.end_capture()


def test_no_host_array_reaches_the_array_library(rng):
    """The first GPU session's bug: the host ``[-inf]`` array of "no sink" went to a CuPy
    function (every CuPy call raised TypeError).  The stand-in refuses NumPy arrays where CuPy
    does: every op without and with a (device) sink runs."""
    q, k, v = _dev(*(_rand(rng, (1, 2, 8, 16)) for _ in range(3)))
    sink = sd.asarray(np.array([-np.inf, 0.5], F32))
    with sd.device(execute=True):
        for s in (None, sink):
            o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True,
                                         learnable_sink=s)
            numba_flash.backward(o, q, k, v, o, lse, causal=True, learnable_sink=s)
            numba_flash.decode(q[:, :, 0], k, v, learnable_sink=s,
                               cache_seqlens=sd.asarray(np.array([8], np.int32)))


def test_decode_on_cuda_array_interface_objects(rng):
    """The first GPU session's other bug (decode's IndexError on Numba device arrays): inputs
    known only by ``__cuda_array_interface__`` are imported as views (no copy, no
    synchronisation) and decode right."""
    qd, kc, vc = _rand(rng, (2, 4, 16)), _rand(rng, (2, 2, 8, 16)), _rand(rng, (2, 2, 8, 16))
    lens = np.array([3, 8], np.int32)
    args = [sd.CAIArray(sd.asarray(x)) for x in (qd, kc, vc, lens)]
    with sd.device(execute=True), sd.count() as c:
        o = numba_flash.decode(*args[:3], cache_seqlens=args[3])
    assert c.syncs == 0 and c.h2d == 0 and c.d2h == 0
    assert isinstance(o, sd.CAIArray)   # the producer's kind back (a Numba device array)
    assert_close(sd.asarray(o).get(), reference.paged_decode(qd, kc, vc, lens)[0], F32)
