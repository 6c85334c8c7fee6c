"""The engine: requests in, one scheduled step at a time, outputs out.

``step()`` is three lines of data flow: ``scheduler.schedule() -> SchedulerOutput``,
``model_runner.execute(SchedulerOutput) -> ModelRunnerOutput``, ``scheduler.update(...)``.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Optional, Union

import torch

from weir.engine.block_pool import BlockPool
from weir.engine.classification import Classification, LabelNode, node_request_plan
from weir.engine.engine_args import EngineArgs
from weir.engine.kv_cache_manager import KVCacheManager
from weir.engine.loader import check_config, load_config, load_generation_eos_ids, load_state_dict, load_tokenizer, resolve_model
from weir.engine.model_runner import ModelRunner
from weir.engine.models.llama import LlamaForCausalLM
from weir.engine.outputs import ClassificationOutput, CompletionOutput, Logprob, RequestOutput
from weir.engine.request import Request, RequestStatus
from weir.engine.sampling_params import SamplingParams
from weir.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

EngineOutput = Union[RequestOutput, ClassificationOutput]


class _SampleGroup:
    """The ``n`` sequences of one generation request; sequence 0 computes the prompt, the others
    are forked from its blocks once it has sampled its first token."""

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.members: list[Request] = []
        self.n = n

    @property
    def finished(self) -> bool:
        return len(self.members) == self.n and all(m.is_finished for m in self.members)


class LLMEngine:
    """Owns the model runner, KV cache, block pool, scheduler and tokenizer of one model.

    Not thread-safe: one thread calls ``add_*``/``step``; see ``weir.engine.front.EngineFront``.
    """

    def __init__(self, args: EngineArgs):
        self.args = args
        self.device = torch.device(
            args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if args.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = getattr(torch, args.dtype)
        t0 = time.time()
        self.tokenizer = None
        if args.load_format == "dummy" and not isinstance(args.model, (str, type(None))):
            self.config = args.model
            check_config(self.config)
            self.model_name = f"dummy-{self.config.model_type}"
            eos_ids = {self.config.eos_token_id} if isinstance(self.config.eos_token_id, int) else set(
                self.config.eos_token_id or [])
        else:
            src = resolve_model(args.model)
            self.model_name = src.name
            self.config = load_config(src)
            if not args.skip_tokenizer_init:
                self.tokenizer = load_tokenizer(resolve_model(args.tokenizer) if args.tokenizer else src)
            eos_ids = load_generation_eos_ids(src, self.config)
            if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
                eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        max_pos = getattr(self.config, "max_position_embeddings", None) or 4096
        self.max_model_len = min(args.max_model_len or max_pos, max_pos)
        if args.max_model_len and args.max_model_len > max_pos:
            raise ValueError(f"max_model_len={args.max_model_len} exceeds the model's "
                             f"max_position_embeddings={max_pos}")

        torch.manual_seed(args.seed)
        self.model = LlamaForCausalLM(self.config, self.dtype, self.max_model_len)
        if args.load_format == "dummy":
            self.model.init_dummy(args.seed)
        else:
            self.model.load_hf_state_dict(load_state_dict(src))
        self.model.to(self.device).eval()

        self.num_blocks = self._num_kv_blocks()
        need = math.ceil(self.max_model_len / args.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {need} KV blocks of {args.block_size} tokens "
                f"but only {self.num_blocks} fit; lower max_model_len or give the cache more memory")
        self.runner = ModelRunner(self.model, self.num_blocks, args.block_size, self.device, self.dtype,
                                  args.max_num_seqs, self.max_model_len, args.enforce_eager)
        self.block_pool = BlockPool(self.num_blocks, args.enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, args.block_size, self.runner.copy_block,
                                 extra_key=self.model_name)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len)
        self.default_generator = torch.Generator(device=self.device).manual_seed(args.seed)
        self._ids = itertools.count()
        self._classifications: dict[str, Classification] = {}
        self._groups: dict[str, _SampleGroup] = {}
        self._deadlines: dict[str, Request] = {}
        # count, sum, max of each per-request duration (seconds)
        self._timings = {k: [0, 0.0, 0.0] for k in ("queue_time_s", "time_to_first_token_s", "e2e_latency_s")}
        self._finished: list[EngineOutput] = []
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        logger.info("engine ready: model=%s device=%s dtype=%s num_gpu_blocks=%d block_size=%d "
                    "max_model_len=%d (%.1f s)", self.model_name, self.device, self.dtype,
                    self.num_blocks, args.block_size, self.max_model_len, time.time() - t0)

    def _num_kv_blocks(self) -> int:
        a = self.args
        per_block = ModelRunner.kv_bytes_per_block(self.config, a.block_size, self.dtype)
        if a.num_gpu_blocks_override:
            return a.num_gpu_blocks_override
        if self.device.type == "cuda":
            from weir.engine.gpu_memory import profile_kv_cache_bytes

            kv_cache_bytes = profile_kv_cache_bytes(
                self.model, a.max_num_batched_tokens, a.max_num_seqs, self.max_model_len, a.block_size,
                a.gpu_memory_utilization, self.device, self.dtype)
            return kv_cache_bytes // per_block
        return max(a.cpu_kv_cache_bytes // per_block, 1)

    # ---- requests ---------------------------------------------------------------------------

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for an empty prompt or one that cannot fit ``max_model_len``."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt is empty")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len} allows "
                             f"(at least one token must be generated)")
        vocab = self.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: Optional[str] = None, prompt: Optional[str] = None,
                    timeout_s: Optional[float] = None) -> str:
        """Queue one generation request (``params.n`` samples).

        Args:
            timeout_s: seconds from now after which the request is aborted (blocks freed,
                output returned with ``finish_reason="abort"`` and ``stop_reason="timeout"``).

        Raises:
            ValueError: empty prompt, prompt too long, token ids outside the vocabulary, stop
                strings without a tokenizer, more logprobs than ``max_logprobs``, timeout_s not > 0.
        """
        self.check_prompt(prompt_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.args.max_logprobs:
                raise ValueError(f"{name}={asked} is more than max_logprobs={self.args.max_logprobs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        rid = request_id or f"gen-{next(self._ids)}"
        req = self._new_sequence(rid, prompt_token_ids, params, 0, prompt)
        if timeout_s is not None:
            req.deadline = time.time() + timeout_s
            self._deadlines[rid] = req
        group = self._groups[rid] = _SampleGroup(rid, params.n)
        group.members.append(req)
        req.group = group
        if params.n > 1:
            req.on_first_token = lambda parent: self._fork_samples(group, parent)
        self.num_prompt_tokens += req.num_prompt_tokens
        self.scheduler.add_request(req)
        return rid

    def _new_sequence(self, rid: str, prompt_token_ids: list[int], params: SamplingParams, index: int,
                      prompt: Optional[str] = None) -> Request:
        req = Request(rid, prompt_token_ids, params, self.eos_token_ids, prompt=prompt)
        req.sample_index = index
        seed = params.sample_seed(index)
        if seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(seed)
        elif not params.is_greedy:
            req.generator = self.default_generator
        if params.stop and self.tokenizer is not None:
            from weir.engine.detokenizer import IncrementalDetokenizer

            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        return req

    def _fork_samples(self, group: _SampleGroup, parent: Request) -> None:
        """Parent has sampled its first token: samples 1..n-1 take its prompt blocks (all but the
        last prompt token's, which each recomputes to sample its own first token)."""
        params = parent.sampling_params
        children = []
        for i in range(1, params.n):
            child = self._new_sequence(f"{group.request_id}/{i}", parent.prompt_token_ids, params, i,
                                       parent.prompt)
            child.deadline = parent.deadline
            if child.deadline is not None:
                self._deadlines[child.request_id] = child
            child.metrics = {"arrival_time": parent.metrics["arrival_time"]}
            if not self.kv.fork(parent, child, parent.num_prompt_tokens - 1):
                child.num_computed_tokens = 0  # no block for the copy: recompute via the prefix cache
            group.members.append(child)
            child.group = group
            children.append(child)
        for child in reversed(children):
            self.scheduler.add_request(child, front=True)

    def add_classification(self, prompt_token_ids: list[int], labels: list[str],
                           label_token_ids: list[list[int]], request_id: Optional[str] = None,
                           length_normalize: bool = False) -> str:
        """Queue choice scoring of ``labels`` as continuations of the prompt.

        Each label's score is the sum of its tokens' log-probabilities (nats), or their mean with
        ``length_normalize``. The prompt and every prefix shared by several labels are computed
        once (see :mod:`weir.engine.classification`).

        Raises:
            ValueError: empty prompt or label list, duplicate labels, a label with no tokens,
                two labels with the same tokens, too long for the model.
        """
        self.check_prompt(prompt_token_ids)
        if not labels:
            raise ValueError("labels is empty")
        if len(set(labels)) != len(labels):
            raise ValueError("labels must be distinct")
        if len(labels) != len(label_token_ids) or any(len(t) == 0 for t in label_token_ids):
            raise ValueError("every label needs at least one token")
        if len({tuple(t) for t in label_token_ids}) != len(label_token_ids):
            raise ValueError("two labels have the same tokens")
        longest = len(prompt_token_ids) + max(len(t) for t in label_token_ids)
        if longest > self.max_model_len:
            raise ValueError(f"prompt plus label has {longest} tokens, more than max_model_len={self.max_model_len}")
        rid = request_id or f"cls-{next(self._ids)}"
        cls = Classification(rid, labels, label_token_ids, prompt_token_ids, length_normalize)
        root = cls.root
        parent = self._scoring_request(cls, rid, root.edge, None, [], [c.edge[0] for c in root.child_list])
        parent.on_finish = lambda req: self._expand(cls, root, req)
        self._classifications[rid] = cls
        self.num_prompt_tokens += parent.num_prompt_tokens
        self.scheduler.add_request(parent)
        return rid

    def _scoring_request(self, cls: Classification, rid: str, tokens: list[int], score_start: Optional[int],
                         targets: list[int], final_ids: Optional[list[int]]) -> Request:
        req = Request(rid, tokens, SamplingParams(temperature=0, max_tokens=1), self.eos_token_ids)
        req.score_start = score_start
        req.score_targets = targets
        req.final_logprob_ids = final_ids
        cls.active.add(rid)
        return req

    def _expand(self, cls: Classification, node: LabelNode, req: Request) -> None:
        """``node``'s request finished: add its scored tokens, record labels ending there, and
        fork one request per child that still has tokens to score."""
        cls.active.discard(req.request_id)
        if node is cls.root:
            cls.num_cached_tokens = max(req.num_cached_tokens, 0)
        else:
            node.score += sum(req.score_logprobs[j] for j in range(len(req.score_targets)))
        for i in node.labels:
            cls.scores[i] = node.score
        forks = []
        for child, first_lp in zip(node.child_list, req.final_logprobs or []):
            child.score = node.score + first_lp
            num_new, targets, final_ids = node_request_plan(req.num_tokens, child)
            if num_new == 0:
                for i in child.labels:
                    cls.scores[i] = child.score
                continue
            tokens = req.all_token_ids + child.edge[:num_new]
            fork = self._scoring_request(cls, cls.next_id(), tokens, req.num_tokens, targets, final_ids)
            fork.on_finish = lambda r, child=child: self._expand(cls, child, r)
            if not self.kv.fork(req, fork):
                fork.num_computed_tokens = 0  # no block for the copy: recompute via the prefix cache
            cls.num_label_tokens += num_new
            forks.append(fork)
        for fork in reversed(forks):
            self.scheduler.add_request(fork, front=True)
        if cls.done and not cls.active:
            del self._classifications[cls.request_id]
            self._finished.append(cls.output())

    def abort(self, request_id: str) -> bool:
        """Stop a request (every sample of it, or a classification with its label forks) and free
        its blocks at once. Nothing is returned for it.

        Returns:
            False if the request is unknown or already finished.
        """
        found = False
        group = self._groups.pop(request_id, None)
        if group is not None:
            for m in group.members:
                found = (self.scheduler.abort(m.request_id) is not None) or found
        cls = self._classifications.pop(request_id, None)
        if cls is not None:
            for rid in list(cls.active):
                self.scheduler.abort(rid)
            found = True
        return found

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished)

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Run one scheduled step; return the outputs of requests that finished in it."""
        if self._deadlines:
            self._expire(time.time())
        sched = self.scheduler.schedule()
        if sched.scheduled:
            result = self.runner.execute(sched)
            finished = self.scheduler.update(sched, result)
            finished += self._check_stop_strings(sched)
            for req in finished:
                if not req.is_scoring:
                    self._sequence_done(req)
        elif self.scheduler.waiting:
            self.scheduler.release_waiting_blocks()
        out, self._finished = self._finished, []
        return out

    def _check_stop_strings(self, sched) -> list[Request]:
        """Feed new tokens to the detokenizers; a stop string ends its request at once."""
        stopped = []
        for s in sched.scheduled:
            req = s.request
            det = req.detokenizer
            if det is None or len(det.token_ids) == len(req.output_token_ids):
                continue
            p = req.sampling_params
            matched = det.update(req.output_token_ids[len(det.token_ids):],
                                 check_stop=len(req.output_token_ids) >= p.min_tokens)
            if matched is not None:
                req.stop_reason = matched
                if req.is_finished:
                    req.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(req, RequestStatus.FINISHED_STOPPED)
                    stopped.append(req)
        return stopped

    def _expire(self, now: float) -> None:
        for rid, req in list(self._deadlines.items()):
            if req.is_finished:
                del self._deadlines[rid]
            elif req.deadline <= now:
                del self._deadlines[rid]
                req.stop_reason = "timeout"
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
                self._sequence_done(req)

    def _sequence_done(self, req: Request) -> None:
        now = time.time()
        req.metrics["finished_time"] = now
        if req.detokenizer is not None:
            req.detokenizer.finish()
        self.num_generation_tokens += len(req.output_token_ids)
        group = req.group
        if req.status == RequestStatus.FINISHED_ABORTED and len(group.members) < group.n:
            group.n = len(group.members)  # timed out before the other samples were forked
        if group.request_id not in self._groups or not group.finished:
            return
        del self._groups[group.request_id]
        m = group.members[0].metrics
        m["finished_time"] = now
        for key, start, end in (("queue_time_s", "arrival_time", "first_scheduled_time"),
                                ("time_to_first_token_s", "arrival_time", "first_token_time"),
                                ("e2e_latency_s", "arrival_time", "finished_time")):
            if start in m and end in m:
                m[key] = m[end] - m[start]
                agg = self._timings[key]
                agg[0], agg[1], agg[2] = agg[0] + 1, agg[1] + m[key], max(agg[2], m[key])
        self._finished.append(self._request_output(group))

    def _logprobs(self, entries: list) -> dict[int, Logprob]:
        tok = self.tokenizer
        return {t: Logprob(lp, rank, tok.decode([t]) if tok is not None else None) for t, lp, rank in entries}

    def _completion(self, req: Request) -> CompletionOutput:
        sp = req.sampling_params
        if req.detokenizer is not None:
            text = req.detokenizer.output_text
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=sp.skip_special_tokens)
        else:
            text = ""
        comp = CompletionOutput(req.sample_index, text, list(req.output_token_ids),
                                RequestStatus.finish_reason(req.status), req.stop_reason)
        if sp.logprobs is not None:
            comp.logprobs = [self._logprobs(e) for e in req.logprobs]
            comp.cumulative_logprob = sum(e[0][1] for e in req.logprobs)
        return comp

    def _request_output(self, group: _SampleGroup) -> RequestOutput:
        first = group.members[0]
        out = RequestOutput(group.request_id, first.prompt, first.prompt_token_ids,
                            [self._completion(m) for m in group.members], True,
                            max(first.num_cached_tokens, 0), dict(first.metrics))
        if first.sampling_params.prompt_logprobs is not None:
            out.prompt_logprobs = [None] + [self._logprobs(first.prompt_logprobs[p])
                                            for p in range(1, first.num_prompt_tokens)]
        return out

    def stats(self) -> dict:
        """Counters with vLLM's metric names (tokens unless stated), and per-request timings of
        the requests finished so far: for each of ``queue_time_s``, ``time_to_first_token_s``,
        ``e2e_latency_s`` a dict with ``count``, ``sum`` and ``max`` (seconds)."""
        timings = {k: {"count": c, "sum": t, "max": mx} for k, (c, t, mx) in self._timings.items()}
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "kv_cache_usage_perc": self.block_pool.usage(),
            "num_gpu_blocks": self.num_blocks,
            "prefix_cache_queries": self.kv.num_queries_tokens,
            "prefix_cache_hits": self.kv.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            **timings,
        }
