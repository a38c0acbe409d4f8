"""``numba_flash.torch``: flash-attn 2's Python API on numba_flash's kernels, for torch tensors.

Replace ``from flash_attn import flash_attn_func`` with ``from numba_flash.torch import
flash_attn_func``: same names, arguments, defaults, ``[batch, seqlen, nheads, headdim]``
layouts and return values (:mod:`numba_flash.torch.interface`), with autograd
(:mod:`numba_flash.torch.autograd`) and ``torch.library`` custom ops with fake implementations
for ``torch.compile`` (:mod:`numba_flash.torch.ops`).  CPU tensors run in the Numba CUDA
simulator (zero-copy NumPy views; slow: tiny shapes), CUDA tensors on the GPU (zero-copy CuPy
views, torch's current stream; needs CuPy).  Also flash-attn's ``bert_padding`` helpers
(:func:`unpad_input`, :func:`pad_input`) and :func:`register_transformers`, which makes
``attn_implementation="numba_fa"`` work in Hugging Face transformers.

float16, bfloat16, float32 and float64 tensors (bfloat16 reaches the kernels as its 16-bit words:
no copy).  Not yet: ``flash_attn_with_kvcache`` (``numba_flash.decode`` covers it on
NumPy/CuPy arrays).
Needs ``torch>=2.4`` (``pip install 'numba_flash[torch]'``).
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("numba_flash.torch needs PyTorch (>= 2.4): pip install "
                      "'numba_flash[torch]'") from exc

from .bert_padding import pad_input, unpad_input
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func)

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "unpad_input", "pad_input",
           "register_transformers"]


def register_transformers(name="numba_fa"):
    """Register numba_flash as transformers' ``attn_implementation=name``; see
    :func:`numba_flash.torch.transformers.register_transformers`."""
    from .transformers import register_transformers as register

    return register(name)
