"""The four ``torch.library`` custom ops (``numba_flash::fwd``, ``bwd``, ``varlen_fwd``,
``varlen_bwd``) that run numba_flash's NumPy front end on torch tensors, with fake
implementations so ``torch.compile`` can trace through them (shapes only, nothing launched).

Layouts are flash-attn's: dense ``[B, N, H, d]``, packed ``[total, H, d]``; ``lse`` is
``[B, H, Nq]`` (dense) or ``[H, total_q]`` (packed), float32 (float64 for float64 inputs).
``rng_state`` is an int64 ``[1]`` CPU tensor holding the dropout seed (drawn by the forward
from torch's generator, read back by the backward).  ``learnable_sink`` (float32 ``[H]`` or
None, attention sinks) is every op's last argument (the dense ops': ``gather_kv_indices``, FA4's
token-sparse lists ``[B, Nq, topk]`` or None, after it); the backward ops return ``dsink`` fourth
(empty without a sink).  The ops take checked arguments (:mod:`numba_flash.torch.checks`); the
front end checks the rest (values of ``cu_seqlens``, ``alibi_slopes``' and
``learnable_sink``'s dtype and shape) before any launch.

On the device path (CUDA tensors; :mod:`numba_flash.torch.bridge`) the outputs ``out`` and
``dq, dk, dv`` are torch tensors the kernels write (``out=``; the varlen ops' once
:func:`varlen_out` finds they take it), ``softmax_lse`` the op's own array through DLPack, and
nothing waits for the GPU; the forward and the backward (SIMT, tensor cores, and the token-sparse
kernels of ``gather_kv_indices``) read ``[B, N, H, d]`` tensors where they lie and write ``out``
and the gradients in place (their kernels read strides: :func:`bridge.heads_first_view`).
"""

import functools
import inspect
from typing import Optional

import numpy as np
import torch

import numba_flash
from numba_flash import reference

from . import bridge

Tensor = torch.Tensor


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dsink(grads, learnable_sink, q):
    """The backward's ``dsink`` as a tensor on ``q``'s device (empty without a sink: a custom
    op returns a fixed number of tensors)."""
    if learnable_sink is None:
        return q.new_empty((0,), dtype=torch.float32)
    return bridge.to_tensor(grads[3], q.device)


def _backward_options(dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                      softcap, alibi_slopes, deterministic, rng_state, learnable_sink):
    """The front end's keyword arguments for both backward ops' shared op arguments."""
    return dict(causal=causal, softmax_scale=softmax_scale, deterministic=deterministic,
                dropout_p=dropout_p, seed=int(rng_state[0]), softcap=softcap,
                window_size=(window_size_left, window_size_right),
                alibi_slopes=bridge.optional_array(alibi_slopes),
                learnable_sink=bridge.optional_array(learnable_sink))


def _run_backward(backward, arrays, outs, q, learnable_sink, options, **sizes):
    """``(dq, dk, dv, dsink)`` of a backward op: ``backward(*arrays(), **sizes)`` with the op's
    shared ``options`` (:func:`_backward_options`'s arguments but the sink), the inputs
    converted and the backward run on ``q``'s device.  ``outs()``: the three gradients'
    ``(out=, results)``: ``out`` the arrays the backward writes (None: it allocates them) and
    ``results(grads)`` the gradient tensors (``dsink``: float32 ``[H]``, empty without a
    sink)."""
    kw = _backward_options(*options, learnable_sink)
    with bridge.on_device(q.device):
        out, results = outs()
        grads = backward(*arrays(), **sizes, **kw, **({} if out is None else {"out": out}))
        return (*results(grads), _dsink(grads, learnable_sink, q))


@functools.cache
def varlen_out(backward=False):
    """Whether ``numba_flash.forward_varlen`` (``backward_varlen``) takes ``out=`` (``o``;
    ``(dq, dk, dv)``): the varlen ops write into the wrappers' torch tensors once they do."""
    fn = numba_flash.backward_varlen if backward else numba_flash.forward_varlen
    return "out" in inspect.signature(fn).parameters


