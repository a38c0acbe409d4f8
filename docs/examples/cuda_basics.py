"""CUDA for NumPy programmers: the code and the runs quoted by ``docs/cuda-basics.md``.

Every kernel here runs in the Numba CUDA simulator on a CPU (each CUDA thread is a Python
thread) and unchanged on a GPU.  Each ``[docs:...]`` region is a block of the page and runs on its
own as shown: it starts with its own imports, ``import numba_flash`` before ``from numba import
cuda`` (with no GPU, importing numba_flash turns the simulator on; ``NUMBA_ENABLE_CUDASIM=1`` does
it by hand).  ``tests/docs/test_cuda_basics.py`` runs every Python block of the page, each alone
in a fresh interpreter, and checks each claim::

    python docs/examples/cuda_basics.py threads     # who runs which element: block, thread, warp
    python docs/examples/cuda_basics.py row-max     # shared memory and syncthreads
    python docs/examples/cuda_basics.py warp        # a warp sum by shuffles
    python docs/examples/cuda_basics.py atomics     # atomics, a fence and the last-block ticket
    python docs/examples/cuda_basics.py naive       # the naive attention kernel, launched by hand
    python docs/examples/cuda_basics.py memory      # coalescing (global) and banks (shared)
    python docs/examples/cuda_basics.py occupancy   # blocks per SM from registers and shared memory
"""

# The regions repeat their imports (each must run alone), hence imports below code (E402) and
# ``import numba_flash`` kept for its side effect only (F401), each a redefinition (F811).
# ruff: noqa: E402, F401, F811

from __future__ import annotations

import sys
from pathlib import Path

from numba_flash import simulator

# -- 1. threads, blocks, the grid ------------------------------------------------------------
# [docs:scale-add]
import numpy as np

import numba_flash  # first: on a machine with no GPU this turns on the Numba CUDA simulator
from numba import cuda


@cuda.jit                                   # compile this Python function for the GPU
def scale_add(alpha, x, y, out):
    """out = alpha * x + y, one element per thread (NumPy: ``out[:] = alpha * x + y``)."""
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x   # this thread's element
    if i < out.shape[0]:                    # bounds guard: the last block has spare threads
        out[i] = alpha * x[i] + y[i]


n = 10
x = np.arange(n, dtype=np.float32)
y = np.ones(n, dtype=np.float32)
out = np.full(n, np.nan, dtype=np.float32)      # NaN: an element no thread wrote shows
threads_per_block = 4
blocks = (n + threads_per_block - 1) // threads_per_block   # ceil(10 / 4) = 3 blocks
scale_add[blocks, threads_per_block](np.float32(2.0), x, y, out)   # launch: [grid, block]
# [/docs:scale-add]


def demo_scale_add():
    out = np.full(n, np.nan, dtype=np.float32)
    scale_add[blocks, threads_per_block](np.float32(2.0), x, y, out)
    print(f"launch scale_add[{blocks}, {threads_per_block}]: {blocks * threads_per_block} threads"
          f" for n = {n} elements")
    print(f"  out          = {out.tolist()}")
    print(f"  2 * x + y    = {(2 * x + y).tolist()}")
    return out


# [docs:whoami-kernel]
import numba_flash  # first: on a machine with no GPU this turns on the Numba CUDA simulator
from numba import cuda


@cuda.jit
def whoami(block_of, thread_of, warp_of, lane_of):
    i = cuda.grid(1)                        # shorthand for blockIdx.x * blockDim.x + threadIdx.x
    if i < block_of.shape[0]:
        block_of[i] = cuda.blockIdx.x
        thread_of[i] = cuda.threadIdx.x
        warp_of[i] = cuda.threadIdx.x // 32  # warps are 32 consecutive threads of one block
        lane_of[i] = cuda.threadIdx.x % 32   # cuda.laneid on the device
# [/docs:whoami-kernel]


