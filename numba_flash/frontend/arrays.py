"""Moving arrays to where the kernels run, allocating outputs, and giving results back.

One :class:`ArrayCall` serves one public call:

* NumPy inputs are copied to the device once (``cuda.to_device``; a non-contiguous view is made
  contiguous first) and results copied back (``copy_to_host``).  The same two calls run in the
  simulator, where "the device" is host memory and each is a plain copy, so both backends walk
  one code path.  Inputs are never written.
* CuPy arrays (or any ``__cuda_array_interface__`` object) on the GPU backend are used in place,
  zero copy, on the current CuPy stream of their device; results come back as CuPy arrays on the
  same device (Numba device arrays for other producers).  Allocation and launch run under
  ``cupy.cuda.Device(q.device.id)``, so outputs land on the inputs' device whatever CuPy's
  current device is.  In the simulator device arrays are a ``TypeError``.

Sizes are checked before anything is allocated: :func:`check_memory` adds up the bytes of the
outputs and workspaces a call asks for and raises ``MemoryError`` naming the arrays, their shapes
and the GiB when they cannot fit in the memory available (the GPU's free memory, or the host's
in the simulator), instead of a failure deep inside NumPy or the driver on a shape the user never
asked for.  :meth:`ArrayCall.reserve` does that for a whole call; :meth:`ArrayCall.empty`,
:meth:`ArrayCall.zeros` and :meth:`ArrayCall.input` check each allocation on their own as well.

Launches (:meth:`ArrayCall.launch`) hide numba's "Grid size N will likely result in GPU
under-utilization" ``NumbaPerformanceWarning`` (small problems are allowed to be small), and in
the simulator warn (:class:`numba_flash.SlowSimulatorWarning`) before a launch estimated at
30 s of CPU time or more (a minute of wall time on a busy machine), from the work hint each op
passes (:mod:`numba_flash.frontend.sim_time`); :func:`estimate_only` gives the estimates of a
call without running it.

bfloat16 (``ml_dtypes.bfloat16`` on the host; a CuPy >= 14 bfloat16 array on the GPU) reaches
the kernels as its 16-bit words: :meth:`ArrayCall.input` hands on a ``uint16`` view (no copy),
:meth:`ArrayCall.empty` allocates a bfloat16 output as ``uint16`` and :meth:`ArrayCall.result`
gives it back viewed as bfloat16 (see :mod:`numba_flash.kernels.core.elements`).

For tests, :func:`poisoned_outputs` fills every output with NaN (or a sentinel for integer
arrays) before launch, so that an element a kernel forgot to write fails the comparison.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import warnings

import numpy as np
from numba import cuda

from .. import simulator
from ..backend import on_simulator
from .launch import INT_DIVIDE_BY_ZERO  # noqa: F401  (re-exported: tests import it here)
from .sim_time import SimWork, simulator_seconds, warn_if_slow
from .validate import BFLOAT16, array_info, is_c_contiguous, is_device_array

__all__ = ["ArrayCall", "poisoned_outputs", "check_memory", "nbytes", "simulator_seconds",
           "SimWork", "estimate_only"]

_POISON = False


_ESTIMATES = None  # the list estimate_only() records into, or None
GIB = 2**30


@contextlib.contextmanager
def estimate_only():
    """Within this block simulator launches do not run: each is estimated
    (:func:`~numba_flash.frontend.sim_time.simulator_seconds`, CPU seconds) and recorded as
    ``(kernel name, seconds)`` in the list this yields; outputs stay unwritten.  What a call
    would cost before running it::

        with estimate_only() as launches:
            numba_flash.forward(q, k, v)
    """
    global _ESTIMATES
    old, _ESTIMATES = _ESTIMATES, []
    try:
        yield _ESTIMATES
    finally:
        _ESTIMATES = old


@contextlib.contextmanager
def poisoned_outputs(enabled=True):
    """Within this block, outputs are filled with NaN (ints: -2**31 + 1) instead of left empty."""
    global _POISON
    old, _POISON = _POISON, enabled
    try:
        yield
    finally:
        _POISON = old


def _poison_value(dtype):
    return np.nan if np.dtype(dtype).kind == "f" else np.iinfo(dtype).min + 1


#: a bfloat16 output's poison: the bits of a quiet NaN
BF16_NAN_BITS = np.uint16(0x7FC0)


def strided_view(x):
    """Whether a kernel that reads strides takes the non-empty array ``x`` as it lies: its last
    dim contiguous (stride one element, or length one), every stride >= 0 and in whole
    elements (flash-attn's rule, ``stride(-1) == 1``: ``[B, N, H, d]`` memory read as ``[B, H,
    N, d]``, a fused projection's slices, a head or batch slice at an offset)."""
    size = x.dtype.itemsize
    strides = tuple(int(s) for s in x.strides)
    if not strides or 0 in x.shape:
        return False
    if x.shape[-1] > 1 and strides[-1] != size:
        return False
    if len(strides) > 1 and strides[-2] // size >= 2**31:   # the kernels' int32 row stride
        return False
    return all(s >= 0 and s % size == 0 for s in strides)


