"""``kernel_jit``: the project's kernel decorator, with compiled kernels cached on disk.

On a GPU nearly all of a first call's time is JIT compilation (about 2 s per kernel
configuration on the H200; the demo's first run took 65 s).  ``@kernel_jit`` is ``@cuda.jit``
plus numba-cuda's on-disk cache, so a second process loads the compiled kernel instead of
building it again; ``numba-flash warmup`` (:func:`~numba_flash.tools.warmup.warm_up`) fills the
cache ahead of time.

How numba-cuda's cache (0.30) treats our kernels, which are built in closures of memoised
factories (read from ``numba/cuda/dispatcher.py`` and ``numba/cuda/core/caching.py``):

* The cache is per Python function: an index file ``<module>.<qualname>-<line>.pyXY.nbi`` next
  to the source (``__pycache__``), or under ``NUMBA_CACHE_DIR`` when set, or the user-wide cache
  directory when the package folder is read-only.  It needs a function backed by a source file
  (a regular module: true for every kernel here).
* One index holds every specialisation of one factory: the key is the signature, the GPU
  architecture, the numba-cuda version, a hash of the bytecode and a hash of the *closure cell
  values* (pickled).  The cells of our kernels are ints, bools, NumPy scalars, Numba types and
  device-function dispatchers; a ``CUDADispatcher`` pickles as its Python function and options,
  so the key is the same in every process (checked: identical hashes for all compile-tier
  configurations across two processes with different ``PYTHONHASHSEED``).
* The index is invalidated when the kernel's own source file changes (mtime and size), but not
  when a device function it calls through a module global (``kernels/core/common.py``,
  ``philox.py``, ``kernels/mainloop/visibility.py``) changes.  ``kernel_jit`` therefore adds a hash
  of the package's device-code sources to the key.
* numba names data files by counting the entries of the index it read, so two processes
  compiling different specialisations at once (``pytest -n 8``) can write two kernels under one
  name and leave an index entry pointing at the wrong kernel.  ``kernel_jit`` names each data
  file after its key instead and updates the index under a file lock.

``NUMBA_FLASH_CACHE=0`` turns the cache off.  In the simulator there is nothing to compile and
``kernel_jit`` is plain ``cuda.jit``.  Device functions (``device_jit``, ``device=True``) are
compiled into the kernels that call them and are not cached on their own.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os

from numba import cuda

from ... import numba_inline
from ...backend import on_simulator

__all__ = ["kernel_jit", "device_jit", "static_for", "range_for", "caching_enabled", "cache_dir",
           "source_fingerprint"]

#: environment variable: "0" turns the on-disk kernel cache off
CACHE_ENV = "NUMBA_FLASH_CACHE"

numba_inline.install()   # inline="always" without numba-cuda's copies of a fresh IR

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def caching_enabled():
    """True when kernels are cached on disk: the CUDA target, and ``NUMBA_FLASH_CACHE`` not 0."""
    flag = os.environ.get(CACHE_ENV, "1").strip().lower()
    return not on_simulator() and flag not in ("0", "false", "no", "off")


@functools.lru_cache(maxsize=None)
def source_fingerprint():
    """A hash of every source file that holds device code (``kernels/**.py``, ``teach/**.py``,
    ``philox.py``, ``tools/philox_check.py``)."""
    h = hashlib.sha256()
    paths = sorted(os.path.join(top, f) for folder in ("kernels", "teach")
                   for top, _, names in os.walk(os.path.join(_PACKAGE, folder))
                   for f in names if f.endswith(".py"))
    for path in [*paths, os.path.join(_PACKAGE, "philox.py"),
                 os.path.join(_PACKAGE, "tools", "philox_check.py")]:
        h.update(os.path.relpath(path, _PACKAGE).encode())
        with contextlib.suppress(OSError), open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


@contextlib.contextmanager
def _locked(path):
    """An exclusive advisory lock on ``path`` (POSIX); no lock where that is unavailable."""
    try:
        import fcntl

        f = open(path, "a+b")
    except (ImportError, OSError):
        yield
        return
    try:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
    finally:
        f.close()  # releases the lock


def _cache_classes():
    """The cache classes, built on first use (they subclass numba-cuda's CUDA target classes)."""
    global _KernelCache
    if _KernelCache is not None:
        return _KernelCache
    from numba.cuda.core.caching import IndexDataCacheFile
    from numba.cuda.dispatcher import CUDACache

    class KeyedIndexDataFile(IndexDataCacheFile):
        """Data file named after its key; index updated under a lock (safe across processes)."""

        def __init__(self, cache_path, filename_base, source_stamp):
            super().__init__(cache_path, filename_base, source_stamp)
            self._filename_base = filename_base

        def save(self, key, data):
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
            name = f"{self._filename_base}.{digest}.nbc"
            self._save_data(name, data)  # the data first: an index entry never points at nothing
            with _locked(self._index_path + ".lock"):
                overloads = self._load_index()
                overloads[key] = name
                self._save_index(overloads)

    class KernelCache(CUDACache):
        """numba-cuda's kernel cache, keyed also on the package's device-code sources."""

        def __init__(self, py_func):
            super().__init__(py_func)
            self._cache_file = KeyedIndexDataFile(
                self._cache_path, self._impl.filename_base,
                self._impl.locator.get_source_stamp())

        def _index_key(self, sig, codegen):
            return super()._index_key(sig, codegen) + (("numba_flash", source_fingerprint()),)

    _KernelCache = KernelCache
    return KernelCache


_KernelCache = None

#: ``cuda.jit`` options that the simulator's ``jit`` rejects; ``kernel_jit`` drops them there
_DEVICE_ONLY_OPTIONS = ("lineinfo", "launch_bounds", "max_registers", "extensions")


def kernel_jit(func=None, **options):
    """``@kernel_jit`` or ``@kernel_jit(**options)`` in place of ``@cuda.jit``.

    The same options as ``cuda.jit`` (``fastmath``, ``debug``, ``lineinfo``...), lazy
    compilation only (no signature).  On the CUDA target, with caching enabled, the compiled
    kernel is stored on disk and loaded by later processes; otherwise this is ``cuda.jit``.
    ``cache=False`` keeps one kernel off the disk (a build that calls a user's functions, whose
    code is not among the sources that key the cache).  In
    the simulator, options it does not know (``lineinfo``, ``launch_bounds``, ``max_registers``)
    are dropped, so a kernel can ask for them on the device and still run thread by thread.
    """
    if func is None:
        return functools.partial(kernel_jit, **options)
    if not callable(func):
        raise TypeError("kernel_jit: expected a function (kernels compile lazily, at first "
                        f"launch), got {type(func).__name__}")
    cache = options.pop("cache", True)  # cache=False: never on disk (a user's functions)
    if on_simulator():  # options the simulator's jit does not take (they tune device code only)
        for name in _DEVICE_ONLY_OPTIONS:
            options.pop(name, None)
    dispatcher = cuda.jit(**options)(func)
    if options.get("device") or not cache or not caching_enabled():
        return dispatcher
    try:
        dispatcher._cache = _cache_classes()(dispatcher.py_func)
    except Exception:  # no cache locator for this file, or another numba-cuda: run uncached
        pass
    return dispatcher


def _reads_cuda(code):
    """True when ``code`` (or a function defined inside it) reads a global named ``cuda``."""
    return "cuda" in code.co_names or any(
        _reads_cuda(c) for c in code.co_consts if hasattr(c, "co_names"))


def device_jit(func=None, *, inline=True, own_module=False):
    """``@device_jit`` or ``@device_jit(inline="always")`` in place of
    ``@cuda.jit(device=True, inline=...)``: a device function, compiled into the kernels that
    call it.

    In the simulator a device function is the Python function itself wherever that changes
    nothing, because a simulated device call is slow: on every call it swaps the ``cuda`` global
    of the function's module for the running kernel's fake module, under two locks contended by
    every simulated thread (most of a small launch's time, measured in numba-cuda 0.30).  The swap
    matters only to a function that reads ``cuda`` (``cuda.local.array``, ``cuda.threadIdx``...)
    and runs while its module's globals are not already swapped.  So in the simulator:

    * a function whose code never names ``cuda`` is returned as it is;
    * ``own_module=True``: the function is called only from kernels of its own module, whose
      launch swaps that module's globals for its whole duration: returned as it is;
    * any other function stays a simulated device function (``cuda.jit(device=True)``).
    """
    if func is None:
        return functools.partial(device_jit, inline=inline, own_module=own_module)
    if on_simulator() and (own_module or not _reads_cuda(func.__code__)):
        return func
    return cuda.jit(device=True, inline=inline)(func)


def _nvvm_inlined(fn):
    """``fn`` (a Python function or a device function) compiled once as a device function that
    NVVM inlines (``forceinline``: LLVM's ``alwaysinline``), not Numba: its callers stay small
    to compile, and after NVVM inlines it the constant arguments fold.  The simulator takes the
    function as it is."""
    if on_simulator():
        return fn
    return cuda.jit(device=True, forceinline=True)(getattr(fn, "py_func", fn))


@functools.lru_cache(maxsize=None)
def static_for(N, body, FIRST=0):
    """``run(ctx)``: ``body(FIRST, ctx); body(FIRST + 1, ctx); ...; body(FIRST + N - 1, ctx)``,
    unrolled in the compiled code (Triton's ``tl.static_range``, CUDA C's ``#pragma unroll``):
    every call passes its index as a constant, so once NVVM has inlined the calls an array a
    body indexes by it (a lane's rows of scores, of the accumulator) stays in registers however
    long the unrolled code, where a ``range`` loop is left to the compiler's unrolling
    heuristics (a loop it keeps puts the array on the stack).  ``body`` is a function of ``(i,
    ctx)``; ``ctx`` a tuple of what it needs (arrays are written in place).  Numba compiles
    ``body`` once and ``O(N)`` small calls (a balanced tree: each half its own function); NVVM
    inlines them (:func:`_nvvm_inlined`)."""
    body = _nvvm_inlined(body)
    return _static_tree(N, body, FIRST)


@functools.lru_cache(maxsize=None)
def range_for(N, body, FIRST=0):
    """``run(ctx)``: the same calls as :func:`static_for` as a ``range`` loop, left to the
    compiler's unrolling heuristics (which unroll a short loop and may schedule it better)."""
    body = _nvvm_inlined(body)

    def run(ctx):
        for i in range(FIRST, FIRST + N):
            body(i, ctx)

    return _nvvm_inlined(run)


@functools.lru_cache(maxsize=None)
def _static_tree(N, body, FIRST):
    if N <= 0:
        def nothing(ctx):
            pass
        return _nvvm_inlined(nothing)
    if N == 1:
        I = FIRST

        def one(ctx):
            body(I, ctx)
        return _nvvm_inlined(one)
    first = _static_tree(N // 2, body, FIRST)
    second = _static_tree(N - N // 2, body, FIRST + N // 2)

    def run(ctx):
        first(ctx)
        second(ctx)

    return _nvvm_inlined(run)


@functools.lru_cache(maxsize=None)
def static_fold(N, body, FIRST=0):
    """``run(ctx, x)``: ``x = body(FIRST, ctx, x); x = body(FIRST + 1, ctx, x); ...`` and the
    last ``x``, unrolled as :func:`static_for` (the same balanced tree of inlined calls) for a
    loop that carries an immutable value, such as a ``wgmma`` accumulator tuple: each step's
    index a constant once inlined, so a tuple it indexes by it is read by constant indices."""
    body = _nvvm_inlined(body)
    return _fold_tree(N, body, FIRST)


@functools.lru_cache(maxsize=None)
def _fold_tree(N, body, FIRST):
    if N <= 0:
        def nothing(ctx, x):
            return x
        return _nvvm_inlined(nothing)
    if N == 1:
        I = FIRST

        def one(ctx, x):
            return body(I, ctx, x)
        return _nvvm_inlined(one)
    first = _fold_tree(N // 2, body, FIRST)
    second = _fold_tree(N - N // 2, body, FIRST + N // 2)

    def run(ctx, x):
        return second(ctx, first(ctx, x))

    return _nvvm_inlined(run)


def cache_dir(dispatcher):
    """Where ``dispatcher`` (a ``kernel_jit`` kernel) keeps its compiled code; None if uncached."""
    return getattr(getattr(dispatcher, "_cache", None), "cache_path", None)
