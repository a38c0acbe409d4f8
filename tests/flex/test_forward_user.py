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
    from numba_flash.kernels import forward_mma
    log = []
    monkeypatch.setattr(forward_mma, "TILE_LOG", log)
    return log


def test_block_mask_skips_empty_tiles(rng, tile_log):
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
    o = numba_flash.forward(q, k, v, block_mask=bm, aux_tensors=(doc,))
    np.testing.assert_allclose(o.astype(np.float64), want, atol=O_TOL, rtol=0)
    visited = {(h, qs // 16, kt) for _, h, qs, kt in tile_log}
    expect = {(h, i, j) for h in range(2) for i in range(3) for j in range(3) if kinds[i, j]}
    assert visited == expect and len(tile_log) == len(expect)
    assert 0 < len(expect) < 18 and (kinds == 1).any() and (kinds == 2).any()
    tile_log.clear()
    o2 = numba_flash.forward(q, k, v, mask_mod=same, aux_tensors=(doc,))  # per element
    assert len(tile_log) == 18  # 2 heads x 3 x 3 tiles
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


def test_simt_and_float32_say_not_yet(rng):
    q, k, v = _qkv(rng, nq=16, nk=16)
    with pytest.raises(NotImplementedError, match="SIMT forward"):
        numba_flash.forward(q, k, v, mask_mod=lambda b, h, i, j: i >= j, kernel="simt")
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    with pytest.raises(NotImplementedError, match="float32"):
        numba_flash.forward(q32, k32, v32, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(TypeError, match="score_mod: expected a function of 5"):
        numba_flash.forward(q, k, v, score_mod=lambda s, b: s)
