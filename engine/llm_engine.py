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

from engine.block_pool import BlockPool
from engine.engine_args import EngineArgs
from engine.kv_cache_manager import KVCacheManager
from engine.loader import check_config, load_config, load_generation_eos_ids, load_state_dict, load_tokenizer, resolve_model
from engine.model_runner import ModelRunner
from engine.models.llama import LlamaForCausalLM
from engine.outputs import ClassificationOutput, CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

EngineOutput = Union[RequestOutput, ClassificationOutput]


class _Classification:
    """Choice scoring of one prompt: a parent request computes the prompt once, then one forked
    child per multi-token label computes that label's tokens on the shared blocks."""

    def __init__(self, request_id, labels, label_ids, prompt_len):
        self.request_id = request_id
        self.labels = labels
        self.label_ids = label_ids
        self.prompt_len = prompt_len
        self.scores: dict[int, float] = {}
        self.num_pending = 0
        self.num_cached_tokens = 0
        self.num_label_tokens = 0

    def output(self) -> ClassificationOutput:
        scores = [self.scores[i] for i in range(len(self.labels))]
        m = max(scores)
        z = sum(math.exp(s - m) for s in scores)
        probs = {lab: math.exp(s - m) / z for lab, s in zip(self.labels, scores)}
        best = max(range(len(scores)), key=lambda i: scores[i])
        return ClassificationOutput(
            label=self.labels[best], probs=probs, logprobs=dict(zip(self.labels, scores)),
            num_prompt_tokens=self.prompt_len, num_cached_tokens=self.num_cached_tokens,
            num_label_tokens=self.num_label_tokens, request_id=self.request_id,
        )


