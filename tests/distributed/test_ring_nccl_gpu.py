"""The NCCL path on one GPU with one rank (the only multi-rank run a single GPU allows):
NcclComm's three operations, and ring_forward/ring_backward on CuPy arrays equal to the plain
single-device ops.  Skipped without a GPU (and without CuPy's NCCL)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_comm():
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import nccl

    if not nccl.available:
        pytest.skip("CuPy was built without NCCL")
    from numba_flash.distributed import NcclComm

    comm = NcclComm(nccl.NcclCommunicator(1, nccl.get_unique_id(), 0))
    yield comm, cupy
    comm.comm.destroy()


def test_nccl_operations(nccl_comm):
    comm, cupy = nccl_comm
    assert (comm.rank, comm.size) == (0, 1)
    np.testing.assert_array_equal(comm.allgather_ints(np.array([3, -1, 7])), [[3, -1, 7]])
    send = cupy.arange(12, dtype=cupy.float16).reshape(3, 4)
    recv = cupy.full_like(send, cupy.nan)
    comm.start_exchange(send, 0, recv, 0, tag=17).wait()  # to itself
    cupy.testing.assert_array_equal(recv, send)


@pytest.mark.parametrize("causal", [False, True])
def test_ring_on_one_gpu_equals_the_plain_ops(nccl_comm, causal):
    comm, cupy = nccl_comm
    import numba_flash
    from numba_flash.distributed import ring_backward, ring_forward

    rng = np.random.default_rng(17)
    q, do = (cupy.asarray(rng.standard_normal((2, 4, 64, 32)), cupy.float32) for _ in range(2))
    k, v = (cupy.asarray(rng.standard_normal((2, 2, 64, 32)), cupy.float32) for _ in range(2))
    o, lse = ring_forward(q, k, v, comm=comm, causal=causal, return_lse=True)
    o1, lse1 = numba_flash.forward(q, k, v, causal=causal, return_lse=True)
    cupy.testing.assert_allclose(o, o1, rtol=0, atol=1e-6)
    cupy.testing.assert_allclose(lse, lse1, rtol=0, atol=1e-6)
    grads = ring_backward(do, q, k, v, o, lse, comm=comm, causal=causal)
    grads1 = numba_flash.backward(do, q, k, v, o1, lse1, causal=causal)
    for g, g1 in zip(grads, grads1):
        assert isinstance(g, cupy.ndarray)
        cupy.testing.assert_allclose(g, g1, rtol=0, atol=1e-5)
