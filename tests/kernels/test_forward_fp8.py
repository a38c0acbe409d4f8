"""The fp8 forward (numba_flash/ops/forward_fp8.py, kernels/forward/fp8.py): e4m3 ``q``, ``k``,
``v`` with FA3's descales on ``mma.sync.m16n8k32`` (the simulator twin here), against the
float64 reference on the dequantised inputs, outputs NaN-poisoned (conftest).

Tolerance, from measurement (docs/fp8.md's table, the simulator, seeds 1-3): the largest
``|o - ref|`` over ``max |v|`` was 0.5 to 1.3 % at unit logits and up to 2.8 % at wide ones (q
x 8, d = 256): ``P``'s three mantissa bits.  The bound is 4 %; ``lse`` (float32, no e4m3
rounding of its own) within 2e-5 of the reference plus 3 float32 ulps of its size.  A build
whose packed ``P`` can pass 448 (``P_OFFSET = 8`` over the threshold 4: FA4's first fp8 build)
misses the bound by 3x to 8x, so the wide-logit test fails if ``P`` is clipped.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from ml_dtypes import bfloat16, float8_e4m3fn, float8_e5m2

import numba_flash
from numba_flash import reference as ref
import numba_flash.ops.forward_fp8 as forward_fp8_op

E4M3 = float8_e4m3fn
#: the bound on max |o - ref| / max |v| (the module docstring's measurement)
O_BOUND = 0.04
LSE_ATOL = 2e-5
#: ... plus 3 float32 ulps of |lse| (wide logits put lse near 100, where an ulp is 7.6e-6)
LSE_RTOL = 4e-7


def fp8_inputs(rng, b=1, h=2, hkv=1, nq=20, nk=41, d=64, q_scale=1.0):
    q = (rng.standard_normal((b, h, nq, d)) * q_scale).astype(E4M3)
    k = rng.standard_normal((b, hkv, nk, d)).astype(E4M3)
    v = rng.standard_normal((b, hkv, nk, d)).astype(E4M3)
    scales = [rng.uniform(0.5, 2.0, (b, hkv)).astype(np.float32) for _ in range(3)]
    return q, k, v, scales


def dequantised(q, k, v, scales):
    """The reference's float64 inputs: each value times its (batch, kv head) descale."""
    qd, kd, vd = scales
    group = q.shape[1] // k.shape[1]
    return (q.astype(np.float64) * np.repeat(qd, group, axis=1)[:, :, None, None],
            k.astype(np.float64) * kd[:, :, None, None],
            v.astype(np.float64) * vd[:, :, None, None])


def check(o, lse, q, k, v, scales, **kw):
    want_o, want_lse = ref.attention(*dequantised(q, k, v, scales), **kw)
    vmax = np.abs(dequantised(q, k, v, scales)[2]).max()
    err = np.abs(o.astype(np.float64) - want_o).max() / vmax
    assert not np.isnan(err), "o has a NaN (an unwritten element or a leak)"
    assert err <= O_BOUND, f"max |o - ref| / max |v| = {err:.4f} > {O_BOUND}"
    np.testing.assert_allclose(lse, want_lse, rtol=LSE_RTOL, atol=LSE_ATOL)
    return err


