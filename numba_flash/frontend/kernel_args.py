"""What every op passes its kernels besides the arrays: the validated forward and backward
arguments (:class:`ForwardArgs`, :class:`BackwardArgs`), a user's variant as the kernels build
and read it (``user_build``, :func:`user_arrays`), the kernels'
:class:`~numba_flash.kernels.core.variant.Variant` of a call (:func:`kernel_variant`), and the
tensor-core forwards' launch.  Shared by the ops in :mod:`numba_flash.ops`, none of which
imports another op for them.
"""

from __future__ import annotations

from typing import NamedTuple

from collections import namedtuple
import numpy as np

from ..backend import on_simulator
from ..kernels.core.common import acc_dtype
from ..kernels.core.variant import Variant
from ..philox import dropout_params
from .sim_time import tiled_work
from .validate import check_backward_arrays, check_bool, check_out, check_qkv, check_scale
from .variants import check_sink, check_variants


class ForwardArgs(NamedTuple):
    """The forward's arguments, validated once (:func:`check_forward_args`), as the launch code
    of both kernel families takes them."""

    b: int
    h: int
    nq: int
    nk: int
    d: int
    dtype: np.dtype
    causal: bool
    return_lse: bool
    scale: float
    dropout_p: float
    #: ``(seed_lo, seed_hi, threshold, keep_scale)`` of :func:`numba_flash.philox.dropout_params`
    dropout: tuple
    window: tuple
    left: int
    right: int
    softcap: float
    #: float32 ``[B, H]`` of the inputs' kind, or None
    alibi: object
    #: float32 ``[H]`` learnable sink logits of the inputs' kind, or None
    sink: object = None
    #: the value head dim (``v``'s and ``o``'s last dim): ``d`` unless ``v`` has its own
    d_v: int = 0
    #: the caller's ``out=`` (checked), or None
    out: object = None
    #: the caller's ``lse_out=`` (checked), or None
    lse_out: object = None


def check_forward_args(q, k, v, causal, softmax_scale, return_lse, dropout_p, seed, window_size,
                       softcap, alibi_slopes, learnable_sink=None, empty=False, out=None,
                       lse_out=None):
    """Check every argument :func:`forward` and :func:`~numba_flash.ops.forward_mma.forward_mma`
    share (raising before any launch) and return them as a :class:`ForwardArgs`.  ``empty``:
    ``B``, ``Nq``, ``Nk`` may be 0 (:func:`numba_flash.forward` answers those without a launch,
    :mod:`numba_flash.frontend.empty`)."""
    qkv = check_qkv(q, k, v, value_dim=True, empty=empty)
    b, h, nq, nk = qkv.b, qkv.h, qkv.nq, qkv.nk
    d, dtype = qkv.d, qkv.dtype
    causal = check_bool("causal", causal)
    return_lse = check_bool("return_lse", return_lse)
    scale = check_scale(softmax_scale, d, dtype)
    dropout = dropout_params(dropout_p, seed)
    var = check_variants(causal, window_size, softcap, alibi_slopes, b, h, nq=nq, nk=nk)
    out = check_out("out", out, (b, h, nq, qkv.d_v), dtype, q, strided=True)
    lse_out = check_out("lse_out", lse_out, (b, h, nq), acc_dtype(dtype), q)
    return ForwardArgs(b, h, nq, nk, d, np.dtype(dtype), causal, return_lse, scale,
                       float(dropout_p), dropout, var.window, var.left, var.right, var.softcap,
                       var.alibi, check_sink(learnable_sink, h), qkv.d_v, out, lse_out)


def check_forward_variant(args, score_mod, mask_mod, block_mask, aux_tensors):
    """A user's variant of the forward (:func:`numba_flash.flex.launch.prepare_variant`),
    checked before any launch against the validated ``args``; None without one."""
    if score_mod is None and mask_mod is None and block_mask is None and not aux_tensors:
        return None
    from ..flex.launch import prepare_variant
    return prepare_variant(score_mod, mask_mod, aux_tensors, block_mask,
                           compute_dtype=acc_dtype(args.dtype),
                           shape=(args.b, args.h, args.nq, args.nk))


def user_build(variant):
    """A kernel factory's ``USER``: ``(score_mod, mask_mod, BLOCKS)`` device code, or None."""
    if variant is None:
        return None
    return (variant.score_mod, variant.mask_mod, variant.block)


def user_arrays(call, variant):
    """``(kinds,) + aux`` on the inputs' device (kinds: the block mask's classification, or a
    dummy a build without one never reads), or ``()`` without a variant."""
    if variant is None:
        return ()
    kinds = (call.input(variant.kinds) if variant.kinds is not None
             else device_constant(call, "no_kinds", np.ones((1, 1, 1, 1), np.int8)))
    return (kinds,) + tuple(call.input(a) for a in variant.aux)


