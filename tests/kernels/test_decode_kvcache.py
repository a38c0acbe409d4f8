"""Kernel tier: ``decode`` with flash_attn_with_kvcache's extras (``k_new``/``v_new`` appended,
``rotary_cos``/``rotary_sin``, ``cache_batch_idx``, ``cache_leftpad``) against the float64
``reference.kvcache_decode``.

Every slot a call must not read is NaN: stale slots past the lengths, the slots the new tokens
are written to (so attending before the append would give NaN), positions before the left pad,
cache rows no sequence uses.  Shapes are tiny (the simulator).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from helpers import assert_close, assert_scaled_close, randn
from test_decode_kernel import LSE_DTYPE, contiguous_cache, paged_cache

# o and lse within helpers.atol(dtype) (lse: times LSE_SCALE).  Measured max abs errors over 12
# random cases per dtype drawn from this file's parameters (paged or contiguous, block sizes
# 1/3/8/16, Hkv 1/2/4, L 0..15, Nnew 0..3, Nq 1..2, rotary dim 0/4/8 of d = 8, both pairings,
# causal or not, left pads; rotated q and k_new are rounded to the input dtype before attending,
# as flash-attn does): float16 o 7.2e-4, lse 1.1e-3; float32 o 2.0e-7, lse 3.8e-7; float64
# o 6.7e-16, lse 8.9e-16.  atol is 2e-3 / 2e-5 / 1e-12; float16's lse (float32, from float16
# scores) is held to 2 * 2e-3 (3.5x the worst seen).
LSE_SCALE = {np.float16: 2.0, np.float32: 1.0, np.float64: 1.0}
# the appended (rotated) k against the float64 reference, relative to max(1, max |k|): measured
# float16 3.3e-4 (its rounding: at most 2**-11 = 4.9e-4 of the largest), float32 5.4e-8,
# float64 0; bounds as tests/kernels/test_rotary.py
K_TOL = {np.float16: 1e-3, np.float32: 5e-7, np.float64: 1e-15}


def tables(rng, max_position, half, dtype):
    angle = rng.uniform(0, 2 * np.pi, (max_position, half))
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


def make_case(rng, *, paged, b=2, h=4, hkv=2, d=8, lens=(5, 11), nnew=2, nq=2,
              dtype=np.float32, block_size=4, bc=None, leftpad=None, rotary_dim=8):
    """Caches with room for ``lens + nnew`` tokens; NaN in every slot the call must not read
    before writing it (stale slots, the append targets, positions before the left pad)."""
    lens = np.asarray(lens, np.int32)
    end = lens + nnew
    if paged:
        k, v, table = paged_cache(rng, b, hkv, d, end, block_size, dtype)
        cbi = None
    else:
        bc = bc or b
        nmax = int(end.max()) + 2
        k, v = contiguous_cache(rng, bc, hkv, nmax, d, [0] * bc, dtype)   # all NaN
        cbi = None if bc == b else rng.permutation(bc)[:b].astype(np.int32)
        rows = np.arange(b) if cbi is None else cbi
        good_k, good_v = randn(rng, k.shape, dtype), randn(rng, v.shape, dtype)
        for s, row in enumerate(rows):
            k[row, :, :lens[s]] = good_k[row, :, :lens[s]]
            v[row, :, :lens[s]] = good_v[row, :, :lens[s]]
        table = None
    nan_new = np.full((b, hkv, nnew, d), np.nan, dtype)
    if nnew:  # the append targets hold NaN until the call writes them
        k, v, _ = ref.append_kv(k, v, nan_new, nan_new, lens, table, cbi)
    if leftpad is not None:  # positions before the pad are not the sequence's: NaN
        leftpad = np.asarray(leftpad, np.int32)
        pos = [np.arange(p) for p in leftpad]
        for s, p in enumerate(pos):
            if paged:
                k[table[s, p // block_size], :, p % block_size] = np.nan
                v[table[s, p // block_size], :, p % block_size] = np.nan
            else:
                row = s if cbi is None else cbi[s]
                k[row, :, p] = np.nan
                v[row, :, p] = np.nan
    q = randn(rng, (b, h, nq, d), dtype)
    kn = randn(rng, (b, hkv, nnew, d), dtype) if nnew else None
    vn = randn(rng, (b, hkv, nnew, d), dtype) if nnew else None
    cos = sin = None
    if rotary_dim:
        cos, sin = tables(rng, int(end.max()) + 1, rotary_dim // 2, dtype)
    return dict(q=q, k_cache=k, v_cache=v, cache_seqlens=lens, block_table=table, k_new=kn,
                v_new=vn, rotary_cos=cos, rotary_sin=sin, cache_batch_idx=cbi,
                cache_leftpad=leftpad)


def run_and_check(case, dtype, **kw):
    """decode (in place) against reference.kvcache_decode; inputs other than the caches
    unchanged; returns (o, lse)."""
    keep = {n: x.copy() for n, x in case.items()
            if x is not None and n not in ("k_cache", "v_cache")}
    args = {n: x for n, x in case.items() if n not in ("q", "k_cache", "v_cache")}
    want_o, want_lse, want_k, want_v = ref.kvcache_decode(
        case["q"], case["k_cache"], case["v_cache"], case["cache_seqlens"],
        **{n: x for n, x in args.items() if n != "cache_seqlens"},
        rotary_interleaved=kw.get("rotary_interleaved", True),
        **{n: x for n, x in kw.items() if n not in ("rotary_interleaved", "num_splits")})
    o, lse = numba_flash.decode(case["q"], case["k_cache"], case["v_cache"], **args,
                                return_lse=True, **kw)
    assert o.dtype == dtype and lse.dtype == LSE_DTYPE[dtype]
    assert_close(o, want_o, dtype, name="o")
    assert_close(lse, want_lse, dtype, scale=LSE_SCALE[dtype], name="lse")
    if case["k_new"] is not None:  # the caches were written in place, where the oracle writes
        k, v = case["k_cache"], case["v_cache"]
        np.testing.assert_array_equal(np.isnan(k), np.isnan(want_k))
        assert_scaled_close(np.nan_to_num(k), np.nan_to_num(want_k), K_TOL[dtype], name="k_cache")
        np.testing.assert_array_equal(v.astype(np.float64), want_v)
    for n, x in keep.items():
        np.testing.assert_array_equal(case[n], x, err_msg=f"{n} was modified")
    return o, lse


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("block_size", [1, 3, 8, 16])
def test_paged_append_rotary(rng, dtype, block_size):
    """Paged, GQA, causal, Nq = Nnew = 2, rotary over part of the head dim (d = 8, 4 rotated),
    GPT-J pairs; a sequence with an empty cache (L = 0) beside a longer one."""
    case = make_case(rng, paged=True, lens=(0, 13), dtype=dtype, block_size=block_size,
                     rotary_dim=4)
    run_and_check(case, dtype, causal=True)


@pytest.mark.parametrize("causal, window, interleaved, hkv", [
    (False, (-1, -1), False, 1),   # not causal: every query token rotated at cache_seqlens
    (True, (-1, -1), True, 4),     # MHA
    (False, (3, 1), False, 2),     # a window: queries at their own positions
])
def test_contiguous_append_rotary_variants(rng, causal, window, interleaved, hkv):
    case = make_case(rng, paged=False, hkv=hkv, lens=(4, 9), nnew=3, nq=3)
    run_and_check(case, np.float32, causal=causal, window_size=window,
                  rotary_interleaved=interleaved, num_splits=2)


def test_paged_window_append_rotary(rng):
    """Paged (block size 3), a sliding window, Nq = Nnew = 3, GPT-NeoX halves."""
    case = make_case(rng, paged=True, lens=(6, 10), nnew=3, nq=3, block_size=3)
    run_and_check(case, np.float32, window_size=(4, 0), rotary_interleaved=False)


def test_unvalidated_append_that_does_not_fit(rng):
    """validate=False: of a sequence whose new tokens do not all fit, the ones past the cache
    are skipped (the others land) and the sequence gets NaN (its length is past the capacity);
    the other sequence is exact."""
    case = make_case(rng, paged=False, lens=(3, 5), nnew=2, rotary_dim=8)
    case["rotary_cos"], case["rotary_sin"] = tables(rng, 12, 4, np.float32)
    nmax = case["k_cache"].shape[2]               # 9: room for 5 + 2, not for 8 + 2
    case["cache_seqlens"] = np.array([3, nmax - 1], np.int32)
    want_v1 = case["v_cache"][1].copy()
    want_v1[:, nmax - 1] = case["v_new"][1, :, 0]  # position 8 fits, 9 is skipped
    want = ref.kvcache_decode(case["q"][:1], case["k_cache"][:1], case["v_cache"][:1], [3],
                              k_new=case["k_new"][:1], v_new=case["v_new"][:1],
                              rotary_cos=case["rotary_cos"], rotary_sin=case["rotary_sin"])
    o, lse = numba_flash.decode(case["q"], case["k_cache"], case["v_cache"],
                                **{n: x for n, x in case.items()
                                   if n not in ("q", "k_cache", "v_cache")},
                                validate=False, return_lse=True)
    assert_close(o[0], want[0][0], np.float32)
    assert np.isnan(o[1]).all() and np.isnan(lse[1]).all()
    np.testing.assert_array_equal(case["v_cache"][1], want_v1)
    assert not np.isnan(case["k_cache"][1, :, nmax - 1]).any()


def test_cache_batch_idx_with_append(rng):
    """Two sequences in cache rows of a 4-row cache (the others all NaN), append + rotary."""
    case = make_case(rng, paged=False, bc=4, lens=(3, 7), nq=1)
    case["q"] = case["q"][:, :, 0]  # [B, H, d]: one token per sequence
    o, lse = run_and_check(case, np.float32, softcap=5.0)
    assert o.shape == (2, 4, 8) and lse.shape == (2, 4)


@pytest.mark.parametrize("paged, nnew", [(False, 0), (False, 2), (True, 2)])
def test_cache_leftpad(rng, paged, nnew):
    """Keys before the pad are never read (NaN there); alignment is to the sequence's end."""
    case = make_case(rng, paged=paged, lens=(9, 6), nnew=nnew, leftpad=(4, 0),
                     rotary_dim=8 if nnew else 0,
                     bc=3 if not paged else None)
    alibi = numba_flash.reference.alibi_slopes(4)
    run_and_check(case, np.float32, causal=True, alibi_slopes=alibi, num_splits=3)


