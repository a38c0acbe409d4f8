"""The code docs/torch.md shows, run: a decode loop over a KV cache with
flash_attn_with_kvcache, and a learned relative-position bias table trained through
flex_attention (its gradient against torch float64 autograd)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_kvcache_decode_loop():
    from numba_flash.torch import flash_attn_func
    torch.manual_seed(0)
    batch, heads, d, max_len = 2, 2, 16, 12
    prompt = torch.randn(batch, 4, heads, d, dtype=torch.float16)
    # [docs:torch-kvcache]
    from numba_flash.torch import flash_attn_with_kvcache

    k_cache = torch.zeros(batch, max_len, heads, d, dtype=torch.float16)  # flash-attn's layout
    v_cache = torch.zeros_like(k_cache)
    lens = torch.zeros(batch, dtype=torch.int32)
    q = k = v = prompt                                    # the prompt: 4 tokens per sequence
    for step in range(3):                                 # then one token per step
        out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                      causal=True)        # appends k, v in place, attends
        lens += k.shape[1]
        q = k = v = out[:, -1:]                           # (a model would project here)
    # [/docs:torch-kvcache]
    assert lens.tolist() == [6, 6]
    assert torch.equal(k_cache[:, :4], prompt) and torch.equal(v_cache[:, :4], prompt)
    assert not k_cache[:, 6:].any()  # nothing written past the sequences
    # step 2's query is its key, stored at position 5: the same attention through the forward
    want = flash_attn_func(k_cache[:, 5:6], k_cache[:, :6], v_cache[:, :6], causal=True)
    err = (out - want).abs().max().item()
    assert err <= 1e-3  # both in float32, rounded once to float16: measured 0; bound 1 ulp at 2


def test_learned_relative_bias_table():
    torch.manual_seed(0)
    # [docs:torch-flex-table]
    from numba_flash.flex import atomic_add
    from numba_flash.torch import flex_attention

    B, H, N, D = 1, 2, 16, 8
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
    table = torch.zeros(H, 2 * N - 1, requires_grad=True)   # T5-style relative bias, learned

    def rel_bias(score, b, h, q_idx, kv_idx, table):         # the table comes as an argument
        return score + table[h, q_idx - kv_idx + N - 1]

    def rel_bias_grad(score, b, h, q_idx, kv_idx, table):    # d rel_bias / d score
        return 1.0

    def rel_bias_aux(grad_score, score, b, h, q_idx, kv_idx, grads, table):
        atomic_add(grads[0], (h, q_idx - kv_idx + N - 1), grad_score)   # d / d table = 1

    def causal(b, h, q_idx, kv_idx, table):
        return q_idx >= kv_idx

    out = flex_attention(q, k, v, score_mod=rel_bias, aux_tensors=(table,),
                         score_mod_grad=rel_bias_grad, aux_grad=rel_bias_aux, mask_mod=causal)
    out.square().sum().backward()                            # table.grad: [H, 2N - 1]
    # [/docs:torch-flex-table]
    got = [x.grad for x in (q, k, v, table)]
    qd, kd, vd, td = (x.detach().double().requires_grad_() for x in (q, k, v, table))
    s = qd @ kd.transpose(-1, -2) * D ** -0.5
    i, j = torch.arange(N)[:, None], torch.arange(N)[None]
    s = (s + td[torch.arange(H)[:, None, None], i - j + N - 1]).masked_fill(j > i, float("-inf"))
    (torch.softmax(s, -1) @ vd).square().sum().backward()
    for g, x in zip(got, (qd, kd, vd, td)):
        # float32 kernels vs float64: measured 1.1e-7 .. 2.2e-7 of max |grad| (test_aux_grad:
        # up to 4.4e-7 over 5 seeds); the bound of test_aux_grad
        assert (g - x.grad).abs().max() <= 2e-6 * x.grad.abs().max()
    assert table.grad[:, :N - 1].abs().max() == 0  # causal: no key after the query
