"""FlashAttention-3's fp8 forward through numba_flash.torch (numba_flash/torch/fp8.py):
torch.float8_e4m3fn q, k, v with q_descale / k_descale / v_descale in flash_attn_func, its packed
forms and flash_attn_varlen_func, against numba_flash.reference.attention of the dequantised
inputs (float64) at the NumPy fp8 tests' bound (4 % of max |v|, tests/kernels/test_forward_fp8.py);
out bfloat16, inputs untouched, forward only (a backward raises), and the bad arguments named
before any launch.  Simulator, d = 64, a few heads: each call is a second or two."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
import numba_flash.ops.forward_fp8 as forward_fp8_op  # noqa: E402
from numba_flash import reference as ref  # noqa: E402
from numba_flash.frontend.fp8 import E4M3 as NP_E4M3  # noqa: E402
from numba_flash.torch import (  # noqa: E402
    flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
)

E4M3 = getattr(torch, "float8_e4m3fn", None)
pytestmark = pytest.mark.skipif(E4M3 is None, reason="this torch has no float8_e4m3fn")

#: max |out - ref| / max |v| (the NumPy fp8 forward's measured bound)
O_BOUND = 0.04
LSE_ATOL = 2e-5
LSE_RTOL = 4e-7


def _fp8(gen, *shape):
    return torch.randn(*shape, generator=gen).to(E4M3)


def _descales(gen, b, hkv):
    """FA3's float32 (batch_size, nheads_k) descales, none of them 1."""
    return [torch.rand(b, hkv, generator=gen) * 1.5 + 0.5 for _ in range(3)]


def _inputs(gen, b=1, nq=16, nk=24, h=4, hkv=2, d=64):
    q, k, v = _fp8(gen, b, nq, h, d), _fp8(gen, b, nk, hkv, d), _fp8(gen, b, nk, hkv, d)
    return q, k, v, _descales(gen, b, hkv)


def _heads_first(x, descale):
    """The reference's float64 [B, H, N, d] input: x's e4m3 values times its descale."""
    return ref.dequantize(x.view(torch.uint8).numpy().view(NP_E4M3)
                          .transpose(0, 2, 1, 3), descale.numpy())


def _bytes(*tensors):
    return [t.view(torch.uint8).clone() if t.dtype == E4M3 else t.clone() for t in tensors]


def _unchanged(tensors, before):
    for t, b in zip(tensors, before):
        assert torch.equal(t.view(torch.uint8) if t.dtype == E4M3 else t, b)


def _check(out, lse, want_o, want_lse, vmax):
    err = np.abs(out.double().numpy() - want_o).max() / vmax
    assert not np.isnan(err), "out has a NaN"
    assert err <= O_BOUND, f"max |out - ref| / max |v| = {err:.4f} > {O_BOUND}"
    np.testing.assert_allclose(lse.numpy(), want_lse, rtol=LSE_RTOL, atol=LSE_ATOL)


@pytest.mark.parametrize("b, h, hkv, kw", [
    (1, 4, 2, dict(causal=True)),                                         # GQA 4 : 2, causal
    (2, 2, 1, dict(window_size=(6, 2), softcap=4.0)),                     # MQA, batch 2
])
def test_fp8_flash_attn_func_matches_the_reference(gen, b, h, hkv, kw):
    """e4m3 q, k, v with descales != 1 (Nq = 16 of Nk = 24: bottom-right alignment, a partial
    key tile): out bfloat16 [batch, seqlen_q, nheads, headdim] within 4 % of max |v| of the
    float64 reference of the dequantised inputs, lse float32 [batch, nheads, seqlen_q], S_dmask
    empty, the inputs (and descales) untouched."""
    q, k, v, (qd, kd, vd) = _inputs(gen, b=b, h=h, hkv=hkv)
    before = _bytes(q, k, v, qd, kd, vd)
    out, lse, s_dmask = flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                        return_attn_probs=True, **kw)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (b, h, 16)
    assert s_dmask.numel() == 0 and not out.requires_grad
    _unchanged((q, k, v, qd, kd, vd), before)
    qh, kh, vh = _heads_first(q, qd), _heads_first(k, kd), _heads_first(v, vd)
    want_o, want_lse = ref.attention(qh, kh, vh, **kw)
    _check(out, lse, want_o.transpose(0, 2, 1, 3), want_lse, np.abs(vh).max())


