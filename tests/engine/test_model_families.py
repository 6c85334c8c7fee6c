"""Qwen2 (q/k/v biases, untied head) and Mistral checkpoints run on the same Llama-family model."""

import pytest
import torch

from weir.engine import LLM, SamplingParams
from tests.conftest import hf_greedy

PROMPTS = [[5, 9, 200, 31, 7], list(range(3, 40)), [17] * 16]


def save_random(tmp_path, config_cls, model_cls, seed=1, **extra):
    """A tiny random checkpoint of ``model_cls`` saved under ``tmp_path`` (every parameter, norms and
    biases too, drawn from N(0, 0.15)); ``extra`` adds to or overrides the config's sizes."""
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cfg = config_cls(**{**sizes, **extra})
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)  # biases too: a zero bias would hide a missing one
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_greedy_equals_transformers(tmp_path, family):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if family == "qwen2":
        hf = save_random(tmp_path, Qwen2Config, Qwen2ForCausalLM)
    else:
        hf = save_random(tmp_path, MistralConfig, MistralForCausalLM, sliding_window=None)
    want = [hf_greedy(hf, p, 10, eos_token_id=2) for p in PROMPTS]
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, num_gpu_blocks_override=32)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))]
    assert got == want


def test_unsupported_architecture_is_refused(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        LLM(str(tmp_path), skip_tokenizer_init=True)


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 50.0},
     "attn_logit_softcapping=50.0 is not supported: weir's attention does not soft-cap its logits"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters rope_type='dynamic' is not supported: its cos/sin depend on the sequence "
     "length, and weir precomputes them once"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
     "rope_parameters rope_type='longrope' is not supported: its cos/sin depend on the sequence "
     "length, and weir precomputes them once"),
])
def test_what_weir_cannot_reproduce_is_refused_at_load_naming_the_key(change, message):
    import re

    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        LLM(cfg, load_format="dummy", skip_tokenizer_init=True, num_gpu_blocks_override=16)


def test_the_unsupported_model_type_message_lists_the_registry(tmp_path):
    import re

    from transformers import GPT2Config

    from weir.engine.models import MODEL_CLASSES

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"weir runs {tuple(MODEL_CLASSES)}")):
        LLM(str(tmp_path), skip_tokenizer_init=True)


@pytest.mark.parametrize("tie", [False, True])
def test_qwen3_greedy_equals_transformers(tmp_path, tie):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 32 is not hidden_size / num_heads (16): the explicit head_dim must be read
    hf = save_random(tmp_path, Qwen3Config, Qwen3ForCausalLM, head_dim=32)
    if tie:
        hf.config.tie_word_embeddings = True
        hf.lm_head.weight = hf.model.embed_tokens.weight
        hf.save_pretrained(tmp_path)
    want = [hf_greedy(hf, p, 10, eos_token_id=2) for p in PROMPTS]
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, num_gpu_blocks_override=32)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))]
    assert got == want
    assert_prompt_logprobs_equal(llm, hf, PROMPTS[1])


def assert_prompt_logprobs_equal(llm, hf, prompt, num_logprobs=5, abs_tol=1e-4):
    """weir's prompt logprobs (each prompt token and the top ``num_logprobs``) equal transformers'
    log-softmax of the same forward pass, in fp32, within ``abs_tol``."""
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=num_logprobs)
    got = llm.generate([prompt], params)[0].prompt_logprobs
    assert got[0] is None
    for pos, entry in enumerate(got[1:]):
        assert prompt[pos + 1] in entry
        for token_id, lp in entry.items():
            assert lp.logprob == pytest.approx(want[pos, token_id].item(), abs=abs_tol), (pos, token_id)
