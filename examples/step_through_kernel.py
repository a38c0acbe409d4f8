#!/usr/bin/env python
"""Stop inside one CUDA thread of a kernel running in the simulator, without editing the kernel.

In the Numba CUDA simulator every CUDA thread is a Python thread, so a kernel's locals are Python
values and its shared arrays NumPy arrays.  This script installs a trace function in every
simulator thread (``threading.settrace``) that stays silent except in the chosen thread
(``--block``, ``--thread``), and there, when the chosen line of the kernel is about to run for the
``--hit``-th time, hands the frame to ``pdb``.  Every pdb command then works on that one thread:
``p m_i``, ``pp acc``, ``n``, ``s``, ``c``.  The other threads of the block wait at their next
``cuda.syncthreads()`` (or run to the end) while you look.

Examples::

    python examples/step_through_kernel.py --kernel softmax --block 1 --thread 0
    python examples/step_through_kernel.py --kernel naive_forward --block 1,0 --thread 2 \\
        --at "m_i = m_new" --hit 3 --commands "p float(s); p float(m_i); p float(l_i); c"
    python examples/step_through_kernel.py --kernel softmax --non-interactive

``--commands`` feeds pdb a ``;``-separated script (a final ``c`` is added if missing);
``--non-interactive`` prints the frame's scalars and arrays at the stop and continues.  Without
either, pdb reads the terminal.  ``q`` in pdb stops the kernel and exits cleanly (status 0).

The alternative the numba docs give needs an edit of the kernel source::

    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 1:
        breakpoint()
"""

from __future__ import annotations

import argparse
import bdb
import io
import pdb
import sys
import threading

import numpy as np

import numba_flash  # noqa: F401  (chooses the simulator on a machine without a GPU)
from numba_flash.backend import on_simulator

#: default stop lines: after the online pass, where the running statistics are complete
DEFAULT_AT = {
    "softmax": "m_sh[tid] = m_i",
    "naive_forward": "if l_i > acc_t(0.0):",
}


def make_inputs(kernel, seed=0):
    """The deterministic inputs the script runs ``kernel`` on (tests recompute from these)."""
    rng = np.random.default_rng(seed)
    if kernel == "softmax":
        return {"x": np.round(rng.standard_normal((3, 20)) * 2, 2).astype(np.float32)}
    q = np.round(rng.standard_normal((1, 2, 10, 4)), 2).astype(np.float32)
    k = np.round(rng.standard_normal((1, 1, 12, 4)), 2).astype(np.float32)
    v = np.round(rng.standard_normal((1, 1, 12, 4)), 2).astype(np.float32)
    return {"q": q, "k": k, "v": v}


def launch(kernel, inputs):
    """Run the public op (which launches the kernel in the simulator); return the op's result.
    Outputs start as NaN, so an element not yet written shows as nan at the stop."""
    from numba_flash.teach.ops.naive_forward import naive_forward

    with numba_flash.poisoned_outputs():
        if kernel == "softmax":
            return numba_flash.softmax(inputs["x"])
        return naive_forward(inputs["q"], inputs["k"], inputs["v"], causal=True)


def kernel_function(kernel, inputs):
    """The Python function the simulator runs for ``kernel`` (to match frames by code object)."""
    if kernel == "softmax":
        from numba_flash.teach.kernels.softmax import default_threads, softmax_kernel

        return softmax_kernel(default_threads(), inputs["x"].dtype).py_func
    from numba_flash.kernels.core.common import padded_head_dim
    from numba_flash.teach.kernels.naive_forward import naive_forward_kernel

    q = inputs["q"]
    return naive_forward_kernel(padded_head_dim(q.shape[-1]), True, q.dtype).py_func


def find_line(func, at):
    """Absolute line number in ``func``'s file of the first source line containing ``at``
    (or ``at`` itself if it is a number)."""
    import inspect

    if str(at).isdigit():
        return int(at)
    lines, first = inspect.getsourcelines(func)
    for n, line in enumerate(lines):
        if at in line and not line.lstrip().startswith("#"):
            return first + n
    raise SystemExit(f"--at {at!r}: no such line in {func.__qualname__}")


def dim3(text):
    parts = [int(p) for p in str(text).split(",")]
    return tuple(parts + [0] * (3 - len(parts)))


