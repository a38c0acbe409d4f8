"""Errors in a user's ``score_mod`` / ``mask_mod`` / ``score_mod_grad``, told in the user's terms.

Three places a user function fails, each reported with the argument's name (``score_mod``...),
the function's name and line, and the aux tensors with their shapes:

* **Numba cannot compile it** (:func:`compile_error`): Numba's message is a pipeline dump of a
  dozen to forty lines; the error keeps its first meaningful line (the most specific reason:
  ``cannot index array(float32, 1d, A) with 3 indices``, ``Untyped global name 'D'``), the
  user's source line, and a hint on what a user function may use.  ``NUMBA_FLASH_DEBUG=1``
  appends Numba's whole message.
* **It raises while a simulator launch runs it** (:func:`user_error`; the simulator runs it as
  Python, thread by thread): the exception comes out of the launch with the same type (an
  ``IndexError`` stays an ``IndexError``) and a message naming the function, the line, the
  arguments it was called with and the aux tensor it indexed, in place of the simulator's
  ``tid=[...] ctaid=[...]: index 100 is out of bounds for axis 0 with size 8``.
* **It indexes an aux tensor out of range on the host** (:func:`numba_flash.flex.create_block_mask`
  evaluates ``mask_mod`` with Numba's CPU bounds check): found again in Python
  (:func:`locate_host_error`) and reported the same way.

On a GPU nothing checks an aux index: an out-of-range read returns whatever memory holds, or
faults.  ``NUMBA_FLASH_CHECK_AUX=1`` compiles the functions with a check on every aux read
(:mod:`numba_flash.flex.aux_check`).
"""

from __future__ import annotations

import ast
import bdb
import linecache
import os
import re
import weakref

__all__ = ["register", "compile_error", "user_error", "locate_host_error", "describe_aux"]

#: the user functions prepared for a launch: code object -> the argument's name (score_mod...)
_ROLES = weakref.WeakKeyDictionary()

#: what a user function may use (the hint of a compile error)
HINT = ("hint: a user function is compiled by Numba in nopython mode: it may use scalars, math, "
        "the NumPy functions Numba supports and the aux_tensors arrays (one index per "
        "dimension); not a dict, list, str or other Python object (pass an array in "
        "aux_tensors instead); NUMBA_FLASH_DEBUG=1 shows Numba's whole message")

#: the advice of an aux index out of range
GPU_NOTE = ("on a GPU nothing checks this index (NUMBA_FLASH_CHECK_AUX=1 checks every aux read "
            "there)")


def register(role, fn):
    """Remember that ``fn``'s code is the user's ``role`` function (for :func:`user_error`)."""
    if fn is not None:
        _ROLES[fn.__code__] = role


def _params(code):
    return list(code.co_varnames[:code.co_argcount])


def _where(code, line=None):
    return f"{os.path.basename(code.co_filename)}:{line or code.co_firstlineno}"


def _shape_text(a):
    import numpy as np

    dt = np.dtype(getattr(a, "dtype", "V"))
    return f"{dt.name} {tuple(int(s) for s in a.shape)}"


def describe_aux(fn, role, aux):
    """``"doc = aux_tensors[0] int32 (1, 64)"`` for each aux parameter of ``fn``."""
    n_fixed = 4 if role == "mask_mod" else 5
    names = _params(fn.__code__)[n_fixed:]
    return ", ".join(f"{n} = aux_tensors[{i}] {_shape_text(a)}" for i, (n, a)
                     in enumerate(zip(names, aux)))


