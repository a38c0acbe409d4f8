"""``NUMBA_FLASH_CHECK_AUX=1``: every aux read of a user function checked, on a GPU as in the
simulator.

Numba's CUDA target has no bounds check (numba-cuda turns ``boundscheck`` off for CUDA
unconditionally), so on a GPU a ``score_mod`` that reads ``bias[q_idx + 100]`` past the end of
``bias`` reads whatever memory follows, or faults, and nothing says so.  With the variable set
(read when an op prepares its variant), each user function is compiled from a rewritten copy of
its source in which every read ``a[i, j]`` of an aux parameter ``a`` becomes a checked read:

* each index is compared with ``a.shape`` (Numba's rule: ``-n <= i < n``, a negative index
  counts from the end);
* an index out of range is recorded, by the first thread that finds one (``cuda.atomic.cas``),
  in a small int64 array that rides at the end of ``aux_tensors`` (the kernels pass every aux
  array to the functions, so no kernel changes): which read, the axis, the index, the size and
  ``b``, ``h``, ``q_idx``, ``kv_idx``; the read then returns an element in range (clamped) so
  the launch finishes;
* after each launch the host reads that array (one synchronisation) and raises ``IndexError``
  naming the function, the line, the read as written, the aux tensor and its shape, the index
  and the arguments of the call.

What it does not check: reads of an aux tensor through a helper function (only the user's own
function is rewritten: pass the indices and check there), slices, and a read ``a[i][j]`` (only
``a[i]`` is checked; write ``a[i, j]``).  A function whose source cannot be read (typed at a
REPL prompt) runs unchecked, with a warning.  It costs a compare and a branch per index and
the synchronisation: a debugging aid, not for production.  The results of a launch that
reports a bad index are not returned.
"""

from __future__ import annotations

import ast
import functools
import inspect
import linecache
import os
import textwrap
import types as pytypes
import warnings
from typing import NamedTuple

import numpy as np
from numba import cuda

__all__ = ["ENV", "enabled", "checked_variant"]

#: the environment variable that turns the check on
ENV = "NUMBA_FLASH_CHECK_AUX"

#: the guard array: [found, site, axis, index, size, b, h, q_idx, kv_idx]
GUARD_LEN = 9


class _Found(NamedTuple):
    """The guard array's entries, in order: the first out-of-range read (``found != 0``)."""

    found: int
    site: int
    axis: int
    index: int
    size: int
    b: int
    h: int
    q_idx: int
    kv_idx: int


_ARGS = {"score_mod": slice(1, 5), "score_mod_grad": slice(1, 5), "mask_mod": slice(0, 4)}


def enabled():
    return os.environ.get(ENV, "").strip() not in ("", "0")


class Site(NamedTuple):
    """One checked read, as the user wrote it."""

    role: str
    function: str
    where: str      # file:line
    text: str       # the read, e.g. "bias[h, q_idx - kv_idx]"
    aux: str        # "bias = aux_tensors[0] float32 (2, 31)"
    args: tuple     # the names of the function's b, h, q_idx, kv_idx parameters


class AuxGuard(np.ndarray):
    """The guard array (``ArrayCall`` finds it by ``aux_guard_sites`` among the inputs)."""

    aux_guard_sites = None

    def report(self, found):
        """The ``IndexError`` for the guard's host copy ``found`` (``found[0] != 0``)."""
        read = _Found._make(int(x) for x in found[:GUARD_LEN])
        s = self.aux_guard_sites[read.site]
        names = dict(zip(s.args, (read.b, read.h, read.q_idx, read.kv_idx)))
        args = ", ".join(f"{n}={v}" for n, v in names.items())
        return IndexError(
            f"{s.role} {s.function} ({s.where}): aux read `{s.text}` out of range: index "
            f"{read.index} on axis {read.axis} of size {read.size} ({s.aux}), called with "
            f"{args} (the first such read of the launch; {ENV}=1)")


def _guard(sites):
    g = np.zeros(GUARD_LEN, np.int64).view(AuxGuard)
    g.aux_guard_sites = sites
    return g


@cuda.jit(device=True)
def _record(guard, site, axis, index, size, b, h, q, k):
    if cuda.atomic.cas(guard, 0, 0, 1) == 0:  # the first out-of-range read is kept
        guard[1] = site
        guard[2] = axis
        guard[3] = index
        guard[4] = size
        guard[5] = b
        guard[6] = h
        guard[7] = q
        guard[8] = k


@functools.lru_cache(maxsize=None)
def _getter(n):
    """The checked read of an ``n``-D aux array: ``get(a, i0, .., site, guard, b, h, q, k)``."""
    from ..kernels.core.jit import device_jit

    idx = [f"i{d}" for d in range(n)]
    lines = [f"def get{n}(a, {', '.join(idx)}, site, guard, b, h, q, k):"]
    for d, i in enumerate(idx):
        lines += [f"    n{d} = a.shape[{d}]",
                  f"    if {i} < -n{d} or {i} >= n{d}:",
                  f"        record(guard, site, {d}, {i}, n{d}, b, h, q, k)",
                  f"        {i} = 0"]
    lines.append(f"    return a[{', '.join(idx)}]")
    namespace = {"record": _record}
    exec(compile("\n".join(lines), f"<numba_flash aux check {n}-D>", "exec"), namespace)
    return device_jit(namespace[f"get{n}"])


