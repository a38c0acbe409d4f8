"""How the docs' example scripts print an error, so a generated block reads the same on every
machine.

An error at float64 rounding level (a few 1e-16) is noise: its digits depend on the CPU's SIMD
``exp``, the BLAS kernel and its thread count, not on the algorithm, so a page that printed them
would change from machine to machine (``docs/snippets.py`` checks each block under a second,
"foreign" arithmetic).  Such errors print as a bound; real errors (a wrong formula, float32 or
float16 rounding measured by the simulator's scalar arithmetic) print with their digits.
"""

from __future__ import annotations

import math

#: below this an error is float64 rounding noise (a few hundred ulps of 1.0 at most)
NOISE = 1e-14


def err(x, width=0, noise=NOISE):
    """``x`` as ``'4.9e-01'``, or ``'< 1e-14'`` when it is below ``noise``; right-aligned."""
    text = f"< {noise:.0e}" if abs(x) < noise else f"{x:.1e}"
    return f"{text:>{width}s}"


def decade(x, width=0):
    """``x`` as the power of ten above it (``6.3e-08`` -> ``'< 1e-07'``): for float32 errors of
    NumPy's vectorised ``exp``, whose last digits depend on the CPU."""
    if x == 0:
        return f"{'0':>{width}s}"
    text = f"< 1e{math.floor(math.log10(abs(x))) + 1:03d}"
    return f"{text:>{width}s}"
