"""Ring attention over a ``torch.distributed`` process group, with autograd.

:class:`TorchRingComm` is the ring communicator of :mod:`numba_flash.distributed.comm` (``rank``,
``size``, ``allgather_ints``, ``start_exchange``) over a process group: ``all_gather`` of an int64
tensor for the agreement check, ``batch_isend_irecv`` of one ``isend`` and one ``irecv`` for each
exchange (gloo on CPU tensors, nccl on CUDA ones).  The arrays the ring moves are handed to torch
as ``uint8`` tensors over their own memory (NumPy: ``torch.from_numpy``; CuPy: DLPack), no copy.

:func:`ring_flash_attn_func` runs :func:`numba_flash.distributed.ring_forward` and
:func:`~numba_flash.distributed.ring_backward` on this rank's shards of ``q``, ``k``, ``v`` in
flash-attn's layout ``[B, N_local, H, d]``, as a ``torch.autograd.Function``: ``out.backward()``
passes the K/V shards and the dK/dV accumulators around the ring again and gives each rank the
gradients of its own shards.  Every rank of the group must call it with shards of one shape,
dtype and options (one ``all_gather`` checks that before any shard moves; every rank raises the
same ``ValueError`` otherwise).  On the nccl backend the exchanges run on NCCL's own streams,
ordered against torch's current stream by ``torch.distributed`` (written to that contract, not
run: no multi-GPU machine was available).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ..frontend.validate import check_bool
from . import bridge, checks

__all__ = ["TorchRingComm", "ring_flash_attn_func"]


def _bytes(a):
    """A contiguous NumPy / CuPy array as a flat ``uint8`` torch tensor over the same memory."""
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a.reshape(-1).view(np.uint8))
    import cupy

    return torch.from_dlpack(a.reshape(-1).view(cupy.uint8))


class _Works:
    def __init__(self, works, keep):
        self._works = works
        self._keep = keep  # the buffers (and their tensor views) live until the wait

    def wait(self):
        for w in self._works:
            w.wait()
        self._keep = None


class TorchRingComm:
    """The ring's three operations over a ``torch.distributed`` process group (``group=None``:
    the default group); ``rank`` and ``size`` within the group."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized (call "
                             "torch.distributed.init_process_group first)")
        self.group = group
        self.rank = int(dist.get_rank(group))
        self.size = int(dist.get_world_size(group))
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the group")
        self._cuda = dist.get_backend(group) == "nccl"

    def _global(self, r):
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def allgather_ints(self, vec):
        t = torch.as_tensor(np.ascontiguousarray(vec, dtype=np.int64))
        if self._cuda:
            t = t.cuda()
        table = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(table, t, group=self.group)
        return np.stack([x.cpu().numpy() for x in table])

    def start_exchange(self, send, dest, recv, source, tag):
        s, r = _bytes(send), _bytes(recv)
        ops = [dist.P2POp(dist.isend, s, self._global(dest), self.group, tag),
               dist.P2POp(dist.irecv, r, self._global(source), self.group, tag)]
        return _Works(dist.batch_isend_irecv(ops), (send, recv, s, r))


