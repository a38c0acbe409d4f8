"""The ring's per-step logic in one process: the block plan, the messages, the argument checks,
and forward/backward against the whole-sequence oracle through an in-process communicator
(tests/distributed/ring_fake_comm.py; the real MPI run is test_ring_mpi.py)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from numba_flash import reference
from numba_flash.kernels.core.elements import BFLOAT16
from numba_flash.distributed import (contiguous_shard, contiguous_unshard, rank_chunks,
                                     ring_backward, ring_forward, shard_positions, zigzag_shard,
                                     zigzag_unshard)
from numba_flash.distributed.ring import _plan
from ring_fake_comm import FakeWorld

HELPERS = {"zigzag": (zigzag_shard, zigzag_unshard),
           "contiguous": (contiguous_shard, contiguous_unshard)}


@pytest.mark.parametrize("layout", sorted(HELPERS))
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_plan_covers_the_mask_once(layout, causal, world):
    """Over all ranks and steps, the planned blocks (with the kernel's own causal mask inside a
    causal block) cover every visible (query, key) pair of the whole sequence exactly once."""
    c = 3
    n_local = c * len(rank_chunks(0, world, layout))
    n = n_local * world
    count = np.zeros((n, n), int)
    calls = []
    for rank in range(world):
        q_pos = shard_positions(rank, world, n, layout)
        calls.append(0)
        for step in range(world):
            src = (rank - step) % world
            k_pos = shard_positions(src, world, n, layout)
            for rows, cols, blk_causal in _plan(rank_chunks(rank, world, layout),
                                                rank_chunks(src, world, layout), c, causal):
                qi, kj = q_pos[rows], k_pos[cols]
                block = np.ones((len(qi), len(kj)), int)
                if blk_causal:
                    assert len(qi) == len(kj)  # the kernel's bottom-right = top-left here
                    block = np.tril(block)
                np.add.at(count, (qi[:, None], kj[None, :]), block)
                calls[-1] += 1
    want = np.tril(np.ones((n, n), int)) if causal else np.ones((n, n), int)
    np.testing.assert_array_equal(count, want)
    if layout == "zigzag" and world > 1:
        # one kernel call per step: the diagonal step is one causal call, the others one full
        assert calls == [world] * world


def _inputs(rng, world, dtype, b=1, h=2, hkv=1, n_local=4, d=8):
    n = n_local * world
    return [rng.standard_normal(s).astype(dtype) for s in
            ((b, h, n, d), (b, hkv, n, d), (b, hkv, n, d), (b, h, n, d))]


def _run_ring(world, layout, causal, q, k, v, do, sink=None):
    shard, unshard = HELPERS[layout]
    fw = FakeWorld(world)
    kw = {} if sink is None else {"learnable_sink": sink}

    def rank_fn(comm):
        r = comm.rank
        sq, sk, sv, sdo = (shard(x, r, world) for x in (q, k, v, do))
        before = [x.copy() for x in (sq, sk, sv, sdo)]
        o, lse = ring_forward(sq, sk, sv, comm=comm, causal=causal, return_lse=True,
                              layout=layout, **kw)
        grads = ring_backward(sdo, sq, sk, sv, o, lse, comm=comm, causal=causal, layout=layout,
                              **kw)
        for x, x0 in zip((sq, sk, sv, sdo), before):
            np.testing.assert_array_equal(x, x0)  # inputs never modified
        return (o, lse, *grads)

    results, errors = fw.run(rank_fn)
    for e in errors:
        if e is not None:
            raise e
    out = [unshard([res[i] for res in results]) for i in range(5)]
    if sink is not None:   # dsink: the whole sequence's, the same bits on every rank
        for res in results[1:]:
            np.testing.assert_array_equal(res[5], results[0][5])
        out.append(results[0][5])
    return out, fw


@pytest.mark.parametrize("world,layout,causal", [(3, "zigzag", True), (2, "contiguous", False)])
def test_fake_ring_with_a_sink(world, layout, causal, rng):
    """The sink joins once per row (after the ring's merges), dsink is summed over the ranks:
    o, lse, dq, dk, dv and dsink equal the whole sequence's reference at the float32 bound."""
    q, k, v, do = _inputs(rng, world, np.float32)
    sink = (rng.standard_normal(q.shape[1]) + 2.0).astype(np.float32)
    got, _ = _run_ring(world, layout, causal, q, k, v, do, sink=sink)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal, learnable_sink=sink)
    refs = (o_ref, lse_ref, *reference.attention_backward(do, q, k, v, causal=causal,
                                                          learnable_sink=sink))
    for name, g, want in zip(("o", "lse", "dq", "dk", "dv", "dsink"), got, refs):
        assert g.dtype == np.float32 and g.shape == want.shape, name
        err = np.abs(g.astype(np.float64) - want).max() / max(1.0, np.abs(want).max())
        assert err <= TOL[np.float32], f"{name}: scaled error {err:.2e} > {TOL[np.float32]}"