@pytest.mark.parametrize("d, out, kw", [
    (64, "bfloat16", dict(causal=True)),                      # GQA 4 : 2 below
    (64, "float16", dict(window_size=(9, 3))),
    (64, "bfloat16", dict(softcap=3.0)),
    (64, "bfloat16", dict(alibi_slopes=np.array([0.3, 0.05], np.float32))),
    (64, "float16", dict(learnable_sink=np.array([0.5, -1.0], np.float32))),
    (128, "bfloat16", dict(causal=True)),
    (256, "bfloat16", dict()),
])
def test_fp8_forward_matches_the_reference(rng, d, out, kw):
    """Ragged Nq = 20 of Nk = 41 (a partial key tile), GQA 4 : 2, descales != 1, o in the
    chosen type: the reference of the dequantised inputs at the measured bound (GQA 4 : 2 in
    the first case, 2 : 1 in the others: the simulator's time goes by heads)."""
    gqa42 = d == 64 and kw.get("causal")
    q, k, v, scales = fp8_inputs(rng, h=4 if gqa42 else 2, hkv=2 if gqa42 else 1, d=d)
    qd, kd, vd = scales
    o, lse = numba_flash.forward(q, k, v, return_lse=True, q_descale=qd, k_descale=kd,
                                 v_descale=vd, out_dtype=out, **kw)
    assert o.dtype == np.dtype(bfloat16 if out == "bfloat16" else np.float16)
    assert o.shape == q.shape and lse.dtype == np.float32
    check(o, lse, q, k, v, scales, **kw)


def build_with(monkeypatch, **fields):
    """The op's configuration with ``fields`` replaced (a build the library does not ship)."""
    shipped = forward_fp8_op.forward_fp8_config
    monkeypatch.setattr(forward_fp8_op, "forward_fp8_config",
                        lambda *a, **kw: dataclasses.replace(shipped(*a, **kw), **fields))


def test_wide_logits_keep_p_unclipped(rng, monkeypatch):
    """q x 20 (the issue's wide logits, a sharp softmax): within the bound.  Then FA4's failure
    (flash-attention #2694): scores that rise by 1 from key tile to key tile (below the lazy
    rescale's threshold, so the running max lags) and a value per tile (-2, 0, 2): within the
    bound, while a build whose packed P reaches 2**(8 + 2.9) (offset 8 over the threshold 4:
    clipped at 448) is off by about half of max |v|, so this test fails if P is clipped."""
    q, k, v, scales = fp8_inputs(rng, h=1, nq=16, nk=192, q_scale=20.0)   # three key tiles
    qd, kd, vd = scales
    o, lse = numba_flash.forward(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                 return_lse=True)
    check(o, lse, q, k, v, scales)
    q = (q.astype(np.float32) * 0.005).astype(E4M3)
    q[..., 0] = 8.0                                  # score 8 k[j, 0] / sqrt(64) = k[j, 0] + ~0
    tile = np.arange(192) // 64
    k[..., 0] = (3.0 + tile).astype(E4M3)           # 3, 4, 5: +1 a tile (1.44 in log2)
    v[:] = (2.0 * (tile - 1)).astype(E4M3)[:, None]
    scales = [np.ones_like(x) for x in scales]
    o, lse = numba_flash.forward(q, k, v, return_lse=True)
    check(o, lse, q, k, v, scales)
    build_with(monkeypatch, P_OFFSET=8)
    o_clipped, lse_clipped = numba_flash.forward(q, k, v, return_lse=True)
    with pytest.raises(AssertionError, match=r"max \|o - ref\|"):
        check(o_clipped, lse_clipped, q, k, v, scales)


def test_nan_in_v_reaches_only_the_rows_that_see_it(rng):
    """A NaN value of key 30 in column 5: causal rows before it never see it (their o is the
    reference's), rows at or after it get o[:, 5] = NaN and nothing else; a NaN in a key no
    row sees changes nothing."""
    q, k, v, scales = fp8_inputs(rng, h=2, hkv=1, nq=41, nk=41)
    v[0, 0, 30, 5] = np.nan
    v_seen = v.copy()
    o = numba_flash.forward(q, k, v_seen, causal=True, q_descale=scales[0],
                            k_descale=scales[1], v_descale=scales[2]).astype(np.float64)
    assert np.isnan(o[:, :, 30:, 5]).all() and not np.isnan(o[:, :, :30]).any()
    assert not np.isnan(np.delete(o[:, :, 30:], 5, axis=-1)).any()
    v_clean = v.copy()
    v_clean[0, 0, 30, 5] = 0.0
    want, _ = ref.attention(*dequantised(q, k, v_clean, scales), causal=True)
    vmax = np.abs(dequantised(q, k, v_clean, scales)[2]).max()
    assert np.abs(o[:, :, :30] - want[:, :, :30]).max() / vmax <= O_BOUND


