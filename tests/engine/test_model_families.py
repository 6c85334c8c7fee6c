"""Qwen2 (q/k/v biases, untied head) and Mistral checkpoints run on the same Llama-family model."""

import pytest
import torch

from weir.engine import LLM, SamplingParams
from tests.conftest import hf_greedy

PROMPTS = [[5, 9, 200, 31, 7], list(range(3, 40)), [17] * 16]


def save_random(tmp_path, config_cls, model_cls, seed=1, **extra):
    cfg = config_cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **extra)
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
