"""Turns logits into next tokens: penalties, min_tokens, greedy, temperature, top-k, top-p, min-p,
per-request seeds, and the log-probabilities a request asked for."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from weir.engine.sampling_params import LOGPROB_SENTINEL, SamplingParams

# (token id, log-probability, rank): rank 1 is the most likely token
TokenLogprob = tuple[int, float, int]


@dataclass
class SampleRow:
    """What the sampler needs of one row of logits."""

    params: SamplingParams
    generator: Optional[torch.Generator]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class SamplerOutput:
    """Per row: the chosen token, and when asked, its log-probability and the top ones.

    ``logprobs[i]`` is None when row i asked for none; otherwise the sampled token's entry
    first, then the top ``params.logprobs`` tokens by rank (the sampled one may repeat there).
    """

    token_ids: list[int]
    logprobs: list[Optional[list[TokenLogprob]]] = field(default_factory=list)


def finite_logprob(v: float) -> float:
    return v if math.isfinite(v) else LOGPROB_SENTINEL


def top_logprobs(row_logprobs: torch.Tensor, token_id: int, num: int) -> list[TokenLogprob]:
    """The entry of ``token_id`` then the top ``num`` entries of one ``[vocab_size]`` log-prob row."""
    chosen = float(row_logprobs[token_id])
    rank = int((row_logprobs > row_logprobs[token_id]).sum()) + 1
    out = [(token_id, finite_logprob(chosen), rank)]
    if num:
        vals, ids = torch.topk(row_logprobs, min(num, row_logprobs.shape[-1]))
        out += [(int(t), finite_logprob(float(v)), r + 1) for r, (v, t) in enumerate(zip(vals, ids))]
    return out


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place, per row asking for them: min_tokens masks EOS and stop token ids; repetition
    penalty (CTRL, Keskar et al. 2019) over prompt and output tokens; frequency and presence
    penalties (OpenAI's definition) over output tokens."""
    vocab = logits.shape[-1]
    device = logits.device  # every tensor built here goes there: CUDA rejects a mix
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            banned = [t for t in banned if t < vocab]
            if banned:
                logits[i, banned] = float("-inf")
        if not p.has_penalties:
            continue
        # the sets and counts are taken on the host (a row's tokens are a short Python list);
        # only the touched logits are read and written
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids).union(r.output_token_ids)), dtype=torch.long,
                                device=device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if r.output_token_ids and (p.frequency_penalty or p.presence_penalty):
            counts = Counter(r.output_token_ids)
            ids = torch.tensor(list(counts), dtype=torch.long, device=device)
            n = torch.tensor(list(counts.values()), dtype=logits.dtype, device=device)
            logits[i, ids] -= p.frequency_penalty * n + p.presence_penalty


def filter_logits(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p (Holtzman et al. 2020, nucleus sampling) and min-p
    (Nguyen et al. 2024) on one ``[vocab_size]`` row; removed tokens get -inf."""
    row = row / p.temperature
    if 0 < p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        row = torch.full_like(row, float("-inf")).scatter(0, order, sorted_logits)
    if p.min_p > 0:
        probs = row.softmax(-1)
        row = row.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return row


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
    """Pick one token per row.

    Args:
        logits: ``[num_rows, vocab_size]`` fp32, straight from the model (not modified).
        rows: one :class:`SampleRow` per row.

    Returns:
        A :class:`SamplerOutput`. Greedy rows (temperature 0) take the argmax of the penalized
        logits; the others sample from softmax of the filtered logits with the row's generator
        (the default RNG when it is None). Log-probabilities are the raw model's.
    """
    needs_processing = any(r.params.has_penalties or r.params.min_tokens for r in rows)
    processed = logits.clone() if needs_processing else logits
    if needs_processing:
        apply_penalties(processed, rows)
    out = processed.argmax(dim=-1).tolist()
    for i, r in enumerate(rows):
        if r.params.is_greedy:
            continue
        probs = filter_logits(processed[i], r.params).softmax(-1)
        out[i] = int(torch.multinomial(probs, 1, generator=r.generator).item())
    result = SamplerOutput(out, [None] * len(rows))
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if lp_rows:
        lps = torch.log_softmax(logits[lp_rows].float(), dim=-1)
        for lp, i in zip(lps, lp_rows):
            result.logprobs[i] = top_logprobs(lp, out[i], rows[i].params.logprobs)
    return result
