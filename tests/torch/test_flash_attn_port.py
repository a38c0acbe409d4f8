"""flash-attn's own tests of ``flash_attn_with_kvcache`` and of ``flash_attn_varlen_func(...,
block_table=...)``, run against ``numba_flash.torch`` in place of ``flash_attn``.

Ported from flash-attention's ``tests/test_flash_attn.py`` (BSD-3-Clause, Copyright (c) 2023,
Tri Dao): ``test_flash_attn_kvcache``, ``test_flash_attn_kvcache_paged_block_table_bounds`` and
the paged cases of ``test_flash_attn_varlen_causal``, with their reference (``attention_ref``,
``construct_local_mask``, ``attn_bias_from_alibi_slopes``, ``_generate_block_kvcache``,
``apply_rotary_emb`` in plain torch) and their tolerance rule (our error at most ``mult`` times
that of the same math in the inputs' dtype, plus 1e-5).  What changed for the simulator and a
CPU: tiny shapes (a few tokens, 4 heads, head dim 32, page blocks of 4 and 8 tokens where
flash-attn needs multiples of 256), one explicit parameter row per case instead of the full
cartesian product (which is about 40 000 cases), CPU tensors, einops spelled out in torch,
``window_size`` drawn as flash-attn does but passed as a tuple of ints (``numba_flash.torch``
takes a tuple or list, not a tensor), and the bounds checks' error type: a ``ValueError`` naming
``block_table`` where flash-attn raises ``RuntimeError``.  The last test is numba_flash's own:
bad arguments of ``flash_attn_with_kvcache`` raise before anything is launched.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from numba_flash.torch import (flash_attn_varlen_func, flash_attn_with_kvcache,  # noqa: E402
                               pad_input, unpad_input)

BF16, F16 = torch.bfloat16, torch.float16


# -- flash-attn's reference helpers, in plain torch ------------------------------------------
def rotate_half(x, interleaved=False):
    if not interleaved:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_emb(x, cos, sin, seqlen_offsets, interleaved=False):
    """flash-attn's ``apply_rotary_emb`` (``x (b, s, h, d)``, per-sequence offsets) in torch,
    computed in float32 and rounded once, as its Triton kernel."""
    ro_dim = cos.shape[-1] * 2
    pos = seqlen_offsets.long()[:, None] + torch.arange(x.shape[1])[None]  # (b, s)
    c, s = cos[pos].float(), sin[pos].float()                                # (b, s, ro/2)
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
    else:
        c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
    c, s = c[:, :, None], s[:, :, None]
    xr = x[..., :ro_dim].float()
    xr = (xr * c + rotate_half(xr, interleaved) * s).to(x.dtype)
    return torch.cat([xr, x[..., ro_dim:]], dim=-1)


def _positions(seqlen_q, seqlen_k, query_padding_mask, key_padding_mask, key_leftpad):
    """``(row_idx, col_idx, sk, sq)`` as flash-attn's two helpers below compute them (key
    columns counted from the left pad, lengths from the padding masks)."""
    row_idx = torch.arange(seqlen_q, dtype=torch.long)[:, None]
    col_idx = torch.arange(seqlen_k, dtype=torch.long)
    if key_leftpad is not None:
        key_leftpad = key_leftpad[:, None, None, None]
        col_idx = col_idx.expand(key_leftpad.shape[0], 1, 1, seqlen_k)
        col_idx = torch.where(col_idx >= key_leftpad, col_idx - key_leftpad, 2**32)
    sk = (seqlen_k if key_padding_mask is None
          else key_padding_mask.sum(-1)[:, None, None, None])
    sq = (seqlen_q if query_padding_mask is None
          else query_padding_mask.sum(-1)[:, None, None, None])
    return row_idx, col_idx, sk, sq


def attn_bias_from_alibi_slopes(slopes, seqlen_q, seqlen_k, query_padding_mask=None,
                                key_padding_mask=None, causal=False, key_leftpad=None):
    slopes = slopes[:, :, None, None]
    if causal:
        return torch.arange(-seqlen_k + 1, 1, dtype=torch.float32) * slopes
    row_idx, col_idx, sk, sq = _positions(seqlen_q, seqlen_k, query_padding_mask,
                                          key_padding_mask, key_leftpad)
    relative_pos = torch.abs(row_idx + sk - sq - col_idx)
    return -slopes * relative_pos.to(dtype=slopes.dtype)


def generate_random_padding_mask(max_seqlen, batch_size, mode="random"):
    if mode == "full":
        lengths = torch.full((batch_size, 1), max_seqlen, dtype=torch.int32)
    else:
        lengths = torch.randint(max(1, max_seqlen - 20), max_seqlen + 1, (batch_size, 1))
    return torch.arange(max_seqlen).expand(batch_size, max_seqlen) < lengths


def construct_local_mask(seqlen_q, seqlen_k, window_size=(-1, -1), query_padding_mask=None,
                         key_padding_mask=None, key_leftpad=None):
    row_idx, col_idx, sk, sq = _positions(seqlen_q, seqlen_k, query_padding_mask,
                                          key_padding_mask, key_leftpad)
    if window_size[0] < 0:
        return col_idx > row_idx + sk - sq + window_size[1]
    sk = torch.full_like(col_idx, seqlen_k) if key_padding_mask is None else sk
    return torch.logical_or(col_idx > torch.minimum(row_idx + sk - sq + window_size[1], sk),
                            col_idx < row_idx + sk - sq - window_size[0])


def attention_ref(q, k, v, query_padding_mask=None, key_padding_mask=None, attn_bias=None,
                  causal=False, window_size=(-1, -1), upcast=True, reorder_ops=False,
                  key_leftpad=None):
    """flash-attn's ``attention_ref`` (no dropout, no softcap: what these tests use)."""
    if causal:
        window_size = (window_size[0], 0)
    dtype_og = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    seqlen_q, seqlen_k = q.shape[1], k.shape[1]
    k = k.repeat_interleave(q.shape[2] // k.shape[2], 2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], 2)
    d = q.shape[-1]
    if not reorder_ops:
        scores = torch.einsum("bthd,bshd->bhts", q / math.sqrt(d), k)
    else:
        scores = torch.einsum("bthd,bshd->bhts", q, k / math.sqrt(d))
    if key_padding_mask is not None:
        scores.masked_fill_(~key_padding_mask[:, None, None, :], float("-inf"))
    local_mask = None
    if window_size[0] >= 0 or window_size[1] >= 0:
        local_mask = construct_local_mask(seqlen_q, seqlen_k, window_size, query_padding_mask,
                                          key_padding_mask, key_leftpad=key_leftpad)
        scores.masked_fill_(local_mask, float("-inf"))
    if attn_bias is not None:
        scores = scores + attn_bias
    attention = torch.softmax(scores, dim=-1).to(v.dtype)
    if local_mask is not None:  # fully masked rows give 0, not NaN
        attention = attention.masked_fill(torch.all(local_mask, dim=-1, keepdim=True), 0.0)
    if query_padding_mask is not None:
        attention = attention.masked_fill(~query_padding_mask[:, None, :, None], 0.0)
    output = torch.einsum("bhts,bshd->bthd", attention, v)
    if query_padding_mask is not None:
        output.masked_fill_(~query_padding_mask[:, :, None, None], 0.0)
    return output.to(dtype=dtype_og), attention.to(dtype=dtype_og)


def _gather_pages(paged, block_table, batch_size, seqlen_k):
    """``rearrange(paged[block_table.flatten()], "(b nblocks) block_size ... -> b (nblocks
    block_size) ...")[:, :seqlen_k]``."""
    x = paged[block_table.to(dtype=torch.long).flatten()]
    return x.reshape(batch_size, -1, *paged.shape[2:])[:, :seqlen_k]


def _generate_block_kvcache(seqlen_k, paged_kv_block_size, batch_size, nheads_k, d, dtype):
    num_blocks = math.ceil(seqlen_k / paged_kv_block_size) * batch_size * 3
    k_cache_paged = torch.randn(num_blocks, paged_kv_block_size, nheads_k, d, dtype=dtype)
    v_cache_paged = torch.randn(num_blocks, paged_kv_block_size, nheads_k, d, dtype=dtype)
    block_table = torch.randperm(num_blocks, dtype=torch.int32).reshape(batch_size, -1)
    k_cache = _gather_pages(k_cache_paged, block_table, batch_size, seqlen_k)
    v_cache = _gather_pages(v_cache_paged, block_table, batch_size, seqlen_k)
    return k_cache, v_cache, block_table, k_cache_paged, v_cache_paged, num_blocks


def _window(local, seqlen_k):
    # flash-attn draws torch.randint(0, seqlen_k, (2,)); numba_flash.torch takes a tuple
    return (-1, -1) if not local else tuple(int(w) for w in torch.randint(0, seqlen_k, (2,)))


# -- test_flash_attn_kvcache -----------------------------------------------------------------
#: (seqlen_q, seqlen_k, d, has_batch_idx, has_leftpad, paged_kv_block_size, rotary_fraction,
#:  rotary_interleaved, seqlen_new_eq_seqlen_q, causal, local, alibi, new_kv, mha_type,
#:  num_splits, dtype): the plain, paged, appended, rotary, left-padded and cache_batch_idx cases
KVCACHE_CASES = [
    (1, 16, 32, False, False, None, 0.0, False, True, False, False, False, False, "mha", 1, F16),
    (3, 20, 32, False, False, None, 0.0, False, True, True, False, True, False, "gqa", 0, BF16),
    (1, 16, 32, False, False, 8, 0.0, False, True, False, False, False, False, "mqa", 0, F16),
    (4, 24, 32, False, False, 8, 0.0, False, True, True, True, False, True, "gqa", 0, BF16),
    (4, 16, 32, False, False, None, 0.0, False, False, True, False, False, True, "mha", 1, F16),
    (3, 16, 32, False, False, None, 1.0, False, True, True, False, False, True, "gqa", 0, F16),
    (3, 16, 32, False, False, None, 0.5, True, True, False, False, False, True, "mha", 0, BF16),
    (2, 16, 32, False, False, 4, 1.0, True, True, True, False, True, True, "mqa", 0, F16),
    (3, 20, 32, False, True, None, 0.0, False, True, True, False, False, True, "gqa", 0, F16),
    (1, 16, 32, False, True, None, 0.0, False, True, False, True, True, False, "mha", 0, BF16),
    (3, 16, 32, True, False, None, 0.0, False, True, True, False, False, True, "gqa", 1, F16),
    (2, 16, 32, True, False, None, 0.5, False, False, False, True, False, True, "mha", 0, BF16),
]


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, d, has_batch_idx, has_leftpad, paged_kv_block_size, rotary_fraction, "
    "rotary_interleaved, seqlen_new_eq_seqlen_q, causal, local, alibi, new_kv, mha_type, "
    "num_splits, dtype", KVCACHE_CASES)
