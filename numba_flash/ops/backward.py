"""``numba_flash.backward``: attention gradients recomputed from the forward's ``lse``."""

from __future__ import annotations

from ..frontend import ArrayCall
from ..frontend.validate import (check_array, check_bool, check_qkv, check_same_dtype,
                                 check_same_kind, check_scale)
from ..kernels.backward import (cast_kernel, default_tiles, dkdv_kernel, dq_kernel,
                                elem_threads, preprocess_kernel)
from ..kernels.common import acc_dtype, cdiv
from ..philox import dropout_params


def backward(do, q, k, v, o, lse, *, causal=False, softmax_scale=None, deterministic=False,
             dropout_p=0.0, seed=0):
    """Gradients ``(dq, dk, dv)`` of attention for the upstream gradient ``do``.

    ``q``, ``o``, ``do`` are ``[B, H, Nq, d]``; ``k``, ``v`` are ``[B, Hkv, Nk, d]`` (GQA: ``H`` a
    multiple of ``Hkv``); ``lse`` ``[B, H, Nq]`` is the forward's log-sum-exp, float32 (float64
    for float64 inputs).  ``causal`` masks bottom-right (query ``i`` sees key ``j`` iff
    ``j <= i + Nk - Nq``); ``softmax_scale`` defaults to ``1/sqrt(d)``.  Each gradient comes in
    its input's shape and dtype; ``dk`` and ``dv`` are summed over each GQA group.

    ``P`` is recomputed from ``lse`` (see :mod:`numba_flash.kernels.backward`).  dQ is summed over
    K/V blocks with atomic adds by default; ``deterministic=True`` computes it in a second kernel
    without atomics, so two runs give bitwise identical gradients (a little slower).

    Dropout: pass the forward's ``dropout_p`` (a real in ``[0, 1)``) and ``seed`` (an integer in
    ``[0, 2**64)``), and its dropped ``o``; the kernels redraw the forward's keep-mask
    (:func:`numba_flash.dropout_mask`) from the seed and differentiate through
    ``keep / (1 - dropout_p)``.  ``dropout_p = 0`` runs exactly the kernels without dropout.

    NumPy in, NumPy out; CuPy in, CuPy out (GPU backend).
    """
    b, h, hkv, nq, nk, d, dtype = check_qkv(q, k, v)
    do_shape, do_dtype = check_array("do", do, 4)
    o_shape, o_dtype = check_array("o", o, 4)
    check_same_dtype({"q": dtype, "do": do_dtype, "o": o_dtype})
    for name, shape in (("do", do_shape), ("o", o_shape)):
        if shape != (b, h, nq, d):
            raise ValueError(f"{name}: expected the shape of q {(b, h, nq, d)}, got {shape}")
    lse_dtype = acc_dtype(dtype)
    lse_shape, _ = check_array("lse", lse, 3, dtypes=(lse_dtype,))
    if lse_shape != (b, h, nq):
        raise ValueError(f"lse: expected shape {(b, h, nq)} ([B, H, Nq] of q), got {lse_shape}")
    check_same_kind({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    causal = check_bool("causal", causal)
    deterministic = check_bool("deterministic", deterministic)
    scale = check_scale(softmax_scale, d)
    seed_lo, seed_hi, threshold, keep_scale = dropout_params(dropout_p, seed)
    dropout = float(dropout_p) > 0.0  # compile-time: p = 0 runs the plain kernels, bit for bit

    call = ArrayCall({"do": do, "q": q, "k": k, "v": v, "o": o, "lse": lse})
    do_in, q_in, k_in, v_in, o_in, lse_in = (call.input(x) for x in (do, q, k, v, o, lse))
    acc_t = lse_dtype  # float32 accumulation for float16/float32, float64 for float64
    dk = call.empty(k_in.shape, dtype)
    dv = call.empty(v_in.shape, dtype)
    dq = call.empty(q_in.shape, dtype)
    # float32 / float64 accumulate straight into dq; float16 goes through a float32 buffer
    dq_accum = dq if dtype == acc_t else call.empty(q_in.shape, acc_t)
    delta = call.empty((b, h, nq), acc_t)
    scale_c = acc_t.type(scale)
    # the kernels' last argument: () adds no parameter to the plain kernels
    drop_args = (seed_lo, seed_hi, threshold, acc_t.type(keep_scale)) if dropout else ()

    # 1. D = rowsum(dO * O); dq_accum = 0
    t = elem_threads()
    call.launch(preprocess_kernel(t, dtype), (cdiv(nq, t), b, h), (t,),
                o_in, do_in, delta, dq_accum)

    # 2. dK, dV (and dQ by atomics unless deterministic): one block per (K/V tile, b, kv head)
    block_m, block_n, head_dim, threads = default_tiles(d, dtype)
    call.launch(dkdv_kernel(block_m, block_n, head_dim, threads, dtype, dropout),
                (cdiv(nk, block_n), b, hkv), (threads,),
                q_in, k_in, v_in, do_in, lse_in, delta, dq_accum, dk, dv, scale_c,
                int(causal), 0 if deterministic else 1, drop_args)

    # 3. deterministic dQ: one block per (Q tile, b, head), no atomics
    if deterministic:
        call.launch(dq_kernel(block_m, block_n, head_dim, threads, dtype, dropout),
                    (cdiv(nq, block_m), b, h), (threads,),
                    q_in, k_in, v_in, do_in, lse_in, delta, dq_accum, scale_c, int(causal),
                    drop_args)

    # 4. float16: cast the float32 accumulator on the device
    if dq_accum is not dq:
        call.launch(cast_kernel(t, acc_t, dtype), (cdiv(nq * d, t), b, h), (t,),
                    dq_accum, dq)
    return call.result(dq), call.result(dk), call.result(dv)