@pytest.mark.parametrize("kw, error, words", [
    (dict(q_descale=np.ones((1, 2), np.float32)), ValueError, "q_descale: expected shape (1, 1)"),
    (dict(k_descale=np.ones((1, 1), np.float64)), TypeError, "k_descale: expected dtype float32"),
    (dict(out_dtype="float32"), ValueError, "out_dtype: expected one of"),
    (dict(dropout_p=0.1), ValueError, "dropout_p: expected 0.0 with e4m3 inputs"),
    (dict(kernel="simt"), ValueError, "kernel: expected one of ('auto', 'mma', 'wgmma')"),
    (dict(block_m=32), ValueError, "block_m: expected None with e4m3 inputs"),
])
def test_bad_fp8_arguments_are_named(rng, kw, error, words):
    q, k, v, _ = fp8_inputs(rng, h=2, hkv=1, nq=4, nk=8)
    with pytest.raises(error, match="^" + words.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace(".", r"\.")):
        numba_flash.forward(q, k, v, **kw)


def test_bad_fp8_inputs_are_named(rng):
    """A head dim that is not a multiple of 32, e5m2, a mix with float16, a descale without
    e4m3 inputs: errors naming the argument before any launch."""
    q, k, v, _ = fp8_inputs(rng, h=2, hkv=1, nq=4, nk=8, d=48)
    with pytest.raises(ValueError, match="^q: expected a head dim that is a multiple of 32"):
        numba_flash.forward(q, k, v)
    q, k, v, _ = fp8_inputs(rng, h=2, hkv=1, nq=4, nk=8)
    with pytest.raises(TypeError, match="^q: expected dtype"):
        numba_flash.forward(q.astype(np.float32).astype(float8_e5m2), k, v)
    with pytest.raises(TypeError, match="^k: "):
        numba_flash.forward(q, k.astype(np.float16), v)
    with pytest.raises(ValueError, match="^v_descale: expected None without e4m3 inputs"):
        numba_flash.forward(*(x.astype(np.float16) for x in (q, k, v)),
                            v_descale=np.ones((1, 1), np.float32))


def test_gpu_below_sm89_is_refused_before_a_launch(rng, monkeypatch):
    """On a (pretended) sm_80: a ValueError naming q from the host checks."""
    from numba_flash.frontend import fp8 as host_fp8

    monkeypatch.setattr(host_fp8, "on_simulator", lambda: False)
    monkeypatch.setattr(host_fp8, "cuda_cc", lambda: (8, 0))
    q, k, v, _ = fp8_inputs(rng, h=2, hkv=1, nq=4, nk=8)
    with pytest.raises(ValueError, match="^q: the e4m3 forward .* compute capability >= 8.9"):
        numba_flash.forward(q, k, v)


