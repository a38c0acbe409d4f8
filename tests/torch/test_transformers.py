"""register_transformers: tiny transformers models built from small configs with random
weights (no download) on attn_implementation="numba_fa" against the same weights on "eager":
a BERT-style encoder on a padded batch, a Llama-style causal LM with GQA (padded and not).
attention_forward's keywords (issue 59): GPT-OSS's sinks ``s_aux`` (a bfloat16 parameter, decode
with and without padding) against transformers' own GPT-OSS eager attention, dropout,
``is_causal``, the packed-row keywords, the harmless ones, and a TypeError naming any other.
The five decoder LLMs end to end: test_transformers_decoders.py."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numba_flash.torch as nft  # noqa: E402

NAME = nft.register_transformers("numba_fa")


def _pair(make, config):
    """The model on numba_fa and a copy with the same weights on eager."""
    torch.manual_seed(0)
    ours = make(copy.deepcopy(config), attn_implementation=NAME)  # one config each: the
    eager = make(copy.deepcopy(config), attn_implementation="eager")  # choice is stored there
    eager.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == NAME
    return ours, eager


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _compare_grads(ours, eager, atol):
    g_ours, g_eager = _grads(ours), _grads(eager)
    assert g_ours.keys() == g_eager.keys() and g_ours
    for name in g_ours:
        torch.testing.assert_close(g_ours[name], g_eager[name], atol=atol, rtol=0, msg=name)


def test_bert_padded_batch_matches_eager():
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    ours, eager = _pair(transformers.AutoModel.from_config, config)
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    outs = []
    for model in (ours, eager):
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (h * mask[..., None]).square().sum().backward()  # a loss on the real tokens only
        outs.append(h)
    valid = mask.bool()  # equal only if the padding was masked (the mask function's job)
    torch.testing.assert_close(outs[0][valid], outs[1][valid], atol=2e-5, rtol=0)
    # and the padding was masked, not attended to: the padded row alone (no padding) agrees
    alone = ours(input_ids=ids[1:, :4]).last_hidden_state[0]
    torch.testing.assert_close(outs[0][1, :4], alone, atol=2e-5, rtol=0)
    _compare_grads(ours, eager, 1e-5)


def _llama_config():
    return transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=32,
                                    attention_dropout=0.0)


@pytest.mark.parametrize("padded", [False, True], ids=["full", "left-padded"])
def test_llama_gqa_causal_lm_matches_eager(padded):
    ours, eager = _pair(transformers.AutoModelForCausalLM.from_config, _llama_config())
    ids = torch.randint(1, 40, (2, 6), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(2, 6, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    # no loss on a label predicted from a padded position (its logits are garbage in eager
    # and 0-attention in numba_fa): the first real token of the padded row is -100 too
    labels = ids.masked_fill(mask == 0, -100)
    if padded:
        labels[1, 2] = -100
    outs = []
    for model in (ours, eager):
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outs.append(out)
    valid = mask.bool()
    torch.testing.assert_close(outs[0].logits[valid], outs[1].logits[valid], atol=2e-5, rtol=0)
    torch.testing.assert_close(outs[0].loss, outs[1].loss, atol=1e-6, rtol=0)
    _compare_grads(ours, eager, 1e-5)


def test_llama_packed_sequences_match_eager():
    """Three sequences packed into one row, told apart only by restarting position_ids (what
    transformers' flash path and eager's packed-sequence mask both read): no attention across
    sequences."""
    ours, eager = _pair(transformers.AutoModelForCausalLM.from_config, _llama_config())
    ids = torch.randint(1, 40, (1, 9), generator=torch.Generator().manual_seed(6))
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    # use_cache=False: eager builds its packed-sequence mask only without a cache (training)
    logits = [m(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
              for m in (ours, eager)]
    torch.testing.assert_close(logits[0], logits[1], atol=2e-5, rtol=0)
    alone = ours(input_ids=ids[:, 3:5], position_ids=pos[:, 3:5]).logits[0]
    torch.testing.assert_close(logits[0][3:5], alone, atol=2e-5, rtol=0)


def test_flattening_collator_keywords(gen):
    """cu_seq_lens_q/k and max_length_q/k (DataCollatorWithFlattening) split the row into its
    sequences: each equals flash_attn_func on that sequence alone."""
    from types import SimpleNamespace

    from numba_flash.torch.transformers import attention_forward
    from torch_helpers import randn

    query, key, value = randn(gen, 1, 2, 7, 4), randn(gen, 1, 1, 7, 4), randn(gen, 1, 1, 7, 4)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    out, weights = attention_forward(SimpleNamespace(is_causal=True), query, key, value, None,
                                     cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                                     max_length_k=4)
    assert weights is None and out.shape == (1, 7, 2, 4)
    for s, e in ((0, 3), (3, 7)):
        alone = nft.flash_attn_func(*(x[:, :, s:e].transpose(1, 2) for x in (query, key, value)),
                                    causal=True)
        torch.testing.assert_close(out[:, s:e], alone, atol=1e-6, rtol=0)
    # without max_length_q/k they are read off the offsets; one offset tensor alone is refused
    again = attention_forward(SimpleNamespace(is_causal=True), query, key, value, None,
                              cu_seq_lens_q=cu, cu_seq_lens_k=cu)[0]
    torch.testing.assert_close(again, out, atol=0, rtol=0)
    with pytest.raises(ValueError, match="cu_seq_lens_k: expected a tensor with cu_seq_lens_q"):
        attention_forward(SimpleNamespace(is_causal=True), query, key, value, None,
                          cu_seq_lens_q=cu)


def _qkv(gen, nq=3, nk=5):
    """transformers' layout: query ``[B, H, Nq, d]``, key/value ``[B, Hkv, Nk, d]`` (GQA 2:1)."""
    from torch_helpers import randn

    return randn(gen, 2, 2, nq, 8), randn(gen, 2, 1, nk, 8), randn(gen, 2, 1, nk, 8)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "left-padded"])
