"""The simulator's recording mode: every memory access of a launch, with its lane, site and
byte address (issue 63).

Off by default.  :data:`RECORDER` is None, and nothing in the simulator changes: the twins of
:mod:`~numba_flash.kernels.ptx.stages` and :mod:`~numba_flash.kernels.ptx.wgmma` test it once
per call (``if record.RECORDER is not None``), and no other code path knows this module.
:meth:`Recorder.start` (``numba_flash.tools.memory_profile`` calls it) switches it on:

* it wraps the simulator's kernel launch (``FakeCUDAKernel.__call__``) so that every array
  argument of a launch, and every array in a tuple argument (the Variant's ``va.sink``), reaches
  the kernel as a :class:`RecordingArray`: a proxy whose ``x[i]`` and ``x[i] = v`` log one access
  of one element (the proxy keeps ``_ary`` and ``__array_interface__``, so the alignment checks
  of :mod:`~numba_flash.kernels.ptx.address` see the memory, as through the simulator's own
  device array);
* ``cuda.shared.array`` (``FakeCUDAShared.array``, as :mod:`numba_flash.simulator` makes it
  thread-safe) hands a recorded launch's shared allocation to :meth:`Recorder.shared_array`,
  which returns it as a :class:`RecordingArray` too;
* the twins log their instruction's access (``cp.async``: a global read and a shared write of
  16 bytes; ``ldmatrix .x4``: a 16-byte row a lane; ``load16``, ``lds16``, ``load_u16``,
  ``load_at``, ``red_add``; a ``wgmma``'s shared operands, one request a warpgroup) and run on
  the NumPy arrays behind the proxies (so a twin's own reads are not logged twice).

:meth:`Recorder.stop` restores the simulator.  One access is one :class:`Access`: the launch,
block, linear thread id, **site**, the array, the operation, its **occurrence** (the ``n``-th
time this thread ran this site on this array with this operation), the byte address and the
byte count.  The site is the call chain inside the kernel, innermost first, of ``(code,
line)`` pairs (device functions inlined on a GPU are frames here): the same dynamic
instruction of a warp's 32 lanes has the same site and occurrence, which is how
``numba_flash.tools.memory_profile`` groups lanes into a warp's request and counts sectors,
128-byte lines and shared-memory wavefronts as the hardware does.

Addresses: a shared element at :mod:`~numba_flash.kernels.ptx.address`'s model,
:data:`~numba_flash.kernels.ptx.address.SHARED_BASE` plus its offset in the allocation; a global
element at its offset in the NumPy buffer that owns its memory (the root of the view's
``.base`` chain) from a :data:`GLOBAL_ALIGN`-aligned address of its own per buffer, as
``cudaMalloc`` (and CuPy's and torch's pools) place an allocation, where ``malloc`` gives 16:
a view keeps its offset in its buffer (a ``qkv`` slice, a view 8 bytes in), an array its own
sectors and lines.  (The alignment checks still read the real pointers.)
"""

from __future__ import annotations

import linecache
import operator
import os
import re
import sys
import threading
from collections import namedtuple

import numpy as np

from . import address

__all__ = ["RECORDER", "Recorder", "RecordingArray", "Access", "Launch", "Request"]

#: the active recorder (None: recording off, the simulator as it always is)
RECORDER = None

#: the modelled alignment of a global buffer (a ``cudaMalloc`` allocation: 256 bytes) and the
#: modelled address of the first one
GLOBAL_ALIGN = 256
GLOBAL_BASE = 1 << 40

#: one logged access (see the module docstring); ``width``: bytes a lane moves per access of
#: this kind (16 for the 16-byte instructions, the element size for plain ones)
Access = namedtuple("Access", "launch block thread site array op space occ addr nbytes width")

#: one request that is not a lane's (a ``wgmma``'s operand read by the warpgroup):
#: ``chunks`` the byte ranges ``(addr, nbytes)`` read, ``phases`` lists of chunk indices each
#: served as one 128-byte access (a core matrix)
Request = namedtuple("Request", "launch block warp site array op space chunks phases")


class Launch:
    """One kernel launch recorded: its kernel, grid, block and array arguments."""

    def __init__(self, index, name, grid, block, arrays):
        self.index, self.name, self.grid, self.block = index, name, grid, block
        self.arrays = arrays   # name -> (space, dtype, shape)

    def __repr__(self):
        return f"Launch({self.index}, {self.name!r}, grid={self.grid}, block={self.block})"


# -- sites ---------------------------------------------------------------------------------------
_KEEP, _SKIP, _STOP, _SIM = 0, 1, 2, 3
_HERE = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))
_STOP_FILES = {os.path.join(_PACKAGE, "simulator.py"), os.path.abspath(threading.__file__)}
_CLASS = {}


def _simulator_dir():
    import numba.cuda.simulator as sim

    return os.path.dirname(os.path.abspath(sim.__file__))


