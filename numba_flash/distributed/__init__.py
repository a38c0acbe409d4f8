"""Context parallelism: ring attention over MPI (mpi4py) or NCCL (CuPy).

Not imported by ``import numba_flash``; ``import numba_flash.distributed`` loads it (and still
imports neither mpi4py nor CuPy: they load when a communicator of theirs is used).

* :func:`ring_forward`, :func:`ring_backward` - attention of a sequence sharded over ranks
* :func:`zigzag_shard`, :func:`zigzag_unshard` - the load-balanced causal layout (2R chunks,
  rank ``r`` holds chunks ``r`` and ``2R-1-r``)
* :func:`contiguous_shard`, :func:`contiguous_unshard` - chunk ``r`` of ``R``
* :func:`shard_positions`, :func:`rank_chunks` - which global tokens / chunks a rank holds
* :class:`NcclComm` - the ring's three operations over ``cupy.cuda.nccl``;
  :class:`MpiRingComm` the same over an mpi4py communicator (made for you from one)

See docs/ring-attention.md.
"""

from .comm import MpiRingComm, NcclComm, as_ring_comm  # noqa: F401
from .ring import ring_backward, ring_forward  # noqa: F401
from .sharding import (contiguous_shard, contiguous_unshard, rank_chunks,  # noqa: F401
                       shard_positions, zigzag_shard, zigzag_unshard)

__all__ = ["ring_forward", "ring_backward", "zigzag_shard", "zigzag_unshard",
           "contiguous_shard", "contiguous_unshard", "shard_positions", "rank_chunks",
           "NcclComm", "MpiRingComm", "as_ring_comm"]
