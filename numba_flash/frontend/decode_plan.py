"""``numba_flash.decode_plan``: FlashInfer's plan / run split of :func:`numba_flash.decode`.

A serving loop calls the decode once per layer per step with the same batch layout (batch,
heads, head dims, dtypes, page size, pages per sequence, splits); only the values change: the
new query, the caches' contents, the lengths, the block table.  :func:`decode_plan` does the
work that depends on the layout alone once: it checks every argument, chooses the kernel and
its configuration, compiles it, packs the launch parameters and allocates the workspace (the
split-KV partials and counters), by recording the call on example arrays without running it
(a dry trace, :func:`numba_flash.frontend.plans.trace_plan`).  :meth:`DecodePlan.run` then
launches on the arrays of a step: it allocates nothing (pass ``out=``; without it the output
is allocated), never synchronises, and reads the lengths and the block table on the device,
so a CUDA graph can capture a ``run`` and replay it step after step while the cache grows (the
arrays of the captured step must then stay where they are, as for any captured graph).

    plan = numba_flash.decode_plan(q, k_cache, v_cache, cache_seqlens=lens,
                                   block_table=table, causal=True)
    for step in range(steps):
        plan.run(q, k_cache, v_cache, lens, table, out=o)

``run`` checks what can change cheaply: every array's shape, strides, dtype, device and address
alignment, and the current stream, against the plan's (a ``ValueError`` names the first that
differs: make a plan for that layout).  Options are fixed by the plan.  A plan's workspace is
its own: two plans never share it, and one plan's runs on one stream never overlap.  The arrays
must be device arrays (CuPy, or the stand-in device's), and ``validate`` must stay off (it reads
lengths on the host): a ``ValueError`` says so.
"""

from __future__ import annotations

import importlib

from .plans import plan_key, trace_plan

__all__ = ["decode_plan", "DecodePlan"]


def _decode_op():
    return importlib.import_module("numba_flash.ops.decode")


class DecodePlan:
    """A planned :func:`numba_flash.decode` (see :func:`decode_plan`)."""

    def __init__(self, plan, key, names, options, extra, raw_options):
        self._plan, self._key, self._names, self._options = plan, key, names, options
        self._raw_options = raw_options   # the options tuple of the plan's key
        self._extra = extra   # arrays given besides q, the caches, lengths, table and out
        self._middle = (None,) * (len(names) - 6)
        self._aux = tuple(options.get("aux_tensors", ()))

    def run(self, q, k_cache, v_cache, cache_seqlens, block_table=None, *, out=None,
            **arrays):
        """The decode of one step: ``o`` (``out``, when given), or ``(o, lse)`` for a plan made
        with ``return_lse=True``.  ``arrays``: the other arrays the plan was made with
        (``k_new``, ``v_new``, ``cache_leftpad``, ...), by name."""
        if out is None:
            out = _decode_op().decode_output(q, k_cache, v_cache, self._options)
        if arrays or self._extra:   # arrays beyond the usual five: by name
            given = dict(arrays, q=q, k_cache=k_cache, v_cache=v_cache,
                         cache_seqlens=cache_seqlens, block_table=block_table, out=out)
            ordered = tuple([given.get(n) for n in self._names]) + tuple(
                arrays.get("aux_tensors", self._aux))
        else:
            ordered = (q, k_cache, v_cache, cache_seqlens, block_table) + self._middle + (
                out,) + self._aux
        key = plan_key("decode", ordered, self._raw_options)
        if key != self._key:
            raise ValueError(f"DecodePlan.run: {_first_difference(key, self._key, self._names)}"
                             f"; make a plan for this layout with numba_flash.decode_plan")
        return self._plan.run(ordered)


def _first_difference(got, want, names):
    if got is None:
        return "expected device arrays of the plan's array library"
    if got[1] != want[1]:
        return f"the current stream ({got[1]:#x}) is not the plan's ({want[1]:#x})"
    for name, a, b in zip(names, got[3], want[3]):
        if a != b:
            return f"{name}: expected {_describe(b)}, got {_describe(a)}"
    return "the arrays differ from the plan's"


def _describe(entry):
    if entry is None:
        return "None"
    if len(entry) == 6:
        _, shape, strides, dtype, device, align = entry
        return (f"shape {shape}, strides {strides}, dtype {dtype}, device {device}, address "
                f"{align} mod 16")
    return f"a {entry[0].__name__}"


def decode_plan(q, k_cache, v_cache, *, cache_seqlens, block_table=None, out=None, **options):
    """A :class:`DecodePlan` of :func:`numba_flash.decode` with these arrays' layout and these
    options (every option :func:`numba_flash.decode` takes, and its arrays by name): nothing is
    launched or written now; its workspace is allocated now, once."""
    op = _decode_op()
    named = dict({n: options.pop(n) for n in op.DECODE_ARRAYS if n in options}, q=q,
                 k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                 block_table=block_table, out=out)
    if options.get("validate"):
        raise ValueError("validate: expected False with decode_plan (validation reads the "
                         "lengths and tables on the host; a plan reads them on the device), "
                         "got True")
    options["validate"] = False
    if named["out"] is None:
        named["out"] = op.decode_output(q, k_cache, v_cache, options)
    names = op.DECODE_ARRAYS
    aux = options.get("aux_tensors", ())
    ordered = tuple([named.get(n) for n in names]) + tuple(aux)
    raw_options = op.decode_options_key(options)
    key = plan_key("decode", ordered, raw_options)
    if key is None:
        raise ValueError("decode_plan: expected device arrays (CuPy, or the stand-in device's) "
                         "and hashable options: a plan replays launches on the device")
    kwargs = {n: named.get(n) for n in names if n not in ("q", "k_cache", "v_cache")}
    plan = trace_plan(op.decode_unplanned, ordered, q, k_cache, v_cache, **kwargs, **options)
    usual = ("q", "k_cache", "v_cache", "cache_seqlens", "block_table", "out")
    extra = [n for n in names if n not in usual and named.get(n) is not None]
    return DecodePlan(plan, key, names, options, extra, raw_options)
