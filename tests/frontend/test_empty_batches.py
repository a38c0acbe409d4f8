"""Empty batches and empty key sets (issue 59): ``B``, ``Nq`` or ``Nk`` 0 (varlen ``total_q`` or
``total_k`` 0, decode ``B = 0`` or a cache that holds no key) are answered as the docs say, the
same as :mod:`numba_flash.reference`: ``o = 0``, ``lse = -inf`` (or the learnable sink's logit),
zero gradients, without a kernel launch (``ArrayCall.launch`` raises here), inputs unchanged;
every other argument is still checked, and ``H = 0`` / ``d = 0`` stay the old error.
flash-attn fills ``lse`` with ``+inf`` there (docs/variants.md, "Empty batches")."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import numba_flash as nf
from numba_flash import reference
from numba_flash.frontend import arrays

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
#: (B, Nq, Nk) with one of them 0
DENSE = [(0, 3, 4), (2, 0, 4), (2, 3, 0), (0, 0, 0)]
DTYPES = [np.float32, np.float64, BF16, np.float16]
H, HKV, D, DV = 4, 2, 8, 6
SINK = np.array([0.5, -1.0, 2.0, -np.inf], np.float32)
NO_DIM = r"expected no empty dimension"


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any kernel launch fails the test."""
    def launch(*args, **kwargs):
        raise AssertionError("an empty batch launched a kernel")

    monkeypatch.setattr(arrays.ArrayCall, "launch", launch)


def lse_dtype(dtype):
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def arrays_of(rng, dtype, *shapes):
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def dense(rng, dtype, b, nq, nk, d_v=DV):
    return arrays_of(rng, dtype, (b, H, nq, D), (b, HKV, nk, D), (b, HKV, nk, d_v))


def same(got, want, dtype=None, name="output"):
    """Shape, dtype and values (NaN, -inf compared as values)."""
    got = np.asarray(got)
    assert got.shape == np.shape(want), f"{name}: shape {got.shape}, want {np.shape(want)}"
    if dtype is not None:
        assert got.dtype == np.dtype(dtype), f"{name}: dtype {got.dtype}, want {dtype}"
    np.testing.assert_array_equal(got.astype(np.float64), np.asarray(want, np.float64),
                                  err_msg=name)


def unchanged(inputs, copies):
    for x, c in zip(inputs, copies):
        np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(c).view(np.uint8))


# -- forward ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", DENSE)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("sink", [None, SINK], ids=["no-sink", "sink"])
def test_forward_answers_as_the_reference(rng, shape, dtype, sink):
    q, k, v = dense(rng, dtype, *shape)
    copies = [x.copy() for x in (q, k, v)]
    o, lse = nf.forward(q, k, v, causal=True, return_lse=True, learnable_sink=sink)
    ro, rlse = reference.attention(q, k, v, causal=True, learnable_sink=sink)
    same(o, ro, dtype, "o")
    same(lse, rlse, lse_dtype(dtype), "lse")
    if shape[2] == 0 and shape[0] * shape[1]:   # every row sees no key: -inf or the sink
        same(lse, np.broadcast_to((SINK if sink is not None else np.full(H, -np.inf))[None, :,
                                                                                        None],
                                  lse.shape))
    unchanged((q, k, v), copies)
    assert isinstance(nf.forward(q, k, v), np.ndarray)


ROUTES = {
    "simt": dict(kernel="simt"),
    "mma": dict(kernel="mma"),
    "wgmma": dict(kernel="wgmma"),
    "tiles": dict(kernel="simt", block_m=8, block_n=8),
    "dropout": dict(dropout_p=0.3, seed=5),
    "variants": dict(window_size=(2, 1), softcap=3.0, alibi_slopes=np.ones(H, np.float32)),
    "mask_mod": dict(mask_mod=lambda b, h, i, j: i >= j),
    "score_mod": dict(score_mod=lambda s, b, h, i, j, bias: s + bias[h],
                      aux_tensors=(np.zeros(H, np.float32),)),
    "kv_indices": dict(kv_indices=True),
}


