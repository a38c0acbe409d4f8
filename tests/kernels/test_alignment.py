"""The hardware's alignment rules in the simulator (issue 62, parts 1 and 2).

A GPU faults (``CUDA_ERROR_MISALIGNED_ADDRESS``) on a vector access whose byte address is not a
multiple of its size; the simulator's twins now check the real address
(:mod:`numba_flash.kernels.ptx.address`) and raise :class:`MisalignedAddressError`, naming the
kernel, the thread, the array and the address.  Here:

* the twins' rules, instruction by instruction, in small probe kernels (the stages' own
  kernels and two written here) launched directly on offset views;
* the host predicates that choose a vectorised build check the real pointers (in the
  simulator too), and the e4m3 forward copies a misaligned input;
* each op that has a vectorised build, on views 1, 2, 4 and 8 bytes past a 64-byte boundary:
  the host check takes the element-wise build (or a copy), and the result matches the float64
  reference at the op's own test bound; the same call with the host check bypassed (the
  predicate told the arrays are aligned) launches the vectorised build and raises
  :class:`MisalignedAddressError`.

An offset view reaches a simulated kernel at its own address: the front end hands a contiguous
NumPy input over without a copy (numba_flash/frontend/arrays.py), as a GPU takes a CuPy view.
Tiny shapes: the simulator's tier.
"""

from __future__ import annotations

import numpy as np
import pytest
from ml_dtypes import bfloat16, float8_e4m3fn
from numba import cuda, types

import numba_flash
from numba_flash import reference as ref
from numba_flash import simulator
from numba_flash.kernels.decode import config as dconfig
from numba_flash.kernels.forward import config as fconfig
from numba_flash.kernels.forward import mma as fmma
from numba_flash.kernels.ptx import address, stages, wgmma
from numba_flash.kernels.ptx.address import MisalignedAddressError
from numba_flash.ops import forward_fp8 as fp8_op
from tests.helpers import assert_close, assert_scaled_close

pytestmark = pytest.mark.skipif(numba_flash.backend() != "simulator",
                                reason="the simulator's twins and launch checks")


def offset_view(x, off):
    """A copy of ``x`` whose data starts ``off`` bytes past a 64-byte boundary (a view into a
    larger byte buffer, as ``np.empty(n + 64, np.uint8)[at:at + n].view(dtype)``)."""
    x = np.asarray(x)
    buf = np.empty(x.nbytes + 128, np.uint8)
    at = -buf.__array_interface__["data"][0] % 64 + off
    out = buf[at:at + x.nbytes].view(x.dtype).reshape(x.shape)
    out[...] = x
    assert address.data_pointer(out) % 64 == off
    return out


def device(x, off):
    """The simulator's device array over :func:`offset_view` ``(x, off)`` (no copy)."""
    return simulator.device_view(offset_view(x, off))


def launch(kernel, blocks, threads, *args):
    with simulator.fast_switching():
        kernel[blocks, threads](*args)


# -- the twins' rules ------------------------------------------------------------------------
def test_error_type_and_model():
    """A RuntimeError (the launch fails) and a ValueError (the twins' earlier checks); shared
    addresses are the offset in the allocation from a 16-byte (not 32-byte) aligned base."""
    assert issubclass(MisalignedAddressError, RuntimeError)
    assert issubclass(MisalignedAddressError, ValueError)
    assert address.SHARED_BASE % 16 == 0 and address.SHARED_BASE % 32 == 16
    smem = np.zeros(64, np.float32)
    assert address.shared_address(smem, 32) == address.SHARED_BASE + 32
    assert address.shared_address(smem[3:], 4) == address.SHARED_BASE + 16
    assert address.shared_address(smem.reshape(8, 8)[1], 0) == address.SHARED_BASE + 32
    assert wgmma.smem_address(smem) == address.SHARED_BASE


