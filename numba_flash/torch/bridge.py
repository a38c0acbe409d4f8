"""Torch tensors to the arrays numba_flash's front end takes, and results back.

* CPU tensors become NumPy views (``t.detach().numpy()``, zero copy, any strides); the front end
  copies them once to where the kernels run (the simulator's "device" memory, or the GPU).
  A bfloat16 tensor (which NumPy cannot hold) is viewed as its int16 words and those as
  ``ml_dtypes.bfloat16`` (still zero copy); a bfloat16 result goes back the same way.  A
  ``float8_e4m3fn`` tensor (``.numpy()`` refuses it) is viewed as its bytes and those as
  ``ml_dtypes.float8_e4m3fn`` (zero copy); the fp8 callers pass :func:`fp8_bytes` instead,
  uint8 on either device (CuPy has no fp8 dtype), with the front end's ``"fp8_e4m3"`` flag.
* CUDA tensors (the device path) become CuPy arrays over the tensor's own memory, made from its
  data pointer, shape and strides (:func:`device_array`): no copy and no synchronisation (not
  ``cupy.asarray``, which waits for the stream a ``__cuda_array_interface__`` names; a
  bfloat16 tensor keeps ``ml_dtypes.bfloat16``, CuPy >= 14).  The kernels run on the tensor's
  device on torch's current stream there: :func:`on_device` makes that stream CuPy's current
  stream, which numba_flash launches on, so they follow the work torch queued before the call
  and the results are returned while the GPU still runs.  The wrappers allocate their outputs
  with torch (:func:`empty`: torch's caching allocator, on the current stream) and pass them to
  the ops as ``out=``, so results are torch tensors from the start; an output an op allocates
  itself (``softmax_lse``: the ops take no ``out=`` for it) comes back through DLPack (zero
  copy, no synchronisation on one stream).  The dense forward's kernels read a ``[B, N, H,
  d]`` tensor through its strides (:func:`heads_first_view`: no copy); where an op needs a
  C-contiguous heads-first array (the backward), the wrappers make that copy with torch
  (:func:`heads_first`, :func:`contiguous`: one allocation and one copy kernel each, on the
  stream).
* :func:`standin_tensors` (tests): CPU tensors take the device path on numba_flash's stand-in
  device (:mod:`numba_flash.standin`): their memory adopted as stand-in device memory in place
  (zero copy), outputs allocated by torch on the CPU and adopted, so the wrappers' device code
  runs on this machine down to the launch, and counts its allocations and copies.

Nothing here copies an input or writes to one (a copy is a new tensor; the ops write only the
outputs and, in ``flash_attn_with_kvcache``, the caches).
"""

from __future__ import annotations

import contextlib
import ctypes

import ml_dtypes
import numpy as np
import torch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
#: torch's e4m3 (an fp8 KV cache, FA3's fp8 q / k / v)
E4M3_TORCH = getattr(torch, "float8_e4m3fn", None)

#: torch dtype -> the NumPy dtype of its device arrays
_NP_DTYPES = {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
              torch.float64: np.dtype(np.float64), torch.bfloat16: BFLOAT16,
              torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8),
              torch.int16: np.dtype(np.int16), torch.int32: np.dtype(np.int32),
              torch.int64: np.dtype(np.int64), torch.bool: np.dtype(np.bool_)}
if E4M3_TORCH is not None:
    _NP_DTYPES[E4M3_TORCH] = E4M3

def numpy_dtype(dtype):
    """The NumPy dtype of a torch dtype's arrays (bfloat16: ``ml_dtypes.bfloat16``)."""
    return _NP_DTYPES[dtype]


#: the :class:`StandInTensors` of an active :func:`standin_tensors` block, or None
_STANDIN = None


