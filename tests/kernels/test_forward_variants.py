"""Kernel tier: the attention variants of ``numba_flash.forward`` (sliding window, softcap, ALiBi,
their mixes with causal, GQA and dropout), its non-finite semantics, argument errors, the
``kernel=`` choice and the grid for ``B * H > 65535``, against the float64 reference
:func:`numba_flash.reference.attention`.

Shapes are tiny (simulator tiles 8 x 8): they still give several Q and K/V tiles, tiles wholly
outside the band (skipped), tiles crossing its edges (masked), tiles inside it (unmasked) and
rows that see no key.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.kernels.forward import config as fconfig
from numba_flash.kernels.forward import simt as fk
from numba_flash.ops import forward as forward_op
from helpers import randn

# Tolerances: about 4x the largest error measured in the simulator over 40 random problems per
# dtype (B in 1..2, H in 1..4 with GQA/MQA, Nq, Nk in 1..30, d in 1..20, random windows, causal,
# softcap in 0.5..5 or off, ALiBi [H] / [B, H] or none; /tmp script, 2026-11-30):
# max |o - o_ref| float16 8.5e-4, float32 4.7e-7, float64 1.1e-15;
# lse relative to max(1, |lse|): float16 2.0e-7, float32 1.7e-7, float64 6.3e-16.
O_TOL = {np.float16: 4e-3, np.float32: 2e-6, np.float64: 5e-15}
LSE_TOL = {np.float16: 8e-7, np.float32: 8e-7, np.float64: 2.5e-15}


def make_qkv(rng, b, h, hkv, nq, nk, d, dtype):
    return (randn(rng, (b, h, nq, d), dtype), randn(rng, (b, hkv, nk, d), dtype),
            randn(rng, (b, hkv, nk, d), dtype))


def compare(o, lse, want_o, want_lse, dtype):
    """Same non-finite pattern as the reference, finite values within the measured bounds."""
    dtype = np.dtype(dtype).type
    o64 = o.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse), err_msg="lse NaN pattern")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse),
                                  err_msg="lse -inf pattern (rows that see no key)")
    np.testing.assert_array_equal(np.isfinite(o64), np.isfinite(want_o),
                                  err_msg="o non-finite pattern")
    fin = np.isfinite(want_o)
    if fin.any():
        err = np.abs(o64[fin] - want_o[fin]).max()
        assert err <= O_TOL[dtype], f"o: max abs error {err:.3e} > {O_TOL[dtype]:.1e}"
    fin = np.isfinite(want_lse)
    if fin.any():
        rel = (np.abs(lse[fin] - want_lse[fin]) / np.maximum(1.0, np.abs(want_lse[fin]))).max()
        assert rel <= LSE_TOL[dtype], f"lse: max relative error {rel:.3e}"
    return o64


def run(q, k, v, **kw):
    """The kernel and the reference on the same arguments."""
    o, lse = numba_flash.forward(q, k, v, return_lse=True, **kw)
    ref_kw = {key: val for key, val in kw.items() if key not in ("block_m", "block_n")}
    want_o, want_lse = ref.attention(q, k, v, **ref_kw)
    assert o.dtype == q.dtype and o.shape == q.shape and lse.shape == q.shape[:3]
    return o, lse, want_o, want_lse


# (B, H, Hkv, Nq, Nk, d), variant keywords: every mix of causal, window, softcap and ALiBi
# ([H] and [B, H]) over GQA / MQA shapes with Nq <, =, > Nk
SLOPES_H4 = ref.alibi_slopes(4)
CASES = [
    ((1, 2, 1, 30, 30, 8), dict(window_size=(5, 3))),                       # band: 3 kinds of tile
    ((1, 2, 2, 20, 29, 5), dict(window_size=(4, 0))),                       # Mistral-style, Nq < Nk
    ((1, 2, 1, 29, 13, 6), dict(causal=True, window_size=(6, -1))),         # Nq > Nk: empty rows
    ((1, 1, 1, 17, 30, 4), dict(window_size=(-1, 2))),                      # right side only
    ((1, 1, 1, 19, 19, 3), dict(window_size=(0, 0))),                       # the diagonal alone
    ((2, 2, 1, 13, 21, 7), dict(softcap=1.5)),                              # softcap, MQA
    ((1, 2, 2, 16, 16, 8), dict(softcap=0.75, causal=True)),
    ((1, 4, 2, 15, 22, 6), dict(alibi_slopes=SLOPES_H4)),                   # ALiBi [H], GQA
    ((2, 4, 1, 11, 9, 5), dict(alibi_slopes=np.arange(1, 9, dtype=np.float32).reshape(2, 4) / 8,
                               causal=True)),                               # ALiBi [B, H]
    ((1, 4, 2, 23, 27, 9), dict(alibi_slopes=SLOPES_H4, softcap=2.0, window_size=(7, 2))),
    ((1, 2, 1, 9, 25, 16), dict(softcap=3.0, window_size=(3, 12), softmax_scale=0.4)),
]


@pytest.mark.parametrize("shape, kw", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_variants_match_reference_float32(rng, shape, kw):
    q, k, v = make_qkv(rng, *shape, np.float32)
    compare(*run(q, k, v, **kw), np.float32)


@pytest.mark.parametrize("dtype, kw", [
    (np.float16, dict(window_size=(3, 1), softcap=2.0, alibi_slopes=SLOPES_H4[:2])),
    (np.float16, dict(causal=True, window_size=(5, -1))),
    (np.float64, dict(window_size=(4, 2), softcap=1.0, alibi_slopes=SLOPES_H4[:2])),
], ids=["float16-all", "float16-causal-window", "float64-all"])
def test_variants_other_dtypes(rng, dtype, kw):
    q, k, v = make_qkv(rng, 1, 2, 1, 19, 23, 9, dtype)
    compare(*run(q, k, v, **kw), dtype)


def test_variants_with_explicit_tiles(rng):
    """Other tile shapes classify the band's tiles differently: same answer."""
    q, k, v = make_qkv(rng, 1, 1, 1, 26, 31, 6, np.float32)
    kw = dict(window_size=(9, 4), softcap=1.0, alibi_slopes=SLOPES_H4[:1])
    for block_m, block_n in fconfig.explicit_tiles(6, np.float32):
        compare(*run(q, k, v, block_m=block_m, block_n=block_n, **kw), np.float32)


