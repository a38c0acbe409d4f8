"""The ``.entry`` parameter list NVVM writes for a kernel of given argument types.

A device call packs its launch parameters itself (:mod:`numba_flash.frontend.launch`), in the
layout it believes Numba's kernel ABI has.  This module asks the compiler: for each signature it
compiles a probe kernel with exactly those argument types (an empty body: the parameter list of a
kernel depends on its argument types only, and NVVM never drops an entry parameter) to PTX for
sm_90, in a process where ``numba.cuda`` is the real CUDA target (the compile tier's mode: no GPU
needed), and reads the ``.param`` declarations of its ``.entry``.  The stand-in device's tests
compare every recorded launch's parameter sizes with them (count, sizes, order)::

    sizes = entry_param_sizes([sig1, sig2])      # {repr(sig): [8, 8, ..., 4]}

Run as a module it reads pickled signatures on stdin and prints JSON (what
:func:`entry_param_sizes` does in a subprocess).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys

__all__ = ["entry_param_sizes", "probe_params"]

#: bytes of each PTX parameter type
PTX_SIZES = {"u8": 1, "s8": 1, "b8": 1, "u16": 2, "s16": 2, "b16": 2, "f16": 2, "u32": 4,
             "s32": 4, "b32": 4, "f32": 4, "u64": 8, "s64": 8, "b64": 8, "f64": 8}


def probe_params(sig):
    """The ``.entry`` parameter types (``["u64", ..., "f32"]``) of a kernel taking ``sig``
    (Numba types), compiled here (``numba.cuda`` must be the CUDA target)."""
    from numba.cuda import compile_ptx

    names = ", ".join(f"a{i}" for i in range(len(sig)))
    namespace = {}
    exec(f"def probe({names}):\n    pass\n", namespace)
    ptx, _ = compile_ptx(namespace["probe"], tuple(sig), cc=(9, 0))
    entry = ptx[ptx.index(".entry"):]
    entry = entry[: entry.index(")")]
    return re.findall(r"\.param\s+\.(\w+)", entry)


def entry_param_sizes(sigs, cache=None):
    """``{repr(sig): [bytes of each .entry parameter]}`` for the signatures ``sigs``, compiled
    in a subprocess in the compile tier's mode; ``cache`` (a JSON file path) keeps results
    between runs."""
    known = {}
    if cache is not None and os.path.exists(cache):
        with open(cache) as f:
            known = json.load(f)
    todo = {repr(s): s for s in sigs if repr(s) not in known}
    if todo:
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
        proc = subprocess.run([sys.executable, "-m", "numba_flash.tools.entry_params"],
                              input=pickle.dumps(list(todo.values())), env=env,
                              capture_output=True)
        if proc.returncode:
            raise RuntimeError(f"entry_params failed:\n{proc.stderr.decode()[-3000:]}")
        got = json.loads(proc.stdout.decode().strip().splitlines()[-1])
        known.update(got)
        if cache is not None:
            with open(cache, "w") as f:
                json.dump(known, f)
    return {repr(s): known[repr(s)] for s in sigs}


def main():
    sigs = pickle.loads(sys.stdin.buffer.read())
    out = {repr(s): [PTX_SIZES[t] for t in probe_params(s)] for s in sigs}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
