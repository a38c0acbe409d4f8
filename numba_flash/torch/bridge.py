"""Torch tensors to the arrays numba_flash's NumPy front end takes, and results back.

* CPU tensors become NumPy views (``t.detach().numpy()``, zero copy, any strides); the front end
  copies them once to where the kernels run (the simulator's "device" memory, or the GPU).
* CUDA tensors become CuPy views through ``__cuda_array_interface__`` (zero copy), and the
  kernels run on the tensor's device on torch's current stream there: :func:`on_device` makes
  that stream CuPy's current stream, which numba_flash launches on.  Results come back through
  DLPack (zero copy).  This path needs CuPy and a GPU; it is written to that contract but has
  not been run (no GPU was available when it was written).

Nothing here copies an input or writes to one.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch


def as_array(t):
    """A zero-copy NumPy (CPU) or CuPy (CUDA) view of ``t``, same shape and strides."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.numpy()
    import cupy  # a CUDA tensor: checks.check_device has already required the CUDA backend

    return cupy.asarray(t)


def as_heads_first(t):
    """A ``[B, N, H, d]`` tensor as the ``[B, H, N, d]`` array view the NumPy ops take."""
    return as_array(t).transpose(0, 2, 1, 3)


def to_tensor(a, device):
    """A result array of the front end as a torch tensor on ``device`` (zero copy)."""
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    return torch.from_dlpack(a).to(device)  # CuPy: already on ``device``; .to is a no-op


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