def test_descales_default_to_one_and_qkvpacked_agrees(gen):
    """No descales means 1 (the reference of the raw e4m3 values); a packed fp8 qkv (q, k, v
    strided views of it) gives flash_attn_func's bits."""
    qkv = _fp8(gen, 1, 16, 3, 2, 64)
    q, k, v = qkv.unbind(2)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    ones = torch.ones(1, 2)
    vh = _heads_first(v, ones)
    want_o, want_lse = ref.attention(_heads_first(q, ones), _heads_first(k, ones), vh,
                                     causal=True)
    err = np.abs(out.double().numpy() - want_o.transpose(0, 2, 1, 3)).max()
    assert err <= O_BOUND * np.abs(vh).max()
    assert torch.equal(flash_attn_func(q, k, v, causal=True), out)


def test_kvpacked_matches_the_reference(gen):
    """q over a packed fp8 kv (MQA 2 : 1) with descales: the reference at the bound."""
    q, kv = _fp8(gen, 1, 12, 2, 64), _fp8(gen, 1, 20, 2, 1, 64)
    qd, kd, vd = _descales(gen, 1, 1)
    out, lse, _ = flash_attn_kvpacked_func(q, kv, q_descale=qd, k_descale=kd, v_descale=vd,
                                           return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (1, 2, 12)
    vh = _heads_first(kv[:, :, 1], vd)
    want_o, want_lse = ref.attention(_heads_first(q, qd), _heads_first(kv[:, :, 0], kd), vh)
    _check(out, lse, want_o.transpose(0, 2, 1, 3), want_lse, np.abs(vh).max())


def test_fp8_varlen_matches_the_reference(gen):
    """flash_attn_varlen_func on packed e4m3 sequences (7 / 12 queries against 10 / 16 keys),
    GQA 2 : 1, a descale row per sequence: each sequence's reference at the bound; out
    bfloat16 [total_q, nheads, headdim], lse float32 [nheads, total_q]."""
    len_q, len_k = [7, 12], [10, 16]
    cu_q = torch.tensor([0, 7, 19], dtype=torch.int32)
    cu_k = torch.tensor([0, 10, 26], dtype=torch.int32)
    q, k, v = _fp8(gen, 19, 2, 64), _fp8(gen, 26, 1, 64), _fp8(gen, 26, 1, 64)
    qd, kd, vd = _descales(gen, 2, 1)
    before = _bytes(q, k, v)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 16, causal=True,
                                         q_descale=qd, k_descale=kd, v_descale=vd,
                                         return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 19)
    _unchanged((q, k, v), before)
    rows_q, rows_k = np.repeat([0, 1], len_q), np.repeat([0, 1], len_k)

    def deq(x, descale, rows):
        return (x.view(torch.uint8).numpy().view(NP_E4M3)
                .astype(np.float64) * descale.numpy()[rows][:, :, None])

    vh = deq(v, vd, rows_k)
    want_o, want_lse = ref.attention_varlen(deq(q, qd, rows_q), deq(k, kd, rows_k), vh,
                                            cu_q.numpy(), cu_k.numpy(), causal=True)
    _check(out, lse, want_o, want_lse, np.abs(vh).max())


def test_forward_only_as_fa3(gen):
    """Inputs that require grad: the forward runs (as FA3's fp8 path), a backward through out
    raises NotImplementedError; under no_grad out carries no graph."""
    q, k, v, (qd, kd, vd) = _inputs(gen, h=2, hkv=1)
    leaf = q.float().requires_grad_()
    out = flash_attn_func(leaf.to(E4M3), k, v, q_descale=qd)
    assert out.requires_grad and out.dtype == torch.bfloat16
    with pytest.raises(NotImplementedError, match="no gradient through fp8"):
        out.float().sum().backward()
    with torch.no_grad():
        assert not flash_attn_func(leaf.to(E4M3), k, v, q_descale=qd).requires_grad


@pytest.fixture
def no_launch(monkeypatch):
    """The fp8 kernels' builders raise: an error test that gets its own error ran no launch."""
    def launched(*args, **kwargs):
        raise AssertionError("an fp8 kernel was launched")

    monkeypatch.setattr(forward_fp8_op, "forward_fp8_kernel", launched)
    monkeypatch.setattr(forward_fp8_op, "forward_wgmma_fp8_kernel", launched)


