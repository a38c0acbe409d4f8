"""Check of docs/exercises/naive_traffic.py: the formula against the bytes the naive kernel
really moves, counted element by element in the simulator (docs/examples/io_count.py), for MHA
and GQA, float32 and float16, causal with Nq < Nk and Nq > Nk."""

from __future__ import annotations

import numpy as np
import pytest

CASES = [  # (b, h, hkv, nq, nk, d, dtype, causal)
    (1, 2, 2, 5, 7, 3, np.float32, False),
    (2, 4, 1, 3, 6, 4, np.float16, False),
    (1, 2, 1, 6, 9, 5, np.float32, True),
    (1, 1, 1, 7, 3, 2, np.float32, True),
]


@pytest.mark.parametrize("case", CASES)
def test_naive_traffic(exercise, case):
    check(exercise("naive_traffic"), [case])


def check(mod, cases=CASES):
    from io_count import count_global_bytes

    from numba_flash.teach.ops.naive_forward import naive_forward

    rng = np.random.default_rng(5)
    for b, h, hkv, nq, nk, d, dtype, causal in cases:
        q = rng.standard_normal((b, h, nq, d)).astype(dtype)
        k, v = (rng.standard_normal((b, hkv, nk, d)).astype(dtype) for _ in range(2))
        _, (rec,) = count_global_bytes(lambda: naive_forward(q, k, v, causal=causal))
        got = mod.naive_bytes(b, h, hkv, nq, nk, d, np.dtype(dtype).itemsize, 4, causal)
        shape = (f"B={b} H={h} Hkv={hkv} Nq={nq} Nk={nk} d={d} {np.dtype(dtype).name} "
                 f"causal={causal}")
        assert got["read"] == rec.read, f"{shape}: predicted {got['read']} bytes read, {rec.read}"
        assert got["written"] == rec.written, (
            f"{shape}: predicted {got['written']} bytes written, measured {rec.written}")
