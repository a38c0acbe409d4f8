"""Kernel tier: the Philox device functions against their NumPy twin, bit for bit.

The check kernels of :mod:`numba_flash.tools.philox_check` call ``philox4x32_10_device``,
``philox_keep`` and ``philox_keep_bits4`` exactly as the attention kernels do; in the simulator
and on a GPU their outputs must equal :func:`numba_flash.philox.philox4x32_10` and
:func:`numba_flash.dropout_mask` exactly.  The last test (compile tier) reads the PTX.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from numba import cuda

import numba_flash
from numba_flash.kernels.core.common import cdiv
from numba_flash.tools.philox_check import default_threads, keep_fill_kernel, philox_fill_kernel
from numba_flash.philox import dropout_params, philox4x32_10

SENTINEL = 0xDEADBEEF  # written before launch: an element the kernel forgot stays visible


def run_fill(counter, key):
    n = counter.shape[0]
    threads = default_threads()
    out = cuda.to_device(np.full((n, 4), SENTINEL, np.uint32))
    philox_fill_kernel(threads)[(cdiv(n, threads),), (threads,)](
        cuda.to_device(np.ascontiguousarray(counter, np.uint32)),
        cuda.to_device(np.ascontiguousarray(key, np.uint32)), out)
    return out.copy_to_host()


def run_keep(seed, B, H, Nq, Nk, p, bits4):
    seed_lo, seed_hi, threshold, _scale = dropout_params(p, seed)
    threads = default_threads()
    keep = cuda.to_device(np.full((B, H, Nq, Nk), -7, np.int32))
    keep_fill_kernel(threads, bits4)[(cdiv(cdiv(Nk, 4), threads), Nq, B * H), (threads,)](
        keep, seed_lo, seed_hi, threshold)
    out = keep.copy_to_host()
    assert set(np.unique(out)) <= {0, 1}, "unwritten or out-of-range keep value"
    return out.astype(bool)


def test_device_known_answers():
    # Random123 kat_vectors, philox4x32 10 (see tests/reference/test_philox.py for the source)
    counter = np.array([[0, 0, 0, 0], [0xFFFFFFFF] * 4,
                        [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]], np.uint32)
    key = np.array([[0, 0], [0xFFFFFFFF] * 2, [0xA4093822, 0x299F31D0]], np.uint32)
    want = np.array([[0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8],
                     [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD],
                     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]], np.uint32)
    np.testing.assert_array_equal(run_fill(counter, key), want)


def test_device_equals_twin_on_many_counters(rng):
    n = 1024
    counter = rng.integers(0, 2**32, (n, 4), dtype=np.uint32)
    key = rng.integers(0, 2**32, (n, 2), dtype=np.uint32)
    # words with the high bit set, all ones, and single-word extremes (carries, 64-bit products)
    counter[:16] = 0xFFFFFFFF
    key[:8] = 0xFFFFFFFF
    for w in range(4):
        counter[16 + w] = 0
        counter[16 + w, w] = 0xFFFFFFFF
        counter[20 + w] = 0x80000000
    key[24:28] = [[0xFFFFFFFF, 0], [0, 0xFFFFFFFF], [0x80000000, 0x80000000], [1, 0xFFFFFFFE]]
    got = run_fill(counter, key)
    want = philox4x32_10(counter, key)
    bad = np.flatnonzero((got != want).any(axis=1))
    assert bad.size == 0, (f"{bad.size} rows differ, first {bad[:5]}: "
                           f"{got[bad[:1]]} != {want[bad[:1]]}")


@pytest.mark.parametrize("bits4", [True, False])
@pytest.mark.parametrize("seed, p, shape", [
    (0, 0.5, (1, 1, 3, 8)),
    (0xDEADBEEFCAFEF00D, 0.3, (2, 3, 5, 13)),   # both key words non-zero, Nk % 4 != 0
    (2**64 - 1, 0.9, (1, 2, 4, 7)),
    (12345, 0.0, (1, 1, 2, 5)),                  # p = 0 keeps everything
])
def test_device_keep_equals_dropout_mask(seed, p, shape, bits4):
    got = run_keep(seed, *shape, p, bits4)
    want = numba_flash.dropout_mask(seed, *shape, p)
    np.testing.assert_array_equal(got, want)
    if p == 0.0:
        assert got.all()
    else:
        assert 0 < got.mean() < 1  # both outcomes occur: the comparison is not vacuous


@pytest.mark.compile
def test_ptx_uses_32x32_products_and_no_float64():
    """Compile tier: every Philox product is ``mul.wide.u32`` (or a 32-bit ``mul.lo``/``mul.hi``),
    never a 64x64 multiply, and no float64 instruction appears (checked for sm_80 and sm_90)."""
    script = textwrap.dedent("""
        import re
        from numba import cuda, types
        from numba_flash.tools.compile_check import _device_functions_for, f64_lines
        from numba_flash.tools import philox_check
        consts = "3528531795|3449720151|-766435501|-845247145"  # M0, M1 as u64 / s32 immediates
        for cfg in philox_check.compile_configs():
            for cc in ((8, 0), (9, 0)):
                with _device_functions_for(cc):
                    ptx, _ = cuda.compile_ptx(cfg["kernel"].py_func,
                                              types.void(*cfg["args"]), cc=cc)
                muls = re.findall(r"^\\s*(mul[a-z0-9.]*)\\s[^;]*(?:" + consts + r")\\b", ptx, re.M)
                print(cfg["name"], cc, muls.count("mul.wide.u32"),
                      sum(m.endswith(("64", "s64")) for m in muls), len(f64_lines(ptx)))
    """)
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.rsplit(None, 3) for line in proc.stdout.strip().splitlines()]
    assert len(rows) == 6, proc.stdout
    for name, wide, wide64, f64 in rows:
        assert int(f64) == 0, name
        # 20 products per Philox call (2 per round); in keep_fill the first round's two inputs
        # are 64-bit loop indices that NVVM multiplies as (x & 0xFFFFFFFF) * M: at most 2 per call
        wide, wide64 = int(wide), int(wide64)
        assert wide >= 18 and wide + wide64 >= 20 and wide64 <= 2, (name, wide, wide64)
