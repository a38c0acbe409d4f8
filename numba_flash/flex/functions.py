"""A user's ``score_mod`` / ``mask_mod``: checked, fingerprinted and compiled for each target.

The functions are plain Python functions of scalars (FlexAttention's and FlashAttention-4's
signatures, with the aux arrays passed as extra positional arguments)::

    def score_mod(score, b, h, q_idx, kv_idx, *aux) -> float   # the scaled score, modified
    def mask_mod(b, h, q_idx, kv_idx, *aux) -> bool            # True where the query sees the key

``q_idx`` and ``kv_idx`` are the query's and the key's own positions (0-based).  The package
compiles each function as Numba code for the target that needs it: a CPU function
(``numba.njit``) for :func:`numba_flash.flex.create_block_mask` and a CUDA device function
(``cuda.jit(device=True)``) for the kernels; in the simulator the device function is the Python
function itself, so ``breakpoint()`` inside it stops in pdb.

Compiled versions are memoised on the function's :func:`fingerprint` (its bytecode, constants,
defaults, closure values and the values of the globals it reads), not on the function object:
an edited or re-defined function never runs a stale compilation, and the same source defined
twice compiles once.  A function may call other plain Python functions (its own helpers, one
mask combining two others): each is compiled for the same target and called from the compiled
code.  ``breakpoint()`` inside a function stops in pdb in the simulator (the device function
is the Python function there) and compiles to nothing elsewhere.  User functions never enter the
on-disk kernel cache.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import pickle
import types as pytypes

import numpy as np

__all__ = ["SCORE_MOD_ARGS", "MASK_MOD_ARGS", "AUX_GRAD_ARGS", "check_mod", "check_aux_tensors",
           "fingerprint", "host_function", "device_function", "check_host_types",
           "register_host_twin"]

#: the fixed leading parameters of each kind of user function (the aux arrays follow)
SCORE_MOD_ARGS = ("score", "b", "h", "q_idx", "kv_idx")
MASK_MOD_ARGS = ("b", "h", "q_idx", "kv_idx")

#: ``aux_grad(grad_score, score, b, h, q_idx, kv_idx, grads, *aux)``: adds the gradient of the
#: loss w.r.t. the aux arrays into ``grads`` (:mod:`numba_flash.frontend.aux_grad`)
AUX_GRAD_ARGS = ("grad_score", "score", "b", "h", "q_idx", "kv_idx", "grads")

_FIXED = {"score_mod": SCORE_MOD_ARGS, "mask_mod": MASK_MOD_ARGS,
          "score_mod_grad": SCORE_MOD_ARGS, "aux_grad": AUX_GRAD_ARGS}

#: device helpers a user's function may call (``numba_flash.flex.atomic_add``), by ``id``: the
#: CPU twin the host compilation (the type check) calls in their place
_HOST_TWINS = {}


def register_host_twin(device_fn, host_fn):
    """Let a user's function call ``device_fn`` (a device helper the package provides): the CPU
    compilation of the function (:func:`host_function`, the type check before a launch) calls
    ``host_fn`` in its place."""
    _HOST_TWINS[id(device_fn)] = (device_fn, host_fn)


def check_aux_tensors(aux_tensors):
    """``aux_tensors`` as a tuple of arrays (NumPy, or device arrays for GPU launches)."""
    if aux_tensors is None:
        return ()
    if not isinstance(aux_tensors, (tuple, list)):
        raise TypeError(f"aux_tensors: expected a tuple of arrays, got "
                        f"{type(aux_tensors).__name__}")
    out = []
    for i, a in enumerate(aux_tensors):
        if not (isinstance(a, np.ndarray) or hasattr(a, "__cuda_array_interface__")):
            raise TypeError(f"aux_tensors[{i}]: expected a NumPy or device array, got "
                            f"{type(a).__name__}")
        dt = np.dtype(a.dtype)
        if dt.kind not in "biuf":
            raise TypeError(f"aux_tensors[{i}]: expected a bool, integer or float array, got "
                            f"dtype {dt}")
        out.append(a)
    return tuple(out)


def check_mod(name, fn, n_aux):
    """``fn`` for the user-function argument ``name`` (``score_mod``, ``mask_mod``,
    ``score_mod_grad`` or ``aux_grad``): ``None``, or a plain Python function taking exactly
    the fixed parameters of its kind plus one per aux array.  TypeError otherwise, naming the
    argument."""
    if fn is None:
        return None
    fixed = _FIXED[name]
    if not isinstance(fn, pytypes.FunctionType):
        raise TypeError(f"{name}: expected a plain Python function (def or lambda) "
                        f"{name}({', '.join(fixed)}, *aux), got {type(fn).__name__}")
    params = list(inspect.signature(fn).parameters.values())
    kinds = {p.kind for p in params}
    if kinds - {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD}:
        raise TypeError(f"{name}: expected only positional parameters ({', '.join(fixed)}, then "
                        f"one per aux tensor), got {fn.__name__}{inspect.signature(fn)}")
    want = len(fixed) + n_aux
    if len(params) != want:
        raise TypeError(f"{name}: expected a function of {want} arguments ({', '.join(fixed)}"
                        f"{' and ' + str(n_aux) + ' aux tensor(s)' if n_aux else ''}), got "
                        f"{fn.__name__}{inspect.signature(fn)} with {len(params)}")
    return fn


def _code_key(code, h):
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    for c in code.co_consts:
        if isinstance(c, pytypes.CodeType):
            _code_key(c, h)
        else:
            h.update(repr(c).encode())


def _value_key(value, h):
    """Hash a constant the function closes over or reads as a global."""
    if isinstance(value, pytypes.FunctionType):
        h.update(fingerprint(value).encode())
    elif isinstance(value, pytypes.ModuleType):
        h.update(("module:" + value.__name__).encode())
    elif isinstance(value, np.ndarray):
        h.update(repr((value.dtype.str, value.shape)).encode())
        h.update(np.ascontiguousarray(value).tobytes())
    else:
        try:
            h.update(pickle.dumps(value))
        except Exception:  # noqa: BLE001 - unpicklable: its identity is the best we know
            h.update(f"{type(value).__qualname__}@{id(value)}".encode())


def fingerprint(fn):
    """A hex digest of everything that decides what ``fn`` computes: its bytecode and constants
    (nested functions too), defaults, closure cell values, and the current values of the globals
    its code reads (Numba freezes globals at compile time, so a changed global must change the
    key)."""
    h = hashlib.sha256()
    code = fn.__code__
    _code_key(code, h)
    for d in fn.__defaults__ or ():
        _value_key(d, h)
    for cell in fn.__closure__ or ():
        _value_key(cell.cell_contents, h)
    names = set()
    stack = [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, pytypes.CodeType))
    g = fn.__globals__
    for name in sorted(names):
        if name in g:
            h.update(name.encode())
            _value_key(g[name], h)
    return h.hexdigest()


def _no_breakpoint():
    """What ``breakpoint()`` in a user's function compiles to outside the simulator: nothing."""
    return None