def test_load16_checks_the_address_not_the_element_index(rng):
    """ld.global.nc.v4 (16): element 0 of a float32 view 8 bytes past a boundary is misaligned
    (the index from the array's start was the old check); the error names the kernel, the
    thread, the argument and the address.  At a 16-byte offset the same kernel reads."""
    src = rng.standard_normal(64).astype(np.float32)
    elems = np.array([0, 4, 8], np.int32)
    out = np.zeros((3, 4), np.float32)
    launch(stages.load16_kernel(4), 1, 3, device(src, 16), elems, out)
    np.testing.assert_array_equal(out, src[:12].reshape(3, 4))
    dsrc = device(src, 8)
    with pytest.raises(MisalignedAddressError) as err:
        launch(stages.load16_kernel(4), 1, 3, dsrc, elems, out)
    msg = str(err.value)
    addr = address.data_pointer(dsrc)
    for part in ("load16: expected a multiple of 16 bytes", "kernel load16_probe",
                 "block (0, 0, 0), thread (", "kernel argument 'src'", "ld.global.nc.v4.u32"):
        assert part in msg, (part, msg)
    assert any(f"{a:#x}" in msg for a in (addr, addr + 16, addr + 32)), msg


def test_launch_checks_every_array_is_aligned_to_its_element():
    """A float32 argument 2 bytes past a boundary: every plain load of it faults, so the launch
    refuses it, naming the kernel and the argument."""
    elems = np.zeros(1, np.int32)
    out = np.zeros((1, 4), np.float32)
    with pytest.raises(MisalignedAddressError,
                       match=r"kernel load16_probe argument 'src' \(float32, 4-byte elements\) "
                             r"at global address 0x[0-9a-f]+2, not a multiple of 4"):
        launch(stages.load16_kernel(4), 1, 1, device(np.zeros(16, np.float32), 2), elems, out)


def test_cp_async_needs_both_addresses_16_byte_aligned(rng):
    """The tile copy's cp.async: a source row start 8 bytes off (a float16 view at +8) raises
    in the copying thread; a shared destination byte 8 raises too (the twin, host call)."""
    ROWS, D = 32, 16
    src = rng.integers(0, 0x7C00, (ROWS, D)).astype(np.uint16)   # finite float16 bits
    out = np.zeros((1, ROWS, D), np.uint32)
    flags = np.zeros(1, np.int32)
    kernel = stages.tile_copy_kernel(ROWS, D, 32, True, 1)
    launch(kernel, 1, 32, device(src, 16), out, np.int32(D), np.int32(ROWS), flags)
    np.testing.assert_array_equal(out[0], src)
    with pytest.raises(MisalignedAddressError,
                       match=r"cp_async16: expected a 16-byte aligned global address.*the source "
                             r"src \(kernel argument 'src'\).*kernel tile_copy, block"):
        launch(kernel, 1, 32, device(src, 8), out, np.int32(D), np.int32(ROWS), flags)
    smem = np.zeros(16, np.uint32)
    with pytest.raises(MisalignedAddressError,
                       match=r"cp_async16: expected a 16-byte aligned shared address, got "
                             r"0x2018 \(byte 8 of the destination smem\).*a host call"):
        stages.cp_async16(smem, 8, src, 0, 16)


def test_lds16_checks_the_shared_address_of_a_view():
    """ld.shared.v4: byte 0 of a view 4 bytes into the allocation is misaligned; 16 in is
    fine."""
    smem = np.arange(32, dtype=np.float32)
    assert stages.lds16(smem[4:], 0) == tuple(smem[4:8])
    with pytest.raises(MisalignedAddressError, match=r"lds16: expected a 16-byte aligned "
                                                      r"shared address, got 0x2014"):
        stages.lds16(smem[1:], 0)


@cuda.jit
def ldmatrix_at(tile, byte0, regs):
    """One warp: lane ``l`` points ``ldmatrix`` at shared byte ``byte0 + 16 l``."""
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(256, types.uint32)
    for i in range(lane, 256, 32):
        smem[i] = tile[i]
    cuda.syncthreads()
    r0, r1, r2, r3 = stages.ldmatrix_x4(smem, byte0 + 16 * lane)
    regs[lane, 0] = r0


def test_ldmatrix_checks_each_lanes_row_address(rng):
    tile = rng.integers(0, 2**32, 256, dtype=np.uint32)
    regs = np.zeros((32, 4), np.uint32)
    launch(ldmatrix_at, 1, 32, tile, np.int32(0), regs)
    with pytest.raises(MisalignedAddressError,
                       match=r"ldmatrix: expected a 16-byte aligned shared address.*"
                             r"ldmatrix.sync.aligned.m8n8.x4.shared.b16 .*kernel ldmatrix_at"):
        launch(ldmatrix_at, 1, 32, tile, np.int32(8), regs)


