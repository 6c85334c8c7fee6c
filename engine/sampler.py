"""Turns a batch of logits into next tokens in one pass over the batch: penalties, min_tokens,
greedy, temperature, top-k, top-p, min-p with per-row parameters as tensors, per-request seeds, and
the log-probabilities a request asked for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from weir.engine.host_transfer import HostTransfer, to_device
from weir.engine.logprobs import TokenLogprob, finite_logprob, gather_logprobs, logprob_entries
from weir.engine.sampling_params import SamplingParams

__all__ = ["SampleRow", "SamplerOutput", "TokenLogprob", "finite_logprob", "apply_penalties",
           "filter_logits", "sample_tokens", "sample"]


@dataclass
class SampleRow:
    """What the sampler needs of one row of logits."""

    params: SamplingParams
    generator: Optional[torch.Generator]
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int] = frozenset()

    @property
    def is_seeded(self) -> bool:
        """Draws from a generator of its own (the same tokens whatever the batch holds)."""
        return self.params.seed is not None and self.generator is not None


@dataclass
class SamplerOutput:
    """Per row: the chosen token, and when asked, its log-probability and the top ones.

    ``logprobs[i]`` is None when row i asked for none; otherwise the sampled token's entry
    first, then the top ``params.logprobs`` tokens by rank (the sampled one may repeat there).
    """

    token_ids: list[int]
    logprobs: list[Optional[list[TokenLogprob]]] = field(default_factory=list)


def divide_rows(x: torch.Tensor, divisors: list[float]) -> torch.Tensor:
    """``x[i] / divisors[i]`` for a ``[num_rows, vocab_size]`` fp32 ``x``, rounded as PyTorch rounds
    ``row / python_float`` on x's device, so that a row's values do not depend on its batch: CUDA's
    ``div_true_kernel_cuda`` multiplies by the reciprocal (taken in double, then cast to fp32);
    the CPU kernel divides."""
    if x.device.type == "cuda":
        return x * to_device([1.0 / d for d in divisors], x.device, x.dtype)[:, None]
    return x / to_device(divisors, x.device, x.dtype)[:, None]


def token_counts(token_ids: list[list[int]], vocab: int, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """``[len(token_ids), vocab]`` counts of each row's token ids, by one ``scatter_add_`` over the
    rows padded with id ``vocab`` (a spare column, dropped)."""
    width = max(map(len, token_ids), default=0)
    padded = to_device([ids + [vocab] * (width - len(ids)) for ids in token_ids], device,
                       torch.long).reshape(len(token_ids), width)  # [num_rows, width]
    counts = torch.zeros(len(token_ids), vocab + 1, dtype=dtype, device=device)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=dtype, device=device))
    return counts[:, :vocab]


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    """In place on ``[num_rows, vocab_size]`` fp32 logits, for the rows asking: min_tokens masks
    EOS and stop token ids; repetition penalty (CTRL, Keskar et al. 2019) over prompt and output
    tokens; frequency and presence penalties (OpenAI's definition) over output tokens. Each is one
    batched operation over the rows that ask for it."""
    vocab = logits.shape[-1]
    device = logits.device  # every tensor built here goes there: CUDA rejects a mix
    banned_rows, banned_ids = [], []
    for i, r in enumerate(rows):
        p = r.params
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
            banned = sorted(t for t in banned if t < vocab)
            banned_rows += [i] * len(banned)
            banned_ids += banned
    if banned_ids:
        logits[to_device(banned_rows, device), to_device(banned_ids, device)] = float("-inf")
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = token_counts([rows[i].prompt_token_ids + rows[i].output_token_ids for i in rep], vocab,
                            device) > 0
        idx = to_device(rep, device)
        penalties = [rows[i].params.repetition_penalty for i in rep]
        vals = logits[idx]
        scaled = torch.where(vals > 0, divide_rows(vals, penalties),
                             vals * to_device(penalties, device, vals.dtype)[:, None])
        logits[idx] = torch.where(seen, scaled, vals)
    freq = [i for i, r in enumerate(rows)
            if r.output_token_ids and (r.params.frequency_penalty or r.params.presence_penalty)]
    if freq:
        counts = token_counts([rows[i].output_token_ids for i in freq], vocab, device, logits.dtype)
        idx = to_device(freq, device)
        f = to_device([rows[i].params.frequency_penalty for i in freq], device, logits.dtype)
        p = to_device([rows[i].params.presence_penalty for i in freq], device, logits.dtype)
        vals = logits[idx]
        logits[idx] = torch.where(counts > 0, vals - (f[:, None] * counts + p[:, None]), vals)


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p (Holtzman et al. 2020, nucleus sampling) and min-p
    (Nguyen et al. 2024), each row with its own parameters; removed tokens get -inf.

    Args:
        logits: ``[num_rows, vocab_size]`` fp32 (not modified).
        params: one per row; temperature 0 rows are left unscaled.

    Returns:
        New ``[num_rows, vocab_size]`` fp32 logits. Each row holds exactly the values filtering
        that row alone would give (the same operations, row-wise); a filter no row asks for is skipped.
    """
    device = logits.device
    vocab = logits.shape[-1]
    x = divide_rows(logits, [p.temperature or 1.0 for p in params])
    top_ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(top_ks):
        rows, sub = asking_rows(x, [k > 0 for k in top_ks])
        ks = [top_ks[i] for i in rows] if rows is not None else top_ks
        top = torch.topk(sub, max(ks), dim=-1).values  # [num_asking, max_k]
        kth = top.gather(1, to_device([k - 1 for k in ks], device)[:, None])
        x = put_rows(x, rows, sub.masked_fill(sub < kth, float("-inf")))
    if any(p.top_p < 1.0 for p in params):
        rows, sub = asking_rows(x, [p.top_p < 1.0 for p in params])
        sorted_logits, order = torch.sort(sub, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        top_p = to_device([p.top_p for p in (params if rows is None else [params[i] for i in rows])], device)
        # drop a token when the mass before it already reaches top_p (keeps at least one)
        drop = probs.cumsum(-1) - probs >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        x = put_rows(x, rows, sub.scatter_(1, order, sorted_logits))  # order is a permutation
    if any(p.min_p > 0 for p in params):
        rows, sub = asking_rows(x, [p.min_p > 0 for p in params])
        probs = sub.softmax(-1)
        min_p = to_device([p.min_p for p in (params if rows is None else [params[i] for i in rows])], device,
                          x.dtype)[:, None]
        x = put_rows(x, rows, sub.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values,
                                              float("-inf")))
    return x


def asking_rows(x: torch.Tensor, asks: list[bool]) -> tuple[Optional[list[int]], torch.Tensor]:
    """The rows of ``x`` a filter applies to: ``(None, x)`` when every row asks (no copy), else
    their indices and a ``[num_asking, vocab_size]`` copy of them, so that a filter's sort or
    softmax costs only the rows that ask for it."""
    if all(asks):
        return None, x
    rows = [i for i, a in enumerate(asks) if a]
    return rows, x[to_device(rows, x.device)]


def put_rows(x: torch.Tensor, rows: Optional[list[int]], values: torch.Tensor) -> torch.Tensor:
    """``x`` with a filter's result: ``values`` itself when every row asked, else ``x`` with the
    asking rows overwritten in place."""
    if rows is None:
        return values
    x[to_device(rows, x.device)] = values
    return x


def sample_tokens(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Pick one token per row, without reading anything back to the host.

    Args:
        logits: ``[num_rows, vocab_size]`` fp32, straight from the model (not modified).
        rows: one :class:`SampleRow` per row.

    Returns:
        ``[num_rows]`` int64 token ids on the logits' device. Greedy rows (temperature 0) take the
        argmax of the penalized logits; the others sample from softmax of the filtered logits by
        ``torch.multinomial``'s own one-sample path (``argmax(probs / q)``, ``q`` exponential
        noise: the Gumbel-max trick), written out because ``torch.multinomial`` first checks its
        input with two ``.item()`` host syncs. A seeded row draws its ``q`` with
        ``exponential_(1, generator=row.generator)`` on its own ``[vocab_size]`` row, as
        ``torch.multinomial(probs_row, 1, generator=row.generator)`` does, so its stream and its token
        are those of the row-by-row sampler whatever the batch holds; unseeded rows sharing a
        generator (the engine's default, or the global RNG for None) draw their noise in one call.
    """
    device = logits.device
    needs_processing = any(r.params.has_penalties or r.params.min_tokens for r in rows)
    processed = logits.clone() if needs_processing else logits
    if needs_processing:
        apply_penalties(processed, rows)
    tokens = processed.max(dim=-1).indices  # argmax's first-maximum index, ~3x faster on CPU
    sampled = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if not sampled:
        return tokens
    x = processed if len(sampled) == len(rows) else processed[to_device(sampled, device)]
    probs = filter_logits(x, [rows[i].params for i in sampled]).softmax(-1)  # [num_sampled, vocab]
    noise = torch.empty_like(probs)
    groups: dict[int, tuple[Optional[torch.Generator], list[int]]] = {}
    for j, i in enumerate(sampled):
        r = rows[i]
        if r.is_seeded:
            noise[j].exponential_(1, generator=r.generator)
        else:
            groups.setdefault(id(r.generator), (r.generator, []))[1].append(j)
    for generator, js in groups.values():
        if len(js) == len(sampled):
            noise.exponential_(1, generator=generator)
        else:
            noise[to_device(js, device)] = torch.empty(len(js), probs.shape[-1], device=device).exponential_(
                1, generator=generator)
    draws = (probs / noise).max(dim=-1).indices
    if len(sampled) == len(rows):
        return draws
    tokens[to_device(sampled, device)] = draws
    return tokens


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
    """:func:`sample_tokens`, then the log-probabilities rows ask for (the raw model's: before
    penalties and temperature), read back with one device-to-host copy.

    Args:
        logits: ``[num_rows, vocab_size]`` fp32 (not modified).
        rows: one :class:`SampleRow` per row.
    """
    tokens = sample_tokens(logits, rows)
    transfer = HostTransfer()
    transfer.add(tokens)
    lp_rows = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if lp_rows:
        every = len(lp_rows) == len(rows)
        idx = to_device(lp_rows, logits.device)
        lps = torch.log_softmax((logits if every else logits[idx]).float(), dim=-1)
        nums = [rows[i].params.logprobs for i in lp_rows]
        for t in gather_logprobs(lps, tokens if every else tokens[idx], max(nums)).tensors():
            transfer.add(t)
    host_tokens, *host_lp = transfer.fetch()
    token_ids = host_tokens.tolist()
    result = SamplerOutput(token_ids, [None] * len(rows))
    if lp_rows:
        entries = logprob_entries([token_ids[i] for i in lp_rows], host_lp, nums)
        for i, entry in zip(lp_rows, entries):
            result.logprobs[i] = entry
    return result