def _small(gen, d=64):
    q, k, v, (qd, kd, vd) = _inputs(gen, nq=4, nk=8, h=2, hkv=1, d=d)
    return q, k, v, qd, kd, vd


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: a.update(q=a["q"].float().to(torch.float8_e5m2)), TypeError,
     r"^q: expected dtype float8_e4m3fn for fp8 inputs \(FA3's; float8_e5m2 is not built\)"),
    (lambda a: a.update(k=a["k"].to(torch.float16)), TypeError,
     r"^k: expected dtype float8_e4m3fn \(the dtype of q\), got float16"),
    (lambda a: a.update(k_descale=torch.ones(1, 2)), ValueError,
     r"^k_descale: expected shape \(1, 1\) = \[B, Hkv\], got \(1, 2\)"),
    (lambda a: a.update(v_descale=a["v_descale"].double()), TypeError,
     r"^v_descale: expected dtype float32, got float64"),
    (lambda a: a.update(q_descale=0.5), TypeError,
     r"^q_descale: expected None or a float32 torch.Tensor \(batch_size, nheads_k\), got "
     r"builtins.float"),
    (lambda a: a.update(dropout_p=0.1), ValueError,
     r"^dropout_p: expected 0.0 with e4m3 inputs"),
    (lambda a: a.update(gather_kv_indices=torch.zeros(1, 4, 2, dtype=torch.int32)), ValueError,
     r"^gather_kv_indices: expected None with float8_e4m3fn inputs"),
    (lambda a: a.update(score_mod=lambda s, b, h, i, j: s), ValueError,
     r"^score_mod: expected None with float8_e4m3fn inputs"),
    (lambda a: a.update(learnable_sink=torch.zeros(3)), ValueError,
     r"^learnable_sink: expected shape \(2,\)"),
])
def test_bad_fp8_arguments_are_named(gen, no_launch, change, exc, match):
    q, k, v, qd, kd, vd = _small(gen)
    args = dict(q=q, k=k, v=v, q_descale=qd, k_descale=kd, v_descale=vd)
    change(args)
    before = _bytes(q, k, v)
    with pytest.raises(exc, match=match):
        flash_attn_func(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    _unchanged((q, k, v), before)


def test_bad_head_dim_and_varlen_table_are_named(gen, no_launch):
    q, k, v, qd, kd, vd = _small(gen, d=48)
    with pytest.raises(ValueError, match="^q: expected a head dim that is a multiple of 32"):
        flash_attn_func(q, k, v)
    q, k, v, qd, kd, vd = _small(gen)
    cu_q, cu_k = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="^block_table: expected None with fp8 inputs"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 4, 8,
                               block_table=torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^q_descale: expected shape \(1, 1\)"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu_q, cu_k, 4, 8, q_descale=torch.ones(2, 1))


def test_descales_without_fp8_inputs_are_the_front_ends_error(gen, no_launch):
    """A descale with float16 inputs: the NumPy front end's ValueError, word for word."""
    q, k, v, qd, kd, vd = _small(gen)
    q16, k16, v16 = (x.to(torch.float16) for x in (q, k, v))
    with pytest.raises(ValueError) as numpy_call:
        numba_flash.forward(*(x.numpy().transpose(0, 2, 1, 3) for x in (q16, k16, v16)),
                            v_descale=vd.numpy())
    with pytest.raises(ValueError, match="^v_descale: expected None without e4m3 inputs") as got:
        flash_attn_func(q16, k16, v16, v_descale=vd)
    assert str(got.value) == str(numpy_call.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_fp8_matches_the_cpu_call(gen):
    """CUDA float8_e4m3fn tensors and descales (their bytes as CuPy uint8 with
    qkv_dtype="fp8_e4m3", the CPU path's route): the CPU call's bits, on the same GPU."""
    pytest.importorskip("cupy")
    q, k, v, qd, kd, vd = _small(gen)
    want, want_lse, _ = flash_attn_func(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd,
                                        return_attn_probs=True)
    got, lse, _ = flash_attn_func(*(x.cuda() for x in (q, k, v)), q_descale=qd.cuda(),
                                  k_descale=kd.cuda(), v_descale=vd.cuda(),
                                  return_attn_probs=True)
    assert got.is_cuda and got.dtype == torch.bfloat16
    assert torch.equal(got.cpu(), want) and torch.equal(lse.cpu(), want_lse)