@cuda.jit
def words_at(src, out):
    i = cuda.threadIdx.x
    out[i] = stages.load_at(src, i)
    stages.red_add(out, i, np.float32(0.0))


def test_element_loads_and_red_add_are_naturally_aligned():
    """load_at (an e4m3 cache's uint32 words: 4), load_u16 (2), red.add.f32 (4): the twins'
    host calls on offset NumPy views; in a kernel the launch check sees them first."""
    words = offset_view(np.arange(8, dtype=np.uint32), 2)
    with pytest.raises(MisalignedAddressError, match=r"load_at: expected a 4-byte aligned "
                                                      r"global address.*ld.global.b32"):
        stages.load_at(words, 1)
    with pytest.raises(MisalignedAddressError, match="load_u16: expected a 2-byte aligned"):
        stages.load_u16(offset_view(np.arange(8, dtype=np.uint16), 1), 0)
    with pytest.raises(MisalignedAddressError, match="red_add: expected a 4-byte aligned"):
        stages.red_add(offset_view(np.zeros(4, np.float32), 2), 0, np.float32(1.0))
    out = np.zeros(8, np.float32)
    with pytest.raises(MisalignedAddressError, match="kernel words_at argument 'src'"):
        launch(words_at, 1, 8, simulator.device_view(words), out)
    launch(words_at, 1, 8, device(np.arange(8, dtype=np.uint32), 4), out)
    np.testing.assert_array_equal(out, np.arange(8))


def test_wgmma_swizzled_start_must_sit_in_its_patterns_first_row():
    desc = wgmma.encode_descriptor(0x2400 + 3 * 128, 16, 1024, 128)   # row 3 of its pattern
    with pytest.raises(MisalignedAddressError, match="first 128-byte row of its 1024-byte "
                                                     "aligned swizzle pattern"):
        wgmma.operand_addresses(desc, "K", 64)


# -- the host predicates ---------------------------------------------------------------------
@pytest.mark.parametrize("off", [1, 2, 4, 8])
def test_vector_predicates_read_real_pointers(off):
    """The build choices of forward mma / wgmma / backward mma (``vector_copies``), the SIMT
    forward (``vector_tiles``) and decode (``vector_loads``, ``aligned_to``): False for a view
    ``off`` bytes past a 16-byte boundary, on device arrays and NumPy arrays alike."""
    x16 = np.zeros((4, 16), np.float16)
    good = simulator.device_view(offset_view(x16, 0))
    for bad in (device(x16, off), offset_view(x16, off)):
        assert fmma.vector_copies(16, 16, good) and not fmma.vector_copies(16, 16, good, bad)
        assert not fmma.vector_copies(16, 32, good, bad, d_v=8)
        assert not dconfig.vector_loads(np.float16, 16, 16, 8, good, bad)
        assert not fconfig.vector_tiles(np.float32, 16, 16, good, bad.view(np.uint8))
        assert dconfig.aligned_to(off, bad) and not dconfig.aligned_to(2 * off, bad)
    assert fconfig.vector_tiles(np.float32, 16, 16, good)


def test_e4m3_inputs_are_copied_aligned():
    x = np.arange(96, dtype=np.uint8).reshape(2, 48)
    same = offset_view(x, 16)
    assert fp8_op.aligned_input(same, 16) is same
    for off, align in ((1, 16), (8, 16), (2, 4)):
        view = offset_view(x, off)
        got = fp8_op.aligned_input(view, align)
        assert got is not view and address.data_pointer(got) % 64 == 0
        np.testing.assert_array_equal(got, x)
    assert fp8_op.FP8_ALIGN == {"q": 16, "k": 16, "v": 4}


# -- the ops ---------------------------------------------------------------------------------
def frontend_takes_misaligned_elements():
    """True while the front end hands a NumPy view that is not aligned to its element size to
    the kernel as it is (a GPU faults on every element of it: issue 62, the front end's part)."""
    from numba_flash.frontend.arrays import ArrayCall

    x = offset_view(np.zeros(8, np.float16), 1)
    dx = ArrayCall({"x": x}).input(x)
    return address.data_pointer(dx) % 2 != 0


