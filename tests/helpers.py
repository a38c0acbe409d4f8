"""Tolerances and comparison helpers shared by the kernel tests.

Tolerances are measured, not chosen for convenience: each bound below is a small multiple
(about 4x) of the largest error seen over many random inputs, and the measurement is recorded
next to the bound.
"""

from __future__ import annotations

import numpy as np

from numba_flash import reference

#: absolute error bound per compute dtype for outputs of magnitude ~1 (probabilities, attention
#: outputs of unit-variance V).  float16 is dominated by the final rounding to float16
#: (2**-11 relative), float32 by accumulation in float32, float64 by accumulation in float64.
ATOL = {np.float16: 2e-3, np.float32: 2e-5, np.float64: 1e-12}


def atol(dtype):
    return ATOL[np.dtype(dtype).type]


def assert_close(got, want, dtype, scale=1.0, name="output"):
    """``got`` (any dtype, no NaN allowed) within ``atol(dtype) * scale`` of float64 ``want``."""
    got = np.asarray(got)
    assert not np.isnan(got).any(), f"{name}: NaN in output (unwritten element or NaN leak)"
    got64 = got.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: NaN, replaced below where both match
        diff = np.abs(got64 - want)
    # infinities must match exactly
    both_inf = np.isinf(want) & (got64 == want)
    diff = np.where(both_inf, 0.0, diff)
    bound = atol(dtype) * scale
    assert diff.max() <= bound, f"{name}: max abs error {diff.max():.3e} > {bound:.1e}"


def randn(rng, shape, dtype=np.float32, scale=1.0):
    """Standard normal samples (times ``scale``) in ``dtype``."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def assert_scaled_close(got, want, tol, name="output"):
    """No NaN, and max abs error <= ``tol * max(1, max |want|)``: a bound relative to the size
    of the reference (gradients scale with their inputs, so a fixed absolute bound would be too
    loose for small ones and too tight for large ones)."""
    got = np.asarray(got)
    assert not np.isnan(got).any(), f"{name}: NaN in output (unwritten element or NaN leak)"
    with np.errstate(invalid="ignore"):  # inf - inf is NaN, and NaN fails the bound below
        err = np.abs(got.astype(np.float64) - want).max()
    bound = tol * max(1.0, np.abs(want).max())
    assert err <= bound, f"{name}: max abs error {err:.3e} > {bound:.1e}"


#: the lse dtype of the teaching forwards per input dtype
LSE_DTYPE = {np.float16: np.float32, np.float32: np.float32, np.float64: np.float64}


def check_forward_against_reference(op, rng, dtype, causal, shape):
    """``op(q, k, v, causal=...) -> (o, lse)`` on random inputs of ``shape = (B, H, Hkv, Nq,
    Nk, d)`` against ``reference.attention``: dtypes, shapes, and ``atol(dtype)`` bounds (float16's
    ``o`` relative to ``max(1, max |o|)``: its final rounding is relative)."""
    from numba_flash import reference as ref

    b, h, hkv, nq, nk, d = shape
    q = randn(rng, (b, h, nq, d), dtype)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d), dtype)
    o, lse = op(q, k, v, causal=causal)
    assert o.dtype == dtype and o.shape == q.shape
    assert lse.dtype == LSE_DTYPE[dtype] and lse.shape == (b, h, nq)
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    o_scale = max(1.0, np.abs(o_ref).max()) if dtype == np.float16 else 1.0
    assert_close(o, o_ref, dtype, scale=o_scale, name="o")
    assert_close(lse, lse_ref, LSE_DTYPE[dtype], name="lse")


def paged_cache(rng, k, v, cu_k, block_size, spare_cols=1, spare_blocks=2, stale=np.nan,
                table_dtype=np.int32):
    """``k``/``v`` scattered into caches of shuffled blocks: key t of sequence b at block
    ``table[b, t // block_size]``, slot ``t % block_size``; every other slot (a sequence's last
    block's tail, spare blocks) is ``stale``, table entries past a sequence's blocks are -1."""
    lens = np.diff(cu_k)
    need = [-(-int(n) // block_size) for n in lens]
    n_blocks = sum(need) + spare_blocks
    max_blocks = max(need) + spare_cols
    perm = rng.permutation(n_blocks)
    table = np.full((len(lens), max_blocks), -1, np.int64)
    kc = np.full((n_blocks, k.shape[1], block_size, k.shape[2]), stale, np.float64)
    kc = kc.astype(k.dtype)
    vc = kc.copy()
    nxt = 0
    for b, n in enumerate(lens):
        table[b, :need[b]] = perm[nxt:nxt + need[b]]
        nxt += need[b]
        t = np.arange(n)
        kc[table[b, t // block_size], :, t % block_size] = k[cu_k[b]:cu_k[b] + n]
        vc[table[b, t // block_size], :, t % block_size] = v[cu_k[b]:cu_k[b] + n]
        # the reference's reading of the layout is the one we wrote
        np.testing.assert_array_equal(reference.gather_paged(kc, table, n, b),
                                      np.asarray(k[cu_k[b]:cu_k[b] + n], np.float64)
                                      .transpose(1, 0, 2))
    return kc, vc, table.astype(table_dtype)