_SIM_DIR = None


def _classify(code):
    """Whether a frame of ``code`` belongs to a site's chain (a kernel or a device function),
    is skipped (the simulator's machinery, a twin, this module) or ends the walk (the
    simulated thread's entry)."""
    global _SIM_DIR
    if _SIM_DIR is None:
        _SIM_DIR = _simulator_dir()
    path = os.path.abspath(code.co_filename)
    if path in _STOP_FILES:
        return _STOP
    if path.startswith(_SIM_DIR):
        return _SIM
    if path == os.path.abspath(__file__) or os.path.basename(path) == "contextlib.py":
        return _SKIP
    if os.path.dirname(path) == _HERE and (code.co_name.startswith("_sim")
                                           or code.co_name in ("__init__", "_read")):
        return _SKIP
    return _KEEP


def site_of(frame):
    """The site of an access made in ``frame``: ``((code, line), ...)`` from the innermost
    kernel-side frame out to the kernel, and whether the access came from the simulator's own
    code (its atomics) rather than the kernel's."""
    chain = []
    first = True
    from_sim = False
    classes = _CLASS
    while frame is not None:
        code = frame.f_code
        kind = classes.get(code)
        if kind is None:
            kind = classes[code] = _classify(code)
        if kind == _STOP:
            break
        if kind == _KEEP:
            chain.append((code, frame.f_lineno))
        elif first and kind == _SIM:
            from_sim = True
        first = False
        frame = frame.f_back
    return tuple(chain), from_sim


_ALLOC_NAME = re.compile(r"^\s*(\w+)\s*=\s*cuda\.shared\.array")


def allocation_name(filename, line):
    """The variable a ``cuda.shared.array`` call at ``filename:line`` is assigned to (else
    ``smem@FILE:LINE``)."""
    m = _ALLOC_NAME.match(linecache.getline(filename, line))
    return m.group(1) if m else f"smem@{os.path.basename(filename)}:{line}"


# -- the proxy -----------------------------------------------------------------------------------
def _offset(idx, strides, shape):
    """Byte offset of the element at the full integer index ``idx`` (TypeError otherwise)."""
    if type(idx) is tuple:
        if len(idx) != len(strides):
            raise TypeError("not a full index")
        off = 0
        for i, s, n in zip(idx, strides, shape):
            i = operator.index(i)
            off += (i + n if i < 0 else i) * s
        return off
    if len(strides) != 1:
        raise TypeError("not a full index")
    i = operator.index(idx)
    return (i + shape[0] if i < 0 else i) * strides[0]


def _element_offsets(view, base_ptr):
    """Byte offsets (from ``base_ptr``) of every element of the view ``view``, C order."""
    ptr = view.__array_interface__["data"][0]
    offs = np.zeros(view.shape, np.int64) + (ptr - base_ptr)
    for axis, (n, s) in enumerate(zip(view.shape, view.strides)):
        shape = [1] * view.ndim
        shape[axis] = n
        offs = offs + (np.arange(n, dtype=np.int64) * s).reshape(shape)
    return offs.reshape(-1)


class RecordingArray:
    """A global or shared array seen by a recorded kernel: element reads and writes are logged
    (:meth:`Recorder.log`), slices are recording views, everything else is the array's own.
    ``_ary``: the NumPy array (what the twins and the alignment checks read)."""

    def __init__(self, ary, rec, name, space, base):
        d = self.__dict__
        d["_ary"] = ary
        d["_rec"] = rec
        d["_name"] = name
        d["_space"] = space
        d["_base"] = base   # the address of this view's first byte
        d["_ptr"] = ary.__array_interface__["data"][0]
        d["_strides"] = ary.strides
        d["_shape"] = ary.shape
        d["_size"] = ary.dtype.itemsize

    def _view(self, view):
        return RecordingArray(view, self._rec, self._name, self._space,
                              self._base + view.__array_interface__["data"][0] - self._ptr)

    def __getitem__(self, idx):
        val = self._ary[idx]
        if isinstance(val, np.ndarray):
            return self._view(val)
        try:
            off = _offset(idx, self._strides, self._shape)
        except TypeError:
            return val   # a field name or another index form the kernels do not use
        self._rec.log(self, "ld", self._base + off, self._size, 1)
        return val

    def __setitem__(self, idx, value):
        try:
            off = _offset(idx, self._strides, self._shape)
        except TypeError:
            off = None
        if off is not None:
            self._ary[idx] = value
            self._rec.log(self, "st", self._base + off, self._size, 1)
            return
        view = self._ary[idx]
        self._ary[idx] = value
        if isinstance(view, np.ndarray):
            for o in _element_offsets(view, self._ptr):
                self._rec.log(self, "st", self._base + int(o), self._size, 1)

    def __getattr__(self, name):
        if name == "shape":
            from numba.cuda.simulator.cudadrv.devicearray import FakeShape

            return FakeShape(self._ary.shape)
        attr = getattr(self._ary, name)
        if callable(attr) and name in ("reshape", "view", "ravel", "transpose", "squeeze"):
            def wrapped(*args, **kwargs):
                out = attr(*args, **kwargs)
                if isinstance(out, np.ndarray) and np.shares_memory(out, self._ary):
                    return self._view(out)
                return out
            return wrapped
        return attr

    def __setattr__(self, name, value):
        raise AttributeError(f"a recorded array has no settable attribute {name!r}")

    @property
    def T(self):
        return self._view(self._ary.T)

    def __len__(self):
        return len(self._ary)

    @property
    def __array_interface__(self):
        """Where the memory is (reading it through NumPy logs nothing)."""
        return self._ary.__array_interface__

    def __array__(self, dtype=None, copy=None):
        return self._ary if dtype is None else self._ary.astype(dtype)

    def __repr__(self):
        return f"RecordingArray({self._space} {self._name!r}, {self._ary.dtype}{self._shape})"