def test_ranks_with_different_sinks_all_raise(rng):
    q, k, v, _ = _inputs(rng, 2, np.float32)

    def fn(comm):
        sink = np.full(2, float(comm.rank), np.float32)
        sq, sk, sv = (zigzag_shard(x, comm.rank, 2) for x in (q, k, v))
        ring_forward(sq, sk, sv, comm=comm, learnable_sink=sink)

    for e in _errors(2, fn):
        assert isinstance(e, ValueError) and "learnable_sink" in str(e)


# tolerance relative to max(1, max|reference|).  float32: measured 1.0e-6 at most over 20 seeds
# (tests/distributed/ring_mpi_check.py --seeds 20), the same bound as the MPI check.  float16
# (partial outputs rounded to float16 before the float32 merge, gradients accumulated in
# float32): measured 1.3e-3 (dk) over 10 seeds, 2 and 3 ranks, causal and not.  bfloat16 (the
# same path, 8-bit mantissa): measured 6.2e-3 (dv; o 3.6e-3) over 4 seeds, 2 ranks zigzag causal
# and 3 ranks contiguous, 4.8x float16's.
TOL = {np.float32: 4e-6, np.float16: 5e-3, BFLOAT16: 2e-2}


@pytest.mark.parametrize("world,layout,causal,dtype", [(3, "zigzag", True, np.float32),
                                                       (2, "contiguous", False, np.float32),
                                                       (2, "zigzag", True, np.float16),
                                                       (2, "zigzag", True, BFLOAT16)],
                         ids=["f32-3-zigzag-causal", "f32-2-contiguous", "f16-2-zigzag-causal",
                              "bf16-2-zigzag-causal"])
def test_fake_ring_matches_whole_sequence(world, layout, causal, dtype, rng):
    q, k, v, do = _inputs(rng, world, dtype)
    got, fw = _run_ring(world, layout, causal, q, k, v, do)
    o_ref, lse_ref = reference.attention(q, k, v, causal=causal)
    refs = (o_ref, lse_ref, *reference.attention_backward(do, q, k, v, causal=causal))
    for name, g, want in zip(("o", "lse", "dq", "dk", "dv"), got, refs):
        assert g.dtype == (np.float32 if name == "lse" else dtype) and g.shape == want.shape
        assert not np.isnan(g).any(), name
        err = np.abs(g.astype(np.float64) - want).max() / max(1.0, np.abs(want).max())
        assert err <= TOL[dtype], f"{name}: scaled error {err:.2e} > {TOL[dtype]}"

    # the messages: forward R-1 K/V hops, backward R-1 K/V hops and R dK/dV hops per rank,
    # each K/V message 2 * B * Hkv * N_local * d * itemsize bytes
    b, hkv, n, d = k.shape[0], k.shape[1], k.shape[2] // world, k.shape[3]
    kv_bytes = 2 * b * hkv * n * d * np.dtype(dtype).itemsize
    for rank in range(world):
        sends = [(tag, nb) for r, kind, _, tag, nb in fw.log if r == rank and kind == "send"]
        kv = [nb for tag, nb in sends if tag == 17]
        dkv = [nb for tag, nb in sends if tag == 18]
        assert kv == [kv_bytes] * (2 * (world - 1))
        assert dkv == [2 * b * hkv * n * d * 4] * world  # float32 accumulators