def demo_threads():
    demo_scale_add()
    n, tpb = 200, 64
    arrays = [np.full(n, -1, np.int32) for _ in range(4)]
    whoami[(n + tpb - 1) // tpb, tpb](*arrays)
    block_of, thread_of, warp_of, lane_of = arrays
    print(f"whoami[{(n + tpb - 1) // tpb}, {tpb}] over {n} elements:")
    print("  element  block  thread  warp  lane")
    for i in (0, 1, 31, 32, 63, 64, 65, 127, 128, 199):
        print(f"  {i:7d}  {block_of[i]:5d}  {thread_of[i]:6d}  {warp_of[i]:4d}  {lane_of[i]:4d}")
    print(f"  elements per block: {np.bincount(block_of).tolist()} "
          f"(the 4th block's last {4 * tpb - n} threads fail the bounds guard and do nothing)")
    return arrays


# -- 2. shared memory and syncthreads -------------------------------------------------------
# [docs:row-max-kernel]
import math

import numba_flash  # first: on a machine with no GPU this turns on the Numba CUDA simulator
from numba import cuda, float32

THREADS = 8  # threads per block (a power of two, for the tree): a compile-time constant


@cuda.jit
def row_max(x, out):
    """out[r] = x[r].max(): one block per row, THREADS threads per block."""
    row = cuda.blockIdx.x
    t = cuda.threadIdx.x
    partial = cuda.shared.array(THREADS, float32)   # one slot per thread, shared by the block
    m = float32(-math.inf)
    for j in range(t, x.shape[1], THREADS):         # thread t reads x[row, t::THREADS]
        m = max(m, x[row, j])
    partial[t] = m
    cuda.syncthreads()  # every slot is written before any thread reads its neighbour's
    stride = THREADS // 2
    while stride > 0:                               # tree: 8 -> 4 -> 2 -> 1 values
        if t < stride:
            partial[t] = max(partial[t], partial[t + stride])
        cuda.syncthreads()  # this level is finished before the next level reads it
        stride //= 2
    if t == 0:
        out[row] = partial[0]
# [/docs:row-max-kernel]


def demo_row_max():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 21)).astype(np.float32)
    out = np.full(3, np.nan, np.float32)
    with simulator.fast_switching():
        row_max[x.shape[0], THREADS](x, out)
    print(f"row_max[{x.shape[0]}, {THREADS}] on x of shape {x.shape}:")
    print(f"  kernel      {out.tolist()}")
    print(f"  x.max(1)    {x.max(axis=1).tolist()}")
    print(f"  equal: {bool(np.array_equal(out, x.max(axis=1)))}")
    return x, out


# -- 2b. warp shuffles ----------------------------------------------------------------------
# [docs:warp-sum-kernel]
import numba_flash  # first: adds warp shuffles to the simulator (numba's own has none)
from numba import cuda, float32, int32