def test_s_aux_is_the_learnable_sink(gen, padded):
    """GPT-OSS's ``s_aux=self.sinks`` (here a bfloat16 parameter) against transformers' own
    GPT-OSS eager attention on a decode-like call (3 queries, the last of 5 keys; causal):
    output, and gradients for q, k, v and the sinks, which arrive in the parameter's dtype."""
    from types import SimpleNamespace

    from numba_flash.torch.transformers import attention_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    query, key, value = (x.requires_grad_() for x in _qkv(gen))
    sinks = torch.nn.Parameter(torch.tensor([1.5, -0.75], dtype=torch.bfloat16))
    mask = torch.ones(2, 5, dtype=torch.long)
    if padded:
        mask[1, :3] = 0
    module = SimpleNamespace(is_causal=True, sinks=sinks)
    out = attention_forward(module, query, key, value, mask if padded else None, scaling=8**-0.5,
                            s_aux=sinks, deterministic=True)[0]
    # the reference: the additive 4-D mask eager gets (causal, bottom-right, padded keys)
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (query, key, value))
    sinks_ref = torch.nn.Parameter(sinks.detach().float())
    visible = (torch.arange(5)[None, :] <= torch.arange(3)[:, None] + 2) & mask.bool()[:, None]
    additive = torch.zeros(2, 1, 3, 5).masked_fill(~visible[:, None], torch.finfo().min)
    ref_module = SimpleNamespace(num_key_value_groups=2, sinks=sinks_ref, training=False)
    want = eager_attention_forward(ref_module, qr, kr, vr, additive, scaling=8**-0.5)[0]
    rows = mask.bool()[:, -3:]  # the padded row's first query is padding: 0 here, eager's mix
    # measured over three seeds, both paths: out 2.4e-7, q/k/v gradients 7.2e-7
    torch.testing.assert_close(out[rows], want[rows], atol=1e-6, rtol=0)
    weights = torch.randn(out.shape, generator=gen)[rows]
    (out[rows] * weights).sum().backward()
    (want[rows] * weights).sum().backward()
    for got, ref in ((query, qr), (key, kr), (value, vr)):
        torch.testing.assert_close(got.grad, ref.grad, atol=3e-6, rtol=0)
    # the float32 dsink rounded once to bfloat16 (at most 2**-9 relative)
    assert sinks.grad.dtype == torch.bfloat16 and sinks.grad.abs().min() > 0
    torch.testing.assert_close(sinks.grad.float(), sinks_ref.grad, atol=0, rtol=2**-8)


