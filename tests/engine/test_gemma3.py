"""Gemma 3 text against transformers' ``Gemma3ForCausalLM`` on tiny random-weight models: four
layers, sliding (window 16) and global interleaved, norm weights random (Gemma initialises them at
zero, which would hide a ``1 + w`` computed as ``w``), logits soft-capped. Prompts of 40-70 tokens
outrun the window; fp32 greedy tokens exactly, prompt logprobs within 1e-4, bf16 logprobs within
0.1, through prefix hits, chunked prefill inside the window and preemption by recompute."""

import re

import pytest
import torch

from weir.engine import LLM, SamplingParams
from tests.conftest import hf_greedy
from tests.engine import test_model_families as families
from tests.engine.test_llm_tiny import assert_all_blocks_free
from tests.engine.test_sliding_window import make_llm, tokens, window_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=10)
WINDOW = 16
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def gemma3_config_kwargs(**extra):
    """Sizes of the tiny Gemma 3 (head_dim 32 is not hidden_size / num_heads: the config's is read)."""
    return dict(num_hidden_layers=4, head_dim=32, sliding_window=WINDOW, layer_types=LAYER_TYPES,
                query_pre_attn_scalar=24, final_logit_softcapping=30.0, pad_token_id=0, **extra)


def save_gemma3(path, **extra):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return families.save_random(path, Gemma3TextConfig, Gemma3ForCausalLM, seed=3, **gemma3_config_kwargs(**extra))


def hf_tokens(hf, ps):
    return [hf_greedy(hf, p, GREEDY.max_tokens, eos_token_id=2) for p in ps]


def with_config(hf, **change):
    """A copy of transformers' model with ``change`` made to its config (same weights)."""
    cfg = hf.config.__class__.from_dict({**hf.config.to_dict(), **change})
    other = type(hf)(cfg).eval()
    other.load_state_dict(hf.state_dict())
    return other


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """(path, transformers' model, prompts, its greedy tokens)."""
    path = tmp_path_factory.mktemp("gemma3")
    hf = save_gemma3(path)
    ps = window_prompts()
    return str(path), hf, ps, hf_tokens(hf, ps)


def test_the_window_and_the_local_rope_base_change_transformers_tokens(gemma3):
    # what the tests below compare against differs without the window or with one RoPE base
    _, hf, ps, want = gemma3
    ps, want = ps[:6], want[:6]  # the prompts that share no prefix
    no_window = hf_tokens(with_config(hf, sliding_window=4096), ps)
    one_base = hf_tokens(with_config(hf, rope_parameters={t: {"rope_type": "default", "rope_theta": 1e6}
                                                          for t in ("sliding_attention", "full_attention")}), ps)
    assert sum(a != b for a, b in zip(want, no_window)) >= 3
    assert sum(a != b for a, b in zip(want, one_base)) >= 3


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_equals_transformers_batched_and_alone(gemma3, caching):
    path, _, ps, want = gemma3
    llm = make_llm(path, enable_prefix_caching=caching)
    assert llm.llm_engine.model.sliding_windows == [WINDOW, None, WINDOW, None]
    assert llm.llm_engine.kv.sliding_window is None  # the global layers read every block: none freed early
    assert tokens(llm, ps) == want
    assert [tokens(llm, [p])[0] for p in ps] == want
    assert_all_blocks_free(llm)


def test_tied_embeddings_greedy_equals_transformers(tmp_path):
    hf = save_gemma3(tmp_path, tie_word_embeddings=True)
    ps = window_prompts()[:4]
    llm = make_llm(str(tmp_path))
    assert llm.llm_engine.model.tie_word_embeddings
    assert tokens(llm, ps) == hf_tokens(hf, ps)


def test_prompt_logprobs_equal_transformers(gemma3):
    path, hf, ps, _ = gemma3
    families.assert_prompt_logprobs_equal(make_llm(path), hf, ps[5])  # 70 tokens: past the window


def test_bf16_prompt_logprobs_close_to_transformers(gemma3):
    """In bf16 each side rounds its own matmuls (different kernels, different sums): every returned
    logprob (the prompt token and the top 5) within 0.1 of transformers' in bf16."""
    path, hf, ps, _ = gemma3
    hf_bf16 = with_config(hf).to(torch.bfloat16)
    llm = make_llm(path, dtype="bfloat16")
    families.assert_prompt_logprobs_equal(llm, hf_bf16, ps[3], abs_tol=0.1)


@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_inside_the_window_and_prefix_hits(gemma3, budget):
    path, _, ps, want = gemma3
    llm = make_llm(path, max_num_batched_tokens=budget, max_num_seqs=4)
    assert tokens(llm, ps) == want
    hits_before = llm.llm_engine.kv.num_hit_tokens
    assert tokens(llm, ps) == want  # again: every prompt hits the cache, every block of it kept
    assert llm.llm_engine.kv.num_hit_tokens - hits_before >= 32 * len(ps)
    assert_all_blocks_free(llm)


def test_on_the_torch_reference_attention(gemma3):
    path, _, ps, want = gemma3
    llm = make_llm(path, max_num_batched_tokens=20)
    llm.llm_engine.runner.use_cpu_kernel = False
    assert tokens(llm, ps) == want
    assert tokens(llm, ps) == want  # prefix hits


def test_preempted_and_recomputed_in_a_tiny_pool(gemma3):
    path, _, ps, want = gemma3
    llm = make_llm(path, num_gpu_blocks_override=8, max_model_len=128)
    assert tokens(llm, ps) == want
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


def test_a_gemma3_image_and_text_config_runs_its_language_model():
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    from weir.engine.models.gemma3 import Gemma3ForCausalLM

    text = Gemma3TextConfig(**{**families_sizes(), **gemma3_config_kwargs()})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    cfg = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), eos_token_id=[2, 5])
    llm = LLM(cfg, load_format="dummy", skip_tokenizer_init=True, num_gpu_blocks_override=16)
    assert isinstance(llm.llm_engine.model, Gemma3ForCausalLM)
    assert llm.llm_engine.eos_token_ids == {2, 5}
    assert len(llm.generate([[5, 9, 200]], GREEDY)[0].outputs[0].token_ids) >= 1


def families_sizes():
    return dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": 50.0},
     "attn_logit_softcapping=50.0 is not supported: weir's attention does not soft-cap its logits"),
    ({"hidden_activation": "gelu"},
     "hidden_activation='gelu' is not supported: weir's Gemma 3 MLP is GeGLU with 'gelu_pytorch_tanh'"),
    ({"attention_bias": True},
     "attention_bias=True is not supported for gemma3: weir's Gemma 3 attention has no biases"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar=0 is not a positive number"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2},
     "layer_types ['chunked_attention'] are not supported; weir runs ['sliding_attention', 'full_attention']"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                          "full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}}},
     "rope_parameters['full_attention'] rope_type='dynamic' is not supported: its cos/sin depend on the "
     "sequence length, and weir precomputes them once"),
])
def test_what_the_gemma3_block_cannot_honour_is_refused_at_load_naming_the_key(change, message):
    from transformers import Gemma3TextConfig

    cfg = Gemma3TextConfig(**{**families_sizes(), **gemma3_config_kwargs()})
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        LLM(cfg, load_format="dummy", skip_tokenizer_init=True, num_gpu_blocks_override=16)