def test_decode_without_append_and_batch_idx(rng):
    """cache_batch_idx alone (no append): rows may repeat; with a left pad and a window."""
    case = make_case(rng, paged=False, bc=3, lens=(8, 8), nnew=0, rotary_dim=0, dtype=np.float64,
                     leftpad=(2, 5))
    case["cache_batch_idx"] = np.repeat(case["cache_batch_idx"][:1], 2)  # one row, twice
    run_and_check(case, np.float64, window_size=(2, 0))


def test_batch_invariance_with_append(rng):
    """One sequence's output is bitwise the same alone or beside another (num_splits=None)."""
    case = make_case(rng, paged=True, lens=(7, 21), rotary_dim=8)
    alone = {n: (x[1:].copy() if x is not None and n not in ("k_cache", "v_cache",
                                                              "rotary_cos", "rotary_sin")
                 else (x.copy() if x is not None else None)) for n, x in case.items()}
    o_all = numba_flash.decode(case["q"], case["k_cache"], case["v_cache"],
                               **{n: x for n, x in case.items()
                                  if n not in ("q", "k_cache", "v_cache")}, causal=True)
    o_one = numba_flash.decode(alone["q"], alone["k_cache"], alone["v_cache"],
                               **{n: x for n, x in alone.items()
                                  if n not in ("q", "k_cache", "v_cache")}, causal=True)
    np.testing.assert_array_equal(o_all[1], o_one[0])