def one_byte_call(fn):
    """``fn()`` on an input 1 byte off (for 2-byte elements, misaligned for every access): the
    front end copies it (the result is checked by the caller) or raises a ValueError naming the
    argument (returns None)."""
    assert not frontend_takes_misaligned_elements()   # it copies such a view
    try:
        return fn()
    except ValueError as exc:
        assert not isinstance(exc, MisalignedAddressError), exc
        assert str(exc).split(":")[0] in ("q", "k", "v", "do", "k_cache", "v_cache", "o"), exc
        return None


def forced(monkeypatch, module, name, keep):
    """Bypass the host check ``module.name``: called without the arrays (only the shape rules
    ``keep`` of its arguments), so the vectorised build launches on misaligned views."""
    orig = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: orig(*a[:keep], **kw))


MMA_TOL = {np.dtype(np.float16): 2e-3, np.dtype(bfloat16): 1.6e-2}


def offsets(dtype):
    """Three offsets (for q, k, v) below 16 that keep ``dtype``'s elements aligned: float16 8,
    4, 2; float32 8, 4, 4; float64 8, 8, 8."""
    size = np.dtype(dtype).itemsize
    return tuple(max(o, size) for o in (8, 4, 2))


@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_forward_mma(rng, monkeypatch, dtype):
    q, k, v = (rng.standard_normal((1, 2, n, 16)).astype(dtype) for n in (9, 11, 11))
    want = ref.attention(q, k, v, causal=True)[0]
    o = numba_flash.forward(*map(offset_view, (q, k, v), offsets(dtype)), causal=True,
                            kernel="mma")
    assert_scaled_close(o, want, MMA_TOL[np.dtype(dtype)], name="o")
    import numba_flash.ops.forward_mma as op

    with monkeypatch.context() as m:
        forced(m, op, "vector_copies", 2)
        with pytest.raises(MisalignedAddressError, match=r"cp_async16.*kernel argument 'v'.*"
                                                          r"kernel flash_forward_mma, block"):
            numba_flash.forward(q, k, offset_view(v, 8), causal=True, kernel="mma")
    o = one_byte_call(lambda: numba_flash.forward(q, offset_view(k, 1), v, causal=True,
                                                  kernel="mma"))
    if o is not None:
        assert_scaled_close(o, want, MMA_TOL[np.dtype(dtype)], name="o")


def test_forward_wgmma(rng, monkeypatch):
    q, k, v = (rng.standard_normal((1, 1, n, 64)).astype(np.float16) for n in (9, 11, 11))
    want = ref.attention(q, k, v)[0]
    o = numba_flash.forward(*map(offset_view, (q, k, v), (2, 4, 8)), kernel="wgmma")
    assert_scaled_close(o, want, 2e-3, name="o")
    import numba_flash.ops.forward_wgmma as op

    forced(monkeypatch, op, "vector_copies", 2)
    with pytest.raises(MisalignedAddressError, match=r"cp_async16.*kernel argument 'k'.*kernel "
                                                      r"flash_forward_wgmma"):
        numba_flash.forward(q, offset_view(k, 8), v, kernel="wgmma")


def test_forward_simt_float32(rng, monkeypatch):
    """The SIMT forward's cp.async build (``vector_tiles``: float32 rows of whole 16-byte
    chunks)."""
    q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(np.float32) for n in (5, 7, 7))
    want = ref.attention(q, k, v)[0]
    o = numba_flash.forward(*map(offset_view, (q, k, v), offsets(np.float32)), kernel="simt")
    assert_close(o, want, np.float32)
    import numba_flash.ops.forward as op

    with monkeypatch.context() as m:
        forced(m, op, "vector_tiles", 3)
        with pytest.raises(MisalignedAddressError, match=r"cp_async16.*kernel argument 'q'"):
            numba_flash.forward(offset_view(q, 8), k, v, kernel="simt")
    o = one_byte_call(lambda: numba_flash.forward(q, k, offset_view(v, 2), kernel="simt"))
    if o is not None:
        assert_close(o, want, np.float32)


def fp8_inputs(rng, d):
    q, k, v = (rng.standard_normal((1, 1, n, d)).astype(float8_e4m3fn) for n in (9, 11, 11))
    scales = [np.full((1, 1), s, np.float32) for s in (0.5, 1.5, 2.0)]
    return q, k, v, scales


def fp8_reference(q, k, v, scales):
    return ref.attention(*(ref.dequantize(x, s) for x, s in zip((q, k, v), scales)))[0]


