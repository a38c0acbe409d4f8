"""The stand-in device: a GPU made of host memory, for testing the device path on a CPU.

numba_flash's device path (CuPy arrays on a GPU) cannot run on a machine without one, so its host
code would go untested between GPU sessions.  This module plays CuPy closely enough that the real
host code of every op runs on it down to the launch:

* :class:`ndarray`: arrays in "device memory" (aligned host buffers, 256 bytes as ``cudaMalloc``)
  with CuPy's attributes (``data.ptr``, ``device.id``, ``flags``, ``__cuda_array_interface__``
  with the current stream), views, elementwise math and reductions; like CuPy, no implicit
  conversion to NumPy (``numpy.asarray(x)`` is a ``TypeError``), and a NumPy array given to one
  of its functions is a ``TypeError`` too.
* the module's functions (``empty``, ``zeros``, ``asarray``, ``ascontiguousarray``, ``asnumpy``,
  ``broadcast_to``, ``where``, ...) and ``cuda`` (``get_current_stream``, ``Stream``,
  ``ExternalStream``, ``Device``, ``MemoryPointer``, ``UnownedMemory``, stream capture into a
  graph that ``Graph.launch`` replays);
* :data:`DRIVER`: the launcher the front end uses for these arrays in place of CUDA's
  (:mod:`numba_flash.frontend.launch`): it records each launch (kernel, signature, grid, block,
  shared memory, stream, the parameter bytes) and each memset, and with ``execute=True`` runs the
  launch in the Numba CUDA simulator from the packed parameter bytes alone (the arrays rebuilt
  from the pointers, shapes and strides in them), so a result from this path is checked against
  the float64 reference like any other.

:class:`Counters` (:func:`count`) count what a call costs the host: synchronisations
(``synchronize``, a device-to-host copy, ``bool(x)`` of a device value...), device-to-host and
host-to-device copies, allocations, launches, memsets, and "foreign" device work (elementwise
math, fills and item writes: what a launch plan would not replay).  During a stream capture an
allocation, a synchronisation or a copy raises :class:`CaptureError`, as CUDA refuses them then.

    import numba_flash, numba_flash.standin as sd
    q = sd.asarray(q_host)  # ... k, v
    with sd.count() as c:
        o = numba_flash.forward(q, k, v)
    c.syncs, c.allocations, sd.DRIVER.launches[-1]
"""

from __future__ import annotations

import bisect
import contextlib
import struct
import threading
import weakref

import numpy as np

__all__ = ["ndarray", "asarray", "asnumpy", "adopt", "empty", "zeros", "count", "Counters",
           "DRIVER", "CaptureError", "device", "CAIArray", "cuda"]

#: cudaMalloc's alignment, which the stand-in's allocations keep
ALIGNMENT = 256


class CaptureError(RuntimeError):
    """An operation CUDA refuses while a stream is being captured into a graph."""


# -- counters -----------------------------------------------------------------------------------
class Counters:
    """What the host did to the device: ``syncs``, ``d2h``, ``h2d`` (copies), ``allocations``,
    ``launches``, ``memsets`` and ``foreign`` (device work other than launches and memsets:
    elementwise math, fills, item writes), each with the list of what it was in ``log``."""

    FIELDS = ("syncs", "d2h", "h2d", "allocations", "launches", "memsets", "foreign")

    def __init__(self):
        for f in self.FIELDS:
            setattr(self, f, 0)
        self.log = []

    def add(self, field, what):
        setattr(self, field, getattr(self, field) + 1)
        self.log.append((field, what))

    def __repr__(self):
        return "Counters(" + ", ".join(f"{f}={getattr(self, f)}" for f in self.FIELDS) + ")"


_COUNTERS = []          # the active count() blocks
_STATE = threading.local()


def _note(field, what):
    for c in _COUNTERS:
        c.add(field, what)
    if _CAPTURES and field in ("syncs", "d2h", "h2d", "allocations"):
        raise CaptureError(f"{what}: not allowed while a stream is being captured ({field})")


@contextlib.contextmanager
def count():
    """Count what the block does to the stand-in device (a :class:`Counters`)."""
    c = Counters()
    _COUNTERS.append(c)
    try:
        yield c
    finally:
        _COUNTERS.remove(c)


