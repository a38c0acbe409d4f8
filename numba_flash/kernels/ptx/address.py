"""The hardware's alignment rules, checked by the simulator's twins (issue 62).

A GPU faults on an access whose byte address is not a multiple of what the instruction moves
(``CUDA_ERROR_MISALIGNED_ADDRESS``: the launch fails, the context is lost).  The simulator runs
the kernels on NumPy memory, where any address works, so without these checks an offset view
(a CuPy ``uint8`` buffer viewed at an odd offset, a float16 view 8 bytes past a 16-byte
boundary) passes here and faults there.  The twins of :mod:`~numba_flash.kernels.ptx.stages`
and :mod:`~numba_flash.kernels.ptx.wgmma` therefore check the real byte address of every access
against the instruction's rule and raise :class:`MisalignedAddressError`, naming the kernel,
the thread (block and thread index), the array and the address:

=================================================  ========================================
instruction (twin)                                  rule
=================================================  ========================================
``cp.async.cg.shared.global`` (``cp_async16``)      both addresses 16-byte aligned
``ld.global.nc.v4.u32`` (``load16``)                16
``ld.shared.v4.f32`` / ``.v2.f64`` (``lds16``)      16
``ldmatrix...x4`` (``ldmatrix_x4[_trans]``)         each lane's row address 16
``red.global.add.f32`` (``red_add``)                4
``ld.global`` of one element (``load_u16``,         the element's size (e4m3 words: 4)
``load_at``)
``wgmma`` descriptor                                start 16; a swizzled operand starts in
                                                    the first row of a pattern aligned to
                                                    8 x the swizzle's bytes
a launch (every array argument)                     its element size (plain ``x[i]`` loads
                                                    and stores)
=================================================  ========================================

Addresses:

* **global**: the array's data pointer (``ndarray.__array_interface__``; a simulator device
  array wraps a NumPy array, and the front end hands a contiguous NumPy input to a simulated
  kernel at its own address, as a GPU takes a CuPy view) plus the flat element's byte offset;
* **shared**: the simulator's shared arrays are NumPy arrays wherever ``malloc`` put them, while
  the device build declares them 16-byte aligned (``cuda.shared.array(..., alignment=16)``,
  :data:`~numba_flash.kernels.ptx.stages.SHARED_ALIGN`; the wgmma kernels align their arena at
  run time).  So a shared address is modelled as :data:`SHARED_BASE` (16-byte aligned, not 32)
  plus the byte's offset from the start of the shared allocation: what the device sees modulo
  16, whatever the host buffer's address.

A launch (the simulator's ``FakeCUDAKernel.__call__``, wrapped by :func:`install`) records the
kernel's array arguments, so an error can name the argument an address falls in, and checks
each one's natural alignment (an element of a misaligned array is misaligned wherever it is
read); the twins find the running thread through ``threading.current_thread()`` (the
simulator's ``BlockThread``: ``blockIdx``, ``threadIdx``, its block manager's kernel function).

Cost: a check is a few integer operations; the data pointer is looked up once per device
array (cached in the simulator wrapper's ``__dict__``).  Nothing here runs on a GPU: the twins
and :func:`install` exist only in the simulator, and the host predicates
(:func:`data_pointer`, :func:`is_aligned`) read ``__cuda_array_interface__`` there.
"""

from __future__ import annotations

import inspect
import threading

import numpy as np

__all__ = ["MisalignedAddressError", "SHARED_BASE", "data_pointer", "is_aligned",
           "pointer_and_size", "global_address", "shared_address", "check_global", "check_shared",
           "check_launch_args", "install", "misaligned", "where"]

#: the modelled shared address of byte 0 of a shared allocation (the declared 16-byte alignment;
#: not a multiple of 32, so that a rule wider than 16 would see it; also the wgmma twin's
#: :func:`~numba_flash.kernels.ptx.wgmma.smem_address`)
SHARED_BASE = 0x2010

_PTR = "_numba_flash_ptr"   # the cache key in a simulator device array's __dict__


class MisalignedAddressError(RuntimeError, ValueError):
    """An access at an address the instruction cannot use: what a GPU reports as
    ``CUDA_ERROR_MISALIGNED_ADDRESS`` (a failed launch), raised by the simulator's twins.  A
    ``RuntimeError`` (the launch fails) and a ``ValueError`` (the twins' earlier offset checks
    raised that)."""


