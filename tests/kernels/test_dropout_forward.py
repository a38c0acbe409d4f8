"""Kernel tier: ``numba_flash.forward(..., dropout_p, seed)`` against the float64 reference fed
the exact keep-mask :func:`numba_flash.dropout_mask` rebuilds on the host.

The kernel draws the mask tile by tile from Philox4x32-10 (global ``(b, h, i, j)`` counters), so
the whole output, not just its statistics, must match ``reference.attention(q, k, v,
dropout_mask=dropout_mask(seed, B, H, Nq, Nk, p), dropout_p=p)``.  Each Philox call costs ~1 ms
in the simulator: shapes stay tiny.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.kernels.forward import config as fconfig
from numba_flash.tools.catalog import forward as catalog_forward
from numba_flash.ops import forward as forward_op
from helpers import randn

# Tolerances on |o - o_ref| * (1 - p): the kept probabilities are scaled by 1 / (1 - p), so the
# output (and its rounding error) grows like 1 / (1 - p).  Measured in the simulator over 25
# random problems per dtype (12 for float16; B = 1, H in 1..2, Nq, Nk, d in 1..29, causal on/off,
# p in {0.1, 0.37, 0.5, 0.8}): float16 6.6e-4, float32 6.0e-7, float64 1.0e-15.
O_TOL = {np.float16: 3e-3, np.float32: 2.5e-6, np.float64: 4e-15}
# lse relative to max(1, |lse|), same runs: float16 1.4e-7, float32 2.0e-7, float64 3.3e-16
# (dropout does not touch lse; these are the plain forward's figures).
LSE_TOL = {np.float16: 6e-7, np.float32: 8e-7, np.float64: 1.5e-15}


def make_qkv(rng, b, h, hkv, nq, nk, d, dtype):
    return (randn(rng, (b, h, nq, d), dtype), randn(rng, (b, hkv, nk, d), dtype),
            randn(rng, (b, hkv, nk, d), dtype))


def check(q, k, v, causal, p, seed, o, lse):
    """``(o, lse)`` against the reference with the host-drawn mask of ``(seed, p)``."""
    dtype = q.dtype.type
    bsz, h, nq, _ = q.shape
    mask = numba_flash.dropout_mask(seed, bsz, h, nq, k.shape[2], p)
    want_o, want_lse = ref.attention(q, k, v, causal=causal, dropout_mask=mask, dropout_p=p)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == (np.float64 if dtype is np.float64 else np.float32)
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "NaN in output"
    bound = O_TOL[dtype] / (1.0 - p)
    err = np.abs(o.astype(np.float64) - want_o).max()
    assert err <= bound, f"o: max abs error {err:.3e} > {bound:.1e}"
    # the comparison can fail: dropout moves o far beyond the bound (scale 1 / (1 - p) != 1)
    plain_o = ref.attention(q, k, v, causal=causal)[0]
    assert np.abs(plain_o - want_o).max() > 10 * bound, "dropout changes nothing here"
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    if fin.any():
        rel = np.abs(lse[fin] - want_lse[fin]) / np.maximum(1.0, np.abs(want_lse[fin]))
        assert rel.max() <= LSE_TOL[dtype], f"lse: max rel error {rel.max():.3e}"


# (B, H, Hkv, Nq, Nk, d, dropout_p, seed): ragged tiles, GQA / MQA, Nq > Nk (causal rows with no
# visible key), a seed whose high word matters
SHAPES = [
    (2, 2, 1, 13, 21, 5, 0.37, 2024),                  # MQA, Nq < Nk, ragged both ways
    (1, 4, 2, 21, 9, 17, 0.5, 2**64 - 12345),          # GQA, Nq > Nk, seed_hi = 0xFFFFFFFF
    (1, 1, 1, 1, 1, 1, 0.2, 7),                        # one query, one key
    (1, 3, 1, 7, 30, 3, 0.8, 2**40 + 3),               # MQA, one Q tile, many K tiles
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])))
def test_dropout_forward_matches_reference_float32(rng, shape, causal):
    *dims, p, seed = shape
    q, k, v = make_qkv(rng, *dims, np.float32)
    o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True, dropout_p=p, seed=seed)
    check(q, k, v, causal, p, seed, o, lse)


@pytest.mark.parametrize("dtype, causal", [(np.float64, False), (np.float64, True),
                                           (np.float16, True)])
def test_dropout_forward_other_dtypes(rng, dtype, causal):
    q, k, v = make_qkv(rng, 1, 2, 1, 19, 11, 9, dtype)
    o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True, dropout_p=0.3,
                                 seed=99)
    check(q, k, v, causal, 0.3, 99, o, lse)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dropout_mask_does_not_depend_on_tiles(rng, causal):
    """Every explicit tile shape draws the same mask (global, not tile-local, indices)."""
    q, k, v = make_qkv(rng, 1, 2, 1, 19, 23, 6, np.float32)
    for block_m, block_n in fconfig.explicit_tiles(6, np.float32):
        o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True, dropout_p=0.6,
                                     seed=31337, block_m=block_m, block_n=block_n)
        check(q, k, v, causal, 0.6, 31337, o, lse)


def test_dropout_leaves_lse_alone(rng):
    """m_i and l_i come from the undropped P: lse is bit for bit that of the plain kernel."""
    q, k, v = make_qkv(rng, 1, 2, 1, 17, 14, 8, np.float32)
    o0, lse0 = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    o1, lse1 = numba_flash.forward(q, k, v, causal=True, return_lse=True, dropout_p=0.5, seed=3)
    assert lse1.tobytes() == lse0.tobytes()
    assert not np.array_equal(o1, o0)


def test_dropout_p_zero_is_the_plain_kernel(rng):
    """dropout_p = 0 (any seed) is bitwise the no-dropout call and builds no dropout kernel."""
    q, k, v = make_qkv(rng, 1, 2, 1, 11, 13, 7, np.float32)
    o0, lse0 = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    built = []
    real = forward_op.forward_kernel

    def spy(cfg):
        built.append(cfg)
        return real(cfg)

    try:
        forward_op.forward_kernel = spy
        o1, lse1 = numba_flash.forward(q, k, v, causal=True, return_lse=True, dropout_p=0.0,
                                       seed=2**63 + 5)
    finally:
        forward_op.forward_kernel = real
    assert o1.tobytes() == o0.tobytes() and lse1.tobytes() == lse0.tobytes()
    assert len(built) == 1 and built[0].DROPOUT is False  # the plain specialisation


def test_dropout_is_deterministic_per_seed(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 9, 12, 5, np.float32)
    run = lambda seed: numba_flash.forward(q, k, v, dropout_p=0.4, seed=seed)  # noqa: E731
    o1, o2 = run(11), run(11)
    assert o1.tobytes() == o2.tobytes()
    # another seed, and one differing only in its high 32 bits, give other masks and outputs
    for other in (12, 11 + 2**32):
        assert not np.array_equal(run(other), o1), other


_Q = np.zeros((1, 1, 2, 4), np.float32)


@pytest.mark.parametrize("kwargs, exc, msg", [
    ({"dropout_p": float("nan")}, ValueError, r"^dropout_p: expected a real number in \[0, 1\)"),
    ({"dropout_p": -0.1}, ValueError, r"^dropout_p: expected a real number in \[0, 1\)"),
    ({"dropout_p": 1.0}, ValueError, r"^dropout_p: expected a real number in \[0, 1\)"),
    ({"dropout_p": "0.1"}, TypeError, r"^dropout_p: expected a real number"),
    ({"dropout_p": True}, TypeError, r"^dropout_p: expected a real number"),
    ({"dropout_p": 0.1, "seed": True}, TypeError, r"^seed: expected an integer in \[0, 2\*\*64\)"),
    ({"dropout_p": 0.1, "seed": -1}, ValueError, r"^seed: expected an integer in \[0, 2\*\*64\)"),
    ({"dropout_p": 0.1, "seed": 2**64}, ValueError, r"^seed: expected an integer"),
    ({"dropout_p": 0.1, "seed": 1.0}, TypeError, r"^seed: expected an integer"),
    ({"seed": -5}, ValueError, r"^seed: expected an integer"),  # checked even when p = 0
])
def test_dropout_rejects_bad_p_and_seed(monkeypatch, kwargs, exc, msg):
    """Rejected before any kernel is built or launched."""
    def no_kernel(*args):
        raise AssertionError("a kernel was built before validation finished")

    monkeypatch.setattr(forward_op, "forward_kernel", no_kernel)
    with pytest.raises(exc, match=msg):
        numba_flash.forward(_Q, _Q, _Q, **kwargs)


# -- GPU configuration (pure functions: checked on every backend) --------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dropout_gpu_kernels_are_compiled_and_fit(dtype):
    """The GPU default tiles of every head dim have a dropout variant in the compile tier (plain,
    with score modifiers, varlen), and every GPU tile pair still fits shared memory with
    keep_tile added."""
    names = {c["name"] for c in catalog_forward.simt_configs()}
    dt = np.dtype(dtype)
    for d in fconfig.HEAD_DIMS:
        for prefix, mods in (("forward", ""), ("forward", " mods"), ("forward varlen", " mods")):
            for (bm, bn), hd2 in fconfig.explicit_tiles(d, dt, simulator=False,
                                                   mods=bool(mods)).items():
                assert fconfig.tile_problem(bm, bn, hd2, dt, dropout=True) is None
            bm, bn, hd = fconfig.gpu_tiles(d, dt, mods=bool(mods))
            tm, tn = fconfig.thread_layout(bm, bn, hd)
            assert f"{prefix} M{bm} N{bn} D{hd} T{tm}x{tn}{mods} dropout {dt.name}" in names
