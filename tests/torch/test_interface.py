"""numba_flash.torch's flash-attn functions against plain torch attention math (forward and
gradients), in the simulator on CPU tensors: flash-attn's tolerance rule."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numba_flash.torch as nft  # noqa: E402
from torch_helpers import attention_ref, check_rule, randn  # noqa: E402

#: floors of the rule.  Measured over the dense and varlen cases below with 15 seeds and the
#: suite's own (2026-12-01): the largest max|ours - ref| - 2 max|torch - ref| was 5.5e-4
#: (float16, dk) and 3.2e-7 (float32, dq; gradients of size ~3, so a few float32 ulps).
#: bfloat16 (bf16 torch tensors in and out, 2026-12-01, 3 seeds, every dense case and varlen):
#: ours was never above 2 max|torch bf16 - ref| (the largest difference -7.2e-3; ours up to
#: 7.2e-3, torch's bf16 math up to 7.5e-3), so its floor is float16's doubled.
FLOOR = {torch.float16: 1e-3, torch.float32: 1e-6, torch.bfloat16: 2e-3}
DTYPES = [torch.float16, torch.float32, torch.bfloat16]
DTYPE_IDS = ["f16", "f32", "bf16"]

CASES = {
    "plain": dict(nq=5, nk=5, h=2, hkv=2, kw={}),
    "causal-gqa": dict(nq=4, nk=7, h=4, hkv=2, kw=dict(causal=True)),
    "window-softcap-alibi": dict(nq=6, nk=6, h=2, hkv=1,
                                 kw=dict(window_size=(2, 1), softcap=2.0, softmax_scale=0.7,
                                         alibi_slopes=torch.tensor([0.25, 0.5]))),
}


def _against_torch(out_fn, q, k, v, kw, dtype, grads=True):
    """Run ``out_fn``, compare out (and dq, dk, dv) with the torch math in float64 and dtype."""
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out = out_fn(q, k, v)
    ref64, _ = attention_ref(*(x.detach().double().requires_grad_() for x in (q, k, v)), **kw)
    refd, _ = attention_ref(*(x.detach().requires_grad_() for x in (q, k, v)), **kw)
    check_rule(out, ref64, refd, FLOOR[dtype])
    if not grads:
        return out
    ours = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    r64 = _grads(q, k, v, kw, g, torch.float64)
    rd = _grads(q, k, v, kw, g, dtype)
    for name, a, b, c in zip(("dq", "dk", "dv"), ours, r64, rd):
        assert a.shape == b.shape and a.dtype == dtype
        check_rule(a, b, c, FLOOR[dtype], name)
    return out


def _grads(q, k, v, kw, g, dtype):
    xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out, _ = attention_ref(*xs, **kw)
    return torch.autograd.grad(out, xs, g.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_flash_attn_func(gen, case, dtype):
    c = CASES[case]
    q = randn(gen, 2, c["nq"], c["h"], 8, dtype=dtype, requires_grad=True)
    k = randn(gen, 2, c["nk"], c["hkv"], 8, dtype=dtype, requires_grad=True)
    v = randn(gen, 2, c["nk"], c["hkv"], 8, dtype=dtype, requires_grad=True)
    out = _against_torch(lambda q, k, v: nft.flash_attn_func(q, k, v, **c["kw"]), q, k, v,
                         c["kw"], dtype)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()


def test_packed_forms_equal_flash_attn_func(gen):
    """qkvpacked / kvpacked give flash_attn_func's out bit for bit, and dqkv / dkv its grads."""
    qkv = randn(gen, 1, 5, 3, 2, 8, requires_grad=True)
    kw = dict(causal=True, window_size=(3, 0))
    out = nft.flash_attn_qkvpacked_func(qkv, **kw)
    g = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    q, k, v = (qkv.detach()[:, :, i].clone().requires_grad_() for i in range(3))
    out_ref = nft.flash_attn_func(q, k, v, **kw)
    grads = torch.autograd.grad(out_ref, (q, k, v), g)
    assert torch.equal(out, out_ref)
    assert torch.equal(dqkv, torch.stack(grads, 2))

    kv = qkv.detach()[:, :, 1:].clone().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    out_kv = nft.flash_attn_kvpacked_func(q2, kv, **kw)
    dq, dkv = torch.autograd.grad(out_kv, (q2, kv), g)
    assert torch.equal(out_kv, out_ref)
    assert torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], 2))


