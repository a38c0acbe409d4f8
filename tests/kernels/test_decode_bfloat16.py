"""bfloat16 (issue 23) on decode (paged and contiguous caches, GQA, a variant, the fused append +
rotary), merge_states, append_kv and apply_rotary: ml_dtypes.bfloat16 in, bfloat16 out (lse
float32), against the float64 reference; a bfloat16 array mixed with float16 is a TypeError
naming the argument.

Simulator launch shapes (kernels/decode/config.py): d = 32 is the 16-byte-load build (``VEC``: 8
bfloat16 per lane chunk, read as 4 float32 and split into words), d = 12 the element-load build
(padded head dim 16).  Errors are ``max |got - ref| / max(1, max |ref|)`` (``lse``: absolute);
each tolerance sits beside the largest error measured for it (:data:`MEASURED`)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from test_decode_kernel import contiguous_cache, paged_cache
from test_decode_kvcache import make_case

BF16 = np.dtype(ml_dtypes.bfloat16)

#: the largest errors measured over 8 seeds of every case below (simulator, 2026-12-01).
#: bfloat16 keeps 8 significant bits: the output's own rounding is up to 2**-9 = 2.0e-3 of
#: |o| (o and merge; rotary: of the rotated k); the fused case also attends to q and k_new
#: rounded to bfloat16 after the rotation (as flash-attn), which the float64 oracle does not
#: round.  lse is float32 from exact bfloat16 inputs (no output rounding), except the fused
#: case's rounded rotations.
MEASURED = {"o": 3.2e-3, "lse": 3.2e-7, "o_fused": 4.1e-3, "lse_fused": 6.3e-3,
            "merge": 3.4e-3, "rotary": 2.9e-3}
#: tolerances: about 2x the measured maxima (o as tests/kernels/test_bfloat16.py's 7e-3)
TOL = {"o": 7e-3, "lse": 1e-6, "o_fused": 8e-3, "lse_fused": 1.3e-2, "merge": 7e-3,
       "rotary": 6e-3}


def scaled_err(got, want):
    got = np.asarray(got, np.float64)
    assert not np.isnan(got).any(), "NaN in an output (unwritten element or NaN leak)"
    return float(np.abs(got - want).max() / max(1.0, np.abs(want).max()))


def lse_err(got, want):
    fin = np.isfinite(want)
    assert np.array_equal(np.asarray(got)[~fin], want[~fin])  # -inf rows stay -inf
    return float(np.abs(np.asarray(got, np.float64)[fin] - want[fin]).max(initial=0.0))


def bf16(rng, *shape):
    return rng.standard_normal(shape).astype(BF16)


# -- the cases: each returns {quantity: error} -----------------------------------------------------
def case_paged_gqa(rng):
    """Paged (block size 3), GQA 4:2, Nq = 2, d = 32 (16-byte loads), 3 splits and the fused
    combine; stale slots NaN."""
    b, h, hkv, d = 2, 4, 2, 32
    lens = np.array([7, 13], np.int32)
    k, v, table = paged_cache(rng, b, hkv, d, lens, 3, BF16)
    q = bf16(rng, b, h, 2, d)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, block_table=table, num_splits=3,
                                return_lse=True)
    assert o.dtype == BF16 and lse.dtype == np.float32
    want_o, want_lse = ref.paged_decode(q, k, v, lens, table)
    return {"o": scaled_err(o, want_o), "lse": lse_err(lse, want_lse)}


def case_contiguous_variant(rng):
    """Contiguous, MQA (Hkv = 1), d = 12 (element loads, padded to 16), causal window with
    softcap and ALiBi, Nq = 3, the default split policy; an empty sequence."""
    b, h, hkv, d, nmax = 2, 2, 1, 12, 20
    lens = np.array([0, 19], np.int32)
    k, v = contiguous_cache(rng, b, hkv, nmax, d, lens, BF16)
    q = bf16(rng, b, h, 3, d)
    kw = dict(window_size=(6, 0), softcap=2.0, alibi_slopes=np.array([0.5, 0.25], np.float32))
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=lens, return_lse=True, **kw)
    assert o.dtype == BF16
    want_o, want_lse = ref.paged_decode(q, k, v, lens, **kw)
    return {"o": scaled_err(o, want_o), "lse": lse_err(lse, want_lse)}


def case_fused_append_rotary(rng):
    """decode with k_new / v_new and rotary fused (paged, block size 4, GQA, Nq = Nnew = 2, a
    left pad, GPT-J pairs): o, lse and the appended caches against reference.kvcache_decode."""
    case = make_case(rng, paged=True, d=8, dtype=BF16, leftpad=(1, 0), rotary_dim=8)
    args = {n: x for n, x in case.items() if n not in ("q", "k_cache", "v_cache")}
    want_o, want_lse, want_k, want_v = ref.kvcache_decode(
        case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
        **{n: x for n, x in args.items() if n != "cache_seqlens"}, causal=True)
    o, lse = numba_flash.decode(case["q"], case["k_cache"], case["v_cache"], **args,
                                causal=True, return_lse=True)
    assert o.dtype == BF16 and case["k_cache"].dtype == BF16
    k = case["k_cache"].astype(np.float64)
    np.testing.assert_array_equal(np.isnan(k), np.isnan(want_k))
    np.testing.assert_array_equal(case["v_cache"].astype(np.float64), want_v)  # a copy: exact
    return {"o_fused": scaled_err(o, want_o), "lse_fused": lse_err(lse, want_lse),
            "rotary": scaled_err(np.nan_to_num(k), np.nan_to_num(want_k))}


def case_merge(rng):
    """merge_states of 3 bfloat16 parts (float32 lse), one part empty for some rows."""
    o_parts = bf16(rng, 3, 2, 5, 16)
    lse_parts = rng.standard_normal((3, 2, 5)).astype(np.float32)
    lse_parts[1, 0, :2] = -np.inf
    o, lse = numba_flash.merge_states(o_parts, lse_parts)
    assert o.dtype == BF16 and lse.dtype == np.float32
    want_o, want_lse = ref.merge_states(o_parts, lse_parts)
    return {"merge": scaled_err(o, want_o), "lse": lse_err(lse, want_lse)}


def case_rotary(rng):
    """apply_rotary in bfloat16 (GPT-NeoX halves, rotary dim 6 of 10, per-sequence offsets)."""
    x = bf16(rng, 2, 3, 4, 10)
    angle = rng.uniform(0, 2 * np.pi, (9, 3))
    cos, sin = np.cos(angle).astype(BF16), np.sin(angle).astype(BF16)
    offsets = np.array([0, 5], np.int32)
    out = numba_flash.apply_rotary(x, cos, sin, seqlen_offsets=offsets)
    assert out.dtype == BF16
    want = ref.apply_rotary(x, cos, sin, seqlen_offsets=offsets)
    np.testing.assert_array_equal(out[..., 6:].view(np.uint16), x[..., 6:].view(np.uint16))
    return {"rotary": scaled_err(out, want)}


CASES = {"paged_gqa": case_paged_gqa, "contiguous_variant": case_contiguous_variant,
         "fused_append_rotary": case_fused_append_rotary, "merge": case_merge,
         "rotary": case_rotary}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bfloat16_against_reference(case, rng):
    errors = CASES[case](rng)
    for what, err in errors.items():
        assert err <= TOL[what], f"{case}: {what} error {err:.3g} > {TOL[what]}"


def test_append_kv_copies_bfloat16_bits(rng):
    """append_kv moves bfloat16 words: the caches equal the reference's bit for bit (NaN
    payloads included), paged with block size 3."""
    lens = np.array([2, 4], np.int32)
    k, v, table = paged_cache(rng, 2, 2, 8, lens + 3, 3, BF16)
    kn, vn = bf16(rng, 2, 2, 3, 8), bf16(rng, 2, 2, 3, 8)
    kn[0, 1, 2, 5] = np.nan
    want_k, want_v, want_lens = ref.append_kv(k.copy(), v.copy(), kn, vn, lens, table)
    new_lens = numba_flash.append_kv(k, v, kn, vn, lens, table)
    np.testing.assert_array_equal(new_lens, want_lens)
    assert k.dtype == BF16
    np.testing.assert_array_equal(k.view(np.uint16), np.asarray(want_k, BF16).view(np.uint16))
    np.testing.assert_array_equal(v.view(np.uint16), np.asarray(want_v, BF16).view(np.uint16))


def test_bfloat16_16_byte_loads_are_exact(rng):
    """The 16-byte bfloat16 loads split each float32 into its two words exactly: with one key
    (p = 1), o is v's row (bfloat16 -> float32 -> bfloat16 is the identity), every one of the 8
    words of each lane chunk in place, and a one-hot q picks single k elements into lse."""
    d = 32
    k = bf16(rng, 1, 1, 4, d)
    v = bf16(rng, 1, 1, 4, d)
    q = np.zeros((1, 1, d), BF16)
    o, lse = numba_flash.decode(q, k, v, cache_seqlens=np.array([1], np.int32),
                                return_lse=True)
    np.testing.assert_array_equal(o[0, 0].view(np.uint16), v[0, 0, 0].view(np.uint16))
    assert lse[0, 0] == 0.0
    for c in (0, 1, 7, 8, 31):  # low and high words of a pair, both ends of chunks
        q1 = np.zeros((1, 1, d), BF16)
        q1[0, 0, c] = 1.0
        _, lse1 = numba_flash.decode(q1, k, v, cache_seqlens=np.array([1], np.int32),
                                     softmax_scale=1.0, return_lse=True)
        assert lse1[0, 0] == np.float32(k[0, 0, 0, c])


@pytest.mark.parametrize("call, name", [
    ("decode_cache", "k_cache"), ("decode_new", "k_new"), ("decode_rotary", "rotary_cos"),
    ("append", "v_new"), ("rotary", "cos"), ("merge", "lse_parts")])
def test_bfloat16_mixed_with_float16_is_a_type_error(rng, call, name):
    b, h, d = 1, 2, 8
    q = bf16(rng, b, h, d)
    k, v = bf16(rng, b, h, 6, d), bf16(rng, b, h, 6, d)
    lens = np.array([3], np.int32)
    kn, vn = bf16(rng, b, h, 1, d), bf16(rng, b, h, 1, d)
    cos, sin = np.ones((8, 4), BF16), np.zeros((8, 4), BF16)
    half = np.float16
    calls = {
        "decode_cache": lambda: numba_flash.decode(q, k.astype(half), v, cache_seqlens=lens),
        "decode_new": lambda: numba_flash.decode(q, k, v, cache_seqlens=lens,
                                                 k_new=kn.astype(half), v_new=vn),
        "decode_rotary": lambda: numba_flash.decode(q, k, v, cache_seqlens=lens, k_new=kn,
                                                    v_new=vn, rotary_cos=cos.astype(half),
                                                    rotary_sin=sin),
        "append": lambda: numba_flash.append_kv(k, v, kn, vn.astype(half), lens),
        "rotary": lambda: numba_flash.apply_rotary(kn, cos.astype(half), sin),
        "merge": lambda: numba_flash.merge_states(bf16(rng, 2, 3, d),
                                                  np.zeros((2, 3), np.float16)),
    }
    k0 = k.copy()
    with pytest.raises(TypeError, match=name):
        calls[call]()
    np.testing.assert_array_equal(k.view(np.uint16), k0.view(np.uint16))  # nothing written