class StandInTensors:
    """What :func:`standin_tensors` yields: ``allocations`` and ``copies`` count the torch
    tensors the wrappers allocated (outputs, :func:`empty`) and the contiguous copies they made
    (:func:`contiguous`), each listed in ``log`` as ``(kind, shape)``; :meth:`reset` zeroes
    them.  ``stream``: the stand-in stream handle that plays torch's current stream."""

    def __init__(self, stream=None):
        from .. import standin

        self.sd = standin
        self.stream = stream
        self._adopted = {}   # storage address -> (uint8 NumPy view, the storage): kept alive
        self.reset()

    def reset(self):
        self.allocations = self.copies = 0
        self.log = []

    def note(self, kind, t):
        if kind == "alloc":
            self.allocations += 1
        else:
            self.copies += 1
        self.log.append((kind, tuple(t.shape)))

    def adopt(self, t):
        """Make the storage of CPU tensor ``t`` stand-in device memory (once per storage)."""
        st = t.untyped_storage()
        base, nbytes = st.data_ptr(), st.nbytes()
        if base in self._adopted or nbytes == 0:
            return
        whole = np.ctypeslib.as_array((ctypes.c_ubyte * nbytes).from_address(base))
        # freed stand-in buffers are forgotten first: standin's registry looks up the nearest
        # start below an address, so a dead record starting inside this storage would be found
        # for its later addresses (and refused as freed memory)
        self.sd.MEMORY._forget()
        self.sd.adopt(whole)
        self._adopted[base] = (whole, st)


@contextlib.contextmanager
def standin_tensors(stream=None):
    """Tests: within this block CPU tensors are device tensors on the stand-in device
    (:mod:`numba_flash.standin`): every wrapper runs its device path (the CUDA tensors' one)
    on them, their memory adopted as stand-in memory in place (``standin.adopt``), its outputs
    allocated by torch on the CPU and adopted; ``stream`` (an int handle) plays torch's current
    stream (None: the stand-in's default stream).  Combine with ``standin.device(execute=True)``
    to run the launches in the simulator and ``standin.count()`` to count what a call does.
    Yields a :class:`StandInTensors` (the wrappers' own torch allocations and copies).  The
    adopted storages are kept alive until the block ends."""
    global _STANDIN
    mode, old = StandInTensors(stream), _STANDIN
    _STANDIN = mode
    try:
        yield mode
    finally:
        _STANDIN = old
        mode._adopted.clear()


def is_device(device):
    """True where tensors on ``device`` take the device path: CUDA, or the CPU inside
    :func:`standin_tensors`."""
    return device.type == "cuda" or (_STANDIN is not None and device.type == "cpu")


def device_array(t):
    """A device array (CuPy's, or the stand-in's) over CUDA tensor ``t``'s memory, same shape
    and strides: no copy, no synchronisation; it keeps ``t`` alive."""
    t = t.detach()
    dtype = _NP_DTYPES.get(t.dtype)
    if dtype is None:
        raise TypeError(f"a {t.dtype} tensor has no device array dtype")
    if _STANDIN is not None and t.device.type == "cpu":
        xp, device_id = _STANDIN.sd, 0
        _STANDIN.adopt(t)
    else:
        import cupy as xp  # a CUDA tensor: checks.check_device has required the CUDA backend

        device_id = t.device.index
    shape = tuple(t.shape)
    if t.numel() == 0:   # nothing to point at (no launch reads an empty array)
        return xp.ndarray(shape, dtype)
    item = dtype.itemsize
    strides = tuple([s * item for s in t.stride()])
    span = item   # the bytes from the first element to the end of the last
    for n, s in zip(shape, strides):
        span += (n - 1) * s
    mem = xp.cuda.UnownedMemory(t.data_ptr(), span, t, device_id)
    return xp.ndarray(shape, dtype, memptr=xp.cuda.MemoryPointer(mem, 0), strides=strides)


def host_array(t):
    """A zero-copy NumPy view of CPU tensor ``t`` (bfloat16 through its int16 words, e4m3
    through its bytes), whatever the mode."""
    t = t.detach()
    if t.dtype == E4M3_TORCH:
        return t.view(torch.uint8).numpy().view(E4M3)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)
    return t.numpy()


