"""Bad arguments to the offline API fail at once with an error naming them, and queue nothing."""

from __future__ import annotations

import pytest
import torch

from weir.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir, device="cpu", cpu_kv_cache_bytes=1 << 22)


def _nothing_queued(llm):
    return not llm.llm_engine.has_unfinished()


def test_sampling_params_of_another_type(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them, got dict"):
        llm.generate(["a", "b"], {"temperature": 0})
    with pytest.raises(TypeError, match="got NoneType"):
        llm.generate(["a", "b"], [GREEDY, None])
    assert _nothing_queued(llm)


def test_prompts_of_another_type(llm):
    with pytest.raises(TypeError, match="got NoneType"):
        llm.generate(None, GREEDY)
    with pytest.raises(TypeError, match="got int"):
        llm.classify(5, ["yes", "no"])


def test_labels_given_as_one_string_are_refused(llm):
    # "AB" would otherwise be scored as the labels "A" and "B"
    with pytest.raises(TypeError, match="labels must be a list of strings, got str 'AB'"):
        llm.classify(["Pick one:"], "AB")
    with pytest.raises(TypeError, match=r"label_texts must be a list of strings, got str ' yes'"):
        llm.classify(["Pick one:"], ["yes"], label_texts=" yes")
    assert _nothing_queued(llm)


def test_stop_token_ids_outside_the_vocabulary(llm):
    vocab = llm.llm_engine.config.vocab_size
    bad = SamplingParams(temperature=0, max_tokens=3, stop_token_ids=[1, vocab])
    with pytest.raises(ValueError, match=rf"stop_token_ids outside the vocabulary \[0, {vocab}\): \[{vocab}\]"):
        llm.generate([[5, 6], [7, 8]], [GREEDY, bad])
    assert _nothing_queued(llm)


def test_last_prompt_bad_queues_nothing_then_a_good_call_works(llm):
    with pytest.raises(ValueError, match="chat message 0 needs a 'content' string"):
        llm.generate([[5, 6], "Hello", [{"role": "user"}]], GREEDY)
    assert _nothing_queued(llm)
    outs = llm.generate([[5, 6]], GREEDY)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 3


def test_prompt_dict_with_text_and_ids_runs_the_ids_and_keeps_the_text(llm):
    (both,) = llm.generate({"prompt": "named", "prompt_token_ids": [5, 6, 7]}, GREEDY)
    (ids,) = llm.generate([[5, 6, 7]], GREEDY)
    assert both.prompt_token_ids == [5, 6, 7] and both.prompt == "named"
    assert both.outputs[0].token_ids == ids.outputs[0].token_ids


def test_use_tqdm_shows_progress_and_changes_nothing(llm, capsys):
    with_bar = llm.generate([[5, 6], [7, 8]], GREEDY, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    plain = llm.generate([[5, 6], [7, 8]], GREEDY)
    assert [o.outputs[0].token_ids for o in with_bar] == [o.outputs[0].token_ids for o in plain]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_without_a_device_fails_before_loading(tiny_model_dir, monkeypatch):
    import weir.engine.llm_engine as llm_engine

    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the device was checked")

    monkeypatch.setattr(llm_engine, "iter_weights", no_loading)
    with pytest.raises(ValueError, match="device='cuda' but torch sees no CUDA device"):
        LLM(tiny_model_dir, device="cuda")


def test_bf16_is_bfloat16(tiny_model_dir):
    assert LLM(tiny_model_dir, device="cpu", dtype="bf16", cpu_kv_cache_bytes=1 << 20).llm_engine.dtype == torch.bfloat16
