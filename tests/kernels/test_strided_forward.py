"""The forward (SIMT and tensor-core ``mma`` kernels) reads q, k, v and writes ``out=`` through
their strides (issue 61): flash-attn's ``[B, N, H, d]`` memory passed as its ``transpose(0, 2,
1, 3)`` view, a fused QKV projection's slices, head slices at an offset, an ``out=`` view with
the caller's data between its rows.  Every case against the float64 reference, outputs
NaN-poisoned (conftest); inputs are left as they were, and the elements between ``out``'s rows
keep their sentinel.  The device path (the stand-in device) hands the views to the launch with
no copy.

Tolerances: the SIMT forward's and the mma forward's own (tests/helpers.ATOL for the SIMT
float32 / float16 builds: the same kernels as C-contiguous inputs take, only the addresses
differ; mma 2e-3 scaled, as tests/kernels/test_mma_forward.py).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference
from numba_flash import standin as sd
from numba_flash.frontend import plans
from numba_flash.kernels.core.elements import BFLOAT16
from tests.helpers import assert_scaled_close

SENTINEL = 7.0
#: the bound on max |o - o_ref| / max(1, max |o_ref|) per input dtype (the kernels' own tests'
#: bounds: tests/helpers.ATOL, test_mma_forward.O_TOL; bfloat16 8x float16's, 3 fewer bits)
O_TOL = {np.dtype(np.float32): 2e-5, np.dtype(np.float16): 2e-3, BFLOAT16: 1.6e-2,
         np.dtype(np.float64): 1e-12}
LSE_TOL = 2e-6


def _layouts(rng, layout, b, h, hkv, nq, nk, d, dtype):
    """``(q, k, v)`` ``[B, H(kv), N, d]`` views of one of the memory layouts under test."""
    def randn(shape):
        return rng.standard_normal(shape).astype(dtype)

    if layout == "bnhd":        # flash-attn's memory: [B, N, H, d], viewed heads-first
        return (randn((b, nq, h, d)).transpose(0, 2, 1, 3),
                randn((b, nk, hkv, d)).transpose(0, 2, 1, 3),
                randn((b, nk, hkv, d)).transpose(0, 2, 1, 3))
    if layout == "fused":       # one projection [B, N, 3, H, d]: q, k, v its slices
        qkv = randn((b, nq, 3, h, d))
        return tuple(qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    if layout == "offset":      # head and batch slices at an offset, C-ordered inside
        big_q = randn((b + 1, h + 2, nq, d))
        big_kv = randn((b, 2 * hkv + 1, nk, d))
        return big_q[1:, 2:], big_kv[:, 1:hkv + 1], big_kv[:, hkv + 1:]
    if layout == "rows":        # rows 2 d apart (a wider buffer's first d columns)
        return (randn((b, h, nq, 2 * d))[..., :d], randn((b, hkv, nk, 2 * d))[..., :d],
                randn((b, hkv, nk, 2 * d))[..., :d])
    if layout == "mixed":       # three layouts at once: each operand's strides its own
        return (randn((b, nq, h, d)).transpose(0, 2, 1, 3),
                randn((b + 1, hkv, nk, d))[1:],
                randn((b, hkv, nk, 3 * d))[..., d:2 * d])
    raise AssertionError(layout)


def _strided_out(b, h, nq, d, dtype):
    """An ``out=`` view ``[B, H, Nq, d]`` of ``[B, Nq, H + 1, d]`` memory (head 0 of each row
    the caller's), filled with a sentinel, and that memory."""
    mem = np.full((b, nq, h + 1, d), SENTINEL, dtype)
    return mem[:, :, 1:].transpose(0, 2, 1, 3), mem


def _check(kernel, dtype, layout, rng, d=16, causal=True, b=2, h=4, hkv=2, nq=20, nk=27,
           **kw):
    dtype = np.dtype(dtype)
    if layout == "fused":
        hkv, nk = h, nq
    q, k, v = _layouts(rng, layout, b, h, hkv, nq, nk, d, dtype)
    assert not all(x.flags.c_contiguous for x in (q, k, v))
    before = [x.copy() for x in (q, k, v)]
    out, mem = _strided_out(b, h, nq, d, dtype)
    o, lse = numba_flash.forward(q, k, v, causal=causal, return_lse=True, kernel=kernel,
                                 out=out, **kw)
    assert o is out
    want_o, want_lse = reference.attention(*(x.astype(np.float64) for x in (q, k, v)),
                                           causal=causal, **kw)
    assert_scaled_close(o.astype(np.float64), want_o, O_TOL[dtype], name="o")
    assert_scaled_close(lse, want_lse, LSE_TOL, name="lse")
    assert (mem[:, :, 0].astype(np.float64) == SENTINEL).all(), "out: a gap element written"
    for x, x0 in zip((q, k, v), before):
        np.testing.assert_array_equal(x.view(np.uint8), x0.view(np.uint8))


@pytest.mark.parametrize("layout", ["bnhd", "fused", "offset", "rows", "mixed"])
@pytest.mark.parametrize("kernel,dtype", [("simt", np.float32), ("mma", np.float16)])
def test_forward_reads_views_through_strides(kernel, dtype, layout, rng):
    _check(kernel, dtype, layout, rng)


@pytest.mark.parametrize("layout", ["bnhd", "mixed"])
def test_wgmma_reads_views_through_strides(layout, rng):
    """The warpgroup forward's STRIDED build: K's and V's bases and row strides each their own
    (its C build reads V at K's addresses), out= written in place."""
    _check("wgmma", np.float16, layout, rng, b=1, h=2, hkv=1)


@pytest.mark.parametrize("kernel,dtype,d", [
    ("simt", np.float16, 16),     # widened element by element (no cp.async)
    ("simt", BFLOAT16, 16),       # its uint16 words, strides halved
    ("simt", np.float64, 16),     # 8-byte elements: strides / 8, cp.async of 2
    ("simt", np.float32, 18),     # a head dim that is no whole 16-byte chunk
    ("mma", BFLOAT16, 16),
    ("mma", np.float16, 20),      # the 16-bit element loads (ld16) of a padded head dim
])
def test_strided_element_builds(kernel, dtype, d, rng):
    _check(kernel, dtype, "bnhd", rng, d=d)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the twin's inf - inf
def test_mma_wide_rows_copied_a_row_address_at_a_time(rng):
    """d = 128 (16 chunks a row): the strided copy gives a row 8 threads and each thread two
    chunks of it, one address a row (stages.make_tile_copy's plan, capped at 8 threads a row
    for STRIDED); the non-finite scan of V's masked tile follows the same plan, so a -inf in a
    key that only later rows see leaves the earlier rows finite, as the reference's."""
    b, h, hkv, nq, nk, d = 1, 2, 1, 20, 40, 128   # two whole 16-key tiles, then a partial
    dtype = np.dtype(np.float16)
    q, k, v = _layouts(rng, "bnhd", b, h, hkv, nq, nk, d, dtype)
    v[0, 0, 38, 100] = -np.inf   # key 38 (the last, partial tile): column 100 of rows >= 18
    v[0, 0, 21, 9] = np.nan      # key 21 (the second whole tile): column 9 of rows >= 1
    out, mem = _strided_out(b, h, nq, d, dtype)
    o = numba_flash.forward(q, k, v, causal=True, kernel="mma", out=out)
    want, _ = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), causal=True)
    got = o.astype(np.float64)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
    fin = np.isfinite(want)
    assert 0 < (~fin).sum() < fin.size   # not vacuous
    assert_scaled_close(got[fin], want[fin], O_TOL[dtype], name="o")
    assert (mem[:, :, 0].astype(np.float64) == SENTINEL).all(), "out: a gap element written"