def _words(x):
    """A bfloat16 array (NumPy or CuPy) as its uint16 words, zero copy; others unchanged."""
    if getattr(x, "dtype", None) == BFLOAT16:
        return x.view(np.uint16)
    return x


# -- sizes ------------------------------------------------------------------------------------
def nbytes(shape, dtype):
    """Bytes of a C-contiguous array of ``shape`` and ``dtype`` (exact, Python ints)."""
    return math.prod(int(s) for s in shape) * np.dtype(dtype).itemsize


def _fmt_shape(shape):
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _gib(n):
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / GIB:.3g} GiB"


def host_memory_available():
    """Bytes the host can still give (``MemAvailable`` + free swap on Linux), or None."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
        if "MemAvailable" in info:
            return info["MemAvailable"] + info.get("SwapFree", 0)
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_available():
    """Free bytes where kernels' arrays live: the current GPU (plus blocks CuPy's pool holds), or
    the host in the simulator; None when unknown."""
    if on_simulator():
        return host_memory_available()
    try:
        free, _total = cuda.current_context().get_memory_info()
    except Exception:  # no context yet / driver error: let the allocation itself report
        return None
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with contextlib.suppress(Exception):
            free += cupy.get_default_memory_pool().free_bytes()
    return int(free)


def _where(device):
    if not device:
        return "host memory"
    if on_simulator():
        return "host memory (the simulator's device memory)"
    with contextlib.suppress(Exception):
        return f"GPU {cuda.get_current_device().id} memory"
    return "GPU memory"


def check_memory(op, buffers, *, device=True, work_bytes=0, work_name="work arrays"):
    """Raise ``MemoryError`` if ``buffers`` cannot fit, before anything is allocated.

    ``buffers`` maps a name to ``(shape, dtype)``; ``work_bytes`` adds temporary memory the call
    needs besides them.  ``device`` says where they live: the kernels' memory (the GPU, or the
    host in the simulator) or the host.  The message names ``op``, every buffer with its shape,
    dtype and size, the total and what is available.  Returns the total in bytes.
    """
    sizes = {name: nbytes(shape, dtype) for name, (shape, dtype) in buffers.items()}
    total = sum(sizes.values()) + int(work_bytes)
    if total < 2**26:  # under 64 MiB: not worth a look at the memory counters
        return total
    avail = device_memory_available() if device else host_memory_available()
    if avail is None or total <= avail:
        return total
    parts = [f"{name} {_fmt_shape(shape)} {np.dtype(dtype).name} ({_gib(sizes[name])})"
             for name, (shape, dtype) in buffers.items()]
    if work_bytes:
        parts.append(f"{work_name} ({_gib(work_bytes)})")
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    raise MemoryError(
        f"{op}: needs {_gib(total)} for {listed}, but only {_gib(avail)} of {_where(device)} is "
        "available; use smaller shapes"
    )


def _performance_warning():
    try:
        from numba.cuda.core.errors import NumbaPerformanceWarning
    except ImportError:  # pragma: no cover - older numba-cuda
        from numba.core.errors import NumbaPerformanceWarning
    return NumbaPerformanceWarning


#: shared memory a block may use without opting in (a static array's limit)
_SHARED_DEFAULT = 48 * 1024


def opt_in_shared(kernel, args, nbytes):
    """Let ``kernel`` (a dispatcher, compiled here for ``args`` if it is not yet) launch with
    ``nbytes`` of dynamic shared memory past 48 KiB (the NumPy-input path on a GPU, which
    launches through Numba's dispatcher).  The build it sets is the one ``typeof_pyval`` of
    ``args`` selects, which is the one the launch then uses (numba-cuda 0.30 types launch
    arguments the same way); were they ever to differ, the launch would fail for its
    shared-memory size, loudly."""
    if nbytes <= _SHARED_DEFAULT or on_simulator():
        return
    from .launch import set_max_dynamic_shared

    compiled = kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))
    set_max_dynamic_shared(compiled._codelibrary.get_cufunc(), nbytes)


_CUDA_DRIVER = None


def device_module(x, name="array"):
    """The array library that runs a device call on ``x``: the stand-in device for its arrays
    (:mod:`numba_flash.standin`), else CuPy (CuPy arrays, and any other
    ``__cuda_array_interface__`` object, imported as a CuPy view).  A ``TypeError`` in the
    simulator (no GPU to run on), an ``ImportError`` naming the wheel without CuPy."""
    if type(x).__module__ == "numba_flash.standin":
        from .. import standin

        return standin
    if on_simulator():
        raise TypeError(
            f"{name}: GPU arrays (CuPy / __cuda_array_interface__) need the CUDA backend, "
            "but kernels run in the simulator here; pass numpy.ndarray instead"
        )
    try:
        import cupy
    except ImportError as exc:
        from ..install_hints import pip_extra

        raise ImportError(f"{name}: device arrays are run through CuPy, which is not "
                          f"installed: {pip_extra('cupy12')}") from exc
    return cupy


def device_driver(xp):
    """The launcher of a device call on ``xp``'s arrays: the stand-in's own, or CUDA's
    (:class:`~numba_flash.frontend.launch.CudaDriver`)."""
    driver = getattr(xp, "DRIVER", None)
    if driver is not None:
        return driver
    global _CUDA_DRIVER
    if _CUDA_DRIVER is None:
        from .launch import CudaDriver

        _CUDA_DRIVER = CudaDriver()
    return _CUDA_DRIVER


def import_cai(xp, x):
    """``x`` (any ``__cuda_array_interface__`` object: a Numba device array, a torch tensor)
    as an ``xp`` array over the same memory: no copy and no synchronisation (the call runs on
    ``xp``'s current stream; ordering it after the producer's work is the caller's part, as
    numba_flash.torch does by making torch's current stream CuPy's)."""
    cai = x.__cuda_array_interface__
    dtype = getattr(x, "dtype", None)
    dtype = dtype if dtype == BFLOAT16 else np.dtype(cai["typestr"])
    shape = tuple(int(n) for n in cai["shape"])
    strides = cai.get("strides")
    if strides is None:
        strides, step = [], dtype.itemsize
        for n in reversed(shape):
            strides.append(step)
            step *= max(1, n)
        strides = tuple(reversed(strides))
    ptr = int(cai["data"][0])
    lo = sum((n - 1) * st for n, st in zip(shape, strides) if st < 0 and n > 0)
    hi = sum((n - 1) * st for n, st in zip(shape, strides) if st > 0 and n > 0) + dtype.itemsize
    mem = xp.cuda.UnownedMemory(ptr + lo, hi - lo, x)
    return xp.ndarray(shape, dtype, memptr=xp.cuda.MemoryPointer(mem, -lo), strides=strides)


class ArrayCall:
    """Array handling for one public call; ``inputs`` are the user's arrays, by name.

    ``op`` names the call in error messages (default: the calling function's name).

    With device arrays (``on_device``) the call runs on ``xp``, the array library (CuPy, or the
    stand-in device), on its current stream: inputs are views (no copy, no synchronisation),
    outputs ``xp.empty`` (zeroed or poisoned by a memset on the stream), launches go through
    :class:`~numba_flash.frontend.launch.PreparedLaunch` and the library's ``driver``, and a
    call being recorded for a launch plan (:mod:`numba_flash.frontend.plans`) reports each
    allocation, memset and launch to its ``trace``.
    """

    def __init__(self, inputs, op=None):
        self.op = op or sys._getframe(1).f_code.co_name
        self._inputs = dict(inputs)
        # the outputs allocated as bfloat16 words, by id, held so that no id is reused: a freed
        # intermediate's id given to a later float32 output made result() view it as bfloat16
        self._bf16 = {}
        self._guards = []  # (device copy, host guard) of NUMBA_FLASH_CHECK_AUX's aux guards
        self._outs = {}    # id(kernel's array) -> (it, the caller's out= array)
        self._copy_back = set()   # ids of those result() copies into a strided out=
        self.device_id = None
        self.stream = 0
        self.xp = self.driver = self.trace = None
        device = [(n, x) for n, x in inputs.items() if is_device_array(x)]
        self.on_device = bool(device)
        if not self.on_device:
            return
        first_name, first = device[0]
        xp = self.xp = device_module(first, first_name)
        self.driver = device_driver(xp)
        from .plans import DEVICE_MODULES

        DEVICE_MODULES[xp.ndarray] = xp   # the ops' fast path knows the library from now on
        ids = {n: getattr(getattr(x, "device", None), "id", None) for n, x in device}
        self.device_id = int(ids[first_name]) if ids[first_name] is not None else None
        for name, dev in ids.items():
            if dev is not None and self.device_id is not None and int(dev) != self.device_id:
                raise ValueError(
                    f"{name}: expected an array on GPU {self.device_id} (the device of "
                    f"{first_name}), got one on GPU {dev}"
                )
        # another producer's arrays (a Numba device array, a torch tensor): results go back as
        # that producer's kind where the library knows one (result())
        self._foreign = type(first) is not xp.ndarray
        with self.device():
            # the library's current stream on that device (0: the legacy default stream)
            self.stream = int(xp.cuda.get_current_stream().ptr)
        from .plans import active_trace

        self.trace = active_trace()
        if self.trace is not None:
            self.trace.device(xp, self.driver, self.stream)

    @property
    def _cupy(self):
        """The device array library (CuPy, or the stand-in device), None for host arrays."""
        return self.xp

    def device(self):
        """Context manager: the array library's current device is the inputs' device (no-op
        otherwise)."""
        if self.xp is None or self.device_id is None:
            return contextlib.nullcontext()
        return self.xp.cuda.Device(self.device_id)

    # -- sizes -------------------------------------------------------------------------------
    def reserve(self, buffers, work_bytes=0, strided=False):
        """Check that ``buffers`` (``{name: (shape, dtype)}``: every output and workspace of the
        call) fit, together with the device copies of NumPy inputs (and contiguous copies of
        non-contiguous ones, but for the views :meth:`input` with ``strided`` hands over as they
        lie) and ``work_bytes``, before allocating any of them.  Call it before the first
        :meth:`input`."""
        copies = 0
        for x in self._inputs.values():
            size = getattr(x, "nbytes", None)
            if size is None:  # None or a non-array entry: nothing to copy
                continue
            contiguous = getattr(getattr(x, "flags", None), "c_contiguous", True)
            if not self.on_device:
                copies += int(size) * (1 if contiguous else 2)
            elif not contiguous and not (strided and strided_view(x)):
                copies += int(size)
        with self.device():
            return check_memory(self.op, buffers, device=True, work_bytes=copies + work_bytes,
                                work_name="input copies and work arrays")

    def _check(self, what, shape, dtype):
        with self.device():
            check_memory(self.op, {what: (shape, dtype)}, device=True)

    # -- inputs ------------------------------------------------------------------------------
    def input(self, x, strided=False):
        """The array as the kernel takes it: C-contiguous, on the backend's memory; with
        ``strided`` (a kernel that reads its strides) a view whose last dim is contiguous
        (:func:`strided_view`) as it is, on the device and in the simulator."""
        dx = self._input(x, strided)
        if getattr(x, "aux_guard_sites", None) is not None:  # read back after each launch
            self._guards.append((dx, x))
        return dx

    def _input(self, x, strided=False):
        if not self.on_device:
            # the user's NumPy input, or one the op made on the host: where the kernels run
            if on_simulator() and x.flags.aligned and (
                    x.flags.c_contiguous or (strided and strided_view(x))):
                # the simulator's device memory is the host's: the kernel gets the view itself,
                # at its own address, as a GPU gets a CuPy view (zero copy), so an offset view
                # meets the alignment rules there as it would on the GPU (a view not aligned
                # to its elements is copied, as a device call copies one)
                return simulator.device_view(_words(x))
            self._check("an input copy", x.shape, x.dtype)
            return cuda.to_device(_words(np.ascontiguousarray(x)), stream=self.stream)
        xp = self.xp
        if isinstance(x, np.ndarray):
            # a host array beside device inputs (made by the op, or given by the user): copied
            # to the device, every call (a launch plan cannot replay it)
            if self.trace is not None:
                self.trace.fail(f"a host array {list(x.shape)} is copied to the device")
            self._check("an input copy", x.shape, x.dtype)
            with self.device():
                return _words(xp.asarray(np.ascontiguousarray(x)))
        if type(x) is not xp.ndarray:   # another producer's array: a view, no synchronisation
            x = import_cai(xp, x)
        misaligned = x.data.ptr % x.dtype.itemsize != 0   # every element load would fault
        if (not x.flags.c_contiguous and not (strided and strided_view(x))) or misaligned:
            self._check("a contiguous input copy", x.shape, x.dtype)
            if self.trace is not None:
                self.trace.fail("a non-contiguous or misaligned input is copied")
            with self.device():
                x = xp.ascontiguousarray(x) if not misaligned else x.copy()
        return _words(x)

    # -- outputs -----------------------------------------------------------------------------
    def empty(self, shape, dtype):
        """An output array (NaN-poisoned inside :func:`poisoned_outputs`); bfloat16 as its
        uint16 words (:meth:`result` views it back)."""
        dtype = np.dtype(dtype)
        self._check("an output", shape, dtype)
        bf16 = dtype == BFLOAT16
        alloc = np.dtype(np.uint16) if bf16 else dtype
        if self.on_device:
            with self.device():
                arr = self.xp.empty(shape, alloc)
            if self.trace is not None:
                self.trace.alloc(arr)
            if _POISON:   # every byte 0xFF: a NaN in every float format (-1 in an integer)
                self._memset(arr, 0xFF)
        else:
            host = np.empty(shape, alloc)
            if _POISON:
                host.fill(BF16_NAN_BITS if bf16 else _poison_value(dtype))
            arr = cuda.to_device(host, stream=self.stream)
        if bf16:
            self._bf16[id(arr)] = arr
        return arr

    def output(self, out, shape, dtype, strided=None):
        """The array a result is written into: the caller's ``out=`` (checked with
        :func:`~numba_flash.frontend.validate.check_out`), written in place, or a new output
        (:meth:`empty`) when None; :meth:`result` gives ``out`` itself back.  A user's strided
        ``out`` (``check_out(strided=True)``) is written in place by a kernel that writes
        through strides (``strided=True``), or (``strided=False``) into a new output that
        :meth:`result` copies into it; ``None``: ``out`` as it is (an op's own view, e.g. the
        varlen backward's ``[1, H, total, d]`` views of whole packed arrays)."""
        if out is None:
            return self.empty(shape, dtype)
        contiguous = is_c_contiguous(out)
        if not contiguous and strided is False:
            dev = self.empty(shape, dtype)
            self._outs[id(dev)] = (dev, out)
            self._copy_back.add(id(dev))
            return dev
        if self.on_device:
            xp = self.xp
            dev = _words(out if type(out) is xp.ndarray else import_cai(xp, out))
            # (a strided out= is not poisoned on a device: a memset would write the caller's
            # memory between its rows, and a fill is work a launch plan does not replay; the
            # simulator's host path poisons it, element by element, below)
            if _POISON and (contiguous or strided is None):
                self._memset(dev, 0xFF)
        elif on_simulator():   # the simulator writes the caller's memory itself
            if _POISON:
                out.fill(np.nan)
            dev = simulator.device_view(_words(out))
        else:                  # NumPy on a GPU: a device array, copied back by result()
            dev = self.empty(shape, dtype)
        self._outs[id(dev)] = (dev, out)
        return dev

    def zeros(self, shape, dtype):
        """A zero-filled work buffer (for atomics)."""
        self._check("a work buffer", shape, dtype)
        if not self.on_device:
            return cuda.to_device(np.zeros(shape, dtype), stream=self.stream)
        with self.device():
            arr = self.xp.empty(shape, dtype)
        if self.trace is not None:
            self.trace.alloc(arr)
        self._memset(arr, 0)
        return arr

    def _memset(self, arr, byte):
        """Every byte of device array ``arr`` set to ``byte``, on the call's stream."""
        from .launch import data_pointer

        if self.trace is not None:
            self.trace.memset(arr, byte, arr.nbytes)
            if self.trace.dry:
                return
        self.driver.memset(data_pointer(arr), byte, arr.nbytes, self.stream)

    def result(self, x):
        """Give a kernel output back in the kind the caller passed in (a bfloat16 output,
        allocated as words by :meth:`empty`, viewed as bfloat16 again: no copy on the GPU).
        Device calls give the array library's arrays (CuPy's), or for another producer's inputs
        (a Numba device array...) Numba device arrays over the same memory."""
        given = self._outs.get(id(x))
        if given is not None and given[0] is x:   # the caller's out=: written, returned
            if id(x) in self._copy_back:          # a strided out= a kernel wrote elsewhere
                self._copy_into(given[1], x)
            elif not self.on_device and not on_simulator():
                x.copy_to_host(_words(given[1]), stream=self.stream)
            return given[1]
        bf16 = self._bf16.get(id(x)) is x
        if not self.on_device:
            host = x.copy_to_host(stream=self.stream)
            return host.view(BFLOAT16) if bf16 else host
        if self._foreign:   # the producer's kind: a Numba device array (bfloat16 as its words)
            return self._as_producer(x)
        return x.view(BFLOAT16) if bf16 else x

    def _copy_into(self, out, x):
        """The kernel's output ``x`` copied into the caller's strided ``out=`` (an op whose
        kernel writes only C-contiguous arrays)."""
        if not self.on_device:
            _words(out)[...] = x.copy_to_host(stream=self.stream)
            return
        if self.trace is not None:
            self.trace.fail("a strided out= is copied into")
        xp = self.xp
        with self.device():
            _words(out if type(out) is xp.ndarray else import_cai(xp, out))[...] = x

    def _as_producer(self, x):
        """A result for another producer's inputs: a Numba device array over the same memory
        (no copy, no synchronisation), or the stand-in's ``CAIArray`` there."""
        maker = getattr(self.xp, "CAIArray", None)
        if maker is not None:
            return maker(x)
        return cuda.as_cuda_array(x, sync=False)

    def launch(self, kernel, grid, block, *args, work=None, shared=0):
        """Launch ``kernel[grid, block, stream, shared](*args)`` (on the inputs' device).

        ``work`` (a :class:`~numba_flash.frontend.sim_time.SimWork`) describes what the threads
        do, for the simulator's time estimate and its warning before a long launch; it changes
        nothing on the GPU.  ``shared``: bytes of dynamic shared memory (past 48 KiB opted into
        first).  Device calls launch through a
        :class:`~numba_flash.frontend.launch.PreparedLaunch` (reported to the call's trace)."""
        if self.on_device:
            from .launch import PreparedLaunch, arg_type

            with self.device():
                prep = PreparedLaunch(self.driver, kernel, [arg_type(a) for a in args], args,
                                      grid, block, shared, self.stream)
                if self.trace is not None:
                    self.trace.launch(prep)
                    if self.trace.dry:   # a plan made ahead: recorded, not run
                        return
                prep.run_direct()
            self._check_guards()
            return
        if not on_simulator():   # NumPy inputs on a GPU: Numba's dispatcher
            with self.device(), warnings.catch_warnings():
                # numba warns on every grid under 128 blocks; a small problem is not a mistake
                warnings.simplefilter("ignore", _performance_warning())
                opt_in_shared(kernel, args, shared)
                kernel[grid, block, self.stream, shared](*args)
            self._check_guards()
            return
        if _ESTIMATES is not None:  # inside estimate_only(): record, do not run
            name = getattr(getattr(kernel, "py_func", None), "__name__", "kernel")
            _ESTIMATES.append((name, simulator_seconds(grid, block, work)))
            return
        warn_if_slow(kernel, grid, block, work)
        from .launch import simulate_launch

        simulate_launch(kernel, grid, block, shared, args, self.stream)
        self._check_guards()

    def _check_guards(self):
        """NUMBA_FLASH_CHECK_AUX=1: an aux read out of range in the launch is an IndexError
        (:mod:`numba_flash.flex.aux_check`; one synchronisation per launch)."""
        for dev, guard in self._guards:
            if self.on_device:
                from .plans import note_host_read

                note_host_read("NUMBA_FLASH_CHECK_AUX's guard")
                with self.device():
                    found = self.xp.asnumpy(dev)
            else:
                found = dev.copy_to_host()
            if found[0]:
                raise guard.report(found)


# -- small integer arrays (lengths, tables, offsets) -----------------------------------------
#: integer dtypes the kernels read directly; others are converted
KERNEL_INTS = (np.dtype(np.int32), np.dtype(np.int64))


def host_ints(x, name="an integer array"):
    """Host copy of a small integer array (NumPy as is; a device array is copied to the host:
    only in the validating mode, a synchronisation)."""
    if is_device_array(x):
        from .plans import note_host_read

        note_host_read(name)
        xp = device_module(x, name)
        if type(x) is not xp.ndarray:
            x = import_cai(xp, x)
        return xp.asnumpy(x)
    return np.asarray(x)


def kernel_ints(call, x, name):
    """``x`` as an int32/int64 array the kernel reads: as it is for those dtypes; other integer
    dtypes converted on the device for CuPy (a uint64 beyond int64 turns negative there, which
    the kernels treat as bad), through the host for other device arrays (documented)."""
    dt = array_info(name, x)[1]
    if dt in KERNEL_INTS:
        return call.input(x)
    if call._cupy is not None:
        return call.input(x.astype(call._cupy.int64))
    host = host_ints(x)
    return call.input(np.clip(host, -1, np.iinfo(np.int64).max).astype(np.int64))