# -- addresses -------------------------------------------------------------------------------
def _host_array(x):
    """The NumPy array behind a simulator array (kernel argument wrapper, device array) or
    ``x`` itself when it is one; None otherwise."""
    d = getattr(x, "__dict__", None)
    if d is not None:
        item = d.get("_item")   # FakeWithinKernelCUDAArray -> FakeCUDAArray
        if item is not None:
            d = item.__dict__
        ary = d.get("_ary")     # FakeCUDAArray -> ndarray
        if isinstance(ary, np.ndarray):
            return ary
    return x if isinstance(x, np.ndarray) else None


def data_pointer(x):
    """The byte address of ``x``'s first element: a NumPy array (or the simulator's wrappers of
    one) or any object with ``__cuda_array_interface__`` (CuPy, Numba device arrays)."""
    ary = _host_array(x)
    if ary is not None:
        return ary.__array_interface__["data"][0]
    return x.__cuda_array_interface__["data"][0]


def is_aligned(n_bytes, *arrays):
    """Every array's data ``n_bytes``-aligned and (a strided view's) every stride of an axis
    longer than one a multiple of ``n_bytes``, so each row starts aligned (host check:
    simulator and GPU alike)."""
    return all(data_pointer(x) % n_bytes == 0 and
               all(int(st) % n_bytes == 0 for n, st in zip(x.shape[:-1], x.strides[:-1])
                   if int(n) > 1)
               for x in arrays)


def pointer_and_size(src):
    """``(data pointer, itemsize)`` of a global array as a twin gets it, cached on the
    simulator's device array (its NumPy array never changes)."""
    d = getattr(src, "__dict__", None)
    if d is not None:
        item = d.get("_item")
        fake = d if item is None else item.__dict__
        got = fake.get(_PTR)
        if got is not None:
            return got
        ary = fake.get("_ary")
        if isinstance(ary, np.ndarray):
            got = fake[_PTR] = (ary.__array_interface__["data"][0], ary.dtype.itemsize)
            return got
    ary = np.asarray(src)
    return ary.__array_interface__["data"][0], ary.dtype.itemsize


def global_address(src, elem):
    """The byte address of flat element ``elem`` of the C-contiguous global array ``src``."""
    ptr, size = pointer_and_size(src)
    return ptr + int(elem) * size


def _shared_offset(smem):
    """Bytes from the start of ``smem``'s shared allocation to ``smem[0]`` (0 for the array
    ``cuda.shared.array`` returned; a view's distance from its root)."""
    if not isinstance(smem, np.ndarray):   # (a device array standing in for one, in a test)
        smem = _host_array(smem)
        if smem is None:
            return 0
    base = smem.base
    if not isinstance(base, np.ndarray):   # the allocation itself (or dynamic shared memory)
        return 0
    root = base
    while isinstance(root.base, np.ndarray):
        root = root.base
    return (smem.__array_interface__["data"][0] - root.__array_interface__["data"][0])


def shared_address(smem, byte=0):
    """The modelled shared-window address of byte ``byte`` of the shared array ``smem``
    (:data:`SHARED_BASE` + its offset in the allocation + ``byte``)."""
    return SHARED_BASE + _shared_offset(smem) + int(byte)


# -- where: the kernel, the thread, the argument -----------------------------------------------
_LAUNCH = None   # the running launch: (kernel name, [(argument name, start, end)])


def _thread():
    """``(kernel name, block, thread)`` of the running simulated thread (None outside one)."""
    t = threading.current_thread()
    block = getattr(t, "blockIdx", None)
    if block is None:
        return None
    fn = getattr(getattr(t, "_manager", None), "_f", None)
    name = getattr(fn, "__name__", None) or (_LAUNCH[0] if _LAUNCH else "?")
    return name, tuple(block), tuple(t.threadIdx)


def where():
    """``"kernel K, block (x, y, z), thread (x, y, z)"`` of the running simulated thread, or
    ``"a host call (no simulated thread)"``."""
    th = _thread()
    if th is None:
        return "a host call (no simulated thread)"
    return f"kernel {th[0]}, block {th[1]}, thread {th[2]}"


def _argument_at(addr):
    """The launch argument whose memory holds byte ``addr`` (``" (kernel argument 'k')"``), or
    an empty string."""
    for name, start, end in (_LAUNCH[1] if _LAUNCH else ()):
        if start <= addr < end:
            return f" (kernel argument {name!r})"
    return ""