def test_single_rank_is_the_plain_op(rng):
    import numba_flash

    q, k, v, do = _inputs(rng, 1, np.float32, h=4, hkv=2, n_local=6)
    (o, lse, dq, dk, dv), fw = _run_ring(1, "zigzag", True, q, k, v, do)
    o1, lse1 = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(o, o1)
    np.testing.assert_array_equal(lse, lse1)
    assert not [e for e in fw.log if e[1] == "send"]  # one rank: nothing sent


def _errors(world, fn):
    _, errors = FakeWorld(world).run(fn)
    return errors


def test_ranks_that_disagree_all_raise():
    def fn(comm):
        n = 6 if comm.rank == 2 else 4
        q = np.zeros((1, 2, n, 8), np.float32)
        k = np.zeros((1, 1, n, 8), np.float32)
        ring_forward(q, k, k, comm=comm)

    errors = _errors(3, fn)
    for e in errors:
        assert isinstance(e, ValueError)
        assert str(e).startswith("q: rank 2 passed shape (1, 2, 6, 8), float32, numpy, but rank 0 "
                                 "passed shape (1, 2, 4, 8)"), str(e)

    def causal_differs(comm):
        x = np.zeros((1, 1, 4, 8), np.float32)
        ring_forward(x, x, x, comm=comm, causal=comm.rank == 1)

    for e in _errors(2, causal_differs):
        assert isinstance(e, ValueError) and str(e).startswith("causal: rank 1 passed"), str(e)


def test_one_rank_with_bad_input_does_not_hang_the_others():
    def fn(comm):
        dtype = np.int32 if comm.rank == 1 else np.float32
        x = np.zeros((1, 1, 4, 8), dtype)
        ring_forward(x, x, x, comm=comm)

    errors = _errors(3, fn)
    assert isinstance(errors[1], TypeError) and "q" in str(errors[1])
    for r in (0, 2):
        assert isinstance(errors[r], ValueError)
        assert str(errors[r]).startswith("rank 1 rejected its arguments"), str(errors[r])


@pytest.mark.parametrize("kwargs,shapes,exc,match", [
    ({}, ((1, 2, 4, 8), (1, 1, 6, 8)), ValueError,
     r"k: ring attention is self-attention over shards of equal length: expected N_local 4"),
    ({}, ((1, 2, 5, 8), (1, 1, 5, 8)), ValueError, r"q: the zigzag layout .* even N_local, got 5"),
    ({"layout": "striped"}, ((1, 2, 4, 8), (1, 1, 4, 8)), ValueError, "layout"),
    ({"causal": 1}, ((1, 2, 4, 8), (1, 1, 4, 8)), TypeError, "causal: expected a bool"),
    ({"return_lse": "yes"}, ((1, 2, 4, 8), (1, 1, 4, 8)), TypeError, "return_lse: expected a bool"),
    ({"softmax_scale": -1.0}, ((1, 2, 4, 8), (1, 1, 4, 8)), ValueError, "softmax_scale"),
    ({}, ((1, 3, 4, 8), (1, 2, 4, 8)), ValueError, "divides the 3 query heads"),
])
def test_local_argument_errors(kwargs, shapes, exc, match):
    def fn(comm):
        q = np.zeros(shapes[0], np.float32)
        k = np.zeros(shapes[1], np.float32)
        ring_forward(q, k, k, comm=comm, **kwargs)

    (e,) = _errors(1, fn)
    assert isinstance(e, exc) and re.search(match, str(e)), repr(e)


def test_backward_argument_errors():
    def fn(comm):
        x = np.zeros((1, 1, 4, 8), np.float32)
        ring_backward(x, x, x, x, x, np.zeros((1, 1, 4), np.float64), comm=comm)

    (e,) = _errors(1, fn)
    assert isinstance(e, TypeError) and str(e).startswith("lse"), repr(e)

    def fn2(comm):
        x = np.zeros((1, 1, 4, 8), np.float32)
        ring_backward(np.zeros((1, 1, 2, 8), np.float32), x, x, x, x,
                      np.zeros((1, 1, 4), np.float32), comm=comm)

    (e,) = _errors(1, fn2)
    assert isinstance(e, ValueError) and str(e).startswith("do: expected the shape of q"), repr(e)


def test_comm_type_error():
    x = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(TypeError, match="comm: expected an mpi4py communicator"):
        ring_forward(x, x, x, comm=object())