@pytest.mark.parametrize("kernel, d, offs", [("mma", 32, (1, 8, 4)), ("wgmma", 64, (4, 2, 1))])
def test_forward_e4m3(rng, monkeypatch, kernel, d, offs):
    """q and k 16-byte aligned or copied, v 4-byte (``offs`` of q, k, v: mma keeps v at +4 in
    place, wgmma copies v at +1); the result at the fp8 tests' bound (4 % of max |v|).  The
    copy bypassed: the kernel's cp.async of q raises; a v at +2 (its uint32 words at 2 mod 4)
    fails the launch."""
    q, k, v, scales = fp8_inputs(rng, d)
    want = fp8_reference(q, k, v, scales)
    kw = dict(q_descale=scales[0], k_descale=scales[1], v_descale=scales[2], kernel=kernel)
    o = numba_flash.forward(*(offset_view(x, off) for x, off in zip((q, k, v), offs)), **kw)
    vmax = np.abs(ref.dequantize(v, scales[2])).max()
    assert np.abs(o.astype(np.float64) - want).max() <= 0.04 * vmax
    monkeypatch.setattr(fp8_op, "aligned_input", lambda x, align: x)
    name = "flash_forward_fp8" if kernel == "mma" else "flash_forward_wgmma_fp8"
    with pytest.raises(MisalignedAddressError, match=rf"cp_async16.*kernel argument 'q'.*"
                                                     rf"kernel {name}, block"):
        numba_flash.forward(offset_view(q, 8), k, v, **kw)
    with pytest.raises(MisalignedAddressError, match=rf"kernel {name} argument 'v' \(uint32"):
        numba_flash.forward(q, k, offset_view(v, 2), **kw)


DECODE_D = {np.dtype(np.float16): 32, np.dtype(bfloat16): 32, np.dtype(np.float32): 16,
            np.dtype(np.float64): 8}


@pytest.mark.parametrize("dtype", [np.float16, bfloat16, np.float32, np.float64])
def test_decode_split_kv(rng, monkeypatch, dtype):
    """The split-KV decode's 16-byte loads (``d`` = one 16-byte chunk a lane here)."""
    d = DECODE_D[np.dtype(dtype)]
    lens = np.array([7])
    k, v = (rng.standard_normal((1, 1, 12, d)).astype(dtype) for _ in range(2))
    q = rng.standard_normal((1, 2, 1, d)).astype(dtype)
    want_o, _ = ref.paged_decode(q, k, v, lens)
    if dtype == bfloat16:
        check = lambda o: assert_scaled_close(o, want_o, 1.6e-2, name="o")   # noqa: E731
    else:
        check = lambda o: assert_close(o, want_o, dtype, name="o")   # noqa: E731
    check(numba_flash.decode(*map(offset_view, (q, k, v), offsets(dtype)), cache_seqlens=lens,
                             kernel="simt"))
    import numba_flash.ops.decode as op

    with monkeypatch.context() as m:
        forced(m, op, "vector_loads", 4)
        with pytest.raises(MisalignedAddressError, match=r"load16.*kernel argument 'k_cache'.*"
                                                          r"kernel decode_split, block"):
            numba_flash.decode(q, offset_view(k, 8), v, cache_seqlens=lens, kernel="simt")
    o = one_byte_call(lambda: numba_flash.decode(q, k, offset_view(v, 1), cache_seqlens=lens,
                                                 kernel="simt"))
    if o is not None:
        check(o)


def test_decode_split_kv_e4m3_cache(rng):
    """e4m3 caches: 16-byte loads at a 16-byte boundary, 32-bit words at 4 mod 16; at 1 or 2
    mod 4 the op raises a ValueError naming the cache (a GPU would fault on the words)."""
    d, lens = 32, np.array([7])
    k, v = (rng.standard_normal((1, 1, 12, d)).astype(float8_e4m3fn) for _ in range(2))
    q = rng.standard_normal((1, 2, 1, d)).astype(np.float16)
    kd = np.full((1, 1), 1.5, np.float32)
    vd = np.full((1, 1), 0.5, np.float32)
    want_o, _ = ref.paged_decode(q, ref.dequantize(k, kd), ref.dequantize(v, vd), lens)
    kw = dict(cache_seqlens=lens, k_descale=kd, v_descale=vd, kernel="simt")
    o = numba_flash.decode(q, offset_view(k, 4), offset_view(v, 8), **kw)
    assert_scaled_close(o, want_o, 2e-3, name="o")
    for off in (1, 2):
        with pytest.raises(ValueError, match="^v_cache: expected a 4-byte aligned e4m3 cache"):
            numba_flash.decode(q, k, offset_view(v, off), **kw)


