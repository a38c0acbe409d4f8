"""Torch tensors to the arrays numba_flash's NumPy front end takes, and results back.

* CPU tensors become NumPy views (``t.detach().numpy()``, zero copy, any strides); the front end
  copies them once to where the kernels run (the simulator's "device" memory, or the GPU).
  A bfloat16 tensor (which NumPy cannot hold) is viewed as its int16 words and those as
  ``ml_dtypes.bfloat16`` (still zero copy); a bfloat16 result goes back the same way.  A
  ``float8_e4m3fn`` tensor (``.numpy()`` refuses it) is viewed as its bytes and those as
  ``ml_dtypes.float8_e4m3fn`` (zero copy); the fp8 callers pass :func:`fp8_bytes` instead,
  uint8 on either device (CuPy has no fp8 dtype), with the front end's ``"fp8_e4m3"`` flag.
* CUDA tensors become CuPy views through ``__cuda_array_interface__`` (zero copy), and the
  kernels run on the tensor's device on torch's current stream there: :func:`on_device` makes
  that stream CuPy's current stream, which numba_flash launches on.  Results come back through
  DLPack (zero copy).  A bfloat16 CUDA tensor (torch's ``__cuda_array_interface__`` refuses
  bfloat16) goes over as int16 words viewed as CuPy's ``ml_dtypes.bfloat16`` (CuPy >= 14).
  This path needs CuPy and a GPU; it is written to that contract but has not been run (no GPU
  was available when it was written).

Nothing here copies an input or writes to one.
"""

from __future__ import annotations

import contextlib

import ml_dtypes
import numpy as np
import torch

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
#: torch's e4m3 (an fp8 KV cache, FA3's fp8 q / k / v)
E4M3_TORCH = getattr(torch, "float8_e4m3fn", None)


def as_array(t):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of ``t``, same shape and strides (bfloat16:
    ``ml_dtypes.bfloat16``, through a view of the int16 words; a CPU float8_e4m3fn tensor:
    ``ml_dtypes.float8_e4m3fn`` through its bytes)."""
    t = t.detach()
    bf16 = t.dtype == torch.bfloat16
    if bf16:
        t = t.view(torch.int16)  # same itemsize: a view for any strides
    if t.dtype == E4M3_TORCH and t.device.type == "cpu":
        return t.view(torch.uint8).numpy().view(E4M3)
    if t.device.type == "cpu":
        a = t.numpy()
        return a.view(BFLOAT16) if bf16 else a
    import cupy  # a CUDA tensor: checks.check_device has already required the CUDA backend

    a = cupy.asarray(t)
    return a.view(BFLOAT16) if bf16 else a


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


def to_tensor(a, device):
    """A result array of the front end as a torch tensor on ``device`` (zero copy)."""
    bf16 = a.dtype == BFLOAT16
    if bf16:
        a = a.view(np.int16)  # torch takes the words; viewed back as bfloat16 below
    if isinstance(a, np.ndarray):
        t = torch.from_numpy(a)
    else:
        t = torch.from_dlpack(a).to(device)  # CuPy: already on ``device``; .to is a no-op
    return t.view(torch.bfloat16) if bf16 else t


def seq_first(a, device):
    """A ``[B, H, N, d]`` result as a contiguous ``[B, N, H, d]`` tensor (flash-attn's layout;
    one O(B N H d) copy, so that ``out.view(...)`` works as it does on flash-attn's output)."""
    return to_tensor(a, device).transpose(1, 2).contiguous()


@contextlib.contextmanager
def on_device(device):
    """Run the NumPy front end for tensors on ``device``: for CUDA, under CuPy's ``Device`` of
    that index with torch's current stream as CuPy's current stream; nothing for the CPU."""
    if device.type != "cuda":
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