def raw(x):
    """The NumPy array behind a :class:`RecordingArray` (``x`` itself otherwise)."""
    return x.__dict__["_ary"] if type(x) is RecordingArray else x


# -- the recorder --------------------------------------------------------------------------------
class Recorder:
    """Logs every access of the launches run between :meth:`start` and :meth:`stop`:
    ``accesses`` (:data:`Access`), ``requests`` (:data:`Request`), ``launches``
    (:class:`Launch`)."""

    def __init__(self):
        self.accesses = []
        self.requests = []
        self.launches = []
        self._launch = None
        self._lock = threading.Lock()
        self._restore = []
        self._shared = {}
        self._buffers = {}   # (root pointer, bytes) -> modelled address

    # -- switching on and off
    def start(self):
        """Install the launch wrapper and make this the :data:`RECORDER`."""
        global RECORDER
        if RECORDER is not None:
            raise RuntimeError("a recorder is already running")
        from numba.cuda.simulator import kernel as sim_kernel

        _classify(self.start.__code__)   # (locates the simulator's folder)
        rec = self
        call = sim_kernel.FakeCUDAKernel.__call__

        def __call__(kernel, *args):
            if kernel._device or sim_kernel._kernel_context is not None:
                return call(kernel, *args)
            args = rec._begin(kernel, args)
            try:
                return call(kernel, *args)
            finally:
                rec._launch = None

        self._restore = [(sim_kernel.FakeCUDAKernel, "__call__", call)]
        sim_kernel.FakeCUDAKernel.__call__ = __call__
        RECORDER = self
        return self

    def stop(self):
        """Restore the simulator (recording off)."""
        global RECORDER
        for owner, name, original in self._restore:
            setattr(owner, name, original)
        self._restore = []
        RECORDER = None
        self._launch = None
        self._shared = {}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- launches
    def _begin(self, kernel, args):
        """A launch starts: a :class:`Launch` record and the arguments as recording arrays."""
        names = address._param_names(kernel.fn)
        arrays = {}
        wrapped = [self._wrap(names[i] if i < len(names) else f"arg{i}", a, arrays)
                   for i, a in enumerate(args)]
        grid = tuple(kernel.grid_dim) if kernel.grid_dim is not None else ()
        block = tuple(kernel.block_dim) if kernel.block_dim is not None else ()
        self._launch = Launch(len(self.launches), getattr(kernel.fn, "__name__", "kernel"),
                              grid, block, arrays)
        self._shared = {}
        self.launches.append(self._launch)
        return wrapped

    def _wrap(self, name, x, arrays, depth=0):
        ary = x if isinstance(x, np.ndarray) else address._host_array(x)
        if ary is not None and ary.ndim > 0:
            arrays[name] = ("global", ary.dtype, ary.shape)
            return RecordingArray(ary, self, name, "global", self.global_base(ary))
        if isinstance(x, tuple) and depth < 3:
            fields = getattr(x, "_fields", None)
            items = [self._wrap(f"{name}.{f}", v, arrays, depth + 1)
                     for f, v in zip(fields or [str(i) for i in range(len(x))], x)]
            return type(x)(*items) if fields else tuple(items)
        return x

    def global_base(self, ary):
        """The modelled global address of ``ary``'s first byte: its offset in the buffer that
        owns its memory, from that buffer's :data:`GLOBAL_ALIGN`-aligned address."""
        root = ary
        while isinstance(root.base, np.ndarray):
            root = root.base
        ptr = root.__array_interface__["data"][0]
        key = (ptr, root.nbytes)
        with self._lock:
            start = self._buffers.get(key)
            if start is None:
                start = self._buffers[key] = GLOBAL_BASE + (len(self._buffers) << 32)
        return start + ary.__array_interface__["data"][0] - ptr

    def shared_array(self, res, filename, line):
        """The shared allocation ``res`` made at ``filename:line`` as a recording array
        (``res`` itself outside a recorded launch)."""
        if self._launch is None or not isinstance(res, np.ndarray):
            return res
        key = (filename, line, id(res))
        with self._lock:
            got = self._shared.get(key)
            if got is None or got._ary is not res:
                name = allocation_name(filename, line)
                got = self._shared[key] = RecordingArray(
                    res, self, name, "shared", address.shared_address(res))
                self._launch.arrays.setdefault(name, ("shared", res.dtype, res.shape))
        return got

    # -- logging
    def log(self, arr, op, addr, nbytes, depth, width=None):
        """One access of the calling simulated thread (``depth``: frames between the caller of
        :meth:`log` and the access's own frame, 1 for a proxy's ``__getitem__``)."""
        t = threading.current_thread()
        d = t.__dict__
        me = d.get("_nf_record")
        if me is None:
            if getattr(t, "blockIdx", None) is None or self._launch is None:
                return   # host code touching a proxy outside a launch
            me = d["_nf_record"] = (self._launch.index, tuple(t.blockIdx), t.thread_id, {})
        site, from_sim = site_of(sys._getframe(depth + 1))
        if from_sim:   # the simulator's atomics: a read-modify-write, logged once
            if op == "ld":
                return
            op = "atom"
        name = arr.__dict__["_name"] if type(arr) is RecordingArray else arr
        space = arr.__dict__["_space"] if type(arr) is RecordingArray else "shared"
        occ = me[3]
        key = (site, name, op)
        n = occ.get(key, 0)
        occ[key] = n + 1
        self.accesses.append(Access(me[0], me[1], me[2], site, name, op, space, n, addr, nbytes,
                                    width or nbytes))

    def twin_global(self, src, elem, nbytes, op):
        """A twin's access of ``nbytes`` from element ``elem`` of the global array ``src``;
        returns the NumPy array behind ``src``."""
        ary = raw(src)
        if nbytes:
            self.log(src if type(src) is RecordingArray else "global", op,
                     self._global_at(src, ary, elem), nbytes, 2)
        return ary

    def _global_at(self, src, ary, elem):
        """The modelled address of flat element ``elem`` of the C-contiguous ``src``."""
        base = src.__dict__["_base"] if type(src) is RecordingArray else self.global_base(ary)
        return base + int(elem) * ary.dtype.itemsize

    def twin_shared(self, smem, byte, nbytes, op):
        """A twin's access of ``nbytes`` at byte ``byte`` of the shared array ``smem``; returns
        the NumPy array behind ``smem``."""
        ary = raw(smem)
        addr = address.shared_address(ary, byte)
        self.log(smem if type(smem) is RecordingArray else "shared", op, addr, nbytes, 2)
        return ary

    def twin_cp_async(self, smem, byte, src, elem, src_bytes):
        """``cp.async``: a global read of ``src_bytes`` (none when 0) and a shared write of 16
        bytes; returns both NumPy arrays."""
        ary = raw(src)
        if src_bytes:
            self.log(src if type(src) is RecordingArray else "global", "ldgsts",
                     self._global_at(src, ary, elem), int(src_bytes), 2, 16)
        smem_ary = raw(smem)
        self.log(smem if type(smem) is RecordingArray else "shared", "ldgsts",
                 address.shared_address(smem_ary, byte), 16, 2)
        return smem_ary, ary

    def wgmma_operand(self, smem, addrs, elem_bytes=2):
        """A ``wgmma``'s read of one shared operand at the byte addresses ``addrs`` (``[mn,
        k]`` elements of ``elem_bytes``), logged once a warpgroup: its 16-byte chunks and, as
        phases, its core matrices (8 rows of 16 bytes, one 128-byte access each)."""
        t = threading.current_thread()
        if getattr(t, "blockIdx", None) is None or self._launch is None:
            return
        site, _ = site_of(sys._getframe(1))
        a = np.asarray(addrs, np.int64)
        if a.shape[1] < 2 or a[0, 1] - a[0, 0] != elem_bytes:
            a = a.T   # MN-major: the 16-byte chunks run along mn
        per = 16 // elem_bytes
        chunks, phases = [], []
        for i in range(0, a.shape[0], 8):
            for j in range(0, a.shape[1], per):
                phase = []
                for row in a[i:i + 8, j:j + per]:
                    phase.append(len(chunks))
                    chunks.append((int(row.min()), 16))
                phases.append(phase)
        name = smem.__dict__["_name"] if type(smem) is RecordingArray else "shared"
        self.requests.append(Request(self._launch.index, tuple(t.blockIdx), t.thread_id // 128,
                                     site, name, "wgmma", "shared", chunks, phases))
