"""A request inside the engine: its tokens, progress, block table and status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Optional

from weir.engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    """Ordered so that every finished state compares greater than ``PREEMPTED``."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> Optional[str]:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_IGNORED: "length",
        }.get(status)


@dataclass
class ScoringTask:
    """What a scoring request computes instead of sampling: the log-probability of each target
    token, where ``targets[i]`` is the token expected after position ``start + i`` (no targets when
    ``start`` is None), and, when ``final_logprob_ids`` is set, the log-probabilities of those ids
    after the request's last token. Results (nats) fill ``logprobs`` and ``final_logprobs``."""

    start: Optional[int]
    targets: list[int]
    final_logprob_ids: Optional[list[int]] = None
    logprobs: dict[int, float] = field(default_factory=dict)  # i -> log p(targets[i])
    final_logprobs: Optional[list[float]] = None


class Request:
    """One sequence the scheduler runs.

    Owns its token ids (prompt then output), ``num_computed_tokens`` (tokens whose keys/values
    are in the cache), its ``block_table`` (KV block ids covering those tokens, in order) and its
    status. ``block_table`` is only appended to while the request holds blocks; freeing or forking
    gives it a new list (the persistent batch copies a longer list's tail and rewrites its row for
    a new list, see :class:`~weir.engine.input_batch.InputBatch`). ``num_cached_tokens`` (prompt tokens found in the prefix cache) is None until it is
    first scheduled. A *scoring* request (``scoring`` set) generates nothing: see
    :class:`ScoringTask`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: Optional[float] = None,
        prompt: Optional[str] = None,
        sample_index: int = 0,
        scoring: Optional[ScoringTask] = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.priority = priority  # scheduling_policy="priority": lower runs first (vLLM's meaning)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None  # stop token id or stop string that ended it
        self.num_computed_tokens = 0
        self.num_cached_tokens: Optional[int] = None
        self.block_table: list[int] = []
        self.block_hashes: list = []  # chain hashes of the full blocks of all_token_ids
        self.num_preemptions = 0
        self.generator = None
        # grammar state (weir.engine.structured_outputs.StructuredOutputRequest) of a constrained sequence
        self.structured_output = None
        self.scoring = scoring
        self.sample_index = sample_index  # which of the request's ``n`` samples this sequence is
        self.logprobs: list = []  # per output token: sampler entries (see engine.sampler.TokenLogprob)
        self.prompt_logprobs: dict[int, list] = {}  # prompt position -> entries
        self.deadline: Optional[float] = None  # time.time() after which the request is aborted
        self.metrics = {"arrival_time": arrival_time or time.time()}

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def is_scoring(self) -> bool:
        return self.scoring is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def reset_progress(self) -> None:
        """Forget what was computed (after its blocks were freed): the request recomputes."""
        self.num_computed_tokens = 0
        if self.scoring is not None:
            self.scoring.logprobs = {}

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")