# -- bad input: raised before any launch, nothing written ------------------------------------
BAD = [
    ("too_small", ValueError, "k_cache: too small: sequence 1 holds 11 tokens and 5 new ones"),
    ("no_room", ValueError, "block_table: no room: sequence 1 holds 11 tokens and 2 new ones"),
    ("rotary_short", ValueError, r"rotary_cos: too short: sequence 1 needs position 12 "
                                 r"\(cache_seqlens\[b\] \+ max\(Nnew, Nq\) - 1\), but rotary_cos "
                                 r"has 12 positions"),
    ("rotary_wide", ValueError, r"rotary_cos: expected \[max_position, rotary_dim / 2\] with "
                                r"rotary_dim <= the head dim 8, got shape \(14, 5\)"),
    ("rotary_dtype", TypeError, "rotary_cos: expected dtype float32 .*got float64"),
    ("rotary_alone", ValueError, "rotary_cos: expected k_new and v_new with the rotary tables"),
    ("sin_missing", ValueError, "rotary_sin: expected an array with the other rotary table"),
    ("v_missing", ValueError, "v_new: expected an array with k_new"),
    ("k_new_dtype", TypeError, "k_new: expected dtype float32"),
    ("k_new_shape", ValueError, r"k_new: expected shape \[B, Hkv, Nnew, d\] = \[2, 2, Nnew, 8\]"),
    ("cbi_paged", ValueError, "cache_batch_idx: expected None with a paged cache"),
    ("cbi_range", ValueError, r"cache_batch_idx: expected entries in \[0, 3\)"),
    ("leftpad", ValueError, r"cache_leftpad: expected entries in \[0, cache_seqlens\[b\] \+ "
                            r"Nnew\], got 14 at index 1 \(length 13\)"),
    ("leftpad_dtype", TypeError, "cache_leftpad: expected dtype in"),
    ("interleaved", TypeError, "rotary_interleaved: expected a bool"),
]


