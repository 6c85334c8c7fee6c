"""Continuous-batching scheduler: which requests run in the next step, and how many tokens each.

One rule covers prefill, chunked prefill, decode and prefix hits: each scheduled request's
``num_computed_tokens`` catches up with its ``num_tokens`` as far as the step's token budget
(``max_num_batched_tokens``) allows. Running requests go first, then waiting ones in arrival order,
up to ``max_num_seqs`` running. When the pool runs out of blocks the most recently admitted running
request is preempted: its blocks are freed and it goes back to the head of the waiting queue, to be
recomputed later (after vLLM's scheduler, recompute mode).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from weir.engine.kv_cache_manager import KVCacheManager
from weir.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """True when this step's tokens bring the request up to date (logits needed)."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens == r.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """Per request id: the sampled token, and/or the scoring log-probabilities of this step."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, list] = field(default_factory=dict)  # sampled-token entries, if asked
    prompt_logprobs: dict[str, dict[int, list]] = field(default_factory=dict)
    score_logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    final_logprobs: dict[str, list[float]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add_request(self, req: Request, front: bool = False) -> None:
        (self.waiting.appendleft if front else self.waiting.append)(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request) -> None:
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.score_logprobs = {}
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            hits, num_hit = ([], 0) if req.num_computed_tokens else self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens += num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.metrics.setdefault("first_scheduled_time", time.time())
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[Request]:
        """Advance every scheduled request by its tokens; append sampled tokens; finish requests.

        Returns:
            The requests that finished in this step (their blocks already freed).
        """
        finished = []
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            rid = req.request_id
            if req.is_scoring and rid in result.score_logprobs:
                req.score_logprobs.update(result.score_logprobs[rid])
            if rid in result.prompt_logprobs:
                req.prompt_logprobs.update(result.prompt_logprobs[rid])
            if req.num_computed_tokens < req.num_tokens:
                continue
            if req.is_scoring:
                if req.request_id in result.final_logprobs:
                    req.final_logprobs = result.final_logprobs[req.request_id]
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                if rid in result.logprobs:
                    req.logprobs.append(result.logprobs[rid])
                self._append_token(req, result.sampled[rid])
                if req.on_first_token is not None:
                    hook, req.on_first_token = req.on_first_token, None
                    hook(req)
            if req.is_finished:
                finished.append(req)
        for req in finished:
            self.running.remove(req)
            if req.on_finish is not None:
                req.on_finish(req)
            self.kv.free(req)
        return finished

    def _append_token(self, req: Request, token: int) -> None:
        req.append_output_token(token)
        if "first_token_time" not in req.metrics:
            req.metrics["first_token_time"] = time.time()
        p = req.sampling_params
        may_stop = len(req.output_token_ids) >= p.min_tokens
        if may_stop and not p.ignore_eos and token in req.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
        elif may_stop and token in p.stop_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
            req.stop_reason = token
        elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH_CAPPED

    def release_waiting_blocks(self) -> None:
        """Nothing could be scheduled although requests wait: the blocks are held by waiting
        (forked) requests. Free theirs, tail first, so they recompute through the prefix cache."""
        for req in reversed(self.waiting):
            if req.block_table:
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.score_logprobs = {}

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """End a running or waiting request from outside the step (a stop string, a deadline):
        it leaves the queues and its blocks are freed at once."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = status

    def abort(self, request_id: str) -> Request | None:
        """Remove a request wherever it is and free its blocks at once."""
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                break
        else:
            for req in self.running:
                if req.request_id == request_id:
                    self.running.remove(req)
                    break
            else:
                return None
        self.kv.free(req)
        req.status = RequestStatus.FINISHED_ABORTED
        return req
