"""Empty batches and empty key sets through numba_flash.torch (issue 59): ``batch_size``,
``seqlen_q`` or ``seqlen_k`` 0 (varlen ``total_q`` / ``total_k`` 0, a KV cache that holds no
key) give flash-attn's shapes and dtypes, ``out = 0``, ``softmax_lse = -inf`` (or the sink's
logit; flash-attn stores +inf) and zero gradients, without a kernel launch; ``nheads = 0`` and
``headdim = 0`` stay the old error."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numba_flash.torch as nft  # noqa: E402
from numba_flash.frontend import arrays  # noqa: E402

H, HKV, D = 4, 2, 8
INF = float("inf")
DENSE = [(0, 3, 4), (2, 0, 4), (2, 3, 0)]


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    def launch(*args, **kwargs):
        raise AssertionError("an empty batch launched a kernel")

    monkeypatch.setattr(arrays.ArrayCall, "launch", launch)


def sink_logits(requires_grad=True):
    return torch.tensor([0.5, -1.0, 2.0, -INF], requires_grad=requires_grad)


def lse_want(sink, shape, head_dim):
    """``softmax_lse`` of rows that see no key: the sink along the heads, or -inf."""
    view = [1] * len(shape)
    view[head_dim] = H
    base = torch.full((H,), -INF) if sink is None else sink.detach()
    return base.view(view).expand(shape)


@pytest.mark.parametrize("shape", DENSE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("with_sink", [False, True])
def test_flash_attn_func(shape, dtype, with_sink):
    b, nq, nk = shape
    q = torch.randn(b, nq, H, D, dtype=dtype, requires_grad=True)
    k = torch.randn(b, nk, HKV, D, dtype=dtype, requires_grad=True)
    v = torch.randn(b, nk, HKV, D, dtype=dtype, requires_grad=True)
    sink = sink_logits() if with_sink else None
    copies = [x.detach().clone() for x in (q, k, v)]
    out, lse, s_dmask = nft.flash_attn_func(q, k, v, causal=True, return_attn_probs=True,
                                            learnable_sink=sink)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (b, H, nq)
    assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(out, torch.zeros_like(out))
    if nk == 0:
        assert torch.equal(lse, lse_want(sink, lse.shape, 1).to(lse.dtype))
    (out.float() * 3).sum().backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and x.grad.dtype == dtype
        assert torch.equal(x.grad, torch.zeros_like(x))
    if with_sink:
        assert torch.equal(sink.grad, torch.zeros(H))
    for x, c in zip((q, k, v), copies):
        assert torch.equal(x.detach(), c)


@pytest.mark.parametrize("shape", DENSE)
@pytest.mark.parametrize("route", ["dropout", "gather", "mask_mod", "qkvpacked", "kvpacked"])
def test_dense_routes(shape, route):
    b, nq, nk = shape
    q = torch.randn(b, nq, H, D, requires_grad=True)
    k = torch.randn(b, nk, HKV, D, requires_grad=True)
    v = torch.randn(b, nk, HKV, D, requires_grad=True)
    if route == "dropout":
        out = nft.flash_attn_func(q, k, v, dropout_p=0.3)
    elif route == "gather":
        out = nft.flash_attn_func(q, k, v,
                                  gather_kv_indices=torch.full((b, nq, 2), -1, dtype=torch.int32))
    elif route == "mask_mod":
        out = nft.flash_attn_func(q, k, v, mask_mod=lambda b, h, i, j: i >= j)
    elif route == "qkvpacked":   # one seqlen for q and k: the shorter (0 here or B = 0)
        nq = min(nq, nk)
        qkv = torch.randn(b, nq, 3, H, D, requires_grad=True)
        out = nft.flash_attn_qkvpacked_func(qkv)
        q = qkv
    else:
        kv = torch.randn(b, nk, 2, HKV, D, requires_grad=True)
        out = nft.flash_attn_kvpacked_func(q, kv)
    assert torch.equal(out, torch.zeros(b, nq, H, D))
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))


CU0 = torch.zeros(3, dtype=torch.int32)
CU = torch.tensor([0, 2, 5], dtype=torch.int32)


@pytest.mark.parametrize("cu", [(CU0, CU), (CU, CU0), (CU0, CU0)],
                         ids=["total_q=0", "total_k=0", "both"])
@pytest.mark.parametrize("with_sink", [False, True])
def test_flash_attn_varlen_func(cu, with_sink):
    cu_q, cu_k = cu
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, H, D, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(tk, HKV, D, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(tk, HKV, D, dtype=torch.bfloat16, requires_grad=True)
    sink = sink_logits() if with_sink else None
    out, lse, _ = nft.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True,
                                             return_attn_probs=True, learnable_sink=sink)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse, lse_want(sink, (H, tq), 0))
    out.float().sum().backward()
    for x in (q, k, v):
        assert torch.equal(x.grad, torch.zeros_like(x))
    if with_sink:
        assert torch.equal(sink.grad, torch.zeros(H))
    kv = torch.randn(tk, 2, HKV, D)
    assert nft.flash_attn_varlen_kvpacked_func(q.detach().float(), kv, cu_q, cu_k, 3,
                                               3).shape == (tq, H, D)
    if tq == tk:
        assert nft.flash_attn_varlen_qkvpacked_func(torch.randn(tq, 3, H, D), cu_q,
                                                    3).shape == (tq, H, D)
    if tk == 0:   # the paged form: a cache of no block, a table of no column
        cache = torch.randn(0, 4, HKV, D)
        out = nft.flash_attn_varlen_func(q.detach().float(), cache, cache, cu_q, cu_k, 3, 0,
                                         block_table=torch.zeros(2, 0, dtype=torch.int32))
        assert torch.equal(out, torch.zeros(tq, H, D))


def test_flash_attn_with_kvcache():
    sink = sink_logits(requires_grad=False)
    # an empty batch, with new tokens to append and rotary tables
    q, cache = torch.randn(0, 1, H, D), torch.randn(0, 6, HKV, D)
    out, lse = nft.flash_attn_with_kvcache(
        q, cache, cache.clone(), k=torch.randn(0, 1, HKV, D), v=torch.randn(0, 1, HKV, D),
        rotary_cos=torch.ones(8, 2), rotary_sin=torch.zeros(8, 2),
        cache_seqlens=torch.zeros(0, dtype=torch.int32), return_softmax_lse=True)
    assert out.shape == (0, 1, H, D) and lse.shape == (0, H, 1)
    # a cache that holds no key: contiguous (seqlen_cache 0) or paged (no block)
    q = torch.randn(2, 3, H, D, dtype=torch.float64)
    for cache, table in ((torch.randn(2, 0, HKV, D, dtype=torch.float64), None),
                         (torch.randn(0, 4, HKV, D, dtype=torch.float64),
                          torch.zeros(2, 2, dtype=torch.int32))):
        out, lse = nft.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=0,
                                               block_table=table, return_softmax_lse=True,
                                               learnable_sink=sink)
        assert out.dtype == torch.float64 and torch.equal(out, torch.zeros_like(q))
        assert torch.equal(lse, lse_want(sink, (2, H, 3), 1).double())
    cache = torch.randn(2, 0, HKV, D, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"k_cache: too small"):
        nft.flash_attn_with_kvcache(q, cache, cache, k=torch.randn(2, 1, HKV, D).double(),
                                    v=torch.randn(2, 1, HKV, D).double(), cache_seqlens=0)


def test_nheads_and_headdim_stay_refused():
    x = torch.randn(1, 2, 0, 8)
    with pytest.raises(ValueError, match=r"q: expected no empty dimension"):
        nft.flash_attn_func(x, x, x)
    x = torch.randn(3, 2, 0)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q: expected no empty dimension"):
        nft.flash_attn_varlen_func(x, x, x, cu, cu, 3, 3)
    with pytest.raises(ValueError, match=r"q: expected no empty dimension"):
        nft.flash_attn_with_kvcache(torch.randn(1, 1, 2, 0), torch.randn(1, 4, 2, 0),
                                    torch.randn(1, 4, 2, 0))
