"""Model references, tokenizers and prompt encoding: one module for the engine and the client."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from weir.config import DEFAULT_GGUF_FILE, default_model_path
from weir.model_source import ModelSource, is_single_prompt, model_name, parse_prompt, resolve_model

HELLO = [19556]  # "Hello" in SmolLM2's tokenizer


def test_resolve_the_packaged_model():
    path = default_model_path()
    expected = ModelSource(os.path.dirname(path), DEFAULT_GGUF_FILE, "SmolLM2-135M-Instruct")
    assert resolve_model(None) == resolve_model("") == resolve_model(path) == expected
    assert expected.location == path
    assert expected.hf_kwargs() == {"gguf_file": DEFAULT_GGUF_FILE}


def test_resolve_a_folder(tmp_path):
    folder = tmp_path / "My-Model"
    folder.mkdir()
    src = resolve_model(str(folder) + "/")
    assert src == ModelSource(str(folder), None, "My-Model")
    assert (src.location, src.hf_kwargs()) == (str(folder), {})


def test_resolve_refuses_what_is_not_a_model(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError) as raised:
        resolve_model(missing)
    assert str(raised.value) == (f"model {missing!r}: no such file or folder (WEIR_MODEL: a .gguf file or a "
                                 "local Hugging Face model folder)")
    with pytest.raises(FileNotFoundError) as raised:
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert str(raised.value) == (
        "model 'HuggingFaceTB/SmolLM2-135M-Instruct' is not a local file or folder; weir loads no model from "
        "the hub: download it first (hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR) and set "
        "WEIR_MODEL=DIR")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="is not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize(
    "model, name",
    [
        (None, "SmolLM2-135M-Instruct"),
        ("/m/Llama-3.2-1B-Instruct.Q4_K_M.gguf", "Llama-3.2-1B-Instruct"),
        ("/m/qwen.F16.gguf", "qwen"),
        ("/m/my model/", "my model"),
    ],
)
def test_model_name(model, name):
    assert model_name(model) == name


@pytest.mark.parametrize(
    "prompt, parsed",
    [
        ("Hello", "Hello"),
        ({"prompt": "Hello"}, "Hello"),
        ({"prompt_token_ids": [5, 6, 7]}, [5, 6, 7]),
        ((5, 6), [5, 6]),
        # vLLM reads the token ids first when a dict holds both
        ({"prompt": "Hello", "prompt_token_ids": [9]}, [9]),
        ([{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Hi"}]),
    ],
)
def test_parse_prompt(prompt, parsed):
    assert parse_prompt(prompt) == parsed


@pytest.mark.parametrize(
    "prompt, message",
    [
        ("", "prompt is empty"),
        ([], "prompt is empty"),
        ({"prompt": ""}, "prompt is empty"),
        ({"prompt_token_ids": []}, "prompt is empty"),
        ({}, r"takes the keys \('prompt', 'prompt_token_ids'\); it has none"),
        ({"prompt": "Hi", "multi_modal_data": {}}, r"takes the keys \('prompt', 'prompt_token_ids'\); unknown key\(s\) "
                                                  r"'multi_modal_data'$"),
        ({"prompt": {"prompt": "Hi"}}, "holds text or token ids"),
        ({"prompt": [{"role": "user", "content": "Hi"}]}, "holds text or token ids"),
        ([1, "a"], r"element 1 is 'a' \(str\)"),
        ([True, 2], r"element 0 is True \(bool\)"),
        ([1, 2.5], r"element 1 is 2.5 \(float\)"),
        (7, "got int"),
        ([{"role": "user", "content": "Hi"}, 5], "chat message 1 is a int"),
        ([{"rle": "user", "content": "Hi"}], "chat message 0 has no 'role' and unknown key\\(s\\) 'rle'"),
        # a list of one misspelt prompt dict reads as a conversation: the error names the key
        ([{"promt": "Hi"}], r"chat message 0 has no 'role' and unknown key\(s\) 'promt': a chat message has "
                            r"'role' and 'content', a prompt dict one of \('prompt', 'prompt_token_ids'\)"),
        ([{"role": "user", "content": "Hi", "name": "ann"}, {"content": "x"}], "chat message 1 needs a 'role'"),
        ([{"role": 5, "content": "Hi"}], "chat message 0 needs a 'role' string"),
        ([{"role": "user"}], "chat message 0 needs a 'content' string, got None"),
    ],
)
def test_parse_prompt_refuses(prompt, message):
    with pytest.raises(ValueError, match=message):
        parse_prompt(prompt)


@pytest.mark.parametrize(
    "prompts, single",
    [
        ("Hello", True),
        ({"prompt": "Hello"}, True),
        ([5, 6, 7], True),
        ([{"role": "user", "content": "Hi"}], True),
        (["Hello", "Bye"], False),
        ([[5, 6], [7]], False),
        ([{"prompt": "a"}, {"prompt_token_ids": [5]}], False),
        ([[{"role": "user", "content": "Hi"}]], False),
        ([], False),
    ],
)
def test_is_single_prompt(prompts, single):
    assert is_single_prompt(prompts) is single


@pytest.mark.parametrize("prompts, kind", [(None, "NoneType"), (5, "int"), ((p for p in ["a"]), "generator")])
def test_prompts_of_another_type_are_refused(prompts, kind):
    with pytest.raises(TypeError, match=f"prompts must be a prompt .* or a list of prompts, got {kind}"):
        is_single_prompt(prompts)


def test_integer_likes_are_token_ids():
    import numpy as np

    assert parse_prompt([np.int64(3), 4]) == [3, 4] and type(parse_prompt([np.int64(3)])[0]) is int


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from weir.engine import LLM

    return LLM(tiny_model_dir, device="cpu", cpu_kv_cache_bytes=1 << 22)


def test_engine_takes_vllm_prompt_dicts(llm):
    assert llm.encode_prompt({"prompt": "Hello"}) == llm.encode_prompt("Hello") == HELLO
    assert llm.encode_prompt({"prompt_token_ids": [5, 6, 7]}) == [5, 6, 7]
    from weir.engine import SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    by_dict = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt": "Hello"}], greedy)
    by_value = llm.generate([[5, 6, 7], "Hello"], greedy)
    assert [o.outputs[0].token_ids for o in by_dict] == [o.outputs[0].token_ids for o in by_value]
    one = llm.generate({"prompt": "Hello"}, greedy)
    assert [o.outputs[0].token_ids for o in one] == [by_value[1].outputs[0].token_ids]
    # RequestOutput.prompt is the text, as vLLM fills it, for a string or a {"prompt": ...} dict
    assert [o.prompt for o in by_dict] == [None, "Hello"] and one[0].prompt == "Hello"
    scored = llm.classify({"prompt_token_ids": [5, 6, 7]}, ["yes", "no"])
    assert scored[0].probs == llm.classify([[5, 6, 7]], ["yes", "no"])[0].probs


def test_engine_front_takes_vllm_prompt_dicts(llm):
    from weir.engine import EngineFront, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    front = EngineFront(llm)
    try:
        by_dict = front.submit_generate({"prompt_token_ids": [5, 6, 7]}, greedy).result(timeout=60)
        by_value = front.submit_generate([5, 6, 7], greedy).result(timeout=60)
        by_text = front.submit_generate({"prompt": "Hello"}, greedy).result(timeout=60)
        assert (by_dict.prompt, by_text.prompt) == (None, "Hello")
        scored = front.submit_classify({"prompt": "Hello"}, ["yes", "no"]).result(timeout=60)
        assert scored.num_prompt_tokens == len(HELLO)
        with pytest.raises(ValueError, match="takes the keys"):
            front.submit_generate({"text": "Hello"}, greedy)
    finally:
        front.shutdown()
    assert by_dict.outputs[0].token_ids == by_value.outputs[0].token_ids


def test_client_counts_as_the_engine_encodes(llm, tiny_model_dir):
    from weir.jobs.model_info import PromptChecker

    checker = PromptChecker.for_model(tiny_model_dir)
    prompts = [
        {"prompt": "Hello"},
        {"prompt_token_ids": [5, 6, 7]},
        "Hello",
        [{"role": "user", "content": "Hello"}],
    ]
    assert [checker.encode(p) for p in prompts] == [llm.encode_prompt(p) for p in prompts]
    assert checker.num_tokens(prompts) == [1, 3, 1, len(llm.encode_prompt(prompts[3]))]


def test_prompts_encoded_as_one_batch_get_each_prompts_own_ids(llm):
    from weir.engine import EngineFront
    from weir.model_source import encode_prompts

    prompts = [
        "Product: Green Tea\nBrand: Leafy",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Product: Tea"}],
        {"prompt_token_ids": [5, 6, 7]},
        "  leading spaces, émojis 🍵 and\ttabs",
        [{"role": "user", "content": "Hello"}],
        {"prompt": "Hello"},
    ]
    one_by_one = [llm.encode_prompt(p) for p in prompts]
    assert one_by_one[2] == [5, 6, 7] and one_by_one[5] == HELLO
    assert encode_prompts(llm.tokenizer, prompts) == one_by_one
    front = EngineFront(llm)
    try:
        assert front.encode_prompts(prompts) == one_by_one
        with pytest.raises(ValueError, match="prompt is empty"):
            front.encode_prompts(["Hello", ""])
    finally:
        front.shutdown()


def test_client_side_stays_light():
    code = (
        "import sys\n"
        "import weir.model_source, weir.jobs.model_info, weir.jobs.client\n"
        "assert 'torch' not in sys.modules, 'the client pulled torch'\n"
        "assert 'transformers' not in sys.modules, 'the client pulled transformers'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