@pytest.mark.parametrize("kernel, d, kw", [
    ("mma", 64, dict(causal=True)),
    ("mma", 128, dict(window_size=(5, 2), learnable_sink=np.array([0.5, -1.0], np.float32))),
    ("wgmma", 64, dict(causal=True, alibi_slopes=np.array([[0.3, 0.1], [0.2, 0.05],
                                                           [0.1, 0.1]], np.float32))),
    ("wgmma", 256, dict(softcap=3.0)),
])
def test_fp8_varlen_matches_the_reference(rng, kernel, d, kw):
    """A packed batch of three sequences (10 / 0 / 23 queries against 17 / 5 / 40 keys: an
    empty one), GQA 2 : 1, each with its own descales: ``forward_varlen`` on e4m3 inputs
    against ``reference.attention_varlen`` of the dequantised sequences, on both kernel
    families."""
    len_q, len_k = np.array([10, 0, 23]), np.array([17, 5, 40])
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(len_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 2, d)).astype(E4M3)
    k = rng.standard_normal((cu_k[-1], 1, d)).astype(E4M3)
    v = rng.standard_normal((cu_k[-1], 1, d)).astype(E4M3)
    scales = [rng.uniform(0.5, 2.0, (3, 1)).astype(np.float32) for _ in range(3)]
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=23, max_seqlen_k=40,
                                        return_lse=True, q_descale=scales[0],
                                        k_descale=scales[1], v_descale=scales[2],
                                        kernel=kernel, **kw)
    assert o.shape == q.shape and o.dtype == np.dtype(bfloat16) and lse.shape == (2, 33)
    row_q = np.repeat(np.arange(3), len_q)
    row_k = np.repeat(np.arange(3), len_k)
    qd = q.astype(np.float64) * scales[0][row_q][:, :, None]
    kd = k.astype(np.float64) * scales[1][row_k][:, :, None]
    vd = v.astype(np.float64) * scales[2][row_k][:, :, None]
    want_o, want_lse = ref.attention_varlen(qd, kd, vd, cu_q, cu_k, **kw)
    err = np.abs(o.astype(np.float64) - want_o).max() / np.abs(vd).max()
    assert err <= O_BOUND, err
    np.testing.assert_allclose(lse, want_lse, rtol=LSE_RTOL, atol=LSE_ATOL)


def test_fp8_varlen_refusals_are_named(rng):
    q = rng.standard_normal((8, 2, 64)).astype(E4M3)
    k = rng.standard_normal((8, 1, 64)).astype(E4M3)
    cu = np.array([0, 8], np.int32)
    call = dict(max_seqlen_q=8, max_seqlen_k=8)
    with pytest.raises(ValueError, match="^kv_indices: expected None with e4m3 inputs"):
        numba_flash.forward_varlen(q, k, k, cu, cu, kv_indices=np.zeros((8, 1, 2), np.int32),
                                   **call)
    with pytest.raises(ValueError, match="^dropout_p: expected 0.0 with e4m3 inputs"):
        numba_flash.forward_varlen(q, k, k, cu, cu, dropout_p=0.1, **call)
    with pytest.raises(ValueError, match="^q_descale: expected shape \\(1, 1\\)"):
        numba_flash.forward_varlen(q, k, k, cu, cu, q_descale=np.ones((2, 1), np.float32),
                                   **call)
    with pytest.raises(ValueError, match="^v: expected shape"):
        numba_flash.forward_varlen(q, k, k[:4], cu, cu, **call)
    with pytest.raises(ValueError, match="^kernel: expected 'auto'"):
        numba_flash.forward_varlen(*(x.astype(np.float16) for x in (q, k, k)), cu, cu,
                                   kernel="mma", **call)


def test_fp8_with_token_lists_is_refused(rng):
    """kv_indices with e4m3 inputs: a ValueError naming it (it was once dropped silently)."""
    q, k, v, _ = fp8_inputs(rng, h=2, hkv=1, nq=4, nk=8)
    with pytest.raises(ValueError, match="^kv_indices: expected None with e4m3 inputs"):
        numba_flash.forward(q, k, v, kv_indices=np.zeros((1, 1, 4, 2), np.int32))