def _helper(value):
    """``(device, host)`` of a package device helper (:func:`register_host_twin`), or None."""
    pair = _HOST_TWINS.get(id(value))
    return pair if pair is not None and pair[0] is value else None


def _swapped(value, compile_one):
    """What ``value`` (a global or closure value of a user's function) becomes in the compiled
    copy: a package helper stays itself on the device and is its CPU twin on the host; another
    plain Python function is compiled (``compile_one``); anything else is ``None`` (kept)."""
    helper = _helper(value)
    if helper is not None:
        return helper[1] if compile_one is host_function else None
    if isinstance(value, pytypes.FunctionType):
        return compile_one(value)
    return None


def _retarget(fn, compile_one, keep_breakpoint=False):
    """A copy of ``fn`` whose globals and closure cells that are plain Python functions (a
    user's helpers, e.g. one mask calling another) are replaced by their compiled versions
    (``compile_one``), so Numba can call them; a package device helper
    (:func:`register_host_twin`) by its CPU twin in a CPU compilation; everything else is shared
    with ``fn``."""
    g = fn.__globals__
    names = set()
    stack = [fn.__code__]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, pytypes.CodeType))
    swap = {}
    for n in names:
        if n in g and g[n] is not fn:
            new = _swapped(g[n], compile_one)
            if new is not None:
                swap[n] = new
    if "breakpoint" in names and "breakpoint" not in g and not keep_breakpoint:
        # compiled code cannot stop in pdb: breakpoint() is a no-op there (the simulator runs
        # the function as Python, where it stops)
        swap["breakpoint"] = compile_one(_no_breakpoint)
    cells = fn.__closure__
    if cells:
        new_cells = tuple(c if (new := _swapped(c.cell_contents, compile_one)) is None
                          else pytypes.CellType(new) for c in cells)
        if any(a is not b for a, b in zip(new_cells, cells)):
            cells = new_cells
    if not swap and cells is fn.__closure__:
        return fn
    new_globals = dict(g)
    new_globals.update(swap)
    out = pytypes.FunctionType(fn.__code__, new_globals, fn.__name__, fn.__defaults__, cells)
    out.__qualname__ = fn.__qualname__
    out.__module__ = fn.__module__
    return out


