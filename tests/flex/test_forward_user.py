"""A user's score_mod / mask_mod / block mask in the tensor-core forward (simulator), against
the float64 reference with the same functions."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.flex import create_block_mask
from numba_flash.flex.examples import prefix_lm_mask

# float16 tensor-core forward vs float64 at these sizes: o within 5.5e-4, lse within 6.3e-7
# (measured over the cases below); flash-attn-style bound with headroom
O_TOL, LSE_TOL = 2e-3, 2e-5


def _qkv(rng, dtype=np.float16, b=1, h=2, hkv=1, nq=24, nk=40, d=16):
    return tuple(rng.standard_normal(s).astype(dtype)
                 for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))


def _check(got, want):
    o, lse = got
    o_r, lse_r = want
    np.testing.assert_allclose(o.astype(np.float64), o_r, atol=O_TOL, rtol=0)
    fin = np.isfinite(lse_r)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    np.testing.assert_allclose(lse[fin], lse_r[fin], atol=LSE_TOL, rtol=0)


def _rel(score, b, h, q_idx, kv_idx, bias):
    return score + bias[h, q_idx - kv_idx + 40]


def _doc_mask(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx + 16] == doc[b, kv_idx]  # queries are the last 24 of the 40 tokens


def test_score_mod_relative_bias(rng):
    q, k, v = _qkv(rng)
    bias = rng.standard_normal((2, 80)).astype(np.float32)
    kw = dict(score_mod=_rel, aux_tensors=(bias,), causal=True)
    _check(numba_flash.forward(q, k, v, return_lse=True, kernel="mma", **kw),
           ref.attention(q, k, v, **kw))


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_mask_mod_documents_with_and_without_a_block_mask(rng, dtype):
    if dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    q, k, v = _qkv(rng, dtype)
    doc = np.repeat(np.arange(3, dtype=np.int32), [10, 14, 16])[None]
    want = ref.attention(q, k, v, mask_mod=_doc_mask, aux_tensors=(doc,))
    tol = 1 if dtype == np.float16 else 8  # bfloat16: 8 bits of mantissa (o within 3.9e-3)
    for bm in (None, create_block_mask(_doc_mask, 1, None, 24, 40, aux_tensors=(doc,),
                                       BLOCK_SIZE=16)):
        o, lse = numba_flash.forward(q, k, v, mask_mod=_doc_mask, block_mask=bm,
                                     aux_tensors=(doc,), return_lse=True)
        np.testing.assert_allclose(o.astype(np.float64), want[0], atol=tol * O_TOL, rtol=0)
        np.testing.assert_allclose(lse, want[1], atol=tol * LSE_TOL, rtol=0)


@pytest.fixture
def tile_log(monkeypatch):
    from numba_flash.kernels.core import common
    log = []
    monkeypatch.setattr(common, "TILE_LOG", log)
    return log


@pytest.mark.parametrize("kernel", ["mma", "simt"])
def test_block_mask_skips_empty_tiles(rng, tile_log, kernel):
    """Count the (query tile, key tile) pairs the kernel computes (the simulator's tile log):
    with a block mask exactly the tiles it does not call EMPTY, without one every tile."""
    q, k, v = _qkv(rng, nq=48, nk=48)
    doc = np.repeat(np.arange(3, dtype=np.int32), [16, 16, 16])[None]
    doc[0, 20:24] = 0  # a document edge inside a tile: some tiles PARTIAL

    def same(b, h, q_idx, kv_idx, doc):
        return doc[b, q_idx] == doc[b, kv_idx]

    bm = create_block_mask(same, 1, 1, 48, 48, aux_tensors=(doc,), BLOCK_SIZE=16)
    kinds = bm.kind[0, 0]
    want = ref.attention(q, k, v, mask_mod=same, aux_tensors=(doc,))[0]
    o = numba_flash.forward(q, k, v, block_mask=bm, aux_tensors=(doc,), kernel=kernel)
    np.testing.assert_allclose(o.astype(np.float64), want, atol=O_TOL, rtol=0)
    if kernel == "mma":
        from numba_flash.kernels.forward.config import forward_mma_config
        cfg = forward_mma_config(16)
        bm_, bn_ = cfg.BLOCK_M, cfg.BLOCK_N
    else:
        from numba_flash.kernels.forward.config import default_tiles
        bm_, bn_, _ = default_tiles(16, np.float16)
    # a kernel tile is computed iff some 16 x 16 block it overlaps is not EMPTY
    nonempty = np.repeat(np.repeat(kinds != 0, 16, axis=0), 16, axis=1)
    tiles = [(i, j) for i in range(0, 48, bm_) for j in range(0, 48, bn_)]
    expect = {(h, i, j // bn_) for h in range(2) for i, j in tiles
              if nonempty[i:i + bm_, j:j + bn_].any()}
    visited = {(h, qs, kt) for _, h, qs, kt in tile_log}
    assert visited == expect and len(tile_log) == len(expect)
    assert 0 < len(expect) < 2 * len(tiles) and (kinds == 1).any() and (kinds == 2).any()
    tile_log.clear()
    o2 = numba_flash.forward(q, k, v, mask_mod=same, aux_tensors=(doc,),  # per element
                             kernel=kernel)
    assert len(tile_log) == 2 * len(tiles)  # every tile of both heads
    np.testing.assert_array_equal(o2, o)


def test_prefix_lm_and_gqa(rng):
    q, k, v = _qkv(rng, b=2, h=4, hkv=2, nq=20, nk=20)
    prefix = np.array([5, 12], np.int32)
    kw = dict(mask_mod=prefix_lm_mask, aux_tensors=(prefix,))
    _check(numba_flash.forward(q, k, v, return_lse=True, kernel="mma", **kw),
           ref.attention(q, k, v, **kw))


def test_functions_may_call_helpers(rng):
    q, k, v = _qkv(rng, nq=16, nk=16)

    def near(q_idx, kv_idx):
        return abs(q_idx - kv_idx) <= 3

    def local_causal(b, h, q_idx, kv_idx):
        return near(q_idx, kv_idx) and kv_idx <= q_idx

    _check(numba_flash.forward(q, k, v, mask_mod=local_causal, return_lse=True),
           ref.attention(q, k, v, window_size=(3, 0)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_simt_float32_float64_score_and_mask_mods(rng, dtype):
    q, k, v = _qkv(rng, dtype, b=2, h=2, hkv=2, nq=20, nk=28)
    bias = rng.standard_normal((2, 80)).astype(np.float32)
    prefix = np.array([5, 12], np.int32)

    def both(b, h, q_idx, kv_idx, bias, prefix):
        return prefix_lm_mask(b, h, q_idx, kv_idx, prefix)

    def rel(score, b, h, q_idx, kv_idx, bias, prefix):
        return score + bias[h, q_idx - kv_idx + 40]

    kw = dict(score_mod=rel, mask_mod=both, aux_tensors=(bias, prefix), softcap=3.0)
    o, lse = numba_flash.forward(q, k, v, return_lse=True, **kw)
    o_r, lse_r = ref.attention(q, k, v, **kw)
    # float32 SIMT: o within 1.2e-7, lse 4.8e-7 measured; float64 at 1e-15
    tol = 2e-6 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(o, o_r, atol=tol, rtol=0)
    np.testing.assert_allclose(lse, lse_r, atol=tol, rtol=tol)


def test_bad_user_functions_fail_before_launch(rng):
    q, k, v = _qkv(rng, nq=16, nk=16)
    with pytest.raises(TypeError, match="score_mod: expected a function of 5"):
        numba_flash.forward(q, k, v, score_mod=lambda s, b: s)
    with pytest.raises(TypeError, match="mask_mod: expected <lambda> to return a bool"):
        numba_flash.forward(q, k, v, mask_mod=lambda b, h, i, j: 1.5)
    with pytest.raises(ValueError, match="block_mask: expected a mask for"):
        bm = create_block_mask(lambda b, h, i, j: i >= j, 1, 1, 32, 32, BLOCK_SIZE=16)
        numba_flash.forward(q, k, v, block_mask=bm)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_backward_with_score_mod_grad_and_mask_mod(rng, dtype):
    q, k, v = _qkv(rng, dtype, b=1, h=2, hkv=1, nq=12, nk=20)
    do = rng.standard_normal(q.shape).astype(dtype)
    bias = rng.standard_normal((2, 80)).astype(np.float32)
    doc = np.repeat(np.arange(2, dtype=np.int32), [9, 11])[None]

    def quad(score, b, h, q_idx, kv_idx, bias, doc):
        return score + 0.1 * score * score + bias[h, q_idx - kv_idx + 40]

    def quad_grad(score, b, h, q_idx, kv_idx, bias, doc):
        return 1.0 + 0.2 * score

    def docs(b, h, q_idx, kv_idx, bias, doc):
        return doc[b, q_idx + 8] == doc[b, kv_idx]

    kw = dict(score_mod=quad, mask_mod=docs, aux_tensors=(bias, doc), causal=True)
    o, lse = numba_flash.forward(q, k, v, return_lse=True, **kw)
    got = numba_flash.backward(do, q, k, v, o, lse, score_mod_grad=quad_grad, **kw)
    want = ref.attention_backward(do, q, k, v, score_mod_grad=quad_grad, **kw)
    # float32 SIMT backward: within 3.1e-6 of the largest gradient measured; float64 1e-14
    tol = 2e-5 if dtype == np.float32 else 1e-12
    for g, w, name in zip(got, want, "qkv"):
        np.testing.assert_allclose(g, w, atol=tol * max(1.0, np.abs(w).max()), rtol=0,
                                   err_msg=f"d{name}")
    with pytest.raises(ValueError, match="score_mod_grad"):
        numba_flash.backward(do, q, k, v, o, lse, **kw)


def test_breakpoint_in_a_score_mod_stops_in_the_simulator(rng, monkeypatch):
    import sys
    stops = []
    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **k: stops.append(1))

    def mod(score, b, h, q_idx, kv_idx):
        if q_idx == 3 and kv_idx == 1:
            breakpoint()  # compiled (the host check): a no-op; simulated: pdb's hook
        return score

    q, k, v = _qkv(rng, np.float32, nq=8, nk=8)
    numba_flash.forward(q, k, v, score_mod=mod)
    assert len(stops) == 2  # one per query head, at (3, 1)
