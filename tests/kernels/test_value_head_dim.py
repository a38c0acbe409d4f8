"""A value head dim of its own (issue 35): ``v [.., d_v]`` beside ``q``, ``k [.., d]``, and MLA's
absorbed decode (one latent cache, the value its first ``head_dim_v`` columns).

Forward, backward, varlen (packed and paged) and decode run the SIMT / decode kernels with one
compiled ``HEAD_DIM`` that holds both widths, each array read at its own (``o``, ``do``, ``dv``
have ``d_v`` columns, the default scale stays ``1/sqrt(d)``).  Against the float64 reference at
the bounds of the kernels' own tests (helpers.atol: the padded columns are zeros, so they add
nothing); the tensor-core forward and backward too (``OWN_V``: Q and K tiles ``d`` rounded up
to 16 wide, V and dO tiles ``d_v``'s; 16-byte copies when both widths are multiples of 8, else
16-bit loads), and backward_varlen; MLA prefill's (192, 128) on both kernel families.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import LSE_DTYPE, assert_close, randn
from test_decode_kernel import paged_cache, some_cache


@pytest.mark.parametrize("d, d_v, dtype", [(24, 8, np.float32), (8, 20, np.float16),
                                            (12, 40, np.float64), (40, 12, np.float32)])
def test_forward_with_a_value_head_dim(rng, d, d_v, dtype):
    q = randn(rng, (2, 4, 9, d), dtype)
    k, v = randn(rng, (2, 2, 13, d), dtype), randn(rng, (2, 2, 13, d_v), dtype)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    want_o, want_lse = ref.attention(q, k, v, causal=True)
    assert o.shape == (2, 4, 9, d_v) and o.dtype == dtype
    scale = max(1.0, np.abs(want_o).max()) if dtype == np.float16 else 1.0
    assert_close(o, want_o, dtype, scale=scale, name="o")
    assert_close(lse, want_lse, LSE_DTYPE[dtype], name="lse")


def test_forward_value_head_dim_with_variants(rng):
    """Window, softcap, ALiBi, a sink, dropout and a user's score_mod on the same path."""
    q = randn(rng, (1, 2, 11, 16))
    k, v = randn(rng, (1, 1, 14, 16)), randn(rng, (1, 1, 14, 8))
    sink = np.array([1.5, 0.5], np.float32)
    kw = dict(window_size=(5, 2), softcap=3.0, alibi_slopes=np.array([0.5, 0.25], np.float32),
              learnable_sink=sink)
    o = numba_flash.forward(q, k, v, **kw)
    assert_close(o, ref.attention(q, k, v, **kw)[0], np.float32, name="o variants")
    mask = numba_flash.dropout_mask(3, 1, 2, 11, 14, 0.2)
    o = numba_flash.forward(q, k, v, dropout_p=0.2, seed=3)
    want = ref.attention(q, k, v, dropout_mask=mask, dropout_p=0.2)[0]
    assert_close(o, want, np.float32, name="o dropout")

    def bias(score, b, h, qi, ki):
        return score + 0.1 * (qi - ki)

    o = numba_flash.forward(q, k, v, score_mod=bias)
    assert_close(o, ref.attention(q, k, v, score_mod=bias)[0], np.float32, name="o score_mod")


@pytest.mark.parametrize("d, d_v, dtype, deterministic", [
    (24, 8, np.float32, False), (8, 20, np.float32, True), (16, 8, np.float16, False),
    (12, 40, np.float64, False)])
def test_backward_with_a_value_head_dim(rng, d, d_v, dtype, deterministic):
    """(dq, dk [.., d], dv [.., d_v]) from the SIMT backward, GQA, causal, a sink (dsink)."""
    q, do = randn(rng, (1, 4, 9, d), dtype), randn(rng, (1, 4, 9, d_v), dtype)
    k, v = randn(rng, (1, 2, 13, d), dtype), randn(rng, (1, 2, 13, d_v), dtype)
    sink = np.array([1.0, -np.inf, 0.5, 2.0], np.float32)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    got = numba_flash.backward(do, q, k, v, o, lse, causal=True, deterministic=deterministic,
                               learnable_sink=sink)
    want = ref.attention_backward(do, q, k, v, causal=True, learnable_sink=sink)
    for name, g, w, x in zip(("dq", "dk", "dv", "dsink"), got, want, (q, k, v, sink)):
        assert g.shape == x.shape, name
        scale = max(1.0, np.abs(w).max()) if dtype == np.float16 else 1.0
        # dsink: float32, but from o and dO in the inputs' dtype (float16: their rounding)
        assert_close(g, w, dtype if dtype != np.float64 else np.float32 if name == "dsink"
                     else dtype, scale=scale, name=name)