def as_array(t):
    """A zero-copy NumPy (CPU) or device (CUDA; the CPU in :func:`standin_tensors`) view of
    ``t``, same shape and strides (bfloat16: ``ml_dtypes.bfloat16``; a CPU float8_e4m3fn
    tensor: ``ml_dtypes.float8_e4m3fn`` through its bytes)."""
    if t.device.type == "cpu" and _STANDIN is None:
        return host_array(t)
    return device_array(t)


def fp8_bytes(t):
    """A ``float8_e4m3fn`` tensor's bytes as a zero-copy uint8 NumPy (CPU) or CuPy (CUDA) view,
    same shape and strides: the form the front end reads as e4m3 under ``qkv_dtype`` /
    ``kv_cache_dtype="fp8_e4m3"`` (CuPy has no fp8 dtype; one path for both devices)."""
    return as_array(t.view(torch.uint8))


def optional_array(t):
    """:func:`as_array` of an optional tensor (``alibi_slopes``, ``learnable_sink``): None
    stays None."""
    return None if t is None else as_array(t)


def as_heads_first(t):
    """A ``[B, N, H, d]`` tensor as the ``[B, H, N, d]`` array view the NumPy ops take."""
    return as_array(t).transpose(0, 2, 1, 3)


# -- the device path's torch work: counted inside standin_tensors() ------------------------------
def empty(shape, dtype, device):
    """An output tensor, allocated by torch (on CUDA: its caching allocator, current stream)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _STANDIN is not None:
        _STANDIN.note("alloc", t)
    return t


def lse_out(shape, q):
    """A ``softmax_lse`` tensor for an op's ``lse_out=`` (allocated by torch: :func:`empty`),
    float32 (float64 for float64 ``q``), and its array for the front end: ``(tensor,
    array)``."""
    t = empty(shape, torch.float64 if q.dtype == torch.float64 else torch.float32, q.device)
    return t, as_array(t)


def contiguous(t):
    """``t`` itself when C-contiguous, else torch's contiguous copy of it."""
    if t.is_contiguous():
        return t
    c = t.contiguous()
    if _STANDIN is not None:
        _STANDIN.note("copy", c)
    return c


def copy_into(dst, src):
    """``dst.copy_(src)`` (a cache written back from its heads-first copy), counted."""
    dst.copy_(src)
    if _STANDIN is not None:
        _STANDIN.note("copy", dst)


def heads_first(t):
    """``[B, N, H, d]`` tensor ``t`` as the ``[B, H, N, d]`` array an op reads: on the host a
    strided view (the front end copies NumPy inputs to the device anyway); on the device path
    a view of ``t`` when that is C-contiguous (``N == 1`` or ``H == 1``), else of torch's
    contiguous copy (the ops take C-contiguous device arrays; issue 61)."""
    if not is_device(t.device):
        return as_heads_first(t)
    return device_array(contiguous(t.detach().transpose(1, 2)))


def heads_first_view(t):
    """``[B, N, H, d]`` tensor ``t`` as the ``[B, H, N, d]`` view an op that reads strides
    takes (:func:`numba_flash.forward`: the SIMT and tensor-core kernels read flash-attn's
    memory where it lies): a view of ``t`` on the host and on the device path, no copy; a
    tensor whose last dim is not contiguous (an expanded ``dout``: stride 0) is
    :func:`heads_first`'s copy, as the op would copy it anyway."""
    if not is_device(t.device):
        return as_heads_first(t)
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return heads_first(t)
    return device_array(t.detach().transpose(1, 2))


def packed(t):
    """A packed ``[total, H, d]`` tensor (or any other input) as the array an op reads: on the
    device path C-contiguous (a view of ``t``, or of torch's contiguous copy of a strided one,
    e.g. ``qkv.unbind(1)``'s); on the host ``t``'s view."""
    if not is_device(t.device):
        return as_array(t)
    return device_array(contiguous(t.detach()))


def packed_view(t):
    """A packed ``[total, H, d]`` tensor as the view an op that reads strides takes
    (:func:`numba_flash.forward_varlen`: a fused projection's ``qkv.unbind(1)`` slices where
    they lie); a tensor whose last dim is not contiguous is :func:`packed`'s copy."""
    if not is_device(t.device):
        return as_array(t)
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return packed(t)
    return device_array(t.detach())


