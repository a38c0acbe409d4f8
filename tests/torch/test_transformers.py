"""register_transformers: tiny transformers models built from small configs with random
weights (no download) on attn_implementation="numba_fa" against the same weights on "eager":
a BERT-style encoder on a padded batch, a Llama-style causal LM with GQA (padded and not)."""

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
