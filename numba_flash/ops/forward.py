"""``numba_flash.forward``: the FlashAttention forward (tiled, online softmax, causal, sliding
window, softcap, ALiBi, GQA, dropout) and the choice between the SIMT and tensor-core kernels."""

from __future__ import annotations

import importlib

from ..frontend import ArrayCall
from ..frontend.validate import is_c_contiguous
from ..frontend.plans import plan_key, run_or_build
from ..frontend.kernel_args import (
    check_forward_args, check_forward_variant, forward_variant, user_build,
)
from ..frontend.sim_time import tiled_work
from ..frontend.validate import check_tile
from ..kernels.core.common import acc_dtype, cdiv
from ..kernels.forward.simt import forward_grid, forward_kernel
from ..kernels.forward.config import (
    choose_tiles, explicit_tiles, forward_simt_config, vector_tiles,
)
from ..frontend.kernel_choice import KERNELS, choose_forward_kernel  # noqa: F401  (KERNELS)
from ..frontend.sparse import sparse_forward
from ..frontend.fp8 import fp8_inputs
from ..frontend.empty import into_outs, is_empty, no_key_outputs


def _tensor_core_launch(choice):
    """The chosen tensor-core forward's launch (``launch_forward_mma`` or
    ``launch_forward_wgmma`` of its op module, which take already validated
    :class:`ForwardArgs`)."""
    return choice.launcher()


def _no_key_answer(q, k, v, args):
    """:func:`forward` of an empty batch, query block or key set (``B``, ``Nq`` or ``Nk`` 0,
    every argument checked): ``o = 0`` and ``lse = -inf`` (or the sink's logit) without a
    launch (:mod:`numba_flash.frontend.empty`)."""
    o, lse = no_key_outputs({"q": q, "k": k, "v": v}, (args.b, args.h, args.nq, args.d_v),
                            args.dtype, (args.b, args.h, args.nq), acc_dtype(args.dtype),
                            args.sink)
    return into_outs(o, lse, args.out, args.lse_out, args.return_lse)


