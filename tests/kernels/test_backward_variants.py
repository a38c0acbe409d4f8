"""Kernel tier: ``numba_flash.backward`` with sliding window, softcap, ALiBi (and their
combinations with causal, GQA, dropout, deterministic and atomic dQ) against
``reference.attention_backward``; argument errors; the folded grid for B * H > 65535.

``o`` and ``lse`` come from ``reference.attention`` with the same variant arguments (and keep
mask), so these tests do not depend on the forward kernel.
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import reference as ref
from numba_flash.kernels.backward import config as bconfig
from numba_flash.kernels.backward import simt as kb
from helpers import randn, assert_scaled_close

#: gradient error bound relative to max(1, max |reference gradient|), as in
#: test_backward_kernel.py / test_dropout_backward.py.  Measured over random cases (B=1, H<=4,
#: GQA, Nq, Nk 1..20, d 1..19, q scaled by 2, causal, window entries -1..5, softcap in
#: {0, 1.5, 5}, ALiBi on/off, dropout p in {0, 0.3}, deterministic on/off; /tmp script, seeds
#: 1000..): float32 over 50 cases 1.5e-6, float16 over 40 cases 5.7e-3 (float16 rounding of o,
#: dO and the inputs, with scores of q scaled by 2 and dropout's 1 / (1 - p)), float64 over 25
#: cases 4.3e-15.  Bounds are ~4x those.
GRAD_TOL = {np.float16: 2.4e-2, np.float32: 6e-6, np.float64: 1.8e-14}


def make_case(rng, b, h, hkv, nq, nk, d, dtype, *, p=0.0, seed=0, q_scale=1.0, **variant):
    """``(args, mask)``: ``(do, q, k, v, o, lse)`` from the reference with ``variant``."""
    q = randn(rng, (b, h, nq, d), dtype, scale=q_scale)
    k = randn(rng, (b, hkv, nk, d), dtype)
    v = randn(rng, (b, hkv, nk, d), dtype)
    do = randn(rng, (b, h, nq, d), dtype)
    mask = numba_flash.dropout_mask(seed, b, h, nq, nk, p) if p else None
    o, lse = ref.attention(q, k, v, dropout_mask=mask, dropout_p=p, **variant)
    lse_dtype = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    return (do, q, k, v, o.astype(dtype), lse.astype(lse_dtype)), mask


def check(args, mask, dtype, grads, p=0.0, **variant):
    do, q, k, v, _, _ = args
    want = ref.attention_backward(do, q, k, v, dropout_mask=mask, dropout_p=p, **variant)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape, (name, g.dtype, g.shape)
        assert_scaled_close(g, w, GRAD_TOL[np.dtype(dtype).type], name)
    return want


# (id, dtype, (B, H, Hkv, Nq, Nk, d), variant, p, deterministic)
CASES = [
    ("window", np.float32, (1, 2, 2, 13, 11, 8), dict(window_size=(3, 2)), 0.0, False),
    ("causal-window-det", np.float32, (1, 2, 1, 12, 15, 8),
     dict(causal=True, window_size=(4, -1)), 0.0, True),
    ("softcap", np.float32, (1, 2, 2, 10, 9, 8), dict(softcap=1.5), 0.0, False),
    ("alibi-causal-gqa-det", np.float32, (1, 4, 2, 9, 12, 8),
     dict(causal=True, alibi_slopes=ref.alibi_slopes(4)), 0.0, True),
    ("all-f16-gqa", np.float16, (2, 2, 1, 11, 10, 8),
     dict(window_size=(5, 1), softcap=2.0,
          alibi_slopes=np.array([[0.5, 0.25], [0.125, 1.0]], np.float32)), 0.0, False),
    ("causal-window-dropout-f16-det", np.float16, (1, 2, 2, 12, 12, 8),
     dict(causal=True, window_size=(6, 0)), 0.25, True),
    ("all-dropout-gqa", np.float32, (1, 4, 2, 10, 13, 12),
     dict(window_size=(4, 3), softcap=3.0, alibi_slopes=ref.alibi_slopes(4)), 0.3, False),
    ("all-f64-causal-det", np.float64, (1, 2, 1, 11, 9, 7),
     dict(causal=True, window_size=(3, -1), softcap=1.0,
          alibi_slopes=ref.alibi_slopes(2)), 0.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_backward_variants_match_reference(rng, case):
    _, dtype, shape, variant, p, det = case
    seed = 2**33 + 17
    args, mask = make_case(rng, *shape, dtype, p=p, seed=seed, q_scale=2.0, **variant)
    grads = numba_flash.backward(*args, dropout_p=p, seed=seed, deterministic=det, **variant)
    check(args, mask, dtype, grads, p=p, **variant)


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_narrow_band_skips_tiles(rng, deterministic):
    """N = 40 over 8-wide simulator tiles with a band of 3 keys: most tile pairs are skipped
    (tile_query_range / tile_key_range) and the rest are masked element by element."""
    variant = dict(window_size=(2, 0))
    args, _ = make_case(rng, 1, 1, 1, 40, 40, 8, np.float32, **variant)
    check(args, None, np.float32, numba_flash.backward(*args, deterministic=deterministic,
                                                       **variant), **variant)


def test_backward_window_rows_that_see_no_key(rng):
    """Nq > Nk with window (2, 0): the first Nq - Nk rows sit left of every key (lse = -inf):
    dq = 0 there, never NaN; softcap and ALiBi on too."""
    variant = dict(window_size=(2, 0), softcap=2.0, alibi_slopes=ref.alibi_slopes(2))
    args, _ = make_case(rng, 1, 2, 1, 20, 6, 8, np.float32, **variant)
    assert np.isneginf(args[5][:, :, :14]).all()
    for det in (False, True):
        dq, dk, dv = numba_flash.backward(*args, deterministic=det, **variant)
        np.testing.assert_array_equal(dq[:, :, :14], 0.0)
        check(args, None, np.float32, (dq, dk, dv), **variant)


def test_backward_softcap_bites(rng):
    """The softcap's (1 - tanh^2) factor matters here: without it the gradient is far off."""
    args, _ = make_case(rng, 1, 1, 1, 8, 8, 8, np.float32, q_scale=3.0, softcap=1.0)
    dq, _, _ = numba_flash.backward(*args, softcap=1.0)
    uncapped = ref.attention_backward(*args[:4])[0]
    capped = check(args, None, np.float32, numba_flash.backward(*args, softcap=1.0),
                   softcap=1.0)[0]
    assert np.abs(capped - uncapped).max() > 100 * GRAD_TOL[np.float32] * np.abs(capped).max()


