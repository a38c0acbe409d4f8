"""The KV-cache kernels' compile-tier configurations: append and rotary."""

from __future__ import annotations

import numpy as np

from numba_flash.kernels.core.elements import ELEMENT_DTYPES
from numba_flash.kernels.cache import append
from numba_flash.kernels.cache import rotary
from numba_flash.kernels.ptx import fp8


def append_configs():
    """The GPU configurations the compile tier builds (a selection: one source, so the others
    differ only in the element type; bfloat16 is copied as its uint16 words, the float16 kernel
    but for the cache key): float16 paged and contiguous, float32, float64 and bfloat16 paged."""
    f16, bf16, f32, f64 = ELEMENT_DTYPES
    for dtype, paged in ((f16, True), (f16, False), (f32, True), (f64, True), (bf16, True)):
        yield {
            "name": f"append_kv {dtype.name}{' paged' if paged else ' contiguous'}",
            "kernel": append.append_kernel(append.GPU_THREADS, dtype, paged),
            "args": append.kernel_args_types(dtype),
            "float64_ok": dtype == np.float64,
        }
    # new float16 tokens rounded into e4m3 caches (issue 46): sm_89+, so sm_90 alone
    yield {"name": "append_kv float16 into e4m3 paged",
           "kernel": append.append_kernel(append.GPU_THREADS, f16, True, True),
           "args": append.kernel_args_types(f16, FP8=True), "float64_ok": False, "cc": fp8.CC}


def rotary_configs():
    """The GPU configurations the compile tier builds (a selection): float16 with both pair
    layouts, float32, float64 and bfloat16 with GPT-NeoX halves."""
    f16, bf16, f32, f64 = ELEMENT_DTYPES
    for dtype, interleaved in ((f16, False), (f16, True), (f32, False), (f64, False),
                               (bf16, False)):
        yield {
            "name": f"rotary {dtype.name}{' interleaved' if interleaved else ''}",
            "kernel": rotary.rotary_kernel(rotary.GPU_THREADS, dtype, interleaved),
            "args": rotary.kernel_args_types(dtype),
            "float64_ok": dtype == np.float64,
        }