@pytest.mark.parametrize("shape", DENSE[:3])
@pytest.mark.parametrize("route", list(ROUTES))
def test_forward_every_route(rng, shape, route):
    b, nq, nk = shape
    kw = dict(ROUTES[route])
    q, k, v = dense(rng, np.float16, b, nq, nk, d_v=D)
    if kw.get("kv_indices"):
        kw["kv_indices"] = np.full((b, HKV, nq, 3), -1, np.int32)
    o, lse = nf.forward(q, k, v, return_lse=True, learnable_sink=SINK, **kw)
    ro, rlse = reference.attention(q, k, v, learnable_sink=SINK)
    same(o, ro, np.float16, "o")
    same(lse, rlse, np.float32, "lse")


@pytest.mark.parametrize("bad, exc, match", [
    (dict(k=(2, 3, 0, D), v=(2, 3, 0, D)), ValueError,
     r"k: expected a number of kv heads that divides the 4"),
    (dict(q=(2, H, 3, 300), k=(2, HKV, 0, 300), v=(2, HKV, 0, 300)), ValueError,
     r"q: expected head dim 1..256"),
    (dict(softmax_scale=-1.0), ValueError, r"softmax_scale: expected a finite number > 0"),
    (dict(kernel="nope"), ValueError, r"kernel"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, r"alibi_slopes: expected shape"),
    (dict(learnable_sink=np.ones(3, np.float32)), ValueError, r"learnable_sink: expected shape"),
    (dict(dropout_p=1.5), ValueError, r"dropout_p"),
    (dict(block_m=7), ValueError, r"block_m: expected one of"),
    (dict(kv_indices=np.zeros((2, HKV, 3, 1), np.int32)), ValueError,
     r"kv_indices: expected entries in \[-1, cache_seqlens\[b\]\)"),
    (dict(q=(2, 0, 3, D)), ValueError, r"q: " + NO_DIM),
    (dict(q=(2, H, 3, 0), k=(2, HKV, 0, 0), v=(2, HKV, 0, 0)), ValueError, r"q: " + NO_DIM),
])
def test_forward_checks_everything_first(rng, bad, exc, match):
    """Nk = 0, yet every other argument is checked as for a non-empty call (the old messages);
    H = 0 and d = 0 stay refused."""
    shapes = dict(q=(2, H, 3, D), k=(2, HKV, 0, D), v=(2, HKV, 0, D))
    kw = {n: x for n, x in bad.items() if n not in shapes}
    shapes.update({n: x for n, x in bad.items() if n in shapes})
    q, k, v = (rng.standard_normal(shapes[n]).astype(np.float32) for n in "qkv")
    with pytest.raises(exc, match=match):
        nf.forward(q, k, v, **kw)


@pytest.mark.parametrize("shape", [(0, 3, 5), (2, 0, 5), (2, 3, 0)], ids=["B0", "Nq0", "Nk0"])
@pytest.mark.parametrize("kernel", ["mma", "wgmma"])
def test_forward_e4m3_answered(shape, kernel):
    """The fp8 forward answers as the others after its checks (both kernels, a sink): o = 0
    in out_dtype, lse = -inf or the sink; H = 0 stays refused."""
    b, nq, nk = shape
    q = np.ones((b, H, nq, 64), E4M3)
    k = np.ones((b, 1, nk, 64), E4M3)
    o, lse = nf.forward(q, k, k, return_lse=True, kernel=kernel, learnable_sink=SINK,
                        out_dtype="float16")
    same(o, np.zeros((b, H, nq, 64)), np.float16, "o")
    same(lse, np.broadcast_to(SINK[None, :, None], (b, H, nq)), np.float32, "lse")
    with pytest.raises(ValueError, match=r"q: " + NO_DIM):
        nf.forward(np.ones((1, 0, 3, 32), E4M3), k[:1], k[:1], kernel=kernel)