def test_backward_varlen_with_a_value_head_dim(rng):
    """Packed sequences (one without queries), GQA, causal: dq, dk [.., 24], dv [.., 8]."""
    cu_q = np.array([0, 5, 5, 12], np.int32)
    cu_k = np.array([0, 7, 9, 15], np.int32)
    q, do = randn(rng, (12, 4, 24)), randn(rng, (12, 4, 8))
    k, v = randn(rng, (15, 2, 24)), randn(rng, (15, 2, 8))
    kw = dict(max_seqlen_q=7, max_seqlen_k=7, causal=True)
    o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, return_lse=True, **kw)
    got = numba_flash.backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, **kw)
    want = ref.attention_backward_varlen(do, q, k, v, cu_q, cu_k, causal=True)
    for name, g, w, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert g.shape == x.shape, name
        assert_close(g, w, np.float32, name=name)


@pytest.mark.parametrize("paged", [False, True])
def test_varlen_with_a_value_head_dim(rng, paged):
    cu_q = np.array([0, 5, 5, 12], np.int32)
    cu_k = np.array([0, 7, 9, 15], np.int32)
    q = randn(rng, (12, 2, 24))
    k, v = randn(rng, (15, 1, 24)), randn(rng, (15, 1, 8))
    want_o, want_lse = ref.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    kw = dict(max_seqlen_q=7, max_seqlen_k=7, causal=True, return_lse=True)
    if not paged:
        o, lse = numba_flash.forward_varlen(q, k, v, cu_q, cu_k, **kw)
    else:   # the same keys in pages of 4 slots, in a shuffled table
        lens = np.diff(cu_k)
        k_c, _, table = paged_cache(rng, 3, 1, 24, lens, 4, np.float32)
        v_c = np.full(k_c.shape[:3] + (8,), np.nan, np.float32)
        for s in range(3):
            t = np.arange(lens[s])
            k_c[table[s, t // 4], :, t % 4] = k[cu_k[s]:cu_k[s + 1]]
            v_c[table[s, t // 4], :, t % 4] = v[cu_k[s]:cu_k[s + 1]]
        o, lse = numba_flash.forward_varlen(q, k_c, v_c, cu_q, cu_k, block_table=table, **kw)
    assert o.shape == (12, 2, 8)
    assert_close(o, want_o, np.float32, name="o")
    np.testing.assert_allclose(lse, want_lse, atol=2e-5)


@pytest.mark.parametrize("d, d_v, paged, num_splits", [(16, 8, True, 3), (8, 24, False, 1),
                                                       (12, 20, True, None)])
def test_decode_with_a_value_head_dim(rng, d, d_v, paged, num_splits):
    b, h, hkv = 2, 4, 2
    lens = np.array([29, 7])
    k, _, table = some_cache(rng, paged, b, hkv, d, lens, np.float32, 5, 32)
    v = randn(rng, k.shape[:3] + (d_v,))
    q = randn(rng, (b, h, 2, d))
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table,
                                num_splits=num_splits, causal=True, return_lse=True)
    want_o, want_lse, _, _ = ref.kvcache_decode(q, k, v, lens, block_table=table, causal=True)
    assert o.shape == (b, h, 2, d_v)
    assert_close(o, want_o, np.float32, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")


def test_decode_appends_a_value_of_its_own_width(rng):
    """k_new [.., d] and v_new [.., d_v] appended (append_kv's kernel: each cache at its own
    width), then attended; append_kv alone does the same."""
    b, hkv, d, d_v = 2, 1, 16, 8
    lens = np.array([5, 9])
    k, v = randn(rng, (b, hkv, 16, d)), randn(rng, (b, hkv, 16, d_v))
    kn, vn = randn(rng, (b, hkv, 2, d)), randn(rng, (b, hkv, 2, d_v))
    q = randn(rng, (b, 2, d))
    want = ref.kvcache_decode(q, k, v, lens, k_new=kn, v_new=vn)
    k2, v2 = k.copy(), v.copy()
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, k_new=kn, v_new=vn,
                                return_lse=True)
    assert_close(o, want[0], np.float32, name="o")
    np.testing.assert_array_equal(k, want[2].astype(np.float32))
    np.testing.assert_array_equal(v, want[3].astype(np.float32))
    new = numba_flash.append_kv(k2, v2, kn, vn, lens)
    np.testing.assert_array_equal(new, lens + 2)
    np.testing.assert_array_equal(v2, v)


@pytest.mark.parametrize("paged, num_splits, kernel", [(True, 2, "mma"), (False, 1, "simt")])
def test_mla_absorbed_decode(rng, paged, num_splits, kernel):
    """DeepSeek's shapes: one latent KV head of 576 (512 latent + 64 rope), 8 query heads, the
    value the first 512 columns of the same cache (FlashMLA's page size 64), a sink: against
    the reference on the cache and its first 512 columns, on the tensor-core kernel
    (kernels/decode/mla.py, what kernel="auto" takes; test_mla_decode.py runs it on a
    contiguous cache) and the SIMT decode."""
    b, h, d, d_v = 2, 8, 576, 512
    lens = np.array([40, 9])
    k, _, table = some_cache(rng, paged, b, 1, d, lens, np.float16, 64, 72)
    q = randn(rng, (b, h, d), np.float16, scale=0.2)
    sink = (rng.standard_normal(h) + 2.0).astype(np.float32)
    before = k.copy()
    o, lse = numba_flash.decode(q, k, None, head_dim_v=d_v, cache_seqlens=lens,
                                block_table=table, num_splits=num_splits, return_lse=True,
                                learnable_sink=sink, kernel=kernel)
    want_o, want_lse = ref.paged_decode(q, k, k[..., :d_v], lens, table, learnable_sink=sink)
    assert o.shape == (b, h, d_v) and o.dtype == np.float16
    assert_close(o, want_o, np.float16, name="o")
    assert_close(lse, want_lse, np.float32, name="lse")
    np.testing.assert_array_equal(k, before)     # read twice, never written


@pytest.mark.parametrize("call, err, words", [
    (lambda q, k, v: numba_flash.forward(q, k, np.zeros((1, 1, 5, 300), np.float32)),
     ValueError, "1..256"),
    (lambda q, k, v: numba_flash.forward(q, k, np.zeros((1, 1, 4, 8), np.float32)),
     ValueError, "d_v"),
    (lambda q, k, v: numba_flash.backward(q, q, k, v, q, np.zeros((1, 2, 3), np.float32)),
     ValueError, "do: expected the shape of q with v's head dim (1, 2, 3, 8)"),
    (lambda q, k, v: numba_flash.backward_varlen(
        q[0, 0][:, None], q[0, 0][:, None], k[0, 0][:, None], v[0, 0][:, None],
        q[0, 0][:, None], np.zeros((1, 3), np.float32), np.array([0, 3], np.int32),
        np.array([0, 5], np.int32), max_seqlen_q=3, max_seqlen_k=5),
     ValueError, "do: expected the shape of q with v's head dim (3, 1, 8)"),
    (lambda q, k, v: numba_flash.decode(q[:, :, 0], k, None, cache_seqlens=np.array([5])),
     ValueError, "head_dim_v"),
    (lambda q, k, v: numba_flash.decode(q[:, :, 0], k, None, cache_seqlens=np.array([5]),
                                        head_dim_v=17), ValueError, "head_dim_v"),
    (lambda q, k, v: numba_flash.decode(q[:, :, 0], k, v, cache_seqlens=np.array([5]),
                                        head_dim_v=8), ValueError, "head_dim_v"),
    (lambda q, k, v: numba_flash.decode(q[:, :, 0], k, None, cache_seqlens=np.array([5]),
                                        head_dim_v=8, k_new=k[:, :, :1], v_new=k[:, :, :1]),
     ValueError, "k_new"),
])
def test_value_head_dim_bad_input_is_named(rng, call, err, words):
    q, k, v = randn(rng, (1, 2, 3, 16)), randn(rng, (1, 1, 5, 16)), randn(rng, (1, 1, 5, 8))
    with pytest.raises(err) as info:
        call(q, k, v)
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("d, d_v, dtype", [(24, 8, "float16"), (8, 20, "float16"),
                                            (40, 24, "bfloat16")])
def test_the_tensor_core_forward_with_a_value_head_dim(rng, d, d_v, dtype):
    """OWN_V: K tiles of ``d`` rounded up to 16, V tiles of ``d_v``'s (16-bit loads for these
    widths); test_mma_forward.py's bounds (float16 2e-3 of max(1, |o|); bfloat16 1.6e-2)."""
    from ml_dtypes import bfloat16
    from helpers import assert_scaled_close
    np_dtype = np.float16 if dtype == "float16" else bfloat16
    q = rng.standard_normal((1, 2, 19, d)).astype(np_dtype)
    k = rng.standard_normal((1, 1, 23, d)).astype(np_dtype)
    v = rng.standard_normal((1, 1, 23, d_v)).astype(np_dtype)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True, kernel="mma")
    want_o, want_lse = ref.attention(q, k, v, causal=True)
    assert o.shape == (1, 2, 19, d_v)
    assert_scaled_close(np.asarray(o, np.float64), want_o,
                        2e-3 if dtype == "float16" else 1.6e-2, name="o")
    assert_scaled_close(lse, want_lse, 2e-6, name="lse")


@pytest.mark.parametrize("d, d_v, dtype, deterministic, nq, nk", [
    (24, 8, "float16", False, 19, 23), (8, 20, "bfloat16", True, 19, 23),
    (200, 136, "float16", True, 5, 7)])
def test_the_tensor_core_backward_with_a_value_head_dim(rng, d, d_v, dtype, deterministic, nq,
                                                        nk):
    """OWN_V in both tensor-core backward kernels (atomic dQ, and the deterministic dQ
    kernel): dq, dk [.., d], dv [.., d_v] at test_mma_backward.py's bounds (float16 2.5e-3 of
    max(1, |grad|), bfloat16 2e-2), GQA, causal, ragged.  (200, 136): tiles 208 and 144 wide,
    past ``ONE_PASS_COLUMNS``: dV in two passes of 80 and 64 columns, dK in 112 and 96, the
    deterministic dQ in two (16-byte copies, the chunks past each width zero-filled)."""
    from ml_dtypes import bfloat16
    from helpers import assert_scaled_close
    np_dtype = np.float16 if dtype == "float16" else bfloat16
    q, do = (rng.standard_normal((1, 2, nq, w)).astype(np_dtype) for w in (d, d_v))
    k, v = (rng.standard_normal((1, 1, nk, w)).astype(np_dtype) for w in (d, d_v))
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True, kernel="mma")
    got = numba_flash.backward(do, q, k, v, o, lse, causal=True, kernel="mma",
                               deterministic=deterministic)
    want = ref.attention_backward(do, q, k, v, causal=True)
    for name, g, w, x in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        assert g.shape == x.shape and g.dtype == np_dtype, name
        assert_scaled_close(np.asarray(g, np.float64), w,
                            2.5e-3 if dtype == "float16" else 2e-2, name=name)


def test_mla_prefill_head_dims_on_both_kernel_families(rng):
    """DeepSeek's MLA prefill shape, (d, d_v) = (192, 128): forward and backward on tensor cores
    (float16; K and Q tiles 192 wide, V and dO tiles 128 in both tensor-core directions, the
    backward's dK and dV in one pass) and SIMT (float32), causal, against the float64 reference
    (GQA with d_v: the tests above)."""
    from helpers import assert_scaled_close
    from numba_flash.kernels.backward.mma import dkdv_passes
    from numba_flash.kernels.backward.config import backward_mma_config
    assert dkdv_passes(192, False, 128) == [dict(WANT_DV=True, WANT_DK=True, DQ_ATOMIC=True)]
    gpu = backward_mma_config(192, "dkdv", simulator=False, head_dim_v=128)
    assert (gpu.HEAD_DIM, gpu.HEAD_DIM_V, gpu.V_ROW_BYTES) == (192, 128, 272)
    for kernel, dtype, tol in (("mma", np.float16, (2e-3, 2.5e-3)),
                               ("simt", np.float32, (None, None))):
        q, do = (rng.standard_normal((1, 1, 5, w)).astype(dtype) for w in (192, 128))
        k, v = (rng.standard_normal((1, 1, 7, w)).astype(dtype) for w in (192, 128))
        o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True, kernel=kernel)
        grads = numba_flash.backward(do, q, k, v, o, lse, causal=True, kernel=kernel)
        want_o, want_lse = ref.attention(q, k, v, causal=True)
        want = ref.attention_backward(do, q, k, v, causal=True)
        for name, g, w, t in zip(("o", "dq", "dk", "dv"), (o, *grads), (want_o, *want),
                                 (tol[0], tol[1], tol[1], tol[1])):
            if t is None:
                assert_close(g, w, dtype, name=f"{kernel} {name}")
            else:
                assert_scaled_close(np.asarray(g, np.float64), w, t, name=f"{kernel} {name}")
        assert_scaled_close(lse, want_lse, 2e-6, name=f"{kernel} lse")
