"""Text out of the engine: stop strings, held-back text, min_tokens against stop strings, EOS set.

A random-weight 2-layer Llama with SmolLM2's tokenizer: its seeded samples are gibberish, but
fixed, so stop strings can be cut from them and the expected text computed exactly.
"""

import json
import os
import shutil

import pytest

from weir.engine import LLM, SamplingParams

PROMPT = [{"role": "user", "content": "Describe: Fresh Alphonso mango, 1 kg"}]
SEEDED = dict(temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, num_gpu_blocks_override=64)


@pytest.fixture(scope="module")
def free_run(llm):
    """The seeded output with nothing stopping it: (token ids, text)."""
    out = llm.chat(PROMPT, SamplingParams(**SEEDED, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return out.token_ids, out.text


def stop_from(text, start, length):
    stop = text[start:start + length]
    assert stop.strip() and text.find(stop) == start, "premise: the stop string first occurs there"
    return stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_the_text(llm, free_run, include):
    ids, text = free_run
    start = len(text) // 2
    stop = stop_from(text, start, 3)
    out = llm.chat(PROMPT, SamplingParams(**SEEDED, max_tokens=24, ignore_eos=True, stop=[stop],
                                          include_stop_str_in_output=include))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == (text[:start + len(stop)] if include else text[:start])
    assert out.token_ids == ids[:len(out.token_ids)] and len(out.token_ids) < len(ids)
    assert llm.llm_engine.block_pool.num_free_blocks == llm.llm_engine.num_blocks


def test_stop_string_never_matched_releases_held_text(llm, free_run):
    ids, text = free_run
    # the text's last 2 characters followed by a character not in it: held back, then released
    stop = text[-2:] + "\u2603"
    out = llm.chat(PROMPT, SamplingParams(**SEEDED, max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert out.outputs[0].text == text and out.outputs[0].finish_reason == "length"
    assert out.outputs[0].stop_reason is None


def test_min_tokens_ignores_a_stop_string_in_its_first_tokens(llm, free_run):
    ids, text = free_run
    first_text = llm.tokenizer.decode(ids[:1], skip_special_tokens=True)
    stop = stop_from(text, 0, min(2, len(first_text)))
    sp = dict(**SEEDED, max_tokens=24, ignore_eos=True, stop=[stop])
    early = llm.chat(PROMPT, SamplingParams(**sp))[0].outputs[0]
    assert early.text == "" and early.token_ids == ids[:1]
    late = llm.chat(PROMPT, SamplingParams(min_tokens=3, **sp))[0].outputs[0]
    assert len(late.token_ids) >= 3 and late.token_ids == ids[:len(late.token_ids)]
    later = text.find(stop, len(llm.tokenizer.decode(ids[:3], skip_special_tokens=True)))
    assert late.text == (text if later < 0 else text[:later])


def test_eos_set_is_tokenizer_config_and_generation_config(tiny_model_dir, tmp_path, free_run):
    ids, _ = free_run
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    # the first sampled token becomes an EOS id through generation_config.json only
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids[0], 7]}, f)
    llm = LLM(str(path), num_gpu_blocks_override=64)
    tok_eos = llm.tokenizer.eos_token_id
    assert llm.llm_engine.eos_token_ids == {tok_eos, ids[0], 7} | {llm.llm_engine.config.eos_token_id}
    stopped = llm.chat(PROMPT, SamplingParams(**SEEDED, max_tokens=5))[0].outputs[0]
    assert stopped.token_ids == ids[:1] and stopped.finish_reason == "stop" and stopped.stop_reason is None
    ignored = llm.chat(PROMPT, SamplingParams(**SEEDED, max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == ids[:5] and ignored.finish_reason == "length"


def test_stop_strings_need_a_tokenizer(tiny_llama_dir):
    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(stop=["x"]))