# -- memory ---------------------------------------------------------------------------------------
class _Memory:
    """The stand-in's device memory: aligned host buffers by start address, so that a pointer in
    a launch's parameters finds its buffer again."""

    def __init__(self):
        self.starts = []
        self.buffers = {}   # start -> (weakref to the uint8 buffer, size)

    def allocate(self, nbytes):
        raw = np.empty(nbytes + ALIGNMENT, np.uint8)
        base = raw.__array_interface__["data"][0]
        start = -base % ALIGNMENT
        buf = raw[start:start + nbytes]
        addr = base + start
        if len(self.starts) >= 4096:
            self._forget()
        if addr in self.buffers:
            self.starts.remove(addr)
        bisect.insort(self.starts, addr)
        self.buffers[addr] = (weakref.ref(raw), start, nbytes)   # no strong reference
        return buf

    def adopt(self, a):
        """Register host memory ``a`` (a NumPy array, any strides) as device memory, in place:
        its whole buffer (``a.base``'s, or its own) becomes an allocation."""
        owner = a
        while isinstance(owner.base, np.ndarray):
            owner = owner.base
        base = owner.__array_interface__["data"][0]
        nbytes = owner.nbytes
        if base not in self.buffers or self.buffers[base][0]() is not owner:
            if not owner.flags.c_contiguous:
                raise ValueError("standin.adopt: expected memory a C-contiguous array owns")
            if base in self.buffers:
                self.starts.remove(base)
            bisect.insort(self.starts, base)
            self.buffers[base] = (weakref.ref(owner), 0, nbytes)
        return a

    def _forget(self):
        live = [a for a in self.starts if self.buffers[a][0]() is not None]
        self.buffers = {a: self.buffers[a] for a in live}
        self.starts = live

    def find(self, ptr):
        """``(uint8 buffer, offset)`` of device address ``ptr``."""
        i = bisect.bisect_right(self.starts, ptr) - 1
        while i >= 0:   # the nearest live allocation below (a freed one may lie inside it)
            start = self.starts[i]
            ref, skip, nbytes = self.buffers[start]
            owner = ref()
            if owner is not None:
                if ptr - start <= nbytes:
                    flat = owner.reshape(-1).view(np.uint8)
                    return flat[skip:skip + nbytes], ptr - start
                break
            i -= 1
        raise ValueError(f"stand-in device: address {ptr:#x} is in no allocation (freed, or "
                         f"host memory)")

    def view(self, ptr, shape, strides, dtype):
        """A NumPy view of the device memory at ``ptr``."""
        buf, off = self.find(ptr)
        return np.ndarray(shape, dtype, buffer=buf, offset=off, strides=strides)


MEMORY = _Memory()


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(1, n)
    return tuple(reversed(strides))


def _alloc(shape, dtype):
    a = np.empty(shape, dtype)   # only its shape, dtype and size (NumPy's own checks)
    _note("allocations", a.dtype)
    return np.ndarray(a.shape, a.dtype, buffer=MEMORY.allocate(a.nbytes))


# -- streams and devices --------------------------------------------------------------------------
class Stream:
    """A stand-in CUDA stream: ``ptr`` (its handle; 0 the default stream), a context manager
    making it the current stream, ``synchronize`` (counted) and capture into a :class:`Graph`."""

    _next = [0x1000]

    def __init__(self, non_blocking=False, ptr=None):
        if ptr is None:
            ptr = Stream._next[0]
            Stream._next[0] += 0x10
        self.ptr = ptr
        self.graph = None

    def __enter__(self):
        _stack().append(self)
        return self

    def __exit__(self, *exc):
        _stack().pop()

    def synchronize(self):
        _note("syncs", f"stream {self.ptr:#x}.synchronize()")

    def use(self):
        _stack()[:] = [self]
        return self

    def begin_capture(self, mode=None):
        """Capture the launches and memsets on this stream into a :class:`Graph` (an
        allocation, synchronisation or copy meanwhile is a :class:`CaptureError`)."""
        self.graph = Graph()
        _CAPTURES.append(self)

    def end_capture(self):
        graph, self.graph = self.graph, None
        _CAPTURES.remove(self)
        return graph

    def is_capturing(self):
        return self.graph is not None