def test_dropout_and_is_causal_reach_the_kernel(gen):
    """``dropout`` is the kernel's dropout_p (the same draw as flash_attn_func's from the same
    seed); ``is_causal`` overrides ``module.is_causal``."""
    from types import SimpleNamespace

    from numba_flash.torch.transformers import attention_forward

    query, key, value = _qkv(gen, nq=5)
    flash = [x.transpose(1, 2) for x in (query, key, value)]
    module = SimpleNamespace(is_causal=True)
    torch.manual_seed(7)
    dropped = attention_forward(module, query, key, value, None, dropout=0.5)[0]
    torch.manual_seed(7)
    want = nft.flash_attn_func(*flash, dropout_p=0.5, causal=True)
    torch.testing.assert_close(dropped, want, atol=0, rtol=0)
    assert not torch.allclose(dropped, nft.flash_attn_func(*flash, causal=True))
    full = attention_forward(module, query, key, value, None, is_causal=False)[0]
    torch.testing.assert_close(full, nft.flash_attn_func(*flash), atol=0, rtol=0)


def test_harmless_keywords_change_nothing(gen):
    from types import SimpleNamespace

    from numba_flash.torch.transformers import HARMLESS_KWARGS, attention_forward

    query, key, value = _qkv(gen)
    module = SimpleNamespace(is_causal=True)
    plain = attention_forward(module, query, key, value, None)[0]
    harmless = dict.fromkeys(HARMLESS_KWARGS, True) | dict(num_items_in_batch=torch.tensor(4),
                                                           encoder_hidden_states=None)
    with_all = attention_forward(module, query, key, value, None, output_attentions=False,
                                 **harmless)[0]
    torch.testing.assert_close(with_all, plain, atol=0, rtol=0)


def test_unknown_keywords_are_a_type_error_naming_them(gen):
    """A keyword that might change the result is refused by name, not dropped (issue 59: GPT-OSS's
    s_aux fell into **kwargs and vanished); output_attentions=True is refused too."""
    from types import SimpleNamespace

    from numba_flash.torch.transformers import attention_forward

    query, key, value = _qkv(gen)
    module = SimpleNamespace(is_causal=True)
    with pytest.raises(TypeError, match="attention_forward: unexpected keyword argument 'sinks'"):
        attention_forward(module, query, key, value, None, sinks=torch.zeros(2))
    with pytest.raises(TypeError, match="arguments 'block_table', 'k_cache' "):
        attention_forward(module, query, key, value, None, k_cache=key, block_table=None)
    with pytest.raises(ValueError, match="output_attentions: numba_flash computes no attention"):
        attention_forward(module, query, key, value, None, output_attentions=True)
    # through a model: eager ignores a stray keyword, numba_fa names it
    ours, eager = _pair(transformers.AutoModelForCausalLM.from_config, _llama_config())
    ids = torch.randint(1, 40, (1, 4), generator=gen)
    eager(input_ids=ids, some_new_keyword=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'some_new_keyword'"):
        ours(input_ids=ids, some_new_keyword=1)


def test_register_then_from_config():
    """The page's how-to (docs/torch.md): register, then build a model on "numba_fa"."""
    from transformers import AttentionInterface

    config = _llama_config()
    # [docs:torch-transformers]
    import numba_flash.torch

    numba_flash.torch.register_transformers()  # the name "numba_fa" (no "flash" in it)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="numba_fa")
    # [/docs:torch-transformers]
    assert model.config._attn_implementation == "numba_fa"
    assert AttentionInterface()["numba_fa"] is numba_flash.torch.transformers.attention_forward


def test_register_refuses_a_flash_name():
    with pytest.raises(ValueError, match="name: expected a name without 'flash'"):
        nft.register_transformers("numba_flash")
