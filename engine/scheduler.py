"""Continuous-batching scheduler: which requests run in the next step, and how many tokens each.

One rule covers prefill, chunked prefill, decode and prefix hits: each scheduled request's
``num_computed_tokens`` catches up with its ``num_tokens`` as far as the step's token budget
(``max_num_batched_tokens``) allows. Running requests go first, then waiting ones in arrival order,
up to ``max_num_seqs`` running. When the pool runs out of blocks the most recently admitted running
request is preempted: its blocks are freed and it goes back to the head of the waiting queue, to be
recomputed later (after vLLM's scheduler, recompute mode).

With ``policy="priority"`` (vLLM's ``scheduling_policy``) the order is each request's
``(priority, arrival_time)``, lower first, for the waiting queue, for serving the running ones and
for choosing the victim of a preemption (the running request last in that order). A waiting request
of strictly lower priority value than some running one also preempts the last running one when it
cannot start otherwise (every sequence slot taken, or too few free blocks for its next chunk).

``strict_priority`` (priority policy only) makes the order a strict one between priority values:
while a request of the best (lowest) priority value present runs or waits, only requests of that
value are scheduled. The others stay in ``running`` with their blocks and computed tokens, are not
stepped, and resume where they were once the better ones are done (or give their blocks up first
when a better one needs them, as above). Without it (vLLM's behaviour) every running request is
stepped in priority order as far as the token budget goes, so a request of priority 0 shares each
step with up to ``max_num_seqs - 1`` bulk ones: free on a GPU, where a decode step of 1 or 64
sequences costs about the same, and a step up to ``max_num_seqs`` times longer where compute grows
with the batch (a CPU) or where bulk prefill chunks share the step's token budget.

``update`` applies a step's ``ModelRunnerOutput`` and returns what changed (:class:`SchedulerUpdate`);
it calls nothing outside the scheduler and the KV cache manager.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Literal
from dataclasses import dataclass, field

from weir.engine.kv_cache_manager import KVCacheManager
from weir.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass(slots=True)
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


@dataclass
class SchedulerUpdate:
    """What one step's ``update`` changed.

    Attributes:
        sampled: generation requests that got a token in this step, in scheduled order (finished
            ones included).
        finished: requests that ended in this step (EOS, a stop token id, a length limit, scoring
            done), in scheduled order. They have left ``running`` but still hold their blocks, so
            that new requests can be forked from them; :meth:`Scheduler.free` returns the blocks.
    """

    sampled: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


def _key(req: Request) -> tuple[int, float]:
    """The priority policy's order: lower priority value first, then earlier arrival."""
    return req.priority, req.metrics["arrival_time"]