def _node_of(fn):
    """The ``ast`` node of ``fn`` (a ``def`` or a ``lambda``) and the line offset of its source,
    or ``None`` when the source cannot be read or found."""
    try:
        lines, first = inspect.getsourcelines(fn)
    except (OSError, TypeError):
        return None
    src = textwrap.dedent("".join(lines))
    code = fn.__code__
    params = list(code.co_varnames[:code.co_argcount])
    if fn.__name__ != "<lambda>":
        try:
            tree = ast.parse(src)
        except SyntaxError:
            return None
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == fn.__name__:
                return node, first - 1
        return None
    # a lambda: the source lines hold the statement around it; try each "lambda" in them
    text = "".join(lines)
    found = []
    start = text.find("lambda")
    while start >= 0:
        for end in range(len(text), start, -1):
            try:
                node = ast.parse("(" + text[start:end] + ")", mode="eval").body
            except SyntaxError:
                continue
            if not isinstance(node, ast.Lambda):
                continue  # e.g. "lambda ...: x, y" parses as a tuple: shorter
            if [a.arg for a in node.args.args] == params:
                found.append((node, first - 1 + text.count("\n", 0, start)))
            break
        start = text.find("lambda", start + 1)
    return found[0] if len(found) == 1 else None


class _Rewrite(ast.NodeTransformer):
    def __init__(self, role, fn, aux_names, aux, where, sites, first_line):
        self.role, self.fn, self.aux_names, self.aux = role, fn, aux_names, aux
        self.sites, self.first_line, self.where = sites, first_line, where
        code = fn.__code__
        self.args = tuple(code.co_varnames[:code.co_argcount][_ARGS[role]])

    def visit_Subscript(self, node):
        self.generic_visit(node)
        if not (isinstance(node.ctx, ast.Load) and isinstance(node.value, ast.Name)
                and node.value.id in self.aux_names):
            return node
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if any(isinstance(e, ast.Slice) for e in elts):
            return node  # a slice: not checked (see the module docstring)
        i = self.aux_names.index(node.value.id)
        a = self.aux[i]
        shape = tuple(int(s) for s in a.shape)
        self.sites.append(Site(self.role, self.fn.__name__,
                               f"{self.where}:{node.lineno + self.first_line}",
                               ast.unparse(node),
                               f"{node.value.id} = aux_tensors[{i}] {np.dtype(a.dtype).name} "
                               f"{shape}", self.args))
        call = ast.Call(func=ast.Name(f"__nf_get{len(elts)}", ast.Load()),
                        args=[node.value, *elts, ast.Constant(len(self.sites) - 1),
                              ast.Name("__nf_guard", ast.Load()),
                              *(ast.Name(n, ast.Load()) for n in self.args)], keywords=[])
        return ast.copy_location(call, node)


def _checked_copy(role, fn, aux, sites):
    """A Python function like ``fn`` with its aux reads checked and one more parameter, the
    guard; ``None`` when ``fn``'s source cannot be found."""
    found = _node_of(fn)
    if found is None:
        return None
    node, offset = found
    code = fn.__code__
    params = list(code.co_varnames[:code.co_argcount])
    n_fixed = 4 if role == "mask_mod" else 5
    aux_names = params[n_fixed:]
    where = os.path.basename(code.co_filename)
    body = _Rewrite(role, fn, aux_names, aux, where, sites, offset).visit(node)
    # a template def gives the FunctionDef every field this Python's ast wants
    module = ast.parse(f"def checked({', '.join(params + ['__nf_guard'])}):\n    pass\n")
    checked = module.body[0]
    if isinstance(body, ast.Lambda):
        checked.body = [ast.copy_location(ast.Return(body.body), body.body)]
    else:
        checked.body = body.body
    ast.copy_location(checked, body)
    module = ast.fix_missing_locations(module)
    ast.increment_lineno(module, offset)
    namespace = dict(fn.__globals__)
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        namespace[name] = cell.cell_contents  # Numba freezes closure values like globals
    namespace.update({f"__nf_get{n}": _getter(n) for n in range(1, 9)})
    linecache.getlines(code.co_filename)  # keep the file's lines for tracebacks
    exec(compile(module, code.co_filename, "exec"), namespace)
    out = namespace["checked"]
    out.__name__ = out.__qualname__ = fn.__name__
    return out


def checked_variant(functions, aux):
    """``(functions, aux)`` for a variant with every aux read checked: ``functions`` maps a role
    to a Python function (or None), the result maps it to its checked copy, and ``aux`` gains
    the guard array at its end.  A function without readable source stays as it is (warned)."""
    for i, a in enumerate(aux):
        if any(int(s) == 0 for s in a.shape):
            raise ValueError(f"aux_tensors[{i}]: expected no empty dimension with {ENV}=1 (every "
                             f"read of it is out of range), got shape {tuple(a.shape)}")
    sites = []
    out = {}
    for role, fn in functions.items():
        if fn is None:
            out[role] = None
            continue
        checked = _checked_copy(role, fn, aux, sites)
        if checked is None:
            warnings.warn(f"{role}: {ENV}=1 cannot read the source of {fn.__name__}, so its aux "
                          f"reads are not checked", stacklevel=4)
            checked = _unchecked(fn)
        out[role] = checked
    return out, tuple(aux) + (_guard(sites),)


def _unchecked(fn):
    """``fn`` with one more (ignored) parameter, the guard, for a function without source."""
    code = fn.__code__
    params = list(code.co_varnames[:code.co_argcount])
    src = (f"def wrapped({', '.join(params)}, __nf_guard):\n"
           f"    return __nf_user({', '.join(params)})\n")
    namespace = {"__nf_user": fn}
    exec(compile(src, f"<{fn.__name__} unchecked>", "exec"), namespace)
    return pytypes.FunctionType(namespace["wrapped"].__code__, namespace, fn.__name__)