def kernel_variant(call, acc_t, scale, left, right, softcap=0.0, alibi=None, bh=(1, 1),
                   dropout=None, variant=None, sink=None):
    """The kernels' :class:`~numba_flash.kernels.core.variant.Variant` of a validated call, on the
    inputs' device, scalars in the compute type ``acc_t``: ``alibi`` float32 ``[B, H]`` or None
    (then zeros of shape ``bh``: ``(B, H)`` for a build that reads slopes, the score-modifier
    SIMT build); ``dropout``: the ``(seed_lo, seed_hi, threshold, keep_scale)`` of
    :func:`numba_flash.philox.dropout_params` when dropout is on, else None; ``variant``: a
    user's (:func:`check_forward_variant`) or None; ``sink``: float32 ``[H]`` learnable sink
    logits or None (then ``[-inf]``: none)."""
    acc_t = np.dtype(acc_t).type
    softcap = float(softcap)
    slopes = (call.input(alibi) if alibi is not None
              else device_constant(call, ("no_slopes", tuple(bh)), np.zeros(bh, np.float32)))
    drop = () if dropout is None else (*dropout[:3], acc_t(dropout[3]))
    return Variant(acc_t(scale), (np.int32(left), np.int32(right)), acc_t(softcap),
                   acc_t(1.0 / softcap if softcap > 0.0 else 0.0), slopes, drop,
                   user_arrays(call, variant), no_sink(call) if sink is None else call.input(sink))


#: the ``[-inf]`` of no sink on a GPU, one per (array library, device), made by the first call:
#: later calls allocate and copy nothing for it, so a CUDA graph captures no transfer of it and
#: its replays read a buffer that stays alive
_CONSTANTS = {}


def device_constant(call, name, value):
    """The host array ``value`` on the call's device, copied once per (name, library, device):
    the same pointer every call, so a captured CUDA graph replays it, and a launch plan records
    it as a constant (:mod:`numba_flash.frontend.plans`).  NumPy calls in the simulator: a
    view of ``value``."""
    if not call.on_device:
        if on_simulator():
            return call.input(value)
        from numba import cuda

        key = (name, None, cuda.get_current_device().id)
    else:
        key = (name, id(call.xp), call.device_id or 0)
    fresh = key not in _CONSTANTS
    if fresh:
        if call.on_device:
            with call.device():
                _CONSTANTS[key] = call.xp.asarray(value)
        else:
            _CONSTANTS[key] = call.input(value)
    arr = _CONSTANTS[key]
    if call.trace is not None:
        call.trace.constant(arr, fresh)
    return arr


def descale_input(call, descale, named):
    """The kernels' ``[n, B, Hkv]`` descales (:func:`~numba_flash.frontend.fp8.check_descales`)
    on the call's device: with none given (``named``'s values all None: ones) a device constant
    (the same memory every call: a launch plan replays it, no copy), else the array itself
    (copied in when it was made on the host)."""
    if all(x is None for x in named.values()):
        return device_constant(call, ("unit_descale",) + tuple(descale.shape), descale)
    return call.input(descale)


def no_sink(call):
    """:class:`~numba_flash.kernels.core.variant.Variant`'s ``sink`` without one: ``[-inf]``."""
    return device_constant(call, "no_sink", np.full(1, -np.inf, np.float32))


def no_descale(call):
    """The decode kernel's ``kv_descale`` without an e4m3 cache: ``[2, 1, 1]`` ones (unread)."""
    return device_constant(call, "no_descale", np.ones((2, 1, 1), np.float32))


def no_indices(call):
    """The decode kernel's ``kv_indices`` without an index list: ``[1, 1, 1, 1]`` (unread)."""
    return device_constant(call, "no_indices", np.zeros((1, 1, 1, 1), np.int32))


def forward_variant(call, args, variant, acc_t, bh=(1, 1)):
    """:func:`kernel_variant` of a :class:`ForwardArgs`."""
    return kernel_variant(call, acc_t, args.scale, args.left, args.right, args.softcap,
                          args.alibi, bh, args.dropout if args.dropout_p > 0.0 else None,
                          variant, args.sink)