def _raise(twin, instr, nbytes, what, space, addr, rule, expect=None):
    expect = expect or f"a {rule}-byte aligned {space} address"
    arg = _argument_at(addr) if space == "global" else ""
    raise MisalignedAddressError(
        f"{twin}: expected {expect}, got {addr:#x} ({what}{arg}): misaligned address "
        f"(CUDA_ERROR_MISALIGNED_ADDRESS) of {instr} ({nbytes} bytes); in {where()}")


# -- the checks the twins call ---------------------------------------------------------------
def check_global(src, elem, rule, twin, instr, what, nbytes=None, expect=None):
    """Raise :class:`MisalignedAddressError` unless element ``elem`` of the global array
    ``src`` (``what``: its role in the instruction ``instr`` of the twin ``twin``) lies at a
    multiple of ``rule`` bytes; returns the address."""
    ptr, size = pointer_and_size(src)
    addr = ptr + int(elem) * size
    if addr % rule:
        _raise(twin, instr, nbytes or rule, f"element {int(elem)} of {what}", "global", addr,
               rule, expect)
    return addr


def check_shared(smem, byte, rule, twin, instr, what, nbytes=None, expect=None):
    """Raise :class:`MisalignedAddressError` unless byte ``byte`` of the shared array ``smem``
    lies at a multiple of ``rule`` bytes of the shared window; returns the address."""
    addr = SHARED_BASE + _shared_offset(smem) + int(byte)
    if addr % rule:
        _raise(twin, instr, nbytes or rule, f"byte {int(byte)} of {what}", "shared", addr, rule,
               expect)
    return addr


def misaligned(message):
    """A :class:`MisalignedAddressError` with ``message`` and where it happened (the wgmma
    twin's descriptor rules)."""
    return MisalignedAddressError(f"misaligned address (CUDA_ERROR_MISALIGNED_ADDRESS): "
                                  f"{message}; in {where()}")


# -- launches --------------------------------------------------------------------------------
_PARAMS = {}


def _param_names(fn):
    names = _PARAMS.get(fn)
    if names is None:
        try:
            names = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            names = ()
        _PARAMS[fn] = names
    return names


def _device_arrays(name, x, out, depth=0):
    """``(name, ndarray)`` of every simulator device array in ``x`` (tuples and named tuples
    searched: the Variant's arrays as ``va.sink``)."""
    ary = None if isinstance(x, np.ndarray) else _host_array(x)   # (NumPy: copied at launch)
    if ary is not None:
        out.append((name, ary))
    elif isinstance(x, tuple) and depth < 3:
        fields = getattr(x, "_fields", None) or [str(i) for i in range(len(x))]
        for f, v in zip(fields, x):
            _device_arrays(f"{name}.{f}", v, out, depth + 1)
    return out


def check_launch_args(fn, args):
    """The launch record of kernel ``fn`` on ``args``; :class:`MisalignedAddressError` for a
    device array argument whose data is not aligned to its element size (every plain load or
    store of it would fault)."""
    names = _param_names(fn)
    kernel = getattr(fn, "__name__", "kernel")
    found = []
    for i, a in enumerate(args):
        _device_arrays(names[i] if i < len(names) else f"arg{i}", a, found)
    record = []
    for name, ary in found:
        if ary.size == 0:
            continue
        ptr = ary.__array_interface__["data"][0]
        record.append((name, ptr, ptr + ary.nbytes))
        size = ary.dtype.itemsize
        rule = min(size, 16)
        if ary.dtype.kind in "biufc" and rule & (rule - 1) == 0 and ptr % rule:
            raise MisalignedAddressError(
                f"misaligned address (CUDA_ERROR_MISALIGNED_ADDRESS): kernel {kernel} argument "
                f"{name!r} ({ary.dtype}, {size}-byte elements) at global address {ptr:#x}, not "
                f"a multiple of {rule}: every load or store of it faults (checked at launch, "
                f"for every thread)")
    return kernel, record


_installed = False


def install():
    """Wrap the simulator's kernel launch (``FakeCUDAKernel.__call__``) so that a launch checks
    its arguments (:func:`check_launch_args`) and records them for the twins' messages
    (idempotent; device-function calls pass straight through)."""
    global _installed
    if _installed:
        return
    from numba.cuda.simulator import kernel as sim_kernel

    original = sim_kernel.FakeCUDAKernel.__call__

    def __call__(self, *args):
        global _LAUNCH
        if self._device or sim_kernel._kernel_context is not None:
            return original(self, *args)
        record = check_launch_args(self.fn, args)
        _LAUNCH = record
        try:
            return original(self, *args)
        finally:
            _LAUNCH = None

    sim_kernel.FakeCUDAKernel.__call__ = __call__
    _installed = True
