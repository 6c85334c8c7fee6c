"""Benchmarks count only tokens that were generated: the per-request checks, W-mixed exiting 1
on an engine that stops short, and weir's KV pool released before a peer runs."""

from __future__ import annotations

import json

import pytest

from bench import mixed
from bench.peers import check_generated, check_stopped, release_engine


def test_check_generated_names_each_short_request():
    assert check_generated("weir", [4, 6, 3], [4, 6, 3]) == []
    assert check_generated("weir", [4, 6, 3], [4, 5, 3]) == ["weir: request 1 generated 5 tokens of 6 requested"]
    assert check_generated("weir", [4, 6, 3], [4, 7, 3]) == ["weir: request 1 generated 7 tokens of 6 requested"]
    # a static batch runs to its longest member: more is fine, fewer is not
    assert check_generated("hf", [4, 6, 3], [6, 6, 6], exact=False) == []
    assert check_generated("hf", [4, 6, 3], [6, 6, 2], exact=False) == ["hf: request 2 generated 2 tokens of 3 requested"]
    assert check_generated("hf", [4, 6], [4]) == ["hf: 1 outputs for 2 requests"]
    many = check_generated("weir", [2] * 8, [1] * 8)
    assert len(many) == 6 and many[-1] == "weir: 3 more requests short"


def test_check_stopped_wants_eos_at_the_end_or_max_tokens():
    eos = {2}
    assert check_stopped("weir", [[5, 6, 2], [5, 6, 7, 8]], eos, max_tokens=4) == []
    assert check_stopped("weir", [[5, 6, 7]], eos, 4) == [
        "weir: request 0 returned 3 tokens, 3 up to its first EOS, ending without EOS (max_tokens 4)"]
    assert check_stopped("weir", [[]], eos, 4) == [
        "weir: request 0 returned 0 tokens, 0 up to its first EOS, ending without EOS (max_tokens 4)"]
    assert check_stopped("hf", [[5, 2, 7, 2]], eos, 4) == [  # tokens counted past an EOS
        "hf: request 0 returned 4 tokens, 2 up to its first EOS, ending at EOS (max_tokens 4)"]


def run_mixed(tmp_path):
    out = tmp_path / "mixed.jsonl"
    rc = mixed.main(["--small", "--shapes", "tiny", "--systems", "weir", "--device", "cpu", "--json", str(out)])
    return rc, [json.loads(line) for line in out.read_text().splitlines()]


def test_w_mixed_passes_when_every_requested_token_is_generated(tmp_path):
    rc, rows = run_mixed(tmp_path)
    weir = rows[0]
    assert (rc, weir["system"], weir["all_generated"]) == (0, "weir", True)
    assert weir["generated_tokens"] == weir["output_tokens"]
    mix = weir["step_mix"]
    assert mix["eager"]["num_steps"] > 0 and mix["cudagraph_full"]["num_steps"] == 0
    assert "forward_host_time_s" in mix["eager"]
    assert weir["roofline_fraction"] == max(weir["compute_bound_fraction"], weir["bandwidth_bound_fraction"])


def test_w_mixed_exits_1_when_an_engine_stops_short(tmp_path, monkeypatch):
    """Every request given one token less than the workload asks: the run still times it, but the
    row says not all generated and the benchmark exits 1."""
    import weir.engine

    real = weir.engine.SamplingParams

    def one_short(**kwargs):
        if kwargs.get("max_tokens", 0) > 8:
            kwargs["max_tokens"] -= 1
        return real(**kwargs)

    monkeypatch.setattr(weir.engine, "SamplingParams", one_short)
    rc, rows = run_mixed(tmp_path)
    assert (rc, rows[0]["all_generated"]) == (1, False)
    assert rows[0]["generated_tokens"] < rows[0]["output_tokens"]


def test_release_engine_frees_the_kv_pool_and_refuses_a_held_one(tiny_llama_dir):
    import weakref

    from weir.engine import LLM

    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=16, device="cpu")
    pool = weakref.ref(llm.llm_engine.runner.kv_cache)
    release_engine(llm)
    assert pool() is None and llm.llm_engine.runner.kv_cache is None
    release_engine(llm)  # twice: nothing left to release

    llm = LLM(tiny_llama_dir, skip_tokenizer_init=True, num_gpu_blocks_override=16, device="cpu")
    held = llm.llm_engine.runner.kv_cache
    with pytest.raises(RuntimeError, match="still referenced"):
        release_engine(llm)
    del held