def _fake_dsink(learnable_sink, q):
    return q.new_empty((0 if learnable_sink is None else learnable_sink.shape[0],),
                       dtype=torch.float32)


def _probs(q, k, scale, causal, window, softcap, alibi):
    """Softmax probabilities ``[B, H, Nq, Nk]`` in float64 (host NumPy) for ``[B, H, N, d]``
    host arrays: the S_dmask of ``return_attn_probs`` (testing only)."""
    k = reference._expand_kv(np.asarray(k, np.float64), q.shape[1])
    _s, p, _lse = reference._probabilities(np.asarray(q, np.float64), k, causal, scale, window,
                                           softcap, alibi)
    return p


def _host(t):
    return bridge.host_array(t.detach().cpu())


def _s_dmask(q, k, seed, dropout_p, scale, causal, window, softcap, alibi_slopes):
    """flash-attn's S_dmask for dense ``[B, N, H, d]`` tensors: ``P`` where kept, ``-P`` where
    dropped, ``[B, H, Nq, Nk]`` in q's dtype (flash-attn pads the last two axes to 128)."""
    qh, kh = (_host(x).transpose(0, 2, 1, 3) for x in (q, k))
    alibi = None if alibi_slopes is None else _host(alibi_slopes)
    p = _probs(qh, kh, scale, causal, window, softcap, alibi)
    keep = numba_flash.dropout_mask(seed, *p.shape, dropout_p)
    return torch.from_numpy(np.where(keep, p, -p)).to(q.dtype).to(q.device)


def _forward_op(q, dropout_p, return_softmax, run, s_dmask):
    """What both forward ops do around their call: draw the dropout seed from torch's generator
    (``rng_state``), ``run(seed)`` on ``q``'s device for ``(out, lse)`` tensors, and S_dmask
    (``s_dmask(seed)``, or an empty tensor without ``return_softmax``); return
    ``(out, lse, S_dmask, rng_state)``."""
    rng_state = bridge.draw_seed(dropout_p)
    seed = int(rng_state[0])
    with bridge.on_device(q.device):
        out, lse = run(seed)
    return out, lse, s_dmask(seed) if return_softmax else q.new_empty((0,)), rng_state


@torch.library.custom_op("numba_flash::fwd", mutates_args=())
def fwd(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax_scale: float, causal: bool,
        window_size_left: int, window_size_right: int, softcap: float,
        alibi_slopes: Optional[Tensor], return_softmax: bool,
        learnable_sink: Optional[Tensor] = None, gather_kv_indices: Optional[Tensor] = None
        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, softmax_lse, S_dmask, rng_state)`` of :func:`numba_flash.forward`."""
    window = (window_size_left, window_size_right)
    extra = {} if gather_kv_indices is None else {"kv_indices": _lists(gather_kv_indices)}

    def run(seed):
        # out= written by the kernel through its strides (the token lists' decode too)
        res = bridge.SeqFirstOut(q.shape[:-1] + v.shape[-1:], q.dtype, q.device, strided=True)
        lse_t, lse_a = bridge.lse_out((q.shape[0], q.shape[2], q.shape[1]), q)
        numba_flash.forward(
            # flash-attn's [B, N, H, d] memory where it lies: the dense kernels read strides,
            # the token lists' decode reads q's and k, v as tokens-first caches
            *(bridge.heads_first_view(x) for x in (q, k, v)), causal=causal,
            softmax_scale=softmax_scale, return_lse=True, dropout_p=dropout_p, seed=seed,
            window_size=window, softcap=softcap, alibi_slopes=bridge.optional_array(alibi_slopes),
            learnable_sink=bridge.optional_array(learnable_sink), out=res.array, lse_out=lse_a,
            **extra)
        return res.result(), lse_t

    def s_dmask(seed):
        return _s_dmask(q, k, seed, dropout_p, softmax_scale, causal, window, softcap,
                        alibi_slopes)

    return _forward_op(q, dropout_p, return_softmax, run, s_dmask)


@fwd.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      alibi_slopes, return_softmax, learnable_sink=None, gather_kv_indices=None):
    b, nq, h, d = q.shape
    lse = q.new_empty((b, h, nq), dtype=_acc_dtype(q.dtype))
    s_dmask = q.new_empty((b, h, nq, k.shape[1]) if return_softmax else (0,))
    out = q.new_empty(q.shape[:-1] + v.shape[-1:])      # v's head dim (its own, or d)
    return out, lse, s_dmask, torch.empty((1,), dtype=torch.int64)


@torch.library.custom_op("numba_flash::bwd", mutates_args=())
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
        dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
        window_size_right: int, softcap: float, alibi_slopes: Optional[Tensor],
        deterministic: bool, rng_state: Tensor, learnable_sink: Optional[Tensor] = None,
        gather_kv_indices: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsink)`` of :func:`numba_flash.backward`, in the inputs' layouts
    (``dsink``: float32 ``[H]``, empty without a sink)."""
    # the backward's kernels (SIMT, tensor cores and the token-sparse one) read and write
    # [B, N, H, d] memory through its strides
    def arrays():
        return [*(bridge.heads_first_view(x) for x in (dout, q, k, v, out)),
                bridge.packed(softmax_lse)]

    def outs():
        res = [bridge.SeqFirstOut(x.shape, x.dtype, x.device, strided=True)
               for x in (q, k, v)]
        return tuple(r.array for r in res), lambda grads: (r.result() for r in res)

    sizes = {} if gather_kv_indices is None else {"kv_indices": _lists(gather_kv_indices)}
    return _run_backward(numba_flash.backward, arrays, outs, q, learnable_sink,
                         (dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                          softcap, alibi_slopes, deterministic, rng_state), **sizes)


