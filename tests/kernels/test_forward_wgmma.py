"""The warpgroup forward (``forward(kernel="wgmma")``, numba_flash.kernels.forward.wgmma) against
the float64 reference, in the simulator: every ``wgmma`` runs as its twin over the warpgroup's
128 Python threads (numba_flash.kernels.ptx.wgmma), the other stages as in the ``mma.sync``
forward.  Outputs are NaN-poisoned before every launch (autouse), so an unwritten element fails.

Tolerances: the ``mma.sync`` forward's (tests/kernels/test_mma_forward.py: o 2e-3 scaled, lse
2e-6; bfloat16 tests/kernels/test_bfloat16.py's ``o_mma`` / ``lse_mma``), which this kernel
meets because its products are the same: 16-bit operands, float32 accumulation (the twin rounds
each ``wgmma``'s float64 product to float32 as the ``mma.sync`` twin does), ``P`` rounded to the
input type, the same softmax stages.  Measured (2026-12-02, six of the cases below, simulator):
o within 3.6e-4 of the reference scaled (float16; bfloat16 2.6e-3), lse within 9.3e-8; every
one of those outputs equals the ``mma.sync`` forward's bit for bit (both twins round each
16-deep product from float64 to float32, and both simulator builds take 16-key tiles).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference
from numba_flash.flex import create_block_mask
from numba_flash.kernels.forward import config as fconfig
from tests.helpers import assert_scaled_close
from tests.kernels.test_bfloat16 import TOL as BF16_TOL
from tests.kernels.test_mma_forward import LSE_TOL, O_TOL

BF16 = np.dtype(ml_dtypes.bfloat16)


def make_qkv(rng, b, h, hkv, nq, nk, d, dtype=np.float16, scale=1.0):
    q = (rng.standard_normal((b, h, nq, d)) * scale).astype(dtype)
    k = (rng.standard_normal((b, hkv, nk, d)) * scale).astype(dtype)
    v = rng.standard_normal((b, hkv, nk, d)).astype(dtype)
    return q, k, v


def check(q, k, v, dropout_p=0.0, seed=0, o_tol=O_TOL, lse_tol=LSE_TOL, **kw):
    copies = [x.copy() for x in (q, k, v)]
    o, lse = numba_flash.forward(q, k, v, return_lse=True, dropout_p=dropout_p, seed=seed,
                                 kernel="wgmma", **kw)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)  # inputs are never modified
    assert o.dtype == q.dtype and lse.dtype == np.float32 and o.shape == q.shape
    mask = None
    if dropout_p:
        b, h, nq, _ = q.shape
        mask = numba_flash.dropout_mask(seed, b, h, nq, k.shape[2], dropout_p)
    o_ref, lse_ref = reference.attention(q, k, v, dropout_mask=mask, dropout_p=dropout_p, **kw)
    assert_scaled_close(o.astype(np.float64), o_ref, o_tol, name="o")
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    fin = np.isfinite(lse_ref)
    assert_scaled_close(lse[fin], lse_ref[fin], lse_tol, name="lse")
    return o, lse


@pytest.mark.parametrize("d", [64, 128])
def test_head_dims_ragged_gqa_causal(rng, d):
    """One 64-row Q tile, three 16-key K/V tiles (the last ragged), two query heads on one KV
    head; causal: the last tile masked, the others whole."""
    q, k, v = make_qkv(rng, 1, 2, 1, 19, 37, d)
    check(q, k, v, causal=True)


def test_two_q_tiles_more_queries_than_keys_odd_head_dim(rng):
    """Nq = 70 > 64: a second, ragged Q tile; Nq > Nk causal: the first rows see no key (o = 0,
    lse = -inf); d = 40 runs in the 64-wide tiles with 16-bit loads (zero columns past d)."""
    q, k, v = make_qkv(rng, 1, 1, 1, 70, 9, 40)
    o, lse = check(q, k, v, causal=True)
    assert np.isneginf(lse[:, :, :61]).all() and (o[:, :, :61] == 0).all()


def test_window_softcap_alibi(rng):
    q, k, v = make_qkv(rng, 1, 2, 2, 20, 33, 64, scale=2.0)
    slopes = reference.alibi_slopes(2)
    check(q, k, v, window_size=(6, 2), softcap=3.0, alibi_slopes=slopes)


def test_dropout_matches_the_philox_mask(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 18, 26, 64)
    o1, _ = check(q, k, v, causal=True, dropout_p=0.25, seed=123)
    o2 = numba_flash.forward(q, k, v, causal=True, dropout_p=0.25, seed=123, kernel="mma")
    np.testing.assert_array_equal(o1, o2)  # the same keep-mask as the mma.sync forward's


@pytest.mark.parametrize("d", [64, 128])
def test_bfloat16_gqa_with_a_sink(rng, d):
    q, k, v = make_qkv(rng, 1, 2, 1, 21, 30, d, dtype=BF16)
    sink = np.array([0.5, -1.0], np.float32)
    check(q, k, v, causal=True, learnable_sink=sink, o_tol=BF16_TOL["o_mma"],
          lse_tol=BF16_TOL["lse_mma"])


def _rel(score, b, h, q_idx, kv_idx, bias):
    return score + bias[h, q_idx - kv_idx + 40]


def _doc_mask(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx + 16] == doc[b, kv_idx]  # queries are the last 24 of the 40 tokens


def test_a_users_score_mod_mask_mod_and_block_mask(rng):
    q, k, v = make_qkv(rng, 1, 2, 1, 24, 40, 64)
    bias = rng.standard_normal((2, 80)).astype(np.float32)
    doc = np.repeat(np.arange(3, dtype=np.int32), [10, 14, 16])[None]

    def both(score, b, h, q_idx, kv_idx, bias, doc):
        return _rel(score, b, h, q_idx, kv_idx, bias)

    def docs(b, h, q_idx, kv_idx, bias, doc):
        return _doc_mask(b, h, q_idx, kv_idx, doc)

    kw = dict(score_mod=both, mask_mod=docs, aux_tensors=(bias, doc))
    o_ref, lse_ref = reference.attention(q, k, v, **kw)
    bm = create_block_mask(docs, 1, None, 24, 40, aux_tensors=(bias, doc), BLOCK_SIZE=16)
    for mask in (None, bm):   # every tile through mask_mod; EMPTY tiles skipped, FULL unmasked
        o, lse = numba_flash.forward(q, k, v, block_mask=mask, return_lse=True, kernel="wgmma",
                                     **kw)
        assert_scaled_close(o.astype(np.float64), o_ref, O_TOL, name="o")
        assert_scaled_close(lse, lse_ref, LSE_TOL, name="lse")


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the twin's inf - inf
def test_non_finite_inputs_follow_the_reference(rng):
    q, k, v = make_qkv(rng, 1, 1, 1, 24, 40, 64)
    q[0, 0, 10, 3] = np.nan      # row 10: NaN
    k[0, 0, 38, 2] = np.inf      # key 38: NaN for the rows that see it (22, 23)
    v[0, 0, 5, 7] = np.nan       # column 7 NaN for rows that see key 5
    v[0, 0, 37, 1] = -np.inf     # column 1 non-finite for rows that see key 37
    o, lse = numba_flash.forward(q, k, v, return_lse=True, causal=True, kernel="wgmma")
    o_ref, lse_ref = reference.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(np.isnan(o), np.isnan(o_ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
    ok = ~np.isnan(o_ref)
    assert np.abs(o[ok] - o_ref[ok]).max() <= O_TOL * max(1.0, np.abs(o_ref[ok]).max())
    assert 0 < np.isnan(o_ref).sum() < o_ref.size  # the case is not vacuous


@pytest.mark.parametrize("sim_tiles", [(2, 32, True), (1, 16, False)])
def test_two_warpgroups_and_the_serial_pipeline(rng, monkeypatch, sim_tiles):
    """The GPU's two warpgroups (128 rows, Q's second 64 rows through the descriptor's row
    offset; 256 Python threads) with 32-key tiles; the pipeline without the overlap (both
    products waited for before the softmax: the d = 64 GPU build's)."""
    monkeypatch.setattr(fconfig, "FORWARD_WGMMA_SIM_TILES", sim_tiles)
    q, k, v = make_qkv(rng, 1, 1, 1, 80, 70, 64)
    check(q, k, v, window_size=(20, 3))


@pytest.mark.parametrize("kw, exc, match", [
    (dict(dtype=np.float32), ValueError, "kernel: 'wgmma'.*float16 or bfloat16"),
    (dict(d=192), ValueError, "q: kernel='wgmma' takes head dims up to 128, got 192"),
    (dict(d_v=32), ValueError, "v: kernel='wgmma' takes v with q's head dim 64, got 32"),
    (dict(block_m=64), ValueError, "block_m: .*kernel='wgmma'"),
])
def test_bad_requests_raise_before_launch(kw, exc, match):
    dtype, d, d_v = kw.pop("dtype", np.float16), kw.pop("d", 64), kw.pop("d_v", None)
    q = np.zeros((1, 1, 4, d), dtype)
    v = np.zeros((1, 1, 4, d_v or d), dtype)
    with pytest.raises(exc, match=match):
        numba_flash.forward(q, q, v, kernel="wgmma", **kw)


def test_backward_and_auto_never_take_wgmma():
    q = np.zeros((1, 1, 4, 16), np.float16)
    with pytest.raises(ValueError, match="kernel: 'wgmma' is the forward's"):
        numba_flash.backward(q, q, q, q, q, np.zeros((1, 1, 4), np.float32), kernel="wgmma")
    from numba_flash.frontend.kernel_choice import check_forward_kernel
    assert check_forward_kernel("auto", np.float16, False) != "wgmma"


def test_gpu_tiles_fit_hopper_shared_memory():
    """The GPU tiles: dynamic shared memory past 48 KiB (opted into at launch), within the 227
    KiB of an sm_90 block; the per-element builds and the 16-bit loads take 64-key tiles."""
    for hd in fconfig.WGMMA_HEAD_DIMS:
        cfg = fconfig.forward_wgmma_config(hd, simulator=False)
        assert 48 * 1024 < cfg.SMEM_BYTES <= fconfig.SMEM_LIMIT_SM90
        assert cfg.BLOCK_M == 128 and cfg.THREADS == 256
        for flags in (dict(SOFTCAP=True), dict(VEC=False)):
            assert fconfig.forward_wgmma_config(hd, simulator=False, **flags).BLOCK_N == 64
