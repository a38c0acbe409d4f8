"""Ring attention over torch.distributed (numba_flash.torch.ring_flash_attn_func): 2 and 4 gloo
processes on the CPU (forked, each running its kernels in the simulator), forward and gradients
of every rank's shard against single-process attention of the gathered sequence (torch float64
autograd), and the agreement check on a rank that passes a bad shard."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import numba_flash.torch as nft  # noqa: E402
from numba_flash.distributed import contiguous_shard, zigzag_shard  # noqa: E402
from torch_helpers import attention_ref, randn  # noqa: E402

SHARD = {"zigzag": zigzag_shard, "contiguous": contiguous_shard}


def _run(world, fn, *args):
    """``fn(rank, world, *args)`` on ``world`` forked gloo processes (an exception in one fails
    the test with its traceback)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        mp.start_processes(_entry, args=(world, init, fn, args), nprocs=world,
                           start_method="fork")


def _entry(rank, world, init, fn, args):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def _check_shards(rank, world, layout, causal, full, want):
    """This rank's shards of ``full = (q, k, v, dout)`` through the ring, against its shards of
    ``want = (out, dq, dk, dv)``."""
    def shard(x):
        return torch.from_numpy(SHARD[layout](x.detach().numpy(), rank, world, axis=1))

    q, k, v, dout = (shard(x) for x in full)  # this rank's [B, N / world, H, d] shards
    for x in (q, k, v):
        x.requires_grad_()
    # [docs:torch-ring]
    # in each process, after torch.distributed.init_process_group("gloo" or "nccl", ...):
    out, lse = nft.ring_flash_attn_func(q, k, v, causal=causal, layout=layout, return_lse=True)
    out.backward(dout)          # the K/V shards and dK/dV go round the ring again
    # [/docs:torch-ring]
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    for got, w, name in zip((out, q.grad, k.grad, v.grad), want, ("out", "dq", "dk", "dv")):
        err = (got.detach() - shard(w)).abs().max().item()
        # float64 throughout: measured 2026-12-01 at most 1.3e-15 (every rank, output and
        # gradients, 2 and 4 ranks) on values of order 1
        assert err < 1e-14, (rank, name, err)


@pytest.mark.parametrize("world, layout, causal", [(2, "zigzag", True), (4, "zigzag", True),
                                                   (4, "contiguous", False)])
def test_ring_matches_single_process_attention(gen, world, layout, causal):
    n_local = 4
    q = randn(gen, 1, world * n_local, 2, 8, dtype=torch.float64, requires_grad=True)
    k = randn(gen, 1, world * n_local, 1, 8, dtype=torch.float64, requires_grad=True)
    v = randn(gen, 1, world * n_local, 1, 8, dtype=torch.float64, requires_grad=True)
    dout = randn(gen, 1, world * n_local, 2, 8, dtype=torch.float64)
    out, _lse = attention_ref(q, k, v, causal=causal)
    out.backward(dout)
    _run(world, _check_shards, layout, causal, (q, k, v, dout),
         (out, q.grad, k.grad, v.grad))


def _bad_rank(rank, world):
    shape = (1, 4, 2, 8) if rank == 0 else (1, 4, 2, 4)  # rank 1: another head dim
    q = torch.randn(shape, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"q: rank 1 passed shape \(1, 2, 4, 4\)"):
        nft.ring_flash_attn_func(q, q, q)
    if rank == 1:
        q = q.to(torch.int32)  # a local torch check: this rank's own error, the other's too
    with pytest.raises((TypeError, ValueError), match=r"q: expected dtype|rank 1 rejected"):
        nft.ring_flash_attn_func(q, q, q)


def test_ring_ranks_that_disagree_all_raise():
    _run(2, _bad_rank)


def _check_sink_shards(rank, world, full, sink, want):
    """The ring with a learnable sink: this rank's out / dq / dk / dv shards and the whole
    sequence's dsink (every rank the same)."""
    def shard(x):
        return torch.from_numpy(zigzag_shard(x.detach().numpy(), rank, world, axis=1))

    q, k, v, dout = (shard(x) for x in full)
    for x in (q, k, v):
        x.requires_grad_()
    s = sink.detach().clone().requires_grad_()
    out = nft.ring_flash_attn_func(q, k, v, causal=True, learnable_sink=s)
    out.backward(dout)
    for got, w, name in zip((out, q.grad, k.grad, v.grad), want, ("out", "dq", "dk", "dv")):
        err = (got.detach().double() - shard(w).double()).abs().max().item()
        assert err < 4e-6, (rank, name, err)   # float32 (test_sinks.py's bound)
    err = (s.grad.double() - want[4].double()).abs().max().item()
    assert err < 4e-6 * max(1.0, want[4].abs().max().item()), (rank, "dsink", err)


def test_ring_with_a_learnable_sink(gen):
    """Two gloo ranks, float32, causal zigzag, a sink that requires grad: against the gpt-oss
    formulation in torch float64 (a sink column in the softmax) of the gathered sequence."""
    world, n_local, h = 2, 4, 2
    q = randn(gen, 1, world * n_local, h, 8, requires_grad=True)
    k = randn(gen, 1, world * n_local, 1, 8, requires_grad=True)
    v = randn(gen, 1, world * n_local, 1, 8, requires_grad=True)
    sink = (torch.randn(h, generator=gen) + 2.0).requires_grad_()
    dout = randn(gen, 1, world * n_local, h, 8)
    from test_sinks_torch import gpt_oss

    out, _ = gpt_oss(q, k, v, sink, causal=True)
    grads = torch.autograd.grad(out, (q, k, v, sink), dout.double())
    _run(world, _check_sink_shards, (q, k, v, dout), sink, (out, *grads))
