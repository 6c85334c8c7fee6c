"""The greedy check's verdict: which prompts part from transformers before the stated position,
and the check itself failing (exit 1) on an engine whose logits are wrong."""

import json

import pytest
import torch

from bench import greedy_check
from bench.greedy_check import diverged_early, first_divergence


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2  # one stops early: it parts where it stops


def test_divergence_before_the_stated_position_fails_the_check():
    divergences = [None, 12, 7, 8]
    assert diverged_early(divergences, 8) == [2]
    assert diverged_early(divergences, 13) == [1, 2, 3]
    assert diverged_early(divergences, None) == [1, 2, 3]  # float32: any divergence fails
    assert diverged_early([None, None], None) == []


def test_a_near_tie_excuses_an_early_divergence_and_nothing_else_does():
    divergences, gaps = [None, 1, 1, 2, 9], [None, 0.25, 3.0, None, 4.0]
    assert diverged_early(divergences, 3, gaps, 0.5) == [2, 3]  # 3: no gap known, not excused
    assert diverged_early(divergences, 3, gaps, None) == [1, 2, 3]
    assert diverged_early(divergences, None, gaps, 0.5) == [2, 3, 4]


def run_check(model_dir, tmp_path, *options):
    """The check on 2 W-gen prompts in float32 on CPU: its exit status and its JSON lines."""
    out = tmp_path / "greedy.jsonl"
    rc = greedy_check.main(["--model", model_dir, "--n", "2", "--device", "cpu", "--dtype", "float32",
                            "--max-model-len", "512", "--json", str(out), *options])
    return rc, [json.loads(line) for line in out.read_text().splitlines()]


def test_the_engine_matches_transformers_to_the_end(tiny_model_dir, tmp_path):
    rc, rows = run_check(tiny_model_dir, tmp_path)
    summary = rows[-1]
    assert (rc, summary["first_divergences"], summary["passed"]) == (0, [None, None], True)
    assert [r["weir_tokens"] for r in rows[:-1]] == [r["hf_tokens"] for r in rows[:-1]]


@pytest.fixture
def engine_biased_from_position_2(monkeypatch):
    """From the third step on (the prefill step samples position 0, each decode step one more)
    weir picks the token its own logits rank last, so its output parts from transformers' at
    position 2 of every prompt, where transformers' gap is its logits' whole range."""
    from weir.engine.models.llama import LlamaForCausalLM

    compute_logits, calls = LlamaForCausalLM.compute_logits, []

    def biased(self, hidden):
        logits = compute_logits(self, hidden)
        calls.append(len(calls))
        if len(calls) > 2:
            rows = torch.arange(logits.shape[0])
            logits[rows, logits.argmin(-1)] += 1e4
        return logits

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", biased)


def test_a_perturbed_engine_fails_the_check(tiny_model_dir, tmp_path, engine_biased_from_position_2):
    rc, rows = run_check(tiny_model_dir, tmp_path)
    assert (rc, rows[-1]["first_divergences"], rows[-1]["diverged_early"]) == (1, [2, 2], [0, 1])
    # the model's whole logit range (1.85 on this flat random-weight model): no near-tie
    assert all(r["tie_gap"] > greedy_check.HALF_MAX_TIE_GAP for r in rows[:-1])


def test_a_divergence_at_the_stated_position_passes(tiny_model_dir, tmp_path, engine_biased_from_position_2):
    rc, rows = run_check(tiny_model_dir, tmp_path, "--min-divergence", "2")
    assert (rc, rows[-1]["first_divergences"], rows[-1]["passed"]) == (0, [2, 2], True)
    rc, rows = run_check(tiny_model_dir, tmp_path / "..", "--min-divergence", "3", "--max-tie-gap", "0.5")
    assert (rc, rows[-1]["diverged_early"]) == (1, [0, 1])


def test_a_small_budget_runs_chunked_prefill_and_is_checked_too(tiny_model_dir, tmp_path):
    """--budgets 8192,24: weir runs twice, the second time with prompts split into 24-token chunks;
    both runs match transformers (a row per prompt and budget); a budget that holds every prompt is refused."""
    rc, rows = run_check(tiny_model_dir, tmp_path, "--budgets", "8192,24")
    assert (rc, rows[-1]["budgets"], rows[-1]["first_divergences"]) == (0, [8192, 24], [None] * 4)
    assert [r["max_num_batched_tokens"] for r in rows[:-1]] == [8192, 8192, 24, 24]
    assert min(r["prompt_tokens"] for r in rows[:-1]) > 24
    with pytest.raises(SystemExit, match="no chunked prefill"):
        run_check(tiny_model_dir, tmp_path / "..", "--budgets", "8192,4096")