def print_frame(frame, out=sys.stdout):
    """The frame's locals: scalars by value, local and shared arrays in full, global arrays (the
    kernel's arguments) by shape only."""
    print(f"-- stopped at {frame.f_code.co_filename}:{frame.f_lineno}", file=out)
    for name, value in sorted(frame.f_locals.items()):
        if isinstance(value, (int, float, np.generic)):
            print(f"{name} = {value!r}", file=out)
        elif isinstance(value, np.ndarray):  # cuda.local.array / cuda.shared.array
            print(f"{name} = {np.array2string(value, precision=6, separator=', ')}", file=out)
        elif hasattr(value, "shape"):  # a global-memory argument
            print(f"{name}: global array of shape {tuple(value.shape)}", file=out)


class ThreadStopper:
    """A ``threading.settrace`` hook that stops in one (block, thread) at one line."""

    def __init__(self, code, line, block, thread, hit=1, commands=None, non_interactive=False):
        self.code, self.line, self.block, self.thread = code, line, block, thread
        self.hit, self.seen = hit, 0
        self.commands, self.non_interactive = commands, non_interactive
        self.stopped = False

    def _is_target(self):
        t = threading.current_thread()
        b, th = getattr(t, "blockIdx", None), getattr(t, "threadIdx", None)
        return (b is not None and (b.x, b.y, b.z) == self.block
                and (th.x, th.y, th.z) == self.thread)

    def global_trace(self, frame, event, arg):
        if event == "call" and frame.f_code is self.code and self._is_target():
            return self.local_trace
        return None  # every other frame and thread runs untraced

    def local_trace(self, frame, event, arg):
        if event != "line" or frame.f_lineno != self.line or self.stopped:
            return self.local_trace
        self.seen += 1
        if self.seen < self.hit:
            return self.local_trace
        self.stopped = True
        if self.non_interactive:
            print_frame(frame)
            sys.stdout.flush()
            return None
        if self.commands is not None:
            script = [c.strip() for c in self.commands.split(";") if c.strip()]
            if not script or script[-1] not in ("c", "cont", "continue", "q", "quit"):
                script.append("c")
            dbg = pdb.Pdb(stdin=io.StringIO("\n".join(script) + "\n"), stdout=sys.stdout)
            dbg.prompt = "(Pdb) "
        else:
            dbg = pdb.Pdb()
        # hand this frame to pdb: stop now, before the chosen line runs; pdb's own trace
        # function takes over this frame, so n / s / c behave as usual from here
        dbg.reset()
        dbg.botframe = frame
        dbg.set_step()
        return dbg.trace_dispatch(frame, event, arg)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=sorted(DEFAULT_AT), default="softmax")
    ap.add_argument("--block", default="1", help="blockIdx as x[,y[,z]] (default 1)")
    ap.add_argument("--thread", default="0", help="threadIdx as x[,y[,z]] (default 0)")
    ap.add_argument("--at", help="stop before the first kernel line containing this text, or at "
                    "this absolute line number (default: after the online pass)")
    ap.add_argument("--hit", type=int, default=1, help="stop the N-th time the line runs")
    ap.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--commands", help='pdb commands, ";"-separated, e.g. "p m_i; p l_i; c"')
    mode.add_argument("--non-interactive", action="store_true",
                      help="print the frame's locals at the stop instead of opening pdb")
    args = ap.parse_args(argv)
    if not on_simulator():
        raise SystemExit("stepping needs the simulator: run with NUMBA_ENABLE_CUDASIM=1")

    inputs = make_inputs(args.kernel, args.seed)
    func = kernel_function(args.kernel, inputs)
    line = find_line(func, args.at or DEFAULT_AT[args.kernel])
    stopper = ThreadStopper(func.__code__, line, dim3(args.block), dim3(args.thread), args.hit,
                            args.commands, args.non_interactive)
    print(f"kernel {func.__name__}: stopping in block {dim3(args.block)} thread "
          f"{dim3(args.thread)} before line {line} (hit {args.hit})")
    threading.settrace(stopper.global_trace)
    try:
        launch(args.kernel, inputs)
    except bdb.BdbQuit:  # "q" in pdb: the simulator re-raises it from the kernel thread
        print("quit: pdb stopped the kernel before it finished (no result)")
        return 0
    finally:
        threading.settrace(None)
    if not stopper.stopped:
        print("never stopped: that thread does not exist or never reached the line")
        return 1
    print("kernel finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