class ExternalStream(Stream):
    def __init__(self, ptr, device_id=-1):
        super().__init__(ptr=int(ptr))


Stream.null = Stream(ptr=0)


def _stack():
    try:
        return _STATE.streams
    except AttributeError:
        s = _STATE.streams = [Stream.null]
        return s


_CAPTURES = []   # the streams being captured


class Graph:
    """A captured sequence of launches and memsets; :meth:`launch` replays it."""

    def __init__(self):
        self.ops = []

    def launch(self, stream=None):
        for op in self.ops:
            DRIVER.replay(op)


class Device:
    """``cuda.Device(id)``: a context manager (the stand-in has one device, 0)."""

    def __init__(self, device=0):
        self.id = int(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def synchronize(self):
        _note("syncs", "Device.synchronize()")

    use = __enter__


class MemoryPointer:
    """``cuda.MemoryPointer(mem, offset)``: ``ptr`` is the device address."""

    __slots__ = ("mem", "ptr")

    def __init__(self, mem, offset=0):
        self.mem, self.ptr = mem, int(mem.ptr) + int(offset)

    def __add__(self, offset):
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))


class _Pointer:
    """An array's ``data``: ``ptr`` its address (CuPy's ``MemoryPointer``, without the
    memory object)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __add__(self, offset):
        return _Pointer(self.ptr + int(offset))


class UnownedMemory:
    """``cuda.UnownedMemory(ptr, size, owner, device_id)``: memory someone else allocated."""

    def __init__(self, ptr, size, owner, device_id=0):
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, device_id


class _Runtime:
    @staticmethod
    def getDevice():
        return 0

    @staticmethod
    def deviceSynchronize():
        _note("syncs", "runtime.deviceSynchronize()")


class cuda:  # noqa: N801  (CuPy's name)
    """The ``cupy.cuda`` the front end uses."""

    Stream = Stream
    ExternalStream = ExternalStream
    Device = Device
    MemoryPointer = MemoryPointer
    UnownedMemory = UnownedMemory
    runtime = _Runtime

    @staticmethod
    def get_current_stream(device_id=None):
        try:
            return _STATE.streams[-1]
        except AttributeError:
            return _stack()[-1]


# -- arrays ---------------------------------------------------------------------------------------
class _DeviceId:
    __slots__ = ("id",)

    def __init__(self, i):
        self.id = i


_DEVICE0 = _DeviceId(0)
_ELEMENTWISE = ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                "__truediv__", "__rtruediv__", "__floordiv__", "__mod__", "__pow__", "__neg__",
                "__abs__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__and__",
                "__or__", "__xor__", "__invert__", "__rand__", "__ror__")
#: ndarray methods that make views (no device work)
_VIEWS = ("reshape", "view", "transpose", "ravel", "squeeze", "swapaxes", "diagonal")


class ndarray:
    """A stand-in device array: CuPy's attributes as plain fields (reading one costs no Python
    call, as CuPy's C-level properties)."""

    __slots__ = ("_a", "shape", "strides", "dtype", "ndim", "size", "nbytes", "itemsize",
                 "data", "device", "flags", "base", "__weakref__")
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is None:
            a = _alloc(shape, dtype)
        else:
            dtype = np.dtype(dtype)
            shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list))
                                           else (shape,)))
            if strides is None:
                strides = _c_strides(shape, dtype.itemsize)
            a = MEMORY.view(memptr.ptr, shape, strides, dtype)
        self._set(a, memptr.mem if memptr is not None else None)

    def _set(self, a, base=None):
        self._a = a
        self.shape, self.strides, self.dtype = a.shape, a.strides, a.dtype
        self.ndim, self.size, self.nbytes, self.itemsize = a.ndim, a.size, a.nbytes, a.itemsize
        self.data = _Pointer(a.__array_interface__["data"][0])
        self.device, self.flags, self.base = _DEVICE0, a.flags, base

    @classmethod
    def _of(cls, a, base=None):
        """Wrap the NumPy view ``a`` of stand-in memory (no copy)."""
        x = cls.__new__(cls)
        x._set(a, base)
        return x

    # -- interop ---------------------------------------------------------------------------
    @property
    def __cuda_array_interface__(self):
        ptr = self.data.ptr
        stream = cuda.get_current_stream().ptr
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (ptr, False),
                "version": 3, "strides": None if self.flags.c_contiguous else self.strides,
                "descr": [("", self.dtype.str)], "stream": stream or None}

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use "
                        "`.get()` to construct a NumPy array explicitly.")

    def get(self, stream=None):
        """A NumPy copy on the host (a device-to-host copy; it waits for the stream)."""
        _note("d2h", f"get() {self.dtype.name}{list(self.shape)}")
        _note("syncs", "get() waits for the stream")
        return self._a.copy()

    def set(self, arr, stream=None):
        """Copy the host array ``arr`` in (a host-to-device copy; CuPy's ``ndarray.set``)."""
        _note("h2d", f"set() {self.dtype.name}{list(self.shape)}")
        self._a[...] = arr

    def item(self):
        return self.get().item()

    def tolist(self):
        return self.get().tolist()

    def __bool__(self):
        return bool(self.get())

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __index__(self):
        return int(self.get())

    def __len__(self):
        return self.shape[0]

    def __iter__(self):
        return (self[i] for i in range(self.shape[0]))

    def __repr__(self):
        return f"standin.ndarray(shape={self.shape}, dtype={self.dtype})"

    # -- views -----------------------------------------------------------------------------
    def __getitem__(self, idx):
        idx = _unwrap(idx)
        r = self._a[idx]
        if isinstance(r, np.generic):   # an element: a 0-d view, as CuPy gives
            r = self._a[(idx if isinstance(idx, tuple) else (idx,)) + (Ellipsis,)]
        if isinstance(r, np.ndarray) and np.shares_memory(r, self._a):
            return ndarray._of(r, self)
        return _wrap(r, "indexing")   # advanced indexing: a gather (device work)

    def __setitem__(self, idx, value):
        _note("foreign", "item write")
        self._a[_unwrap(idx)] = _unwrap(value)

    @property
    def T(self):
        return ndarray._of(self._a.T, self)

    def reshape(self, *shape, order="C"):
        return ndarray._of(self._a.reshape(*shape, order=order), self)

    def view(self, dtype=None):
        return ndarray._of(self._a.view(dtype), self)

    def transpose(self, *axes):
        return ndarray._of(self._a.transpose(*axes), self)

    def astype(self, dtype, copy=True, **kw):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _wrap(self._a.astype(dtype), "astype")

    def copy(self, order="C"):
        return _wrap(self._a.copy(order=order), "copy")

    def fill(self, value):
        _note("foreign", "fill")
        self._a.fill(value)

    def __getattr__(self, name):
        attr = getattr(np.ndarray, name, None)
        if attr is None or name.startswith("__"):
            raise AttributeError(f"standin.ndarray has no attribute {name!r}")

        def method(*args, **kwargs):
            r = getattr(self._a, name)(*_unwrap(args), **_unwrap(kwargs))
            if name in _VIEWS:
                return ndarray._of(r, self)
            return _wrap(r, name)

        return method