def _varlen_ref(q, k, v, cu_q, cu_k, kw):
    outs = []
    for b in range(len(cu_q) - 1):
        sl_q, sl_k = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, _ = attention_ref(q[None, sl_q], k[None, sl_k], v[None, sl_k], **kw)
        outs.append(o[0])
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_flash_attn_varlen_func(gen, dtype):
    cu_q = torch.tensor([0, 3, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 7, 11], dtype=torch.int32)
    q = randn(gen, 9, 4, 8, dtype=dtype, requires_grad=True)
    k = randn(gen, 11, 2, 8, dtype=dtype, requires_grad=True)
    v = randn(gen, 11, 2, 8, dtype=dtype, requires_grad=True)
    kw = dict(causal=True, softcap=3.0)
    out = nft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 5, **kw)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, grads = {}, {}
    for dt in (torch.float64, dtype):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        outs[dt] = _varlen_ref(*xs, cq, ck, kw)
        grads[dt] = torch.autograd.grad(outs[dt], xs, g.to(dt))
    check_rule(out, outs[torch.float64], outs[dtype], FLOOR[dtype])
    ours = torch.autograd.grad(out, (q, k, v), g.to(dtype))
    for name, a, b, c in zip(("dq", "dk", "dv"), ours, grads[torch.float64], grads[dtype]):
        check_rule(a, b, c, FLOOR[dtype], name)


def test_varlen_packed_forms_equal_varlen_func(gen):
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    qkv = randn(gen, 6, 3, 2, 8, requires_grad=True)
    out = nft.flash_attn_varlen_qkvpacked_func(qkv, cu, 4, causal=True)
    g = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, g)
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    out_ref = nft.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True)
    grads = torch.autograd.grad(out_ref, (q, k, v), g)
    assert torch.equal(out, out_ref) and torch.equal(dqkv, torch.stack(grads, 1))
    kv = qkv.detach()[:, 1:].clone().requires_grad_()
    out_kv = nft.flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 4, 4, causal=True)
    dq, dkv = torch.autograd.grad(out_kv, (q, kv), g)
    assert torch.equal(out_kv, out_ref)
    assert torch.equal(dq, grads[0]) and torch.equal(dkv, torch.stack(grads[1:], 1))


def test_return_attn_probs_lse(gen):
    """softmax_lse as torch's logsumexp; S_dmask empty without dropout (as flash-attn); lse is
    not differentiable (a clear error, not a silent zero gradient)."""
    q = randn(gen, 1, 4, 2, 8, requires_grad=True)
    k = randn(gen, 1, 6, 2, 8)
    v = randn(gen, 1, 6, 2, 8)
    out, lse, s_dmask = nft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    _, lse_ref = attention_ref(q.detach().double(), k.double(), v.double(), causal=True)
    assert lse.shape == (1, 2, 4) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-6, rtol=0)
    assert s_dmask.shape == (0,)
    assert not lse.requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        lse.sum().backward()


def test_row_without_keys_gives_zero_and_minus_inf_lse(gen):
    """A query row that sees no key (Nq > Nk, causal): out 0 as flash-attn, lse -inf."""
    q, k, v = randn(gen, 1, 4, 1, 8), randn(gen, 1, 2, 1, 8), randn(gen, 1, 2, 1, 8)
    out, lse, _ = nft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[0, :2], torch.zeros(2, 1, 8))
    assert torch.isneginf(lse[0, 0, :2]).all() and torch.isfinite(lse[0, 0, 2:]).all()