# -- backward --------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", DENSE)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("sink", [None, SINK], ids=["no-sink", "sink"])
def test_backward_zero_gradients(rng, shape, dtype, sink):
    q, k, v = dense(rng, dtype, *shape)
    o, lse = nf.forward(q, k, v, return_lse=True, learnable_sink=sink)
    do = rng.standard_normal(o.shape).astype(dtype)
    ins = (do, q, k, v, o, lse)
    copies = [x.copy() for x in ins]
    grads = nf.backward(*ins, causal=True, learnable_sink=sink)
    want = reference.attention_backward(do, q, k, v, causal=True, learnable_sink=sink)
    assert len(grads) == len(want) == (3 if sink is None else 4)
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want, (q, k, v)):
        same(g, np.zeros(x.shape), dtype, name)
        same(g, w, dtype, name)
    if sink is not None:
        same(grads[3], want[3], np.float32, "dsink")
        same(grads[3], np.zeros(H), np.float32, "dsink")
    unchanged(ins, copies)


@pytest.mark.parametrize("shape", DENSE[:3])
@pytest.mark.parametrize("route", ["mma", "deterministic", "dropout", "kv_indices",
                                   "kv_indices-deterministic", "aux_grad"])
def test_backward_every_route(rng, shape, route):
    from numba_flash.flex import atomic_add

    b, nq, nk = shape
    dtype = np.float16 if route == "mma" else np.float32
    q, k, v = dense(rng, dtype, b, nq, nk, d_v=D)
    o, lse = nf.forward(q, k, v, return_lse=True)
    kw = {}
    if route == "mma":
        kw = dict(kernel="mma")
    elif route == "deterministic":
        kw = dict(deterministic=True)
    elif route == "dropout":
        kw = dict(dropout_p=0.3, seed=7)
    elif route.startswith("kv_indices"):
        kw = dict(kv_indices=np.full((b, 1, nq, 2), -1, np.int32),
                  deterministic=route.endswith("deterministic"))
    elif route == "aux_grad":
        def score_mod(s, b, h, i, j, bias):
            return s + bias[h]

        def score_mod_grad(s, b, h, i, j, bias):
            return 1.0

        def aux_grad(g, s, b, h, i, j, grads, bias):
            atomic_add(grads[0], h, g)

        kw = dict(score_mod=score_mod, score_mod_grad=score_mod_grad, aux_grad=aux_grad,
                  aux_tensors=(np.zeros(H, np.float32),))
    grads = nf.backward(o, q, k, v, o, lse, **kw)
    for g, x in zip(grads, (q, k, v)):
        same(g, np.zeros(x.shape), dtype)
    if route == "aux_grad":
        assert len(grads) == 4
        same(grads[3], np.zeros(H), np.float32, "aux gradient")


