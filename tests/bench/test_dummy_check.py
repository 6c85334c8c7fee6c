"""The dummy-weight check: weir against transformers on sharpened random weights, and weir's graph
and eager runs against each other; it passes a correct engine and fails one that picks a wrong
token or whose two modes disagree."""

import json
import math

import pytest
import torch

from bench import dummy_check
from bench.dummy_check import compare_modes


def run_check(tmp_path, *options):
    out = tmp_path / "dummy.jsonl"
    rc = dummy_check.main(["--small", "--device", "cpu", "--json", str(out), *options])
    return rc, [json.loads(line) for line in out.read_text().splitlines()]


def test_sharpened_logits_make_a_wrong_token_far_from_a_tie():
    """On the smollm2 shape (4 layers) the median top-two gap of a step is above the bf16 tie
    allowance and the last-ranked token is about 190 logits below the first: a wrong pick is
    no near-tie. With the default init (std 0.02) the median top-two gap is under a tenth of the allowance."""
    from transformers import LlamaForCausalLM

    from bench.mixed import SHAPES, llama_config

    cfg = llama_config("smollm2-135m", 64)
    cfg.num_hidden_layers = 4
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(3, SHAPES["smollm2-135m"]["vocab_size"], (8, 24), generator=torch.Generator().manual_seed(1))
    allowance = dummy_check.HALF_TOL["max_tie_gap"]
    with torch.no_grad():
        flat = model(input_ids=ids).logits[:, -1]
        dummy_check.sharpen(model)
        sharp = model(input_ids=ids).logits[:, -1]
    flat2, top2 = flat.topk(2).values, sharp.topk(2).values
    assert (flat2[:, 0] - flat2[:, 1]).median() < allowance / 10
    assert (top2[:, 0] - top2[:, 1]).median() > allowance
    assert (sharp.max(-1).values - sharp.min(-1).values).min() > 50 * allowance


def test_a_correct_engine_passes(tmp_path):
    rc, rows = run_check(tmp_path)
    summary = rows[-1]
    assert (rc, summary["passed"], summary["problems"]) == (0, True, [])
    greedy = [r for r in rows if r["check"] == "dummy-greedy"]
    assert len(greedy) == 8 and all(r["first_divergence"] is None for r in greedy)


def test_a_wrong_token_fails(tmp_path, monkeypatch):
    """From the fourth sampling call on, weir picks the token its logits rank last: both weir runs
    part from transformers, far from a tie, and the check exits 1."""
    from weir.engine.models.llama import LlamaForCausalLM

    compute_logits, calls = LlamaForCausalLM.compute_logits, []

    def biased(self, hidden):
        logits = compute_logits(self, hidden)
        calls.append(1)
        if len(calls) % 20 > 3:
            rows = torch.arange(logits.shape[0])
            logits[rows, logits.argmin(-1)] += 1e4
        return logits

    monkeypatch.setattr(LlamaForCausalLM, "compute_logits", biased)
    rc, rows = run_check(tmp_path)
    assert rc == 1 and not rows[-1]["passed"]
    assert any("parts from transformers" in p for p in rows[-1]["problems"])


def lp(*pairs):
    return {t: v for t, v in pairs}


def test_modes_agree_within_tolerance_and_part_only_at_a_near_tie():
    a_tokens, b_tokens = [[5, 6, 7]], [[5, 6, 7]]
    a_lp = [[lp((5, -0.10)), lp((6, -0.20)), lp((7, -0.30))]]
    b_lp = [[lp((5, -0.12)), lp((6, -0.20)), lp((7, -0.30))]]
    assert compare_modes(a_tokens, a_lp, b_tokens, b_lp, logprob_tol=0.05, max_tie_gap=1.0) == []
    assert compare_modes(a_tokens, a_lp, b_tokens, b_lp, logprob_tol=0.01, max_tie_gap=1.0) == [
        "prompt 0 position 0: sampled-token logprobs differ by 0.02 > 0.01"]
    # b picks 8 at position 2: a near-tie in b's own top two (0.5 apart) is excused, a wide gap is not
    near = [[lp((5, -0.1)), lp((6, -0.2)), lp((8, -0.9), (7, -1.4))]]
    # a large logprob difference at a near-tie position is not counted (rounding moves both)
    tie = [[lp((5, -0.9), (9, -1.0)), lp((6, -0.2)), lp((7, -0.3))]]
    assert compare_modes(a_tokens, a_lp, b_tokens, tie, logprob_tol=0.05, max_tie_gap=1.0) == []
    far = [[lp((5, -0.1)), lp((6, -0.2)), lp((8, -0.1), (7, -3.0))]]
    assert compare_modes(a_tokens, a_lp, [[5, 6, 8]], near, 0.05, 1.0) == []
    assert compare_modes(a_tokens, a_lp, [[5, 6, 8]], far, 0.05, 1.0) == [
        "prompt 0: modes part at position 2 where the top two are 2.9 apart"]
    assert math.isclose(2.9, -0.1 + 3.0)