def test_rows_not_16_byte_aligned_take_element_loads(rng):
    """Rows 17 halves apart (a [.., 17] buffer's first 16): no row is 16-byte aligned, so
    the mma forward takes its element loads (cp.async would fault there; its twin raises)."""
    b, h, n, d = 1, 2, 18, 16
    mem = rng.standard_normal((3, b, h, n, d + 1)).astype(np.float16)
    q, k, v = (mem[i, ..., :d] for i in range(3))
    o = numba_flash.forward(q, k, v, kernel="mma")
    want, _ = reference.attention(*(x.astype(np.float64) for x in (q, k, v)))
    assert_scaled_close(o.astype(np.float64), want, O_TOL[np.dtype(np.float16)], name="o")


@pytest.mark.parametrize("kernel,dtype", [("simt", np.float32), ("mma", np.float16)])
def test_strided_variants(kernel, dtype, rng):
    """The strided build with a window, softcap, ALiBi and a sink (the score stages see only
    positions: the strides stay in the loads and the epilogue)."""
    h = 4
    _check(kernel, dtype, "bnhd", rng, causal=False, window_size=(5, 3), softcap=8.0,
           alibi_slopes=np.linspace(0.1, 0.4, h).astype(np.float32),
           learnable_sink=np.linspace(-1, 1, h).astype(np.float32))