def forward(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, block_m=None,
            block_n=None, dropout_p=0.0, seed=0, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, kernel="auto", score_mod=None, mask_mod=None, block_mask=None,
            aux_tensors=(), learnable_sink=None, kv_indices=None, q_descale=None,
            k_descale=None, v_descale=None, out_dtype=None, qkv_dtype="auto", out=None,
            lse_out=None):
    """Attention forward: ``o``, or ``(o, lse)`` with ``return_lse=True``.

    ``q`` is ``[B, H, Nq, d]``, ``k`` and ``v`` are ``[B, Hkv, Nk, d]`` with ``H`` a multiple of
    ``Hkv`` (query head ``h`` reads kv head ``h // (H // Hkv)``: GQA / MQA), ``d`` in 1..256.
    Same contract as :func:`numba_flash.reference.attention`: ``S = softmax_scale * Q K^T``
    (default ``1/sqrt(d)``).

    Which keys a query sees (flash-attn's conventions,
    :mod:`numba_flash.kernels.mainloop.visibility`): query ``i`` sits at key column ``c = i + Nk -
    Nq`` (bottom-right alignment) and sees key ``j`` iff ``c - left <= j <= c + right`` for
    ``window_size = (left, right)`` (``-1``: unbounded on that side); ``causal=True`` means ``right
    = 0``.  A row that sees no key gets ``o = 0``, ``lse = -inf``.  ``softcap > 0`` replaces each
    scaled score ``s`` by ``softcap * tanh(s / softcap)``; ``alibi_slopes`` (float32 ``[H]`` or
    ``[B, H]``) then subtracts ``slope
    * |c - j|``.  K/V tiles wholly outside the visible band are never read, so windowed
    attention costs ``O(Nq * window)``.

    Non-finite inputs (as torch SDPA): a NaN or inf in a query row, or in a key the row sees,
    makes that row's ``o`` and ``lse`` NaN; a non-finite ``v[j, c]`` of a visible key makes
    ``o[i, c]`` non-finite; a key the row does not see never affects it, whatever it holds.

    ``o`` has the input dtype; ``lse [B, H, Nq]`` (natural log) is float32, or float64 for
    float64 inputs.  float16 and bfloat16 (``ml_dtypes.bfloat16``) compute in float32, float64
    in float64.  ``block_m`` / ``block_n``
    pick other compiled SIMT tile shapes (see
    :func:`numba_flash.kernels.forward.config.explicit_tiles`); ``None`` takes the backend's
    default. NumPy in, NumPy out; CuPy in, CuPy out (GPU backend); bfloat16 in, bfloat16 out.

    ``dropout_p`` in ``[0, 1)`` drops each attention probability with that probability and
    scales the kept ones by ``1 / (1 - dropout_p)``: ``o = (P * keep / (1 - p)) V``, while ``lse``
    is that of the undropped ``P``.  The keep-mask is drawn in the kernel from ``seed`` (an
    integer in ``[0, 2**64)``) and is exactly ``numba_flash.dropout_mask(seed, B, H, Nq, Nk,
    dropout_p)`` (``h`` the query head), whatever the tiles; the same seed gives the same
    output.  ``dropout_p = 0`` runs the plain kernel (no random numbers drawn).

    ``kernel``: ``"simt"`` (the FMA kernel of :mod:`numba_flash.kernels.forward.simt`, every dtype),
    ``"mma"`` (tensor cores, float16 and bfloat16: :func:`numba_flash.ops.forward_mma.forward_mma`)
    or ``"auto"``: ``"mma"`` for float16 / bfloat16 on a GPU of compute capability >= 8.0
    without explicit
    ``block_m`` / ``block_n``, ``"simt"`` otherwise.  ``"wgmma"``: Hopper's warpgroup forward
    (:mod:`numba_flash.ops.forward_wgmma`; float16 / bfloat16, ``d`` <= 128, compute
    capability 9.0 or the simulator; ``"auto"`` does not take it while its GPU speed is
    unmeasured).

    Your own variant (FlexAttention's functions, :mod:`numba_flash.flex`; both kernel
    families, every dtype):

    * ``mask_mod(b, h, q_idx, kv_idx, *aux_tensors) -> bool``: True where query ``q_idx`` sees
      key ``kv_idx`` (positions from 0), and-ed with ``causal`` / ``window_size``;
    * ``score_mod(score, b, h, q_idx, kv_idx, *aux_tensors) -> float``: the score the softmax
      uses, from the score after scale, softcap and ALiBi;
    * ``block_mask``: a :class:`numba_flash.flex.BlockMask` of ``mask_mod`` from
      :func:`numba_flash.flex.create_block_mask`: tiles it calls EMPTY are never loaded, FULL
      ones skip ``mask_mod``;
    * ``aux_tensors``: a tuple of arrays the functions read (moved to the inputs' device).

    The functions are plain Python, compiled by Numba for the device (run as Python, thread by
    thread, in the simulator); :func:`numba_flash.reference.attention` takes the same ones.

    ``learnable_sink`` (float32 ``[H]``, gpt-oss's attention sinks, flash-attn 4's
    ``learnable_sink``): one logit per query head that joins every row's softmax denominator as
    a key with no value: ``o_i = sum_j e^{s_ij} v_j / (e^{sink_h} + sum_j e^{s_ij})``, ``lse_i =
    log(e^{sink_h} + sum_j e^{s_ij})``; a row that sees no key gets ``o = 0``, ``lse =
    sink_h``.  Both kernel families, every variant (the sink is added once, in the epilogue).

    ``kv_indices`` (token-sparse attention, DeepSeek V3.2's DSA, FA4's ``gather_kv_indices``):
    integer ``[B, Hkv or 1, Nq, topk]``, query token ``i`` sees only the keys
    ``kv_indices[b, kvh or 0, i]`` lists (``-1``: none; each key at most once per list, entries
    in ``[-1, Nk)``: a ``ValueError`` naming ``kv_indices``), and-ed with ``causal``, the window,
    softcap, ALiBi and the sink.  Runs the gathering decode kernels
    (:func:`numba_flash.frontend.sparse.sparse_forward`: ``O(Nq * topk)`` work; ``kernel``
    ``"auto"``, ``"simt"`` or ``"mma"``: the tensor-core gather of 32 listed K / V rows (16 past
    head dims 128) into shared memory, float16 / bfloat16 with head dims multiples of 64, no
    softcap or ALiBi; ``"auto"`` takes it with at least 8 query heads a kv head); not with
    dropout, ``block_m`` / ``block_n`` or the user's functions.
    The reference: :func:`numba_flash.reference.sparse_attention`.

    fp8 (FA3's API): e4m3 ``q``, ``k``, ``v`` (``ml_dtypes.float8_e4m3fn``, ``d`` a multiple of
    32 up to 256) with ``q_descale``, ``k_descale``, ``v_descale`` (float32 ``[B, Hkv]``, None:
    1) and ``out_dtype`` (``"bfloat16"``, the default, or ``"float16"``): the scores are ``(q8
    k8^T) q_descale k_descale softmax_scale``, ``o = P v8 v_descale``; causal, window, softcap,
    ALiBi, GQA, sinks and the user's functions (:mod:`numba_flash.ops.forward_fp8`:
    ``mma.sync.m16n8k32``, sm_89+; ``kernel="wgmma"``: Hopper's e4m3 warpgroup build, sm_90a,
    d = 64, 128, 256).  ``qkv_dtype="fp8_e4m3"`` (default ``"auto"``: the arrays' own dtype):
    uint8 ``q``, ``k``, ``v`` read as e4m3 bytes, the form a CuPy array (no fp8 dtype) or a
    CUDA ``torch.float8_e4m3fn`` tensor's bytes carry them in; the descales may then be device
    arrays too.

    Empty batches (:mod:`numba_flash.frontend.empty`): ``B``, ``Nq`` or ``Nk`` 0 is answered
    after every check, without a launch, on every route (e4m3 inputs too): ``o = 0`` and ``lse =
    -inf`` (``sink_h`` with a learnable sink) in the shapes and dtypes above (flash-attn fills
    ``lse`` with ``+inf`` there); ``H = 0`` or ``d = 0`` is a ``ValueError``.

    ``out``: an array of ``o``'s shape and dtype (of the inputs' kind) that ``o`` is written
    into and returned as: C-contiguous, or a view whose last dim is contiguous and whose
    elements do not overlap (flash-attn's ``[B, Nq, H, d]`` memory as its ``transpose(0, 2, 1,
    3)``: every dense forward, 16-bit, float32, float64 and e4m3, writes it through its
    strides); ``lse_out``: the same for ``lse``, C-contiguous (written, and returned with
    ``return_lse``).  ``q``, ``k``, ``v``: views whose last dim is contiguous (flash-attn's
    memory, a fused projection's slices) are read where they lie by the same kernels
    (docs/tensor-cores.md, strided views).  The token-sparse forward (``kv_indices``) hands
    ``q`` and ``out`` to :func:`numba_flash.decode` as they are (its kernels read and write
    them through their strides, see there), and ``k``, ``v`` as caches read in their memory
    order (``[B, Nk, Hkv, d]`` memory where it lies; rows with gaps between them, a fused
    projection's slices, are copied).

    Device arrays (CuPy): the call runs on the current stream and returns before the GPU
    finishes (no synchronisation, no host copy).  A call of a signature seen before (shapes,
    strides, dtypes, address alignment, options, stream) replays its launch plan
    (:mod:`numba_flash.frontend.plans`): no checks or configuration again, only the results
    allocated (nothing with ``out``) and the launches made; dropout and a ``block_mask`` run
    the ordinary path every call.  A device array's values (ALiBi slopes, sink logits) are not
    read on the host (that would wait for the GPU): a NaN or inf slope or logit there gives NaN
    rows instead of the ``ValueError`` a host array gets.
    """
    kw = dict(causal=causal, softmax_scale=softmax_scale, return_lse=return_lse,
              block_m=block_m, block_n=block_n, dropout_p=dropout_p, seed=seed,
              window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
              kernel=kernel, score_mod=score_mod, mask_mod=mask_mod, block_mask=block_mask,
              aux_tensors=aux_tensors, learnable_sink=learnable_sink, kv_indices=kv_indices,
              q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
              out_dtype=out_dtype, qkv_dtype=qkv_dtype, out=out, lse_out=lse_out)
    if dropout_p == 0.0 and block_mask is None and type(aux_tensors) is tuple:
        arrays = (q, k, v, alibi_slopes, learnable_sink, q_descale, k_descale, v_descale,
                  kv_indices, out, lse_out) + aux_tensors
        key = plan_key("forward", arrays, (causal, softmax_scale, return_lse, block_m,
                                           block_n, window_size, softcap, kernel, score_mod,
                                           mask_mod, out_dtype, qkv_dtype))
        if key is not None:
            return run_or_build(key, _forward, arrays, q, k, v, **kw)
    return _forward(q, k, v, **kw)