def test_backward_checks_everything_first(rng):
    q, k, v = dense(rng, np.float32, 2, 3, 0)
    o, lse = nf.forward(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"lse: expected shape \(2, 4, 3\)"):
        nf.backward(o, q, k, v, o, lse[:, :, :2])
    with pytest.raises(TypeError, match=r"lse: expected dtype in \(float32\)"):
        nf.backward(o, q, k, v, o, lse.astype(np.float64))
    with pytest.raises(ValueError, match=r"score_mod_grad"):
        nf.backward(o, q, k, v, o, lse, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(ValueError, match=r"kernel"):
        nf.backward(o, q, k, v, o, lse, kernel="nope")
    with pytest.raises(ValueError, match=r"q: " + NO_DIM):
        nf.backward(o[:, :0], q[:, :0], k, v, o[:, :0], lse[:, :0])


# -- varlen ----------------------------------------------------------------------------------
def packed(rng, dtype, cu_q, cu_k, d_v=DV):
    return arrays_of(rng, dtype, (int(cu_q[-1]), H, D), (int(cu_k[-1]), HKV, D),
                     (int(cu_k[-1]), HKV, d_v))


ZERO = np.zeros(3, np.int32)
SOME = np.array([0, 2, 5], np.int32)
VARLEN = [(ZERO, SOME), (SOME, ZERO), (ZERO, ZERO)]
VARLEN_IDS = ["total_q=0", "total_k=0", "both"]


def lens(cu):
    return dict(max_seqlen_q=int(np.diff(cu[0]).max()), max_seqlen_k=int(np.diff(cu[1]).max()))


@pytest.mark.parametrize("cu", VARLEN, ids=VARLEN_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("sink", [None, SINK], ids=["no-sink", "sink"])
def test_varlen_forward_and_backward(rng, cu, dtype, sink):
    cu_q, cu_k = cu
    q, k, v = packed(rng, dtype, cu_q, cu_k)
    copies = [x.copy() for x in (q, k, v)]
    o, lse = nf.forward_varlen(q, k, v, cu_q, cu_k, return_lse=True, learnable_sink=sink,
                               causal=True, **lens(cu))
    ro, rlse = reference.attention_varlen(q, k, v, cu_q, cu_k, causal=True, learnable_sink=sink)
    same(o, ro, dtype, "o")
    same(lse, rlse, lse_dtype(dtype), "lse")
    unchanged((q, k, v), copies)
    do = rng.standard_normal(o.shape).astype(dtype)
    grads = nf.backward_varlen(do, q, k, v, o, lse, cu_q, cu_k, learnable_sink=sink, causal=True,
                               **lens(cu))
    want = reference.attention_backward_varlen(do, q, k, v, cu_q, cu_k, causal=True,
                                               learnable_sink=sink)
    for name, g, w in zip(("dq", "dk", "dv", "dsink"), grads, want):
        same(g, w, np.float32 if name == "dsink" else dtype, name)
    assert len(grads) == len(want)


@pytest.mark.parametrize("cu", VARLEN, ids=VARLEN_IDS)
@pytest.mark.parametrize("route", ["dropout", "mask_mod", "kv_indices", "paged",
                                   "paged-no-block", "fp8"])
def test_varlen_every_route(rng, cu, route):
    cu_q, cu_k = cu
    q, k, v = packed(rng, np.float32, cu_q, cu_k, d_v=D)
    kw = {}
    if route == "dropout":
        kw = dict(dropout_p=0.4)
    elif route == "mask_mod":
        kw = dict(mask_mod=lambda b, h, i, j: i >= j)
    elif route == "kv_indices":
        kw = dict(kv_indices=np.full((int(cu_q[-1]), HKV, 2), -1, np.int32))
    elif route.startswith("paged"):
        if route == "paged-no-block" and cu_k[-1]:
            pytest.skip("keys a cache of no block cannot hold: test_varlen_checks_everything_first")
        blocks = 0 if route == "paged-no-block" else 3
        k = v = rng.standard_normal((blocks, HKV, 4, D)).astype(np.float32)
        kw = dict(block_table=np.zeros((2, 1 if blocks else 0), np.int32))
    elif route == "fp8":
        q, k, v = (x.astype(E4M3) for x in arrays_of(rng, np.float32, (int(cu_q[-1]), H, 32),
                                                       (int(cu_k[-1]), HKV, 32),
                                                       (int(cu_k[-1]), HKV, 32)))
    o, lse = nf.forward_varlen(q, k, v, cu_q, cu_k, return_lse=True, learnable_sink=SINK,
                               **lens(cu), **kw)
    assert o.shape == q.shape[:2] + v.shape[-1:]
    same(o, np.zeros(o.shape))
    same(lse, np.broadcast_to(SINK[:, None], (H, int(cu_q[-1]))), np.float32, "lse")


def test_varlen_checks_everything_first(rng):
    q, k, v = packed(rng, np.float32, SOME, ZERO)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: expected the packed length 0 last"):
        nf.forward_varlen(q, k, v, SOME, SOME, **lens((SOME, SOME)))
    with pytest.raises(ValueError, match=r"max_seqlen_q: expected at least the longest"):
        nf.forward_varlen(q, k, v, SOME, ZERO, max_seqlen_q=1, max_seqlen_k=0)
    with pytest.raises(ValueError, match=r"alibi_slopes"):
        nf.forward_varlen(q, k, v, SOME, ZERO, alibi_slopes=np.ones(2, np.float32),
                          **lens((SOME, ZERO)))
    with pytest.raises(ValueError, match=r"q: " + NO_DIM):
        nf.forward_varlen(q[:, :0], k[:, :0], v[:, :0], SOME, ZERO, **lens((SOME, ZERO)))
    kc = np.zeros((0, HKV, 4, D), np.float32)
    table = np.zeros((2, 1), np.int32)
    with pytest.raises(ValueError, match=r"block_table: expected the entries holding"):
        nf.forward_varlen(q, kc, kc, SOME, SOME, block_table=table, **lens((SOME, SOME)))
    with pytest.raises(ValueError, match=r"k: expected a paged cache of at least one block"):
        nf.forward_varlen(q, kc, kc, SOME, SOME, block_table=table, validate=False,
                          **lens((SOME, SOME)))
    o, lse = nf.forward_varlen(q, k, v, SOME, ZERO, return_lse=True, **lens((SOME, ZERO)))
    do = np.ones_like(o)
    with pytest.raises(ValueError, match=r"lse: expected shape \(4, 5\)"):
        nf.backward_varlen(do, q, k, v, o, lse[:, :2], SOME, ZERO, **lens((SOME, ZERO)))
    grads = nf.backward_varlen(do, q, k, v, o, lse, SOME, ZERO,
                               kv_indices=np.full((5, 1, 2), -1, np.int32), **lens((SOME, ZERO)))
    for g, x in zip(grads, (q, k, v)):
        same(g, np.zeros(x.shape), np.float32)


# -- decode ----------------------------------------------------------------------------------
def kvcache(rng, dtype, b, nq, n_cache, nmax, single=False):
    q_shape = (b, H, D) if single else (b, H, nq, D)
    return arrays_of(rng, dtype, q_shape, (n_cache, HKV, nmax, D), (n_cache, HKV, nmax, DV))


@pytest.mark.parametrize("case", ["B=0", "B=0 single", "Nq=0", "Nmax=0", "Nmax=0 single"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("sink", [None, SINK], ids=["no-sink", "sink"])
def test_decode_answers_as_the_reference(rng, case, dtype, sink):
    b, nq, nmax = {"B=0": (0, 3, 5), "Nq=0": (2, 0, 5), "Nmax=0": (2, 3, 0)}[case.split()[0]]
    q, kc, vc = kvcache(rng, dtype, b, nq, b, nmax, single="single" in case)
    lengths = np.zeros(b, np.int32)
    copies = [x.copy() for x in (q, kc, vc)]
    o, lse = nf.decode(q, kc, vc, cache_seqlens=lengths, return_lse=True, learnable_sink=sink)
    ro, rlse, _, _ = reference.kvcache_decode(q, kc, vc, lengths, learnable_sink=sink)
    same(o, ro, dtype, "o")
    same(lse, rlse, lse_dtype(dtype), "lse")
    unchanged((q, kc, vc), copies)


@pytest.mark.parametrize("form", ["paged", "cache_batch_idx", "append", "append-rotary",
                                  "kv_indices", "latent"])
def test_decode_empty_batch_every_form(rng, form):
    # a contiguous cache of B = 0 rows, or (paged, cache_batch_idx) a cache of its own size
    q, kc, vc = kvcache(rng, np.float32, 0, 2, 3 if form in ("paged", "cache_batch_idx") else 0,
                        8)
    kw = dict(cache_seqlens=np.zeros(0, np.int32))
    if form == "paged":
        kw.update(block_table=np.zeros((0, 2), np.int32), cache_leftpad=np.zeros(0, np.int32))
    elif form == "cache_batch_idx":
        kw.update(cache_batch_idx=np.zeros(0, np.int32))
    elif form.startswith("append"):
        kw.update(k_new=np.ones((0, HKV, 1, D), np.float32),
                  v_new=np.ones((0, HKV, 1, DV), np.float32))
        if form == "append-rotary":
            kw.update(rotary_cos=np.ones((16, 2), np.float32),
                      rotary_sin=np.zeros((16, 2), np.float32))
    elif form == "kv_indices":
        kw.update(kv_indices=np.zeros((0, HKV, 2, 3), np.int32))
    if form == "latent":
        vc, kw = None, dict(kw, head_dim_v=4)
    else:
        kw["learnable_sink"] = SINK
    o, lse = nf.decode(q, kc, vc, return_lse=True, **kw)
    assert o.shape == (0, H, 2, 4 if form == "latent" else DV) and lse.shape == (0, H, 2)


def test_decode_cache_that_holds_no_key(rng):
    q, kc, vc = kvcache(rng, np.float32, 2, 3, 2, 0)
    kw = dict(return_lse=True, learnable_sink=SINK)
    with pytest.raises(ValueError, match=r"cache_seqlens: expected every entry <= Nmax = 0"):
        nf.decode(q, kc, vc, cache_seqlens=np.array([0, 1], np.int32), **kw)
    new = dict(k_new=np.ones((2, HKV, 1, D), np.float32), v_new=np.ones((2, HKV, 1, DV),
                                                                         np.float32))
    with pytest.raises(ValueError, match=r"k_cache: too small: sequence 0 holds 0 tokens"):
        nf.decode(q, kc, vc, cache_seqlens=np.zeros(2, np.int32), **new, **kw)
    # unvalidated: the rows of a length the cache cannot hold are NaN, as the kernel makes them
    o, lse = nf.decode(q, kc, vc, cache_seqlens=np.array([0, 1], np.int32), validate=False, **kw)
    same(o[0], np.zeros((H, 3, DV)))
    same(lse[0], np.broadcast_to(SINK[:, None], (H, 3)))
    assert np.isnan(o[1]).all() and np.isnan(lse[1]).all()
    o = nf.decode(q, kc, vc, cache_seqlens=np.zeros(2, np.int32), validate=False, **new)
    assert np.isnan(o).all()    # no room for the new tokens: every row NaN
    # a paged cache of no block: every length 0, else the table's error
    pc = np.zeros((0, HKV, 4, D), np.float32)
    table = np.zeros((2, 2), np.int32)
    o, lse = nf.decode(q, pc, pc, cache_seqlens=np.zeros(2, np.int32), block_table=table, **kw)
    same(o, np.zeros((2, H, 3, D)))
    same(lse, np.broadcast_to(SINK[None, :, None], (2, H, 3)))
    with pytest.raises(ValueError, match=r"block_table: expected entries covering live tokens"):
        nf.decode(q, pc, pc, cache_seqlens=np.array([0, 2], np.int32), block_table=table, **kw)
    with pytest.raises(ValueError, match=r"q: " + NO_DIM):
        nf.decode(q[:, :0], kc, vc, cache_seqlens=np.zeros(2, np.int32))
    with pytest.raises(ValueError, match=r"k_cache: " + NO_DIM):
        nf.decode(q, kc[:, :, :, :0], vc, cache_seqlens=np.zeros(2, np.int32))


# -- the reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", DENSE)
def test_reference_rule(rng, shape):
    """The reference's own answer is the rule: o = 0, lse = -inf or the sink, gradients 0."""
    q, k, v = dense(rng, np.float64, *shape)
    o, lse = reference.attention(q, k, v, learnable_sink=SINK)
    same(o, np.zeros(o.shape))
    same(lse, np.broadcast_to(SINK[None, :, None], lse.shape))
    assert o.shape == (shape[0], H, shape[1], DV)
    do = rng.standard_normal(o.shape)
    for g, x in zip(reference.attention_backward(do, q, k, v, learnable_sink=SINK),
                    (q, k, v, SINK)):
        same(g, np.zeros(np.shape(x)))
    b = shape[0]
    o, lse = reference.paged_decode(q, k, v, np.zeros(b, np.int64))
    assert o.shape == (b, H, shape[1], DV) and lse.shape == (b, H, shape[1])
    same(lse, np.full(lse.shape, -np.inf))
