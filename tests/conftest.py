import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


def pytest_configure(config):
    """Under ``CI``, a skip outside the allow-list fails the run (see ``tests/skip_policy.py``)."""
    from tests.skip_policy import ALLOWED_CI_SKIPS, SkipPolicy

    config.pluginmanager.register(SkipPolicy(ALLOWED_CI_SKIPS), "weir-skip-policy")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A random-weight 2-layer Llama (GQA 4:2, vocab 256) saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties in argmax
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_greedy(hf_model, prompt_ids, max_new_tokens, eos_token_id=None):
    """transformers' own greedy generate on one unpadded prompt; returns the new token ids."""
    out = hf_model.generate(
        torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_token_id,
        pad_token_id=0,
    )
    return out[0, len(prompt_ids):].tolist()


# ---- services shared by tests/jobs and tests/worker (see tests/support.py) ----------------------


@pytest.fixture(scope="session")
def postgres_url():
    """URL of a fresh, migrated Postgres database for this test run (dropped at the end)."""
    from tests import support

    with support.fresh_postgres_database() as url:
        yield url


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight 2-layer Llama with SmolLM2's tokenizer (see ``support.tiny_chat_model_dir``)."""
    from tests import support

    return support.tiny_chat_model_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def redis_url():
    """The test Redis URL; skips (fails under ``CI``) when no Redis answers."""
    from tests import support

    return support.redis_or_skip()
