"""Count the global-memory bytes a kernel really reads and writes, in the simulator.

:func:`count_global_bytes` runs any call of the package (``lambda: numba_flash.softmax(x)``) with
``ArrayCall.launch`` patched so that every array argument of every kernel launch is wrapped in a
:class:`CountingArray`: a proxy whose element reads and writes add the element's size to a
counter.  The simulator passes objects it does not know straight to the kernel, so the kernel runs
unchanged; only global memory goes through the proxy (shared and local arrays are the simulator's
own NumPy arrays and are not counted).

What is counted is *accesses*: an element read twice counts twice.  On a GPU some repeats hit L1
or L2 instead of HBM, so these figures are the traffic a kernel asks of the memory system, the
quantity the I/O analysis of ``docs/io-complexity.md`` bounds.  Each record also gives the
*distinct* bytes touched (the compulsory traffic: every input read once, every output written
once).

The models below say what each kernel should read and write; ``tests/docs/test_io_count.py``
checks measured == model exactly.  Run ``python docs/examples/io_count.py`` for the table quoted
in the docs.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import numpy as np

import numba_flash  # noqa: F401  (chooses the backend before numba.cuda is imported)
from numba_flash.backend import on_simulator
from numba_flash.frontend.arrays import ArrayCall


# [docs:counting-array]
class CountingArray:
    """Global memory seen through a counter: every element read or written is tallied."""

    def __init__(self, array, stats, lock):
        self._a = getattr(array, "_ary", array)  # the simulator's device array wraps a ndarray
        self._stats = stats
        self._lock = lock
        self.shape, self.dtype, self.ndim = self._a.shape, self._a.dtype, self._a.ndim
        self.size = self._a.size

    def _tally(self, kind, idx):
        n = np.asarray(self._a[idx]).size
        with self._lock:
            self._stats[kind] += n * self._a.itemsize
            self._stats["touched_" + kind][idx] = True

    def __getitem__(self, idx):
        self._tally("read", idx)
        return self._a[idx]

    def __setitem__(self, idx, value):
        self._tally("written", idx)
        self._a[idx] = value

    def __len__(self):
        return len(self._a)

    @property
    def __array_interface__(self):
        """Where the memory is (the simulator's alignment checks read the address; not a read
        of the elements, so not counted)."""
        return self._a.__array_interface__
# [/docs:counting-array]


def counting_wrap():
    """``(wrap, stats)`` for a kernel launched by hand: ``wrap(name, array)`` is ``array`` seen
    through a :class:`CountingArray` whose byte counts land in ``stats[name]["read"]`` and
    ``stats[name]["written"]`` (the exercises' checks count this way)."""
    stats, lock = {}, threading.Lock()

    def wrap(name, a):
        stats[name] = {"read": 0, "written": 0, "touched_read": np.zeros(a.shape, bool),
                       "touched_written": np.zeros(a.shape, bool)}
        return CountingArray(a, stats[name], lock)

    return wrap, stats


@dataclass
class LaunchCount:
    """Bytes one kernel launch read and wrote, per array argument (by kernel parameter name)."""

    kernel: str
    grid: tuple
    block: tuple
    arrays: dict = field(default_factory=dict)  # name -> {"read", "written", "distinct_read", ...}

    @property
    def read(self):
        return sum(a["read"] for a in self.arrays.values())

    @property
    def written(self):
        return sum(a["written"] for a in self.arrays.values())

    @property
    def distinct(self):
        return sum(a["distinct_read"] + a["distinct_written"] for a in self.arrays.values())


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


# [docs:count-global-bytes]
def count_global_bytes(call):
    """Run ``call()`` (any numba_flash op) and return ``(result, [LaunchCount per launch])``."""
    if not on_simulator():
        raise RuntimeError("count_global_bytes needs the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)")
    launches = []
    original = ArrayCall.launch

    def counting_launch(self, kernel, grid, block, *args, **kw):
        names = list(inspect.signature(kernel.py_func).parameters)
        record = LaunchCount(kernel.py_func.__name__, _as_tuple(grid), _as_tuple(block))
        lock = threading.Lock()
        wrapped = []
        for name, arg in zip(names, args):
            if hasattr(arg, "shape") and not np.isscalar(arg):  # a device array
                shape = arg.shape
                stats = {"read": 0, "written": 0, "itemsize": np.dtype(arg.dtype).itemsize,
                         "touched_read": np.zeros(shape, bool),
                         "touched_written": np.zeros(shape, bool)}
                record.arrays[name] = stats
                wrapped.append(CountingArray(arg, stats, lock))
            else:
                wrapped.append(arg)
        original(self, kernel, grid, block, *wrapped, **kw)  # kw: the work hint
        for stats in record.arrays.values():
            for kind in ("read", "written"):
                touched = int(stats.pop("touched_" + kind).sum())
                stats["distinct_" + kind] = touched * stats["itemsize"]
        launches.append(record)

    ArrayCall.launch = counting_launch
    try:
        result = call()
    finally:
        ArrayCall.launch = original
    return result, launches
# [/docs:count-global-bytes]


# -- what each kernel should move (bytes) ------------------------------------------------------
# [docs:io-models]
def softmax_kernel_bytes(rows, n, itemsize):
    """numba_flash.softmax: pass 1 reads x, pass 2 reads x again and writes y."""
    return {"read": 2 * rows * n * itemsize, "written": rows * n * itemsize}


def visible_keys(nq, nk, causal):
    """Keys each query row sees (bottom-right causal alignment)."""
    rows = np.arange(nq)
    return np.clip(rows + nk - nq + 1, 0, nk) if causal else np.full(nq, nk)


def naive_forward_bytes(b, h, nq, nk, d, itemsize, lse_itemsize, causal=False):
    """One thread per query row: q row once, then every visible K and V row straight from HBM."""
    keys = int(visible_keys(nq, nk, causal).sum())
    read = b * h * (nq * d + 2 * keys * d) * itemsize
    written = b * h * (nq * d * itemsize + nq * lse_itemsize)
    return {"read": read, "written": written}


def standard_attention_bytes(nq, nk, d, itemsize):
    """Three kernels with S and P materialised in HBM (per head)."""
    read = (nq * d + nk * d) + nq * nk + (nq * nk + nk * d)  # S = QK^T; P = softmax(S); O = PV
    written = nq * nk + nq * nk + nq * d
    return {"read": read * itemsize, "written": written * itemsize}


def tiled_forward_bytes(b, h, nq, nk, d, block_m, block_n, itemsize, lse_itemsize, causal=False):
    """Q tiles outer (one thread block each), K/V tiles inner: replay the loop and count."""
    offset = nk - nq
    read = written = 0
    for q_start in range(0, nq, block_m):
        rows = min(nq, q_start + block_m) - q_start
        read += rows * d  # q_tile: loaded once, kept in shared memory / registers
        for k_start in range(0, nk, block_n):
            if causal and k_start > q_start + rows - 1 + offset:
                break  # this tile and all after it lie above the diagonal
            cols = min(nk, k_start + block_n) - k_start
            read += 2 * cols * d  # k_tile and v_tile
        written += rows * d  # o, once, after the last K/V tile
    return {"read": b * h * read * itemsize,
            "written": b * h * (written * itemsize + nq * lse_itemsize)}

def decode_kv_bytes(seqlens, h, hkv, nq, d, itemsize, block_m):
    """numba_flash.decode stage 1: each K/V element of a live token read once per chunk of
    ``block_m`` query rows of its GQA group (once, when ``(h // hkv) * nq <= block_m``)."""
    chunks = -(-(h // hkv) * nq // block_m)
    return 2 * hkv * int(np.sum(seqlens)) * d * itemsize * chunks
# [/docs:io-models]


def main():
    import numba_flash as nf
    from numba_flash.kernels.decode.config import SIM_BLOCK_M
    from numba_flash.teach.ops.naive_forward import naive_forward

    rng = np.random.default_rng(0)
    print(f"{'kernel and shape':44s} {'read B':>9s} {'model':>9s} {'written B':>9s} {'model':>9s}"
          f" {'distinct B':>10s}")
    x = rng.standard_normal((4, 40)).astype(np.float32)
    _, (rec,) = count_global_bytes(lambda: nf.softmax(x))
    model = softmax_kernel_bytes(4, 40, 4)
    print(f"{'softmax float32 x[4, 40]':44s} {rec.read:9d} {model['read']:9d} {rec.written:9d}"
          f" {model['written']:9d} {rec.distinct:10d}")
    for n, causal in ((16, False), (32, False), (64, False), (64, True)):
        d = 16
        q = rng.standard_normal((1, 1, n, d)).astype(np.float32)
        _, (rec,) = count_global_bytes(lambda: naive_forward(q, q, q, causal=causal))
        model = naive_forward_bytes(1, 1, n, n, d, 4, 4, causal)
        label = f"naive_forward float32 N={n} d={d}{' causal' if causal else ''}"
        print(f"{label:44s} {rec.read:9d} {model['read']:9d} {rec.written:9d}"
              f" {model['written']:9d} {rec.distinct:10d}")
    print()
    print("tiled forward (numba_flash.forward, float32, B = H = 1, N = Nq = Nk), measured vs"
          " tiled_forward_bytes")
    print(f"{'N':>4s} {'d':>3s} {'BLOCK_M':>7s} {'BLOCK_N':>7s} {'causal':>6s} {'Q read':>7s}"
          f" {'K+V read':>8s} {'model':>8s} {'K/V passes':>10s} {'written':>7s} {'model':>7s}")
    for n, d, bm, bn, causal in ((32, 16, 8, 8, False), (32, 16, 16, 8, False),
                                 (32, 16, 8, 16, False), (32, 16, 16, 16, False),
                                 (64, 16, 16, 16, False), (64, 16, 16, 16, True),
                                 (64, 64, 16, 16, False)):
        q, k, v = (rng.standard_normal((1, 1, n, d)).astype(np.float32) for _ in range(3))
        _, launches = count_global_bytes(
            lambda: nf.forward(q, k, v, causal=causal, block_m=bm, block_n=bn))
        rec = next(r for r in launches if {"q", "k", "v"} <= set(r.arrays))
        a = rec.arrays
        kv = a["k"]["read"] + a["v"]["read"]
        written = a["o"]["written"] + a["lse"]["written"]
        model = tiled_forward_bytes(1, 1, n, n, d, bm, bn, 4, 4, causal)
        print(f"{n:4d} {d:3d} {bm:7d} {bn:7d} {str(causal):>6s} {a['q']['read']:7d} {kv:8d}"
              f" {model['read'] - n * d * 4:8d} {kv / (2 * k.nbytes):10.3g} {written:7d}"
              f" {model['written']:7d}")
    print()
    print("decode (numba_flash.decode, float32, paged, block_size 4, d = 8), K+V bytes read:")
    print(f"{'H':>3s} {'Hkv':>3s} {'chunks':>6s} {'cache_seqlens':>14s} {'measured':>8s} "
          f"{'model':>8s}"
          f" {'per q head':>10s} {'table':>6s}")
    for h, hkv, seqlens in ((4, 4, (5, 37, 20)), (8, 2, (5, 37, 20)), (8, 1, (5, 37, 20))):
        seqlens = np.array(seqlens, np.int32)
        d, bs = 8, 4
        n_blocks = int(sum(-(-seqlens // bs)))
        kc, vc = (rng.standard_normal((n_blocks, hkv, bs, d)).astype(np.float32) for _ in "kv")
        table = np.full((3, 10), -1, np.int32)
        perm, i = rng.permutation(n_blocks), 0
        for b, n in enumerate(seqlens):
            table[b, : -(-n // bs)] = perm[i: i + -(-n // bs)]
            i += -(-n // bs)
        q = rng.standard_normal((3, h, d)).astype(np.float32)
        _, launches = count_global_bytes(
            lambda: nf.decode(q, kc, vc, cache_seqlens=seqlens, block_table=table))
        a = launches[0].arrays
        model = decode_kv_bytes(seqlens, h, hkv, 1, d, 4, SIM_BLOCK_M)
        per_head = 2 * h * int(seqlens.sum()) * d * 4
        chunks = -(-(h // hkv) // SIM_BLOCK_M)
        print(f"{h:3d} {hkv:3d} {chunks:6d} {str(seqlens.tolist()):>14s} "
              f"{a['k_cache']['read'] + a['v_cache']['read']:8d} {model:8d} {per_head:10d}"
              f" {a['block_table']['read']:6d}")
    print()
    print("models per head, float16 (2 bytes), d = 64, BLOCK_N = 64: bytes read + written")
    print(f"{'N':>6s} {'standard':>13s} {'naive kernel':>13s} {'tiled M=64':>13s}"
          f" {'tiled M=128':>13s} {'compulsory':>13s}")
    for n in (256, 1024, 4096, 16384):
        std = standard_attention_bytes(n, n, 64, 2)
        nai = naive_forward_bytes(1, 1, n, n, 64, 2, 4)
        t64 = tiled_forward_bytes(1, 1, n, n, 64, 64, 64, 2, 4)
        t128 = tiled_forward_bytes(1, 1, n, n, 64, 128, 64, 2, 4)
        comp = 4 * n * 64 * 2 + n * 4  # q, k, v read once, o written once (+ lse)
        print(f"{n:6d} {sum(std.values()):13d} {sum(nai.values()):13d} {sum(t64.values()):13d}"
              f" {sum(t128.values()):13d} {comp:13d}")


if __name__ == "__main__":
    main()