def _elementwise_method(name):
    def method(self, *args):
        return _wrap(getattr(self._a, name)(*_unwrap(args)), name)
    method.__name__ = name
    return method


for _name in _ELEMENTWISE:
    setattr(ndarray, _name, _elementwise_method(_name))
ndarray.__hash__ = None


class CAIArray:
    """A device array known only by ``__cuda_array_interface__`` (as a Numba device array or a
    torch CUDA tensor is to the front end), over a stand-in array's memory."""

    def __init__(self, x, stream=None):
        self._x = x
        self._stream = stream

    @property
    def __cuda_array_interface__(self):
        cai = dict(self._x.__cuda_array_interface__)
        cai["strides"] = self._x.strides
        cai["stream"] = self._stream
        return cai

    @property
    def shape(self):
        return self._x.shape

    @property
    def dtype(self):
        return self._x.dtype

    def reshape(self, *shape):
        """A view of another shape (as a Numba device array gives)."""
        return CAIArray(self._x.reshape(*shape), self._stream)

    def view(self, dtype):
        return CAIArray(self._x.view(dtype), self._stream)


def _unwrap(x):
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError("Unsupported type <class 'numpy.ndarray'>")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


def _wrap(r, what):
    """A NumPy result of device work as a stand-in array in fresh device memory (counted as
    foreign device work and an allocation); other results (tuples, scalars) as they are."""
    if isinstance(r, tuple):
        return tuple(_wrap(v, what) for v in r)
    if not isinstance(r, (np.ndarray, np.generic)):
        return r
    _note("foreign", what)
    r = np.asarray(r)
    out = _alloc(r.shape, r.dtype)
    out[...] = r
    return ndarray._of(out)


