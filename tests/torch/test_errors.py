"""Bad input to numba_flash.torch: a clear TypeError / ValueError naming flash-attn's argument,
before anything runs; inputs untouched."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numba_flash.torch as nft  # noqa: E402


def _qkv(nq=4, nk=4, h=2, hkv=2, d=8, dtype=torch.float32):
    return (torch.randn(1, nq, h, d, dtype=dtype), torch.randn(1, nk, hkv, d, dtype=dtype),
            torch.randn(1, nk, hkv, d, dtype=dtype))


def _call(**over):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v) | over
    return nft.flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("over, exc, match", [
    (dict(q=None), TypeError, r"q: expected a torch.Tensor \(batch_size, seqlen, nheads"),
    (dict(q=torch.randn(4, 2, 8)), ValueError,
     r"q: expected a 4-D tensor .* got shape \(4, 2, 8\)"),
    (dict(k=torch.randn(1, 4, 2, 8).bfloat16()), TypeError,
     r"k: expected dtype float32 \(the dtype of q\), got bfloat16"),
    (dict(k=torch.ones(1, 4, 2, 8, dtype=torch.int32)), TypeError,
     r"k: expected dtype in \(float16, bfloat16, float32, float64\), got int32"),
    (dict(v=torch.randn(1, 4, 2, 8).double()), TypeError,
     r"v: expected dtype float32 \(the dtype of q\), got float64"),
    (dict(v=torch.randn(1, 5, 2, 8)), ValueError, r"v: expected the shape of k \(1, 4, 2, 8\)"),
    (dict(k=torch.randn(2, 4, 2, 8), v=torch.randn(2, 4, 2, 8)), ValueError,
     r"k: expected batch_size 1 \(from q\), got 2"),
    (dict(k=torch.randn(1, 4, 3, 8), v=torch.randn(1, 4, 3, 8)), ValueError,
     r"k: expected a number of heads \(nheads_k\) that divides the 2 heads of q"),
    (dict(dropout_p=1.0), ValueError, r"dropout_p: expected a real number in \[0, 1\)"),
    (dict(causal="yes"), TypeError, r"causal: expected a bool"),
    (dict(window_size=(-2, 0)), ValueError, r"window_size"),
    (dict(softcap=-1.0), ValueError, r"softcap: expected a finite number >= 0"),
    (dict(softmax_scale=0.0), ValueError, r"softmax_scale: expected a finite number > 0"),
    (dict(alibi_slopes=torch.ones(2, requires_grad=True)), ValueError,
     r"alibi_slopes: expected a tensor that does not require grad"),
    (dict(alibi_slopes=torch.ones(2, device="meta")), TypeError,
     r"alibi_slopes: expected a dense \(strided\) tensor with values, got a meta tensor"),
])
def test_dense_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _call(**over)


def test_tensor_on_another_device():
    """A meta tensor is a TypeError before the device check (issue 37: it has no values); the
    device check itself, on the only other device a CPU machine has."""
    from numba_flash.torch import checks

    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"v: expected a dense \(strided\) tensor with values, "
                                        r"got a meta tensor"):
        nft.flash_attn_func(q, k, v.to("meta"))
    with pytest.raises(ValueError, match=r"v: expected a tensor on cpu \(the device of q\), got "
                                         r"one on meta"):
        checks.check_device({"q": q, "k": k, "v": v.to("meta")})
    with pytest.raises(ValueError, match=r"q: expected a CPU or CUDA tensor, got one on meta"):
        checks.check_device({n: x.to("meta") for n, x in zip("qkv", (q, k, v))})


def test_cuda_tensor_in_the_simulator():
    import numba_flash

    if numba_flash.backend() != "simulator" or not torch.cuda.is_available():
        pytest.skip("needs a CUDA tensor while numba_flash runs the simulator")
    q, k, v = (x.cuda() for x in _qkv())
    with pytest.raises(ValueError, match="needs numba_flash's CUDA backend"):
        nft.flash_attn_func(q, k, v)


def test_packed_bad_input():
    with pytest.raises(ValueError, match=r"qkv: expected 3 along dim 2 of \(batch_size, seqlen, "
                                         r"3, nheads, headdim\), got shape \(1, 4, 2, 2, 8\)"):
        nft.flash_attn_qkvpacked_func(torch.randn(1, 4, 2, 2, 8))
    with pytest.raises(ValueError, match=r"qkv: expected headdim 1..256, got 300"):
        nft.flash_attn_qkvpacked_func(torch.randn(1, 2, 3, 1, 300))
    with pytest.raises(ValueError, match=r"kv: expected a 5-D tensor"):
        nft.flash_attn_kvpacked_func(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8))


def _varlen(**over):
    args = dict(q=torch.randn(5, 2, 8), k=torch.randn(5, 2, 8), v=torch.randn(5, 2, 8),
                cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32),
                cu_seqlens_k=torch.tensor([0, 2, 5], dtype=torch.int32),
                max_seqlen_q=3, max_seqlen_k=3) | over
    return nft.flash_attn_varlen_func(**args)


@pytest.mark.parametrize("over, exc, match", [
    (dict(q=torch.randn(1, 5, 2, 8)), ValueError, r"q: expected a 3-D tensor \(total, nheads"),
    (dict(cu_seqlens_q=torch.tensor([0.0, 5.0])), TypeError, r"cu_seqlens_q: expected dtype int32"),
    (dict(cu_seqlens_k=torch.tensor([0, 2, 4], dtype=torch.int32)), ValueError,
     r"cu_seqlens_k: expected the packed length 5 last, got 4"),
    (dict(max_seqlen_q=2), ValueError, r"max_seqlen_q: expected at least the longest sequence"),
    (dict(max_seqlen_k=3.0), TypeError, r"max_seqlen_k: expected an int"),
    (dict(cu_seqlens_q=torch.tensor([0, 2, 5], dtype=torch.int32, device="meta")), TypeError,
     r"cu_seqlens_q: expected a dense \(strided\) tensor with values, got a meta tensor"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32)), ValueError,
     r"k: expected a 4-D tensor \(num_blocks, page_block_size, nheads_k, headdim\)"),
])
def test_varlen_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        _varlen(**over)


def test_inputs_not_modified():
    q, k, v = _qkv()
    copies = [x.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.requires_grad_()
    out = nft.flash_attn_func(q, k, v, causal=True, dropout_p=0.2)
    out.sum().backward()
    for x, c in zip((q, k, v), copies):
        assert torch.equal(x.detach(), c)