@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
def test_fp8_paged_prefill_equals_the_packed_call(rng, kernel):
    """The prefill over an e4m3 paged cache (pages of 8, shuffled, stale pages NaN, -1 past a
    sequence's keys): bit for bit the packed call on the keys gathered by hand, which the
    reference checks; a table entry outside the cache is a ValueError naming block_table."""
    len_q, len_k, bs = np.array([7, 19]), np.array([13, 30]), 8
    cu_q = np.concatenate([[0], np.cumsum(len_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(len_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 2, 64)).astype(E4M3)
    k = rng.standard_normal((cu_k[-1], 1, 64)).astype(E4M3)
    v = rng.standard_normal((cu_k[-1], 1, 64)).astype(E4M3)
    pages = -(-len_k // bs)                       # 2 and 4 pages
    n_blocks = 9
    order = rng.permutation(n_blocks)[:pages.sum()]
    table = np.full((2, 5), -1, np.int32)
    k_cache = np.full((n_blocks, 1, bs, 64), np.nan, np.float32).astype(E4M3)
    v_cache = k_cache.copy()
    at = 0
    for b in range(2):
        for p in range(pages[b]):
            blk = order[at]
            at += 1
            table[b, p] = blk
            rows = slice(cu_k[b] + p * bs, min(cu_k[b] + (p + 1) * bs, cu_k[b + 1]))
            n = rows.stop - rows.start
            k_cache[blk, :, :n] = k[rows].transpose(1, 0, 2)
            v_cache[blk, :, :n] = v[rows].transpose(1, 0, 2)
    scales = [rng.uniform(0.5, 2.0, (2, 1)).astype(np.float32) for _ in range(3)]
    kw = dict(max_seqlen_q=19, max_seqlen_k=30, return_lse=True, causal=True, kernel=kernel,
              q_descale=scales[0], k_descale=scales[1], v_descale=scales[2])
    o, lse = numba_flash.forward_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=table, **kw)
    o_packed, lse_packed = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, **kw)
    np.testing.assert_array_equal(o.view(np.uint16), o_packed.view(np.uint16))
    np.testing.assert_array_equal(lse, lse_packed)
    bad = table.copy()
    bad[1, 3] = n_blocks
    with pytest.raises(ValueError, match="^block_table: expected the entries holding"):
        numba_flash.forward_varlen(q, k_cache, v_cache, cu_q, cu_k, block_table=bad, **kw)


def test_uint8_inputs_with_qkv_dtype_fp8_e4m3(rng):
    """``qkv_dtype="fp8_e4m3"``: uint8 q, k, v (how a CuPy array or a CUDA float8 tensor's
    bytes carry e4m3) read as e4m3, bit for bit the float8_e4m3fn call, forward and varlen;
    "auto" keeps uint8 out, a bad value or a 16-bit input under the flag is named."""
    q, k, v, scales = fp8_inputs(rng, h=2, hkv=1, nq=12, nk=21, d=32)
    call = dict(q_descale=scales[0], k_descale=scales[1], v_descale=scales[2], causal=True,
                return_lse=True)
    want = numba_flash.forward(q, k, v, **call)
    got = numba_flash.forward(*(x.view(np.uint8) for x in (q, k, v)), qkv_dtype="fp8_e4m3",
                              **call)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8))
    cu = np.array([0, 12], np.int32), np.array([0, 21], np.int32)
    packed = [x[0].transpose(1, 0, 2).copy() for x in (q, k, v)]
    want = numba_flash.forward_varlen(*packed, *cu, max_seqlen_q=12, max_seqlen_k=21, **call)
    got = numba_flash.forward_varlen(*(x.view(np.uint8) for x in packed), *cu, max_seqlen_q=12,
                                     max_seqlen_k=21, qkv_dtype="fp8_e4m3", **call)
    for g, w in zip(got, want):
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8))
    u8 = [x.view(np.uint8) for x in (q, k, v)]
    with pytest.raises(TypeError, match="^q: expected dtype in"):
        numba_flash.forward(*u8)
    with pytest.raises(ValueError, match="^qkv_dtype: expected one of \\('auto', 'fp8_e4m3'\\)"):
        numba_flash.forward(*u8, qkv_dtype="e4m3")
    with pytest.raises(TypeError, match="^k: expected uint8 \\(or float8_e4m3fn\\) with "
                                        "qkv_dtype='fp8_e4m3', got float16"):
        numba_flash.forward(u8[0], k.astype(np.float16), u8[2], qkv_dtype="fp8_e4m3")