@cuda.jit
def warp_sum(x, out):
    """out[w] = x[32 w : 32 w + 32].sum(): one warp per 32 elements, no shared memory."""
    i = cuda.grid(1)
    lane = cuda.threadIdx.x % 32
    v = x[i] if i < x.shape[0] else float32(0.0)
    offset = 16
    while offset > 0:  # butterfly: after 5 steps every lane holds the warp's sum
        v += cuda.shfl_xor_sync(0xFFFFFFFF, v, int32(offset))  # lane ^ offset's v
        offset //= 2
    if lane == 0 and i < x.shape[0]:
        out[i // 32] = v
# [/docs:warp-sum-kernel]


def demo_warp():
    x = np.arange(70, dtype=np.float32)
    out = np.full(3, np.nan, np.float32)
    with simulator.fast_switching():
        warp_sum[1, 96](x, out)
    want = [x[w * 32:(w + 1) * 32].sum() for w in range(3)]
    print(f"warp_sum[1, 96] on x = arange(70): {out.tolist()}")
    print(f"  NumPy sums of x[0:32], x[32:64], x[64:70]: {[float(w) for w in want]}")
    return x, out


# -- 3. atomics and fences ------------------------------------------------------------------
# [docs:atomics-kernel]
import numba_flash  # first: on a machine with no GPU this turns on the Numba CUDA simulator
from numba import cuda, float32

SUM_THREADS = 8  # threads per block (a power of two, for the tree): a compile-time constant


@cuda.jit
def grid_sum(x, partial, ticket, out):
    """out[0] = x.sum() in one launch: each block sums its slice, and the last block to finish
    (the one that draws the last ticket) adds up the blocks' partial sums."""
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    s = cuda.shared.array(SUM_THREADS, float32)
    s[t] = x[i] if i < x.shape[0] else float32(0.0)
    cuda.syncthreads()  # every slot is written before the tree reads its neighbour's
    stride = SUM_THREADS // 2
    while stride > 0:
        if t < stride:
            s[t] += s[t + stride]
        cuda.syncthreads()  # this level is finished before the next level reads it
        stride //= 2
    if t == 0:
        partial[cuda.blockIdx.x] = s[0]
        cuda.threadfence()  # this block's partial is visible to every block before its ticket
        drawn = cuda.atomic.add(ticket, 0, 1)  # returns the old value: 0, 1, 2, ... in turn
        if drawn == cuda.gridDim.x - 1:      # the last block: every partial is written
            cuda.threadfence()  # read the partials only after seeing all the tickets
            total = float32(0.0)
            for b in range(cuda.gridDim.x):  # a fixed order: the same bits on every run
                total += partial[b]
            out[0] = total
            ticket[0] = 0                    # ready for the next launch
# [/docs:atomics-kernel]


def demo_atomics():
    rng = np.random.default_rng(1)
    x = rng.integers(-8, 9, 37).astype(np.float32)  # small integers: every sum is exact
    n_blocks = (x.shape[0] + SUM_THREADS - 1) // SUM_THREADS
    partial = np.full(n_blocks, np.nan, np.float32)
    ticket = np.zeros(1, np.int32)
    out = np.full(1, np.nan, np.float32)
    with simulator.fast_switching():
        grid_sum[n_blocks, SUM_THREADS](x, partial, ticket, out)
    print(f"grid_sum[{n_blocks}, {SUM_THREADS}] on {x.shape[0]} integers: {out[0]}"
          f"  (NumPy x.sum(): {x.sum()})")
    print(f"  the blocks' partial sums: {partial.tolist()}")
    print(f"  ticket after the launch: {int(ticket[0])} (reset by the last block)")
    return x, partial, ticket, out


# -- 4. the naive attention kernel, launched by hand ----------------------------------------
def demo_naive():
    # [docs:naive-launch]
    import math

    import numpy as np

    import numba_flash  # first: on a machine with no GPU this turns on the Numba CUDA simulator
    from numba_flash.teach.kernels.naive_forward import naive_forward_kernel

    rng = np.random.default_rng(0)
    B, H, Hkv, nq, nk, d = 1, 2, 1, 6, 6, 16          # GQA: two query heads share one kv head
    q = rng.standard_normal((B, H, nq, d)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, nk, d)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, nk, d)).astype(np.float32)
    scale = 1.0 / math.sqrt(d)
    o = np.full((B, H, nq, d), np.nan, np.float32)   # outputs: every element must be written
    lse = np.full((B, H, nq), np.nan, np.float32)
    kernel = naive_forward_kernel(16, True, np.dtype(np.float32))  # HEAD_DIM=16, CAUSAL=True
    BLOCK_M = 4                                      # threads (query rows) per block
    grid = ((nq + BLOCK_M - 1) // BLOCK_M, B * H)    # (Q tiles, batch x heads) = (2, 2)
    kernel[grid, BLOCK_M](q, k, v, o, lse, np.float32(scale))

    o_ref, lse_ref = numba_flash.reference.attention(q, k, v, causal=True, softmax_scale=scale)
    # [/docs:naive-launch]
    print(f"naive_forward[{grid}, {BLOCK_M}]: {grid[0] * grid[1]} blocks of {BLOCK_M} threads "
          f"for {B * H * nq} query rows")
    print(f"  max |o - reference|   = {np.abs(o - o_ref).max():.1e}")
    print(f"  max |lse - reference| = {np.abs(lse - lse_ref).max():.1e}")
    print(f"  NaN left in o: {int(np.isnan(o).sum())}")
    return o, lse, o_ref, lse_ref


# -- 5. memory: coalescing and banks --------------------------------------------------------
SECTOR = 32  # bytes: the unit in which global memory is read through L2


def sectors(byte_addresses):
    """How many 32-byte sectors one warp-wide load touches (4 is ideal for 32 x 4 bytes)."""
    return len({a // SECTOR for a in byte_addresses})


def bank_conflict(word_indices, banks=32):
    """The worst number of *different* 4-byte words one bank must serve for one warp-wide
    shared-memory access (1 = conflict-free; the same word to many lanes is a broadcast)."""
    per_bank = {}
    for w in word_indices:
        per_bank.setdefault(w % banks, set()).add(w)
    return max(len(s) for s in per_bank.values())


def naive_load_addresses(d=64, itemsize=4):
    """Byte offsets read by lanes 0..31 of one warp of the naive kernel (rows 0..31 of one head),
    at one step of its loops: ``q[b, h, row, c]`` (c fixed) and ``k[b, h_kv, j, c]`` (j, c
    fixed)."""
    c = j = 0
    q_addr = [(row * d + c) * itemsize for row in range(32)]
    k_addr = [(j * d + c) * itemsize for _ in range(32)]
    row_addr = [(j * d + lane) * itemsize for lane in range(32)]  # lane = column: a tile load
    return q_addr, k_addr, row_addr


def demo_memory():
    q_addr, k_addr, row_addr = naive_load_addresses()
    print("global loads, one warp (32 lanes x 4 bytes), float32, d = 64:")
    print(f"  naive kernel q[b, h, row, c], lane = row   sectors: {sectors(q_addr):2d}"
          f"  (addresses {q_addr[0]}, {q_addr[1]}, {q_addr[2]}, ..."
          f" stride {q_addr[1] - q_addr[0]})")
    print(f"  naive kernel k[b, h_kv, j, c], same j, c   sectors: {sectors(k_addr):2d}"
          "  (every lane the same address: one broadcast)")
    print(f"  tile load k[b, h_kv, j, lane], lane = col  sectors: {sectors(row_addr):2d}"
          "  (coalesced: 128 consecutive bytes)")
    print("shared memory, 32 banks of 4 bytes, a float32 tile[32][W] (W words per row):")
    for width in (32, 33):
        col = [t * width + 0 for t in range(32)]     # tile[t][0]: one column
        row = [0 * width + t for t in range(32)]     # tile[0][t]: one row
        print(f"  W = {width}: tile[lane][0] (a column) {bank_conflict(col):2d}-way,"
              f"  tile[0][lane] (a row) {bank_conflict(row)}-way")


# -- 6. occupancy ---------------------------------------------------------------------------
# [docs:occupancy]
H200 = dict(sms=132, max_warps=64, max_blocks=32, regs=65536, reg_unit=256,
            smem=228 * 1024, smem_per_block_reserved=1024)


def blocks_per_sm(threads, regs_per_thread, smem_bytes, gpu=H200):
    """How many blocks of a kernel one SM holds at once, and which resource stops it."""
    warps = -(-threads // 32)
    regs_per_warp = -(-regs_per_thread * 32 // gpu["reg_unit"]) * gpu["reg_unit"]  # rounded up
    limits = {
        "warps": gpu["max_warps"] // warps,
        "blocks": gpu["max_blocks"],
        "registers": gpu["regs"] // (regs_per_warp * warps),
    }
    if smem_bytes:
        limits["shared memory"] = gpu["smem"] // (smem_bytes + gpu["smem_per_block_reserved"])
    n = min(limits.values())
    return n, [k for k, v in limits.items() if v == n], n * warps / gpu["max_warps"]
# [/docs:occupancy]


RESOURCES = Path(__file__).resolve().parents[1] / "resources.md"


def resources(config):
    """``(sm_90 registers per thread, static shared bytes per block)`` of one configuration, as
    the compile tier measured it with ptxas (a row of ``docs/resources.md``)."""
    head = None
    for line in RESOURCES.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "configuration" and head is None:   # the columns, by name
            head = cells
        if head and cells[0] == config:
            return int(cells[head.index("sm_90 regs")]), int(cells[head.index("smem B")])
    raise LookupError(f"no row {config!r} in {RESOURCES}")


def occupancy_cases():
    """``[(label, threads, registers, shared bytes)]``: the kernels of the occupancy table."""
    import numpy as np

    from numba_flash.kernels.forward import simt as forward
    from numba_flash.teach.kernels import naive_forward
    from numba_flash.kernels.forward.config import forward_mma_config, gpu_tiles, thread_layout

    f32 = np.dtype(np.float32)
    bm, bn, hd = gpu_tiles(64, f32)
    tm, tn = thread_layout(bm, bn, hd)
    tiled = forward.config_name(bm, bn, hd, tm, tn, f32)      # "forward M64 N32 D64 T16x8 ..."
    mma = forward_mma_config(64, "float16", simulator=False)  # the GPU's tensor-core tiles
    return [
        # Nsight Compute on an H200, 2026-11-30 (commit 38a7cb7), before the 128-thread layout
        ("tiled forward fp32 d=64, old (ncu)", 64, 167, 44032),  # ncu's "44.03 KB" = 43.0 KiB
        ("tiled forward fp32 d=64 (ptxas)", tm * tn, *resources(tiled)),
        ("mma forward fp16 d=64 (ptxas)", mma.THREADS, *resources(mma.name)),
        ("naive forward fp32 d=64 (ptxas)", naive_forward.GPU_BLOCK_M,
         *resources("naive_forward HEAD_DIM=64 CAUSAL=1 float32")),
        ("a 256-thread block, 32 KiB", 256, 64, 32 * 1024),
    ]


def demo_occupancy():
    print("H200 SM: 64 warps, 32 blocks, 65536 registers, 228 KiB shared memory (1 KiB kept per"
          " block)")
    print("  kernel                              threads  regs  shared   blocks/SM  limited by"
          "                occupancy")
    for name, threads, regs, smem in occupancy_cases():
        n, by, occ = blocks_per_sm(threads, regs, smem)
        print(f"  {name:35s} {threads:7d} {regs:5d} {smem / 1024:4.1f} KiB {n:9d}  "
              f"{' and '.join(by):24s} {100 * occ:5.1f}%")


DEMOS = {"threads": demo_threads, "row-max": demo_row_max, "warp": demo_warp,
         "atomics": demo_atomics, "naive": demo_naive, "memory": demo_memory,
         "occupancy": demo_occupancy}

if __name__ == "__main__":
    DEMOS[sys.argv[1]]()