@bwd.register_fake
def _(dout, q, k, v, out, softmax_lse, dropout_p, softmax_scale, causal, window_size_left,
      window_size_right, softcap, alibi_slopes, deterministic, rng_state, learnable_sink=None,
      gather_kv_indices=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _fake_dsink(
        learnable_sink, q)


def _lists(gather_kv_indices):
    """FA4's ``gather_kv_indices`` ``[B, Nq, topk]`` (or packed ``[total_q, topk]``: one list
    per query token for every head) as the front end's ``kv_indices`` ``[B, 1, Nq, topk]`` (or
    ``[total_q, 1, topk]``) view."""
    lists = bridge.as_array(gather_kv_indices)
    return lists[:, None]


def _varlen_s_dmask(q, k, cu_q, cu_k, max_q, max_k, seed, dropout_p, scale, causal, window,
                    softcap, alibi_slopes):
    """S_dmask ``[B, H, max_seqlen_q, max_seqlen_k]`` of a packed batch: sequence ``b`` in the
    top-left ``[nq_b, nk_b]`` corner (0 elsewhere), signed by its keep-mask."""
    qh, kh = _host(q), _host(k)
    cq, ck = _host(cu_q).tolist(), _host(cu_k).tolist()
    alibi = None if alibi_slopes is None else _host(alibi_slopes)
    b, h = len(cq) - 1, q.shape[1]
    out = np.zeros((b, h, max_q, max_k))
    for i in range(b):
        nq, nk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if nq == 0 or nk == 0:
            continue
        slopes = None if alibi is None else (alibi[i] if alibi.ndim == 2 else alibi)
        p = _probs(qh[None, cq[i]:cq[i + 1]].transpose(0, 2, 1, 3),
                   kh[None, ck[i]:ck[i + 1]].transpose(0, 2, 1, 3), scale, causal, window,
                   softcap, slopes)[0]
        keep = numba_flash.dropout_mask(seed, b, h, nq, nk, dropout_p)[i]
        out[i, :, :nq, :nk] = np.where(keep, p, -p)
    return torch.from_numpy(out).to(q.dtype).to(q.device)


@torch.library.custom_op("numba_flash::varlen_fwd", mutates_args=())
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, softmax_scale: float,
               causal: bool, window_size_left: int, window_size_right: int, softcap: float,
               alibi_slopes: Optional[Tensor], return_softmax: bool,
               learnable_sink: Optional[Tensor] = None,
               gather_kv_indices: Optional[Tensor] = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(out, softmax_lse, S_dmask, rng_state)`` of :func:`numba_flash.forward_varlen`."""
    window = (window_size_left, window_size_right)
    extra = {} if gather_kv_indices is None else {"kv_indices": _lists(gather_kv_indices)}

    def run(seed):
        # out= when forward_varlen takes it (not with the token lists)
        out = (None if extra or not varlen_out()
               else bridge.empty(q.shape[:-1] + v.shape[-1:], q.dtype, q.device))
        lse_t, lse_a = (None, None) if out is None else bridge.lse_out(
            (q.shape[1], q.shape[0]), q)
        # q, k, v where they lie (the varlen kernel reads strides; the token lists' path
        # pads q into a batch and reads k, v as one-key pages, copying rows with gaps)
        o, lse = numba_flash.forward_varlen(
            *(bridge.packed_view(x) for x in (q, k, v)),
            *bridge.packed_arrays(cu_seqlens_q, cu_seqlens_k),
            max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
            window_size=window, softcap=softcap, alibi_slopes=bridge.optional_array(alibi_slopes),
            softmax_scale=softmax_scale, dropout_p=dropout_p, seed=seed, return_lse=True,
            learnable_sink=bridge.optional_array(learnable_sink),
            **(extra if out is None else {"out": bridge.as_array(out), "lse_out": lse_a}))
        return (bridge.to_tensor(o, q.device) if out is None else out,
                bridge.to_tensor(lse, q.device) if lse_t is None else lse_t)

    def s_dmask(seed):
        return _varlen_s_dmask(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seed, dropout_p, softmax_scale, causal, window, softcap,
                               alibi_slopes)

    return _forward_op(q, dropout_p, return_softmax, run, s_dmask)


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
      causal, window_size_left, window_size_right, softcap, alibi_slopes, return_softmax,
      learnable_sink=None, gather_kv_indices=None):
    total_q, h, _d = q.shape
    lse = q.new_empty((h, total_q), dtype=_acc_dtype(q.dtype))
    shape = ((cu_seqlens_q.shape[0] - 1, h, max_seqlen_q, max_seqlen_k) if return_softmax
             else (0,))
    return (q.new_empty(q.shape[:-1] + v.shape[-1:]), lse, q.new_empty(shape),
            torch.empty((1,), dtype=torch.int64))


@torch.library.custom_op("numba_flash::varlen_bwd", mutates_args=())
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, softmax_lse: Tensor,
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
               dropout_p: float, softmax_scale: float, causal: bool, window_size_left: int,
               window_size_right: int, softcap: float, alibi_slopes: Optional[Tensor],
               deterministic: bool, rng_state: Tensor, learnable_sink: Optional[Tensor] = None,
               gather_kv_indices: Optional[Tensor] = None
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dq, dk, dv, dsink)`` of :func:`numba_flash.backward_varlen`, packed like the inputs."""
    extra = {} if gather_kv_indices is None else {"kv_indices": _lists(gather_kv_indices)}

    def arrays():
        # dout, q, k, v, out where they lie (the varlen backward reads token and head strides;
        # the token lists' backward pads them into a batch, reading them as they lie)
        return [*(bridge.packed_view(x) for x in (dout, q, k, v, out)),
                *bridge.packed_arrays(softmax_lse, cu_seqlens_q, cu_seqlens_k)]

    def outs():
        if gather_kv_indices is not None or not varlen_out(backward=True):
            return None, lambda grads: (bridge.to_tensor(g, q.device) for g in grads[:3])
        res = tuple(bridge.empty(x.shape, x.dtype, x.device) for x in (q, k, v))
        return tuple(bridge.as_array(r) for r in res), lambda grads: res

    return _run_backward(numba_flash.backward_varlen, arrays, outs, q,
                         learnable_sink, (dropout_p, softmax_scale, causal, window_size_left,
                                          window_size_right, softcap, alibi_slopes,
                                          deterministic, rng_state),
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, **extra)


@varlen_bwd.register_fake
def _(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
      dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
      alibi_slopes, deterministic, rng_state, learnable_sink=None, gather_kv_indices=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _fake_dsink(
        learnable_sink, q)
