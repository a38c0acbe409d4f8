"""``atomic_add(array, index, value)``: how a user's ``aux_grad`` adds into its gradient arrays.

Many (query, key) pairs add into one entry of an aux tensor's gradient (every pair at one
relative distance into one entry of a ``[H, 2N - 1]`` bias table), from many threads at once,
so the add must be atomic.  A user's ``aux_grad`` (:mod:`numba_flash.frontend.aux_grad`) calls::

    from numba_flash.flex import atomic_add

    def aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, bias):
        atomic_add(grads[0], (h, q_idx - kv_idx + N - 1), grad_score)

``array`` is one of ``grads`` (float32, float64 for float64 inputs), ``index`` an int or a tuple
of ints (one per dimension, each in ``[0, shape)``), ``value`` a number; returns the entry's old
value.  Three versions of the one function:

* on the GPU, ``numba.cuda.atomic.add`` (``atom.global.add.f32`` / ``.f64``).  An index outside
  the array writes outside it, as any CUDA store would: nothing checks it;
* in the simulator, a Python twin under a lock that raises ``IndexError`` for an index outside
  the array, a negative one included (NumPy would wrap it to the end: the GPU would not);
* for the host type check before a launch (:func:`numba_flash.flex.functions.check_host_types`
  compiles the user's function for the CPU), a plain ``array[index] += value``.

Import it by name (``from numba_flash.flex import atomic_add``): the compilations recognise it
as a global or closure value of the user's function (``numba_flash.flex.atomic_add`` through the
module attribute is not swapped for its CPU twin and fails the type check).

Atomics and determinism: the adds into one entry arrive in an order that varies from run to run
on a GPU, and float addition is not associative, so a gradient summed this way can differ in its
last bits between two runs (``deterministic=True`` makes ``dq``, ``dk``, ``dv`` reproducible,
not the aux gradients).  In the simulator the threads interleave in an order Python's thread
switching decides: the same caution applies.
"""

from __future__ import annotations

import threading

from numba import cuda, njit

from ..backend import on_simulator
from .functions import register_host_twin

__all__ = ["atomic_add"]

_LOCK = threading.Lock()


def _atomic_add_gpu(array, index, value):
    """``array[index] += value`` as one atomic operation; returns the old value."""
    return cuda.atomic.add(array, index, value)


def _atomic_add_simulator(array, index, value):
    """The simulator's ``atomic_add``: the bounds the GPU does not check, then the add under one
    lock (the simulator runs each CUDA thread as a Python thread)."""
    idx = tuple(index) if isinstance(index, tuple) else (index,)
    shape = array.shape
    if len(idx) != len(shape) or any(not 0 <= int(i) < n for i, n in zip(idx, shape)):
        raise IndexError(f"atomic_add: index {tuple(int(i) for i in idx)} is outside the array "
                         f"of shape {tuple(shape)} (on a GPU this add would write outside it)")
    with _LOCK:
        old = array[idx]
        array[idx] = old + value
    return old


def _atomic_add_host(array, index, value):
    old = array[index]
    array[index] += value
    return old


if on_simulator():
    atomic_add = _atomic_add_simulator
else:
    from ..kernels.core.jit import device_jit

    atomic_add = device_jit(_atomic_add_gpu)

register_host_twin(atomic_add, njit(_atomic_add_host))
