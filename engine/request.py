"""A request inside the engine: its tokens, progress, block table and status."""

from __future__ import annotations

import enum
import time
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


class Request:
    """One sequence the scheduler runs.

    Owns its token ids (prompt then output), ``num_computed_tokens`` (tokens whose keys/values
    are in the cache) and its ``block_table`` (KV block ids covering those tokens, in order).

    A *scoring* request (``score_targets`` set) generates nothing: it computes its prompt and
    returns the log-probability of each target token, where ``score_targets[i]`` is the token
    expected after position ``score_start + i`` (``score_logprobs[i]``), and, when
    ``final_logprob_ids`` is set, the log-probabilities of those ids after its last token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: Optional[float] = None,
        prompt: Optional[str] = None,
    ):
        self.request_id = request_id
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
        self.num_cached_tokens = -1  # set at first scheduling
        self.block_table: list[int] = []
        self.block_hashes: list = []  # chain hashes of the full blocks of all_token_ids
        self.num_preemptions = 0
        self.generator = None
        self.score_start: Optional[int] = None
        self.score_targets: Optional[list[int]] = None
        self.score_logprobs: dict[int, float] = {}
        self.final_logprob_ids: Optional[list[int]] = None
        self.final_logprobs: Optional[list[float]] = None
        self.on_finish = None  # callable(request) run by the engine when the request ends
        self.on_first_token = None  # callable(request) run when the first output token is appended
        self.sample_index = 0  # which of the request's ``n`` samples this sequence is
        self.group = None  # the engine's record of the ``n`` samples this sequence belongs to
        self.logprobs: list = []  # per output token: sampler entries (see engine.sampler.TokenLogprob)
        self.prompt_logprobs: dict[int, list] = {}  # prompt position -> entries
        self.detokenizer = None  # engine.detokenizer.IncrementalDetokenizer when text is tracked
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
        return self.score_targets is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")
