"""The greedy check's verdict: which prompts part from transformers before the stated position."""

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
