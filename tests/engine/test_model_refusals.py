"""What weir cannot load is refused at load with one line naming the file or the config key,
before transformers' own (longer, or silently wrong) handling of it."""

import json
import os
import re

import pytest

from weir.engine import LLM, SamplingParams
from tests.engine.test_model_families import save_random

SMALL = dict(num_gpu_blocks_override=16)


def word_tokenizer(folder, size):
    """A word-level fast tokenizer of ``size`` tokens (``w0`` .. ``w{size-2}`` and ``[UNK]``), no
    chat template, saved into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)


def tiny_llama(folder, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM

    save_random(folder, LlamaConfig, LlamaForCausalLM, **extra)


def edit_config(folder, **changes):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        raw = json.load(f)
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    with open(path, "w") as f:
        json.dump(raw, f)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma3_text"])
def test_a_folder_without_tokenizer_files_is_refused_naming_them(tmp_path, family):
    import transformers as t

    classes = {"llama": (t.LlamaConfig, t.LlamaForCausalLM), "mistral": (t.MistralConfig, t.MistralForCausalLM),
               "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM),
               "gemma3_text": (t.Gemma3TextConfig, t.Gemma3ForCausalLM)}[family]
    save_random(tmp_path, *classes)
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(tmp_path))} has no tokenizer files "
                                                r"\(one of tokenizer.json, "):
        LLM(str(tmp_path), **SMALL)
    # without a tokenizer on purpose, the same folder loads and runs token ids
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **SMALL)
    assert len(llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids) == 2


def test_a_tokenizer_far_smaller_than_the_vocabulary_is_refused(tmp_path):
    tiny_llama(tmp_path)  # vocab_size 256
    word_tokenizer(tmp_path, 100)
    with pytest.raises(ValueError, match=r"^the tokenizer at .* has 100 tokens for a model of vocab_size=256: "
                                         "it is not this model's tokenizer$"):
        LLM(str(tmp_path), **SMALL)
    word_tokenizer(tmp_path, 128)  # half the vocabulary: a padded vocabulary is not refused
    llm = LLM(str(tmp_path), **SMALL)
    assert llm.encode_prompt("w5 w7") == [5, 7]


def test_chat_messages_to_a_tokenizer_without_a_chat_template_are_refused(tmp_path):
    tiny_llama(tmp_path)
    word_tokenizer(tmp_path, 200)
    llm = LLM(str(tmp_path), **SMALL)
    message = "has no chat template (a base model?): send text prompts, not chat messages"
    with pytest.raises(ValueError, match=re.escape(message)):
        llm.chat([{"role": "user", "content": "w1 w2"}], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=re.escape(message)):  # the batched encoding, too
        llm.generate(["w1", [{"role": "user", "content": "w1 w2"}]], SamplingParams(max_tokens=1))
    assert len(llm.generate(["w1 w2"], SamplingParams(max_tokens=1))[0].outputs[0].token_ids) == 1


def test_text_to_an_engine_without_a_tokenizer_names_why_it_has_none(tmp_path):
    tiny_llama(tmp_path)
    word_tokenizer(tmp_path, 200)
    llm = LLM(str(tmp_path), skip_tokenizer_init=True, **SMALL)
    with pytest.raises(ValueError, match=r"^this engine has no tokenizer \(skip_tokenizer_init=True, or "
                                         r"load_format='dummy' with a config object\): pass token ids$"):
        llm.generate(["w1 w2"], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("change, message", [
    ({"model_type": "foobar"}, "model_type 'foobar' is not supported; weir runs ('llama', "),
    ({"model_type": None}, "config.json has no model_type; weir runs ('llama', "),
    ({"model_type": "mistral", "sliding_window": "16"}, "sliding_window='16' is not a positive number of tokens"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for 2 layers"),
    ({"layer_types": ["full_attention", "chunked_attention"]},
     "layer_types ['chunked_attention'] are not supported; weir runs ['sliding_attention', 'full_attention']"),
    ({"rope_scaling": "linear"}, "config.json: rope_scaling='linear' is not a table of rope parameters"),
    ({"rope_scaling": {"rope_type": "banana", "factor": 2.0}},
     "rope_parameters rope_type='banana' is not a rope type transformers knows (default, linear, "),
])
def test_a_config_file_weir_cannot_run_is_refused_before_transformers_reads_it(tmp_path, change, message):
    tiny_llama(tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        LLM(str(tmp_path), skip_tokenizer_init=True, **SMALL)
    assert "\n" not in str(refused.value)
    assert str(tmp_path / "config.json") in str(refused.value)  # the file, not only the key
    assert refused.traceback[-1].path.name == "loader.py"  # weir's check, not transformers'


def test_a_truncated_safetensors_shard_is_refused_naming_the_file(tmp_path):
    tiny_llama(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: not a readable safetensors file"):
        LLM(str(tmp_path), skip_tokenizer_init=True, **SMALL)


def test_a_gguf_of_another_architecture_is_refused_naming_it(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "foobar")
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"^GGUF general.architecture 'foobar' is not supported; weir loads "
                                         r"\('llama', "):
        LLM(str(path), **SMALL)
