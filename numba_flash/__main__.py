"""Command line: python -m numba_flash (also installed as numba-flash).

  demo          run every kernel on a small problem, check it against the float64 reference
  info          the backend and library versions
  warmup        compile the common kernel configurations ahead, into the on-disk cache (GPU)
  compile-check build every kernel configuration to PTX and assemble it (no GPU needed)
  pictures      draw the tile map, block table and split-KV figures (needs matplotlib)
  profile       one call of an op in the simulator, every memory access recorded: per kernel
                site the global sectors and shared-memory bank conflicts of a warp's request

Errors end in one line (numba-flash: error: ...), not a traceback.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from numba_flash.install_hints import pip_extra


#: the demo's cases (``numba_flash.demo.CASES``, listed here so that ``--help`` imports nothing)
DEMO_OPS = ("softmax", "forward", "causal", "backward", "dropout", "variants", "varlen", "mma",
            "bfloat16", "decode", "paged")
#: the demo's ``--dtype`` choices
DEMO_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _nonnegative_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _demo(args):
    from numba_flash import demo

    ops = list(demo.CASES) if args.ops == "all" else args.ops.split(",")
    unknown = [o for o in ops if o not in demo.CASES]
    if unknown:  # a bad option value: exit status 2, as argparse's own
        print(f"numba-flash: error: --ops: unknown operation(s) {', '.join(unknown)}; choose "
              f"from {', '.join(demo.CASES)} (or all)", file=sys.stderr)
        return 2
    rows = demo.run(ops, size=args.size, dtype=args.dtype, seed=args.seed)
    return 0 if demo.render(rows) else 1


def _info(_args):
    import numba
    import numpy

    import numba_flash

    print(f"numba_flash {numba_flash.__version__}")
    print(f"backend     {numba_flash.backend()}")
    print(f"numba       {numba.__version__}")
    try:
        from importlib.metadata import version

        print(f"numba-cuda  {version('numba-cuda')}")
    except Exception:  # pragma: no cover
        pass
    print(f"numpy       {numpy.__version__}")
    from numba_flash.kernels.core import jit

    state = "on" if jit.caching_enabled() else "off (simulator or NUMBA_FLASH_CACHE=0)"
    print(f"kernel cache {state}")
    return 0


def _warmup(args):
    from numba_flash.tools import warmup
    import numba_flash
    from numba_flash.kernels.core import jit

    if args.list:
        for cfg in warmup.warmup_configs(args.k, args.all):
            print(cfg["name"])
        return 0
    if numba_flash.backend() == "simulator":
        print("warmup: nothing to compile: the simulator runs the kernels as Python (no GPU "
              "found). On a GPU this compiles the common configurations into the disk cache.")
        return 0
    from numba import cuda

    if not cuda.is_available():
        print("numba-flash: error: warmup compiles for this machine's GPU and there is none "
              "(to build PTX without a GPU use compile-check)", file=sys.stderr)
        return 1
    if not jit.caching_enabled():
        print(f"warmup: {jit.CACHE_ENV}=0, so nothing is kept after this process",
              file=sys.stderr)
    configs = list(warmup.warmup_configs(args.k, args.all))
    width = len(str(len(configs)))

    def report(i, n, name, seconds, source):
        print(f"[{i:>{width}}/{n}] {name:<48} {seconds:6.2f} s  {source}", flush=True)

    dev = cuda.get_current_device()
    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    print(f"warmup: {len(configs)} configurations for GPU {dev.id} ({name})", flush=True)
    import time

    t0 = time.perf_counter()
    done = warmup.warm_up(configs, report)
    compiled = sum(1 for _, _, src in done if src == "compiled")
    uncached = sum(1 for _, _, src in done if src.endswith("(no disk cache)"))
    print(f"warmup: {compiled} compiled, {len(done) - compiled - uncached} already cached, "
          f"{uncached} without a disk cache (cuda.jit, not kernel_jit), "
          f"{time.perf_counter() - t0:.1f} s in all", flush=True)
    return 0


class MissingExtra(Exception):
    """A command needs packages of an extra that is not installed (one line, naming it)."""


def _missing_compile_tools(rest=()):
    """What the compile tier needs and cannot find: NVRTC and NVVM (the numba-cuda[cu13]
    wheels), ptxas (the nvidia-cuda-nvcc wheel: one on PATH is another toolchain, and the
    committed tables are the wheel's) and, for ``--sass`` / ``--dump``, nvdisasm (the
    nvidia-cuda-nvdisasm wheel); [] when all are there."""
    missing = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
    except ImportError:
        return ["cuda.pathfinder (numba-cuda[cu13])"]
    for lib in ("nvrtc", "nvvm"):
        try:
            load_nvidia_dynamic_lib(lib)
        except Exception as exc:  # DynamicLibNotFoundError and kin
            missing.append(f"lib{lib} ({type(exc).__name__})")
    import shutil

    from numba_flash.tools.compile_check import TOOL_WHEELS, wheel_tool

    sass = any(a in ("--sass", "--dump") or a.startswith("--dump=") for a in rest)
    for tool in ("ptxas", "nvdisasm") if sass else ("ptxas",):
        if not wheel_tool(tool):
            system = shutil.which(tool)
            missing.append(f"{tool} of the {TOOL_WHEELS[tool]} wheel" +
                           (f" (the one on PATH, {system}, is not the pinned toolchain)"
                            if system else ""))
    return missing


def _compile_check(args):
    if not any(a in ("-h", "--help") for a in args.rest):
        missing = _missing_compile_tools(args.rest)
        if missing:
            raise MissingExtra(
                f"compile-check needs the test extra's CUDA compiler wheels, and "
                f"{', '.join(missing)} cannot be found; install them with: {pip_extra('test')}")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    cmd = [sys.executable, "-m", "numba_flash.tools.compile_check", *args.rest]
    return subprocess.call(cmd, env=env)


def _pictures(args):
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise MissingExtra(f"pictures needs matplotlib ({exc}); install it with: "
                           f"{pip_extra('pictures')}") from exc
    from numba_flash.tools import pictures

    for path in pictures.draw_all(args.out):
        print(path)
    return 0


def _profile(args):
    from numba_flash.tools import memory_profile

    return memory_profile.main(args.rest)


def main(argv=None):
    """Run the command line; return the exit status (errors: one line on stderr, status 1)."""
    try:
        try:
            status = _main(argv)
        except SystemExit:  # argparse's --help (or its usage error): flush its text here too
            sys.stdout.flush()
            raise
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return status
    except KeyboardInterrupt:
        print("numba-flash: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (numba-flash warmup --list | head -1): the
        # output was wanted only so far, so this is no error; stdout goes to /dev/null so that
        # the interpreter's last flush at exit does not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except MissingExtra as exc:
        print(f"numba-flash: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # one line, not a traceback (NUMBA_FLASH_DEBUG=1 shows it)
        if os.environ.get("NUMBA_FLASH_DEBUG"):
            raise
        print(f"numba-flash: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def _main(argv):
    from numba_flash import __version__

    parser = argparse.ArgumentParser(prog="numba-flash", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"numba-flash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run each kernel on a small problem and check it against "
                                    "the float64 reference; exits 1 on any FAIL")
    p.add_argument("--ops", default="all",
                   help=f"comma-separated subset of: {', '.join(DEMO_OPS)} (default: all)")
    p.add_argument("--size", default=None, choices=["tiny", "small", "gpu"],
                   help="problem size: tiny (default in the simulator, seconds per op), small, "
                        "gpu (default on a GPU)")
    p.add_argument("--dtype", default="float32", choices=DEMO_DTYPES,
                   help="input dtype (float16 and bfloat16 compute in float32, float64 in "
                        "float64; the mma and bfloat16 rows keep their own dtype)")
    p.add_argument("--seed", type=_nonnegative_int, default=0,
                   help="seed of the random inputs (an integer >= 0)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("info", help="print the backend and library versions")
    p.set_defaults(func=_info)

    p = sub.add_parser("warmup", help="compile the common kernel configurations ahead (float16 "
                                      "and float32 of every public op) into the on-disk cache, "
                                      "so later processes start in seconds (GPU only)")
    p.add_argument("-k", default=None, metavar="TEXT",
                   help="only configurations whose name contains TEXT")
    p.add_argument("--all", action="store_true",
                   help="also float64 and the teaching kernels (naive_forward, philox_check)")
    p.add_argument("--list", action="store_true", help="list the configurations, compile nothing")
    p.set_defaults(func=_warmup)

    p = sub.add_parser("compile-check", help="build every kernel configuration to PTX for "
                                             "sm_80/sm_90 and check it with ptxas")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="passed to numba_flash.tools.compile_check (-k TEXT, -j N, --json, "
                        "--markdown, --cc)")
    p.set_defaults(func=_compile_check)

    p = sub.add_parser("pictures", help="draw the docs' figures as PNG (needs matplotlib)")
    p.add_argument("--out", default="docs/img", help="output folder (default docs/img)")
    p.set_defaults(func=_pictures)

    p = sub.add_parser("profile", help="run one call of an op (mma, wgmma, backward, decode, "
                                       "forward, teach, demo:NAME) in the simulator with every "
                                       "memory access recorded and print per kernel site the "
                                       "sectors, lines, wavefronts and bank-conflict ways of a "
                                       "warp's request (--goal-builds: docs/resources.md's "
                                       "tables)",
                       add_help=False)   # -h goes to the module's own parser
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="passed to numba_flash.tools.memory_profile (OP, --head-dim, --seqlen, "
                        "--tiles gpu, --lines, --markdown, --goal-builds; -h there lists them)")
    p.set_defaults(func=_profile)

    args, extra = parser.parse_known_args(argv)
    if args.command in ("compile-check", "profile"):  # their options belong to their modules
        args.rest = extra + args.rest
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "size", "unset") is None:
        import numba_flash

        args.size = "gpu" if numba_flash.backend() == "cuda" else "tiny"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
