"""Ring attention: the sequence sharded over ranks, K/V shards passed around a ring.

Each of ``R`` ranks holds a shard of the queries, keys and values of one self-attention
sequence (``N = R * N_local`` tokens, zig-zag or contiguous layout, see
:mod:`numba_flash.distributed.sharding`).  In step ``s = 0 .. R-1`` rank ``r`` holds the K/V
shard of rank ``src = (r - s) mod R`` and

1. starts sending that shard to rank ``r + 1`` and receiving the next one from rank ``r - 1``
   (non-blocking; it travels while this step computes),
2. runs :func:`numba_flash.forward` for every (query chunk, key chunk) pair that is visible:
   under a causal mask a key chunk before the query chunk is seen whole (``causal=False``),
   the same chunk is the causal diagonal (``causal=True``, equal lengths so bottom-right and
   top-left alignment agree) and a later chunk is skipped,
3. merges the partial ``(o, lse)`` into its running state with :func:`numba_flash.merge_states`
   (``lse = log(e^lse_a + e^lse_b)``, ``o = e^(lse_a - lse) o_a + e^(lse_b - lse) o_b``),
4. waits for the transfer and swaps buffers.

The backward passes K/V around the same ring and, behind them, the dK/dV accumulators: each
step calls :func:`numba_flash.backward` with the *global* ``o`` and ``lse`` of the local rows
(``P = exp(S - lse)`` is then the slice of the global softmax, and ``D = rowsum(dO * O)``
the global one), adds dQ locally, and adds dK/dV to the accumulator of the shard's owner,
which travels on; after ``R`` steps one last hop brings each accumulator home.

A learnable sink (gpt-oss's attention sinks) is added once per row, after the ring: the merged
partials are the plain softmax over all keys, and one more :func:`numba_flash.merge_states`
with the sink as a part of its own (``o_p = 0``) gives the rows their sink.  The backward
needs nothing new from the ring (``lse`` holds the sink, so ``P`` is right); ``dsink`` is each
rank's sum over its rows, summed over the ranks by one allgather (in rank order: every rank
gets the same bits).
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import NamedTuple

import ml_dtypes
import numpy as np

from .comm import as_ring_comm
from ..frontend.validate import array_module
from ..ops.kv_cache import host_ints   # (any small array's host copy)
from .sharding import check_layout, rank_chunks

__all__ = ["ring_forward", "ring_backward"]

_TAG_KV, _TAG_DKV = 17, 18
#: the dtypes a shard may have, by code (bfloat16: ``ml_dtypes.bfloat16``); the order is the
#: code each rank sends in the agreement check
_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
           np.dtype(ml_dtypes.bfloat16))
_LAYOUT_CODE = {"zigzag": 0, "contiguous": 1}


# -- argument agreement across ranks ---------------------------------------------------------
def _describe(x):
    """``[ndim, shape (padded to 4), dtype code, kind]`` of one argument, as ints."""
    shape = tuple(getattr(x, "shape", ()) or ())
    ndim = len(shape) if hasattr(x, "shape") else -1
    dt = getattr(x, "dtype", None)
    try:
        code = _DTYPES.index(np.dtype(dt)) if dt is not None else -1
    except (TypeError, ValueError):
        code = -2  # not a float dtype: the local check names it
    kind = 1 if type(x).__module__.split(".")[0] == "cupy" else 0
    return [ndim, *(list(shape[:4]) + [-1] * (4 - len(shape[:4]))), code, kind]


def _show(desc):
    ndim, *shape_code = desc
    shape = tuple(int(s) for s in shape_code[:4] if s >= 0)[: max(ndim, 0)]
    code, kind = shape_code[4], shape_code[5]
    dtype = _DTYPES[code].name if 0 <= code < len(_DTYPES) else "a non-float dtype"
    where = "cupy" if kind else "numpy"
    return f"shape {shape}, {dtype}, {where}"


def _float_bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _agree(ring, arrays, scalars, local_check):
    """Run ``local_check`` here, then check with one allgather that every rank agrees.

    Every rank raises the same ValueError when ranks disagree (so none is left waiting); a rank
    whose own check failed raises its own error, the others name that rank.
    """
    err, info = None, None
    try:
        info = local_check()
    except Exception as e:  # noqa: BLE001  raised after the collective, so no rank hangs
        err = e
    vec = [0 if err is None else 1]
    for x in arrays.values():
        vec += _describe(x)
    vec += [v for v in scalars.values()]
    table = ring.allgather_ints(np.asarray(vec, np.int64))
    if err is not None:
        raise err
    failed = [r for r in range(ring.size) if table[r, 0]]
    if failed:
        raise ValueError(f"rank {failed[0]} rejected its arguments (see the error on that rank); "
                         "every rank must pass valid shards")
    width = len(_describe(None))
    for r in range(ring.size):
        pos = 1
        for name in arrays:
            mine, first = table[r, pos : pos + width], table[0, pos : pos + width]
            if not np.array_equal(mine, first):
                raise ValueError(f"{name}: rank {r} passed {_show(list(mine))}, but rank 0 "
                                 f"passed {_show(list(first))}; every rank must pass shards of "
                                 "one shape and dtype")
            pos += width
        for name in scalars:
            if table[r, pos] != table[0, pos]:
                raise ValueError(f"{name}: rank {r} passed a different value from rank 0; "
                                 "every rank must pass the same")
            pos += 1
    return info


class _Shards(NamedTuple):
    """What :func:`_check_shards` returns: this rank's shard dims (``q [B, H, N_local, d]``,
    ``Hkv`` kv heads), dtype, softmax scale and checked sink (or None)."""

    b: int
    h: int
    hkv: int
    n: int
    d: int
    dtype: np.dtype
    scale: float
    sink: object


def _check_shards(ring, q, k, v, causal, softmax_scale, layout, extra=None, flags=None,
                  learnable_sink=None):
    """Local checks (types, GQA shapes, self-attention shard lengths, the sink) and the
    cross-rank one (the sink's bytes too: every rank must pass the same logits); returns the
    :class:`_Shards` of this rank."""
    from ..frontend.variants import check_sink
    from ..frontend.validate import (ATTENTION_DTYPES, check_array, check_bool, check_qkv,
                                     check_same_dtype, check_same_kind, check_scale)
    from ..kernels.core.common import acc_dtype

    layout_ok = layout if isinstance(layout, str) and layout in _LAYOUT_CODE else None

    def local():
        qkv = check_qkv(q, k, v)
        b, h, nq, nk = qkv.b, qkv.h, qkv.nq, qkv.nk
        d, dtype = qkv.d, qkv.dtype
        if nq != nk:
            raise ValueError(f"k: ring attention is self-attention over shards of equal length: "
                             f"expected N_local {nq} (that of q), got {nk}")
        check_bool("causal", causal)
        for name, value in (flags or {}).items():  # per-rank options (return_lse)
            check_bool(name, value)
        check_layout(layout)
        scale = check_scale(softmax_scale, d, dtype)
        per_rank = len(rank_chunks(0, 1, layout))
        if nq % per_rank:
            raise ValueError(f"q: the {layout} layout holds {per_rank} equal chunks per rank: "
                             f"expected an even N_local, got {nq}")
        if nq == 0:
            raise ValueError("q: expected N_local >= 1, got 0")
        if extra:  # the backward's do, o, lse
            named = dict(extra)
            for name in ("do", "o"):
                shape, dt = check_array(name, named[name], 4, ATTENTION_DTYPES)
                check_same_dtype({"q": dtype, name: dt})
                if shape != (b, h, nq, d):
                    raise ValueError(f"{name}: expected the shape of q {(b, h, nq, d)}, "
                                     f"got {shape}")
            shape, _ = check_array("lse", named["lse"], 3, dtypes=(acc_dtype(dtype),))
            if shape != (b, h, nq):
                raise ValueError(f"lse: expected shape {(b, h, nq)} ([B, H, N_local] of q), "
                                 f"got {shape}")
            check_same_kind({"q": q, **named})
        sink = check_sink(learnable_sink, h)
        if sink is not None:
            check_same_kind({"q": q, "learnable_sink": sink})
        return _Shards(b, h, qkv.hkv, nq, d, dtype, scale, sink)

    arrays = {"q": q, "k": k, "v": v, **(dict(extra) if extra else {})}
    d = getattr(q, "shape", (0,))[-1] if getattr(q, "ndim", 0) else 0
    try:
        scale_bits = _float_bits(softmax_scale if softmax_scale is not None
                                 else 1.0 / math.sqrt(max(d, 1)))
    except (TypeError, ValueError):
        scale_bits = -1
    scalars = {"causal": int(bool(causal)) if isinstance(causal, (bool, np.bool_)) else -1,
               "layout": _LAYOUT_CODE.get(layout_ok, -1), "softmax_scale": scale_bits,
               "learnable_sink": _bytes_code(learnable_sink)}
    return _agree(ring, arrays, scalars, local)


def _bytes_code(x):
    """A 32-bit code of an array's bytes (``-1``: None or not an array), for the agreement."""
    if x is None:
        return -1
    try:
        return zlib.crc32(np.ascontiguousarray(host_ints(x)).tobytes())
    except (TypeError, ValueError):
        return -2


def _sum_over_ranks(ring, x):
    """``sum_r x_r`` of a small float64 vector on every rank, identical bits everywhere: one
    allgather of the bits, summed in rank order."""
    bits = np.ascontiguousarray(x, np.float64).view(np.int64)
    table = ring.allgather_ints(bits)
    return np.ascontiguousarray(table).view(np.float64).sum(axis=0)


# -- which (query rows, key columns) pairs each step computes ---------------------------------
def _plan(q_chunks, k_chunks, c, causal):
    """A list of ``(rows, cols, causal)`` blocks of the local shard for one ring step.

    ``q_chunks`` / ``k_chunks`` are the global chunk ids (increasing) of the local queries and
    of the K/V shard held this step, each chunk ``c`` rows long.  Without a mask it is one block.
    With one, chunk pair (i, j) is full for j < i, the causal diagonal for j == i and skipped
    for j > i; for the rank's own shard (same chunks, increasing, equal lengths) that is exactly
    the causal mask of the whole local block, so step 0 is one causal call too.
    """
    # [docs:ring-plan]
    nq, nk = c * len(q_chunks), c * len(k_chunks)
    if not causal:
        return [(slice(0, nq), slice(0, nk), False)]
    if tuple(q_chunks) == tuple(k_chunks):
        return [(slice(0, nq), slice(0, nk), True)]
    blocks = []
    for a, i in enumerate(q_chunks):
        rows = slice(a * c, (a + 1) * c)
        full = [bi for bi, j in enumerate(k_chunks) if j < i]
        # runs of adjacent full chunks make one call each
        run = []
        for bi in full + [None]:
            if run and (bi is None or bi != run[-1] + 1):
                blocks.append((rows, slice(run[0] * c, (run[-1] + 1) * c), False))
                run = []
            if bi is not None:
                run.append(bi)
        for bi, j in enumerate(k_chunks):
            if j == i:
                blocks.append((rows, slice(bi * c, (bi + 1) * c), True))
    # [/docs:ring-plan]
    # query chunks with the same key blocks share one call (e.g. both halves seeing chunk 0)
    merged = []
    for rows, cols, cz in blocks:
        for m, (r0, c0, z0) in enumerate(merged):
            if c0 == cols and z0 == cz and r0.stop == rows.start:
                merged[m] = (slice(r0.start, rows.stop), cols, cz)
                break
        else:
            merged.append((rows, cols, cz))
    return merged


def _op(name):
    """``numba_flash.forward`` / ``backward`` / ``merge_states``, imported on first use."""
    import numba_flash

    return getattr(numba_flash, name)


# -- forward ----------------------------------------------------------------------------------
def ring_forward(q, k, v, *, comm, causal=False, softmax_scale=None, return_lse=False,
                 layout="zigzag", learnable_sink=None):
    """Attention over a sequence sharded across the ranks of ``comm``: this rank's shard of ``o``.

    ``q`` ``[B, H, N_local, d]``, ``k``/``v`` ``[B, Hkv, N_local, d]`` are this rank's shards
    (``layout="zigzag"``: :func:`~numba_flash.distributed.zigzag_shard`; ``"contiguous"``:
    :func:`~numba_flash.distributed.contiguous_shard`) of one self-attention sequence of
    ``N = R * N_local`` tokens (queries and keys the same tokens, so the bottom-right causal
    alignment is the plain ``j <= i``).  Returns this rank's shard of ``o`` (input dtype:
    float16, bfloat16, float32 or float64; the partial results merge in float32, float64 for
    float64, and are rounded to the input dtype once, at the end), and of ``lse``
    ``[B, H, N_local]`` (float32; float64 for float64) with ``return_lse=True``: equal to
    :func:`numba_flash.forward` of the whole sequence, sharded the same way.
    ``learnable_sink``: float32 ``[H]``, the same on every rank (as :func:`numba_flash.forward`;
    added once per row, after the ring).

    ``comm``: an mpi4py communicator or :class:`~numba_flash.distributed.NcclComm`.  Every rank
    must call with the same shapes, dtypes and options; one allgather checks that first and
    every rank raises the same ValueError (naming the rank and the argument) if not.
    """
    ring = as_ring_comm(comm)
    shards = _check_shards(ring, q, k, v, causal, softmax_scale, layout,
                           flags={"return_lse": return_lse}, learnable_sink=learnable_sink)
    b, h, n, d = shards.b, shards.h, shards.n, shards.d
    dtype, scale, sink = shards.dtype, shards.scale, shards.sink
    causal = bool(causal)
    forward, merge_states = _op("forward"), _op("merge_states")
    xp = array_module(q)
    acc_t = np.float64 if dtype == np.float64 else np.float32
    size, rank = ring.size, ring.rank
    mine = rank_chunks(rank, size, layout)
    c = n // len(mine)

    kv = xp.ascontiguousarray(xp.stack([k, v]))  # [2, B, Hkv, N_local, d]: one message a step
    kv_next = xp.empty_like(kv) if size > 1 else None
    o_acc = xp.zeros((b, h, n, d), acc_t)
    lse_acc = xp.full((b, h, n), -np.inf, acc_t)
    fresh = np.ones(n, bool)  # local rows that have no partial state yet

    # [docs:ring-forward-loop]
    for step in range(size):
        src = (rank - step) % size
        pending = None
        if step < size - 1:  # the next shard travels while this one is computed
            pending = ring.start_exchange(kv, (rank + 1) % size, kv_next, (rank - 1) % size,
                                          _TAG_KV)
        for rows, cols, blk_causal in _plan(mine, rank_chunks(src, size, layout), c, causal):
            o_p, lse_p = forward(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                 causal=blk_causal, softmax_scale=scale, return_lse=True)
            o_p = o_p.astype(acc_t, copy=False)
            if fresh[rows].all():
                o_acc[:, :, rows], lse_acc[:, :, rows] = o_p, lse_p
            else:
                o_m, lse_m = merge_states(xp.stack([o_acc[:, :, rows], o_p]),
                                          xp.stack([lse_acc[:, :, rows], lse_p]))
                o_acc[:, :, rows], lse_acc[:, :, rows] = o_m, lse_m
            fresh[rows] = False
        if pending is not None:
            pending.wait()
            kv, kv_next = kv_next, kv
    # [/docs:ring-forward-loop]

    if sink is not None:  # once per row, as one more part with o = 0 (not per step or rank)
        o_acc, lse_acc = merge_states(o_acc[None], lse_acc[None], learnable_sink=sink[:, None])
    o = o_acc.astype(dtype, copy=False)
    return (o, lse_acc) if return_lse else o


# -- backward ---------------------------------------------------------------------------------
def ring_backward(do, q, k, v, o, lse, *, comm, causal=False, softmax_scale=None,
                  layout="zigzag", learnable_sink=None):
    """Gradients ``(dq, dk, dv)`` of :func:`ring_forward`, each this rank's shard (and with a
    ``learnable_sink``, ``dsink`` float32 ``[H]``: the whole sequence's, the same on every
    rank).

    ``o`` and ``lse`` are this rank's shards of the forward's *global* output and log-sum-exp
    (``ring_forward(..., return_lse=True)``); ``do`` the upstream gradient of this rank's
    ``o``.  Shapes, dtypes and the options as in :func:`ring_forward`.  dQ is accumulated
    locally; dK/dV accumulate (float32, float64 for float64) on the shard's way round the
    ring and reach their owner one hop after the last step.
    """
    ring = as_ring_comm(comm)
    shards = _check_shards(ring, q, k, v, causal, softmax_scale, layout,
                           extra=(("do", do), ("o", o), ("lse", lse)),
                           learnable_sink=learnable_sink)
    b, h, hkv, n = shards.b, shards.h, shards.hkv, shards.n
    d, dtype, scale, sink = shards.d, shards.dtype, shards.scale, shards.sink
    causal = bool(causal)
    backward = _op("backward")
    xp = array_module(q)
    acc_t = np.float64 if dtype == np.float64 else np.float32
    size, rank = ring.size, ring.rank
    mine = rank_chunks(rank, size, layout)
    c = n // len(mine)
    nxt, prv = (rank + 1) % size, (rank - 1) % size

    kv = xp.ascontiguousarray(xp.stack([k, v]))
    kv_next = xp.empty_like(kv) if size > 1 else None
    dq = xp.zeros((b, h, n, d), acc_t)
    dkv_in = xp.empty((2, b, hkv, n, d), acc_t) if size > 1 else None
    dkv_pending = None  # the accumulator arriving from the previous rank

    # [docs:ring-backward-loop]
    for step in range(size):
        src = (rank - step) % size
        kv_pending = None
        if step < size - 1:
            kv_pending = ring.start_exchange(kv, nxt, kv_next, prv, _TAG_KV)
        dkv = xp.zeros((2, b, hkv, n, d), acc_t)  # this step's part for src's shard
        for rows, cols, blk_causal in _plan(mine, rank_chunks(src, size, layout), c, causal):
            dq_p, dk_p, dv_p = backward(do[:, :, rows], q[:, :, rows], kv[0][:, :, cols],
                                        kv[1][:, :, cols], o[:, :, rows], lse[:, :, rows],
                                        causal=blk_causal, softmax_scale=scale)
            dq[:, :, rows] += dq_p
            dkv[0][:, :, cols] += dk_p
            dkv[1][:, :, cols] += dv_p
        if dkv_pending is not None:  # what the ranks before added for src's shard
            dkv_pending.wait()
            dkv += dkv_in
        if size > 1:  # pass src's accumulator on (after the last step: home to its owner)
            dkv_pending = ring.start_exchange(dkv, nxt, dkv_in, prv, _TAG_DKV)
        if kv_pending is not None:
            kv_pending.wait()
            kv, kv_next = kv_next, kv

    if dkv_pending is not None:
        dkv_pending.wait()
        dkv = dkv_in
    # [/docs:ring-backward-loop]
    grads = (dq.astype(dtype, copy=False), dkv[0].astype(dtype, copy=False),
             dkv[1].astype(dtype, copy=False))
    if sink is None:
        return grads
    from ..frontend.backward_launch import sink_gradient   # this rank's rows, then every rank's
    mine = sink_gradient(do, o, lse, sink, accumulate=True)
    dsink = _sum_over_ranks(ring, host_ints(mine)).astype(np.float32)
    return (*grads, xp.asarray(dsink))