def test_overlapping_out_is_refused():
    """An ``out=`` whose elements share addresses (a broadcast view) cannot be written in
    place: a ValueError naming it, before any launch."""
    q = np.zeros((1, 2, 4, 16), np.float16)
    out = np.broadcast_to(np.zeros((1, 1, 4, 16), np.float16), (1, 2, 4, 16))
    with pytest.raises(ValueError, match="out: expected a view whose last dim is contiguous"):
        numba_flash.forward(q, q, q, out=out)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_device_path_takes_views_without_a_copy(dtype, rng):
    """Stand-in device arrays in flash-attn's layout (q, k, v and out= transposed views of
    [B, N, H, d] memory): the launch gets the views themselves (no copy, no allocation but
    lse's, no device work outside the launch), the steady call replays its plan, and the
    result is the reference's.  float32 takes the SIMT forward there (the auto choice of the
    simulator and of float32), float16 ``kernel="mma"``."""
    b, h, n, d = 1, 2, 16, 16
    kernel = "simt" if dtype == np.float32 else "mma"
    mems = [rng.standard_normal((b, n, h, d)).astype(dtype) for _ in range(3)]
    q, k, v = (sd.adopt(m).transpose(0, 2, 1, 3) for m in mems)
    out_mem = sd.adopt(np.zeros((b, n, h, d), dtype))
    out = out_mem.transpose(0, 2, 1, 3)
    # (unpoisoned: the poison of a strided out= is a fill, device work a plan does not hold)
    with sd.device(execute=True), numba_flash.poisoned_outputs(False):
        numba_flash.forward(q, k, v, causal=True, kernel=kernel, out=out)
        before = plans.plan_stats()["plans"]
        numba_flash.forward(q, k, v, causal=True, kernel=kernel, out=out)
        with sd.count() as c:
            numba_flash.forward(q, k, v, causal=True, kernel=kernel, out=out)
        assert plans.plan_stats()["plans"] == before
    assert (c.syncs, c.d2h, c.h2d, c.foreign, c.launches) == (0, 0, 0, 0, 1), c.log
    assert c.allocations <= 1, c.log     # lse (no copy of q, k, v, nor of out)
    want, _ = reference.attention(*(m.transpose(0, 2, 1, 3).astype(np.float64) for m in mems),
                                  causal=True)
    got = out_mem._a.transpose(0, 2, 1, 3).astype(np.float64)
    assert_scaled_close(got, want, O_TOL[np.dtype(dtype)], name="o")


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_varlen_reads_a_fused_projection_in_place(dtype, rng):
    """``forward_varlen`` on a packed ``[total, 3, H, d]`` projection's q, k, v slices (token
    stride 3 H d), ``out=`` a view of ``[total, H + 1, d]`` memory: the SIMT varlen kernel reads
    and writes them where they lie; the reference per sequence, gaps kept, inputs unchanged."""
    h, d = 2, 16
    cu = np.array([0, 7, 7, 20], np.int32)   # three sequences, one empty
    total = int(cu[-1])
    qkv = rng.standard_normal((total, 3, h, d)).astype(dtype)
    q, k, v = (qkv[:, i] for i in range(3))
    before = qkv.copy()
    mem = np.full((total, h + 1, d), SENTINEL, dtype)
    out = mem[:, 1:]
    o, lse = numba_flash.forward_varlen(q, k, v, cu, cu, max_seqlen_q=13, max_seqlen_k=13,
                                        causal=True, return_lse=True, out=out)
    assert o is out
    want_o, want_lse = reference.attention_varlen(*(x.astype(np.float64) for x in (q, k, v)),
                                                  cu, cu, causal=True)
    assert_scaled_close(o.astype(np.float64), want_o, O_TOL[np.dtype(dtype)], name="o")
    assert_scaled_close(lse, want_lse, LSE_TOL, name="lse")
    assert (mem[:, 0].astype(np.float64) == SENTINEL).all(), "out: a gap element written"
    np.testing.assert_array_equal(qkv, before)