# -- the module's functions ----------------------------------------------------------------------
def empty(shape, dtype=float, order="C"):
    x = ndarray.__new__(ndarray)
    x._set(_alloc(shape, dtype))
    return x


def empty_like(x, dtype=None):
    return empty(x.shape, x.dtype if dtype is None else dtype)


def zeros(shape, dtype=float):
    out = empty(shape, dtype)
    out.fill(0)
    return out


def full(shape, value, dtype=None):
    out = empty(shape, np.result_type(value) if dtype is None else dtype)
    out.fill(value)
    return out


def ones(shape, dtype=float):
    return full(shape, 1, dtype)


def asarray(x, dtype=None, order=None):
    """A stand-in array of ``x``: itself; a view of a ``__cuda_array_interface__`` object (the
    exporter's stream synchronised, as CuPy does); a copy of host data (host-to-device)."""
    if isinstance(x, ndarray):
        return x if dtype is None or np.dtype(dtype) == x.dtype else x.astype(dtype)
    if hasattr(x, "__cuda_array_interface__"):
        cai = x.__cuda_array_interface__
        if cai.get("stream") is not None:
            _note("syncs", "asarray(__cuda_array_interface__) waits for the exporter's stream")
        dt = np.dtype(cai["typestr"])
        a = MEMORY.view(cai["data"][0], cai["shape"], cai.get("strides"), dt)
        out = ndarray._of(a, x)
        return out if dtype is None else out.astype(dtype)
    host = np.asarray(x, dtype=dtype)
    _note("h2d", f"asarray {host.dtype.name}{list(host.shape)}")
    out = _alloc(host.shape, host.dtype)
    out[...] = host
    return ndarray._of(out)


def adopt(a):
    """A stand-in array over host memory ``a`` itself (no copy): what a device tensor's view is
    to CuPy (``numba_flash.torch`` runs CPU tensors through the device path this way in its
    tests).  The memory stays ``a``'s; writes through the stand-in array land in ``a``."""
    return ndarray._of(MEMORY.adopt(np.asarray(a)))


def ascontiguousarray(x, dtype=None):
    x = asarray(x)
    if x.flags.c_contiguous and (dtype is None or np.dtype(dtype) == x.dtype):
        return x
    return _wrap(np.ascontiguousarray(x._a, dtype=dtype), "ascontiguousarray")


def asnumpy(x, stream=None):
    return x.get() if isinstance(x, ndarray) else np.asarray(x)


def broadcast_to(x, shape):
    return ndarray._of(np.broadcast_to(_unwrap(x), shape), x)


def __getattr__(name):
    """NumPy's dtypes and constants as they are; its functions as device work on stand-in
    arrays (NumPy arrays refused, as CuPy refuses them)."""
    attr = getattr(np, name)
    if isinstance(attr, (type, float, int)) or name in ("newaxis",):
        return attr
    if not callable(attr):
        return attr

    def function(*args, **kwargs):
        return _wrap(attr(*_unwrap(args), **_unwrap(kwargs)), name)

    function.__name__ = name
    return function


# -- the driver -----------------------------------------------------------------------------------
class Launch:
    """One recorded launch: ``name``, ``sig`` (Numba types), ``sizes`` (each parameter's bytes),
    ``grid``, ``block``, ``shared``, ``stream``, ``params`` (the packed bytes) and the
    ``kernel`` (the simulator's dispatcher)."""

    __slots__ = ("prep", "params")

    def __init__(self, prep, params):
        self.prep, self.params = prep, params

    def __getattr__(self, name):
        if name == "kernel":
            return self.prep.kernel
        return getattr(self.prep, name)

    def __repr__(self):
        return f"Launch({self.name}, grid={self.grid}, block={self.block})"


