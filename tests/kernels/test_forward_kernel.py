"""Kernel tier: ``numba_flash.forward`` (the tiled FlashAttention forward) against the float64
reference :func:`numba_flash.reference.attention`.

Shapes are tiny so the file runs in the simulator (default tiles 8 x 8 there): they still give
several Q and K/V tiles, ragged last tiles, diagonal-crossing causal tiles and rows that see no
key.  On a GPU the same tests run with the GPU tiles.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.kernels.forward import config as fconfig
from numba_flash.tools.catalog import forward as catalog_forward
from helpers import randn

# Tolerances: about 4x the largest error measured in the simulator over 25 random problems per
# dtype and case (B = 1, H in 1..2, Nq, Nk, d in 1..39, causal on/off; GPU runs the same
# arithmetic with other tile shapes).
# Unit-normal q, k, v: max |o - o_ref| float16 8.5e-4, float32 5.2e-7, float64 1.6e-15.
O_TOL = {np.float16: 4e-3, np.float32: 2e-6, np.float64: 6e-15}
# lse error relative to max(1, |lse|): float16 3.2e-7 (computed in float32), float32 1.5e-7,
# float64 4.4e-16.
LSE_TOL = {np.float16: 1.5e-6, np.float32: 6e-7, np.float64: 2e-15}
# Logits of order 1e3 (q, k scaled by 30): the scores carry a rounding error of order
# eps * sum |q_c k_c|, which exp turns into a relative error of P.  Measured: o float16 9.0e-4,
# float32 4.4e-5, float64 3.0e-13; relative lse float16 7.3e-6, float32 9.0e-7, float64 6.0e-15.
O_TOL_LARGE = {np.float16: 4e-3, np.float32: 2e-4, np.float64: 1.2e-12}
LSE_TOL_LARGE = {np.float16: 3e-5, np.float32: 4e-6, np.float64: 2.4e-14}


def make_qkv(rng, b, h, hkv, nq, nk, d, dtype, scale=1.0):
    q = randn(rng, (b, h, nq, d), dtype, scale)
    k = randn(rng, (b, hkv, nk, d), dtype, scale)
    v = randn(rng, (b, hkv, nk, d), dtype)
    return q, k, v


def check(q, k, v, causal, o, lse, o_tol=None, lse_tol=None, softmax_scale=None):
    dtype = q.dtype.type
    want_o, want_lse = ref.attention(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert o.dtype == q.dtype and o.shape == q.shape
    assert lse.dtype == (np.float64 if dtype is np.float64 else np.float32)
    assert lse.shape == q.shape[:3]
    assert not np.isnan(o).any() and not np.isnan(lse).any(), "NaN in output"
    err = np.abs(o.astype(np.float64) - want_o).max()
    bound = (o_tol or O_TOL)[dtype]
    assert err <= bound, f"o: max abs error {err:.3e} > {bound:.1e}"
    # rows that see no key: lse = -inf exactly (and o = 0, checked above); others finite
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    if fin.any():
        rel = np.abs(lse[fin] - want_lse[fin]) / np.maximum(1.0, np.abs(want_lse[fin]))
        bound = (lse_tol or LSE_TOL)[dtype]
        assert rel.max() <= bound, f"lse: max relative error {rel.max():.3e} > {bound:.1e}"


# (B, H, Hkv, Nq, Nk, d): Nq < Nk, Nq = Nk, Nq > Nk, GQA, MQA, ragged tiles, odd head dims
SHAPES = [
    (1, 2, 2, 16, 16, 16),   # whole tiles, Nq = Nk
    (2, 2, 1, 13, 21, 5),    # MQA, Nq < Nk, ragged
    (1, 4, 2, 21, 9, 17),    # GQA, Nq > Nk: causal rows with no visible key
    (1, 1, 1, 1, 1, 1),      # one query, one key, d = 1
    (1, 3, 1, 7, 30, 3),     # MQA, one Q tile (ragged), many K tiles
    (1, 1, 1, 19, 3, 33),    # Nk < one tile, d = 33 (pads to 64)
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_matches_reference_float32(rng, shape, causal):
    q, k, v = make_qkv(rng, *shape, np.float32)
    o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True)
    check(q, k, v, causal, o, lse)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_other_dtypes(rng, dtype, causal):
    q, k, v = make_qkv(rng, 1, 2, 1, 19, 11, 9, dtype)
    o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True)
    check(q, k, v, causal, o, lse)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_forward_large_logits(rng, dtype):
    """Scores of order 1e3: exp overflows without the running max."""
    q, k, v = make_qkv(rng, 1, 2, 1, 12, 20, 16, dtype, scale=30.0)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    assert np.abs(ref.attention(q, k, v)[1]).max() > 200  # the test really has huge logits
    check(q, k, v, True, o, lse, o_tol=O_TOL_LARGE, lse_tol=LSE_TOL_LARGE)


def test_forward_softmax_scale(rng):
    q, k, v = make_qkv(rng, 1, 1, 1, 10, 12, 8, np.float32)
    o, lse = numba_flash.forward(q, k, v, softmax_scale=0.7, return_lse=True)
    check(q, k, v, False, o, lse, softmax_scale=0.7)


def test_forward_rows_without_visible_key(rng):
    """Causal with Nq > Nk: the first Nq - Nk rows see nothing: o = 0 and lse = -inf exactly."""
    q, k, v = make_qkv(rng, 1, 1, 1, 20, 6, 4, np.float32)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    assert np.all(o[:, :, :14] == 0) and np.all(np.isneginf(lse[:, :, :14]))
    check(q, k, v, True, o, lse)


def test_forward_causal_skips_tiles_after_the_diagonal(rng):
    """NaN keys/values after Q tile 0's last K/V tile never reach Q tile 0: those tiles are
    not loaded (a masked-but-loaded NaN value would give 0 * NaN = NaN)."""
    d = 8
    block_m, block_n, _ = fconfig.default_tiles(d, np.float32)
    first_skipped = -(-block_m // block_n) * block_n  # first tile starting after row block_m-1
    n = max(32, 2 * first_skipped)
    q, k, v = make_qkv(rng, 1, 1, 1, n, n, d, np.float32)
    want_o, want_lse = ref.attention(q, k, v, causal=True)
    k[:, :, first_skipped:] = np.nan
    v[:, :, first_skipped:] = np.nan
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    rows = slice(0, block_m)
    assert np.abs(o[:, :, rows] - want_o[:, :, rows]).max() <= O_TOL[np.float32]
    # |lse| < 4 here
    assert np.abs(lse[:, :, rows] - want_lse[:, :, rows]).max() <= LSE_TOL[np.float32] * 4


def test_forward_non_contiguous_inputs_and_not_modified(rng):
    base_q = randn(rng, (1, 4, 22, 2 * 12), np.float32)
    base_kv = randn(rng, (1, 2, 2 * 15, 12, 2), np.float32)
    q = base_q[:, ::2, :, ::2]                 # [1, 2, 22, 12], strided heads and columns
    k = base_kv[:, :1, ::2, :, 0]              # [1, 1, 15, 12]
    v = base_kv[:, 1:, 1::2, :, 1]
    before = (base_q.copy(), base_kv.copy())
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    check(q, k, v, True, o, lse)
    np.testing.assert_array_equal(base_q, before[0])
    np.testing.assert_array_equal(base_kv, before[1])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_forward_explicit_tiles(rng, causal):
    """Every explicit tile shape on offer, with ragged last tiles in both directions."""
    d = 6
    pairs = fconfig.explicit_tiles(d, np.float32)
    q, k, v = make_qkv(rng, 1, 2, 1, 25, 19, d, np.float32)
    for block_m, block_n in pairs:
        o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True, block_m=block_m,
                                     block_n=block_n)
        check(q, k, v, causal, o, lse)
    # one of the two alone picks the first pair that has it
    bm, bn = list(pairs)[-1]
    o = numba_flash.forward(q, k, v, causal=causal, block_m=bm)
    assert o.shape == q.shape


def test_forward_returns_o_alone_by_default(rng):
    q, k, v = make_qkv(rng, 1, 1, 1, 5, 5, 4, np.float32)
    o = numba_flash.forward(q, k, v)
    assert isinstance(o, np.ndarray) and o.shape == q.shape


def test_forward_deterministic(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 17, 23, 7, np.float32)
    o1, lse1 = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    o2, lse2 = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    assert o1.tobytes() == o2.tobytes() and lse1.tobytes() == lse2.tobytes()


def _qkv32(h=2, hkv=1, nq=4, nk=5, d=8):
    z = np.zeros
    return (z((1, h, nq, d), np.float32), z((1, hkv, nk, d), np.float32),
            z((1, hkv, nk, d), np.float32))


@pytest.mark.parametrize("change, exc, msg", [
    (lambda q, k, v: ([1.0], k, v), TypeError, r"^q: expected a numpy.ndarray"),
    (lambda q, k, v: (q.astype(np.int32), k, v), TypeError, r"^q: expected dtype in"),
    (lambda q, k, v: (q, k.astype(np.float64), v), TypeError, r"^k: expected dtype float32"),
    (lambda q, k, v: (q[0], k, v), ValueError, r"^q: expected a 4-D array"),
    (lambda q, k, v: (q, k, v[:, :, :3]), ValueError, r"^v: expected shape \(.*'d_v'\)"),
    (lambda q, k, v: (q, k[..., :4], v[..., :4]), ValueError, r"^k: expected head dim 8"),
    (lambda q, k, v: (q[:, :0], k, v), ValueError, r"^q: expected no empty dimension"),
    (lambda q, k, v: (np.zeros((1, 3, 4, 8), np.float32), np.zeros((1, 2, 5, 8), np.float32),
                      np.zeros((1, 2, 5, 8), np.float32)), ValueError,
     r"^k: expected a number of kv heads"),
    (lambda q, k, v: (np.zeros((1, 1, 2, 300), np.float32), np.zeros((1, 1, 2, 300), np.float32),
                      np.zeros((1, 1, 2, 300), np.float32)), ValueError,
     r"^q: expected head dim 1..256"),
])
def test_forward_rejects_bad_arrays(change, exc, msg):
    q, k, v = change(*_qkv32())
    with pytest.raises(exc, match=msg):
        numba_flash.forward(q, k, v)


@pytest.mark.parametrize("kwargs, exc, msg", [
    ({"causal": 1}, TypeError, r"^causal: expected a bool"),
    ({"return_lse": "yes"}, TypeError, r"^return_lse: expected a bool"),
    ({"softmax_scale": -1.0}, ValueError, r"^softmax_scale: expected a finite number > 0"),
    ({"softmax_scale": "1"}, TypeError, r"^softmax_scale: expected a real number"),
    ({"block_m": 7}, ValueError, r"^block_m: expected one of"),
    ({"block_n": 12}, ValueError, r"^block_n: expected one of"),
    ({"block_m": 16.0}, TypeError, r"^block_m: expected an int"),
])
def test_forward_rejects_bad_options(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        numba_flash.forward(*_qkv32(), **kwargs)


def test_forward_rejects_a_tile_pair_not_on_offer():
    pairs = fconfig.explicit_tiles(8, np.float32)
    ms = {bm for bm, _ in pairs}
    ns = {bn for _, bn in pairs}
    bad = [(m, n) for m in ms for n in ns if (m, n) not in pairs]
    if not bad:
        pytest.skip("every combination is on offer on this backend")
    with pytest.raises(ValueError, match=r"^block_[mn]: expected \(block_m, block_n\) in"):
        numba_flash.forward(*_qkv32(), block_m=bad[0][0], block_n=bad[0][1])


# -- GPU tile choice (pure functions: checked on every backend) ---------------------------------
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_gpu_tiles_are_compiled_and_fit(dtype):
    """Every head dim 1..256 maps to GPU tiles that compile_configs lists (plain, with score
    modifiers, varlen; causal and windows are run-time arguments of each), and
    every tile a GPU caller can ask for (defaults and explicit) fits shared memory and registers."""
    names = {c["name"] for c in catalog_forward.simt_configs()}
    dt = np.dtype(dtype)
    for d in range(1, 257):
        for prefix, mods in (("forward", ""), ("forward", " mods"), ("forward varlen", " mods")):
            pairs = dict(fconfig.explicit_tiles(d, dt, simulator=False, mods=bool(mods)))
            bm, bn, hd = fconfig.gpu_tiles(d, dt, mods=bool(mods))
            assert pairs[(bm, bn)] == hd
            for (bm, bn), hd in pairs.items():
                assert hd >= d
                assert fconfig.tile_problem(bm, bn, hd, dt) is None
                tm, tn = fconfig.thread_layout(bm, bn, hd)
                assert f"{prefix} M{bm} N{bn} D{hd} T{tm}x{tn}{mods} {dt.name}" in names


@pytest.mark.parametrize("dtype, d", [(np.float32, 12), (np.float64, 16)])
def test_cp_async_copies_equal_elementwise_copies(rng, monkeypatch, dtype, d):
    """The VEC build (16-byte cp.async tile copies; d a multiple of the chunk, zero-filled up to
    HEAD_DIM) computes bit for bit what the element-wise build does, ragged tiles and padded
    head dim included; float16 takes the element-wise build."""
    from numba_flash.ops import forward as forward_op
    q, k, v = make_qkv(rng, 1, 2, 1, 11, 13, d, dtype)
    built = []
    real = forward_op.forward_kernel

    def spy(cfg):
        built.append(cfg.VEC)
        return real(cfg)

    monkeypatch.setattr(forward_op, "forward_kernel", spy)
    o1, lse1 = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    monkeypatch.setattr(forward_op, "vector_tiles", lambda *a: False)
    o2, lse2 = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    assert built == [True, False]
    assert o1.tobytes() == o2.tobytes() and lse1.tobytes() == lse2.tobytes()
    assert not fconfig.vector_tiles(np.float16, 16, 16) and not fconfig.vector_tiles(dtype, 7, 16)
