"""The engine: requests in, one scheduled step at a time, outputs out.

``step()`` is data flow: ``scheduler.schedule() -> SchedulerOutput``,
``model_runner.execute(SchedulerOutput) -> ModelRunnerOutput``,
``scheduler.update(SchedulerOutput, ModelRunnerOutput) -> SchedulerUpdate``, then the requests that
update created (n > 1 samples: :mod:`weir.engine.parallel_sampling`; label forks:
:mod:`weir.engine.classification`) are queued and the outputs of the finished ones are made
(:mod:`weir.engine.output_processor`) and returned.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import Optional, Union

import torch

from weir.engine.block_pool import BlockPool
from weir.engine.classification import Classification
from weir.engine.cuda_graphs import CUDAGraphMode
from weir.engine.engine_args import EngineArgs
from weir.engine.input_processor import InputProcessor
from weir.engine.kv_cache_manager import KVCacheManager, freeable_window
from weir.engine.loader import check_config, language_config, load_config, load_generation_eos_ids, load_tokenizer, resolve_model
from weir.engine.model_runner import ModelRunner
from weir.engine.models import MODEL_CLASSES
from weir.engine.output_processor import DURATIONS, OutputProcessor
from weir.engine.outputs import ClassificationOutput, RequestOutput
from weir.engine.parallel_sampling import ParentRequest
from weir.engine.piecewise_graphs import resolve_capture_sizes
from weir.engine.request import Request, RequestStatus
from weir.engine.sampling_params import SamplingParams
from weir.engine.scheduler import Scheduler, SchedulerOutput, SchedulerUpdate
from weir.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats, StatLoggerBase
from weir.engine.structured_outputs import StructuredOutputManager
from weir.engine.weight_loader import iter_weights, no_init_weights
from weir.gguf_metadata import shared_gguf_parse

logger = logging.getLogger(__name__)

EngineOutput = Union[RequestOutput, ClassificationOutput]


class EngineStepError(RuntimeError):
    """A step's execute raised (a fault of the engine or device, not of any one request).

    The requests of that step were ended and their blocks freed; the prefix cache keeps only
    blocks whose keys/values were written. Submitting them again may succeed.

    Attributes:
        request_ids: the ids (as given to ``add_request``/``add_classification``) of the requests
            that were ended, in scheduled order.
    """

    def __init__(self, message: str, request_ids: Optional[list[str]] = None):
        super().__init__(message)
        self.request_ids = list(request_ids or [])


class LLMEngine:
    """Owns the model runner, KV cache, block pool, scheduler and tokenizer of one model.

    Not thread-safe: one thread calls ``add_*``/``step``; see ``weir.engine.front.EngineFront``.

    ``stat_loggers``: after every step each one's ``record(SchedulerStats, IterationStats)`` is
    called in the step thread (:mod:`weir.engine.stats`); add them before the first step. Empty
    by default, and then a step builds no stats.
    """

    def __init__(self, args: EngineArgs):
        self.args = args
        self.device = torch.device(
            args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' but torch sees no CUDA device (torch.cuda.is_available() is "
                             f"False; torch {torch.__version__}); use device='cpu' or 'auto'")
        if args.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = getattr(torch, args.dtype)
        t0 = time.time()
        self.tokenizer = None
        if args.load_format == "dummy" and not isinstance(args.model, (str, type(None))):
            self.config = language_config(args.model)
            check_config(self.config)
            self.model_name = f"dummy-{self.config.model_type}"
            eos_ids = {self.config.eos_token_id} if isinstance(self.config.eos_token_id, int) else set(
                self.config.eos_token_id or [])
        else:
            src = resolve_model(args.model)
            self.model_name = src.name
            with shared_gguf_parse(enabled=src.gguf_file is not None):
                self.config = load_config(src)
                if not args.skip_tokenizer_init:
                    self.tokenizer = load_tokenizer(resolve_model(args.tokenizer) if args.tokenizer else src,
                                                    self.config.vocab_size)
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
        # built on its device, so each weight is cast and moved there once, as it is loaded
        # (its random initialisation skipped: load_weights or init_dummy sets every parameter)
        with torch.device(self.device), no_init_weights():
            self.model = MODEL_CLASSES[self.config.model_type](self.config, self.dtype, self.max_model_len)
        if args.load_format == "dummy":
            self.model.init_dummy(args.seed)
        else:
            self.model.load_weights(iter_weights(src, self.config))
        self.model.eval()

        self.cudagraph_capture_sizes = resolve_capture_sizes(
            args.cudagraph_capture_sizes, args.max_cudagraph_capture_size, args.max_num_batched_tokens)
        self.num_blocks = self._num_kv_blocks()
        need = math.ceil(self.max_model_len / args.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {need} KV blocks of {args.block_size} tokens "
                f"but only {self.num_blocks} fit; lower max_model_len or give the cache more memory")
        self.runner = ModelRunner(self.model, self.num_blocks, args.block_size, self.device, self.dtype,
                                  args.max_num_seqs, self.max_model_len, args.enforce_eager, args.cudagraph_mode,
                                  self.cudagraph_capture_sizes, args.measure_step_gpu_time)
        self.block_pool = BlockPool(self.num_blocks, args.enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, args.block_size, self.runner.copy_block,
                                 extra_key=self.model_name, sliding_window=freeable_window(self.model.sliding_windows))
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len,
                                   args.scheduling_policy, args.strict_priority)
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.config.vocab_size, self.eos_token_ids)
        self.processor = InputProcessor(self.tokenizer, self.max_model_len, self.config.vocab_size,
                                        self.scheduler.policy, self.structured_outputs)
        self.runner.structured_outputs = self.structured_outputs
        self.default_generator = torch.Generator(device=self.device).manual_seed(args.seed)
        self._ids = itertools.count()
        self.output_processor = OutputProcessor(self.tokenizer)
        # caller's request id -> its sequences' owner; and each sequence's id -> the same owner
        self._requests: dict[str, Union[ParentRequest, Classification]] = {}
        self._owners: dict[str, Union[ParentRequest, Classification]] = {}
        self._deadlines: dict[str, Request] = {}
        # count, sum, max of each per-request duration (seconds)
        self._timings = {key: [0, 0.0, 0.0] for key, _, _ in DURATIONS}
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.stat_loggers: list[StatLoggerBase] = []
        self._recorded_counts = (0, 0, 0, 0, 0)  # the counters at the last record (_record_stats)
        self._finished_stats: list[FinishedRequestStats] = []
        logger.info("engine ready: model=%s device=%s dtype=%s num_gpu_blocks=%d block_size=%d "
                    "max_model_len=%d, %s (%.1f s)", self.model_name, self.device, self.dtype,
                    self.num_blocks, args.block_size, self.max_model_len, self.runner.cudagraph_summary,
                    time.time() - t0)

    def _num_kv_blocks(self) -> int:
        a = self.args
        per_block = ModelRunner.kv_bytes_per_block(self.config, a.block_size, self.dtype)
        if a.num_gpu_blocks_override:
            return a.num_gpu_blocks_override
        if self.device.type == "cuda":
            from weir.engine.gpu_memory import profile_kv_cache_bytes

            kv_cache_bytes = profile_kv_cache_bytes(
                self.model, a.max_num_batched_tokens, a.max_num_seqs, self.max_model_len, a.block_size,
                a.gpu_memory_utilization, self.device, self.dtype, self._cudagraph_num_tokens())
            return kv_cache_bytes // per_block
        return max(a.cpu_kv_cache_bytes // per_block, 1)

    def _cudagraph_num_tokens(self) -> int:
        """Tokens of the largest CUDA graph the runner will capture (0: none), which sizes the
        memory the profile reserves for the graph pool."""
        a = self.args
        mode = CUDAGraphMode(a.cudagraph_mode)
        if a.enforce_eager or self.dtype not in (torch.float16, torch.bfloat16):
            return 0
        full = a.max_num_seqs if mode.has_full else 0
        return max(full, self.cudagraph_capture_sizes[-1] if mode.has_piecewise else 0)

    # ---- requests ---------------------------------------------------------------------------

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError for an empty prompt or one that cannot fit ``max_model_len``
        (:meth:`weir.engine.input_processor.InputProcessor.check_prompt`)."""
        self.processor.check_prompt(prompt_token_ids)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      request_id: Optional[str] = None, timeout_s: Optional[float] = None) -> None:
        """Raise what :meth:`add_request` would raise for these arguments; queue nothing."""
        self.check_prompt(prompt_token_ids)
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if asked is not None and asked > self.args.max_logprobs:
                raise ValueError(f"{name}={asked} is more than max_logprobs={self.args.max_logprobs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (skip_tokenizer_init is set)")
        vocab = self.config.vocab_size
        outside = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"stop_token_ids outside the vocabulary [0, {vocab}): {outside[:5]}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if params.structured_outputs is not None:
            self.structured_outputs.compile(params.structured_outputs)  # cached: the sequences reuse it
        self._check_id_free(request_id)

    def _check_id_free(self, request_id: Optional[str]) -> None:
        if request_id is not None and (request_id in self._requests or request_id in self._owners):
            raise ValueError(f"request id {request_id!r} is already in use")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: Optional[str] = None, prompt: Optional[str] = None,
                    timeout_s: Optional[float] = None, priority: int = 0) -> str:
        """Queue one generation request (``params.n`` samples).

        Args:
            request_id: unique among live requests (default: a fresh ``gen-<k>``); free again
                once the request's output was returned or it was aborted.
            timeout_s: seconds from now after which the request is aborted (blocks freed,
                output returned with ``finish_reason="abort"`` and ``stop_reason="timeout"``).
            priority: with ``scheduling_policy="priority"``, lower runs first and may preempt
                running requests of a higher value (vLLM's meaning); must be 0 under ``"fcfs"``.

        Raises:
            ValueError: empty prompt, prompt too long, token ids outside the vocabulary, stop
                strings without a tokenizer, more logprobs than ``max_logprobs``, timeout_s not > 0,
                a request id already in use, ``structured_outputs`` the backend cannot compile (or
                without a tokenizer), a priority other than 0 under ``"fcfs"``.
        """
        self.check_request(prompt_token_ids, params, request_id, timeout_s)
        self.check_priority(priority)
        rid = request_id or self._fresh_id("gen")
        first = self._new_sequence(rid, prompt_token_ids, params, 0, prompt)
        first.priority = priority
        if timeout_s is not None:
            first.deadline = time.time() + timeout_s
        parent = ParentRequest(rid, params.n, first)
        parent.priority = priority
        self._requests[rid] = parent
        self._add_sequences(parent, [first])
        self.num_prompt_tokens += first.num_prompt_tokens
        return rid

    def check_priority(self, priority: int) -> None:
        """Raise ValueError for a priority that is not an integer, or not 0 under ``"fcfs"``
        (:meth:`weir.engine.input_processor.InputProcessor.check_priority`)."""
        self.processor.check_priority(priority)

    def _fresh_id(self, prefix: str) -> str:
        rid = f"{prefix}-{next(self._ids)}"
        while rid in self._requests or rid in self._owners:
            rid = f"{prefix}-{next(self._ids)}"
        return rid

    def _new_sequence(self, rid: str, prompt_token_ids: list[int], params: SamplingParams, index: int,
                      prompt: Optional[str] = None) -> Request:
        req = Request(rid, prompt_token_ids, params, self.eos_token_ids, prompt=prompt, sample_index=index)
        if params.structured_outputs is not None:
            req.structured_output = self.structured_outputs.new_request(params.structured_outputs)
        seed = params.sample_seed(index)
        if seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(seed)
        elif not params.is_greedy:
            req.generator = self.default_generator
        return req

    def _add_sequences(self, owner: Union[ParentRequest, Classification], seqs: list[Request],
                       front: bool = False) -> None:
        """Queue new sequences of ``owner`` (``front``: ahead of every waiting request, in order)."""
        for seq in seqs:
            self._owners[seq.request_id] = owner
            seq.priority = owner.priority
            if seq.deadline is not None:
                self._deadlines[seq.request_id] = seq
            if not seq.is_scoring:
                self.output_processor.add_sequence(seq)
        for seq in (reversed(seqs) if front else seqs):
            self.scheduler.add_request(seq, front=front)

    def check_classification(self, prompt_token_ids: list[int], labels: list[str],
                             label_token_ids: list[list[int]], request_id: Optional[str] = None) -> None:
        """Raise what :meth:`add_classification` would raise for these arguments; queue nothing."""
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
        self._check_id_free(request_id)

    def add_classification(self, prompt_token_ids: list[int], labels: list[str],
                           label_token_ids: list[list[int]], request_id: Optional[str] = None,
                           length_normalize: bool = False, priority: int = 0) -> str:
        """Queue choice scoring of ``labels`` as continuations of the prompt.

        Each label's score is the sum of its tokens' log-probabilities (nats), or their mean with
        ``length_normalize``. The prompt and every prefix shared by several labels are computed
        once (see :mod:`weir.engine.classification`).

        Raises:
            ValueError: empty prompt or label list, duplicate labels, a label with no tokens,
                two labels with the same tokens, too long for the model, a request id already in use,
                a priority other than 0 under ``"fcfs"``. ``priority``: as :meth:`add_request`'s.
        """
        self.check_classification(prompt_token_ids, labels, label_token_ids, request_id)
        self.check_priority(priority)
        rid = request_id or self._fresh_id("cls")
        cls = Classification(rid, labels, label_token_ids, prompt_token_ids, length_normalize)
        cls.priority = priority
        root = cls.root_request()
        self._requests[rid] = cls
        self._add_sequences(cls, [root])
        self.num_prompt_tokens += root.num_prompt_tokens
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request (every sample of it, or a classification with its label forks) and free
        its blocks at once. Nothing is returned for it.

        Returns:
            False if the request is unknown or already finished.
        """
        owner = self._requests.pop(request_id, None)
        if owner is None:
            return False
        seq_ids = owner.sequence_ids() if isinstance(owner, ParentRequest) else list(owner.active)
        for rid in seq_ids:
            self.scheduler.abort(rid)
            self._forget_sequence(rid)
        return True

    def _forget_sequence(self, seq_id: str) -> None:
        self._owners.pop(seq_id, None)
        self._deadlines.pop(seq_id, None)
        self.output_processor.remove_sequence(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Schedule, execute, update, make outputs.

        Returns:
            The outputs of the requests that finished in this step (and of those past their deadline).

        Raises:
            EngineStepError: the model runner raised; the step's requests were ended (see
                :class:`EngineStepError`), the others stay queued and the engine stays usable.
        """
        finished = []
        sched = self.scheduler.schedule()
        if sched.scheduled:
            result = self._execute(sched)
            update = self.scheduler.update(sched, result)
            self._add_forks(update)
            self.scheduler.free(update.finished)
            finished += update.finished + self._stop_on_strings(update)
        elif self.scheduler.waiting:
            self.scheduler.release_waiting_blocks()
        if self._deadlines:  # after the step, so that a failed step cannot drop an expired request
            finished += self._expire(time.time())
        outputs = self._make_outputs(finished)
        if self.stat_loggers:
            self._record_stats()
        return outputs

    def _record_stats(self) -> None:
        """Hand every stat logger the state after this step and the counters' change since the
        last record (a failed step's change is reported with the next good one)."""
        counts = (self.num_prompt_tokens, self.num_generation_tokens, self.scheduler.num_preemptions,
                  self.kv.num_queries_tokens, self.kv.num_hit_tokens)
        last, self._recorded_counts = self._recorded_counts, counts
        iteration = IterationStats(counts[0] - last[0], counts[1] - last[1], counts[2] - last[2],
                                   counts[3] - last[3], counts[4] - last[4], self._finished_stats)
        self._finished_stats = []
        scheduler = SchedulerStats(len(self.scheduler.running), len(self.scheduler.waiting), self.block_pool.usage())
        for stat_logger in self.stat_loggers:
            stat_logger.record(scheduler, iteration)

    def _execute(self, sched: SchedulerOutput):
        try:
            return self.runner.execute(sched)
        except Exception as e:
            failed = []
            for seq in self.scheduler.fail_step(sched):
                owner = self._owners.get(seq.request_id)
                if owner is not None and owner.request_id not in failed:
                    failed.append(owner.request_id)
            for rid in failed:
                self.abort(rid)
            raise EngineStepError(f"engine step failed: {type(e).__name__}: {e}", failed) from e

    def _add_forks(self, update: SchedulerUpdate) -> None:
        """Queue the sequences the step's results call for, ahead of every waiting request: the
        other samples of an n > 1 request once its first sequence sampled a token, and the label
        forks of a finished classification node (both forked from blocks still held)."""
        for seq in update.sampled:
            owner = self._owners[seq.request_id]
            if owner.needs_children(seq):
                children = owner.fork_children(
                    lambda cid, i: self._new_sequence(cid, seq.prompt_token_ids, seq.sampling_params, i,
                                                      seq.prompt), self.kv)
                self._add_sequences(owner, children, front=True)
        for seq in update.finished:
            if seq.is_scoring:
                cls = self._owners[seq.request_id]
                self._add_sequences(cls, cls.expand(seq, self.kv), front=True)

    def _stop_on_strings(self, update: SchedulerUpdate) -> list[Request]:
        """End the sequences whose text reached a stop string; returns those that were still running."""
        stopped = []
        for seq in self.output_processor.find_stop_strings(update.sampled):
            if not seq.is_finished:
                self.scheduler.finish_request(seq, RequestStatus.FINISHED_STOPPED)
                stopped.append(seq)
            seq.status = RequestStatus.FINISHED_STOPPED
        return stopped

    def _expire(self, now: float) -> list[Request]:
        expired = []
        for rid, req in list(self._deadlines.items()):
            if req.is_finished:
                del self._deadlines[rid]
            elif req.deadline <= now:
                del self._deadlines[rid]
                req.stop_reason = "timeout"
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
                expired.append(req)
        return expired

    def _make_outputs(self, finished: list[Request]) -> list[EngineOutput]:
        """Outputs of the requests whose last sequence is among ``finished``."""
        outputs = []
        for seq in finished:
            owner = self._owners.pop(seq.request_id, None)
            self._deadlines.pop(seq.request_id, None)
            if owner is None:  # aborted
                continue
            if isinstance(owner, Classification):
                if owner.done and self._requests.pop(owner.request_id, None) is not None:
                    outputs.append(owner.output())
                continue
            self.output_processor.finish_sequence(seq)
            self.num_generation_tokens += len(seq.output_token_ids)
            owner.sequence_ended(seq)
            if owner.is_finished and self._requests.pop(owner.request_id, None) is not None:
                out = self.output_processor.make_request_output(owner)
                m = out.metrics
                for key, agg in self._timings.items():
                    if key in m:
                        v = m[key]
                        agg[0], agg[1], agg[2] = agg[0] + 1, agg[1] + v, max(agg[2], v)
                if self.stat_loggers:
                    self._finished_stats.append(FinishedRequestStats(
                        m.get("queue_time_s"), m.get("time_to_first_token_s"), m.get("e2e_latency_s")))
                outputs.append(out)
        return outputs

    def stats(self) -> dict:
        """Counters with vLLM's metric names (tokens unless stated), and per-request timings of
        the requests finished so far: for each of ``queue_time_s``, ``time_to_first_token_s``,
        ``e2e_latency_s`` a dict with ``count``, ``sum`` and ``max`` (seconds); and how the steps'
        forwards ran (``num_steps_cudagraph_full``, ``num_tokens_cudagraph_piecewise``,
        ``forward_host_time_s_eager``, ...: ``weir.engine.cudagraph_stats``); and structured outputs'
        ``num_grammars_compiled``, ``grammar_cache_hits``, ``grammar_compile_time_s``."""
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
            **self.runner.step_stats.as_dict(),
            **self.structured_outputs.stats(),
            **timings,
        }
