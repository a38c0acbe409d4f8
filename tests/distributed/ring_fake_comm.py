"""An in-process ring communicator for tests: R "ranks" as threads of one process.

Only one rank runs at a time (a token lock, released while a rank waits for a message or for
the allgather), so the simulator's kernel launches never overlap.  Messages are stricter than
MPI's: the send buffer is copied when the *sender* waits (so a buffer written before its
exchange is waited for sends the wrong data) and the receive buffer is filled only inside the
receiver's ``wait()`` (so reading it early reads stale data).
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque

import numpy as np

TIMEOUT_S = 120


class FakeWorld:
    def __init__(self, size):
        self.size = size
        self.token = threading.Lock()
        self.cond = threading.Condition()
        self.mail = defaultdict(deque)  # (source, dest, tag) -> payloads in send order
        self.gathers = defaultdict(dict)  # call index -> {rank: vector}
        self.log = []  # (rank, "send"/"recv"/"allgather", peer, tag, nbytes)

    def run(self, fn):
        """``fn(comm)`` on every rank; returns the results, or raises rank 0's... first error."""
        results, errors = [None] * self.size, [None] * self.size

        def body(rank):
            with self.token:
                try:
                    results[rank] = fn(FakeComm(self, rank))
                except BaseException as e:  # re-raised below, in the test's thread
                    errors[rank] = e

        threads = [threading.Thread(target=body, args=(r,)) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT_S)
            assert not t.is_alive(), "a fake rank hung (deadlock in the ring?)"
        return results, errors

    def block_until(self, pred):
        """Give up the token, wait for ``pred()``, take the token back."""
        self.token.release()
        try:
            with self.cond:
                if not self.cond.wait_for(pred, TIMEOUT_S):
                    raise TimeoutError("fake communicator: no matching message")
        finally:
            self.token.acquire()


class _Handle:
    def __init__(self, comm, send, dest, recv, source, tag):
        self.comm, self.send, self.dest = comm, send, dest
        self.recv, self.source, self.tag = recv, source, tag

    def wait(self):
        w, me = self.comm.world, self.comm.rank
        with w.cond:
            w.mail[(me, self.dest, self.tag)].append(np.array(self.send, copy=True))
            w.log.append((me, "send", self.dest, self.tag, self.send.nbytes))
            w.cond.notify_all()
        box = w.mail[(self.source, me, self.tag)]
        w.block_until(lambda: len(box) > 0)
        with w.cond:
            payload = box.popleft()
        assert payload.nbytes == self.recv.nbytes, "exchange of mismatched sizes"
        self.recv[...] = payload.view(self.recv.dtype).reshape(self.recv.shape)
        w.log.append((me, "recv", self.source, self.tag, self.recv.nbytes))


class FakeComm:
    """The ring communicator interface (rank, size, allgather_ints, start_exchange)."""

    def __init__(self, world, rank):
        self.world, self.rank, self.size = world, rank, world.size
        self._calls = 0

    def allgather_ints(self, vec):
        w = self.world
        call = self._calls
        self._calls += 1
        with w.cond:
            w.gathers[call][self.rank] = np.array(vec, np.int64)
            w.cond.notify_all()
        w.block_until(lambda: len(w.gathers[call]) == self.size)
        return np.stack([w.gathers[call][r] for r in range(self.size)])

    def start_exchange(self, send, dest, recv, source, tag):
        assert send.flags.c_contiguous and recv.flags.c_contiguous
        return _Handle(self, send, dest, recv, source, tag)
