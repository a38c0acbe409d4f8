"""The fp8 forward: :func:`numba_flash.forward` with e4m3 ``q``, ``k``, ``v`` (FA3's fp8 API).

``q``, ``k``, ``v``: ``ml_dtypes.float8_e4m3fn`` ``[B, H(kv), N, d]`` (d a multiple of 32, at
most 256; ``v`` as wide as ``k``), their real values the stored ones times FA3's descales
``q_descale``, ``k_descale``, ``v_descale`` (float32 ``[B, Hkv]``, None: 1): the scores are
``(q8 k8^T) q_descale k_descale softmax_scale``, ``o = (P v8) v_descale``.  ``o`` in
``out_dtype`` (``"bfloat16"``, FA3's, or ``"float16"``), ``lse`` float32.  Causal, window,
softcap, ALiBi, GQA, a learnable sink and the user's functions (``score_mod``, ``mask_mod``,
``block_mask``, ``aux_tensors``: :mod:`numba_flash.flex`, the score being the descaled one);
not dropout, ``block_m`` / ``block_n`` (a ``ValueError`` naming each).  The kernels:
``kernel="mma"`` (and ``"auto"``) :mod:`numba_flash.kernels.forward.fp8`
(``mma.sync.m16n8k32`` e4m3, sm_89+; ``P`` packed with an exponent offset so the largest lands
at 256 of e4m3's 448); ``kernel="wgmma"`` :mod:`numba_flash.kernels.forward.wgmma_fp8`
(Hopper's e4m3 ``wgmma``, sm_90a, head dims 64, 128, 256; ``"auto"`` does not choose it until
a GPU record says it is faster).  The
reference: :func:`numba_flash.reference.attention` of :func:`numba_flash.reference.dequantize`'d
inputs times their descales; the story and the error table: docs/fp8.md.

Alignment: the kernels copy ``q`` and ``k`` tiles with 16-byte ``cp.async`` and read ``v`` as
32-bit words, so a GPU faults (``CUDA_ERROR_MISALIGNED_ADDRESS``) on a ``q`` or ``k`` whose data
is not 16-byte aligned or a ``v`` not 4-byte aligned (an offset view of a byte buffer).  Such an
input is first copied into an aligned buffer (:func:`aligned_input`: one copy of that array, on
its own device; the result is the same), and an aligned one is used in place.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from ..backend import on_simulator
from ..frontend import ArrayCall
from ..frontend.empty import into_outs, is_empty, no_key_outputs
from ..frontend.fp8 import E4M3, check_descales, check_fp8_gpu
from ..frontend.validate import check_out, is_c_contiguous
from ..frontend.kernel_args import (check_forward_variant, descale_input, kernel_variant,
                                     user_build)
from ..frontend.sim_time import tiled_work
from ..frontend.validate import (
    BFLOAT16, check_bool, check_dense_options_off, check_qkv, check_scale,
)
from ..frontend.variants import check_sink, check_variants
from ..frontend.kernel_choice import check_wgmma_gpu
from ..kernels.forward.config import WGMMA_FP8_HEAD_DIMS
from ..kernels.forward.fp8 import forward_fp8_config, forward_fp8_kernel
from ..kernels.forward.wgmma_fp8 import forward_wgmma_fp8_config, forward_wgmma_fp8_kernel
from ..kernels.forward.mma import forward_grid
from ..kernels.ptx.address import data_pointer

#: the output types of the fp8 forward (FA3 writes bfloat16)
FP8_OUT_DTYPES = ("bfloat16", "float16")
#: the kernels an fp8 call runs on: ``mma.sync`` (``"auto"``'s) or Hopper's ``wgmma``
FP8_KERNELS = ("auto", "mma", "wgmma")
#: the user's functions (FlexAttention's), taken by both fp8 builds, and their "off"
USER_OPTIONS = {"score_mod": None, "mask_mod": None, "block_mask": None, "aux_tensors": ()}
#: the alignment (bytes) each e4m3 input's data needs: ``q`` and ``k`` are copied into shared
#: memory 16 bytes at a time (``cp.async``), ``v`` is read as 32-bit words
FP8_ALIGN = {"q": 16, "k": 16, "v": 4}


class _Shape(NamedTuple):
    """What :func:`~numba_flash.frontend.kernel_args.check_forward_variant` reads of a call:
    the compute type (float32 for e4m3) and the dims."""

    dtype: np.dtype
    b: int
    h: int
    nq: int
    nk: int



def aligned_input(x, align):
    """``x`` (an e4m3 array's ``uint8`` bytes, NumPy or device) itself when its data and its
    strides (a strided view's rows and heads) are ``align``-byte aligned, else a C-contiguous
    copy that is (NumPy: placed on a 64-byte
    boundary of a fresh buffer, in the simulator, whose kernels read a NumPy input in place; on
    a GPU its device copy is the aligned copy; CuPy: a fresh allocation of its memory pool,
    256-byte aligned; another device array: a fresh ``cuda.device_array``)."""
    if data_pointer(x) % align == 0 and all(s % align == 0 for s in x.strides[:-1]):
        return x
    if isinstance(x, np.ndarray) and not on_simulator():
        return x                    # its device copy is a fresh allocation: aligned
    if isinstance(x, np.ndarray):
        buf = np.empty(x.nbytes + 64, np.uint8)
        at = -buf.__array_interface__["data"][0] % 64
        out = buf[at:at + x.nbytes].view(x.dtype).reshape(x.shape)   # (C order)
        out[...] = x
        return out
    if hasattr(x, "copy"):          # CuPy
        return x.copy()
    from numba import cuda

    out = cuda.device_array(x.shape, x.dtype)
    out.copy_to_device(x)
    return out


def _input_dtypes(qkv_dtype):
    """The dtypes ``q``, ``k``, ``v`` may have: e4m3, and uint8 (its bytes) under
    ``qkv_dtype="fp8_e4m3"`` (:func:`~numba_flash.frontend.fp8.fp8_inputs` checked the value)."""
    return (E4M3,) + ((np.dtype(np.uint8),) if qkv_dtype == "fp8_e4m3" else ())


def _out_dtype(out_dtype):
    """The output element type's name: None -> ``"bfloat16"``; a name or a NumPy dtype in
    :data:`FP8_OUT_DTYPES`, else a ``ValueError`` naming ``out_dtype``."""
    if out_dtype is None:
        return "bfloat16"
    try:
        name = np.dtype(out_dtype).name
    except TypeError:
        name = repr(out_dtype)
    if name not in FP8_OUT_DTYPES:
        raise ValueError(f"out_dtype: expected one of {FP8_OUT_DTYPES} for e4m3 inputs, got "
                         f"{name}")
    return name


def forward_fp8(q, k, v, *, causal, softmax_scale, return_lse, window_size, softcap,
                alibi_slopes, learnable_sink, kernel, q_descale, k_descale, v_descale,
                out_dtype, kv_indices=None, qkv_dtype="auto", out=None, lse_out=None,
                **not_fp8):
    """:func:`numba_flash.forward` on e4m3 inputs (the module docstring); ``not_fp8``: the
    options of :data:`~numba_flash.frontend.validate.DENSE_FORWARD_OPTIONS`, each a
    ``ValueError`` naming it when set; ``out``, ``lse_out``: the caller's arrays for ``o`` and
    ``lse`` (checked), written and returned."""
    out_arr = out   # (out is the output dtype's name below)
    user = {n: not_fp8.pop(n, off) for n, off in USER_OPTIONS.items()}
    check_dense_options_off(not_fp8, "e4m3 inputs (the fp8 forward takes none)")
    if kv_indices is not None:
        raise ValueError("kv_indices: expected None with e4m3 inputs (the token-sparse forward "
                         "takes 16-bit or float32 inputs), got an array")
    if not isinstance(kernel, str) or kernel not in FP8_KERNELS:
        raise ValueError(f"kernel: expected one of {FP8_KERNELS} with e4m3 inputs, got "
                         f"{kernel!r}")
    s = check_qkv(q, k, v, dtypes=_input_dtypes(qkv_dtype), empty=True)
    if s.d % 32 or s.d > 256:
        raise ValueError(f"q: expected a head dim that is a multiple of 32 up to 256 for e4m3 "
                         f"inputs (one m16n8k32 k-step is 32 values), got {s.d}")
    out = _out_dtype(out_dtype)
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    scale = check_scale(softmax_scale, s.d, np.float32)
    var = check_variants(causal, window_size, softcap, alibi_slopes, s.b, s.h, nq=s.nq,
                         nk=s.nk)
    sink = check_sink(learnable_sink, s.h)
    named_descales = {"q_descale": q_descale, "k_descale": k_descale, "v_descale": v_descale}
    descale = check_descales(named_descales, s.b, s.hkv, True, (q, k, v))
    wgmma = kernel == "wgmma"
    variant = check_forward_variant(_Shape(np.dtype(np.float32), s.b, s.h, s.nq, s.nk),
                                    user["score_mod"], user["mask_mod"], user["block_mask"],
                                    user["aux_tensors"])
    if wgmma:
        if s.d not in WGMMA_FP8_HEAD_DIMS:
            raise ValueError(f"q: kernel='wgmma' takes e4m3 head dims {WGMMA_FP8_HEAD_DIMS}, "
                             f"got {s.d}; use kernel='mma'")
        check_wgmma_gpu()
    else:
        check_fp8_gpu("q", "the e4m3 forward (mma.sync.m16n8k32)")
    flags = dict(SOFTCAP=var.softcap > 0.0, ALIBI=var.alibi is not None)
    if variant is not None:
        flags["USER"] = user_build(variant)
    cfg = (forward_wgmma_fp8_config(s.d, out, **flags) if wgmma else
           forward_fp8_config(s.d, out, **flags))
    o_dtype = np.dtype(BFLOAT16 if out == "bfloat16" else out)
    out_arr = check_out("out", out_arr, (s.b, s.h, s.nq, s.d), o_dtype, q, strided=True)
    lse_out = check_out("lse_out", lse_out, (s.b, s.h, s.nq), np.float32, q)
    if is_empty(s.b, s.nq, s.nk):   # after every check: o = 0, lse = -inf or the sink
        o, lse = no_key_outputs({"q": q, "k": k, "v": v}, (s.b, s.h, s.nq, s.d), o_dtype,
                                (s.b, s.h, s.nq), np.float32, sink)
        return into_outs(o, lse, out_arr, lse_out, return_lse)

    # e4m3 travels as its bytes (Numba has no fp8 type); a misaligned view is copied aligned
    # (q, k: 16-byte cp.async copies; v: 32-bit word loads), where a GPU would fault
    q, k, v = (aligned_input(x.view(np.uint8), FP8_ALIGN[n]) for n, x in zip("qkv", (q, k, v)))
    call = ArrayCall({"q": q, "k": k, "v": v}, op="forward_fp8")
    call.reserve({"o": ((s.b, s.h, s.nq, s.d), np.float16), "lse": ((s.b, s.h, s.nq),
                                                                     np.float32)})
    # the bytes as uint16 pairs for the tile copies, uint32 words of V for the transposing fill,
    # V's bytes for the NaN fix-up; views whose last dim is contiguous (flash-attn's [B, N, H,
    # d] memory) are read, and out= written, through their strides (the STRIDED builds)
    dq, dk, dv = (call.input(x, strided=True) for x in (q, k, v))
    o = call.output(out_arr, (s.b, s.h, s.nq, s.d), o_dtype, strided=True)
    if not all(is_c_contiguous(x) for x in (dq, dk, dv, o)):
        cfg = dataclasses.replace(cfg, STRIDED=True)
    lse = call.output(lse_out, (s.b, s.h, s.nq), np.float32)
    va = kernel_variant(call, np.float32, scale, var.left, var.right, var.softcap, var.alibi,
                        variant=variant, sink=sink)
    # V's words: [rows, d / 4] for the mma.sync fill, flat for the warpgroup's (STRIDED: both
    # [B, Hkv, N, d / 4] through its strides)
    strided = cfg.STRIDED
    words = (dv.view(np.uint32) if strided
             else dv.reshape(s.b * s.hkv * s.nk, s.d).view(np.uint32))
    call.launch((forward_wgmma_fp8_kernel if wgmma else forward_fp8_kernel)(cfg),
                forward_grid(s.nq, s.b, s.h, cfg.BLOCK_M),
                (cfg.THREADS,), dq.view(np.uint16), dk.view(np.uint16),
                words.reshape(-1) if wgmma and not strided else words, dv,
                o if strided else o.reshape(-1),
                lse.reshape(-1), descale_input(call, descale, named_descales), va,
                shared=cfg.SMEM_BYTES if wgmma else 0,
                work=tiled_work(call.op, [(s.nq, s.nk)] * s.b, s.h, cfg.BLOCK_M, cfg.BLOCK_N,
                                var.left, var.right, cfg.THREADS, s.d, mma=True))
    o = call.result(o)   # (bfloat16: its uint16 words viewed back)
    return (o, call.result(lse)) if return_lse else o


def forward_varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q, max_seqlen_k,
                       causal, window_size, softcap, alibi_slopes, softmax_scale, return_lse,
                       learnable_sink, kernel, q_descale, k_descale, v_descale, out_dtype,
                       block_table, kv_indices, validate=None, qkv_dtype="auto", **not_fp8):
    """:func:`numba_flash.forward_varlen` on e4m3 ``q [total_q, H, d]``, ``k``, ``v [total_k,
    Hkv, d]`` with FA3's descales per sequence and kv head (``[B, Hkv]``, ``B`` the number of
    sequences): ``o [total_q, H, d]`` in ``out_dtype``, ``lse [H, total_q]`` float32.  Each
    sequence is :func:`forward_fp8` on its rows (one launch a sequence: the fp8 kernels have no
    packed-batch build yet), with its own descales, ALiBi row (``[B, H]`` slopes) and
    bottom-right alignment; a sequence without keys gives ``o = 0``, ``lse = -inf`` (or its
    sink's logit).  Paged (``block_table``, the prefill over an e4m3 cache ``[num_blocks, Hkv,
    block_size, d]``): a sequence's keys are gathered from its table row (``k[table[b, :n]]``,
    the entries checked on the host first, whatever ``validate`` says: the gather reads through
    them) and run as above.  Not token-sparse (``kv_indices``), nor the options of
    :data:`~numba_flash.frontend.validate.DENSE_FORWARD_OPTIONS` (a ``ValueError`` naming
    each)."""
    from ..frontend.arrays import host_ints
    from ..frontend.cache_args import (
        check_prefill_table, cumulative_total, validate_prefill_table,
    )
    from ..frontend.validate import array_module, check_array
    from ..frontend.variants import check_cu_seqlens_pair

    check_dense_options_off(not_fp8, "e4m3 inputs (the fp8 forward takes none)")
    if kv_indices is not None:
        raise ValueError("kv_indices: expected None with e4m3 inputs (the token-sparse forward "
                         "takes 16-bit or float32 inputs), got an array")
    if validate is not None:
        check_bool("validate", validate)
    paged = block_table is not None
    dtypes = _input_dtypes(qkv_dtype)
    (total_q, h, d), _ = check_array("q", q, 3, dtypes)
    if paged:   # caches [num_blocks, Hkv, block_size, d]; cu_seqlens_k counts keys
        (n_blocks, hkv, block_size, _dk), _ = check_array("k", k, 4, dtypes)
        want_v = (n_blocks, hkv, block_size, _dk)
        total_k = cumulative_total("cu_seqlens_k", cu_seqlens_k)
    else:
        (total_k, hkv, _dk), _ = check_array("k", k, 3, dtypes)
        want_v = (total_k, hkv, _dk)
    vs, _ = check_array("v", v, len(want_v), dtypes)
    if tuple(vs) != want_v:
        raise ValueError(f"v: expected shape {want_v} (k's), got {tuple(vs)}")
    cu_q, len_q, cu_k, len_k = check_cu_seqlens_pair(cu_seqlens_q, cu_seqlens_k, total_q,
                                                     total_k, max_seqlen_q, max_seqlen_k)
    b = len(len_q)
    if paged:
        check_prefill_table(block_table, b)
        table = host_ints(block_table)
        validate_prefill_table(table, len_k, block_size, n_blocks)
    descale = check_descales({"q_descale": q_descale, "k_descale": k_descale,
                              "v_descale": v_descale}, b, hkv, True, (q, k, v))
    out = _out_dtype(out_dtype)
    xp = array_module(q)   # (CuPy inputs: the slopes and the sink may be CuPy arrays too)
    alibi = None if alibi_slopes is None else xp.asarray(alibi_slopes)
    if alibi is not None and alibi.ndim == 2 and alibi.shape[0] != b:
        raise ValueError(f"alibi_slopes: expected shape ({h},) or ({b}, {h}) = [B, H] (B the "
                         f"number of sequences), got {alibi.shape}")
    o = xp.zeros((total_q, h, d), np.dtype(BFLOAT16 if out == "bfloat16" else out))
    lse = xp.full((h, total_q), -np.inf, np.float32)
    if learnable_sink is not None:   # a sequence without keys: the sink's logit
        lse[:] = xp.asarray(learnable_sink, dtype=np.float32)[:, None]
    def per_seq(x, lo, hi):   # rows [lo, hi) of a packed array as [1, H, n, d]
        return xp.ascontiguousarray(x[lo:hi].transpose(1, 0, 2)[None])

    def gathered(cache, i, n):   # sequence i's n keys through its table row: [1, Hkv, n, d]
        pages = xp.asarray(table[i, :-(-n // block_size)].astype(np.int64))
        rows = cache[pages].transpose(1, 0, 2, 3).reshape(hkv, -1, _dk)
        return xp.ascontiguousarray(rows[None, :, :n])

    for i in range(b):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0 or k1 == k0:
            continue
        slopes = alibi[i] if alibi is not None and alibi.ndim == 2 else alibi
        ki, vi = ((gathered(k, i, k1 - k0), gathered(v, i, k1 - k0)) if paged else
                  (per_seq(k, k0, k1), per_seq(v, k0, k1)))
        oi, li = forward_fp8(per_seq(q, q0, q1), ki, vi,
                             causal=causal, softmax_scale=softmax_scale, return_lse=True,
                             window_size=window_size, softcap=softcap, alibi_slopes=slopes,
                             learnable_sink=learnable_sink, kernel=kernel,
                             q_descale=descale[0, i:i + 1], k_descale=descale[1, i:i + 1],
                             v_descale=descale[2, i:i + 1], out_dtype=out, qkv_dtype=qkv_dtype)
        o[q0:q1] = oi[0].transpose(1, 0, 2)
        lse[:, q0:q1] = li[0]
    return (o, lse) if return_lse else o