def _good():
    z = np.zeros
    return (z((1, 2, 4, 8), np.float32), z((1, 2, 4, 8), np.float32),
            z((1, 1, 5, 8), np.float32), z((1, 1, 5, 8), np.float32),
            z((1, 2, 4, 8), np.float32), z((1, 2, 4), np.float32))


@pytest.mark.parametrize("kwargs, exc, msg", [
    (dict(window_size=(-2, 0)), ValueError, "window_size: expected left >= -1"),
    (dict(window_size=(1, 2, 3)), ValueError, "window_size: expected a pair"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size: expected left an int"),
    (dict(window_size=3), TypeError, "window_size: expected a pair"),
    (dict(softcap=-1.0), ValueError, "softcap: expected a finite number >= 0"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap: expected a real number"),
    (dict(alibi_slopes=np.zeros(3, np.float32)), ValueError, r"alibi_slopes: expected shape"),
    (dict(alibi_slopes=np.zeros(2, np.float64)), TypeError, "alibi_slopes: expected dtype float32"),
    (dict(alibi_slopes=np.array([1.0, np.inf], np.float32)), ValueError,
     "alibi_slopes: expected finite"),
    (dict(kernel="tensor"), ValueError, "kernel: expected one of"),
    (dict(kernel=1), TypeError, "kernel: expected one of"),
    (dict(kernel="mma"), ValueError, "kernel: 'mma' .* float16"),
])
def test_backward_variant_argument_errors(kwargs, exc, msg):
    args = _good()
    before = [a.copy() for a in args]
    with pytest.raises(exc, match=msg):
        numba_flash.backward(*args, **kwargs)
    for a, a0 in zip(args, before):
        np.testing.assert_array_equal(a, a0)


def test_backward_kernel_choice(rng):
    """"auto" and "simt" run the SIMT kernels here (simulator); "mma" for float16 runs the
    tensor-core backward when it exists and otherwise says so by name."""
    from numba_flash.frontend.kernel_choice import check_backward_kernel as check_kernel

    assert check_kernel("auto", np.float16) == "simt"  # simulator: no compute capability
    assert check_kernel("auto", np.float32) == "simt"
    args, _ = make_case(rng, 1, 1, 1, 4, 4, 8, np.float16)
    if not _real_mma_available():
        with pytest.raises(NotImplementedError, match="kernel: 'mma'"):
            numba_flash.backward(*args, kernel="mma")
    a = numba_flash.backward(*args, kernel="simt")
    b = numba_flash.backward(*args, kernel="auto")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)


def test_backward_mma_dispatch(monkeypatch):
    """kernel="auto" picks tensor cores for float16 on compute capability >= 8.0 (when the mma
    backward exists), and kernel="mma" hands every argument on, validated once, to the
    tensor-core launches (launch_backward_mma)."""
    import numba_flash.frontend.kernel_choice as kc

    monkeypatch.setattr(kc, "mma_available", lambda name: True)
    for cc, dtype, want in (((9, 0), np.float16, "mma"), ((8, 0), np.float16, "mma"),
                            ((7, 5), np.float16, "simt"), ((9, 0), np.float32, "simt"),
                            (None, np.float16, "simt")):
        monkeypatch.setattr(kc, "cuda_cc", lambda cc=cc: cc)
        assert kc.check_backward_kernel("auto", dtype) == want, (cc, dtype)
    if not _real_mma_available():
        pytest.skip("numba_flash.ops.backward_mma is not in this build")
    import numba_flash.ops.backward_mma as om

    seen = {}
    monkeypatch.setattr(om, "launch_backward_mma", lambda *a, **kw: seen.update(kw) or "called")
    args = tuple(x.astype(np.float16) if x.dtype == np.float32 and x.ndim == 4 else x
                 for x in _good())
    slopes = np.ones(2, np.float32)
    assert numba_flash.backward(*args, kernel="mma", causal=True, window_size=[3, -1],
                                softcap=1.5, alibi_slopes=slopes, dropout_p=0.1, seed=5,
                                deterministic=True) == "called"
    # causal with window (3, -1): the kernels' bounds left 3, right 0
    assert (seen["left"], seen["right"]) == (3, 0) and seen["softcap"] == 1.5
    b, h = args[1].shape[:2]
    assert seen["alibi"].shape == (b, h) and (seen["alibi"] == 1.0).all()
    assert seen["dropout_p"] == 0.1 and seen["seed"] == 5 and seen["deterministic"]
    assert seen["scale"] == pytest.approx(1 / np.sqrt(args[1].shape[-1]))
    assert seen["shape"][:2] == (b, h)


def _real_mma_available():
    try:
        import numba_flash.ops.backward_mma  # noqa: F401
    except ImportError:
        return False
    return True


def test_grid_folds_batch_and_heads_past_65535():
    """B * H = 70000 (> 65535, CUDA's gridDim.y/z limit): every backward grid is 1-D, inside
    CUDA's limits, and its last block unfolds to the last (tile, b, h)."""
    b, h, hkv, n, d = 7000, 10, 5, 300, 64
    for dtype in (np.float16, np.float32, np.float64):
        grids = kb.backward_grids(b, h, hkv, n, n, d, dtype, simulator=False)
        for name, grid in grids.items():
            assert len(grid) == 1 and 0 < grid[0] <= kb.GRID_X_MAX, (name, grid)
        block_m, block_n, _, _ = bconfig.default_tiles(d, dtype, simulator=False)
        tiles = -(-n // block_n)
        assert grids["dkdv"] == (tiles * b * h,)
        assert kb.unfold_block_py(grids["dkdv"][0] - 1, tiles, h) == (tiles - 1, b - 1, h - 1)
        tiles_q = -(-n // block_m)
        assert kb.unfold_block_py(grids["dq"][0] - 1, tiles_q, h) == (tiles_q - 1, b - 1, h - 1)
    # every (tile, b, h) appears exactly once for a small fold
    seen = {kb.unfold_block_py(x, 3, 5) for x in range(kb.fold_grid(3, 4, 5)[0])}
    assert seen == {(t, bb, hh) for t in range(3) for bb in range(4) for hh in range(5)}
    with pytest.raises(ValueError, match="grid limit"):
        kb.fold_grid(2**20, 2**10, 2**10)


def test_backward_many_heads_folded_grid(rng):
    """A launch whose B * H blocks run on the folded 1-D grid (small here: the simulator)."""
    args, _ = make_case(rng, 3, 6, 3, 3, 5, 4, np.float32, causal=True)
    check(args, None, np.float32, numba_flash.backward(*args, causal=True), causal=True)


@pytest.mark.gpu
def test_backward_grid_70000_heads_on_gpu():
    """B * H = 70000 on the device: every (b, h) gets its gradient (GPU only)."""
    rng = np.random.default_rng(0)
    b, h, n, d = 70000, 1, 4, 16
    args, _ = make_case(rng, b, h, 1, n, n, d, np.float32)
    grads = numba_flash.backward(*args)
    sample = [0, 12345, 65535, 65536, 69999]
    sub = tuple(x[sample] for x in args)
    want = ref.attention_backward(*sub[:4])
    for g, w in zip(grads, want):
        assert_scaled_close(g[sample], w, GRAD_TOL[np.float32])


def test_backward_gpu_tile_layout_in_simulator(rng, monkeypatch):
    """The GPU configuration (128 threads, 32 x 32 tiles at d = 64, 32 lanes per preprocess row)
    run in the simulator, which otherwise uses 16 threads and 8 x 8 tiles: the thread layouts the
    GPU launches compute the same gradients (window, softcap, ALiBi, causal, GQA, both dQ paths).
    Measured: 5e-7 relative (float32)."""
    import numba_flash.frontend.backward_launch as ob

    monkeypatch.setattr(ob, "default_tiles", lambda d, dtype: bconfig.default_tiles(
        d, dtype, simulator=False))
    monkeypatch.setattr(ob, "elem_threads", lambda: bconfig.GPU_ELEM_THREADS)
    monkeypatch.setattr(ob, "row_lanes", lambda: bconfig.GPU_ROW_LANES)
    variant = dict(causal=True, window_size=(20, -1), softcap=2.0,
                   alibi_slopes=ref.alibi_slopes(2))
    args, _ = make_case(rng, 1, 2, 1, 40, 37, 64, np.float32, q_scale=2.0, **variant)
    check(args, None, np.float32, numba_flash.backward(*args, deterministic=True, **variant),
          **variant)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NumPy on inf * 0
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_non_finite_key_or_query_never_reaches_a_row_that_does_not_see_it(
        rng, deterministic):
    """An inf in k (or q) that shares a tile with rows (keys) that do not see it: those rows'
    gradients stay finite (no 0 * inf in dS K or dS^T Q); the rows that see it are NaN, as in
    the reference."""
    b, h, hkv, nq, nk, d = 1, 2, 1, 20, 18, 8
    q = randn(rng, (b, h, nq, d))
    k = randn(rng, (b, hkv, nk, d))
    v = randn(rng, (b, hkv, nk, d))
    do = randn(rng, (b, h, nq, d))
    k[0, 0, 12, 2] = np.inf
    q[0, 1, 3, 5] = np.nan
    kw = dict(window_size=(3, 2))
    o, lse = numba_flash.forward(q, k, v, return_lse=True, **kw)
    dq, dk, dv = numba_flash.backward(do, q, k, v, o, lse, deterministic=deterministic, **kw)
    want = ref.attention_backward(do, q, k, v, **kw)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert (np.isnan(got) == np.isnan(w)).all(), name
        fin = np.isfinite(w)
        assert_scaled_close(got[fin], w[fin], 6e-6, name=name)
    vis = ref.visible_mask(nq, nk, window_size=(3, 2))
    blind = ~vis[:, 12]  # rows that do not see key 12 (some share its tile)
    assert np.isfinite(dq[0, 0, blind]).all() and np.isnan(dq[0, 0, vis[:, 12]]).all()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the simulator's NumPy on NaN * 0
@pytest.mark.parametrize("deterministic, p", [(False, 0.0), (True, 0.3)])
def test_backward_non_finite_do_never_reaches_a_key_the_row_does_not_see(rng, deterministic, p):
    """A NaN (inf) in ``do[i, c]``: ``dq`` of row i, ``dk`` and ``dv[:, c]`` of the keys row i
    sees are non-finite, as in the reference; ``dv`` of the keys it does not see, some in its
    tile, stays finite (no ``0 * NaN`` in ``P^T dO``), also with dropout and GQA."""
    b, h, hkv, nq, nk, d = 1, 2, 1, 20, 18, 8
    kw = dict(window_size=(3, 2))
    (do, q, k, v, o, lse), mask = make_case(rng, b, h, hkv, nq, nk, d, np.float32, p=p,
                                            seed=5, **kw)
    do[0, 0, 9, 3] = np.nan
    do[0, 1, 14, 6] = np.inf
    dq, dk, dv = numba_flash.backward(do, q, k, v, o, lse, deterministic=deterministic,
                                      dropout_p=p, seed=5, **kw)
    want = ref.attention_backward(do, q, k, v, dropout_mask=mask, dropout_p=p, **kw)
    for name, got, w in zip(("dq", "dk", "dv"), (dq, dk, dv), want):
        assert (np.isfinite(got) == np.isfinite(w)).all(), name
        fin = np.isfinite(w)
        assert_scaled_close(got[fin], w[fin], GRAD_TOL[np.float32], name=name)
    vis = ref.visible_mask(nq, nk, window_size=(3, 2))
    assert not np.isfinite(dv[0, 0, vis[9], 3]).any()          # keys row 9 sees (and 14)
    assert np.isfinite(dv[0, 0, ~(vis[9] | vis[14])]).all()    # keys neither row sees
    assert np.isfinite(dv[0, 0, :, :3]).all() and np.isfinite(dv[0, 0, :, 7]).all()
