"""The stand-in device (numba_flash.standin): it plays CuPy for the front end's device path, so
its own rules are tested first: no implicit host conversion, every synchronisation, copy,
allocation and piece of foreign device work counted, stream capture refusing what CUDA refuses,
and launches rebuilt from their packed parameter bytes alone."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
import numba_flash.standin as sd
from numba_flash.frontend.launch import PreparedLaunch, arg_type, param_sizes

from helpers import assert_close


def test_arrays_are_aligned_device_memory():
    x = sd.empty((3, 5), np.float32)
    assert x.data.ptr % sd.ALIGNMENT == 0
    assert x.shape == (3, 5) and x.strides == (20, 4) and x.flags.c_contiguous
    cai = x.__cuda_array_interface__
    assert cai["data"][0] == x.data.ptr and cai["shape"] == (3, 5) and cai["version"] == 3
    v = x[1:]
    assert v.data.ptr == x.data.ptr + 20   # a view: same memory, no allocation


def test_no_implicit_conversion_as_cupy():
    x = sd.asarray(np.arange(4.0))
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    with pytest.raises(TypeError, match="Unsupported type"):
        sd.where(np.ones(4, bool), x, x)   # a NumPy array where CuPy wants its own


def test_counters():
    with sd.count() as c:
        x = sd.asarray(np.arange(6.0).reshape(2, 3))   # host-to-device copy + allocation
        y = x.reshape(3, 2)                            # a view: nothing
        z = y * 2.0                                    # device work + allocation
        host = z.get()                                 # device-to-host copy, a sync
        bool(x[0, 0])                                  # reading a device value: a sync
    assert (c.h2d, c.allocations, c.foreign, c.d2h) == (1, 2, 1, 2)
    assert c.syncs == 2
    np.testing.assert_array_equal(host, np.arange(6.0).reshape(3, 2) * 2.0)


def test_capture_refuses_allocation_and_sync():
    s = sd.cuda.Stream()
    with s:
        s.begin_capture()
        try:
            with pytest.raises(sd.CaptureError, match="allocation"):
                sd.empty(4, np.float32)
            with pytest.raises(sd.CaptureError, match="syncs"):
                s.synchronize()
        finally:
            s.end_capture()
    sd.empty(4, np.float32)   # allowed again


def test_launch_rebuilt_from_packed_bytes(rng):
    """A forward on stand-in arrays, run in the simulator from its packed parameters alone,
    equals the float64 reference: the packing (pointers, shapes, strides, scalars, the
    variant tuple) says everything the kernel reads."""
    q, k, v = (rng.standard_normal((1, 2, 8, 16)).astype(np.float32) for _ in range(3))
    with sd.device(execute=True) as driver:
        o = numba_flash.forward(*(sd.asarray(x) for x in (q, k, v)), causal=True)
    assert [r.name for r in driver.launches] == ["flash_forward"]
    want = numba_flash.reference.attention(q, k, v, causal=True)[0]
    assert_close(o.get(), want, np.float32)


def test_param_sizes_follow_numba_abi():
    """An array is meminfo, parent, nitems, itemsize, data, shape[ndim], strides[ndim] (8 bytes
    each); scalars their width (a boolean one byte); tuples flattened."""
    x = sd.empty((2, 3), np.float16)
    args = (x, np.int32(1), True, 1.5, np.float32(2), (np.int32(3), np.int64(4)))
    sig = [arg_type(a) for a in args]
    assert param_sizes(sig, args) == [8] * 9 + [4, 1, 8, 4, 4, 8]


def test_prepared_launch_packs_pointers(rng):
    x = sd.empty((4,), np.float32)
    prep = PreparedLaunch(sd.DRIVER, _Kernel(), [arg_type(x)], (x,), (1,), (1,), 0, 0)
    prep.run_direct()
    assert int.from_bytes(prep.packed()[32:40], "little") == x.data.ptr


class _Kernel:
    """A stand-in for a dispatcher (the driver only names it)."""

    py_func = staticmethod(lambda: None)