class _RingSaved(NamedTuple):
    """What :class:`RingFunc`'s forward saves for its backward (``save_for_backward``'s order):
    the shards, this rank's ``out`` and ``lse``, and the sink (or None)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    sink: object


class RingFunc(torch.autograd.Function):
    """``(out, lse)`` of the ring on ``[B, N_local, H, d]`` shards; gradients of ``q, k, v`` and
    the learnable sink (``sink``: float32 ``[H]`` or None; its gradient summed over the ranks)."""

    @staticmethod
    def forward(ctx, comm, opts, q, k, v, sink=None):
        from numba_flash.distributed import ring_forward

        with bridge.on_device(q.device):
            o, lse = ring_forward(*(bridge.as_heads_first(x) for x in (q, k, v)), comm=comm,
                                  return_lse=True, learnable_sink=bridge.optional_array(sink),
                                  **opts)
            out, lse = bridge.seq_first(o, q.device), bridge.to_tensor(lse, q.device)
        ctx.save_for_backward(*_RingSaved(q, k, v, out, lse, sink))
        ctx.comm, ctx.opts = comm, opts
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        from numba_flash.distributed import ring_backward

        s = _RingSaved(*ctx.saved_tensors)
        device = s.q.device
        with bridge.on_device(device):
            arrays = (bridge.as_heads_first(x) for x in (dout, s.q, s.k, s.v, s.out))
            grads = ring_backward(*arrays, bridge.as_array(s.lse), comm=ctx.comm,
                                  learnable_sink=bridge.optional_array(s.sink), **ctx.opts)
            dsink = None
            if s.sink is not None and ctx.needs_input_grad[5]:
                dsink = bridge.to_tensor(grads[3], device)
            return ((None, None) + tuple(bridge.seq_first(g, device) for g in grads[:3])
                    + (dsink,))



def _local_checks(q, k, v, return_lse, learnable_sink):
    """This rank's torch checks (raised after the ring's agreement check, so no rank is left
    waiting in the collective)."""
    check_bool("return_lse", return_lse)
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, x, 4, "(batch_size, seqlen_local, nheads, headdim)")
    checks.check_same_dtype({"q": q, "k": k, "v": v})
    checks.check_sink(learnable_sink, q.shape[2])
    checks.check_device({"q": q, "k": k, "v": v, "learnable_sink": learnable_sink})


@torch.compiler.disable
def ring_flash_attn_func(q, k, v, group=None, causal=False, softmax_scale=None,
                         layout="zigzag", return_lse=False, *, learnable_sink=None):
    """Attention of one sequence sharded over the ranks of ``group`` (``None``: the default
    process group): this rank's shard of ``out``, with autograd.

    ``q [batch_size, seqlen_local, nheads, headdim]``, ``k``, ``v`` ``[batch_size,
    seqlen_local, nheads_k, headdim]`` are this rank's shards of a self-attention sequence of
    ``world * seqlen_local`` tokens in ``layout``: ``"zigzag"`` (rank ``r`` holds chunks ``r``
    and ``2 world - 1 - r`` of ``2 world``: balanced under a causal mask; shard with
    :func:`numba_flash.distributed.zigzag_shard` on axis 1) or ``"contiguous"`` (chunk ``r`` of
    ``world``, as ring-flash-attention's ``ring_flash_attn_func``).  ``causal``: token ``i``
    sees tokens ``j <= i`` of the whole sequence; ``softmax_scale``: default ``headdim **
    -0.5``.  Returns ``out`` of q's shape and dtype, and with ``return_lse`` also ``lse
    [batch_size, nheads, seqlen_local]`` (float32; float64 for float64; not differentiable).
    ``learnable_sink``: float32 ``(nheads,)`` attention-sink logits, the same on every rank,
    added once per row; its gradient is the whole sequence's (summed over the ranks).

    Every rank must call it (and ``backward``) together; shards of one shape, dtype and options
    (checked with one ``all_gather``).  float16, bfloat16, float32, float64; CPU tensors (gloo;
    kernels in the simulator) or CUDA tensors (nccl).
    """
    comm = TorchRingComm(group)
    err = None
    try:
        _local_checks(q, k, v, return_lse, learnable_sink)
    except (TypeError, ValueError) as e:  # raised after the collective check, on this rank
        err = e
    opts = dict(causal=causal, softmax_scale=softmax_scale, layout=layout)
    if err is not None:
        from numba_flash.distributed.ring import _check_shards

        try:  # tell the other ranks (they raise "rank r rejected its arguments")
            _check_shards(comm, None, None, None, causal, softmax_scale, layout)
        except (TypeError, ValueError):
            pass
        raise err
    out, lse = RingFunc.apply(comm, opts, q, k, v, learnable_sink)
    return (out, lse) if return_lse else out
