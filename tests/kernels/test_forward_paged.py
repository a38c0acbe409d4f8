"""Kernel tier: paged prefill, ``numba_flash.forward_varlen(..., block_table=...)`` (issue 25): K/V
read from a paged cache ``[num_blocks, Hkv, block_size, d]`` through a shuffled block table by the
tiled forward kernel.

Each case scatters packed K/V into a cache whose other slots and spare blocks hold NaN (a stale
or foreign slot that is read shows up), then checks the paged call equals ``forward_varlen`` on
the packed K/V bit for bit (the same kernel arithmetic, only the row addresses differ) and the
float64 reference :func:`numba_flash.reference.attention_varlen` within the varlen tolerances.
Block sizes 1, 3, 8, 16 and the kernel's ``BLOCK_N``; sequences of different lengths (one
without keys, one without queries, one over several tiles); every variant; float16/32/64 and
bfloat16; bad tables rejected before any launch; an unvalidated bad entry gives NaN rows and
reads nothing outside the cache or the table.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.kernels.forward.config import default_tiles
from numba_flash.ops import forward_varlen as varlen_op
from helpers import paged_cache, randn

BF16 = np.dtype(ml_dtypes.bfloat16)
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

# Tolerances against the float64 reference.  The paged call is bit-equal to the packed call
# (asserted in every case), so these are the packed varlen kernel's bounds
# (tests/kernels/test_forward_varlen.py: o float16 4e-3, float32 2e-6, float64 5e-15; lse
# relative 8e-7, 2.5e-15 for float64; bfloat16 lse 1e-6 from tests/kernels/test_bfloat16.py).
# Measured here, the largest over 8 seeds of every case (simulator, 2026-12-01): o float16
# 4.8e-4, float32 3.2e-7, float64 4.4e-16, bfloat16 4.9e-3 (absolute, |o| up to ~2; hence
# 1e-2, 2x, above test_bfloat16's 7e-3 on its scaled error); lse relative float16 1.4e-7,
# float32 1.9e-7, float64 3.4e-16, bfloat16 1.4e-7.
O_TOL = {F16: 4e-3, F32: 2e-6, F64: 5e-15, BF16: 1e-2}
LSE_TOL = {F16: 8e-7, F32: 8e-7, F64: 2.5e-15, BF16: 1e-6}

# ragged: 0 keys under 2 queries, 0 queries over 3 keys, 9 queries over 12 keys (several Q and
# K/V tiles of the simulator's 8 x 8), Nq < Nk and Nq > Nk
LENS_Q = [5, 2, 0, 9]
LENS_K = [7, 0, 3, 12]
H, HKV, D = 2, 1, 4  # GQA: two query heads per kv head
BLOCK_N = default_tiles(D, np.float32)[1]


def packed(rng, dtype, lens_q=LENS_Q, lens_k=LENS_K, h=H, hkv=HKV, d=D):
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = randn(rng, (int(cu_q[-1]), h, d), dtype)
    k = randn(rng, (int(cu_k[-1]), hkv, d), dtype)
    v = randn(rng, (int(cu_k[-1]), hkv, d), dtype)
    return q, k, v, cu_q, cu_k


def call(q, k, v, cu_q, cu_k, **kw):
    lq, lk = np.diff(cu_q), np.diff(cu_k)
    return numba_flash.forward_varlen(q, k, v, cu_q, cu_k, max_seqlen_q=int(lq.max()),
                                      max_seqlen_k=int(lk.max()), return_lse=True, **kw)


def check_case(rng, dtype, block_size, table_dtype=np.int32, **kw):
    """Paged == packed bit for bit, both within the tolerance of the reference; the caches and
    the table are not modified.  Returns the errors (o absolute, lse relative)."""
    q, k, v, cu_q, cu_k = packed(rng, dtype)
    kc, vc, table = paged_cache(rng, k, v, cu_k, block_size, table_dtype=table_dtype)
    before = (kc.copy(), vc.copy(), table.copy())
    o, lse = call(q, kc, vc, cu_q, cu_k, block_table=table, **kw)
    for was, now in zip(before, (kc, vc, table)):
        np.testing.assert_array_equal(was, now)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (H, q.shape[0])
    o_packed, lse_packed = call(q, k, v, cu_q, cu_k, **kw)
    np.testing.assert_array_equal(o.view(np.uint8), o_packed.view(np.uint8))
    np.testing.assert_array_equal(lse, lse_packed)

    masks = None
    if kw.get("dropout_p", 0.0) > 0:  # sequence b's mask: dropout_mask(...)[b], as varlen's
        masks = [numba_flash.dropout_mask(kw["seed"], len(LENS_Q), H, max(nq, 1), max(nk, 1),
                                          kw["dropout_p"])[b, :, :nq, :nk]
                 for b, (nq, nk) in enumerate(zip(LENS_Q, LENS_K))]
    ref_kw = {n: x for n, x in kw.items() if n != "seed"}
    want_o, want_lse = ref.attention_varlen(q, k, v, cu_q, cu_k, dropout_masks=masks, **ref_kw)
    assert not np.isnan(o.astype(np.float64)).any() and not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    # the sequence without keys: o = 0, lse = -inf
    q1 = slice(int(cu_q[1]), int(cu_q[2]))
    assert (o[q1].astype(np.float64) == 0).all() and np.isneginf(lse[:, q1]).all()
    o_err = float(np.abs(o.astype(np.float64) - want_o).max())
    fin = np.isfinite(want_lse)
    lse_err = float((np.abs(lse[fin] - want_lse[fin]) / np.maximum(1, np.abs(want_lse[fin])))
                    .max())
    dt = np.dtype(dtype)
    assert o_err <= O_TOL[dt], f"o: max abs error {o_err:.2e} > {O_TOL[dt]:.0e}"
    assert lse_err <= LSE_TOL[dt], f"lse: max relative error {lse_err:.2e} > {LSE_TOL[dt]:.0e}"
    return o_err, lse_err


VARIANTS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window-softcap": dict(window_size=(3, 1), softcap=1.5),
    "causal-window-alibi": dict(causal=True, window_size=(4, -1),
                                alibi_slopes=np.array([0.5, 0.25], np.float32)),
    "alibi-BxH-softcap-scale": dict(alibi_slopes=np.linspace(0.1, 0.8, 8, dtype=np.float32)
                                    .reshape(4, 2), softcap=2.0, softmax_scale=0.3),
    "dropout-causal": dict(causal=True, dropout_p=0.3, seed=2**40 + 7),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_paged_variants_float32(rng, variant):
    """Every variant at block size 3 (blocks straddle the K/V tiles of 8)."""
    check_case(rng, np.float32, 3, **VARIANTS[variant])


@pytest.mark.parametrize("block_size", sorted({1, 8, 16, BLOCK_N}),
                         ids=lambda n: f"bs{n}" + ("=BLOCK_N" if n == BLOCK_N else ""))
def test_paged_block_sizes(rng, block_size):
    """Block sizes 1 (a lookup per key), 8 (= the simulator's BLOCK_N: one block per tile), 16
    (a block over two tiles); causal with a window, GQA; an int64 table."""
    check_case(rng, np.float32, block_size, table_dtype=np.int64, causal=True,
               window_size=(6, -1))


@pytest.mark.parametrize("dtype", [F16, F64, BF16], ids=str)
def test_paged_dtypes(rng, dtype):
    check_case(rng, dtype, 3, causal=True, softcap=2.0)


# -- bad tables -----------------------------------------------------------------------------------
def _bad_args():
    rng = np.random.default_rng(5)
    q, k, v, cu_q, cu_k = packed(rng, np.float32)
    kc, vc, table = paged_cache(rng, k, v, cu_k, 3)  # 3 + 0 + 1 + 4 + 2 spare = 10 blocks
    return q, kc, vc, cu_q, cu_k, table


def _with_entry(table, b, j, value):
    t = table.copy()
    t[b, j] = value
    return t


@pytest.mark.parametrize("change, exc, msg", [
    (lambda a: dict(block_table=a[5][:, :3]), ValueError,
     r"^block_table: sequence 3 has 12 keys \(cu_seqlens_k\), which need 4 blocks of 3 tokens, "
     r"but block_table has 3 per sequence"),
    (lambda a: dict(block_table=_with_entry(a[5], 3, 2, 10)), ValueError,
     r"^block_table: expected the entries holding a sequence's keys in \[0, 10\) \(num_blocks, "
     r"dim 0 of k\), got 10 at \[3, 2\]"),
    (lambda a: dict(block_table=_with_entry(a[5], 0, 0, -1)), ValueError,
     r"^block_table: expected .* got -1 at \[0, 0\]"),
    (lambda a: dict(block_table=a[5].astype(np.float32)), TypeError,
     r"^block_table: expected dtype in \(int8"),
    (lambda a: dict(block_table=a[5].astype(bool)), TypeError, r"^block_table: expected dtype"),
    (lambda a: dict(block_table=a[5][:3]), ValueError,
     r"^block_table: expected 4 rows \(B, from cu_seqlens_q\), got shape \(3, 5\)"),
    (lambda a: dict(block_table=a[5][0]), ValueError, r"^block_table: expected a 2-D array"),
    (lambda a: dict(k=a[1][:, :, :, :3]), ValueError, r"^k: expected head dim"),
    (lambda a: dict(k=a[1][0], v=a[2][0]), ValueError, r"^k: expected a 4-D array"),
    (lambda a: dict(k=a[1][..., :3], v=a[2][..., :3]), ValueError,
     r"^k: expected head dim 4 \(from q\) in dim 3"),
    (lambda a: dict(block_table=a[5].astype(np.uint64), validate="no"), TypeError,
     r"^validate: expected a bool"),
])
def test_bad_tables_are_errors_before_launch(monkeypatch, change, exc, msg):
    def no_kernel(*args):
        raise AssertionError("a kernel was built before validation finished")

    monkeypatch.setattr(varlen_op, "forward_kernel", no_kernel)
    q, kc, vc, cu_q, cu_k, table = _bad_args()
    a = dict(q=q, k=kc, v=vc, cu_q=cu_q, cu_k=cu_k, block_table=table)
    a.update(change((q, kc, vc, cu_q, cu_k, table)))
    kw = {n: x for n, x in a.items() if n not in ("q", "k", "v", "cu_q", "cu_k")}
    with pytest.raises(exc, match=msg):
        numba_flash.forward_varlen(a["q"], a["k"], a["v"], a["cu_q"], a["cu_k"],
                                   max_seqlen_q=9, max_seqlen_k=12, **kw)


def test_unvalidated_bad_entries_give_nan_rows(rng):
    """validate=False: sequence 0's entry for key 6 is num_blocks and sequence 1's for keys 6-8
    is 2**64 - 1; then a table cut to 3 columns, short of sequence 1's keys 9-11 (reading past
    it would leave the array).  Under a window (2, 0) only the rows that see one of those keys
    get o = lse = NaN, every other row is the validated result bit for bit.  The cache holds no NaN
    here, so a NaN can only come from the bad-entry path, and the simulator raises on any index
    past an array (a negative one is never formed: entries are checked before use)."""
    lens_q, lens_k = [4, 9], [7, 12]
    q, k, v, cu_q, cu_k = packed(rng, np.float32, lens_q, lens_k)
    kc, vc, table = paged_cache(rng, k, v, cu_k, 3, spare_cols=0, stale=0.5,
                                table_dtype=np.uint64)
    kw = dict(window_size=(2, 0), block_table=table)
    good_o, good_lse = call(q, kc, vc, cu_q, cu_k, **kw)
    bad = table.copy()
    bad[1, 2] = np.uint64(2**64 - 1)  # past int32 too: clamped, still outside [0, num_blocks)
    bad[0, 2] = kc.shape[0]           # key 6 of sequence 0: entry num_blocks
    o, lse = call(q, kc, vc, cu_q, cu_k, validate=False, **dict(kw, block_table=bad))
    short = table[:, :3].copy()       # 3 columns: sequence 0's key 6 and sequence 1's 9-11
    o2, lse2 = call(q, kc, vc, cu_q, cu_k, validate=False, **dict(kw, block_table=short))

    def rows_seeing(keys, b, nq, nk):
        """Global query rows of sequence b whose window (2, 0) holds one of ``keys``."""
        out = []
        for i in range(nq):
            c = i + nk - nq
            if any(c - 2 <= j <= c for j in keys):
                out.append(int(cu_q[b]) + i)
        return out

    for got_o, got_lse, bad_keys in ((o, lse, {0: [6], 1: [6, 7, 8]}),
                                     (o2, lse2, {1: [9, 10, 11]})):
        nan_rows = sorted(r for b, keys in bad_keys.items()
                          for r in rows_seeing(keys, b, lens_q[b], lens_k[b]))
        assert nan_rows and len(nan_rows) < q.shape[0]
        is_nan = np.isnan(got_o).all(axis=(1, 2))
        assert sorted(np.flatnonzero(is_nan)) == nan_rows
        assert np.isnan(got_lse[:, nan_rows]).all()
        ok = np.setdiff1d(np.arange(q.shape[0]), nan_rows)
        assert not np.isnan(got_o[ok]).any()
        np.testing.assert_array_equal(got_o[ok], good_o[ok])
        np.testing.assert_array_equal(got_lse[:, ok], good_lse[:, ok])
