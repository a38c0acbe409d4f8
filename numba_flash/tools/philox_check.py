"""Philox check kernels: fill arrays with the device Philox4x32-10 outputs and dropout keep bits.

These kernels exist so that the device functions of :mod:`numba_flash.philox` (which the
attention kernels call for dropout) are run in the simulator against their NumPy twin and built
by the compile tier for sm_80/sm_90 (no float64, ``mul.wide.u32`` products, no spills).

Math
----
``philox_fill``: ``out[n, :] = philox4x32_10(counter[n, :], key[n, :])`` for every row ``n``.

``keep_fill``: ``keep[b, h, i, j] = 1`` iff element ``(b, h, i, j)`` is kept, drawn with
counter ``(j // 4, i, h, b)`` and key ``(seed_lo, seed_hi)`` (the contract stated in
:mod:`numba_flash.philox`), else ``0``.  With ``BITS4`` one Philox call serves the thread's four
columns (``philox_keep_bits4``, as the attention kernels use it); without, each column calls
``philox_keep`` (four Philox calls): both must give the same mask.

Grid / block
------------
``philox_fill``: grid = (cdiv(n, THREADS),), block = (THREADS,); thread ``t`` handles row ``t``.
``keep_fill``: grid = (cdiv(cdiv(Nk, 4), THREADS), Nq, B * H), block = (THREADS,); thread ``t``
of block ``(x, i, bh)`` handles columns ``4 * jq .. 4 * jq + 3`` (``jq = x * THREADS + t``) of
row ``i`` of head ``bh % H`` of batch ``bh // H``, skipping columns ``>= Nk``.

Shared memory
-------------
None.
"""

from __future__ import annotations

import functools

import numpy as np
from numba import cuda, int32, types

from ..philox import philox4x32_10_device, philox_keep, philox_keep_bits4
from ..kernels.core.common import backend_threads, numba_array_type
from ..kernels.core.jit import kernel_jit

#: threads per block: small in the simulator (one Python thread each), a full block on the GPU.
SIM_THREADS = 8
GPU_THREADS = 128
default_threads = functools.partial(backend_threads, SIM_THREADS, GPU_THREADS)


@functools.lru_cache(maxsize=None)
def philox_fill_kernel(THREADS):
    """Build (once per ``THREADS``) ``kernel(counter [n,4] u32, key [n,2] u32, out [n,4] u32)``."""

    @kernel_jit
    def philox_fill(counter, key, out):
        n = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        if n < out.shape[0]:
            out[n, 0], out[n, 1], out[n, 2], out[n, 3] = philox4x32_10_device(
                counter[n, 0], counter[n, 1], counter[n, 2], counter[n, 3], key[n, 0], key[n, 1])

    return philox_fill


@functools.lru_cache(maxsize=None)
def keep_fill_kernel(THREADS, BITS4):
    """Build ``kernel(keep [B,H,Nq,Nk] int32, seed_lo, seed_hi, threshold)`` (uint32 scalars)."""

    @kernel_jit
    def keep_fill(keep, seed_lo, seed_hi, threshold):
        H = keep.shape[1]
        Nk = keep.shape[3]
        jq = cuda.blockIdx.x * THREADS + cuda.threadIdx.x
        i = cuda.blockIdx.y
        b = cuda.blockIdx.z // H
        h = cuda.blockIdx.z % H
        if BITS4:
            bits = philox_keep_bits4(seed_lo, seed_hi, b, h, i, jq, threshold)
        for w in range(4):
            j = jq * 4 + w
            if j < Nk:
                if BITS4:
                    keep[b, h, i, j] = int32((bits >> w) & 1)
                else:
                    keep[b, h, i, j] = int32(1) if philox_keep(seed_lo, seed_hi, b, h, i, j,
                                                               threshold) else int32(0)

    return keep_fill


def compile_configs():
    """The Philox check kernels at the GPU block size, for the compile tier."""
    u32 = numba_array_type(np.uint32, 2)
    yield {
        "name": f"philox_fill THREADS={GPU_THREADS}",
        "kernel": philox_fill_kernel(GPU_THREADS),
        "args": (u32, u32, u32),
        "float64_ok": False,
    }
    for bits4 in (True, False):
        yield {
            "name": f"philox_keep_fill THREADS={GPU_THREADS} BITS4={bits4}",
            "kernel": keep_fill_kernel(GPU_THREADS, bits4),
            "args": (numba_array_type(np.int32, 4), types.uint32, types.uint32, types.uint32),
            "float64_ok": False,
        }
