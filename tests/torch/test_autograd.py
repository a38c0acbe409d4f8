"""Gradients of numba_flash.torch through torch.autograd.gradcheck (float64, tiny shapes), and
torch.compile(fullgraph=True) of small modules that call it (the custom ops' fake
implementations trace; the real ops run in the simulator)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numba_flash.torch as nft  # noqa: E402
from torch_helpers import randn  # noqa: E402


def test_gradcheck_dense_causal_gqa_variants(gen):
    q = randn(gen, 1, 3, 2, 4, dtype=torch.float64, requires_grad=True)
    k = randn(gen, 1, 4, 1, 4, dtype=torch.float64, requires_grad=True)
    v = randn(gen, 1, 4, 1, 4, dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([0.3, 0.6], dtype=torch.float32)

    def f(q, k, v):
        return nft.flash_attn_func(q, k, v, causal=True, softcap=1.5, alibi_slopes=slopes)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True, atol=1e-8, rtol=1e-6)


def test_gradcheck_varlen(gen):
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    q = randn(gen, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    k = randn(gen, 5, 2, 4, dtype=torch.float64, requires_grad=True)
    v = randn(gen, 5, 2, 4, dtype=torch.float64, requires_grad=True)

    def f(q, k, v):
        return nft.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, window_size=(1, 1))

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True, atol=1e-8, rtol=1e-6)


def test_double_backward_is_an_error(gen):
    """The backward is once-differentiable: a second derivative is torch's error, not a silent
    zero."""
    q = randn(gen, 1, 3, 1, 4, dtype=torch.float64, requires_grad=True)
    out = nft.flash_attn_func(q, q.detach(), q.detach())
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|differentiate twice"):
        dq.sum().backward()


class TinyAttention(torch.nn.Module):
    """One causal self-attention layer on a qkv projection, [B, N, 8] -> [B, N, 8]."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 3 * 8)

    def forward(self, x):
        b, n, _ = x.shape
        qkv = self.qkv(x).view(b, n, 3, 2, 4)
        return nft.flash_attn_qkvpacked_func(qkv, causal=True).reshape(b, n, 8)


def test_torch_compile_fullgraph_module():
    """torch.compile(fullgraph=True) traces the module (no graph break) and gives eager's
    output and weight gradient; "aot_eager" runs the fake implementations and AOT autograd
    (inductor works too but compiles C++ for seconds: not in the suite)."""
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(1, 5, 8)
    ref = model(x)
    ref.square().sum().backward()
    grad_ref = model.qkv.weight.grad.clone()
    model.zero_grad()
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    out.square().sum().backward()
    assert torch.equal(out, ref)
    assert torch.equal(model.qkv.weight.grad, grad_ref)


def test_torch_compile_fullgraph_varlen_shared_cu_seqlens(gen):
    """The varlen function under fullgraph compile with one tensor as both cu_seqlens (what
    self-attention passes)."""
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    q, k, v = (randn(gen, 6, 2, 4, requires_grad=True) for _ in range(3))

    def f(q, k, v):
        return nft.flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True)

    ref = f(q, k, v)
    grads_ref = torch.autograd.grad(ref.sum(), (q, k, v))
    torch._dynamo.reset()
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.equal(out, ref)
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), grads_ref):
        assert torch.equal(a, b)