class StandInDriver:
    """The stand-in's launcher: records every launch and memset (``launches``, ``memsets``),
    and with :attr:`execute` runs each launch in the simulator from its packed parameters."""

    def __init__(self):
        self.functions = []
        self.launches = []
        self.memsets = []
        self.execute = False

    def function(self, kernel, sig, shared):
        self.functions.append((kernel, tuple(sig)))
        return len(self.functions) - 1

    def stream(self, ptr):
        return ptr

    def launch(self, prep):
        rec = Launch(prep, prep.buffer.raw[: prep.packer.size])
        if _COUNTERS:
            _note("launches", prep.name)
        self.launches.append(rec)
        if _CAPTURES:
            graph = _capture_of(prep.stream)
            if graph is not None:
                graph.ops.append(rec)
                return
        if self.execute:
            self.run(rec)

    def memset(self, ptr, byte, nbytes, stream):
        if _COUNTERS:
            _note("memsets", nbytes)
        rec = ("memset", ptr, byte, nbytes)
        self.memsets.append(rec)
        if _CAPTURES:
            graph = _capture_of(stream)
            if graph is not None:
                graph.ops.append(rec)
                return
        self.replay(rec)

    def replay(self, op):
        if isinstance(op, tuple):
            _, ptr, byte, nbytes = op
            if nbytes:
                buf, off = MEMORY.find(ptr)
                buf[off:off + nbytes] = byte
        elif self.execute:
            self.run(op)

    def run(self, rec):
        """Run a recorded launch in the simulator from its parameter bytes."""
        from .frontend.launch import simulate_launch

        args = unpack_args(rec.sig, rec.params)
        simulate_launch(rec.kernel, rec.grid, rec.block, rec.shared, args)


def _capture_of(stream_ptr):
    for s in _CAPTURES:
        if s.graph is not None and s.ptr == stream_ptr:
            return s.graph
    return None


def unpack_args(sig, params):
    """The launch arguments rebuilt from the packed parameter bytes (8-byte slots, Numba's
    kernel ABI): arrays as simulator device arrays over the stand-in memory their pointers
    name, scalars as NumPy scalars of their types, tuples (named ones too) element by element."""
    from numba.core import types
    from numba.np import numpy_support

    from .simulator import device_view

    pos = [0]

    def take(code):
        (v,) = struct.unpack_from("=" + code, params, pos[0])
        pos[0] += 8
        return v

    def build(ty):
        if isinstance(ty, types.Array):
            take("Q"), take("Q")
            nitems, itemsize, ptr = take("q"), take("q"), take("Q")
            shape = tuple(take("q") for _ in range(ty.ndim))
            strides = tuple(take("q") for _ in range(ty.ndim))
            dtype = numpy_support.as_dtype(ty.dtype)
            if dtype.itemsize != itemsize or int(np.prod(shape, dtype=np.int64)) != nitems:
                raise ValueError(f"packed array parameter inconsistent: {ty}, nitems {nitems}, "
                                 f"itemsize {itemsize}, shape {shape}")
            return device_view(MEMORY.view(ptr, shape, strides, dtype))
        if isinstance(ty, types.BaseTuple):
            vals = [build(t) for t in ty]
            cls = getattr(ty, "instance_class", tuple)
            return cls(*vals) if cls is not tuple else tuple(vals)
        from .frontend.launch import _SCALAR_CODES

        v = take(_SCALAR_CODES[ty])
        if ty == types.boolean:
            return bool(v)
        return numpy_support.as_dtype(ty)(v).item() if ty == types.float16 else \
            numpy_support.as_dtype(ty).type(v)

    return tuple(build(t) for t in sig)


DRIVER = StandInDriver()


@contextlib.contextmanager
def device(execute=False):
    """Within this block the stand-in driver runs launches in the simulator (``execute=True``)
    or only records them; yields :data:`DRIVER`, its records cleared."""
    old = DRIVER.execute
    DRIVER.execute = execute
    DRIVER.launches.clear()
    DRIVER.memsets.clear()
    try:
        yield DRIVER
    finally:
        DRIVER.execute = old

