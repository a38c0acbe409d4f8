"""The e4m3 warpgroup forward (kernels/forward/wgmma_fp8.py, ``forward(..., kernel="wgmma")``
with e4m3 inputs) and its primitives (kernels/ptx/wgmma.py's ``m64nNk32`` e4m3 twin, the
8-bit ``A`` register layout, the P packing), in the simulator, against float64, outputs
NaN-poisoned (conftest).

Bounds: the GEMM twin multiplies e4m3 values exactly and sums in float64 before one float32
rounding (test_wgmma.py's bound); the forward is held to test_forward_fp8.py's measured bound
(4 % of max |v|; measured here 0.5 % to 1.5 % at unit logits, seeds 1-3), ``lse`` within 2e-5.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from ml_dtypes import bfloat16, float8_e4m3fn

import numba_flash
from numba_flash import simulator
from numba_flash.kernels.ptx import mma_fp8, wgmma
from numba_flash.kernels.forward import config as fconfig
from numba_flash.kernels.forward.wgmma_fp8 import vt_fill_probe_kernel
import numba_flash.ops.forward_fp8 as forward_fp8_op

from tests.kernels.test_forward_fp8 import check, dequantised, fp8_inputs
from tests.kernels.test_wgmma import cute, within

E4M3 = float8_e4m3fn


def e4m3(rng, shape, scale=1.0):
    """Random-normal e4m3 values (float64) and their bytes as byte pairs (uint16)."""
    x = (rng.standard_normal(shape) * scale).astype(E4M3)
    return x.astype(np.float64), np.ascontiguousarray(x).view(np.uint8).view(np.uint16)


def launch(kernel, *args, threads=128):
    with simulator.fast_switching():
        kernel[1, threads](*args)


# -- the primitives ---------------------------------------------------------------------------
def test_a8_layout_is_cutlass_alayout_64x32_and_the_mma_sync_layout_per_warp():
    """Byte ``i`` of thread ``r``: CUTLASS's ``ALayout_64x32`` (8-bit register source:
    ``((4, 8, 4), (4, 2, 2)) : ((256, 1, 16), (64, 8, 1024))`` over the column-major 64 x 32),
    every element once, and per warp ``mma.m16n8k32``'s ``A`` (kernels/ptx/mma_fp8.py)."""
    rows, cols = wgmma.a8_tables()
    seen = set()
    for r in range(128):
        for i in range(16):
            off = cute(((4, 8, 4), (4, 2, 2)), ((256, 1, 16), (64, 8, 1024)), (r, i))
            assert (rows[r, i], cols[r, i]) == (off % 64, off // 64)
            assert (rows[r, i] - 16 * (r >> 5), cols[r, i]) == mma_fp8.a_coords(r & 31, i)
            seen.add((rows[r, i], cols[r, i]))
    assert len(seen) == 64 * 32


#: (N, K, swizzle, A source, warpgroups): every N the forwards use, SS and RS, the three
#: swizzles (rows of 32, 64, 128 bytes and more), two warpgroups sharing B
GEMMS = [(128, 128, 128, "smem", 1), (64, 64, 64, "regs", 1), (32, 32, 32, "smem", 1),
         (256, 64, 64, "regs", 1), (32, 256, 128, "regs", 2), (64, 128, 128, "smem", 2)]


@pytest.mark.parametrize("N, K, swizzle, a_src, wgs", GEMMS)
def test_e4m3_gemm_matches_float64(rng, N, K, swizzle, a_src, wgs):
    """``d = a @ B + c`` on ``m64nNk32`` e4m3 steps (``B`` K-major: the only e4m3 major)."""
    M = 64 * wgs
    a, a8 = e4m3(rng, (M, K))
    bt, bt8 = e4m3(rng, (N, K))
    c = rng.standard_normal((M, N)).astype(np.float32)
    d = np.full((M, N), np.nan, np.float32)
    launch(wgmma.wgmma_gemm_kernel(N, K, "e4m3", swizzle, a_src, "K", wgs), a8, bt8, c, d,
           threads=128 * wgs)
    within(d, a @ bt.T + c, K)


def test_e4m3_operands_are_k_major_only():
    with pytest.raises(ValueError, match="^TRANS_A, TRANS_B: e4m3 operands are K-major"):
        wgmma.make_wgmma(64, "e4m3", "smem", 0, 1)


def test_vt_fill_is_the_transpose_in_p_key_order(rng):
    """The fill's ``V^T`` tile, read back through the layout's offsets: row ``c`` byte ``k``
    is ``v[p_key_of_k(k), c]`` of each 32-key step, zeros past ``nk``, NaN bytes zeroed and
    reported only by the masked build."""
    BLOCK_N, D, THREADS, SW = 64, 64, 128, 64
    lay = wgmma.TileLayout(D, BLOCK_N // 2, SW)
    v = rng.integers(0, 0x7E, (BLOCK_N, D), dtype=np.uint8)   # no NaN
    v[3, 7] = 0x7F
    words = np.ascontiguousarray(v).view(np.uint32).reshape(-1)
    for masked, nk in ((True, 50), (False, BLOCK_N)):
        out = np.zeros(1024, np.uint32)
        bad = np.zeros(1, np.int32)
        launch(vt_fill_probe_kernel(BLOCK_N, D, THREADS, SW, masked), out, words, bad, nk,
               threads=THREADS)
        tile = out.view(np.uint8)[lay.offsets()[:, :, None] + np.arange(2)].reshape(D, BLOCK_N)
        keys = np.array([32 * (k // 32) + mma_fp8.p_key_of_k(k % 32) for k in range(BLOCK_N)])
        want = v[keys].T.copy()
        want[:, keys >= nk] = 0
        if masked:
            want[want == 0x7F] = 0
        np.testing.assert_array_equal(tile, want)
        assert bad[0] == int(masked)


# -- the forward ------------------------------------------------------------------------------
def wgmma_fp8(q, k, v, scales, kernel="wgmma", **kw):
    qd, kd, vd = scales
    return numba_flash.forward(q, k, v, return_lse=True, q_descale=qd, k_descale=kd,
                               v_descale=vd, kernel=kernel, **kw)


@pytest.mark.parametrize("d, out, kw", [
    (64, "bfloat16", dict(causal=True)),                      # GQA 4 : 2
    (64, "float16", dict(window_size=(9, 3))),
    (64, "bfloat16", dict(softcap=3.0)),
    (64, "bfloat16", dict(alibi_slopes=np.array([0.3, 0.1, 0.2, 0.05], np.float32))),
    (64, "float16", dict(learnable_sink=np.array([0.5, -1.0, 2.0, 0.0], np.float32))),
    (128, "bfloat16", dict(causal=True)),
    (256, "bfloat16", dict()),
])
def test_wgmma_fp8_forward_matches_the_reference(rng, d, out, kw):
    """Ragged Nq = 20 of Nk = 41 (a partial key tile), GQA, descales != 1, o in the chosen
    type: the reference of the dequantised inputs at the measured bound."""
    h = 4 if d == 64 else 2
    q, k, v, scales = fp8_inputs(rng, h=h, hkv=2 if d == 64 else 1, d=d)
    o, lse = wgmma_fp8(q, k, v, scales, out_dtype=out, **kw)
    assert o.dtype == np.dtype(bfloat16 if out == "bfloat16" else np.float16)
    check(o, lse, q, k, v, scales, **kw)


def test_gpu_tiles_in_the_simulator(rng, monkeypatch):
    """The GPU's build at d = 64 (two warpgroups, 128-key tiles, V^T rows of one 128-byte
    swizzle row) run by the twin: two batches, causal, Nk = 150 (a partial second tile)."""
    shipped = forward_fp8_op.forward_wgmma_fp8_config
    monkeypatch.setattr(forward_fp8_op, "forward_wgmma_fp8_config",
                        lambda *a, **kw: shipped(*a, simulator=False, **kw))
    q, k, v, scales = fp8_inputs(rng, b=2, h=1, hkv=1, nq=40, nk=150, d=64)
    o, lse = wgmma_fp8(q, k, v, scales, causal=True)
    check(o, lse, q, k, v, scales, causal=True)


def test_wide_logits_keep_p_unclipped(rng, monkeypatch):
    """test_forward_fp8.py's wide-logit and FA4 cases on the warpgroup build: within the
    bound, while a build whose packed P can pass 448 (offset 8 over the threshold 4) misses
    it, so this test fails if P is clipped."""
    q, k, v, scales = fp8_inputs(rng, h=1, nq=16, nk=192, q_scale=20.0)
    o, lse = wgmma_fp8(q, k, v, scales)
    check(o, lse, q, k, v, scales)
    q = (q.astype(np.float32) * 0.005).astype(E4M3)
    q[..., 0] = 8.0
    tile = np.arange(192) // 64
    k[..., 0] = (3.0 + tile).astype(E4M3)
    v[:] = (2.0 * (tile - 1)).astype(E4M3)[:, None]
    scales = [np.ones_like(x) for x in scales]
    o, lse = wgmma_fp8(q, k, v, scales)
    check(o, lse, q, k, v, scales)
    shipped = forward_fp8_op.forward_wgmma_fp8_config
    monkeypatch.setattr(forward_fp8_op, "forward_wgmma_fp8_config",
                        lambda *a, **kw: dataclasses.replace(shipped(*a, **kw), P_OFFSET=8))
    o_clipped, lse_clipped = wgmma_fp8(q, k, v, scales)
    with pytest.raises(AssertionError, match=r"max \|o - ref\|"):
        check(o_clipped, lse_clipped, q, k, v, scales)


def test_nan_in_v_reaches_only_the_rows_that_see_it(rng):
    """A NaN value of key 30 in column 5 (a masked tile): causal rows before it keep the
    reference's o, rows at or after it get o[:, 5] = NaN and nothing else.  A NaN in a key of
    an unmasked tile (key 2, every row after 34 sees the whole first tile) makes the column
    NaN for every row that sees it."""
    q, k, v, scales = fp8_inputs(rng, h=2, hkv=1, nq=41, nk=41)
    v[0, 0, 30, 5] = np.nan
    o, _ = wgmma_fp8(q, k, v, scales, causal=True)
    o = o.astype(np.float64)
    assert np.isnan(o[:, :, 30:, 5]).all() and not np.isnan(o[:, :, :30]).any()
    assert not np.isnan(np.delete(o[:, :, 30:], 5, axis=-1)).any()
    v_clean = v.copy()
    v_clean[0, 0, 30, 5] = 0.0
    want, _ = numba_flash.reference.attention(*dequantised(q, k, v_clean, scales), causal=True)
    vmax = np.abs(dequantised(q, k, v_clean, scales)[2]).max()
    assert np.abs(o[:, :, :30] - want[:, :, :30]).max() / vmax <= 0.04
    v = v_clean
    v[0, 0, 2, 9] = np.nan
    o, _ = wgmma_fp8(q, k, v, scales)
    o = o.astype(np.float64)
    assert np.isnan(o[..., 9]).all() and not np.isnan(np.delete(o, 9, axis=-1)).any()


def test_bad_wgmma_fp8_calls_are_named(rng, monkeypatch):
    """A head dim the warpgroup build has no tiles for, and a GPU that is not sm_90: errors
    naming the argument before any launch."""
    q, k, v, _ = fp8_inputs(rng, h=2, hkv=1, nq=4, nk=8, d=96)
    with pytest.raises(ValueError, match=r"^q: kernel='wgmma' takes e4m3 head dims \(64, 128, "
                                         r"256\), got 96; use kernel='mma'"):
        numba_flash.forward(q, k, v, kernel="wgmma")
    from numba_flash.frontend import kernel_choice

    monkeypatch.setattr(kernel_choice, "cuda_cc", lambda: (8, 9))
    q, k, v, _ = fp8_inputs(rng, h=2, hkv=1, nq=4, nk=8)
    with pytest.raises(ValueError, match="^kernel: 'wgmma' needs a GPU of compute capability "
                                         "9.0"):
        numba_flash.forward(q, k, v, kernel="wgmma")
    with pytest.raises(ValueError, match="^head_dim: expected one of"):
        fconfig.forward_wgmma_fp8_config(96)


def test_a_users_score_mod_mask_mod_and_block_mask(rng):
    """test_forward_wgmma.py's relative bias and document mask (aux arrays) on e4m3 inputs with
    descales != 1, every tile through mask_mod and then with a block mask (EMPTY tiles skipped,
    FULL ones unmasked): the reference of the dequantised inputs with the same functions."""
    from numba_flash.flex import create_block_mask

    from tests.kernels.test_forward_wgmma import _doc_mask, _rel

    q, k, v, scales = fp8_inputs(rng, h=2, hkv=1, nq=24, nk=40, d=64)
    bias = rng.standard_normal((2, 80)).astype(np.float32)
    doc = np.repeat(np.arange(3, dtype=np.int32), [10, 14, 16])[None]

    def both(score, b, h, q_idx, kv_idx, bias, doc):
        return _rel(score, b, h, q_idx, kv_idx, bias)

    def docs(b, h, q_idx, kv_idx, bias, doc):
        return _doc_mask(b, h, q_idx, kv_idx, doc)

    kw = dict(score_mod=both, mask_mod=docs, aux_tensors=(bias, doc))
    bm = create_block_mask(docs, 1, None, 24, 40, aux_tensors=(bias, doc), BLOCK_SIZE=32)
    for kernel in ("wgmma", "mma"):   # both fp8 builds
        for mask in (None, bm):
            o, lse = wgmma_fp8(q, k, v, scales, block_mask=mask, **{**kw, "kernel": kernel})
            check(o, lse, q, k, v, scales, **kw)