@pytest.mark.parametrize("what, exc, msg", BAD)
def test_bad_input_writes_nothing(rng, what, exc, msg):
    paged = what in ("no_room", "cbi_paged", "rotary_short")
    case = make_case(rng, paged=paged, bc=None if paged else 3, lens=(5, 11))
    kw = {}
    if what == "too_small":
        case["k_new"] = randn(rng, (2, 2, 5, 8))
        case["v_new"] = case["k_new"].copy()
    elif what == "no_room":
        case["block_table"] = case["block_table"][:, :3]   # 3 blocks of 4 < 13 tokens
    elif what == "rotary_short":
        case["rotary_cos"], case["rotary_sin"] = tables(rng, 12, 4, np.float32)
        kw["causal"] = True
    elif what == "rotary_wide":
        case["rotary_cos"], case["rotary_sin"] = tables(rng, 14, 5, np.float32)
    elif what == "rotary_dtype":
        case["rotary_cos"] = case["rotary_cos"].astype(np.float64)
    elif what == "rotary_alone":
        case["k_new"] = case["v_new"] = None
    elif what == "sin_missing":
        case["rotary_sin"] = None
    elif what == "v_missing":
        case["v_new"] = None
    elif what == "k_new_dtype":
        case["k_new"] = case["k_new"].astype(np.float64)
    elif what == "k_new_shape":
        case["k_new"] = case["v_new"] = randn(rng, (2, 1, 2, 8))
    elif what == "cbi_paged":
        case["cache_batch_idx"] = np.array([0, 1])
    elif what == "cbi_range":
        case["cache_batch_idx"] = np.array([0, 3])
    elif what == "leftpad":
        case["cache_leftpad"] = np.array([0, 14])
    elif what == "leftpad_dtype":
        case["cache_leftpad"] = np.array([0.0, 1.0])
    elif what == "interleaved":
        kw["rotary_interleaved"] = 1
    k0, v0 = case["k_cache"].copy(), case["v_cache"].copy()
    with pytest.raises(exc, match=msg):
        numba_flash.decode(case["q"], case["k_cache"], case["v_cache"],
                           **{n: x for n, x in case.items()
                              if n not in ("q", "k_cache", "v_cache")}, **kw)
    np.testing.assert_array_equal(case["k_cache"], k0)
    np.testing.assert_array_equal(case["v_cache"], v0)


def test_unvalidated_bad_pad_and_batch_idx_give_nan(rng):
    """validate=False: a left pad past the length or a cache_batch_idx outside [0, Bc) gives
    NaN for that sequence only (nothing outside the cache is read; the simulator would raise
    IndexError), the others match the reference."""
    case = make_case(rng, paged=False, bc=3, b=3, lens=(6, 6, 6), nnew=0, rotary_dim=0)
    case["cache_batch_idx"] = np.array([0, 1, 2], np.int32)
    case["cache_leftpad"] = np.array([1, 7, 0], np.int32)
    want = ref.kvcache_decode(case["q"][[0]], case["k_cache"], case["v_cache"], [6],
                              cache_batch_idx=[0], cache_leftpad=[1])
    case["cache_batch_idx"][2] = 5
    o, lse = numba_flash.decode(case["q"], case["k_cache"], case["v_cache"],
                                cache_seqlens=case["cache_seqlens"],
                                cache_batch_idx=case["cache_batch_idx"],
                                cache_leftpad=case["cache_leftpad"], validate=False,
                                return_lse=True)
    assert_close(o[0], want[0][0], np.float32)
    assert np.isnan(o[1:]).all() and np.isnan(lse[1:]).all()


@pytest.mark.gpu
def test_cupy_fused_decode_matches_numpy(rng):
    cp = pytest.importorskip("cupy")
    case = make_case(rng, paged=True, b=3, h=8, hkv=2, d=128, lens=(0, 100, 700), nnew=1, nq=1,
                     dtype=np.float16, block_size=16, rotary_dim=64)
    host = {n: (x.copy() if x is not None else None) for n, x in case.items()}
    want = numba_flash.decode(host["q"], host["k_cache"], host["v_cache"],
                              **{n: x for n, x in host.items()
                                 if n not in ("q", "k_cache", "v_cache")}, causal=True)
    dev = {n: (cp.asarray(x) if x is not None else None) for n, x in case.items()}
    got = numba_flash.decode(dev["q"], dev["k_cache"], dev["v_cache"],
                             **{n: x for n, x in dev.items()
                                if n not in ("q", "k_cache", "v_cache")}, causal=True)
    np.testing.assert_array_equal(got.get(), want)
    np.testing.assert_array_equal(dev["k_cache"].get(), host["k_cache"])