class LLMEngine:
    """Owns the model runner, KV cache, block pool, scheduler and tokenizer of one model.

    Not thread-safe: one thread calls ``add_*``/``step``; see ``engine.front.EngineFront``.
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
        self.runner = ModelRunner(self.model, self.num_blocks, args.block_size, self.device, self.dtype)
        self.block_pool = BlockPool(self.num_blocks, args.enable_prefix_caching)
        self.kv = KVCacheManager(self.block_pool, args.block_size, self.runner.copy_block,
                                 extra_key=self.model_name)
        self.scheduler = Scheduler(self.kv, args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len)
        self.default_generator = torch.Generator().manual_seed(args.seed)
        self._ids = itertools.count()
        self._classifications: dict[str, _Classification] = {}
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
            free, total = torch.cuda.mem_get_info(self.device)
            cfg = self.config
            # activations of one full step (hidden, qkv, MLP) plus logits of the sampled rows
            act = a.max_num_batched_tokens * (6 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4
            act += a.max_num_seqs * cfg.vocab_size * 4 * 2
            budget = total * a.gpu_memory_utilization - (total - free) - act
            return max(int(budget // per_block), 0)
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
                    request_id: Optional[str] = None, prompt: Optional[str] = None) -> str:
        """Queue one generation request.

        Raises:
            ValueError: empty prompt, prompt too long, token ids outside the vocabulary.
        """
        self.check_prompt(prompt_token_ids)
        rid = request_id or f"gen-{next(self._ids)}"
        req = Request(rid, prompt_token_ids, params, self.eos_token_ids, prompt=prompt)
        if params.seed is not None:
            req.generator = torch.Generator().manual_seed(params.seed)
        elif not params.is_greedy:
            req.generator = self.default_generator
        self.num_prompt_tokens += req.num_prompt_tokens
        self.scheduler.add_request(req)
        return rid

    def add_classification(self, prompt_token_ids: list[int], labels: list[str],
                           label_token_ids: list[list[int]], request_id: Optional[str] = None) -> str:
        """Queue choice scoring of ``labels`` as continuations of the prompt.

        Each label's score is the sum of its tokens' log-probabilities (nats). The prompt is
        computed once; label forks share its blocks.

        Raises:
            ValueError: empty prompt or label list, a label with no tokens, too long for the model.
        """
        self.check_prompt(prompt_token_ids)
        if not labels:
            raise ValueError("labels is empty")
        if len(labels) != len(label_token_ids) or any(len(t) == 0 for t in label_token_ids):
            raise ValueError("every label needs at least one token")
        longest = len(prompt_token_ids) + max(len(t) for t in label_token_ids)
        if longest > self.max_model_len:
            raise ValueError(f"prompt plus label has {longest} tokens, more than max_model_len={self.max_model_len}")
        rid = request_id or f"cls-{next(self._ids)}"
        cls = _Classification(rid, list(labels), [list(t) for t in label_token_ids], len(prompt_token_ids))
        parent = Request(rid, prompt_token_ids, SamplingParams(temperature=0, max_tokens=1), self.eos_token_ids)
        parent.score_targets = []
        parent.final_logprob_ids = [t[0] for t in cls.label_ids]
        parent.on_finish = lambda req: self._fork_labels(cls, req)
        self._classifications[rid] = cls
        self.num_prompt_tokens += parent.num_prompt_tokens
        self.scheduler.add_request(parent)
        return rid

    def _fork_labels(self, cls: _Classification, parent: Request) -> None:
        cls.num_cached_tokens = max(parent.num_cached_tokens, 0)
        cls.num_label_tokens = 0
        children = []
        for i, (first_lp, ids) in enumerate(zip(parent.final_logprobs, cls.label_ids)):
            cls.scores[i] = first_lp
            if len(ids) == 1:
                continue
            child = Request(f"{cls.request_id}/{i}", parent.prompt_token_ids + ids[:-1],
                            parent.sampling_params, self.eos_token_ids)
            child.score_start = cls.prompt_len
            child.score_targets = ids[1:]
            child.on_finish = lambda req, i=i: self._label_done(cls, i, req)
            if not self.kv.fork(parent, child):
                child.num_computed_tokens = 0  # no block for the copy: recompute via the prefix cache
            cls.num_label_tokens += len(ids) - 1
            children.append(child)
        cls.num_pending = len(children)
        for child in reversed(children):
            self.scheduler.add_request(child, front=True)
        if not children:
            self._finish_classification(cls)

    def _label_done(self, cls: _Classification, i: int, child: Request) -> None:
        cls.scores[i] += sum(child.score_logprobs[j] for j in range(len(child.score_targets)))
        cls.num_pending -= 1
        if cls.num_pending == 0:
            self._finish_classification(cls)

    def _finish_classification(self, cls: _Classification) -> None:
        del self._classifications[cls.request_id]
        self._finished.append(cls.output())

    def abort(self, request_id: str) -> bool:
        """Stop a request (a classification with its label forks) and free its blocks at once.

        Returns:
            False if the request is unknown or already finished.
        """
        found = self.scheduler.abort(request_id) is not None
        cls = self._classifications.pop(request_id, None)
        if cls is not None:
            for i in range(len(cls.labels)):
                self.scheduler.abort(f"{request_id}/{i}")
            found = True
        return found

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._finished)

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Run one scheduled step; return the outputs of requests that finished in it."""
        sched = self.scheduler.schedule()
        if sched.scheduled:
            result = self.runner.execute(sched)
            finished = self.scheduler.update(sched, result)
            for req in finished:
                if not req.is_scoring:
                    self.num_generation_tokens += len(req.output_token_ids)
                    self._finished.append(self._request_output(req))
        elif self.scheduler.waiting:
            self.scheduler.release_waiting_blocks()
        out, self._finished = self._finished, []
        return out

    def _request_output(self, req: Request) -> RequestOutput:
        sp = req.sampling_params
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=sp.skip_special_tokens)
        req.metrics["finished_time"] = time.time()
        comp = CompletionOutput(0, text, list(req.output_token_ids),
                                RequestStatus.finish_reason(req.status), req.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], True,
                             max(req.num_cached_tokens, 0), dict(req.metrics))

    def stats(self) -> dict:
        """Counters with vLLM's metric names (tokens unless stated)."""
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
        }
