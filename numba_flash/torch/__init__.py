"""``numba_flash.torch``: flash-attn 2's Python API on numba_flash's kernels, for torch tensors.

Replace ``from flash_attn import flash_attn_func`` with ``from numba_flash.torch import
flash_attn_func``: same names, arguments, defaults, ``[batch, seqlen, nheads, headdim]``
layouts and return values (:mod:`numba_flash.torch.interface`), with autograd
(:mod:`numba_flash.torch.autograd`) and ``torch.library`` custom ops with fake implementations
for ``torch.compile`` (:mod:`numba_flash.torch.ops`).  CPU tensors run in the Numba CUDA
simulator (zero-copy NumPy views; slow: tiny shapes), CUDA tensors on the GPU (zero-copy CuPy
views, torch's current stream, outputs from torch's allocator, no synchronisation; needs CuPy:
:mod:`numba_flash.torch.bridge`).  Also flash-attn's ``bert_padding`` helpers
(:func:`unpad_input`, :func:`pad_input`) and :func:`register_transformers`, which makes
``attn_implementation="numba_fa"`` work in Hugging Face transformers.

Also :func:`flash_attn_with_kvcache` and ``flash_attn_varlen_func(..., block_table=...)``
(:mod:`numba_flash.torch.kvcache`), FlashAttention-4's variant arguments on
:func:`flash_attn_func` / :func:`flash_attn_varlen_func` and FlexAttention's
:func:`flex_attention` / :func:`create_block_mask` with gradients for learnable aux tensors
(:mod:`numba_flash.torch.variants`, :mod:`numba_flash.torch.flex`), and ring attention over a
``torch.distributed`` process group (:func:`ring_flash_attn_func`,
:mod:`numba_flash.torch.ring`).

float16, bfloat16, float32 and float64 tensors (bfloat16 reaches the kernels as its 16-bit words:
no copy), and FlashAttention-3's fp8: ``torch.float8_e4m3fn`` ``q``, ``k``, ``v`` with
``q_descale``, ``k_descale``, ``v_descale`` in :func:`flash_attn_func` (its packed forms and
:func:`flash_attn_varlen_func` too; ``out`` bfloat16, forward only; CUDA tensors by the CPU
ones' route, not yet run on a GPU: :mod:`numba_flash.torch.fp8`) and an e4m3 KV cache in
:func:`flash_attn_with_kvcache`.
Needs ``torch>=2.4``: torch first (its CPU build on a machine without a GPU, ``pip install
'torch==2.13.*' --index-url https://download.pytorch.org/whl/cpu``), then ``pip install
'.[torch]'`` in the numba_flash clone (it is not on PyPI; the README's "PyTorch" section).
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # exercised only without torch (tests/cli/test_cli_issue37.py)
    from numba_flash.install_hints import torch_first

    raise ImportError(f"numba_flash.torch needs PyTorch (>= 2.4): {torch_first('torch')}"
                      ) from exc

from .bert_padding import pad_input, unpad_input
from .flex import create_block_mask, flex_attention
from .interface import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                        flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                        flash_attn_varlen_qkvpacked_func)
from .kvcache import flash_attn_with_kvcache

__all__ = ["flash_attn_func", "flash_attn_kvpacked_func", "flash_attn_qkvpacked_func",
           "flash_attn_varlen_func", "flash_attn_varlen_kvpacked_func",
           "flash_attn_varlen_qkvpacked_func", "flash_attn_with_kvcache", "flex_attention",
           "create_block_mask", "ring_flash_attn_func", "unpad_input", "pad_input",
           "register_transformers"]


def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         layout="zigzag", return_lse=False, *, learnable_sink=None):
    """Ring attention over a ``torch.distributed`` process group, with autograd; see
    :func:`numba_flash.torch.ring.ring_flash_attn_func` (imports ``torch.distributed`` on
    first use)."""
    from .ring import ring_flash_attn_func as ring

    return ring(q, k, v, group=group, causal=causal, softmax_scale=softmax_scale,
                layout=layout, return_lse=return_lse, learnable_sink=learnable_sink)


def register_transformers(name="numba_fa"):
    """Register numba_flash as transformers' ``attn_implementation=name``; see
    :func:`numba_flash.torch.transformers.register_transformers`."""
    from .transformers import register_transformers as register

    return register(name)