def test_decode_mla(rng, monkeypatch):
    """MLA's tensor-core decode (cp.async only): the check bypassed, the MLA kernel raises on
    an offset q; with it, an offset q or latent cache takes the split-KV kernel under
    ``kernel="auto"``."""
    lens = np.array([7])
    lat = rng.standard_normal((1, 1, 12, 64)).astype(np.float16)
    q = rng.standard_normal((1, 4, 1, 64)).astype(np.float16)
    want_o, _ = ref.paged_decode(q, lat, lat, lens)
    kw = dict(cache_seqlens=lens, head_dim_v=64)
    import numba_flash.ops.decode as op

    with monkeypatch.context() as m:
        forced(m, op, "vector_copies", 2)
        with pytest.raises(MisalignedAddressError, match=r"cp_async16.*kernel argument 'q'.*"
                                                          r"kernel mla_decode, block"):
            numba_flash.decode(offset_view(q, 8), lat, None, kernel="mma", **kw)
    o = numba_flash.decode(offset_view(q, 8), offset_view(lat, 4), None, **kw)
    assert_close(o, want_o, np.float16, name="o")   # auto: _mma_decode sees the offsets


@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_backward_mma(rng, monkeypatch, dtype):
    do, q, k, v = (rng.standard_normal((1, 1, n, 16)).astype(dtype) for n in (9, 9, 11, 11))
    o, lse = numba_flash.forward(q, k, v, return_lse=True, kernel="mma")
    refs = ref.attention_backward(do, q, k, v)
    grads = numba_flash.backward(offset_view(do, 4), offset_view(q, 8), k, offset_view(v, 2),
                                 o, lse, kernel="mma")
    tol = 2.5e-3 if dtype == np.float16 else 2e-2
    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
        assert_scaled_close(got, want, tol, name=name)
    import numba_flash.ops.backward_mma as op

    forced(monkeypatch, op, "vector_copies", 2)
    with pytest.raises(MisalignedAddressError, match=r"cp_async16.*kernel argument 'k'"):
        numba_flash.backward(do, q, offset_view(k, 8), v, o, lse, kernel="mma")


@pytest.mark.parametrize("dtype", [np.float16, float8_e4m3fn])
def test_append_kv(rng, dtype):
    """The append writes element by element (no vectorised build): a cache at any offset of
    its element size is written in place (e4m3: any offset); a float16 cache 1 byte off is
    misaligned for every write: the front end copies it (and writes it back) or the op raises
    naming the cache, and the kernel launched on it fails."""
    d, lens = 16, np.array([5])
    k0, v0 = (rng.standard_normal((1, 1, 8, d)).astype(dtype) for _ in range(2))
    kn, vn = (rng.standard_normal((1, 1, 2, d)).astype(np.float16) for _ in range(2))
    want_k, want_v, _ = ref.append_kv(k0, v0, kn, vn, lens)
    offs = (1, 2) if dtype == float8_e4m3fn else (2, 8)
    kc, vc = offset_view(k0, offs[0]), offset_view(v0, offs[1])
    numba_flash.append_kv(kc, vc, kn, vn, lens)
    np.testing.assert_array_equal(kc.view(np.uint8), want_k.view(np.uint8))
    np.testing.assert_array_equal(vc.view(np.uint8), want_v.view(np.uint8))
    if dtype == float8_e4m3fn:
        return
    from numba_flash.kernels.cache.append import append_kernel

    with pytest.raises(MisalignedAddressError, match="kernel append_kv argument 'k_cache'"):
        launch(append_kernel(32, np.float16, False), 2, 32, device(k0, 1).reshape(8, d),
               simulator.device_view(v0.reshape(8, d).copy()), kn, vn, lens.astype(np.int32),
               np.zeros((1, 1), np.int32), np.zeros(1, np.int32), np.int32(1), np.int32(8),
               np.ones((2, 1, 1), np.float32))
    kc = offset_view(k0, 1)
    if one_byte_call(lambda: numba_flash.append_kv(kc, v0.copy(), kn, vn, lens)) is not None:
        np.testing.assert_array_equal(kc, want_k)
