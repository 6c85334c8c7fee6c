"""Log-probabilities a step reports: the chosen token's value and rank, and the top ones, gathered
for every row at once on the device; turned into entries on the host."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from weir.engine.sampling_params import LOGPROB_SENTINEL

# (token id, log-probability, rank): rank 1 is the most likely token
TokenLogprob = tuple[int, float, int]


def finite_logprob(v: float) -> float:
    return v if math.isfinite(v) else LOGPROB_SENTINEL


@dataclass
class LogprobTensors:
    """Per row, on the device: ``chosen`` ``[num_rows]`` fp32 log-probability of the row's token,
    ``ranks`` ``[num_rows]`` int64 (1 + the number of tokens strictly more likely), and the
    ``top_values`` ``[num_rows, k]`` fp32 / ``top_ids`` ``[num_rows, k]`` int64 of the k most likely
    tokens, most likely first."""

    chosen: torch.Tensor
    ranks: torch.Tensor
    top_values: torch.Tensor
    top_ids: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.chosen, self.ranks, self.top_values, self.top_ids]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> LogprobTensors:
    """One top-k and one rank count for every row.

    Args:
        logprobs: ``[num_rows, vocab_size]`` fp32 log-softmax rows.
        token_ids: ``[num_rows]`` int64 on the same device, the token whose entry each row reports.
        num_top: k, the largest number of top tokens any row asks for (capped at the vocabulary).
    """
    chosen = logprobs.gather(1, token_ids[:, None])  # [num_rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
    return LogprobTensors(chosen[:, 0], ranks, top_values, top_ids)


def logprob_entries(token_ids: list[int], host: list[torch.Tensor], nums: list[int]) -> list[list[TokenLogprob]]:
    """Host side of :func:`gather_logprobs`: per row, the token's entry then its first ``nums[i]``
    top entries (ranks 1..nums[i]); non-finite values become ``LOGPROB_SENTINEL``.

    Args:
        token_ids: the row tokens, as passed to :func:`gather_logprobs`.
        host: its four tensors (``LogprobTensors.tensors()`` order) on the host.
        nums: per row, how many top entries it asked for.
    """
    chosen, ranks, top_values, top_ids = (t.tolist() for t in host)
    out = []
    for i, (tok, num) in enumerate(zip(token_ids, nums)):
        entry = [(tok, finite_logprob(chosen[i]), ranks[i])]
        entry += [(top_ids[i][r], finite_logprob(top_values[i][r]), r + 1) for r in range(num)]
        out.append(entry)
    return out
