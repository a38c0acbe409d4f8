"""Small helpers every kernel factory shares: compute types and Numba argument types."""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import float32, float64, int32, int64, types

from ...backend import on_simulator
from .jit import device_jit

_NUMBA_DTYPE = {
    np.dtype(np.float16): types.float16,
    np.dtype(np.float32): types.float32,
    np.dtype(np.float64): types.float64,
    np.dtype(np.int32): types.int32,
    np.dtype(np.int64): types.int64,
    np.dtype(np.uint32): types.uint32,
    np.dtype(np.uint16): types.uint16,
}


#: the per-block static shared-memory limit (no dynamic opt-in); the compile tier enforces it.
SMEM_LIMIT = 48 * 1024

#: CUDA's grid limits: blocks along x, and along y or z.  Every launcher checks its grid
#: against these (a ValueError naming the shapes, before any launch).
GRID_X_MAX = 2**31 - 1
GRID_YZ_MAX = 65535


def backend_threads(sim_threads, gpu_threads):
    """The block size of a one-dimensional kernel on this process's backend: ``sim_threads`` in
    the simulator (each thread a Python thread: few), ``gpu_threads`` on a GPU."""
    return sim_threads if on_simulator() else gpu_threads


#: threads per block of the row kernels (append_kv, rotary, merge: one block per row of ``d``
#: elements, thread ``t`` on elements ``t, t + THREADS, ...``): one per element up to 128 on a
#: GPU, 4 in the simulator
GPU_ROW_THREADS = 128
SIM_ROW_THREADS = 4


def row_threads():
    """The row kernels' threads per block on this process's backend."""
    return backend_threads(SIM_ROW_THREADS, GPU_ROW_THREADS)


def grid_x(name, product, *sizes):
    """``(x,)``, ``x = prod(sizes)``: a one-dimensional grid of one block per row; a
    ``ValueError`` naming the argument ``name`` and the ``product`` it counts (e.g. ``"B * H *
    N"``) past CUDA's x limit."""
    x = math.prod(int(s) for s in sizes)
    if x > GRID_X_MAX:
        got = " * ".join(str(s) for s in sizes)
        raise ValueError(f"{name}: expected {product} <= {GRID_X_MAX} (the CUDA grid's x limit), "
                         f"got {got} = {x}")
    return (x,)


#: all 32 lanes of a warp: the member mask of the ``*_sync`` warp intrinsics
FULL_MASK = 0xFFFFFFFF

#: compile-time head dims of the attention kernels: a head dim ``d`` runs in the smallest one
#: >= d, zero-padded.
HEAD_DIMS = (16, 32, 64, 128, 256)


def padded_head_dim(d):
    """The compile-time ``HEAD_DIM`` a head dim ``d`` (1..256) runs in."""
    return next(h for h in HEAD_DIMS if h >= d)


def acc_dtype(dtype):
    """The NumPy compute dtype for an input dtype: float64 for float64, float32 otherwise
    (float16, bfloat16, float32; also the dtype of ``lse`` and of float partial results)."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def compute_type(dtype):
    """The Numba arithmetic type for an input dtype: float64 for float64, float32 otherwise."""
    return float64 if np.dtype(dtype) == np.float64 else float32


def numba_array_type(dtype, ndim):
    """The Numba type of a C-contiguous array as the launch path passes it to a kernel (a
    bfloat16 array as its uint16 words, :func:`numba_flash.kernels.core.elements.kernel_dtype`)."""
    from .elements import kernel_dtype

    return types.Array(_NUMBA_DTYPE[kernel_dtype(dtype)], ndim, "C")


def cdiv(a, b):
    """Ceiling division, for grid sizes."""
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def make_elem_strides(ITEMSIZE):
    """``elem_strides(x) -> (s0, s1, s2)``: the element strides of the three outer axes of a
    4-D array of ``ITEMSIZE``-byte elements as a kernel gets it (a strided view's own strides,
    non-negative, its last axis contiguous: checked at launch, so a shift divides them); the
    row stride ``s2`` an int32 (below 2**31 elements: checked at launch, one register held
    across the K/V loop, not two)."""
    SHIFT = ITEMSIZE.bit_length() - 1
    assert 1 << SHIFT == ITEMSIZE

    @device_jit(inline=True)
    def elem_strides(x):
        return (int64(x.strides[0]) >> SHIFT, int64(x.strides[1]) >> SHIFT,
                int32(int64(x.strides[2]) >> SHIFT))

    return elem_strides


@functools.lru_cache(maxsize=None)
def make_packed_strides(ITEMSIZE):
    """``packed_strides(x) -> (s_token, s_head)``: the element strides of a packed ``[total, H,
    d]`` view's first two axes (:func:`make_elem_strides`' rules: non-negative, the last axis
    contiguous; the token stride an int64: ``total`` rows of it are the array)."""
    SHIFT = ITEMSIZE.bit_length() - 1
    assert 1 << SHIFT == ITEMSIZE

    @device_jit(inline=True)
    def packed_strides(x):
        return int64(x.strides[0]) >> SHIFT, int64(x.strides[1]) >> SHIFT

    return packed_strides


#: simulator only: when a list, each block's thread 0 of an attention forward appends
#: ``(b, h, q_start, kt)`` for every K/V tile it computes (tests count the tiles a block mask
#: lets through); the kernels call :func:`log_tile` only in their simulator builds
TILE_LOG = None


def log_tile(b, h, q_start, kt):
    """Record one computed tile in :data:`TILE_LOG` (plain Python: the simulator only)."""
    if TILE_LOG is not None:
        TILE_LOG.append((int(b), int(h), int(q_start), int(kt)))


@device_jit(inline=True)
def clamp_rows(start, end, total):
    """``(first row, rows)``, int32 as ``cu_seqlens``, of a packed batch's rows ``[start,
    end)`` (a sequence's) kept inside ``[0, total)``: a bad ``cu_seqlens`` (unvalidated device
    arrays) makes a kernel read and write nothing outside its packed arrays; a good one is
    unchanged."""
    first = min(max(int32(start), int32(0)), int32(total))
    last = min(max(int32(end), first), int32(total))
    return first, int32(last - first)