def launch_tensor_core(call, args, variant, kernel, grid, cfg, words, d_v, shared=0, o=None):
    """Launch a tensor-core forward build (``mma.sync`` or warpgroup) on ``words`` (q, k, v as
    uint16 words) and return ``o`` ``[B, H, Nq, d_v]`` (and ``lse``, with ``return_lse``):
    the given ``o`` (:meth:`ArrayCall.output`'s), else one made here; a ``STRIDED`` build
    takes the 4-D ``o`` with its strides."""
    if o is None:   # (a strided out=: this build writes a new o, copied into it)
        o = call.output(args.out, (args.b, args.h, args.nq, d_v), args.dtype, strided=False)
    lse = call.output(args.lse_out, (args.b, args.h, args.nq), np.float32)
    strided = getattr(cfg, "STRIDED", False)
    call.launch(kernel, grid, (cfg.THREADS,), *words, o if strided else o.reshape(-1),
                lse.reshape(-1),
                forward_variant(call, args, variant, np.float32), shared=shared,
                work=tiled_work(call.op, [(args.nq, args.nk)] * args.b, args.h, cfg.BLOCK_M,
                                cfg.BLOCK_N, args.left, args.right, cfg.THREADS, cfg.HEAD_DIM,
                                mma=True))
    if args.return_lse:
        return call.result(o), call.result(lse)
    return call.result(o)


#: The dense backward's dims ``(B, H, Hkv, Nq, Nk, d)`` (:attr:`BackwardArgs.shape`).
BackwardShape = namedtuple("BackwardShape", "b h hkv nq nk d")


class BackwardArgs(NamedTuple):
    """The dense backward's arguments, checked once (:func:`check_backward_args`)."""

    b: int
    h: int
    hkv: int
    nq: int
    nk: int
    d: int
    dtype: np.dtype
    causal: bool
    deterministic: bool
    scale: float
    #: the kernels' window bounds (:func:`numba_flash.frontend.variants.check_variants`)
    left: int
    right: int
    softcap: float
    #: float32 ``[B, H]`` of the inputs' kind, or None
    alibi: object
    #: a user's variant (:func:`numba_flash.flex.launch.prepare_variant`), or None
    variant: object
    #: the value head dim (``v``, ``o``, ``do``, ``dv``): ``d`` unless ``v`` has its own
    d_v: int = 0

    @property
    def shape(self):
        """A :class:`BackwardShape` ``(B, H, Hkv, Nq, Nk, d)``."""
        return BackwardShape(self.b, self.h, self.hkv, self.nq, self.nk, self.d)


def check_backward_args(do, q, k, v, o, lse, causal, softmax_scale, deterministic, dropout_p,
                        seed, window_size, softcap, alibi_slopes, score_mod, mask_mod,
                        score_mod_grad, block_mask, aux_tensors, check_dtype=None, empty=False):
    """Check every argument :func:`backward` and
    :func:`~numba_flash.ops.backward_mma.backward_mma` share (raising before any launch), in
    one order: the arrays, then ``check_dtype(dtype)`` when given, the flags, the scale,
    ``dropout_p`` and ``seed``, the built-in variants, the user's variant; return them as a
    :class:`BackwardArgs`.  ``empty``: ``B``, ``Nq``, ``Nk`` may be 0 (:func:`numba_flash.backward`
    answers those with zero gradients, :mod:`numba_flash.frontend.empty`)."""
    qkv = check_backward_arrays(do, q, k, v, o, lse, value_dim=True, empty=empty)
    b, h, nq, nk = qkv.b, qkv.h, qkv.nq, qkv.nk
    d, dtype = qkv.d, qkv.dtype
    if check_dtype is not None:
        check_dtype(dtype)
    causal = check_bool("causal", causal)
    deterministic = check_bool("deterministic", deterministic)
    scale = check_scale(softmax_scale, d, dtype)
    dropout_params(dropout_p, seed)  # checks dropout_p and seed
    var = check_variants(causal, window_size, softcap, alibi_slopes, b, h, nq=nq, nk=nk)
    # the one check of the user's arguments: None = no variant (and none of them given)
    from ..flex.launch import prepare_variant

    variant = prepare_variant(score_mod, mask_mod, aux_tensors, block_mask,
                              score_mod_grad=score_mod_grad, needs_grad=True,
                              compute_dtype=acc_dtype(dtype), shape=(b, h, nq, nk))
    return BackwardArgs(b, h, qkv.hkv, nq, nk, d, dtype, causal, deterministic, scale, var.left,
                        var.right, var.softcap, var.alibi, variant, qkv.d_v)


def backward_user_build(variant):
    """The backward kernels' ``USER`` (both families): ``(score_mod, mask_mod,
    score_mod_grad, BLOCKS)`` device code of a user's variant, or None without one."""
    if variant is None:
        return None
    return (variant.score_mod, variant.mask_mod, variant.score_mod_grad, variant.block)