def test_window_with_dropout_matches_the_reference_mask(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 18, 22, 5, np.float32)
    kw = dict(window_size=(4, 3), softcap=2.0, alibi_slopes=SLOPES_H4[:2])
    p, seed = 0.35, 77
    o, lse = numba_flash.forward(q, k, v, return_lse=True, dropout_p=p, seed=seed, **kw)
    mask = numba_flash.dropout_mask(seed, 1, 2, 18, 22, p)
    want_o, want_lse = ref.attention(q, k, v, dropout_mask=mask, dropout_p=p, **kw)
    plain_o = ref.attention(q, k, v, **kw)[0]
    assert np.abs(plain_o - want_o).max() > 1e-2  # the mask matters here
    compare(o * (1 - p), lse, want_o * (1 - p), want_lse, np.float32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # other Q tiles do read the inf / NaN
def test_window_skips_tiles_outside_the_band(rng):
    """NaN keys and values in the tiles no row of a Q tile sees never reach it: those tiles are
    never loaded (a masked-but-loaded NaN value would give 0 * NaN = NaN)."""
    d = 4
    block_m, block_n, _ = fconfig.default_tiles(d, np.float32)
    n = 5 * block_m
    q, k, v = make_qkv(rng, 1, 1, 1, n, n, d, np.float32)
    kw = dict(window_size=(block_n, 0))  # Q tile t sees keys [t*BM - BN, t*BM + BM)
    want_o, want_lse = ref.attention(q, k, v, **kw)
    t = 3  # simulator: Q tile 3 = rows [24, 32) sees keys [16, 32); other K/V tiles skipped
    rows = slice(t * block_m, (t + 1) * block_m)
    first, end = t * block_m - block_n, (t + 1) * block_m
    k[:, :, :first] = np.nan
    v[:, :, :first] = np.nan
    k[:, :, end:] = np.inf
    v[:, :, end:] = np.nan
    o, lse = numba_flash.forward(q, k, v, return_lse=True, **kw)
    assert np.abs(o[:, :, rows] - want_o[:, :, rows]).max() <= O_TOL[np.float32]
    assert np.abs(lse[:, :, rows] - want_lse[:, :, rows]).max() <= 4 * LSE_TOL[np.float32]


# -- non-finite inputs (issue 15): the reference's semantics --------------------------------------
def test_nan_in_a_query_row_poisons_that_row_only(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 12, 14, 5, np.float32)
    q[0, 1, 4, 2] = np.nan
    o, lse, want_o, want_lse = run(q, k, v, causal=True)
    assert np.isnan(lse[0, 1, 4]) and np.isnan(o[0, 1, 4]).all()
    assert np.isfinite(lse[0, 0]).all() and np.isfinite(np.delete(lse[0, 1], 4)).all()
    compare(o, lse, want_o, want_lse, np.float32)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_in_a_visible_key_poisons_the_rows_that_see_it(rng, bad):
    q, k, v = make_qkv(rng, 1, 1, 1, 16, 16, 4, np.float32)
    k[0, 0, 9, 1] = bad  # seen by rows 9..12 only with window (3, 0)
    o, lse, want_o, want_lse = run(q, k, v, window_size=(3, 0))
    assert np.isnan(lse[0, 0, 9:13]).all() and np.isfinite(lse[0, 0, :9]).all()
    assert np.isfinite(lse[0, 0, 13:]).all()
    compare(o, lse, want_o, want_lse, np.float32)


def test_non_finite_value_of_a_visible_key_poisons_that_column(rng):
    q, k, v = make_qkv(rng, 1, 1, 1, 10, 10, 4, np.float32)
    v[0, 0, 6, 2] = np.nan
    v[0, 0, 7, 3] = np.inf
    o, lse, want_o, want_lse = run(q, k, v, causal=True)
    assert np.isfinite(lse).all()
    compare(o, lse, want_o, want_lse, np.float32)
    assert not np.isfinite(o[0, 0, 6:, 2]).any() and np.isfinite(o[0, 0, :6]).all()


def test_masked_nan_key_and_value_never_reach_a_row(rng):
    """Inside a partly visible tile (the diagonal tile), NaN k and v of a key some rows do not
    see: those rows are exact, not NaN (no 0 * NaN in P V)."""
    q, k, v = make_qkv(rng, 1, 1, 1, 16, 16, 4, np.float32)
    want_o, want_lse = ref.attention(q, k, v, causal=True)
    k[0, 0, 13] = np.nan
    v[0, 0, 13] = np.nan
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    compare(o[:, :, :13], lse[:, :, :13], want_o[:, :, :13], want_lse[:, :, :13], np.float32)
    assert np.isnan(lse[0, 0, 13:]).all()


def test_a_row_that_sees_no_key(rng):
    """Causal with Nq > Nk: rows 0..Nq-Nk-1 see nothing: o = 0, lse = -inf (a NaN key that
    only the last row sees changes nothing there)."""
    q, k, v = make_qkv(rng, 1, 1, 1, 20, 6, 4, np.float32)
    k[0, 0, 5] = np.nan  # a key only the last row sees
    o, lse, want_o, want_lse = run(q, k, v, causal=True)
    assert (o[0, 0, :14] == 0).all() and np.isneginf(lse[0, 0, :14]).all()
    compare(o, lse, want_o, want_lse, np.float32)


# -- arguments -----------------------------------------------------------------------------------
def _qkv32(h=2, hkv=1, nq=4, nk=5, d=8, dtype=np.float32):
    z = np.zeros
    return z((1, h, nq, d), dtype), z((1, hkv, nk, d), dtype), z((1, hkv, nk, d), dtype)


@pytest.mark.parametrize("kwargs, exc, msg", [
    ({"window_size": 3}, TypeError, r"^window_size: expected a pair"),
    ({"window_size": (1, 2, 3)}, ValueError, r"^window_size: expected a pair"),
    ({"window_size": (1.5, 0)}, TypeError, r"^window_size: expected left an int"),
    ({"window_size": (0, -2)}, ValueError, r"^window_size: expected right >= -1"),
    ({"softcap": -1.0}, ValueError, r"^softcap: expected a finite number >= 0"),
    ({"softcap": float("inf")}, ValueError, r"^softcap: expected a finite number >= 0"),
    ({"softcap": "1"}, TypeError, r"^softcap: expected a real number"),
    ({"alibi_slopes": np.ones(2, np.float64)}, TypeError, r"^alibi_slopes: expected dtype float32"),
    ({"alibi_slopes": np.ones(3, np.float32)}, ValueError, r"^alibi_slopes: expected shape \(2,\)"),
    ({"alibi_slopes": np.array([1, np.nan], np.float32)}, ValueError,
     r"^alibi_slopes: expected finite values"),
    ({"alibi_slopes": [0.5, 0.25]}, TypeError, r"^alibi_slopes: expected a numpy.ndarray"),
    ({"kernel": "tensor"}, ValueError, r"^kernel: expected one of"),
    ({"kernel": 1}, TypeError, r"^kernel: expected one of"),
    ({"kernel": "mma"}, ValueError, r"^kernel: 'mma' \(tensor cores\) takes float16"),
])
def test_variant_arguments_are_checked_before_launch(monkeypatch, kwargs, exc, msg):
    def no_kernel(*args):
        raise AssertionError("a kernel was built before validation finished")

    monkeypatch.setattr(forward_op, "forward_kernel", no_kernel)
    with pytest.raises(exc, match=msg):
        numba_flash.forward(*_qkv32(), **kwargs)


def test_kernel_choice(monkeypatch):
    """'mma' hands every argument, validated once, to the tensor-core launch; 'auto' in the
    simulator (and for float32/64, or with explicit SIMT tiles) runs the SIMT kernel; block_m
    with 'mma' is an error."""
    from numba_flash.frontend.kernel_choice import check_forward_kernel

    calls = []

    def fake_mma(q, k, v, args, variant=None):
        calls.append(args)
        return "mma result"

    monkeypatch.setattr(forward_op, "_tensor_core_launch", lambda choice: fake_mma)
    q, k, v = _qkv32(dtype=np.float16)
    slopes = np.ones(2, np.float32)
    out = numba_flash.forward(q, k, v, kernel="mma", causal=True, window_size=(3, 0),
                              softcap=1.0, alibi_slopes=slopes, dropout_p=0.1, seed=5,
                              return_lse=True, softmax_scale=0.5)
    assert out == "mma result"
    kw = calls[0]
    assert kw.causal is True and kw.window == (3, 0) and kw.softcap == 1.0
    assert (kw.left, kw.right) == (3, 0)
    np.testing.assert_array_equal(kw.alibi, np.broadcast_to(slopes, (1, 2)))
    assert kw.dropout_p == 0.1 and kw.dropout == numba_flash.philox.dropout_params(0.1, 5)
    assert kw.return_lse is True and kw.scale == 0.5
    assert check_forward_kernel("auto", np.float32, False) == "simt"
    assert check_forward_kernel("auto", np.float16, True) == "simt"
    assert check_forward_kernel("simt", np.float16, False) == "simt"
    if numba_flash.backend() == "simulator":
        assert check_forward_kernel("auto", np.float16, False) == "simt"
    with pytest.raises(ValueError, match=r"^block_m: the tile choice applies to kernel='simt'"):
        numba_flash.forward(q, k, v, kernel="mma", block_m=8)


# -- the grid (issue 15): B * H beyond gridDim.y's 65535 -----------------------------------------
@pytest.mark.parametrize("n_bh", [1, 7, 65535, 65536, 70000, 200003])
def test_grid_covers_every_head_within_limits(n_bh):
    x, y, z = fk.forward_grid(5, n_bh)
    assert x == 5 and 1 <= y <= 65535 and 1 <= z <= 65535
    assert y * z >= n_bh and y * z - n_bh < z  # every (b, h) once, fewer than z spare blocks
    if n_bh == 70000:
        assert (y, z) == (35000, 2)


def test_folded_grid_runs_every_head(rng, monkeypatch):
    """The kernel's side of the fold: with the y limit lowered to 3, B * H = 8 runs on a 3 x 3
    (y, z) grid with one spare block, and every head matches the reference."""
    monkeypatch.setattr(fk, "GRID_YZ_MAX", 3)
    assert fk.forward_grid(1, 8) == (1, 3, 3)
    q, k, v = make_qkv(rng, 2, 4, 2, 5, 6, 3, np.float32)
    compare(*run(q, k, v, causal=True), np.float32)


@pytest.mark.gpu
def test_forward_with_70000_heads_on_the_gpu(rng):
    """B * H = 70000 > 65535 on the device: every head written and right (grid (1, 35000, 2))."""
    q, k, v = make_qkv(rng, 2, 35000, 35000, 5, 6, 16, np.float32)
    compare(*run(q, k, v, causal=True, window_size=(3, -1)), np.float32)
