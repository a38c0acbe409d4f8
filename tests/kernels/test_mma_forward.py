"""The tensor-core forward (numba_flash.ops.forward_mma) against the float64 reference.

In the simulator the mma runs as its twin (numba_flash.kernels.ptx.mma), one warp of 32 Python
threads per block, so the shapes are tiny.  Outputs are NaN-poisoned before every launch.

Measured errors (simulator, 12 random cases, d in {16, 64, 128}, ragged Nq/Nk in 1..40, causal,
dropout 0.3; 2026-12-01, the stages kernel: ex2 with scale * log2(e) folded in): max |o - o_ref|
/ max(1, max |o_ref|) = 5.0e-4 (float16 output rounding and P rounded to float16 before P V),
max |lse - lse_ref| / max(1, |lse_ref|) = 1.6e-7 (1.2e-7 with |lse| up to 106: the rounding of
m * scale * log2(e) gives 1e-5 absolute there).  2026-11-30 kernel: 3.8e-4, 3.8e-7.
Bounds: 2e-3 for o (scaled), 2e-6 for lse (scaled by
max(1, |lse|)).  On a GPU the tensor core accumulates in float32 as the twin does (rounded
from float64 per mma), so the same bounds apply (the gpu-marked test checks it at N = 2049).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference
from numba_flash.kernels.forward import mma as fm
from numba_flash.kernels.forward import config as fconfig
from numba_flash.ops.forward_mma import forward_mma
from tests.helpers import assert_scaled_close

O_TOL = 2e-3
LSE_TOL = 2e-6


def make_qkv(rng, b, h, hkv, nq, nk, d, scale=1.0):
    q = (rng.standard_normal((b, h, nq, d)) * scale).astype(np.float16)
    k = (rng.standard_normal((b, hkv, nk, d)) * scale).astype(np.float16)
    v = rng.standard_normal((b, hkv, nk, d)).astype(np.float16)
    return q, k, v


def check(q, k, v, dropout_p=0.0, seed=0, **kw):
    copies = [x.copy() for x in (q, k, v)]
    o, lse = forward_mma(q, k, v, return_lse=True, dropout_p=dropout_p, seed=seed, **kw)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)  # inputs are never modified
    assert o.dtype == np.float16 and lse.dtype == np.float32
    mask = None
    if dropout_p:
        b, h, nq, _ = q.shape
        mask = numba_flash.dropout_mask(seed, b, h, nq, k.shape[2], dropout_p)
    o_ref, lse_ref = reference.attention(q, k, v, dropout_mask=mask, dropout_p=dropout_p, **kw)
    assert_scaled_close(o, o_ref, O_TOL, name="o")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    assert_scaled_close(lse[fin], lse_ref[fin], LSE_TOL, name="lse")
    return o, lse


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_head_dims_ragged_gqa(rng, d):
    """d = 256: Q's fragments are read from shared memory at every k-step (not registers)."""
    q, k, v = make_qkv(rng, 1, 2, 1, 19, 37, d)
    check(q, k, v)


def test_causal_more_queries_than_keys_odd_head_dim(rng):
    """Nq > Nk: the first rows see no key (o = 0, lse = -inf); d = 7 is zero-padded to 16."""
    q, k, v = make_qkv(rng, 2, 3, 1, 21, 9, 7)
    o, lse = check(q, k, v, causal=True)
    assert np.isneginf(lse[:, :, :12]).all() and (o[:, :, :12] == 0).all()


def test_window_softcap_alibi(rng):
    q, k, v = make_qkv(rng, 1, 2, 2, 20, 33, 32, scale=2.0)
    slopes = reference.alibi_slopes(2)
    check(q, k, v, window_size=(6, 2), softcap=3.0, alibi_slopes=slopes)
    check(q, k, v, causal=True, window_size=(4, -1), alibi_slopes=np.tile(slopes, (1, 1)))


def test_dropout_matches_the_philox_mask(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 18, 26, 16)
    o1, _ = check(q, k, v, causal=True, dropout_p=0.25, seed=123)
    o2 = forward_mma(q, k, v, causal=True, dropout_p=0.25, seed=123)
    np.testing.assert_array_equal(o1, o2)  # same seed, same output


