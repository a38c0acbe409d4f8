"""The teaching kernels' compile-tier configurations."""

from __future__ import annotations

import numpy as np

from numba_flash.kernels.core.common import (
    HEAD_DIMS, SMEM_LIMIT, acc_dtype, compute_type, numba_array_type,
)
from numba_flash.kernels.core.elements import BFLOAT16
from numba_flash.teach.kernels import naive_forward
from numba_flash.teach.kernels import row_forward
from numba_flash.teach.kernels import softmax
from numba_flash.teach.kernels import tiled_forward


def naive_forward_configs():
    """Every naive-forward configuration the package can launch on a GPU, for the compile tier
    (bfloat16: HEAD_DIM 64 only, the stage's loads and stores in this kernel)."""
    for dtype in (np.float16, np.float32, np.float64, BFLOAT16):
        dtype = np.dtype(dtype)
        arr = numba_array_type(dtype, 4)
        acc_np = acc_dtype(dtype)
        lse_arr = numba_array_type(acc_np, 3)
        scale_t = compute_type(dtype)
        for head_dim in HEAD_DIMS:
            if dtype == BFLOAT16 and head_dim != 64:
                continue
            for causal in (False, True):
                yield {
                    "name": f"naive_forward HEAD_DIM={head_dim} CAUSAL={int(causal)} {dtype.name}",
                    "kernel": naive_forward.naive_forward_kernel(head_dim, causal, dtype),
                    "args": (arr, arr, arr, arr, lse_arr, scale_t),
                    "float64_ok": dtype == np.float64,
                }


def row_forward_configs():
    """The row-forward configurations the compile tier builds: :data:`COMPILE_SELECTION` (the
    kernel is a teaching step; its one design-level fact, the stack frame, is the same in all)."""
    for dtype, head_dim, causal in row_forward.COMPILE_SELECTION:
        dtype = np.dtype(dtype)
        arr = numba_array_type(dtype, 4)
        lse_arr = numba_array_type(acc_dtype(dtype), 3)
        block_m, block_n = row_forward.gpu_blocks(head_dim, dtype)
        yield {
            "name": (f"row_forward M{block_m} N{block_n} D{head_dim} "
                     f"CAUSAL={int(causal)} {dtype.name}"),
            "kernel": row_forward.row_forward_kernel(head_dim, block_m, block_n, causal, dtype),
            "args": (arr, arr, arr, arr, lse_arr, compute_type(dtype)),
            "float64_ok": dtype == np.float64,
        }


def softmax_configs():
    """Every softmax configuration the package can launch on a GPU, for the compile tier."""
    for dtype in (np.float16, np.float32, np.float64, BFLOAT16):
        arr = numba_array_type(dtype, 2)
        yield {
            "name": f"softmax THREADS={softmax.GPU_THREADS} {np.dtype(dtype).name}",
            "kernel": softmax.softmax_kernel(softmax.GPU_THREADS, np.dtype(dtype)),
            "args": (arr, arr),
            "float64_ok": np.dtype(dtype) == np.float64,
        }


def tiled_forward_configs():
    """The teaching kernel's configurations for the compile tier (:data:`COMPILE_SELECTION`)."""
    import numpy as np

    from numba_flash.kernels.core.common import numba_array_type

    for dtype, head_dim, causal in tiled_forward.COMPILE_SELECTION:
        dtype = np.dtype(dtype)
        arr = numba_array_type(dtype, 4)
        block_m, block_n = next(mn for mn in tiled_forward.GPU_BLOCKS
                                if tiled_forward.shared_bytes(head_dim, *mn, dtype) <= SMEM_LIMIT)
        yield {
            "name": (f"tiled_forward_teach M{block_m} N{block_n} D{head_dim} "
                     f"CAUSAL={int(causal)} {dtype.name}"),
            "kernel": tiled_forward.tiled_forward_teach_kernel(head_dim, block_m, block_n, causal,
                                                               dtype),
            "args": (arr, arr, arr, arr, numba_array_type(acc_dtype(dtype), 3),
                     compute_type(dtype)),
            "float64_ok": False,
        }