def packed_arrays(*tensors):
    """:func:`packed` of each tensor, one array for a tensor given twice (``cu_seqlens_q is
    cu_seqlens_k``): two arrays starting at one address would be ambiguous to a launch plan,
    which then never replays the call."""
    seen = {}
    return [seen[id(t)] if id(t) in seen else seen.setdefault(id(t), packed(t))
            for t in tensors]


class SeqFirstOut:
    """A ``[B, N, H, d]`` result (contiguous, flash-attn's layout) that an op writes as the
    ``[B, H, N, d]`` array :attr:`array` (``out=``): in place when the op writes through
    strides (``strided``: the dense forward) or that view is C-contiguous (``N == 1`` or ``H ==
    1``), else into a heads-first tensor that :meth:`result` copies to the result's layout."""

    __slots__ = ("tensor", "heads_first", "array")

    def __init__(self, shape, dtype, device, strided=False):
        b, n, h, d = shape
        if strided or n == 1 or h == 1 or b * n * h * d == 0:   # (else: no view C-ordered)
            self.tensor = empty((b, n, h, d), dtype, device)
            self.heads_first = self.tensor.transpose(1, 2)
        else:
            self.tensor, self.heads_first = None, empty((b, h, n, d), dtype, device)
        self.array = as_array(self.heads_first)

    def result(self):
        """The ``[B, N, H, d]`` tensor, contiguous."""
        if self.tensor is not None:
            return self.tensor
        return contiguous(self.heads_first.transpose(1, 2))


def to_tensor(a, device):
    """A result array of the front end as a torch tensor on ``device`` (zero copy): a torch
    tensor as it is, NumPy through ``torch.from_numpy``, a stand-in array through its host
    memory, CuPy through DLPack (on the one stream CuPy and torch share: no wait)."""
    if isinstance(a, torch.Tensor):
        return a
    bf16 = a.dtype == BFLOAT16
    if bf16:
        a = a.view(np.int16)  # torch takes the words; viewed back as bfloat16 below
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(a)
    elif type(a).__module__ == "numba_flash.standin":
        t = torch.from_numpy(a._a)   # the stand-in's device memory is host memory
    else:
        t = torch.from_dlpack(a).to(device)  # CuPy: already on ``device``; .to is a no-op
    return t.view(torch.bfloat16) if bf16 else t


def seq_first(a, device):
    """A ``[B, H, N, d]`` result as a contiguous ``[B, N, H, d]`` tensor (flash-attn's layout;
    one O(B N H d) copy, so that ``out.view(...)`` works as it does on flash-attn's output)."""
    return contiguous(to_tensor(a, device).transpose(1, 2))


@contextlib.contextmanager
def on_device(device):
    """Run the front end for tensors on ``device``: for CUDA, under CuPy's ``Device`` of that
    index with torch's current stream as CuPy's current stream; inside
    :func:`standin_tensors`, on its ``stream`` for CPU tensors; nothing for other CPU calls."""
    if device.type != "cuda":
        if _STANDIN is None or _STANDIN.stream is None:
            yield
            return
        with _STANDIN.sd.cuda.ExternalStream(_STANDIN.stream):
            yield
        return
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    ptr = torch.cuda.current_stream(index).cuda_stream
    with cupy.cuda.Device(index):
        # torch's stream as CuPy's current one (0: the legacy default stream, CuPy's null one)
        stream = cupy.cuda.ExternalStream(ptr, index) if ptr else cupy.cuda.Stream.null
        with stream:
            yield


def draw_seed(dropout_p):
    """A dropout seed in ``[0, 2**63)`` from torch's default CPU generator (so
    ``torch.manual_seed`` reproduces it), as an int64 ``[1]`` CPU tensor; ``[0]`` without
    dropout (nothing drawn, the generator untouched)."""
    if dropout_p > 0.0:
        return torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)
    return torch.zeros((1,), dtype=torch.int64)
