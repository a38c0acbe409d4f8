"""The token-sparse backward (issue 47): the gradients of :func:`numba_flash.forward` with
``kv_indices``, reading only the listed keys.

Contract (:func:`numba_flash.reference.sparse_attention_backward`): for query row ``r`` (head
``h`` of token ``i``) and each key ``j`` its list names and the built-in rules let it see,
``p = exp(score - lse_r)`` (the forward's ``lse``, sink included), ``dp = do_r . v_j``, ``ds =
p (dp - D_r) (1 - t^2)`` (``D_r = do_r . o_r``; ``t = tanh(scale q.k / softcap)`` with softcap,
else the factor is 1), then ``dq_r += scale ds k_j``, ``dk_j += scale ds q_r``, ``dv_j += p do_r``.

:func:`sparse_backward_kernel` ``(cfg)`` builds, for a :class:`~numba_flash.kernels.backward.
config.SparseBackwardConfig`, ``kernel(q, k, v, o, do, lse, kv_indices, dq, dk_acc, dv_acc,
va)``: ``q``, ``o``, ``do``, ``dq`` ``[B, H, Nq, d or d_v]``, ``k`` ``[B, Hkv, Nk, d]``, ``v``
``[B, Hkv, Nk, d_v]``, ``lse`` ``[B, H, Nq]``, ``kv_indices`` int32 ``[B, Hkv or 1, Nq, topk]``
(checked on the host), ``dk_acc``, ``dv_acc`` zeroed compute-type accumulators in ``k``'s and
``v``'s shapes, ``va`` the :class:`~numba_flash.kernels.core.variant.Variant` (scale, window,
softcap, ALiBi slopes ``[B, H]``).  Grid ``B * Hkv * Nq * chunks``: block ``((b * Hkv + kvh) *
Nq + i) * chunks + z`` serves the ``ROWS`` query heads ``z ROWS ..`` of kv head ``kvh``'s group at
token ``i`` (they share the list, as in the forward).  Thread ``t`` takes list entries ``t, t +
THREADS, ..``; per entry and row it recomputes ``p`` and ``ds``, adds ``dk_j`` and ``dv_j`` with
global atomics (the keys of other tokens' lists meet there: not bitwise reproducible, as
flash-attn's dQ without ``deterministic``) and ``dq_r`` into a shared ``[ROWS, HEAD_DIM]``
accumulator with shared atomics, written once at the end.  An entry outside ``[-1, Nk)`` is never
dereferenced and makes the block's ``dq`` rows NaN.  Work ``O(Nq * H * topk * d)``, memory the
lists' own: no dense mask.  The story: docs/sparse-attention.md (the backward section).
"""

from __future__ import annotations

import functools
import math

from numba import cuda, int32

from ..core.common import compute_type
from ..core.elements import element_ops
from ..core.jit import kernel_jit
from ..mainloop.visibility import key_bounds


@functools.lru_cache(maxsize=None)
def sparse_backward_kernel(cfg):
    """The kernel of :class:`~numba_flash.kernels.backward.config.SparseBackwardConfig` ``cfg``
    (see the module docstring)."""
    THREADS, ROWS, HEAD_DIM, SOFTCAP, ALIBI = (cfg.THREADS, cfg.ROWS, cfg.HEAD_DIM, cfg.SOFTCAP,
                                               cfg.ALIBI)
    acc_t = compute_type(cfg.np_dtype)
    load, store = element_ops(cfg.np_dtype)
    ZERO = acc_t(0.0)
    ONE = acc_t(1.0)
    NAN = acc_t(math.nan)
    NEG_INF = acc_t(-math.inf)

    @kernel_jit(cache=True)
    def sparse_backward(q, k, v, o, do, lse, kv_indices, dq, dk_acc, dv_acc, va):
        tid = cuda.threadIdx.x
        n_heads = q.shape[1]
        nq = q.shape[2]
        d = q.shape[3]
        d_v = v.shape[3]
        hkv = k.shape[1]
        nk = k.shape[2]
        group = n_heads // hkv
        chunks = (group + ROWS - 1) // ROWS
        bx = cuda.blockIdx.x
        z = bx % chunks
        tok = bx // chunks % nq
        kvh = bx // chunks // nq % hkv
        b = bx // chunks // nq // hkv
        g_list = kvh if kv_indices.shape[1] > 1 else 0
        topk = kv_indices.shape[3]
        left, right = va.window
        offset = nk - nq                      # bottom-right: token i at key column i + offset
        lo, hi = key_bounds(tok, offset, nk, left, right)

        dq_sh = cuda.shared.array((ROWS, HEAD_DIM), acc_t)
        d_sh = cuda.shared.array(ROWS, acc_t)     # D_r = do_r . o_r
        bad_sh = cuda.shared.array(1, int32)
        for e in range(tid, ROWS * HEAD_DIM, THREADS):
            dq_sh[e // HEAD_DIM, e % HEAD_DIM] = ZERO
        if tid < ROWS:
            h = kvh * group + z * ROWS + tid
            acc = ZERO
            if z * ROWS + tid < group:
                for c in range(d_v):
                    acc += load(do[b, h, tok, c]) * load(o[b, h, tok, c])
            d_sh[tid] = acc
        if tid == 0:
            bad_sh[0] = 0
        cuda.syncthreads()  # dq_sh zeroed, D_r and the bad flag set before any entry adds

        for t in range(tid, topk, THREADS):
            j = kv_indices[b, g_list, tok, t]
            if j < -1 or j >= nk:
                bad_sh[0] = 1                 # never dereferenced: the rows' dq is NaN
                continue
            if j < 0 or j < lo or j >= hi:    # no key, or one the rule hides
                continue
            for r in range(ROWS):
                if z * ROWS + r >= group:
                    continue
                h = kvh * group + z * ROWS + r
                lse_r = acc_t(lse[b, h, tok])
                if lse_r == NEG_INF:          # the row sees no key: it adds nothing
                    continue
                s = ZERO
                for c in range(d):
                    s += load(q[b, h, tok, c]) * load(k[b, kvh, j, c])
                s *= va.scale
                slope = ONE                   # d score / d s: the softcap's (1 - t^2)
                if SOFTCAP:
                    th = math.tanh(s * va.inv_softcap)
                    s = va.softcap * th
                    slope = ONE - th * th
                if ALIBI:
                    s -= acc_t(va.alibi[b, h]) * acc_t(abs(tok + offset - j))
                p = math.exp(s - lse_r)
                dp = ZERO
                for c in range(d_v):
                    dp += load(do[b, h, tok, c]) * load(v[b, kvh, j, c])
                ds = p * (dp - d_sh[r]) * slope * va.scale
                for c in range(d_v):
                    cuda.atomic.add(dv_acc, (b, kvh, j, c), p * load(do[b, h, tok, c]))
                for c in range(d):
                    cuda.atomic.add(dk_acc, (b, kvh, j, c), ds * load(q[b, h, tok, c]))
                    cuda.atomic.add(dq_sh, (r, c), ds * load(k[b, kvh, j, c]))
        cuda.syncthreads()  # every entry's dq share is in dq_sh before the rows are written
        for e in range(tid, ROWS * HEAD_DIM, THREADS):
            r = e // HEAD_DIM
            c = e % HEAD_DIM
            if z * ROWS + r < group and c < d:
                out = dq_sh[r, c]
                if bad_sh[0] != 0:
                    out = NAN
                dq[b, kvh * group + z * ROWS + r, tok, c] = store(out)

    return sparse_backward