@pytest.mark.parametrize("sim_tiles", [(2, 1, 32, 1, False), (1, 1, 16, 3, True)])
def test_other_tiles_and_pipelines(rng, monkeypatch, sim_tiles):
    """The GPU's other tile choices in the simulator (whose default is one warp of two 16-row
    tiles, 16 keys, 2 K/V stages, Q in registers): 2 warps of one row tile, 32 keys, one K and
    one V buffer (V copied under Q K^T, K under P V) and Q read from shared memory; and a
    3-stage pipeline (K/V two tiles ahead)."""
    monkeypatch.setattr(fconfig, "FORWARD_MMA_SIM_TILES", sim_tiles)
    q, k, v = make_qkv(rng, 1, 1, 1, 40, 45, 16)
    check(q, k, v, causal=True)
    check(q, k, v, window_size=(7, 7))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the twin's inf - inf
def test_non_finite_inputs_follow_the_reference(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 24, 20, 16)
    q[0, 0, 10, 3] = np.nan      # row 10 of head 0: NaN
    k[0, 0, 15, 2] = np.inf      # key 15: NaN for every row that sees it
    v[0, 0, 5, 7] = np.nan       # column 7 NaN for rows that see key 5
    v[0, 0, 17, 1] = -np.inf     # column 1 non-finite for rows that see key 17
    for kw in (dict(causal=True), dict(window_size=(3, 2))):
        o, lse = forward_mma(q, k, v, return_lse=True, **kw)
        o_ref, lse_ref = reference.attention(q, k, v, **kw)
        np.testing.assert_array_equal(np.isnan(o), np.isnan(o_ref))
        np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
        ok = ~np.isnan(o_ref)
        assert np.abs(o[ok] - o_ref[ok]).max() <= O_TOL * max(1.0, np.abs(o_ref[ok]).max())
        assert 0 < np.isnan(o_ref).sum() < o_ref.size  # the case is not vacuous


def test_public_forward_dispatches_to_mma(rng):
    q, k, v = make_qkv(rng, 1, 1, 1, 9, 11, 16)
    o = numba_flash.forward(q, k, v, causal=True, kernel="mma")
    np.testing.assert_array_equal(o, forward_mma(q, k, v, causal=True))


@pytest.mark.parametrize("bad, exc, match", [
    (dict(q=np.zeros((1, 1, 4, 8), np.float32)), TypeError, "float16"),
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(alibi_slopes=np.zeros(3, np.float32)), ValueError, "alibi_slopes"),
    (dict(dropout_p=1.0), ValueError, "dropout_p"),
    (dict(causal=1), TypeError, "causal"),
])
def test_bad_arguments_raise_before_launch(bad, exc, match):
    args = dict(q=np.zeros((1, 2, 4, 8), np.float16), k=np.zeros((1, 1, 4, 8), np.float16),
                v=np.zeros((1, 1, 4, 8), np.float16))
    args.update(bad)
    if args["q"].dtype != np.float16:
        args["k"] = args["k"].astype(args["q"].dtype)
        args["v"] = args["v"].astype(args["q"].dtype)
        args["q"] = args["q"][:, :1]
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=match):
        forward_mma(q, k, v, **args)


def test_grid_and_shared_memory_budgets():
    assert fm.forward_grid(4096, 700, 100, 64) == (64 * 70000,)  # B * H = 70000 > 65535
    with pytest.raises(ValueError, match="grid limit"):
        fm.forward_grid(2**20, 2**12, 2**8, 16)
    for hd in fconfig.FORWARD_MMA_TILES:
        cfg = fconfig.forward_mma_config(hd, simulator=False)
        assert cfg.SMEM_BYTES <= 48 * 1024, cfg
        assert cfg.BLOCK_M * cfg.ROW_BYTES <= cfg.STAGE_BYTES or not cfg.Q_IN_REGS, cfg


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_size(causal):
    rng = np.random.default_rng(2049)
    q, k, v = make_qkv(rng, 1, 4, 2, 2049, 2049, 128)
    check(q, k, v, causal=causal)
    check(q, k, v, causal=causal, window_size=(256, 0), softcap=20.0,
          alibi_slopes=reference.alibi_slopes(4), dropout_p=0.1, seed=7)


def test_head_dim_256(rng):
    q, k, v = make_qkv(rng, 1, 1, 1, 9, 20, 256)
    check(q, k, v, window_size=(10, 0))
