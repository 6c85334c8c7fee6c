"""Turns logits into next tokens: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row.

    Args:
        logits: ``[num_rows, vocab_size]`` fp32.
        params: one :class:`SamplingParams` per row.
        generators: one generator per row (seeded requests), or None for the default RNG.

    Returns:
        The chosen token id of each row. Greedy rows (temperature 0) take the argmax; the others
        sample from softmax(logits / temperature) restricted to the top-k tokens and then to the
        smallest set whose mass reaches top-p (Holtzman et al. 2020, nucleus sampling).
    """
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.is_greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = sorted_logits.softmax(-1)
            # drop a token when the mass before it already reaches top_p (keeps at least one)
            drop = probs.cumsum(-1) - probs >= p.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
        probs = row.softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
