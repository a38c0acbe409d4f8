"""register_transformers on the decoder LLMs it serves (issue 59): tiny Llama, Mistral (sliding
window), Qwen2 (windows on some layers), Gemma2 (softcap, alternating windows,
query_pre_attn_scalar) and GPT-OSS (attention sinks, alternating windows) built from configs
with random weights from a fixed seed (nothing downloaded), float32, on attn_implementation=
"numba_fa" against the same weights on "eager": logits and loss on a left-padded batch, the
gradient of every parameter (GPT-OSS's sinks included), greedy cached generation (padded;
GPT-OSS unpadded too).  A negative control per feature (padding, window, softcap, scale,
sinks) runs the same check with numba_fa's attention function replaced by one that drops that
argument and shows it fails by far more than the tolerance: each feature is really
honoured, not equal by luck.

Errors are relative to the largest |value| of eager's tensor (the loss's absolute); the
figures measured on these seeds are in the comments, each bound about 4x the largest.  The
models are shared by a module-scoped fixture: about 31 s of CPU time for the file."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models come from configs: nothing to download
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import numba_flash.torch as nft  # noqa: E402
from numba_flash.torch.transformers import attention_forward  # noqa: E402

NAME = nft.register_transformers("numba_fa")
VOCAB, N = 64, 8
# initializer_range 0.2 (not 0.02) so that scores are large enough for softcap, scale, window
# and sinks to change the result visibly (the negative controls)
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, initializer_range=0.2, pad_token_id=0)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=3),
    # Qwen2: layers from max_window_layers on slide
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, sliding_window=3, use_sliding_window=True,
                                              max_window_layers=1),
    # Gemma2: sliding and full layers alternate; scaling 4 ** -0.5, not head_dim ** -0.5
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, sliding_window=3,
                                                query_pre_attn_scalar=4,
                                                attn_logit_softcapping=1.0),
    # GPT-OSS: sliding and full layers alternate, sinks, a tiny MoE; YaRN's factor made to
    # agree with the position range (else transformers warns)
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON, sliding_window=3, num_local_experts=4, num_experts_per_tok=2,
        rope_parameters=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                             truncate=False, original_max_position_embeddings=2)),
}
# measured on these seeds (max over the five models): logits 6.4e-7 (llama), loss 9.5e-7
# absolute, gradients 1.8e-6 (per parameter; GPT-OSS's sinks 6.3e-7), logits of the generate
# steps 9.4e-7 (llama)
LOGITS_TOL, LOSS_TOL, GRAD_TOL = 4e-6, 4e-6, 8e-6

IDS = torch.randint(1, VOCAB, (2, N), generator=torch.Generator().manual_seed(1))
MASK = torch.ones(2, N, dtype=torch.long)
MASK[1, :3] = 0  # row 1 left-padded (generate's padding side for decoders)
VALID = MASK.bool()
# no loss on a label predicted from a padded position (its logits are garbage in eager and
# 0-attention in numba_fa): the first real token of the padded row is -100 too
LABELS = IDS.masked_fill(MASK == 0, -100)
LABELS[1, 3] = -100


def _rel(ours, eager):
    return ((ours - eager).abs().max() / eager.abs().max()).item()


@pytest.fixture(scope="module", params=list(CONFIGS))
def run(request):
    """Both models of one architecture after one forward and backward on the padded batch."""
    make = CONFIGS[request.param]
    torch.manual_seed(0)
    ours = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation=NAME)
    eager = transformers.AutoModelForCausalLM.from_config(make(), attn_implementation="eager")
    eager.load_state_dict(ours.state_dict())
    assert ours.config._attn_implementation == NAME
    outs = []
    for model in (ours, eager):
        model.eval()  # no dropout anywhere: the comparison is exact up to rounding
        out = model(input_ids=IDS, attention_mask=MASK, labels=LABELS)
        out.loss.backward()
        outs.append(out)
    return dict(arch=request.param, ours=ours, eager=eager, out=outs[0], out_eager=outs[1])


def test_logits_and_loss_match_eager(run):
    assert _rel(run["out"].logits[VALID], run["out_eager"].logits[VALID]) <= LOGITS_TOL
    assert abs(run["out"].loss.item() - run["out_eager"].loss.item()) <= LOSS_TOL


def test_every_gradient_matches_eager(run):
    ours = dict(run["ours"].named_parameters())
    eager = dict(run["eager"].named_parameters())
    assert ours.keys() == eager.keys()
    for name, p in ours.items():
        assert p.grad is not None and eager[name].grad is not None, name
        assert _rel(p.grad, eager[name].grad) <= GRAD_TOL, name
    if run["arch"] == "gpt_oss":  # the sinks learn: a dropped s_aux left them without gradient
        sinks = [p for name, p in ours.items() if name.endswith("sinks")]
        assert len(sinks) == 2 and all(s.grad.abs().min() > 0 for s in sinks)


def test_cached_generate_matches_eager(run):
    """Greedy decoding with the KV cache, 4 new tokens: one query against a longer cache, through
    flash_attn_varlen_func with the padding mask; GPT-OSS (sinks and window) also without
    padding, through flash_attn_func."""
    batches = [(IDS, MASK)] + [(IDS[:1], MASK[:1])] * (run["arch"] == "gpt_oss")
    for ids, mask in batches:
        gens = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                           do_sample=False, return_dict_in_generate=True, output_logits=True)
                for m in (run["ours"], run["eager"])]
        assert torch.equal(gens[0].sequences, gens[1].sequences)
        for step, (ours, eager) in enumerate(zip(gens[0].logits, gens[1].logits)):
            assert _rel(ours, eager) <= LOGITS_TOL, (len(ids), step)


# what each architecture's control drops ("attention_mask": the padding mask)
CONTROLS = {"llama": ["attention_mask"], "mistral": ["sliding_window", "attention_mask"],
            "qwen2": ["sliding_window"], "gemma2": ["softcap", "scaling", "sliding_window"],
            "gpt_oss": ["s_aux", "sliding_window"]}
# measured: the logits move by 0.12 (gemma2 scaling), 0.30 (qwen2 window), 0.43 (softcap),
# 0.85 (gpt_oss sinks), 0.94 (llama padding) ... 1.18 (mistral padding) of max |logit|
CONTROL_MIN = 0.05


def test_negative_controls(run):
    """The logits check fails by far more than its tolerance when numba_fa's attention function
    drops one argument (the bug of issue 59 for s_aux): each feature is exercised."""
    for dropped in CONTROLS[run["arch"]]:
        calls = []

        def dropping(module, query, key, value, attention_mask, **kwargs):
            if dropped == "attention_mask":
                calls.append(attention_mask is not None)
                attention_mask = None
            else:
                calls.append(kwargs.pop(dropped, None) is not None)
            return attention_forward(module, query, key, value, attention_mask, **kwargs)

        transformers.AttentionInterface.register(NAME, dropping)
        try:
            with torch.no_grad():
                logits = run["ours"](input_ids=IDS, attention_mask=MASK).logits
        finally:
            transformers.AttentionInterface.register(NAME, attention_forward)
        assert any(calls), dropped  # the argument came and was dropped
        err = _rel(logits[VALID], run["out_eager"].logits[VALID])
        assert err > CONTROL_MIN > 100 * LOGITS_TOL, (dropped, err)