def test_dropout_reproducible_and_matches_its_mask(gen):
    """torch.manual_seed reproduces the dropout; out and grads equal the torch math with the
    keep-mask S_dmask encodes (negative = dropped)."""
    p = 0.3
    q = randn(gen, 1, 5, 2, 8, requires_grad=True)
    k = randn(gen, 1, 7, 2, 8, requires_grad=True)
    v = randn(gen, 1, 7, 2, 8, requires_grad=True)
    torch.manual_seed(123)
    out, lse, s_dmask = nft.flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True)
    torch.manual_seed(123)
    again = nft.flash_attn_func(q, k, v, dropout_p=p)
    other = nft.flash_attn_func(q, k, v, dropout_p=p)  # the generator moved on
    assert torch.equal(out, again) and not torch.equal(out, other)
    keep = s_dmask >= 0
    assert s_dmask.shape == (1, 2, 5, 7) and 0.4 < keep.double().mean() < 0.95
    ref64, _ = attention_ref(q.detach().double(), k.detach().double(), v.detach().double(),
                             keep=keep, dropout_p=p)
    ref32, _ = attention_ref(q.detach(), k.detach(), v.detach(), keep=keep, dropout_p=p)
    check_rule(out, ref64, ref32, FLOOR[torch.float32])
    # |S_dmask| is the undropped softmax
    _, lse_ref = attention_ref(q.detach().double(), k.detach().double(), v.detach().double())
    torch.testing.assert_close(s_dmask.abs().sum(-1), torch.ones(1, 2, 5), atol=1e-6, rtol=0)
    g = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), g)
    xs = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, _ = attention_ref(*xs, keep=keep, dropout_p=p)
    for a, b in zip(ours, torch.autograd.grad(ref, xs, g.double())):
        torch.testing.assert_close(a.double(), b, atol=1e-5, rtol=0)


def test_varlen_dropout_mask_per_sequence(gen):
    """Varlen S_dmask: sequence b's mask in its top-left corner; out equals the torch math."""
    p = 0.25
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, k, v = (randn(gen, 7, 2, 8) for _ in range(3))
    torch.manual_seed(7)
    out, lse, s_dmask = nft.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, dropout_p=p,
                                                   return_attn_probs=True)
    assert s_dmask.shape == (2, 2, 4, 4) and lse.shape == (2, 7)
    for b, (s, e) in enumerate(((0, 3), (3, 7))):
        n = e - s
        keep = s_dmask[b, :, :n, :n][None] >= 0
        ref, _ = attention_ref(q[None, s:e].double(), k[None, s:e].double(),
                               v[None, s:e].double(), keep=keep, dropout_p=p)
        torch.testing.assert_close(out[s:e].double(), ref[0], atol=1e-6, rtol=0)


def test_bfloat16_tensors_in_and_out_as_the_numpy_op(gen):
    """bf16 CPU tensors in (a non-contiguous view too), bf16 out: exactly numba_flash.forward on
    the ml_dtypes.bfloat16 view of the same bits; inputs untouched; dropout's S_dmask in bf16."""
    import ml_dtypes
    import numpy as np

    import numba_flash

    q = randn(gen, 1, 8, 2, 6, dtype=torch.bfloat16)  # [B, N, H, d]
    kv = randn(gen, 1, 2, 8, 1, 6, dtype=torch.bfloat16)
    k, v = kv[:, 0], kv[:, 1]  # views, not contiguous
    before = [x.clone() for x in (q, k, v)]
    torch.manual_seed(5)
    out, lse, s_dmask = nft.flash_attn_func(q, k, v, causal=True, dropout_p=0.2,
                                            return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.dtype == torch.float32
    assert s_dmask.dtype == torch.bfloat16 and s_dmask.shape == (1, 2, 8, 8)
    for x, x0 in zip((q, k, v), before):
        assert torch.equal(x, x0)

    def bits(t):  # [B, N, H, d] bf16 tensor -> [B, H, N, d] ml_dtypes array, same bits
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).transpose(0, 2, 1, 3)

    torch.manual_seed(5)
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64)[0])  # the op's own draw
    o_np = numba_flash.forward(bits(q), bits(k), bits(v), causal=True, dropout_p=0.2, seed=seed)
    np.testing.assert_array_equal(bits(out).view(np.uint16), o_np.view(np.uint16))
