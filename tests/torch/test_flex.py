"""numba_flash.torch.flex_attention / create_block_mask against torch's FlexAttention on
attention-gym's eight standard variants (causal, sliding window, prefix LM, document ids, ALiBi
with learnable slopes, tanh softcap, relative position, a learned relative-bias table [H, 2N - 1]):
outputs and lse against ``torch.nn.attention.flex_attention`` (eager, CPU), gradients of q, k, v
and of the learnable aux tensors against torch float64 autograd of the same functions (torch's
FlexAttention has no backward on a CPU); FlashAttention-4's arguments on flash_attn_func /
flash_attn_varlen_func; the checks before any launch."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import numba_flash.torch as nft  # noqa: E402
from numba_flash.flex import atomic_add  # noqa: E402
from torch_helpers import randn  # noqa: E402

B, H, N, D = 1, 2, 16, 8
W = 5           # sliding window
SOFTCAP = 2.0
BLOCK = 16      # the smallest block size
TOL = 1e-14     # float64 against float64 (measured figures at the comparisons)


# -- numba_flash's functions: scalars, the tensors they read as aux arguments ----------------
def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx and q_idx - kv_idx <= W


def prefix_lm(b, h, q_idx, kv_idx, prefix):
    return kv_idx < prefix[b] or kv_idx <= q_idx


def document(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def alibi(score, b, h, q_idx, kv_idx, slopes):
    return score + slopes[h] * (kv_idx - q_idx)


def alibi_aux(grad_score, score, b, h, q_idx, kv_idx, grads, slopes):
    atomic_add(grads[0], h, grad_score * (kv_idx - q_idx))


def softcap(score, b, h, q_idx, kv_idx):
    return SOFTCAP * math.tanh(score / SOFTCAP)


def softcap_grad(score, b, h, q_idx, kv_idx):
    t = math.tanh(score / SOFTCAP)
    return 1.0 - t * t


def relative(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx)


def table(score, b, h, q_idx, kv_idx, bias):
    return score + bias[h, q_idx - kv_idx + N - 1]


def table_aux(grad_score, score, b, h, q_idx, kv_idx, grads, bias):
    atomic_add(grads[0], (h, q_idx - kv_idx + N - 1), grad_score)


def one(score, b, h, q_idx, kv_idx):
    return 1.0


def one_aux1(score, b, h, q_idx, kv_idx, a):
    return 1.0


# -- the same in torch ops, for FlexAttention (closures) and the dense reference ------------
def _aux(gen, name):
    if name == "prefix":
        return torch.tensor([5], dtype=torch.int32)
    if name == "document":
        return torch.tensor([[0] * 5 + [1] * 8 + [2] * 3], dtype=torch.int32)
    if name == "alibi":
        return (0.1 + 0.2 * torch.rand(H, generator=gen, dtype=torch.float64)).requires_grad_()
    if name == "table":
        return randn(gen, H, 2 * N - 1, dtype=torch.float64, requires_grad=True)
    return None


def _torch_fns(name, a):
    """``(score_mod, mask_mod)`` in torch ops over ``a`` (FlexAttention's form)."""
    return {
        "causal": (None, lambda b, h, q, kv: q >= kv),
        "sliding": (None, lambda b, h, q, kv: (q >= kv) & (q - kv <= W)),
        "prefix": (None, lambda b, h, q, kv: (kv < a[b]) | (kv <= q)),
        "document": (None, lambda b, h, q, kv: a[b, q] == a[b, kv]),
        "alibi": (lambda s, b, h, q, kv: s + a[h] * (kv - q), None),
        "softcap": (lambda s, b, h, q, kv: SOFTCAP * torch.tanh(s / SOFTCAP), None),
        "relative": (lambda s, b, h, q, kv: s + (q - kv), None),
        "table": (lambda s, b, h, q, kv: s + a[h, q - kv + N - 1], None),
    }[name]


#: name: (score_mod, score_mod_grad, mask_mod, aux_grad) of numba_flash
OURS = {"causal": (None, None, causal, None), "sliding": (None, None, sliding, None),
        "prefix": (None, None, prefix_lm, None), "document": (None, None, document, None),
        "alibi": (alibi, one_aux1, None, alibi_aux), "softcap": (softcap, softcap_grad, None, None),
        "relative": (relative, one, None, None), "table": (table, one_aux1, None, table_aux)}


def _dense(q, k, v, score_mod, mask_mod):
    """float64 attention with the torch functions applied on index grids."""
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    b = torch.arange(B)[:, None, None, None]
    h = torch.arange(H)[None, :, None, None]
    qi, kv = torch.arange(N)[:, None], torch.arange(N)[None]
    if score_mod is not None:
        s = score_mod(s, b, h, qi, kv)
    if mask_mod is not None:
        s = s.masked_fill(~mask_mod(b, h, qi, kv).expand(s.shape), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


@pytest.mark.parametrize("name", sorted(OURS))
def test_eight_variants_match_flex_attention(gen, name):
    q, k, v, dout = (randn(gen, B, H, N, D, dtype=torch.float64, requires_grad=True)
                     for _ in range(4))
    a = _aux(gen, name)
    aux = () if a is None else (a,)
    t_score, t_mask = _torch_fns(name, a)
    score_mod, score_mod_grad, mask_mod, aux_grad = OURS[name]
    block_mask = None
    if name == "causal":  # a block mask (the others pass mask_mod: one Numba build less each)
        block_mask = nft.create_block_mask(mask_mod, B, None, N, N, BLOCK_SIZE=BLOCK)
        mask_mod = None
    out, lse = nft.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask,
                                  return_lse=True, aux_tensors=aux,
                                  score_mod_grad=score_mod_grad, aux_grad=aux_grad,
                                  mask_mod=mask_mod)
    out.backward(dout)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention's eager-mode notice
        t_block = (None if t_mask is None else
                   flex.create_block_mask(t_mask, B, None, N, N, device="cpu", BLOCK_SIZE=BLOCK))
        t_out, t_lse = flex.flex_attention(q.detach(), k.detach(), v.detach(), score_mod=t_score,
                                           block_mask=t_block, return_lse=True)
    # float64 on both sides; measured 2026-12-01 over 3 seeds, all eight variants: max |out -
    # t_out| <= 1.9e-15, |lse - t_lse| <= 1.8e-15, gradients within 1.2e-15 of max(1, |grad|)
    assert (out - t_out).abs().max() < TOL
    assert (lse - t_lse).abs().max() < TOL
    leaves = [q, k, v] + [x for x in aux if x.requires_grad]
    got = [x.grad for x in leaves]
    for x in leaves:
        x.grad = None
    ref_out, _ = _dense(q, k, v, t_score, t_mask)
    ref_out.backward(dout)
    for g, x in zip(got, leaves):
        assert (g - x.grad).abs().max() < TOL * max(1.0, x.grad.abs().max().item())


def test_create_block_mask_classifies_blocks_as_flexattention(gen):
    """FlexAttention's signature (B / H None broadcast, device accepted) and classification:
    the causal mask over 2 x 2 blocks is FULL, EMPTY / PARTIAL, FULL (the kernels never load the
    EMPTY block: tests/flex), and the aux tensors are read on the host."""
    n = 2 * BLOCK
    bm = nft.create_block_mask(causal, None, None, n, n, device="cpu", BLOCK_SIZE=BLOCK)
    assert bm.shape == (1, 1, n, n) and bm.kind[0, 0].tolist() == [[1, 0], [2, 1]]
    doc = torch.tensor([[0] * 7 + [1] * 25, [0] * 16 + [1] * 16], dtype=torch.int32)
    bm = nft.create_block_mask(document, 2, None, n, n, BLOCK_SIZE=BLOCK, aux_tensors=(doc,))
    assert bm.kind[1].tolist() == [[[2, 0], [0, 2]]]  # two documents of 16 tokens
    assert bm.kind[0].tolist() == [[[1, 1], [1, 2]]]


def test_flash_attn_func_takes_flashattention4_variant_arguments(gen):
    """``score_mod`` with FlashAttention-4's ``score_mod_bwd`` (grad, score, ...), an aux table
    that learns through ``aux_grad``, a ``block_sparse_tensors`` block mask and-ed with
    ``causal``, in flash-attn's [B, N, H, d] layout, and the varlen form."""
    q, k, v = (randn(gen, 1, N, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bias = randn(gen, H, 2 * N - 1, dtype=torch.float64, requires_grad=True)

    def table_bwd(grad, score, b, h, q_idx, kv_idx, bias):
        return grad

    def window(b, h, q_idx, kv_idx, bias):
        return q_idx - kv_idx <= W

    bm = nft.create_block_mask(window, None, None, N, N, BLOCK_SIZE=BLOCK, aux_tensors=(bias,))
    out = nft.flash_attn_func(q, k, v, causal=True, score_mod=table, score_mod_bwd=table_bwd,
                              aux_tensors=[bias], aux_grad=table_aux, block_sparse_tensors=bm)
    out.sum().backward()
    got = [x.grad for x in (q, k, v, bias)]
    for x in (q, k, v, bias):
        x.grad = None
    t_score, _ = _torch_fns("table", bias)
    ref, _ = _dense(*(x.transpose(1, 2) for x in (q, k, v)), t_score,
                    lambda b, h, qi, kv: (qi >= kv) & (qi - kv <= W))
    # measured over 3 seeds: out within 1.1e-15, gradients 1.6e-15 (relative), varlen 0
    assert (out.transpose(1, 2) - ref).abs().max() < TOL
    ref.sum().backward()
    for g, x in zip(got, (q, k, v, bias)):
        assert (g - x.grad).abs().max() < TOL * max(1.0, x.grad.abs().max().item())
    # varlen: the batch of one sequence, packed; b is the sequence
    qv, kv_, vv = (x.detach()[0].requires_grad_() for x in (q, k, v))
    cu = torch.tensor([0, N], dtype=torch.int32)
    out_v = nft.flash_attn_varlen_func(qv, kv_, vv, cu, cu, N, N, causal=True, score_mod=table,
                                       score_mod_grad=one_aux1, aux_tensors=(bias.detach(),),
                                       mask_mod=window)
    assert (out_v - out[0]).abs().max() < TOL
    out_v.sum().backward()
    assert (qv.grad - got[0][0]).abs().max() < TOL * got[0].abs().max()


def _qkv(gen, requires_grad=False):
    return [randn(gen, 1, H, N, D, requires_grad=requires_grad) for _ in range(3)]


def _wrong_arity(grad_score, score, b, h, q_idx, kv_idx, bias):
    atomic_add(bias, h, grad_score)


@pytest.mark.parametrize("case, exc, match", [
    ("arity", TypeError, r"aux_grad: expected a function of 8 arguments \(grad_score, score, "
                         r"b, h, q_idx, kv_idx, grads and 1 aux tensor\(s\)\), got _wrong_arity"),
    ("device", ValueError, r"aux_tensors\[0\]: expected a tensor on cpu \(the device of query\), "
                           r"got one on meta"),
    ("mask_shape", ValueError, r"block_mask: expected a mask for \[B, H, Nq, Nk\] = \[1, 2, 16, "
                               r"16\] \(B and H may be 1\), got one created for \[1, 1, 16, 32\]"),
    ("torch_mask", TypeError, r"block_mask: expected a numba_flash.flex.BlockMask \(from "
                              r"numba_flash.torch.create_block_mask\), got "
                              r"torch.nn.attention.flex_attention.BlockMask"),
    ("no_aux_grad", ValueError, r"aux_grad: aux_tensors\[0\] requires grad, which needs "
                                r"aux_grad"),
    ("no_grad_fn", ValueError, r"score_mod_grad: the gradients of query, key, value through "
                               r"score_mod table need its derivative"),
    ("gqa", ValueError, r"key: expected 2 heads \(those of query; pass enable_gqa=True"),
])
def test_bad_input_is_an_error_before_any_launch(gen, monkeypatch, case, exc, match):
    """Each raises before anything is launched (a launch would fail the test)."""
    from numba_flash.frontend import ArrayCall

    monkeypatch.setattr(ArrayCall, "launch", lambda *a, **k: pytest.fail("launched"))
    q, k, v = _qkv(gen, requires_grad=case == "no_grad_fn")
    bias = randn(gen, H, 2 * N - 1, dtype=torch.float32, requires_grad=case == "no_aux_grad")
    kw = dict(score_mod=table, score_mod_grad=one_aux1, aux_tensors=(bias,))
    if case == "arity":
        kw["aux_grad"] = _wrong_arity
    elif case == "device":
        kw["aux_tensors"] = (bias.to("meta"),)
    elif case == "mask_shape":
        kw["block_mask"] = nft.create_block_mask(window_mask, None, None, N, 2 * N,
                                                 BLOCK_SIZE=BLOCK, aux_tensors=(bias,))
    elif case == "torch_mask":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kw["block_mask"] = flex.create_block_mask(lambda b, h, q_, k_: q_ >= k_, None, None,
                                                      N, N, device="cpu")
    elif case == "no_grad_fn":
        kw["score_mod_grad"] = None
    elif case == "gqa":
        k, v = k[:, :1], v[:, :1]
    with pytest.raises(exc, match=match):
        nft.flex_attention(q, k, v, **kw)


def window_mask(b, h, q_idx, kv_idx, bias):
    return q_idx - kv_idx <= W