def test_flash_attn_kvcache(seqlen_q, seqlen_k, d, has_batch_idx, has_leftpad,
                            paged_kv_block_size, rotary_fraction, rotary_interleaved,
                            seqlen_new_eq_seqlen_q, causal, local, alibi, new_kv, mha_type,
                            num_splits, dtype):
    if seqlen_q > seqlen_k and new_kv:
        pytest.skip()
    if not new_kv and rotary_fraction > 0.0:
        pytest.skip()
    if has_batch_idx and paged_kv_block_size is not None:
        pytest.skip()
    if has_leftpad and paged_kv_block_size is not None:
        pytest.skip()
    torch.random.manual_seed(0)
    batch_size = 2
    batch_size_cache = batch_size if not has_batch_idx else batch_size * 2
    nheads = 4
    rotary_dim = math.floor(int(rotary_fraction * d) / 16) * 16
    nheads_k = nheads if mha_type == "mha" else (1 if mha_type == "mqa" else 2)
    window_size = _window(local, seqlen_k)
    q = torch.randn(batch_size, seqlen_q, nheads, d, dtype=dtype)
    seqlen_new = (seqlen_q if seqlen_new_eq_seqlen_q
                  else torch.randint(1, seqlen_q + 1, (1,)).item())
    if new_kv:
        k = torch.randn(batch_size, seqlen_new, nheads_k, d, dtype=dtype)
        v = torch.randn(batch_size, seqlen_new, nheads_k, d, dtype=dtype)
    else:
        k, v = None, None
    if paged_kv_block_size is None:
        k_cache = torch.randn(batch_size_cache, seqlen_k, nheads_k, d, dtype=dtype)
        v_cache = torch.randn(batch_size_cache, seqlen_k, nheads_k, d, dtype=dtype)
        block_table = None
    else:
        (k_cache, v_cache, block_table, k_cache_paged, v_cache_paged,
         num_blocks) = _generate_block_kvcache(seqlen_k, paged_kv_block_size, batch_size,
                                               nheads_k, d, dtype)
    cache_seqlens = torch.randint(
        0 if new_kv else 1,
        # If we don't use seqlen_q in the case of causal and rotary, cos/sin won't be long enough
        ((seqlen_k - (seqlen_q if (causal or local) and rotary_dim > 1 else seqlen_new) + 1)
         if new_kv else (seqlen_k + 1)),
        (batch_size,), dtype=torch.int32)
    if has_leftpad:
        cache_leftpad = torch.cat([
            torch.randint(0, cache_seqlens[i].item(), (1,), dtype=torch.int32)
            if cache_seqlens[i].item() > 0 else torch.zeros(1, dtype=torch.int32)
            for i in range(batch_size)])
    else:
        cache_leftpad = None
    arange = torch.arange(seqlen_k)[None]
    cache_seqlens_expanded = cache_seqlens[:, None]
    key_padding_mask = arange < cache_seqlens_expanded + (seqlen_new if new_kv else 0)
    if has_leftpad:
        key_padding_mask = torch.logical_and(
            key_padding_mask, arange >= cache_leftpad.unsqueeze(-1).expand(-1, seqlen_k))
    if has_batch_idx:
        cache_batch_idx = torch.randperm(batch_size_cache, dtype=torch.int32)[:batch_size]
    else:
        cache_batch_idx = None
    if alibi:
        alibi_slopes = torch.rand(batch_size, nheads, dtype=torch.float32) * 0.3
        attn_bias = attn_bias_from_alibi_slopes(alibi_slopes, seqlen_q, seqlen_k, None,
                                                key_padding_mask, causal=causal,
                                                key_leftpad=cache_leftpad)
    else:
        alibi_slopes, attn_bias = None, None
    if rotary_dim > 0:
        angle = torch.rand(seqlen_k if paged_kv_block_size is None
                           else num_blocks * paged_kv_block_size, rotary_dim // 2) * 2 * math.pi
        cos = torch.cos(angle).to(dtype=dtype)
        sin = torch.sin(angle).to(dtype=dtype)
        if causal or local:
            q_ro = apply_rotary_emb(q, cos, sin, seqlen_offsets=cache_seqlens,
                                    interleaved=rotary_interleaved)
        else:  # every query token at position cache_seqlens
            q_ro = apply_rotary_emb(q.reshape(batch_size, 1, seqlen_q * nheads, d), cos, sin,
                                    seqlen_offsets=cache_seqlens,
                                    interleaved=rotary_interleaved).reshape(q.shape)
        k_ro = apply_rotary_emb(k, cos, sin, seqlen_offsets=cache_seqlens,
                                interleaved=rotary_interleaved)
    else:
        cos, sin = None, None
        q_ro, k_ro = q, k
    k_cache_ref = (k_cache if not has_batch_idx
                   else k_cache[cache_batch_idx.to(dtype=torch.long)]).clone()
    v_cache_ref = (v_cache if not has_batch_idx
                   else v_cache[cache_batch_idx.to(dtype=torch.long)]).clone()
    if new_kv:
        update_mask = torch.logical_and(cache_seqlens_expanded <= arange,
                                        arange < cache_seqlens_expanded + seqlen_new)
        k_cache_ref[update_mask] = k_ro.reshape(-1, nheads_k, d)
        v_cache_ref[update_mask] = v.reshape(-1, nheads_k, d)
    k_cache_rep = k_cache_ref.repeat_interleave(nheads // nheads_k, 2)
    v_cache_rep = v_cache_ref.repeat_interleave(nheads // nheads_k, 2)
    untouched = [x.clone() for x in (q, cache_seqlens) + ((k, v) if new_kv else ())]
    out = flash_attn_with_kvcache(
        q, k_cache if paged_kv_block_size is None else k_cache_paged,
        v_cache if paged_kv_block_size is None else v_cache_paged, k, v, rotary_cos=cos,
        rotary_sin=sin, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, block_table=block_table, causal=causal,
        window_size=window_size, rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes, num_splits=num_splits)
    out_ref, _ = attention_ref(q_ro, k_cache_rep, v_cache_rep, None, key_padding_mask, attn_bias,
                               causal=causal, window_size=window_size, key_leftpad=cache_leftpad)
    out_pt, _ = attention_ref(q_ro, k_cache_rep, v_cache_rep, None, key_padding_mask, attn_bias,
                              causal=causal, window_size=window_size, upcast=False,
                              reorder_ops=True, key_leftpad=cache_leftpad)
    if new_kv:
        if paged_kv_block_size is None:
            k_cache_select = (k_cache if not has_batch_idx
                              else k_cache[cache_batch_idx.to(dtype=torch.long)])
            v_cache_select = (v_cache if not has_batch_idx
                              else v_cache[cache_batch_idx.to(dtype=torch.long)])
        else:
            k_cache_select = _gather_pages(k_cache_paged, block_table, batch_size, seqlen_k)
            v_cache_select = _gather_pages(v_cache_paged, block_table, batch_size, seqlen_k)
        assert torch.allclose(k_cache_select, k_cache_ref, rtol=1e-3, atol=1e-3)
        assert torch.equal(v_cache_select, v_cache_ref)
    for x, c in zip((q, cache_seqlens) + ((k, v) if new_kv else ()), untouched):
        assert torch.equal(x, c)  # nothing but the caches is written
    mult = 3 if not alibi else 5
    assert (out - out_ref).abs().max().item() <= mult * (out_pt - out_ref).abs().max().item() + 1e-5


# -- test_flash_attn_varlen_causal, paged --------------------------------------------------
@pytest.mark.parametrize("seqlen_q, seqlen_k, swap_sq_sk, local, paged_kv_block_size, dtype", [
    (7, 12, False, False, 4, F16), (12, 7, True, True, 8, BF16), (9, 9, False, True, 4, F16)])
def test_flash_attn_varlen_causal_paged(seqlen_q, seqlen_k, swap_sq_sk, local,
                                        paged_kv_block_size, dtype):
    if swap_sq_sk:
        seqlen_q, seqlen_k = seqlen_k, seqlen_q
    causal = True
    d = 32
    torch.random.manual_seed(0)
    batch_size = 2
    nheads = 3
    window_size = _window(local, seqlen_k)
    q = torch.randn(batch_size, seqlen_q, nheads, d, dtype=dtype, requires_grad=True)
    k, v, block_table, k_cache_paged, v_cache_paged, num_blocks = _generate_block_kvcache(
        seqlen_k, paged_kv_block_size, batch_size, nheads, d, dtype)
    query_padding_mask = generate_random_padding_mask(seqlen_q, batch_size)
    key_padding_mask = generate_random_padding_mask(seqlen_k, batch_size)
    q_unpad, _, cu_seqlens_q, max_seqlen_q, _ = unpad_input(q, query_padding_mask)
    _, _, cu_seqlens_k, max_seqlen_k, _ = unpad_input(k, key_padding_mask)
    indices_q = torch.nonzero(query_padding_mask.flatten(), as_tuple=False).flatten()
    out_unpad = flash_attn_varlen_func(q_unpad, k_cache_paged, v_cache_paged, cu_seqlens_q,
                                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0,
                                       causal=causal, window_size=window_size,
                                       block_table=block_table)
    out = pad_input(out_unpad, indices_q, batch_size, seqlen_q)
    out_ref, _ = attention_ref(q, k, v, query_padding_mask, key_padding_mask, None,
                               causal=causal, window_size=window_size)
    out_pt, _ = attention_ref(q, k, v, query_padding_mask, key_padding_mask, None,
                              causal=causal, window_size=window_size, upcast=False,
                              reorder_ops=True)
    assert (out - out_ref).abs().max().item() <= 2 * (out_pt - out_ref).abs().max().item() + 1e-5
    # test_backward = block_table is None: no gradient with a paged cache (flash-attn has none)
    with pytest.raises(NotImplementedError, match="block_table"):
        out_unpad.sum().backward()


# -- test_flash_attn_kvcache_paged_block_table_bounds --------------------------------------
@pytest.mark.parametrize("append_knew", [False, True])
def test_flash_attn_kvcache_paged_block_table_bounds(append_knew):
    dtype, paged_kv_block_size = F16, 16
    batch_size, nheads, d = 1, 1, 32
    max_num_blocks_per_seq = 1
    capacity = max_num_blocks_per_seq * paged_kv_block_size
    num_blocks = 4
    k_cache_paged = torch.randn(num_blocks, paged_kv_block_size, nheads, d, dtype=dtype)
    v_cache_paged = torch.randn(num_blocks, paged_kv_block_size, nheads, d, dtype=dtype)
    block_table = torch.zeros(batch_size, max_num_blocks_per_seq, dtype=torch.int32)
    q = torch.randn(batch_size, 1, nheads, d, dtype=dtype)
    if append_knew:  # full at capacity: one more key overflows the block table
        k_new = torch.randn(batch_size, 1, nheads, d, dtype=dtype)
        v_new = torch.randn(batch_size, 1, nheads, d, dtype=dtype)
        cache_seqlens = torch.full((batch_size,), capacity, dtype=torch.int32)
    else:
        k_new = v_new = None
        cache_seqlens = torch.full((batch_size,), capacity + 1, dtype=torch.int32)
    before = k_cache_paged.clone()
    with pytest.raises(ValueError, match="block_table"):  # flash-attn: RuntimeError
        flash_attn_with_kvcache(q, k_cache_paged, v_cache_paged, k=k_new, v=v_new,
                                cache_seqlens=cache_seqlens, block_table=block_table,
                                causal=False)
    assert torch.equal(k_cache_paged, before)  # nothing written before the error
    cache_seqlens_ok = torch.full((batch_size,), capacity, dtype=torch.int32)
    out = flash_attn_with_kvcache(q, k_cache_paged, v_cache_paged, cache_seqlens=cache_seqlens_ok,
                                  block_table=block_table, causal=False)
    assert out.shape == (batch_size, 1, nheads, d)
    assert not out.isnan().any()


# -- not from flash-attn: numba_flash's own checks of the torch arguments --------------------
def _kvcache(**over):
    args = dict(q=torch.randn(2, 1, 4, 32, dtype=F16), k_cache=torch.randn(2, 8, 2, 32, dtype=F16),
                v_cache=torch.randn(2, 8, 2, 32, dtype=F16), cache_seqlens=3) | over
    return flash_attn_with_kvcache(**args)


@pytest.mark.parametrize("over, exc, match", [
    (dict(k=torch.randn(2, 1, 2, 32, dtype=F16)), ValueError,
     r"v: expected a tensor with k \(both or neither\), got None"),
    (dict(v_cache=torch.randn(2, 8, 1, 16, dtype=F16)), ValueError,
     r"v_cache: expected the shape of k_cache \(2, 8, 2, 32\) but for the last dim "
     r"\(headdim_v\), got \(2, 8, 1, 16\)"),
    (dict(k=torch.randn(2, 1, 4, 32, dtype=F16), v=torch.randn(2, 1, 4, 32, dtype=F16)),
     ValueError, r"k: expected shape \(batch_size, seqlen_new, nheads_k, headdim\) = \(2, "
                 r"seqlen_new, 2, 32\)"),
    (dict(k_cache=torch.randn(2, 8, 2, 32)), TypeError,
     r"k_cache: expected dtype float16 \(the dtype of q\), got float32"),
    (dict(cache_seqlens=torch.tensor([1.0, 2.0])), TypeError, r"cache_seqlens: expected dtype in"),
    (dict(cache_seqlens=torch.tensor([9, 1], dtype=torch.int32)), ValueError,
     r"cache_seqlens: expected every entry <= Nmax = 8"),
    (dict(block_table=torch.zeros(2, 1, dtype=torch.int32, device="meta")), TypeError,
     r"block_table: expected a dense \(strided\) tensor with values, got a meta tensor"),
    (dict(num_splits=-1), ValueError, r"num_splits: expected an int >= 0 \(0: automatic\)"),
])
def test_flash_attn_with_kvcache_bad_input(monkeypatch, over, exc, match):
    from numba_flash.frontend import ArrayCall

    monkeypatch.setattr(ArrayCall, "launch", lambda *a, **k: pytest.fail("launched"))
    with pytest.raises(exc, match=match):
        _kvcache(**over)
