"""The transformers peers every benchmark shares, on the tiny Llama: greedy tokens as transformers'
own one-prompt ``generate`` gives them, in request order."""

from __future__ import annotations

import json

from bench.peers import hf_continuous_batching, hf_static_generate, useful_tokens
from bench.report import Report
from tests.conftest import hf_greedy

REQUESTS = [([5, 6, 7, 8, 9], 4), ([11, 12], 6), ([20, 21, 22], 3)]


def test_static_batches_are_left_padded_and_run_to_their_longest_output(tiny_hf_model):
    _, rows = hf_static_generate(tiny_hf_model, REQUESTS, batch_size=2, eos=())
    assert [len(r) for r in rows] == [6, 6, 3]
    for (prompt, num_out), row in zip(REQUESTS, rows):
        assert row[:num_out] == hf_greedy(tiny_hf_model, prompt, num_out)


def test_continuous_batching_gives_each_request_its_own_length(tiny_hf_model):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    # a small cache: the default one is sized from the free memory and takes half a minute on CPU
    small = ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=256)
    _, rows = hf_continuous_batching(tiny_hf_model, REQUESTS, eos=(), continuous_batching_config=small)
    assert rows == [hf_greedy(tiny_hf_model, prompt, num_out) for prompt, num_out in REQUESTS]


def test_useful_tokens_stop_after_the_first_eos():
    assert [useful_tokens([4, 2, 9, 2], {2}), useful_tokens([4, 5], {2}), useful_tokens([], {2})] == [2, 2, 0]


def test_report_prints_and_appends_rows_after_the_fixed_fields(tmp_path, capsys):
    path = tmp_path / "out.jsonl"
    report = Report(str(path), workload="W-x", n=2)
    report.emit("weir 1.0 tok/s", system="weir", value=1.0)
    report.emit("a note")
    assert capsys.readouterr().out == "weir 1.0 tok/s\na note\n"
    assert [json.loads(line) for line in path.read_text().splitlines()] == report.rows == [
        {"workload": "W-x", "n": 2, "system": "weir", "value": 1.0}]


def test_continuous_batching_stops_at_eos(tiny_hf_model):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    small = ContinuousBatchingConfig(num_blocks=16, page_size=16, max_batch_tokens=256)
    free = hf_greedy(tiny_hf_model, [20, 21, 22], 6)
    eos = free[1]  # the second greedy token, as EOS
    _, rows = hf_continuous_batching(tiny_hf_model, [([20, 21, 22], 6)], eos={eos}, continuous_batching_config=small)
    assert rows == [free[:free.index(eos) + 1]]
