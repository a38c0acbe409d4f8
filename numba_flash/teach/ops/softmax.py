"""``numba_flash.softmax``: row softmax over the last axis of a 2-D array."""

from __future__ import annotations

from ...frontend import ArrayCall
from ...frontend.sim_time import SimWork
from ...frontend.validate import ATTENTION_DTYPES, check_array
from ..kernels.softmax import default_threads, softmax_kernel


def softmax(x):
    """Softmax over the last axis of a 2-D array ``x`` ``[rows, n]``, in ``x``'s dtype.

    One thread block per row (see :mod:`numba_flash.teach.kernels.softmax`).  float16 and bfloat16
    (``ml_dtypes.bfloat16``) compute in float32, float64 in float64.  NumPy in, NumPy out;
    CuPy in, CuPy out (GPU backend).
    """
    (rows, _n), dtype = check_array("x", x, 2, ATTENTION_DTYPES)
    call = ArrayCall({"x": x}, op="softmax")
    call.reserve({"y": (x.shape, dtype)})  # sizes checked before anything is allocated
    dx = call.input(x)
    y = call.empty(dx.shape, dtype)
    threads = default_threads()
    call.launch(softmax_kernel(threads, dtype), (rows,), (threads,), dx, y,
                work=SimWork("softmax", rows * threads * -(-_n // threads)))
    return call.result(y)