def _forward(q, k, v, *, causal, softmax_scale, return_lse, block_m, block_n, dropout_p, seed,
             window_size, softcap, alibi_slopes, kernel, score_mod, mask_mod, block_mask,
             aux_tensors, learnable_sink, kv_indices, q_descale, k_descale, v_descale,
             out_dtype, qkv_dtype, out, lse_out):
    """:func:`forward`'s checks and launches (its ordinary path, and what a plan records)."""
    if fp8_inputs({"q": q, "k": k, "v": v}, qkv_dtype):
        # the fp8 op imported by name, as the kernel choice imports the tensor-core ops: the
        # front end routes between ops, no op imports another
        forward_fp8 = importlib.import_module("numba_flash.ops.forward_fp8").forward_fp8
        return forward_fp8(q, k, v, causal=causal, softmax_scale=softmax_scale,
                           return_lse=return_lse, window_size=window_size, softcap=softcap,
                           alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                           kernel=kernel, q_descale=q_descale, k_descale=k_descale,
                           v_descale=v_descale, out_dtype=out_dtype, qkv_dtype=qkv_dtype,
                           dropout_p=dropout_p,
                           block_m=block_m, block_n=block_n, score_mod=score_mod,
                           mask_mod=mask_mod, block_mask=block_mask, aux_tensors=aux_tensors,
                           kv_indices=kv_indices, out=out, lse_out=lse_out)
    for name, x in (("q_descale", q_descale), ("k_descale", k_descale),
                    ("v_descale", v_descale), ("out_dtype", out_dtype)):
        if x is not None:
            raise ValueError(f"{name}: expected None without e4m3 inputs (FA3's fp8 API), got "
                             f"{x!r}")
    if kv_indices is not None:
        return sparse_forward(q, k, v, kv_indices, causal=causal, softmax_scale=softmax_scale,
                              return_lse=return_lse, window_size=window_size, softcap=softcap,
                              alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
                              kernel=kernel, dropout_p=dropout_p, block_m=block_m,
                              block_n=block_n, score_mod=score_mod, mask_mod=mask_mod,
                              block_mask=block_mask, aux_tensors=aux_tensors, out=out,
                              lse_out=lse_out)
    args = check_forward_args(q, k, v, causal, softmax_scale, return_lse, dropout_p, seed,
                              window_size, softcap, alibi_slopes, learnable_sink, empty=True,
                              out=out, lse_out=lse_out)
    b, h, nq, d, dtype = args.b, args.h, args.nq, args.d, args.dtype
    left, right, softcap, alibi = args.left, args.right, args.softcap, args.alibi
    variant = check_forward_variant(args, score_mod, mask_mod, block_mask, aux_tensors)
    choice = choose_forward_kernel(kernel, dtype, block_m is not None or block_n is not None)
    d_v = args.d_v
    empty = is_empty(b, nq, args.nk)   # answered after the checks, without a launch
    if choice.kernel != "simt":  # hands on the validated arguments: nothing checked twice
        if empty:
            return _no_key_answer(q, k, v, args)
        return _tensor_core_launch(choice)(q, k, v, args, variant)
    use_dropout = args.dropout_p > 0.0  # dropout_p = 0: the plain kernel, nothing drawn
    # a user's variant rides on the score-modifier build (softcap / ALiBi switched at run time)
    use_mods = softcap > 0.0 or alibi is not None or variant is not None
    d_tile = max(d, d_v)  # one HEAD_DIM holds both (each array read at its own width)
    allowed = explicit_tiles(d_tile, dtype, mods=use_mods)
    block_m = check_tile("block_m", block_m, {bm for bm, _ in allowed})
    block_n = check_tile("block_n", block_n, {bn for _, bn in allowed})
    tiles = choose_tiles(d_tile, dtype, block_m, block_n, mods=use_mods)
    if empty:
        return _no_key_answer(q, k, v, args)
    acc_t = acc_dtype(dtype)  # lse and scalars in the compute type: no float64 in f32 kernels

    call = ArrayCall({"q": q, "k": k, "v": v})
    call.reserve({"o": ((b, h, nq, d_v), dtype), "lse": ((b, h, nq), acc_t)}, strided=True)
    # views whose last dim is contiguous are read (and out= written) through their strides
    dq, dk, dv = (call.input(x, strided=True) for x in (q, k, v))
    o = call.output(args.out, (b, h, nq, d_v), dtype, strided=True)
    strided = not all(is_c_contiguous(x) for x in (dq, dk, dv, o))
    vec = (vector_tiles(dtype, d, tiles[2], dq, dk, dv)       # cp.async copies
           and vector_tiles(dtype, d_v, tiles[2]))
    cfg = forward_simt_config(d_tile, dtype, use_dropout, use_mods, tiles=tiles, vec=vec,
                              user=user_build(variant), own_v=d_v != d, strided=strided)
    lse = call.output(args.lse_out, (b, h, nq), acc_t)
    block = (cfg.THREADS_N, cfg.THREADS_M)
    work = tiled_work("forward", [(nq, args.nk)] * b, h, cfg.BLOCK_M, cfg.BLOCK_N, left, right,
                      cfg.THREADS, cfg.HEAD_DIM)
    call.launch(forward_kernel(cfg), forward_grid(cdiv(nq, cfg.BLOCK_M), b * h), block, dq, dk,
                dv, o if strided else o.reshape(-1), lse.reshape(-1),
                forward_variant(call, args, variant, acc_t, (b, h) if use_mods else (1, 1)),
                (), work=work)
    if args.return_lse:
        return call.result(o), call.result(lse)
    return call.result(o)