class Scheduler:
    """Owns the ``waiting`` queue and the ``running`` list; changes blocks only through the
    :class:`KVCacheManager`."""

    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: Literal["fcfs", "priority"] = "fcfs", strict_priority: bool = False):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={policy!r} is not one of fcfs, priority")
        if strict_priority and policy != "priority":
            raise ValueError("strict_priority=True needs scheduling_policy='priority'")
        self.policy = policy
        self.strict_priority = strict_priority
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # ids of the requests scheduled for the first time since the last take_first_scheduled()
        self._first_scheduled: list[str] = []

    def take_first_scheduled(self) -> list[str]:
        """The ids of the requests scheduled for the first time (their ``first_scheduled_time``
        set) since the last call, in scheduling order; a request preempted and scheduled again is
        not listed again."""
        ids, self._first_scheduled = self._first_scheduled, []
        return ids

    def add_request(self, req: Request, front: bool = False) -> None:
        """Queue ``req``; ``front``: ahead of the waiting requests (under the priority policy, of
        those of its priority and lower ones)."""
        if self.policy == "fcfs":
            (self.waiting.appendleft if front else self.waiting.append)(req)
            return
        key = req.priority if front else (req.priority, req.metrics["arrival_time"])
        i = len(self.waiting)
        # from the back: new requests usually arrive last in their priority
        while i > 0 and (self.waiting[i - 1].priority if front else _key(self.waiting[i - 1])) > key:
            i -= 1
        if front:
            while i > 0 and self.waiting[i - 1].priority == req.priority:
                i -= 1
        self.waiting.insert(i, req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, victim: Request) -> None:
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.reset_progress()
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.add_request(victim, front=True)

    def _preempt_for_waiting(self) -> bool:
        """Priority policy: preempt the last running requests (in priority order) while the first
        waiting one has a strictly lower priority value and no sequence slot or too few free blocks
        for its next chunk. True when something was preempted."""
        preempted = False
        while self.waiting and self.running:
            head, last = self.waiting[0], self.running[-1]
            if last.priority <= head.priority:
                break
            need = self.kv.num_blocks_needed(min(head.num_tokens, head.num_computed_tokens + self.max_num_batched_tokens))
            if len(self.running) < self.max_num_seqs and self.kv.pool.num_free_blocks >= need - len(head.block_table):
                break
            self._preempt(self.running.pop())
            preempted = True
        return preempted

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        top = None  # strict_priority: the only priority value scheduled in this step
        if self.policy == "priority":
            self.running.sort(key=_key)  # stable: equal keys keep their order
            self._preempt_for_waiting()
            if self.strict_priority and (self.running or self.waiting):
                top = min(q[0].priority for q in (self.running, self.waiting) if q)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if top is not None and req.priority > top:
                break  # held: the rest of running is of worse priority (sorted)
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
            if top is not None and req.priority > top:
                break
            hits, num_hit = ([], 0) if req.num_computed_tokens else self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - req.num_computed_tokens - num_hit, budget)
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens += num_hit
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
                req.metrics.setdefault("first_scheduled_time", time.time())
                self._first_scheduled.append(req.request_id)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> SchedulerUpdate:
        """Advance every scheduled request by its tokens; append sampled tokens; finish requests.

        Called once the step's execute returned, so the hashes registered while scheduling it
        are committed to the prefix cache first.
        """
        self.kv.commit_cached_blocks()
        out = SchedulerUpdate()
        for s in sched.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            rid = req.request_id
            if req.is_scoring and rid in result.score_logprobs:
                req.scoring.logprobs.update(result.score_logprobs[rid])
            if rid in result.prompt_logprobs:
                req.prompt_logprobs.update(result.prompt_logprobs[rid])
            if req.num_computed_tokens < req.num_tokens:
                continue
            if req.is_scoring:
                if rid in result.final_logprobs:
                    req.scoring.final_logprobs = result.final_logprobs[rid]
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                if rid in result.logprobs:
                    req.logprobs.append(result.logprobs[rid])
                self._append_token(req, result.sampled[rid])
                out.sampled.append(req)
            if req.is_finished:
                out.finished.append(req)
        if out.finished:  # one pass over running, not one list.remove per finished request
            self.running[:] = [r for r in self.running if not r.is_finished]
        return out

    def free(self, reqs: list[Request]) -> None:
        """Return the blocks of finished requests, in the order given."""
        for req in reqs:
            self.kv.free(req)

    def fail_step(self, sched: SchedulerOutput) -> list[Request]:
        """The step's execute raised: forget the block hashes registered for it (their blocks
        were never written), leaving the requests as scheduled for the caller to end.

        Returns:
            The step's requests, in scheduled order.
        """
        self.kv.uncache_uncommitted()
        return [s.request for s in sched.scheduled]

    def _append_token(self, req: Request, token: int) -> None:
        req.append_output_token(token)
        if "first_token_time" not in req.metrics:
            req.metrics["first_token_time"] = time.time()
        p = req.sampling_params
        may_stop = len(req.output_token_ids) >= p.min_tokens
        grammar = req.structured_output
        if grammar is not None and not grammar.accept(token):
            # only when every token was masked (min_tokens banning the end the grammar requires)
            req.status = RequestStatus.FINISHED_ABORTED
            req.stop_reason = "grammar"
            logger.warning("request %s: token %d is outside its grammar; aborted", req.request_id, token)
        elif grammar is not None and grammar.is_terminated:
            req.status = RequestStatus.FINISHED_STOPPED
        elif may_stop and not p.ignore_eos and token in req.eos_token_ids:
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
                req.reset_progress()

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