@functools.lru_cache(maxsize=256)
def _host_compiled(key, fn):
    from numba import njit
    # bounds-checked: create_block_mask's evaluation must not read past an aux tensor (an
    # IndexError it reports, not garbage); about a compare per index
    return njit(boundscheck=True)(_retarget(fn, host_function))


@functools.lru_cache(maxsize=256)
def _device_compiled(key, fn):
    from ..backend import on_simulator
    from ..kernels.core.jit import device_jit
    return device_jit(inline="never")(_retarget(fn, device_function,
                                                keep_breakpoint=on_simulator()))


def host_function(fn):
    """``fn`` compiled for the CPU (``numba.njit``, bounds-checked), memoised on its
    fingerprint."""
    return _host_compiled(fingerprint(fn), fn)


def device_function(fn):
    """``fn`` as a CUDA device function, memoised on its fingerprint (in the simulator: the
    Python function itself, run thread by thread)."""
    return _device_compiled(fingerprint(fn), fn)


def check_host_types(name, fn, arg_types, want, aux=()):
    """Compile ``fn`` for the CPU with Numba types ``arg_types`` and check its return type is of
    kind ``want`` (``"float"``, ``"bool"`` or ``"none"``: returns nothing).  A function Numba
    cannot compile is a TypeError naming the argument and the function, with the first
    meaningful line of Numba's message and a hint (:func:`numba_flash.flex.errors.compile_error`;
    ``aux``: the aux arrays, for their shapes); the compiled CPU function is returned."""
    from numba import types
    from numba.core.errors import NumbaError, UnsupportedBytecodeError

    from .errors import compile_error

    host = host_function(fn)
    try:
        host.compile(tuple(arg_types))
    except (NumbaError, UnsupportedBytecodeError) as e:  # the latter: an import, a global store
        raise compile_error(name, fn, arg_types, e, aux) from None
    ret = next(s.return_type for s in host.nopython_signatures
               if tuple(s.args) == tuple(arg_types))
    if want == "none":
        ok = ret == types.none
    elif want == "float":
        ok = isinstance(ret, types.Float)
    else:
        ok = isinstance(ret, types.Boolean) or ret == types.boolean
    if not ok:
        what = {"float": "a float", "bool": "a bool", "none": "nothing (None)"}[want]
        raise TypeError(f"{name}: expected {fn.__name__} to return {what}, got {ret}")
    return host
