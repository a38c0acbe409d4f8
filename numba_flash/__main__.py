"""Command line: ``python -m numba_flash`` (also installed as ``numba-flash``).

  demo          run every kernel on a small problem, check it against the float64 reference
  info          the backend and library versions
  compile-check build every kernel configuration to PTX and assemble it (no GPU needed)
  pictures      draw the tile map, block table and split-KV figures (needs matplotlib)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def _demo(args):
    from numba_flash import demo

    ops = list(demo.CASES) if args.ops == "all" else args.ops.split(",")
    unknown = [o for o in ops if o not in demo.CASES]
    if unknown:
        print(f"--ops: unknown operation(s) {unknown}; choose from {list(demo.CASES)}",
              file=sys.stderr)
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
    return 0


def _compile_check(args):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    cmd = [sys.executable, "-m", "numba_flash.compile_check", *args.rest]
    return subprocess.call(cmd, env=env)


def _pictures(args):
    from numba_flash import pictures

    for path in pictures.draw_all(args.out):
        print(path)
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="numba-flash", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="run each kernel on a small problem and check it against "
                                    "the float64 reference; exits 1 on any FAIL")
    p.add_argument("--ops", default="all",
                   help="comma-separated subset of: softmax, forward, causal, backward, dropout, "
                        "decode, paged (default: all)")
    p.add_argument("--size", default=None, choices=["tiny", "small", "gpu"],
                   help="problem size: tiny (default in the simulator, seconds per op), small, "
                        "gpu (default on a GPU)")
    p.add_argument("--dtype", default="float32", choices=["float16", "float32", "float64"],
                   help="input dtype (float16 computes in float32; float64 in float64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.set_defaults(func=_demo)

    p = sub.add_parser("info", help="print the backend and library versions")
    p.set_defaults(func=_info)

    p = sub.add_parser("compile-check", help="build every kernel configuration to PTX for "
                                             "sm_80/sm_90 and check it with ptxas")
    p.add_argument("rest", nargs=argparse.REMAINDER,
                   help="passed to numba_flash.compile_check (-k TEXT, -j N, --json, --markdown, "
                        "--cc)")
    p.set_defaults(func=_compile_check)

    p = sub.add_parser("pictures", help="draw the docs' figures as PNG (needs matplotlib)")
    p.add_argument("--out", default="docs/img", help="output folder (default docs/img)")
    p.set_defaults(func=_pictures)

    args, extra = parser.parse_known_args(argv)
    if args.command == "compile-check":  # its options belong to numba_flash.compile_check
        args.rest = extra + args.rest
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "size", "unset") is None:
        import numba_flash

        args.size = "gpu" if numba_flash.backend() == "cuda" else "tiny"
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
