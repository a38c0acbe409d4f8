"""Stop in pdb inside a user's ``score_mod`` while the tensor-core forward runs in the simulator.

In the simulator a device function is the Python function itself, called by each CUDA thread (a
Python thread) for each score it computes.  This script installs a trace function in every
simulator thread (``threading.settrace``, as ``examples/step_through_kernel.py`` does for a
kernel) that counts the calls of ``score_mod`` and, at the first call whose arguments match
``--when`` (``q_idx=3,kv_idx=1``), hands that frame to pdb.  The pdb commands come from
``--commands`` (``;``-separated) so that a docs page can show the session; without it pdb reads
the terminal.  The function is not edited.

``docs/own-variant.md`` quotes the output of::

    python docs/examples/flex_step.py --commands "p q_idx, kv_idx, float(score); n; ..."
    python docs/examples/flex_step.py --breakpoint --commands "..."  # breakpoint() inside it

pdb's location lines inside the package's kernels are printed without their line numbers (they
move whenever the kernel is edited).  ``tests/docs/test_flex_demo.py`` checks both stops.
"""

from __future__ import annotations

import argparse
import io
import os
import pdb
import re
import sys
import threading
from pathlib import Path

import numpy as np
from report import err

import numba_flash  # first: it chooses the simulator before numba.cuda is imported
import numba
import numba.cuda
from numba_flash import reference as ref
from numba_flash.backend import on_simulator

N, D = 16, 16


# [docs:flex-step-score-mod]
def my_bias(score, b, h, q_idx, kv_idx, bias):
    s = score + bias[h, q_idx - kv_idx + N - 1]
    return s
# [/docs:flex-step-score-mod]


def with_breakpoint(score, b, h, q_idx, kv_idx, bias):
    if q_idx == 3 and kv_idx == 1:
        breakpoint()
    return score + bias[h, q_idx - kv_idx + N - 1]


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((1, 1, N, D)).astype(np.float16) for _ in range(3))
    bias = np.round(rng.standard_normal((1, 2 * N - 1)), 2).astype(np.float32)
    return q, k, v, bias


class ScoreModStopper:
    """A ``threading.settrace`` hook: counts the calls of ``code`` per simulator thread and hands
    the first call whose arguments equal ``when`` to pdb, before its first line runs."""

    def __init__(self, code, when, commands=None):
        self.code, self.when, self.commands = code, when, commands
        self.calls = {}          # threadIdx.x -> calls
        self.stopped_in = None   # (blockIdx.x, threadIdx.x) of the stop
        self.lock = threading.Lock()
        self.out = io.StringIO()

    def global_trace(self, frame, event, arg):
        if event != "call" or frame.f_code is not self.code:
            return None  # every other frame runs untraced
        t = threading.current_thread()
        tid = t.threadIdx.x
        with self.lock:
            self.calls[tid] = self.calls.get(tid, 0) + 1
            hit = self.stopped_in is None and all(
                int(frame.f_locals[k]) == v for k, v in self.when.items())
            if hit:
                self.stopped_in = (t.blockIdx.x, tid)
        return self.first_line if hit else None

    def first_line(self, frame, event, arg):
        if event != "line":
            return self.first_line
        stopper = self

        class Pdb(pdb.Pdb):
            def set_continue(self):
                super().set_continue()                 # pdb stops tracing this thread ...
                sys.settrace(stopper.global_trace)     # ... the counting goes on

        if self.commands is None:
            dbg = Pdb()
        else:
            script = [c.strip() for c in self.commands.split(";") if c.strip()]
            if not script or script[-1] not in ("c", "cont", "continue"):
                script.append("c")
            dbg = Pdb(stdin=io.StringIO("\n".join(script) + "\n"), stdout=self.out)
            dbg.prompt = "(Pdb) "
        # hand this frame to pdb: it stops now, before the line runs; "up" reaches every frame
        # of the thread, the kernel's included
        dbg.reset()
        bottom = frame
        while bottom.f_back is not None:
            bottom = bottom.f_back
        dbg.botframe = bottom
        dbg.set_step()
        return dbg.trace_dispatch(frame, event, arg)


#: the folders pdb's paths are written from: the repository (docs/...), the one that holds the
#: numba_flash package (numba_flash/...) and those that hold numba and numba.cuda (numba/...)
_ROOTS = sorted({str(Path(m.__file__).resolve().parents[n]) + os.sep
                 for m, n in ((numba_flash, 1), (numba, 1), (numba.cuda, 2))}
                | {str(Path(__file__).resolve().parents[2]) + os.sep}, key=len, reverse=True)


