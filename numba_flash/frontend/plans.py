"""Launch plans: what a device call does, recorded once per call signature and replayed.

A call on device arrays (CuPy, or the stand-in device of :mod:`numba_flash.standin`) with a
signature not seen before runs the op's ordinary code under a :class:`Trace`: every allocation
(:meth:`ArrayCall.empty` / ``zeros``), every memset, every launch (a
:class:`~numba_flash.frontend.launch.PreparedLaunch`: the build compiled for the arguments'
types, its parameters packed) and every device constant is recorded, and each array a launch
reads or writes is traced back to the buffer it lies in: one of the call's own arrays (the
op's inputs and ``out=`` arrays), an allocation of the call, or a constant.  When the op returns,
its results are traced the same way.  The :class:`Plan` that comes of it replays the call for
any later call with the same signature (op, shapes, strides, dtypes, pointer alignment, every
option, the stream): allocate the results (nothing at all with ``out=``), relocate each launch
parameter that points into a buffer (the new array's address plus the same offset), memset and
launch, in the recorded order.  No validation runs again (the signature is what it checked), no
configuration is rebuilt, nothing is copied or synchronised.

A call is not planned (and runs its ordinary code every time, as before) when its trace sees
what a replay could not repeat: a value read back from the device (``validate=True``), a host
array copied in that is not a constant, device work outside the launches (an elementwise
CuPy operation), or two of its arrays starting at one address (a replay could not tell which
to relocate; arrays that overlap but start apart, a fused projection's q, k, v slices, are
told apart by their start); :func:`plan_stats` says which and why.  Work arrays of a plan
(split-KV partials, counters, accumulation buffers) are kept by the plan and reused by its
replays (zeroed by a memset each time where the op zeroes them), so a replay on the same
stream allocates only its results; plans are per stream, so two streams never share work
arrays.  At most :data:`MAX_PLANS` plans are kept (the oldest dropped first), and work arrays
over :data:`KEEP_BYTES` a plan are allocated afresh by each replay instead of kept.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from .launch import data_pointer

__all__ = ["PLANS", "Plan", "Trace", "build", "tracing", "active_trace", "clear_plans",
           "plan_stats", "note_host_read", "MAX_PLANS", "KEEP_BYTES"]

#: the most plans kept (a dict in insertion order: the oldest is dropped first)
MAX_PLANS = 256
#: a plan's work arrays up to this many bytes are kept between replays; larger ones are
#: allocated by each replay
KEEP_BYTES = 256 * 2**20

#: key -> Plan, or a :class:`Unplanned` naming why the signature runs unplanned
PLANS = {}
_STATE = threading.local()


class Unplanned(NamedTuple):
    """Why calls of one signature run without a plan."""

    reason: str


def active_trace():
    """The :class:`Trace` recording the current call on this thread, or None."""
    return getattr(_STATE, "trace", None)


def tracing():
    """True while a call is being recorded on this thread (an op's fast path then steps
    aside: the outer call's trace records everything)."""
    return getattr(_STATE, "trace", None) is not None


def note_host_read(what):
    """Called where the front end reads device values on the host (a synchronisation): the
    call being traced cannot be replayed."""
    trace = active_trace()
    if trace is not None:
        trace.fail(f"{what} is read on the host")


def clear_plans():
    """Drop every plan (and the work arrays they keep)."""
    PLANS.clear()


def plan_stats():
    """``{"plans": n, "unplanned": {reason: count}}`` of the cache."""
    unplanned = {}
    for v in PLANS.values():
        if isinstance(v, Unplanned):
            unplanned[v.reason] = unplanned.get(v.reason, 0) + 1
    return {"plans": sum(isinstance(v, Plan) for v in PLANS.values()), "unplanned": unplanned}


def _extent(x):
    """``(lo, hi)``: the bytes array ``x`` spans (its strides may be negative or zero)."""
    ptr = data_pointer(x)
    lo = hi = 0
    for n, s in zip(x.shape, x.strides):
        if n == 0:
            return ptr, ptr
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return ptr + lo, ptr + hi + x.dtype.itemsize


class _Buffer:
    """One buffer a traced call knows: ``kind`` "input" (position ``pos`` of the call's arrays),
    "alloc" (an allocation of the call, ``array``) or
    "const" (a device constant), with its address range at trace time; ``result``: an
    allocation the call returns (a view of it); ``fresh``: a constant this call copied in."""

    __slots__ = ("kind", "pos", "array", "ptr", "lo", "hi", "result", "fresh")

    def __init__(self, kind, array, pos=None):
        self.kind, self.array, self.pos = kind, array, pos
        self.ptr = data_pointer(array)
        self.lo, self.hi = _extent(array)
        self.result = False
        self.fresh = False


class Trace:
    """The record of one call on device arrays: ``arrays`` are the call's own arrays (its
    inputs and ``out=`` arrays, None where not given), in the order :meth:`Plan.run` gets
    them; ``dry``: launches and memsets are recorded, not run (a plan made before its first
    call: :func:`trace_plan`)."""

    def __init__(self, arrays, dry=False):
        self.arrays = tuple(arrays)
        self.dry = dry           # record without launching (a plan made ahead of its calls)
        self.buffers = []
        self.ops = []            # ("launch", prep, relocs) / ("memset", buf, offset, byte, n)
        self.failed = None
        self.per_call = False    # the reason depends on this call's arrays, not its signature
        self.xp = self.driver = None
        self.stream = None
        for pos, x in enumerate(self.arrays):
            if x is not None:
                self.buffers.append(_Buffer("input", x, pos))
        starts = [b.ptr for b in self.buffers if b.hi > b.lo]
        if len(set(starts)) < len(starts):
            self.fail("two of the call's arrays start at one address", per_call=True)

    def fail(self, why, per_call=False):
        if self.failed is None:
            self.failed, self.per_call = why, per_call

    def device(self, xp, driver, stream):
        """The array library, driver and stream of the call (the first ArrayCall's)."""
        if self.xp is None:
            self.xp, self.driver, self.stream = xp, driver, stream
            if any(x is not None and type(x) is not xp.ndarray for x in self.arrays):
                self.fail("some arrays are not the array library's own (a "
                          "__cuda_array_interface__ import)")
        elif (xp, stream) != (self.xp, self.stream):
            self.fail("the call's launches use two streams or array libraries")

    def alloc(self, array):
        self.buffers.append(_Buffer("alloc", array))

    def constant(self, array, fresh=False):
        """A device constant the call reads (``fresh``: copied to the device by this call)."""
        buf = _Buffer("const", array)
        buf.fresh = fresh
        self.buffers.append(buf)

    def _find(self, x, what):
        """``(buffer index, byte offset)`` of array ``x``, or None (the trace then fails)."""
        lo, hi = _extent(x)
        ptr = data_pointer(x)
        for i, b in enumerate(self.buffers):   # the array itself (or a view of it at its start)
            if b.ptr == ptr and b.lo <= lo and hi <= b.hi:
                return i, 0
        for i, b in enumerate(self.buffers):   # a part of one
            if b.lo <= lo and hi <= b.hi and (b.hi > b.lo or ptr == b.ptr):
                return i, ptr - b.ptr
        self.fail(f"{what} lies in no buffer of the call (device work outside the launches)")
        return None

    def memset(self, array, byte, nbytes):
        found = self._find(array, "a memset")
        if found is not None:
            self.ops.append(("memset", found[0], found[1], byte, nbytes))

    def launch(self, prep):
        relocs = []
        for slot, x in zip(prep.slots, prep.arrays):
            found = self._find(x, f"an array of the launch of {prep.name}")
            if found is None:
                return
            relocs.append((slot, found[0], found[1]))
        self.ops.append(("launch", prep, relocs))

    # -- the plan ------------------------------------------------------------------------
    def result_template(self, result):
        """The op's return value as a template of buffers (None: not replayable)."""
        if result is None:
            return ("none",)
        if isinstance(result, tuple):
            parts = tuple(self.result_template(r) for r in result)
            return None if any(p is None for p in parts) else ("tuple", parts)
        if not hasattr(result, "__cuda_array_interface__"):
            self.fail(f"the op returns a {type(result).__name__}")
            return None
        for pos, x in enumerate(self.arrays):
            if result is x:
                return ("input", pos)
        found = self._find(result, "a result")
        if found is None:
            return None
        buf = self.buffers[found[0]]
        if buf.kind != "alloc":
            self.fail("a result is a view of an input or constant")
            return None
        buf.result = True
        whole = (found[1] == 0 and result.nbytes == buf.array.nbytes
                 and result.flags.c_contiguous)
        return ("array", found[0], found[1], tuple(result.shape), tuple(result.strides),
                result.dtype, whole)

    def plan(self, result):
        """The :class:`Plan` of the traced call, or None (``failed`` says why)."""
        if self.failed is None and self.xp is None:
            self.fail("no launch on a device")
        template = None if self.failed else self.result_template(result)
        if self.failed is not None:
            return None
        return Plan(self, template)


class Plan:
    """A traced call, replayable: :meth:`run` with the arrays of a call of the same signature
    (in the trace's order) returns what the op would."""

    def __init__(self, trace, template):
        self.xp, self.driver, self.stream = trace.xp, trace.driver, trace.stream
        self.lock = threading.Lock()
        bufs = trace.buffers
        self.input_pos = [b.pos for b in bufs if b.kind == "input"]
        # the base list of a replay: inputs (relocated), results (allocated), then kept work
        # arrays and constants (fixed addresses)
        order = ([i for i, b in enumerate(bufs) if b.kind == "input"]
                 + [i for i, b in enumerate(bufs) if b.kind == "alloc" and b.result]
                 + [i for i, b in enumerate(bufs) if b.kind == "alloc" and not b.result]
                 + [i for i, b in enumerate(bufs) if b.kind == "const"])
        where = {old: new for new, old in enumerate(order)}
        self.results = [(bufs[i].array.shape, bufs[i].array.dtype) for i in order
                        if bufs[i].kind == "alloc" and bufs[i].result]
        _whole_results(template, where, self.results, len(self.input_pos))
        scratch = [bufs[i] for i in order if bufs[i].kind == "alloc" and not bufs[i].result]
        self.keep = sum(b.array.nbytes for b in scratch) <= KEEP_BYTES
        self.scratch = [(b.array.shape, b.array.dtype) for b in scratch]
        self.kept = [b.array for b in scratch] if self.keep else []
        self.fixed = ([b.ptr for b in scratch] if self.keep else []) + \
            [bufs[i].ptr for i in order if bufs[i].kind == "const"]
        self._constants = [bufs[i].array for i in order if bufs[i].kind == "const"]
        self.ops = []
        for op in trace.ops:
            if op[0] == "launch":
                prep, relocs = op[1], op[2]
                prep.relocs = [(slot, where[b], off) for slot, b, off in relocs]
                prep.arrays = None   # the traced call's arrays: not held alive by the plan
                self.ops.append(prep)
            else:
                self.ops.append(_Memset(where[op[1]], op[2], op[3], op[4]))
        self.template = _remap(template, where)
        self.n_inputs = len(self.input_pos)

    def run(self, arrays):
        """Replay the call on ``arrays`` (the call's arrays in the trace's order)."""
        xp = self.xp
        with self.lock:
            base = [arrays[p].data.ptr for p in self.input_pos]
            out = [xp.empty(shape, dtype) for shape, dtype in self.results]
            base += [x.data.ptr for x in out]
            if not self.keep:   # work arrays too large to keep: this replay's own
                work = [xp.empty(shape, dtype) for shape, dtype in self.scratch]
                base += [x.data.ptr for x in work]
            base += self.fixed
            stream = self.stream
            for op in self.ops:
                if op.__class__ is _Memset:
                    self.driver.memset(base[op.buf] + op.offset, op.byte, op.nbytes, stream)
                else:
                    op.run(base)
        return _build(self.template, arrays, out, base, xp, self.n_inputs)


class _Memset:
    __slots__ = ("buf", "offset", "byte", "nbytes")

    def __init__(self, buf, offset, byte, nbytes):
        self.buf, self.offset, self.byte, self.nbytes = buf, offset, byte, nbytes


def _whole_results(t, where, results, n_inputs):
    """A result that is its whole allocation (C-contiguous, from its first byte) is allocated
    in the shape and dtype it is returned in, so a replay returns it as it is."""
    if t is None:
        return
    if t[0] == "tuple":
        for p in t[1]:
            _whole_results(p, where, results, n_inputs)
    elif t[0] == "array" and t[-1]:
        results[where[t[1]] - n_inputs] = (t[3], t[5])


def _remap(t, where):
    if t[0] == "tuple":
        return ("tuple", tuple(_remap(p, where) for p in t[1]))
    if t[0] == "array":
        return ("array", where[t[1]]) + t[2:]
    return t


def _build(t, arrays, out, base, xp, n_inputs):
    kind = t[0]
    if kind == "array":
        _, buf, off, shape, strides, dtype, whole = t
        x = out[buf - n_inputs]
        if whole:   # allocated as returned (_whole_results)
            return x
        mem = xp.cuda.UnownedMemory(base[buf] + off, x.nbytes - off, x)
        return xp.ndarray(shape, dtype, memptr=xp.cuda.MemoryPointer(mem, 0), strides=strides)
    if kind == "tuple":
        return tuple(_build(p, arrays, out, base, xp, n_inputs) for p in t[1])
    if kind == "input":
        return arrays[t[1]]
    return None


def _record(trace, fn, args, kwargs):
    """Run ``fn(*args, **kwargs)`` with ``trace`` recording it (on the stand-in device also
    counting what the call does outside its launches); return what ``fn`` returned."""
    counters = _standin_counters(trace.arrays)
    _STATE.trace = trace
    try:
        if counters is None:
            return fn(*args, **kwargs)
        with counters as c:
            result = fn(*args, **kwargs)
        if c.syncs or c.d2h or c.foreign or c.h2d > trace_constants(trace):
            trace.fail(f"the call synchronises or works on the device outside its launches "
                       f"({c})")
        return result
    finally:
        _STATE.trace = None


def build(key, fn, arrays, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` (an op's ordinary code) recording it, keep the plan (or why
    there is none) under ``key``, and return what ``fn`` returned."""
    trace = Trace(arrays)
    result = _record(trace, fn, args, kwargs)
    plan = trace.plan(result)
    if plan is not None or not trace.per_call:
        if len(PLANS) >= MAX_PLANS:
            PLANS.pop(next(iter(PLANS)))
        PLANS[key] = plan if plan is not None else Unplanned(trace.failed)
    return result


def trace_plan(fn, arrays, *args, **kwargs):
    """A :class:`Plan` of ``fn(*args, **kwargs)`` on ``arrays`` made without running it (a dry
    trace: nothing launched, nothing written), or raise ``ValueError`` saying why the call
    cannot be planned."""
    trace = Trace(arrays, dry=True)
    plan = trace.plan(_record(trace, fn, args, kwargs))
    if plan is None:
        raise ValueError(f"this call cannot be planned: {trace.failed}")
    return plan


def trace_constants(trace):
    """The host-to-device copies the trace expects: the constants it copied in."""
    return sum(b.kind == "const" and b.fresh for b in trace.buffers)


def _standin_counters(arrays):
    """The stand-in device's counter (its work is seen whole: what a trace must not contain),
    or None for other array libraries."""
    for x in arrays:
        if x is not None:
            mod = type(x).__module__
            if mod == "numba_flash.standin":
                import numba_flash.standin as sd

                return sd.count()
            return None
    return None


#: array type -> its array library, for the ops' fast path (filled as device calls meet them)
DEVICE_MODULES = {}


def plan_key(op, arrays, options):
    """The launch-plan key of a call of ``op`` on ``arrays`` (its inputs and ``out=`` arrays,
    None where absent; the first one's type picks the array library) with ``options`` (a tuple
    of every other argument), or None when the call is not one to plan: host arrays, a call
    inside another's trace, an unhashable option.  The key holds each array's type, shape,
    strides, dtype, device and address modulo 16 (a build's vector loads depend on it), and the
    library's current stream."""
    xp = DEVICE_MODULES.get(type(arrays[0]))
    if xp is None:
        xp = _library_of(type(arrays[0]))
    if xp is None or getattr(_STATE, "trace", None) is not None:
        return None
    nd = xp.ndarray
    try:   # each option with its type: 1 is not True, 5.0 not 5 (the checks tell them apart)
        return (op, xp.cuda.get_current_stream().ptr, tuple([(o.__class__, o) for o in options]),
                tuple([
            None if a is None else
            (nd, a.shape, a.strides, a.dtype, a.device.id, a.data.ptr & 15) if type(a) is nd
            else (type(a), getattr(a, "shape", None), getattr(a, "dtype", None))
            for a in arrays]))
    except (AttributeError, TypeError):
        return None


_HOST_TYPES = set()


def _library_of(t):
    """The array library of array type ``t`` (CuPy's ndarray, the stand-in's), registered in
    :data:`DEVICE_MODULES`; None for other types (remembered)."""
    if t in _HOST_TYPES:
        return None
    import sys

    name = t.__module__.split(".")[0] if t.__module__ != "numba_flash.standin" else t.__module__
    mod = sys.modules.get(name) if name in ("cupy", "numba_flash.standin") else None
    if mod is None or getattr(mod, "ndarray", None) is not t:
        _HOST_TYPES.add(t)
        return None
    DEVICE_MODULES[t] = mod
    return mod


def run_or_build(key, fn, arrays, *args, **kwargs):
    """The op's fast path: replay the plan of ``key``, or build it (or run unplanned)."""
    try:
        plan = PLANS.get(key)
    except TypeError:   # an option that cannot be a key (a list): no plan
        return fn(*args, **kwargs)
    if plan is None:
        return build(key, fn, arrays, *args, **kwargs)
    if plan.__class__ is Plan:
        return plan.run(arrays)
    return fn(*args, **kwargs)

