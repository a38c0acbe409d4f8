"""A user's score_mod / mask_mod / block mask in the backward of both kernel families
(simulator): the tensor-core backward against the float64 reference and the SIMT backward with
the same functions, and block masks that skip EMPTY tiles in the dK/dV and dQ loops."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.flex import BlockMask, create_block_mask
from numba_flash.flex.examples import prefix_lm_mask

#: max |got - want| / max |want| of the gradients, measured 2026-12-01 on these tests' shapes (8
#: seeds) and on larger ones (Nq 24, Nk 40 / 20 x 20, 5 seeds): float16 tensor cores vs float64
#: within 6.2e-4 (the SIMT backward 6.6e-4: the gradients' own float16 rounding), the two
#: families within 8.8e-4 of each other (two roundings of a gradient near 2: 2 ulp); bfloat16
#: (8-bit mantissa; P and dS rounded to it on the tensor cores) within 1.03e-2 of float64 and
#: 7.6e-3 of SIMT.  Bounds with about 2x headroom.
TOL = {"float16": 2e-3, "bfloat16": 2e-2}


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16
    return np.dtype(name)


def _inputs(rng, dtype, b=1, h=2, hkv=1, nq=24, nk=40, d=16):
    q, k, v, do = (rng.standard_normal(s).astype(dtype)
                   for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d), (b, h, nq, d)))
    return q, k, v, do


def _forward_ref(q, k, v, **kw):
    """``o`` and ``lse`` from the float64 reference in the forward's dtypes (the backward's
    inputs, without simulating a forward)."""
    o, lse = ref.attention(q, k, v, **kw)
    return o.astype(q.dtype), lse.astype(np.float32)


def _close(got, want, tol, what):
    for g, w, name in zip(got, want, "qkv"):
        g = np.asarray(g).astype(np.float64)
        w = np.asarray(w).astype(np.float64)
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err <= tol, f"d{name} ({what}): {err:.3g} of max |d{name}| > {tol}"


def _rel_quad(score, b, h, q_idx, kv_idx, bias):
    """A relative position bias from aux plus a curvature, so score_mod_grad is not 1."""
    return score + 0.1 * score * score + bias[h, q_idx - kv_idx + 40]


def _rel_quad_grad(score, b, h, q_idx, kv_idx, bias):
    return 1.0 + 0.2 * score


@pytest.mark.parametrize("dtype, deterministic", [("float16", False), ("bfloat16", True)])
def test_mma_backward_score_mod_with_its_grad(rng, dtype, deterministic):
    q, k, v, do = _inputs(rng, _dtype(dtype), nq=16, nk=32)
    bias = rng.standard_normal((2, 80)).astype(np.float32)
    kw = dict(score_mod=_rel_quad, aux_tensors=(bias,), causal=True)
    o, lse = numba_flash.forward(q, k, v, return_lse=True, kernel="mma", **kw)
    got = numba_flash.backward(do, q, k, v, o, lse, score_mod_grad=_rel_quad_grad, kernel="mma",
                               deterministic=deterministic, **kw)
    want = ref.attention_backward(do, q, k, v, score_mod_grad=_rel_quad_grad, **kw)
    _close(got, want, TOL[dtype], "mma vs reference")
    simt = numba_flash.backward(do, q, k, v, o, lse, score_mod_grad=_rel_quad_grad,
                                kernel="simt", deterministic=deterministic, **kw)
    _close(got, simt, TOL[dtype], "mma vs simt")
    for g, x in zip(got, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mma_backward_prefix_lm_mask_and_gqa(rng, dtype):
    from numba_flash.ops.backward_mma import backward_mma
    q, k, v, do = _inputs(rng, _dtype(dtype), b=2, h=2, hkv=1, nq=16, nk=16)
    prefix = np.array([5, 12], np.int32)
    kw = dict(mask_mod=prefix_lm_mask, aux_tensors=(prefix,))
    o, lse = _forward_ref(q, k, v, **kw)
    got = backward_mma(do, q, k, v, o, lse, **kw)   # the op module's own entry point
    want = ref.attention_backward(do, q, k, v, **kw)
    _close(got, want, TOL[dtype], "mma vs reference")
    simt = numba_flash.backward(do, q, k, v, o, lse, kernel="simt", **kw)
    _close(got, simt, TOL[dtype], "mma vs simt")


@pytest.fixture
def tile_log(monkeypatch):
    from numba_flash.kernels.core import common
    log = []
    monkeypatch.setattr(common, "TILE_LOG", log)
    return log


def _same_document(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def _tiles(kernel):
    """``(dkdv (Q rows, keys), dq (Q rows, keys))`` per tile of each backward kernel here."""
    if kernel == "mma":
        from numba_flash.kernels.backward.config import backward_mma_config
        dkdv, dq = (backward_mma_config(16, kind) for kind in ("dkdv", "dq"))
        return (dkdv.STEP, dkdv.BLOCK), (dq.BLOCK, dq.STEP)
    from numba_flash.kernels.backward.config import default_tiles
    bm, bn, _, _ = default_tiles(16, np.float16)
    return (bm, bn), (bm, bn)


@pytest.mark.parametrize("kernel", ["mma", "simt"])
def test_block_mask_skips_empty_tiles_in_both_backward_loops(rng, tile_log, kernel):
    """Count the (Q tile, K/V tile) pairs each backward kernel computes (the simulator's tile
    log, dK/dV's then dQ's): with a block mask exactly those it does not call EMPTY, without
    one every pair; the gradients are the per-element mask's."""
    n = 48
    q, k, v, do = _inputs(rng, np.float16, h=1, nq=n, nk=n)
    doc = np.repeat(np.arange(3, dtype=np.int32), [16, 16, 16])[None]
    doc[0, 20:24] = 0  # a document edge inside a block: some blocks PARTIAL
    bm = create_block_mask(_same_document, 1, 1, n, n, aux_tensors=(doc,), BLOCK_SIZE=16)
    kinds = bm.kind[0, 0]
    assert (kinds == 0).any() and (kinds == 1).any() and (kinds == 2).any()
    kw = dict(aux_tensors=(doc,), kernel=kernel, deterministic=True)
    o, lse = _forward_ref(q, k, v, mask_mod=_same_document, aux_tensors=(doc,))
    got = numba_flash.backward(do, q, k, v, o, lse, block_mask=bm, **kw)
    nonempty = np.repeat(np.repeat(kinds != 0, 16, axis=0), 16, axis=1)  # per element
    counts = []
    for tm, tn in _tiles(kernel):   # the dK/dV kernel's log comes first, then the dQ kernel's
        pairs = [(i, j) for i in range(0, n, tm) for j in range(0, n, tn)]
        expect = {(0, i, j // tn) for i, j in pairs if nonempty[i:i + tm, j:j + tn].any()}
        assert 0 < len(expect) < len(pairs)
        part, tile_log[:len(expect)] = tile_log[:len(expect)], []
        assert {(h, qs, kt) for _, h, qs, kt in part} == expect and len(part) == len(expect)
        counts.append(len(pairs))
    assert tile_log == []   # nothing else computed
    per_element = numba_flash.backward(do, q, k, v, o, lse, mask_mod=_same_document, **kw)
    assert len(tile_log) == sum(counts)   # every pair, in both kernels
    for g, p in zip(got, per_element):
        np.testing.assert_array_equal(g, p)
    want = ref.attention_backward(do, q, k, v, mask_mod=_same_document, aux_tensors=(doc,))
    _close(got, want, TOL["float16"], f"{kernel} block mask vs reference")


def _never(b, h, q_idx, kv_idx):
    return q_idx < 0   # masks everything, but only where it is asked


@pytest.mark.parametrize("kernel", ["mma", "simt"])
def test_a_full_block_skips_mask_mod(rng, kernel):
    """A block mask that calls every block FULL (built by hand, contradicting its mask_mod,
    which masks everything): the kernels never ask mask_mod, on the tiles every row sees whole
    and on the diagonal ones alike, so the gradients are plain causal attention's (the
    per-element mask_mod would make them all 0)."""
    n = 32
    q, k, v, do = _inputs(rng, np.float16, h=1, nq=n, nk=n)
    o, lse = _forward_ref(q, k, v, causal=True)
    full = BlockMask(kind=np.full((1, 1, 2, 2), 2, np.int8), shape=(1, 1, n, n), Q_BLOCK=16,
                     KV_BLOCK=16, mask_mod=_never)
    got = numba_flash.backward(do, q, k, v, o, lse, causal=True, block_mask=full, kernel=kernel,
                               deterministic=True)
    _close(got, ref.attention_backward(do, q, k, v, causal=True), TOL["float16"],
           f"{kernel}, every block FULL")


def test_backward_variant_errors_before_launch(rng):
    q, k, v, do = _inputs(rng, np.float16, nq=16, nk=16)
    o = np.zeros_like(q)
    lse = np.zeros(q.shape[:3], np.float32)
    bias = np.zeros((2, 80), np.float32)
    for kernel in ("mma", "simt", "auto"):
        with pytest.raises(ValueError, match="score_mod_grad: the backward of score_mod"):
            numba_flash.backward(do, q, k, v, o, lse, score_mod=_rel_quad, aux_tensors=(bias,),
                                 kernel=kernel)
        with pytest.raises(ValueError, match="aux_tensors: given without"):
            numba_flash.backward(do, q, k, v, o, lse, aux_tensors=(bias,), kernel=kernel)
        with pytest.raises(ValueError, match="score_mod_grad: given without a score_mod"):
            numba_flash.backward(do, q, k, v, o, lse, score_mod_grad=_rel_quad_grad,
                                 kernel=kernel)
