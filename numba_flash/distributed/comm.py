"""The three operations the ring needs from a communicator, over MPI (mpi4py) or NCCL (CuPy).

The ring code talks to a *ring communicator*: any object with

* ``rank`` and ``size`` (ints),
* ``allgather_ints(vec)``: every rank passes an int64 vector of the same length and gets the
  ``[size, len]`` table of all of them (used once per call, to check that the ranks agree on
  shapes, dtypes and options before any tensor moves),
* ``start_exchange(send, dest, recv, source, tag)``: start sending the contiguous array ``send``
  to rank ``dest`` while receiving an array of the same byte size from rank ``source`` into
  ``recv``; returns a handle whose ``wait()`` returns once ``recv`` may be read and ``send``
  may be overwritten.  ``tag`` tells two exchanges in flight at once apart (K/V and dK/dV in
  the backward); every rank starts its exchanges in the same order.

:func:`as_ring_comm` turns an mpi4py communicator into one (:class:`MpiRingComm`, non-blocking
``Isend``/``Irecv``); :class:`NcclComm` is one over ``cupy.cuda.nccl`` (grouped ``send``/``recv``
on a communication stream of its own, ordered against the compute stream with CUDA events).
Neither mpi4py nor CuPy is imported by ``numba_flash`` unless one of these is used.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MpiRingComm", "NcclComm", "as_ring_comm"]

_RING_METHODS = ("allgather_ints", "start_exchange")


def _is_cupy(x):
    return type(x).__module__.split(".")[0] == "cupy"


def as_ring_comm(comm):
    """``comm`` as a ring communicator: itself if it already is one, else an mpi4py wrapper.

    Raises TypeError for anything else (naming what came).
    """
    if all(callable(getattr(comm, m, None)) for m in _RING_METHODS) and hasattr(comm, "rank"):
        return comm
    if all(callable(getattr(comm, m, None)) for m in ("Get_rank", "Get_size", "Isend", "Irecv",
                                                      "Allgather")):
        return MpiRingComm(comm)
    raise TypeError(
        "comm: expected an mpi4py communicator (e.g. mpi4py.MPI.COMM_WORLD) or a ring "
        "communicator such as numba_flash.distributed.NcclComm (rank, size, allgather_ints, "
        f"start_exchange), got {type(comm).__name__}"
    )


class _MpiHandle:
    def __init__(self, requests, keep):
        self._requests = requests
        self._keep = keep  # the buffers stay alive until the transfer is waited for

    def wait(self):
        from mpi4py import MPI

        MPI.Request.Waitall(self._requests)
        self._keep = None


class MpiRingComm:
    """Ring operations over an mpi4py communicator (``Allgather``, ``Isend`` + ``Irecv``).

    NumPy buffers work with any MPI.  CuPy buffers are handed to mpi4py as they are, which needs
    a CUDA-aware MPI; the compute stream is synchronised before each send (unmeasured).
    """

    def __init__(self, comm):
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())

    def allgather_ints(self, vec):
        vec = np.ascontiguousarray(vec, dtype=np.int64)
        table = np.empty((self.size, vec.size), np.int64)
        self.comm.Allgather(vec, table)
        return table

    def start_exchange(self, send, dest, recv, source, tag):
        from mpi4py import MPI

        if _is_cupy(send):
            import cupy

            # the send buffer must be complete before MPI reads it
            cupy.cuda.get_current_stream().synchronize()
        # raw bytes: MPI has no float16 type, and the ring only moves whole arrays
        reqs = [self.comm.Irecv([recv, MPI.BYTE], source=source, tag=tag),
                self.comm.Isend([send, MPI.BYTE], dest=dest, tag=tag)]
        return _MpiHandle(reqs, (send, recv))


class _NcclHandle:
    def __init__(self, done, keep):
        self._done = done
        self._keep = keep  # the buffers stay alive until the transfer is waited for

    def wait(self):
        import cupy

        # the compute stream waits on the device; the host does not block
        cupy.cuda.get_current_stream().wait_event(self._done)
        self._keep = None


class NcclComm:
    """A ring communicator over a ``cupy.cuda.nccl.NcclCommunicator`` (one GPU per process).

    Transfers run on a stream of their own (``stream``, default a new non-blocking CuPy stream):
    :meth:`start_exchange` makes that stream wait for the work queued so far on the current
    (compute) stream, issues ``send`` and ``recv`` in one NCCL group, and records an event that
    the handle's ``wait()`` makes the compute stream wait for.  Written for the GPU and run
    there with one rank only (the one multi-rank run a single GPU allows); multi-GPU timing is
    unmeasured.

    Build it from an existing NCCL communicator (``rank`` and ``size`` default to its
    ``rank_id()`` and ``size()``), or with :meth:`from_mpi`, which creates one over the ranks of
    an mpi4py communicator (each process must have selected its GPU first).
    """

    def __init__(self, nccl_comm, *, rank=None, size=None, stream=None):
        import cupy

        self.comm = nccl_comm
        self.rank = int(nccl_comm.rank_id() if rank is None else rank)
        self.size = int(nccl_comm.size() if size is None else size)
        self.stream = stream if stream is not None else cupy.cuda.Stream(non_blocking=True)

    @classmethod
    def from_mpi(cls, mpi_comm, *, stream=None):
        """An NCCL communicator over the same ranks as ``mpi_comm`` (rank 0's id broadcast)."""
        from cupy.cuda import nccl

        uid = nccl.get_unique_id() if mpi_comm.Get_rank() == 0 else None
        uid = mpi_comm.bcast(uid, root=0)
        rank, size = mpi_comm.Get_rank(), mpi_comm.Get_size()
        return cls(nccl.NcclCommunicator(size, uid, rank), rank=rank, size=size, stream=stream)

    def allgather_ints(self, vec):
        import cupy
        from cupy.cuda import nccl

        vec = np.ascontiguousarray(vec, dtype=np.int64)
        with self.stream:
            send = cupy.asarray(vec)
            table = cupy.empty((self.size, vec.size), np.int64)
        self.comm.allGather(send.data.ptr, table.data.ptr, vec.size, nccl.NCCL_INT64,
                            self.stream.ptr)
        self.stream.synchronize()
        return cupy.asnumpy(table)

    def start_exchange(self, send, dest, recv, source, tag):
        import cupy
        from cupy.cuda import nccl

        del tag  # NCCL matches by issue order; every rank issues its exchanges in one order
        if not (_is_cupy(send) and _is_cupy(recv)):
            raise TypeError("NcclComm moves CuPy arrays only; got "
                            f"{type(send).__name__} and {type(recv).__name__}")
        if send.nbytes != recv.nbytes or not (send.flags.c_contiguous and recv.flags.c_contiguous):
            raise ValueError("start_exchange: expected two C-contiguous arrays of one byte size")
        ready = cupy.cuda.get_current_stream().record()
        self.stream.wait_event(ready)  # the send buffer is written by queued compute work
        nccl.groupStart()
        self.comm.send(send.data.ptr, send.nbytes, nccl.NCCL_UINT8, dest, self.stream.ptr)
        self.comm.recv(recv.data.ptr, recv.nbytes, nccl.NCCL_UINT8, source, self.stream.ptr)
        nccl.groupEnd()
        return _NcclHandle(self.stream.record(), (send, recv))