def _reason(text):
    """The first meaningful line of a Numba error: the most specific reason it gives."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, ln in enumerate(lines):
        if ln.startswith("Rejected as the implementation raised a specific error"):
            nxt = next((x for x in lines[i + 1:] if x), "")
            return re.sub(r"^\w*(TypeError|Error): ", "", nxt)
    sig = next((ln[4:] for ln in lines if ln.startswith(">>> ")), None)
    if sig is not None:
        return f"no implementation of {sig}"
    for ln in lines:
        if ln and not ln.startswith(("Failed in ", "During:", "File ", "^")):
            return ln
    return text.strip().splitlines()[0] if text.strip() else "(no message)"


def compile_error(role, fn, arg_types, exc, aux=()):
    """A ``TypeError`` for a function Numba could not compile: the first meaningful line of
    Numba's message, the user's source line it points at, and a hint."""
    text = str(exc)
    code = fn.__code__
    names = _params(code)
    args = ", ".join(f"{n}: {t}" for n, t in zip(names, arg_types))
    at = ""
    found = re.findall(r'File "[^"]*", line (\d+):', text)
    if found:
        line = int(found[-1])
        src = linecache.getline(code.co_filename, line).strip()
        at = f", at {_where(code, line)}" + (f" `{src}`" if src else "")
    msg = (f"{role}: Numba could not compile {fn.__name__} ({_where(code)}) for ({args}): "
           f"{_reason(text)}{at}")
    if aux:
        msg += f"; aux tensors: {describe_aux(fn, role, aux)}"
    msg += f"\n{HINT}"
    if os.environ.get("NUMBA_FLASH_DEBUG"):
        msg += f"\nNumba's message:\n{text}"
    return TypeError(msg)


def _value_text(v):
    if isinstance(v, float) or type(v).__name__.startswith("float"):
        return f"{float(v):.6g}"
    return str(v)


def _indexed_aux(line, aux_names):
    """The aux parameters a source line subscripts (by name)."""
    try:
        tree = ast.parse(line.strip().removeprefix("return ").rstrip(":"), mode="exec")
    except SyntaxError:
        return [n for n in aux_names if re.search(rf"\b{re.escape(n)}\s*\[", line)]
    seen = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                and node.value.id in aux_names and node.value.id not in seen:
            seen.append(node.value.id)
    return seen


def _library(filename):
    return any(part in filename for part in (f"{os.sep}numba", f"{os.sep}numpy", "<frozen"))


def _message(exc, role, frame, site):
    """The message of ``exc`` raised in user function ``frame`` (``site``: the innermost user
    frame, the same or a helper it called)."""
    code = frame.f_code
    names = _params(code)
    n_fixed = 4 if role == "mask_mod" else 5
    fixed, aux_names = names[:n_fixed], names[n_fixed:]
    local = frame.f_locals
    args = ", ".join(f"{n}={_value_text(local[n])}" for n in fixed if n in local)
    text = re.sub(r"^tid=\[[^\]]*\] ctaid=\[[^\]]*\]:? ?", "", str(exc))
    line = linecache.getline(site.f_code.co_filename, site.f_lineno).strip()
    where = _where(site.f_code, site.f_lineno)
    if site is not frame:
        where = f"{site.f_code.co_name} {where}, called from {code.co_name}"
    aux_desc = []
    for i, n in enumerate(aux_names):
        if n in local and hasattr(local[n], "shape"):
            aux_desc.append((n, f"{n} = aux_tensors[{i}] {_shape_text(local[n])}"))
    indexed = set(_indexed_aux(line, [n for n, _ in aux_desc])) if site is frame else set()
    shown = [d for n, d in aux_desc if n in indexed] or [d for _, d in aux_desc]
    msg = (f"{role} {code.co_name} ({_where(code)}) raised {type(exc).__name__}: {text}, at "
           f"{where} `{line}`, called with {args}")
    if shown:
        msg += f"; {'indexing' if indexed else 'aux tensors:'} {', '.join(shown)}"
    if isinstance(exc, IndexError):
        msg += f"; {GPU_NOTE}"
    return msg


def _rebuild(exc, msg):
    try:
        new = type(exc)(msg)
    except Exception:  # noqa: BLE001 - an exception type that wants other arguments
        new = RuntimeError(msg)
    return new


def user_error(exc, roles=None):
    """The exception to raise for ``exc`` when it came from inside a registered user function
    (the innermost one in its traceback), else ``None``."""
    roles = _ROLES if roles is None else roles
    if isinstance(exc, bdb.BdbQuit):  # quitting pdb inside the function: not an error of it
        return None
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    hits = [i for i, f in enumerate(frames) if f.f_code in roles]
    if not hits:
        return None
    i = hits[-1]
    frame = frames[i]
    site = next((f for f in reversed(frames[i:]) if not _library(f.f_code.co_filename)), frame)
    if isinstance(exc, RuntimeWarning) and "divide by zero" in str(exc):
        # NumPy's integer division by zero, made an error in a simulator launch
        # (frontend.arrays.INT_DIVIDE_BY_ZERO): what a Python int raises
        what = re.sub(r"^tid=\[[^\]]*\] ctaid=\[[^\]]*\]:? ?", "", str(exc))
        exc = ZeroDivisionError(f"integer division or modulo by zero ({what})")
    return _rebuild(exc, _message(exc, roles[frame.f_code], frame, site))


def locate_host_error(role, fn, calls, aux, limit=1 << 20):
    """Find the call of ``fn`` (as Python, NumPy ``aux``) that raises, among the argument tuples
    ``calls`` yields (at most ``limit``); its exception, reported as :func:`user_error` does, or
    ``None`` if none raises."""
    roles = {fn.__code__: role}
    for n, args in enumerate(calls):
        if n >= limit:
            return None
        try:
            fn(*args, *aux)
        except Exception as exc:  # noqa: BLE001 - any exception of the user's code
            return user_error(exc, roles)
    return None