def readable(text):
    """pdb's transcript with machine-independent locations: paths from the repository, the
    package or numba down (whatever the folder the clone is in is called), no line numbers
    inside numba_flash or numba (they move with every edit)."""
    for root in _ROOTS:
        text = text.replace(root, "")
    return re.sub(r"((?:numba_flash|numba)/[\w/]+\.py)\(\d+\)", r"\1(...)", text)


def run_stopped(commands, when):
    q, k, v, bias = inputs()
    stopper = ScoreModStopper(my_bias.__code__, when, commands)
    threading.settrace(stopper.global_trace)
    try:
        o = numba_flash.forward(q, k, v, score_mod=my_bias, aux_tensors=(bias,), kernel="mma")
    finally:
        threading.settrace(None)
    want = ref.attention(q, k, v, score_mod=my_bias, aux_tensors=(bias,))[0]
    return stopper, float(np.max(np.abs(o - want)))


def try_breakpoint(commands=None):
    """Run :func:`with_breakpoint` as the score_mod: ``breakpoint()`` stops in pdb in the
    simulator (the device function is the Python function); ``commands`` (``;``-separated) feed
    that pdb, or None for the terminal.  Returns ``(transcript, max |o - reference|)``, or
    ``(why, None)`` if the call is refused before launch."""
    q, k, v, bias = inputs()
    out = io.StringIO()

    def hook(*args, **kwargs):  # sys.breakpointhook: pdb at the caller, fed from `commands`
        if commands is None:
            dbg = pdb.Pdb()
        else:
            script = [c.strip() for c in commands.split(";") if c.strip()]
            if not script or script[-1] not in ("c", "cont", "continue"):
                script.append("c")
            dbg = pdb.Pdb(stdin=io.StringIO("\n".join(script) + "\n"), stdout=out)
            dbg.prompt = "(Pdb) "
        dbg.set_trace(sys._getframe(1))

    old_hook, sys.breakpointhook = sys.breakpointhook, hook
    try:
        o = numba_flash.forward(q, k, v, score_mod=with_breakpoint, aux_tensors=(bias,),
                                kernel="mma")
    except TypeError as e:
        return "refused before launch: TypeError: " + str(e).splitlines()[0], None
    finally:
        sys.breakpointhook = old_hook
    sys.breakpointhook = lambda *args, **kwargs: None   # the reference calls it too: no stop
    try:
        want = ref.attention(q, k, v, score_mod=with_breakpoint, aux_tensors=(bias,))[0]
    finally:
        sys.breakpointhook = old_hook
    return readable(out.getvalue()).rstrip(), float(np.max(np.abs(o - want)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--when", default="q_idx=3,kv_idx=1",
                    help="stop at the first call with these arguments (default q_idx=3,kv_idx=1)")
    ap.add_argument("--commands", help='pdb commands, ";"-separated (default: the terminal)')
    ap.add_argument("--breakpoint", action="store_true",
                    help="run a score_mod that calls breakpoint() instead (pdb stops there)")
    args = ap.parse_args(argv)
    if not on_simulator():
        raise SystemExit("stepping needs the simulator: run with NUMBA_ENABLE_CUDASIM=1")
    if args.breakpoint:
        text, o_err = try_breakpoint(args.commands)
        if o_err is None:
            print("breakpoint() inside a score_mod:", text)
            return 1
        print("breakpoint() inside with_breakpoint stopped in pdb:")
        print(text)
        print(f"o against the reference with the same function: max |error| {err(o_err)}")
        return 0
    when = {k: int(v) for k, v in (p.split("=") for p in args.when.split(","))}
    stopper, o_err = run_stopped(args.commands, when)
    if stopper.stopped_in is None:
        print(f"never stopped: no call of my_bias with {args.when}")
        return 1
    blk, tid = stopper.stopped_in
    print(f"stopped in block {blk}, thread {tid}, at the first call of my_bias with {args.when}")
    print(readable(stopper.out.getvalue()).rstrip())
    calls = stopper.calls
    print(f"my_bias ran {sum(calls.values())} times, in {len(calls)} threads "
          f"({min(calls.values())} to {max(calls.values())} calls each)")
    print(f"o against the reference with the same function: max |error| {err(o_err)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
